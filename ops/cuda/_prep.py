"""The GPU path's prep thread: which samples of a batch go on, their headers, plans, windows and parts.

Runs in the executor's prep thread, vectorised over the batch where it can (per-image Python is
paid under the GIL, beside the lanes). Before any pixel memory is allocated, a sample must pass
what the CPU path checks too:

- its read succeeded; it has the label field (when the pipeline reads labels), the pass-through
  fields and a non-empty image field;
- its header's width x height is within ``Decode.max_pixels`` (else a DecodeError naming the
  claimed size, ``_limits.pixel_error``), read by nvImageCodec before any decode;
- a file goes to nvImageCodec only when it is a JPEG that ends with its EOI marker, the CPU
  path's rule (``_limits.incomplete``): a window decode stops after the window's last row, so a
  file cut below it would decode (nvJPEG fills what is missing with grey), and that holds at
  least a bit for each 8x8 block its header claims (``too_short``). The others, and every other
  format, go to Pillow (in the executor's Pillow threads), which checks the same rules and
  raises the typed error;
- every image the ops make is within ``max_pixels`` (else a TransformError; ``_geometry.output_pixels``).

Then, when the batch's decode windows need more than a lane's share of ``Decode.max_batch_bytes``,
the parts the lane decodes it in (``parts``).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import numpy as np
import torch
from headrace._errors import DecodeError, LoaderError, TransformError
from headrace._sample import SampleBatch

from .. import _pillow
from .._geometry import output_error, output_pixels, plan_batch, roi_batch
from .._gil import columns, zeros
from .._limits import MAX_SIDE, ByteBudget, pixel_error, too_few_bits
from .._pipeline import Pipeline
from .._iou_crop import op_randoms
from .._results import check_fields, image_field, read_failure, sample_label
from ._post_passes import PlannedPost, plan_post

__all__ = ["PillowThreads", "Prepared", "cut_short", "kernel_tables", "lane_budget", "parts", "prepare", "too_short"]

_SOI, _EOI = b"\xff\xd8", b"\xff\xd9"
_head = operator.itemgetter(slice(0, 2))
_tail = operator.itemgetter(slice(-2, None))
_ALIGN = 256  # each window starts on a 256-byte boundary of a lane's workspace (``NativeDecoder.buffers``)


@dataclass
class Prepared:
    """One batch, ready for a lane: what survived, its parsed headers, plans and decode windows."""

    batch: SampleBatch
    rows: list[int]  # batch rows still in the running
    indices: np.ndarray  # their samples' dataset indices (int64), which key the random draws
    label_array: np.ndarray | None  # the labels as int64 (None: the pipeline reads no labels)
    failures: list[tuple[int, LoaderError]]
    token: Any  # the header reader's parsed batch; None once given back (``release``)
    parse_idx: np.ndarray  # rows' positions in the parsed batch
    on_gpu: np.ndarray  # nvImageCodec decodes it (else Pillow already did)
    pillow: dict[int, torch.Tensor | LoaderError]  # Pillow's window (HWC uint8, host) or the sample's error, by row
    regions: np.ndarray  # (y0, x0, y1, x1) decode windows
    meta: np.ndarray  # the fused kernel's tables (``kernel_tables``), but the row strides
    geo: np.ndarray
    parts: list[tuple[int, int]] | None  # row ranges decoded one after another; None: the batch at once
    recycle: Callable[[Any], None] | None = None  # gives ``token`` back to its header reader
    # The post ops planned for every row at the fixed output size (``plan_post``), one plan an
    # augmented view (``Pipeline.splits``: more than one with splits).
    post: tuple[PlannedPost, ...] | None = None

    def release(self) -> None:
        """Give the parsed headers back (once; later calls do nothing)."""
        token, self.token = self.token, None
        if token is not None and self.recycle is not None:
            self.recycle(token)


def _jpeg_heads(data: list) -> np.ndarray:
    return np.fromiter(map(operator.eq, map(_head, data), repeat(_SOI)), dtype=bool, count=len(data))


def cut_short(data: list) -> np.ndarray:
    """For each blob: True when it starts as a JPEG (SOI) and does not end with EOI, the JPEG case of
    ``_limits.incomplete`` without a Python call per blob (C-level maps over the list; bytes and
    memoryviews alike)."""
    ended = np.fromiter(map(operator.eq, map(_tail, data), repeat(_EOI)), dtype=bool, count=len(data))
    return _jpeg_heads(data) & ~ended


def too_short(data: list, sizes: np.ndarray) -> np.ndarray:
    """For each blob: True when it is a JPEG too short for the size it claims (``_limits.too_few_bits``)."""
    lengths = np.fromiter(map(len, data), dtype=np.int64, count=len(data))
    return _jpeg_heads(data) & too_few_bits(lengths, sizes[:, 0], sizes[:, 1])


def lane_budget(max_batch_bytes: int | None) -> int | None:
    """A lane's bytes for one batch's decoded windows: half of ``max_batch_bytes``, as a lane keeps
    two workspaces (batch i decodes while batch i-1's kernel may still read the other)."""
    return None if max_batch_bytes is None else max(1, max_batch_bytes // 2)


def window_bytes(regions: np.ndarray, channels: int) -> np.ndarray:
    """Bytes each decode window takes in a lane's workspace, aligned as ``NativeDecoder.buffers`` lays them."""
    sizes = (regions[:, 2] - regions[:, 0]).astype(np.int64) * (regions[:, 3] - regions[:, 1]) * channels
    return (sizes + _ALIGN - 1) // _ALIGN * _ALIGN


def parts(regions: np.ndarray, channels: int, budget: int | None) -> list[tuple[int, int]] | None:
    """None when the windows of the whole batch fit ``budget`` bytes (the common case, one sum);
    else consecutive row ranges, each within it (a window larger than the budget alone in its part)."""
    if budget is None or len(regions) == 0:
        return None
    cum = np.cumsum(window_bytes(regions, channels))
    if int(cum[-1]) <= budget:
        return None
    out, lo, base, n = [], 0, 0, len(cum)
    while lo < n:
        hi = max(int(np.searchsorted(cum, base + budget, side="right")), lo + 1)
        out.append((lo, hi))
        lo, base = hi, int(cum[hi - 1])
    return out


@dataclass
class PillowThreads:
    """Where the prep thread has Pillow decode (it releases the GIL): ``pool``'s threads, whose
    decodes together hold at most ``budget`` (the executor's ``max_batch_bytes``)."""

    pool: Executor
    budget: ByteBudget


def prepare(batch: SampleBatch, pipe: Pipeline, headers: Any, seed: int, seconds: Any,
            threads: PillowThreads | None = None) -> Prepared:
    """Labels, headers and each sample's crop plan and decode window (in the prep thread); Pillow's
    windows decoded in ``threads`` (else here)."""
    t0 = time.perf_counter()
    samples = batch.samples
    failures: list[tuple[int, LoaderError]] = []
    rows, data, labels = [], [], []
    for row, sample in enumerate(samples):
        try:
            if sample.error is not None:
                raise read_failure(sample)
            label = sample_label(sample, pipe.label_field) if pipe.label_field is not None else None
            check_fields(sample, pipe.fields)
            blob = image_field(sample, pipe.image_fields)
            if len(blob) == 0:
                raise DecodeError("empty file: nothing to decode", key=sample.key, source=sample.source)
        except LoaderError as exc:
            failures.append((row, exc))
            continue
        rows.append(row)
        data.append(blob)
        labels.append(label)
    token, info = headers.parse(data)
    t1 = time.perf_counter()
    try:
        return _plan(batch, pipe, seed, rows, data, labels, failures, token, info, headers.recycle, seconds, t0, t1, threads)
    except BaseException:
        headers.recycle(token)
        raise


def _plan(batch, pipe, seed, rows, data, labels, failures, token, info, recycle, seconds, t0, t1, threads) -> Prepared:
    samples = batch.samples
    limit = pipe.decode.max_pixels
    sizes = columns([info[:, 0], info[:, 1]], np.int64)  # whole-array NumPy calls give up the GIL: ``_gil``
    parsed = info[:, 3] == 1
    alive = np.ones(len(rows), dtype=bool)
    # A header nvImageCodec read: its claim checked as the CPU path does (``_limits.pixel_error``).
    refused = parsed & ((np.minimum(sizes[:, 0], sizes[:, 1]) < 1) | (np.maximum(sizes[:, 0], sizes[:, 1]) > MAX_SIDE))
    if limit is not None:
        refused |= parsed & (sizes[:, 0] * sizes[:, 1] > limit)
    for i in np.flatnonzero(refused).tolist():
        sample = samples[rows[i]]
        why = pixel_error(int(sizes[i, 1]), int(sizes[i, 0]), limit)
        failures.append((rows[i], DecodeError(why, key=sample.key, source=sample.source)))
        alive[i] = False
    # Pillow decodes, once (its error is the sample's), what nvImageCodec must not decode:
    # - formats other than JPEG, as on the CPU path: nvImageCodec's CPU codecs crashed the process
    #   on damaged PNGs in fuzzing on the H100 (libpng: "Not enough image data"), and batches
    #   mixing its codecs hung ("Processing results for sample 11 was already set");
    # - a file that does not end where its format says (``_limits.incomplete``);
    # - a JPEG too short for the size it claims (``too_short``).
    to_pillow = alive & ~(parsed & _jpeg_heads(data))
    to_pillow |= alive & cut_short(data)
    to_pillow |= alive & parsed & too_short(data, sizes)
    opened: dict[int, _pillow.Opened] = {}  # headers only: the pixels are decoded once the windows are known
    for i in np.flatnonzero(to_pillow).tolist():
        sample = samples[rows[i]]
        try:
            opened[i] = _pillow.open_image(data[i], pipe.decode, sample.key, sample.source)
        except LoaderError as exc:
            failures.append((rows[i], exc))
            alive[i] = False
            continue
        sizes[i] = (opened[i].height, opened[i].width)
    # Contiguous columns: NumPy gathers rows of a 2-D array by an index array with the GIL let go.
    heights, widths = sizes[:, 0].copy(), sizes[:, 1].copy()
    if limit is not None:  # what the ops would make, bounded as the files are (as on the CPU path)
        idx = np.flatnonzero(alive)
        for i in idx[output_pixels(heights[idx], widths[idx], pipe.image_ops) > limit].tolist():
            sample = samples[rows[i]]
            why = output_error(int(sizes[i, 0]), int(sizes[i, 1]), pipe.image_ops, limit)
            failures.append((rows[i], TransformError(why, key=sample.key, source=sample.source)))
            alive[i] = False
            if i in opened:
                opened.pop(i).img.close()
    kept = np.flatnonzero(alive)
    # Geometry for the whole batch at once, keyed on each sample's index.
    indices = np.fromiter((samples[rows[i]].index for i in kept.tolist()), dtype=np.int64, count=len(kept))
    randoms = op_randoms(pipe.image_ops, seed, batch.epoch, indices, [samples[rows[i]] for i in kept.tolist()])
    heights, widths = heights[kept], widths[kept]
    plans = plan_batch(heights, widths, pipe.image_ops, randoms)
    regions = roi_batch(plans, heights, widths, np.int32)
    meta, geo = kernel_tables(plans, regions)
    keep = kept.tolist()
    pillow = _decode_windows(opened, keep, regions, pipe, threads)
    t2 = time.perf_counter()
    size = pipe.output_size() if pipe.post_ops else None
    post = None
    if size is not None:  # one plan an augmented view (``Pipeline.splits``)
        post = tuple(plan_post(pipe, seed, batch.epoch, indices, size, split) for split in pipe.augmented_views)
        post = None if post[0] is None else post
    seconds["parse"] += t1 - t0
    seconds["plan"] += t2 - t1
    seconds["post_plan"] += time.perf_counter() - t2
    return Prepared(
        batch=batch,
        rows=[rows[i] for i in keep],
        indices=indices,
        label_array=None if pipe.label_field is None else np.array([labels[i] for i in keep], dtype=np.int64),
        failures=failures,
        token=token,
        parse_idx=kept.astype(np.int32),
        on_gpu=~to_pillow[kept],
        pillow=pillow,
        regions=regions,
        meta=meta,
        geo=geo,
        parts=parts(regions, pipe.channels, lane_budget(pipe.decode.max_batch_bytes)),
        recycle=recycle,
        post=post,
    )


def _decode_windows(opened: dict[int, Any], keep: list[int], regions: np.ndarray, pipe: Pipeline,
                    threads: PillowThreads | None) -> dict[int, torch.Tensor | LoaderError]:
    """Pillow's decode of the kept samples ``opened`` holds, cut to their windows: by position in
    ``keep``, an HWC uint8 window or the sample's DecodeError. Decoded in ``threads`` (whose
    decodes together stay within its budget) while the windows kept stay within a lane's share of
    ``max_batch_bytes``; the others are left out, for the lane to decode one at a time."""
    share = lane_budget(pipe.decode.max_batch_bytes)
    jobs, held = [], 0
    for j, i in enumerate(keep):
        image = opened.pop(i, None)
        if image is None:
            continue
        y0, x0, y1, x1 = (int(v) for v in regions[j])
        nbytes = (y1 - y0) * (x1 - x0) * pipe.channels
        if share is not None and held + nbytes > share:
            image.img.close()
            continue
        held += nbytes
        jobs.append((j, image, (y0, x0, y1, x1)))
    budget = threads.budget if threads is not None else ByteBudget(None)

    def window(job: tuple[int, Any, tuple[int, int, int, int]]) -> torch.Tensor | LoaderError:
        _, image, (y0, x0, y1, x1) = job
        try:
            with budget.hold(image.predicted_bytes(pipe.channels)):
                return _pillow.pixels(image, pipe.decode)[y0:y1, x0:x1].clone()
        except LoaderError as exc:
            return exc

    windows = threads.pool.map(window, jobs) if threads is not None and len(jobs) > 1 else map(window, jobs)
    return {job[0]: result for job, result in zip(jobs, windows)}


def kernel_tables(plans, regions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The fused kernel's per-sample tables (``_kernels.py``), row strides left 0 for the lane:
    meta = (height, width, row stride, flip_h, flip_v, out_h, out_w, 0) of the decoded window and
    the output; geo = the box to read and the real pixels (outside them: zero padding), in window
    coordinates."""
    zero = zeros(len(regions), np.int32)
    meta = columns([regions[:, 2] - regions[:, 0], regions[:, 3] - regions[:, 1], zero, plans.flip_h, plans.flip_v,
                    plans.out_h, plans.out_w, zero], np.int32)
    # Column by column, as ``_gil.columns``: the box and clip less the window's origin (x, y, x, y).
    x0, y0 = regions[:, 1].astype(np.float64), regions[:, 0].astype(np.float64)
    origin = (x0, y0, x0, y0)
    geo = columns([plans.box[:, k] - origin[k] for k in range(4)] + [plans.clip[:, k] - origin[k] for k in range(4)],
                  np.float32)
    return meta, geo
