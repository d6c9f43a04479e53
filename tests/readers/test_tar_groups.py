"""The shards reader groups a window's tar members into samples in C (``hr_tar_groups``, with the
sample pool): the same samples, fields and errors as the parser's Python loop, on archives that
mix what the C path takes (plain ``key.field`` members) with what it leaves to the loop (long and
odd names, a field twice, directories, ``__meta__`` members), samples that cross a window of
headers, fields that differ only in case, and samples not selected."""

from __future__ import annotations

import io
import random
import tarfile

import pytest

from headrace import readers
from headrace.readers._shard_files import SamplePool
from headrace.readers._tar import iter_groups, open_shard
from headrace.readers._storage._remote import Span

from sample_data import tar_bytes


def _groups(path, select, grouper):
    with open_shard(str(path)) as f:
        out = []
        for j, key, fields, error in iter_groups(f, str(path), select, None, spans=True, grouper=grouper):
            if fields is not None:
                fields = {k: bytes(v.view) if isinstance(v, Span) else v for k, v in fields.items()}
            out.append((j, key, fields, None if error is None else error.message))
        return out


def _mixed_members(rng: random.Random, samples: int) -> list[tuple[str, bytes]]:
    members = []
    for i in range(samples):
        key = f"part{i % 3}/{i:05d}"
        exts = rng.choice([("jpg", "cls"), ("JPG", "cls"), ("png",), ("jpg", "json", "cls"), ("seg.png", "jpg")])
        for ext in exts:
            size = rng.choice([0, 3, 4095, 4096, 5000, 70_000])
            members.append((f"{key}.{ext}", rng.randbytes(size)))
        odd = rng.random()
        if odd < 0.05:  # a field twice: the sample is an error
            members.append((f"{key}.{exts[0].lower()}", b"again"))
        elif odd < 0.08:  # a name the C helper leaves to Python (over 100 bytes: a GNU long name)
            members.append((f"{key}/{'x' * 120}.txt", b"long"))
        elif odd < 0.10:  # WebDataset's meta members are passed over
            members.append(("__meta__/info.json", b"{}"))
        elif odd < 0.12:  # a non-ASCII field name
            members.append((f"{key}.caf\u00e9", b"utf8"))
    return members


@pytest.fixture(scope="module")
def grouper():
    pool = SamplePool(4096)
    grouper = pool.grouper()
    if grouper is None:
        pytest.skip("the sample pool's C helper does not build here (no compiler or Python headers)")
    yield grouper
    del pool


def _counting(grouper, tally):
    def counted(*args):
        samples = grouper(*args)
        tally["C" if samples is not None else "loop"] += 1
        return samples
    return counted


@pytest.mark.parametrize("seed", range(6))
def test_the_c_grouping_gives_the_python_loops_samples(tmp_path, grouper, seed):
    rng = random.Random(seed)
    path = tmp_path / "s.tar"
    path.write_bytes(tar_bytes(_mixed_members(rng, 300)))
    tally = {"C": 0, "loop": 0}
    for select in (None, lambda j: j % 3 != 1, lambda j: False):
        assert _groups(path, select, _counting(grouper, tally)) == _groups(path, select, None)
    assert tally["C"] > 0 and tally["loop"] > 0  # both paths ran, windows of each kind


def test_a_directory_and_a_link_among_the_members(tmp_path, grouper):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(80):
            if i % 7 == 0:
                info = tarfile.TarInfo(f"d{i:03d}")
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            if i % 11 == 0:
                info = tarfile.TarInfo(f"{i:03d}.lnk")
                info.type, info.linkname = tarfile.SYMTYPE, "elsewhere"
                tar.addfile(info)
            for ext, size in (("jpg", 6000), ("cls", 1)):
                info = tarfile.TarInfo(f"{i:03d}.{ext}")
                info.size = size
                tar.addfile(info, io.BytesIO(bytes([i]) * size))
    path = tmp_path / "d.tar"
    path.write_bytes(buf.getvalue())
    assert _groups(path, None, grouper) == _groups(path, None, None)


async def test_the_reader_gives_every_field_as_its_own_bytes(tmp_path):
    rng = random.Random(11)
    members = [(f"{i:04d}.{ext}", rng.randbytes(rng.randrange(5_000, 90_000) if ext == "jpg" else 2))
               for i in range(400) for ext in ("jpg", "cls")]
    path = tmp_path / "r.tar"
    path.write_bytes(tar_bytes(members))
    expected = dict(members)
    reader = readers.webdataset(str(path), shuffle=False, chunk_size=16)
    seen = 0
    async for chunk in reader.read(0):
        for sample in chunk:
            assert sample.error is None
            for ext, value in sample.fields.items():
                assert type(value) is bytes and value == expected[f"{sample.key}.{ext}"]
            seen += 1
    assert seen == 400


def test_a_window_after_a_sample_whose_key_is_not_utf8(tmp_path, grouper):
    # The Python loop reads the first window (its last member's name is not UTF-8: the key keeps the
    # bytes as surrogates), which leaves that sample open when the C path takes the next window.
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        names = [f"{i:05d}.cls" for i in range(255)] + ["\udcff\udcfe.cls", "\udcff\udcfe.jpg"]
        names += [f"z{i:05d}.cls" for i in range(300)]
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = 5
            tar.addfile(info, io.BytesIO(b"12345"))
    path = tmp_path / "u.tar"
    path.write_bytes(buf.getvalue())
    tally = {"C": 0, "loop": 0}
    assert _groups(path, None, _counting(grouper, tally)) == _groups(path, None, None)
    assert tally["C"] > 0


def test_a_scan_spans_at_most_its_byte_bound_and_a_larger_member_goes_alone(tmp_path, grouper, monkeypatch):
    # The bound keeps what a window copies at once small; a member past it is scanned alone.
    monkeypatch.setattr("headrace.readers._tar._SCAN_BYTES", 64 << 10)
    rng = random.Random(3)
    members = [(f"{i:04d}.{ext}", rng.randbytes(rng.choice([10, 20_000, 100_000]) if ext == "bin" else 1))
               for i in range(60) for ext in ("bin", "cls")]
    path = tmp_path / "b.tar"
    path.write_bytes(tar_bytes(members))
    sizes = []

    def recording(base, records, n, *rest):
        sizes.append(n)
        return grouper(base, records, n, *rest)

    assert _groups(path, None, recording) == _groups(path, None, None)
    assert max(sizes) < 60 and 1 in sizes  # bounded windows, some of one member
