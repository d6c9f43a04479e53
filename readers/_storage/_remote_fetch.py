"""The loop side of a ``RemoteFile``: the GETs that fill its buffer, how many run at once and how big.

A store that answers each GET after a latency and caps each connection's bandwidth makes one GET
too slow for a parser: while the thread waits for bytes (20 ms of waiting since the last look),
the download gains ranged GETs of the segments ahead. Segments are ``max_capacity / 8``, 1 to 4 MiB
(``segment_bytes``; why 4 at most: ``_MAX_SEGMENT``), and an eighth of the object at most. How many GETs come from what the read's
downloads observed (their ``Link``): the first-byte latency ``L`` and a connection's bandwidth ``B``
(both taken before the read's own GETs load the CPU and the network), and the parser's pace ``R``
(bytes it read per second of not waiting, a wait going on counted as waiting). By Little's law
``n`` segments of ``s`` bytes in flight pass ``n * s / (L + s / B)``: the GETs grow to 1.5 times
what ``R`` needs. A GET holds no bytes while it waits for its first one, so they may ask for
``_SPAN`` (2) capacities at once, ``n * s <= 2 * capacity`` (``_MAX_PIECES`` at most; ``_READ_GETS``
for all the read's downloads), while what they hold stays within ``capacity`` (below).

The bound itself grows the same way: a download starts with ``capacity`` (the read's ``Link``
remembers what the earlier ones came to) and, while its thread still waits with every GET that
bound lets it ask for in flight, doubles it, up to ``max_capacity`` (the reader's ``buffer_bytes``).
A store near enough that the parser never waits leaves it where it started; a far one gets the
bytes in flight its latency and bandwidth need, and no more. Segments are sized from
``max_capacity``, so a download that grows keeps its GETs' size.

Only the oldest download still asking for bytes (``Link.leader``) grows: the ones read ahead stream
on one GET until they lead, then start with what it came to, so the consumer's shard gets the CPU
and the network first. A piece done ahead of the head frees its GET for the next segment at once
(its bytes stay held, counted): GETs started together do not wait for the slowest of them.

Only the first piece's bytes go to the thread; a later piece holds its own until the ones before it
are done. What a download holds is counted as its ``load``: the bytes buffered for the thread, those
held by later pieces, and for each later piece reading a block, what the client may hold for it until
``next()`` hands it over (``Store.held_per_get``, at most what is left of the range: over S3 obstore
assembles a block of 1 MiB and more below us, so a 1 MiB segment sits there whole until it is done).
A later piece reads only while its block fits in ``capacity`` with the load and the bytes the pieces
before it have still to bring (room kept for them: the head never waits on the pieces behind it),
and its block is counted from that check on, so pieces passing together cannot overshoot; the head
reads while the load is under ``capacity``, or the thread has nothing buffered (it waits for these
bytes). Memory stays under ``capacity`` plus the head's block. Each piece retries alone, from its own first missing byte, with
the first answer's ETag; an answer of another size or ETag (a server that ignores ``If-Match``) is the
object changed, a StorageError, never bytes of two versions joined.

The fetcher shares the file's lock: the thread's reads, the bytes held here and the wake-ups
between them are counted under one condition.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from ._base import Body, Store, StoreFault
from ._retry import Retry, backoff_or_raise

if TYPE_CHECKING:
    from ._remote import RemoteFile

__all__ = ["Fetcher", "Link"]


class _Jump(Exception):
    """The thread seeked far ahead: the download starts again there."""

    def __init__(self, target: int) -> None:
        super().__init__(target)
        self.target = target


# The thread waited this long for bytes since the download last grew: more GETs in flight.
_STARVED = 0.02
_MAX_PIECES = 64  # GETs in flight for one download
_SPAN = 2  # what one download's GETs ask for at once, in capacities (a GET waiting for its first byte holds none)
_READ_GETS = 128  # for all the downloads of one read: well inside a store's connection cap (S3's 503 SlowDown)
_MIB = 1 << 20
# A piece reads only with room for the bytes the pieces before it still owe (``_owed_before``), so
# about ``capacity / s`` pieces read at once, and the parser waits on the head piece's one
# connection: larger segments leave fewer pieces reading and longer waits on the head; smaller
# ones cost a GET each. The H200's reader alone over S3 at 50 ms and 100 MB/s a connection read
# 17.0-17.6k samples/s with 8 MiB, 18.9-19.9k with 2, 3 or 4 MiB, 15.6-16.3k with 1 MiB (128 GETs);
# at 128 MiB of buffer 17.4-17.7k with 8 MiB, 19.6-20.0k with 4 (docs/benchmarks.md, fifteenth session).
_MAX_SEGMENT = 4 * _MIB
_REMEMBERED = 1 << 16  # objects whose size and ETag a Link keeps (~150 bytes each)


class Link:
    """What the downloads of one read observed of their store, shared by them: a download sizes
    its GET count from it and starts with the GETs the earlier ones came to (``pieces``).

    Loop side only. ``latency``: seconds from a GET to its answer; ``bandwidth``: bytes a second
    one connection delivered. Both are taken before any download of the read gains a ranged GET:
    later, the read's own GETs share the CPU and the network, and a connection's share of them
    would add more GETs to share them with.
    """

    def __init__(self) -> None:
        self.latency: float | None = None
        self.pieces = 1  # the most GETs in flight one download came to
        self.capacity = 0  # the largest buffer bound one download grew to (0: none grew)
        self.fetchers: dict[Fetcher, None] = {}  # the downloads running now, oldest first
        # Times a head GET went on only because its parser had read all it was given, the room
        # being held by the pieces behind it: it then creeps a block per read (what
        # ``Fetcher._owed_before`` prevents).
        self.head_starved = 0
        # Each object's (size, ETag) from its last download's first answer, by URL: the next
        # download of it (the next epoch's) starts its ranged GETs at once, pinned to that ETag,
        # instead of one latency later.
        self.objects: dict[str, tuple[int, str]] = {}
        self._bytes = 0
        self._seconds = 0.0

    @property
    def bandwidth(self) -> float | None:
        return self._bytes / self._seconds if self._seconds > 0.01 else None

    @property
    def observing(self) -> bool:
        return self.pieces == 1 or self.latency is None or self.bandwidth is None

    def answered(self, seconds: float) -> None:
        if self.observing:
            self.latency = seconds if self.latency is None else min(self.latency, seconds)

    def received(self, nbytes: int, seconds: float) -> None:
        if self.observing:
            self._bytes += nbytes
            self._seconds += seconds

    def remember(self, url: str, size: int, etag: str) -> None:
        self.objects.pop(url, None)
        self.objects[url] = (size, etag)
        if len(self.objects) > _REMEMBERED:
            del self.objects[next(iter(self.objects))]  # the longest unread

    def leader(self) -> Fetcher | None:
        """The oldest running download with bytes no GET asks for yet: the one that adds GETs.

        The consumer reads the downloads in the order they started; once the oldest has asked for
        all its bytes, more GETs for it would fetch nothing, and the next one takes the lead.
        """
        return next((f for f in self.fetchers if f.can_grow()), None)

    def handed_over(self) -> None:
        """The lead passed (a download asked for its last bytes, or ended): the new leader grows now."""
        leader = self.leader()
        if leader is not None:
            leader.grow()

    def wanted(self) -> int:
        """GETs the running downloads want in flight, together."""
        return sum(f.want for f in self.fetchers)


def segment_bytes(capacity: int) -> int:
    """Bytes per ranged GET of a download bound to ``capacity``: an eighth of it in whole MiB, 1 MiB
    to ``_MAX_SEGMENT``."""
    return max(_MIB, min(capacity // 8 // _MIB * _MIB, _MAX_SEGMENT))


class _Piece:
    """Bytes ``[pos, end)`` of the object still to come from one GET (``end`` None: to the object's end)."""

    __slots__ = ("done", "end", "held", "pos", "recovering", "reserved", "streamed")

    def __init__(self, pos: int, end: int | None) -> None:
        self.pos, self.end, self.done = pos, end, False
        self.held: list[tuple[int, memoryview]] = []  # received before it was the head
        self.reserved = 0  # bytes counted for the block the client assembles for it now
        self.streamed = False  # read block by block even where the body could give it whole
        self.recovering = False  # failed, and no block has come since (counted in ``Fetcher.recovering``)


class Fetcher:
    """The GETs of one ``RemoteFile``, run on the loop by its ``fill()``; ``cond`` is the file's lock."""

    def __init__(self, file: RemoteFile, store: Store, key: str, retry: Retry, link: Link,
                 cond: threading.Condition) -> None:
        self.file, self.store, self.key, self.retry, self.link = file, store, key, retry, link
        self._cond = cond
        self.size: int | None = None  # the object's size, from the first answer
        self.retries = 0  # faults survived (reported in the reader's stats)
        # Pieces between a failure and their next block (or their end): the backoff and the retry's
        # first byte. A parser's wait for bytes meanwhile is the fault's, not the link being slow
        # (``RemoteFile.read`` does not count it as starved). Written under the lock.
        self.recovering = 0
        self.peak = 0  # most bytes buffered at once
        self.want = 1  # GETs in flight wanted now
        # Bytes per ranged GET, whatever the bound grows to (4 MiB at the default 64 MiB bound), and
        # an eighth of the object at most once its size is known (``_sized``): a 6 MiB shard gets
        # 1 MiB segments, not less than two 4 MiB ones past its streamed GET and none at all.
        self.segment = segment_bytes(file.max_capacity)
        self._mark: tuple[float, int, float] | None = None  # (time, bytes read, seconds waited) at the last look
        self._loop: asyncio.AbstractEventLoop | None = None
        self._room: asyncio.Event | None = None
        self._waking = False  # a wake-up of the download is scheduled on the loop
        self._pieces: deque[_Piece] = deque()  # in flight or held, in offset order (the head's bytes go to the thread)
        self._running = 0  # pieces whose GET is not done: what ``want`` counts
        self._group: asyncio.TaskGroup | None = None
        self._planned: int | None = None
        self._held = 0  # bytes held by pieces after the head
        self._reserved = 0  # bytes the client may hold for the later pieces' blocks being read
        self._etag: str | None = None
        # The size and ETag are the link's memory of the object, no answer of this download has
        # confirmed them yet: the thread does not see the size, and a GET refused for the ETag
        # (or answered with another object) starts the download again without them.
        self.unconfirmed = False
        self._start = 0  # where the download started last (it starts again there if unconfirmed)

    async def run(self) -> None:
        """Download to the end or a close; raises the first error of a piece's GET."""
        self._loop = asyncio.get_running_loop()
        self._room = asyncio.Event()
        self.link.fetchers[self] = None
        remembered = self.link.objects.get(self.file.identity)
        if remembered is not None:
            self.size, self._etag = remembered
            self.unconfirmed = True
            self._sized(self.size)
        try:
            await self._download()
        except BaseExceptionGroup as group:  # from the pieces' task group: its first error
            raise group.exceptions[0] from None
        finally:
            self.link.fetchers.pop(self, None)
            self.link.handed_over()

    async def _download(self) -> None:
        start: int | None = 0
        while start is not None and not self.file.closed:
            start = await self._from(start)

    async def _from(self, start: int) -> int | None:
        """Download from byte ``start`` to the end: one streamed GET, then (once the thread starves)
        ranged GETs of segments ahead of it. Returns the target of a long seek, or None at the end."""
        self._pieces = deque([_Piece(start, None)])
        self._running = 1
        self._planned = self.size  # the end of the last piece planned; None until the size is known
        self.want = 1
        self._mark = None
        self._start = start
        self.file.restarted()
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                group.create_task(self._fetch(self._pieces[0]), name=f"headrace:storage:range:{start}")
                self.grow()  # with the size known (remembered, or a seek's restart): GETs at once
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
        failures, body, loop = 0, None, asyncio.get_running_loop()
        try:
            while not self.file.closed:
                end = piece.end if piece.end is not None else self.size
                if end is not None and piece.pos >= end:
                    break
                if body is None:
                    asked = loop.time()
                    try:
                        async with asyncio.timeout(self.retry.timeout):
                            body = await self._open(piece)
                    except (StoreFault, TimeoutError) as exc:
                        if self.unconfirmed and isinstance(exc, StoreFault) and not exc.retryable:
                            raise self._forget() from None  # the object changed, or is gone: ask plainly
                        failures += 1
                        await self._backoff(piece, exc, failures)
                        continue
                    self.link.answered(loop.time() - asked)
                    if self.unconfirmed and (body.size, body.etag or self._etag) != (self.size, self._etag):
                        await _drop(body)  # a store that ignored If-Match: another object
                        body = None
                        raise self._forget()
                    changed = self._changed(body)
                    if changed is not None:
                        await _drop(body)
                        body = None
                        await backoff_or_raise(StoreFault(changed, retryable=False), failures + 1, self.retry,
                                               self.file.name, "GET")
                    self._etag = self._etag or body.etag  # later pieces must come from the same object
                    self._confirm(body.size)
                    self.grow()
                    continue
                whole = body.whole and self._whole(piece)
                waited = await self._wait_for_room(piece, whole)
                whole = whole and piece.reserved > 0  # not if it became the head meanwhile: that one streams
                asked = loop.time()
                try:
                    try:
                        async with asyncio.timeout(self.retry.timeout):
                            block = await (body.rest() if whole else body.next())
                    finally:
                        self._release(piece)
                    if not block and piece.pos < (end if end is not None else body.size):
                        raise StoreFault(f"the body ended at byte {piece.pos} of {end}", retryable=True)
                except (StoreFault, TimeoutError) as exc:
                    await _drop(body)
                    body = None
                    failures += 1
                    if whole and isinstance(exc, TimeoutError):
                        piece.streamed = True  # its progress unseen: the retry streams, block by block
                    await self._backoff(piece, exc, failures)
                    continue
                if not block:
                    break
                if not waited:  # bytes the socket held while the piece waited would overstate the link
                    self.link.received(len(block), loop.time() - asked)
                failures = 0  # progress: the budget is for failures in a row
                self._recovered(piece)  # before the thread sees the block: its wait ends with none recovering
                end = piece.end if piece.end is not None else body.size
                if piece.pos + len(block) > end:  # a cut piece, or a server that ignored the range's end
                    block = block[: end - piece.pos]
                self._deliver(piece, memoryview(block))
                piece.pos += len(block)
                self.grow()
        finally:
            self._recovered(piece)
            if body is not None:
                await _drop(body)
        if not self.file.closed:
            self._done(piece)

    async def _open(self, piece: _Piece) -> Body:
        if piece.end is None:
            return await self.store.open(self.key, piece.pos, etag=self._etag)
        return await self.store.open(self.key, piece.pos, end=piece.end, etag=self._etag)

    def _changed(self, body: Body) -> str | None:
        """Why ``body`` is not the object this download's earlier answers came from, or None.

        ``If-Match`` asks the store to refuse another version, but not every server heeds it (a
        plain HTTP server may serve the file as it is now, with its new ETag, ranges and all):
        the answer's size and ETag are checked too, so that a resume never joins the bytes of
        two versions.
        """
        if self.size is not None and body.size != self.size:
            return f"the object changed while it was read (now {body.size} bytes, was {self.size})"
        if self._etag is not None and body.etag is not None and body.etag != self._etag:
            return "the object changed while it was read (its ETag differs)"
        return None

    def _confirm(self, size: int) -> None:
        """An answer: the object's size, for the thread; with its ETag, remembered by the link."""
        with self._cond:
            self.size = size
            self.unconfirmed = False
            self._cond.notify_all()
        self._sized(size)
        if self._etag is not None:
            self.link.remember(self.file.identity, size, self._etag)

    def _sized(self, size: int) -> None:
        """The object's size is known, before any ranged GET: segments of an eighth of it at most
        (``segment_bytes`` of it), so a small object still splits into several."""
        if self._planned is None or self._planned == size:  # no ranged GET planned yet
            self.segment = min(segment_bytes(self.file.max_capacity), segment_bytes(size))

    def _forget(self) -> _Jump:
        """The remembered size and ETag were refused: forgotten, and the download starts again
        where it started, with a plain GET (no byte reached the thread: nothing was answered)."""
        self.link.objects.pop(self.file.identity, None)
        with self._cond:
            self.size = self._etag = None
            self.unconfirmed = False
        return _Jump(self._start)

    def _deliver(self, piece: _Piece, block: memoryview) -> None:
        """The head piece's bytes go to the thread; a later piece's are held until it is the head."""
        if self._pieces and self._pieces[0] is piece:
            self._push(piece.pos, block)
        else:
            with self._cond:
                piece.held.append((piece.pos, block))
                self._held += len(block)
                self.peak = max(self.peak, self.load())

    def _push(self, offset: int, block: memoryview) -> None:
        # The lock (reentrant) is held across the push, so the peak counts the buffer as it left it.
        with self._cond:
            if self.file.push(offset, block):
                self.peak = max(self.peak, self.load())

    def _done(self, piece: _Piece) -> None:
        """A piece is complete: the pieces after it that are complete too, or the next one, become
        the head (their held bytes go to the thread), and the next segment is started."""
        piece.done = True
        self._running -= 1
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

    def grow(self) -> None:
        """More GETs in flight, if this download leads the read's (``Link.leader``): at once as
        many as the read's downloads came to (``Link.pieces``: what the consumer needed), then,
        each time the thread has waited ``_STARVED`` seconds since the last look, what the
        thread's pace needs (see the module docstring), or one more. A download read ahead
        of the consumer keeps its one streamed GET until it leads: the CPU and the network go to
        the shard the consumer waits on first."""
        if self.size is None:
            return
        starved = self.file.starved
        if self._mark is None or starved == 0:
            self._mark = (time.monotonic(), self.file.tell(), self.file.waited)
        if self.link.leader() is not self:
            return
        if self.file.capacity < self.link.capacity:
            # A download opened before an earlier one grew the bound (read ahead of it) takes the
            # lead: it starts with what that one grew to, as it does with the GETs (``link.pieces``,
            # which its own smaller span would cap).
            self._raise_capacity(self.link.capacity)
        # Up to what the read's downloads came to; then, while the thread still waits, what its
        # pace needs, measured again.
        if self.want < self.link.pieces and self._more():
            while self.want < self.link.pieces and self._more():
                pass
        elif starved >= _STARVED:
            self.file.forget_starved()
            needed = self._needed()
            # With the link observed, the GETs the pace needs (half again: the estimate is taken
            # before the read's own load, so it is low); without, one more, as each wait asks.
            target = math.ceil(1.5 * needed) if needed else self.want + 1
            if target > self.want >= _SPAN * self.file.capacity // self.segment:
                self._raise_capacity()  # every GET the bound allows is in flight, and the thread still waits
            while self.want < target and self._more():
                pass
            self._mark = (time.monotonic(), self.file.tell(), self.file.waited)
        if not self.can_grow():
            self.link.handed_over()

    def _raise_capacity(self, to: int | None = None) -> None:
        """Double the buffer bound (or raise it ``to`` that), up to ``max_capacity``; later downloads
        of the read start there."""
        with self._cond:
            grown = min(self.file.max_capacity, to if to is not None else 2 * self.file.capacity)
            if grown <= self.file.capacity:
                return
            self.file.capacity = grown
        self.link.capacity = max(self.link.capacity, grown)
        self.wake()  # pieces waiting for room may fit now

    def can_grow(self) -> bool:
        """Bytes of the object are not yet asked for by a ranged GET (or its size is unknown)."""
        if self.size is None:
            return True
        tail = self._pieces[-1] if self._pieces else None
        if tail is not None and tail.end is None:  # one streamed GET: _more cuts it a segment ahead
            return tail.pos + 2 * self.segment <= self.size
        return self._planned is not None and self._planned < self.size

    def _needed(self) -> int:
        """GETs in flight the thread's pace since the last look needs: ``R * (L + s / B) / s``."""
        link, mark = self.link, self._mark
        bandwidth = link.bandwidth
        if mark is None or link.latency is None or bandwidth is None:
            return 0
        began, read, waited = mark
        busy = (time.monotonic() - began) - (self.file.waited - waited)
        if self.file.tell() <= read:  # nothing read since (a jump, or a thread held up elsewhere)
            return 0
        pace = (self.file.tell() - read) / max(busy, 2e-3)
        return math.ceil(pace * (link.latency + self.segment / bandwidth) / self.segment)

    def _more(self) -> bool:
        """One more piece in flight, if the limits and the object's size allow."""
        assert self.size is not None
        segment = self.segment
        # The span: GETs asking for twice ``capacity``. Answered, the pieces after the head hold
        # their segments (in the client, then here) only as far as the room check lets them.
        if self.want >= min(_MAX_PIECES, _SPAN * self.file.capacity // segment) or self.link.wanted() >= _READ_GETS:
            return False
        tail = self._pieces[-1] if self._pieces else None
        if tail is not None and tail.end is None:  # still one streamed GET: it stops a segment ahead
            if tail.pos + 2 * segment > self.size:
                return False
            tail.end = self._planned = tail.pos + segment
        self.want += 1
        self.link.pieces = max(self.link.pieces, self.want)
        self._plan()
        return True

    def load(self) -> int:
        """The bytes this download holds, counted against ``capacity``: those buffered for the
        thread, those held by later pieces, and the blocks the client assembles for the later
        pieces reading now (``Store.held_per_get`` each, at most what is left of the range; the
        head's block is not counted: its bytes go to the thread as they come)."""
        return self.file.buffered + self._held + self._reserved

    def _release(self, piece: _Piece) -> None:
        with self._cond:
            self._reserved -= piece.reserved
            piece.reserved = 0

    def _plan(self) -> None:
        """Start segments after the last planned piece until ``want`` GETs run (pieces done and
        held behind the head do not count)."""
        if self._group is None or self._planned is None or self.file.closed:
            return
        segment = self.segment
        while self._running < self.want and self._planned < (self.size or 0):
            piece = _Piece(self._planned, min(self._planned + segment, self.size or 0))
            self._planned = piece.end
            self._pieces.append(piece)
            self._running += 1
            self._group.create_task(self._fetch(piece), name=f"headrace:storage:range:{piece.pos}")

    def _drop_pieces(self) -> None:
        with self._cond:
            self._held = self._reserved = 0
        self._pieces.clear()
        self._running = 0

    async def _backoff(self, piece: _Piece, exc: BaseException, failures: int) -> None:
        with self._cond:
            self.retries += 1
            if not piece.recovering:
                piece.recovering = True
                self.recovering += 1
        self.file.forget_starved()  # waiting out a fault is not a download too slow: no more GETs for it
        fault = exc if isinstance(exc, StoreFault) else StoreFault(
            f"stalled: nothing within {self.retry.timeout:g} s", retryable=True)
        await backoff_or_raise(fault, failures, self.retry, self.file.name, "GET")

    def _recovered(self, piece: _Piece) -> None:
        """The piece brought a block after its failure, or ended: no longer recovering."""
        if piece.recovering:
            with self._cond:
                piece.recovering = False
                self.recovering -= 1

    def _whole(self, piece: _Piece) -> bool:
        """Read this piece's range in one go: a later segment (its bytes wait for the ones before
        it anyway), one the link observed delivers well within a retry's timeout (its progress is
        not seen until it is done), and not after such a read timed out."""
        bandwidth = self.link.bandwidth
        if piece.streamed or piece.end is None or bandwidth is None or (self._pieces and self._pieces[0] is piece):
            return False
        return (piece.end - piece.pos) / bandwidth < self.retry.timeout / 4

    async def _wait_for_room(self, piece: _Piece, whole: bool = False) -> bool:
        """Wait until the piece's next block fits: a later piece while ``load()`` and the block the
        client may assemble for it (``whole``: the rest of its range) stay within ``capacity``
        (counted from here until its ``next()`` returns: pieces that pass together cannot
        overshoot); the head while ``load()`` is under it, or the thread has nothing buffered (it
        waits for these bytes). True if it waited. A long seek of the thread ends the download here."""
        assert self._room is not None
        waited = False
        while True:
            with self._cond:
                target = self.file.take_jump()
                if target is not None:
                    raise _Jump(target)
                if self.file.closed:
                    return waited
                if self._pieces and self._pieces[0] is piece:
                    if self.load() < self.file.capacity or not self.file.buffered:
                        if self.load() >= self.file.capacity:  # the room is all behind it
                            self.link.head_starved += 1
                        return waited
                else:
                    rest = (piece.end or 0) - piece.pos
                    block = rest if whole else min(self.store.held_per_get, rest)
                    if self.load() + self._owed_before(piece) + block <= self.file.capacity:
                        piece.reserved = max(block, 0)
                        self._reserved += piece.reserved
                        return waited
                self._room.clear()
            waited = True
            await self._room.wait()

    def _owed_before(self, piece: _Piece) -> int:
        """Bytes the pieces before ``piece`` have still to bring: room kept for them. Held bytes
        reach the thread in offset order, so a later piece filling the room would leave the head
        to creep a block per parser read while the bytes behind it wait."""
        owed = 0
        for ahead in self._pieces:
            if ahead is piece:
                break
            if not ahead.done and ahead.end is not None:
                owed += ahead.end - ahead.pos
        return owed

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
