"""The user's stages and the batching of fields around an image executor (or alone, without images).

A batch goes: read failures out, ``.npy`` fields loaded, the stages before Decode (each sample's
fields), then the image executor (``CpuExecutor``/``CudaExecutor`` over ``Pipeline.core()``) on
the samples left, or for a pipeline without images the batching of every field (``_collate``);
then the stages after the built-in ops, on rows (``Map``, ``Filter``: ``_row_stages``) or on the
batch (``MapBatch``). A failure anywhere is that sample's, recorded with its row of the whole batch,
and the rows left move on: the loader's ``on_error`` sees every failure once. A row a ``Filter``
drops is neither kept nor failed: it leaves the batch, and the loader counts it apart from the errors.

Plain functions run in this executor's threads, a batch's samples spread over them (one call per
thread per batch, as the CPU executor's chunks); ``async def`` ones run on the event loop, each
``Map`` at most ``concurrency`` calls at once. On the GPU path, stages after decode run with a CUDA
stream of this executor's as torch's current stream, ordered after the lane by the batch's event:
the host never waits for the GPU here.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from headrace._errors import ClosedError, DecodeError, LoaderError, TransformError
from headrace._sample import Sample, SampleBatch

from ._batch_stages import batch_extras, checked_batch, stage_rng
from ._collate import collate, is_npy_field, load_npy
from ._follow import Carried, carried_columns, read_carried, rows_on_device, with_iou_windows
from ._results import Processed, image_field, read_failure, sample_label
from ._pipeline import Pipeline
from ._row_stages import filter_rows, keep_when_true, map_rows, row_arguments
from ._stage_calls import StageCalls, each_row, stage_failure
from ._stages import Filter, MapBatch, SampleStage

__all__ = ["StagedExecutor"]

logger = logging.getLogger("headrace")

# A failure there that is not already a typed, named LoaderError says this (``stage_failure``).
_READING_CARRIED = "reading the boxes or mask that move with the image"


class StagedExecutor:
    """Runs ``pipeline``'s stages and field batching; ``inner`` (an executor over
    ``pipeline.core()``, or None when the pipeline has no image) decodes and transforms the images.

    Owns ``inner`` (``drain`` and ``aclose`` pass on to it) and ``num_threads`` threads of its own.
    ``device`` is where batches are made: on ``"cuda:N"`` stacked columns are copied there.
    ``on_lanes`` is how many of the stages after decode the GPU lanes of ``inner`` run themselves
    (``_batch_stages.lane_stages``): this executor runs the rest.
    """

    def __init__(self, pipeline: Pipeline, inner: Any, *, num_threads: int, seed: int, device: str = "cpu",
                 on_lanes: int = 0) -> None:
        self.pipeline = pipeline
        self.inner = inner
        self.after = pipeline.after[on_lanes:]
        self.seed = seed
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self.num_threads = num_threads
        self._calls = StageCalls(num_threads, self.device)
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
        dropped: set[int] = set()  # rows a Filter dropped: they leave the batch without failing
        alive = await self._before(batch, samples, failures, dropped)
        carried: dict[int, Carried] = {}
        if pipe.carries and alive:  # read and checked before decoding: a bad one fails its sample here
            await self._carry_rows(samples, alive, carried, batch.epoch, failures)
            alive = [i for i in alive if i not in failures]
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
            if (pipe.fields or pipe.carries) and kept:
                columns, ready = await self._calls.call(self._host_columns, samples, kept, carried, batch.epoch,
                                                        data, ready)
                data.update(columns)
        else:
            data, kept, ready = await self._calls.call(self._collate_fields, samples, alive, failures)
        for stage in self.after:
            if not kept:
                break
            if isinstance(stage, MapBatch):
                data, kept, ready = await self._map_batch(stage, batch, samples, data, kept, ready, failures)
                continue
            position = pipe.stage_position(stage)
            arguments = row_arguments(data, kept, lambda i, stage=stage, position=position:
                                      self._extras(stage, batch, position, samples[i]))
            if isinstance(stage, Filter):
                data, kept = await filter_rows(self._calls, stage, arguments, data, kept, samples, failures, dropped)
            else:
                data, kept, ready = await map_rows(self._calls, stage, arguments, data, kept, ready, samples, failures,
                                                   self._cuda)
        return Processed(data, kept, sorted(failures.items()), ready, sorted(dropped))

    # -- before decode ---------------------------------------------------------------------------------

    async def _before(self, batch: SampleBatch, samples: list[Sample], failures: dict[int, LoaderError],
                      dropped: set[int]) -> list[int]:
        """``.npy`` fields loaded and the ``Map``s and ``Filter``s before Decode applied, sample by sample,
        in place; a ``Filter``'s rows go to ``dropped``. Returns the rows left: neither failed nor dropped."""
        pipe = self.pipeline
        rows = [i for i in range(len(samples)) if i not in failures]
        if any(is_npy_field(n) for i in rows[:1] for n in samples[i].fields):
            await self._calls.in_threads(rows, lambda i: _load_npy_fields(samples, i), "loading a .npy field", samples,
                                         failures)
        for stage in pipe.before:
            rows = [i for i in rows if i not in failures and i not in dropped]
            position = pipe.stage_position(stage)

            def arguments(i: int, stage: SampleStage = stage, position: int = position) -> tuple[Any, dict[str, Any]]:
                return dict(samples[i].fields), self._extras(stage, batch, position, samples[i])

            store = keep_when_true(dropped) if isinstance(stage, Filter) else functools.partial(_store_fields, samples)
            await self._calls.apply(stage, rows, arguments, store, samples, failures)
        rows = [i for i in rows if i not in failures and i not in dropped]
        if pipe.has_image and pipe.before and not self._warned_unused:
            self._warn_unused(samples, rows[:1], batch)
        if pipe.has_image and pipe.fields:
            for i in rows:
                if missing := [n for n in pipe.fields if n not in samples[i].fields]:
                    failures[i] = _sample_error(TransformError, samples[i], f"sample has no {missing[0]!r} field (Pipeline "
                                                f"fields={pipe.fields!r}; it has {', '.join(samples[i].fields) or 'none'})")
        return [i for i in rows if i not in failures]

    def _host_columns(self, samples: list[Sample], kept: list[int], carried: dict[int, Carried], epoch: int,
                      data: dict[str, Any], ready: Any) -> tuple[dict[str, Any], Any]:
        """Thread: the kept rows' ``fields`` batched (arrays may be large, the loop's time is not) and
        the boxes and mask moved with their images; on the GPU copied there beside the lane (the
        host's data: the copy does not wait for the lane's kernels), one event after both. One
        thread call a batch: each hop between threads waits for the GIL."""
        pipe = self.pipeline
        columns = {n: collate([samples[i].fields[n] for i in kept]) for n in pipe.fields}
        if pipe.carries:
            columns.update(carried_columns(pipe, self.seed, epoch, [samples[i] for i in kept], [carried[i] for i in kept]))
        if not self._cuda:
            return columns, ready
        return self._calls.copied_beside(data, ready, lambda: rows_on_device(columns, self.device))

    async def _carry_rows(self, samples: list[Sample], rows: list[int], carried: dict[int, Carried], epoch: int,
                          failures: dict[int, LoaderError]) -> None:
        """Each row's boxes and mask read before decoding (``_follow``; a row that raises fails,
        named); with a ``RandomIoUCrop``, the windows then chosen on them for the rows left and put
        in their samples for the image executor."""
        pipe = self.pipeline

        def read(i: int) -> None:
            carried[i] = read_carried(samples[i], pipe, image_field(samples[i], pipe.image_fields))

        def choose_windows() -> None:
            if pipe.iou_crop is not None:
                with_iou_windows(samples, [i for i in rows if i not in failures], pipe, carried, self.seed, epoch)

        if pipe.mask is not None:  # Pillow lets the GIL go while it decodes a PNG mask: threads help
            await self._calls.in_threads(rows, read, _READING_CARRIED, samples, failures)
            if pipe.iou_crop is not None:
                await self._calls.call(choose_windows)
            return

        # Boxes alone are Python and NumPy work that holds the GIL (read_boxes, the JPEG header,
        # the windows): spread over the threads, each sample cost 0.66 ms against 0.1 alone on
        # the H200, in GIL hand-offs. One thread call a batch; batches in flight still overlap.
        def read_then_choose() -> None:
            each_row(rows, read, _READING_CARRIED, samples, failures)
            choose_windows()

        await self._calls.call(read_then_choose)

    def _extras(self, stage: SampleStage, batch: SampleBatch, position: int, sample: Sample) -> dict[str, Any]:
        """The keyword arguments a Map's or Filter's function asked for by name: ``rng``, ``key``, ``index``."""
        extras: dict[str, Any] = {}
        if stage.wants_rng:
            extras["rng"] = stage_rng(self.seed, batch.epoch, position, sample.index)
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
                  and name != pipe.label_field and name not in (pipe.boxes, pipe.mask, pipe.instance_masks, *pipe.per_box)]
        self._warned_unused = True
        if unused:
            logger.warning("headrace: the stages before Decode add fields %s that no batch carries; name them in "
                           "Pipeline(fields=...) to have them batched", unused)

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
        self._calls.side_stream().wait_stream(torch.cuda.current_stream(self.device))
        data, ready = self._calls.on_side_stream({}, None, lambda: rows_on_device(data, self.device))
        return data, kept, ready

    # -- after the built-in ops -----------------------------------------------------------------------------

    async def _map_batch(self, stage: MapBatch, batch: SampleBatch, samples: list[Sample], data: dict[str, Any],
                         kept: list[int], ready: Any, failures: dict[int, LoaderError]) -> tuple[dict[str, Any], list[int], Any]:
        extras = batch_extras(stage, self.pipeline.stage_position(stage), seed=self.seed, epoch=batch.epoch,
                              index=batch.index, keys=lambda: [samples[i].key for i in kept],
                              layout=self.pipeline.layout)
        try:
            if stage.is_async:
                out = await stage.fn(data, **extras)
            elif self._cuda:
                out, ready = await self._calls.call_on_stream(data, ready, lambda: stage.fn(data, **extras))
            else:
                out = await self._calls.call(stage.fn, data, **extras)
            out = checked_batch(out, rows=len(kept))
        except Exception as exc:
            for i in kept:
                failures[i] = stage_failure(stage, samples[i], exc)
            return {}, [], None
        return out, kept, ready

    async def drain(self) -> None:
        """Cancel stage calls not started, wait for running ones, then drain ``inner``."""
        try:
            await self._calls.drain()
        finally:
            if self.inner is not None:
                await self.inner.drain()

    async def aclose(self) -> None:
        """Drain, join the threads, close ``inner``. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._calls.aclose()
        finally:
            if self.inner is not None:
                await self.inner.aclose()


def _store_fields(samples: list[Sample], i: int, out: Any) -> None:
    """A ``Map`` before Decode returned ``out``: sample ``i``'s new fields (a new Sample: the reader's stays as it was)."""
    if not isinstance(out, dict):
        raise TypeError(f"returned {type(out).__name__}, not a dict of fields")
    sample = samples[i]
    samples[i] = Sample(sample.key, out, sample.source, sample.index, sample.position)


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


def _sample_error(kind: type[LoaderError], sample: Sample, message: str) -> LoaderError:
    return kind(message, key=sample.key, source=sample.source)
