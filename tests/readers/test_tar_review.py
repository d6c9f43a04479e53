"""Shards damaged the ways real ones are (cut short, bytes flipped in transit), read through the tar
parser and through the reader: each is a ReadError naming the shard and the sample being read,
the samples before it kept, and never a hang.

Every shard is a real tar written by ``tarfile``; the damage is done to its bytes.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import tarfile

import pytest

from headrace import ReadError, readers
from headrace.readers import _shard_files, _tar

# A hang guard only: a reader that waits forever fails the test here instead of stopping the run.
_HANG = 120


def _tar_bytes(members: list[tuple[str, bytes]], fmt: int = tarfile.GNU_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


_MEMBERS = [(f"s{i:03d}.{ext}", bytes([i]) * (300 + 97 * i)) for i in range(12) for ext in ("jpg", "cls")]


def _groups(path) -> list:
    """What iter_groups yields (key, fields), then what it raised, if anything."""
    out: list = []
    try:
        with _tar.open_shard(str(path)) as f:
            for _, key, fields, error in _tar.iter_groups(f, str(path)):
                out.append((key, fields, error))
    except ReadError as exc:
        out.append(exc)
    return out


async def _read_all(path) -> list:
    async def read():
        return [s async for chunk in readers.webdataset(path).read(0) for s in chunk]

    return await asyncio.wait_for(read(), _HANG)


def _python_only(monkeypatch):
    monkeypatch.setattr(_tar, "tar_scanner", lambda: None)


@pytest.fixture(params=["helper", "python"])
def paths(request, monkeypatch):
    """Each test both ways: headers read by the C helper where it builds, and by Python alone."""
    if request.param == "python":
        _python_only(monkeypatch)
    return request.param


# -- gzip ---------------------------------------------------------------------------------------


async def test_a_gzip_shard_cut_short_is_a_read_error_not_a_hang(tmp_path, paths):
    packed = gzip.compress(_tar_bytes(_MEMBERS))
    shard = tmp_path / "cut.tar.gz"
    shard.write_bytes(packed[: len(packed) // 2])
    groups = _groups(shard)
    assert groups[0][0] == "s000" and all(g[2] is None for g in groups[:-1])
    error = groups[-1]
    assert isinstance(error, ReadError) and "truncated gzip" in str(error)
    assert error.source == str(shard) and error.key == f"s{len(groups) - 1:03d}"  # the sample being read
    # Through the reader: the parser's thread raised EOFError, no END came, the loop waited forever.
    samples = await _read_all(shard)
    assert [s.key for s in samples[:-1]] == [g[0] for g in groups[:-1]]
    assert isinstance(samples[-1].error, ReadError) and samples[-1].error.source == str(shard)


async def test_a_gzip_shard_with_damaged_bytes_fails_its_crc(tmp_path, paths):
    # Stored deflate blocks: a flipped byte inside a member decodes to a wrong byte, every tar
    # header intact, so only gzip's CRC (checked after the archive's end marker) can see it.
    plain = _tar_bytes(_MEMBERS)
    packed = bytearray(gzip.compress(plain, compresslevel=0))
    at = packed.index(bytes([5]) * 300)  # inside s005.jpg's data
    packed[at + 10] ^= 0xFF
    shard = tmp_path / "damaged.tar.gz"
    shard.write_bytes(bytes(packed))
    groups = _groups(shard)
    error = groups[-1]
    assert isinstance(error, ReadError) and "CRC" in str(error)
    assert error.source == str(shard) and error.key == "s011"  # in the last sample's place
    assert len(groups) == 12 and [g[0] for g in groups[:-1]] == [f"s{i:03d}" for i in range(11)]
    samples = await _read_all(shard)
    assert len(samples) == 12 and "CRC" in str(samples[-1].error)  # an error, not a twelfth good sample
    assert [s.position for s in samples] == list(range(12))


async def test_a_whole_gzip_shard_reads_as_its_plain_tar(tmp_path, paths):
    plain = _tar_bytes(_MEMBERS)
    (tmp_path / "s.tar").write_bytes(plain)
    (tmp_path / "s.tar.gz").write_bytes(gzip.compress(plain))
    assert _groups(tmp_path / "s.tar.gz") == _groups(tmp_path / "s.tar")
    assert _tar.count_samples(str(tmp_path / "s.tar.gz")) == 12


# -- extended headers ---------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
async def test_a_shard_cut_after_a_long_name_header_is_truncated(tmp_path, paths, fmt):
    # A copy cut on a block boundary between a long name's header (GNU "L" or pax "x") and the
    # member it names: the end of the file came where a member must, and that sample is incomplete.
    long_key = "train/" + "x" * 120 + "/0001"
    members = [("a.jpg", b"a" * 600), (long_key + ".jpg", b"j" * 700), (long_key + ".cls", b"3"), ("b.jpg", b"b")]
    data = _tar_bytes(members, fmt)
    header_of_cls = data.index(b"3" + bytes(511)) - 512  # the .cls member's own header
    shard = tmp_path / "cut.tar"
    shard.write_bytes(data[:header_of_cls])
    groups = _groups(shard)
    assert groups[0] == ("a", {"jpg": b"a" * 600}, None)
    error = groups[-1]
    assert len(groups) == 2 and isinstance(error, ReadError) and "truncated" in str(error)
    assert error.key == long_key and error.source == str(shard)  # not a sample without its .cls
    samples = await _read_all(shard)
    assert [s.key for s in samples] == ["a", long_key] and samples[1].error is not None


@pytest.mark.parametrize("damage", [b"xx", b"00", b"99"], ids=["not-a-number", "zero-length", "past-the-end"])
async def test_a_damaged_pax_record_is_a_read_error(tmp_path, paths, damage):
    # The header checksum does not cover a pax header's data: damage there reached the record
    # parser as a ValueError (the reader then waited forever) or, for a length of 0, looped forever.
    data = bytearray(_tar_bytes([("a.jpg", b"1"), ("\u00fcber.jpg", b"2"), ("c.jpg", b"3")], tarfile.PAX_FORMAT))
    record = data.index(b" path=") - 2  # "NN path=..."
    data[record : record + 2] = damage
    shard = tmp_path / "pax.tar"
    shard.write_bytes(bytes(data))
    [error] = _groups(shard)  # in the place of "a", the sample being read (its end unknown)
    assert isinstance(error, ReadError) and "corrupt pax header at byte 1024" in str(error)
    assert error.key == "a" and error.source == str(shard)
    samples = await _read_all(shard)
    assert samples[-1].error is not None and "pax" in str(samples[-1].error)


def test_pax_records_are_read_and_checked():
    records = b"18 path=\xc3\xbcber.jpg\n19 size=9663676416\n"  # a unicode name, a size past 8 GiB
    assert _tar._pax(records) == {"path": "\u00fcber.jpg", "size": "9663676416"}
    for bad in (b"0 path=x\n", b"5 path=x\n", b"99 path=x\n", b"9 path=xy", b"9path=xy\n"):
        with pytest.raises(ValueError):
            _tar._pax(bad)


# -- the reader's threads -----------------------------------------------------------------------


async def test_a_parser_failing_unforeseen_is_raised_in_the_reader(tmp_path, monkeypatch):
    # An exception no error sample can carry (a bug, a MemoryError) used to stay in the parser
    # thread's future while the reader waited for the end of its feed forever.
    shard = tmp_path / "s.tar"
    shard.write_bytes(_tar_bytes(_MEMBERS))
    real = _shard_files.iter_groups

    def failing_after_one(*args, **kwargs):
        groups = real(*args, **kwargs)
        yield next(groups)
        raise RuntimeError("parser bug")

    monkeypatch.setattr(_shard_files, "iter_groups", failing_after_one)
    with pytest.raises(RuntimeError, match="parser bug"):
        await _read_all(shard)
