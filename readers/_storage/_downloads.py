"""The downloads of one read: their tasks on the loop, their stop, and their counts summed up.

The downloads of a read share a ``Link`` (``_remote_fetch.py``): what they observed of the store
sizes a new download's segments, and it starts at the GET count the earlier ones came to. A reader
passes the same ``Link`` to every epoch's read, so an epoch's first shard starts from what the
last epoch learned instead of one streamed GET.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from headrace._threads import cancel_and_wait

from ._remote import RemoteFile
from ._remote_fetch import Link

if TYPE_CHECKING:
    from headrace.readers._shard_cache import CacheWriter

    from ._resolve import Storage

__all__ = ["START_CAPACITY", "Downloads"]

# What a download buffers at first (the readers' default bound before it could grow): a store whose
# bytes come faster than the parser reads them never needs more.
START_CAPACITY = 8 << 20


class Downloads:
    """The objects one read streams: ``open(source, n)`` starts a download as a task on this loop
    (named ``headrace:storage:n``) and returns the file a parser thread reads; ``aclose()`` stops
    them all and awaits their tasks, even when cancelled. ``retries`` and ``peak`` sum them up."""

    def __init__(self, storage: Storage | None, capacity: int, link: Link | None = None) -> None:
        # ``capacity``: the most a download may buffer. It starts with less (``START_CAPACITY``, or
        # what the read's downloads grew to) and grows while its parser waits (``Fetcher.grow``).
        self.storage, self.capacity = storage, capacity
        self.files: list[RemoteFile] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.retries = 0
        self.peak = 0
        self.link = link or Link()

    def open(self, source: str, n: int, tee: CacheWriter | None = None) -> RemoteFile:
        """``tee``: a local copy the parser writes as it reads (``webdataset(cache_dir=)``)."""
        assert self.storage is not None
        self._prune()
        store, key = self.storage.locate(source)
        # A new download starts with the GETs in flight the read's downloads came to (they grow
        # while their parser waits): the shard after a slow one need not find that out again.
        start = min(self.capacity, max(START_CAPACITY, self.link.capacity))
        remote = RemoteFile(store, key, capacity=start, max_capacity=self.capacity, retry=self.storage.retry,
                            link=self.link, tee=tee)
        self.files.append(remote)
        self.tasks.append(asyncio.get_running_loop().create_task(remote.fill(), name=f"headrace:storage:{n}"))
        return remote

    def hand_over(self, remote: RemoteFile, to: Downloads) -> None:
        """Move a running download to ``to``, which owns it from now on (stops and awaits it)."""
        i = self.files.index(remote)
        to.files.append(self.files.pop(i))
        to.tasks.append(self.tasks.pop(i))

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
                self.retries += remote.fetcher.retries
                self.peak = max(self.peak, remote.fetcher.peak)
                if not task.cancelled():
                    task.exception()  # retrieved: fill() hands its errors to the thread, never raises
            else:
                keep.append((remote, task))
        self.files, self.tasks = [f for f, _ in keep], [t for _, t in keep]
