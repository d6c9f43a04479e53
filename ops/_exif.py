"""EXIF orientation from JPEG bytes, without decoding: the GPU path needs it to plan crops before decode."""

from __future__ import annotations

import struct

__all__ = ["jpeg_orientation"]


def jpeg_orientation(data: bytes | memoryview) -> int:
    """The EXIF orientation tag (1-8) of a JPEG, or 1 when absent or unreadable."""
    buf = bytes(data[:65536]) if not isinstance(data, bytes) else data
    # Exif's APP1 comes first after SOI (or after a JFIF APP0): most files settle in one find().
    if buf[:2] != b"\xff\xd8" or buf.find(b"Exif\x00\x00", 0, 1024) < 0:
        return 1
    pos, n = 2, len(buf)
    while pos + 4 <= n and buf[pos] == 0xFF:
        marker = buf[pos + 1]
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        if marker == 0xDA:  # start of scan: no EXIF before the image data
            return 1
        (length,) = struct.unpack(">H", buf[pos + 2 : pos + 4])
        if marker == 0xE1 and buf[pos + 4 : pos + 10] == b"Exif\x00\x00":
            return _tiff_orientation(buf[pos + 10 : pos + 2 + length])
        pos += 2 + length
    return 1


def _tiff_orientation(tiff: bytes) -> int:
    if len(tiff) < 8:
        return 1
    endian = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if endian is None:
        return 1
    (ifd,) = struct.unpack(endian + "I", tiff[4:8])
    if ifd + 2 > len(tiff):
        return 1
    (count,) = struct.unpack(endian + "H", tiff[ifd : ifd + 2])
    for i in range(count):
        entry = ifd + 2 + 12 * i
        if entry + 12 > len(tiff):
            break
        tag, typ = struct.unpack(endian + "HH", tiff[entry : entry + 4])
        if tag == 0x0112 and typ == 3:
            (value,) = struct.unpack(endian + "H", tiff[entry + 8 : entry + 10])
            return value if 1 <= value <= 8 else 1
    return 1
