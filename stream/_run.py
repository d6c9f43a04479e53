"""One epoch's pipeline: reader → batcher → ops (several batches in flight) → reorder → output.

A ``_Run`` owns a runner task, and the runner owns every stage task through one TaskGroup. The
consumer never runs inside that TaskGroup: it only receives from the output channel, so leaving
its loop early cancels the runner from the outside, and the runner's ``finally`` closes the
executor (joining its threads) and the reader (closing its files).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ._batcher import LastBatch, batch_samples
from ._budget import ErrorBudget
from ._channel import ChannelStats, open_channel
from ._errors import LoaderError
from ._sample import Batch, SampleBatch, samples_nbytes

__all__ = ["RunConfig", "_Run"]


@dataclass(frozen=True, slots=True)
class RunConfig:
    """What one epoch's run needs from the loader.

    The loader decides an executor's lifetime through ``open_executor``/``close_executor``: the CPU
    one lives for a run, the GPU one (its decoders and streams are costly to make) for the loader.
    """

    reader: Any
    open_executor: Callable[[], Awaitable[Any]]
    close_executor: Callable[[Any], Awaitable[None]]
    batch_size: int
    last_batch: LastBatch
    seed: int
    prefetch: int
    max_bytes: int
    on_error: str
    max_errors: int | float


class _Run:
    def __init__(self, cfg: RunConfig, epoch: int, start: int, first_batch: int,
                 history: tuple[tuple[int, int], ...] = ()) -> None:
        self.cfg = cfg
        self.epoch = epoch
        self.start = start
        self.first_batch = first_batch
        self.history = history  # spans of this epoch read on other world sizes (Reader docstring)
        self.failure: BaseException | None = None
        self.budget = ErrorBudget(cfg.max_errors)
        self._chunks_tx, self._chunks_rx = open_channel(16, cfg.max_bytes, name="samples")
        self._batches_tx, self._batches_rx = open_channel(2, name="batches")
        self._order_tx, self._order_rx = open_channel(cfg.prefetch + 1, name="in-flight")
        self.out_tx, self.out_rx = open_channel(2, name="output")
        self._slots = asyncio.Semaphore(cfg.prefetch)
        self._runner: asyncio.Task[None] | None = None
        # Set once every batch of the epoch has gone to the executor: the loader may then start
        # the next epoch's run beside this one's last batches (``Loader(run_ahead=...)``).
        self.dispatched_all = asyncio.Event()

    def start_runner(self) -> None:
        """Start the stages (once; a run started ahead of its epoch is not started again)."""
        if self._runner is None:
            self._runner = asyncio.create_task(self._main(), name=f"loader:run:epoch{self.epoch}")

    def channels(self) -> list[ChannelStats]:
        return [c.statistics() for c in (self._chunks_rx, self._batches_rx, self._order_rx, self.out_rx)]

    async def aclose(self) -> None:
        """Cancel every stage and wait until threads, files and tasks are gone. Safe to call twice."""
        runner = self._runner
        if runner is None:
            return
        if not runner.done():
            runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([runner])
        await self.out_rx.aclose()

    async def _main(self) -> None:
        try:
            executor = await self.cfg.open_executor()
        except BaseException:
            await self.out_tx.aclose()
            raise
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(_noted(self._read(), "read"), name="loader:read")
                tg.create_task(_noted(self._batch(), "batch"), name="loader:batch")
                tg.create_task(_noted(self._dispatch(tg, executor), "dispatch"), name="loader:dispatch")
                tg.create_task(_noted(self._emit(), "emit"), name="loader:emit")
        except BaseExceptionGroup as group:
            leaves = _leaves(group)
            if any(isinstance(e, asyncio.CancelledError) for e in leaves) and len(leaves) == 1:
                raise leaves[0] from None
            self.failure = leaves[0] if len(leaves) == 1 else group
        finally:
            try:
                await self.cfg.close_executor(executor)
            finally:
                await self.out_tx.aclose()

    async def _read(self) -> None:
        cfg = self.cfg
        try:
            # ``history`` only when there is one: readers that cannot reshard need not take it.
            more = {"history": self.history} if self.history else {}
            stream = cfg.reader.read(self.epoch, start=self.start, seed=cfg.seed, **more)
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    await self._chunks_tx.send(chunk, samples_nbytes(chunk))
        finally:
            await self._chunks_tx.aclose()

    async def _batch(self) -> None:
        await batch_samples(
            self._chunks_rx,
            self._batches_tx,
            batch_size=self.cfg.batch_size,
            policy=self.cfg.last_batch,
            epoch=self.epoch,
            first_index=self.first_batch,
        )

    async def _dispatch(self, tg: asyncio.TaskGroup, executor: Any) -> None:
        # A slot is held from dispatch until the batch is handed to the output channel, so at most
        # ``prefetch`` batches are decoded-or-waiting at once: that bounds memory and is the
        # backpressure the batcher (and through it the reader) feels.
        try:
            async for batch in self._batches_rx:
                await self._slots.acquire()
                task = tg.create_task(executor.run(batch), name=f"loader:ops:batch{batch.index}")
                await self._order_tx.send((batch, task))
            self.dispatched_all.set()
        finally:
            await self._order_tx.aclose()

    async def _emit(self) -> None:
        async for batch, task in self._order_rx:
            processed = await task
            item = self._finish(batch, processed)
            await self.out_tx.send(item)
            self._slots.release()
            if isinstance(item, LoaderError):
                return  # the consumer raises it; everything after it is cancelled

    def _finish(self, batch: SampleBatch, processed: Any) -> Batch | LoaderError:
        failures = [err for _, err in processed.failures]
        if failures:
            if self.cfg.on_error == "raise":
                return failures[0]
            try:
                self.budget.record(len(batch.samples) - batch.padded, failures)
            except LoaderError as exc:
                return exc
        else:
            self.budget.record(len(batch.samples) - batch.padded, [])
        samples, rows = batch.samples, processed.kept
        if len(rows) == len(samples):  # none failed (kept rows ascend without repeats: all of them)
            kept, padded = samples, batch.padded
        else:
            kept = [samples[i] for i in rows]
            padded = sum(1 for i in rows if i >= len(samples) - batch.padded) if batch.padded else 0
        return Batch(
            data=processed.data,
            sample_keys=[s.key for s in kept],
            sources=[s.source for s in kept],
            epoch=batch.epoch,
            index=batch.index,
            padded=padded,
            dropped=len(failures),
            extra={"end_position": batch.end_position, "ready": processed.ready},
        )


async def _noted(coro: Awaitable[None], stage: str) -> None:
    try:
        await coro
    except Exception as exc:
        exc.add_note(f"in headrace stage {stage!r}")
        raise


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


