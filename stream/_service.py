"""Online inference preprocessing: concurrent requests gathered into batches under a latency bound.

A call enqueues one request per image. The collector task closes a batch when it holds
``max_batch`` requests or when its oldest request has waited ``max_delay``, whichever comes first,
and only once a batch slot is free: while the executor is busy, requests pile up, so batches grow
with the load by themselves. Each batch is a ``SampleBatch`` for the executor the Loader uses
(CPU threads or GPU lanes); each caller gets its own row back, or its own error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Self

from ._admission import Admission
from ._device import resolve_device
from ._distributed import detect_distributed
from ._errors import (
    ClosedError,
    ConfigError,
    LoaderError,
    OverloadedError,
    TransformError,
    require_int,
)
from ._sample import Sample, SampleBatch, hand_off
from ._threads import join_threads

if TYPE_CHECKING:
    from headrace.ops._executors import Executor

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


@dataclass(eq=False, slots=True)
class _Request:
    sample: Sample
    future: asyncio.Future[Any]
    arrival: float
    dispatched: bool = False
    retired: bool = False


class Preprocessor:
    """A preprocessing service: ``await pre(image_bytes)`` from any number of concurrent callers.

    ::

        async with Preprocessor(ops.validation(), max_batch=32, max_delay=0.002) as pre:
            x = await pre(jpeg_bytes)            # (3, 224, 224) float32, this request's row
            xs = await pre([jpeg_a, jpeg_b])     # (2, 3, 224, 224)

    Arguments:
        pipeline: a ``headrace.ops.Pipeline``; default ``ops.validation(label=None)`` (decode →
            resize shorter side 256 → centre crop 224 → normalize). Requests fill its first image field.
        max_batch: at most this many images per batch.
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
        postprocess: optional ``fn(images) -> outputs`` run on each whole batch (a model's forward,
            say) in one thread the service owns; each caller then gets its row of ``outputs``. On
            the GPU the thread's current stream waits for the lane first.
        wait_ready: GPU only: answer a batch only once the device has finished it (a thread waits;
            the event loop never does). Use it to time requests or before copying to the host.

    Returns and raises, per call: the image's output row (a view of the batch tensor; on the GPU a
    CUDA tensor left on the device, ordered after the lane on the event loop thread's current
    stream), a stacked tensor for a list (a list of tensors when the pipeline's output size varies).
    A corrupt image fails only its own request, with DecodeError naming it (``key``, default
    ``request-<n>``; a list fails with its first bad image). OverloadedError when full and
    rejecting; ClosedError after ``aclose()``.

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
        hw_load: float | str = 0.65,
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
        self.max_batch = require_int("max_batch", max_batch)
        if isinstance(max_delay, bool) or not isinstance(max_delay, (int, float)) or not 0 <= max_delay < float("inf"):
            raise ConfigError(f"max_delay must be a finite number of seconds >= 0, got {max_delay!r}")
        self.max_delay = float(max_delay)
        require_int("max_pending", max_pending)
        if when_full not in ("wait", "reject"):
            raise ConfigError(f"when_full must be 'wait' or 'reject', got {when_full!r}")
        if postprocess is not None and not callable(postprocess):
            raise ConfigError(f"postprocess must be callable, got {postprocess!r}")
        # One process per GPU under torchrun: "auto"/"cuda" is this process's GPU, as for the Loader.
        self.device = resolve_device(pipeline, device, local_rank=detect_distributed().local_rank)
        self.pipeline = pipeline
        self.when_full = when_full
        self.num_threads = require_int("num_threads", num_threads or os.cpu_count() or 1)
        self.lanes = require_int("lanes", lanes)
        self.hw_load = hw_load
        if gpu_tuning is not None and not isinstance(gpu_tuning, ops.GpuTuning):
            raise ConfigError(f"gpu_tuning must be a headrace.ops.GpuTuning, got {type(gpu_tuning).__name__}")
        self.gpu_tuning = gpu_tuning
        self.seed = seed
        on_gpu = self.device.startswith("cuda")
        default_slots = self.lanes + 1 if on_gpu else self.num_threads
        self.batches_in_flight = require_int("batches_in_flight", batches_in_flight or default_slots)
        self.postprocess = postprocess
        self.wait_ready = bool(wait_ready) and on_gpu
        self._field = pipeline.image_fields[0]
        self._admission = Admission(max_pending)
        self._queue: deque[_Request] = deque()
        self._queued = 0  # live (not withdrawn) requests in _queue
        self._arrived = asyncio.Event()
        self._slots = asyncio.Semaphore(self.batches_in_flight)
        self._numbers = 0
        self._stats = PreprocessorStats()
        self._executor: Executor | None = None
        self._finisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._finishing: set[concurrent.futures.Future[Any]] = set()
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
        self._start()
        keys = [key] if single else [None if key is None else f"{key}/{i}" for i in range(len(datas))]
        reqs: list[_Request] = []
        try:
            if self.when_full == "reject":
                if not self._admission.try_acquire(len(datas)):
                    self._stats.rejected += len(datas)
                    raise OverloadedError(
                        f"{self._admission.used} images in flight, max_pending={self._admission.limit}",
                        key=keys[0] or f"request-{self._numbers}", source="request",
                    )
                reqs = [self._enqueue(d, k) for d, k in zip(datas, keys)]
            else:
                for d, k in zip(datas, keys):
                    await self._admission.acquire()  # one at a time: a list longer than max_pending still fits
                    reqs.append(self._enqueue(d, k))
            # Not ``await future``: a cancelled caller would cancel the future behind our back; here
            # _withdraw does it, and keeps the queue's count exact in the same step.
            await asyncio.wait([r.future for r in reqs])
        except BaseException:
            self._withdraw(reqs)
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

    def _enqueue(self, data: ImageBytes, key: str | None) -> _Request:
        n = self._numbers
        self._numbers += 1
        sample = Sample(key=key or f"request-{n}", fields={self._field: data}, source="request", index=n, position=n)
        loop = asyncio.get_running_loop()
        req = _Request(sample, loop.create_future(), loop.time())
        self._queue.append(req)
        self._queued += 1
        self._stats.requests += 1
        self._arrived.set()
        return req

    def _withdraw(self, reqs: list[_Request]) -> None:
        """The caller left (cancelled, or failed part-way through a list): drop what is unanswered."""
        for r in reqs:
            if r.future.done():
                continue
            r.future.cancel()
            self._stats.cancelled += 1
            if not r.dispatched:  # still queued: free its place now; a dispatched one frees it when its batch ends
                self._queued -= 1
                self._retire(r)

    def _retire(self, r: _Request) -> None:
        if not r.retired:
            r.retired = True
            self._admission.release()

    # --- batching -----------------------------------------------------------------------------------

    async def _collect(self, tg: asyncio.TaskGroup) -> None:
        index = 0
        while True:
            await self._slots.acquire()
            try:
                reqs = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            self._stats.batches += 1
            self._stats.batch_sizes[len(reqs)] += 1
            tg.create_task(self._process(reqs, index), name=f"preprocessor:batch{index}")
            index += 1

    async def _next_batch(self) -> list[_Request]:
        loop = asyncio.get_running_loop()
        while True:
            while self._queue and self._queue[0].future.done():  # withdrawn or failed at close
                self._queue.popleft()
            if self._queued >= self.max_batch:
                break
            timeout = None
            if self._queued:
                timeout = self._queue[0].arrival + self.max_delay - loop.time()
                if timeout <= 0:
                    break
            self._arrived.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._arrived.wait()
            except TimeoutError:
                pass
        reqs: list[_Request] = []
        while self._queue and len(reqs) < self.max_batch:
            r = self._queue.popleft()
            if not r.future.done():
                r.dispatched = True
                reqs.append(r)
        self._queued -= len(reqs)
        return reqs

    async def _process(self, reqs: list[_Request], index: int) -> None:
        try:
            batch = SampleBatch([r.sample for r in reqs], epoch=0, index=index)
            try:
                processed = await self._executor.run(batch)
                outputs = await self._finish(processed)
            except asyncio.CancelledError:
                for r in reqs:
                    self._answer(r, error=ClosedError("the service closed while the request was processed",
                                                      key=r.sample.key, source="request"))
                raise
            except Exception as exc:  # noqa: BLE001 - the whole batch failed: each caller gets its own typed copy
                for r in reqs:
                    self._answer(r, error=_for_request(exc, r.sample))
                return
            failures = dict(processed.failures)
            row_of = {row: j for j, row in enumerate(processed.kept)}
            for row, r in enumerate(reqs):
                if row in row_of:
                    self._answer(r, result=outputs[row_of[row]])
                else:
                    self._answer(r, error=failures.get(row) or TransformError(
                        "the executor returned no output for this request", key=r.sample.key, source="request"))
        finally:
            for r in reqs:
                self._retire(r)
            self._slots.release()

    def _answer(self, r: _Request, *, result: Any = None, error: BaseException | None = None) -> None:
        if r.future.done():  # the caller left while its batch ran
            return
        if error is None:
            r.future.set_result(result)
            self._stats.completed += 1
        else:
            r.future.set_exception(error)
            self._stats.failed += 1

    async def _finish(self, processed: Any) -> Any:
        images = processed.data["image"]
        ready = processed.ready
        if self._finisher is None:
            hand_off([images], ready)  # the loop thread's current stream: the callers'
            return images
        fut = self._finisher.submit(self._finish_in_thread, images, ready)
        self._finishing.add(fut)
        fut.add_done_callback(self._finishing.discard)
        return await asyncio.wrap_future(fut)

    def _finish_in_thread(self, images: Any, ready: Any) -> Any:
        hand_off([images], ready)  # this thread's current stream waits for the lane
        outputs = images
        if self.postprocess is not None:
            try:
                outputs = self.postprocess(images)
            except Exception as exc:
                raise TransformError(f"postprocess failed: {type(exc).__name__}: {exc}", stage="postprocess") from exc
            if len(outputs) != len(images):
                raise TransformError(f"postprocess returned {len(outputs)} rows for {len(images)} images",
                                     stage="postprocess")
        if self.wait_ready and ready is not None:
            import torch

            first = images[0] if isinstance(images, list) and images else images  # a list: sizes differ
            if isinstance(first, torch.Tensor):
                torch.cuda.current_stream(first.device).synchronize()
        return outputs

    # --- lifetime -----------------------------------------------------------------------------------

    def _start(self) -> None:
        if self._closed:
            raise ClosedError("Preprocessor is closed")
        if self._runner is not None:
            return
        self._executor = self._open_executor()
        if self.postprocess is not None or self.wait_ready:
            self._finisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="headrace-serve")
        self._runner = asyncio.create_task(self._main(), name="preprocessor:run")

    def _open_executor(self) -> Any:
        from headrace.ops._executors import open_executor

        return open_executor(self.pipeline, self.device, num_threads=self.num_threads, seed=self.seed,
                             lanes=self.lanes, hw_load=self.hw_load, name="headrace-serve-cpu", tuning=self.gpu_tuning)

    async def _main(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                if not self._closed:  # aclose() may come before this task's first step
                    self._collector = tg.create_task(self._collect(tg), name="preprocessor:collect")
        finally:
            self._shut()
            await self._release()

    def _shut(self) -> None:
        """Refuse new calls; fail queued requests and callers waiting for room with ClosedError."""
        self._closed = True
        self._admission.close()
        while self._queue:
            r = self._queue.popleft()
            if not r.future.done():
                self._queued -= 1
                self._answer(r, error=ClosedError("the service closed before the request was processed",
                                                  key=r.sample.key, source="request"))
                self._retire(r)

    async def _release(self) -> None:
        """Join the finisher thread, then close the executor. Idempotent; runs to the end if cancelled."""
        try:
            if self._finisher is not None:
                await join_threads(list(self._finishing))
                self._finisher.shutdown(wait=True)
        finally:
            if self._executor is not None:
                await self._executor.aclose()

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
        await self._release()  # in case the runner was cancelled before its first step
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
        s.in_flight, s.peak_in_flight, s.waiting = self._admission.used, self._admission.peak, self._admission.waiting
        return s

    def __repr__(self) -> str:
        return (
            f"Preprocessor({self.pipeline!r}, device={self.device!r}, max_batch={self.max_batch}, "
            f"max_delay={self.max_delay}, max_pending={self._admission.limit}, when_full={self.when_full!r})"
        )


def _for_request(exc: Exception, sample: Sample) -> LoaderError:
    """A batch-wide failure as this request's own error: same type and stage, the request's key."""
    if isinstance(exc, LoaderError):
        err = type(exc)(exc.message, key=sample.key, source=sample.source, stage=exc.stage)
    else:
        err = TransformError(f"{type(exc).__name__}: {exc}", key=sample.key, source=sample.source)
    err.__cause__ = exc
    return err
