from __future__ import annotations

import pytest

from headrace import LastBatch, Sample
from headrace._batcher import batch_samples, batches_per_epoch
from headrace._channel import open_channel


def _samples(n: int) -> list[Sample]:
    return [Sample(f"k{i}", {"cls": b"0"}, "mem", i, position=i) for i in range(n)]


async def _run(n: int, chunk: int, policy: LastBatch, batch_size: int = 4):
    chunks_tx, chunks_rx = open_channel(100)
    batches_tx, batches_rx = open_channel(100)
    items = _samples(n)
    for lo in range(0, n, chunk):
        await chunks_tx.send(items[lo : lo + chunk])
    await chunks_tx.aclose()
    await batch_samples(chunks_rx, batches_tx, batch_size=batch_size, policy=policy, epoch=3, first_index=5)
    return [b async for b in batches_rx]


@pytest.mark.parametrize("chunk", [1, 3, 4, 7])
async def test_partial_keeps_the_short_last_batch(chunk):
    batches = await _run(10, chunk, LastBatch.PARTIAL)
    assert [[s.index for s in b.samples] for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [b.index for b in batches] == [5, 6, 7]
    assert {b.epoch for b in batches} == {3}
    assert batches[-1].end_position == 10


async def test_drop_drops_it():
    batches = await _run(10, 3, LastBatch.DROP)
    assert [len(b) for b in batches] == [4, 4]


async def test_fill_repeats_the_last_batch_samples_and_counts_the_padding():
    batches = await _run(10, 3, LastBatch.FILL)
    last = batches[-1]
    assert [s.index for s in last.samples] == [8, 9, 8, 9]
    assert last.padded == 2
    assert last.end_position == 10


async def test_exact_multiple_has_no_short_batch():
    for policy in LastBatch:
        assert [len(b) for b in await _run(8, 3, policy)] == [4, 4]


@pytest.mark.parametrize(
    ("n", "policy", "expected"),
    [(10, LastBatch.PARTIAL, 3), (10, LastBatch.FILL, 3), (10, LastBatch.DROP, 2), (8, LastBatch.PARTIAL, 2), (0, LastBatch.PARTIAL, 0)],
)
def test_batches_per_epoch(n, policy, expected):
    assert batches_per_epoch(n, 4, policy) == expected


def test_policy_parse_rejects_unknown():
    from headrace import ConfigError

    assert LastBatch.parse("fill") is LastBatch.FILL
    with pytest.raises(ConfigError):
        LastBatch.parse("wrap")


async def test_the_batches_channel_counts_the_batches_bytes_not_their_samples():
    # stats().channels["batches"].bytes is read as memory held, like the samples channel's.
    chunks_tx, chunks_rx = open_channel(8)
    batches_tx, batches_rx = open_channel(8)
    samples = [Sample(f"k{i}", {"jpg": b"x" * 100, "cls": b"1"}, "src", i) for i in range(5)]
    await chunks_tx.send(samples)
    await chunks_tx.aclose()
    count = await batch_samples(chunks_rx, batches_tx, batch_size=2, policy=LastBatch.FILL, epoch=0, first_index=0)
    assert count == 3
    stats = batches_rx.statistics()
    assert stats.items == 3 and stats.bytes == 5 * 101  # the filled last batch's repeat adds nothing
