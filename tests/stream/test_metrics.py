"""Epoch metrics (starved, blocked, per-stage counts and seconds) and the progress bar, on real loaders.

Times are compared between runs, or against sleeps the test injects, with wide margins: never a
tight wall-clock bound.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from headrace import ConfigError, EpochMetrics, Loader, StageStats, ops, readers
from headrace._channel import open_channel
from headrace.readers import Reader

SAMPLES, BATCHES = 75, 10  # the image_folder fixture, batch size 8, partial last batch


def _pipe():
    return ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(32), ops.Normalize()])


def _loader(reader, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("batch_size", 8)
    kw.setdefault("pipeline", _pipe())
    kw.setdefault("num_threads", 2)
    return Loader(reader, **kw)


class SlowSource(Reader):
    """A files reader whose source waits ``delay`` seconds before each list of samples."""

    def __init__(self, inner, delay):
        self.inner, self.delay = inner, delay

    def __len__(self):
        return len(self.inner)

    def shard(self, rank, world, *, equal=None):
        return SlowSource(self.inner.shard(rank, world, equal=equal), self.delay)

    async def read(self, epoch, *, start=0, seed=0):
        async with contextlib.aclosing(self.inner.read(epoch, start=start, seed=seed)) as chunks:
            async for chunk in chunks:
                await asyncio.sleep(self.delay)
                yield chunk


async def _epoch(loader, pause=0.0):
    """One epoch; the consumer sleeps ``pause`` seconds per batch. The epoch's metrics."""
    batches = 0
    async for _ in loader:
        batches += 1
        if pause:
            await asyncio.sleep(pause)
    assert batches == BATCHES
    return loader.stats().epoch_metrics


async def test_channel_sums_only_the_waits_that_happen():
    tx, rx = open_channel(1)
    await tx.send(1)  # room: no wait
    assert await rx.receive() == 1  # an item: no wait
    stats = rx.statistics()
    assert (stats.send_wait_seconds, stats.receive_wait_seconds) == (0.0, 0.0)

    waiting = asyncio.create_task(rx.receive())
    await asyncio.sleep(0.05)
    assert rx.statistics().receive_wait_seconds >= 0.04  # a wait in progress counts already
    await tx.send(2)
    assert await waiting == 2
    done = rx.statistics().receive_wait_seconds
    await asyncio.sleep(0.02)
    assert rx.statistics().receive_wait_seconds == done  # finished: it no longer grows

    await tx.send(3)
    blocked = asyncio.create_task(tx.send(4))
    await asyncio.sleep(0.05)
    blocked.cancel()  # a cancelled wait still counts
    with pytest.raises(asyncio.CancelledError):
        await blocked
    assert tx.statistics().send_wait_seconds >= 0.04
    assert tx.statistics().waiting_senders == 0


async def test_stage_counts_match_what_was_delivered(image_folder, leaks):
    loader = _loader(readers.files(image_folder, shuffle=True))
    assert loader.stats().epoch_metrics is None
    m = await _epoch(loader)
    assert isinstance(m, EpochMetrics) and m.finished and m.epoch == 0
    assert (m.batches, m.samples) == (BATCHES, SAMPLES)
    assert set(m.stages) == {"read", "decode", "handoff"}
    assert all(isinstance(s, StageStats) for s in m.stages.values())
    assert [s.items for s in m.stages.values()] == [SAMPLES] * 3
    assert all(s.busy_seconds > 0 for s in m.stages.values())
    assert m.stages["handoff"].blocked_seconds == 0.0
    assert 0 < m.starved_seconds < m.wall_seconds
    assert m.stages["decode"].busy_seconds <= m.wall_seconds  # overlapping batches are not summed
    assert m.samples_per_second == pytest.approx(SAMPLES / m.wall_seconds)

    m1 = await _epoch(loader)  # the next epoch counts from zero
    assert (m1.epoch, m1.batches, m1.stages["read"].items) == (1, BATCHES, SAMPLES)
    await loader.aclose()
    await leaks.check()


async def test_a_slow_consumer_blocks_the_pipeline_and_is_named_the_limit(image_folder):
    fast = await _epoch(_loader(readers.files(image_folder, shuffle=True)))
    pause = 0.1  # 10 batches: 1 s of consumer work the pipeline must wait for (0.5 s was named "decode" once in a loaded CI run)
    slow = await _epoch(_loader(readers.files(image_folder, shuffle=True)), pause=pause)
    assert slow.blocked_seconds > BATCHES * pause / 4
    assert slow.blocked_seconds == slow.stages["decode"].blocked_seconds
    assert slow.blocked_seconds > slow.starved_seconds
    assert slow.starved_fraction < fast.starved_fraction
    assert slow.wall_seconds >= BATCHES * pause
    assert slow.limit == "consumer"
    assert "the consumer is the limit" in slow.summary()


async def test_a_slow_source_starves_the_consumer_and_is_named_the_limit(image_folder):
    delay = 0.02  # 19 lists of 4: about 0.4 s of waiting in the source
    loader = _loader(SlowSource(readers.files(image_folder, shuffle=True, chunk_size=4), delay))
    m = await _epoch(loader)
    assert m.starved_fraction > 0.5
    assert m.starved_seconds > m.blocked_seconds
    assert m.stages["read"].busy_seconds >= 19 * delay * 0.9  # the source's waits are the read's busy time
    assert m.stages["read"].blocked_seconds < m.stages["read"].busy_seconds
    assert m.limit == "read"
    assert "reading is the limit" in m.summary()


async def test_metrics_while_the_epoch_runs_and_after_it_is_left(image_folder):
    loader = _loader(readers.files(image_folder, shuffle=True))
    async with contextlib.aclosing(aiter(loader)) as batches:  # closed at the break, not by the GC
        async for batch in batches:
            if batch.index == 2:
                now = loader.stats().epoch_metrics
                assert not now.finished and now.batches == 3 and now.samples == 24
                assert "(so far)" in now.summary()
                break
    left = loader.stats().epoch_metrics
    assert left.finished and left.batches == 3
    again = loader.stats().epoch_metrics
    assert again.wall_seconds == left.wall_seconds  # frozen once the epoch ended
    await loader.aclose()


async def test_as_dict_is_flat_floats_and_summary_one_line(image_folder):
    loader = _loader(readers.files(image_folder, shuffle=True))
    m = await _epoch(loader)
    d = m.as_dict()
    assert all(isinstance(k, str) and type(v) is float for k, v in d.items())
    for key in ("epoch", "batches", "samples", "wall_seconds", "samples_per_second", "starved_seconds",
                "starved_fraction", "blocked_seconds", "blocked_fraction"):
        assert key in d
    for stage in ("read", "decode", "handoff"):
        for name in ("items", "busy_seconds", "blocked_seconds", "items_per_second"):
            assert f"{stage}/{name}" in d
    assert d["read/items"] == SAMPLES and d["batches"] == BATCHES
    assert d["decode/items_per_second"] == pytest.approx(SAMPLES / m.stages["decode"].busy_seconds)
    line = m.summary()
    assert "\n" not in line and line.startswith("epoch 0: 10 batches, ") and "samples/s" in line
    assert "consumer starved" in line and "readers blocked" in line
    await loader.aclose()


async def test_progress_bar_for_async_for(image_folder, capsys):
    loader = _loader(readers.files(image_folder), progress=True)
    await _epoch(loader)
    err = capsys.readouterr().err
    assert "epoch 0" in err and f"{BATCHES}/{BATCHES}" in err and "starved" in err
    quiet = _loader(readers.files(image_folder))
    await _epoch(quiet)
    assert capsys.readouterr().err == ""
    await loader.aclose()
    await quiet.aclose()


def test_progress_bar_for_sync(image_folder, capsys):
    loader = _loader(readers.files(image_folder))
    with loader.sync(progress=True) as it:
        assert sum(1 for _ in it) == BATCHES
        assert it.stats().epoch_metrics.batches == BATCHES
    err = capsys.readouterr().err
    assert "epoch 0" in err and f"{BATCHES}/{BATCHES}" in err


def test_progress_must_be_a_bool(image_folder):
    with pytest.raises(ConfigError):
        _loader(readers.files(image_folder), progress="yes")
