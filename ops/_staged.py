"""The user's stages and the batching of fields around an image executor (or alone, without images).

A batch goes: read failures out, ``.npy`` fields loaded, the stages before Decode (each sample's
fields), then the image executor (``CpuExecutor``/``CudaExecutor`` over ``Pipeline.core()``) on
the samples left, or for a pipeline without images the batching of every field (``_collate``);
then the stages after the built-in ops, on rows (``Map``) or on the batch (``MapBatch``). A
failure anywhere is that sample's, recorded with its row of the whole batch, and the rows left
move on: the loader's ``on_error`` sees every failure once.

Plain functions run in this executor's threads, a batch's samples spread over them (one call per
thread per batch, as the CPU executor's chunks); ``async def`` ones run on the event loop, each
``Map`` at most ``concurrency`` calls at once. On the GPU path, stages after decode run with a CUDA
stream of this executor's as torch's current stream, ordered after the lane by the batch's event:
the host never waits for the GPU here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from headrace._errors import ClosedError, DecodeError, LoaderError, TransformError
from headrace._sample import Sample, SampleBatch, hand_off
from headrace._threads import gather_jobs, join_threads

from ._collate import collate, is_npy_field, load_npy
from ._results import Processed, read_failure, sample_label, split_evenly
from ._pipeline import Pipeline
from ._stages import Map, MapBatch, Stage

__all__ = ["StagedExecutor"]

logger = logging.getLogger("headrace")

_MASK64 = (1 << 64) - 1


class StagedExecutor:
    """Runs ``pipeline``'s stages and field batching; ``inner`` (an executor over
    ``pipeline.core()``, or None when the pipeline has no image) decodes and transforms the images.

    Owns ``inner`` (``drain`` and ``aclose`` pass on to it) and ``num_threads`` threads of its own.
    ``device`` is where batches are made: on ``"cuda:N"`` stacked columns are copied there.
    """

    def __init__(self, pipeline: Pipeline, inner: Any, *, num_threads: int, seed: int, device: str = "cpu") -> None:
        self.pipeline = pipeline
        self.inner = inner
        self.seed = seed
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix="headrace-stage")
        self.num_threads = num_threads
        self._running: set[concurrent.futures.Future[Any]] = set()
        self._limits: dict[int, tuple[Any, asyncio.Semaphore]] = {}
        self._stream: Any = None
        self._warned_unused = False
        self._closed = False

    def timings(self) -> dict[str, float]:
        return self.inner.timings() if hasattr(self.inner, "timings") else {}

    async def run(self, batch: SampleBatch) -> Processed:
        """``batch`` through the stages and the image executor; per-sample failures in ``failures``."""
        if self._closed:
            raise ClosedError("StagedExecutor.run after aclose()")
        pipe = self.pipeline
        samples: list[Sample] = list(batch.samples)
        failures: dict[int, LoaderError] = {}
        for i, sample in enumerate(samples):
            if sample.error is not None:
                failures[i] = read_failure(sample)
        await self._before(batch, samples, failures)
        alive = [i for i in range(len(samples)) if i not in failures]
        ready = None
        if not alive:
            data: dict[str, Any] = {}
            kept: list[int] = []
        elif self.inner is not None:
            processed = await self.inner.run(SampleBatch([samples[i] for i in alive], batch.epoch, batch.index))
            for row, err in processed.failures:
                failures[alive[row]] = err
            kept = [alive[row] for row in processed.kept]
            data, ready = processed.data, processed.ready
            if pipe.fields and kept:  # batched in a thread: arrays may be large, the loop's time is not
                columns = await self._call(lambda: {n: collate([samples[i].fields[n] for i in kept]) for n in pipe.fields})
                if self._cuda:  # copied on the stage stream, after the lane: one event covers both
                    columns, ready = await self._call(self._on_side_stream, data, ready, lambda: _on_device(columns, self.device))
                data.update(columns)
        else:
            data, kept, ready = await self._call(self._collate_fields, samples, alive, failures)
        for stage in pipe.after:
            if not kept:
                break
            if isinstance(stage, MapBatch):
                data, kept, ready = await self._map_batch(stage, batch, samples, data, kept, ready, failures)
            else:
                data, kept, ready = await self._map_rows(stage, batch, samples, data, kept, ready, failures)
        return Processed(data, kept, sorted(failures.items()), ready)

    # -- before decode ---------------------------------------------------------------------------------

    async def _before(self, batch: SampleBatch, samples: list[Sample], failures: dict[int, LoaderError]) -> None:
        """``.npy`` fields loaded and the ``Map``s before Decode applied, sample by sample, in place."""
        pipe = self.pipeline
        rows = [i for i in range(len(samples)) if i not in failures]
        if any(is_npy_field(n) for i in rows[:1] for n in samples[i].fields):
            await self._in_threads(rows, lambda i: _load_npy_fields(samples, i), None, samples, failures)
        for stage in pipe.before:
            rows = [i for i in rows if i not in failures]
            position = pipe.stage_position(stage)

            def arguments(i: int, stage: Map = stage, position: int = position) -> tuple[Any, dict[str, Any]]:
                return dict(samples[i].fields), self._extras(stage, batch, position, samples[i])

            def store(i: int, out: Any) -> None:
                if not isinstance(out, dict):
                    raise TypeError(f"returned {type(out).__name__}, not a dict of fields")
                sample = samples[i]
                samples[i] = Sample(sample.key, out, sample.source, sample.index, sample.position)

            await self._apply(stage, rows, arguments, store, samples, failures)
        if pipe.has_image and pipe.before and not self._warned_unused:
            self._warn_unused(samples, [i for i in rows if i not in failures][:1], batch)
        if pipe.has_image and pipe.fields:
            for i in rows:
                if i not in failures and (missing := [n for n in pipe.fields if n not in samples[i].fields]):
                    failures[i] = _sample_error(TransformError, samples[i], f"sample has no {missing[0]!r} field (Pipeline "
                                                f"fields={pipe.fields!r}; it has {', '.join(samples[i].fields) or 'none'})")

    def _extras(self, stage: Map, batch: SampleBatch, position: int, sample: Sample) -> dict[str, Any]:
        """The keyword arguments a Map's function asked for by name: ``rng``, ``key``, ``index``."""
        extras: dict[str, Any] = {}
        if stage.wants_rng:
            extras["rng"] = _rng(self.seed, batch.epoch, position, sample.index)
        if stage.wants_key:
            extras["key"] = sample.key
        if stage.wants_index:
            extras["index"] = sample.index
        return extras

    def _warn_unused(self, samples: list[Sample], rows: list[int], batch: SampleBatch) -> None:
        """Say once when the stages before Decode made fields the batch will not carry: a field is
        handed out only when ``Pipeline(fields=...)`` names it, and a new one is easy to forget."""
        if not rows:
            return
        pipe = self.pipeline
        made = [name for name in samples[rows[0]].fields if name not in batch.samples[rows[0]].fields]
        unused = [name for name in made if name not in pipe.fields and name not in pipe.image_fields
                  and name != pipe.label_field]
        self._warned_unused = True
        if unused:
            logger.warning("headrace: the stages before Decode add fields %s that no batch carries; name them in "
                           "Pipeline(fields=...) to have them batched", unused)

    async def _apply(self, stage: Map, rows: list[int], arguments: Callable[[int], tuple[Any, dict[str, Any]]],
                     store: Callable[[int, Any], None], samples: list[Sample], failures: dict[int, LoaderError]) -> None:
        """``stage.fn`` on each row (its value and keyword arguments from ``arguments(i)``), each result
        through ``store(i, out)``: in the threads, or on the loop for an ``async def``. A row that
        raises fails, named."""
        if not stage.is_async:
            def work(i: int) -> None:
                value, extras = arguments(i)
                store(i, stage.fn(value, **extras))

            await self._in_threads(rows, work, stage, samples, failures)
            return
        limit = self._limit(stage)
        pending = iter(rows)

        async def worker() -> None:
            # A few workers a batch, each taking the next row, rather than a task a row: a task
            # costs the loop more than a typical call, and the bound is the semaphore anyway.
            for i in pending:
                async with limit:
                    try:
                        value, extras = arguments(i)
                        store(i, await stage.fn(value, **extras))
                    except Exception as exc:
                        failures[i] = _failed(stage, samples[i], exc)

        async with asyncio.TaskGroup() as tg:  # a cancelled batch cancels its calls
            for _ in range(min(len(rows), stage.concurrency)):
                tg.create_task(worker())

    async def _in_threads(self, rows: list[int], work: Callable[[int], None], stage: Stage | None,
                          samples: list[Sample], failures: dict[int, LoaderError]) -> None:
        """``work(i)`` for each row, the rows spread over the threads (one call per thread)."""
        parts = [rows[lo:hi] for lo, hi in split_evenly(len(rows), max(1, min(len(rows), self.num_threads)))]
        await gather_jobs([self._submit(_each_row, part, work, stage, samples, failures) for part in parts if part])

    def _limit(self, stage: Map) -> asyncio.Semaphore:
        """The stage's bound on calls at once, shared by the batches in flight on this event loop."""
        loop = asyncio.get_running_loop()
        held = self._limits.get(id(stage))
        if held is None or held[0] is not loop:
            held = self._limits[id(stage)] = (loop, asyncio.Semaphore(stage.concurrency))
        return held[1]

    # -- batching without an image --------------------------------------------------------------------------

    def _collate_fields(self, samples: list[Sample], alive: list[int],
                        failures: dict[int, LoaderError]) -> tuple[dict[str, Any], list[int], Any]:
        """Every field (or the pipeline's ``fields``) of the ``alive`` samples, and the label, as columns.
        The fields of the first sample are the batch's when the pipeline names none."""
        pipe = self.pipeline
        label = pipe.label_field
        names = pipe.fields or tuple(n for n in samples[alive[0]].fields if n != label)
        labels: list[int] = []
        kept: list[int] = []
        for i in alive:
            sample = samples[i]
            try:
                missing = [n for n in names if n not in sample.fields]
                if missing:
                    raise _sample_error(TransformError, sample, f"sample has no {missing[0]!r} field (the batch's "
                                        f"fields are {', '.join(names)}; it has {', '.join(sample.fields) or 'none'})")
                if label is not None:
                    labels.append(sample_label(sample, label))
            except LoaderError as exc:
                failures[i] = exc
                continue
            kept.append(i)
        data = {name: collate([samples[i].fields[name] for i in kept]) for name in names}
        if label is not None:
            data["label"] = torch.tensor(labels, dtype=torch.int64)
        if not self._cuda:
            return data, kept, None
        # CUDA tensors a stage made (DecodeClip on the GPU) were stacked on this thread's stream: the side stream's event covers them.
        self._side_stream().wait_stream(torch.cuda.current_stream(self.device))
        data, ready = self._on_side_stream({}, None, lambda: _on_device(data, self.device))
        return data, kept, ready

    # -- after the built-in ops -----------------------------------------------------------------------------

    async def _map_rows(self, stage: Map, batch: SampleBatch, samples: list[Sample], data: dict[str, Any],
                        kept: list[int], ready: Any, failures: dict[int, LoaderError]) -> tuple[dict[str, Any], list[int], Any]:
        position = self.pipeline.stage_position(stage)
        results: dict[int, dict[str, Any]] = {}
        slot = {row: p for p, row in enumerate(kept)}

        def arguments(i: int) -> tuple[Any, dict[str, Any]]:
            row = {name: column[slot[i]] for name, column in data.items()}
            return row, self._extras(stage, batch, position, samples[i])

        def store(i: int, out: Any) -> None:
            if not isinstance(out, dict):
                raise TypeError(f"returned {type(out).__name__}, not a dict")
            results[i] = out

        def outputs() -> tuple[dict[str, Any], list[int]]:
            left = [i for i in kept if i in results]
            return _columns(results, left), left

        if not self._cuda:
            await self._apply(stage, kept, arguments, store, samples, failures)
            return *outputs(), None

        def on_stream() -> tuple[dict[str, Any], list[int]]:
            def work(i: int) -> None:
                value, extras = arguments(i)
                store(i, stage.fn(value, **extras))

            _each_row(kept, work, stage, samples, failures)  # one thread: kernels launched in row order
            return outputs()

        (out, left), ready = await self._call(self._on_side_stream, data, ready, on_stream)
        return out, left, ready

    async def _map_batch(self, stage: MapBatch, batch: SampleBatch, samples: list[Sample], data: dict[str, Any],
                         kept: list[int], ready: Any, failures: dict[int, LoaderError]) -> tuple[dict[str, Any], list[int], Any]:
        extras = {"rng": _rng(self.seed, batch.epoch, self.pipeline.stage_position(stage), batch.index)} if stage.wants_rng else {}
        if stage.wants_keys:
            extras["keys"] = [samples[i].key for i in kept]
        try:
            if stage.is_async:
                out = await stage.fn(data, **extras)
            elif self._cuda:
                out, ready = await self._call(self._on_side_stream, data, ready, lambda: stage.fn(data, **extras))
            else:
                out = await self._call(stage.fn, data, **extras)
            if not isinstance(out, dict):
                raise TypeError(f"returned {type(out).__name__}, not a dict")
        except Exception as exc:
            for i in kept:
                failures[i] = _failed(stage, samples[i], exc)
            return {}, [], None
        return out, kept, ready

    def _on_side_stream(self, data: dict[str, Any], ready: Any, fn: Callable[[], Any]) -> tuple[Any, Any]:
        """``fn()`` with this executor's stream current, after the lane's ``ready`` event (the input
        tensors recorded on the stream, so the lane reuses their memory only after it); the result
        and the event recorded after it."""
        stream = self._side_stream()
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            hand_off(data.values(), ready)
            out = fn()
            return out, _recorded(stream)

    def _side_stream(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    # -- threads -------------------------------------------------------------------------------------------

    def _submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut = self._pool.submit(fn, *args, **kwargs)
        self._running.add(fut)
        fut.add_done_callback(self._running.discard)
        return fut

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        job = self._submit(fn, *args, **kwargs)
        await gather_jobs([job])
        return job.result()

    async def drain(self) -> None:
        """Cancel stage calls not started, wait for running ones, then drain ``inner``."""
        running = list(self._running)
        for fut in running:
            fut.cancel()
        try:
            await join_threads(running)
        finally:
            if self.inner is not None:
                await self.inner.drain()

    async def aclose(self) -> None:
        """Drain, join the threads, close ``inner``. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            await join_threads(list(self._running))
            self._pool.shutdown(wait=True)
            if self._stream is not None:
                self._stream.synchronize()
        finally:
            if self.inner is not None:
                await self.inner.aclose()


def _load_npy_fields(samples: list[Sample], i: int) -> None:
    """Sample ``i`` with its ``.npy`` fields loaded (a new Sample: the reader's stays as it was)."""
    sample = samples[i]
    fields = dict(sample.fields)
    for name, value in fields.items():
        if is_npy_field(name) and isinstance(value, (bytes, bytearray, memoryview)):
            try:
                fields[name] = load_npy(value)
            except ValueError as exc:
                raise _sample_error(DecodeError, sample, f"field {name!r} is not a .npy file: {exc}") from exc
    samples[i] = Sample(sample.key, fields, sample.source, sample.index, sample.position)


def _columns(results: dict[int, dict[str, Any]], rows: list[int]) -> dict[str, Any]:
    if not rows:
        return {}
    names = list(results[rows[0]])
    return {name: collate([results[i].get(name) for i in rows]) for name in names}


def _on_device(columns: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {name: _copied(value, device) for name, value in columns.items()}


def _copied(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True) if value.is_cuda else value.pin_memory().to(device, non_blocking=True)
    if isinstance(value, list) and value and all(isinstance(v, torch.Tensor) for v in value):
        return [_copied(v, device) for v in value]
    return value


def _recorded(stream: Any) -> Any:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _rng(seed: int, epoch: int, position: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed & _MASK64, epoch & _MASK64, position, index & _MASK64])


def _sample_error(kind: type[LoaderError], sample: Sample, message: str) -> LoaderError:
    return kind(message, key=sample.key, source=sample.source)


def _stage_error(stage: Stage | None, sample: Sample, exc: Exception) -> LoaderError:
    where = f"stage {stage.name!r}" if stage is not None else "loading a .npy field"
    err = TransformError(f"{where} failed: {type(exc).__name__}: {exc}", key=sample.key, source=sample.source,
                         stage=f"stage {stage.name}" if stage is not None else None)
    err.__cause__ = exc
    return err


def _each_row(rows: list[int], work: Callable[[int], None], stage: Stage | None, samples: list[Sample],
              failures: dict[int, LoaderError]) -> None:
    """``work(i)`` for each row in turn; a row that raises fails, named (in a thread, or on the
    stage stream's thread for row stages on the GPU)."""
    for i in rows:
        try:
            work(i)
        except Exception as exc:
            failures[i] = _failed(stage, samples[i], exc)


def _failed(stage: Stage | None, sample: Sample, exc: Exception) -> LoaderError:
    """The sample's failure: a LoaderError as it is (named), anything else as the stage's TransformError."""
    return _named(exc, sample) if isinstance(exc, LoaderError) else _stage_error(stage, sample, exc)


def _named(exc: LoaderError, sample: Sample) -> LoaderError:
    if exc.key is None:
        exc.key, exc.source = sample.key, sample.source
    return exc
