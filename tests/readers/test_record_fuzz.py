"""TFRecord and RecordIO files damaged at random (bytes flipped, lengths rewritten, the file cut,
garbage spliced in): finding the records and reading them never raises anything but a ReadError at
construction, every record found is one sample in its place, and every bad one carries a ReadError
naming its file and key. Seeded: the same damage every run."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from headrace import ReadError, readers
from sample_data import jpeg_bytes, recordio_record, write_recordio

tfrecord_writer = pytest.importorskip("tfrecord.writer")
CASES = 120


def _images(n: int) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [jpeg_bytes(rng, 24 + 3 * i, 20 + 2 * i) for i in range(n)]


def _damage(data: bytes, rng: np.random.Generator, header_at: list[int]) -> bytes:
    """One to three of: a byte flipped anywhere, a record's length field rewritten, the file cut,
    garbage spliced in."""
    out = bytearray(data)
    for _ in range(rng.integers(1, 4)):
        how = rng.integers(0, 4)
        if how == 0 and out:
            out[rng.integers(0, len(out))] ^= int(rng.integers(1, 256))
        elif how == 1 and header_at:
            at = int(rng.choice(header_at))
            width = 4 if at + 8 > len(out) else 8
            out[at:at + width] = rng.integers(0, 256, width, dtype=np.uint8).tobytes()
        elif how == 2 and out:
            del out[rng.integers(0, len(out)):]
        else:
            at = int(rng.integers(0, len(out) + 1))
            out[at:at] = rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
    return bytes(out)


async def _read(reader):
    return [s async for chunk in reader.read(0) for s in chunk]


async def _check(make, path) -> tuple[int, int]:
    """Read the damaged file: (samples, bad samples); any exception but a ReadError at construction fails."""
    try:
        reader = make(path)
    except ReadError:
        return 0, 0  # nothing to read (no records found): said so, typed
    samples = await _read(reader)
    assert len(samples) == len(reader) and [s.position for s in samples] == list(range(len(samples)))
    assert len({s.key for s in samples}) == len(samples)  # none read twice
    bad = [s for s in samples if s.error is not None]
    for s in bad:
        assert isinstance(s.error, ReadError) and s.error.source == str(path) and s.error.key == s.key
        assert s.fields == {}
    return len(samples), len(bad)


async def test_damaged_tfrecord_files_give_typed_errors_in_place(tmp_path):
    path = tmp_path / "data.tfrecord"
    writer = tfrecord_writer.TFRecordWriter(str(path))
    starts = []
    for i, image in enumerate(_images(12)):
        starts.append(writer.file.tell())
        writer.write({"image/encoded": (image, "byte"), "image/class/label": (i % 3, "int")})
    writer.close()
    pristine = path.read_bytes()
    rng = np.random.default_rng(1)
    totals = np.zeros(2, int)
    for _ in range(CASES):
        path.write_bytes(_damage(pristine, rng, starts))
        totals += await _check(readers.tfrecord, path)
    assert totals[1] > 0 and totals[0] > totals[1]  # damage was found, and records around it read


async def test_damaged_recordio_files_give_typed_errors_in_place(tmp_path):
    path = tmp_path / "data.rec"
    offsets = write_recordio(path, [recordio_record(i % 3, image) for i, image in enumerate(_images(12))], idx=False)
    pristine = path.read_bytes()
    assert struct.unpack_from("<I", pristine)[0] == 0xCED7230A
    rng = np.random.default_rng(2)
    totals = np.zeros(2, int)
    for _ in range(CASES):
        path.write_bytes(_damage(pristine, rng, [o + 4 for o in offsets]))  # the flag and length word
        totals += await _check(readers.recordio, path)
    assert totals[1] > 0 and totals[0] > totals[1]
