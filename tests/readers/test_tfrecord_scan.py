"""The TFRecord reader's C scan of an Example (``readers/_native/tf_example.h``) against protobuf:
records written byte by byte in every form the wire format allows (packed and unpacked lists,
unknown fields at every level, keys and features twice, missing keys and values, over-long varints,
non-ASCII keys) and then damaged, each read by the reader as it runs and by the reader on its
protobuf path alone. Every sample must come out the same: its fields, or its error's words."""

from __future__ import annotations

import importlib
import struct
from pathlib import Path

import numpy as np
import pytest

from headrace import ReadError, readers
from headrace.readers.tfrecord import _masked_crc32c, parse_example

pytest.importorskip("google.protobuf")

WANTED = {"image/encoded": "jpg", "image/class/label": "cls", "height": "height"}


# -- the wire format, written by hand --------------------------------------------------------------

def varint(value: int, pad: int = 0) -> bytes:
    """``value`` as a varint (two's complement for a negative one), ``pad`` bytes longer than needed."""
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value == 0 and pad == 0:
            out.append(byte)
            return bytes(out)
        if value == 0:
            pad -= 1
        out.append(byte | 0x80)


def tag(field: int, wire: int, pad: int = 0) -> bytes:
    return varint(field << 3 | wire, pad)


def field(number: int, payload: bytes, pad: int = 0) -> bytes:
    return tag(number, 2) + varint(len(payload), pad) + payload


def unknown(rng: np.random.Generator) -> bytes:
    """A field no schema here knows, of a random wire type."""
    number, wire = int(rng.integers(4, 3000)), int(rng.choice([0, 1, 2, 5]))
    body = {0: varint(int(rng.integers(0, 1 << 62))), 1: rng.bytes(8), 5: rng.bytes(4),
            2: varint(3) + rng.bytes(3)}[wire]
    return tag(number, wire) + body


class Writer:
    """A random Example's bytes, with the oddities the wire format allows one at a time."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def chance(self, p: float) -> bool:
        return bool(self.rng.random() < p)

    def maybe_unknown(self) -> bytes:
        return unknown(self.rng) if self.chance(0.01) else b""

    def bytes_list(self) -> bytes:
        n = int(self.rng.choice([1] * 8 + [0, 2]))
        return b"".join(field(1, self.rng.bytes(int(self.rng.integers(0, 300))), int(self.chance(0.05)))
                        + self.maybe_unknown() for _ in range(n))

    def int64_list(self) -> bytes:
        n = int(self.rng.choice([1] * 8 + [0, 2]))
        values = [int(self.rng.choice([0, 1, 7, 300, -1, -(1 << 40), (1 << 63) - 1])) for _ in range(n)]
        if self.chance(0.5):  # unpacked: one varint field each
            return b"".join(tag(1, 0) + varint(v, int(self.chance(0.05))) for v in values) + self.maybe_unknown()
        return field(1, b"".join(varint(v) for v in values)) + self.maybe_unknown()

    def float_list(self) -> bytes:
        values = self.rng.random(int(self.rng.integers(0, 3))).astype("<f4")
        if self.chance(0.5):
            return b"".join(tag(1, 5) + v.tobytes() for v in values)
        return field(1, values.tobytes())

    def feature(self, kind: str) -> bytes:
        number, body = {"bytes": (1, self.bytes_list), "int64": (3, self.int64_list),
                        "float": (2, self.float_list)}[kind]
        out = self.maybe_unknown() + field(number, body())
        if self.chance(0.03):  # a second list of the oneof
            out += field(int(self.rng.choice([1, 2, 3])), b"")
        return out + self.maybe_unknown()

    def entry(self, key: bytes, kind: str | None) -> bytes:
        parts = [field(1, key)] if not self.chance(0.02) else []
        if kind is not None and not self.chance(0.02):
            parts.append(field(2, self.feature(kind)))
        if self.chance(0.1):
            parts.reverse()  # the value before the key
        return self.maybe_unknown() + b"".join(parts) + self.maybe_unknown()

    def example(self) -> bytes:
        names = [(b"image/encoded", "bytes"), (b"image/class/label", "int64"), (b"height", "int64"),
                 (b"bbox", "float"), (b"text", "bytes")]
        entries = []
        for name, kind in names:
            if self.chance(0.04):
                continue  # a feature missing
            if self.chance(0.04):
                kind = str(self.rng.choice(["bytes", "int64", "float"]))  # another kind than the usual
            entries.append(self.entry(name, None if self.chance(0.02) else kind))
            if self.chance(0.02):
                entries.append(self.entry(name, kind))  # the same key twice
        if self.chance(0.03):
            entries.append(self.entry("hauteur é".encode(), "int64"))
        if self.chance(0.02):
            entries.append(self.entry(b"\xff\xfe", "int64"))  # not UTF-8
        order = self.rng.permutation(len(entries))
        features = b"".join(field(1, entries[i]) + self.maybe_unknown() for i in order)
        out = self.maybe_unknown() + field(1, features) + self.maybe_unknown()
        if self.chance(0.02):
            out += field(1, field(1, self.entry(b"extra", "int64")))  # a second Features: merged
        return out

    def damaged(self, data: bytes) -> bytes:
        """``data`` cut short, a byte changed, inserted or dropped, or a group's wire type put in."""
        if not data:
            return data
        at = int(self.rng.integers(0, len(data)))
        how = int(self.rng.integers(0, 5))
        if how == 0:
            return data[:at]
        if how == 1:
            return data[:at] + bytes([data[at] ^ int(self.rng.integers(1, 256))]) + data[at + 1:]
        if how == 2:
            return data[:at] + self.rng.bytes(1) + data[at:]
        if how == 3:
            return data[:at] + data[at + 1:]
        return data[:at] + tag(int(self.rng.integers(1, 20)), int(self.rng.choice([3, 4, 6, 7]))) + data[at:]


def write_records(path: Path, records: list[bytes]) -> None:
    with open(path, "wb") as f:
        for data in records:
            length = struct.pack("<Q", len(data))
            f.write(length + struct.pack("<I", _masked_crc32c(length)) + data
                    + struct.pack("<I", _masked_crc32c(data[:64])))  # the data's CRC is not checked


async def read_both(path: Path, features: dict[str, str] | None) -> tuple[list, list, readers.TFRecordReader]:
    """The samples as the reader reads them, and as protobuf alone makes them."""
    scanned = readers.tfrecord(path, features=features, chunk_size=16)
    alone = readers.tfrecord(path, features=features, chunk_size=16)
    alone._open_io = lambda: None  # no sample pool: protobuf for every record, the reference
    both = []
    for reader in (scanned, alone):
        both.append([s async for chunk in reader.read(0) for s in chunk])
    return both[0], both[1], scanned


def same_samples(scanned: list, alone: list) -> None:
    assert len(scanned) == len(alone)
    for a, b in zip(scanned, alone):
        assert a.key == b.key and a.source == b.source
        assert (a.error is None) == (b.error is None), (a.key, a.error, b.error)
        if a.error is not None:
            assert isinstance(a.error, ReadError) and str(a.error) == str(b.error)
            continue
        assert a.fields.keys() == b.fields.keys()
        for name, value in a.fields.items():
            other = b.fields[name]
            assert type(value) is type(other), (a.key, name, value, other)
            if isinstance(value, np.ndarray):
                assert np.array_equal(value, other)
            else:
                assert value == other, (a.key, name)


@pytest.mark.parametrize("damage", [False, True])
async def test_the_scan_reads_every_record_as_protobuf_does(tmp_path, damage):
    rng = np.random.default_rng(7 + damage)
    writer = Writer(rng)
    records = [writer.example() for _ in range(1500)]
    if damage:
        records = [writer.damaged(r) if writer.chance(0.5) else r for r in records]
    path = tmp_path / "records.tfrecord"
    write_records(path, records)
    scanned, alone, reader = await read_both(path, WANTED)
    same_samples(scanned, alone)
    good = sum(s.error is None for s in alone)
    assert good > 300 and len(alone) - good > 30  # both kinds of record were there to compare
    if reader._pool.available:  # the helper built: it took the plain records
        stats = reader._pool.stats()
        assert stats["new"] + stats["reused"] > 150  # an image's blob each


async def test_a_feature_map_of_one_name_and_every_feature_kept(tmp_path):
    rng = np.random.default_rng(3)
    writer = Writer(rng)
    path = tmp_path / "records.tfrecord"
    write_records(path, [writer.example() for _ in range(400)])
    for features in ({"text": "txt"}, {"height": "cls"}, None):
        scanned, alone, _ = await read_both(path, features)
        same_samples(scanned, alone)


async def test_large_records_and_chunks_past_the_scratch_bound_read_whole(tmp_path, monkeypatch):
    # A chunk whose records add up to more than an I/O thread reads at once goes in several groups;
    # a record larger than that alone goes through protobuf.
    monkeypatch.setattr(importlib.import_module("headrace.readers._record_files"), "SCRATCH_BYTES", 5000)
    rng = np.random.default_rng(5)
    images = [rng.bytes(int(n)) for n in rng.integers(500, 7000, 60)]
    records = [field(1, field(1, field(1, b"image/encoded") + field(2, field(1, field(1, image))))
                         + field(1, field(1, b"image/class/label") + field(2, field(3, field(1, varint(i))))))
               for i, image in enumerate(images)]
    path = tmp_path / "large.tfrecord"
    write_records(path, records)
    samples = [s async for chunk in readers.tfrecord(path, chunk_size=16).read(0) for s in chunk]
    assert [s.fields["jpg"] for s in samples] == images
    assert [s.fields["cls"] for s in samples] == [str(i).encode() for i in range(60)]
    assert parse_example(records[0])["image/encoded"] == images[0]  # the records are real Examples
