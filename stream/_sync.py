"""The blocking facade: the same async loader, driven from a plain ``for`` loop.

Each ``for`` runs one epoch on an event loop in a background thread (uvloop when installed) and
hands batches over with ``run_coroutine_threadsafe``; nothing is implemented twice. So it does not
run ahead into the next epoch (``Loader(run_ahead=...)``): that work would be bound to a loop that
ends with the epoch. Leaving the loop early, or an exception (KeyboardInterrupt included) in the
consumer, closes the async iterator on its loop, which stops the pipeline, before the thread is
joined. An epoch's iterator still held when the next ``iter()`` starts, or at ``close()``, is closed
first the same way: trainers (Lightning's fetcher) may keep the last one after leaving it early.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

from ._loop import new_event_loop

if TYPE_CHECKING:
    from ._loader import Loader, LoaderStats
    from ._sample import Batch

__all__ = ["SyncLoader"]


class SyncLoader:
    """``for batch in loader.sync():`` yields one epoch per loop; ``len()`` and state pass through.

    ``progress``: a tqdm bar per epoch (``Loader(progress=...)``); ``stats()`` is the loader's.
    """

    def __init__(self, loader: Loader, *, progress: bool = False) -> None:
        self.loader = loader
        self.progress = progress
        # Weak: a dropped iterator is still closed at once by its finaliser, as before.
        self._live: weakref.ref[Generator[Batch, None, None]] | None = None

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
        loop = new_event_loop()
        try:
            loop.run_until_complete(self.loader.aclose())
        finally:
            loop.close()

    def __enter__(self) -> SyncLoader:
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
            batches.close()  # runs its ``finally``: the pipeline stops and the loop thread is joined

    def _epoch(self) -> Generator[Batch, None, None]:
        loop = new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="headrace-sync-loop", daemon=True)
        thread.start()
        try:
            agen = asyncio.run_coroutine_threadsafe(_start(self.loader, self.progress), loop).result()
            try:
                while True:
                    future = asyncio.run_coroutine_threadsafe(agen.__anext__(), loop)
                    try:
                        batch = future.result()
                    except StopAsyncIteration:
                        return
                    except BaseException:
                        future.cancel()
                        raise
                    batch.handoff()  # order this thread's CUDA stream after the lane (no-op on the CPU)
                    yield batch
            finally:
                asyncio.run_coroutine_threadsafe(agen.aclose(), loop).result()
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()


async def _start(loader: Loader, progress: bool):
    # On the loop's thread, so the async generator is bound to that loop; no running ahead: the
    # next ``for`` has a loop of its own, where work started on this one could not go on.
    return loader._aiter(run_ahead=False, progress=progress)
