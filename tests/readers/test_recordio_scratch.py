"""The RecordIO reader's chunk read (``ScratchGroups``, ``hr_pread_records``): one-part image records
whose image is copied once out of the thread's buffer into the sample pool, every other record read
and parsed on its own. Records of every kind (one label, several, none whole, an image holding the
magic so that it is written in parts, a headrace record as the image), then files damaged at random,
read both ways: the same samples and the same errors."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from headrace import ReadError, readers
from headrace.readers import encode_record
from headrace.readers._sample_pool import _pool_lib
from headrace.readers.recordio import MAGIC, RecordIOReader
from sample_data import recordio_record, write_recordio

from test_record_fuzz import _damage
from test_tfrecord_scan import same_samples

pytestmark = pytest.mark.skipif(_pool_lib() is None, reason="the C helper does not build here")


def _records(rng: np.random.Generator, n: int) -> list[bytes]:
    out = []
    for i in range(n):
        image = b"\xff\xd8\xff" + rng.bytes(int(rng.integers(0, 3000)))
        kind = int(rng.integers(0, 8))
        if kind == 0:  # the magic inside, at a 4-byte boundary of the data: written in parts
            at = 4 * int(rng.integers(8, 40))
            image = image[:at] + struct.pack("<I", MAGIC) + image[at:]
        elif kind == 1:
            image = encode_record({"jpg": image, "txt": b"caption"})  # a headrace record as the image
        if kind == 2:
            out.append(recordio_record(rng.random(int(rng.integers(2, 5))).astype(np.float32), image, i))
        elif kind == 3:
            out.append(recordio_record(float(rng.choice([1.5, np.nan, np.inf, 7.0])), image, i))
        elif kind == 4:
            out.append(rng.bytes(int(rng.integers(0, 30))))  # too short for an image header
        else:
            out.append(recordio_record(int(rng.integers(0, 1000)), image, i))
    return out


async def _read_both(path, monkeypatch) -> tuple[list, list]:
    chunked = [s async for chunk in readers.recordio(path, chunk_size=16).read(0) for s in chunk]
    with monkeypatch.context() as patched:
        patched.setattr(RecordIOReader, "_open_io", lambda self: None)  # no pool: every record on its own
        alone = [s async for chunk in readers.recordio(path, chunk_size=16).read(0) for s in chunk]
    return chunked, alone


async def test_every_kind_of_record_reads_as_on_its_own(tmp_path, monkeypatch):
    path = tmp_path / "data.rec"
    write_recordio(path, _records(np.random.default_rng(4), 600))
    chunked, alone = await _read_both(path, monkeypatch)
    same_samples(chunked, alone)
    good = sum(s.error is None for s in alone)
    assert good > 300 and len(alone) - good > 30
    assert any("labels" in s.fields for s in chunked) and any("txt" in s.fields for s in chunked)


async def test_damaged_files_read_as_on_their_own(tmp_path, monkeypatch):
    rng = np.random.default_rng(9)
    path = tmp_path / "data.rec"
    starts = write_recordio(path, _records(rng, 80))
    pristine = path.read_bytes()
    compared = 0
    for _ in range(40):
        path.write_bytes(_damage(pristine, rng, starts))
        path.with_suffix(".idx").unlink(missing_ok=True)  # found by a scan of the damaged file
        try:
            chunked, alone = await _read_both(path, monkeypatch)
        except ReadError:
            continue  # no records found at all: refused at construction, both ways
        same_samples(chunked, alone)
        compared += len(alone)
    assert compared > 1000
