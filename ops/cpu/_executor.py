"""The CPU executor: a batch split into chunks, each chunk one call in a worker thread.

A chunk's thread decodes each image (nvImageCodec's CPU backend for JPEG, only the window the ops
read, see ``cpu/_decode.py``; Pillow for the rest and as the fallback), applies the geometry with
torch on the uint8 pixels (``cpu/_ops.py``), then normalises it straight into its row of the
preallocated batch tensor, while the pixels are still in cache. The event loop sees one await
per chunk, never one per sample.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from headrace._errors import ClosedError, DecodeError, LoaderError, TransformError, require_int
from headrace._sample import SampleBatch
from headrace._threads import gather_jobs, join_threads

from .. import _pillow
from .._geometry import output_error
from .._limits import ByteBudget, release_frames
from .._nvimgcodec import nvimgcodec
from .._pipeline import Pipeline
from .._iou_crop import op_randoms
from .._results import (Processed, check_fields, field_columns, image_field, named, read_failure, sample_label,
                       split_evenly)
from . import _ops, _post
from ._buffers import BatchBuffers
from ._decode import Header, JpegDecoders
from ._omp import limit_openmp_threads

__all__ = ["CpuExecutor", "Processed"]

_GROUP = 16  # samples decoded together before they are transformed (fewer where the byte budget says)


@dataclass(slots=True)
class _Job:
    """One sample through decode: its image bytes; its nvImageCodec header and window, or its
    Pillow header (``opened``); the decoded bytes predicted from the header; then its pixels (only
    the window's when ``window`` is set)."""

    i: int
    data: Any
    header: Header | None = None
    window: tuple[int, int, int, int] | None = None
    opened: _pillow.Opened | None = None
    nbytes: int = 0
    pixels: torch.Tensor | None = None


@dataclass(slots=True)
class _Chunk:
    """What one chunk's thread works with: its samples (rows ``lo`` on in the batch), their
    uniforms, and where results and failures go."""

    samples: list[Any]
    lo: int
    randoms: list[np.ndarray | None]
    post: list[list[np.ndarray | None]]  # each augmented view's uniforms of the post ops (``Pipeline.splits``)
    out: torch.Tensor | None
    rows: list[Any]
    failures: list[tuple[int, LoaderError]]
    scratch: torch.Tensor | None = None


class CpuExecutor:
    """Runs a pipeline on the CPU with ``num_threads`` worker threads.

    ``run`` may be awaited for several batches at once; their chunks share the threads. The
    executor lives as long as its loader, across epochs: ``drain`` (between epochs, when no ``run``
    is awaited) cancels queued chunks and waits for running ones; ``aclose`` also joins the threads
    and releases their decoders.

    Limits (``pipeline.decode``): a header claiming more than ``max_pixels``, or ops that would make
    a larger image, fail their sample before decoding; the decoded pixels all threads hold at once
    stay within ``max_batch_bytes`` (predicted from the headers; see ``_limits.ByteBudget``).

    JPEGs are decoded by nvImageCodec's CPU backend when ``nvidia.nvimgcodec`` imports and the
    pipeline asks for RGB, by Pillow otherwise; both give the same pixels (libjpeg-turbo, same
    settings). Geometry is torchvision's on uint8 tensors (antialiased bilinear resize).
    """

    def __init__(self, pipeline: Pipeline, *, num_threads: int, seed: int, name: str = "headrace-cpu") -> None:
        num_threads = require_int("CpuExecutor: num_threads", num_threads)
        self.pipeline = pipeline
        self.seed = seed
        self.num_threads = num_threads
        self._jpeg: JpegDecoders | None = None
        if pipeline.decode.color == "rgb":
            nvc = nvimgcodec()
            if nvc is not None:
                self._jpeg = JpegDecoders(nvc, exif=pipeline.decode.exif, max_pixels=pipeline.decode.max_pixels)
        self._budget = ByteBudget(pipeline.decode.max_batch_bytes)
        self._buffers = BatchBuffers()
        # Each worker runs torch's kernels on one OpenMP thread (see _cpu_omp).
        self._pool = concurrent.futures.ThreadPoolExecutor(
            num_threads, thread_name_prefix=name, initializer=limit_openmp_threads
        )
        self._running: set[concurrent.futures.Future[Any]] = set()
        self._closed = False
        size = pipeline.output_size()
        # uint8 rows are written as the HWC pixels they are and handed out as an NCHW view
        # (channels-last memory) when CHW is asked for; normalised rows are written in their layout.
        layout = pipeline.layout if pipeline.normalize is not None else "HWC"
        self._out_shape = None if size is None else _row_shape(size, pipeline.channels, layout)
        norm = pipeline.normalize
        if norm is not None:
            self._mean = torch.tensor(norm.mean, dtype=torch.float32).mul_(255.0)
            self._inv_std = 1.0 / torch.tensor(norm.std, dtype=torch.float32).mul_(255.0)
            shape = (-1, 1, 1) if norm.layout == "CHW" else (1, 1, -1)
            self._mean, self._inv_std = self._mean.reshape(shape), self._inv_std.reshape(shape)

    async def run(self, batch: SampleBatch) -> Processed:
        """Decode and transform ``batch``; per-sample failures come back in ``Processed.failures``.

        A sample that arrives with ``error`` set (its read failed) is a failure with that error.
        Cancelled, it cancels its chunks that have not started (``drain`` waits for running ones).
        Raises ClosedError after ``aclose()``.
        """
        if self._closed:
            raise ClosedError("CpuExecutor.run after aclose()")
        n = len(batch.samples)
        out = None
        splits = self.pipeline.splits
        if self._out_shape is not None:  # with splits, view-major: each view's rows are one block
            out = self._buffers.tensor((*((splits,) if splits > 1 else ()), n, *self._out_shape), self.pipeline.dtype)
        rows: list[Any] = [None] * n
        labels: list[int] | None = [0] * n if self.pipeline.label_field is not None else None
        failures: list[tuple[int, LoaderError]] = []
        chunks = split_evenly(n, max(1, min(n, 2 * self.num_threads)))
        futures = [self._submit(self._process_chunk, batch, lo, hi, out, rows, labels, failures) for lo, hi in chunks]
        await gather_jobs(futures)  # cancelled: chunks not started are dropped, drain() waits for running ones
        failed = {row for row, _ in failures}
        kept = [i for i in range(n) if i not in failed]
        images: Any
        if out is not None:
            if splits > 1:  # [B, splits, ...] over the view-major memory (Pipeline's docstring)
                images = (out if not failed else out[:, kept]).transpose(0, 1)
            else:
                images = out if not failed else out[kept]
            if self.pipeline.normalize is None and self.pipeline.layout == "CHW":
                images = images.movedim(-1, -3)  # a view: NCHW in channels-last memory
        else:
            images = [rows[i] for i in kept]
        data: dict[str, Any] = {"image": images}
        if labels is not None:
            data["label"] = torch.tensor([labels[i] for i in kept], dtype=torch.int64)
        data.update(field_columns(batch.samples, kept, self.pipeline.fields))
        return Processed(data, kept, sorted(failures, key=lambda f: f[0]))

    def _submit(self, fn, *args) -> concurrent.futures.Future[Any]:
        fut = self._pool.submit(fn, *args)
        self._running.add(fut)
        fut.add_done_callback(self._running.discard)
        return fut

    def _process_chunk(self, batch: SampleBatch, lo: int, hi: int, out, rows, labels, failures) -> None:
        samples = batch.samples[lo:hi]
        pipe = self.pipeline
        indices = np.fromiter((s.index for s in samples), dtype=np.int64, count=len(samples))
        randoms = op_randoms(pipe.image_ops, self.seed, batch.epoch, indices, samples)
        post = [pipe.post_uniforms(self.seed, batch.epoch, indices, split) for split in pipe.augmented_views]
        chunk = _Chunk(samples, lo, randoms, post, out, rows, failures)
        # Decode a group, then transform it: measured 3-13% faster than alternating decode and
        # transforms image by image (each library's code stays hot). The group's decoded bytes,
        # predicted from the headers, are held from the executor's budget while it is decoded and
        # transformed; a group over the budget is decoded in parts.
        for start in range(0, len(samples), _GROUP):
            jobs = [job for i in range(start, min(start + _GROUP, len(samples)))
                    if (job := self._header(chunk, i, labels)) is not None]
            while jobs:
                retry: list[_Job] = []
                for part in _parts(jobs, self._budget.limit):
                    with self._budget.hold(sum(job.nbytes for job in part)):
                        retry += self._decode(chunk, part)
                        for job in part:
                            if job.pixels is not None:
                                self._transform(chunk, job)
                jobs = retry  # JPEGs nvImageCodec failed on: Pillow's turn, with Pillow's prediction

    def _header(self, chunk: _Chunk, i: int, labels) -> _Job | None:
        """Sample ``i``'s label and image header, checked against the limits (pixels claimed, end of
        file, output sizes), as a ``_Job``; None when it failed (the failure is recorded)."""
        pipe = self.pipeline
        sample = chunk.samples[i]
        try:
            if sample.error is not None:
                raise read_failure(sample)
            if labels is not None:
                labels[chunk.lo + i] = sample_label(sample, pipe.label_field)
            check_fields(sample, pipe.fields)
            job = _Job(i, image_field(sample, pipe.image_fields))
            ops = pipe.image_ops
            header = self._jpeg.header(job.data, sample.key, sample.source) if self._jpeg is not None else None
            if header is not None:
                u = chunk.randoms[0][i] if ops and chunk.randoms[0] is not None else None
                job.header, job.window = header, _ops.leading_window(ops, header.height, header.width, u)
                h, w = header.height, header.width
                ch, cw = (h, w) if job.window is None else job.window[2:]
                # The region, and up to two more of its size inside nvImageCodec (measured: 2x for
                # clean files, 3x for some damaged ones) or for rot90's copy.
                job.nbytes = 3 * 3 * ch * cw
            else:
                job.opened = _pillow.open_image(job.data, pipe.decode, sample.key, sample.source)
                h, w = job.opened.height, job.opened.width
                job.nbytes = job.opened.predicted_bytes(pipe.channels)
            reason = output_error(h, w, ops, pipe.decode.max_pixels)
            if reason is not None:
                raise TransformError(reason, key=sample.key, source=sample.source)
            return job
        except Exception as exc:  # noqa: BLE001 - a surprise reading one header fails that sample only
            chunk.failures.append((chunk.lo + i, _decode_failure(exc, sample)))
        return None

    def _decode(self, chunk: _Chunk, part: list[_Job]) -> list[_Job]:
        """Decode the jobs of ``part`` (their HWC uint8 pixels into ``job.pixels``; failures recorded).

        nvImageCodec decodes the JPEGs it takes (only the window when the first op is a crop inside
        the image), in one call; Pillow decodes the others whole. Returns the JPEGs nvImageCodec
        failed on, opened for Pillow, to be decoded with their own budget.
        """
        pipe = self.pipeline
        fast = [job for job in part if job.header is not None]
        retry = []
        if fast:
            for job, pixels in zip(fast, self._jpeg.decode([(job.header, job.window) for job in fast])):
                job.pixels = pixels
                if pixels is None:
                    retry.append(job)
        for job in part:
            if job.opened is None:
                continue
            try:
                job.pixels = _pillow.pixels(job.opened, pipe.decode)
            except Exception as exc:  # noqa: BLE001 - DecodeError, or a surprise: this sample's failure
                chunk.failures.append((chunk.lo + job.i, _decode_failure(exc, chunk.samples[job.i])))
            finally:
                job.opened = None  # the Pillow image: its memory goes now
        for job in retry:
            sample = chunk.samples[job.i]
            job.header = job.window = None
            try:
                job.opened = _pillow.open_image(job.data, pipe.decode, sample.key, sample.source)
                job.nbytes = job.opened.predicted_bytes(pipe.channels)
            except Exception as exc:  # noqa: BLE001
                chunk.failures.append((chunk.lo + job.i, _decode_failure(exc, sample)))
        return [job for job in retry if job.opened is not None]

    def _transform(self, chunk: _Chunk, job: _Job) -> None:
        """Run the image ops and post ops on ``job.pixels`` and write the result into its row."""
        pipe = self.pipeline
        i, pixels = job.i, job.pixels
        job.pixels = None
        sample, row = chunk.samples[i], chunk.lo + i
        us = [None if u is None else u[i] for u in chunk.randoms]
        try:
            ops = pipe.image_ops
            if job.window is not None:  # the first op's window is what was decoded
                pixels = _ops.after_leading_window(pixels, ops[0])
                pixels = _ops.apply_image_ops(pixels, ops[1:], us[1:])
            else:
                pixels = _ops.apply_image_ops(pixels, ops, us)
            if pipe.splits > 1:  # the clean view, then each augmented view from the same pixels
                views = [pixels] + [_post.apply(pixels, pipe.post_ops, [None if u is None else u[i : i + 1] for u in us])
                                    for us in chunk.post]
                for view, target in zip(views, chunk.out[:, row]):
                    _, chunk.scratch = self._finish(view, target, chunk.scratch)
                return
            if pipe.post_ops:
                pixels = _post.apply(pixels, pipe.post_ops, [None if u is None else u[i : i + 1] for u in chunk.post[0]])
            target = chunk.out[row] if chunk.out is not None else None
            chunk.rows[row], chunk.scratch = self._finish(pixels, target, chunk.scratch)
        except LoaderError as exc:
            chunk.failures.append((row, named(release_frames(exc), sample)))
        except Exception as exc:  # noqa: BLE001 - MemoryError, a torch error: this sample's failure
            err = TransformError(f"{type(exc).__name__}: {exc}", key=sample.key, source=sample.source)
            err.__cause__ = exc
            chunk.failures.append((row, release_frames(err, keep_text=True)))

    def _finish(self, pixels: torch.Tensor, target: torch.Tensor | None, scratch):
        """Write one HWC uint8 image into ``target`` (or a new tensor), normalised and laid out."""
        norm = self.pipeline.normalize
        layout = "HWC" if norm is None else norm.layout
        if target is not None and tuple(target.shape) != _row_shape(pixels.shape[:2], pixels.shape[2], layout):
            raise TransformError(f"image is {tuple(pixels.shape)} (HWC) after the ops, expected {tuple(target.shape)}")
        if norm is None:
            if target is None:  # a copy only where ``pixels`` views a larger buffer (a crop) or is strided
                pixels = pixels.contiguous()
                return (pixels.permute(2, 0, 1) if self.pipeline.layout == "CHW" else pixels), scratch
            target.copy_(pixels)
            return None, scratch
        src = pixels.permute(2, 0, 1) if norm.layout == "CHW" else pixels
        if target is None:
            target = torch.empty(src.shape, dtype=norm.dtype)
            result = target
        else:
            result = None
        if target.dtype == torch.float32:
            torch.sub(src, self._mean, out=target).mul_(self._inv_std)
        else:
            if scratch is None or scratch.shape != src.shape:
                scratch = torch.empty(src.shape, dtype=torch.float32)
            torch.sub(src, self._mean, out=scratch).mul_(self._inv_std)
            target.copy_(scratch)
        return result, scratch

    async def drain(self) -> None:
        """Cancel the chunks ``run`` submitted that have not started, and wait until none is running.

        Safe to call when idle; when cancelled it still waits, then re-raises. Afterwards the
        executor takes new ``run`` calls.
        """
        running = list(self._running)
        for fut in running:
            fut.cancel()
        await join_threads(running)

    async def aclose(self) -> None:
        """Cancel queued chunks, wait for running ones, join the threads. Safe to call twice, and
        it finishes its work when cancelled (a second call returns at once, so it must)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            await join_threads(list(self._running))
        finally:
            # Cancelled or not: the threads only finish the chunk each holds (the queued ones were
            # cancelled), so this wait is short; and the JPEG decoders must outlive them.
            self._pool.shutdown(wait=True)
            self._buffers.clear()
            if self._jpeg is not None:
                self._jpeg.close()


def _decode_failure(exc: Exception, sample) -> LoaderError:
    """``exc`` as the sample's LoaderError: its own when it is one, else a DecodeError caused by it.
    Either way the frames it passed through let go of their pixels (``release_frames``)."""
    if isinstance(exc, LoaderError):
        return named(release_frames(exc), sample)
    err = DecodeError(f"{type(exc).__name__}: {exc}", key=sample.key, source=sample.source)
    err.__cause__ = exc
    return release_frames(err, keep_text=True)  # a surprise: where it came from stays readable


def _row_shape(size, channels: int, layout: str) -> tuple[int, int, int]:
    h, w = int(size[0]), int(size[1])
    return (channels, h, w) if layout == "CHW" else (h, w, channels)


def _parts(jobs: list[_Job], limit: int | None) -> list[list[_Job]]:
    """``jobs`` in order, cut where a part's predicted bytes would pass ``limit`` (a job over it alone)."""
    if limit is None:
        return [jobs]
    parts: list[list[_Job]] = []
    total = limit + 1
    for job in jobs:
        if total + job.nbytes > limit:
            parts.append([])
            total = 0
        parts[-1].append(job)
        total += job.nbytes
    return parts
