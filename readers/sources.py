"""Readers over sources the user already has: any indexable sequence (a list, a torch map-style
``Dataset``) and any sync or async iterable (a generator, an async generator, a queue reader).

Their items become samples by the rules in ``_items.py`` (dicts of fields, ``Sample``s, or
``(image, label)`` tuples of encoded bytes or paths).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import inspect
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Self

from headrace._errors import ConfigError, ReadError, require_int
from headrace._sample import Sample
from headrace._threads import join_threads

from ._base import Equal, IndexedReader, Reader, _check_shard, shard_length
from ._feed import END, Feed
from ._items import failed_sample, item_sample

__all__ = ["IterableReader", "SequenceReader", "iterable", "sequence"]


class SequenceReader(IndexedReader):
    """Reads ``seq[i]`` in chunks from I/O threads; one Sample per item (see ``sequence``)."""

    def __init__(self, seq: Any, *, shuffle: bool, seed: int | None, chunk_size: int, io_threads: int) -> None:
        super().__init__(shuffle=shuffle, seed=seed, chunk_size=chunk_size, io_threads=io_threads)
        if isinstance(seq, (str, bytes, bytearray, Mapping)) or not (
                hasattr(type(seq), "__getitem__") and hasattr(type(seq), "__len__")):
            hint = "; for an iterable or a torch IterableDataset use readers.iterable" if isinstance(seq, Iterable) else ""
            raise ConfigError(f"sequence: source must be indexable by position and have len(), "
                              f"got {type(seq).__name__}{hint}")
        if any(c.__name__ == "IterableDataset" for c in type(seq).__mro__):
            raise ConfigError("sequence: a torch IterableDataset has no items by index; use readers.iterable")
        self.seq = seq
        self._n = len(seq)  # once: a resumed run must see the same order
        if self._n == 0:
            raise ConfigError("sequence: the source is empty")
        self._name = type(seq).__name__

    def _dataset_size(self) -> int:
        return self._n

    def _fetch(self, indices: Sequence[int]) -> list[Sample]:
        seq, name, out = self.seq, self._name, []
        for i in indices:
            try:
                item = seq[i]
            except Exception as exc:  # the user's __getitem__: this sample fails, the epoch goes on
                error = ReadError(f"{name}[{i}] raised {type(exc).__name__}: {exc}", key=str(i), source=f"{name}[{i}]")
                error.__cause__ = exc
                out.append(failed_sample(str(i), f"{name}[{i}]", i, error))
                continue
            out.append(item_sample(item, i, name))
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "source": self._name}

    def __repr__(self) -> str:
        return (f"SequenceReader({self._name}, samples={len(self)}, shuffle={self.shuffle}, "
                f"rank={self.rank}/{self.world})")


def sequence(
    seq: Any,
    *,
    shuffle: bool = True,
    seed: int | None = None,
    chunk_size: int = 64,
    io_threads: int = 2,
) -> SequenceReader:
    """A reader over any indexable sequence with ``len()``: a list, a torch map-style ``Dataset``.

    Items may be dicts of fields (``{"jpg": bytes, "cls": 3}``; ``"__key__"`` names the sample),
    ``headrace.Sample``s, or ``(image, label)`` tuples whose image is encoded bytes or a path (read
    as a file); integers become ASCII digits, ``pathlib.Path`` values are read as files (the full
    rules: ``headrace/readers/_items.py``). A sample's ``index`` is its index in ``seq``; its key
    is ``"__key__"``, a path without extension, or the index.

    Shuffle, shard and resume are the files reader's, exactly: ``shuffle`` gives a new seeded
    permutation each epoch (``seed`` defaults to the loader's), ``shard(rank, world, equal=)``
    takes every ``world``-th entry of that order, ``read(epoch, start=k)`` continues at stream
    position ``k``, and an epoch can resume on another world size. ``len(seq)`` is taken once, here.

    ``seq[i]`` is called in ``io_threads`` I/O threads, ``chunk_size`` items per call, at most
    ``io_threads + 1`` chunks ahead of the loader (its backpressure); ``__getitem__`` may do I/O,
    but Python code in it holds the GIL. An item whose ``__getitem__`` raises, or that the rules do
    not take, becomes a sample whose ``error`` is a ``ReadError`` naming the index (the exception
    is its ``__cause__``): the epoch goes on and the loader's ``on_error`` decides. Closing or
    cancelling a read waits for the ``__getitem__`` calls running, no more.

    Raises ConfigError if ``seq`` is not indexable with ``len()``, is empty, or an argument is wrong.
    """
    return SequenceReader(seq, shuffle=shuffle, seed=seed, chunk_size=chunk_size, io_threads=io_threads)


class IterableReader(Reader):
    """Samples in a source's own order, one epoch per pass over it (see ``iterable``)."""

    def __init__(self, source: Any, *, length: int | None, chunk_size: int) -> None:
        if length is not None:  # Python ints: they are in the state dict, which goes to JSON
            length = require_int("iterable: length", length)
        chunk_size = require_int("iterable: chunk_size", chunk_size)
        if isinstance(source, (str, bytes, bytearray, Mapping)):
            # Iterable, but its items would be its letters, bytes or keys: samples that all fail.
            raise ConfigError(f"iterable: source must be an iterable of items (dicts of fields, Samples, "
                              f"(image, label) tuples), got a {type(source).__name__}; for one file, "
                              "readers.files([path]); for one item, [item]")
        if callable(source) and not isinstance(source, (Iterable, AsyncIterable)):
            _check_no_arguments(source)
            self._factory: Callable[[], Any] | None = source
            self._name = getattr(source, "__qualname__", type(source).__name__)
        elif isinstance(source, (Iterable, AsyncIterable)):
            self._factory = None
            self._name = type(source).__name__
        else:
            raise ConfigError(f"iterable: source must be an iterable, an async iterable or a zero-argument "
                              f"callable returning one, got {type(source).__name__}")
        self.source = source
        self.length = length
        self.chunk_size = chunk_size
        self.equal: Equal = None
        # An iterator (a generator, an async generator) is used up by one pass; shards share the box.
        self._used = [False]

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError(f"iterable: the length of {self._name} is unknown (pass length=)")
        return shard_length(self.length, self.rank, self.world, self.equal)

    def shard(self, rank: int, world: int, *, equal: Equal = None) -> Self:
        """Rank ``rank`` takes the source's items ``rank``, ``rank + world``, ...; every rank reads the
        whole source. ``equal`` ("pad" or "drop") needs ``length``."""
        rank, world = _check_shard(rank, world, equal)
        if equal is not None and world > 1 and self.length is None:
            raise ConfigError(f"iterable: equal={equal!r} needs the source's length: pass length=, "
                              "or equal=None (ranks may then yield different sample counts)")
        part = copy.copy(self)
        part.rank, part.world, part.equal = rank, world, equal
        return part

    def state_dict(self) -> dict:
        return {"type": type(self).__name__, "samples": len(self) if self.length is not None else None,
                "rank": self.rank, "world": self.world, "length": self.length, "equal": self.equal,
                "source": self._name}

    def _open(self) -> Any:
        """This epoch's iterable: a fresh one from the factory, or the source itself."""
        if self._factory is not None:
            try:
                made = self._factory()
            except Exception as exc:  # the user's callable: its failure is the source's, typed
                raise _source_failed(self._name, 0, exc) from exc
            if not isinstance(made, (Iterable, AsyncIterable)):
                raise ConfigError(f"iterable: the source callable returned {type(made).__name__}, not an iterable")
            return made
        source = self.source
        one_shot = isinstance(source, (Iterator, AsyncIterator))
        if one_shot and self._used[0]:
            raise ConfigError(
                f"iterable: the source ({self._name}) is an iterator and was used up by an earlier epoch; "
                "pass a zero-argument callable that returns a fresh iterable each epoch, "
                "e.g. readers.iterable(lambda: my_generator())")
        self._used[0] = one_shot
        return source

    async def read(self, epoch: int, *, start: int = 0, seed: int = 0) -> AsyncIterator[list[Sample]]:
        start = require_int("start", start, 0)
        if self.length is not None and start > len(self):
            raise ConfigError(f"start must be in [0, {len(self)}], got {start}")
        made = self._open()
        pick = _Picker(self, start)
        if isinstance(made, AsyncIterable):
            stream = self._read_async(made, pick)
        else:
            stream = self._read_sync(made, pick)
        async with contextlib.aclosing(stream) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _read_async(self, made: AsyncIterable, pick: _Picker) -> AsyncIterator[list[Sample]]:
        try:
            it = aiter(made)
        except Exception as exc:
            raise _source_failed(self._name, 0, exc) from exc
        # Items become samples in a thread: a path item is a file read, kept off the event loop.
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="headrace-io-iterable")
        job: concurrent.futures.Future[list[Sample]] | None = None
        loop = asyncio.get_running_loop()
        try:
            items: list[tuple[Any, int]] = []
            done = False
            while not done:
                try:
                    item = await anext(it)
                except StopAsyncIteration:
                    done = True
                except Exception as exc:
                    failed = _source_failed(self._name, pick.seen, exc)
                    failed.__cause__ = exc
                    if items:  # the items before the failure are good samples: they go first
                        job = pool.submit(pick.samples, items)
                        items = []
                        yield await asyncio.wrap_future(job, loop=loop)
                    raise failed
                else:
                    done = pick.take(item, items)
                if done:
                    pick.finish(items)
                if items and (done or len(items) >= self.chunk_size):
                    job = pool.submit(pick.samples, items)
                    items = []
                    yield await asyncio.wrap_future(job, loop=loop)
        finally:
            try:
                pool.shutdown(wait=False, cancel_futures=True)
                await join_threads([job] if job is not None else [])
                pool.shutdown(wait=True)
            finally:
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    await aclose()

    async def _read_sync(self, made: Iterable, pick: _Picker) -> AsyncIterator[list[Sample]]:
        loop = asyncio.get_running_loop()
        feed = Feed(loop, capacity=2)
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="headrace-io-iterable")
        job = pool.submit(self._produce, made, pick, feed)
        try:
            while (chunk := await feed.get()) is not END:
                if isinstance(chunk, BaseException):
                    raise chunk
                yield chunk
        finally:
            feed.stop()
            pool.shutdown(wait=False)
            # A source blocked in next() holds this until it returns: a sync iterator cannot be interrupted.
            await join_threads([job])
            pool.shutdown(wait=True)  # the job is done: this waits only for its thread to exit

    def _produce(self, made: Iterable, pick: _Picker, feed: Feed) -> None:
        """In the thread: advance the sync source, hand over chunks; END (or the failure) at the end."""
        it = None
        try:
            try:
                it = iter(made)
            except Exception as exc:
                error = _source_failed(self._name, 0, exc)
                error.__cause__ = exc
                feed.put(error, force=True)
                return
            items: list[tuple[Any, int]] = []
            done = False
            while not done and not feed.stopped:
                try:
                    item = next(it)
                except StopIteration:
                    done = True
                except Exception as exc:
                    error = _source_failed(self._name, pick.seen, exc)
                    error.__cause__ = exc
                    if items and not feed.put(pick.samples(items)):  # the good items before it first
                        return
                    feed.put(error, force=True)
                    return
                else:
                    done = pick.take(item, items)
                if done:
                    pick.finish(items)
                if items and (done or len(items) >= self.chunk_size):
                    if not feed.put(pick.samples(items)):
                        return
                    items = []
            feed.put(END, force=True)
        except BaseException as exc:  # iter() failing, or a bug: the loop side raises it
            feed.put(exc, force=True)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def __repr__(self) -> str:
        return f"IterableReader({self._name}, length={self.length}, rank={self.rank}/{self.world})"


class _Picker:
    """Which of the source's items this rank yields in one read: every ``world``-th from ``rank``,
    the first ``start`` of them skipped, at most ``length`` items of the source looked at, and the
    pad item remembered (``equal="pad"``: ``epoch_order``'s rule, the head of the stream repeated)."""

    def __init__(self, reader: IterableReader, start: int) -> None:
        self.reader = reader
        self.seen = 0  # items of the source so far (an item's index)
        self.taken = 0  # this rank's items so far (its stream position)
        self.start = start
        n, world, rank = reader.length, reader.world, reader.rank
        extra = n % world if n is not None else 0
        self.limit = n
        # ``epoch_order`` pads by repeating the stream from its head, around again when the ranks
        # outnumber the items: rank r past the last full row repeats item (r - extra) mod n.
        self.pad_index = (rank - extra) % n if reader.equal == "pad" and extra and rank >= extra else None
        self.pad_item: Any = None
        self.stop_at = len(reader) if reader.equal == "drop" else None  # this rank's count

    def take(self, item: Any, items: list[tuple[Any, int]]) -> bool:
        """Note ``item``; append it to ``items`` if this rank yields it. True once no more are needed."""
        r = self.reader
        index = self.seen
        self.seen += 1
        if index == self.pad_index:
            self.pad_item = item
        if index % r.world == r.rank:
            if self.stop_at is not None and self.taken >= self.stop_at:
                return True
            if self.taken >= self.start:
                items.append((item, index))
            self.taken += 1
        return self.limit is not None and self.seen >= self.limit

    def finish(self, items: list[tuple[Any, int]]) -> None:
        """At the source's end: the pad item, if this rank has one and the source reached ``length``."""
        if self.pad_index is not None and self.limit is not None and self.seen >= self.limit:
            if self.taken >= self.start:
                items.append((self.pad_item, self.pad_index))
            self.taken += 1

    def samples(self, items: list[tuple[Any, int]]) -> list[Sample]:
        """``items`` as samples, numbered by stream position (run in a thread: paths are file reads)."""
        name = self.reader._name
        first = self.taken - len(items)  # positions are consecutive and end at ``taken``
        out = [item_sample(item, index, name) for item, index in items]
        for position, sample in enumerate(out, first):
            sample.position = position
        return out


def _check_no_arguments(factory: Callable[..., Any]) -> None:
    """ConfigError now for a source callable that needs arguments (a generator function of ``n``):
    each epoch calls it with none, and the first epoch would fail on the TypeError. Callables
    whose signature Python cannot tell (some built-ins) are taken as they are."""
    try:
        inspect.signature(factory).bind()
    except ValueError:  # no signature to check
        return
    except TypeError as exc:
        name = getattr(factory, "__qualname__", type(factory).__name__)
        raise ConfigError(f"iterable: the source callable {name} is called with no arguments each epoch, "
                          f"but {exc}; pass e.g. readers.iterable(lambda: {name}(...))") from None


def _source_failed(name: str, seen: int, exc: Exception) -> ReadError:
    """The source's own failure, named by the index (the default key) of the item it did not give."""
    return ReadError(f"the source raised {type(exc).__name__} after {seen} items: {exc}", key=str(seen), source=name)


def iterable(source: Any, *, length: int | None = None, chunk_size: int = 32) -> IterableReader:
    """A reader over a sync or async iterable of items: a generator, an async generator, a queue reader.

    Items are as for ``sequence()`` (dicts of fields, ``Sample``s, ``(image, label)`` tuples). Samples
    come in the source's order (no shuffle); an item's ``index`` is its count in the source (0, 1,
    ...), its key ``"__key__"``, a path without extension, or that count.

    Epochs: each ``read`` makes one pass. ``source`` may be a zero-argument callable that returns a
    fresh iterable (sync or async) each epoch, e.g. a generator function; a re-iterable object (a
    list, a class whose ``__iter__`` starts over) is iterated again each epoch; an iterator (a
    generator object, an async generator) serves one epoch only, and a second ``read`` raises
    ConfigError. ``read(epoch, start=k)`` (resume) pulls and drops this rank's first ``k`` items:
    exact only if the source yields the same items in the same order again.

    ``length``: the number of items the source yields per epoch; ``len()`` then works (else it
    raises TypeError, like a generator's). At most ``length`` items are read per epoch; a source
    that ends sooner ends the epoch sooner.

    Sharding: rank ``r`` of ``w`` takes the source's items ``r``, ``r + w``, ... and reads (and
    drops) the others, so each rank's process must iterate its own source; the parts are disjoint
    and complete only if every rank's source yields the same sequence. ``equal="pad"`` (the
    loader's default when it shards) repeats the head of the stream for the short ranks, as the
    files reader does, and ``"drop"`` cuts the long ones; both need ``length``. An epoch cannot be
    resumed on another world size.

    Sync iterables are advanced in a thread (``iter()`` and ``next()`` never run on the event
    loop), at most two chunks of ``chunk_size`` items ahead of the loader; closing or cancelling a
    read waits for a ``next()`` that is running (a sync source blocked forever blocks the close).
    Async iterables are awaited on the loop and closed (``aclose()``) when the read ends; their items
    become samples in a thread, since a path item is a file read. An item the rules do not take, or
    a path that cannot be read, gives a sample with a ``ReadError``; an exception raised by the
    source itself (by ``next()``, ``iter()`` or the source callable) ends the epoch with a
    ``ReadError`` (its ``__cause__``), since a failed iterator cannot go on: the items before it are
    yielded first, and the error's ``key`` is the count of the item the source failed to give.

    Raises ConfigError if ``source`` is neither an iterable nor a callable, is a str, bytes or a
    dict (their letters, bytes or keys are no items), is a callable that needs arguments, or an
    argument is wrong.
    """
    return IterableReader(source, length=length, chunk_size=chunk_size)
