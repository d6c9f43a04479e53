"""Where the user's stage calls run: plain functions in threads, ``async def`` ones on the event
loop (each ``Map`` or ``Filter`` at most ``concurrency`` calls at once), GPU work on a side stream.

A row that raises fails alone, named: its error goes into the batch's ``failures`` under its row.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

import torch

from headrace._errors import LoaderError, TransformError
from headrace._sample import Sample, hand_off
from headrace._threads import gather_jobs, join_threads

from ._results import named, split_evenly
from ._stages import SampleStage, Stage

__all__ = ["StageCalls", "each_row", "stage_failure"]


class StageCalls:
    """``num_threads`` threads, the bounds of the ``async def`` stages, and (on ``device``, a GPU)
    one CUDA stream, for the calls of a ``StagedExecutor``'s stages.

    ``drain`` cancels the calls not started and waits for the running ones; ``aclose`` joins the
    threads and waits for the stream.
    """

    def __init__(self, num_threads: int, device: torch.device) -> None:
        self.num_threads = num_threads
        self.device = device
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="headrace-stage")
        self._running: set[concurrent.futures.Future[Any]] = set()
        self._limits: dict[int, tuple[Any, asyncio.Semaphore]] = {}
        self._stream: Any = None
        self._copy_stream: Any = None  # ``copied_beside``'s

    async def apply(self, stage: SampleStage, rows: list[int], arguments: Callable[[int], tuple[Any, dict[str, Any]]],
                    store: Callable[[int, Any], None], samples: list[Sample], failures: dict[int, LoaderError]) -> None:
        """``stage.fn`` on each row (its value and keyword arguments from ``arguments(i)``), each result
        through ``store(i, out)``: in the threads, or on the loop for an ``async def``. A row that
        raises fails, named."""
        if not stage.is_async:
            def work(i: int) -> None:
                value, extras = arguments(i)
                store(i, stage.fn(value, **extras))

            await self.in_threads(rows, work, stage, samples, failures)
            return
        limit = self._limit(stage)
        pending = iter(rows)

        async def worker() -> None:
            # A few workers a batch, each taking the next row, rather than a task a row: a task
            # costs the loop more than a typical call. A worker holds its permit of the bound
            # for all the rows it takes (one call at a time), not one acquire a row: with several
            # batches in flight the permits are contended, and each blocked acquire cost the
            # loop a future and a wake-up a sample.
            async with limit:
                for i in pending:
                    try:
                        value, extras = arguments(i)
                        store(i, await stage.fn(value, **extras))
                    except Exception as exc:
                        failures[i] = stage_failure(stage, samples[i], exc)

        async with asyncio.TaskGroup() as tg:  # a cancelled batch cancels its calls
            for _ in range(min(len(rows), stage.concurrency)):
                tg.create_task(worker())

    async def in_threads(self, rows: list[int], work: Callable[[int], None], stage: Stage | str,
                         samples: list[Sample], failures: dict[int, LoaderError]) -> None:
        """``work(i)`` for each row, the rows spread over the threads (one call per thread);
        ``stage``: the user's stage, or what a built-in step does (named in a failure's message)."""
        parts = [rows[lo:hi] for lo, hi in split_evenly(len(rows), max(1, min(len(rows), self.num_threads)))]
        await gather_jobs([self._submit(each_row, part, work, stage, samples, failures) for part in parts if part])

    def _limit(self, stage: SampleStage) -> asyncio.Semaphore:
        """The stage's bound on calls at once, shared by the batches in flight on this event loop."""
        loop = asyncio.get_running_loop()
        held = self._limits.get(id(stage))
        if held is None or held[0] is not loop:
            held = self._limits[id(stage)] = (loop, asyncio.Semaphore(stage.concurrency))
        return held[1]

    def on_side_stream(self, data: dict[str, Any], ready: Any, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """``fn()`` with this executor's stream current, after the lane's ``ready`` event (the input
        tensors recorded on the stream, so the lane reuses their memory only after it); the result
        and the event recorded after it."""
        stream = self.side_stream()
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            hand_off(data.values(), ready)
            out = fn()
            return out, _recorded(stream)

    async def call_on_stream(self, data: dict[str, Any], ready: Any, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """``on_side_stream(data, ready, fn)`` in one of the threads."""
        return await self.call(self.on_side_stream, data, ready, fn)

    def copied_beside(self, data: dict[str, Any], ready: Any, copy: Callable[[], Any]) -> tuple[Any, Any]:
        """``copy()`` (host-to-device copies of what does not depend on the lane's output) on a
        stream of its own, which never waits for a lane, then the event after both it and the
        lane's ``ready``. Issued after the lane's event on the side stream, a copy from pageable
        memory held this thread until the batch's kernels were done: on the H200 the boxes' copy
        took 60 ms a batch and held the pipeline to a quarter of its rate."""
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device):
            with torch.cuda.stream(self._copy_stream):
                out = copy()
                copied = _recorded(self._copy_stream)
            stream = self.side_stream()
            with torch.cuda.stream(stream):
                hand_off(data.values(), ready)
                stream.wait_event(copied)
                return out, _recorded(stream)

    def side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut = self._pool.submit(fn, *args, **kwargs)
        self._running.add(fut)
        fut.add_done_callback(self._running.discard)
        return fut

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in one of the threads."""
        job = self._submit(fn, *args, **kwargs)
        await gather_jobs([job])
        return job.result()

    async def drain(self) -> None:
        """Cancel the calls not started, wait for the running ones."""
        running = list(self._running)
        for fut in running:
            fut.cancel()
        await join_threads(running)

    async def aclose(self) -> None:
        """Refuse new calls, cancel those not started, join the threads, wait for the stream."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        await join_threads(list(self._running))
        self._pool.shutdown(wait=True)
        for stream in (self._stream, self._copy_stream):
            if stream is not None:
                stream.synchronize()


def each_row(rows: list[int], work: Callable[[int], None], stage: Stage | str, samples: list[Sample],
             failures: dict[int, LoaderError]) -> None:
    """``work(i)`` for each row in turn; a row that raises fails, named (in a thread, or on the
    stage stream's thread for row stages on the GPU)."""
    for i in rows:
        try:
            work(i)
        except Exception as exc:
            failures[i] = stage_failure(stage, samples[i], exc)


def stage_failure(stage: Stage | str, sample: Sample, exc: Exception) -> LoaderError:
    """The sample's failure: a LoaderError as it is (named), anything else as the stage's TransformError."""
    return named(exc, sample) if isinstance(exc, LoaderError) else _stage_error(stage, sample, exc)


def _stage_error(stage: Stage | str, sample: Sample, exc: Exception) -> LoaderError:
    """``exc`` as the sample's TransformError: in the user's stage, or in the built-in step ``stage`` names."""
    if isinstance(stage, str):
        where, tag = stage, None
    else:
        where, tag = f"stage {stage.name!r}", f"stage {stage.name}"
    err = TransformError(f"{where} failed: {type(exc).__name__}: {exc}", key=sample.key, source=sample.source,
                         stage=tag)
    err.__cause__ = exc
    return err


def _recorded(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event
