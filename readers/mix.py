"""Several readers as one: their samples interleaved in a seeded order, in set proportions.

An epoch's order is a seeded permutation of a multiset: source ``i`` appears ``counts[i]`` times,
the counts fixed by the weights and the epoch's length. So the proportions hold exactly in every
epoch (not only in expectation, as a draw per sample would give), ``len()`` is known before the
epoch starts, and stream position ``k`` maps to how many samples each source had given by then:
resuming reads each source from its own position (Mosaic streaming fixes its streams' sample
counts per epoch for the same reasons).
"""

from __future__ import annotations

import contextlib
import copy
import math
import numbers
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Self

import numpy as np

from headrace._errors import ConfigError, ReadError, require_int
from headrace._sample import Sample

from ._base import Equal, Reader, _check_shard, number_samples, shard_length

__all__ = ["MixReader", "mix"]

_PER_RANK = ("rank", "world", "samples", "equal")
_ORDER_TAG = 0x6D6978  # "mix": keeps the interleave's random stream apart from the sources' own orders


class MixReader(Reader):
    """Reads several readers as one stream (see ``mix``)."""

    def __init__(self, sources: Sequence[Reader], names: Sequence[str], weights: Sequence[float] | None, *,
                 length: int | None, seed: int | None, chunk_size: int, tag: str | None) -> None:
        self.sources = list(sources)
        self.names = list(names)
        self.weights = None if weights is None else [float(w) for w in weights]
        self.length = length
        self.seed = seed
        self.chunk_size = chunk_size
        self.tag = tag
        self.equal: Equal = None
        self._plan()

    def _plan(self, whole: Sequence[Reader] | None = None) -> None:
        """This rank's samples of each source per epoch, and the passes the most repeated one needs
        (``whole``: the sources this rank's were cut from, to plan the other ranks too)."""
        self.lengths = self._lengths(self.sources)  # each source's samples on this rank
        self.counts = self._counts(self.lengths, self.rank)
        # Pass p of source i in epoch e reads the source's epoch e * passes + p: one more epoch of a
        # source for each time it comes round again, none shared between two epochs of the mix.
        plans = [(self.counts, self.lengths)]
        if whole is not None and self.length is not None and self.world > 1:
            # Only a set length repeats a source. Every rank must then count the same passes, or
            # ranks would read pass p from different epochs of a source, parts of different orders:
            # some samples twice and others never (and indices shared). The most any rank needs.
            plans = [self._rank_plan(whole, rank) for rank in range(self.world)]
        self.passes = max([1] + [math.ceil(c / n) for counts, lengths in plans
                                 for c, n in zip(counts, lengths) if c])

    def _rank_plan(self, whole: Sequence[Reader], rank: int) -> tuple[list[int], list[int]]:
        """Rank ``rank``'s counts and lengths of each source (what ``_plan`` works out on that rank)."""
        if rank == self.rank:
            return self.counts, self.lengths
        lengths = self._lengths([s.shard(rank, self.world, equal=self.equal) for s in whole])
        return self._counts(lengths, rank), lengths

    def _lengths(self, sources: Sequence[Reader]) -> list[int]:
        lengths = []
        for name, source in zip(self.names, sources):
            try:
                lengths.append(len(source))
            except TypeError as exc:  # its message says what would give one (counts=, length=)
                raise ConfigError(f"mix: source {name!r} needs a len() to be mixed: {exc}") from None
        return lengths

    def _counts(self, lengths: list[int], rank: int) -> list[int]:
        for name, n, w in zip(self.names, lengths, self.weights or lengths):
            if n == 0 and w > 0:
                raise ConfigError(f"mix: source {name!r} has no samples on rank {rank} of {self.world}")
        if self.weights is None:
            if self.length is not None:
                return _apportion(shard_length(self.length, rank, self.world, self.equal), lengths)
            return lengths
        total = sum(self.weights)
        shares = [w / total for w in self.weights]
        if self.length is not None:
            return _apportion(shard_length(self.length, rank, self.world, self.equal), shares)
        # The longest epoch in which no source comes round twice: the first one to run out ends it.
        whole = min(n / s for n, s in zip(lengths, shares) if s > 0)
        return [math.floor(whole * s + 1e-9) for s in shares]

    def __len__(self) -> int:
        return sum(self.counts)

    @contextlib.asynccontextmanager
    async def connections(self) -> AsyncIterator[None]:
        """Every source's connections, kept open for the block (``Reader.connections``)."""
        async with contextlib.AsyncExitStack() as stack:
            for source in self.sources:
                await stack.enter_async_context(source.connections())
            yield

    def shard(self, rank: int, world: int, *, equal: Equal = None) -> Self:
        rank, world = _check_shard(rank, world, equal)
        part = copy.copy(self)
        part.sources = [s.shard(rank, world, equal=equal) for s in self.sources]
        part.rank, part.world, part.equal = rank, world, equal
        part._plan(whole=self.sources)
        return part

    def order(self, epoch: int, seed: int = 0) -> np.ndarray:
        """Which source each stream position of ``epoch`` comes from (this rank)."""
        seed = self.seed if self.seed is not None else seed
        dtype = np.uint8 if len(self.sources) <= 256 else np.int32  # an epoch of 10M samples: 10 MB
        labels = np.repeat(np.arange(len(self.sources), dtype=dtype), self.counts)
        return np.random.default_rng([seed, epoch, _ORDER_TAG]).permutation(labels)

    async def read(self, epoch: int, *, start: int = 0, seed: int = 0) -> AsyncIterator[list[Sample]]:
        start = require_int("start", start, 0)
        order = self.order(epoch, seed)
        if start > len(order):  # as every reader: a position past the end is a wrong state, not an empty epoch
            raise ConfigError(f"start must be in [0, {len(order)}], got {start}")
        given = np.bincount(order[:start], minlength=len(self.sources))  # each source's position at ``start``
        lanes = [_Lane(self, i, epoch, int(given[i]), seed) for i in range(len(self.sources))]
        async with contextlib.AsyncExitStack() as stack:
            for lane in lanes:
                stack.push_async_callback(lane.aclose)
            for first in range(start, len(order), self.chunk_size):
                picks = order[first : first + self.chunk_size].tolist()
                need = np.bincount(picks, minlength=len(lanes)).tolist()
                taken = [await lane.take(n) if n else [] for lane, n in zip(lanes, need)]
                at = [0] * len(lanes)
                out = []
                for i in picks:
                    out.append(taken[i][at[i]])
                    at[i] += 1
                yield number_samples(out, first)

    def state_dict(self) -> dict:
        # The sources' states without what differs between ranks and world sizes: the loader leaves
        # those out of its check (a state saved on rank 0 loads on every rank), and so must the mix.
        sources = {n: {k: v for k, v in s.state_dict().items() if k not in _PER_RANK}
                   for n, s in zip(self.names, self.sources)}
        return {**super().state_dict(), "sources": sources, "weights": self.weights, "length": self.length,
                "seed": self.seed, "equal": self.equal}

    def __repr__(self) -> str:
        parts = ", ".join(f"{n}={c}" for n, c in zip(self.names, self.counts))
        return f"MixReader({parts}, samples={len(self)}, rank={self.rank}/{self.world})"


class _Lane:
    """One source's samples within an epoch of the mix, in its own stream order, across its passes."""

    def __init__(self, mix: MixReader, i: int, epoch: int, position: int, seed: int) -> None:
        self.mix, self.i, self.epoch, self.seed = mix, i, epoch, seed
        self.source = mix.sources[i]
        self.length = mix.lengths[i]
        self.pass_, self.offset = divmod(position, self.length) if self.length else (0, 0)  # the next read's start
        self.given = self.offset  # samples of the current pass read so far
        self.stream: AsyncIterator[list[Sample]] | None = None
        self.held: list[Sample] = []  # read, not yet taken

    async def take(self, n: int) -> list[Sample]:
        """The next ``n`` samples, renumbered so that no two of the mix's samples share an index."""
        while len(self.held) < n:
            self.held.extend(self._renumber(await self._next_chunk()))
        out, self.held = self.held[:n], self.held[n:]
        return out

    async def _next_chunk(self) -> list[Sample]:
        while True:
            if self.stream is None:
                self.stream = self.source.read(self.epoch * self.mix.passes + self.pass_, start=self.offset,
                                               seed=self.seed)
            try:
                chunk = await anext(self.stream)
            except StopAsyncIteration:
                await self.aclose()
                if self.given < self.length:
                    name = self.mix.names[self.i]
                    raise ReadError(f"mix: source {name!r} ended after {self.given} of the {self.length} samples "
                                    f"its len() gives (pass {self.pass_} of epoch {self.epoch})",
                                    source=repr(self.source)) from None
                self.pass_, self.offset, self.given = self.pass_ + 1, 0, 0
                continue
            self.given += len(chunk)
            return chunk

    def _renumber(self, chunk: list[Sample]) -> list[Sample]:
        """``chunk``'s samples, each with an index of its own in the mix: per-sample random parameters
        are keyed on it, and two sources' sample 5, or one sample on its second pass, would otherwise
        share them. A reader's chunks are its consumer's (the loader numbers their positions in place
        too); their fields dicts may be the user's, so the tag goes into a new one."""
        k, passes, i, pass_, tag = len(self.mix.sources), self.mix.passes, self.i, self.pass_, self.mix.tag
        for s in chunk:
            s.index = (s.index * passes + pass_) * k + i
            if tag is not None and s.error is None:
                s.fields = {**s.fields, tag: i}
        return chunk

    async def aclose(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            await stream.aclose()


def _apportion(total: int, shares: Sequence[float]) -> list[int]:
    """``total`` split in proportion to ``shares``, whole numbers that add up to it (largest remainder)."""
    scale = sum(shares)
    exact = [total * s / scale for s in shares]
    counts = [math.floor(x) for x in exact]
    for j in sorted(range(len(shares)), key=lambda j: counts[j] - exact[j])[: total - sum(counts)]:
        counts[j] += 1
    return counts


def mix(
    sources: Sequence[Reader] | Mapping[str, Reader],
    weights: Sequence[float] | Mapping[str, float] | None = None,
    *,
    length: int | None = None,
    seed: int | None = None,
    chunk_size: int = 64,
    tag: str | None = None,
) -> MixReader:
    """One reader over several: their samples interleaved in a seeded order, in set proportions.

    ``sources``: readers (any of this package's, with ``len()``), as a list or as a mapping of
    names to readers (the names appear in errors and in ``state_dict()``).

    ``weights``: each source's share of every epoch (a list, or a mapping by name for sources
    given by name). Without them, an epoch is every sample of every
    source once, interleaved uniformly (each source's share its size). With them, an epoch holds
    ``length`` samples, split among the sources in proportion to the weights (whole numbers that add
    up exactly, the same every epoch); by default ``length`` is the longest epoch in which no source
    comes round twice, so the first source to run out ends it (a larger source is then read only
    in part each epoch: the first samples of its own order for that epoch). A source asked for more
    samples than it has comes round again: its second pass reads its next epoch (for a shuffled
    source, a new order), so a small data set can be weighted up. ``length`` without ``weights``
    splits that many samples in proportion to the sources' sizes. A weight of 0 leaves a source out.

    Order: source ``i`` fills ``counts[i]`` of the epoch's positions, which positions drawn from
    ``(seed, epoch)`` (``seed`` defaults to the loader's); each source is read in its own order for
    that epoch, from its own ``read()``, so its shuffle, sharding and I/O are its own. Each sample
    keeps its ``key`` and ``source`` (errors name them), and gets an ``index`` of its own in the mix
    (random augmentation parameters are keyed on it): the source's index, the pass and the source's
    number combined. ``tag="dataset"`` adds a field ``dataset`` holding the source's number (0, 1,
    ...), which ``Pipeline(fields=("dataset",))`` turns into an int64 tensor of the batch.

    The sources' samples meet one pipeline: they need the fields it takes (the image field may be
    any image extension; ``label=`` and ``fields=`` the same in every source).

    Resume: stream position ``k`` of an epoch is, for each source, the count of its samples among
    the first ``k`` positions, so ``read(epoch, start=k)`` reads each source from there: exact when
    every source's own resume is. Not on another world size (the order depends on each rank's
    share of every source).

    Sharding (the loader's ``rank``/``world``, or ``shard()``): every source is sharded the same
    way and each rank mixes its parts; the counts come from each rank's part, so with
    ``equal="pad"`` or ``"drop"`` (the loader's default when it shards) every rank has the same.
    A source that comes round again (a set ``length``) reads pass p from the same epoch of the
    source on every rank, as many passes as the rank that needs most, so each pass is one epoch of
    the source dealt among the ranks.

    While one source's next chunk is awaited the others' reads go on in the background (each
    reader fetches ahead on its own), bounded as each reader bounds itself; the mix hands out its
    samples ``chunk_size`` at a time. Closing or cancelling
    the read closes every source's read. A source that ends before its ``len()`` ends the epoch
    with a ``ReadError`` naming it. Raises ConfigError for an empty ``sources``, a source that is
    not a reader or has no ``len()``, weights that do not match the sources or are negative or all
    zero, or a source with no samples (on some rank) and a positive weight.
    """
    if isinstance(sources, Mapping):
        names, readers_ = [str(n) for n in sources], list(sources.values())
    elif isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence):
        raise ConfigError(f"mix: sources must be a list or a mapping of readers, got {type(sources).__name__}")
    else:
        names, readers_ = [str(i) for i in range(len(sources))], list(sources)
    if not readers_:
        raise ConfigError("mix: no sources")
    for name, source in zip(names, readers_):
        if not isinstance(source, Reader):
            raise ConfigError(f"mix: source {name!r} is not a reader (got {type(source).__name__}); "
                              "make one with readers.files, webdataset, lmdb, sequence or iterable")
    if isinstance(weights, Mapping):  # by name, for sources given by name
        if not isinstance(sources, Mapping) or set(map(str, weights)) != set(names):
            raise ConfigError(f"mix: weights by name need sources by the same names; got weights for "
                              f"{sorted(map(str, weights))} and sources {names}")
        weights = [{str(k): v for k, v in weights.items()}[n] for n in names]
    if weights is not None:
        weights = list(weights)
        if len(weights) != len(readers_):
            raise ConfigError(f"mix: {len(weights)} weights for {len(readers_)} sources")
        # Any real number, NumPy's too (weights from an array or np.bincount), not a bool.
        if any(not isinstance(w, numbers.Real) or isinstance(w, (bool, np.bool_)) or not math.isfinite(w) or w < 0
               for w in weights) or sum(weights) <= 0:
            raise ConfigError(f"mix: weights must be finite numbers >= 0, not all 0; got {weights!r}")
    if length is not None:
        length = require_int("mix: length", length, 1)
    chunk_size = require_int("mix: chunk_size", chunk_size, 1)
    if seed is not None:
        seed = require_int("mix: seed", seed, 0)
    if tag is not None and not (isinstance(tag, str) and tag):
        raise ConfigError(f"mix: tag must be a field name (a non-empty str), got {tag!r}")
    return MixReader(readers_, names, weights, length=length, seed=seed, chunk_size=chunk_size, tag=tag)
