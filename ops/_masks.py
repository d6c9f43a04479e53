"""A segmentation mask that moves with the image (``Pipeline(mask=)``; ``_follow`` says how).

A mask is a single-channel image of the decoded image's size whose values are classes: an
encoded one (a PNG in mode L or P, whose values are the palette indices, not colours; I and I;16
too) or an array ``[H, W]`` of integers. It goes through the image's geometry nearest-neighbour:
output pixel (x, y) takes the mask's value at the source pixel under the point the image's
resampling is centred on, so classes are never blended; where the image is zero padding (a crop
past its edge) the mask is ``mask_fill`` (255 for the usual "ignore" class).
"""

from __future__ import annotations

import io

import numpy as np
import torch
from PIL import Image

from headrace._errors import TransformError
from headrace._sample import Sample

from ._geometry import PlanBatch
from ._pipeline import Pipeline

__all__ = ["follow_masks", "read_mask"]

_BYTES = (bytes, bytearray, memoryview)
_INDEX_MODES = ("L", "P", "1", "I", "I;16", "I;16L", "I;16B")


def read_mask(sample: Sample, pipe: Pipeline, height: int, width: int) -> np.ndarray:
    """``sample``'s mask as a 2-D integer array of the image's upright size. Raises TransformError
    naming the sample for a mask that is missing, not single-channel, not integers, or of another
    size than its image."""
    name = pipe.mask
    assert name is not None
    raw = sample.fields.get(name)

    def fail(why: str) -> TransformError:
        return TransformError(f"mask field {name!r} {why}", key=sample.key, source=sample.source)

    if raw is None:
        raise TransformError(f"sample has no {name!r} field (Pipeline mask={name!r}; it has "
                             f"{', '.join(sample.fields) or 'none'})", key=sample.key, source=sample.source)
    if isinstance(raw, _BYTES):
        try:
            with Image.open(io.BytesIO(raw)) as img:
                if img.mode not in _INDEX_MODES:
                    raise fail(f"is a {img.mode} image; a mask has one channel of classes (mode L, P or I)")
                if img.width * img.height != width * height:  # before decoding it: a wrong mask may be huge
                    raise fail(f"is {img.width}x{img.height}, its image decodes to {width}x{height}")
                mask = np.asarray(img)
        except TransformError:
            raise
        except Exception as exc:  # noqa: BLE001 - Pillow's errors for bad bytes are of many kinds
            raise fail(f"cannot be decoded: {type(exc).__name__}: {exc}") from exc
    else:
        mask = np.asarray(raw.numpy(force=True) if isinstance(raw, torch.Tensor) else raw)
    if mask.dtype == bool:
        mask = mask.astype(np.uint8)
    if mask.ndim != 2 or mask.dtype.kind not in "iu":
        raise fail(f"is {mask.ndim}-D {mask.dtype}, not a 2-D array of integer classes")
    if mask.shape != (height, width):
        raise fail(f"is {mask.shape[1]}x{mask.shape[0]}, its image decodes to {width}x{height}")
    return mask if mask.dtype == np.uint8 else mask.astype(np.int64)


def follow_masks(plan: PlanBatch, masks: list[np.ndarray], fill: int, stack: bool) -> torch.Tensor | list[torch.Tensor]:
    """Each mask through its row of ``plan``: one tensor ``[B, H, W]`` with ``stack`` (the ops fix
    the output size, and the images are one tensor too), else a tensor a row. uint8 when every mask
    is, else int64."""
    uint8 = all(m.dtype == np.uint8 for m in masks) and fill <= 255
    dtype = np.uint8 if uint8 else np.int64
    # One allocation for a stacked batch, each row gathered into its place: no copy to stack them.
    batch = np.empty((len(masks), int(plan.out_h[0]), int(plan.out_w[0])), dtype) if stack and masks else None
    rows = []
    for r, mask in enumerate(masks):
        out_w, out_h = int(plan.out_w[r]), int(plan.out_h[r])
        bx0, by0, bx1, by1 = plan.box[r]
        cx0, cy0, cx1, cy1 = plan.real[r]
        # The source point each output pixel's centre maps to, and the pixel it falls in.
        px = bx0 + (np.arange(out_w) + 0.5) * ((bx1 - bx0) / out_w)
        py = by0 + (np.arange(out_h) + 0.5) * ((by1 - by0) / out_h)
        inside_x = (px >= max(cx0, 0.0)) & (px < min(cx1, mask.shape[1]))
        inside_y = (py >= max(cy0, 0.0)) & (py < min(cy1, mask.shape[0]))
        xs = np.clip(np.floor(px).astype(np.int64), 0, mask.shape[1] - 1)
        ys = np.clip(np.floor(py).astype(np.int64), 0, mask.shape[0] - 1)
        if plan.flip_h[r]:  # flipped by the indices, not by a copy
            xs, inside_x = xs[::-1], inside_x[::-1]
        if plan.flip_v[r]:
            ys, inside_y = ys[::-1], inside_y[::-1]
        out = batch[r] if batch is not None else np.empty((out_h, out_w), dtype)
        rows_taken = mask[ys] if mask.dtype == dtype else mask[ys].astype(dtype)  # a uint8 mask among int64 ones
        np.take(rows_taken, xs, axis=1, out=out)  # the rows, then their columns: faster than one 2-D gather
        if not inside_y.all():
            out[~inside_y, :] = fill
        if not inside_x.all():
            out[:, ~inside_x] = fill
        rows.append(torch.from_numpy(out))
    return torch.from_numpy(batch) if batch is not None else rows
