"""A segmentation mask, and instance masks, that move with the image (``Pipeline(mask=,
instance_masks=)``; ``_follow`` says how).

A mask is a single-channel image of the decoded image's size whose values are classes: an
encoded one (a PNG in mode L or P, whose values are the palette indices, not colours; I and I;16
too) or an array ``[H, W]`` of integers. It goes through the image's geometry nearest-neighbour:
output pixel (x, y) takes the mask's value at the source pixel under the point the image's
resampling is centred on, so classes are never blended; where the image is zero padding (a crop
past its edge) the mask is ``mask_fill`` (255 for the usual "ignore" class).

Instance masks are ``[N, H, W]``, one binary mask a box (Mask R-CNN's targets): each layer goes
through the same gather, the layers of the boxes kept picked in it, padding 0.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from PIL import Image

from headrace._errors import TransformError
from headrace._sample import Sample

from ._geometry import PlanBatch
from ._pipeline import Pipeline

__all__ = ["follow_instance_masks", "follow_masks", "read_instance_masks", "read_mask"]

_BYTES = (bytes, bytearray, memoryview)
_INDEX_MODES = ("L", "P", "1", "I", "I;16", "I;16L", "I;16B")


def _field(sample: Sample, argument: str, name: str) -> tuple[Any, Callable[[str], TransformError]]:
    """The value of ``sample``'s field ``name`` (named by ``Pipeline(argument=name)``), and a maker
    of the TransformErrors that name the sample and the field. Raises one for a missing field."""
    raw = sample.fields.get(name)
    if raw is None:
        raise TransformError(f"sample has no {name!r} field (Pipeline {argument}={name!r}; it has "
                             f"{', '.join(sample.fields) or 'none'})", key=sample.key, source=sample.source)

    def fail(why: str) -> TransformError:
        return TransformError(f"{argument} field {name!r} {why}", key=sample.key, source=sample.source)

    return raw, fail


def read_mask(sample: Sample, pipe: Pipeline, height: int, width: int) -> np.ndarray:
    """``sample``'s mask as a 2-D integer array of the image's upright size. Raises TransformError
    naming the sample for a mask that is missing, not single-channel, not integers, or of another
    size than its image."""
    assert pipe.mask is not None
    raw, fail = _field(sample, "mask", pipe.mask)
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


def read_instance_masks(sample: Sample, pipe: Pipeline, height: int, width: int, count: int) -> np.ndarray:
    """``sample``'s instance masks as uint8 ``[count, height, width]``, 1 inside (any nonzero value
    given): one a box of its ``count``. A lazy field (``readers.coco``'s) is drawn here. Raises
    TransformError naming the sample for masks that are missing, not a 3-D array of integers or
    bools, of another size than the image, or of another number than its boxes."""
    assert pipe.instance_masks is not None
    raw, fail = _field(sample, "instance_masks", pipe.instance_masks)
    if isinstance(raw, _BYTES):
        raise fail("is encoded bytes; instance masks are an array [N, H, W], one mask a box")
    masks = np.asarray(raw.numpy(force=True) if isinstance(raw, torch.Tensor) else raw)
    if masks.shape == (0,):
        # No masks as an empty list (a list of one mask an object, for an image with none; JSON's
        # "[]"): NumPy makes it float64 [0], with no H and W to check. As the boxes' empty list is [0, 4].
        masks = np.zeros((0, height, width), np.uint8)
    if masks.ndim != 3 or masks.dtype.kind not in "biu":
        raise fail(f"is {masks.ndim}-D {masks.dtype}, not a 3-D array [N, H, W] of integers or bools")
    if masks.shape[1:] != (height, width):
        raise fail(f"is {masks.shape[2]}x{masks.shape[1]}, its image decodes to {width}x{height}")
    if len(masks) != count:
        raise fail(f"holds {len(masks)} masks for {count} boxes (one mask a box, in the boxes' order)")
    if masks.dtype == bool:
        return masks.view(np.uint8)
    if masks.dtype == np.uint8 and masks.max(initial=0) <= 1:  # already 0 and 1: no copy
        return masks
    return (masks != 0).view(np.uint8)


def _source_pixels(plan: PlanBatch, r: int, height: int, width: int
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For row ``r`` of ``plan`` over a source of ``height`` x ``width``: the source row and column
    of each output row and column (flips included), and which of them fall on the real pixels."""
    out_w, out_h = int(plan.out_w[r]), int(plan.out_h[r])
    bx0, by0, bx1, by1 = plan.box[r]
    cx0, cy0, cx1, cy1 = plan.real[r]
    # The source point each output pixel's centre maps to, and the pixel it falls in.
    px = bx0 + (np.arange(out_w) + 0.5) * ((bx1 - bx0) / out_w)
    py = by0 + (np.arange(out_h) + 0.5) * ((by1 - by0) / out_h)
    inside_x = (px >= max(cx0, 0.0)) & (px < min(cx1, width))
    inside_y = (py >= max(cy0, 0.0)) & (py < min(cy1, height))
    xs = np.clip(np.floor(px).astype(np.int64), 0, width - 1)
    ys = np.clip(np.floor(py).astype(np.int64), 0, height - 1)
    if plan.flip_h[r]:  # flipped by the indices, not by a copy
        xs, inside_x = xs[::-1], inside_x[::-1]
    if plan.flip_v[r]:
        ys, inside_y = ys[::-1], inside_y[::-1]
    return ys, xs, inside_y, inside_x


def _moved(plan: PlanBatch, r: int, source: np.ndarray, out: np.ndarray, fill: int,
           layers: np.ndarray | None = None) -> np.ndarray:
    """``source`` (``[H, W]``, or ``[N, H, W]`` moved layer by layer) through row ``r`` of ``plan``
    into ``out`` (``[h, w]`` or ``[len(layers), h, w]``), nearest-neighbour, ``fill`` where the output
    is padding. ``layers`` picks the layers of a 3-D source (in one gather with their rows)."""
    ys, xs, inside_y, inside_x = _source_pixels(plan, r, source.shape[-2], source.shape[-1])
    # The rows, then their columns (faster than one 2-D gather); a 3-D source's layers in the same gather, not a loop.
    rows_taken = source[..., ys, :] if layers is None else source[layers[:, None], ys]
    if rows_taken.dtype != out.dtype:  # a uint8 mask among int64 ones
        rows_taken = rows_taken.astype(out.dtype)
    # The indices are in range already: "clip" spares the copy through a buffer that "raise" makes of ``out``.
    np.take(rows_taken, xs, axis=-1, out=out, mode="clip")
    if not inside_y.all():
        out[..., ~inside_y, :] = fill
    if not inside_x.all():
        out[..., ~inside_x] = fill
    return out


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
        out = batch[r] if batch is not None else np.empty((int(plan.out_h[r]), int(plan.out_w[r])), dtype)
        rows.append(torch.from_numpy(_moved(plan, r, mask, out, fill)))
    return torch.from_numpy(batch) if batch is not None else rows


def follow_instance_masks(plan: PlanBatch, masks: list[np.ndarray], layers: list[np.ndarray]) -> list[torch.Tensor]:
    """Each row's instance masks (uint8 ``[N, H, W]``) through its row of ``plan`` as ``follow_masks``
    moves a mask, padding 0, only the layers ``layers[r]`` (those whose boxes were kept, in order):
    a uint8 tensor ``[len(layers[r]), h, w]`` a row."""
    out = []
    for r, (source, kept) in enumerate(zip(masks, layers)):
        moved = np.empty((len(kept), int(plan.out_h[r]), int(plan.out_w[r])), np.uint8)
        out.append(torch.from_numpy(_moved(plan, r, source, moved, 0, kept)))
    return out
