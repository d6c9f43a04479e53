"""Pillow-backed decode for one image.

``decode`` is the CPU path's decoder for everything nvImageCodec does not take (PNG and other
formats, CMYK or 12-bit JPEGs, gray output, files without an EOI marker, and any JPEG nvImageCodec
fails on), and the GPU path's CPU fallback. Pillow releases the GIL inside decode, so worker
threads run in parallel.
"""

from __future__ import annotations

import io
from typing import Any

from PIL import Image, UnidentifiedImageError

from headrace._errors import DecodeError

from ._spec import Decode

__all__ = ["decode"]

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
