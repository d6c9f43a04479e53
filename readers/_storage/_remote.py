"""A download on the event loop, read as a file by a parser thread, with a byte bound in between.

``RemoteFile`` is the thread's side: ``read``, ``peek``, ``seek`` forward, ``tell``, ``size``. Its
``fill()`` coroutine is the loop's side: it streams the object into a buffer of at most
``capacity`` bytes (plus the block in hand) and waits while the buffer is full, so a slow parser
slows the socket (TCP backpressure), whatever the object's size. A dropped or stalled download is
reopened at the first byte not yet received (``Range``, ``If-Match``): the thread sees one exact byte
stream, so no sample is lost or doubled by a retry. A forward seek longer than what is buffered
plus ``jump`` bytes reopens the download at the target instead of reading through.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import TYPE_CHECKING

from headrace._errors import ReadError, StorageError

from ._base import Body, Store, StoreFault
from ._retry import Retry, backoff_or_raise
from headrace._threads import cancel_and_wait

if TYPE_CHECKING:
    from ._resolve import Storage

__all__ = ["Downloads", "RemoteFile"]


class _Closed(ReadError):
    """The file was closed while the thread still read it (the reader is shutting down)."""


class RemoteFile:
    """One object, downloaded by ``fill()`` on the loop and read by one thread."""

    mode = "rb"

    def __init__(self, store: Store, key: str, *, capacity: int = 8 << 20, retry: Retry | None = None,
                 jump: int = 4 << 20) -> None:
        self.store, self.key, self.name = store, key, store.url(key)
        self.capacity, self.jump = capacity, jump
        self.retry = retry or Retry()
        self._cond = threading.Condition()
        self._blocks: deque[tuple[int, memoryview]] = deque()  # (offset, bytes), in offset order
        self._buffered = 0  # bytes in _blocks
        self._pos = 0  # next byte the thread reads
        self._jump: int | None = None  # set by a long seek, taken by the download
        self._size: int | None = None
        self._eof = False
        self._error: StorageError | None = None
        self.closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._room: asyncio.Event | None = None
        self._waking = False  # a wake-up of the download is scheduled on the loop
        self.retries = 0  # faults survived (reported in the reader's stats)
        self.peak = 0  # most bytes buffered at once

    # -- loop side ----------------------------------------------------------------------------

    async def fill(self) -> None:
        """Download into the buffer until the end, a close, or a StorageError (handed to the thread).

        Cancelling it drops the download; a thread still reading gets a ReadError.
        """
        self._loop = asyncio.get_running_loop()
        self._room = asyncio.Event()
        try:
            await self._download()
        except StorageError as exc:
            self._fail(exc)
        except Exception as exc:  # a bug or a missing backend: the thread must hear of it, not hang
            self._fail(StorageError(f"download failed: {type(exc).__name__}: {exc}", source=self.name))
        except BaseException:
            self._fail(_Closed("download stopped", source=self.name))
            raise

    async def _download(self) -> None:
        offset, failures, etag = 0, 0, None
        body: Body | None = None
        try:
            while not self.closed:
                if body is None:
                    if self._size is not None and offset >= self._size:
                        return self._finish()
                    try:
                        async with asyncio.timeout(self.retry.timeout):
                            body = await self.store.open(self.key, offset, etag=etag)
                    except (StoreFault, TimeoutError) as exc:
                        failures += 1
                        await self._backoff(exc, failures)
                        continue
                    etag = etag or body.etag  # later pieces must come from the same object
                    self._set_size(body.size)
                await self._wait_for_room()
                with self._cond:
                    jump, self._jump = self._jump, None
                if jump is not None and jump > offset:
                    await _drop(body)
                    body, offset = None, jump
                    continue
                try:
                    async with asyncio.timeout(self.retry.timeout):
                        block = await body.next()
                    if not block and offset < body.size:
                        raise StoreFault(f"the body ended at byte {offset} of {body.size}", retryable=True)
                except (StoreFault, TimeoutError) as exc:
                    await _drop(body)
                    body = None
                    failures += 1
                    await self._backoff(exc, failures)
                    continue
                if not block:
                    return self._finish()
                failures = 0  # progress: the budget is for failures in a row
                self._push(offset, memoryview(block))
                offset += len(block)
        finally:
            if body is not None:
                await _drop(body)

    async def _backoff(self, exc: BaseException, failures: int) -> None:
        self.retries += 1
        fault = exc if isinstance(exc, StoreFault) else StoreFault(
            f"stalled: nothing within {self.retry.timeout:g} s", retryable=True)
        await backoff_or_raise(fault, failures, self.retry, self.name, "GET")

    async def _wait_for_room(self) -> None:
        assert self._room is not None
        while True:
            with self._cond:
                if self._buffered < self.capacity or self.closed or self._jump is not None:
                    return
                self._room.clear()
            await self._room.wait()

    def _push(self, offset: int, block: memoryview) -> None:
        with self._cond:
            if self.closed or offset + len(block) <= self._pos:  # closed, or read past by a jump
                return
            self._blocks.append((offset, block))
            self._buffered += len(block)
            self.peak = max(self.peak, self._buffered)
            self._cond.notify_all()

    def _set_size(self, size: int) -> None:
        with self._cond:
            self._size = size
            self._cond.notify_all()

    def _finish(self) -> None:
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def _fail(self, error: StorageError) -> None:
        with self._cond:
            if self._error is None and not self._eof:
                self._error = error
            self._cond.notify_all()

    def close_from_loop(self) -> None:
        """Loop side: stop the download and wake a blocked thread (its next read raises)."""
        with self._cond:
            self.closed = True
            self._drop_all()
            self._cond.notify_all()
        if self._room is not None:
            self._room.set()

    # -- thread side --------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """The object's size in bytes (waits for the first answer)."""
        with self._cond:
            while self._size is None:
                self._check()
                self._cond.wait()
            return self._size

    def tell(self) -> int:
        return self._pos

    def read(self, n: int = -1) -> bytes:
        """Up to ``n`` bytes (fewer only at the end); raises StorageError after the retry budget."""
        if n is None or n < 0:
            n = self.size - self._pos
        out: list[memoryview] = []
        got = 0
        with self._cond:
            while got < n:
                if not self._blocks:
                    if self._eof:
                        break
                    self._check()
                    self._cond.wait()
                    continue
                offset, block = self._blocks[0]
                start = self._pos - offset
                part = block[start : start + n - got]
                out.append(part)
                got += len(part)
                self._pos += len(part)
                if start + len(part) == len(block):
                    self._blocks.popleft()
                    self._buffered -= len(block)
                    self._wake()
        return bytes(out[0]) if len(out) == 1 else b"".join(out)

    def peek(self, n: int = 1) -> bytes:
        """Up to ``n`` next bytes without consuming them (``n`` small: the gzip magic)."""
        with self._cond:
            while True:
                ahead = self._buffered - (self._pos - self._blocks[0][0] if self._blocks else 0)
                if ahead >= n or self._eof:
                    break
                self._check()
                self._cond.wait()
            data = b"".join(bytes(b) for _, b in self._blocks)
            skip = self._pos - self._blocks[0][0] if self._blocks else 0
            return data[skip : skip + n]

    def seek(self, offset: int, whence: int = 0) -> int:
        """Forward only: read through short gaps, reopen the download past long ones."""
        target = offset if whence == 0 else self._pos + offset if whence == 1 else self.size + offset
        if target < self._pos:
            raise OSError(f"cannot seek backwards in a download ({self.name})")
        with self._cond:
            ahead = self._buffered - (self._pos - self._blocks[0][0] if self._blocks else 0)
            if target - self._pos > ahead + self.jump:
                self._drop_all()
                self._pos = self._jump = target
                self._wake(always=True)
                return target
        while self._pos < target and self.read(min(target - self._pos, 1 << 20)):
            pass
        return self._pos

    def close(self) -> None:
        """Thread side: done reading; the download stops."""
        with self._cond:
            self.closed = True
            self._drop_all()
            self._wake(always=True)

    def __enter__(self) -> RemoteFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- with the lock held -------------------------------------------------------------------

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if self.closed:
            raise _Closed("the download was closed", source=self.name)

    def _drop_all(self) -> None:
        self._blocks.clear()
        self._buffered = 0

    def _wake(self, always: bool = False) -> None:
        # One call_soon_threadsafe per refill, not per read: only when the download waits for
        # room, the buffer has drained to half (or on a jump or a close), and no wake-up is on
        # its way already (the loop may need a few ms to get the GIL from a parsing thread).
        room, loop = self._room, self._loop
        if room is None or loop is None or room.is_set() or self._waking:
            return
        if always or self._buffered <= self.capacity // 2:
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


class Downloads:
    """The objects one read streams: ``open(source, n)`` starts a download as a task on this loop
    (named ``headrace:storage:n``) and returns the file a parser thread reads; ``aclose()`` stops
    them all and awaits their tasks, even when cancelled. ``retries`` and ``peak`` sum them up."""

    def __init__(self, storage: Storage | None, capacity: int) -> None:
        self.storage, self.capacity = storage, capacity
        self.files: list[RemoteFile] = []
        self.tasks: list[asyncio.Task[None]] = []
        self.retries = 0
        self.peak = 0

    def open(self, source: str, n: int) -> RemoteFile:
        assert self.storage is not None
        self._prune()
        store, key = self.storage.locate(source)
        remote = RemoteFile(store, key, capacity=self.capacity, retry=self.storage.retry)
        self.files.append(remote)
        self.tasks.append(asyncio.get_running_loop().create_task(remote.fill(), name=f"headrace:storage:{n}"))
        return remote

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
                self.retries += remote.retries
                self.peak = max(self.peak, remote.peak)
                if not task.cancelled():
                    task.exception()  # retrieved: fill() hands its errors to the thread, never raises
            else:
                keep.append((remote, task))
        self.files, self.tasks = [f for f, _ in keep], [t for _, t in keep]


async def _drop(body: Body) -> None:
    try:
        await body.aclose()
    except Exception:  # noqa: BLE001 - closing a failed download can fail too; it is gone either way
        pass
