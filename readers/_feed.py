"""Hand-off from I/O threads to the event loop: a bounded feed per producer."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Any

from headrace._markers import END  # the producer is done (checked by identity)

__all__ = ["END", "Feed"]


class Feed:
    """A bounded queue from one producer thread to one consumer coroutine.

    ``put`` blocks the thread while ``capacity`` items wait (backpressure reaches the file read) and
    returns False once the consumer has called ``stop``, which also wakes a blocked producer. The
    consumer's ``get`` costs one ``call_soon_threadsafe`` per item only when it had to wait.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, capacity: int) -> None:
        self._loop = loop
        self._capacity = capacity
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._waiter: asyncio.Future[None] | None = None
        self.stopped = False

    def put(self, item: Any, *, force: bool = False) -> bool:
        """Thread side: queue ``item`` (``force`` ignores the bound, for END); False if stopped."""
        with self._cond:
            while not force and len(self._items) >= self._capacity and not self.stopped:
                self._cond.wait()
            if self.stopped:
                return False
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)
        return True

    async def get(self) -> Any:
        """Loop side: the next item, waiting for the producer if there is none yet."""
        while True:
            with self._cond:
                if self._items:
                    item = self._items.popleft()
                    self._cond.notify()
                    return item
                waiter = self._waiter = self._loop.create_future()
            await waiter

    def stop(self) -> None:
        """Loop side: drop what is queued and make the producer's next ``put`` return False."""
        with self._cond:
            self.stopped = True
            self._items.clear()
            self._cond.notify_all()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)
