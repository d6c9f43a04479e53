"""The Loader: the public face of the pipeline."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ._batcher import LastBatch, batches_per_epoch
from ._channel import ChannelStats
from ._cursor import Cursor
from ._epochs import Epochs
from ._errors import HW_LOAD, ConfigError, LoaderError, require_hw_load
from ._loader_args import resolve_loader_args
from ._loader_state import STATE_VERSION, ResumePoint, resume_point
from ._policy import ErrorRecord
from ._run import EpochMetrics
from ._sample import Batch

if TYPE_CHECKING:
    from headrace.ops._executors import Executor

__all__ = ["Loader", "LoaderStats"]


@dataclass
class LoaderStats:
    """Counters since the loader was made, plus the channels and metrics of the current or last epoch.

    ``dropped`` counts samples skipped and ``replaced`` samples whose row another sample took
    (``on_error``); ``errors`` counts every failed sample by error class (``{"DecodeError": 3}``),
    and ``recent_errors`` holds the last 32 failures, newest last. ``filtered`` counts samples an
    ``ops.Filter`` dropped: not failures, so in none of the error counts and not against ``max_errors``.

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
    filtered: int = 0
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
            and plans crops. Four is the default: on the H100 (16 cores) four lanes of 4 host
            threads each ran the training pipeline 1.16x as fast as two lanes of 16, epochs
            interleaved (docs/benchmarks.md, issue 22): more batches in the decoders at once keep
            both the hardware engines and the host threads busier.
        hw_load: share of each batch given to the hardware JPEG decoder (GPU path), counted in
            the bytes the batch's crop windows need read: 0.76, what 0.65 of the images (DALI's
            default, measured as good as or better than the others) gives training's random
            crops, while validation's largest windows, its largest images, then get fewer bytes
            than at 0.65 of the images; or ``"adaptive"``: the share starts there and moves batch
            by batch, up when the CUDA decoder kept the batch waiting, down when it did not. Where
            the host's cores are the limit that was faster (on one H200, training 1.06-1.14x and
            validation 1.01-1.07x, on fewer host cores), but which decoder takes an image then
            depends on timing, and the engine and the CUDA decoder do not give a JPEG the same
            pixels: two runs of one seed differ a little.
        gpu_tuning: a ``headrace.ops.GpuTuning``: how the GPU path drives nvImageCodec (expert
            knobs; the defaults were the fastest measured).
        last_batch: ``"partial"`` (default), ``"fill"`` or ``"drop"`` for the short last batch.
        seed: keys the reader's shuffle (unless it has its own seed) and every random op.
        num_threads: CPU threads for decode and transforms: the CPU path's workers, or the GPU
            lanes' nvImageCodec host threads, shared among the lanes (each gets
            ``num_threads // lanes``, at least one). Default: all cores, divided among the processes
            torchrun started on the node, from ``LOCAL_WORLD_SIZE``.
        prefetch: batches in flight between the batcher and the output channel (decoding, or
            done and waiting for a place in it); the output channel holds two more finished
            batches for the consumer, so a slow consumer has up to ``prefetch + 2`` finished
            batches waiting. Default 3 on the CPU, ``lanes + 2`` on the GPU.
        run_ahead: once an epoch's reader is done, start reading the next epoch (into the bounded
            channels: ``max_bytes``, two batches), and once the epoch's last batch has gone to
            decode, start decoding it (up to ``prefetch`` batches), so neither the reads nor the
            lanes drain and refill at every epoch boundary, as DALI's pipeline runs on (over
            object storage, the loader holds the reader's connections over each epoch, and on
            while the next epoch runs ahead, and that epoch's first shards download as this
            epoch's last ones finish). The next ``async for``
            takes that work over;
            a ``load_state_dict``, a ``break`` or ``aclose()`` throws it away (``state_dict()`` never
            counts it). The ``sync()`` facade runs ahead inside ``with loader.sync() as epochs:``
            (one loop thread serves all its epochs); a bare ``for batch in loader.sync():`` does not
            (each of its epochs has its own event loop, which the work would not outlive). Default: on for the GPU path (its executor is shared
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
            (checked once 100 were seen). Default: 1% (``0.01``). Each rank counts its own
            samples. A run resumed mid-epoch (``load_state_dict``) counts from the resume point:
            the state is the same on every rank, and the failures before it are each rank's own.
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

    Backpressure: the consumer sets the pace; the pipeline runs at most ``prefetch + 2`` batches
    ahead (``prefetch`` in flight, two finished in the output channel) and the reader at most
    ``max_bytes`` ahead of the batcher.

    Resume: ``state_dict()`` at any point between batches, ``load_state_dict()`` on a new loader
    with the same arguments, and the next ``async for`` yields exactly the batches the
    uninterrupted run would have yielded next.

    Many processes (torchrun): every rank computes the same seeded global order of an epoch with
    no communication and takes a disjoint part of it; the parts cover the epoch, and with
    ``equal="pad"`` or ``"drop"`` every rank yields the same number of batches, whatever
    ``last_batch``. All ranks hold the same ``state_dict()`` after the same step (so saving rank
    0's is enough). Loaded on the same world size, the run continues exactly; loaded on another
    (say 4 ranks to 2, files, LMDB, or WebDataset with per-shard counts, not resampled), the new ranks split what
    the epoch has not read yet: no sample of the epoch is read twice and none is left out (but the
    repeats or the cut that ``equal`` makes at the epoch's end). That epoch then yields fewer
    batches than ``len()`` says, the same number on every rank; the next epochs are whole. Where
    what is left would make no batch on any new rank (nothing left, or under
    ``last_batch="drop"`` fewer samples than a batch), the run starts the next epoch, as an
    uninterrupted one would.
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
        lanes: int = 4,
        hw_load: float | str = HW_LOAD,
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
        self.batch_size = args.batch_size
        self.pipeline = args.pipeline
        self.device = args.device
        self.lanes = args.lanes
        self.hw_load = require_hw_load(hw_load)
        self.gpu_tuning = gpu_tuning
        self.run_ahead = args.run_ahead
        self.last_batch = args.last_batch
        self.seed = args.seed
        self.num_threads = args.num_threads
        self.progress = progress
        self._cursor = Cursor()  # where the next batch comes from
        self._epochs = Epochs(self._cursor, LoaderStats(), self._make_executor, self._epoch_length,
                              reader=args.reader, batch_size=args.batch_size, last_batch=args.last_batch,
                              seed=args.seed, prefetch=args.prefetch, max_bytes=args.max_bytes, on_error=on_error,
                              max_errors=args.max_errors)

    def _make_executor(self) -> Executor:
        """This loader's executor for its pipeline and device; ``Epochs`` makes one, at the first epoch."""
        from headrace.ops._executors import open_executor

        return open_executor(self.pipeline, self.device, num_threads=self.num_threads, seed=self.seed,
                             lanes=self.lanes, hw_load=self.hw_load,
                             decoder_threads=max(1, self.num_threads // self.lanes),
                             tuning=self.gpu_tuning)

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return batches_per_epoch(len(self.reader), self.batch_size, self.last_batch)

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) ``async for`` iterates."""
        return self._cursor.epoch

    def __aiter__(self) -> AsyncIterator[Batch]:
        return self._aiter(run_ahead=self.run_ahead, progress=self.progress)

    def _aiter(self, *, run_ahead: bool, progress: bool) -> AsyncIterator[Batch]:
        return self._epochs.iterate(run_ahead=run_ahead, progress=progress and self.rank == 0)

    async def aclose(self) -> None:
        """Stop the epoch in progress, if any, and release everything: tasks, threads, files,
        decoders and GPU memory. Final: the loader raises ``ClosedError`` when used again, and a
        loop inside the epoch (in another task) gets ``ClosedError`` at its next batch, not the
        epoch's end. Safe to call twice, and from a task being cancelled (it finishes the cleanup,
        then re-raises)."""
        await self._epochs.aclose()

    async def __aenter__(self) -> Loader:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def sync(self, *, progress: bool | None = None):
        """A blocking facade for plain ``for`` loops; it runs this loader's loop in a thread.

        ``with loader.sync() as epochs:`` keeps that thread for every epoch of the block, so the
        loader runs ahead between epochs (``run_ahead``), and closes the loader at its end.
        ``progress``: a tqdm bar per epoch, as ``Loader(progress=...)`` (None: the loader's setting).
        """
        from ._sync import SyncLoader

        if progress is not None and not isinstance(progress, bool):  # as Loader(progress=): "no" would show a bar
            raise ConfigError(f"sync: progress must be True, False or None, got {progress!r}")
        return SyncLoader(self, progress=self.progress if progress is None else progress)

    def _epoch_length(self) -> int | None:
        try:
            return len(self)
        except TypeError:  # a reader that does not know its length
            return None

    def stats(self) -> LoaderStats:
        """Counters and the current epoch's metrics; cheap (a few channel snapshots), fine per batch."""
        return self._epochs.stats()

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: after the last batch handed out, or at the next epoch's start.

        ``position`` and ``batches`` count this rank's samples and batches in the epoch (after the
        spans in ``history``, if it resumed on another world size); in a job whose ranks step
        together they are the same on every rank. ``epoch_end`` says the last batch handed out was
        the epoch's last (the loop had not ended yet: a trainer's checkpoint at its last step), so a
        loader given the state starts at the next epoch (on any world size, for any reader). Readers
        that know their length say it by ``len()``; for the others the loader knows it once it has
        seen the reader's end, which it has by the last batch unless the source was still being read
        (then the resumed ``async for`` yields nothing and ends, and the one after it starts the next
        epoch), and still after a ``break`` there has stopped the epoch. The same empty rest follows
        a state taken at the last batch handed out when every sample of the batches after it failed
        under ``on_error="skip"``: that it would fail is not known when the state is taken.
        """
        cursor = self._cursor
        return {
            "version": STATE_VERSION,
            "epoch": cursor.epoch,
            "position": cursor.position,
            "batches": cursor.batches,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "world": self.world,
            "rank": self.rank,
            "history": [list(span) for span in cursor.history],
            "source": self.reader.state_dict(),
            "epoch_end": self._at_epoch_end(),
        }

    def _at_epoch_end(self) -> bool:
        # By the length where the reader knows it, so that every rank of a step writes the same
        # state whatever its reader's timing; else by the end the run has seen.
        length, cursor = self._epoch_length(), self._cursor
        if length is not None:
            return not cursor.history and cursor.batches >= length
        return self._epochs.handed_out_all()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the next ``async for`` resumes mid-epoch if the state was taken there
        (and at the next epoch's start if it was taken after an epoch's last batch).

        The state may come from any rank of the same step. Saved on another world size, the epoch
        continues with what it has not read yet, split across this job's ranks (see the class
        docstring); the reader must be ``reshardable``.

        Raises ConfigError if the state came from a loader with another batch size, seed or reader,
        or from another world size with a reader that cannot resume across world sizes.
        """
        self._epochs.let_go_of_a_left_run()  # raises while a loop is inside an epoch
        saved_at_epoch_end = state.get("epoch_end") is True and not state.get("history")
        if saved_at_epoch_end:
            # At the epoch's end: the next epoch's start, which any reader can take on any world
            # size. Checked as a state at this epoch's start would be (batch size, seed, reader).
            state = {**state, "position": 0, "batches": 0}
        point = resume_point(state, batch_size=self.batch_size, seed=self.seed, reader=self.reader,
                             world=self.world)
        if saved_at_epoch_end or self._past_last_batch(point):
            point = ResumePoint(point.epoch + 1, 0, 0, [])
        self._cursor.resume(point)
        self._epochs.forget_left_end()

    def _past_last_batch(self, point: ResumePoint) -> bool:
        # Saved after the epoch's last batch, before its loop ended (a trainer's checkpoint at its
        # last step): the uninterrupted run's next batch is the next epoch's first, so start there,
        # not in an empty rest of this epoch that a trainer would count as one.
        length = self._epoch_length()
        return length is not None and not point.history and point.batches >= length

    def __repr__(self) -> str:
        return (
            f"Loader({self.reader!r}, batch_size={self.batch_size}, pipeline={self.pipeline!r}, "
            f"device={self.device!r}, epoch={self._cursor.epoch})"
        )
