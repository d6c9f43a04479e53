"""Remote shards kept on local disk as they are read, so later epochs (and later runs) read them
from there: ``webdataset(..., cache_dir=, cache_bytes=)``.

A shard is written while its parser reads it (``RemoteFile``'s ``tee``: each downloaded block once
the parser is done with it, handed to one writing thread per read, so parsing and writing overlap)
into a file of its own name ending ``.part``, and renamed into place only once every byte of the
object is in it: a reader that stops early, seeks far ahead, or meets a fault it cannot get past leaves no file
behind. Several processes (ranks on one host) may share a folder: each writes its own ``.part`` and
the rename is atomic, so a reader sees a whole shard or none.

A cached shard is used as it is, without asking the store: like webdataset's ``cache_dir`` and
litdata's cache, the cache assumes the object at a URL does not change (clear the folder if it
does). With ``cache_bytes``, the least recently used shards go to make room for a new one (the
folder locked: ranks committing at once evict for each other's shards too); a shard larger than the
bound alone is not kept, its copy stopped once it passes the bound. Writing never fails a read: an unwritable folder, a
write error, or a disk nearly full (``_cache_folder.disk_has_room``: checkpoints must still fit)
stops the caching of that shard (counted in ``failed``), and the parser goes on.

A copy records the size it was written with (``_cache_folder.damage``). One found of another size,
or with no record (copied by a tool that leaves extended attributes behind), is removed and the
store read instead: a tar cut where a sample starts parses without an error, and every epoch would
silently lose the samples after the cut.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from headrace._threads import join_threads

from ._cache_folder import (CacheFolder, damage, disk_has_room, hold, is_copy, is_dead_part, locked_folder, logger,
                            nearly_full, unlink)

__all__ = ["CacheWriter", "CacheWrites", "ShardCache"]

_CHECK_EVERY = 64 << 20  # bytes a shard's copy writes between two looks at the free space


class ShardCache(CacheFolder):
    """A folder of whole shards, named by their URL. ``hits``: shards read from it; ``kept``: shards
    written to it; ``evicted``: shards removed for room; ``failed``: writes given up (disk full, ...);
    ``damaged``: copies found of another size than written, or with no record of it, removed and
    read from the store instead."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int | None = None) -> None:
        super().__init__(folder, max_bytes)
        self.hits = self.kept = self.evicted = self.damaged = 0
        _remove_dead_parts(self.folder)

    def __repr__(self) -> str:
        return (f"ShardCache({str(self.folder)!r}, max_bytes={self.max_bytes}, hits={self.hits}, kept={self.kept}, "
                f"evicted={self.evicted}, failed={self.failed})")

    def path(self, url: str, identity: str | None = None) -> Path:
        """Where the shard at ``url`` is kept: named by ``identity`` (its source as given), else ``url``."""
        return self.folder / self._name(url, "shard", identity)[1]

    def open(self, url: str, identity: str | None = None) -> BinaryIO | None:
        """The cached copy of ``url``, open for reading, or None. Opened here, not by path later: a
        copy another process evicts meanwhile stays readable once open."""
        path = self.path(url, identity)
        try:
            f = open(path, "rb", buffering=1 << 20)  # noqa: SIM115 - the parser closes it
        except OSError:
            return None
        try:
            why = damage(f.fileno(), os.fstat(f.fileno()).st_size)
        except OSError:  # its record cannot be read: not served, and a new copy replaces it
            f.close()
            return None
        if why is not None:
            self._remove_damaged(url, path, f, why)
            return None
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        with self._lock:
            self.hits += 1
        return f

    def _remove_damaged(self, url: str, path: Path, f: BinaryIO, why: str) -> None:
        """A copy not whole (``why``): parsed, it would end early without an error (a tar cut at a
        header ends there), so it goes and the store is read; a later read keeps a new copy."""
        found = os.fstat(f.fileno())
        f.close()
        try:
            if os.stat(path).st_ino == found.st_ino:  # not a whole copy another rank put there since
                os.unlink(path)
        except OSError:
            pass
        with self._lock:
            self.damaged += 1
        logger.warning("headrace: the cached copy of %s in %s %s: removed, read from the store", url, self.folder, why)

    def writer(self, url: str, writes: CacheWrites, identity: str | None = None) -> CacheWriter | None:
        """A ``.part`` file for ``url``'s bytes, written by ``writes``, or None where it cannot be
        made (counted)."""
        final = self.path(url, identity)
        part = Path(self._part(final))
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            self._give_up(url, exc)
            return None
        hold(fd)  # until renamed or removed: a ``.part`` file not held is a killed run's (``is_dead_part``)
        return CacheWriter(self, url, fd, part, final, writes)

    def _make_room(self, size: int, keep: Path) -> bool:
        """With ``max_bytes``: remove the least recently used shards until ``size`` more fit. False
        if it cannot fit even alone. Called with the folder locked (``locked_folder``)."""
        if self.max_bytes is None:
            return True
        if size > self.max_bytes:
            return False
        shards = []
        for entry in os.scandir(self.folder):
            if not is_copy(entry) or entry.path == str(keep):  # a user's file in the folder stays
                continue
            try:
                st = entry.stat()
            except OSError:  # removed meanwhile (another process)
                continue
            shards.append((st.st_mtime, st.st_size, entry.path))
        total = sum(s for _, s, _ in shards)
        for _, nbytes, path in sorted(shards):
            if total + size <= self.max_bytes:
                break
            try:
                os.unlink(path)
                self.evicted += 1
            except FileNotFoundError:
                pass
            total -= nbytes
        return total + size <= self.max_bytes


class CacheWrites:
    """The local copies' writes of one read, done in order by one thread of their own, so a parser
    goes on parsing while its blocks go to disk. At most ``bound`` bytes wait to be written: past
    it a parser waits (a disk slower than the store slows the read, rather than filling memory).
    ``aclose()`` waits for the writes queued, then for the thread."""

    def __init__(self, bound: int) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="headrace-io-cache")
        self._cond = threading.Condition()
        self._queued = 0
        self._bound = bound
        self._last: concurrent.futures.Future[None] | None = None

    def submit(self, job: Callable[[], None], nbytes: int = 0) -> None:
        with self._cond:
            while nbytes and self._queued and self._queued + nbytes > self._bound:  # a removal never waits
                self._cond.wait()
            self._queued += nbytes
            self._last = self._pool.submit(self._run, job, nbytes)

    def _run(self, job: Callable[[], None], nbytes: int) -> None:
        try:
            job()
        finally:
            with self._cond:
                self._queued -= nbytes
                self._cond.notify_all()

    async def aclose(self) -> None:
        self._pool.shutdown(wait=False)  # what is queued still runs
        if self._last is not None:
            await join_threads([self._last])
        self._pool.shutdown(wait=True)


class CacheWriter:
    """One shard's ``.part`` file, written front to back by ``CacheWrites``' thread. The parser's
    side: ``write(offset, block)`` queues a block that starts where the last ended (else the copy
    is given up: a seek skipped bytes); ``commit(size)`` puts it in place once it holds ``size``
    bytes; ``abandon()`` removes it. Each is called once the parser is done with the block."""

    def __init__(self, cache: ShardCache, url: str, fd: int, part: Path, final: Path, writes: CacheWrites) -> None:
        self.cache, self.url, self._writes = cache, url, writes
        self._part, self._final = part, final
        self._fd: int | None = fd  # the writing thread's
        self._next = 0  # the parser's: the offset the next block must start at
        self._open = True  # the parser's: neither committed nor abandoned yet
        self._failed = False  # set by the writing thread (a full disk)
        self._unchecked: int | None = None  # bytes written since the free space was last looked at

    @property
    def active(self) -> bool:
        return self._open and not self._failed

    def write(self, offset: int, block: memoryview) -> None:
        if not self.active:
            return
        if offset != self._next or self._past_the_bound(offset + len(block)):
            self.abandon()
            return
        self._next += len(block)
        self._writes.submit(functools.partial(self._write, block), len(block))

    def _past_the_bound(self, nbytes: int) -> bool:
        """A shard of more than ``max_bytes`` is never kept: its copy stops there, rather than
        writing the whole shard to disk (it may be many times the bound) to throw it away."""
        return self.cache.max_bytes is not None and nbytes > self.cache.max_bytes

    def commit(self, size: int) -> None:
        if not self._open:
            return
        if self._next != size:
            self.abandon()
            return
        self._open = False
        self._writes.submit(functools.partial(self._commit, size))

    def abandon(self) -> None:
        if self._open:
            self._open = False
            self._writes.submit(self._remove)

    # -- the writing thread ----------------------------------------------------------------------

    def _write(self, block: memoryview) -> None:
        if self._fd is None:
            return
        if self._unchecked is None or self._unchecked >= _CHECK_EVERY:
            if not disk_has_room(self.cache.folder, _CHECK_EVERY):
                self._failed = True
                self.cache._give_up(self.url, nearly_full())
                self._remove()
                return
            self._unchecked = 0
        self._unchecked += len(block)
        try:
            view = block
            while view:  # a short write goes on where it stopped
                view = view[os.write(self._fd, view) :]
        except OSError as exc:
            self._failed = True
            self.cache._give_up(self.url, exc)
            self._remove()

    def _commit(self, size: int) -> None:
        fd, self._fd = self._fd, None
        if fd is None:  # a write failed
            return
        try:  # held until renamed or removed (``hold``)
            try:
                self.cache._record_size(fd, size)
                # The folder locked, not only this process's threads: two ranks looking at it at once
                # would each evict for their own shard the same oldest copies, and both pass the bound.
                with self.cache._lock, locked_folder(self.cache.folder):
                    if self.cache._make_room(size, self._final):
                        os.replace(self._part, self._final)
                        self.cache.kept += 1
                        return
            except OSError as exc:
                self.cache._give_up(self.url, exc)
            unlink(self._part)  # over the bound alone, or failed
        finally:
            os.close(fd)

    def _remove(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            unlink(self._part)
            os.close(fd)


def _remove_dead_parts(folder: Path) -> None:
    """``.part`` files whose writer is gone: a run killed mid-shard."""
    for entry in os.scandir(folder):
        if is_dead_part(entry.path):
            unlink(entry.path)
