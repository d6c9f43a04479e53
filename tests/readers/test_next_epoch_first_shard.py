"""The next epoch's first shards start downloading as this epoch's last shards free their places,
while the reader's connections are held (the Loader holds them over each epoch): where reading is the
limit, the loader's run ahead starts the next epoch only once this read is done, and over a store 50 ms
away its first batch then waited a first-byte latency and the GETs' ramp (~130 ms on the H200, against
~30 ms from local disk; docs/benchmarks.md). The next read's first ``read_ahead + 1`` shards (those it
opens at once) are started, never more downloads at once than a read keeps. A read outside a held
session starts nothing; a download started so and not taken over is stopped, and nothing is left
open. No test asserts a time."""

from __future__ import annotations

import asyncio
import contextlib
import re

import pytest

from headrace import Loader, StorageError, ops, readers

from test_storage import RETRY as FAST
from test_storage import WDS, _read_all, _same, _url
from test_storage_latency import RETRY, slow, slow_server  # noqa: F401 - fixtures

SEED = 3


def _remote(slow, kind: str):
    return readers.webdataset(slow.source(kind, WDS), shuffle=True, shuffle_buffer=20, seed=SEED,
                              storage_options={"retry": RETRY})


def _local(slow):
    return readers.webdataset(str(slow.root / WDS), shuffle=True, shuffle_buffer=20, seed=SEED)


def _loader(reader, run_ahead: bool) -> Loader:
    return Loader(reader, batch_size=4, pipeline=ops.Pipeline(image=None, label=None, fields=["jpg"]),
                  device="cpu", num_threads=1, run_ahead=run_ahead, distributed=False)


async def _keys(loader: Loader) -> list[str]:
    return [key async for batch in loader for key in batch.sample_keys]


async def _local_keys(slow, epoch: int) -> list[str]:
    return [s.key for s in await _read_all(_local(slow), epoch=epoch, seed=SEED)]


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_each_epoch_run_ahead_takes_over_its_first_shard_started_by_the_epoch_before(slow, kind, leaks):
    reader = _remote(slow, kind)
    loader = _loader(reader, run_ahead=True)
    try:
        for epoch in range(3):
            assert await _keys(loader) == await _local_keys(slow, epoch)  # every sample once, in order
    finally:
        await loader.aclose()
    await leaks.check()  # before idle(): its to_thread may start a second default-executor thread
    await slow.idle()
    # Epochs 1 and 2 began on the three downloads (read_ahead + 1) started in the epoch before; so
    # did epoch 3, where its run had started ahead (then thrown away by aclose) before the last
    # batch of epoch 2 was taken.
    assert reader.files.warmed in (6, 9)
    assert slow.stats()["open"] == 0


async def test_without_run_ahead_nothing_is_started_for_the_next_epoch(slow, leaks):
    reader = _remote(slow, "s3")
    loader = _loader(reader, run_ahead=False)
    try:
        for epoch in range(2):
            keys = []
            async for batch in loader:
                keys += batch.sample_keys
                # Not held: the epoch's end would let go of the connections before the next read
                # began, and stop the downloads started for it, fetched for nothing.
                assert reader.files._next is None and reader.files._warm == {}
            assert keys == await _local_keys(slow, epoch)
    finally:
        await loader.aclose()
    await leaks.check()
    await slow.idle()
    assert reader.files.warmed == 0
    assert slow.stats()["open"] == 0


async def test_a_read_outside_a_held_session_starts_nothing_for_the_next(slow, leaks):
    reader = _remote(slow, "s3")
    _same(await _read_all(reader, epoch=0, seed=SEED), await _read_all(_local(slow), epoch=0, seed=SEED))
    assert reader.files._warm == {} and reader.files._next is None
    await leaks.check()


async def test_a_next_read_of_another_epoch_drops_the_started_download_and_reads_its_own(slow, leaks):
    reader = _remote(slow, "s3")
    firsts = [job.shard for job in reader._jobs(1, SEED)[:3]]
    # An epoch none of whose first read_ahead + 1 shards (those its read opens at once) is among epoch 1's.
    other = next(e for e in range(2, 50) if not set(firsts) & {job.shard for job in reader._jobs(e, SEED)[:3]})
    async with reader.connections():
        _same(await _read_all(reader, epoch=0, seed=SEED), await _read_all(_local(slow), epoch=0, seed=SEED))
        assert list(reader.files._warm) == firsts  # epoch 1's first read_ahead + 1 shards, started
        _same(await _read_all(reader, epoch=other, seed=SEED),
              await _read_all(_local(slow), epoch=other, seed=SEED))
        assert reader.files.warmed == 0  # not epoch 1: its download stopped unread
        _same(await _read_all(reader, epoch=other + 1, seed=SEED),
              await _read_all(_local(slow), epoch=other + 1, seed=SEED))
        assert reader.files.warmed == 3  # the epoch after ``other``: started by ``other``'s read
    assert reader.files._warm == {} and reader.files._next is None
    await leaks.check()
    await slow.idle()
    assert slow.stats()["open"] == 0


def _downloads_running() -> int:
    """Shard downloads whose task is still running on this loop (not their ranged GETs)."""
    return sum(1 for t in asyncio.all_tasks() if re.fullmatch(r"headrace:storage:\d+", t.get_name()) and not t.done())


@pytest.mark.parametrize("read_ahead", [0, 1])
async def test_the_downloads_started_for_the_next_read_keep_within_a_reads_places(slow, read_ahead, leaks):
    reader = readers.webdataset(slow.source("s3", WDS), shuffle=True, shuffle_buffer=20, seed=SEED,
                                read_ahead=read_ahead, storage_options={"retry": RETRY})
    most = 0
    async with reader.connections():
        async with contextlib.aclosing(reader.read(0, seed=SEED)) as stream:
            keys = []
            async for chunk in stream:
                keys += [s.key for s in chunk]
                most = max(most, _downloads_running())
        assert keys == await _local_keys(slow, 0)
        assert list(reader.files._warm) == [job.shard for job in reader._jobs(1, SEED)[:read_ahead + 1]]
        assert [s.key for s in await _read_all(reader, epoch=1, seed=SEED)] == await _local_keys(slow, 1)
        assert reader.files.warmed == read_ahead + 1
    assert 0 < most <= read_ahead + 1
    await leaks.check()
    await slow.idle()
    assert slow.stats()["open"] == 0


async def test_a_break_with_the_next_first_shard_started_leaves_nothing_open(slow, leaks):
    reader = _remote(slow, "s3")
    loader = _loader(reader, run_ahead=True)
    started = False
    try:
        async with contextlib.aclosing(aiter(loader)) as batches:
            async for _ in batches:
                # The read asked for its last shard: the next epoch's first is downloading, held for
                # the next read or already taken over by the run started ahead.
                started = bool(reader.files._warm or reader.files.warmed)
                if started:
                    break
        assert started, "the epoch ended before its read asked for its last shard"
    finally:
        await loader.aclose()
    await leaks.check()
    await slow.idle()
    assert reader.files._next is None
    assert slow.stats()["open"] == 0


async def test_a_ranks_part_has_its_own_session_state(slow, leaks):
    reader = _remote(slow, "s3")
    async with reader.connections():
        await _read_all(reader, epoch=0, seed=SEED)
        part = reader.shard(0, 2)
        assert part.files._warm == {} and part.files._next is None and part.files._holders == 0
        assert reader.files._warm  # the original's started download is its own
    await leaks.check()


@pytest.mark.parametrize("kind", ["s3", "http"])
@pytest.mark.parametrize("start", [1, 29])
async def test_a_resume_inside_the_started_shard_reads_on_from_there(slow, kind, start, leaks):
    big = readers.webdataset(slow.source(kind, "big/big-0.tar"), counts="scan", buffer_bytes=2 << 20,
                             storage_options={"retry": RETRY})
    whole = await _read_all(big, epoch=1)
    async with big.connections():
        await _read_all(big, epoch=0)
        assert big.files._warm  # one shard: epoch 1's first, started as epoch 0 asked for it
        await asyncio.sleep(0.3)  # some of it downloaded before the resumed read seeks past it
        resumed = await _read_all(big, epoch=1, start=start)
        assert big.files.warmed == 1
        _same(resumed, whole[start:])
    await leaks.check()


async def test_the_started_shards_failure_is_its_epochs_named_and_typed(s3_env, leaks):
    reader = readers.webdataset(_url(s3_env, "s3", WDS), shuffle=True, shuffle_buffer=20, seed=SEED,
                                storage_options={"retry": FAST})
    first = reader._jobs(1, SEED)[0].shard
    name = reader.shards[first].rsplit("/", 1)[1]
    # Epoch 0 reads that shard cleanly; every GET of it after that answers 500.
    s3_env.faults("s3", {"match": name, "faults": [None], "then": {"kind": "status", "status": 500}})
    loader = _loader(reader, run_ahead=True)
    try:
        assert await _keys(loader) == await _local_keys_at(s3_env.root, 0)
        with pytest.raises(StorageError) as raised:
            await _keys(loader)
        assert name in str(raised.value)
    finally:
        await loader.aclose()
        s3_env.faults("s3")
    await leaks.check()


async def _local_keys_at(root, epoch: int) -> list[str]:
    local = readers.webdataset(str(root / WDS), shuffle=True, shuffle_buffer=20, seed=SEED)
    return [s.key for s in await _read_all(local, epoch=epoch, seed=SEED)]
