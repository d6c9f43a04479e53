"""The reader contract, and the shared machinery of readers whose samples can be fetched by index."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Literal, Self, TypeVar

import numpy as np

from headrace._errors import ConfigError, require_int
from headrace._sample import Sample, SampleList, samples_nbytes

from headrace._threads import cancel_and_wait, join_threads


__all__ = ["IndexedReader", "Reader", "check_order", "int_label", "consumed_prefix", "epoch_order", "number_samples"]

Equal = Literal["pad", "drop"] | None
_Job = TypeVar("_Job")  # a chunk's fetch in flight: a thread job or a task
# Readers of byte payloads (``IndexedReader.grows``) given no ``chunk_size`` let a chunk grow past
# ``DEFAULT_CHUNK`` samples where they are small, toward ``CHUNK_BYTES``, to at most ``CHUNK_GROWTH``
# times as many.
CHUNK_BYTES = 4 << 20
CHUNK_GROWTH = 16
DEFAULT_CHUNK = 64
# Where a finished chunk reaches the loop late (the GIL held by a thread busy in Python: ~6 ms at
# the median, against ~0.15 ms alone, on the 2-core VM), a chunk grows toward up to this many times
# ``CHUNK_BYTES``, in proportion to the delay past ``HANDOVER_DELAY_FREE`` seconds: chunks of 256
# files of ~70 KiB read 20-21k files/s beside such a thread against 7-9k for the 64 that 4 MiB
# makes, and alone 62-70k against 72-85k (bigger chunks leave the caches), so only then.
CONTENDED_GROWTH = 4
HANDOVER_DELAY_FREE = 0.001


class Reader(ABC):
    """An async source of encoded samples, one epoch at a time.

    ``read(epoch, start=k)`` yields the epoch's samples for this rank from stream position ``k`` on,
    in lists (one await per list, not per sample). The same (seed, epoch) gives the same stream, so
    resuming is reading from the position the loader recorded.

    Resuming on another world size: a reader whose ``reshardable`` is true also takes
    ``read(epoch, start=k, history=[(world, position), ...])``, the spans of this epoch that earlier
    runs read on other world sizes (every rank of a span at the same position); it then yields this
    rank's part of what those spans left unread, from position ``k`` of that part. The loader passes
    ``history`` only when it is not empty, so other readers need not take it.
    """

    rank: int = 0
    world: int = 1
    reshardable: bool = False

    @abstractmethod
    def __len__(self) -> int:
        """Samples this rank yields per epoch."""

    @abstractmethod
    def shard(self, rank: int, world: int, *, equal: Equal = None) -> Self:
        """A copy of this reader that yields rank ``rank``'s part of each epoch."""

    @abstractmethod
    def read(self, epoch: int, *, start: int = 0, seed: int = 0) -> AsyncIterator[list[Sample]]:
        """Yield lists of samples; closing the iterator stops all reading and releases threads and files."""

    def state_dict(self) -> dict:
        """What the loader stores to check that a resumed run reads the same stream."""
        return {"type": type(self).__name__, "samples": len(self), "rank": self.rank, "world": self.world}

    def connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Keep this reader's storage connections open for the block, across reads: the loader holds
        it over an epoch, so the next epoch's read, started ahead while this one's last batches
        decode, takes over warm connections instead of opening new ones (each read's own session
        would close them as it ends).

        The default holds nothing, for readers with nothing remote; a reader that reads through a
        store overrides it to return its storage's ``session()``. Overridden rather than found by
        attribute name, so that a reader keeping its storage under another name cannot go without
        unnoticed (tests/readers/test_reader_connections_override.py checks the public readers)."""
        return contextlib.nullcontext()


def epoch_order(
    n: int, epoch: int, *, shuffle: bool, seed: int, rank: int = 0, world: int = 1, equal: Equal = None,
    offset: int = 0,
) -> np.ndarray:
    """Dataset indices in rank ``rank``'s stream order for ``epoch``.

    Every rank computes the same global order from (seed, epoch) with no communication, then takes
    every ``world``-th entry from its rank on: the parts are disjoint and together complete. With
    ``equal="pad"`` the order is first extended by repeating its head, with ``"drop"`` cut, to a
    multiple of ``world``, so every rank gets the same count.

    ``offset``: the first ``offset`` entries of the global order were read already (by an earlier
    run, on another world size); the rest is split the same way. Once every rank has read ``k`` of
    its entries, the first ``offset + k * world`` of the global order are read (padding aside):
    that prefix is what ``consumed_prefix`` gives back.
    """
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    if offset:
        order = order[offset:]
    if world > 1:
        rest = len(order)
        extra = rest % world
        if extra and equal == "pad":
            order = np.concatenate([order, np.resize(order, world - extra)])
        elif extra and equal == "drop":
            order = order[: rest - extra]
        order = order[rank::world]
    return order


def consumed_prefix(n: int, history: Sequence[tuple[int, int]], equal: Equal = None) -> int:
    """How much of an epoch's global order ``epoch_order`` spans have read: ``history`` lists
    (world, position) per span, in order, every rank of a span having read ``position`` entries."""
    done = 0
    for world, position in history:
        world = require_int("history: world", world)
        position = require_int("history: position", position, 0)
        if equal == "drop" and world > 1:  # the ranks' streams end after (n - done) // world
            position = min(position, (n - done) // world)
        done = min(n, done + position * world)
    return done


def number_samples(samples: list[Sample], first: int) -> list[Sample]:
    """Give ``samples`` their stream positions from ``first`` on; the same list (a ``SampleList``
    keeps its byte count)."""
    for position, sample in enumerate(samples, first):
        sample.position = position
    return samples


def shard_length(n: int, rank: int, world: int, equal: Equal) -> int:
    """Samples rank ``rank`` of ``world`` reads of ``n``: every ``world``-th from ``rank``, or, with
    ``equal``, the same count on every rank (``"pad"`` rounds up, ``"drop"`` down)."""
    if equal == "pad":
        return -(-n // world)
    if equal == "drop":
        return n // world
    return len(range(rank, n, world))


def check_order(shuffle: object, seed: object, reader: str = "") -> tuple[bool, int | None]:
    """``shuffle`` and ``seed`` as a reader keeps them: a bool, and an int NumPy can seed with or None
    (the loader's seed). NumPy's bools and ints are taken as Python's. ConfigError naming the
    argument (after ``reader``, the reader's name, if given) for anything else now, not when the
    first epoch starts: ``shuffle="no"`` is true (it would shuffle), and NaN, -1, 2.0 or True are no
    seed ``np.random.default_rng`` takes (True would be seed 1)."""
    prefix = f"{reader}: " if reader else ""
    if not isinstance(shuffle, (bool, np.bool_)):
        raise ConfigError(f"{prefix}shuffle must be True or False, got {shuffle!r}")
    if seed is None:
        return bool(shuffle), None
    return bool(shuffle), require_int(f"{prefix}seed", seed, 0)


def int_label(value: object, reader: str, source: object) -> int:
    """``value`` as a label: an int (NumPy's too), not a bool, a float (1.7 is not class 1) or a str;
    ConfigError naming ``reader`` and the sample's ``source`` otherwise."""
    return require_int(f"{reader}: the label of {source!r}", value, None)


def _check_shard(rank: object, world: object, equal: Equal) -> tuple[int, int]:
    """``(rank, world)`` as Python ints (NumPy's taken too); ConfigError for a wrong one or ``equal``."""
    world = require_int("world", world)
    rank = require_int("rank", rank, 0, below=world)
    if equal not in (None, "pad", "drop"):
        raise ConfigError(f"equal must be None, 'pad' or 'drop', got {equal!r}")
    return rank, world


class IndexedReader(Reader):
    """A reader over N samples fetched by index, in chunks, by a few I/O threads.

    Subclasses implement ``_dataset_size`` and ``_fetch(indices)``, which runs in a thread and
    returns one Sample per index (with ``error`` set for a sample it could not read).
    """

    reshardable = True  # the global order is one permutation whatever the world size
    # Whether a local read's chunks, given no ``chunk_size``, grow where samples are small (toward
    # ``CHUNK_BYTES``, at most ``CHUNK_GROWTH`` x ``chunk_size``): each chunk costs the same
    # hand-overs whatever its size (an I/O thread's job, the GIL let go and taken back once or
    # twice, the loop woken), and beside a thread busy in Python each time the GIL is taken back
    # waits up to the switch interval (5 ms). On the 2-core VM, ~4 KiB values, chunks of 64 against
    # 1,024: LMDB 164k against 258k values/s alone, 11k against 86k beside a busy thread.
    grows: bool = False

    def __init__(self, *, shuffle: bool, seed: int | None, chunk_size: int | None, io_threads: int) -> None:
        # None: DEFAULT_CHUNK, and more where the reader ``grows``; a number given is kept.
        self.chunk_auto = chunk_size is None
        self.chunk_size = DEFAULT_CHUNK if chunk_size is None else require_int("chunk_size", chunk_size)
        self.io_threads = require_int("io_threads", io_threads)
        self.shuffle, self.seed = check_order(shuffle, seed)
        self.equal: Equal = None

    @abstractmethod
    def _dataset_size(self) -> int: ...

    @abstractmethod
    def _fetch(self, indices: Sequence[int]) -> list[Sample]: ...

    def _open_io(self) -> None:
        """Called before the first ``_fetch`` of a ``read`` (e.g. to open a database); default: nothing."""

    def _close_io(self) -> None:
        """Called once that ``read``'s I/O threads are idle, even after an error or cancellation."""

    # Readers whose samples come over the network (URLs) fetch them on the event loop instead:
    # ``_fetch_async`` replaces ``_fetch`` when ``_fetch_on_loop`` is true, and ``_io_session``
    # keeps connections open for one ``read``.
    _fetch_on_loop: bool = False

    async def _fetch_async(self, indices: Sequence[int]) -> list[Sample]:
        raise NotImplementedError

    def _io_session(self) -> contextlib.AbstractAsyncContextManager[object]:
        return contextlib.nullcontext()

    def __len__(self) -> int:
        return shard_length(self._dataset_size(), self.rank, self.world, self.equal)

    def shard(self, rank: int, world: int, *, equal: Equal = None) -> Self:
        rank, world = _check_shard(rank, world, equal)
        part = copy.copy(self)
        part.rank, part.world, part.equal = rank, world, equal
        return part

    def order(self, epoch: int, seed: int = 0, history: Sequence[tuple[int, int]] = ()) -> np.ndarray:
        """This rank's dataset indices for ``epoch``, in stream order (after ``history``; see ``Reader``)."""
        seed = self.seed if self.seed is not None else seed
        n = self._dataset_size()
        return epoch_order(
            n, epoch, shuffle=self.shuffle, seed=seed,
            rank=self.rank, world=self.world, equal=self.equal, offset=consumed_prefix(n, history, self.equal),
        )

    def state_dict(self) -> dict:
        return {**super().state_dict(), "total": self._dataset_size(), "equal": self.equal,
                "shuffle": self.shuffle, "seed": self.seed}

    async def read(
        self, epoch: int, *, start: int = 0, seed: int = 0, history: Sequence[tuple[int, int]] = ()
    ) -> AsyncIterator[list[Sample]]:
        order = self.order(epoch, seed, history)
        if not 0 <= start <= len(order):
            raise ConfigError(f"start must be in [0, {len(order)}], got {start}")
        loop = asyncio.get_running_loop()
        if self._fetch_on_loop:
            async def stop_tasks(pending: list[asyncio.Task[list[Sample]]]) -> None:
                await cancel_and_wait(pending)

            def start_task(indices: list[int], first: int) -> asyncio.Task[list[Sample]]:
                return loop.create_task(self._fetch_async_numbered(indices, first),
                                        name=f"headrace:{type(self).__name__}:fetch:{first}")

            async with self._io_session():
                async with contextlib.aclosing(self._in_order(order, start, start_task, lambda t: t, stop_tasks)) as chunks:
                    async for samples in chunks:
                        yield samples
            return
        self._open_io()
        pool = concurrent.futures.ThreadPoolExecutor(self.io_threads, thread_name_prefix=f"headrace-io-{type(self).__name__}")

        async def stop_threads(pending: list[concurrent.futures.Future[list[Sample]]]) -> None:
            pool.shutdown(wait=False, cancel_futures=True)
            # The I/O threads must be idle before we return (or close what they use), even if
            # we are cancelled while waiting for them.
            await join_threads(pending)
            pool.shutdown(wait=True)

        try:
            chunks = self._in_order(order, start, lambda indices, first: pool.submit(self._fetch_numbered, indices, first),
                                    lambda fut: asyncio.wrap_future(fut, loop=loop), stop_threads)
            async with contextlib.aclosing(chunks):
                async for samples in chunks:
                    yield samples
        finally:
            self._close_io()

    async def _in_order(self, order: np.ndarray, start: int, fetch: Callable[[list[int], int], _Job],
                        result: Callable[[_Job], Awaitable[list[Sample]]],
                        stop: Callable[[list[_Job]], Awaitable[None]]) -> AsyncIterator[list[Sample]]:
        """The chunks of ``order`` from ``start``, in order, with ``_ahead()`` fetches in flight
        plus the one being handed over. ``fetch(indices, first)`` starts a chunk's fetch (a thread
        job or a task), ``result`` awaits it, and ``stop`` ends the fetches still pending when the
        consumer leaves early, waiting for them."""
        pending: deque[_Job] = deque()
        next_pos = start
        seen_samples = seen_bytes = 0  # counted only where chunks grow (``_chunk_length``)
        growing = self._growing
        delay = 0.0  # how late a finished chunk reaches the loop, smoothed (``_chunk_length``)
        try:
            while next_pos < len(order) or pending:
                while next_pos < len(order) and len(pending) <= self._ahead():
                    length = self._chunk_length(seen_samples, seen_bytes, delay) if growing else self.chunk_size
                    end = min(next_pos + length, len(order))
                    pending.append(fetch(order[next_pos:end].tolist(), next_pos))
                    next_pos = end
                began = time.monotonic()
                samples = await result(pending.popleft())
                now = time.monotonic()
                self._handed(samples, now - began)
                if growing:
                    seen_samples += len(samples)
                    seen_bytes += samples_nbytes(samples)
                    done_at = getattr(samples, "done_at", 0.0)
                    if done_at > began:  # it finished while we waited: the rest is the hand-over
                        delay += (now - done_at - delay) / 4
                yield samples
        finally:
            await stop(list(pending))

    def _ahead(self) -> int:
        """Chunks fetched ahead of the one being handed over: one per I/O thread."""
        return self.io_threads

    @property
    def _growing(self) -> bool:
        """Whether this read's chunks grow: a reader that ``grows``, given no ``chunk_size`` (one
        given also bounds a chunk's memory), reading local data."""
        return self.grows and self.chunk_auto and not self._fetch_on_loop

    @property
    def max_chunk(self) -> int:
        """The most samples a chunk of this reader's holds (a sample pool's sizing)."""
        return self.chunk_size * CHUNK_GROWTH if self._growing else self.chunk_size

    def _chunk_length(self, seen_samples: int, seen_bytes: int, delay: float = 0.0) -> int:
        """The next chunk's samples where they grow: ``chunk_size`` first, then as many as make
        ``CHUNK_BYTES`` at the mean size of the samples handed so far, more (up to
        ``CONTENDED_GROWTH`` times the bytes) where finished chunks reach the loop ``delay``
        seconds late: each chunk costs the same hand-overs whatever its size."""
        if seen_samples == 0:
            return self.chunk_size
        mean = max(seen_bytes / seen_samples, 1.0)
        contended = min(max(delay / HANDOVER_DELAY_FREE, 1.0), CONTENDED_GROWTH)
        return max(self.chunk_size, min(self.max_chunk, int(CHUNK_BYTES * contended / mean)))

    def _handed(self, samples: list[Sample], waited: float) -> None:
        """A chunk is handed over, after the consumer ``waited`` seconds for it (a hook for readers
        that size their fetching from it)."""

    def _fetch_numbered(self, indices: Sequence[int], first: int) -> list[Sample]:
        # In the I/O thread: numbering a chunk and counting its bytes is per-sample Python the event
        # loop need not do (the loader and ``_chunk_length`` take the count from the SampleList).
        samples = number_samples(self._fetch(indices), first)
        chunk = samples if type(samples) is SampleList else SampleList(samples, samples_nbytes(samples))
        chunk.done_at = time.monotonic()  # how late the loop takes it says how busy the GIL is
        return chunk

    async def _fetch_async_numbered(self, indices: Sequence[int], first: int) -> list[Sample]:
        return number_samples(await self._fetch_async(indices), first)
