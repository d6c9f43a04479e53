"""Samples from WebDataset tar shards, read as streams: no index needed, bounded memory, exact resume.

Stream of one rank for (seed, epoch):

1. shard order: all shards, permuted by an RNG keyed on (seed, epoch) when shuffling;
2. this rank's part: with at least as many shards as ranks, the shards ``i`` with ``i % world == rank``
   (fixed across epochs, so ``len()`` is too); with fewer, every shard, keeping sample ``j`` of shard
   ``i`` when ``(i + j) % world == rank`` (the others are seeked over, not read);
3. the samples of those shards in order, through a seeded shuffle buffer (``_shuffle.py``) that
   emits from ``shuffle_initial`` samples on and grows to ``shuffle_buffer``;
4. with ``equal="drop"`` cut, with ``"pad"`` extended by the stream's own head, to the same count on
   every rank.

Resume: ``read(epoch, start=k)`` recomputes the shuffle buffer's state after ``k`` outputs by running
it over input ordinals (integers; no I/O), then opens only the shards holding an input it still needs
(the ones held in the buffer at ``k`` and every later one) and, inside those, reads only the samples
it needs: the others are skipped with a seek over their data. It needs per-shard sample counts: from
the index ``pack`` writes, from ``counts=``, or else from a one-time scan of the tar headers (seeks,
no data read) done on the first resume. Cost: O(buffer + k) integer steps (~0.5 s per million) plus
reading the ``shuffle_buffer`` held samples again; without a shuffle buffer, only what is left.

``resampled=True`` replaces steps 1-2 and 4: each rank draws shards uniformly with replacement from
all of them, by an RNG keyed on (seed, epoch, rank); with counts, until ``ceil(samples / world)``
inputs (the last drawn shard read up to there), else ``ceil(shards / world)`` whole shards. The
draws are a function of (seed, epoch, rank), so resume works as above (by ``rank_base``, a
position in the rank's draws, never the shard's identity: a shard drawn twice is two jobs).
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import functools
import os
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, Self

import numpy as np

from headrace._errors import ConfigError, ReadError, require_int
from headrace._sample import Sample

from ._base import Equal, Reader, _check_shard, check_order, number_samples
from ._cache_folder import from_arguments
from ._reshard import resharded
from ._shard_cache import ShardCache
from ._shard_files import ShardFiles, ShardJob
from ._shards import read_index, resolve_shards
from ._shuffle import Draws, ShuffleBuffer, resume_state
from ._storage import Storage, Store, run_sync

__all__ = ["WebDatasetReader", "webdataset"]

Split = Literal["auto", "shards", "samples"]


class WebDatasetReader(Reader):
    """Streams samples out of tar shards; see the module docstring for the stream and resume design.

    Build it with ``headrace.readers.webdataset(...)``.
    """

    def __init__(
        self,
        shards: Sequence[str],
        *,
        counts: Sequence[int] | None = None,
        total: int | None = None,
        shuffle: bool = False,
        shuffle_buffer: int = 1000,
        shuffle_initial: int = 100,
        seed: int | None = None,
        read_ahead: int = 2,
        chunk_size: int = 64,
        split: Split = "auto",
        require: Sequence[str] = (),
        storage: Storage | None = None,
        buffer_bytes: int = 64 << 20,
        cache: ShardCache | None = None,
        resampled: bool = False,
    ) -> None:
        if not isinstance(resampled, (bool, np.bool_)):
            raise ConfigError(f"webdataset: resampled must be True or False, got {resampled!r}")
        if resampled and split != "auto":
            raise ConfigError(f"webdataset: split={split!r} has no meaning with resampled=True "
                              "(every rank draws from all the shards)")
        shuffle_buffer = require_int("webdataset: shuffle_buffer", shuffle_buffer, 0)
        shuffle_initial = require_int("webdataset: shuffle_initial", shuffle_initial, 1)
        read_ahead = require_int("webdataset: read_ahead", read_ahead, 0)
        chunk_size = require_int("webdataset: chunk_size", chunk_size, 1)
        buffer_bytes = require_int("webdataset: buffer_bytes", buffer_bytes, 1 << 16)
        if split not in ("auto", "shards", "samples"):
            raise ConfigError(f"webdataset: split must be 'auto', 'shards' or 'samples', got {split!r}")
        if counts is not None and len(counts) != len(shards):
            raise ConfigError(f"webdataset: {len(shards)} shards but {len(counts)} counts")
        self.shards = list(shards)
        self.shuffle, self.seed = check_order(shuffle, seed, "webdataset")
        self.shuffle_buffer = shuffle_buffer
        # More than the buffer holds is the whole buffer, as WebDataset's min(initial, bufsize): so the
        # default (100) leaves a buffer of 100 or less as it was.
        self.shuffle_initial = min(shuffle_initial, shuffle_buffer)
        self.split = split
        self.resampled = bool(resampled)
        self.equal: Equal = None
        self.storage = storage
        self.files = ShardFiles(self.shards, storage, read_ahead=read_ahead, chunk_size=chunk_size,
                                require=[tuple(alt.split(";")) for alt in require], buffer_bytes=buffer_bytes,
                                cache=cache)
        self._counts = None if counts is None else [int(c) for c in counts]
        self._total = sum(self._counts) if self._counts is not None else total
        # Sample.index: dense dataset positions when counts are known now, else (shard << 32) + ordinal.
        # Fixed here, so a scan done later (for a resume) never changes the indices.
        self._offsets = None if self._counts is None else np.concatenate([[0], np.cumsum(self._counts)]).tolist()
        self._scanned: list[int] | None = self._counts

    @property
    def _names(self) -> list[str]:
        return self.files.names

    @property
    def retries(self) -> int:
        """Storage faults survived by this reader's downloads (each resumed from the byte reached)."""
        return self.files.retries

    @property
    def cache(self) -> ShardCache | None:
        """The local copies of remote shards (``cache_dir=``), with their counts: ``hits``, ``kept``,
        ``evicted``, ``failed``; None without a ``cache_dir``."""
        return self.files.cache

    @property
    def peak_buffered(self) -> int:
        """The most bytes one download held ahead of its parser, counting what the client held for
        its ranged GETs: ``buffer_bytes`` at most, plus the block of the GET the parser reads."""
        return self.files.peak_buffered

    # -- shape of the stream ------------------------------------------------------------------

    @property
    def by_samples(self) -> bool:
        """True when ranks split every shard's samples, False when they split the shards."""
        return self.split == "samples" or (self.split == "auto" and len(self.shards) < self.world)

    def _jobs(self, epoch: int, seed: int) -> list[ShardJob]:
        if self.resampled:
            return self._resampled_jobs(epoch, seed)
        n = len(self.shards)
        order = np.random.default_rng([seed, epoch, 0]).permutation(n).tolist() if self.shuffle else range(n)
        jobs = []
        for i in order:
            if self.by_samples:
                first, stride = (self.rank - i) % self.world, self.world
            elif i % self.world == self.rank:
                first, stride = 0, 1
            else:
                continue
            base = self._offsets[i] if self._offsets is not None else i << 32
            count = None if self._counts is None else self._counts[i]
            jobs.append(ShardJob(i, self._names[i], first, stride, base, count=count))
        return jobs

    def _draws(self, epoch: int, seed: int) -> Iterator[int]:
        """``resampled``: this rank's shard draws for the epoch, uniform with replacement over all the
        shards, endless. Drawn in blocks of a fixed size, so the sequence never depends on how much
        of it is used."""
        rng = np.random.default_rng([seed, epoch, 2, self.rank])
        while True:
            yield from rng.integers(len(self.shards), size=256).tolist()

    def _resampled_target(self) -> int:
        """``resampled`` with counts: samples in each rank's epoch, a pass's worth shared by the ranks."""
        assert self._counts is not None
        return -(-sum(self._counts) // self.world)

    def _resampled_jobs(self, epoch: int, seed: int) -> list[ShardJob]:
        """Whole drawn shards, ``ceil(shards / world)`` of them; with counts, drawn shards until the
        epoch's samples are reached, the last one read up to there."""
        draws = self._draws(epoch, seed)
        counts, offsets = self._counts, self._offsets
        if counts is None or offsets is None:
            picks = [next(draws) for _ in range(-(-len(self.shards) // self.world))]
            return [ShardJob(i, self._names[i], 0, 1, i << 32) for i in picks]
        target, pos, jobs = self._resampled_target(), 0, []
        while pos < target:
            i = next(draws)
            needed = None if pos + counts[i] <= target else (lambda r, end=target: r < end)
            jobs.append(ShardJob(i, self._names[i], 0, 1, offsets[i], pos, needed, counts[i]))
            pos += counts[i]
        return jobs

    def _stream_total(self, jobs: list[ShardJob], counts: Sequence[int]) -> int:
        """Samples in the rank's natural stream made of ``jobs``."""
        if not self.resampled:
            return self._rank_total(counts, self.rank)
        total = sum(counts[j.shard] for j in jobs)
        return min(total, self._resampled_target()) if self._counts is not None else total

    def _rank_total(self, counts: Sequence[int], rank: int) -> int:
        if self.by_samples:
            return sum(len(range((rank - i) % self.world, c, self.world)) for i, c in enumerate(counts))
        return sum(counts[rank :: self.world])

    def _target(self, counts: Sequence[int]) -> int:
        """Samples per epoch on this rank once the ``equal`` policy is applied."""
        if self.resampled:  # the same on every rank: ``equal`` has nothing to do
            return self._resampled_target()
        if self.equal is None or self.world == 1:
            return self._rank_total(counts, self.rank)
        totals = [self._rank_total(counts, r) for r in range(self.world)]
        return max(totals) if self.equal == "pad" else min(totals)

    def __len__(self) -> int:
        if self.resampled and self._counts is None:
            raise TypeError("len() of this resampled webdataset reader is unknown: without per-shard counts "
                            "(headrace-index.json from `headrace pack`, or counts=[...] or counts='scan') an epoch "
                            "is a number of whole shards drawn, not of samples")
        if self._counts is not None:
            return self._target(self._counts)
        if self._total is not None and self.world == 1:
            return self._total
        raise TypeError(
            "len() of this webdataset reader is unknown: its shards have no headrace-index.json "
            "(written by `headrace pack`) and no counts= were given"
            + (" (a total count does not say how the shards split across ranks)" if self._total else "")
        )

    @property
    def reshardable(self) -> bool:  # type: ignore[override]
        """A state saved on another world size resumes here when the per-shard counts are known
        (never with ``resampled``: its ranks' draws have no part to hand over)."""
        return self._counts is not None and not self.resampled

    def shard(self, rank: int, world: int, *, equal: Equal = None) -> Self:
        rank, world = _check_shard(rank, world, equal)
        part = copy.copy(self)
        part.rank, part.world, part.equal = rank, world, equal
        part.files = copy.copy(self.files)  # its own download counters, as a copy's attributes were
        if part.split == "shards" and len(self.shards) < world and not self.resampled:
            raise ConfigError(f"webdataset: split='shards' needs at least {world} shards, there are {len(self.shards)}")
        if equal is not None and self._counts is None:
            raise ConfigError(f"webdataset: equal={equal!r} needs per-shard sample counts "
                              "(headrace-index.json from `headrace pack`, or counts=[...] or counts='scan')")
        if equal == "pad" and world > 1 and not self.resampled:
            # "pad" repeats a rank's own stream: a rank with none has nothing to repeat. Refused here,
            # the same on every rank (each counts them all), not when that rank's epoch starts.
            assert self._counts is not None
            totals = [part._rank_total(self._counts, r) for r in range(world)]
            empty = [r for r, total in enumerate(totals) if total == 0]
            if empty and max(totals) > 0:
                split = "samples" if part.by_samples else "shards"
                raise ConfigError(
                    f"webdataset: equal='pad' repeats a rank's own samples, but {len(empty)} of {world} ranks "
                    f"(rank {empty[0]} the first) get none of the {sum(self._counts)} samples in "
                    f"{len(self.shards)} shards (split by {split}): run on fewer ranks"
                    + (", or split='samples'" if split == "shards" else "")
                    + ", or equal=None (those ranks then read nothing)")
        return part

    def state_dict(self) -> dict:
        try:
            samples: int | None = len(self)
        except TypeError:
            samples = None
        return {"type": type(self).__name__, "samples": samples, "rank": self.rank, "world": self.world,
                "total": self._total, "shards": len(self.shards), "shuffle": self.shuffle,
                "shuffle_buffer": self.shuffle_buffer if self.shuffle else 0,
                "shuffle_initial": self.shuffle_initial if self.shuffle else 0,
                "split": self.split, "equal": self.equal,
                **({"resampled": True} if self.resampled else {})}

    def __repr__(self) -> str:
        return (f"WebDatasetReader({len(self.shards)} shards, samples={self._total}, shuffle={self.shuffle}, "
                f"buffer={self.shuffle_buffer if self.shuffle else 0}"
                + (f", initial={self.shuffle_initial}" if self.shuffle else "")
                + f", rank={self.rank}/{self.world}"
                + (", resampled" if self.resampled else "") + ")")

    # -- reading ------------------------------------------------------------------------------

    def _shuffle_buffer(self, key: Sequence[int], position: int) -> ShuffleBuffer:
        """An empty sample buffer at output ``position``, its draws keyed on ``key``: ``shuffle_buffer``
        samples, emitting from ``shuffle_initial`` on (none without ``shuffle``)."""
        size = self.shuffle_buffer if self.shuffle else 0
        return ShuffleBuffer(size, Draws(key), position=position, initial=self.shuffle_initial)

    def connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The storage's session when any shard is read through a store (``Reader.connections``);
        local and ``pipe:`` shards hold no connection."""
        # The same test as the downloads', which open a session of their own only then.
        if self.storage is None or not any(self.files.remote):
            return super().connections()
        return self.files.held_session()

    async def read(
        self, epoch: int, *, start: int = 0, seed: int = 0, history: Sequence[tuple[int, int]] = ()
    ) -> AsyncIterator[list[Sample]]:
        """Yield this rank's samples for ``epoch`` from stream position ``start`` on.

        Up to ``read_ahead`` shards beyond the current one are read at once, each by its own thread
        into a feed of two ``chunk_size`` lists; a full feed stops that thread (backpressure). Memory
        is about ``(read_ahead + 1) * 3 * chunk_size + shuffle_buffer`` samples, plus a window of up
        to 256 tar members and 32 MiB per thread (copied out at once, ``_tar._SCAN_BYTES``), and the reader keeps
        at most as much again of the memory of fields let go, to copy later ones into (its pages
        stay faulted in: ``_shard_files.SamplePool``; docs/storage.md). Closing the iterator
        stops the threads and closes the files before it returns. A sample that cannot be read is
        a sample whose ``error`` is a ReadError naming the shard (and key, where known). Without
        counts a truncated or corrupt shard ends with one. With known counts (the index,
        ``counts=``) every place keeps its sample, so ``len()``, each rank's batch count under
        ``equal=`` and a resume stay exact and ``on_error``/``max_errors`` count every sample lost:
        a shard that ends early, truncated or cut exactly between two members (a tar that parses
        cleanly: only the count tells it from a whole one), gives an error sample for each place
        from the failure to its count that this read reads ("sample 94 of 100 missing: shard ends
        after 93 ..."; a striding rank, a resume, a resampled epoch's last draw read only theirs).
        A shard with more samples than its count gives its count's samples (those past it are not
        read) with the last one replaced by the error, as is one whose command fails after its last
        counted sample: an error that no missing place can carry takes the last counted place, as a
        tar damaged past its last member's data has its last sample's taken, rather than make the
        epoch longer (or go uncounted). A shard counted empty has no place for it, and gives none.
        """
        seed = self.seed if self.seed is not None else seed
        start = require_int("start", start, 0)
        if history and self.resampled:
            raise ConfigError("webdataset: a resampled epoch cannot be resumed on another world size (each "
                              "rank's draws are its own); resume on the same world size, or start the next epoch")
        if history:  # the epoch began on other world sizes: see _reshard.py
            async with contextlib.aclosing(resharded(self, epoch, seed, history, start)) as stream:
                async for chunk in stream:
                    yield chunk
            return
        if self.equal is None or self.world == 1 or self.resampled:
            async with contextlib.aclosing(self._stream(epoch, seed, start, None)) as stream:
                async for chunk in stream:
                    yield chunk
            return
        counts = self._counts
        assert counts is not None  # shard() checked
        natural, target = self._rank_total(counts, self.rank), self._target(counts)
        if start > target:
            raise ConfigError(f"start must be in [0, {target}], got {start}")
        if natural == 0 and target > 0:
            raise ReadError(f"equal='pad': rank {self.rank} has no samples to repeat", source=self._names[0])
        pos = start
        while pos < target:  # "pad" repeats the stream's head; "drop" stops early
            base = pos % natural
            stream = self._stream(epoch, seed, base, min(natural, base + target - pos))
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    for s in chunk:
                        s.position += pos - base
                    yield chunk
            pos += min(natural, base + target - pos) - base

    async def _stream(self, epoch: int, seed: int, start: int, stop: int | None) -> AsyncIterator[list[Sample]]:
        """Positions [start, stop) of the rank's natural stream (``stop=None``: to its end)."""
        buf = self._shuffle_buffer([seed, epoch, 1, self.rank], start)
        jobs = self._jobs(epoch, seed)
        slot_of: dict[int, int] = {}
        if start > 0:
            counts = await self._known_counts()
            total = self._stream_total(jobs, counts)
            if start > total:
                raise ConfigError(f"start must be in [0, {total}], got {start}")
            held, nxt = resume_state(buf.size, buf.draws, total, start, initial=buf.initial)
            buf.slots = [None] * len(held)
            slot_of = {ordinal: i for i, ordinal in enumerate(held)}
            jobs = _resume_jobs(jobs, counts, nxt, slot_of)
        limit = None if stop is None else stop - start
        if limit == 0:
            return
        # The natural stream to its end: the next epoch's first shards may start downloading as
        # this read's last ones free their places (``ShardFiles.samples``' ``then``).
        then = None if stop is not None or self.resampled else functools.partial(self._jobs, epoch + 1, seed)
        async with contextlib.aclosing(self._buffered(jobs, buf, slot_of, start, limit, then)) as stream:
            async for chunk in stream:
                yield chunk

    async def _buffered(self, jobs: list[ShardJob], buf: ShuffleBuffer, slot_of: dict[int, int], start: int,
                        limit: int | None, then: Callable[[], list[ShardJob]] | None = None
                        ) -> AsyncIterator[list[Sample]]:
        """The jobs' samples through ``buf``, numbered from ``start``; at most ``limit`` of them.

        ``slot_of`` (resuming): the buffer slot of each held sample, by its ``position`` as the jobs
        number it; those samples come first and fill their slots instead of being pushed. ``then``:
        the next read's jobs (``ShardFiles.samples``).
        """
        emitted = 0
        out: list[Sample] = []
        async with contextlib.aclosing(self.files.samples(jobs, buf.size, then)) as chunks:
            async for chunk in chunks:
                for s in chunk:
                    if slot_of:  # resuming: the first samples to come are the buffer's held ones
                        slot = slot_of.pop(s.position, None)
                        if slot is None:
                            raise ReadError("cannot resume: the shards changed since their counts were taken",
                                            key=s.key, source=s.source)
                        buf.slots[slot] = s
                    else:
                        buf.push(s, out)
                if not out:
                    continue
                if limit is not None and emitted + len(out) >= limit:
                    yield number_samples(out[: limit - emitted], start + emitted)
                    return
                yield number_samples(out, start + emitted)
                emitted += len(out)
                out = []
        if slot_of:
            raise ReadError(f"cannot resume: {len(slot_of)} samples are missing; the shards changed since their "
                            "counts were taken", source=self._names[0])
        buf.drain(out, None if limit is None else limit - emitted)
        if out:
            yield number_samples(out, start + emitted)

    def _index_jobs(self, indices: np.ndarray) -> list[ShardJob]:
        """Jobs that read exactly ``indices`` (dataset indices), in that order: one per run of
        increasing indices inside one shard; a sample's ``position`` is its dataset index."""
        offsets = self._offsets
        assert offsets is not None
        shard_of = np.searchsorted(offsets, indices, side="right") - 1
        cuts = np.flatnonzero((np.diff(shard_of) != 0) | (np.diff(indices) <= 0)) + 1
        jobs = []
        for first, run in zip(np.concatenate([[0], cuts]).tolist(), np.split(indices, cuts)):
            i = int(shard_of[first])
            jobs.append(ShardJob(i, self._names[i], 0, 1, offsets[i], offsets[i], frozenset(run.tolist()).__contains__,
                                 offsets[i + 1] - offsets[i]))
        return jobs

    async def _known_counts(self) -> list[int]:
        if self._scanned is None:
            self._scanned = await self.files.count()
        return self._scanned


def _resume_jobs(jobs: list[ShardJob], counts: Sequence[int], nxt: int, held: dict[int, int]) -> list[ShardJob]:
    """The jobs still needed after a resume, each told which of its samples to read."""

    def needed(r: int) -> bool:
        return r >= nxt or r in held

    marks = sorted(held)
    out = []
    rank_base = 0
    for job in jobs:
        lo = rank_base
        rank_base += len(range(job.first, counts[job.shard], job.stride))
        if rank_base > nxt or bisect.bisect_left(marks, lo) < bisect.bisect_left(marks, rank_base):
            keep = needed if job.needed is None else (lambda r, own=job.needed: own(r) and needed(r))
            out.append(ShardJob(job.shard, job.path, job.first, job.stride, job.base_index, lo, keep, job.count))
    return out


def webdataset(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    counts: int | Sequence[int] | Literal["scan"] | None = None,
    shuffle: bool = False,
    shuffle_buffer: int = 1000,
    shuffle_initial: int = 100,
    seed: int | None = None,
    read_ahead: int = 2,
    chunk_size: int = 64,
    split: Split = "auto",
    require: Sequence[str] = (),
    storage_options: Mapping[str, Any] | None = None,
    store: Store | None = None,
    buffer_bytes: int = 64 << 20,
    cache_dir: str | os.PathLike | None = None,
    cache_bytes: int | None = None,
    resampled: bool = False,
) -> WebDatasetReader:
    """A reader over WebDataset tar shards, local or in object storage.

    ``source``: a brace pattern (``"train-{0000..0127}.tar"``, ``"{a,b}.tar"``), a folder (its
    ``*.tar`` files in sorted order), or a list of either. Each may be a URL:
    ``"s3://bucket/prefix/train-{0000..0127}.tar"``, ``"https://host/data/train-{0..9}.tar"``, a
    bucket folder ``"s3://bucket/prefix/"`` or an S3 glob ``"s3://bucket/train-*.tar"``. Or a shell
    command whose output is the shard, WebDataset's ``pipe:`` convention, for stores the S3 and HTTP
    readers do not reach (``"pipe:gsutil cat gs://bucket/train-{0000..0127}.tar"``: braces expand
    into one command per shard). A command runs in ``/bin/sh`` when its shard is read, in a session
    of its own: closing the read kills it and whatever it started. Its output is read through (a
    resume mid-shard runs it again and reads over the start); an exit status other than 0 is a
    ReadError naming the shard, with the end of the command's error output. Commands have no index
    beside them: give ``counts=`` (or ``"scan"``) for ``len()``. Members are
    grouped by key (the path up to the first dot of the file name) into one Sample per key, whose
    fields are the extensions (lowercased; ``"jpg"``, ``"cls"``, ``"json"``...) mapped to the
    members' bytes, undecoded.

    ``counts``: per-shard sample counts, a total, ``"scan"`` (count now by reading the tar headers),
    or None to use the ``headrace-index.json`` that ``headrace pack`` writes beside the shards, if
    any (fetched too for URLs). They give ``len()``, the ``equal=`` policy of ``shard()`` and a fast
    resume; without them ``len()`` raises TypeError and the first resume scans the headers. Known
    counts are checked as the shards are read: a shard that ends early (cut short exactly between
    two members, truncated, or changed since it was counted) gives a ReadError sample in the place
    of each sample it lacks, so lengths and resume stay exact and ``on_error="skip"`` counts every
    sample lost; one that holds more gives its last counted sample's place to a ReadError naming
    both numbers (``read``). Without counts a failing shard ends with one ReadError sample, and one
    cut exactly between members cannot be told from a whole one.

    ``shuffle``: a new shard order each epoch, plus a ``shuffle_buffer``-sample shuffle buffer, both
    seeded by (``seed`` or the loader's seed, epoch). ``shuffle_initial``: the buffer emits once it
    holds this many samples (WebDataset's ``shuffle(bufsize, initial=100)``, and its default) and
    grows to ``shuffle_buffer`` as it goes, two samples in for each one out, so an epoch's first
    sample waits for ``shuffle_initial`` samples to be read, not ``shuffle_buffer``; more than
    ``shuffle_buffer`` is the whole buffer. ``shuffle_initial=shuffle_buffer`` fills the whole buffer
    first (DALI's ``initial_fill``), the order this reader gave before it had ``shuffle_initial``;
    with a buffer of 100 samples or less the default does too. Either way the buffer's draws depend
    only on the seed and the counts, so resume stays exact. ``read_ahead``: shards read ahead of the
    current one, each by its own thread (and, for URLs, its own download). ``chunk_size``: samples
    per hand-off. ``split``: how ranks divide the data (``"auto"``: by shards when there are at
    least as many shards as ranks, else by samples within every shard). ``require``: field names
    every sample must have (``"jpg;png"`` accepts either); a sample without one becomes a ReadError
    sample.

    Local shards (and cached copies) are mapped into memory where the C helper builds: their tar
    headers are read in place and grouped into samples up to 256 members at a time, the members
    copied out with the GIL let go once for all of them. Treat a shard
    as immutable while it is read: as with any memory map, a file cut short under the reader stops
    the process with SIGBUS (write a new file and rename it over the old one;
    ``HEADRACE_NO_C_HELPERS=1`` reads through buffered files instead).

    Object storage: ``storage_options`` are the S3 and HTTP options (endpoint, region, credentials,
    headers; see ``headrace.readers.S3Store`` and ``HttpStore``) and ``retry`` (a ``Retry``, its fields
    as a dict, or an attempt count); without them the standard AWS environment applies (e.g.
    ``AWS_ENDPOINT_URL_S3`` for an S3-compatible store). ``store``: read every shard from this
    store instead, ``source`` naming keys in it (``MemoryStore`` in tests). A shard is parsed while
    it downloads; each download holds 8 MiB ahead of its parser at first, doubled while the parser
    waits on the store with every GET that allows in flight (later shards and epochs start from what
    it grew to), and at most ``buffer_bytes``, counting what the
    HTTP client holds for each ranged GET it has in flight (a full buffer stops reading the socket),
    so the reader holds about ``(read_ahead + 1) * buffer_bytes`` (in a loader that runs ahead, the
    next epoch's first shards download in the places this epoch's last ones free) plus the samples in flight, however
    large the shards (a parser groups and copies the members of the block at hand at once, letting
    the GIL go; those it leaves to Python a chunk at a time: until then it keeps the blocks they lie
    in, about a chunk's bytes plus a block of up to ``buffer_bytes / 8``). The process may show up to as much again in freed blocks the allocator keeps
    (glibc's arenas of the client's threads: 60-170 MB at ``3 * 64`` MiB, measured). While a
    parser waits for bytes (a store's latency, a bandwidth cap per connection), its download adds
    ranged GETs of the segments ahead, as many as the latency and per-connection bandwidth it observed
    and the parser's pace need (``buffer_bytes / 8`` each, 1 to 4 MiB, up to ``2 * buffer_bytes / segment``
    in flight, 128 for the whole read: a GET waiting for its first byte holds nothing, the bound
    above holds for the bytes they bring); the next shards start with as many once the current one has
    asked for all its bytes: for a store 50 ms and 100 MB/s per connection away, 64 MiB (the
    default bound) streams ~1.1-1.3 GB/s on a 16-core host (~0.6 GB/s on 2 cores).
    Timeouts, dropped connections and 5xx answers are retried with backoff and jitter, resuming
    from the byte reached; once the budget is spent the shard ends with a sample whose ``error`` is
    a ``StorageError`` naming the URL.

    ``resampled``: shards drawn with replacement instead of one exact pass (WebDataset's
    ``resampled=True``, OpenCLIP's ``--dataset-resampled``): every epoch each rank draws shards
    uniformly from the whole list, independently of the other ranks, by an RNG seeded with (seed,
    epoch, rank), and reads each drawn shard's samples in order (through the shuffle buffer with
    ``shuffle=True``). A rank's epoch is a pass's worth shared by the ranks: with per-shard counts,
    ``ceil(samples / world)`` samples (``len()``; drawn shards are read until then, the last one cut
    there), so every rank has the same length and ``equal=`` has nothing to do; without counts,
    ``ceil(shards / world)`` whole shards drawn (``len()`` unknown, ``equal=`` refused as for an
    exact pass). ``readers.mix([reader], length=n)`` sets another length. An epoch resumes exactly
    on the same world size; on another the Loader refuses it (ConfigError: each rank's draws are its
    own, there is no unread part to hand over; start the next epoch). ``split`` must stay
    ``"auto"``.

    ``cache_dir``: a local folder where remote shards are kept as they are read, whole, so later
    epochs and later runs read them from local disk instead of the store (local shards are read
    where they are). A shard is written while its parser reads it, from the blocks it has parsed
    (no second download; at most ``buffer_bytes`` more held while they wait for the disk), and
    appears in the folder, renamed into place, only once every byte of it is there: a shard left early (a ``break``, a resume past its start, a fault
    past the retry budget) is not kept. Processes may share the folder (ranks on one host). A kept
    shard is used as it is: clear the folder when the objects at those URLs change.
    ``cache_bytes``: the most the folder may hold; the least recently used shards are removed to
    make room (None: no bound). A cache leaves 5% of its disk or 1 GiB free, whichever is more; a
    nearly full disk stops caching, never reading (logged once). ``reader.cache`` counts
    hits, shards kept, evicted and failed writes.

    Raises ReadError for a missing local shard, StorageError when a bucket cannot be listed,
    ConfigError for a wrong argument (``resampled`` not a bool, or with ``split`` other than ``"auto"``;
    ``shuffle_initial`` not a positive int).
    """
    cache = from_arguments("webdataset", cache_dir, cache_bytes, ShardCache)
    storage = Storage(storage_options, store)
    shards = resolve_shards(source, storage)
    reader = WebDatasetReader(shards, shuffle=shuffle, shuffle_buffer=shuffle_buffer, shuffle_initial=shuffle_initial,
                              seed=seed, read_ahead=read_ahead, chunk_size=chunk_size, split=split, require=require,
                              storage=storage, buffer_bytes=buffer_bytes, cache=cache, resampled=resampled)
    per_shard, total = _given_counts(counts, shards, storage, reader)
    if per_shard is None and total is None:
        return reader
    return WebDatasetReader(shards, counts=per_shard, total=total, shuffle=shuffle, shuffle_buffer=shuffle_buffer,
                            shuffle_initial=shuffle_initial, seed=seed, read_ahead=read_ahead, chunk_size=chunk_size,
                            split=split, require=require, storage=storage, buffer_bytes=buffer_bytes, cache=cache,
                            resampled=resampled)


def _given_counts(counts: int | Sequence[int] | Literal["scan"] | None, shards: list[str], storage: Storage,
                  reader: WebDatasetReader) -> tuple[list[int] | None, int | None]:
    """``webdataset(counts=...)`` as (per-shard counts, total): from the index, a scan, a total or a list."""
    if counts is None:
        return read_index(shards, storage), None
    if isinstance(counts, str):
        if counts != "scan":
            raise ConfigError(f"webdataset: counts must be a list, an int, 'scan' or None, got {counts!r}")
        return run_sync(reader.files.count), None
    if not isinstance(counts, Iterable):  # a total (NumPy's ints too); a bool or a float is refused
        return None, require_int("webdataset: counts", counts, 0)
    return list(counts), None
