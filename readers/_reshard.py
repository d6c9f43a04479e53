"""A WebDataset epoch resumed on another world size (``read(..., history=)``).

``history`` lists the spans of the epoch read before, each as (world, position): every rank of that
world read ``position`` samples of its stream. Span 0 is made of the ranks' ordinary streams; what a
rank had read is found without I/O from its inputs and ``resume_state`` (the inputs before the next
one, less those held in its buffer). The samples no span read, in the epoch's shard order and in
shard order within a shard, are cut into ``world`` contiguous blocks (after ``equal``: padded by
repeating their head, or cut), one per rank; a rank reads its block (seeking over the rest of those
shards) through a shuffle buffer of its own. A later span is read the same way, so a world size may
change any number of times in an epoch.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from headrace._errors import ConfigError, require_int
from headrace._sample import Sample

from ._base import Equal
from ._shuffle import Draws, resume_state

if TYPE_CHECKING:
    from .webdataset import WebDatasetReader

__all__ = ["block", "rank_inputs", "resharded", "span_length", "unread"]


def unread(reader: WebDatasetReader, epoch: int, seed: int, history: Sequence[tuple[int, int]]) -> np.ndarray:
    """Dataset indices of the epoch's samples that no span of ``history`` read, in block order."""
    if reader._counts is None or reader._offsets is None:
        raise ConfigError("webdataset: resuming on another world size needs per-shard sample counts "
                          "(headrace-index.json from `headrace pack`, or counts=[...] or counts='scan')")
    offsets = reader._offsets
    n = len(reader.shards)
    order = np.random.default_rng([seed, epoch, 0]).permutation(n).tolist() if reader.shuffle else range(n)
    remaining = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in order])
    size = reader.shuffle_buffer if reader.shuffle else 0
    for span, (world, position) in enumerate(history):
        world = require_int("history: world", world)
        position = require_int("history: position", position, 0)
        read = np.zeros(offsets[-1], dtype=bool)
        for rank in range(world):
            if span == 0:
                part = reader.shard(rank, world, equal=reader.equal)
                inputs = rank_inputs(part, epoch, seed)
                draws = Draws([seed, epoch, 1, rank])
                took = min(position, len(part))  # "drop" ends the stream early
            else:
                inputs = block(remaining, rank, world, reader.equal)
                draws = Draws([seed, epoch, 1, rank, span])
                took = position
            took = min(took, len(inputs))  # past its end ("pad" repeats): every input was read
            if took == 0:
                continue
            held, nxt = resume_state(size, draws, len(inputs), took, initial=reader.shuffle_initial)
            done = np.ones(nxt, dtype=bool)
            done[held] = False
            read[inputs[:nxt][done]] = True
        remaining = remaining[~read[remaining]]
    return remaining


def rank_inputs(reader: WebDatasetReader, epoch: int, seed: int) -> np.ndarray:
    """Dataset indices of this rank's ordinary stream, in input (pre-shuffle-buffer) order."""
    counts, offsets = reader._counts, reader._offsets
    assert counts is not None and offsets is not None
    parts = [offsets[j.shard] + np.arange(j.first, counts[j.shard], j.stride) for j in reader._jobs(epoch, seed)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


async def resharded(reader: WebDatasetReader, epoch: int, seed: int, history: Sequence[tuple[int, int]],
                    start: int) -> AsyncIterator[list[Sample]]:
    """This rank's block of what ``history`` left unread, from position ``start`` (see above)."""
    inputs = block(unread(reader, epoch, seed, history), reader.rank, reader.world, reader.equal)
    buf = reader._shuffle_buffer([seed, epoch, 1, reader.rank, len(history)], start)
    if start > len(inputs):
        raise ConfigError(f"start must be in [0, {len(inputs)}], got {start}")
    held, nxt = resume_state(buf.size, buf.draws, len(inputs), start, initial=buf.initial) if start else ([], 0)
    buf.slots = [None] * len(held)
    # Jobs number samples by dataset index (a block holds each at most once).
    slot_of = {int(inputs[ordinal]): i for i, ordinal in enumerate(held)}
    wanted = inputs[np.concatenate([np.sort(np.asarray(held, dtype=np.int64)), np.arange(nxt, len(inputs))])]
    if len(wanted) == 0:
        return
    async with contextlib.aclosing(reader._buffered(reader._index_jobs(wanted), buf, slot_of, start, None)) as stream:
        async for chunk in stream:
            yield chunk


def span_length(reader: WebDatasetReader, epoch: int, seed: int, history: Sequence[tuple[int, int]],
                rank: int, world: int, equal: Equal) -> int:
    """Samples in rank ``rank`` of ``world``'s stream for the span of ``epoch`` after ``history``."""
    seed = reader.seed if reader.seed is not None else seed  # as read() does
    part = reader.shard(rank, world, equal=equal)
    if not history:
        return len(part)
    return len(block(unread(part, epoch, seed, history), rank, world, equal))


def block(items: np.ndarray, rank: int, world: int, equal: Equal) -> np.ndarray:
    """Rank ``rank``'s contiguous part of ``items``; ``equal`` as for ``shard()``."""
    n = len(items)
    if equal == "pad":
        size = -(-n // world)
        if size * world > n:
            items = np.concatenate([items, np.resize(items, size * world - n)])
        return items[rank * size : (rank + 1) * size]
    if equal == "drop":
        size = n // world
        return items[rank * size : (rank + 1) * size]
    return np.array_split(items, world)[rank]
