"""The loop side of a ``RemoteFile``: the GETs that fill its buffer, and how many run at once.

A store that answers each GET after a latency and caps each connection's bandwidth makes one GET
too slow for a parser: while the thread waits for bytes (20 ms of waiting since the last look),
the download gains a ranged GET of the next segment (``capacity / 8`` bytes, 1 MiB at least), up
to ``capacity / segment + 1`` GETs in flight (16 at most). Only the first piece's bytes go to the
thread; a later piece holds its own until the ones before it are done, and reads while everything
held stays under ``capacity``: memory stays under ``2 * capacity`` plus a block per GET. Each piece
retries alone, from its own first missing byte, with the first answer's ETag.

The fetcher shares the file's lock: the thread's reads, the bytes held here and the wake-ups
between them are counted under one condition.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import TYPE_CHECKING

from ._base import Body, Store, StoreFault
from ._retry import Retry, backoff_or_raise

if TYPE_CHECKING:
    from ._remote import RemoteFile

__all__ = ["Fetcher"]


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


class Fetcher:
    """The GETs of one ``RemoteFile``, run on the loop by its ``fill()``; ``cond`` is the file's lock."""

    def __init__(self, file: RemoteFile, store: Store, key: str, retry: Retry, pieces: int,
                 cond: threading.Condition) -> None:
        self.file, self.store, self.key, self.retry = file, store, key, retry
        self._cond = cond
        self.size: int | None = None  # the object's size, from the first answer
        self.retries = 0  # faults survived (reported in the reader's stats)
        self.peak = 0  # most bytes buffered at once
        self.pieces = pieces  # GETs in flight to start with once the size is known
        self.want = 1  # GETs in flight wanted now
        self._loop: asyncio.AbstractEventLoop | None = None
        self._room: asyncio.Event | None = None
        self._waking = False  # a wake-up of the download is scheduled on the loop
        self._pieces: deque[_Piece] = deque()  # in flight, in offset order (the head's bytes go to the thread)
        self._group: asyncio.TaskGroup | None = None
        self._planned: int | None = None
        self._held = 0  # bytes held by pieces after the head
        self._etag: str | None = None

    async def run(self) -> None:
        """Download to the end or a close; raises the first error of a piece's GET."""
        self._loop = asyncio.get_running_loop()
        self._room = asyncio.Event()
        try:
            await self._download()
        except BaseExceptionGroup as group:  # from the pieces' task group: its first error
            raise group.exceptions[0] from None

    async def _download(self) -> None:
        start: int | None = 0
        while start is not None and not self.file.closed:
            start = await self._from(start)

    async def _from(self, start: int) -> int | None:
        """Download from byte ``start`` to the end: one streamed GET, then (once the thread starves)
        ranged GETs of segments ahead of it. Returns the target of a long seek, or None at the end."""
        self._pieces = deque([_Piece(start, None)])
        self._planned = self.size  # the end of the last piece planned; None until the size is known
        self.want = 1
        self.file.restarted()
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
        if not self.file.closed:
            self.file.finish()
        return None

    async def _fetch(self, piece: _Piece) -> None:
        """One piece's GET, resumed at its first byte not yet received after a fault."""
        failures, body = 0, None
        try:
            while not self.file.closed:
                end = piece.end if piece.end is not None else self.size
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
        if not self.file.closed:
            self._done(piece)

    async def _open(self, piece: _Piece) -> Body:
        if piece.end is None:
            return await self.store.open(self.key, piece.pos, etag=self._etag)
        return await self.store.open(self.key, piece.pos, end=piece.end, etag=self._etag)

    def _set_size(self, size: int) -> None:
        with self._cond:
            self.size = size
            self._cond.notify_all()

    def _deliver(self, piece: _Piece, block: memoryview) -> None:
        """The head piece's bytes go to the thread; a later piece's are held until it is the head."""
        if self._pieces and self._pieces[0] is piece:
            self._push(piece.pos, block)
        else:
            with self._cond:
                piece.held.append((piece.pos, block))
                self._held += len(block)
                self.peak = max(self.peak, self.file.buffered + self._held)

    def _push(self, offset: int, block: memoryview) -> None:
        # The lock (reentrant) is held across the push, so the peak counts the buffer as it left it.
        with self._cond:
            if self.file.push(offset, block):
                self.peak = max(self.peak, self.file.buffered + self._held)

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
        self.wake()  # the new head waited as a later piece: it may go on now
        self._plan()

    def _grow(self) -> None:
        """The thread waited for bytes (``_STARVED`` seconds since the last look): one more GET in
        flight, up to ``capacity / segment + 1`` (``_MAX_PIECES`` at most). A new download starts at once with as many as ``pieces``
        (what the downloads before it of the same read came to)."""
        if self.size is None:
            return
        if self.want < self.pieces:
            while self.want < self.pieces and self._more():
                pass
        elif self.file.starved >= _STARVED:
            self.file.forget_starved()
            self._more()

    def _more(self) -> bool:
        """One more piece in flight, if the limit and the object's size allow."""
        assert self.size is not None
        segment = self._segment()
        if self.want >= min(_MAX_PIECES, self.file.capacity // segment + 1):
            return False
        tail = self._pieces[-1] if self._pieces else None
        if tail is not None and tail.end is None:  # still one streamed GET: it stops a segment ahead
            if tail.pos + 2 * segment > self.size:
                return False
            tail.end = self._planned = tail.pos + segment
        self.want += 1
        self._plan()
        return True

    def _segment(self) -> int:
        # Segments of capacity / 8: the pieces after the head hold at most ``capacity`` (the
        # head's bound is its own), and at 50 ms first byte and 100 MB/s a segment of 8 MiB (a
        # 64 MiB buffer) keeps its connection busy 60% of the time, 1 MiB (8 MiB) 17%.
        return max(1 << 20, self.file.capacity // 8)

    def _plan(self) -> None:
        """Start segments after the last planned piece until ``want`` are in flight."""
        if self._group is None or self._planned is None or self.file.closed:
            return
        segment = self._segment()
        while len(self._pieces) < self.want and self._planned < (self.size or 0):
            piece = _Piece(self._planned, min(self._planned + segment, self.size or 0))
            self._planned = piece.end
            self._pieces.append(piece)
            self._group.create_task(self._fetch(piece), name=f"headrace:storage:range:{piece.pos}")

    def _drop_pieces(self) -> None:
        with self._cond:
            self._held = 0
        self._pieces.clear()

    async def _backoff(self, exc: BaseException, failures: int) -> None:
        self.retries += 1
        self.file.forget_starved()  # waiting out a fault is not a download too slow: no more GETs for it
        fault = exc if isinstance(exc, StoreFault) else StoreFault(
            f"stalled: nothing within {self.retry.timeout:g} s", retryable=True)
        await backoff_or_raise(fault, failures, self.retry, self.file.name, "GET")

    async def _wait_for_room(self, piece: _Piece) -> None:
        """Wait while the bytes held reach ``capacity`` (the head: its own, sent to the thread;
        a later piece: everything held). A long seek of the thread ends the download here."""
        assert self._room is not None
        while True:
            with self._cond:
                target = self.file.take_jump()
                if target is not None:
                    raise _Jump(target)
                head = bool(self._pieces) and self._pieces[0] is piece
                used = self.file.buffered if head else self.file.buffered + self._held
                if used < self.file.capacity or self.file.closed:
                    return
                self._room.clear()
            await self._room.wait()

    # -- wake-ups ------------------------------------------------------------------------------

    def wake(self) -> None:
        """Loop side: a piece waiting for room looks again (the head changed, or the file closed)."""
        if self._room is not None:
            self._room.set()

    def wake_from_thread(self) -> None:
        """Thread side, with the lock held: ``wake()`` on the loop, unless the download does not
        wait for room or a wake-up is on its way already."""
        room, loop = self._room, self._loop
        if room is None or loop is None or room.is_set() or self._waking:
            return
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


async def _drop(body: Body) -> None:
    try:
        await body.aclose()
    except Exception:  # noqa: BLE001 - closing a failed download can fail too; it is gone either way
        pass
