"""The CPU path's geometry on uint8 HWC tensors: torchvision's tensor semantics, op by op.

Resize is ``torch.nn.functional.interpolate(mode="bilinear", antialias=True)`` on the uint8 image,
which is what torchvision's ``resize`` does to a uint8 tensor: the same triangle filter as
Pillow's BILINEAR (stretched by the scale when shrinking), computed with int16 weights and a
rounding after each pass: within 1 of Pillow's result, and within 1 + 1/64 of the exact resample
(tests/ops/test_ops_geometry.py). On the benchmark's crops it took 0.36-0.56 ms a 224 x 224 output
where Pillow's resize took about 1.5 ms (AVX2), which is why the CPU path uses it. Crops are views
(padding makes a zero-filled copy); flips copy.

Nothing is fused: a crop after a resize resizes the whole image first, as torchvision does.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from .._spec import CenterCrop, Flip, Op, RandomCrop, RandomIoUCrop, RandomResize, RandomResizedCrop, Resize

__all__ = ["after_leading_window", "apply_image_ops", "center_crop", "leading_window", "resize"]


def resize(x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Antialiased bilinear resize of an HWC uint8 image to ``h`` x ``w`` (the same size: unchanged)."""
    if x.shape[0] == h and x.shape[1] == w:
        return x
    y = F.interpolate(x.permute(2, 0, 1)[None], size=(h, w), mode="bilinear", antialias=True, align_corners=False)
    return y[0].permute(1, 2, 0)


def center_crop(x: torch.Tensor, top: int, left: int, ch: int, cw: int) -> torch.Tensor:
    """The window ``(top, left, ch, cw)`` of ``x``; parts outside the image are zeros (torchvision pads)."""
    h, w = x.shape[:2]
    if top >= 0 and left >= 0 and top + ch <= h and left + cw <= w:
        return x[top : top + ch, left : left + cw]
    out = x.new_zeros((ch, cw, x.shape[2]))
    y0, y1, x0, x1 = max(top, 0), min(top + ch, h), max(left, 0), min(left + cw, w)
    if y1 > y0 and x1 > x0:
        out[y0 - top : y1 - top, x0 - left : x1 - left] = x[y0:y1, x0:x1]
    return out


def leading_window(ops: tuple[Op, ...], h: int, w: int, u: np.ndarray | None) -> tuple[int, int, int, int] | None:
    """The window ``(top, left, ch, cw)`` of an h x w image that the first op crops, when it is a crop
    that lies inside the image (RandomResizedCrop always; CenterCrop without padding); else None.

    Decoding only this window, then running ``ops`` with the first one's crop already done
    (``after_leading_window``), gives the pixels of running ``ops`` on the whole image.
    """
    if not ops:
        return None
    op = ops[0]
    if isinstance(op, RandomResizedCrop):
        return op.window(h, w, u)
    if isinstance(op, RandomIoUCrop):
        return _given_window(u)
    if isinstance(op, (CenterCrop, RandomCrop)):
        top, left, ch, cw = op.window(h, w) if isinstance(op, CenterCrop) else op.window(h, w, u)
        if top >= 0 and left >= 0 and top + ch <= h and left + cw <= w:
            return top, left, ch, cw
    return None


def _given_window(u: np.ndarray) -> tuple[int, int, int, int]:
    """A RandomIoUCrop's window, chosen before decoding and handed over as its numbers."""
    top, left, ch, cw = (int(v) for v in u[:4])
    return top, left, ch, cw


def after_leading_window(x: torch.Tensor, op: Op) -> torch.Tensor:
    """What the first op does to its own window: RandomResizedCrop resizes it; the other crops are done."""
    return resize(x, *op.size) if isinstance(op, RandomResizedCrop) else x


def apply_image_ops(x: torch.Tensor, ops: tuple[Op, ...], randoms: list[np.ndarray | None]) -> torch.Tensor:
    """Apply the geometry ops (Resize, RandomResize, CenterCrop, RandomCrop, RandomResizedCrop, Flip) in order to HWC uint8 ``x``.

    ``randoms[i]`` are op i's uniforms. Returns a tensor that may view ``x``.
    """
    for op, u in zip(ops, randoms):
        h, w = x.shape[0], x.shape[1]
        if isinstance(op, Resize):
            x = resize(x, *op.target(h, w))
        elif isinstance(op, RandomResize):
            x = resize(x, *op.target(h, w, u))
        elif isinstance(op, RandomCrop):
            x = center_crop(x, *op.window(h, w, u))
        elif isinstance(op, RandomIoUCrop):
            x = center_crop(x, *_given_window(u))
        elif isinstance(op, RandomResizedCrop):
            top, left, ch, cw = op.window(h, w, u)
            x = resize(x[top : top + ch, left : left + cw], *op.size)
        elif isinstance(op, CenterCrop):
            x = center_crop(x, *op.window(h, w))
        elif isinstance(op, Flip):
            if op.flips(u):
                x = x.flip(0 if op.vertical else 1)
    return x
