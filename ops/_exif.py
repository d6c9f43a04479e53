"""EXIF orientation from encoded bytes, without decoding: one parser for every path and colour mode.

The GPU path needs the orientation to plan crops before decode; the CPU path's two decoders
(nvImageCodec for JPEG, Pillow for the rest) take it from here too, so the same bytes turn the
same way whichever decoder or colour mode runs. Where the tag lives:

- JPEG: the TIFF structure in the first APP1 segment that starts ``Exif\\0\\0``, among the
  application segments that open the file (where the EXIF standard puts it; one after the
  quantization or Huffman tables is not read);
- PNG: the ``eXIf`` chunk; WebP: the ``EXIF`` chunk of its RIFF container;
- TIFF: the file's own first IFD (classic TIFF or BigTIFF, whose IFDs have wider fields);
- AVIF: not read from the bytes here. Its orientation is the container's ``irot``/``imir``
  boxes, which Pillow's AVIF plugin turns into an EXIF block while opening the header (the
  block's own tag is overridden, as libavif and browsers do); ``_pillow`` reads that block with
  ``block_orientation``. Every path hands AVIF to Pillow, so all of them see it.

The rule (CIPA DC-008): tag 0x0112 in IFD0, type SHORT, count 1, value 1..8. Anything else (a
wrong type or count, a value out of range, an offset outside the data, a truncated table) reads
as 1, the image as stored. XMP's ``tiff:Orientation`` and PNG text chunks are not read (browsers
do not read them either).
"""

from __future__ import annotations

import struct
from typing import Any

import torch

__all__ = [
    "bigtiff_orientation", "block_orientation", "jpeg_orientation", "orientation", "stored_region", "tiff_orientation",
    "upright",
]

_TAG = 0x0112
_SHORT = 3
_EXIF_HEADER = b"Exif\x00\x00"


def orientation(data: Any) -> int:
    """The EXIF orientation (1-8) of a JPEG, PNG, WebP or TIFF file; 1 when absent, malformed, or another format."""
    if isinstance(data, bytes) and data[:2] == b"\xff\xd8":
        return _jpeg(data)
    buf = flat_bytes(data)
    head = bytes(buf[:12])
    if head[:2] == b"\xff\xd8":
        return _jpeg(buf)
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return _png(buf)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return _webp(buf)
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return tiff_orientation(buf)
    if head[:4] in (b"II+\x00", b"MM\x00+"):
        return bigtiff_orientation(buf)
    return 1


def jpeg_orientation(data: Any) -> int:
    """The EXIF orientation tag (1-8) of a JPEG, or 1 when absent, malformed, or not a JPEG."""
    buf = data if isinstance(data, bytes) else flat_bytes(data)
    return _jpeg(buf) if buf[:2] == b"\xff\xd8" else 1


def tiff_orientation(tiff: Any, start: int = 0, end: int | None = None) -> int:
    """Tag 0x0112 of IFD0 of the TIFF structure in ``tiff[start:end]`` (a TIFF file, or the body of
    an EXIF block), read in place: no copy of a block that may hold a thumbnail."""
    buf = tiff if isinstance(tiff, bytes) else flat_bytes(tiff)
    n = len(buf) if end is None else min(end, len(buf))
    if n - start < 8:
        return 1
    endian = {b"II": "<", b"MM": ">"}.get(bytes(buf[start : start + 2]))
    if endian is None:
        return 1
    magic, ifd = struct.unpack_from(endian + "HI", buf, start + 2)
    ifd += start
    if magic != 42 or ifd < start + 8 or ifd + 2 > n:
        return 1
    return _ifd_orientation(buf, endian, ifd, n, _CLASSIC)


def block_orientation(block: Any) -> int:
    """Tag 0x0112 of an EXIF block as a decoder library hands it out (Pillow's ``info["exif"]``):
    the TIFF structure, with or without JPEG's ``Exif\\0\\0`` prefix; 1 when absent or malformed."""
    if not block:
        return 1
    buf = block if isinstance(block, bytes) else flat_bytes(block)
    return tiff_orientation(buf, 6 if bytes(buf[:6]) == _EXIF_HEADER else 0)


def bigtiff_orientation(buf: Any) -> int:
    """Tag 0x0112 of IFD0 of a BigTIFF file, by the same rule as ``tiff_orientation``.

    Why a second reader: Pillow's TIFF loader turns a BigTIFF upright on load as it does a
    classic TIFF, and the decode undoes what Pillow applied before applying the orientation read
    here; read as 1, a BigTIFF came out as stored. Its layout: a 16-byte header (byte order, 43,
    offset size 8, 0, the first IFD's 8-byte offset); an IFD is an 8-byte count, then 20-byte
    entries (tag, type, an 8-byte count, an 8-byte value or offset).
    """
    n = len(buf)
    if n < 16:
        return 1
    endian = {b"II": "<", b"MM": ">"}.get(bytes(buf[:2]))
    if endian is None:
        return 1
    magic, offset_size, zero, ifd = struct.unpack_from(endian + "HHHQ", buf, 2)
    if magic != 43 or offset_size != 8 or zero != 0 or ifd < 16 or ifd + 8 > n:
        return 1
    return _ifd_orientation(buf, endian, ifd, n, _BIG)


# An IFD's layout: the count's format, an entry's size and (tag, type, count) format, and where
# its value starts. Classic TIFF: a 2-byte count, 12-byte entries; BigTIFF: 8 and 20.
_CLASSIC = ("H", 2, 12, "HHI", 8)
_BIG = ("Q", 8, 20, "HHQ", 12)


def _ifd_orientation(buf: Any, endian: str, ifd: int, n: int, layout: tuple[str, int, int, str, int]) -> int:
    """The orientation tag in the IFD at ``ifd``: a lone SHORT of 1-8, else 1 (absent or malformed)."""
    count_format, count_size, entry_size, entry_format, value_at = layout
    if ifd + count_size > n:
        return 1
    (count,) = struct.unpack_from(endian + count_format, buf, ifd)
    for i in range(count):
        entry = ifd + count_size + entry_size * i
        if entry + entry_size > n:
            return 1  # the table runs off the end: malformed
        tag, typ, num = struct.unpack_from(endian + entry_format, buf, entry)
        if tag == _TAG:
            if typ != _SHORT or num != 1:
                return 1
            (value,) = struct.unpack_from(endian + "H", buf, entry + value_at)  # a lone SHORT sits at the value's start
            return value if 1 <= value <= 8 else 1
    return 1


def flat_bytes(data: Any) -> memoryview:
    """A flat memoryview of unsigned bytes over ``data`` (an array, a view): its items are Python ints."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _jpeg(buf: Any) -> int:
    # The application segments that open the file, where the EXIF standard puts its APP1 (right
    # after SOI, or after JFIF's APP0); the first Exif one decides. The walk stops at the first
    # other marker (the tables before the scan): one or two hops for most files, which matters on
    # the GPU path's header thread (a walk to the scan took 3 us an image, this one under 1).
    pos, n = 2, len(buf)
    while pos + 4 <= n and buf[pos] == 0xFF:
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte before a marker
            pos += 1
            continue
        if not (0xE0 <= marker <= 0xEF or marker == 0xFE):
            return 1
        length = (buf[pos + 2] << 8) | buf[pos + 3]
        if length < 2:
            return 1
        end = pos + 2 + length
        if marker == 0xE1 and buf[pos + 4 : pos + 10] == _EXIF_HEADER:
            return tiff_orientation(buf, pos + 10, end)
        pos = end
    return 1


def _png(buf: memoryview) -> int:
    pos, n = 8, len(buf)
    while pos + 8 <= n:
        length, kind = struct.unpack_from(">I4s", buf, pos)
        if kind == b"eXIf":
            skip = 6 if bytes(buf[pos + 8 : pos + 14]) == _EXIF_HEADER else 0  # as Pillow reads it
            return tiff_orientation(buf, pos + 8 + skip, pos + 8 + length)
        if kind == b"IEND":
            return 1
        pos += 12 + length
    return 1


def _webp(buf: memoryview) -> int:
    pos, n = 12, len(buf)
    while pos + 8 <= n:
        kind, length = struct.unpack_from("<4sI", buf, pos)
        if kind == b"EXIF":
            skip = 6 if bytes(buf[pos + 8 : pos + 14]) == _EXIF_HEADER else 0  # some writers keep JPEG's prefix
            return tiff_orientation(buf, pos + 8 + skip, pos + 8 + length)
        pos += 8 + length + (length & 1)
    return 1


def stored_region(orientation: int, sh: int, sw: int, y0: int, x0: int, y1: int, x1: int) -> tuple[int, int, int, int]:
    """The region (y0, x0, y1, x1) of the stored sh x sw image that shows as the upright region given.

    The upright image is ``upright(stored, orientation)``; ``upright(stored[region], orientation)``
    is then the upright region (each move maps rectangles to rectangles).
    """
    if orientation == 2:
        return y0, sw - x1, y1, sw - x0
    if orientation == 3:
        return sh - y1, sw - x1, sh - y0, sw - x0
    if orientation == 4:
        return sh - y1, x0, sh - y0, x1
    if orientation == 5:
        return x0, y0, x1, y1
    if orientation == 6:
        return sh - x1, y0, sh - x0, y1
    if orientation == 7:
        return sh - x1, sw - y1, sh - x0, sw - y0
    if orientation == 8:
        return x0, sw - y1, x1, sw - y0
    return y0, x0, y1, x1


def upright(x: torch.Tensor, orientation: int) -> torch.Tensor:
    """Turn an HWC image stored with EXIF ``orientation`` upright (as Pillow's ``exif_transpose``)."""
    if orientation == 2:
        return x.flip(1)
    if orientation == 3:
        return x.flip(0, 1)
    if orientation == 4:
        return x.flip(0)
    if orientation == 5:
        return x.transpose(0, 1)
    if orientation == 6:
        return torch.rot90(x, -1, (0, 1))
    if orientation == 7:
        return x.flip(0, 1).transpose(0, 1)
    if orientation == 8:
        return torch.rot90(x, 1, (0, 1))
    return x
