"""Online inference preprocessing: concurrent requests gathered into batches under a latency bound.

A call enqueues one request per image. The collector task closes a batch when it holds
``max_batch`` requests (or ``max_pending``, if fewer) or when its oldest request has waited
``max_delay``, whichever comes first, and only once a batch slot is free: while the executor is
busy, requests pile up, so batches grow with the load by themselves. Each batch is a
``SampleBatch`` for the executor the Loader uses (CPU threads or GPU lanes); each caller gets its
own row back, or its own error.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Self

from ._batch_processor import BatchProcessor
from ._device import resolve_device
from ._distributed import detect_distributed
from ._errors import HW_LOAD, ClosedError, ConfigError, require_hw_load, require_int, require_number
from ._request_batcher import Request, RequestBatcher

__all__ = ["Preprocessor", "PreprocessorStats"]

ImageBytes = bytes | bytearray | memoryview


@dataclass
class PreprocessorStats:
    """Counters since the service was made. ``batch_sizes`` maps a batch size to how many batches had it."""

    requests: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    rejected: int = 0
    batches: int = 0
    batch_sizes: Counter[int] = field(default_factory=Counter)
    in_flight: int = 0
    peak_in_flight: int = 0
    waiting: int = 0


class Preprocessor:
    """A preprocessing service: ``await pre(image_bytes)`` from any number of concurrent callers.

    ::

        async with Preprocessor(ops.validation(), max_batch=32, max_delay=0.002) as pre:
            x = await pre(jpeg_bytes)            # (3, 224, 224) float32, this request's row
            xs = await pre([jpeg_a, jpeg_b])     # (2, 3, 224, 224)

    Arguments:
        pipeline: a ``headrace.ops.Pipeline``; default ``ops.validation(label=None)`` (decode →
            resize shorter side 256 → centre crop 224 → normalize). Requests fill its first image field.
        max_batch: at most this many images per batch. A batch that holds ``max_pending`` images
            goes at once too: no other request could join it.
        max_delay: seconds a request waits at most for company once a batch slot is free. The
            default, 0, sends whatever is queued at once: batches then form from the requests that
            arrive while the executor is busy, which is when they pay (on 2 CPU cores, 2 ms of delay
            cost 1.8 ms at p50 alone and gave no throughput from 16 to 256 callers). Raise it where
            a batch's fixed cost is high and moderate load arrives spread out.
        max_pending: bound on images in flight (queued or being processed).
        when_full: past ``max_pending``, ``"wait"`` (in arrival order) or ``"reject"`` (raise
            OverloadedError at once, before any work).
        device, num_threads, lanes, hw_load, gpu_tuning, seed: as for ``Loader``.
        batches_in_flight: batches the executor works on at once (default: ``num_threads`` on the
            CPU, so single requests use every core; ``lanes + 1`` on the GPU, so a lane never idles
            between batches).
        postprocess: optional plain ``fn(images) -> outputs`` (an ``async def`` is a ConfigError)
            run on each whole batch (a model's forward, say) in one thread the service owns; each
            caller then gets its row of ``outputs``: a tensor or an array with a row per image, or a
            list of them (a tuple or a dict is a TransformError: its length would not say whose row
            is whose). On the GPU the thread's current stream waits for the lane first.
        wait_ready: GPU only: answer a batch only once the device has finished it (a thread waits;
            the event loop never does). Use it to time requests or before copying to the host.

    Returns and raises, per call: the image's output row (a view of the batch tensor; on the GPU a
    CUDA tensor left on the device, ordered after the lane on the event loop thread's current
    stream), a stacked tensor for a list (a list of tensors when the pipeline's output size varies).
    A corrupt image fails only its own request, with DecodeError naming it (``key``, default
    ``request-<n>``; a list fails with its first bad image). OverloadedError when full and
    rejecting (a list is taken whole or not at all: one of more than ``max_pending`` images never
    fits, and its error says so); ClosedError after ``aclose()``.

    Cancellation: a cancelled caller leaves its batch-mates alone. Not yet in a batch, the request
    is withdrawn and its place freed; already in one, the batch runs on and only that row is dropped.

    Lifetime: the first call (or ``async with``) starts the collector and the executor (on the GPU
    this blocks the loop once, while decoders and streams are made). ``aclose()`` refuses new calls,
    fails queued requests and callers waiting for room with ClosedError, lets the batches already
    in the executor finish and answer their callers, then joins every thread. Cancelling ``aclose``
    abandons those batches too (their callers get ClosedError); threads are joined in any case.
    """

    def __init__(
        self,
        pipeline: Any = None,
        *,
        max_batch: int = 32,
        max_delay: float = 0.0,
        max_pending: int = 1024,
        when_full: Literal["wait", "reject"] = "wait",
        device: Literal["auto", "cpu", "cuda"] | str = "auto",
        num_threads: int | None = None,
        lanes: int = 1,
        hw_load: float | str = HW_LOAD,
        gpu_tuning: Any = None,
        seed: int = 0,
        batches_in_flight: int | None = None,
        postprocess: Callable[[Any], Any] | None = None,
        wait_ready: bool = False,
    ) -> None:
        from headrace import ops

        pipeline = ops.validation(label=None) if pipeline is None else pipeline
        if not isinstance(pipeline, ops.Pipeline):
            raise ConfigError(f"pipeline must be a headrace.ops.Pipeline, got {type(pipeline).__name__}")
        if pipeline.fields or not pipeline.has_image:
            raise ConfigError(f"Preprocessor: a request carries only its image; the pipeline's fields={pipeline.fields!r} "
                              "cannot be filled" if pipeline.has_image else "Preprocessor: serves images; the pipeline "
                              "has image=None")
        if any(isinstance(stage, ops.Filter) for stage in pipeline.stages):  # each caller is owed a row
            raise ConfigError("Preprocessor: every request is answered with its row, and an ops.Filter would drop "
                              "some; leave the request out before calling instead")
        self.max_batch = require_int("max_batch", max_batch)
        self.max_delay = require_number("max_delay", max_delay, 0, float("inf"), high_open=True,
                                        wanted="a finite number of seconds >= 0")
        max_pending = require_int("max_pending", max_pending)
        if when_full not in ("wait", "reject"):
            raise ConfigError(f"when_full must be 'wait' or 'reject', got {when_full!r}")
        if postprocess is not None and not callable(postprocess):
            raise ConfigError(f"postprocess must be callable, got {postprocess!r}")
        from headrace.ops._stages import is_async_callable

        if postprocess is not None and is_async_callable(postprocess):  # its thread has no loop to await it on
            raise ConfigError(f"postprocess runs in a thread of the service's own and must be a plain function, "
                              f"got the async {postprocess!r}")
        # One process per GPU under torchrun: "auto"/"cuda" is this process's GPU, as for the Loader.
        self.device = resolve_device(pipeline, device, local_rank=detect_distributed().local_rank)
        self.pipeline = pipeline
        self.when_full = when_full
        # ``is None``, not ``or``: a 0 is a wrong argument, not a request for the default.
        self.num_threads = require_int("num_threads", num_threads if num_threads is not None else os.cpu_count() or 1)
        self.lanes = require_int("lanes", lanes)
        self.hw_load = require_hw_load(hw_load)
        if gpu_tuning is not None and not isinstance(gpu_tuning, ops.GpuTuning):
            raise ConfigError(f"gpu_tuning must be a headrace.ops.GpuTuning, got {type(gpu_tuning).__name__}")
        self.gpu_tuning = gpu_tuning
        self.seed = require_int("seed", seed, None)  # as the Loader: every request would fail on a wrong one
        on_gpu = self.device.startswith("cuda")
        default_slots = self.lanes + 1 if on_gpu else self.num_threads
        self.batches_in_flight = require_int("batches_in_flight",
                                             batches_in_flight if batches_in_flight is not None else default_slots)
        self.postprocess = postprocess
        self.wait_ready = bool(wait_ready) and on_gpu
        self._stats = PreprocessorStats()
        self._requests = RequestBatcher(pipeline.image_fields[0], max_batch=self.max_batch, max_delay=self.max_delay,
                                        max_pending=max_pending, batches_in_flight=self.batches_in_flight,
                                        stats=self._stats)
        self._batches = BatchProcessor(self._requests, postprocess=postprocess, wait_ready=self.wait_ready)
        self._runner: asyncio.Task[None] | None = None
        self._collector: asyncio.Task[None] | None = None
        self._closed = False
        self._failure_reported = False

    # --- calls ------------------------------------------------------------------------------------

    async def __call__(self, images: ImageBytes | Sequence[ImageBytes], *, key: str | None = None) -> Any:
        single = isinstance(images, (bytes, bytearray, memoryview))
        if not single and (isinstance(images, str) or not isinstance(images, Sequence)):
            raise ConfigError(f"Preprocessor: an image must be bytes, bytearray or memoryview (or a list of them), "
                              f"got {type(images).__name__}", key=key)
        datas = [images] if single else list(images)
        for data in datas:
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise ConfigError(f"Preprocessor: an image must be bytes, bytearray or memoryview, got "
                                  f"{type(data).__name__}", key=key)
        if not datas:
            raise ConfigError("Preprocessor: an empty list of images")
        if self._closed:
            raise ClosedError("Preprocessor is closed", key=key, source="request")
        self._start()
        keys = [key] if single else [None if key is None else f"{key}/{i}" for i in range(len(datas))]
        reqs: list[Request] = []
        try:
            await self._requests.admit(datas, keys, reqs, reject=self.when_full == "reject")
            # Not ``await future``: a cancelled caller would cancel the future behind our back; here
            # withdraw does it, and keeps the queue's count exact in the same step.
            await asyncio.wait([r.future for r in reqs])
        except BaseException:
            self._requests.withdraw(reqs)
            raise
        errors = [r.future.exception() for r in reqs]  # every one retrieved, none logged as unseen
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        if single:
            return reqs[0].future.result()
        rows = [r.future.result() for r in reqs]
        import torch

        if all(isinstance(r, torch.Tensor) for r in rows) and len({tuple(r.shape) for r in rows}) == 1:
            return torch.stack(rows)
        return rows

    # --- lifetime -----------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._closed:
            raise ClosedError("Preprocessor is closed")
        if self._runner is not None:
            return
        self._batches.start(self._open_executor())
        self._runner = asyncio.create_task(self._main(), name="preprocessor:run")

    def _open_executor(self) -> Any:
        from headrace.ops._executors import open_executor

        return open_executor(self.pipeline, self.device, num_threads=self.num_threads, seed=self.seed,
                             lanes=self.lanes, hw_load=self.hw_load, name="headrace-serve-cpu", tuning=self.gpu_tuning)

    async def _main(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                if not self._closed:  # aclose() may come before this task's first step
                    self._collector = tg.create_task(self._requests.collect(tg, self._batches.process),
                                                     name="preprocessor:collect")
        finally:
            self._shut()
            await self._batches.release()

    def _shut(self) -> None:
        """Refuse new calls; fail queued requests and callers waiting for room with ClosedError."""
        self._closed = True
        self._requests.close()

    async def aclose(self) -> None:
        """Stop taking requests and release everything (see the class docstring). Safe to call twice."""
        if not self._closed:
            self._shut()
            if self._collector is not None:
                self._collector.cancel()  # batches already dispatched run on inside the TaskGroup
        runner = self._runner
        if runner is None:
            return
        cancelled = False
        while not runner.done():
            try:
                await asyncio.wait([runner])
            except asyncio.CancelledError:
                cancelled = True
                runner.cancel()  # abandon the running batches; their threads are still joined
        await self._batches.release()  # in case the runner was cancelled before its first step
        if cancelled:
            raise asyncio.CancelledError
        if not runner.cancelled() and runner.exception() is not None and not self._failure_reported:
            self._failure_reported = True
            raise runner.exception()

    async def __aenter__(self) -> Self:
        self._start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def stats(self) -> PreprocessorStats:
        s = self._stats
        admission = self._requests.admission
        s.in_flight, s.peak_in_flight, s.waiting = admission.used, admission.peak, admission.waiting
        return s

    def __repr__(self) -> str:
        return (
            f"Preprocessor({self.pipeline!r}, device={self.device!r}, max_batch={self.max_batch}, "
            f"max_delay={self.max_delay}, max_pending={self._requests.admission.limit}, when_full={self.when_full!r})"
        )

