"""readers.tfrecord over real TFRecord files, written by the ``tfrecord`` package (a writer that is
not ours, with the CRCs TensorFlow writes): the ImageNet layout, every feature kind, DALI's index
files, the files reader's order, shard and resume, the loader end to end, and bad records (cut
short, not an Example, a feature missing) as typed errors naming their file and byte.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from headrace import ConfigError, ReadError, readers
from record_checks import a_loader_trains_on, reads_as_the_files_reader, write_tfrecord

pytest.importorskip("tfrecord.writer")  # in the test extra; a skip only off it


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory, image_folder):
    """image_folder's 75 JPEGs as 3 TFRecord files in TensorFlow's ImageNet layout (labels from 1),
    with DALI index files beside; and the (bytes, label) of each record, in file order."""
    root = tmp_path_factory.mktemp("tfrecord")
    reference = readers.files(image_folder)
    items = [(Path(p).read_bytes(), label) for p, label in zip(reference.paths, reference.labels)]
    for part in range(3):
        chunk = items[part * 25:(part + 1) * 25]
        spans = write_tfrecord(root / f"train-{part:05d}-of-00003", [
            {"image/encoded": (jpg, "byte"), "image/class/label": (label + 1, "int"),
             "image/height": (64, "int"), "image/format": (b"JPEG", "byte"),
             "image/object/bbox/xmin": ([0.25, 0.5], "float")} for jpg, label in chunk])
        (root / f"train-{part:05d}-of-00003.idx").write_text("".join(f"{o} {s}\n" for o, s in spans))
    return root, items


async def _read(reader, epoch=0, start=0, seed=4):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]


async def test_the_imagenet_layout_reads_as_the_images_with_their_labels(imagenet, leaks):
    root, items = imagenet
    reader = readers.tfrecord(root, label_offset=-1)  # a folder: its files, the .idx ones left out
    assert len(reader) == 75 and len(reader.paths) == 3
    samples = await _read(reader)
    assert [(bytes(s.fields["jpg"]), int(s.fields["cls"])) for s in samples] == items
    assert samples[26].key == "train-00001-of-00003/1" and samples[26].source == str(root / "train-00001-of-00003")
    assert set(samples[0].fields) == {"jpg", "cls"}  # only the features asked for
    await leaks.check()


async def test_every_feature_kind_under_its_own_name(imagenet):
    root, items = imagenet
    reader = readers.tfrecord(root / "train-00000-of-00003", features=None)
    first = (await _read(reader))[0]
    assert first.fields["image/encoded"] == items[0][0]
    assert first.fields["image/class/label"] == items[0][1] + 1
    assert first.fields["image/height"] == 64 and first.fields["image/format"] == b"JPEG"
    box = first.fields["image/object/bbox/xmin"]
    assert box.dtype == np.float32 and box.tolist() == [0.25, 0.5]
    renamed = readers.tfrecord(root / "train-00000-of-00003", features={"image/encoded": "jpeg", "image/height": "h"})
    assert set((await _read(renamed))[0].fields) == {"jpeg", "h"}


async def test_dali_index_files_give_the_same_records_as_a_scan(imagenet):
    root, _ = imagenet
    files = sorted(str(p) for p in root.glob("train-*-of-00003"))
    scanned = readers.tfrecord(files, shuffle=True)
    indexed = readers.tfrecord(files, index=[f + ".idx" for f in files], shuffle=True)
    assert np.array_equal(scanned.records, indexed.records)
    assert [s.fields for s in await _read(indexed, epoch=2)] == [s.fields for s in await _read(scanned, epoch=2)]


def test_an_index_file_missing_or_not_text_is_a_read_error_naming_it(imagenet, tmp_path):
    root, _ = imagenet
    data = str(root / "train-00000-of-00003")
    missing = str(tmp_path / "missing.idx")
    with pytest.raises(ReadError) as info:
        readers.tfrecord(data, index=[missing])
    assert info.value.source == missing
    binary = tmp_path / "binary.idx"
    binary.write_bytes(b"\xff\xfe not text")
    with pytest.raises(ReadError, match="cannot read the index file"):
        readers.tfrecord(data, index=[str(binary)])


@pytest.mark.parametrize("start", [1, 30, 74])
async def test_shuffle_shard_and_resume_are_the_files_readers(imagenet, image_folder, start):
    root, _ = imagenet
    records = readers.tfrecord(str(root / "train-{00000..00002}-of-00003"), label_offset=-1, shuffle=True)
    await reads_as_the_files_reader(records, image_folder, epoch=3, start=start, world=2)


async def test_the_loader_trains_on_them(imagenet, leaks):
    await a_loader_trains_on(readers.tfrecord(imagenet[0], label_offset=-1, shuffle=True), leaks)


async def test_bad_records_are_errors_naming_their_file_and_byte_and_the_rest_reads(imagenet, tmp_path):
    _, items = imagenet
    good = [{"image/encoded": (jpg, "byte"), "image/class/label": (label, "int")} for jpg, label in items[:4]]
    path = tmp_path / "damaged"
    spans = write_tfrecord(path, good[:2] + [{"image/height": (1, "int")}] + good[2:])
    data = bytearray(path.read_bytes())
    garbage_at = spans[1][0] + 12  # the second record's data, after its length header
    data[garbage_at:garbage_at + 4] = b"\x0f\xff\xff\xff"  # wire type 7: not a protocol buffer
    path.write_bytes(bytes(data[: spans[4][0] + spans[4][1] // 2]))  # the last record cut in half
    samples = await _read(readers.tfrecord(path))
    assert [s.key for s in samples] == [f"damaged/{i}" for i in range(5)]
    errors = {s.key: s.error for s in samples if s.error is not None}
    assert set(errors) == {"damaged/1", "damaged/2", "damaged/4"}
    assert all(isinstance(e, ReadError) and e.source == str(path) for e in errors.values())
    assert f"at byte {garbage_at}" in str(errors["damaged/1"]) and "not a tf.train.Example" in str(errors["damaged/1"])
    assert "no feature 'image/encoded' (it has image/height)" in str(errors["damaged/2"])
    assert "cut short" in str(errors["damaged/4"])
    assert bytes(samples[3].fields["jpg"]) == items[2][0]  # the records around them read


async def test_a_label_that_is_not_an_int_is_named(imagenet, tmp_path):
    _, items = imagenet
    path = tmp_path / "labels"
    write_tfrecord(path, [{"image/encoded": (items[0][0], "byte"), "image/class/label": (b"tench", "byte")},
                  {"image/encoded": (items[0][0], "byte"), "image/class/label": ([], "int")}])
    samples = await _read(readers.tfrecord(path))
    assert [str(s.error).split(" [")[0] for s in samples] == ["feature 'image/class/label' is not an int64 label"] * 2


def test_wrong_arguments_and_missing_files_are_refused(imagenet, tmp_path):
    root, _ = imagenet
    one = root / "train-00000-of-00003"
    with pytest.raises(ReadError, match="no such TFRecord file"):
        readers.tfrecord(tmp_path / "none")
    with pytest.raises(ReadError, match="no TFRecord files in folder"):
        readers.tfrecord(tmp_path)
    for kwargs, message in (({"features": {}}, "features must map"), ({"features": {"a": "x", "b": "x"}}, "one field"),
                            ({"label_offset": 0.5}, "label_offset"), ({"index": []}, "0 index files for 1")):
        with pytest.raises(ConfigError, match=message):
            readers.tfrecord(one, **kwargs)
    (tmp_path / "bad.idx").write_text("0 100\nnot a line\n")
    with pytest.raises(ReadError, match="line 2 is not 'offset size'"):
        readers.tfrecord(one, index=[tmp_path / "bad.idx"])
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ReadError, match="no records"):
        readers.tfrecord(tmp_path / "empty")
    assert os.path.exists(one)
