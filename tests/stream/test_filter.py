"""``ops.Filter`` on the CPU path: where it stands and what it gets, sync and async, its randomness
across thread counts, how a dropped sample is counted (apart from the errors), resume past a batch
it emptied, and an answer that is no truth value. With the Map's tests in test_stages.py: exact
resume mid-epoch with filters drawing random numbers, and an exception in its function under
``on_error``."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from sample_data import jpeg_bytes

from headrace import ConfigError, Loader, Preprocessor, TransformError, ops, readers

N = 40
BATCH = 8


def _items(n: int = N, *, broken_class: int | None = None) -> list[dict]:
    """Real JPEGs; the samples of ``broken_class`` (if given) hold bytes that do not decode."""
    rng = np.random.default_rng(3)
    items = []
    for i in range(n):
        image = jpeg_bytes(rng, 40 + i % 7, 48 + i % 5)
        if i % 4 == broken_class:
            image = b"not a jpeg at all"
        items.append({"__key__": f"s{i:03d}", "jpg": image, "cls": i % 4, "txt": f"caption {i}"})
    return items


def _loader(pipeline, *, items=None, shuffle=True, **kw) -> Loader:
    kw.setdefault("num_threads", 2)
    return Loader(readers.sequence(items or _items(), shuffle=shuffle, seed=5), batch_size=BATCH,
                  pipeline=pipeline, device="cpu", **kw)


async def _all(loader) -> list:
    return [b async for b in loader]


def _keys(batches) -> list[str]:
    return sorted(k for b in batches for k in b.sample_keys)


def _not_class_one(fields: dict) -> bool:
    return int(fields["cls"]) != 1


async def test_a_filter_before_decode_drops_samples_before_they_are_decoded(leaks):
    seen_types = set()

    def keep(fields: dict) -> bool:
        seen_types.add(type(fields["jpg"]))
        return _not_class_one(fields)

    # Class 1's images do not decode: under on_error="raise" the epoch ends well only if the filter
    # dropped them before Decode.
    pipe = ops.Pipeline([ops.Filter(keep), ops.Decode(), ops.Resize((16, 16))])
    async with _loader(pipe, items=_items(broken_class=1), on_error="raise") as loader:
        batches = await _all(loader)
        stats = loader.stats()
    assert seen_types == {bytes}  # the encoded fields
    assert _keys(batches) == [f"s{i:03d}" for i in range(N) if i % 4 != 1]
    for b in batches:
        assert b["image"].shape == (len(b.sample_keys), 3, 16, 16) and b["label"].tolist().count(1) == 0
        assert len(b.sample_keys) + b.filtered == BATCH and b.dropped == 0
    assert sum(b.filtered for b in batches) == N // 4
    assert (stats.filtered, stats.dropped, stats.errors, stats.samples) == (N // 4, 0, {}, N - N // 4)
    await leaks.check()


async def test_an_async_filter_runs_on_the_loop_within_its_concurrency(leaks):
    running = peak = 0
    threads = set()

    async def allowed(fields: dict, key: str, index: int) -> bool:
        nonlocal running, peak
        threads.add(threading.get_ident())
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.002)  # a remote lookup
        running -= 1
        assert key == f"s{index:03d}"
        return index % 3 != 0

    pipe = ops.Pipeline([ops.Filter(allowed, concurrency=3), ops.Decode(), ops.Resize((16, 16))])
    async with _loader(pipe) as loader:
        batches = await _all(loader)
        stats = loader.stats()
    assert threads == {threading.get_ident()} and peak == 3
    assert _keys(batches) == [f"s{i:03d}" for i in range(N) if i % 3 != 0]
    assert stats.filtered == sum(1 for i in range(N) if i % 3 == 0) == sum(b.filtered for b in batches)
    await leaks.check()


async def test_a_filter_after_the_ops_sees_rows_and_keeps_every_column_in_step(leaks):
    rows_seen = []

    def bright(row: dict) -> bool:
        rows_seen.append((row["image"].shape, row["label"].dim(), type(row["txt"])))
        return row["image"].float().mean() > 120

    base = [ops.Decode(), ops.Resize((16, 16))]
    async with _loader(ops.Pipeline(base, fields=["txt"])) as loader:
        plain = {k: (b["image"][r], b["label"][r], b["txt"][r])
                 for b in await _all(loader) for r, k in enumerate(b.sample_keys)}
    async with _loader(ops.Pipeline([*base, ops.Filter(bright)], fields=["txt"])) as loader:
        batches = await _all(loader)
        stats = loader.stats()
    assert set(rows_seen) == {((3, 16, 16), 0, bytes)}
    expected = sorted(k for k, (image, _, _) in plain.items() if image.float().mean() > 120)
    assert 0 < len(expected) < N and _keys(batches) == expected
    for b in batches:
        assert len(b["txt"]) == len(b.sample_keys) == len(b["label"]) == len(b["image"])
        for r, key in enumerate(b.sample_keys):
            image, label, txt = plain[key]
            assert torch.equal(b["image"][r], image) and b["label"][r] == label and b["txt"][r] == txt
    assert stats.filtered == N - len(expected) and stats.dropped == 0
    await leaks.check()


def _coin(fields: dict, rng: np.random.Generator) -> bool:
    return rng.random() < 0.6


def _row_coin(row: dict, rng: np.random.Generator) -> bool:
    return rng.random() < 0.8


def _random_filters() -> ops.Pipeline:
    return ops.Pipeline([ops.Filter(_coin), ops.Decode(), ops.RandomResizedCrop(16), ops.Filter(_row_coin)])


async def test_filter_draws_are_keyed_by_sample_whatever_the_threads(leaks):
    async def kept(threads: int) -> list[list[str]]:
        async with _loader(_random_filters(), num_threads=threads) as loader:
            return [_keys(await _all(loader)) for _ in range(2)]

    one, three = await kept(1), await kept(3)
    assert one == three
    assert 0 < len(one[0]) < N and one[0] != one[1]  # a new epoch draws anew
    await leaks.check()


async def test_filtered_samples_are_counted_apart_from_skipped_ones(leaks):
    def lookup(fields: dict) -> dict:
        if fields["cls"] == 3:
            raise KeyError("no entry for class 3")
        return fields

    # The budget allows exactly the failures: were the filtered samples counted against it, the
    # epoch would end with ErrorBudgetExceeded.
    pipe = ops.Pipeline([ops.Filter(_not_class_one), ops.Map(lookup), ops.Decode(), ops.Resize((16, 16))])
    async with _loader(pipe, on_error="skip", max_errors=N // 4) as loader:
        batches = await _all(loader)
        stats = loader.stats()
    assert _keys(batches) == [f"s{i:03d}" for i in range(N) if i % 4 in (0, 2)]
    for b in batches:
        assert len(b.sample_keys) + b.dropped + b.filtered == BATCH
    assert (sum(b.filtered for b in batches), sum(b.dropped for b in batches)) == (N // 4, N // 4)
    assert (stats.filtered, stats.dropped, stats.errors) == (N // 4, N // 4, {"TransformError": N // 4})
    assert {int(r.key[1:]) % 4 for r in stats.recent_errors} == {3}  # no filtered sample among the errors
    async with _loader(ops.Pipeline([ops.Filter(_not_class_one), ops.Decode()]), on_error="skip",
                       max_errors=0) as loader:
        assert _keys(await _all(loader)) == [f"s{i:03d}" for i in range(N) if i % 4 != 1]
    await leaks.check()


async def test_a_batch_the_filter_empties_is_not_handed_out_but_counts_as_read(leaks):
    def not_second_batch(fields: dict, index: int) -> bool:
        return not BATCH <= index < 2 * BATCH

    pipe = ops.Pipeline([ops.Filter(not_second_batch), ops.Decode(), ops.Resize((16, 16))])
    async with _loader(pipe, shuffle=False) as loader:
        assert [b.index for b in await _all(loader)] == [0, 2, 3, 4]
        assert loader.stats().filtered == BATCH and loader.stats().batches == 4
        async for b in loader:  # epoch 1, stopped after its first batch
            break
        state = loader.state_dict()
    async with _loader(pipe, shuffle=False) as resumed:
        resumed.load_state_dict(state)
        rest = await _all(resumed)
    assert [b.index for b in rest] == [2, 3, 4]
    assert _keys(rest) == [f"s{i:03d}" for i in range(2 * BATCH, N)]
    await leaks.check()


async def test_an_answer_with_no_truth_value_fails_its_sample():
    def ambiguous(row: dict) -> np.ndarray:
        return np.array([True, False])

    pipe = ops.Pipeline([ops.Decode(), ops.Resize((16, 16)), ops.Filter(ambiguous)])
    with pytest.raises(TransformError, match="ambiguous") as info:
        async with _loader(pipe) as loader:
            await _all(loader)
    assert isinstance(info.value.__cause__, ValueError)


def test_filters_stand_where_maps_do_and_not_after_decode_on_the_gpu():
    early = ops.Pipeline([ops.Filter(_not_class_one), ops.Map(lambda fields: fields), ops.Decode(), ops.Resize(8)])
    late = ops.Pipeline([ops.Decode(), ops.Resize(8), ops.Filter(_row_coin), ops.MapBatch(lambda b: b)])
    assert [type(s).__name__ for s in early.before] == ["Filter", "Map"] and not early.after
    assert [type(s).__name__ for s in late.after] == ["Filter", "MapBatch"]
    with pytest.raises(ConfigError, match="between built-in ops"):
        ops.Pipeline([ops.Decode(), ops.Filter(_row_coin), ops.Resize(8)])
    with pytest.raises(ConfigError, match="callable"):
        ops.Filter("not a function")
    with pytest.raises(ConfigError, match="concurrency"):
        ops.Filter(_not_class_one, concurrency=4)  # a plain function runs in the threads
    # The GPU path refuses a Filter after decode, saying where to put it (device="auto" then picks the CPU).
    assert ops.gpu_unsupported(early) is None
    assert "put the Filter before Decode" in ops.gpu_unsupported(late)


def test_the_preprocessor_refuses_a_filter():
    pipe = ops.Pipeline([ops.Filter(_not_class_one), ops.Decode(), ops.Resize((16, 16))], label=None)
    with pytest.raises(ConfigError, match="Filter"):
        Preprocessor(pipe, device="cpu")
