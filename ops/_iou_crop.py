"""``RandomIoUCrop``: a crop window chosen against the sample's boxes, and the random numbers
of every geometry op of a batch.

The window depends on the boxes, which only the stage executor reads (``_follow``), so it chooses
each sample's window before decoding and hands it to the image executor in the sample itself,
in the field ``WINDOW_FIELD``: ``op_randoms`` then gives the op that window, ``(top, left,
height, width)``, where other ops get their uniforms, and the fold (``plan_batch``), the CPU ops
and the boxes all crop it alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._random import uniforms
from ._spec import Op, RandomIoUCrop

__all__ = ["WINDOW_FIELD", "choose_window", "choose_windows", "op_randoms"]

WINDOW_FIELD = "__headrace_iou_window__"

# The most (samples x draws x trials x boxes) one pass of ``choose_windows`` holds in each array.
_BLOCK_ELEMENTS = 1 << 18


def op_randoms(ops: tuple[Op, ...], seed: int, epoch: int, indices: np.ndarray, samples: Any) -> list[np.ndarray | None]:
    """Each geometry op's per-sample numbers for ``samples`` (sample indices ``indices``): its
    uniforms, or for ``RandomIoUCrop`` each sample's chosen window."""
    out: list[np.ndarray | None] = []
    for pos, op in enumerate(ops, start=1):
        if isinstance(op, RandomIoUCrop):
            out.append(np.array([s.fields[WINDOW_FIELD] for s in samples], dtype=np.float64).reshape(-1, 4))
        else:
            out.append(uniforms(seed, epoch, pos, indices, op.randoms) if op.randoms else None)
    return out


def choose_window(op: RandomIoUCrop, height: int, width: int, boxes: np.ndarray, seed: int, epoch: int,
                  position: int, index: int) -> tuple[tuple[int, int, int, int], np.ndarray]:
    """One sample's window: ``choose_windows`` for a batch of one."""
    return choose_windows(op, [height], [width], [boxes], seed, epoch, position, np.array([index]))[0]


def choose_windows(op: RandomIoUCrop, heights: Sequence[int], widths: Sequence[int], boxes: Sequence[np.ndarray],
                   seed: int, epoch: int, position: int, indices: np.ndarray
                   ) -> list[tuple[tuple[int, int, int, int], np.ndarray]]:
    """Each sample's window ``(top, left, height, width)`` (the whole image when none is taken)
    and which of its boxes (x0, y0, x1, y1) stay: those whose centres lie inside it.

    torchvision's search, for a whole batch at once: each draw picks an overlap and tries
    ``op.trials`` windows for every sample still without one, as one array pass over (samples,
    draws, trials, boxes); a sample's first passing trial is taken. Its numbers are its own
    (``uniforms`` keyed by seed, epoch, the op and the sample index; draw ``d`` takes the d-th run
    of them), so a sample's window does not depend on its batch. A sample at a time, this was
    ~100 µs of NumPy calls holding the GIL a sample, and 0.4-0.7 ms under the GPU path's threads.

    The samples go in slices of similar box counts, each padded to its own most, and small enough
    that an array of a slice stays within ``_BLOCK_ELEMENTS``: one image of a thousand boxes in a
    batch makes its own slice, not every sample's arrays a thousand boxes wide.
    """
    n = len(indices)
    out: list[tuple[tuple[int, int, int, int], np.ndarray]] = [((0, 0, 0, 0), np.zeros(0, bool))] * n
    counts = np.array([len(b) for b in boxes], dtype=np.int64)
    order = np.argsort(counts, kind="stable")
    lo = 0
    while lo < n:
        hi = lo + 1  # the slice order[lo:hi]: its widest sample is its last
        while hi < n and (hi + 1 - lo) * op.trials * max(int(counts[order[hi]]), 1) <= _BLOCK_ELEMENTS:
            hi += 1
        part = order[lo:hi].tolist()
        chosen = _choose_slice(op, [int(heights[i]) for i in part], [int(widths[i]) for i in part],
                               [boxes[i] for i in part], seed, epoch, position, np.asarray(indices)[part])
        for i, result in zip(part, chosen):
            out[i] = result
        lo = hi
    return out


def _choose_slice(op: RandomIoUCrop, heights: list[int], widths: list[int], boxes: list[np.ndarray],
                  seed: int, epoch: int, position: int, indices: np.ndarray
                  ) -> list[tuple[tuple[int, int, int, int], np.ndarray]]:
    """``choose_windows`` for samples whose padded arrays fit in one pass."""
    n = len(indices)
    height, width = np.asarray(heights, dtype=np.int64), np.asarray(widths, dtype=np.int64)
    counts = [len(b) for b in boxes]
    most = max(counts, default=0)
    padded = np.zeros((n, most, 4))
    real = np.zeros((n, most), dtype=bool)  # the padding is no box
    for i, b in enumerate(boxes):
        padded[i, : counts[i]] = b
        real[i, : counts[i]] = True
    x0, y0, x1, y1 = (padded[:, None, None, :, k] for k in range(4))  # (n, 1, 1, boxes): every draw and trial at once
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    area = (x1 - x0) * (y1 - y0)
    windows = np.stack([np.zeros(n, np.int64), np.zeros(n, np.int64), height, width], axis=1)
    kept = real.copy()  # the whole image keeps every box
    options = np.asarray(op.sampler_options, dtype=np.float64)
    trials = op.trials
    per_draw = 1 + 4 * trials  # the overlap's pick, then each trial's two scales and two places
    todo = np.arange(n)
    draw = 0
    while len(todo) and draw < op.draws:
        # Draws in doubling blocks (1, 1, 2, 4, ...): most samples pass in their first draw or
        # two, a few need dozens, and a pass costs ~30 NumPy calls whatever its block.
        block = min(op.draws - draw, max(1, draw), max(1, _BLOCK_ELEMENTS // (len(todo) * trials * max(most, 1))))
        k = len(todo)
        u = uniforms(seed, epoch, position, np.asarray(indices)[todo], block * per_draw,
                     first=draw * per_draw).reshape(k, block, per_draw)
        overlap = options[(u[..., 0] * len(options)).astype(np.int64)]  # (k, block)
        scale = op.min_scale + (op.max_scale - op.min_scale) * u[..., 1 : 1 + 2 * trials].reshape(k, block, trials, 2)
        place = u[..., 1 + 2 * trials :].reshape(k, block, trials, 2)
        w, h = width[todo, None, None], height[todo, None, None]
        new_w, new_h = (w * scale[..., 0]).astype(np.int64), (h * scale[..., 1]).astype(np.int64)
        aspect = new_w / np.maximum(new_h, 1)
        ok = (new_h > 0) & (op.min_aspect_ratio <= aspect) & (aspect <= op.max_aspect_ratio)
        left, top = ((w - new_w) * place[..., 0]).astype(np.int64), ((h - new_h) * place[..., 1]).astype(np.int64)
        right, bottom = left + new_w, top + new_h
        ok &= (left != right) & (top != bottom)
        l, t, r, b = left[..., None], top[..., None], right[..., None], bottom[..., None]  # (k, block, trials, 1)
        bx0, by0, bx1, by1 = x0[todo], y0[todo], x1[todo], y1[todo]  # (k, 1, 1, boxes)
        bcx, bcy = cx[todo], cy[todo]
        inside = (l < bcx) & (bcx < r) & (t < bcy) & (bcy < b) & real[todo, None, None, :]
        inter = (np.clip(np.minimum(bx1, r) - np.maximum(bx0, l), 0, None)
                 * np.clip(np.minimum(by1, b) - np.maximum(by0, t), 0, None))
        with np.errstate(divide="ignore", invalid="ignore"):  # boxes of no area, outside anyway
            iou = np.where(inside, inter / (area[todo] + (new_w * new_h)[..., None] - inter), -1.0)
        ok &= inside.any(axis=3) & (iou.max(axis=3, initial=-1.0) >= overlap[..., None])  # (k, block, trials)
        whole = overlap >= 1.0  # this draw keeps the image as it is
        ends = whole | ok.any(axis=2)  # (k, block): the draw that settles the sample
        done = ends.any(axis=1)
        at = np.argmax(ends, axis=1)  # each sample's first settling draw
        rows = np.flatnonzero(done & ~whole[np.arange(k), at])  # settled by a window, not as it is
        d = at[rows]
        trial = np.argmax(ok[rows, d], axis=1)  # its first passing trial
        taken = todo[rows]
        windows[taken] = np.stack([top[rows, d, trial], left[rows, d, trial], new_h[rows, d, trial],
                                   new_w[rows, d, trial]], axis=1)
        kept[taken] = inside[rows, d, trial]
        todo = todo[~done]
        draw += block
    return [(tuple(window), kept[i, : counts[i]]) for i, window in enumerate(windows.tolist())]
