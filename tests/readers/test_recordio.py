"""readers.recordio over RecordIO files laid out byte for byte as MXNet's ``im2rec`` writes them
(the writer below follows dmlc-core's ``RecordIOWriter`` and ``mx.recordio.pack``; MXNet itself is
not installable here): images with their labels, a record split around the magic number, several
labels, ``.idx`` files or a scan, the files reader's order, shard and resume, the loader, and bad
records as typed errors naming their file and byte.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from headrace import ConfigError, ReadError, readers
from sample_data import recordio_record, write_recordio
from record_checks import a_loader_trains_on, reads_as_the_files_reader

MAGIC = 0xCED7230A


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory, image_folder):
    """image_folder's 75 JPEGs as 3 .rec files with .idx beside (labels from 0, as im2rec gives
    them); and the (bytes, label) of each record, in file order."""
    root = tmp_path_factory.mktemp("recordio")
    reference = readers.files(image_folder)
    items = [(Path(p).read_bytes(), label) for p, label in zip(reference.paths, reference.labels)]
    for part in range(3):
        chunk = items[part * 25:(part + 1) * 25]
        records = [recordio_record(label, jpg, n) for n, (jpg, label) in enumerate(chunk)]
        write_recordio(root / f"train-{part}.rec", records)
    return root, items


async def _read(reader, epoch=0, start=0, seed=4):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]


async def test_images_with_their_labels_from_index_files_or_a_scan(imagenet, tmp_path, leaks):
    root, items = imagenet
    indexed = readers.recordio(root)
    assert len(indexed) == 75
    samples = await _read(indexed)
    assert [(s.fields["jpg"], int(s.fields["cls"])) for s in samples] == items
    assert samples[30].key == "train-1/5" and samples[30].source == str(root / "train-1.rec")
    for p in root.glob("*.rec"):  # the same files without their .idx: found by their headers
        (tmp_path / p.name).write_bytes(p.read_bytes())
    scanned = readers.recordio(tmp_path)
    assert [s.fields for s in await _read(scanned)] == [s.fields for s in samples]
    assert np.array_equal(scanned.records[:, :2], indexed.records[:, :2])
    await leaks.check()


async def test_a_record_split_around_the_magic_and_one_with_several_labels(imagenet, tmp_path):
    _, items = imagenet
    magic = struct.pack("<I", MAGIC)
    tricky = items[0][0][:40] + magic + items[0][0][40:80] + magic + magic + items[0][0][80:]
    assert len(items[0][0][:40]) % 4 == 0  # the magic lands at 4-byte boundaries once packed (header: 24)
    path = tmp_path / "tricky.rec"
    offsets = write_recordio(path, [recordio_record(1, items[1][0]), recordio_record(2, tricky),
                                    recordio_record([3.0, 7.5], items[2][0])])
    raw = path.read_bytes()
    assert struct.unpack_from("<I", raw, offsets[1] + 4)[0] >> 29 == 1  # written in parts
    for reader in (readers.recordio(path), readers.recordio(path, index=[path.with_suffix(".idx")])):
        samples = await _read(reader)
        assert [s.error for s in samples] == [None] * 3
        assert samples[1].fields == {"jpg": tricky, "cls": b"2"}
        assert samples[2].fields["labels"].tolist() == [3.0, 7.5] and "cls" not in samples[2].fields


@pytest.mark.parametrize("start", [1, 33, 74])
async def test_shuffle_shard_and_resume_are_the_files_readers(imagenet, image_folder, start):
    root, _ = imagenet
    records = readers.recordio(str(root / "train-{0..2}.rec"), shuffle=True)
    await reads_as_the_files_reader(records, image_folder, epoch=5, start=start, world=3)


async def test_the_loader_trains_on_them(imagenet, leaks):
    await a_loader_trains_on(readers.recordio(imagenet[0], shuffle=True), leaks)


async def test_bad_records_are_errors_naming_their_file_and_byte_and_the_rest_reads(imagenet, tmp_path):
    _, items = imagenet
    path = tmp_path / "damaged.rec"
    records = [recordio_record(0, items[0][0]), b"short", recordio_record(0.5, items[1][0]),
               recordio_record(1, items[2][0]), recordio_record(2, items[3][0])]
    offsets = write_recordio(path, records, idx=False)
    raw = bytearray(path.read_bytes())
    path.write_bytes(bytes(raw[: offsets[4] + 100]))  # the last record cut off
    samples = await _read(readers.recordio(path))
    assert [s.key for s in samples] == [f"damaged/{i}" for i in range(5)]
    errors = {s.key: str(s.error).split(" [")[0] for s in samples if s.error is not None}
    assert errors == {
        "damaged/1": f"record at byte {offsets[1]}: 5 bytes, too short for an image record's header",
        "damaged/2": f"record at byte {offsets[2]}: its label 0.5 is not a whole number",
        "damaged/4": f"record at byte {offsets[4]}: it runs past the end of the file (cut short)",
    }
    assert all(s.source == str(path) for s in samples) and samples[3].fields["jpg"] == items[2][0]
    raw[offsets[3]:offsets[3] + 4] = b"XXXX"  # the magic of record 3 gone: nothing after it can be found
    path.write_bytes(bytes(raw[: offsets[4]]))
    samples = await _read(readers.recordio(path))
    assert len(samples) == 4 and "no RecordIO magic at its part 0 (found 0x58585858)" in str(samples[3].error)
    assert samples[3].error.key == "damaged/3" and "cut short" not in str(samples[3].error)
    write_recordio(path, [recordio_record(float("inf"), items[0][0]), recordio_record(float("nan"), items[0][0])])
    assert ["is not a whole number" in str(s.error) for s in await _read(readers.recordio(path))] == [True, True]


async def test_a_record_cut_short_is_an_error_by_index_or_scan_whole_parts_or_not(imagenet, tmp_path):
    _, items = imagenet
    path = tmp_path / "cut.rec"
    split = recordio_record(1, items[1][0])
    split = split[:28] + struct.pack("<I", MAGIC) + split[32:]  # the magic at a 4-byte boundary: two parts
    offsets = write_recordio(path, [recordio_record(0, items[0][0]), split])
    raw = path.read_bytes()
    second_part = offsets[1] + 8 + 28  # the first part's header and its 28 bytes (a multiple of 4)
    assert struct.unpack_from("<I", raw, second_part)[0] == MAGIC
    for end, idx in ((len(raw) - 50, True), (len(raw) - 50, False), (second_part, True), (second_part, False)):
        path.write_bytes(raw[:end])  # the last record cut inside its last part, or after a whole first part
        if not idx:
            path.with_suffix(".idx").unlink(missing_ok=True)
        else:
            path.with_suffix(".idx").write_text(f"0\t{offsets[0]}\n1\t{offsets[1]}\n")
        reader = readers.recordio(path)
        samples = await _read(reader)
        assert len(reader) == len(samples) == 2, (end, idx)
        assert samples[0].error is None and samples[0].fields["jpg"] == items[0][0]
        assert isinstance(samples[1].error, ReadError) and "cut short" in str(samples[1].error), (end, idx)
        assert samples[1].key == "cut/1" and f"byte {offsets[1]}" in str(samples[1].error)


def test_wrong_arguments_and_missing_files_are_refused(imagenet, tmp_path):
    root, _ = imagenet
    one = root / "train-0.rec"
    with pytest.raises(ReadError, match="no such .rec file"):
        readers.recordio(tmp_path / "none.rec")
    with pytest.raises(ReadError, match="no .rec files in folder"):
        readers.recordio(tmp_path)
    with pytest.raises(ConfigError, match="label_offset"):
        readers.recordio(one, label_offset="1")
    with pytest.raises(ConfigError, match="0 index files for 1 files"):
        readers.recordio(one, index=[])
    (tmp_path / "bad.idx").write_text("0\t0\nnonsense\n")
    with pytest.raises(ReadError, match="line 2 is not 'key<TAB>offset'"):
        readers.recordio(one, index=[tmp_path / "bad.idx"])
