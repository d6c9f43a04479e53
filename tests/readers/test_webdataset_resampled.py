"""``webdataset(resampled=True)``: each rank draws shards with replacement, seeded by (seed, epoch, rank)."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest

from headrace import ConfigError, readers


async def _read_all(reader, epoch=0, start=0, seed=0):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]


@pytest.fixture(scope="module")
def no_index(tmp_path_factory, packed_in_order):
    dest = tmp_path_factory.mktemp("noindex")
    for p in sorted(packed_in_order.glob("*.tar")):
        shutil.copy(p, dest / p.name)
    return dest


def _shard_runs(samples):
    """The shards a stream read, in order, from an unshuffled stream without counts: a sample's
    index is (shard << 32) + its ordinal, and a drawn shard starts at ordinal 0."""
    return [s.index >> 32 for s in samples if s.index & 0xFFFFFFFF == 0]


async def test_draws_are_reproducible_per_seed_epoch_and_rank(packed_in_order):
    reader = readers.webdataset(packed_in_order, resampled=True, shuffle=True, shuffle_buffer=6)
    keys = {}
    for world in (1, 2):
        for rank in range(world):
            for epoch in (0, 1):
                part = reader.shard(rank, world)
                first = [s.key for s in await _read_all(part, epoch=epoch, seed=3)]
                assert [s.key for s in await _read_all(part, epoch=epoch, seed=3)] == first
                keys[world, rank, epoch] = first
    assert len({tuple(k) for k in keys.values()}) == len(keys)  # epochs and ranks all differ
    other_seed = [s.key for s in await _read_all(reader, epoch=0, seed=4)]
    assert other_seed != keys[1, 0, 0]
    own = readers.webdataset(packed_in_order, resampled=True, shuffle=True, shuffle_buffer=6, seed=3)
    assert [s.key for s in await _read_all(own, epoch=0, seed=99)] == keys[1, 0, 0]


async def test_shards_are_drawn_with_replacement_uniformly(no_index):
    reader = readers.webdataset(no_index, resampled=True)
    drawn, repeated = Counter(), 0
    for epoch in range(60):
        runs = _shard_runs(await _read_all(reader, epoch=epoch, seed=7))
        assert len(runs) == 10  # one pass's worth of draws: ceil(10 shards / 1 rank)
        drawn.update(runs)
        repeated += len(set(runs)) < len(runs)
    # With replacement, 10 draws from 10 shards repeat one nearly always (1 - 10!/10**10).
    assert repeated >= 55
    assert set(drawn) == set(range(10)) and all(30 <= n <= 95 for n in drawn.values()), drawn  # 60 expected


async def test_samples_of_a_drawn_shard_come_in_order(no_index):
    samples = await _read_all(readers.webdataset(no_index, resampled=True), epoch=2)
    ordinals = [s.index & 0xFFFFFFFF for s in samples]
    assert all(b == a + 1 or b == 0 for a, b in zip(ordinals, ordinals[1:]))


@pytest.mark.parametrize("world", [1, 3, 16])
async def test_epoch_length_with_counts_is_a_pass_shared_by_the_ranks(packed_in_order, world):
    reader = readers.webdataset(packed_in_order, resampled=True, shuffle=True, shuffle_buffer=5)
    for rank in range(world):
        part = reader.shard(rank, world)
        assert len(part) == -(-75 // world)
        for epoch in (0, 1):
            samples = await _read_all(part, epoch=epoch)
            assert len(samples) == len(part) and [s.position for s in samples] == list(range(len(part)))
            assert all(s.error is None for s in samples)
        # equal= has nothing to do: every rank's epoch already has the same length.
        assert len(reader.shard(rank, world, equal="pad")) == len(reader.shard(rank, world, equal="drop")) == len(part)


@pytest.mark.parametrize("world", [1, 4, 16])
async def test_epoch_length_without_counts_is_a_number_of_whole_shards(no_index, world):
    reader = readers.webdataset(no_index, resampled=True)
    part = reader.shard(world - 1, world)
    with pytest.raises(TypeError, match="resampled"):
        len(part)
    samples = await _read_all(part, epoch=1)
    runs = _shard_runs(samples)
    assert len(runs) == -(-10 // world)
    sizes = [8] * 9 + [3]
    assert len(samples) == sum(sizes[i] for i in runs)
    with pytest.raises(ConfigError, match="counts"):
        reader.shard(0, world, equal="pad")


@pytest.mark.parametrize(("world", "rank", "buffer"), [(1, 0, 0), (1, 0, 20), (3, 2, 7)])
async def test_resume_yields_exactly_the_rest(packed_in_order, no_index, world, rank, buffer):
    for folder in (packed_in_order, no_index):
        reader = readers.webdataset(folder, resampled=True, shuffle=buffer > 0, shuffle_buffer=buffer).shard(rank, world)
        full = await _read_all(reader, epoch=3, seed=2)
        for start in sorted({1, 2, len(full) // 3, len(full) // 2, len(full) - 1, len(full)}):
            tail = await _read_all(reader, epoch=3, seed=2, start=start)
            assert [(s.key, s.index, s.position) for s in tail] == [(s.key, s.index, s.position) for s in full[start:]]
            assert all(t.fields == f.fields for t, f in zip(tail, full[start:]))


def _loader(packed_in_order, **kw):
    import headrace
    from headrace import ops

    return headrace.Loader(readers.webdataset(packed_in_order, resampled=True, shuffle=True, shuffle_buffer=16),
                           batch_size=4, pipeline=ops.training(32), num_threads=2, seed=5, device="cpu", **kw)


@pytest.mark.parametrize("world", [1, 2])
async def test_loader_resumes_a_resampled_epoch_exactly(packed_in_order, leaks, world):
    import torch

    rank = world - 1
    loader = _loader(packed_in_order, rank=rank, world=world)
    batches = [b async for b in loader]
    assert len(batches) == len(loader) == -(-(-(-75 // world)) // 4)
    first = _loader(packed_in_order, rank=rank, world=world)
    async for batch in first:
        if batch.index == 2:
            break
    state = first.state_dict()
    await first.aclose()
    second = _loader(packed_in_order, rank=rank, world=world)
    second.load_state_dict(state)
    rest = [b async for b in second]
    for x, y in zip(batches[3:], rest, strict=True):
        assert x.sample_keys == y.sample_keys and torch.equal(x["image"], y["image"])
    # On another world size: refused, with the reason.
    third = _loader(packed_in_order, rank=0, world=world + 1)
    with pytest.raises(ConfigError, match="another world size"):
        third.load_state_dict(state)
    for each in (loader, second, third):
        await each.aclose()
    await leaks.check()


async def test_a_resampled_epoch_is_not_read_from_another_world_size_history(packed_in_order):
    reader = readers.webdataset(packed_in_order, resampled=True)
    assert not reader.reshardable
    with pytest.raises(ConfigError, match="another world size"):
        await _read_all_history(reader.shard(0, 2), [(3, 4)])


async def _read_all_history(reader, history):
    return [s async for chunk in reader.read(0, history=history) for s in chunk]


async def test_remote_shards_are_resampled_as_local_ones(tmp_path, packed_in_order):
    from storage_servers import serving

    shutil.copytree(packed_in_order, tmp_path / "wds")
    local = readers.webdataset(packed_in_order, resampled=True, shuffle=True, shuffle_buffer=4, seed=8).shard(1, 2)
    expected = await _read_all(local, epoch=1)
    with serving(tmp_path) as urls:
        remote = readers.webdataset(urls["http_direct"] + "/wds/shard-{000000..000009}.tar", resampled=True,
                                    shuffle=True, shuffle_buffer=4, seed=8, read_ahead=1, buffer_bytes=1 << 16)
        part = remote.shard(1, 2)
        assert len(part) == len(local) == 38
        samples = await _read_all(part, epoch=1)
        tail = await _read_all(part, epoch=1, start=20)
    assert [(s.key, s.fields) for s in samples] == [(s.key, s.fields) for s in expected]
    assert [(s.key, s.fields) for s in tail] == [(s.key, s.fields) for s in expected[20:]]
    assert 0 < part.peak_buffered <= 1 << 16  # the downloads' bound holds as for an exact pass


@pytest.mark.parametrize("kwargs", [{"resampled": "yes"}, {"resampled": 1}, {"resampled": True, "split": "shards"},
                                    {"resampled": True, "split": "samples"}])
def test_wrong_arguments(packed_in_order, kwargs):
    with pytest.raises(ConfigError, match="resampled"):
        readers.webdataset(packed_in_order, **kwargs)


async def test_mix_length_sets_the_epoch_as_with_epoch_does(packed_in_order):
    reader = readers.webdataset(packed_in_order, resampled=True, shuffle=True, shuffle_buffer=4)
    for n in (20, 130):  # fewer than a pass, and more: the source's next epoch draws again
        mixed = readers.mix([reader], length=n)
        samples = await _read_all(mixed, epoch=0, seed=1)
        assert len(samples) == len(mixed) == n and all(s.error is None for s in samples)
        assert [s.key for s in await _read_all(mixed, epoch=0, seed=1, start=7)] == [s.key for s in samples[7:]]
