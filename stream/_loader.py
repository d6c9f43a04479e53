"""The Loader: the public face of the pipeline."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from ._batcher import LastBatch, batches_per_epoch
from ._budget import ErrorBudget
from ._channel import ChannelStats
from ._device import resolve_device
from ._errors import ClosedError, ConfigError, LoaderError, require_int
from ._markers import END
from ._run import RunConfig, _Run
from ._sample import Batch

__all__ = ["Loader", "LoaderStats"]

STATE_VERSION = 1


@dataclass
class LoaderStats:
    """Counters since the loader was made, plus the channels of the current or last epoch."""

    epoch: int = 0
    batches: int = 0
    samples: int = 0
    dropped: int = 0
    channels: list[ChannelStats] = field(default_factory=list)
    lanes: dict[str, float] = field(default_factory=dict)  # GPU path: seconds per lane phase


class Loader:
    """Batches of tensors from a reader, one epoch per ``async for``.

    ::

        loader = Loader(readers.files("train/", shuffle=True), batch_size=256, pipeline=ops.training(224))
        for epoch in range(90):
            async for batch in loader:          # or: for batch in loader.sync():
                train_step(batch["image"], batch["label"])

    Arguments:
        reader: a ``headrace.readers.Reader`` (already sharded for this rank, if any).
        batch_size: samples per batch.
        pipeline: a ``headrace.ops.Pipeline`` (default: decode only, images of their own sizes).
        device: ``"auto"`` (the GPU when CUDA, CuPy and nvImageCodec are there, else the CPU),
            ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. On the GPU, batches are torch CUDA tensors,
            ready on the consumer's current stream (it waits on the lane's event; the host does not).
        lanes: GPU lanes (thread + CUDA stream + decoder), fed by one thread that parses headers
            and plans crops. Two is the default: on the H100 it was as fast as one or faster, and
            held up better when other Python threads competed for the GIL (ops/README.md).
        hw_load: share of each batch offered to the hardware JPEG decoder first (GPU path; 0.65,
            DALI's default, measured as good as or better than the others), or ``"adaptive"``
            (nvImageCodec moves the share batch by batch).
        last_batch: ``"partial"`` (default), ``"fill"`` or ``"drop"`` for the short last batch.
        seed: keys the reader's shuffle (unless it has its own seed) and every random op.
        num_threads: CPU worker threads for decode and transforms (default: all cores).
        prefetch: batches in flight between the batcher and the consumer (decoding or done);
            default 3 on the CPU, ``lanes + 2`` on the GPU.
        max_bytes: bound on encoded bytes buffered between the reader and the batcher.
        on_error: ``"raise"`` (default) raises the first sample error, typed and naming the sample;
            ``"skip"`` drops failed samples from their batch and counts them (``stats().dropped``).
        max_errors: the skip budget per epoch: an int count, or a float fraction of samples seen.

    GPU lanes (decoders, streams, compiled kernels) are costly to make, so they outlive a
    completed epoch and serve the next; leaving a loop early, an error or cancellation closes them
    with the epoch, and ``aclose()`` (or ``async with``) closes them in any case.

    Backpressure: the consumer sets the pace; the pipeline runs at most ``prefetch`` batches ahead
    and the reader at most ``max_bytes`` ahead of the batcher. Breaking out of the loop, an error or
    cancellation stops every task, joins every thread and closes every file before control returns
    (``break`` is cleaned up by the asyncgen finaliser on the next loop turns; ``async with loader``
    or ``await loader.aclose()`` makes it immediate).

    Resume: ``state_dict()`` at any point between batches, ``load_state_dict()`` on a new loader
    with the same arguments, and the next ``async for`` yields exactly the batches the
    uninterrupted run would have yielded next.
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
        on_error: Literal["raise", "skip"] = "raise",
        max_errors: int | float = 0,
        lanes: int = 2,
        hw_load: float | str = 0.65,
    ) -> None:
        from headrace.ops import Pipeline
        from headrace.readers import Reader

        if not isinstance(reader, Reader):
            raise ConfigError(f"reader must be a headrace.readers.Reader, got {type(reader).__name__}")
        require_int("batch_size", batch_size)
        pipeline = Pipeline() if pipeline is None else pipeline
        if not isinstance(pipeline, Pipeline):
            raise ConfigError(f"pipeline must be a headrace.ops.Pipeline, got {type(pipeline).__name__}")
        device = resolve_device(pipeline, device)
        require_int("lanes", lanes)
        if on_error not in ("raise", "skip"):
            raise ConfigError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        num_threads = num_threads or os.cpu_count() or 1
        if prefetch is None:  # on the GPU: one batch per lane, one being prepared, one handed over
            prefetch = lanes + 2 if device.startswith("cuda") else 3
        for name, value in (("num_threads", num_threads), ("prefetch", prefetch), ("max_bytes", max_bytes)):
            require_int(name, value)
        ErrorBudget(max_errors)  # validates max_errors now rather than at the first failure
        if not isinstance(seed, int):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        self.reader = reader
        self.batch_size = batch_size
        self.pipeline = pipeline
        self.device = device
        self.lanes = lanes
        self.hw_load = hw_load
        self._gpu_executor: Any = None
        self.last_batch = LastBatch.parse(last_batch)
        self.seed = seed
        self.num_threads = num_threads
        self._cfg = RunConfig(
            reader=reader,
            open_executor=self._open_executor,
            close_executor=self._close_executor,
            batch_size=batch_size,
            last_batch=self.last_batch,
            seed=seed,
            prefetch=prefetch,
            max_bytes=max_bytes,
            on_error=on_error,
            max_errors=max_errors if on_error == "skip" else 0,
        )
        # Where the next batch comes from. ``_fresh``: nobody has started iterating from it yet;
        # an iteration left mid-epoch makes the next ``async for`` start the next epoch.
        self._epoch, self._position, self._batches = 0, 0, 0
        self._fresh = True
        self._active: _Run | None = None
        self._closed = False
        self._stats = LoaderStats()

    async def _open_executor(self) -> Any:
        from headrace.ops import CpuExecutor, CudaExecutor

        if self.device == "cpu":
            return CpuExecutor(self.pipeline, num_threads=self.num_threads, seed=self.seed)
        if self._gpu_executor is None:
            # Made once (decoders, streams, compiled kernels) and kept until aclose(): this blocks
            # the loop once, before the first batch.
            self._gpu_executor = CudaExecutor(
                self.pipeline, device=self.device,
                lanes=self.lanes, seed=self.seed, hw_load=self.hw_load,
            )
        return self._gpu_executor

    async def _close_executor(self, executor: Any) -> None:
        if executor is not self._gpu_executor:
            await executor.aclose()

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return batches_per_epoch(len(self.reader), self.batch_size, self.last_batch)

    @property
    def epoch(self) -> int:
        """The epoch the next (or current) ``async for`` iterates."""
        return self._epoch

    def __aiter__(self) -> AsyncIterator[Batch]:
        if self._closed:
            raise ClosedError("loader is closed")
        if self._active is not None:
            raise LoaderError("this loader is already being iterated; finish or close that loop first")
        if not self._fresh:
            self._epoch, self._position, self._batches = self._epoch + 1, 0, 0
        self._fresh = False
        run = _Run(self._cfg, self._epoch, self._position, self._batches)
        self._active = run
        return self._iterate(run)

    async def _iterate(self, run: _Run) -> AsyncIterator[Batch]:
        stats = self._stats
        stats.epoch = run.epoch
        completed = False
        run.start_runner()
        try:
            while True:
                item = await run.out_rx.receive()
                if item is END:
                    if run.failure is not None:
                        raise run.failure
                    break
                if isinstance(item, BaseException):
                    raise item
                self._position, self._batches = item.extra["end_position"], item.index + 1
                stats.batches += 1
                stats.samples += item.size
                stats.dropped += item.dropped
                item.handoff()
                yield item
            self._epoch, self._position, self._batches = run.epoch + 1, 0, 0
            self._fresh = True
            completed = True
        finally:
            stats.channels = run.channels()
            self._active = None
            await run.aclose()
            if not completed:  # break, cancel or error: the GPU lanes go too, not only the epoch
                await self._close_gpu_executor()

    async def aclose(self) -> None:
        """Stop the epoch in progress, if any, and release everything. Safe to call twice."""
        run = self._active
        if run is not None:
            self._active = None
            await run.aclose()
        await self._close_gpu_executor()

    async def _close_gpu_executor(self) -> None:
        executor, self._gpu_executor = self._gpu_executor, None
        if executor is not None:
            await executor.aclose()

    async def __aenter__(self) -> Loader:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def sync(self):
        """A blocking facade for plain ``for`` loops; it runs this loader's loop in a thread."""
        from ._sync import SyncLoader

        return SyncLoader(self)

    def stats(self) -> LoaderStats:
        if self._active is not None:
            self._stats.channels = self._active.channels()
        if self._gpu_executor is not None:
            self._stats.lanes = self._gpu_executor.timings()
        return self._stats

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands: after the last batch handed out, or at the next epoch's start."""
        return {
            "version": STATE_VERSION,
            "epoch": self._epoch,
            "position": self._position,
            "batches": self._batches,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "source": self.reader.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; the next ``async for`` resumes mid-epoch if the state was taken there.

        Raises ConfigError if the state came from a loader with another batch size, seed or reader.
        """
        if self._active is not None:
            raise LoaderError("cannot load state while an epoch is being iterated")
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"unknown loader state version {state.get('version')!r}")
        for name in ("batch_size", "seed"):
            if state[name] != getattr(self, name):
                raise ConfigError(f"state was saved with {name}={state[name]!r}, this loader has {getattr(self, name)!r}")
        if state["source"] != self.reader.state_dict():
            raise ConfigError(f"state was saved with reader {state['source']!r}, this loader reads {self.reader.state_dict()!r}")
        self._epoch, self._position, self._batches = int(state["epoch"]), int(state["position"]), int(state["batches"])
        self._fresh = True

    def __repr__(self) -> str:
        return (
            f"Loader({self.reader!r}, batch_size={self.batch_size}, pipeline={self.pipeline!r}, "
            f"device={self.device!r}, epoch={self._epoch})"
        )
