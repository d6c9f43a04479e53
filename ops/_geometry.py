"""Geometry of the image ops as one source box and one output size, without touching pixels.

The GPU path needs, per sample and before decoding, the window of the source image that the ops
read (to decode only that region) and the mapping from output pixels into it (for the fused
kernel). This folds Resize / CenterCrop / RandomResizedCrop into a box in source coordinates, the
same fold the CPU path's ``_pillow._Window`` does, and Flip into flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from headrace._errors import ConfigError

from ._spec import CenterCrop, Flip, Op, RandomResizedCrop, Resize

__all__ = ["Plan", "check_foldable", "plan", "roi"]


@dataclass(slots=True)
class Plan:
    """Output pixel (x, y) samples source point ``box[0] + (x + 0.5) * sx`` (and likewise y).

    ``clip`` is the part of the source the filter may read: torchvision (and the CPU path) crop
    before they resize, so a resize after a crop must not see pixels outside that crop. It is also
    the extent of real pixels: output pixels whose source point falls outside it are zero padding.
    """

    box: tuple[float, float, float, float]  # x0, y0, x1, y1 in source pixels
    out_w: int
    out_h: int
    clip: tuple[float, float, float, float]
    flip_h: bool = False
    flip_v: bool = False


def check_foldable(ops: tuple[Op, ...]) -> None:
    """Refuse what one fused resample cannot do exactly: a geometric op after a Flip, or two resizes."""
    seen_flip = False
    resizes = 0
    for op in ops:
        if isinstance(op, Flip):
            seen_flip = True
            continue
        if seen_flip:
            raise ConfigError(f"the GPU path applies Flip after all crops and resizes; move {op!r} before Flip")
        resizes += isinstance(op, (Resize, RandomResizedCrop))
        if resizes > 1:
            raise ConfigError(f"the GPU path fuses one resize per pipeline; {op!r} is a second one")


def plan(h: int, w: int, ops: tuple[Op, ...], randoms: list[np.ndarray | None]) -> Plan:
    """Fold the ops for an h x w (display-oriented) image, with this sample's uniforms per op."""
    x0, y0, x1, y1 = 0.0, 0.0, float(w), float(h)
    clip = (x0, y0, x1, y1)
    cw, ch = w, h  # current virtual size
    resized = False
    flip_h = flip_v = False
    for op, u in zip(ops, randoms):
        if isinstance(op, Resize):
            ch, cw = op.target(ch, cw)
            resized = True
        elif isinstance(op, (RandomResizedCrop, CenterCrop)):
            top, left, wh, ww = op.window(ch, cw, u) if isinstance(op, RandomResizedCrop) else op.window(ch, cw)
            sx, sy = (x1 - x0) / cw, (y1 - y0) / ch
            x0, y0, x1, y1 = x0 + left * sx, y0 + top * sy, x0 + (left + ww) * sx, y0 + (top + wh) * sy
            ch, cw = wh, ww
            if not resized:  # a crop before any resize is carried out: later filters stay inside it
                clip = (max(x0, clip[0]), max(y0, clip[1]), min(x1, clip[2]), min(y1, clip[3]))
            if isinstance(op, RandomResizedCrop):
                ch, cw = op.size
                resized = True
        elif isinstance(op, Flip):
            if op.flips(u):
                if op.vertical:
                    flip_v = not flip_v
                else:
                    flip_h = not flip_h
    return Plan((x0, y0, x1, y1), cw, ch, clip, flip_h, flip_v)


def roi(p: Plan, h: int, w: int) -> tuple[int, int, int, int]:
    """The integer region (y0, x0, y1, x1) of the source that the resampling filter reads.

    Pillow's bilinear filter reaches ``max(scale, 1)`` pixels around each sample point, so the box
    grows by that margin (plus one for rounding), then is clipped to ``p.clip``. Decoding exactly
    this region and resampling it gives the pixels of the CPU path.
    """
    x0, y0, x1, y1 = p.box
    cx0, cy0, cx1, cy1 = p.clip
    mx = math.ceil(max((x1 - x0) / p.out_w, 1.0)) + 1
    my = math.ceil(max((y1 - y0) / p.out_h, 1.0)) + 1
    rx0, ry0 = max(math.floor(cx0), math.floor(x0) - mx), max(math.floor(cy0), math.floor(y0) - my)
    rx1, ry1 = min(math.ceil(cx1), math.ceil(x1) + mx), min(math.ceil(cy1), math.ceil(y1) + my)
    rx0, ry0, rx1, ry1 = max(rx0, 0), max(ry0, 0), min(rx1, w), min(ry1, h)
    if rx1 <= rx0 or ry1 <= ry0:  # a window wholly in the padding: read one pixel, the kernel zero-fills
        rx0, ry0, rx1, ry1 = 0, 0, min(w, 1), min(h, 1)
    return ry0, rx0, ry1, rx1
