"""Review 4 of the loader's bounds, as a user with big samples and a slow consumer meets them.

Real files throughout: raw ``.npy`` fields of megabytes read by the files reader, corrupt JPEGs for
the error budget. What is held is read from the channels' ``statistics()`` (``stats().channels``)
and from counts of live objects; nothing here asserts a time. A timeout only guards against a hang.
"""

from __future__ import annotations

import asyncio
import gc
import io
import weakref

import numpy as np
import pytest

from headrace import ConfigError, ErrorBudgetExceeded, Loader, ops, readers

MB = 1 << 20


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def big_npy(tmp_path_factory):
    """24 raw ``.npy`` files of 1 MiB of float32 each, in one class folder; file i holds i."""
    root = tmp_path_factory.mktemp("big-npy")
    (root / "c0").mkdir()
    for i in range(24):
        (root / "c0" / f"{i:02d}.npy").write_bytes(_npy(np.full(MB // 4, i, np.float32)))
    return root


# A sample's bytes as the loader counts them: the .npy file and its label, b"0".
ONE = len(_npy(np.full(MB // 4, 0, np.float32))) + 1


def _npy_loader(folder, *, chunk_size, **kw):
    reader = readers.files(folder, extensions=["npy"], chunk_size=chunk_size, io_threads=1)
    return Loader(reader, pipeline=ops.Pipeline(image=None, label="cls", fields=["npy"]), device="cpu",
                  num_threads=2, **kw)


def _by_name(loader):
    return {c.name: c for c in loader.stats().channels}


async def test_a_slow_consumer_of_big_samples_meets_every_channel_bound(big_npy, leaks):
    budget = 5 * MB // 2
    loader = _npy_loader(big_npy, chunk_size=1, batch_size=1, max_bytes=budget, prefetch=2)
    firsts = []
    async with asyncio.timeout(120):  # a hang guard, not a measurement
        async for batch in loader:
            firsts += batch["npy"][:, 0].tolist()
            await asyncio.sleep(0.02)  # the consumer is the slow stage: everything before it fills up
            held = _by_name(loader)
            assert held["samples"].bytes <= budget and held["output"].items <= 2
    assert firsts == list(range(24))  # every sample, once, in order
    channels = _by_name(loader)
    # max_bytes held two 1 MiB samples at most (a third would pass 2.5 MiB), and was reached.
    assert channels["samples"].peak_bytes == 2 * ONE and channels["samples"].peak_items == 2
    assert channels["samples"].sent == 24
    assert channels["batches"].peak_items <= 2
    assert channels["in-flight"].peak_items <= 2  # prefetch
    assert channels["output"].peak_items <= 2
    await loader.aclose()
    await leaks.check()


async def test_a_chunk_larger_than_max_bytes_passes_alone_and_the_epoch_ends(big_npy, leaks):
    # A chunk of three 1 MiB samples against a budget of 1 KiB: each goes when the channel is empty.
    loader = _npy_loader(big_npy, chunk_size=3, batch_size=5, max_bytes=1024, prefetch=1, run_ahead=True)
    async with asyncio.timeout(120):
        for _ in range(2):  # run_ahead: the next epoch's run reads into its own bounded channels
            keys = []
            async for batch in loader:
                keys += batch.sample_keys
                await asyncio.sleep(0.02)
                assert _by_name(loader)["samples"].items <= 1
            assert len(keys) == len(set(keys)) == 24
            assert _by_name(loader)["samples"].peak_bytes == 3 * ONE
    await loader.aclose()
    await leaks.check()


@pytest.mark.parametrize("bad", [0, -1, 2.0, None, True])
def test_zero_negative_and_untyped_budgets_are_config_errors_naming_the_argument(image_folder, bad):
    reader = readers.files(image_folder)
    for name in ("prefetch", "max_bytes"):
        if name == "prefetch" and bad is None:
            continue  # None: the default
        with pytest.raises(ConfigError, match=name):
            Loader(reader, batch_size=4, device="cpu", **{name: bad})
    if bad is not None:
        with pytest.raises(ConfigError, match="max_batch_bytes"):
            ops.Decode(max_batch_bytes=bad)
        with pytest.raises(ConfigError, match="buffer_bytes"):
            readers.files(image_folder, buffer_bytes=bad)


async def test_huge_budgets_are_taken_as_no_bound(big_npy):
    loader = _npy_loader(big_npy, chunk_size=4, batch_size=4, max_bytes=10**30, prefetch=10**30)
    async with asyncio.timeout(120):
        assert sum([b.size async for b in loader]) == 24
    await loader.aclose()


# -- decoded batches ahead of a slow consumer ---------------------------------------------------------


@pytest.mark.parametrize("prefetch", [1, 3])
async def test_finished_batches_waiting_for_a_slow_consumer_are_at_most_prefetch_plus_two(prefetch):
    """``prefetch`` batches in flight, two finished ones in the output channel (the Loader's docs)."""
    live = [0]

    def made(batch):  # a decoded batch of 1 MiB, counted while it is alive
        out = np.zeros(MB, np.uint8)
        live[0] += 1
        weakref.finalize(out, lambda: live.__setitem__(0, live[0] - 1))
        return {**batch, "decoded": out}

    items = [{"__key__": f"s{i}", "raw": np.full(8, i, np.uint8)} for i in range(40)]
    loader = Loader(readers.sequence(items, shuffle=False, chunk_size=4), batch_size=2, prefetch=prefetch,
                    pipeline=ops.Pipeline([ops.MapBatch(made)], image=None, label=None), device="cpu", num_threads=2)
    ahead = 0
    async with asyncio.timeout(120):
        async for batch in loader:
            await asyncio.sleep(0.02)  # the pipeline fills up behind us
            gc.collect()
            ahead = max(ahead, live[0] - 1)  # the batch in our hands is not ahead
            del batch
    await loader.aclose()
    assert ahead <= prefetch + 2


# -- the error budget ------------------------------------------------------------------------------------


@pytest.fixture
def front_loaded(tmp_path, image_folder):
    """120 files: 30 empty JPEGs first, then 90 good ones (the good folder's 75 and 15 again)."""
    bad = tmp_path / "bad"
    bad.mkdir()
    paths = []
    for i in range(30):
        (bad / f"broken{i:02d}.jpg").write_bytes(b"")
        paths.append(str(bad / f"broken{i:02d}.jpg"))
    good = sorted(image_folder.rglob("*.jpg"))
    paths += [str(p) for p in good] + [str(p) for p in good[:15]]
    return paths


async def test_failures_made_before_the_fraction_is_checked_count_once_it_is(front_loaded):
    # 30 of 120 samples fail (25%), all in the first batch, against a budget of 5%. The fraction is
    # checked once 100 samples were seen: then 30 of 120 is over it, though the batch that passed
    # the 100 had no failure of its own. The run went to its end with a quarter of its data gone.
    pipe = ops.Pipeline([ops.Decode(), ops.Resize(16), ops.CenterCrop(16)])
    loader = Loader(readers.files(front_loaded, labels=[0] * 120), batch_size=60, pipeline=pipe, device="cpu",
                    num_threads=2, on_error="skip", max_errors=0.05)
    got = []
    with pytest.raises(ErrorBudgetExceeded, match="30 of 120 samples failed") as info:
        async for batch in loader:
            got.append(batch.size)
    assert got == [30]  # the first batch, skips out; the second is where the budget is spent
    assert info.value.key.endswith("broken29") and info.value.source.endswith("broken29.jpg")
    await loader.aclose()


async def test_early_failures_within_the_fraction_do_not_end_the_run(front_loaded):
    # One failure in the first 100 is 1% of them: within a 1% budget, then and after.
    paths = front_loaded[29:]  # one broken file, then 90 good
    paths = paths + paths[1:11]  # 101 samples
    pipe = ops.Pipeline([ops.Decode(), ops.Resize(16), ops.CenterCrop(16)])
    loader = Loader(readers.files(paths, labels=[0] * len(paths)), batch_size=50, pipeline=pipe, device="cpu",
                    num_threads=2, on_error="skip", max_errors=0.01)
    assert sum([b.size async for b in loader]) == 100
    assert loader.stats().dropped == 1
    await loader.aclose()
