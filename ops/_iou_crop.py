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
    which of its boxes (x0, y0, x1, y1) stay: those whose centres lie inside it."""
    rng = stage_rng(seed, epoch, position, index)
    whole = ((0, 0, height, width), np.ones(len(boxes), dtype=bool))
    cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
    area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    options = op.sampler_options
    for _ in range(op.draws):
        overlap = options[int(rng.integers(len(options)))]
        if overlap >= 1.0:
            return whole
        for _ in range(op.trials):
            r = op.min_scale + (op.max_scale - op.min_scale) * rng.random(2)
            new_w, new_h = int(width * r[0]), int(height * r[1])
            if new_h == 0 or not op.min_aspect_ratio <= new_w / new_h <= op.max_aspect_ratio:
                continue
            r = rng.random(2)
            left, top = int((width - new_w) * r[0]), int((height - new_h) * r[1])
            right, bottom = left + new_w, top + new_h
            if left == right or top == bottom:
                continue
            inside = (left < cx) & (cx < right) & (top < cy) & (cy < bottom)
            if not inside.any():
                continue
            b = boxes[inside]
            iw = np.clip(np.minimum(b[:, 2], right) - np.maximum(b[:, 0], left), 0, None)
            ih = np.clip(np.minimum(b[:, 3], bottom) - np.maximum(b[:, 1], top), 0, None)
            inter = iw * ih
            iou = inter / (area[inside] + new_w * new_h - inter)
            if iou.max() < overlap:
                continue
            return (top, left, new_h, new_w), inside
    return whole
