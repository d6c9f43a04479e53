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

from headrace import ReadError, readers
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
