"""The Caffe reader's C scan of a ``caffe.Datum`` (``readers/_native/caffe_datum.h``) against
protobuf: values written byte by byte in the forms the wire format allows (fields in any order or
twice, unknown fields, float_data, ``encoded`` 0, 1 or 2, no or empty data, negative labels,
over-long varints, wrong wire types), then damaged, in a real LMDB, each read by the reader as it
runs and by the reader with protobuf parsing every value. Every sample must come out the same."""

from __future__ import annotations

import numpy as np
import pytest

from headrace import readers
from headrace.readers._sample_pool import SamplePool, _pool_lib

from test_tfrecord_scan import Writer, field, same_samples, tag, varint

lmdb_lib = pytest.importorskip("lmdb")
pytest.importorskip("google.protobuf")
pytestmark = pytest.mark.skipif(_pool_lib() is None, reason="the C helper does not build here")

SIGNATURES = [b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"RIFF\x00\x00\x00\x00WEBP", b"", b"HRC1"]


class DatumWriter(Writer):
    """A random Datum's bytes; ``damaged`` as the Example writer's."""

    def number(self, number: int, value: int) -> bytes:
        return tag(number, 0) + varint(value, int(self.chance(0.05)))

    def datum(self) -> bytes:
        image = SIGNATURES[int(self.rng.integers(0, len(SIGNATURES)))] + self.rng.bytes(int(self.rng.integers(0, 400)))
        parts = [self.number(1, 3), self.number(2, int(self.rng.integers(1, 500))), self.number(3, 64)]
        if not self.chance(0.05):
            parts.append(field(4, b"" if self.chance(0.03) else image, int(self.chance(0.05))))
        if not self.chance(0.1):
            parts.append(self.number(5, int(self.rng.choice([0, 1, 999, -1, -(1 << 31), (1 << 31) - 1, 1 << 33]))))
        if not self.chance(0.05):
            parts.append(self.number(7, int(self.rng.choice([1] * 8 + [0, 2]))))
        if self.chance(0.04):
            parts.append(field(6, self.rng.random(3).astype("<f4").tobytes()))  # float_data
        if self.chance(0.04):
            parts.append(parts[int(self.rng.integers(0, len(parts)))])  # a field twice
        if self.chance(0.04):
            parts.append(tag(int(self.rng.integers(8, 100)), 0) + varint(5))  # a field a Datum has not
        if self.chance(0.03):
            parts.append(tag(int(self.rng.choice([1, 5, 7])), 2) + varint(1) + b"x")  # a wrong wire type
        order = self.rng.permutation(len(parts)) if self.chance(0.3) else range(len(parts))
        return b"".join(parts[i] for i in order)


def write_lmdb(path, values: list[bytes]) -> None:
    env = lmdb_lib.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i, value in enumerate(values):
            txn.put(f"{i:06d}".encode(), value)
    env.close()


async def read_both(path, monkeypatch) -> tuple[list, list]:
    scanned = [s async for chunk in readers.caffe(path, chunk_size=16).read(0) for s in chunk]
    with monkeypatch.context() as patched:
        patched.setattr(SamplePool, "datums", lambda self, spans: None)  # protobuf for every value
        alone = [s async for chunk in readers.caffe(path, chunk_size=16).read(0) for s in chunk]
    return scanned, alone


@pytest.mark.parametrize("damage", [False, True])
async def test_the_scan_reads_every_datum_as_protobuf_does(tmp_path, monkeypatch, damage):
    rng = np.random.default_rng(21 + damage)
    writer = DatumWriter(rng)
    values = [writer.datum() for _ in range(1500)]
    if damage:
        values = [writer.damaged(v) if writer.chance(0.5) else v for v in values]
    write_lmdb(tmp_path / "db", values)
    taken = []
    real = SamplePool.datums
    monkeypatch.setattr(SamplePool, "datums", lambda self, spans: taken.append(real(self, spans)) or taken[-1])
    scanned, alone = await read_both(tmp_path / "db", monkeypatch)
    same_samples(scanned, alone)
    good = sum(s.error is None for s in alone)
    assert good > 300 and len(alone) - good > 100  # both kinds of value were there to compare
    assert sum(d is not None for chunk in taken for d in chunk) > 300  # the scan took the plain ones
