"""``webdataset(cache_dir=)``: remote shards kept on local disk as they are read, through the real
S3 (moto) and HTTP servers behind their fault proxies; later epochs read the copies, not the store."""

from __future__ import annotations

import contextlib
import os

import pytest

from headrace import ConfigError, StorageError, readers

from storage_servers import BUCKET
from test_storage import RETRY, WDS, _read_all, _same, _url

SHARDS = 10


def _kept(folder) -> dict[str, bytes]:
    """The whole shards in the cache folder, by file name; asserts no ``.part`` file is left."""
    names = sorted(os.listdir(folder))
    assert not [n for n in names if n.endswith(".part")], names
    return {n: (folder / n).read_bytes() for n in names}


def _originals(root) -> set[bytes]:
    return {p.read_bytes() for p in (root / "wds").glob("*.tar")}


def _shard_gets(servers, kind: str) -> set[str]:
    """The shards GET asked for since the last look (a GET resumed after a slow answer counts once)."""
    return {r["path"] for r in servers.log(kind) if r["path"].endswith(".tar")}


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_later_epochs_read_the_kept_shards_not_the_store(s3_env, kind, tmp_path, leaks):
    local = readers.webdataset(str(s3_env.root / WDS), shuffle=True, shuffle_buffer=20)
    remote = readers.webdataset(_url(s3_env, kind, WDS), shuffle=True, shuffle_buffer=20,
                                storage_options={"retry": RETRY}, cache_dir=tmp_path / "cache")
    _shard_gets(s3_env, kind)  # the log from here on
    _same(await _read_all(remote, epoch=0, seed=3), await _read_all(local, epoch=0, seed=3))
    assert len(_shard_gets(s3_env, kind)) == SHARDS
    kept = _kept(tmp_path / "cache")
    assert len(kept) == SHARDS and set(kept.values()) == _originals(s3_env.root)  # byte for byte
    assert (remote.cache.kept, remote.cache.hits) == (SHARDS, 0)

    _same(await _read_all(remote, epoch=1, seed=3), await _read_all(local, epoch=1, seed=3))
    assert _shard_gets(s3_env, kind) == set()  # every shard from the folder
    assert (remote.cache.kept, remote.cache.hits) == (SHARDS, SHARDS)
    samples = await _read_all(remote, epoch=2, seed=3)
    assert samples[0].source.startswith(f"s3://{BUCKET}/" if kind == "s3" else s3_env.http)  # named by URL
    await leaks.check()



async def test_a_new_reader_and_other_ranks_share_the_folder(s3_env, tmp_path, leaks):
    cache = tmp_path / "cache"
    first = readers.webdataset(_url(s3_env, "s3", WDS), storage_options={"retry": RETRY}, cache_dir=cache)
    await _read_all(first)
    _shard_gets(s3_env, "s3")
    # A later run, two ranks: each reads its shards from the folder.
    ranks = [readers.webdataset(_url(s3_env, "s3", WDS), storage_options={"retry": RETRY},
                                cache_dir=cache).shard(r, 2) for r in range(2)]
    local = [readers.webdataset(str(s3_env.root / WDS)).shard(r, 2) for r in range(2)]
    for remote, expected in zip(ranks, local):
        _same(await _read_all(remote), await _read_all(expected))
    assert _shard_gets(s3_env, "s3") == set()
    assert sum(r.cache.hits for r in ranks) == SHARDS
    await leaks.check()


async def test_a_shard_left_early_is_not_kept(s3_env, tmp_path, leaks):
    reader = readers.webdataset(_url(s3_env, "s3", WDS), storage_options={"retry": RETRY},
                                cache_dir=tmp_path / "cache", chunk_size=2, read_ahead=0)
    async with contextlib.aclosing(reader.read(0)) as stream:
        async for _ in stream:
            break  # inside the first shard
    assert _kept(tmp_path / "cache") == {}
    assert reader.cache.kept == 0
    await leaks.check()


async def test_leaving_early_closes_the_kept_shards_opened_ahead(s3_env, tmp_path, leaks):
    reader = readers.webdataset(_url(s3_env, "s3", WDS), storage_options={"retry": RETRY},
                                cache_dir=tmp_path / "cache", chunk_size=2, read_ahead=4)
    await _read_all(reader)
    async with contextlib.aclosing(reader.read(1)) as stream:
        async for _ in stream:
            break  # five shards opened from the folder, one of them partly read
    assert reader.cache.hits >= 5
    await leaks.check()


async def test_a_resume_keeps_only_whole_shards_and_is_exact(s3_env, tmp_path, leaks):
    local = readers.webdataset(str(s3_env.root / WDS), shuffle=True, shuffle_buffer=5)
    remote = readers.webdataset(_url(s3_env, "s3", WDS), shuffle=True, shuffle_buffer=5,
                                storage_options={"retry": RETRY}, cache_dir=tmp_path / "cache")
    _same(await _read_all(remote, epoch=0, start=40, seed=1), await _read_all(local, epoch=0, start=40, seed=1))
    kept = _kept(tmp_path / "cache")
    assert 0 < len(kept) < SHARDS  # the shards the resume opened; none of those it passed over
    assert set(kept.values()) <= _originals(s3_env.root)
    # A full epoch then reads the kept ones from the folder and the rest from the store.
    _same(await _read_all(remote, epoch=1, seed=1), await _read_all(local, epoch=1, seed=1))
    assert remote.cache.hits == len(kept) and len(_kept(tmp_path / "cache")) == SHARDS
    await leaks.check()


async def test_a_big_shard_fetched_by_ranged_gets_through_faults_is_kept_whole(s3_env, tmp_path, leaks):
    s3_env.faults("s3", {"match": "big-0", "faults": [{"kind": "reset", "after": 3 << 20}]})
    reader = readers.webdataset(f"s3://{BUCKET}/big/big-0.tar", buffer_bytes=1 << 20, chunk_size=2,
                                storage_options={"retry": RETRY}, cache_dir=tmp_path / "cache")
    assert len(await _read_all(reader)) == 48
    assert reader.retries >= 1
    kept = _kept(tmp_path / "cache")
    assert list(kept.values()) == [(s3_env.root / "big" / "big-0.tar").read_bytes()]
    await leaks.check()


async def test_a_shard_that_fails_past_the_budget_is_not_kept(s3_env, tmp_path, leaks):
    s3_env.faults("s3", {"match": "shard-000002", "faults": [{"kind": "reset", "after": 1500}],
                         "then": {"kind": "status", "status": 503}})
    reader = readers.webdataset(_url(s3_env, "s3", WDS), storage_options={"retry": RETRY},
                                cache_dir=tmp_path / "cache")
    samples = await _read_all(reader)
    # The index counts the shard's samples: each of them is a StorageError in its place, so the
    # epoch keeps its length.
    failed = [s for s in samples if s.error is not None]
    assert [type(s.error) for s in failed] == [StorageError] * 8 and len(samples) == len(reader)
    assert all("shard-000002" in s.source for s in failed)
    kept = _kept(tmp_path / "cache")
    assert len(kept) == SHARDS - 1 and not any("shard-000002" in name for name in kept)
    await leaks.check()


async def test_cache_bytes_keeps_the_most_recently_used_within_the_bound(s3_env, tmp_path, leaks):
    sizes = sorted(p.stat().st_size for p in (s3_env.root / "wds").glob("*.tar"))
    bound = sum(sizes[-3:])  # room for any three shards, never for all ten
    local = readers.webdataset(str(s3_env.root / WDS))
    remote = readers.webdataset(_url(s3_env, "s3", WDS), storage_options={"retry": RETRY},
                                cache_dir=tmp_path / "cache", cache_bytes=bound, read_ahead=0)
    _same(await _read_all(remote), await _read_all(local))
    kept = _kept(tmp_path / "cache")
    assert 3 <= len(kept) < SHARDS and sum(map(len, kept.values())) <= bound
    assert remote.cache.kept == SHARDS and remote.cache.evicted == SHARDS - len(kept)
    # The last shards read are the ones kept (read_ahead=0: in order, one at a time).
    last = (s3_env.root / "wds" / f"shard-{SHARDS - 1:06d}.tar").read_bytes()
    assert last in kept.values()
    await leaks.check()


async def test_a_shard_larger_than_the_bound_is_read_but_not_kept(s3_env, tmp_path, leaks):
    reader = readers.webdataset(f"s3://{BUCKET}/big/big-0.tar", storage_options={"retry": RETRY},
                                cache_dir=tmp_path / "cache", cache_bytes=1 << 20)
    assert len(await _read_all(reader)) == 48
    assert _kept(tmp_path / "cache") == {} and reader.cache.kept == 0
    await leaks.check()


async def test_a_dead_writers_part_file_is_removed_and_local_shards_are_not_copied(s3_env, tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    dead = cache / "0123456789abcdef-shard-000000.tar.999999999-0a1b2c3d.part"  # no such process
    dead.write_bytes(b"half a shard")
    reader = readers.webdataset(str(s3_env.root / WDS), cache_dir=cache)
    assert len(await _read_all(reader)) == 75
    assert os.listdir(cache) == []


def test_wrong_cache_arguments(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_bytes(b"")
    with pytest.raises(ConfigError, match="cache_dir"):
        readers.webdataset(f"s3://{BUCKET}/{WDS}", cache_dir=a_file / "cache", counts=75)
    with pytest.raises(ConfigError, match="cache_bytes needs a cache_dir"):
        readers.webdataset(f"s3://{BUCKET}/{WDS}", cache_bytes=1 << 30, counts=75)
    with pytest.raises(ConfigError, match="cache_bytes"):
        readers.webdataset(f"s3://{BUCKET}/{WDS}", cache_dir=tmp_path, cache_bytes=0, counts=75)
