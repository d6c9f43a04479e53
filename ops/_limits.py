"""What a file may claim and what a decode may hold: ``Decode(max_pixels=, max_batch_bytes=)``, and
the rule for files that do not end where their format says.

Shared by the CPU and GPU paths so that the same bytes get the same verdict on both:

- ``pixel_error`` / ``check_pixels``: a header claiming more than ``max_pixels`` (width x height)
  is refused before anything is allocated for its pixels.
- ``incomplete``: the byte-level end-of-file rule (strict): a JPEG must end with its EOI marker,
  a PNG with its IEND chunk and every chunk's CRC must match, a WebP must be as long as its RIFF
  header says, a GIF must end with its trailer byte. A truncated file fails this whatever part of
  it a decoder would read (a region decode stops after the crop's last row; libwebp and nvJPEG
  fill what is missing with grey), and so does a file with bytes after its end.
- ``ByteBudget``: the bytes of decoded pixels that the threads of one executor hold at once.
"""

from __future__ import annotations

import struct
import threading
import zlib
from collections import deque
from typing import Any

from headrace._errors import DecodeError

__all__ = ["ByteBudget", "check_pixels", "incomplete", "pixel_error"]

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def pixel_error(width: int, height: int, max_pixels: int | None) -> str | None:
    """Why a header claiming ``width`` x ``height`` is refused, or None when it is within the limit."""
    if width < 1 or height < 1:
        return f"header claims {width}x{height} pixels: an empty image"
    if max_pixels is not None and width * height > max_pixels:
        return f"header claims {width}x{height} pixels, over max_pixels={max_pixels}"
    return None


def check_pixels(width: int, height: int, max_pixels: int | None, key: str | None, source: str | None) -> None:
    """Raise a DecodeError naming the sample when ``pixel_error`` refuses its header."""
    reason = pixel_error(width, height, max_pixels)
    if reason is not None:
        raise DecodeError(reason, key=key, source=source)


def incomplete(data: Any) -> str | None:
    """Why ``data`` does not end where its format says (see the module docstring), or None.

    Zero bytes after the end are padding (some cameras and scanners pad files to a block size)
    and are allowed; any other byte after the end is not. Formats without such a rule here (TIFF,
    BMP, PPM, ...) return None: their decoder checks that the pixel data it reads is there. Cost:
    a few byte reads for JPEG, WebP and GIF; for PNG a walk over the chunks and a CRC of the file
    (zlib's, a small part of the decode's time).
    """
    n = len(data)
    if n < 4:
        return None
    head = bytes(data[:12])
    end = n if data[n - 1] != 0 else len(bytes(data).rstrip(b"\x00"))  # without padding
    if head[:2] == b"\xff\xd8":
        if end < 4 or data[end - 2] != 0xFF or data[end - 1] != 0xD9:
            return "JPEG does not end with its EOI marker (truncated, or bytes after the image)"
        return None
    if head[:8] == _PNG_SIGNATURE:
        return _png_damage(memoryview(data), end)
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        (size,) = struct.unpack_from("<I", head, 4)
        if not 8 + size <= n or end > 8 + size + (size & 1):
            return f"WebP is {n} bytes, its RIFF header says {8 + size} (truncated, or bytes after the image)"
        return None
    if head[:6] in (b"GIF87a", b"GIF89a") and data[end - 1] != 0x3B:
        return "GIF does not end with its trailer byte (truncated, or bytes after the image)"
    return None


def _png_damage(view: memoryview, unpadded: int) -> str | None:
    pos, n = 8, len(view)
    while pos + 12 <= n:
        length, kind = struct.unpack_from(">I4s", view, pos)
        end = pos + 12 + length
        if end > n:
            return f"PNG chunk {kind!r} at byte {pos} runs past the end of the file (truncated)"
        (crc,) = struct.unpack_from(">I", view, end - 4)
        if zlib.crc32(view[pos + 4 : end - 4]) != crc:
            return f"PNG chunk {kind!r} at byte {pos} fails its CRC (damaged)"
        if kind == b"IEND":
            return None if end >= unpadded else f"PNG has {unpadded - end} bytes after its IEND chunk"
        pos = end
    return "PNG ends without its IEND chunk (truncated)"


class ByteBudget:
    """Bytes of decoded pixels that the worker threads of one executor may hold together.

    ``hold(n)`` waits until it can take ``n`` bytes at once, all or nothing, then gives them back
    when its block ends. A thread holds at most one grant and never waits while holding one, so
    the threads cannot deadlock; grants are served in the order asked (a large one is not starved
    by small ones). A request larger than the whole budget takes the whole budget: it runs alone.
    ``limit=None`` never waits.
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self._free = limit or 0
        self._cond = threading.Condition()
        self._queue: deque[object] = deque()
        self.peak = 0  # the most bytes granted at once: for tests and reports

    def hold(self, n: int) -> _Grant:
        return _Grant(self, n)

    def _acquire(self, n: int) -> int:
        if self.limit is None:
            return 0
        grant = min(n, self.limit)
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while self._queue[0] is not ticket or self._free < grant:
                    self._cond.wait()
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next in line may fit now
            self._free -= grant
            self.peak = max(self.peak, self.limit - self._free)
        return grant

    def _release(self, grant: int) -> None:
        if grant:
            with self._cond:
                self._free += grant
                self._cond.notify_all()


class _Grant:
    __slots__ = ("_budget", "_n", "_grant")

    def __init__(self, budget: ByteBudget, n: int) -> None:
        self._budget, self._n, self._grant = budget, n, 0

    def __enter__(self) -> None:
        self._grant = self._budget._acquire(self._n)

    def __exit__(self, *exc) -> None:
        self._budget._release(self._grant)
