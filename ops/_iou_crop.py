"""``RandomIoUCrop``: a crop window chosen against the sample's boxes, and the random numbers
of every geometry op of a batch.

The window depends on the boxes, which only the stage executor reads (``_follow``), so it chooses
each sample's window before decoding and hands it to the image executor in the sample itself,
in the field ``WINDOW_FIELD``: ``op_randoms`` then gives the op that window, ``(top, left,
height, width)``, where other ops get their uniforms, and the fold (``plan_batch``), the CPU ops
and the boxes all crop it alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ._batch_stages import stage_rng
from ._random import uniforms
from ._spec import Op, RandomIoUCrop

__all__ = ["WINDOW_FIELD", "choose_window", "op_randoms"]

WINDOW_FIELD = "__headrace_iou_window__"


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
    """The sample's window ``(top, left, height, width)`` (the whole image when none is taken) and
    which of its boxes (x0, y0, x1, y1) stay: those whose centres lie inside it.

    torchvision's search, its trials for one drawn overlap tried all at once (the first that passes
    is taken): one array pass a draw rather than a Python loop a trial, which cost ~580 µs a sample
    on the VM (1-6 boxes, ImageNet-sized images)."""
    rng = stage_rng(seed, epoch, position, index)
    whole = ((0, 0, height, width), np.ones(len(boxes), dtype=bool))
    x0, y0, x1, y1 = (boxes[:, k][None, :] for k in range(4))  # (1, N): against every trial at once
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    area = (x1 - x0) * (y1 - y0)
    options = op.sampler_options
    for _ in range(op.draws):
        overlap = options[int(rng.integers(len(options)))]
        if overlap >= 1.0:
            return whole
        scale = op.min_scale + (op.max_scale - op.min_scale) * rng.random((op.trials, 2))
        new_w, new_h = (width * scale[:, 0]).astype(np.int64), (height * scale[:, 1]).astype(np.int64)
        aspect = new_w / np.maximum(new_h, 1)
        ok = (new_h > 0) & (op.min_aspect_ratio <= aspect) & (aspect <= op.max_aspect_ratio)
        place = rng.random((op.trials, 2))
        left, top = ((width - new_w) * place[:, 0]).astype(np.int64), ((height - new_h) * place[:, 1]).astype(np.int64)
        right, bottom = left + new_w, top + new_h
        ok &= (left != right) & (top != bottom)
        l, t, r, b = left[:, None], top[:, None], right[:, None], bottom[:, None]
        inside = (l < cx) & (cx < r) & (t < cy) & (cy < b)  # (trials, N)
        inter = np.clip(np.minimum(x1, r) - np.maximum(x0, l), 0, None) * np.clip(np.minimum(y1, b) - np.maximum(y0, t), 0, None)
        iou = np.where(inside, inter / (area + (new_w * new_h)[:, None] - inter), -1.0)
        ok &= inside.any(axis=1) & (iou.max(axis=1, initial=-1.0) >= overlap)
        if ok.any():
            k = int(np.argmax(ok))
            return (int(top[k]), int(left[k]), int(new_h[k]), int(new_w[k])), inside[k]
    return whole
