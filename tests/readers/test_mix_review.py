"""readers.mix review: what a user of WebDataset's RandomMix or torchdata's multiplexers would try.

A set ``length=`` that makes a sharded source come round again reads the same pass of the same
source epoch on every rank (each sample once per pass across the ranks), and NumPy weights are
weights.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

from headrace import ConfigError, readers


def _seq(name: str, n: int):
    return readers.sequence([{"__key__": f"{name}{i}", "bin": name.encode()} for i in range(n)], shuffle=True)


async def _read(reader, epoch=0, seed=5):
    return [s async for chunk in reader.read(epoch, seed=seed) for s in chunk]


@pytest.mark.parametrize("epoch", [0, 1, 2])
async def test_ranks_repeating_a_source_read_the_same_passes_so_every_sample_comes_once_a_pass(epoch):
    # 10 samples over 3 ranks are 4, 3 and 3; a length of 12 asks 4 of each rank, so ranks 1 and 2
    # come round again and rank 0 does not. Each rank planned alone: rank 0 read the source's epoch
    # e, the others epochs 2e and 2e + 1, parts of different orders (epoch 1: 9 of the 10 samples,
    # one three times).
    mixed = readers.mix([_seq("a", 10)], length=12)
    parts = [mixed.shard(rank, 3) for rank in range(3)]
    assert [p.passes for p in parts] == [2, 2, 2]
    samples = [s for p in parts for s in await _read(p, epoch)]
    times = collections.Counter(s.key for s in samples)
    assert len(samples) == 12 and set(times) == {f"a{i}" for i in range(10)}
    assert sorted(times.values()) == [1] * 8 + [2] * 2  # the first pass whole, two samples again
    assert len({s.index for s in samples}) == 12  # no two samples share augmentation parameters


async def test_two_sources_sharded_with_a_length_cover_every_sample_of_the_repeated_one():
    # small's 16 are 6, 5 and 5 a rank, each asked for 6: rank 0 needs one pass, the others two.
    mixed = readers.mix({"big": _seq("big", 40), "small": _seq("small", 16)}, weights=[1, 1], length=36, tag="part")
    parts = [mixed.shard(rank, 3) for rank in range(3)]
    assert [p.counts for p in parts] == [[6, 6]] * 3 and [p.passes for p in parts] == [2, 2, 2]
    samples = [s for p in parts for s in await _read(p, epoch=1)]
    small = collections.Counter(s.key for s in samples if s.fields["part"] == 1)
    assert sum(small.values()) == 18 and set(small) == {f"small{i}" for i in range(16)}
    assert max(small.values()) == 2
    big = [s.key for s in samples if s.fields["part"] == 0]
    assert len(big) == len(set(big)) == 18


def test_numpy_weights_are_weights():
    a, b = _seq("a", 40), _seq("b", 40)
    assert readers.mix([a, b], weights=np.array([3, 1])).counts == [40, 13]
    assert readers.mix([a, b], weights=np.array([0.75, 0.25], dtype=np.float32)).counts == [40, 13]
    assert readers.mix([a, b], weights=np.bincount([0, 0, 0, 1])).counts == [40, 13]
    for wrong in (np.array([1, -1]), np.array([1.0, np.nan]), [np.True_, np.True_]):
        with pytest.raises(ConfigError, match="weights must be"):
            readers.mix([a, b], weights=wrong)
