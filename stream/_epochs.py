"""The Loader's epochs: a run of the pipeline per ``async for``, and the executor the runs share.

Kept apart from ``_loader.py`` (the public face: arguments, resume state) because handing over
from one run to the next is a subject of its own: a loop left without closing its iterator, an
iteration replaced by a later one, the next epoch's run started before this one ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from ._batcher import batches_per_epoch
from ._errors import ClosedError, LoaderError
from ._markers import END
from ._policy import ErrorLog
from ._progress import EpochProgress
from ._run import RunConfig, _Run
from ._sample import Batch

if TYPE_CHECKING:
    from headrace.ops._executors import Executor

    from ._cursor import Cursor
    from ._loader import LoaderStats

__all__ = ["Epochs"]

_REPLACED = "this iteration was replaced by a later async for on the same loader"
_CLOSED = "the loader was closed (aclose()) during this epoch"


class Epochs:
    """The runs of a loader's epochs, the executor they share, and the counters of what they handed out.

    ``active`` is the run being iterated (or left early, until it is stopped); ``ahead`` the next
    epoch's run, started early (``run_ahead``). Each batch handed out moves ``cursor`` on, and
    ``cursor.batches_in`` batches as the runs do (a resumed epoch with no batch left is skipped).
    ``make_executor`` is called once, at the first epoch; ``epoch_length`` gives the progress bar's
    total. ``settings`` are the rest of ``RunConfig``.
    """

    def __init__(self, cursor: Cursor, stats: LoaderStats, make_executor: Callable[[], Executor],
                 epoch_length: Callable[[], int | None], **settings: Any) -> None:
        self.cfg = RunConfig(executor=self.open_executor, **settings)
        self._cursor = cursor
        cursor.batches_in = functools.partial(batches_per_epoch, batch_size=self.cfg.batch_size,
                                              policy=self.cfg.last_batch)
        self._stats = stats
        self._errors = ErrorLog()
        self._make_executor = make_executor
        self._epoch_length = epoch_length
        self._executor: Executor | None = None
        self.active: _Run | None = None
        self.ahead: _Run | None = None
        # A run whose loop was left without closing its iterator (a bare ``break``): the next
        # ``async for`` tears it down before it starts its own.
        self._abandoned: _Run | None = None
        # (epoch, history, batch_end) of the last run a loop left early once its batcher had seen
        # the reader's end: after its teardown, ``handed_out_all`` still knows that epoch's end.
        self._left_end: tuple[int, tuple[tuple[int, int], ...], int] | None = None
        # The reader's storage connections, held from an epoch's start to its end: the next epoch's
        # read, started ahead during this one, takes them over warm (``Reader.connections``).
        self._connections: contextlib.AsyncExitStack | None = None
        self.closed = False

    async def open_executor(self) -> Executor:
        """The loader's executor, made at the first epoch and kept until ``aclose()``."""
        if self.closed:
            raise ClosedError("loader is closed")
        if self._executor is None:  # on the GPU (decoders, streams, compiled kernels) this blocks the loop once
            self._executor = self._make_executor()
        return self._executor

    def let_go_of_a_left_run(self) -> None:
        """Before loading a state: a run left without closing its iterator (a bare ``break``) is
        taken as abandoned, as a new ``async for`` takes it (the next one tears it down first).
        Raises LoaderError while a loop is inside the run, waiting for its next batch."""
        run = self.active
        if run is None:
            return
        if run.consumer_inside:
            raise LoaderError("cannot load state while an epoch is being iterated")
        run.superseded = True
        self._abandoned, self.active = run, None

    def handed_out_all(self) -> bool:
        """The consumer has had the last batch of the epoch the cursor is in, as far as the run
        has seen: its reader ended and no batch of it is left. Known for readers without a length too,
        once the batcher has seen the end (the run reads ahead, so by the last batch it has)."""
        run, cursor = self.active, self._cursor
        if run is not None and not run.superseded and run.batch_end is not None:
            end = (run.epoch, run.history, run.batch_end)
        else:  # the loop was left (a break at the last batch) and its run torn down since
            end = self._left_end
        return (end is not None and end[0] == cursor.epoch and end[1] == tuple(cursor.history)
                and cursor.batches >= end[2])

    def forget_left_end(self) -> None:
        """A state was loaded: the cursor no longer stands where the run left early was."""
        self._left_end = None

    def iterate(self, *, run_ahead: bool, progress: bool) -> AsyncIterator[Batch]:
        """The next ``async for``'s iterator: the epoch the cursor points at."""
        if self.closed:
            raise ClosedError("loader is closed")
        previous = self.active
        if previous is not None:
            if previous.consumer_inside:
                raise LoaderError("this loader is already being iterated by another task; "
                                  "finish or close that loop first")
            # The last loop was left without closing its iterator (a bare ``break``, or an
            # exception in its body): this one takes over and tears that run down first.
            previous.superseded = True
            self._abandoned, self.active = previous, None
            if not previous.entered:
                # Its iterator was made (``aiter()``) but never asked for a batch: its epoch has
                # not begun, so this loop starts it rather than skipping to the next one.
                self._cursor.not_begun()
        where = self._cursor.begin_iteration()
        ahead = self.ahead
        # Not after ``load_state_dict`` let go of a left run: tearing that run down drains the
        # executor, which would cancel the batches the run ahead has in flight (it is thrown away).
        if (previous is None and self._abandoned is None and ahead is not None and ahead.can_follow()
                and (ahead.epoch, ahead.start, ahead.first_batch, ahead.history) == where):
            run, self.ahead = ahead, None  # started during the last epoch: take it over
        else:
            run = _Run(self.cfg, *where)  # (a stale run ahead, after load_state_dict, goes in _iterate)
        self.active = run
        return self._iterate(run, run_ahead, progress)

    async def _iterate(self, run: _Run, run_ahead: bool, progress: bool) -> AsyncIterator[Batch]:
        completed = False
        bar: EpochProgress | None = None
        run.consumer_inside = run.entered = True
        try:
            if run.superseded:  # a later ``async for`` took over before this one started
                raise ClosedError(_REPLACED)
            if run.started_elsewhere():
                # Run ahead on an event loop that has ended since (an ``asyncio.run`` per epoch):
                # that loop cancelled it, and its channels would end the epoch early. Start afresh.
                await run.aclose()
                run = self.active = _Run(self.cfg, run.epoch, run.start, run.first_batch, run.history)
                run.consumer_inside = run.entered = True
            await self._begin(run, hold_connections=run_ahead)
            if progress:
                bar = EpochProgress(run, self._epoch_length(), run.first_batch)
            run.start_runner()
            while True:
                try:
                    item = await run.out_rx.receive()
                except ClosedError:
                    if self.closed:
                        raise ClosedError(_CLOSED) from None
                    raise
                if item is END:
                    run.ended = time.perf_counter()
                    if run.failure is not None:
                        raise run.failure
                    if self.closed:  # ``aclose()`` from another task stopped the run: not the epoch's end
                        raise ClosedError(_CLOSED)
                    # Where the read ended after the last batch was handed out (its threads joined
                    # late on a loaded machine), no batch saw it: start the next epoch here.
                    self._start_ahead(run, run_ahead)
                    break
                batch = self._accept(run, item, run_ahead)
                if batch is None:
                    continue  # every sample of the batch failed: nothing to hand out
                if bar is not None:
                    bar.step()
                run.consumer_inside = False
                yield batch
                if run.superseded:
                    raise ClosedError(_REPLACED)
                run.consumer_inside = True
            self._cursor.epoch_completed(run.epoch)
            completed = True
        finally:
            await self._end(run, completed, bar)

    async def _begin(self, run: _Run, *, hold_connections: bool) -> None:
        """Before an epoch's first batch: tear down a loop left without closing and any stale run
        ahead, and start the epoch's clock (once, also when an iteration resumes it). With
        ``hold_connections`` (running ahead), hold the reader's connections over the epoch for the
        next epoch's read; without, they would be let go at the epoch's end, before that read, and
        a webdataset reader's downloads started for it (``ShardFiles.held_session``) fetched for nothing."""
        abandoned, self._abandoned = self._abandoned, None
        if abandoned is not None:
            await self._stop_early(abandoned)
        await self._close_ahead()
        if hold_connections and self._connections is None:
            stack = contextlib.AsyncExitStack()
            await stack.enter_async_context(self.cfg.reader.connections())
            self._connections = stack
        self._stats.epoch = run.epoch
        if run.started is None:
            run.started = time.perf_counter()

    def _accept(self, run: _Run, item: Any, run_ahead: bool) -> Batch | None:
        """Account for one item from the run: its failures, the stream position and the counters;
        raise the error it carries, if any. The batch to hand out, or None when all its samples failed."""
        item, outcomes = item
        for error, action in outcomes:
            self._errors.add(error, action)
        if isinstance(item, BaseException):
            raise item
        if run.read_all.is_set():
            self._start_ahead(run, run_ahead)
        stats = self._stats
        self._cursor.position, self._cursor.batches = item.extra["end_position"], item.index + 1
        stats.dropped += item.dropped
        stats.replaced += item.replaced
        stats.filtered += item.filtered
        if not item.sample_keys:
            return None
        stats.batches += 1
        stats.samples += item.size
        started = time.perf_counter()
        item.handoff()
        item.substitute()
        run.handoff_seconds += time.perf_counter() - started
        run.batches_out += 1
        run.samples_out += item.size
        return item

    def _start_ahead(self, run: _Run, run_ahead: bool) -> None:
        """Start reading the next epoch, once ``run`` has read all of its own."""
        if run_ahead and self.ahead is None and not self.closed:
            self.ahead = _Run(self.cfg, run.epoch + 1, 0, 0, dispatch_after=run.dispatched_all)
            self.ahead.start_runner()

    async def _end(self, run: _Run, completed: bool, bar: EpochProgress | None) -> None:
        """After an iteration, however it ended: record the epoch's metrics and stop the run."""
        run.consumer_inside = False
        if run.ended is None:  # left early
            run.ended = time.perf_counter()
        if not completed and not run.superseded and run.batch_end is not None:
            # Kept past the teardown: a state taken after a ``break`` at the epoch's last batch
            # says ``epoch_end`` whether or not the garbage collector has closed the iterator yet.
            self._left_end = (run.epoch, run.history, run.batch_end)
        if not run.superseded:  # else the later loop's run is the current epoch
            self._stats.channels = run.channels()
            self._stats.epoch_metrics = run.metrics()
        if bar is not None:
            bar.close(run.metrics())
        try:
            if completed:
                self.active = None
                await run.aclose()
            elif run.superseded:
                await run.aclose()  # the loop that replaced this one stops the rest
            else:
                # ``active`` stays this run until it is stopped: a new ``async for`` meanwhile
                # takes it as abandoned and waits for the same teardown before it starts.
                try:
                    await self._stop_early(run)
                finally:
                    if self.active is run:
                        self.active = None
        finally:
            # Kept while a run ahead reads the next epoch: that epoch holds them on (``_begin``),
            # whether or not the run's read has yet entered the storage's session itself. A
            # superseded loop's are held by the loop that replaced it.
            if not run.superseded and self.ahead is None:
                await self._release_connections()

    async def _release_connections(self) -> None:
        """Let go of the connections held over the epoch."""
        stack, self._connections = self._connections, None
        if stack is not None:
            await stack.aclose()

    async def _stop_early(self, run: _Run) -> None:
        """Tear down an epoch left early: its tasks, the work running ahead, and the batches it had
        in flight in the executor (which stays, for the next epoch)."""
        ahead, self.ahead = self.ahead, None
        try:
            await _close_each([run] if ahead is None else [run, ahead])  # both, even if cancelled
        finally:
            if self._executor is not None:
                await self._executor.drain()

    async def _close_ahead(self) -> None:
        run, self.ahead = self.ahead, None
        if run is not None:
            await run.aclose()

    async def aclose(self) -> None:
        """Stop every run and release the executor; ``iterate`` raises ``ClosedError`` after it."""
        self.closed = True
        runs = [r for r in (self.active, self._abandoned, self.ahead) if r is not None]
        self.active = self._abandoned = self.ahead = None
        executor, self._executor = self._executor, None
        try:
            await _close_each(runs)
        finally:
            try:
                await self._release_connections()
            finally:
                if executor is not None:
                    await executor.aclose()

    def stats(self) -> LoaderStats:
        """The counters, with the current epoch's channels and metrics, the errors and the lanes' timings."""
        if self.active is not None:
            self._stats.channels = self.active.channels()
            self._stats.epoch_metrics = self.active.metrics()
        # Derived here, not per batch: the error log is the record.
        self._stats.errors = dict(self._errors.counts)
        self._stats.recent_errors = list(self._errors.recent)
        timings = getattr(self._executor, "timings", None)
        if timings is not None:
            self._stats.lanes = timings()
        return self._stats


async def _close_each(runs: list[_Run]) -> None:
    """Close every run, also when cancelled meanwhile: each close finishes before it re-raises
    the cancellation, and the runs after it are closed before this re-raises it."""
    cancelled: asyncio.CancelledError | None = None
    for run in runs:
        try:
            await run.aclose()
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is not None:
        raise cancelled
