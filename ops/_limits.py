"""What a file may claim and what a decode may hold: ``Decode(max_pixels=, max_batch_bytes=)``, and
the rule for files that do not end where their format says.

Shared by the CPU and GPU paths so that the same bytes get the same verdict on both:

- ``pixel_error`` / ``check_pixels``: a header claiming more than ``max_pixels`` (width x height)
  is refused before anything is allocated for its pixels. ``claimed_size`` reads the claim of a
  JPEG, PNG, WebP or GIF from the bytes, before any decoder library sees them (some of Pillow's
  format plugins allocate, or apply Pillow's own limit, while they open a file).
- ``incomplete``: the byte-level end-of-file rule (strict): a JPEG must end with its EOI marker,
  a PNG with its IEND chunk and every chunk's CRC must match, a WebP must be as long as its RIFF
  header says, a GIF must end with its trailer byte. A truncated file fails this whatever part of
  it a decoder would read (a region decode stops after the crop's last row; libwebp and nvJPEG
  fill what is missing with grey), and so does a file with bytes after its end.
- ``ByteBudget``: the bytes of decoded pixels that the threads of one executor hold at once.
- ``release_frames``: a sample's error must not keep its pixels alive.
"""

from __future__ import annotations

import struct
import threading
import traceback
import zlib
from collections import deque
from typing import Any

from headrace._errors import DecodeError
from headrace._heap import trim_heap

from ._exif import flat_bytes

__all__ = ["ByteBudget", "check_pixels", "claimed_size", "incomplete", "pixel_error", "release_frames", "too_few_bits"]

# A grant this large is given back to the C allocator's arenas when it ends (see ByteBudget).
TRIM_AT = 64 << 20

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


# libjpeg refuses a side over 65,500 pixels (JPEG_MAX_DIMENSION) where nvJPEG decodes it: the same
# bytes got two verdicts. Every format, on both paths, is held to it, so they agree.
MAX_SIDE = 65500


def pixel_error(width: int, height: int, max_pixels: int | None) -> str | None:
    """Why a header claiming ``width`` x ``height`` is refused, or None when it is within the limit."""
    if width < 1 or height < 1:
        return f"header claims {width}x{height} pixels: an empty image"
    if max_pixels is not None and width * height > max_pixels:
        return f"header claims {width}x{height} pixels, over max_pixels={max_pixels}"
    if max(width, height) > MAX_SIDE:
        return f"header claims {width}x{height} pixels: a side over {MAX_SIDE}, more than JPEG decoders take"
    return None


def check_pixels(width: int, height: int, max_pixels: int | None, key: str | None, source: str | None) -> None:
    """Raise a DecodeError naming the sample when ``pixel_error`` refuses its header."""
    reason = pixel_error(width, height, max_pixels)
    if reason is not None:
        raise DecodeError(reason, key=key, source=source)


def too_few_bits(nbytes, height, width):
    """True where a JPEG of ``nbytes`` bytes holds fewer bits than the 8x8 blocks of the size its
    header claims (ints or NumPy arrays alike).

    Every block of a Huffman-coded JPEG (baseline or progressive) takes at least one bit, its DC
    code, so such a file cannot hold its image. Neither path hands one to nvImageCodec: nvJPEG's
    host decode read past the data of one (a progressive 178x175 JPEG of 4,920 bytes whose header
    claimed 6000x6000) and crashed the process on the H100 (``nvjpegDecodeJpegHost``). Pillow
    decodes what the file holds, or says why not; a valid arithmetic-coded JPEG may be that small,
    and Pillow decodes it.
    """
    return nbytes * 8 < ((height + 7) // 8) * ((width + 7) // 8)


def claimed_size(data: Any) -> tuple[int, int] | None:
    """(width, height) as the header of a JPEG, PNG, WebP or GIF states it; None for other formats
    and for headers too damaged to say (the decoder then reports them)."""
    data = _byte_view(data)
    head = bytes(data[:32])
    try:
        if head[:2] == b"\xff\xd8":
            return _jpeg_size(data)
        if head[:8] == _PNG_SIGNATURE and head[12:16] == b"IHDR":
            width, height = struct.unpack_from(">II", head, 16)
            return width, height
        if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            return _webp_size(head)
        if head[:6] in (b"GIF87a", b"GIF89a"):
            return _gif_size(data)
    except (struct.error, IndexError):
        return None
    return None


def _byte_view(data: Any) -> Any:
    """``data`` as bytes or a flat byte memoryview, whose items are Python ints.

    Why: an image field may be a NumPy uint8 array, whose items are NumPy scalars; NumPy 2 keeps
    ``data[i] << 8`` in uint8, so a JPEG 300 pixels high read as 44.
    """
    return data if isinstance(data, bytes) else flat_bytes(data)


_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # start-of-frame markers (not DHT, JPG, DAC)


def jpeg_sof(data: Any) -> int | None:
    """The start-of-frame marker of a JPEG (0xC0 baseline, 0xC1 extended, 0xC2 progressive, 0xC3
    lossless, ...), which names its coding; None when the header does not reach one."""
    data = _byte_view(data)
    found = _jpeg_frame(data)
    return None if found is None else data[found]


def _jpeg_size(data: Any) -> tuple[int, int] | None:
    pos = _jpeg_frame(data)
    if pos is None:
        return None
    height = (data[pos + 4] << 8) | data[pos + 5]
    width = (data[pos + 6] << 8) | data[pos + 7]
    return width, height


def _jpeg_frame(data: Any) -> int | None:
    """Where the SOF marker's second byte is, when the header reaches a whole SOF segment start."""
    pos, n = 2, len(data)
    while pos + 9 <= n and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1
            continue
        if marker in _SOF:
            return pos + 1
        if marker in (0xDA, 0xD9):
            return None
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:
            pos += 2
            continue
        pos += 2 + ((data[pos + 2] << 8) | data[pos + 3])
    return None


def _gif_size(data: Any) -> tuple[int, int]:
    """The size Pillow opens a GIF at: its logical screen, grown to hold the first frame.

    Why not the screen alone: Pillow enlarges the canvas for a frame that reaches past it (and
    checks its own limit on the result while opening), so a few bytes whose first frame claims
    30000 x 30000 got past ``max_pixels`` here and were refused by Pillow's limit instead.
    """
    width, height = struct.unpack_from("<HH", data, 6)
    flags = data[10]
    pos, n = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0), len(data)  # after the global colour table
    while pos < n and data[pos] == 0x21:  # extensions: a label, then sub-blocks up to an empty one
        pos += 2
        while pos < n and data[pos]:
            pos += 1 + data[pos]
        pos += 1
    if pos < n and data[pos] == 0x2C:  # the first image descriptor: left, top, width, height
        left, top, frame_width, frame_height = struct.unpack_from("<HHHH", data, pos + 1)
        width, height = max(width, left + frame_width), max(height, top + frame_height)
    return width, height


def _webp_size(head: bytes) -> tuple[int, int] | None:
    kind = head[12:16]
    body = 20  # the first chunk's payload
    if kind == b"VP8X":
        width = int.from_bytes(head[body + 4 : body + 7], "little") + 1
        height = int.from_bytes(head[body + 7 : body + 10], "little") + 1
        return width, height
    if kind == b"VP8 " and head[body + 3 : body + 6] == b"\x9d\x01\x2a":
        width, height = struct.unpack_from("<HH", head, body + 6)
        return width & 0x3FFF, height & 0x3FFF
    if kind == b"VP8L" and head[body] == 0x2F:
        bits = int.from_bytes(head[body + 1 : body + 5], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


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

    def _release(self, grant: int, asked: int) -> None:
        if asked >= TRIM_AT:
            # glibc serves a worker thread's allocations from that thread's arena and, once it has
            # freed a block as large as a decoded image, raises its threshold for using mmap (up to
            # 32 MiB). The 16 MiB blocks Pillow allocates an image in then come from the arena, and
            # their pages stay with the process after they are freed: each thread that decoded a
            # large image kept it resident, and a 610 MiB budget held one image at a time peaked at
            # 950 MiB on two threads. Trimming when a large grant ends keeps the resident size to
            # what the budget holds (ops/README.md).
            trim_heap()
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
        self._budget._release(self._grant, self._n)


def release_frames(exc: BaseException, *, keep_text: bool = False) -> BaseException:
    """Drop the tracebacks of ``exc`` and of its causes; return ``exc``. With ``keep_text`` the
    causes' tracebacks stay readable, as a note on each (``add_note``).

    Why: a failed sample's error is kept (in ``Processed.failures``, then in the loader's recent
    errors), and a traceback keeps every frame it passes through alive, and through each frame
    its callers, with their local variables: the decoder's half-filled image, the pixels an op was
    resizing, the executor loop's last decoded image. Thirty errors from files claiming 8192 x
    8192 held 3-7 GiB until their batch was dropped. Clearing the frames' locals is not enough
    (a frame keeps its caller, which keeps its own locals once it returns).
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            if keep_text and e is not exc:
                e.add_note("".join(["Traceback (frames released):\n", *traceback.format_tb(e.__traceback__)]).rstrip())
            e.__traceback__ = None
        pending += [e.__cause__, e.__context__]
    return exc
