"""One epoch's pipeline: reader → batcher → ops (several batches in flight) → reorder → output.

A ``_Run`` owns a runner task, and the runner owns every stage task through one TaskGroup. The
consumer never runs inside that TaskGroup: it only receives from the output channel, so leaving
its loop early cancels the runner from the outside; the stages' ``finally`` blocks close the
reader (its files), and each batch's ops task, cancelled, stops the thread work it queued. The
executor (threads, decoders, GPU lanes) belongs to the loader, not to the run: the next epoch
uses it again.

The run also keeps the epoch's metrics (``EpochMetrics``): per stage, the samples it passed on and
the seconds it was at work, read with one clock pair per chunk or batch, never per sample.

Whatever escapes a stage reaches the consumer as one ``LoaderError``: a sample's error as it is,
anything else (a bug) as a ``LoaderError`` whose ``__cause__`` is the original, never an
``ExceptionGroup``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._batcher import LastBatch, batch_samples
from ._budget import ErrorBudget
from ._channel import ChannelStats, open_channel
from ._errors import LoaderError
from ._policy import decide
from ._sample import Batch, SampleBatch, samples_nbytes
from ._threads import wait_all

if TYPE_CHECKING:
    from headrace.ops._executors import Executor

__all__ = ["EpochMetrics", "RunConfig", "StageStats", "_Run"]

# The consumer waiting less than this share of the epoch means the data was ready when it asked.
_STARVED_LIMIT = 0.10
_VERDICT = {"consumer": "the consumer is the limit", "read": "reading is the limit",
            "decode": "decoding and transforms are the limit"}


@dataclass(frozen=True, slots=True)
class StageStats:
    """One stage of one epoch.

    ``items``: samples the stage passed on. ``busy_seconds``: seconds it was at work (for ``decode``,
    seconds with at least one batch in the executor, however many were). ``blocked_seconds``:
    seconds it waited for room downstream. ``items_per_second`` is the stage's rate while busy.
    """

    items: int
    busy_seconds: float
    blocked_seconds: float = 0.0

    @property
    def items_per_second(self) -> float:
        return self.items / self.busy_seconds if self.busy_seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class EpochMetrics:
    """Where one epoch's time went, as the consumer and the stages saw it.

    ``wall_seconds`` runs from the epoch's first ``__anext__`` to its end (or to now, while
    ``finished`` is false); ``batches`` and ``samples`` were handed to the consumer in that time.
    ``starved_seconds``: the consumer waited inside ``__anext__`` for a batch that was not ready
    (the output channel's receive wait). ``blocked_seconds``: finished batches waited for the
    consumer to take them (the output channel's send wait); the stages before them then wait in
    turn, back to the reader (``stages["read"].blocked_seconds``, the samples channel's send wait,
    once every channel between is full). ``stages`` holds ``"read"`` (the reader yielding samples), ``"decode"`` (decode
    and transforms in the executor; its ``blocked_seconds``: finished batches waiting for room in
    the output channel) and ``"handoff"`` (the loader's work between a finished batch and the
    consumer: the ``on_error`` policy, the CUDA stream hand-off).

    With ``run_ahead``, an epoch's reading starts once the previous epoch's reading is done, and its
    decoding once the previous epoch's last batch has gone to decode, so their seconds can include
    time before ``wall_seconds`` began.
    """

    epoch: int
    finished: bool
    batches: int
    samples: int
    wall_seconds: float
    starved_seconds: float
    blocked_seconds: float
    stages: dict[str, StageStats]

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def starved_fraction(self) -> float:
        return self.starved_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def blocked_fraction(self) -> float:
        return self.blocked_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def limit(self) -> str:
        """What set the pace: ``"consumer"`` (it waited less than 10% of the time: batches were
        ready when asked for), else the busier of ``"read"`` and ``"decode"``; ``""`` before the
        first batch. A rule of thumb for a first look, not a profile."""
        if not self.batches:
            return ""
        if self.starved_fraction < _STARVED_LIMIT:
            return "consumer"
        read, decode = self.stages["read"], self.stages["decode"]
        return "read" if read.busy_seconds > decode.busy_seconds else "decode"

    def as_dict(self) -> dict[str, float]:
        """Flat ``name -> float`` for TensorBoard or W&B; stage numbers as ``"read/items_per_second"``."""
        out = {
            "epoch": float(self.epoch),
            "batches": float(self.batches),
            "samples": float(self.samples),
            "wall_seconds": self.wall_seconds,
            "samples_per_second": self.samples_per_second,
            "starved_seconds": self.starved_seconds,
            "starved_fraction": self.starved_fraction,
            "blocked_seconds": self.blocked_seconds,
            "blocked_fraction": self.blocked_fraction,
        }
        for name, stage in self.stages.items():
            out[f"{name}/items"] = float(stage.items)
            out[f"{name}/busy_seconds"] = stage.busy_seconds
            out[f"{name}/blocked_seconds"] = stage.blocked_seconds
            out[f"{name}/items_per_second"] = stage.items_per_second
        return out

    def summary(self) -> str:
        """One line, e.g. ``epoch 3: 1,204 batches, 2,310 samples/s; consumer starved 4% of the
        time, pipeline blocked 83%, readers blocked 61%; the consumer is the limit``."""
        head = f"epoch {self.epoch}{'' if self.finished else ' (so far)'}: {self.batches:,} batches"
        if not self.batches:
            return head
        # With run_ahead a wait can begin before the epoch's clock: a share is shown as at most 100%.
        readers = self.stages["read"].blocked_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0
        return (f"{head}, {self.samples_per_second:,.0f} samples/s; consumer starved "
                f"{self.starved_fraction:.0%} of the time, pipeline blocked {min(self.blocked_fraction, 1.0):.0%}, "
                f"readers blocked {min(readers, 1.0):.0%}; {_VERDICT[self.limit]}")


@dataclass(frozen=True, slots=True)
class RunConfig:
    """What one epoch's run needs from the loader. ``executor`` gives the loader's executor (made
    on first use, kept until the loader closes)."""

    reader: Any
    executor: Callable[[], Awaitable[Executor]]
    batch_size: int
    last_batch: LastBatch
    seed: int
    prefetch: int
    max_bytes: int
    on_error: Any  # "raise", "skip", "replace" or a callable (``_policy``)
    max_errors: int | float


class _Run:
    def __init__(self, cfg: RunConfig, epoch: int, start: int, first_batch: int,
                 history: tuple[tuple[int, int], ...] = (), *, dispatch_after: asyncio.Event | None = None) -> None:
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
        # Set once the reader has yielded the epoch's last sample: the loader may then start the
        # next epoch's run (``Loader(run_ahead=...)``), whose reading fills its own bounded channels
        # while this one's last batches decode. Over object storage that hides the next epoch's
        # first GETs, ~0.2 s an epoch at 50 ms a GET.
        self.read_all = asyncio.Event()
        # Set once every batch of the epoch has gone to the executor; a run started ahead sends
        # its first batch only after the previous run's (``dispatch_after``), so the lanes take
        # the epochs' batches in order.
        self.dispatched_all = asyncio.Event()
        # The index after the epoch's last batch, once the batcher has seen the reader's end: a
        # state taken when the consumer has had that many batches is at the epoch's end, also for
        # readers without a length.
        self.batch_end: int | None = None
        self._dispatch_after = dispatch_after
        # Set by the loader: a consumer is inside this run's iterator (between two batches), or a
        # later ``async for`` replaced the iterator that a loop left without closing it.
        self.consumer_inside = False
        self.superseded = False
        self.entered = False  # an iterator asked this run for a batch: its epoch has begun
        # Metrics: the loader sets ``started`` and ``ended`` (perf_counter) and counts what it
        # handed out; the stages count the rest.
        self.started: float | None = None
        self.ended: float | None = None
        self.batches_out = self.samples_out = 0
        self.handoff_seconds = 0.0
        self._read_items, self._read_seconds = 0, 0.0
        self._decode_items, self._decode_seconds = 0, 0.0
        self._decoding, self._decoding_since = 0, 0.0  # batches in the executor, and since when

    def start_runner(self) -> None:
        """Start the stages (once; a run started ahead of its epoch is not started again)."""
        if self._runner is None:
            self._runner = asyncio.create_task(self._main(), name=f"loader:run:epoch{self.epoch}")

    def channels(self) -> list[ChannelStats]:
        return [c.statistics() for c in (self._chunks_rx, self._batches_rx, self._order_rx, self.out_rx)]

    def metrics(self) -> EpochMetrics:
        """The epoch's metrics so far (final once ``ended`` is set)."""
        now = time.perf_counter()
        end = self.ended if self.ended is not None else now
        decode_seconds = self._decode_seconds + (now - self._decoding_since if self._decoding else 0.0)
        samples, output = self._chunks_rx.statistics(), self.out_rx.statistics()
        return EpochMetrics(
            epoch=self.epoch,
            finished=self.ended is not None,
            batches=self.batches_out,
            samples=self.samples_out,
            wall_seconds=end - self.started if self.started is not None else 0.0,
            starved_seconds=output.receive_wait_seconds,
            blocked_seconds=output.send_wait_seconds,
            stages={
                "read": StageStats(self._read_items, self._read_seconds, samples.send_wait_seconds),
                "decode": StageStats(self._decode_items, decode_seconds, output.send_wait_seconds),
                "handoff": StageStats(self.samples_out, self.handoff_seconds),
            },
        )

    def can_follow(self) -> bool:
        """Started ahead, it can still be taken over: the run it follows has sent every batch to
        decode. One stopped early never will, and this run would wait for it forever."""
        return self._dispatch_after is None or self._dispatch_after.is_set()

    def started_elsewhere(self) -> bool:
        """Its stages were started on another event loop than the running one: one that has ended
        since (an ``asyncio.run`` per epoch), which cancelled them as it ended or never runs them again."""
        return self._runner is not None and self._runner.get_loop() is not asyncio.get_running_loop()

    async def aclose(self) -> None:
        """Cancel every stage and wait until threads, files and tasks are gone. Safe to call twice."""
        runner = self._runner
        if runner is None:
            return
        if self.started_elsewhere():
            # Nothing of it can be awaited here: its futures belong to that loop. Cancelled, if
            # that loop still runs; else it is gone with it (its reader's files closed by the
            # garbage collector), and the executor's thread work is waited for by ``drain``.
            loop = runner.get_loop()
            if not runner.done() and not loop.is_closed():
                loop.call_soon_threadsafe(runner.cancel)
            return
        if not runner.done():
            runner.cancel()
        try:
            await wait_all([runner])  # the runner's cleanup finishes even if we are cancelled
        finally:
            await self.out_rx.aclose()
            if runner.done() and not runner.cancelled():
                runner.exception()  # retrieved: its failure went to the consumer as ``failure``

    async def _main(self) -> None:
        try:
            executor = await self.cfg.executor()
            async with asyncio.TaskGroup() as tg:
                tg.create_task(_noted(self._read, "read"), name="loader:read")
                tg.create_task(_noted(self._batch, "batch"), name="loader:batch")
                tg.create_task(_noted(functools.partial(self._dispatch, tg, executor), "dispatch"), name="loader:dispatch")
                tg.create_task(_noted(self._emit, "emit"), name="loader:emit")
        except BaseExceptionGroup as group:
            leaves = _leaves(group)
            if all(isinstance(e, asyncio.CancelledError) for e in leaves):
                raise leaves[0] from None
            self.failure = _one_failure([e for e in leaves if not isinstance(e, asyncio.CancelledError)])
        except Exception as exc:  # making the executor failed
            self.failure = _one_failure([exc])
        finally:
            await self.out_tx.aclose()

    async def _read(self) -> None:
        cfg = self.cfg
        try:
            # ``history`` only when there is one: readers that cannot reshard need not take it.
            more = {"history": self.history} if self.history else {}
            stream = cfg.reader.read(self.epoch, start=self.start, seed=cfg.seed, **more)
            async with contextlib.aclosing(stream):
                chunks = aiter(stream)
                while True:
                    started = time.perf_counter()
                    try:
                        chunk = await anext(chunks)
                    except StopAsyncIteration:
                        break
                    finally:
                        self._read_seconds += time.perf_counter() - started
                    self._read_items += len(chunk)
                    await self._chunks_tx.send(chunk, samples_nbytes(chunk))
            self.read_all.set()
        finally:
            await self._chunks_tx.aclose()

    async def _batch(self) -> None:
        self.batch_end = await batch_samples(
            self._chunks_rx,
            self._batches_tx,
            batch_size=self.cfg.batch_size,
            policy=self.cfg.last_batch,
            epoch=self.epoch,
            first_index=self.first_batch,
        )

    async def _dispatch(self, tg: asyncio.TaskGroup, executor: Executor) -> None:
        # A slot is held from dispatch until the batch is handed to the output channel, so at most
        # ``prefetch`` batches are decoded-or-waiting at once: that bounds memory and is the
        # backpressure the batcher (and through it the reader) feels.
        try:
            if self._dispatch_after is not None:  # run ahead: the batcher fills its channel meanwhile
                await self._dispatch_after.wait()
            async for batch in self._batches_rx:
                await self._slots.acquire()
                task = tg.create_task(self._decode(executor, batch), name=f"loader:ops:batch{batch.index}")
                await self._order_tx.send((batch, task))
            self.dispatched_all.set()
        finally:
            await self._order_tx.aclose()

    async def _decode(self, executor: Executor, batch: SampleBatch) -> Any:
        # ``decode`` is busy while at least one batch is in the executor: overlapping batches'
        # seconds are not summed, so items / busy seconds is the stage's rate.
        if not self._decoding:
            self._decoding_since = time.perf_counter()
        self._decoding += 1
        try:
            processed = await executor.run(batch)
        finally:
            self._decoding -= 1
            if not self._decoding:
                self._decode_seconds += time.perf_counter() - self._decoding_since
        self._decode_items += len(batch.samples)  # padded rows included: they were decoded too
        return processed

    async def _emit(self) -> None:
        async for batch, task in self._order_rx:
            outcomes: list[tuple[LoaderError, str]] = []
            try:
                processed = await task
                started = time.perf_counter()
                item = self._finish(batch, processed, outcomes)
                self.handoff_seconds += time.perf_counter() - started
            except LoaderError as exc:  # the on_error callable failed, or the budget is spent
                item = exc
            except Exception as exc:
                item = _unexpected(exc, f"processing batch {batch.index}", batch)
            # The failures go along: the loader counts and logs them when the consumer gets here.
            await self.out_tx.send((item, outcomes))
            self._slots.release()
            if isinstance(item, LoaderError):
                return  # the consumer raises it; everything after it is cancelled

    def _finish(self, batch: SampleBatch, processed: Any, outcomes: list[tuple[LoaderError, str]]) -> Batch | LoaderError:
        """The batch as the consumer gets it, after the ``on_error`` policy met its failures.

        Skipped rows leave the batch; a replaced row holds another sample of the same batch (chosen
        by the seed, epoch and the failed sample's index, so a resumed run chooses the same), named
        by that sample's key. A row an ``ops.Filter`` dropped (``processed.filtered``) leaves the
        batch too, counted in ``filtered``, never an error. A batch left with no row is still sent
        (empty), for its counts; the loader does not hand it out. Each failure and what was done
        with it goes to ``outcomes``.
        """
        samples, kept = batch.samples, processed.kept
        real = len(samples) - batch.padded
        replaced: dict[int, int] = {}  # failed row -> position in ``kept`` of its substitute
        # A row of ``last_batch="fill"``'s padding repeats row (row - real) % real, and fails with
        # it: the sample's failure is decided, counted and spent from the budget once.
        decided: dict[int, str] = {}  # failed sample's row in the data -> "skip" or "replace"
        for row, err in processed.failures:
            original = row if row < real else (row - real) % real
            action = decided.get(original)
            if action is None:
                action = decide(self.cfg.on_error, err)
                if action == "raise":
                    outcomes.append((err, "raise"))
                    return err
                action = decided[original] = "replace" if action == "replace" and kept else "skip"
                outcomes.append((err, action))
            if action == "replace":
                replaced[row] = hash((self.cfg.seed, batch.epoch, samples[row].index)) % len(kept)
        self.budget.record(real, [err for err, _ in outcomes])  # ErrorBudgetExceeded when spent
        if len(kept) == len(samples):  # none failed (kept rows ascend without repeats: all of them)
            slots, rows, take = kept, kept, None
        else:
            position = {row: p for p, row in enumerate(kept)}
            slots = [row for row in range(len(samples)) if row in position or row in replaced]
            take = [position[row] if row in position else replaced[row] for row in slots]
            rows = [kept[p] for p in take]  # the sample each output row holds
            if not replaced:
                take = None  # the executor's output already is the kept rows, in order
        kept_samples = [samples[r] for r in rows]
        return Batch(
            data=processed.data,
            sample_keys=[s.key for s in kept_samples],
            sources=[s.source for s in kept_samples],
            epoch=batch.epoch,
            index=batch.index,
            padded=sum(1 for slot in slots if slot >= real) if batch.padded else 0,
            dropped=sum(1 for action in decided.values() if action == "skip"),
            replaced=sum(1 for action in decided.values() if action == "replace"),
            filtered=sum(1 for row in processed.filtered if row < real),  # padded rows are not the data's
            extra={"end_position": batch.end_position, "ready": processed.ready, "take": take},
        )


async def _noted(stage_fn: Callable[[], Awaitable[None]], stage: str) -> None:
    """Run a stage, noting its name on what it raises. It takes the stage's function, not its
    coroutine: a task cancelled before its first step (Ctrl-C just as an epoch starts) never runs
    this body, and a coroutine made beforehand would be dropped unawaited, with a RuntimeWarning."""
    try:
        await stage_fn()
    except Exception as exc:
        exc.add_note(f"in headrace stage {stage!r}")
        raise


def _one_failure(errors: list[BaseException]) -> LoaderError:
    """One LoaderError for what the stages raised: the first LoaderError, or a LoaderError wrapping
    the first foreign exception (a bug: its traceback is the cause); the others become notes."""
    first = next((e for e in errors if isinstance(e, LoaderError)), None)
    if first is None:
        first = _unexpected(errors[0], "in the loader")
    for other in errors:
        if other is not first and other is not first.__cause__:
            first.add_note(f"also failed: {type(other).__name__}: {other}")
    return first


def _unexpected(exc: BaseException, where: str, batch: SampleBatch | None = None) -> LoaderError:
    """An exception no stage should raise, as a LoaderError naming the batch's first sample."""
    sample = batch.samples[0] if batch is not None and batch.samples else None
    notes = "; ".join(getattr(exc, "__notes__", []))
    err = LoaderError(
        f"unexpected {type(exc).__name__} {where}: {exc}" + (f" ({notes})" if notes else ""),
        key=sample.key if sample else None, source=sample.source if sample else None, stage="internal",
    )
    err.__cause__ = exc
    return err


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


