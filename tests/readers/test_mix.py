"""readers.mix: several real readers (JPEG files, tar shards, an LMDB, sequences) read as one stream.

Exact proportions every epoch, every sample once where no source repeats, a repeated source on a
new pass with new indices, exact resume from any position (the reader's and the loader's), ranks
disjoint and complete, a short source named in a typed error, and nothing left running after a
break.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from headrace import ConfigError, Loader, ReadError, ops, readers


@pytest.fixture(scope="module")
def database(tmp_path_factory, image_folder):
    dest = tmp_path_factory.mktemp("mix") / "db.lmdb"
    readers.pack(image_folder, dest, format="lmdb")
    return dest


def _seq(name: str, n: int, *, shuffle: bool = True):
    return readers.sequence([{"__key__": f"{name}{i}", "bin": name.encode()} for i in range(n)], shuffle=shuffle)


async def _read(reader, epoch=0, start=0, seed=5):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]


def _ids(samples):
    return [(s.source, s.key) for s in samples]


async def test_without_weights_an_epoch_is_every_sample_of_every_source_once(image_folder, shards, database):
    parts = {"files": readers.files(image_folder, shuffle=True), "shards": readers.webdataset(str(shards)),
             "lmdb": readers.lmdb(database, shuffle=True)}
    mixed = readers.mix(parts, tag="dataset")
    assert len(mixed) == 3 * 75 and mixed.counts == [75, 75, 75] and mixed.passes == 1
    samples = await _read(mixed)
    assert [s.position for s in samples] == list(range(225))
    by_source = collections.defaultdict(list)
    for s in samples:
        by_source[s.fields["dataset"]].append(s)
    for number, (name, part) in enumerate(parts.items()):
        alone = await _read(part)  # each source in its own order for the epoch, interleaved
        assert [(s.key, bytes(s.fields["jpg"])) for s in by_source[number]] == \
            [(s.key, bytes(s.fields["jpg"])) for s in alone], name
    assert len({s.index for s in samples}) == 225  # no two samples share augmentation parameters
    first_half = [s.fields["dataset"] for s in samples[:112]]
    assert set(first_half) == {0, 1, 2}  # interleaved, not one source after another
    assert _ids(await _read(mixed, epoch=1)) != _ids(samples)
    assert _ids(await _read(mixed)) == _ids(samples)  # the same (seed, epoch), the same stream


async def test_weights_fix_each_sources_count_every_epoch_and_the_first_to_run_out_ends_it():
    big, small = _seq("big", 100), _seq("small", 30)
    mixed = readers.mix([big, small], weights=[0.5, 0.5])
    assert mixed.counts == [30, 30] and len(mixed) == 60  # small runs out first: 30 + 30
    for epoch in range(3):
        samples = await _read(mixed, epoch=epoch)
        keys = collections.Counter(s.key.rstrip("0123456789") for s in samples)
        assert keys == {"big": 30, "small": 30}
        assert len({s.key for s in samples}) == 60  # nothing read twice
    skewed = readers.mix([big, small], weights=[3, 1])
    assert skewed.counts == [90, 30]
    assert readers.mix([big, small], weights=[1, 0]).counts == [100, 0]
    assert readers.mix({"b": big, "s": small}, weights={"s": 1, "b": 3}).counts == [90, 30]


async def test_a_source_weighted_past_its_size_comes_round_again_in_a_new_order_with_new_indices():
    big, small = _seq("big", 40), _seq("small", 10)
    mixed = readers.mix([big, small], weights=[1, 1], length=60, tag="part")
    assert mixed.counts == [30, 30] and mixed.passes == 3
    samples = await _read(mixed)
    smalls = [s for s in samples if s.fields["part"] == 1]
    assert collections.Counter(s.key for s in smalls) == {f"small{i}": 3 for i in range(10)}
    passes = [[s.key for s in smalls[p * 10:(p + 1) * 10]] for p in range(3)]
    assert all(sorted(p) == sorted(passes[0]) for p in passes)  # each pass all of the source
    assert passes[0] != passes[1]  # the next pass is the source's next epoch: a new shuffle
    assert len({s.index for s in samples}) == 60  # a repeated sample gets its own augmentation parameters
    bigs = [s.key for s in samples if s.fields["part"] == 0]
    assert len(set(bigs)) == 30


async def test_length_without_weights_splits_by_the_sources_sizes():
    mixed = readers.mix([_seq("a", 30), _seq("b", 10)], length=20)
    assert mixed.counts == [15, 5]
    assert readers.mix([_seq("a", 3), _seq("b", 3), _seq("c", 3)], length=7).counts in ([3, 2, 2], [2, 3, 2], [2, 2, 3])


@pytest.mark.parametrize("length", [30, 75, 160])
async def test_one_source_at_a_set_length_is_a_fixed_length_epoch(shards, length):
    alone = readers.webdataset(str(shards), shuffle=True)
    fixed = readers.mix([alone], length=length)
    assert len(fixed) == length
    samples = await _read(fixed, epoch=1)
    passes = [samples[p:p + 75] for p in range(0, length, 75)]
    assert [s.key for s in passes[0]] == [s.key for s in (await _read(alone, epoch=1 * fixed.passes))[:length]]
    for p in passes:  # each pass (whole or cut) is the shards' order with no sample twice
        assert len({s.key for s in p}) == len(p)
    assert len({s.index for s in samples}) == length


@pytest.mark.parametrize("start", [1, 17, 59, 60, 75])
async def test_reading_from_any_position_gives_the_rest_of_the_stream_exactly(image_folder, shards, start):
    mixed = readers.mix([readers.files(image_folder, shuffle=True), readers.webdataset(str(shards), shuffle=True),
                         _seq("s", 12)], weights=[2, 2, 1], length=75, chunk_size=7)
    whole = await _read(mixed, epoch=2)
    rest = await _read(mixed, epoch=2, start=start)
    assert [(s.source, s.key, s.index, s.position, s.fields) for s in rest] == \
        [(s.source, s.key, s.index, s.position, s.fields) for s in whole[start:]]
    with pytest.raises(ConfigError, match="start must be in"):  # past the end: a wrong state, as every reader says
        await _read(mixed, epoch=2, start=76)


async def test_the_loader_resumes_a_mix_mid_epoch_to_the_same_batches(image_folder, shards):
    def loader():
        mixed = readers.mix({"files": readers.files(image_folder, shuffle=True),
                             "shards": readers.webdataset(str(shards), shuffle=True)}, weights=[3, 1], length=64,
                            tag="dataset")
        return Loader(mixed, batch_size=8, device="cpu", num_threads=2, seed=11,
                      pipeline=ops.Pipeline([ops.Decode(), ops.Resize(32), ops.CenterCrop(32)], fields=("dataset",)))

    async with loader() as whole:
        expected = [b async for b in whole]
    assert sum(len(b.sample_keys) for b in expected) == 64
    assert torch.equal(torch.bincount(torch.cat([b["dataset"] for b in expected])), torch.tensor([48, 16]))
    async with loader() as first:
        async for batch in first:
            if batch.index == 2:
                break
        state = first.state_dict()
    async with loader() as second:
        second.load_state_dict(state)
        rest = [b async for b in second]
    assert len(rest) == len(expected) - 3
    for x, y in zip(expected[3:], rest, strict=True):
        assert x.sample_keys == y.sample_keys and x.sources == y.sources
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["dataset"], y["dataset"])
    other = readers.mix([readers.files(image_folder, shuffle=True), readers.webdataset(str(shards))],
                        weights=[1, 1], length=64)
    with pytest.raises(ConfigError):  # another mix's state
        Loader(other, batch_size=8, device="cpu", seed=11, pipeline=ops.validation(32)).load_state_dict(state)


async def test_rank_0s_state_loads_on_every_rank_and_at_an_epoch_boundary_on_another_world_size():
    def loader(rank, world):
        mixed = readers.mix([_seq("a", 40), _seq("s", 20)], weights=[1, 1])
        return Loader(mixed, batch_size=4, device="cpu", num_threads=1, seed=3, rank=rank, world=world,
                      pipeline=ops.Pipeline([], image=None, label=None, fields=("bin",)))

    async with loader(0, 2) as rank0:
        async for batch in rank0:
            break
        state = rank0.state_dict()
        async for _ in rank0:  # a whole epoch (the next one): the state after it points at the one after
            pass
        boundary = rank0.state_dict()
    assert (state["epoch"], state["position"]) == (0, 4) and (boundary["epoch"], boundary["position"]) == (2, 0)
    async with loader(1, 2) as rank1:
        rank1.load_state_dict(state)  # the same step on every rank: rank 0's state serves rank 1
        assert [b async for b in rank1]
    async with loader(0, 4) as wider:
        wider.load_state_dict(boundary)
        assert [b.epoch async for b in wider] == [2] * len(wider)
        with pytest.raises(ConfigError, match="cannot resume an epoch on another world size"):
            loader(0, 4).load_state_dict(state)


@pytest.mark.parametrize("equal", [None, "drop", "pad"])
async def test_ranks_read_disjoint_parts_that_together_are_every_sample(image_folder, shards, equal):
    mixed = readers.mix([readers.files(image_folder, shuffle=True), _seq("s", 21)], tag="n")
    parts = [mixed.shard(rank, 4, equal=equal) for rank in range(4)]
    read = [await _read(part, epoch=1) for part in parts]
    if equal is not None:
        assert len({len(p) for p in parts}) == 1  # every rank the same count
    assert [len(r) for r in read] == [len(p) for p in parts]
    ids = [i for r in read for i in _ids(r)]
    whole = set(_ids(await _read(mixed, epoch=1)))  # 75 files and 21 items
    if equal is None:  # files 19, 19, 19, 18 and items 6, 5, 5, 5
        assert len(ids) == len(set(ids)) == 96 and set(ids) == whole
    elif equal == "pad":  # 19 + 6 a rank: the short ranks repeat a sample of each source
        assert len(ids) == 100 and set(ids) == whole
    else:  # 18 + 5 a rank: the last 3 files and the last item of the global orders left out
        assert len(ids) == len(set(ids)) == 92 and set(ids) < whole


async def test_a_bad_sample_keeps_its_key_and_source_and_a_short_source_is_named(image_folder, tmp_path, leaks):
    broken = tmp_path / "broken"
    for c in ("a", "b"):
        (broken / c).mkdir(parents=True)
    for i, p in enumerate(sorted(image_folder.rglob("*.jpg"))[:6]):
        (broken / ("a" if i % 2 else "b") / p.name).write_bytes(p.read_bytes())
    files = readers.files(broken)
    (broken / "a" / sorted(p.name for p in (broken / "a").iterdir())[0]).unlink()  # gone after listing
    samples = await _read(readers.mix([files, _seq("s", 6)]))
    failed = [s for s in samples if s.error is not None]
    assert len(failed) == 1 and isinstance(failed[0].error, ReadError)
    assert failed[0].source.startswith(str(broken / "a")) and failed[0].key.startswith("a/")

    def five():
        yield from ({"__key__": f"it{i}", "bin": b"x"} for i in range(5))

    short = readers.iterable(five, length=8)  # promises 8, gives 5
    with pytest.raises(ReadError, match=r"source 'stream' ended after 5 of the 8 samples") as info:
        await _read(readers.mix({"seq": _seq("s", 8), "stream": short}))
    assert "IterableReader" in info.value.source
    await leaks.check()


async def test_breaking_out_closes_every_sources_read(image_folder, shards, database, leaks):
    mixed = readers.mix([readers.files(image_folder, shuffle=True), readers.webdataset(str(shards)),
                         readers.lmdb(database)], chunk_size=4)
    chunks = mixed.read(0)
    taken = 0
    async for chunk in chunks:
        taken += len(chunk)
        if taken >= 20:
            break
    await chunks.aclose()
    await leaks.check()
    loader = Loader(mixed, batch_size=8, device="cpu", num_threads=2, pipeline=ops.validation(32))
    async with loader:
        async for batch in loader:
            break
    await leaks.check()


def test_wrong_arguments_are_refused_by_name():
    a, b = _seq("a", 4), _seq("b", 4)
    cases = [
        (lambda: readers.mix([]), "no sources"),
        (lambda: readers.mix(a), "list or a mapping"),
        (lambda: readers.mix([a, [1, 2]]), "source '1' is not a reader"),
        (lambda: readers.mix([a, b], weights=[1]), "1 weights for 2 sources"),
        (lambda: readers.mix([a, b], weights=[1, -1]), "weights must be"),
        (lambda: readers.mix([a, b], weights={"0": 1, "1": 1}), "weights by name need sources by the same names"),
        (lambda: readers.mix({"a": a, "b": b}, weights={"a": 1}), "weights by name need sources by the same names"),
        (lambda: readers.mix([a, b], weights=[0, 0]), "weights must be"),
        (lambda: readers.mix([a, b], weights=[1, float("nan")]), "weights must be"),
        (lambda: readers.mix([a, b], length=0), "length"),
        (lambda: readers.mix([a, b], chunk_size=0), "chunk_size"),
        (lambda: readers.mix([a, b], tag=""), "tag"),
        (lambda: readers.mix([a, readers.iterable(lambda: iter([]))]), "source '1' needs a len"),
        (lambda: readers.mix([a, _seq("c", 2)], weights=[1, 1]).shard(3, 4, equal="drop"), "no samples on rank 3"),
    ]
    for make, message in cases:
        with pytest.raises(ConfigError, match=message):
            make()


def test_the_order_holds_the_counts_exactly_and_is_uniform_over_the_epoch():
    mixed = readers.mix([_seq("a", 900), _seq("b", 300)])
    order = mixed.order(0, seed=1)
    assert np.bincount(order).tolist() == [900, 300]
    quarters = [np.bincount(q, minlength=2)[1] for q in np.split(order, 4)]
    assert all(40 <= q <= 110 for q in quarters)  # b spread over the epoch (75 a quarter on average)
