"""Bounded channels between pipeline stages, made as (send, receive) pairs.

A channel is bounded twice: by the number of items and by their total bytes. A full channel makes
``send`` wait, and that wait is the backpressure that reaches back to the reader's I/O. One item
larger than ``max_bytes`` still passes when the channel is empty, so a large sample cannot
deadlock the pipeline.

Each channel also sums the seconds its senders waited for room and its receivers waited for an
item (only waits that happened; a send or receive that did not wait costs no clock read). A wait
still in progress counts up to the moment of the snapshot. The loader reads its "blocked" and
"starved" times from these sums.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ._errors import ClosedError, require_int
from ._markers import END

__all__ = ["ChannelStats", "ReceiveChannel", "SendChannel", "open_channel"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ChannelStats:
    """A snapshot of one channel. ``peak_*`` are the highest levels seen since it opened.

    ``send_wait_seconds`` and ``receive_wait_seconds`` sum, since it opened, the seconds senders
    waited for room and receivers waited for an item, over every waiter (two senders waiting the
    same second count two), waits in progress included.
    """

    name: str
    items: int
    bytes: int
    max_items: int
    max_bytes: int | None  # None: not bounded by bytes
    peak_items: int
    peak_bytes: int
    sent: int
    waiting_senders: int
    waiting_receivers: int
    send_wait_seconds: float = 0.0
    receive_wait_seconds: float = 0.0


class _State:
    def __init__(self, name: str, max_items: int, max_bytes: int) -> None:
        self.name = name
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.buffer: deque[tuple[Any, int]] = deque()
        self.bytes = 0
        self.peak_items = 0
        self.peak_bytes = 0
        self.sent = 0
        self.send_closed = False
        self.receive_closed = False
        self.senders: list[asyncio.Future[None]] = []
        self.receivers: list[asyncio.Future[None]] = []
        self.send_waits = _WaitTime()
        self.receive_waits = _WaitTime()

    def has_room(self, nbytes: int) -> bool:
        if len(self.buffer) >= self.max_items:
            return False
        return not self.buffer or self.bytes + nbytes <= self.max_bytes

    @staticmethod
    def wake(waiters: list[asyncio.Future[None]]) -> None:
        for fut in waiters:
            # A waiter on a loop closed without cancelling it can never run again: setting its
            # result would raise RuntimeError ('Event loop is closed') in whoever closes this end.
            if not fut.done() and not fut.get_loop().is_closed():
                fut.set_result(None)
        waiters.clear()


class _WaitTime:
    """Seconds one end's callers spent waiting: finished waits summed, waits in progress kept by
    their start time until they end. The clock is read only by a call that has to wait."""

    __slots__ = ("done", "open")

    def __init__(self) -> None:
        self.done = 0.0
        self.open: list[float] = []

    def begin(self) -> float:
        started = time.perf_counter()
        self.open.append(started)
        return started

    def end(self, started: float) -> None:
        self.open.remove(started)  # any equal start time is the same to the sum
        self.done += time.perf_counter() - started

    def total(self) -> float:
        now = time.perf_counter() if self.open else 0.0
        return self.done + sum(now - t for t in self.open)


async def _wait(waiters: list[asyncio.Future[None]]) -> None:
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    waiters.append(fut)
    try:
        await fut
    finally:
        if fut in waiters:
            waiters.remove(fut)


class SendChannel(Generic[T]):
    """The sending end. ``aclose()`` tells the receiver that nothing more will come."""

    def __init__(self, state: _State) -> None:
        self._state = state

    async def send(self, item: T, nbytes: int = 0) -> None:
        """Put ``item`` in the channel, waiting while it is full.

        Raises ClosedError if either end is closed. Cancelling a waiting ``send`` leaves the
        channel unchanged.
        """
        s = self._state
        started = 0.0
        try:
            while True:
                if s.send_closed:
                    raise ClosedError(f"send on closed channel {s.name!r}", stage=s.name)
                if s.receive_closed:
                    raise ClosedError(f"channel {s.name!r}: the receiver is gone", stage=s.name)
                if s.has_room(nbytes):
                    break
                started = started or s.send_waits.begin()
                await _wait(s.senders)
        finally:
            if started:
                s.send_waits.end(started)
        s.buffer.append((item, nbytes))
        s.bytes += nbytes
        s.sent += 1
        s.peak_items = max(s.peak_items, len(s.buffer))
        s.peak_bytes = max(s.peak_bytes, s.bytes)
        s.wake(s.receivers)

    async def aclose(self) -> None:
        """Close this end; the receiver gets END after the buffered items. Safe to call twice."""
        self._state.send_closed = True
        self._state.wake(self._state.receivers)
        self._state.wake(self._state.senders)

    def statistics(self) -> ChannelStats:
        return _stats(self._state)


class ReceiveChannel(Generic[T]):
    """The receiving end; ``async for`` yields items until the sender closes."""

    def __init__(self, state: _State) -> None:
        self._state = state

    async def receive(self) -> T | Any:
        """The next item, or the END marker once the sender has closed and the buffer is empty."""
        s = self._state
        started = 0.0
        try:
            while not s.buffer:
                if s.receive_closed:
                    raise ClosedError(f"receive on closed channel {s.name!r}", stage=s.name)
                if s.send_closed:
                    return END
                started = started or s.receive_waits.begin()
                await _wait(s.receivers)
        finally:
            if started:
                s.receive_waits.end(started)
        item, nbytes = s.buffer.popleft()
        s.bytes -= nbytes
        s.wake(s.senders)
        return item

    def __aiter__(self) -> ReceiveChannel[T]:
        return self

    async def __anext__(self) -> T:
        item = await self.receive()
        if item is END:
            raise StopAsyncIteration
        return item

    async def aclose(self) -> None:
        """Drop buffered items; a waiting or later ``send`` raises ClosedError. Safe to call twice."""
        s = self._state
        s.receive_closed = True
        s.buffer.clear()
        s.bytes = 0
        s.wake(s.senders)
        s.wake(s.receivers)

    def statistics(self) -> ChannelStats:
        return _stats(self._state)


def _stats(s: _State) -> ChannelStats:
    return ChannelStats(
        name=s.name,
        items=len(s.buffer),
        bytes=s.bytes,
        max_items=s.max_items,
        max_bytes=None if s.max_bytes == _UNBOUNDED else s.max_bytes,
        peak_items=s.peak_items,
        peak_bytes=s.peak_bytes,
        sent=s.sent,
        waiting_senders=len(s.senders),
        waiting_receivers=len(s.receivers),
        send_wait_seconds=s.send_waits.total(),
        receive_wait_seconds=s.receive_waits.total(),
    )


_UNBOUNDED = 1 << 62  # the byte bound of a channel bounded by its item count alone


def open_channel(
    max_items: int, max_bytes: int = _UNBOUNDED, *, name: str = "channel"
) -> tuple[SendChannel[Any], ReceiveChannel[Any]]:
    """Make a bounded channel and return its ``(send, receive)`` ends.

    ``max_items`` must be a positive, finite count; ``max_bytes`` bounds the sum of the ``nbytes``
    given to ``send``.
    """
    max_items = require_int("max_items", max_items)
    max_bytes = require_int("max_bytes", max_bytes)
    state = _State(name, max_items, max_bytes)
    return SendChannel(state), ReceiveChannel(state)
