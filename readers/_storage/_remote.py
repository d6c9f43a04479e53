"""A download on the event loop, read as a file by a parser thread, with a byte bound in between.

``RemoteFile`` is the thread's side: ``read``, ``take``, ``peek``, ``seek`` forward, ``tell``,
``size``. Its ``fill()`` coroutine is the loop's side: its ``Fetcher`` (``_remote_fetch.py``) streams the object
into a buffer of at most ``capacity`` bytes (plus the block in hand) and waits while the buffer is
full, so a slow parser slows the socket (TCP backpressure), whatever the object's size. A dropped or
stalled download is reopened at the first byte not yet received (``Range``, ``If-Match``): the thread
sees one exact byte stream, so no sample is lost or doubled by a retry. A forward seek longer than
what is buffered plus ``jump`` bytes reopens the download at the target instead of reading through.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
from headrace._errors import ReadError, StorageError

from ._base import Store
from ._remote_fetch import Fetcher, Link
from ._retry import Retry

if TYPE_CHECKING:
    from headrace.readers._shard_cache import CacheWriter

__all__ = ["RemoteFile", "Span"]

# ``take`` hands out spans this long and longer; shorter reads (tar headers, labels) are copied at once.
SPAN_MIN = 4 << 10


class Span:
    """Bytes of a download not copied out yet: a view of the block that holds them, and where they
    start in memory. The view keeps the block alive; copy it out soon (``_shard_files`` copies a
    chunk's spans in one GIL-free call) so the block goes back with it."""

    __slots__ = ("address", "view")

    def __init__(self, view: memoryview, address: int) -> None:
        self.view, self.address = view, address

    def __len__(self) -> int:
        return len(self.view)


def _address(block: memoryview) -> int:
    """Where a block's bytes start (read-only buffers too, as obstore's are)."""
    return np.frombuffer(block, dtype=np.uint8).ctypes.data if len(block) else 0


class _Closed(ReadError):
    """The file was closed while the thread still read it (the reader is shutting down)."""


class RemoteFile:
    """One object, downloaded by ``fill()`` on the loop and read by one thread."""

    mode = "rb"

    def __init__(self, store: Store, key: str, *, capacity: int = 8 << 20, retry: Retry | None = None,
                 jump: int = 4 << 20, link: Link | None = None, tee: CacheWriter | None = None,
                 max_capacity: int | None = None) -> None:
        self.name = store.url(key)
        # What the link remembers the object under: an HTTP URL as given, its query string too
        # (``name`` drops it: URLs differing only there are distinct objects of distinct sizes).
        self.identity = key if store.scheme == "http" else self.name
        # A local copy being written (``webdataset(cache_dir=)``): the blocks the thread is done
        # with, handed to the copy's writing thread once the lock is let go (the loop pushes under it).
        self.tee = tee
        self._teed: list[tuple[int, memoryview]] = []
        # ``capacity`` bounds the buffer now; the download may raise it up to ``max_capacity``
        # while the thread waits on a far store (``Fetcher.grow``), never lowers it (a restart after
        # a long seek keeps it). Only the loop writes it, under the lock; the loop reads it without
        # (it is the writer), the thread only under the lock (``_wake``).
        self.capacity, self.jump = capacity, jump
        self.max_capacity = max(capacity, max_capacity or capacity)
        self._cond = threading.Condition()
        # [offset, bytes, their address (found on the first take from the block)], in offset order
        self._blocks: deque[list] = deque()
        self._buffered = 0  # bytes in _blocks
        self._pos = 0  # next byte the thread reads
        self._jump: int | None = None  # set by a long seek, taken by the download
        self._eof = False
        self._error: StorageError | None = None
        self.closed = False
        self._flowing = False  # the head piece has delivered bytes since the last (re)start
        self._starved = 0.0  # seconds the thread waited for bytes, since the download last grew
        self._waited = 0.0  # seconds the thread waited for bytes in all, up to its last wait
        self._waiting: float | None = None  # when the thread's wait for bytes going on now began
        self.fetcher = Fetcher(self, store, key, retry or Retry(), link or Link(), self._cond)

    @classmethod
    def arrived(cls, data: bytes, block: int) -> RemoteFile:
        """A download of ``data`` whose blocks of ``block`` bytes have all arrived: read by a
        thread with no loop and no store behind it (the parser's tests and benchmarks)."""
        from ._memory import MemoryStore

        remote = cls(MemoryStore({"shard": b""}), "shard", capacity=1 << 62)
        view = memoryview(data)
        for offset in range(0, len(data), block):
            remote.push(offset, view[offset : offset + block])
        remote.fetcher.size = len(data)
        remote.finish()
        return remote

    # -- loop side ----------------------------------------------------------------------------

    async def fill(self) -> None:
        """Download into the buffer until the end, a close, or a StorageError (handed to the thread).

        Cancelling it drops the download; a thread still reading gets a ReadError.
        """
        try:
            await self.fetcher.run()
        except StorageError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug or a missing backend: the thread must hear of it, not hang
            self._fail(StorageError(f"download failed: {type(exc).__name__}: {exc}", source=self.name))
        except BaseException:
            self._fail(_Closed("download stopped", source=self.name))
            raise

    @property
    def buffered(self) -> int:
        """Bytes downloaded and not yet read (what ``capacity`` bounds); read with the lock held."""
        return self._buffered

    @property
    def starved(self) -> float:
        """Seconds the thread waited for bytes while they flowed, since ``forget_starved()``."""
        return self._starved

    @property
    def waited(self) -> float:
        """Seconds the thread waited for bytes in ``read``, in all, the wait going on now included
        (its pace is the rest: a wait counted only once it ends would count as the thread busy)."""
        with self._cond:
            began = self._waiting
            return self._waited + (time.monotonic() - began if began is not None else 0.0)

    def forget_starved(self) -> None:
        with self._cond:
            self._starved = 0.0

    def restarted(self) -> None:
        """The download starts again: waiting for its first bytes is not the download being slow."""
        self._flowing = False

    def take_jump(self) -> int | None:
        """With the lock held: the target of a long seek, once (the download starts again there)."""
        target, self._jump = self._jump, None
        return target

    def push(self, offset: int, block: memoryview) -> bool:
        """Bytes for the thread; False if it no longer wants them (closed, or read past by a jump)."""
        with self._cond:
            if self.closed or offset + len(block) <= self._pos:
                return False
            self._blocks.append([offset, block, None])
            self._flowing = True
            self._buffered += len(block)
            self._cond.notify_all()
            return True

    def finish(self) -> None:
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _fail(self, error: StorageError) -> None:
        with self._cond:
            if self._error is None and not self._eof:
                self._error = error
            self._cond.notify_all()

    def close_from_loop(self) -> None:
        """Loop side: stop the download and wake a blocked thread (its next read raises)."""
        with self._cond:
            self.closed = True
            self._drop_all()
            self._cond.notify_all()
        self.fetcher.wake()

    # -- thread side --------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """The object's size in bytes (waits for the first answer)."""
        with self._cond:
            while self.fetcher.size is None or self.fetcher.unconfirmed:
                self._check()
                self._cond.wait()
            return self.fetcher.size

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (fewer only at the end); raises StorageError after the retry budget."""
        if n is None or n < 0:
            n = self.size - self._pos
        # Within the first block, short of its end, without the lock (a tar header, a label, a
        # member's padding: ~0.7 µs against ~3 µs locked, several times a sample). Safe: only this
        # thread takes blocks off and moves ``_pos``; the loop appends, or clears on a close (then
        # the index fails, or the next read that needs the lock raises).
        try:
            offset, block, _ = self._blocks[0]
        except IndexError:
            pass
        else:
            start = self._pos - offset
            if 0 <= start and start + n < len(block):
                self._pos += n
                return bytes(block[start : start + n])
        out: list[memoryview] = []
        got = 0
        with self._cond:
            while got < n:
                if not self._blocks:
                    if self._eof:
                        break
                    self._check()
                    # Not while a piece recovers from a fault: a wait that begins in its backoff
                    # sees no new fault by its end, yet it waits out the fault, not a slow link.
                    began, faults = time.monotonic(), self.fetcher.retries
                    flowing = self._flowing and not self.fetcher.recovering
                    self._waiting = began
                    try:
                        self._cond.wait()
                    finally:
                        self._waiting = None
                    waited = time.monotonic() - began
                    self._waited += waited
                    # Bytes flowed before and after, no fault meanwhile and none being recovered
                    # from at either end: the download is too slow.
                    if flowing and self._flowing and not self.fetcher.recovering and self.fetcher.retries == faults:
                        self._starved += waited
                    continue
                offset, block, _ = self._blocks[0]
                start = self._pos - offset
                part = block[start : start + n - got]
                out.append(part)
                got += len(part)
                self._advance(start, len(part), block)
        if self._teed:
            self._write_teed()
        return bytes(out[0]) if len(out) == 1 else b"".join(out)

    def take(self, n: int) -> bytes | Span:
        """``read(n)``, but where the ``n`` bytes (``SPAN_MIN`` or more) lie in one downloaded block
        already here, a ``Span`` of them, not a copy: the caller copies many spans at once."""
        if n >= SPAN_MIN:
            try:  # within the first block, short of its end: without the lock, as in ``read``
                first = self._blocks[0]
            except IndexError:
                pass
            else:
                offset, block, address = first
                start = self._pos - offset
                if 0 <= start and start + n < len(block):
                    if address is None:  # once a block (numpy: ~2.5 µs; HTTP's small blocks seldom get here)
                        address = first[2] = _address(block)
                    self._pos += n
                    return Span(block[start : start + n], address + start)
            span = None
            with self._cond:
                if self._blocks:
                    first = self._blocks[0]
                    offset, block, address = first
                    start = self._pos - offset
                    if start + n <= len(block):
                        if address is None:  # once a block (numpy: ~2.5 µs; HTTP's small blocks seldom get here)
                            address = first[2] = _address(block)
                        span = Span(block[start : start + n], address + start)
                        self._advance(start, n, block)
            if span is not None:
                if self._teed:
                    self._write_teed()
                return span
        return self.read(n)

    def window(self) -> tuple[memoryview, int] | None:
        """The rest of the block at hand, from the next byte, and where it starts in memory (for the
        tar parser's C helper to read headers in place); None when no block is here yet."""
        try:  # without the lock, as in ``read``: only this thread takes blocks off
            first = self._blocks[0]
        except IndexError:
            return None
        offset, block, address = first
        start = self._pos - offset
        if not 0 <= start < len(block):
            return None
        if address is None:
            address = first[2] = _address(block)
        return block[start:], address + start

    def consume(self, n: int) -> None:
        """The thread is done with the next ``n`` bytes, all in the block ``window()`` gave."""
        with self._cond:
            if not self._blocks:
                self._check()
            offset, block, _ = self._blocks[0]
            self._advance(self._pos - offset, n, block)
        if self._teed:
            self._write_teed()

    def peek(self, n: int = 1) -> bytes:
        """Up to ``n`` next bytes without consuming them (``n`` small: the gzip magic)."""
        with self._cond:
            while True:
                ahead = self._buffered - (self._pos - self._blocks[0][0] if self._blocks else 0)
                if ahead >= n or self._eof:
                    break
                self._check()
                self._cond.wait()
            # Only the n bytes: the blocks may hold the whole buffer by the time a parser opens the shard.
            out: list[bytes] = []
            skip = self._pos - self._blocks[0][0] if self._blocks else 0
            for _, block, _ in self._blocks:
                if n <= 0:
                    break
                part = bytes(block[skip : skip + n])
                out.append(part)
                n -= len(part)
                skip = 0
            return b"".join(out)

    def seek(self, offset: int, whence: int = 0) -> int:
        """Forward only: read through short gaps, reopen the download past long ones."""
        target = offset if whence == 0 else self._pos + offset if whence == 1 else self.size + offset
        if target < self._pos:
            raise OSError(f"cannot seek backwards in a download ({self.name})")
        with self._cond:
            ahead = self._buffered - (self._pos - self._blocks[0][0] if self._blocks else 0)
            if target - self._pos > ahead + self.jump:
                if self.tee is not None:  # the bytes jumped over never come: no whole copy
                    self.tee.abandon()
                self._drop_all()
                self._pos = self._jump = target
                self._flowing = False  # waiting for the first bytes there is not the download being slow
                self._wake(always=True)
                return target
        while self._pos < target and self.read(min(target - self._pos, 1 << 20)):
            pass
        return self._pos

    def keep(self) -> None:
        """Thread side, once the parser is done: read the rest (a tar's end padding) and have the
        local copy put in place if it holds the whole object."""
        tee = self.tee
        if tee is None or not tee.active:
            return
        while tee.active and self.read(1 << 20):
            pass
        tee.commit(self.size)

    def close(self) -> None:
        """Thread side: done reading; the download stops (and a local copy not kept is removed)."""
        with self._cond:
            self.closed = True
            self._drop_all()
            self._wake(always=True)
            self._teed.clear()
        if self.tee is not None:
            self.tee.abandon()

    def __enter__(self) -> RemoteFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- with the lock held -------------------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self.closed:
            raise _Closed("the download was closed", source=self.name)

    def _advance(self, start: int, n: int, block: memoryview) -> None:
        """The thread has read ``n`` bytes of the first block from ``start``: a block read to its end
        goes, and the download may refill."""
        self._pos += n
        if start + n == len(block):
            if self.tee is not None:
                self._teed.append((self._blocks[0][0], block))
            self._blocks.popleft()
            self._buffered -= len(block)
            self._wake()

    def _write_teed(self) -> None:
        """Without the lock: the blocks the thread is done with, to the local copy (may wait while
        the copy's writes are ``buffer_bytes`` behind)."""
        teed, self._teed = self._teed, []
        assert self.tee is not None
        for offset, block in teed:
            self.tee.write(offset, block)

    def _drop_all(self) -> None:
        self._blocks.clear()
        self._buffered = 0

    def _wake(self, always: bool = False) -> None:
        # One call_soon_threadsafe per refill, not per read: only when the download waits for
        # room, the buffer has drained to half (or on a jump or a close), and no wake-up is on
        # its way already (the loop may need a few ms to get the GIL from a parsing thread).
        if always or self._buffered <= self.capacity // 2:
            self.fetcher.wake_from_thread()
