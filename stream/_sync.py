"""The blocking facade: the same async loader, driven from a plain ``for`` loop.

Each ``for`` runs one epoch on an event loop in a background thread (uvloop when installed) and
hands batches over with ``run_coroutine_threadsafe``; nothing is implemented twice. Inside
``with loader.sync() as epochs:`` one loop thread serves every epoch until the block ends, so the
loader runs ahead into the next epoch (``Loader(run_ahead=...)``) while your code works between
epochs, as DALI's pipeline does. A bare ``for batch in loader.sync():`` has no owner to end such a
thread, so each of its epochs has a loop of its own and does not run ahead: work started on that
loop could not outlive it. Leaving the loop early, or an exception (KeyboardInterrupt included) in
the consumer, closes the async iterator on its loop, which stops the pipeline (and the work ahead).
An epoch's iterator still held when the next ``iter()`` starts, or at ``close()``, is closed first
the same way: trainers (Lightning's fetcher) may keep the last one after leaving it early. Asking
such a closed iterator for another batch (a ``for`` nested in another over the same loader) is a
ClosedError, as for the async iterator, not a silent end of its epoch. An iterator
dropped in a reference cycle is closed by the garbage collector, which may run on the loop's own
thread: there the close is handed to the loop (waiting for it would block the loop that runs it),
and the next ``iter()`` or ``close()`` waits for it to finish.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import weakref
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

from ._errors import ClosedError
from ._loop import new_event_loop

if TYPE_CHECKING:
    from ._loader import Loader, LoaderStats
    from ._sample import Batch

__all__ = ["SyncLoader"]


class _LoopThread:
    """An event loop running in a thread of its own until ``stop()``."""

    def __init__(self) -> None:
        self.loop = new_event_loop()
        # The epochs' async iterators until they are closed, held where the running thread keeps
        # them reachable: when an epoch's generator is dropped in a reference cycle, the garbage
        # collector must not finalise its iterator too, or it would be closed twice at once.
        self.iterators: set[Any] = set()
        self.thread = threading.Thread(target=self._serve, name="headrace-sync-loop", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.loop.run_forever()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def on_its_thread(self) -> bool:
        return threading.current_thread() is self.thread

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class SyncLoader:
    """``for batch in loader.sync():`` yields one epoch per loop; ``len()`` and state pass through.

    ``progress``: a tqdm bar per epoch (``Loader(progress=...)``); ``stats()`` is the loader's.
    Used as a context manager, it keeps one loop thread for all its epochs (the loader runs ahead
    between them, where its ``run_ahead`` is on) and closes the loader at the end of the block.
    """

    def __init__(self, loader: Loader, *, progress: bool = False) -> None:
        self.loader = loader
        self.progress = progress
        # Weak: a dropped iterator is still closed at once by its finaliser, as before.
        self._live: weakref.ref[Generator[Batch, None, None]] | None = None
        self._driver: _LoopThread | None = None  # inside ``with``: the block's loop thread, for every epoch
        # An epoch's close handed to its loop by a finaliser on that loop's thread, and the loop
        # thread to stop once it is done (None: the block's, which goes on).
        self._closing: tuple[concurrent.futures.Future[None], _LoopThread | None] | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def stats(self) -> LoaderStats:
        return self.loader.stats()

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        """Close the epoch in progress if its iterator is still held, then release what outlives
        an epoch (threads, the GPU lanes). Safe to call twice."""
        self._close_live()
        # The work ahead, if any, lives on the block's loop: the loader is closed there.
        driver, self._driver = self._driver, None
        driver = driver or _LoopThread()
        try:
            driver.run(self.loader.aclose())
        finally:
            driver.stop()

    def __enter__(self) -> SyncLoader:
        if self._driver is None:
            self._driver = _LoopThread()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[Batch]:
        self._close_live("this epoch's iterator was replaced by a later for loop over the same loader")
        batches = _EpochIterator(self._epoch())
        self._live = weakref.ref(batches)
        return batches

    def _close_live(self, why: str | None = None) -> None:
        """Close the epoch still held (else a new epoch would wait on a run bound to the old loop).
        With ``why`` (a later ``iter()``), asking it for another batch is then a ClosedError saying
        so; after ``close()`` it just has no more (a trainer stopped at a step limit)."""
        batches = self._live() if self._live is not None else None
        self._live = None
        if batches is not None:
            batches.close(why)  # runs its ``finally``: the pipeline stops (and an epoch's own loop thread is joined)
        closing, self._closing = self._closing, None
        if closing is not None:  # closed by the garbage collector on its loop's thread: wait for it here
            done, driver = closing
            try:
                done.result()
            finally:
                if driver is not None:
                    driver.stop()

    def _epoch(self) -> Generator[Batch, None, None]:
        driver = self._driver or _LoopThread()
        own = driver is not self._driver  # an epoch's own loop ends with it
        loop = driver.loop
        try:
            run_ahead = not own and self.loader.run_ahead
            agen = driver.run(_start(self.loader, self.progress, run_ahead))
            driver.iterators.add(agen)
            step: list[asyncio.Task[Batch]] = []  # the request for the next batch, running on the loop
            try:
                while True:
                    future = asyncio.run_coroutine_threadsafe(_next(agen, step), loop)
                    try:
                        batch = future.result()
                    except StopAsyncIteration:
                        return
                    except BaseException:  # KeyboardInterrupt while waiting: the step still runs
                        future.cancel()  # cancels it on the loop; ``_close`` waits for it to end
                        raise
                    batch.handoff()  # order this thread's CUDA stream after the lane (no-op on the CPU)
                    yield batch
            finally:
                if driver.on_its_thread():
                    # The garbage collector finalises this generator on the loop's thread (it was
                    # dropped in a reference cycle): waiting there would block the loop that has
                    # to run the close, forever. The loop closes it (and stops, if it is the
                    # epoch's own); the next ``iter()`` or ``close()`` waits for that.
                    done = asyncio.run_coroutine_threadsafe(_close_on_its_loop(driver, agen, stop=own), loop)
                    self._closing, own = (done, driver if own else None), False
                else:
                    try:
                        driver.run(_close(agen, step))
                    finally:
                        driver.iterators.discard(agen)
        finally:
            if own:
                driver.stop()


class _EpochIterator:
    """One epoch's batches. Closed by a later ``iter()`` of the same facade (a nested ``for`` over
    it, or a trainer starting the next epoch while it holds this one), it raises ClosedError if
    asked for another batch, as the async iterator does, instead of ending the epoch silently."""

    __slots__ = ("_batches", "_closed_because", "_ended", "__weakref__")

    def __init__(self, batches: Generator[Batch, None, None]) -> None:
        self._batches = batches
        self._closed_because: str | None = None
        self._ended = False

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Batch:
        if self._closed_because is not None and not self._ended:
            raise ClosedError(self._closed_because)
        try:
            return next(self._batches)
        except StopIteration:
            self._ended = True
            raise

    def close(self, why: str | None = None) -> None:
        self._closed_because = why
        self._batches.close()


async def _start(loader: Loader, progress: bool, run_ahead: bool):
    # On the loop's thread, so the async generator is bound to that loop. Running ahead only on a
    # loop that serves the next ``for`` too (inside ``with``), where the work can go on.
    return loader._aiter(run_ahead=run_ahead, progress=progress)


async def _next(agen: Any, step: list[asyncio.Task[Batch]]) -> Batch:
    step[:] = [asyncio.current_task()]
    return await anext(agen)


async def _close(agen: Any, step: list[asyncio.Task[Batch]]) -> None:
    """Close the epoch's generator once its last step has ended. A step the consumer stopped
    waiting for (a KeyboardInterrupt) is being cancelled but may still run: closing the generator
    under it would fail ("asynchronous generator is already running") and leave it running."""
    if step and not step[0].done():
        await asyncio.wait(step)
    await agen.aclose()


async def _close_on_its_loop(driver: _LoopThread, agen: Any, *, stop: bool) -> None:
    try:
        await agen.aclose()
    finally:
        driver.iterators.discard(agen)
        if stop:  # the epoch's own loop: nothing else runs on it
            driver.loop.stop()
