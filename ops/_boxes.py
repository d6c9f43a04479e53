"""Boxes that move with the image: each sample's boxes through the geometry its pixels go through.

A pipeline with ``boxes=`` names a field holding each sample's boxes, ``(x0, y0, x1, y1)`` in
pixels of the decoded image (upright, as ``Decode`` makes it). Both executors fold the geometry
ops into one source box, output size and flips per sample (``_geometry.plan_batch``), from random
numbers keyed on (seed, epoch, op, sample index): the same fold, computed here from the image's
header and the same keys, maps the boxes without the executor's help, so they follow the pixels on
the CPU and the GPU path alike.

A box is clipped to the image's real pixels in the output (a crop's edge, not the zero padding
beyond the image); a box left with no area is dropped, and with it the same rows of the
``per_box`` fields (its label), as torchvision's ``SanitizeBoundingBoxes`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from headrace._errors import TransformError
from headrace._sample import Sample

from . import _pillow
from ._geometry import plan_batch
from ._pipeline import Pipeline
from ._random import uniforms

__all__ = ["SampleBoxes", "follow", "read_boxes", "rows_on_device"]


@dataclass(slots=True)
class SampleBoxes:
    """One sample's boxes as read before decoding, and the size its image decodes to."""

    boxes: np.ndarray  # (N, 4) float64: x0, y0, x1, y1 in pixels of the decoded image
    per_box: dict[str, np.ndarray]  # name -> N rows
    height: int
    width: int


def read_boxes(sample: Sample, pipe: Pipeline, image: Any) -> SampleBoxes:
    """``sample``'s boxes and per-box fields, checked, and the upright size of ``image`` (its encoded
    bytes) from the header. Raises TransformError naming the sample for boxes that are not
    ``[N, 4]`` numbers or a per-box field of another length, DecodeError for an unreadable header."""
    name = pipe.boxes
    assert name is not None
    raw = sample.fields.get(name)
    if raw is None:
        raise TransformError(f"sample has no {name!r} field (Pipeline boxes={name!r}; it has "
                             f"{', '.join(sample.fields) or 'none'})", key=sample.key, source=sample.source)
    try:
        boxes = np.asarray(raw.numpy(force=True) if isinstance(raw, torch.Tensor) else raw, dtype=np.float64)
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
        rows = np.asarray(value.numpy(force=True) if isinstance(value, torch.Tensor) else value)
        if rows.dtype.kind not in "biuf":
            raise TransformError(f"field {field!r} is not an array of numbers (a per_box field is one, a row a box)",
                                 key=sample.key, source=sample.source)
        if rows.ndim == 0 or len(rows) != len(boxes):
            raise TransformError(f"field {field!r} has {len(rows) if rows.ndim else 'no'} rows for {len(boxes)} "
                                 f"boxes (a per_box field has one row per box)", key=sample.key, source=sample.source)
        per_box[field] = rows
    opened = _pillow.open_image(image, pipe.decode, sample.key, sample.source)
    try:
        return SampleBoxes(boxes, per_box, opened.height, opened.width)
    finally:
        opened.img.close()


def follow(pipe: Pipeline, seed: int, epoch: int, indices: np.ndarray,
           found: list[SampleBoxes]) -> dict[str, list[torch.Tensor]]:
    """The boxes of ``found`` (samples with sample indices ``indices``) in their output images, and
    their per-box fields, as columns of one tensor a row: ``{boxes: [float32 (M, 4)], name: [...]}``."""
    assert pipe.boxes is not None
    indices = np.asarray(indices, dtype=np.int64)
    randoms = [
        uniforms(seed, epoch, pos, indices, op.randoms) if op.randoms else None
        for pos, op in enumerate(pipe.image_ops, start=1)
    ]
    heights = np.array([f.height for f in found], dtype=np.int64)
    widths = np.array([f.width for f in found], dtype=np.int64)
    plan = plan_batch(heights, widths, pipe.image_ops, randoms)
    out: dict[str, list[torch.Tensor]] = {pipe.boxes: [], **{name: [] for name in pipe.per_box}}
    for r, sample in enumerate(found):
        bx0, by0, bx1, by1 = plan.box[r]
        out_w, out_h = float(plan.out_w[r]), float(plan.out_h[r])
        sx, sy = out_w / (bx1 - bx0), out_h / (by1 - by0)
        # The real pixels in output coordinates: outside them the output is padding.
        cx0, cy0, cx1, cy1 = plan.clip[r]
        lo_x, hi_x = max((cx0 - bx0) * sx, 0.0), min((cx1 - bx0) * sx, out_w)
        lo_y, hi_y = max((cy0 - by0) * sy, 0.0), min((cy1 - by0) * sy, out_h)
        b = sample.boxes
        x0 = np.clip((b[:, 0] - bx0) * sx, lo_x, hi_x)
        x1 = np.clip((b[:, 2] - bx0) * sx, lo_x, hi_x)
        y0 = np.clip((b[:, 1] - by0) * sy, lo_y, hi_y)
        y1 = np.clip((b[:, 3] - by0) * sy, lo_y, hi_y)
        if plan.flip_h[r]:
            x0, x1 = out_w - x1, out_w - x0
        if plan.flip_v[r]:
            y0, y1 = out_h - y1, out_h - y0
        keep = (x1 > x0) & (y1 > y0)
        out[pipe.boxes].append(torch.from_numpy(np.stack([x0, y0, x1, y1], axis=1)[keep].astype(np.float32)))
        for name, rows in sample.per_box.items():
            out[name].append(torch.from_numpy(np.ascontiguousarray(rows[keep])))
    return out


def rows_on_device(columns: dict[str, list[torch.Tensor]], device: torch.device) -> dict[str, list[torch.Tensor]]:
    """Each column's rows copied to ``device`` in one transfer, handed out as views of it (a copy a
    row would cost a pinned buffer and a transfer for each few dozen bytes)."""
    out = {}
    for name, rows in columns.items():
        if not rows:
            out[name] = rows
            continue
        flat = torch.cat(rows).pin_memory().to(device, non_blocking=True)
        out[name] = list(flat.split([len(row) for row in rows]))
    return out
