"""LMDB reader: key lists, a database another process writes while we read, and what is left on disk.

The writers here are real processes (``lmdb`` in a child Python), as they would be beside a job:
LMDB lets one process open an environment only once, and its readers and writers coordinate
through the lock file, not through anything of ours.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from headrace import ConfigError, ReadError, readers

lmdb_lib = pytest.importorskip("lmdb")


async def _read_all(reader, epoch=0):
    return [s async for chunk in reader.read(epoch) for s in chunk]


def _write(path, items, map_size=1 << 22, lock=True):
    """A database as an ordinary writer leaves it (with locking on, LMDB's default: ``lock.mdb`` stays)."""
    env = lmdb_lib.open(str(path), map_size=map_size, subdir=True, lock=lock)
    with env.begin(write=True) as txn:
        for k, v in items:
            txn.put(k, v)
    env.close()
    return path


# Run in another process, as a writer beside the job would be.
_REWRITE = """
import sys, lmdb
env = lmdb.open(sys.argv[1], map_size=1 << 26, subdir=True)
for round_ in range(6):  # several commits, so that the pages of older snapshots are free to reuse
    with env.begin(write=True) as txn:
        for i in range(int(sys.argv[2])):
            txn.put(b"k%05d" % i, b"new%d-" % round_ * 20)
env.close()
"""

_GROW = """
import sys, lmdb
env = lmdb.open(sys.argv[1], map_size=1 << 28, subdir=True)
with env.begin(write=True) as txn:
    for i in range(24):
        txn.put(b"z%03d" % i, bytes(1 << 20))  # 24 MiB: past the 4 MiB map the reader opened with
env.close()
"""


def _run_writer(script, *args):
    subprocess.run([sys.executable, "-c", script, *map(str, args)], check=True, timeout=60)


# -- the key list ----------------------------------------------------------------------------------


async def test_an_empty_key_is_one_error_sample_naming_it_and_the_rest_are_read(tmp_path):
    """LMDB cannot hold an empty key; asking for one raised lmdb.BadValsizeError out of the read,
    ending the epoch (every other key of it lost)."""
    path = _write(tmp_path / "db", [(b"k0", b"zero"), (b"k1", b"one")])
    samples = await _read_all(readers.lmdb(path, keys=["k0", "", "k1"], chunk_size=8))
    assert [s.key for s in samples] == ["k0", "", "k1"]
    assert [s.fields.get("bin") for s in samples] == [b"zero", None, b"one"]
    bad = samples[1].error
    assert isinstance(bad, ReadError) and bad.key == "" and bad.source == str(path.resolve())


@pytest.mark.parametrize("keys", ["k0", b"k0", [0, 1], ["k0", None]])
def test_keys_that_are_not_a_list_of_str_or_bytes_are_refused(tmp_path, keys):
    """One string was taken letter by letter; an int n became n zero bytes (0: the empty key)."""
    path = _write(tmp_path / "db", [(b"k0", b"zero")])
    with pytest.raises(ConfigError, match="keys"):
        readers.lmdb(path, keys=keys)


def test_a_keys_entry_that_is_not_a_list_of_strings_is_a_read_error(tmp_path):
    """``"abc"`` (a JSON string) was three keys, a, b and c."""
    path = _write(tmp_path / "db", [(b"__keys__", json.dumps("abc").encode()), (b"a", b"1")])
    with pytest.raises(ReadError, match="__keys__") as info:
        readers.lmdb(path)
    assert info.value.source == str(path.resolve())


@pytest.mark.parametrize("meta", [{"classes": 5}, {"classes": "abc"}, {"classes": [1, 2]}, [1]])
async def test_another_programs_meta_entry_gives_no_classes(tmp_path, meta):
    """``{"classes": 5}`` raised a bare TypeError, ``"abc"`` gave classes a, b and c."""
    path = _write(tmp_path / "db", [(b"__meta__", json.dumps(meta).encode()), (b"a", b"1")])
    reader = readers.lmdb(path)
    assert reader.classes == () and [s.key for s in await _read_all(reader)] == ["a"]


# -- another process writes while we read ----------------------------------------------------------


async def test_a_writer_in_another_process_leaves_the_snapshot_of_a_chunk_alone(tmp_path, leaks):
    """Read without locking, a chunk's transaction is invisible to writers, which reuse its pages:
    1978 of 2000 keys came back "not found" and the rest held a later write's values."""
    n = 2000
    path = _write(tmp_path / "db", [(b"k%05d" % i, b"old-" * 20) for i in range(n)], map_size=1 << 26)
    wrote = []

    def decode(key, value):
        if not wrote:  # in the middle of the chunk's transaction
            wrote.append(True)
            _run_writer(_REWRITE, path, n)
        return {"bin": value}

    samples = await _read_all(readers.lmdb(path, decode=decode, chunk_size=n, io_threads=1))
    assert wrote and len(samples) == n
    assert [s.error for s in samples if s.error] == []
    assert {s.fields["bin"] for s in samples} == {b"old-" * 20}  # one snapshot, the one the chunk began on
    later = await _read_all(readers.lmdb(path, chunk_size=500))
    assert {s.fields["bin"] for s in later} == {b"new5-" * 20}
    await leaks.check()


@pytest.mark.parametrize("io_threads", [1, 2])
async def test_a_database_another_process_grows_past_our_map_is_read_on(tmp_path, io_threads, leaks):
    """The next transaction after the writer's commit failed with lmdb.MapResizedError, ending the
    epoch; the map is now resized (with no transaction of ours open) and the read goes on."""
    keys = [b"k%03d" % i for i in range(30)]
    path = _write(tmp_path / "db", [(k, k * 3) for k in keys])
    reader = readers.lmdb(path, chunk_size=2, io_threads=io_threads)
    samples = []
    async for chunk in reader.read(0):
        samples += chunk
        if len(samples) == 2:
            _run_writer(_GROW, path)
    assert os.path.getsize(path / "data.mdb") > 1 << 24
    assert [s.error for s in samples if s.error] == []
    assert [(s.key.encode(), s.fields["bin"]) for s in samples] == [(k, k * 3) for k in keys]
    await leaks.check()


async def test_ranks_sharing_one_environment_read_on_across_a_resize(tmp_path, leaks):
    """Several readers (ranks) of one process share the environment; the resize waits for all of
    their transactions and then serves them all."""
    import asyncio

    keys = [b"k%03d" % i for i in range(60)]
    path = _write(tmp_path / "db", [(k, k) for k in keys])
    base = readers.lmdb(path, shuffle=True, seed=4, chunk_size=3, io_threads=2)
    grown = asyncio.Event()

    async def rank(r):
        out = []
        async for chunk in base.shard(r, 3).read(0):
            out += chunk
            if r == 0 and not grown.is_set():
                _run_writer(_GROW, path)  # the loop waits; the other ranks' I/O threads go on
                grown.set()
            await asyncio.sleep(0)
        return out

    parts = await asyncio.gather(*(rank(r) for r in range(3)))
    samples = [s for part in parts for s in part]
    assert grown.is_set() and [s.error for s in samples if s.error] == []
    assert sorted(s.key.encode() for s in samples) == keys and all(s.fields["bin"] == s.key.encode() for s in samples)
    await leaks.check()


# -- what is left on disk --------------------------------------------------------------------------


async def test_reading_makes_no_lock_file_and_keeps_a_writers_one(tmp_path):
    """No lock file is ever made (a read-only dataset folder could not hold one); a writer's is used."""
    bare = _write(tmp_path / "bare", [(b"a", b"1")], map_size=1 << 34, lock=False)  # a 16 GiB map
    assert sorted(os.listdir(bare)) == ["data.mdb"]
    assert [s.fields["bin"] for s in await _read_all(readers.lmdb(bare))] == [b"1"]
    assert [s.key for s in await _read_all(readers.lmdb(bare / "data.mdb"))] == ["a"]  # the file itself
    assert sorted(os.listdir(bare)) == ["data.mdb"]
    locked = _write(tmp_path / "locked", [(b"a", b"1")])
    assert [s.fields["bin"] for s in await _read_all(readers.lmdb(locked))] == [b"1"]
    assert sorted(os.listdir(locked)) == ["data.mdb", "lock.mdb"]


# -- ranks -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 3, 8, 13])
@pytest.mark.parametrize("equal", [None, "pad", "drop"])
async def test_ranks_split_one_order_of_the_epoch_even_with_more_ranks_than_keys(tmp_path, world, equal):
    """Rank r reads entries r, r + world, ... of the one seeded order (``pad``: extended by its head
    to a multiple of ``world``, ``drop``: cut to one), as long as ``len()`` says."""
    keys = [b"k%02d" % i for i in range(7)]
    base = readers.lmdb(_write(tmp_path / "db", [(k, k) for k in keys]), shuffle=True, seed=9, chunk_size=2)
    whole = [s.key for s in await _read_all(base, epoch=3)]
    assert sorted(whole) == [k.decode() for k in keys]
    extra = len(whole) % world
    if equal == "pad" and extra:
        whole = [whole[i % len(whole)] for i in range(len(whole) + world - extra)]
    elif equal == "drop":
        whole = whole[: len(whole) - extra]
    for r in range(world):
        part = base.shard(r, world, equal=equal)
        assert [s.key for s in await _read_all(part, epoch=3)] == whole[r::world]
        assert len(part) == len(whole[r::world])
