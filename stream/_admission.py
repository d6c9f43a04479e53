"""A bound on requests in flight, with first-come-first-served waiting and a close that wakes waiters."""

from __future__ import annotations

import asyncio
from collections import deque

from ._errors import ClosedError

__all__ = ["Admission"]


class Admission:
    """At most ``limit`` permits out at once.

    Unlike ``asyncio.Semaphore`` it can be closed: ``close()`` fails every waiter (and every later
    ``acquire``) with ClosedError, so callers waiting for room do not hang past the service's end.
    ``try_acquire(n)`` takes ``n`` permits or none, for the "reject" policy; it never jumps the queue
    of callers already waiting.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.closed = False
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def try_acquire(self, n: int = 1) -> bool:
        if self.closed:
            raise ClosedError("the service is closed")
        if self.waiting or self.used + n > self.limit:
            return False
        self._take(n)
        return True

    async def acquire(self) -> None:
        """One permit; waits in arrival order while none is free. Raises ClosedError once closed."""
        if self.try_acquire(1):
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release()  # granted just as the caller was cancelled: pass it on
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            try:
                self._waiters.remove(waiter)  # only a cancelled one is still there: O(n), but rare
            except ValueError:
                pass

    def release(self, n: int = 1) -> None:
        self.used -= n
        self._wake()

    def close(self) -> None:
        """Fail every waiter with ClosedError; later acquires fail too. Permits out stay valid."""
        self.closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ClosedError("the service closed while the request waited for room"))

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def _wake(self) -> None:
        while self._waiters and self.used < self.limit:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._take(1)
                waiter.set_result(None)
