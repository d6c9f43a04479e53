"""The tar shards of a WebDataset reader, and how they are read: local files or downloads, one
thread per shard in flight, each parsed into chunks of samples.

``webdataset.py`` decides which samples of which shards make a rank's stream (``ShardJob``s, in
order); this module reads them. Keeping the two apart lets the stream and resume logic be read
without the threads, feeds and downloads that serve it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from headrace._errors import ReadError
from headrace._sample import Sample
from headrace._threads import join_threads

from ._feed import END, Feed
from ._pipe import PIPE, PipeShard, is_pipe
from ._read_files import copy_spans
from ._sample_pool import SamplePool, _pool_lib  # noqa: F401 - _pool_lib: tests ask whether it builds
from ._shard_cache import CacheWrites, ShardCache
from ._storage import Downloads, Link, RemoteFile, Storage, is_url, scrub
from ._storage._remote import Span
from ._tar import count_samples, iter_groups, open_shard

__all__ = ["ShardFiles", "ShardJob"]


@dataclass(frozen=True, slots=True)
class ShardJob:
    """One shard as this rank reads it in one epoch."""

    shard: int  # number in the sorted shard list
    path: str
    first: int  # first in-shard ordinal that belongs to this rank
    stride: int  # then every stride-th
    base_index: int  # Sample.index of the shard's first sample
    rank_base: int = -1  # this rank's input ordinal of the shard's first kept sample (-1: unknown)
    needed: Callable[[int], bool] | None = None  # on rank input ordinals; None: all
    count: int | None = None  # samples the shard holds, as its index or counts= says; None: unknown


class ShardFiles:
    """Reads shards, local or through a store, into lists of samples.

    ``read_ahead`` shards beyond the current one are read at once, each by its own thread (and, for
    a remote shard, its own download buffering at most ``buffer_bytes``) into a feed of two
    ``chunk_size`` lists. ``require``: alternatives of field names every sample must have.
    ``retries`` and ``peak_buffered`` add up what the downloads reported. ``cache``: remote shards
    are read from it when there, and written to it as they are read when not (``_shard_cache.py``).
    """

    def __init__(self, shards: Sequence[str], storage: Storage | None, *, read_ahead: int, chunk_size: int,
                 require: list[tuple[str, ...]], buffer_bytes: int, cache: ShardCache | None = None) -> None:
        self.shards = list(shards)
        self.storage = storage
        self.read_ahead = read_ahead
        self.chunk_size = chunk_size
        self.require = require
        self.buffer_bytes = buffer_bytes
        self.cache = cache
        self._pool: SamplePool | None = None  # recycles the samples' memory across reads (``SamplePool``)
        # Shards read through a store (URLs, or keys of an explicit store) and their display names.
        self.remote = [storage is not None and not is_pipe(p) and (storage.store is not None or is_url(p))
                       for p in self.shards]
        # A command's name leaves out its URLs' query strings and credentials, as a URL's does.
        self.names = [storage.locate(p)[0].url(storage.locate(p)[1]) if remote and storage
                      else scrub(p, ()) if is_pipe(p) else p for p, remote in zip(self.shards, self.remote)]
        self.retries = 0  # storage faults survived by the downloads (resumed from their offset)
        self.peak_buffered = 0  # most bytes one download held ahead of its parser
        # What the epochs' downloads observed of the store (latency, bandwidth, GETs a download came
        # to, the parser's pace): kept across epochs, so each epoch's first shard starts grown.
        self.link = Link()
        # While ``held_session()`` is held (the loader holds it over each epoch): the next read's
        # first shards, their downloads started as this read's last shards free their places
        # (``samples``' ``then``), so the next epoch's first batches need not wait a first-byte
        # latency and the GETs' ramp after this epoch's last bytes. ``_next`` owns such downloads
        # until a read takes them over (``warmed`` counts those) or the session ends.
        self._next: Downloads | None = None
        self._holders = 0
        self._warm: dict[int, RemoteFile] = {}
        self.warmed = 0

    def __copy__(self) -> ShardFiles:
        """A copy (a rank's part of the reader: ``shard()``) with its own counters, and no held
        session or download started for its next read: those are the original's."""
        part = object.__new__(type(self))
        part.__dict__.update(self.__dict__)
        part._next, part._holders, part._warm = None, 0, {}
        return part

    def _source(self, shard: int, downloads: Downloads, writes: CacheWrites | None = None,
                warm: dict[int, RemoteFile] | None = None) -> str | RemoteFile | BinaryIO | PipeShard:
        """A local shard's path; a remote shard's cached copy, open, or its download (with
        ``writes``, copied into the cache as it is read; from ``warm``, the one started ahead by
        the read before); a command's output (``pipe:``), not yet started."""
        path = self.shards[shard]
        if is_pipe(path):
            return PipeShard(path[len(PIPE):], self.names[shard])
        if not self.remote[shard]:
            return path
        if warm and shard in warm:
            self.warmed += 1
            return warm.pop(shard)
        if writes is not None and self.cache is not None:
            # Named by the URL as given, query string and all; a key of an explicit store, by its URL.
            identity = path if is_url(path) else self.names[shard]
            local = self.cache.open(self.names[shard], identity)
            if local is not None:
                return local
            return downloads.open(path, shard, tee=self.cache.writer(self.names[shard], writes, identity))
        return downloads.open(path, shard)

    async def count(self) -> list[int]:
        """Samples per shard from the tar headers (data is seeked over; remote: skipped by Range requests)."""
        with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="headrace-io-scan") as pool:
            async with self.downloads(Link()) as downloads:  # header reads: small GETs, not a stream's
                sources = [self._source(i, downloads) for i in range(len(self.shards))]
                futures = [pool.submit(count_samples, source, self.names[i]) for i, source in enumerate(sources)]
                try:
                    return [await asyncio.wrap_future(f) for f in futures]
                finally:
                    for f in futures:
                        f.cancel()
                    downloads.stop()
                    _kill_commands(sources)
                    await join_threads(futures)
                    for f, source in zip(futures, sources):
                        if f.cancelled() and isinstance(source, PipeShard):
                            source.close()

    @contextlib.asynccontextmanager
    async def downloads(self, link: Link | None = None) -> AsyncIterator[Downloads]:
        """The downloads of one read (sharing ``link``, by default the reader's); on exit they are
        stopped, their tasks awaited and the stores' connections closed, even when cancelled: no
        task outlives the block."""
        downloads = Downloads(self.storage, self.buffer_bytes, link or self.link)
        if self.storage is None or not any(self.remote):
            yield downloads
            return
        async with self.storage.session():
            try:
                yield downloads
            finally:
                try:
                    await downloads.aclose()
                finally:
                    self.retries += downloads.retries
                    self.peak_buffered = max(self.peak_buffered, downloads.peak)

    @contextlib.asynccontextmanager
    async def held_session(self) -> AsyncIterator[None]:
        """The storage's session (``Reader.connections``), and while it is held, a read that asks
        for its last shard starts the next read's first one (see ``samples``). Downloads started
        so and not taken over by a read are stopped and awaited when the last holder leaves."""
        assert self.storage is not None
        async with self.storage.session():
            self._holders += 1
            if self._next is None:
                self._next = Downloads(self.storage, self.buffer_bytes, self.link)
            try:
                yield
            finally:
                self._holders -= 1
                if self._holders == 0 and self._next is not None:
                    nxt, self._next = self._next, None
                    self._warm.clear()
                    try:
                        await nxt.aclose()
                    finally:
                        self.retries += nxt.retries
                        self.peak_buffered = max(self.peak_buffered, nxt.peak)

    def _drop_warm(self) -> None:
        """Stop the downloads started for a next read that did not come (or read another order)."""
        for remote in self._warm.values():
            remote.close_from_loop()
        self._warm = {}

    def _start_next(self, jobs: Iterator[ShardJob], room: int) -> None:
        """Start downloading the next read's shards from ``jobs`` while ``room`` places are free (only
        in a held session, for shards through a store and not through the cache: the cache's copy
        is written as a read parses). A shard of the next read's first ``read_ahead + 1`` that is
        local takes no place, as its read opens no download for it."""
        nxt = self._next
        if nxt is None or self.cache is not None:
            return
        while room > len(self._warm):
            job = next(jobs, None)
            if job is None:
                return
            if self.remote[job.shard]:
                self._warm[job.shard] = nxt.open(self.shards[job.shard], job.shard)

    def _take_warm(self, downloads: Downloads) -> dict[int, RemoteFile]:
        """The downloads started ahead for this read, now owned by its ``downloads``."""
        warm, self._warm = self._warm, {}
        if self._next is None:
            return {}
        warm = {shard: remote for shard, remote in warm.items() if remote in self._next.files}
        for remote in warm.values():
            self._next.hand_over(remote, downloads)
        return warm

    async def samples(self, jobs: list[ShardJob], held: int = 0,
                      then: Callable[[], list[ShardJob]] | None = None) -> AsyncIterator[list[Sample]]:
        """The jobs' samples in order; ``read_ahead`` shards beyond the current one are read meanwhile.
        ``held``: how many samples the caller keeps at once (a shuffle buffer), for the pool that
        recycles the samples' memory (``SamplePool``). ``then``: the next read's jobs (the next
        epoch's). In a held session (``held_session``), once this read has no shard left to open,
        each place its last shards free goes to a download of the next read's first ``read_ahead
        + 1`` (those the next read opens at once), so the downloads stay within ``read_ahead + 1``;
        the next read takes over those its first jobs read. Where reading is the limit, the
        loader's run ahead starts the next epoch only once this read is done, and over a store
        50 ms away its first batch then came ~130 ms after the consumer asked, against ~30 ms from
        local disk; one shard started so was not enough where it held fewer samples than the first
        batch took in (565 against 612: the shuffle buffer's initial 100, then two in for each of
        256 out while it grows; docs/benchmarks.md, issue 21)."""
        loop = asyncio.get_running_loop()
        if self._pool is None:  # the fields a read holds at once, a sample's two largest counted (an image, a mask)
            self._pool = SamplePool(2 * (held + (self.read_ahead + 1) * 3 * self.chunk_size) + 1024)
        samples = self._pool
        pool = concurrent.futures.ThreadPoolExecutor(self.read_ahead + 1, thread_name_prefix="headrace-io-webdataset")
        running: deque[tuple[Feed, concurrent.futures.Future[None], object]] = deque()
        todo = iter(jobs)
        writes = CacheWrites(self.buffer_bytes) if self.cache is not None else None
        following: Iterator[ShardJob] | None = None  # the next read's first jobs, once this read has opened its last
        async with self.downloads() as downloads:
            warm = self._take_warm(downloads) if self._warm else {}
            try:
                while True:
                    while len(running) <= self.read_ahead:
                        job = next(todo, None)
                        if job is None:
                            if then is not None and self._next is not None:
                                self._drop_warm()  # left from a read that had no next read
                                following, then = iter(then()[:self.read_ahead + 1]), None
                            if following is not None:
                                self._start_next(following, self.read_ahead + 1 - len(running))
                            break
                        feed = Feed(loop, capacity=2)
                        source = self._source(job.shard, downloads, writes, warm)
                        running.append((feed, pool.submit(self._parse, job, feed, source, samples), source))
                    for remote in warm.values():  # started for a first job this read does not have
                        remote.close_from_loop()
                    warm = {}
                    if not running:
                        return
                    item = await running[0][0].get()
                    if item is END:
                        running.popleft()
                        continue
                    if isinstance(item, Exception):  # the parser failed unforeseen (``_parse``)
                        raise item
                    yield item
            finally:
                for feed, _, _ in running:
                    feed.stop()
                downloads.stop()  # a thread waiting for bytes wakes up (and its read raises)
                _kill_commands([source for _, _, source in running])  # and one waiting on a command's output
                pool.shutdown(wait=False, cancel_futures=True)
                try:
                    await join_threads([f for _, f, _ in running])  # a cancellation is raised once they are done
                finally:
                    pool.shutdown(wait=True)
                    for _, future, source in running:  # a cached copy or a copy begun, for a job that never ran
                        if future.cancelled() and not isinstance(source, str):
                            source.close()
                    if writes is not None:
                        await writes.aclose()

    def _parse(self, job: ShardJob, feed: Feed, source: str | RemoteFile | BinaryIO | PipeShard,
               pool: SamplePool | None = None) -> None:
        """Thread: parse one shard (a local path, a cached copy open, a download, or a command's
        output) into lists of samples, then END. An exception no sample can carry goes into the
        feed for ``samples`` to raise: left in the thread's future, the consumer waited for END
        forever."""
        try:
            self._parse_samples(job, feed, source, pool)
        except Exception as exc:
            feed.put(exc, force=True)
        feed.put(END, force=True)

    def _parse_samples(self, job: ShardJob, feed: Feed, source: str | RemoteFile | BinaryIO | PipeShard,
                       pool: SamplePool | None) -> None:
        """``_parse`` up to END: samples, and a bad shard's ReadError samples (``_lost``);
        ``position`` carries the rank input ordinal."""
        first, stride, base, path, rank_base = job.first, job.stride, job.base_index, job.path, job.rank_base
        needed, count = job.needed, job.count

        def select(j: int) -> bool:
            if j < first or (j - first) % stride or (count is not None and j >= count):
                return False
            return needed is None or needed(rank_base + (j - first) // stride)

        chunk: list[Sample] = []

        def put(sample: Sample) -> bool:
            """Into the chunk, sent when full; False once the reader stopped listening."""
            nonlocal chunk
            chunk.append(sample)
            if len(chunk) < self.chunk_size:
                return True
            _own_bytes(chunk, pool)
            sent, chunk = feed.put(chunk), []
            return sent

        last = -1
        # The shard's last counted sample waits for the shard's end: a failure found past it (more
        # samples than the count, a command's exit status) takes its place (``_lost``).
        held: Sample | None = None
        miscounted = False
        remote = isinstance(source, RemoteFile)
        try:
            with open_shard(source) as f:
                grouper = pool.grouper() if pool is not None else None
                for j, key, fields, error in iter_groups(f, path, select, lambda: feed.stopped, spans=True, grouper=grouper):
                    last = j
                    if fields is None:
                        continue
                    if error is None and self.require:
                        error = _missing(fields, self.require, key, path)
                    if error is not None:
                        fields = {}
                    sample = Sample(key, fields, path, base + j, rank_base + (j - first) // stride, error)
                    if count is not None and j == count - 1:
                        held = sample
                    elif not put(sample):
                        return
                if remote and source.tee is not None and not feed.stopped:
                    _keep(source)
                if isinstance(source, PipeShard) and not feed.stopped:
                    source.finish()  # the command's exit status: a failure after its last sample is one too
                if count is not None and last + 1 != count and not feed.stopped:
                    miscounted = True
                    raise _miscounted(last + 1, count, path)
        except (OSError, ReadError) as exc:
            if not isinstance(exc, ReadError):
                err = ReadError(f"cannot read shard: {exc.strerror or exc}", source=path)
                err.__cause__ = exc
                exc = err
            for sample in _lost(job, exc, last + 1, held, select, miscounted):
                if not put(sample):
                    return
            held = None
        if held is not None:
            chunk.append(held)
        if chunk:
            _own_bytes(chunk, pool)
            feed.put(chunk)


def _lost(job: ShardJob, exc: ReadError, j: int, held: Sample | None, select: Callable[[int], bool],
          miscounted: bool) -> Iterator[Sample]:
    """The error samples of a shard that failed (or ended) at in-shard ordinal ``j``.

    Without a count: one, in the place of this rank's first sample at or after ``j`` (the epoch's
    length is not known then anyway). With a count, positions stay exact (``len()``, equal batches
    per rank, resume, ``max_errors``): every sample from ``j`` to the count that this job reads is
    an error, the first the failure itself, the others "sample k of N missing". A failure found
    past the last counted sample (a shard longer than its count, a command's exit status after its
    last sample) has no missing place of its own: it takes the last counted sample's (``held``,
    when this job reads it), as a tar whose end is damaged has its last sample's taken
    (``_tar.iter_groups``)."""
    path, count = job.path, job.count
    name = os.path.basename(path)
    if count is None:
        position = job.rank_base - (-max(0, j - job.first) // job.stride)
        yield Sample(exc.key or name, {}, path, job.base_index + j, position, exc)
        return
    if j >= count:
        if held is not None:
            yield Sample(held.key, {}, path, held.index, held.position, exc)
        return
    for k in range(j, count):
        if not select(k):
            continue
        if miscounted or k > j:
            at = f"sample {j + 1}" + (f" ({exc.key!r})" if exc.key else "")
            why = exc.message if miscounted else f"the shard failed at {at}: {exc.message}"
            # The cause's class (a StorageError's lost samples are StorageErrors: on_error= and
            # stats().errors see one failure of one kind, however many samples it cost).
            error = type(exc)(f"sample {k + 1} of {count} missing: {why}", source=path)
            error.__cause__ = None if miscounted else exc
        else:
            error = exc
        position = job.rank_base + (k - job.first) // job.stride
        yield Sample(error.key or name, {}, path, job.base_index + k, position, error)


def _miscounted(held: int, count: int, path: str) -> ReadError:
    """A shard read to its end that held another number of samples than its known count: a tar cut
    exactly between two members parses cleanly, so only the count tells it from a whole one. A
    shorter shard's message is the reason each missing sample gives (``_lost``); a longer one's
    error takes the place of its last counted sample (the samples past the count are not read)."""
    if held < count:
        return ReadError(f"shard ends after {held} (cut short, or changed since it was counted: "
                         "headrace-index.json, counts= or counts='scan')", source=path)
    return ReadError(f"shard holds {held} samples; its count says {count} (headrace-index.json, counts= or "
                     f"counts='scan'): changed since it was counted; its sample {count} of {count} is given as "
                     f"this error and the {held - count} past it are not read", source=path)


def _kill_commands(sources: Sequence[object]) -> None:
    for source in sources:
        if isinstance(source, PipeShard):
            source.kill()


def _keep(download: RemoteFile) -> None:
    """The shard was parsed to its end: its local copy goes into the cache if whole. Reading the
    bytes after the archive's end marker can fail like any read; every sample is out by then, so
    that only means the copy is not kept."""
    try:
        download.keep()
    except (OSError, ReadError):
        pass


def _own_bytes(chunk: list[Sample], pool: SamplePool | None = None) -> None:
    """Every field of the chunk its own ``bytes``, as read from a file: the members a download or
    a mapped shard handed out uncopied (``Span``) are copied out in one call that lets the GIL go.
    A copy into fresh memory costs ~50 µs a 68 KB member in page faults (H100, samples kept alive
    as a shuffle buffer keeps them): with the GIL held, the event loop and the decode lanes waited
    that long for every member (docs/benchmarks.md, issue 21). ``pool`` recycles the memory of
    fields nobody holds any more (``SamplePool``)."""
    held = [(s.fields, name, value) for s in chunk for name, value in s.fields.items() if type(value) is Span]
    if not held:
        return
    spans = [(span.address, len(span.view)) for _, _, span in held]
    blobs = pool.copy(spans) if pool is not None else None
    if blobs is None:
        blobs = copy_spans(spans)
    if blobs is None:  # no C helper: copied here, the GIL held
        blobs = [bytes(span.view) for _, _, span in held]
    for (fields, name, _), blob in zip(held, blobs):
        fields[name] = blob


def _missing(fields: dict, require: list[tuple[str, ...]], key: str, path: str) -> ReadError | None:
    for alternatives in require:
        if not any(a in fields for a in alternatives):
            return ReadError(f"sample has no {' or '.join(map(repr, alternatives))} field "
                             f"(it has {', '.join(sorted(fields)) or 'none'})", key=key, source=path)
    return None
