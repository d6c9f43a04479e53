"""The Loader keeps a remote reader's connections over each epoch, so the next epoch's read, run ahead
while this one's last batches decode, takes them over warm instead of connecting anew (a GET on a new
connection cost the client about twice the CPU a byte on the 2-core VM,
examples/results/remote-cpu-vm-2026-12-02.txt); after ``aclose()`` none is left open. Connections are
counted at the server (tests/readers/object_server.py). No test asserts a time."""

from __future__ import annotations

import asyncio
import contextlib

from headrace import Loader, ops, readers

from test_storage_latency import RETRY, _big_shard, slow, slow_server  # noqa: F401 - fixtures


def _loader(slow, run_ahead: bool, wrap=lambda reader: reader) -> Loader:
    reader = readers.webdataset(slow.source("s3", "big/big-0.tar"), buffer_bytes=4 << 20, chunk_size=4,
                                storage_options={"retry": RETRY})
    return Loader(wrap(reader), batch_size=4, pipeline=ops.Pipeline(image=None, label=None, fields=["bin"]),
                  device="cpu", num_threads=1, run_ahead=run_ahead, distributed=False)


async def _epochs(loader: Loader, slow, n: int) -> list[int]:
    """Connections the server accepted during each of ``n`` epochs; every sample checked."""
    want = [key for key, _ in _big_shard(slow)]
    counts = []
    for _ in range(n):
        before = slow.stats()["connections"]
        keys = [k async for batch in loader for k in batch.sample_keys]
        assert keys == want
        counts.append(slow.stats()["connections"] - before)
    return counts


async def test_epochs_run_ahead_take_over_the_connections_of_the_epoch_before(slow, leaks):
    loader = _loader(slow, run_ahead=True)
    try:
        counts = await _epochs(loader, slow, 3)
    finally:
        await loader.aclose()
    await leaks.check()  # before idle(): its to_thread may start a second default-executor thread
    await slow.idle()
    assert counts[0] > 0
    # The later epochs read on connections the first opened (a few more where a GET's connection
    # was busy), not a fresh pool each.
    assert counts[1] < counts[0] and counts[2] < counts[0], counts  # before: [10, 15, ...]; now [10, 1, 1]
    assert slow.stats()["open"] == 0  # aclose() let go of the pool


async def test_a_break_then_aclose_leaves_no_connection_open(slow, leaks):
    loader = _loader(slow, run_ahead=True)
    try:
        async for _ in loader:
            break  # mid-epoch, the iterator left open
    finally:
        await loader.aclose()
    await leaks.check()
    await slow.idle()
    assert slow.stats()["open"] == 0


class _SlowToEnd(readers.Reader):
    """A reader whose stream ends a while after its last samples, as a loaded machine's did (its
    threads joined and its files closed after the last chunk): the epoch's last batch is handed out
    before the loader learns that everything was read, so the run ahead can only start at the end."""

    def __init__(self, inner: readers.Reader) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def shard(self, rank: int, world: int, *, equal=None) -> _SlowToEnd:
        return _SlowToEnd(self.inner.shard(rank, world, equal=equal))

    def connections(self):
        return self.inner.connections()

    async def read(self, epoch: int, *, start: int = 0, seed: int = 0):
        async with contextlib.aclosing(self.inner.read(epoch, start=start, seed=seed)) as chunks:
            async for chunk in chunks:
                yield chunk
        await asyncio.sleep(0.3)


async def test_an_epoch_whose_read_ends_after_its_last_batch_still_hands_its_connections_on(slow, leaks):
    # CI once counted [11, 1, 13]: the third epoch's read had not been started ahead, and the
    # connections were let go at the second's end.
    loader = _loader(slow, run_ahead=True, wrap=_SlowToEnd)
    try:
        counts = await _epochs(loader, slow, 3)
    finally:
        await loader.aclose()
    await leaks.check()
    await slow.idle()
    assert counts[0] > 0
    assert counts[1] < counts[0] and counts[2] < counts[0], counts
    assert slow.stats()["open"] == 0
