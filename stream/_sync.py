"""The blocking facade: the same async loader, driven from a plain ``for`` loop.

Each ``for`` runs one epoch on an event loop in a background thread (uvloop when installed);
nothing is implemented twice. A task on that loop takes each batch from the epoch's async
iterator one batch ahead of the consumer and leaves it where the consumer's thread picks it up
without waiting on the loop (``_OneAhead``). Asking the loop for every batch
(``run_coroutine_threadsafe``, as before) cost two thread wake-ups a batch, each of which waits
for the GIL, up to the switch interval (5 ms) while the decode threads run Python: at batch 64
that capped the H200's consumer at ~13k images/s. The loader's ``state_dict()`` still says where
the consumer is (after the batch it holds), not where the iterator is.

Inside ``with loader.sync() as epochs:`` one loop thread serves every epoch until the block
ends, so the loader runs ahead into the next epoch (``Loader(run_ahead=...)``) while your code
works between epochs, as DALI's pipeline does. A bare ``for batch in loader.sync():`` has no owner
to end such a thread, so each of its epochs has a loop of its own and does not run ahead: work
started on that loop could not outlive it. Leaving the loop early, or an exception
(KeyboardInterrupt included) in the consumer, stops the task and closes the async iterator on its
loop, which stops the pipeline (and the work ahead); the batch taken ahead is dropped. An epoch's
iterator still held when the next ``iter()`` starts, or at ``close()``, is closed first the same
way: trainers (Lightning's fetcher) may keep the last one after leaving it early.
"""

from __future__ import annotations

import asyncio
import queue
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
        self.thread = threading.Thread(target=self.loop.run_forever, name="headrace-sync-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

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
        self._close_live()  # else the new epoch would wait on a run bound to the old loop
        batches = self._epoch()
        self._live = weakref.ref(batches)
        return batches

    def _close_live(self) -> None:
        batches = self._live() if self._live is not None else None
        self._live = None
        if batches is not None:
            batches.close()  # runs its ``finally``: the pipeline stops (and an epoch's own loop thread is joined)

    def _epoch(self) -> Generator[Batch, None, None]:
        driver = self._driver or _LoopThread()
        loop = driver.loop
        loader = self.loader
        try:
            run_ahead = driver is self._driver and loader.run_ahead
            agen = driver.run(_start(loader, self.progress, run_ahead))
            ahead = _OneAhead(loader, agen, loop)
            driver.run(ahead.start())
            try:
                while True:
                    batch, state = ahead.take()
                    if batch is None:  # the epoch's end
                        loader._handed_state = None
                        return
                    loader._handed_state = state
                    batch.handoff()  # order this thread's CUDA stream after the lane (no-op on the CPU)
                    yield batch
            finally:
                driver.run(ahead.aclose())
        finally:
            if driver is not self._driver:  # an epoch's own loop ends with it
                driver.stop()


class _OneAhead:
    """Takes an epoch's batches from its async iterator on ``loop``, each once the consumer has
    taken the one before, so the next batch is usually waiting when the consumer's thread asks.

    Each batch goes with the loader's state right after the iterator yielded it: the state the
    consumer holds with that batch (``Loader.state_dict``). An error from the iterator reaches the
    consumer after the batches before it, as it would have without running ahead.
    """

    def __init__(self, loader: Loader, agen: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.loader, self.agen, self.loop = loader, agen, loop
        # (batch or None at the end, state) or (exception, None). A C queue: its ``get`` waits with
        # the GIL let go and wakes once, where a ``threading.Condition`` wakes on its lock too.
        self._ready: queue.SimpleQueue[tuple[Any, Any]] = queue.SimpleQueue()
        self._space: asyncio.Event | None = None  # set on the loop when the consumer took the batch
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._space = asyncio.Event()
        self._space.set()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._space is not None
        while True:
            await self._space.wait()  # at most one batch ahead: its memory is the only extra
            self._space.clear()
            try:
                batch = await self.agen.__anext__()
            except StopAsyncIteration:
                self._put((None, None))
                return
            except asyncio.CancelledError:  # ``aclose`` (nobody waits then) or the loop going away
                self._put((ClosedError("the loader's loop stopped before the epoch ended"), None))
                raise
            except BaseException as exc:  # the consumer's to raise, in order
                self._put((exc, None))
                return
            self._put((batch, self.loader._cursor_state()))

    def _put(self, item: tuple[Any, Any]) -> None:
        self._ready.put(item)

    def take(self) -> tuple[Any, Any]:
        """Consumer's thread: the next (batch, state), (None, None) at the end; raises the
        iterator's error."""
        item, state = self._ready.get()
        if isinstance(item, BaseException):
            self.loader._handed_state = None  # the loader's own state, as the error left it
            raise item
        if item is not None:
            assert self._space is not None
            self.loop.call_soon_threadsafe(self._space.set)  # no wait: the loop fetches the next meanwhile
        return item, state

    async def aclose(self) -> None:
        """Stop taking batches (one taken ahead is dropped) and close the iterator."""
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
        await self.agen.aclose()


async def _start(loader: Loader, progress: bool, run_ahead: bool):
    # On the loop's thread, so the async generator is bound to that loop. Running ahead only on a
    # loop that serves the next ``for`` too (inside ``with``), where the work can go on.
    return loader._aiter(run_ahead=run_ahead, progress=progress)
