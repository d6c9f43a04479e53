"""Pillow-backed decode for one image, and Pillow's version of the geometry.

``decode`` is the CPU path's decoder for everything nvImageCodec does not take (PNG and other
formats, CMYK or 12-bit JPEGs, gray output, files without an EOI marker, and any JPEG nvImageCodec
fails on), and the GPU path's CPU fallback.

``apply_image_ops`` is no longer what the CPU executor runs (it uses torch, ``_cpu_ops``); it is
the Pillow rendering of the fused geometry the GPU kernel reproduces, and tests/ops/test_geometry.py
checks the GPU path's region-of-interest plan against it. Crops after a resize fold into one
``Image.resize(box=...)`` call, which computes only the output pixels of "resize, then crop".
It is not bit-exact with the two calls: Pillow rounds between its horizontal and vertical passes
and picks the pass order by cost, which differs for the box, and the box travels as float32. Both
results lie within 1 of the exact (unrounded) resize, so they differ by at most 2. A resize never
folds into an earlier crop or resize: torchvision crops first, so the filter must not reach
outside the crop. Pillow releases the GIL inside decode and resize, so worker threads run in parallel.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from headrace._errors import DecodeError

from ._spec import CenterCrop, Decode, Flip, Op, RandomResizedCrop, Resize

__all__ = ["decode", "apply_image_ops"]

_EXIF_ORIENTATION = 0x0112
_TRANSPOSE = {
    2: (Image.Transpose.FLIP_LEFT_RIGHT,),
    3: (Image.Transpose.ROTATE_180,),
    4: (Image.Transpose.FLIP_TOP_BOTTOM,),
    5: (Image.Transpose.TRANSPOSE,),
    6: (Image.Transpose.ROTATE_270,),
    7: (Image.Transpose.TRANSVERSE,),
    8: (Image.Transpose.ROTATE_90,),
}


def decode(data: Any, spec: Decode, key: str, source: str) -> Image.Image:
    """Decode ``data`` to an RGB or L image, upright by its EXIF orientation. Raises DecodeError."""
    if len(data) == 0:
        raise DecodeError("empty file: nothing to decode", key=key, source=source)
    try:
        img = Image.open(io.BytesIO(data))
        orientation = _orientation(img) if spec.exif else 1
        mode = "RGB" if spec.color == "rgb" else "L"
        if img.mode == "RGBA" or img.mode == "LA" or (img.mode == "P" and "transparency" in img.info):
            img = img.convert("RGBA")  # drop alpha the way Pillow's RGB conversion does
        img = img.convert(mode) if img.mode != mode else _loaded(img)
        for method in _TRANSPOSE.get(orientation, ()):
            img = img.transpose(method)
    except UnidentifiedImageError as exc:
        raise DecodeError("not an image format the decoder knows", key=key, source=source) from exc
    except Exception as exc:  # noqa: BLE001 - plugins raise OSError, ValueError, struct.error, ...
        # Corrupt bytes surface as whatever the format plugin trips over; all of them mean the
        # same thing to the caller, and one sample's bad file must not fail its whole batch.
        raise DecodeError(f"corrupt or truncated image: {type(exc).__name__}: {exc}", key=key, source=source) from exc
    return img


def _orientation(img: Image.Image) -> int:
    """The EXIF orientation tag (1..8), read as ``ImageOps.exif_transpose`` reads it; 1 if none."""
    try:
        value = img.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block should not cost the pixels
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def _loaded(img: Image.Image) -> Image.Image:
    img.load()
    return img


class _Window:
    """A pending resize-then-crop: the source box (in the current image) and the output size."""

    __slots__ = ("box", "size")

    def __init__(self, w: int, h: int) -> None:
        self.box = (0.0, 0.0, float(w), float(h))
        self.size = (w, h)

    def crop(self, top: int, left: int, ch: int, cw: int) -> None:
        """Crop the pending output; the window must lie inside it (padding is done elsewhere)."""
        if (top, left, cw, ch) == (0, 0, *self.size):
            return  # the whole output: keep the box exact rather than recompose it in floating point
        x0, y0, x1, y1 = self.box
        sx = (x1 - x0) / self.size[0]
        sy = (y1 - y0) / self.size[1]
        self.box = (x0 + left * sx, y0 + top * sy, x0 + (left + cw) * sx, y0 + (top + ch) * sy)
        self.size = (cw, ch)

    def apply(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        x0, y0, x1, y1 = self.box
        if self.box == (0.0, 0.0, float(w), float(h)) and self.size == img.size:
            return img
        if (x1 - x0, y1 - y0) == self.size and all(float(v).is_integer() for v in self.box):
            return img.crop((int(x0), int(y0), int(x1), int(y1)))  # pure crop: a copy, no filter
        return img.resize(self.size, Image.Resampling.BILINEAR, box=self.box)


def _settle(img: Image.Image, win: _Window) -> tuple[Image.Image, _Window]:
    """Carry out the pending window; the next op starts from a fresh one on the result."""
    img = win.apply(img)
    return img, _Window(img.width, img.height)


def apply_image_ops(img: Image.Image, ops: tuple[Op, ...], randoms: list[np.ndarray | None]) -> Image.Image:
    """Apply Resize/CenterCrop/RandomResizedCrop/Flip in order; ``randoms[i]`` are op i's uniforms."""
    win = _Window(img.width, img.height)
    for op, u in zip(ops, randoms):
        w, h = win.size
        if isinstance(op, Resize):
            img, win = _settle(img, win)
            th, tw = op.target(h, w)
            win.size = (tw, th)
        elif isinstance(op, RandomResizedCrop):
            win.crop(*op.window(h, w, u))
            img, win = _settle(img, win)  # torchvision crops, then resizes only the crop
            win.size = (op.size[1], op.size[0])
        elif isinstance(op, CenterCrop):
            top, left, ch, cw = op.window(h, w)
            if top >= 0 and left >= 0 and top + ch <= h and left + cw <= w:
                win.crop(top, left, ch, cw)
            else:  # padding: Pillow's crop fills outside the image with zeros
                img, _ = _settle(img, win)
                img = img.crop((left, top, left + cw, top + ch))
                win = _Window(img.width, img.height)
        elif isinstance(op, Flip):
            if op.flips(u):
                img, win = _settle(img, win)
                flip = Image.Transpose.FLIP_TOP_BOTTOM if op.vertical else Image.Transpose.FLIP_LEFT_RIGHT
                img = img.transpose(flip)
    return win.apply(img)
