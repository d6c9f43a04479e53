"""Pillow-backed decode and geometry for one image: the CPU path's per-image work.

Geometry is fused: resizes and crops before a flip collapse into one ``Image.resize(box=...)``
call, which Pillow computes exactly as resize-then-crop (same filter support, same sample
centres) but only for the output pixels. Pillow releases the GIL inside decode and resize, so
worker threads run in parallel.
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
        orientation = 1
        if spec.exif and "exif" in img.info:
            orientation = img.getexif().get(_EXIF_ORIENTATION, 1)
        mode = "RGB" if spec.color == "rgb" else "L"
        if img.mode == "RGBA" or img.mode == "LA" or (img.mode == "P" and "transparency" in img.info):
            img = img.convert("RGBA")  # drop alpha the way Pillow's RGB conversion does
        img = img.convert(mode) if img.mode != mode else _loaded(img)
        for method in _TRANSPOSE.get(orientation, ()):
            img = img.transpose(method)
    except UnidentifiedImageError as exc:
        raise DecodeError("not an image format the decoder knows", key=key, source=source) from exc
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise DecodeError(f"corrupt or truncated image: {exc}", key=key, source=source) from exc
    return img


def _loaded(img: Image.Image) -> Image.Image:
    img.load()
    return img


class _Window:
    """A pending crop-and-resize: the source box (in the current image) and the output size."""

    __slots__ = ("box", "size")

    def __init__(self, w: int, h: int) -> None:
        self.box = (0.0, 0.0, float(w), float(h))
        self.size = (w, h)

    def crop(self, top: int, left: int, ch: int, cw: int) -> None:
        x0, y0, x1, y1 = self.box
        sx = (x1 - x0) / self.size[0]
        sy = (y1 - y0) / self.size[1]
        self.box = (x0 + left * sx, y0 + top * sy, x0 + (left + cw) * sx, y0 + (top + ch) * sy)
        self.size = (cw, ch)

    def inside(self, img: Image.Image) -> bool:
        x0, y0, x1, y1 = self.box
        return x0 >= 0 and y0 >= 0 and x1 <= img.width and y1 <= img.height

    def apply(self, img: Image.Image) -> Image.Image:
        box = self.box
        if box == (0.0, 0.0, float(img.width), float(img.height)) and self.size == img.size:
            return img
        if (box[2] - box[0], box[3] - box[1]) == self.size and all(float(v).is_integer() for v in box):
            return img.crop(tuple(int(v) for v in box))  # pure crop; zero-fills outside the image
        return img.resize(self.size, Image.Resampling.BILINEAR, box=box)


def apply_image_ops(img: Image.Image, ops: tuple[Op, ...], randoms: list[np.ndarray | None]) -> Image.Image:
    """Apply Resize/CenterCrop/RandomResizedCrop/Flip in order; ``randoms[i]`` are op i's uniforms."""
    win = _Window(img.width, img.height)
    for op, u in zip(ops, randoms):
        w, h = win.size
        if isinstance(op, Resize):
            th, tw = op.target(h, w)
            win.size = (tw, th)
        elif isinstance(op, RandomResizedCrop):
            win.crop(*op.window(h, w, u))
            win.size = (op.size[1], op.size[0])
        elif isinstance(op, CenterCrop):
            top, left, ch, cw = op.window(h, w)
            before = win.box
            win.crop(top, left, ch, cw)
            if not win.inside(img):  # padding: materialise the resize, then crop with zero fill
                win.box = before
                win.size = (w, h)
                img = win.apply(img)
                img = img.crop((left, top, left + cw, top + ch))
                win = _Window(img.width, img.height)
        elif isinstance(op, Flip):
            if op.flips(u):
                img = win.apply(img)
                win = _Window(img.width, img.height)
                flip = Image.Transpose.FLIP_TOP_BOTTOM if op.vertical else Image.Transpose.FLIP_LEFT_RIGHT
                img = img.transpose(flip)
    return win.apply(img)
