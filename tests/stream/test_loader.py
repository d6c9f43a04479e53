from __future__ import annotations

import asyncio
import concurrent.futures
import shutil

import pytest
import torch

import headrace
from headrace import ConfigError, DecodeError, ErrorBudgetExceeded, Loader, ReadError, ops, readers


def _pipe():
    return ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(32), ops.Flip(), ops.Normalize()])


def _loader(folder, **kw):
    kw.setdefault("device", "cpu")  # the engine's lifecycle on the CPU executor; tests/gpu covers the lanes
    kw.setdefault("batch_size", 8)
    kw.setdefault("pipeline", _pipe())
    kw.setdefault("num_threads", 2)
    return Loader(readers.files(folder, shuffle=True), **kw)


async def _collect(loader):
    return [b async for b in loader]


def _same(a, b):
    assert a.sample_keys == b.sample_keys
    assert (a.epoch, a.index) == (b.epoch, b.index)
    assert torch.equal(a["image"], b["image"])
    assert torch.equal(a["label"], b["label"])


async def test_one_epoch_yields_every_sample_once_with_labels(image_folder, leaks):
    loader = _loader(image_folder)
    batches = await _collect(loader)
    assert len(batches) == len(loader) == 10  # 75 samples, batch 8, partial last
    keys = [k for b in batches for k in b.sample_keys]
    assert sorted(keys) == sorted(f"c{c}/{i:04d}" for c in range(3) for i in range(25))
    for b in batches:
        assert b["image"].shape == (b.size, 3, 32, 32) and b["image"].dtype == torch.float32
        assert b["label"].tolist() == [int(k[1]) for k in b.sample_keys]
    assert batches[-1].size == 3
    await loader.aclose()  # the worker threads live until then, for the next epoch
    await leaks.check()


async def test_epochs_reshuffle_and_same_seed_repeats(image_folder):
    a, b = _loader(image_folder, seed=1), _loader(image_folder, seed=1)
    a0, a1 = await _collect(a), await _collect(a)
    b0 = await _collect(b)
    assert [x.sample_keys for x in a0] != [x.sample_keys for x in a1]
    assert a1[0].epoch == 1
    for x, y in zip(a0, b0):
        _same(x, y)
    c0 = await _collect(_loader(image_folder, seed=2))
    assert [x.sample_keys for x in a0] != [x.sample_keys for x in c0]


async def test_results_do_not_depend_on_threads_or_prefetch(image_folder):
    base = await _collect(_loader(image_folder, num_threads=1, prefetch=1))
    other = await _collect(_loader(image_folder, num_threads=3, prefetch=4))
    for x, y in zip(base, other, strict=True):
        _same(x, y)


@pytest.mark.parametrize(("policy", "sizes"), [("partial", [8] * 9 + [3]), ("drop", [8] * 9), ("fill", [8] * 10)])
async def test_last_batch_policy(image_folder, policy, sizes):
    loader = _loader(image_folder, last_batch=policy)
    batches = await _collect(loader)
    assert [b.size for b in batches] == sizes and len(loader) == len(sizes)
    if policy == "fill":
        assert batches[-1].padded == 5


async def test_sync_facade_matches_async(image_folder, leaks):
    async with _loader(image_folder) as loader:
        async_batches = await _collect(loader)

    def one_epoch():
        with _loader(image_folder).sync() as sync_loader:
            return list(sync_loader)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # joined on exit: no thread of ours left
        sync_batches = await asyncio.get_running_loop().run_in_executor(pool, one_epoch)
    for x, y in zip(async_batches, sync_batches, strict=True):
        _same(x, y)
    await leaks.check()


def test_sync_break_closes_everything(image_folder):
    import threading

    before = set(threading.enumerate())
    loader = _loader(image_folder).sync()
    for i, _ in enumerate(loader):
        if i == 1:
            break
    # Only the loader's worker threads remain (kept for the next epoch): no loop thread.
    assert all(t.name.startswith("headrace-cpu") for t in threading.enumerate() if t not in before)
    assert len(list(loader)) == 10  # the next loop is the next epoch, in full
    loader.close()
    assert [t for t in threading.enumerate() if t not in before] == []


async def test_break_shuts_everything_down(image_folder, leaks):
    loader = _loader(image_folder, prefetch=4)
    async for _ in loader:
        break
    # A bare `break` leaves closing to the asyncgen finaliser, which runs on the next loop turns
    # and must wait for chunks already decoding in threads; the worker threads stay until aclose.
    await leaks.check(settle=5.0, threads=False)
    await loader.aclose()
    await leaks.check()
    async with _loader(image_folder) as loader2:
        async for _ in loader2:
            break
    await leaks.check()


class SlowReader(headrace.readers.Reader):
    """A real reader around a FileReader that sleeps between lists: the slow stage of the cancel tests."""

    def __init__(self, inner, delay):
        self.inner, self.delay = inner, delay

    def __len__(self):
        return len(self.inner)

    def shard(self, rank, world, *, equal=None):
        return SlowReader(self.inner.shard(rank, world, equal=equal), self.delay)

    async def read(self, epoch, *, start=0, seed=0):
        async for chunk in self.inner.read(epoch, start=start, seed=seed):
            await asyncio.sleep(self.delay)
            yield chunk


async def test_cancelling_the_consumer_shuts_everything_down(image_folder, leaks):
    reader = SlowReader(readers.files(image_folder, chunk_size=4), delay=0.05)
    loader = Loader(reader, batch_size=8, pipeline=_pipe(), device="cpu")

    async def consume():
        async for _ in loader:
            pass

    with pytest.raises(TimeoutError):
        await asyncio.wait_for(consume(), timeout=0.02)
    await leaks.check()


async def test_corrupt_file_raises_typed_error_naming_it_after_good_batches(tmp_path, image_folder, leaks):
    folder = tmp_path / "data"
    shutil.copytree(image_folder, folder)
    bad = folder / "c1" / "0003.jpg"
    bad.write_bytes(bad.read_bytes()[:200])  # truncated JPEG
    loader = Loader(readers.files(folder), batch_size=8, pipeline=_pipe(), device="cpu")  # no shuffle: bad is sample 28
    seen = []
    with pytest.raises(DecodeError) as info:
        async for batch in loader:
            seen.append(batch.index)
    assert seen == [0, 1, 2]  # batches before the bad one arrive, in order
    assert info.value.key == "c1/0003" and info.value.source == str(bad)
    assert info.value.stage == "decode"
    assert loader.state_dict()["position"] == 24
    await loader.aclose()
    await leaks.check()


async def test_skip_policy_drops_and_counts_then_budget_stops(tmp_path, image_folder, leaks):
    folder = tmp_path / "data"
    shutil.copytree(image_folder, folder)
    (folder / "c0" / "0001.jpg").write_bytes(b"")
    (folder / "c2" / "0007.jpg").write_bytes(b"not an image at all")
    loader = Loader(readers.files(folder), batch_size=8, pipeline=_pipe(), on_error="skip", max_errors=2, device="cpu")
    batches = await _collect(loader)
    assert sum(b.size for b in batches) == 73
    assert sum(b.dropped for b in batches) == 2 == loader.stats().dropped
    assert "c0/0001" not in {k for b in batches for k in b.sample_keys}
    strict = Loader(readers.files(folder), batch_size=8, pipeline=_pipe(), on_error="skip", max_errors=1, device="cpu")
    with pytest.raises(ErrorBudgetExceeded) as info:
        await _collect(strict)
    assert info.value.key == "c2/0007" and isinstance(info.value.__cause__, DecodeError)
    await loader.aclose()
    await strict.aclose()
    await leaks.check()


async def test_missing_listed_file_is_a_read_error_naming_it(image_folder, leaks):
    paths = sorted(str(p) for p in image_folder.rglob("*.jpg"))[:10] + [str(image_folder / "gone.jpg")]
    loader = Loader(readers.files(paths, labels=[0] * 11), batch_size=4, pipeline=_pipe(), device="cpu")
    with pytest.raises(ReadError) as info:
        await _collect(loader)
    assert info.value.source == str(image_folder / "gone.jpg")
    await loader.aclose()
    await leaks.check()


@pytest.mark.parametrize("stop_after", [0, 1, 4, 9])
async def test_resume_mid_epoch_yields_exactly_the_remaining_batches(image_folder, stop_after):
    full = _loader(image_folder, seed=7)
    await _collect(full)  # epoch 0
    expected = await _collect(full)  # epoch 1
    first = _loader(image_folder, seed=7)
    await _collect(first)
    async for batch in first:
        if batch.index == stop_after:
            break
    state = first.state_dict()
    await first.aclose()
    assert state["epoch"] == 1 and state["batches"] == stop_after + 1
    second = _loader(image_folder, seed=7)
    second.load_state_dict(state)
    if stop_after + 1 == len(expected):  # saved at the epoch's last batch: the next epoch comes next
        assert second.epoch == 2 and second.state_dict()["position"] == 0
        await second.aclose()
        return
    rest = await _collect(second)
    for x, y in zip(expected[stop_after + 1 :], rest, strict=True):
        _same(x, y)
    assert second.state_dict()["epoch"] == 2 and second.state_dict()["position"] == 0


async def test_state_after_an_epoch_points_at_the_next_one(image_folder):
    loader = _loader(image_folder)
    await _collect(loader)
    state = loader.state_dict()
    assert (state["epoch"], state["position"], state["batches"]) == (1, 0, 0)
    other = _loader(image_folder)
    other.load_state_dict(state)
    assert (await _collect(other))[0].epoch == 1


async def test_state_from_another_configuration_is_refused(image_folder):
    state = _loader(image_folder, seed=1).state_dict()
    with pytest.raises(ConfigError):
        _loader(image_folder, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError):
        _loader(image_folder, seed=1, batch_size=4).load_state_dict(state)


async def test_backpressure_bounds_work_ahead_of_a_slow_consumer(image_folder):
    loader = _loader(image_folder, batch_size=4, prefetch=2)
    async for batch in loader:
        if batch.index == 3:
            await asyncio.sleep(0.2)  # the pipeline fills up and must wait for us
            stats = loader.stats()
            break
    by_name = {c.name: c for c in stats.channels}
    assert by_name["in-flight"].items <= 2
    assert by_name["output"].items <= 2
    await loader.aclose()


async def test_a_second_concurrent_iteration_is_refused(image_folder):
    reader = SlowReader(readers.files(image_folder, chunk_size=4), delay=0.05)
    loader = Loader(reader, batch_size=8, pipeline=_pipe(), device="cpu")
    first = loader.__aiter__()
    waiting = asyncio.create_task(first.__anext__())  # another task is inside the first loop
    await asyncio.sleep(0.01)
    assert not waiting.done()
    with pytest.raises(headrace.LoaderError, match="already being iterated"):
        loader.__aiter__()
    await waiting
    await first.aclose()
    await loader.aclose()


async def test_a_new_loop_replaces_one_left_without_closing(image_folder, leaks):
    loader = _loader(image_folder)
    first = loader.__aiter__()
    await first.__anext__()  # suspended between batches, as after a bare ``break``
    second = [b async for b in loader]  # starts at once: the next epoch, whole
    assert len(second) == 10 and {b.epoch for b in second} == {1}
    with pytest.raises(headrace.ClosedError, match="replaced"):
        await first.__anext__()
    await loader.aclose()
    await leaks.check()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"batch_size": 0},
        {"batch_size": "8"},
        {"last_batch": "wrap"},
        {"device": "tpu"},
        {"on_error": "ignore"},
        {"num_threads": -1},
        {"prefetch": 0},
        {"on_error": "skip", "max_errors": -1},
        {"on_error": "skip", "max_errors": float("nan")},  # would pass every comparison: no budget at all
        {"on_error": "skip", "max_errors": 1.5},
        {"pipeline": [ops.Decode()]},
    ],
)
def test_wrong_arguments_raise_config_error(image_folder, kwargs):
    with pytest.raises(ConfigError):
        base = {"batch_size": 8, **kwargs}
        Loader(readers.files(image_folder), **base)


def test_reader_must_be_a_reader():
    with pytest.raises(ConfigError):
        Loader(["a.jpg"], batch_size=2)


async def test_a_state_loads_right_after_a_bare_break_and_resumes_exactly(image_folder, leaks):
    loader = _loader(image_folder, seed=2)
    whole = await _collect(loader)  # epoch 0
    second = await _collect(loader)  # epoch 1, for comparison
    again = _loader(image_folder, seed=2)
    await _collect(again)
    state = again.state_dict()  # at epoch 1's start
    async for _ in again:  # epoch 1: one batch, then a bare break (the iterator is left to the finaliser)
        break
    again.load_state_dict(state)  # at once: the run left behind is let go, torn down by the next loop
    resumed = await _collect(again)
    for want, got in zip(second, resumed, strict=True):
        _same(want, got)
    assert len(whole) == len(second)
    await loader.aclose()
    await again.aclose()
    await leaks.check(settle=1.0)


async def test_a_state_is_refused_while_a_loop_waits_inside_the_epoch():
    release = asyncio.Event()

    async def items():  # holds the first batch back until released: the loop waits inside the epoch
        await release.wait()
        for i in range(4):
            yield {"__key__": f"k{i}", "x": torch.zeros(2)}

    loader = Loader(readers.iterable(items, length=4), batch_size=2, device="cpu",
                    pipeline=ops.Pipeline(image=None, label=None))
    state = loader.state_dict()
    epoch = loader.__aiter__()
    waiting = asyncio.create_task(epoch.__anext__())
    await asyncio.sleep(0.05)
    assert not waiting.done()
    with pytest.raises(headrace.LoaderError, match="being iterated"):
        loader.load_state_dict(state)
    release.set()
    assert (await waiting).sample_keys == ["k0", "k1"]
    await epoch.aclose()
    await loader.aclose()


async def test_a_state_saved_at_an_epochs_last_batch_resumes_at_the_next_epoch(image_folder, leaks):
    """A trainer checkpoints after its step on the epoch's last batch, before the loop ends: the
    resumed run's next batch is the next epoch's first, as the uninterrupted run's, with no empty
    rest of the epoch in between (which a trainer would count as an epoch)."""
    whole = _loader(image_folder, seed=6)
    epochs = [await _collect(whole) for _ in range(2)]
    await whole.aclose()

    def save_at_the_last_batch():
        with _loader(image_folder, seed=6).sync() as sync:
            for batch in sync:
                state = sync.state_dict()
            return batch, state

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        last, state = await asyncio.get_running_loop().run_in_executor(pool, save_at_the_last_batch)
    _same(last, epochs[0][-1])
    assert (state["epoch"], state["batches"]) == (0, len(epochs[0]))
    resumed = _loader(image_folder, seed=6)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    for want, got in zip(epochs[1], await _collect(resumed), strict=True):
        _same(want, got)
    await resumed.aclose()
    await leaks.check()
