"""The Preprocessor's requests: admitted within ``max_pending``, queued, and gathered into batches
under a latency bound.

A batch closes when it holds ``max_batch`` requests (or ``max_pending``, if that is fewer: then
no other request can come until this batch goes) or when its oldest request has waited
``max_delay``, whichever comes first, and only once a batch slot is free: while the executor is
busy, requests pile up, so batches grow with the load by themselves.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._admission import Admission
from ._errors import ClosedError, OverloadedError
from ._sample import Sample

if TYPE_CHECKING:
    from ._service import ImageBytes, PreprocessorStats

__all__ = ["Request", "RequestBatcher"]


@dataclass(eq=False, slots=True)
class Request:
    sample: Sample
    future: asyncio.Future[Any]
    arrival: float
    dispatched: bool = False
    retired: bool = False


class RequestBatcher:
    """Requests from their admission to their batch, and the bound on batches in flight.

    A request holds a place of ``admission`` (``max_pending``) from the moment it is queued until it
    is retired: withdrawn while queued, answered at close, or its batch ended. Each request is a
    ``Sample`` whose ``field`` holds the image; ``stats`` counts requests, batches and answers.
    """

    def __init__(self, field: str, *, max_batch: int, max_delay: float, max_pending: int, batches_in_flight: int,
                 stats: PreprocessorStats) -> None:
        self.max_batch = max_batch
        self.max_delay = max_delay
        self.admission = Admission(max_pending)
        self._field = field
        self._queue: deque[Request] = deque()
        self._queued = 0  # live (not withdrawn) requests in _queue
        self._arrived = asyncio.Event()
        self._slots = asyncio.Semaphore(batches_in_flight)
        self._numbers = 0
        self._stats = stats

    # --- requests -----------------------------------------------------------------------------------

    async def admit(self, datas: list[ImageBytes], keys: list[str | None], reqs: list[Request], *,
                    reject: bool) -> None:
        """Queue a request per image, each once it has a place, into ``reqs`` (so that a caller
        cancelled part-way withdraws those already queued). ``reject``: raise OverloadedError at
        once, before any work, unless every image has a place now."""
        if reject:
            if not self.admission.try_acquire(len(datas)):
                self._stats.rejected += len(datas)
                n, used, limit = len(datas), self.admission.used, self.admission.limit
                if n > limit:  # not "0 images in flight": a caller told that would retry forever
                    why = (f"a list of {n} images is more than max_pending={limit}: taken whole or not at all, it "
                           f"never fits; send at most {limit} at once")
                else:
                    why = f"{used} images in flight, max_pending={limit}" + (f", {n} asked for" if n > 1 else "")
                raise OverloadedError(why, key=self._name(keys[0]), source="request")
            reqs.extend([self._enqueue(d, k) for d, k in zip(datas, keys)])
        else:
            for d, k in zip(datas, keys):
                await self._acquire_place(k)  # one at a time: a list longer than max_pending still fits
                reqs.append(self._enqueue(d, k))

    async def _acquire_place(self, key: str | None) -> None:
        """One place of ``admission``. If the service closes meanwhile, the ClosedError names the
        request, as a queued request's does: a caller with several waiting learns which."""
        try:
            await self.admission.acquire()
        except ClosedError as exc:
            raise ClosedError(exc.message, key=self._name(key), source="request") from None

    def _name(self, key: str | None) -> str:
        """``key``, or ``request-<n>`` with a number of its own: a request refused before it was
        queued named the next request's number, so two requests' errors bore one name."""
        if key:
            return key
        self._numbers += 1
        return f"request-{self._numbers - 1}"

    def _enqueue(self, data: ImageBytes, key: str | None) -> Request:
        n = self._numbers
        self._numbers += 1
        sample = Sample(key=key or f"request-{n}", fields={self._field: data}, source="request", index=n, position=n)
        loop = asyncio.get_running_loop()
        req = Request(sample, loop.create_future(), loop.time())
        self._queue.append(req)
        self._queued += 1
        self._stats.requests += 1
        self._arrived.set()
        return req

    def withdraw(self, reqs: list[Request]) -> None:
        """The caller left (cancelled, or failed part-way through a list): drop what is unanswered."""
        for r in reqs:
            if r.future.done():
                # Answered before the caller left (a list's first images when the close stops the rest,
                # or a close racing a cancel): read its error, or asyncio logs "Future exception was
                # never retrieved" for it.
                if not r.future.cancelled():
                    r.future.exception()
                continue
            r.future.cancel()
            self._stats.cancelled += 1
            if not r.dispatched:  # still queued: free its place now; a dispatched one frees it when its batch ends
                self._queued -= 1
                self._retire(r)

    def _retire(self, r: Request) -> None:
        if not r.retired:
            r.retired = True
            self.admission.release()

    def answer(self, r: Request, *, result: Any = None, error: BaseException | None = None) -> None:
        if r.future.done():  # the caller left while its batch ran
            return
        if error is None:
            r.future.set_result(result)
            self._stats.completed += 1
        else:
            r.future.set_exception(error)
            self._stats.failed += 1

    def close(self) -> None:
        """Fail queued requests and callers waiting for room with ClosedError."""
        self.admission.close()
        while self._queue:
            r = self._queue.popleft()
            if not r.future.done():
                self._queued -= 1
                self.answer(r, error=ClosedError("the service closed before the request was processed",
                                                 key=r.sample.key, source="request"))
                self._retire(r)

    # --- batching -----------------------------------------------------------------------------------

    async def collect(self, tg: asyncio.TaskGroup, process: Callable[[list[Request], int], Awaitable[None]]) -> None:
        """Forever: a free batch slot, then the next batch, started in ``tg`` as ``process(reqs, index)``,
        which calls ``batch_done`` at its end."""
        index = 0
        while True:
            await self._slots.acquire()
            try:
                reqs = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            self._stats.batches += 1
            self._stats.batch_sizes[len(reqs)] += 1
            tg.create_task(process(reqs, index), name=f"preprocessor:batch{index}")
            index += 1

    async def _next_batch(self) -> list[Request]:
        loop = asyncio.get_running_loop()
        while True:
            while self._queue and self._queue[0].future.done():  # withdrawn or failed at close
                self._queue.popleft()
            if self._queued >= self._full_batch():
                break
            timeout = None
            if self._queued:
                timeout = self._queue[0].arrival + self.max_delay - loop.time()
                if timeout <= 0:
                    break
            self._arrived.clear()
            try:
                async with asyncio.timeout(timeout):
                    await self._arrived.wait()
            except TimeoutError:
                pass
        reqs: list[Request] = []
        while self._queue and len(reqs) < self.max_batch:
            r = self._queue.popleft()
            if not r.future.done():
                r.dispatched = True
                reqs.append(r)
        self._queued -= len(reqs)
        return reqs

    def _full_batch(self) -> int:
        """Requests that make a batch full. With ``max_pending`` below ``max_batch``, once every place is
        queued no other request can be admitted before this batch goes: waiting for company then
        only costs ``max_delay`` (or, with a long one, hangs every caller)."""
        return min(self.max_batch, self.admission.limit)

    def batch_done(self, reqs: list[Request]) -> None:
        """A batch ended, however: its requests' places and its slot are free again."""
        for r in reqs:
            self._retire(r)
        self._slots.release()
