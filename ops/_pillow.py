"""Pillow-backed decode for one image, in two steps: the header, then the pixels.

``open_image`` reads the header only (Pillow's ``open`` is lazy) and applies the verdict rules
before any pixel memory exists: the pixel limit (``Decode.max_pixels``; Pillow's own
``MAX_IMAGE_PIXELS`` check is bypassed, so our limit and message decide, whatever the user set
there), the end-of-file rule (``_limits.incomplete``, and a TIFF's strips must lie inside the
file), and the EXIF orientation from ``_exif`` (never ``getexif()``, which loads a PNG's pixels to
look for a late eXIf chunk and would swallow a load error). ``pixels`` then decodes to an upright
HWC uint8 tensor; ``decode`` to an upright Pillow image (the GPU path's CPU fallback).

This is the CPU path's decoder for everything nvImageCodec does not take (PNG and other formats,
CMYK or 12-bit JPEGs, gray output, and any JPEG nvImageCodec fails on). Pillow releases the GIL
inside decode, so worker threads run in parallel. Every failure is a DecodeError naming the sample.

Pixels are Pillow's ``convert("RGB")`` / ``convert("L")`` of the upright image (what
``ImageOps.exif_transpose(img).convert(...)`` gives: alpha dropped, palettes looked up, CMYK and
YCCK JPEGs as Pillow reads them) except where Pillow's conversion destroys the picture:

- 16-bit grey (``I;16``, ``I;16B``: PNG, TIFF) and the 16-bit ``I`` images (a 16-bit grey PNG
  in the Pillow versions that open it as ``I``, a PGM whose maxval is over 255, which Pillow
  scales to 0..65535) keep their high byte, as Pillow reads 16-bit colour and as torchvision's
  uint16 decode scaled to uint8 does; Pillow clips them at 255, a full-range image nearly white.
- An unsigned 32-bit TIFF (``I``) keeps its high byte too; Pillow reads it as signed (wrapped).
  A signed integer TIFF (16 or 32 bits) has no range to scale from: clipped to 0..255, as Pillow.
- A float image (``F``: 32-bit float TIFF) whose values all lie in [0, 1] (NaN aside) is scaled
  by 255 and rounded half up, torchvision's float convention; Pillow truncates it to 0 and 1.
  Any other float image is Pillow's conversion: clipped to 0..255 and truncated. NaN gives 0.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

from headrace._errors import DecodeError

from ._exif import block_orientation, upright
from ._exif import orientation as exif_orientation
from ._limits import check_pixels, claimed_size, incomplete, release_frames
from ._spec import Decode

__all__ = ["Opened", "decode", "open_image", "pixels"]

_ORIENTATION_TAG = 0x0112
_INVERSE = {1: 1, 2: 2, 3: 3, 4: 4, 5: 5, 6: 8, 7: 7, 8: 6}  # the move that undoes each orientation
_PILLOW_TURNS = {o: o for o in range(2, 9)}  # the orientations Pillow's TIFF loader acts on
_TRANSPOSE = {
    2: (Image.Transpose.FLIP_LEFT_RIGHT,),
    3: (Image.Transpose.ROTATE_180,),
    4: (Image.Transpose.FLIP_TOP_BOTTOM,),
    5: (Image.Transpose.TRANSPOSE,),
    6: (Image.Transpose.ROTATE_270,),
    7: (Image.Transpose.TRANSVERSE,),
    8: (Image.Transpose.ROTATE_90,),
}
# Bytes a pixel takes in Pillow's own storage, by mode: RGB-like modes use 4, whatever their bands.
_SIXTEEN_BIT_GREY = ("I;16", "I;16B", "I;16L", "I;16N")
_PILLOW_BYTES = {"1": 1, "L": 1, "P": 1, "I;16": 2, "I;16B": 2, "I;16L": 2, "I;16N": 2}
_STRIP_TAGS = ((273, 279), (324, 325))  # (StripOffsets, StripByteCounts), (TileOffsets, TileByteCounts)
_BITS_PER_SAMPLE, _SAMPLE_FORMAT, _SIGNED = 258, 339, 2


@dataclass(slots=True)
class Opened:
    """A file whose header passed the checks: Pillow's lazy image and the orientation to apply."""

    img: Image.Image
    orientation: int  # EXIF orientation, as ``_exif`` reads it (1 when Decode(exif=False))
    height: int  # upright size: what the pixels will be
    width: int
    key: str | None
    source: str | None

    def predicted_bytes(self, channels: int) -> int:
        """Peak bytes ``pixels`` holds for this image: Pillow's decoded image, its converted copies
        when the mode differs, the array (which NumPy fills from a ``tobytes`` copy), and the copies
        that turning it upright makes."""
        mode = self.img.mode
        stored = _PILLOW_BYTES.get(mode, 4)
        target = 1 if channels == 1 else 4
        converted = 0
        if mode in ("RGBA", "LA", "PA") or (mode == "P" and "transparency" in self.img.info):
            converted += 4
        if mode not in ("RGB", "L") or (channels == 1) != (mode == "L"):
            converted += target
        if mode in _SIXTEEN_BIT_GREY or mode in ("I", "F"):
            converted += 2 * stored + 1  # NumPy's copy, a scaled copy (I;16), the uint8 result (see _loaded)
        turned = stored + channels if self.orientation != 1 or _pillow_orientation(self.img) != 1 else 0
        return self.height * self.width * (stored + converted + 2 * channels + turned)


def open_image(data: Any, spec: Decode, key: str | None, source: str | None) -> Opened:
    """Read the header of ``data`` and check it against ``spec``'s limits. Raises DecodeError."""
    if len(data) == 0:
        raise DecodeError("empty file: nothing to decode", key=key, source=source)
    claimed = claimed_size(data)
    if claimed is not None:  # before Pillow: some of its plugins allocate, or check, while opening
        check_pixels(*claimed, spec.max_pixels, key, source)
    try:
        img = _open(data)
        width, height = img.size
    except UnidentifiedImageError as exc:
        raise DecodeError("not an image format the decoder knows", key=key, source=source) from exc
    except Image.DecompressionBombError as exc:  # only where max_pixels allows more than Pillow does
        raise DecodeError(f"Pillow's own limit refuses it ({exc}); raise PIL.Image.MAX_IMAGE_PIXELS as well as "
                          f"max_pixels={spec.max_pixels} to decode it", key=key, source=source) from exc
    except Exception as exc:  # noqa: BLE001 - plugins raise OSError, ValueError, struct.error, ...
        raise DecodeError(f"unreadable image header: {type(exc).__name__}: {exc}", key=key, source=source) from exc
    check_pixels(width, height, spec.max_pixels, key, source)
    reason = incomplete(data) or _tiff_outside(img, len(data))
    if reason is not None:
        raise DecodeError(reason, key=key, source=source)
    try:
        orientation = _orientation(data, img) if spec.exif else 1
    except Exception:  # noqa: BLE001 - the parser reads malformed blocks as 1; this is only a guard
        orientation = 1
    applied = _pillow_orientation(img)
    if _INVERSE[applied] >= 5:  # Pillow reports the size it will make: the stored size swapped
        width, height = height, width
    if orientation >= 5:
        width, height = height, width
    return Opened(img, orientation, height, width, key, source)


def pixels(opened: Opened, spec: Decode) -> torch.Tensor:
    """Decode an opened image to an upright HWC uint8 tensor of ``spec.channels``. Raises DecodeError."""
    key, source = opened.key, opened.source
    try:
        img, applied = _loaded(opened.img, spec)
        arr = np.array(img)
        img.close()  # Pillow's pixels go now, not when the last reference does
        if arr.dtype != np.uint8 or arr.ndim not in (2, 3):
            raise ValueError(f"Pillow gave {arr.dtype} pixels of shape {arr.shape}")
        x = torch.from_numpy(arr.reshape(arr.shape[0], arr.shape[1], -1))
        if x.shape[2] != spec.channels:
            raise ValueError(f"Pillow gave {x.shape[2]} channels, expected {spec.channels}")
        x = upright(upright(x, _INVERSE[applied]), opened.orientation)
    except Exception as exc:  # noqa: BLE001 - see _loaded
        raise _failure(exc, opened) from exc
    finally:
        opened.img.close()
    if tuple(x.shape[:2]) != (opened.height, opened.width):
        raise DecodeError(f"decoded {tuple(x.shape[:2])} pixels, the header said {(opened.height, opened.width)}",
                          key=key, source=source)
    return x


def decode(data: Any, spec: Decode, key: str | None, source: str | None) -> Image.Image:
    """Decode ``data`` to an RGB or L Pillow image, upright by its EXIF orientation. Raises DecodeError."""
    opened = open_image(data, spec, key, source)
    try:
        img, applied = _loaded(opened.img, spec)
        for orientation in (_INVERSE[applied], opened.orientation):
            for method in _TRANSPOSE.get(orientation, ()):
                img = img.transpose(method)
    except Exception as exc:  # noqa: BLE001 - see _loaded
        opened.img.close()
        raise _failure(exc, opened) from exc
    return img


def _failure(exc: Exception, opened: Opened) -> DecodeError:
    """The sample's DecodeError for a failure while decoding. The failure's traceback is dropped:
    the error outlives the decode, and its frames would keep the decode's memory (see
    ``_limits.release_frames``)."""
    release_frames(exc)
    if isinstance(exc, MemoryError):
        message = f"out of memory decoding a {opened.width}x{opened.height} image"
    else:
        message = f"corrupt or truncated image: {type(exc).__name__}: {exc}"
    return DecodeError(message, key=opened.key, source=opened.source)


def _loaded(img: Image.Image, spec: Decode) -> tuple[Image.Image, int]:
    """``img`` decoded and converted to RGB or L, and the orientation Pillow applied while loading.

    Corrupt bytes surface as whatever the format plugin trips over (OSError, ValueError,
    struct.error, ...); the callers turn every one into the sample's DecodeError.
    """
    before = _pillow_orientation(img)
    mode = "RGB" if spec.color == "rgb" else "L"
    out = img
    bits = _unsigned_bits(img) if img.mode == "I" else None
    if img.mode in _SIXTEEN_BIT_GREY:
        # Pillow converts 16-bit grey to L or RGB by clipping at 255 (a full-range image comes out
        # nearly white), where it reads 16-bit colour as its high byte: the high byte here too.
        out = Image.fromarray((np.asarray(img) >> 8).astype(np.uint8))
    elif bits is not None:  # 16 or 32-bit unsigned in Pillow's int32 mode: the high byte as well
        values = np.array(img)  # a copy of its own, scaled in place
        if bits == 32:
            values = values.view(np.uint32)  # Pillow reads an unsigned 32-bit TIFF as signed
        values >>= bits - 8
        out = Image.fromarray(np.clip(values, 0, 255, out=values).astype(np.uint8))
    elif img.mode == "F" and _unit_range(values := np.array(img, dtype=np.float32)):
        # Floats in [0, 1] are scaled (Pillow's conversion truncates them to 0 and 1); NaN gives 0.
        np.nan_to_num(values, copy=False, nan=0.0)
        values *= 255
        values += 0.5
        out = Image.fromarray(np.floor(values, out=values).astype(np.uint8))
    elif img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        out = img.convert("RGBA")  # drop alpha the way Pillow's RGB conversion does
    if out.mode != mode:
        out = out.convert(mode)
    else:
        out.load()
    # Pillow's TIFF loader turns the image upright itself and then drops the tag (Pillow >= 10);
    # where the tag is still there, it did not.
    applied = before if before != 1 and _ORIENTATION_TAG not in getattr(img, "tag_v2", {}) else 1
    return out, applied


def _orientation(data: Any, img: Image.Image) -> int:
    """The EXIF orientation to apply to ``img``, opened from ``data``: ``_exif``'s, read from the
    bytes, except for AVIF, whose orientation is its ``irot``/``imir`` boxes: Pillow's AVIF plugin
    puts it in the EXIF block it makes while opening the header, and leaves the pixels as stored."""
    if img.format == "AVIF":
        return block_orientation(img.info.get("exif"))
    return exif_orientation(data)


def _unsigned_bits(img: Image.Image) -> int | None:
    """The bits of an ``I`` (int32) image's unsigned samples where the file says (16 or 32), else
    None (a signed TIFF, or a format that does not say: those are clipped, as Pillow does).

    Pillow opens in mode ``I``: a 16-bit grey PNG (before it opened them as ``I;16``), a PGM with a
    maxval over 255 (its values scaled to 0..65535), and 16 or 32-bit integer TIFFs.
    """
    if img.format in ("PNG", "PPM"):
        return 16
    tags = getattr(img, "tag_v2", None) if img.format == "TIFF" else None
    if tags is None:
        return None
    bits, sample_format = tags.get(_BITS_PER_SAMPLE), tags.get(_SAMPLE_FORMAT, 1)
    bits = bits[0] if isinstance(bits, tuple) and bits else bits
    sample_format = sample_format[0] if isinstance(sample_format, tuple) and sample_format else sample_format
    if sample_format == _SIGNED or bits not in (16, 32):
        return None
    return bits


def _unit_range(values: np.ndarray) -> bool:
    """True when every value that is not NaN lies in [0, 1] (and there is one)."""
    lo, hi = np.fmin.reduce(values, axis=None), np.fmax.reduce(values, axis=None)
    return bool(lo >= 0 and hi <= 1)


def _pillow_orientation(img: Image.Image) -> int:
    """The orientation Pillow's TIFF loader applies on load (1 for other formats, or none set).

    Pillow looks the tag's value up in a dict of 2..8, so any value equal to one of them turns the
    image: a RATIONAL 6/1 or a FLOAT 6.0 as well as an int. Looked up the same way here; an int
    alone was undone before, and such a TIFF came out turned whatever ``Decode(exif=)`` said.
    """
    tags = getattr(img, "tag_v2", None) if img.format == "TIFF" else None
    value = tags.get(_ORIENTATION_TAG) if tags is not None else None
    try:
        return _PILLOW_TURNS.get(value, 1)
    except TypeError:  # an unhashable value (none that Pillow makes is known): not one of them
        return 1


def _tiff_outside(img: Image.Image, size: int) -> str | None:
    """Why a TIFF's strips or tiles do not all lie inside its ``size`` bytes (truncated), or None."""
    tags = getattr(img, "tag_v2", None) if img.format == "TIFF" else None
    if tags is None:
        return None
    for offsets_tag, counts_tag in _STRIP_TAGS:
        offsets, counts = tags.get(offsets_tag), tags.get(counts_tag)
        if offsets is None or counts is None:
            continue
        offsets = offsets if isinstance(offsets, tuple) else (offsets,)
        counts = counts if isinstance(counts, tuple) else (counts,)
        ends = [o + c for o, c in zip(offsets, counts) if isinstance(o, int) and isinstance(c, int)]
        if ends and max(ends) > size:
            return f"TIFF image data runs to byte {max(ends)}, the file has {size} (truncated)"
    return None


def _open(data: Any) -> Image.Image:
    """``Image.open`` without its decompression-bomb check (``Decode.max_pixels`` decides instead).

    The same search as Pillow's: the commonly used plugins first, then all of them; a plugin that
    rejects the bytes with SyntaxError (and the like) lets the next one try.
    """
    fp = io.BytesIO(data)
    prefix = bytes(data[:16])
    Image.preinit()
    tried: set[str] = set()
    for load_plugins in (None, Image.init):
        if load_plugins is not None:
            load_plugins()
        for name in [f for f in Image.ID if f not in tried]:
            tried.add(name)
            factory, accept = Image.OPEN[name]
            ok = not accept or accept(prefix)
            if not ok or isinstance(ok, str):
                continue
            fp.seek(0)
            try:
                return factory(fp, "")
            except (SyntaxError, IndexError, TypeError, struct.error):
                continue
    raise UnidentifiedImageError("cannot identify image file")
