"""A download on the event loop, read as a file by a parser thread, with a byte bound in between.

``RemoteFile`` is the thread's side: ``read``, ``peek``, ``seek`` forward, ``tell``, ``size``. Its
``fill()`` coroutine is the loop's side: it streams the object into a buffer of at most
``capacity`` bytes (plus the block in hand) and waits while the buffer is full, so a slow parser
slows the socket (TCP backpressure), whatever the object's size. A dropped or stalled download is
reopened at the first byte not yet received (``Range``, ``If-Match``): the thread sees one exact byte
stream, so no sample is lost or doubled by a retry. A forward seek longer than what is buffered
plus ``jump`` bytes reopens the download at the target instead of reading through.

A store that answers each GET after a latency and caps each connection's bandwidth makes one GET
too slow for a parser: while the thread waits for bytes (20 ms of waiting since the last look),
the download gains a ranged GET of the next segment (``capacity / 8`` bytes, 1 MiB at least), up
to ``capacity / segment + 1`` GETs in flight (16 at most). Only the first piece's bytes go to the
thread; a later piece holds its own until the ones before it are done, and reads while everything
held stays under ``capacity``: memory stays under ``2 * capacity`` plus a block per GET. Each piece
retries alone, from its own first missing byte, with the first answer's ETag. ``Downloads`` starts
each new download of a read at the GET count the earlier ones came to.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from headrace._errors import ReadError, StorageError

from ._base import Body, Store, StoreFault
from ._retry import Retry, backoff_or_raise
from headrace._threads import cancel_and_wait

if TYPE_CHECKING:
    from ._resolve import Storage

__all__ = ["Downloads", "RemoteFile"]


class _Closed(ReadError):
    """The file was closed while the thread still read it (the reader is shutting down)."""


class _Jump(Exception):
    """The thread seeked far ahead: the download starts again there."""

    def __init__(self, target: int) -> None:
        super().__init__(target)
        self.target = target


# The thread waited this long for bytes since the download last grew: one more GET in flight.
_STARVED = 0.02
_MAX_PIECES = 16


class _Piece:
    """Bytes ``[pos, end)`` of the object still to come from one GET (``end`` None: to the object's end)."""

    __slots__ = ("done", "end", "held", "pos")

    def __init__(self, pos: int, end: int | None) -> None:
        self.pos, self.end, self.done = pos, end, False
        self.held: list[tuple[int, memoryview]] = []  # received before it was the head


class RemoteFile:
    """One object, downloaded by ``fill()`` on the loop and read by one thread."""

    mode = "rb"

    def __init__(self, store: Store, key: str, *, capacity: int = 8 << 20, retry: Retry | None = None,
                 jump: int = 4 << 20, pieces: int = 1) -> None:
        self.store, self.key, self.name = store, key, store.url(key)
        self.capacity, self.jump = capacity, jump
        self.retry = retry or Retry()
        self._cond = threading.Condition()
        self._blocks: deque[tuple[int, memoryview]] = deque()  # (offset, bytes), in offset order
        self._buffered = 0  # bytes in _blocks
        self._pos = 0  # next byte the thread reads
        self._jump: int | None = None  # set by a long seek, taken by the download
        self._size: int | None = None
        self._eof = False
        self._error: StorageError | None = None
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._room: asyncio.Event | None = None
        self._waking = False  # a wake-up of the download is scheduled on the loop
        self.retries = 0  # faults survived (reported in the reader's stats)
        self.peak = 0  # most bytes buffered at once
        # Loop side: the pieces in flight, in offset order (the head's bytes go to the thread).
        self._pieces: deque[_Piece] = deque()
        self._group: asyncio.TaskGroup | None = None
        self._planned: int | None = None
        self._want = 1
        self.pieces = pieces  # GETs in flight to start with once the size is known
        self._flowing = False  # the head piece has delivered bytes since the last (re)start
        self._held = 0  # bytes held by pieces after the head
        self._etag: str | None = None
        self._starved = 0.0  # seconds the thread waited for bytes, since the download last grew

    # -- loop side ----------------------------------------------------------------------------

    async def fill(self) -> None:
        """Download into the buffer until the end, a close, or a StorageError (handed to the thread).

        Cancelling it drops the download; a thread still reading gets a ReadError.
        """
        self._loop = asyncio.get_running_loop()
        self._room = asyncio.Event()
        try:
            try:
                await self._download()
            except BaseExceptionGroup as group:  # from the pieces' task group: its first error
                raise group.exceptions[0] from None
        except StorageError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug or a missing backend: the thread must hear of it, not hang
            self._fail(StorageError(f"download failed: {type(exc).__name__}: {exc}", source=self.name))
        except BaseException:
            self._fail(_Closed("download stopped", source=self.name))
            raise

    async def _download(self) -> None:
        start: int | None = 0
        while start is not None and not self.closed:
            start = await self._from(start)

    async def _from(self, start: int) -> int | None:
        """Download from byte ``start`` to the end: one streamed GET, then (once the thread starves)
        ranged GETs of segments ahead of it. Returns the target of a long seek, or None at the end."""
        self._pieces = deque([_Piece(start, None)])
        self._planned = self._size  # the end of the last piece planned; None until the size is known
        self._want = 1  # pieces in flight wanted
        self._flowing = False
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                group.create_task(self._fetch(self._pieces[0]), name=f"headrace:storage:range:{start}")
        except BaseExceptionGroup as group:
            jumps = [e for e in group.exceptions if isinstance(e, _Jump)]
            if not jumps:
                raise
            self._drop_pieces()
            return jumps[0].target
        finally:
            self._group = None
        if not self.closed:
            self._finish()
        return None

    async def _fetch(self, piece: _Piece) -> None:
        """One piece's GET, resumed at its first byte not yet received after a fault."""
        failures, body = 0, None
        try:
            while not self.closed:
                end = piece.end if piece.end is not None else self._size
                if end is not None and piece.pos >= end:
                    break
                if body is None:
                    try:
                        async with asyncio.timeout(self.retry.timeout):
                            body = await self._open(piece)
                    except (StoreFault, TimeoutError) as exc:
                        failures += 1
                        await self._backoff(exc, failures)
                        continue
                    self._etag = self._etag or body.etag  # later pieces must come from the same object
                    self._set_size(body.size)
                    self._grow()
                    continue
                await self._wait_for_room(piece)
                try:
                    async with asyncio.timeout(self.retry.timeout):
                        block = await body.next()
                    if not block and piece.pos < (end if end is not None else body.size):
                        raise StoreFault(f"the body ended at byte {piece.pos} of {end}", retryable=True)
                except (StoreFault, TimeoutError) as exc:
                    await _drop(body)
                    body = None
                    failures += 1
                    await self._backoff(exc, failures)
                    continue
                if not block:
                    break
                failures = 0  # progress: the budget is for failures in a row
                end = piece.end if piece.end is not None else body.size
                if piece.pos + len(block) > end:  # a cut piece, or a server that ignored the range's end
                    block = block[: end - piece.pos]
                self._deliver(piece, memoryview(block))
                piece.pos += len(block)
                self._grow()
        finally:
            if body is not None:
                await _drop(body)
        if not self.closed:
            self._done(piece)

    async def _open(self, piece: _Piece) -> Body:
        if piece.end is None:
            return await self.store.open(self.key, piece.pos, etag=self._etag)
        return await self.store.open(self.key, piece.pos, end=piece.end, etag=self._etag)

    def _deliver(self, piece: _Piece, block: memoryview) -> None:
        """The head piece's bytes go to the thread; a later piece's are held until it is the head."""
        if self._pieces and self._pieces[0] is piece:
            self._push(piece.pos, block)
        else:
            with self._cond:
                piece.held.append((piece.pos, block))
                self._held += len(block)
                self.peak = max(self.peak, self._buffered + self._held)

    def _done(self, piece: _Piece) -> None:
        """A piece is complete: the pieces after it that are complete too, or the next one, become
        the head (their held bytes go to the thread), and the next segment is started."""
        piece.done = True
        while self._pieces and self._pieces[0].done:
            self._pieces.popleft()
            if self._pieces:
                head = self._pieces[0]
                with self._cond:
                    self._held -= sum(len(b) for _, b in head.held)
                held, head.held = head.held, []
                for offset, block in held:
                    self._push(offset, block)
        if self._room is not None:
            self._room.set()  # the new head waited as a later piece: it may go on now
        self._plan()

    def _grow(self) -> None:
        """The thread waited for bytes (``_STARVED`` seconds since the last look): one more GET in
        flight, up to ``_limit()``. A new download starts at once with as many as ``pieces``
        (what the downloads before it of the same read came to)."""
        if self._size is None:
            return
        if self._want < self.pieces:
            while self._want < self.pieces and self._more():
                pass
        elif self._starved >= _STARVED:
            with self._cond:
                self._starved = 0.0
            self._more()

    def _more(self) -> bool:
        """One more piece in flight, if the limit and the object's size allow."""
        assert self._size is not None
        segment = self._segment()
        if self._want >= min(_MAX_PIECES, self.capacity // segment + 1):
            return False
        tail = self._pieces[-1] if self._pieces else None
        if tail is not None and tail.end is None:  # still one streamed GET: it stops a segment ahead
            if tail.pos + 2 * segment > self._size:
                return False
            tail.end = self._planned = tail.pos + segment
        self._want += 1
        self._plan()
        return True

    def _segment(self) -> int:
        # Segments of capacity / 8: the pieces after the head hold at most ``capacity`` (the
        # head's bound is its own), and at 50 ms first byte and 100 MB/s a segment of 8 MiB (a
        # 64 MiB buffer) keeps its connection busy 60% of the time, 1 MiB (8 MiB) 17%.
        return max(1 << 20, self.capacity // 8)

    def _plan(self) -> None:
        """Start segments after the last planned piece until ``_want`` are in flight."""
        if self._group is None or self._planned is None or self.closed:
            return
        segment = self._segment()
        while len(self._pieces) < self._want and self._planned < (self._size or 0):
            piece = _Piece(self._planned, min(self._planned + segment, self._size or 0))
            self._planned = piece.end
            self._pieces.append(piece)
            self._group.create_task(self._fetch(piece), name=f"headrace:storage:range:{piece.pos}")

    def _drop_pieces(self) -> None:
        with self._cond:
            self._held = 0
        self._pieces.clear()

    async def _backoff(self, exc: BaseException, failures: int) -> None:
        self.retries += 1
        with self._cond:
            self._starved = 0.0  # waiting out a fault is not a download too slow: no more GETs for it
        fault = exc if isinstance(exc, StoreFault) else StoreFault(
            f"stalled: nothing within {self.retry.timeout:g} s", retryable=True)
        await backoff_or_raise(fault, failures, self.retry, self.name, "GET")

    async def _wait_for_room(self, piece: _Piece) -> None:
        """Wait while the bytes held reach ``capacity`` (the head: its own, sent to the thread;
        a later piece: everything held). A long seek of the thread ends the download here."""
        assert self._room is not None
        while True:
            with self._cond:
                if self._jump is not None:
                    target, self._jump = self._jump, None
                    raise _Jump(target)
                head = bool(self._pieces) and self._pieces[0] is piece
                used = self._buffered if head else self._buffered + self._held
                if used < self.capacity or self.closed:
                    return
                self._room.clear()
            await self._room.wait()

    def _push(self, offset: int, block: memoryview) -> None:
        with self._cond:
            if self.closed or offset + len(block) <= self._pos:  # closed, or read past by a jump
                return
            self._blocks.append((offset, block))
            self._flowing = True
            self._buffered += len(block)
            self.peak = max(self.peak, self._buffered + self._held)
            self._cond.notify_all()

    def _set_size(self, size: int) -> None:
        with self._cond:
            self._size = size
            self._cond.notify_all()

    def _finish(self) -> None:
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
        if self._room is not None:
            self._room.set()

    # -- thread side --------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """The object's size in bytes (waits for the first answer)."""
        with self._cond:
            while self._size is None:
                self._check()
                self._cond.wait()
            return self._size

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (fewer only at the end); raises StorageError after the retry budget."""
        if n is None or n < 0:
            n = self.size - self._pos
        out: list[memoryview] = []
        got = 0
        with self._cond:
            while got < n:
                if not self._blocks:
                    if self._eof:
                        break
                    self._check()
                    began, faults, flowing = time.monotonic(), self.retries, self._flowing
                    self._cond.wait()
                    # Bytes flowed before and after, and no fault meanwhile: the download is too slow.
                    if flowing and self._flowing and self.retries == faults:
                        self._starved += time.monotonic() - began
                    continue
                offset, block = self._blocks[0]
                start = self._pos - offset
                part = block[start : start + n - got]
                out.append(part)
                got += len(part)
                self._pos += len(part)
                if start + len(part) == len(block):
                    self._blocks.popleft()
                    self._buffered -= len(block)
                    self._wake()
        return bytes(out[0]) if len(out) == 1 else b"".join(out)

    def peek(self, n: int = 1) -> bytes:
        """Up to ``n`` next bytes without consuming them (``n`` small: the gzip magic)."""
        with self._cond:
            while True:
                ahead = self._buffered - (self._pos - self._blocks[0][0] if self._blocks else 0)
                if ahead >= n or self._eof:
                    break
                self._check()
                self._cond.wait()
            data = b"".join(bytes(b) for _, b in self._blocks)
            skip = self._pos - self._blocks[0][0] if self._blocks else 0
            return data[skip : skip + n]

    def seek(self, offset: int, whence: int = 0) -> int:
        """Forward only: read through short gaps, reopen the download past long ones."""
        target = offset if whence == 0 else self._pos + offset if whence == 1 else self.size + offset
        if target < self._pos:
            raise OSError(f"cannot seek backwards in a download ({self.name})")
        with self._cond:
            ahead = self._buffered - (self._pos - self._blocks[0][0] if self._blocks else 0)
            if target - self._pos > ahead + self.jump:
                self._drop_all()
                self._pos = self._jump = target
                self._flowing = False  # waiting for the first bytes there is not the download being slow
                self._wake(always=True)
                return target
        while self._pos < target and self.read(min(target - self._pos, 1 << 20)):
            pass
        return self._pos

    def close(self) -> None:
        """Thread side: done reading; the download stops."""
        with self._cond:
            self.closed = True
            self._drop_all()
            self._wake(always=True)

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

    def _drop_all(self) -> None:
        self._blocks.clear()
        self._buffered = 0

    def _wake(self, always: bool = False) -> None:
        # One call_soon_threadsafe per refill, not per read: only when the download waits for
        # room, the buffer has drained to half (or on a jump or a close), and no wake-up is on
        # its way already (the loop may need a few ms to get the GIL from a parsing thread).
        room, loop = self._room, self._loop
        if room is None or loop is None or room.is_set() or self._waking:
            return
        if always or self._buffered <= self.capacity // 2:
            self._waking = True
            try:
                loop.call_soon_threadsafe(self._woken)
            except RuntimeError:  # the loop is closed: so is the download
                pass

    def _woken(self) -> None:
        with self._cond:
            self._waking = False
        assert self._room is not None
        self._room.set()


class Downloads:
    """The objects one read streams: ``open(source, n)`` starts a download as a task on this loop
    (named ``headrace:storage:n``) and returns the file a parser thread reads; ``aclose()`` stops
    them all and awaits their tasks, even when cancelled. ``retries`` and ``peak`` sum them up."""

    def __init__(self, storage: Storage | None, capacity: int) -> None:
        self.storage, self.capacity = storage, capacity
        self.files: list[RemoteFile] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.retries = 0
        self.peak = 0
        self.pieces = 1  # the most GETs in flight a finished download came to

    def open(self, source: str, n: int) -> RemoteFile:
        assert self.storage is not None
        self._prune()
        store, key = self.storage.locate(source)
        # A new download starts with the GETs in flight the read's downloads came to (they grow
        # while their parser waits): the shard after a slow one need not find that out again.
        pieces = max([self.pieces] + [f._want for f in self.files])
        remote = RemoteFile(store, key, capacity=self.capacity, retry=self.storage.retry, pieces=pieces)
        self.files.append(remote)
        self.tasks.append(asyncio.get_running_loop().create_task(remote.fill(), name=f"headrace:storage:{n}"))
        return remote

    def stop(self) -> None:
        """Stop every download and wake every thread waiting for bytes (its read raises)."""
        for remote in self.files:
            remote.close_from_loop()

    async def aclose(self) -> None:
        self.stop()
        try:
            await cancel_and_wait(self.tasks)
        finally:
            self._prune()

    def _prune(self) -> None:
        """Forget finished downloads (an epoch may stream thousands of shards), keeping their counts."""
        keep = []
        for remote, task in zip(self.files, self.tasks):
            if task.done() and remote.closed:
                self.retries += remote.retries
                self.peak = max(self.peak, remote.peak)
                self.pieces = max(self.pieces, remote._want)
                if not task.cancelled():
                    task.exception()  # retrieved: fill() hands its errors to the thread, never raises
            else:
                keep.append((remote, task))
        self.files, self.tasks = [f for f, _ in keep], [t for _, t in keep]


async def _drop(body: Body) -> None:
    try:
        await body.aclose()
    except Exception:  # noqa: BLE001 - closing a failed download can fail too; it is gone either way
        pass
