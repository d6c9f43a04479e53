"""Review 4 of the record readers, each test a user's case that went wrong: a file that is not a
RecordIO or TFRecord file at all (a JPEG or a tar given by mistake, bytes before the first record,
a JSON file in a TFRecord folder) was read as one record "cut short" or "damaged", a sample standing
for a whole file that has none; it is now refused, naming the file.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from headrace import ConfigError, ReadError, readers
from record_checks import write_tfrecord
from sample_data import jpeg_bytes, recordio_record, write_recordio

pytest.importorskip("tfrecord.writer")


def _images(n: int) -> list[bytes]:
    rng = np.random.default_rng(4)
    return [jpeg_bytes(rng, 18 + i, 22) for i in range(n)]


def _tar_of(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


async def _read(reader, epoch=0, start=0):
    return [s async for chunk in reader.read(epoch, start=start, seed=1) for s in chunk]


def _not_recordio_cases(tmp_path: Path) -> dict[str, Path]:
    images = _images(3)
    good = tmp_path / "good.rec"
    write_recordio(good, [recordio_record(i, jpg) for i, jpg in enumerate(images)], idx=False)
    cases = {"jpeg": images[0], "tar": _tar_of({"0.jpg": images[0], "0.cls": b"1"}),
             "garbage before the first record": b"JUNK" + good.read_bytes()}
    paths = {}
    for name, data in cases.items():
        path = paths[name] = tmp_path / f"{name.split()[0]}.rec"
        path.write_bytes(data)
    return paths


@pytest.mark.parametrize("case", ["jpeg", "tar", "garbage before the first record"])
def test_a_file_that_is_not_recordio_is_refused_naming_it_not_called_cut_short(tmp_path, case):
    # It was one record, "at byte 0: it runs past the end of the file (cut short)", which sent the
    # user looking for a truncated download; with on_error="skip" the whole file was one drop.
    path = _not_recordio_cases(tmp_path)[case]
    good = tmp_path / "good.rec"
    with pytest.raises(ReadError, match=r"not a RecordIO file: no RecordIO magic \(0xced7230a\) at byte 0") as caught:
        readers.recordio([good, path])
    assert caught.value.source == str(path) and "cut short" not in str(caught.value)
    path.with_suffix(".idx").write_text("0\t0\n")  # read by an index: the same
    with pytest.raises(ReadError, match="not a RecordIO file") as caught:
        readers.recordio(path)
    assert caught.value.source == str(path)
    assert len(readers.recordio(good)) == 3  # control


async def test_a_recordio_file_cut_inside_its_first_header_is_still_cut_short(tmp_path):
    path = tmp_path / "cut.rec"
    write_recordio(path, [recordio_record(0, _images(1)[0])], idx=False)
    for end in (2, 6):  # inside the magic, then inside the flag and length word
        path.write_bytes(path.read_bytes()[:end])
        samples = await _read(readers.recordio(path))
        assert len(samples) == 1 and "cut short" in str(samples[0].error), end


@pytest.mark.parametrize("case", ["jpeg", "tar", "json"])
async def test_a_file_that_is_not_tfrecord_is_refused_naming_it(tmp_path, case):
    # It was one sample "at byte 0: its length header is damaged (its CRC is wrong), or this is not
    # such a file": len() counted a JPEG as a record, and a TFRecord folder with the dataset_info.json
    # and features.json that tensorflow_datasets writes beside its shards had two phantom samples.
    images = _images(2)
    root = tmp_path / "shards"
    root.mkdir()
    write_tfrecord(root / "train.tfrecord-00000-of-00001",
                   [{"image/encoded": (jpg, "byte"), "image/class/label": (i, "int")} for i, jpg in enumerate(images)])
    stray = root / {"jpeg": "cover.jpg", "tar": "train-0.tar", "json": "dataset_info.json"}[case]
    stray.write_bytes({"jpeg": images[0], "tar": _tar_of({"0.jpg": images[0]}),
                       "json": json.dumps({"name": "imagenet2012", "splits": [{"name": "train"}]}).encode()}[case])
    for source in (root, [root / "train.tfrecord-00000-of-00001", stray]):
        with pytest.raises(ReadError, match="not a TFRecord file: the length header at byte 0 fails its CRC") as caught:
            readers.tfrecord(source)
        assert caught.value.source == str(stray)
    stray.with_name(stray.name + ".idx").write_text(f"0 {stray.stat().st_size}\n")  # read by an index: the same
    with pytest.raises(ReadError, match="not a TFRecord file") as caught:
        readers.tfrecord(stray, index=stray.with_name(stray.name + ".idx"))
    assert caught.value.source == str(stray)
    samples = await _read(readers.tfrecord(root / "train.tfrecord-00000-of-00001"))  # control
    assert [s.fields["jpg"] for s in samples] == images


def test_an_index_of_the_wrong_type_is_a_config_error_naming_index(tmp_path):
    # index=5 raised TypeError ('int' object is not iterable), index=[None] another; a bytes path
    # was taken as its letters.
    path = tmp_path / "a.rec"
    write_recordio(path, [recordio_record(0, _images(1)[0])])
    tf = tmp_path / "a.tfrecord"
    write_tfrecord(tf, [{"image/encoded": (_images(1)[0], "byte"), "image/class/label": (1, "int")}])
    for make in (readers.recordio, readers.tfrecord):
        for index in (5, [None], b"a.idx", [path.with_suffix(".idx"), 3]):
            with pytest.raises(ConfigError, match="index must be an index file's path or a list of them"):
                make(path if make is readers.recordio else tf, index=index)
    assert len(readers.recordio(path, index=(p for p in [path.with_suffix(".idx")]))) == 1


def test_an_index_cut_short_or_empty_is_refused_not_records_lost_unsaid(tmp_path):
    # An .idx cut short (a copy that stopped, an im2rec run killed) gave the records it names and
    # lost the rest without a word; the last one it names spanned to the file's end, read whole
    # for one record (the whole rest of a .rec of ImageNet). Empty, it lost the file's every record.
    images = _images(5)
    path = tmp_path / "train.rec"
    offsets = write_recordio(path, [recordio_record(i, jpg, i) for i, jpg in enumerate(images)])
    size = path.stat().st_size
    for kept in (3, 0):
        path.with_suffix(".idx").write_text("".join(f"{k}\t{o}\n" for k, o in enumerate(offsets[:kept])))
        end = offsets[kept] if kept else 0
        with pytest.raises(ReadError, match=f"the index's records end at byte {end}, the file goes on to byte "
                                            f"{size}: the index misses the records after") as caught:
            readers.recordio(path)
        assert caught.value.source == str(path.with_suffix(".idx"))
    tf = tmp_path / "train-0"
    spans = write_tfrecord(tf, [{"image/encoded": (jpg, "byte"), "image/class/label": (i, "int")}
                                for i, jpg in enumerate(images)])
    index = tmp_path / "train-0.idx"
    for kept in (3, 0):
        index.write_text("".join(f"{o} {s}\n" for o, s in spans[:kept]))
        end = spans[kept][0] if kept else 0
        with pytest.raises(ReadError, match=f"the index's records end at byte {end}, the file goes on") as caught:
            readers.tfrecord(tf, index=index)
        assert caught.value.source == str(index)
    index.write_text("".join(f"{o} {s}\n" for o, s in spans))  # control: whole, every record reads
    assert len(readers.tfrecord(tf, index=index)) == 5


async def test_a_recordio_index_with_a_negative_offset_names_its_line(tmp_path):
    # It was a sample "cannot read record at byte -8: Invalid argument", from the read's OSError.
    path = tmp_path / "train.rec"
    offsets = write_recordio(path, [recordio_record(i, jpg) for i, jpg in enumerate(_images(2))])
    path.with_suffix(".idx").write_text(f"0\t-8\n1\t{offsets[0]}\n2\t{offsets[1]}\n")
    with pytest.raises(ReadError, match="line 1: a record at byte -8 cannot be") as caught:
        readers.recordio(path)
    assert caught.value.source == str(path.with_suffix(".idx"))


async def test_a_tfrecord_index_line_twice_is_one_record_not_a_sample_read_twice(tmp_path):
    # RecordIO's .idx took a record named twice once (review 3); a DALI index with a line twice gave
    # the record two samples, read twice an epoch.
    images = _images(3)
    tf = tmp_path / "train-0"
    spans = write_tfrecord(tf, [{"image/encoded": (jpg, "byte"), "image/class/label": (i, "int")}
                                for i, jpg in enumerate(images)])
    index = tmp_path / "train-0.idx"
    index.write_text("".join(f"{o} {s}\n" for o, s in spans + spans[1:2]))
    reader = readers.tfrecord(tf, index=index)
    samples = await _read(reader)
    assert len(reader) == 3 and [s.fields["jpg"] for s in samples] == images
    index.write_text("".join(f"{o} {s}\n" for o, s in spans) + f"{spans[1][0]} {spans[1][1] + 4}\n")
    with pytest.raises(ReadError, match=f"line 4: the record at byte {spans[1][0]} has {spans[1][1]} bytes on an "
                                        f"earlier line, {spans[1][1] + 4} here"):
        readers.tfrecord(tf, index=index)
