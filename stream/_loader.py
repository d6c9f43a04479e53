"""The Loader: the public face of the pipeline."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ._batcher import LastBatch, batches_per_epoch
from ._channel import ChannelStats
from ._errors import ClosedError, LoaderError
from ._loader_args import resolve_loader_args
from ._loader_state import STATE_VERSION, resume_point
from ._markers import END
from ._policy import ErrorLog, ErrorRecord
from ._progress import EpochProgress
from ._run import EpochMetrics, RunConfig, _Run
from ._sample import Batch

if TYPE_CHECKING:
    from headrace.ops._executors import Executor

__all__ = ["Loader", "LoaderStats"]

_REPLACED = "this iteration was replaced by a later async for on the same loader"


@dataclass
class LoaderStats:
    """Counters since the loader was made, plus the channels and metrics of the current or last epoch.

    ``dropped`` counts samples skipped and ``replaced`` samples whose row another sample took
    (``on_error``); ``errors`` counts every failed sample by error class (``{"DecodeError": 3}``),
    and ``recent_errors`` holds the last 32 failures, newest last.

    ``epoch_metrics`` says where the current (or last) epoch's time went: how long the consumer
    waited for batches (starved), how long finished batches waited for the consumer (blocked), and
    each stage's samples, busy and blocked seconds (``EpochMetrics``); ``epoch_metrics.summary()`` puts it in one line and
    ``epoch_metrics.as_dict()`` gives flat floats for TensorBoard or W&B. None before the first epoch.
    """

    epoch: int = 0
    batches: int = 0
    samples: int = 0
    dropped: int = 0
    replaced: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    recent_errors: list[ErrorRecord] = field(default_factory=list)
    channels: list[ChannelStats] = field(default_factory=list)
    lanes: dict[str, float] = field(default_factory=dict)  # GPU path: seconds per lane phase
    epoch_metrics: EpochMetrics | None = None


class Loader:
    """Batches of tensors from a reader, one epoch per ``async for``.

    ::

        loader = Loader(readers.files("train/", shuffle=True), batch_size=256, pipeline=ops.training(224))
        for epoch in range(90):
            async for batch in loader:          # or: for batch in loader.sync():
                train_step(batch["image"], batch["label"])

    Arguments:
        reader: a ``headrace.readers.Reader`` over the whole data set; in a job of several
            processes the loader shards it (below). A reader already sharded by the caller
            (``reader.shard(rank, world)``) is used as it is.
        batch_size: samples per batch.
        pipeline: a ``headrace.ops.Pipeline`` (default: decode only, images of their own sizes).
        device: ``"auto"`` (the GPU when CUDA, CuPy and nvImageCodec are there, else the CPU),
            ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. On the GPU, batches are torch CUDA tensors,
            ready on the consumer's current stream (it waits on the lane's event; the host does not).
            Under torchrun, ``"auto"`` and ``"cuda"`` mean ``"cuda:<LOCAL_RANK>"``.
        lanes: GPU lanes (thread + CUDA stream + decoder), fed by one thread that parses headers
            and plans crops. Two is the default: on the H100 it was as fast as one or faster, and
            held up better when other Python threads competed for the GIL (ops/README.md).
        hw_load: share of each batch offered to the hardware JPEG decoder first (GPU path; 0.65,
            DALI's default, measured as good as or better than the others), or ``"adaptive"``
            (the share moves batch by batch).
        gpu_tuning: a ``headrace.ops.GpuTuning``: how the GPU path drives nvImageCodec (expert
            knobs; the defaults were the fastest measured).
        last_batch: ``"partial"`` (default), ``"fill"`` or ``"drop"`` for the short last batch.
        seed: keys the reader's shuffle (unless it has its own seed) and every random op.
        num_threads: CPU threads for decode and transforms: the CPU path's workers, or each GPU
            lane's nvImageCodec host threads (default: all cores, divided among the processes
            torchrun started on the node, from ``LOCAL_WORLD_SIZE``).
        prefetch: batches in flight between the batcher and the consumer (decoding or done);
            default 3 on the CPU, ``lanes + 2`` on the GPU.
        run_ahead: once an epoch's last batch has gone to decode, start reading and decoding the
            next epoch (up to ``prefetch`` batches), so the lanes do not drain and refill at every
            epoch boundary, as DALI's pipeline runs on. The next ``async for`` takes that work over;
            a ``load_state_dict``, a ``break`` or ``aclose()`` throws it away (``state_dict()`` never
            counts it). The ``sync()`` facade does not run ahead (each of its epochs has its own
            event loop, which the work would not outlive). Default: on for the GPU path (its executor is shared
            by the epochs), off on the CPU (each epoch's run has its own threads).
        max_bytes: bound on encoded bytes buffered between the reader and the batcher.
        on_error: what a sample that cannot be read, decoded or transformed does to the run.
            ``"raise"`` (default): the first one raises, typed and naming the sample, after the good
            batches before it. ``"skip"``: it leaves its batch (``stats().dropped``). ``"replace"``:
            another sample of the same batch, chosen by the seed (the same on resume), takes its row,
            so batches stay full (``stats().replaced``; a batch with no good sample is left out).
            A callable gets the ``LoaderError`` and returns one of those three words. Every failure
            is counted by class in ``stats().errors`` and recorded in ``stats().recent_errors``;
            skips and replacements are logged on the ``headrace`` logger, at most a line a second.
        max_errors: the budget of skipped and replaced samples per epoch, past which the loader
            raises ``ErrorBudgetExceeded``: an int count, or a float fraction of the samples seen
            (checked once 100 were seen). Default: 1% (``0.01``).
        distributed: take this process's rank and world size from ``torch.distributed`` (when its
            default process group is initialised) or from torchrun's ``RANK``/``WORLD_SIZE``
            (``headrace._distributed``); False: this process reads the whole data set.
        rank, world: this process's data-parallel rank and world size, given instead (both or
            neither), e.g. when data-parallel groups are not the default process group.
        equal: when the loader shards the reader (world > 1), how ranks get the same number of
            samples (DALI's ``pad_last_batch``): ``"pad"`` (default) completes the short ranks'
            parts with repeated samples (files, LMDB: the head of the epoch's order, fewer than
            ``world``), ``"drop"`` cuts the long ones, None leaves the parts unequal (ranks may then
            yield different batch counts, and a collective can wait forever).
        progress: show a tqdm progress bar per epoch (batches, with the total when the reader knows
            its length, samples/s and the share of time the consumer starved), on stderr, on rank 0
            only. It serves ``async for`` and ``sync()`` alike (``sync(progress=...)`` overrides it).

    Lifetime: the executor (worker threads; on the GPU the lanes' decoders, streams and compiled
    kernels) is made at the first epoch and serves every epoch until ``aclose()`` (or the end of
    ``async with loader``), which releases it; the loader cannot be used after that
    (``ClosedError``). Leaving an epoch early in any way (``break``, an exception in the loop's
    body, cancellation, a timeout) stops that epoch's tasks and waits for the batches it had in
    flight, no more; the next ``async for`` then starts the next epoch at once, even right after a
    bare ``break`` whose iterator the garbage collector has not closed yet. Only one loop may
    iterate at a time: a second ``async for`` while another task is waiting inside the first
    raises ``LoaderError``.

    Backpressure: the consumer sets the pace; the pipeline runs at most ``prefetch`` batches ahead
    and the reader at most ``max_bytes`` ahead of the batcher.

    Resume: ``state_dict()`` at any point between batches, ``load_state_dict()`` on a new loader
    with the same arguments, and the next ``async for`` yields exactly the batches the
    uninterrupted run would have yielded next.

    Many processes (torchrun): every rank computes the same seeded global order of an epoch with
    no communication and takes a disjoint part of it; the parts cover the epoch, and with
    ``equal="pad"`` or ``"drop"`` every rank yields the same number of batches, whatever
    ``last_batch``. All ranks hold the same ``state_dict()`` after the same step (so saving rank
    0's is enough). Loaded on the same world size, the run continues exactly; loaded on another
    (say 4 ranks to 2, files, LMDB, or WebDataset with per-shard counts), the new ranks split what
    the epoch has not read yet: no sample of the epoch is read twice and none is left out (but the
    repeats or the cut that ``equal`` makes at the epoch's end). That epoch then yields fewer
    batches than ``len()`` says, the same number on every rank; the next epochs are whole.
    """

    def __init__(
        self,
        reader: Any,
        *,
        batch_size: int,
        pipeline: Any = None,
        device: Literal["auto", "cpu", "cuda"] | str = "auto",
        last_batch: LastBatch | str = LastBatch.PARTIAL,
        seed: int = 0,
        num_threads: int | None = None,
        prefetch: int | None = None,
        max_bytes: int = 256 << 20,
        on_error: Literal["raise", "skip", "replace"] | Callable[[LoaderError], str] = "raise",
        max_errors: int | float | None = None,
        lanes: int = 2,
        hw_load: float | str = 0.65,
        gpu_tuning: Any = None,
        run_ahead: bool | None = None,
        distributed: bool = True,
        rank: int | None = None,
        world: int | None = None,
        equal: Literal["pad", "drop"] | None = "pad",
        progress: bool = False,
    ) -> None:
        args = resolve_loader_args(
            reader, batch_size=batch_size, pipeline=pipeline, device=device, last_batch=last_batch, seed=seed,
            num_threads=num_threads, prefetch=prefetch, max_bytes=max_bytes, on_error=on_error, max_errors=max_errors,
            lanes=lanes, gpu_tuning=gpu_tuning, run_ahead=run_ahead, distributed=distributed, rank=rank, world=world,
            equal=equal, progress=progress)
        self.reader = args.reader
        self.rank, self.world = args.reader.rank, args.reader.world
        self.batch_size = batch_size
        self.pipeline = args.pipeline
        self.device = args.device
        self.lanes = lanes
        self.hw_load = hw_load
        self.gpu_tuning = gpu_tuning
        self.run_ahead = args.run_ahead
        self._executor: Executor | None = None
        self.last_batch = args.last_batch
        self.seed = seed
        self.num_threads = args.num_threads
        self.progress = progress
        self._cfg = RunConfig(
            reader=args.reader,
            executor=self._open_executor,
            batch_size=batch_size,
            last_batch=args.last_batch,
            seed=seed,
            prefetch=args.prefetch,
            max_bytes=max_bytes,
            on_error=on_error,
            max_errors=args.max_errors,
        )
        # Where the next batch comes from. ``_fresh``: nobody has started iterating from it yet;
        # an iteration left mid-epoch makes the next ``async for`` start the next epoch.
        self._start_epoch(0)
        self._fresh = True
        self._active: _Run | None = None
        self._ahead: _Run | None = None  # the next epoch's run, started early (run_ahead)
        # A run whose loop was left without closing its iterator (a bare ``break``): the next
        # ``async for`` tears it down before it starts its own.
        self._abandoned: _Run | None = None
        self._closed = False
        self._stats = LoaderStats()
        self._errors = ErrorLog()

    async def _open_executor(self) -> Any:
        """The loader's executor, made at the first epoch and kept until ``aclose()``."""
        from headrace.ops._executors import open_executor

        if self._closed:
            raise ClosedError("loader is closed")
        if self._executor is None:  # on the GPU (decoders, streams, compiled kernels) this blocks the loop once
            self._executor = open_executor(self.pipeline, self.device, num_threads=self.num_threads, seed=self.seed,
                                           lanes=self.lanes, hw_load=self.hw_load, decoder_threads=self.num_threads,
                                           tuning=self.gpu_tuning)
        return self._executor

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return batches_per_epoch(len(self.reader), self.batch_size, self.last_batch)

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) ``async for`` iterates."""
        return self._epoch

    def _start_epoch(self, epoch: int) -> None:
        """Point the stream at ``epoch``'s first sample."""
        self._epoch, self._position, self._batches = epoch, 0, 0
        # The spans of the epoch read on other world sizes before a resume, as (world, position)
        # pairs; ``_position`` counts inside the span after them.
        self._history: list[tuple[int, int]] = []

    def __aiter__(self) -> AsyncIterator[Batch]:
        return self._aiter(run_ahead=self.run_ahead, progress=self.progress)

    def _aiter(self, *, run_ahead: bool, progress: bool) -> AsyncIterator[Batch]:
        if self._closed:
            raise ClosedError("loader is closed")
        previous = self._active
        if previous is not None:
            if previous.consumer_inside:
                raise LoaderError("this loader is already being iterated by another task; "
                                  "finish or close that loop first")
            # The last loop was left without closing its iterator (a bare ``break``, or an
            # exception in its body): this one takes over and tears that run down first.
            previous.superseded = True
            self._abandoned, self._active = previous, None
        if not self._fresh:
            self._start_epoch(self._epoch + 1)
        self._fresh = False
        where = (self._epoch, self._position, self._batches, tuple(self._history))
        ahead = self._ahead
        if (previous is None and ahead is not None
                and (ahead.epoch, ahead.start, ahead.first_batch, ahead.history) == where):
            run, self._ahead = ahead, None  # started during the last epoch: take it over
        else:
            run = _Run(self._cfg, *where)  # (a stale run ahead, after load_state_dict, goes in _iterate)
        self._active = run
        return self._iterate(run, run_ahead, progress and self.rank == 0)

    async def _iterate(self, run: _Run, run_ahead: bool, progress: bool) -> AsyncIterator[Batch]:
        completed = False
        bar: EpochProgress | None = None
        run.consumer_inside = True
        try:
            if run.superseded:  # a later ``async for`` took over before this one started
                raise ClosedError(_REPLACED)
            await self._begin(run)
            if progress:
                bar = EpochProgress(run, self._epoch_length(), run.first_batch)
            run.start_runner()
            while True:
                item = await run.out_rx.receive()
                if item is END:
                    run.ended = time.perf_counter()
                    if run.failure is not None:
                        raise run.failure
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
            self._start_epoch(run.epoch + 1)
            self._fresh = True
            completed = True
        finally:
            await self._end(run, completed, bar)

    async def _begin(self, run: _Run) -> None:
        """Before an epoch's first batch: tear down a loop left without closing and any stale run
        ahead, and start the epoch's clock (once, also when an iteration resumes it)."""
        abandoned, self._abandoned = self._abandoned, None
        if abandoned is not None:
            await self._stop_early(abandoned)
        await self._close_ahead()
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
        if run_ahead and self._ahead is None and run.dispatched_all.is_set():
            self._ahead = _Run(self._cfg, run.epoch + 1, 0, 0)
            self._ahead.start_runner()
        stats = self._stats
        self._position, self._batches = item.extra["end_position"], item.index + 1
        stats.dropped += item.dropped
        stats.replaced += item.replaced
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

    async def _end(self, run: _Run, completed: bool, bar: EpochProgress | None) -> None:
        """After an iteration, however it ended: record the epoch's metrics and stop the run."""
        run.consumer_inside = False
        if run.ended is None:  # left early
            run.ended = time.perf_counter()
        if not run.superseded:  # else the later loop's run is the current epoch
            self._stats.channels = run.channels()
            self._stats.epoch_metrics = run.metrics()
        if bar is not None:
            bar.close(run.metrics())
        if completed:
            self._active = None
            await run.aclose()
        elif run.superseded:
            await run.aclose()  # the loop that replaced this one stops the rest
        else:
            # ``_active`` stays this run until it is stopped: a new ``async for`` meanwhile
            # takes it as abandoned and waits for the same teardown before it starts.
            try:
                await self._stop_early(run)
            finally:
                if self._active is run:
                    self._active = None

    async def _stop_early(self, run: _Run) -> None:
        """Tear down an epoch left early: its tasks, the work running ahead, and the batches it had
        in flight in the executor (which stays, for the next epoch)."""
        try:
            await run.aclose()
            await self._close_ahead()
        finally:
            if self._executor is not None:
                await self._executor.drain()

    async def aclose(self) -> None:
        """Stop the epoch in progress, if any, and release everything: tasks, threads, files,
        decoders and GPU memory. Final: the loader raises ``ClosedError`` when used again. Safe to
        call twice, and from a task being cancelled (it finishes the cleanup, then re-raises)."""
        self._closed = True
        runs = [r for r in (self._active, self._abandoned, self._ahead) if r is not None]
        self._active = self._abandoned = self._ahead = None
        executor, self._executor = self._executor, None
        try:
            for run in runs:
                await run.aclose()
        finally:
            if executor is not None:
                await executor.aclose()

    async def _close_ahead(self) -> None:
        run, self._ahead = self._ahead, None
        if run is not None:
            await run.aclose()

    async def __aenter__(self) -> Loader:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def sync(self, *, progress: bool | None = None):
        """A blocking facade for plain ``for`` loops; it runs this loader's loop in a thread.

        ``progress``: a tqdm bar per epoch, as ``Loader(progress=...)`` (None: the loader's setting).
        """
        from ._sync import SyncLoader

        return SyncLoader(self, progress=self.progress if progress is None else progress)

    def _epoch_length(self) -> int | None:
        try:
            return len(self)
        except TypeError:  # a reader that does not know its length
            return None

    def stats(self) -> LoaderStats:
        """Counters and the current epoch's metrics; cheap (a few channel snapshots), fine per batch."""
        if self._active is not None:
            self._stats.channels = self._active.channels()
            self._stats.epoch_metrics = self._active.metrics()
        # Derived here, not per batch: the error log is the record.
        self._stats.errors = dict(self._errors.counts)
        self._stats.recent_errors = list(self._errors.recent)
        timings = getattr(self._executor, "timings", None)
        if timings is not None:
            self._stats.lanes = timings()
        return self._stats

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: after the last batch handed out, or at the next epoch's start.

        ``position`` and ``batches`` count this rank's samples and batches in the epoch (after the
        spans in ``history``, if it resumed on another world size); in a job whose ranks step
        together they are the same on every rank.
        """
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "batches": self._batches,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "world": self.world,
            "rank": self.rank,
            "history": [list(span) for span in self._history],
            "source": self.reader.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the next ``async for`` resumes mid-epoch if the state was taken there.

        The state may come from any rank of the same step. Saved on another world size, the epoch
        continues with what it has not read yet, split across this job's ranks (see the class
        docstring); the reader must be ``reshardable``.

        Raises ConfigError if the state came from a loader with another batch size, seed or reader,
        or from another world size with a reader that cannot resume across world sizes.
        """
        if self._active is not None:
            raise LoaderError("cannot load state while an epoch is being iterated")
        point = resume_point(state, batch_size=self.batch_size, seed=self.seed, reader=self.reader, world=self.world)
        self._epoch, self._position, self._batches = point.epoch, point.position, point.batches
        self._history = point.history
        self._fresh = True

    def __repr__(self) -> str:
        return (
            f"Loader({self.reader!r}, batch_size={self.batch_size}, pipeline={self.pipeline!r}, "
            f"device={self.device!r}, epoch={self._epoch})"
        )
