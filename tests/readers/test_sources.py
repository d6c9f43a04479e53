from __future__ import annotations

import contextlib

from pathlib import Path

import pytest
import torch

from headrace import ConfigError, Loader, ReadError, Sample, ops, readers


class PathDataset(torch.utils.data.Dataset):
    """A torch map-style Dataset of (path, label), as torchvision's ImageFolder keeps them."""

    def __init__(self, paths, labels, fail_at=None):
        self.paths, self.labels, self.fail_at = paths, labels, fail_at

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"no row {i} in the label table")
        return str(self.paths[i]), self.labels[i]


def _reference(folder):
    """The files reader's paths and labels, in its dataset order."""
    ref = readers.files(folder)
    return [Path(p) for p in ref.paths], ref.labels


def _dicts(folder):
    paths, labels = _reference(folder)
    return [{"__key__": p.relative_to(folder).with_suffix("").as_posix(), "jpg": p.read_bytes(), "cls": c}
            for p, c in zip(paths, labels)]


def _loader(reader, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("batch_size", 8)
    kw.setdefault("num_threads", 2)
    kw.setdefault("seed", 7)
    kw.setdefault("pipeline", ops.training(32))
    return Loader(reader, **kw)


async def _collect(loader):
    return [b async for b in loader]


async def _once(loader):
    """One epoch of a loader made for it, closed after."""
    async with loader:
        return await _collect(loader)


def _same(a, b):
    assert a.sample_keys == b.sample_keys
    assert (a.epoch, a.index) == (b.epoch, b.index)
    assert torch.equal(a["image"], b["image"])
    assert torch.equal(a["label"], b["label"])


async def _read_all(reader, epoch=0, start=0, seed=0):
    out = []
    async for chunk in reader.read(epoch, start=start, seed=seed):
        out.extend(chunk)
    return out


async def test_list_of_dicts_gives_the_files_readers_batches(image_folder):
    expected = await _once(_loader(readers.files(image_folder, shuffle=True)))
    loader = _loader(readers.sequence(_dicts(image_folder), chunk_size=5))
    got = await _collect(loader)
    assert len(loader) == len(got) == 10
    for x, y in zip(expected, got, strict=True):
        _same(x, y)
    again = await _collect(loader)  # epoch 1: a new permutation, still the files reader's
    expected_1 = await _once(_epoch(1, readers.files(image_folder, shuffle=True)))
    for x, y in zip(expected_1, again, strict=True):
        _same(x, y)
    await loader.aclose()


def _epoch(epoch, reader):
    loader = _loader(reader)
    loader.load_state_dict({**loader.state_dict(), "epoch": epoch})
    return loader


async def test_torch_dataset_of_paths_gives_the_files_readers_batches(image_folder, leaks):
    paths, labels = _reference(image_folder)
    expected = await _once(_loader(readers.files(paths, labels, shuffle=True)))
    loader = _loader(readers.sequence(PathDataset(paths, labels), io_threads=3, chunk_size=4))
    got = await _collect(loader)
    for x, y in zip(expected, got, strict=True):
        _same(x, y)
    assert got[0].sources[0] in map(str, paths)
    await loader.aclose()
    await leaks.check()


async def test_bytes_pairs_and_samples_become_fields(image_folder):
    paths, labels = _reference(image_folder)
    items = [(paths[0].read_bytes(), 2), (paths[1], None),
             Sample("mine", {"jpg": b"\xff\xd8\xff", "cls": b"1"}, "here", 99), {"jpg": paths[2], "txt": "héllo"}]
    samples = await _read_all(readers.sequence(items, shuffle=False))
    assert samples[0].fields == {"jpg": paths[0].read_bytes(), "cls": 2} and samples[0].key == "0"
    assert samples[1].fields == {"jpg": paths[1].read_bytes()} and samples[1].source == str(paths[1])
    assert (samples[2].key, samples[2].source, samples[2].index) == ("mine", "here", 2)
    assert samples[3].fields == {"jpg": paths[2].read_bytes(), "txt": "héllo".encode()}
    assert [s.position for s in samples] == [0, 1, 2, 3] and all(s.error is None for s in samples)


async def test_items_it_cannot_take_fail_typed_in_their_place(tmp_path):
    items = [(b"\xff\xd8\xff", 1.5), (tmp_path / "missing.jpg", 0), [b"x"], {"jpg": b"\xff\xd8\xff"}]
    samples = await _read_all(readers.sequence(items, shuffle=False))
    assert [type(s.error) for s in samples] == [ReadError, ReadError, ReadError, type(None)]
    assert "float" in str(samples[0].error) and samples[0].error.key == "0"
    assert samples[1].error.source == str(tmp_path / "missing.jpg")
    assert isinstance(samples[1].error.__cause__, FileNotFoundError)
    assert "dict of fields" in str(samples[2].error)


async def test_shuffle_is_seeded_per_epoch(image_folder):
    reader = readers.sequence(_dicts(image_folder))
    e0 = [s.index for s in await _read_all(reader, epoch=0, seed=3)]
    assert e0 == [s.index for s in await _read_all(reader, epoch=0, seed=3)]
    assert e0 != [s.index for s in await _read_all(reader, epoch=1, seed=3)]
    assert e0 != [s.index for s in await _read_all(reader, epoch=0, seed=4)]
    assert sorted(e0) == list(range(75))
    own_seed = readers.sequence(_dicts(image_folder), seed=3)
    assert [s.index for s in await _read_all(own_seed, epoch=0, seed=99)] == e0
    files = readers.files(image_folder, shuffle=True)
    assert [s.index for s in await _read_all(files, epoch=0, seed=3)] == e0


@pytest.mark.parametrize("world", [2, 3])
async def test_shards_are_disjoint_and_complete(image_folder, world):
    base = readers.sequence(_dicts(image_folder))
    files = readers.files(image_folder, shuffle=True)
    parts = [[s.index for s in await _read_all(base.shard(r, world), epoch=1)] for r in range(world)]
    assert sorted(i for p in parts for i in p) == list(range(75))
    assert [len(base.shard(r, world)) for r in range(world)] == list(map(len, parts))
    for r in range(world):
        assert parts[r] == [s.index for s in await _read_all(files.shard(r, world), epoch=1)]
        padded = [s.index for s in await _read_all(base.shard(r, world, equal="pad"), epoch=1)]
        assert padded == [s.index for s in await _read_all(files.shard(r, world, equal="pad"), epoch=1)]


@pytest.mark.parametrize("stop_after", [0, 4])
async def test_resume_mid_epoch_from_state_dict(image_folder, stop_after):
    items = _dicts(image_folder)
    full = _loader(readers.sequence(items))
    await _collect(full)
    expected = await _collect(full)  # epoch 1
    await full.aclose()
    first = _loader(readers.sequence(items))
    await _collect(first)
    async for batch in first:
        if batch.index == stop_after:
            break
    state = first.state_dict()
    await first.aclose()
    second = _loader(readers.sequence(PathDataset(*_reference(image_folder))))
    with pytest.raises(ConfigError):  # another source
        second.load_state_dict(state)
    second = _loader(readers.sequence(items))
    second.load_state_dict(state)
    for x, y in zip(expected[stop_after + 1 :], await _collect(second), strict=True):
        _same(x, y)


async def test_failing_getitem_fails_only_its_sample(image_folder):
    paths, labels = _reference(image_folder)
    dataset = PathDataset(paths, labels, fail_at=10)
    samples = await _read_all(readers.sequence(dataset, shuffle=False, chunk_size=4))
    bad = samples[10]
    assert isinstance(bad.error, ReadError) and bad.error.key == "10" and "PathDataset[10]" in str(bad.error)
    assert isinstance(bad.error.__cause__, KeyError)
    assert [s.error for s in samples[:10] + samples[11:]] == [None] * 74
    skip = _loader(readers.sequence(dataset), on_error="skip", max_errors=1)
    batches = await _collect(skip)
    keys = [k for b in batches for k in b.sample_keys]
    assert sorted(keys) == sorted(str(p.with_suffix("")) for i, p in enumerate(paths) if i != 10)
    assert sum(b.dropped for b in batches) == 1
    strict = _loader(readers.sequence(dataset))
    with pytest.raises(ReadError) as info:
        await _collect(strict)
    assert info.value.key == "10"
    await skip.aclose()
    await strict.aclose()


def _gen(items):
    yield from items


async def _agen(items):
    for item in items:
        yield item


@pytest.mark.parametrize("kind", ["generator", "async generator", "factory", "async factory"])
@pytest.mark.parametrize("length", [None, 75])
async def test_iterables_through_a_loader(image_folder, kind, length, leaks):
    items = _dicts(image_folder)
    source = {"generator": lambda: _gen(items), "async generator": lambda: _agen(items),
              "factory": lambda: (lambda: _gen(items)), "async factory": lambda: (lambda: _agen(items))}[kind]()
    expected = await _once(_loader(readers.files(image_folder)))  # no shuffle: the source's order
    loader = _loader(readers.iterable(source, length=length, chunk_size=6))
    if length is None:
        with pytest.raises(TypeError):
            len(loader)
    else:
        assert len(loader) == 10
    for x, y in zip(expected, await _collect(loader), strict=True):
        _same(x, y)
    if "factory" in kind:
        assert [b.epoch for b in await _collect(loader)] == [1] * 10
    await loader.aclose()
    await leaks.check()


@pytest.mark.parametrize("run_ahead", [False, True])
@pytest.mark.parametrize("source", [_gen, _agen])
async def test_a_one_shot_iterable_is_refused_on_its_second_epoch(image_folder, source, run_ahead):
    loader = _loader(readers.iterable(source(_dicts(image_folder))), run_ahead=run_ahead)
    assert len(await _collect(loader)) == 10
    with pytest.raises(ConfigError, match="zero-argument callable"):
        await _collect(loader)
    await loader.aclose()


async def test_a_list_is_iterated_again_each_epoch():
    reader = readers.iterable([{"cls": i} for i in range(5)])
    for epoch in range(2):
        assert [s.fields["cls"] for s in await _read_all(reader, epoch)] == [0, 1, 2, 3, 4]


async def test_a_sync_sources_thread_is_gone_when_its_read_ends_or_is_closed(leaks):
    reader = readers.iterable(lambda: _gen([{"cls": i} for i in range(50)]), chunk_size=4)
    for epoch in range(20):  # its pool's thread outlived the read now and then (1 read in 4, say) before
        if epoch % 2:
            assert len(await _read_all(reader, epoch)) == 50
        else:
            async with contextlib.aclosing(reader.read(epoch)) as chunks:
                await anext(chunks)
        await leaks.check()


@pytest.mark.parametrize("world", [2, 3, 13, 25])  # 25 ranks for 10 items: the padding wraps around
@pytest.mark.parametrize("equal", [None, "pad", "drop"])
async def test_iterable_shards_match_the_files_readers(world, equal):
    items = [{"cls": i} for i in range(10)]
    base = readers.iterable(lambda: iter(items), length=10)
    order = readers.sequence(items, shuffle=False)
    for r in range(world):
        part = base.shard(r, world, equal=equal)
        got = [(s.index, s.position) for s in await _read_all(part)]
        assert got == [(s.index, s.position) for s in await _read_all(order.shard(r, world, equal=equal))]
        assert len(part) == len(got)
    parts = [[s.index for s in await _read_all(base.shard(r, world))] for r in range(world)]
    assert sorted(i for p in parts for i in p) == list(range(10))
    with pytest.raises(ConfigError, match="length"):
        readers.iterable(lambda: iter(items)).shard(0, world, equal="pad")


@pytest.mark.parametrize("make", [lambda items: lambda: _gen(items), lambda items: lambda: _agen(items)])
async def test_iterable_resume_from_state_dict(image_folder, make):
    items = _dicts(image_folder)
    expected = await _once(_loader(readers.iterable(make(items), length=75)))
    first = _loader(readers.iterable(make(items), length=75))
    async for batch in first:
        if batch.index == 3:
            break
    state = first.state_dict()
    await first.aclose()
    second = _loader(readers.iterable(make(items), length=75))
    second.load_state_dict(state)
    for x, y in zip(expected[4:], await _collect(second), strict=True):
        _same(x, y)
    # start=k skips this rank's first k items, padding included
    part = readers.iterable(make([{"cls": i} for i in range(10)]), length=10).shard(2, 3, equal="pad")
    assert [(s.index, s.position) for s in await _read_all(part, start=2)] == [(8, 2), (1, 3)]


async def test_a_failing_source_ends_the_epoch_with_a_read_error():
    def broken():
        yield {"cls": 0}
        raise OSError("connection reset")

    with pytest.raises(ReadError, match="connection reset") as info:
        await _read_all(readers.iterable(broken))
    assert isinstance(info.value.__cause__, OSError)


def test_wrong_sources_are_refused():
    with pytest.raises(ConfigError):
        readers.sequence({"a": 1})
    with pytest.raises(ConfigError):
        readers.sequence([])
    with pytest.raises(ConfigError, match="readers.iterable"):
        readers.sequence(_gen([]))
    with pytest.raises(ConfigError):
        readers.iterable(3)
    with pytest.raises(ConfigError):
        readers.iterable([], length=0)
