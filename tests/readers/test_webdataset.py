from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from headrace import ConfigError, ReadError, readers
from headrace.readers._shards import INDEX_NAME, expand_braces
from sample_data import tar_bytes



async def _read_all(reader, epoch=0, start=0, seed=0):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]


def _ids(samples):
    return [(s.key, s.index, s.position) for s in samples]


@pytest.fixture(scope="module")
def packed(tmp_path_factory, image_folder):
    """image_folder (75 JPEGs) packed into 10 shards of at most 8 samples, shuffled."""
    dest = tmp_path_factory.mktemp("packed") / "wds"
    readers.pack(image_folder, dest, format="webdataset", shard_count=8, shuffle=True, seed=1)
    return dest


@pytest.fixture(scope="module")
def no_index(tmp_path_factory, packed):
    """The same shards without headrace-index.json: counts unknown."""
    dest = tmp_path_factory.mktemp("noindex")
    for p in sorted(packed.glob("*.tar")):
        shutil.copy(p, dest / p.name)
    return dest


def _tar(path, members):
    """A tar of (name, bytes) pairs at path."""
    path.write_bytes(tar_bytes(members))
    return path


# -- formats ------------------------------------------------------------------------------------


async def test_reads_shards_written_by_the_webdataset_library(tmp_path):
    wds = pytest.importorskip("webdataset")
    expected = {}
    for shard in range(2):
        with wds.TarWriter(str(tmp_path / f"w-{shard}.tar")) as sink:
            for i in range(5):
                key = f"a/b/{shard}{i:03d}"
                sample = {"__key__": key, "jpg": os.urandom(700 + i), "cls": i % 3, "json": {"i": i}}
                sink.write(sample)
                expected[key] = (sample["jpg"], str(i % 3).encode(), json.dumps({"i": i}).encode())
    reader = readers.webdataset(str(tmp_path / "w-{0..1}.tar"))
    samples = await _read_all(reader)
    assert [s.key for s in samples] == list(expected)
    for s in samples:
        assert set(s.fields) == {"jpg", "cls", "json"}
        assert (s.fields["jpg"], s.fields["cls"], s.fields["json"]) == expected[s.key]
        assert s.source.endswith(".tar") and s.error is None
    with pytest.raises(TypeError, match="unknown"):
        len(reader)


@pytest.mark.parametrize("fmt", ["gnu", "posix", "ustar"])
async def test_reads_gnu_tar_shards_with_long_names_and_folders(tmp_path, fmt):
    root = tmp_path / "tree"
    deep = "d" * 60 + "/" + "e" * (20 if fmt == "ustar" else 80)  # > 100 chars needs a long-name header
    expected = {}
    for i, folder in enumerate(["x", deep]):
        (root / folder).mkdir(parents=True)
        for j in range(3):
            stem = f"{folder}/s{j}.v1"  # a dot in the name: key is up to the first dot
            payload = os.urandom(100 * (i + j + 1))
            (root / f"{stem}.JPG").write_bytes(payload)
            (root / f"{stem}.cls").write_bytes(str(j).encode())
            expected[f"{folder}/s{j}"] = {"v1.jpg": payload, "v1.cls": str(j).encode()}
    shard = tmp_path / "gnu.tar"
    subprocess.run(["tar", f"--format={fmt}", "--sort=name", "-cf", str(shard), "-C", str(root), "x", deep.split("/")[0]],
                   check=True)
    samples = await _read_all(readers.webdataset(shard))
    assert {s.key: s.fields for s in samples} == expected
    assert len(samples) == 6


async def test_gzip_shards_are_read_as_streams(tmp_path, packed):
    import gzip

    plain = sorted(packed.glob("*.tar"))[0]
    (tmp_path / "s.tar.gz").write_bytes(gzip.compress(plain.read_bytes()))
    got = await _read_all(readers.webdataset(tmp_path / "s.tar.gz"))
    want = await _read_all(readers.webdataset(plain))
    assert [(s.key, s.fields) for s in got] == [(s.key, s.fields) for s in want]


def test_brace_patterns_and_shard_lists(packed):
    assert expand_braces("t-{0000..0002}.tar") == ["t-0000.tar", "t-0001.tar", "t-0002.tar"]
    assert expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert expand_braces("x{a,{b,c}d}") == ["xa", "xbd", "xcd"]
    # A bare 0 pads nothing (bash and braceexpand alike); a written leading zero pads both ends.
    assert expand_braces("t-{0..10}") == [f"t-{i}" for i in range(11)]
    assert expand_braces("t-{00..10}") == [f"t-{i:02d}" for i in range(11)]
    assert expand_braces("t-{8..012}") == ["t-008", "t-009", "t-010", "t-011", "t-012"]
    assert expand_braces("{-1..1}") == ["-1", "0", "1"]
    with pytest.raises(ConfigError):
        expand_braces("t-{0..3.tar")
    by_pattern = readers.webdataset(str(packed / "shard-{000000..000009}.tar"))
    by_folder = readers.webdataset(packed)
    by_list = readers.webdataset(sorted(packed.glob("*.tar")))
    assert by_pattern.shards == by_folder.shards == [str(p) for p in sorted(packed.glob("*.tar"))] == by_list.shards
    assert len(by_pattern) == len(by_folder) == 75  # counts from headrace-index.json
    with pytest.raises(ReadError) as info:
        readers.webdataset(str(packed / "shard-{000000..000010}.tar"))
    assert info.value.source.endswith("shard-000010.tar")
    with pytest.raises(ConfigError):  # URLs are read through stores (tests/readers/test_storage*.py)
        readers.webdataset("ftp://host/train-{0..3}.tar")


def test_counts_argument_and_scan(no_index, packed):
    with pytest.raises(TypeError, match="headrace-index.json"):
        len(readers.webdataset(no_index))
    assert len(readers.webdataset(no_index, counts="scan")) == 75
    assert len(readers.webdataset(no_index, counts=75)) == 75
    assert len(readers.webdataset(no_index, counts=[8] * 9 + [3]).shard(1, 2)) == 35  # shards 1, 3, .., 9
    with pytest.raises(TypeError):
        len(readers.webdataset(no_index, counts=75).shard(0, 2))
    with pytest.raises(ConfigError):
        readers.webdataset(no_index).shard(0, 2, equal="pad")


# -- order, shards, resume ----------------------------------------------------------------------


async def test_shuffle_is_seeded_per_epoch_and_complete(packed):
    reader = readers.webdataset(packed, shuffle=True, shuffle_buffer=20)
    e0 = [s.key for s in await _read_all(reader, epoch=0, seed=3)]
    again = [s.key for s in await _read_all(reader, epoch=0, seed=3)]
    e1 = [s.key for s in await _read_all(reader, epoch=1, seed=3)]
    plain = [s.key for s in await _read_all(readers.webdataset(packed))]
    assert e0 == again and e0 != e1 and e0 != plain
    assert sorted(e0) == sorted(e1) == sorted(plain) and len(set(e0)) == 75
    own = readers.webdataset(packed, shuffle=True, shuffle_buffer=20, seed=3)
    assert [s.key for s in await _read_all(own, epoch=0, seed=99)] == e0
    samples = await _read_all(reader, epoch=0, seed=3)
    assert [s.position for s in samples] == list(range(75))
    assert sorted(s.index for s in samples) == list(range(75))  # dense indices from the index file


@pytest.mark.parametrize("world", [2, 3, 16])  # 16 ranks > 10 shards: split inside the shards
async def test_shards_are_disjoint_and_complete(packed, world):
    base = readers.webdataset(packed, shuffle=True, shuffle_buffer=10)
    parts = [[s.index for s in await _read_all(base.shard(r, world), epoch=2)] for r in range(world)]
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(75))
    assert [len(base.shard(r, world)) for r in range(world)] == list(map(len, parts))
    assert base.shard(0, world).by_samples == (world > 10)


@pytest.mark.parametrize(("world", "equal"), [(3, "pad"), (3, "drop"), (16, "pad"), (16, "drop")])
async def test_equal_counts(packed, world, equal):
    base = readers.webdataset(packed, shuffle=True, shuffle_buffer=5)
    parts = [await _read_all(base.shard(r, world, equal=equal)) for r in range(world)]
    sizes = {len(p) for p in parts}
    assert len(sizes) == 1 and sizes == {len(base.shard(0, world, equal=equal))}
    indices = [s.index for p in parts for s in p]
    if equal == "pad":
        assert set(indices) == set(range(75))
    else:
        assert len(indices) == len(set(indices))
    for p in parts:
        assert [s.position for s in p] == list(range(len(p)))


@pytest.mark.parametrize(
    ("world", "rank", "equal", "buffer"),
    [(1, 0, None, 0), (1, 0, None, 30), (3, 1, None, 7), (16, 5, None, 3), (3, 2, "pad", 4), (3, 0, "drop", 4)],
)
async def test_resume_yields_exactly_the_rest_of_the_stream(packed, world, rank, equal, buffer):
    reader = readers.webdataset(packed, shuffle=buffer > 0, shuffle_buffer=buffer).shard(rank, world, equal=equal)
    full = await _read_all(reader, epoch=4, seed=2)
    for start in sorted({0, 1, 2, len(full) // 3, len(full) // 2, len(full) - 1, len(full)}):
        tail = await _read_all(reader, epoch=4, seed=2, start=start)
        assert _ids(tail) == _ids(full[start:]), start
        assert all(t.fields == f.fields for t, f in zip(tail, full[start:]))


async def test_resume_without_counts_scans_headers_once(no_index, packed):
    reader = readers.webdataset(no_index, shuffle=True, shuffle_buffer=12)
    full = await _read_all(reader, epoch=1)
    assert reader._scanned is None
    for start in (1, 40, 74):
        assert [(s.key, s.position) for s in await _read_all(reader, epoch=1, start=start)] == \
               [(s.key, s.position) for s in full[start:]]
    assert sum(reader._scanned) == 75
    # Without an index the indices are (shard << 32) + ordinal: stable, but not dense.
    assert {s.index >> 32 for s in full} == set(range(10))


async def test_reading_stops_threads_and_files_when_closed_early(packed, leaks):
    reader = readers.webdataset(packed, shuffle=True, read_ahead=3, chunk_size=2)
    stream = reader.read(0)
    await stream.__anext__()
    await stream.aclose()
    await leaks.check()
    assert len(await _read_all(reader)) == 75
    await leaks.check()


# -- errors -------------------------------------------------------------------------------------


async def test_truncated_shard_ends_with_an_error_sample_naming_shard_and_key(tmp_path, packed):
    shard = sorted(packed.glob("*.tar"))[0]
    data = shard.read_bytes()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: len(data) // 2 + 100])
    samples = await _read_all(readers.webdataset(cut))
    good, bad = samples[:-1], samples[-1]
    assert good and all(s.error is None for s in good)
    assert isinstance(bad.error, ReadError) and "truncated" in str(bad.error)
    assert bad.error.source == str(cut) and bad.error.key == bad.key and bad.key not in {s.key for s in good}
    assert [s.position for s in samples] == list(range(len(samples)))


async def test_corrupt_header_is_a_read_error(tmp_path, packed):
    data = bytearray(sorted(packed.glob("*.tar"))[0].read_bytes())
    second = 512 + (int(data[124:135], 8) + 511) // 512 * 512  # the second member's header
    data[second + 130] ^= 0x5A  # inside its size field
    bad = tmp_path / "bad.tar"
    bad.write_bytes(bytes(data))
    samples = await _read_all(readers.webdataset(bad))
    assert isinstance(samples[-1].error, ReadError) and "checksum" in str(samples[-1].error)
    assert samples[-1].error.source == str(bad) and samples[-1].error.key is not None


def test_header_byte_sum_equals_pythons_sum():
    import random

    from headrace.readers._tar import _byte_sum

    rng = random.Random(0)
    headers = [bytes(512), b"\xff" * 512, b"\xff" * 256 + bytes(256)]
    headers += [bytes(rng.randrange(256) for _ in range(512)) for _ in range(200)]
    assert [_byte_sum(h) for h in headers] == [sum(h) for h in headers]


async def test_hostile_member_names_are_error_samples_never_paths(tmp_path):
    shard = _tar(tmp_path / "evil.tar", [
        ("ok/1.jpg", b"one"), ("../x.jpg", b"evil"), ("/etc/x", b"evil"), ("a/../../y.cls", b"3"), ("ok/2.jpg", b"two"),
    ])
    samples = await _read_all(readers.webdataset(shard))
    assert [s.key for s in samples] == ["ok/1", "../x", "/etc/x", "a/../../y", "ok/2"]
    assert [s.fields for s in samples] == [{"jpg": b"one"}, {}, {}, {}, {"jpg": b"two"}]
    for s in samples[1:4]:
        assert isinstance(s.error, ReadError) and s.error.key == s.key and s.error.source == str(shard)
    assert not (tmp_path / "x.jpg").exists() and sorted(os.listdir(tmp_path)) == ["evil.tar"]


async def test_required_field_missing_is_an_error_sample(tmp_path):
    shard = _tar(tmp_path / "s.tar", [("a.jpg", b"1"), ("a.cls", b"0"), ("b.cls", b"1"), ("c.png", b"3"), ("c.cls", b"2")])
    samples = await _read_all(readers.webdataset(shard, require=["jpg;png", "cls"]))
    assert [s.error is None for s in samples] == [True, False, True]
    assert samples[1].error.key == "b" and "'jpg' or 'png'" in str(samples[1].error)


async def test_duplicate_field_and_skipped_members(tmp_path):
    shard = _tar(tmp_path / "s.tar", [("__meta__", b"x"), ("noext", b"x"), ("a.jpg", b"1"), ("a.jpg", b"2"), ("b.jpg", b"3")])
    samples = await _read_all(readers.webdataset(shard))
    assert [s.key for s in samples] == ["a", "b"]
    assert isinstance(samples[0].error, ReadError) and "duplicate" in str(samples[0].error)


def test_stale_index_is_refused(tmp_path, packed):
    for p in packed.iterdir():
        shutil.copy(p, tmp_path / p.name)
    with open(tmp_path / "shard-000000.tar", "ab") as f:
        f.write(bytes(512))
    with pytest.raises(ReadError, match="stale"):
        readers.webdataset(tmp_path)
    (tmp_path / INDEX_NAME).unlink()
    assert readers.webdataset(tmp_path).shards


@pytest.mark.parametrize("kwargs", [{"shuffle_buffer": -1}, {"read_ahead": -1}, {"chunk_size": 0}, {"split": "rows"},
                                    {"counts": "guess"}, {"counts": [1, 2]}])
def test_wrong_arguments(packed, kwargs):
    with pytest.raises(ConfigError):
        readers.webdataset(packed, **kwargs)


# -- through the Loader -------------------------------------------------------------------------


def _loader(packed, **kw):
    import headrace
    from headrace import ops

    return headrace.Loader(readers.webdataset(packed, shuffle=True, shuffle_buffer=16), batch_size=8,
                           pipeline=ops.training(32), num_threads=2, seed=5, device="cpu", **kw)


async def test_loader_trains_on_packed_shards_and_resumes_exactly(packed, leaks):
    import torch

    loader = _loader(packed)
    batches = [b async for b in loader]
    assert len(batches) == len(loader) == 10
    keys = [k for b in batches for k in b.sample_keys]
    assert sorted(keys) == sorted(f"c{c}/{i:04d}" for c in range(3) for i in range(25))
    for b in batches:
        assert b["image"].shape == (b.size, 3, 32, 32)
        assert b["label"].tolist() == [int(k[1]) for k in b.sample_keys]  # label = sorted sub-folder index
    first = _loader(packed)
    async for batch in first:
        if batch.index == 3:
            break
    state = first.state_dict()
    await first.aclose()
    second = _loader(packed)
    second.load_state_dict(state)
    rest = [b async for b in second]
    await loader.aclose()
    await second.aclose()
    for x, y in zip(batches[4:], rest, strict=True):
        assert x.sample_keys == y.sample_keys and torch.equal(x["image"], y["image"])
    await leaks.check()


async def test_a_timeout_while_reading_leaves_nothing_behind(packed, leaks):
    import asyncio
    import contextlib

    reader = readers.webdataset(packed, shuffle=True, shuffle_buffer=2, read_ahead=4, chunk_size=1)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.02):
            async with contextlib.aclosing(reader.read(0)) as stream:
                async for _ in stream:
                    await asyncio.sleep(0.005)  # a slow consumer: the read-ahead threads fill their feeds and wait
    await leaks.check()


def test_glob_patterns(packed):
    assert readers.webdataset(str(packed / "shard-00000[0-2].tar")).shards == [str(packed / f"shard-00000{i}.tar")
                                                                              for i in range(3)]


@pytest.mark.parametrize(("size", "total"), [(0, 9), (1, 5), (3, 10), (7, 7), (7, 3), (40, 9000)])
def test_resume_state_agrees_with_the_buffer_at_every_position(size, total):
    from headrace.readers._shuffle import Draws, ShuffleBuffer, resume_state

    buf, out, states = ShuffleBuffer(size, Draws([1, 2])), [], {0: (list(range(min(size, total))), min(size, total))}
    for x in range(total):
        buf.push(x, out)
        states[buf.position] = (list(buf.slots), x + 1)
    while buf.slots:
        buf.drain(out, 1)
        states[buf.position] = (list(buf.slots), total)
    assert sorted(out) == list(range(total)) and (size < 2 or out != sorted(out))
    for k in sorted(states)[:: max(1, total // 50)] + [len(out) - 1, len(out)]:
        assert resume_state(size, Draws([1, 2]), total, k) == states[k], k
