"""Boxes that move with the image (``Pipeline(boxes=, per_box=)``; ``_follow`` says how).

A sample's boxes are ``(x0, y0, x1, y1)`` in pixels of the decoded image (upright, as ``Decode``
makes it). A box is clipped to the image's real pixels in the output (a crop's edge, not the zero
padding beyond the image); a box left with no area is dropped, and with it the same rows of the
``per_box`` fields (its label) and its instance mask, as torchvision's ``SanitizeBoundingBoxes`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from headrace._errors import ConfigError, TransformError
from headrace._sample import Sample

from ._geometry import PlanBatch, plan_batch
from ._pipeline import Pipeline
from ._spec import Flip, RandomIoUCrop

__all__ = ["BoxFields", "follow_boxes", "read_boxes", "source_boxes"]

# Where a box's edge lies on a crop's edge, the folded geometry's float64 arithmetic (the crop's
# edge mapped through a scale or two) puts it ~1e-14 pixels to one side: a box cropped away then
# comes out a sliver of that width, which is no area. Anything narrower than this is none.
_NO_AREA = 1e-6  # pixels of the output


@dataclass(slots=True)
class BoxFields:
    boxes: np.ndarray  # (N, 4) float64: x0, y0, x1, y1 in pixels of the decoded image
    per_box: dict[str, np.ndarray]  # name -> N rows


def _array(value: object) -> np.ndarray:
    return np.asarray(value.numpy(force=True) if isinstance(value, torch.Tensor) else value)


def read_boxes(sample: Sample, pipe: Pipeline) -> BoxFields:
    """``sample``'s boxes and per-box fields, checked. Raises TransformError naming the sample for
    boxes that are not ``[N, 4]`` finite numbers or a per-box field of another length."""
    name = pipe.boxes
    assert name is not None
    raw = sample.fields.get(name)
    if raw is None:
        raise TransformError(f"sample has no {name!r} field (Pipeline boxes={name!r}; it has "
                             f"{', '.join(sample.fields) or 'none'})", key=sample.key, source=sample.source)
    try:
        boxes = _array(raw).astype(np.float64)
    except (TypeError, ValueError) as exc:
        raise TransformError(f"field {name!r} is not an array of numbers: {exc}", key=sample.key,
                             source=sample.source) from exc
    if boxes.size == 0:
        boxes = boxes.reshape(0, 4)
    if boxes.ndim != 2 or boxes.shape[1] != 4:
        raise TransformError(f"field {name!r} has shape {list(boxes.shape)}, not [N, 4] (x0, y0, x1, y1)",
                             key=sample.key, source=sample.source)
    if not np.isfinite(boxes).all():
        raise TransformError(f"field {name!r} holds a value that is not finite", key=sample.key, source=sample.source)
    per_box = {}
    for field in pipe.per_box:
        value = sample.fields.get(field)
        if value is None:
            raise TransformError(f"sample has no {field!r} field (Pipeline per_box={pipe.per_box!r})",
                                 key=sample.key, source=sample.source)
        rows = _array(value)
        if rows.dtype.kind not in "biuf":
            raise TransformError(f"field {field!r} is not an array of numbers (a per_box field is one, a row a box)",
                                 key=sample.key, source=sample.source)
        if rows.ndim == 0 or len(rows) != len(boxes):
            raise TransformError(f"field {field!r} has {len(rows) if rows.ndim else 'no'} rows for {len(boxes)} "
                                 f"boxes (a per_box field has one row per box)", key=sample.key, source=sample.source)
        per_box[field] = rows
    return BoxFields(boxes, per_box)


def follow_boxes(pipe: Pipeline, plan: PlanBatch, found: list[BoxFields]
                 ) -> tuple[dict[str, list[torch.Tensor]], list[np.ndarray]]:
    """The boxes of ``found`` (row r planned by ``plan``'s row r) in their output images, and their
    per-box fields, as columns of one tensor a row: ``{boxes: [float32 (M, 4)], name: [...]}``; and
    for each row which of its boxes were kept (bool ``[N]``), for what else is kept with them (the
    instance masks). Computed for the batch's boxes at once (a box's row picks its plan), then split by row."""
    assert pipe.boxes is not None
    counts = [len(f.boxes) for f in found]
    row = np.repeat(np.arange(len(found)), counts)
    b = np.concatenate([f.boxes for f in found]) if found else np.zeros((0, 4))
    bx0, by0, bx1, by1 = plan.box[row].T
    out_w, out_h = plan.out_w[row].astype(np.float64), plan.out_h[row].astype(np.float64)
    sx, sy = out_w / (bx1 - bx0), out_h / (by1 - by0)
    # The real pixels in output coordinates: outside them the output is padding.
    cx0, cy0, cx1, cy1 = plan.real[row].T
    lo_x, hi_x = np.maximum((cx0 - bx0) * sx, 0.0), np.minimum((cx1 - bx0) * sx, out_w)
    lo_y, hi_y = np.maximum((cy0 - by0) * sy, 0.0), np.minimum((cy1 - by0) * sy, out_h)
    x0 = np.clip((b[:, 0] - bx0) * sx, lo_x, hi_x)
    x1 = np.clip((b[:, 2] - bx0) * sx, lo_x, hi_x)
    y0 = np.clip((b[:, 1] - by0) * sy, lo_y, hi_y)
    y1 = np.clip((b[:, 3] - by0) * sy, lo_y, hi_y)
    fh, fv = plan.flip_h[row], plan.flip_v[row]
    x0, x1 = np.where(fh, out_w - x1, x0), np.where(fh, out_w - x0, x1)
    y0, y1 = np.where(fv, out_h - y1, y0), np.where(fv, out_h - y0, y1)
    moved = np.stack([x0, y0, x1, y1], axis=1).astype(np.float32)
    keep = _has_area(x0, y0, x1, y1, moved)
    cuts = np.cumsum(counts)[:-1]
    keeps = np.split(keep, cuts)
    out: dict[str, list[torch.Tensor]] = {pipe.boxes: [], **{name: [] for name in pipe.per_box}}
    for boxes, kept in zip(np.split(moved, cuts), keeps):
        out[pipe.boxes].append(torch.from_numpy(boxes[kept]))
    for name in pipe.per_box:
        rows_of = _typed_alike([sample.per_box[name] for sample in found])
        for rows, kept in zip(rows_of, keeps):
            out[name].append(torch.from_numpy(np.ascontiguousarray(rows[kept])))
    return out, keeps


def _has_area(x0: np.ndarray, y0: np.ndarray, x1: np.ndarray, y1: np.ndarray, moved: np.ndarray) -> np.ndarray:
    """Which moved boxes keep an area: more than the fold's rounding (``_NO_AREA``) in float64, and
    still some in the float32 handed out, where a box 1e-5 wide at x = 1000 has none. A box with
    none would fail a torchvision detector's check (``x1 > x0``) or train it on a line."""
    return ((x1 - x0 > _NO_AREA) & (y1 - y0 > _NO_AREA)
            & (moved[:, 2] > moved[:, 0]) & (moved[:, 3] > moved[:, 1]))


def _typed_alike(rows_of: list[np.ndarray]) -> list[np.ndarray]:
    """One per-box field's rows for a batch, each empty one given the dtype and row shape of the
    first that is not. NumPy makes an empty list (a JSON ``[]``) float64 whatever the field holds,
    so an image without boxes would be the one row of float labels, and a loss that joins the
    rows (``torch.cat``) would get float targets."""
    model = next((rows for rows in rows_of if rows.size), None)
    if model is None:
        return rows_of
    return [np.empty((0, *model.shape[1:]), model.dtype)
            if rows.size == 0 and (rows.dtype != model.dtype or rows.shape[1:] != model.shape[1:]) else rows
            for rows in rows_of]


def source_boxes(pipeline: Pipeline, boxes: Any, image_size: tuple[int, int]) -> torch.Tensor:
    """Boxes found in a pipeline's output image, in pixels of the image it was made from.

    For inference: a detector's boxes on a letterboxed or resized image (``(x0, y0, x1, y1)`` in
    the output's pixels), mapped back through ``pipeline``'s geometry to the decoded image of
    ``image_size`` ``(height, width)`` (upright, as ``Decode`` made it), and clipped to it. Only
    for pipelines whose geometry draws nothing: ``Resize``, ``CenterCrop`` and ``Flip(p=0 or 1)``.
    Returns float32 ``[N, 4]`` on ``boxes``' device. Raises ConfigError for a pipeline with random
    geometry or boxes that are not ``[N, 4]`` (a ValueError too).
    """
    random = [op for op in pipeline.image_ops if isinstance(op, RandomIoUCrop)  # its window, drawn on the boxes
              or op.randoms and not (isinstance(op, Flip) and op.p in (0.0, 1.0))]
    if random:
        raise ConfigError(f"source_boxes: {random[0]!r} draws its geometry per sample; only a pipeline without "
                          "random geometry maps back (Resize, CenterCrop, Flip(p=0 or 1))")
    height, width = (int(v) for v in image_size)
    flips = [np.full((1, 1), 0.5) if op.randoms else None for op in pipeline.image_ops]  # u = 0.5: Flip(1) flips
    plan = plan_batch(np.array([height]), np.array([width]), pipeline.image_ops, flips)
    given = boxes if isinstance(boxes, torch.Tensor) else torch.as_tensor(np.asarray(boxes, dtype=np.float32))
    if given.ndim != 2 or given.shape[-1] != 4:
        raise ConfigError(f"source_boxes: boxes must be [N, 4], got {list(given.shape)}")
    b = given.detach().to("cpu", torch.float64).numpy()
    out_w, out_h = float(plan.out_w[0]), float(plan.out_h[0])
    x0, y0, x1, y1 = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    if plan.flip_h[0]:
        x0, x1 = out_w - x1, out_w - x0
    if plan.flip_v[0]:
        y0, y1 = out_h - y1, out_h - y0
    bx0, by0, bx1, by1 = plan.box[0]
    sx, sy = (bx1 - bx0) / out_w, (by1 - by0) / out_h
    mapped = np.stack([np.clip(bx0 + x0 * sx, 0, width), np.clip(by0 + y0 * sy, 0, height),
                       np.clip(bx0 + x1 * sx, 0, width), np.clip(by0 + y1 * sy, 0, height)], axis=1)
    return torch.from_numpy(mapped.astype(np.float32)).to(given.device)
