"""User stages (``ops.Map``, ``ops.MapBatch``; ``ops.Filter`` in test_filter.py) on the CPU path: where they run, what they get, their
randomness across thread counts and resume, their errors under ``on_error``, the bound on async calls."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from sample_data import jpeg_bytes

from headrace import ConfigError, Loader, Preprocessor, TransformError, ops, readers

N = 40


def _items(n: int = N) -> list[dict]:
    rng = np.random.default_rng(3)
    return [{"__key__": f"s{i:03d}", "jpg": jpeg_bytes(rng, 40 + i % 7, 48 + i % 5), "cls": i % 4,
             "txt": f"a caption for sample {i}"} for i in range(n)]


def _tokenize(fields: dict) -> dict:
    words = bytes(fields.pop("txt")).split()
    fields["tokens"] = np.array([len(w) for w in words], dtype=np.int64)
    return fields


def _loader(pipeline, *, items=None, **kw) -> Loader:
    kw.setdefault("num_threads", 2)
    return Loader(readers.sequence(items or _items(), shuffle=True, seed=5), batch_size=8, pipeline=pipeline,
                  device="cpu", **kw)


async def _all(loader) -> list:
    return [b async for b in loader]


async def test_a_sync_stage_before_decode_changes_the_fields_the_batch_gets(leaks):
    pipe = ops.Pipeline([ops.Map(_tokenize), ops.Decode(), ops.Resize((24, 24))], fields=["tokens"])
    async with _loader(pipe) as loader:
        batches = await _all(loader)
    items = {it["__key__"]: it for it in _items()}
    assert sorted(k for b in batches for k in b.sample_keys) == sorted(items)
    for b in batches:
        assert b["image"].shape == (len(b.sample_keys), 3, 24, 24)
        assert b["tokens"].dtype == torch.int64 and b["tokens"].shape == (len(b.sample_keys), 5)
        for key, tokens, label in zip(b.sample_keys, b["tokens"].tolist(), b["label"].tolist()):
            assert tokens == [len(w) for w in items[key]["txt"].split()]
            assert label == items[key]["cls"]
    await leaks.check()


async def test_an_async_stage_runs_on_the_loop_within_its_concurrency(leaks):
    running = peak = 0
    loop_thread = None

    async def lookup(fields: dict) -> dict:
        nonlocal running, peak, loop_thread
        loop_thread = threading.get_ident()
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.002)
        running -= 1
        fields["weight"] = float(fields["cls"]) / 2
        return fields

    pipe = ops.Pipeline([ops.Map(lookup, concurrency=3), ops.Decode(), ops.Resize((16, 16))], fields=["weight"])
    async with _loader(pipe) as loader:
        batches = await _all(loader)
    assert loop_thread == threading.get_ident()
    assert peak == 3  # batches in flight share the bound, and 8 samples a batch fill it
    for b in batches:
        assert b["weight"].dtype == torch.float64
        assert b["weight"].tolist() == [label / 2 for label in b["label"].tolist()]
    await leaks.check()


async def test_row_and_batch_stages_after_decode_see_the_outputs(leaks):
    def brightness(row: dict) -> dict:
        assert row["image"].shape == (3, 16, 16) and row["label"].dim() == 0
        return {**row, "mean": row["image"].float().mean()}

    async def double(batch: dict) -> dict:
        batch["label"] = batch["label"] * 2
        return batch

    pipe = ops.Pipeline([ops.Decode(), ops.Resize((16, 16)), ops.Map(brightness), ops.MapBatch(double)])
    async with _loader(pipe) as loader:
        batches = await _all(loader)
    items = {it["__key__"]: it for it in _items()}
    for b in batches:
        assert torch.allclose(b["mean"], b["image"].float().mean(dim=(1, 2, 3)))
        assert b["label"].tolist() == [2 * items[k]["cls"] for k in b.sample_keys]
    await leaks.check()


def _noisy(row: dict, rng: np.random.Generator) -> dict:
    return {**row, "noise": float(rng.random())}


def _jitter(batch: dict, rng: np.random.Generator) -> dict:
    batch["shift"] = torch.full((len(batch["label"]),), float(rng.integers(1000)))
    return batch


def _pre(fields: dict, rng: np.random.Generator) -> dict:
    fields["pre"] = float(rng.random())
    return fields


def _keep_most(fields: dict, rng: np.random.Generator) -> bool:
    return rng.random() < 0.7


def _random_pipeline(filtered: bool = False) -> ops.Pipeline:
    """Stages drawing random numbers before and after the ops; ``filtered``: a Filter drawing in each place too."""
    filters = [ops.Filter(_keep_most)] if filtered else []
    return ops.Pipeline([*filters, ops.Map(_pre), ops.Decode(), ops.RandomResizedCrop(16), *filters, ops.Map(_noisy),
                         ops.MapBatch(_jitter)], fields=["pre"])


def _draws(batches) -> dict:
    out = {}
    for b in batches:
        for row, key in enumerate(b.sample_keys):
            out[key] = (b["pre"][row].item(), b["noise"][row].item(), b["shift"][row].item(), b.epoch)
    return out


@pytest.mark.parametrize("filtered", [False, True])
async def test_stage_randomness_is_keyed_like_the_ops_whatever_the_threads_or_resume(leaks, filtered):
    async def run(threads: int, epochs: int = 2) -> list:
        async with _loader(_random_pipeline(filtered), num_threads=threads) as loader:
            return [await _all(loader) for _ in range(epochs)]

    one, four = await run(1), await run(4)
    assert _draws(one[0]) == _draws(four[0]) and _draws(one[1]) == _draws(four[1])
    assert _draws(one[0]) != _draws(one[1])  # a new epoch draws anew
    if filtered:  # the same samples kept whatever the threads, others in another epoch
        assert 0 < len(_draws(one[0])) < N and _draws(one[0]).keys() != _draws(one[1]).keys()
    # Stop after 2 batches of epoch 1, resume in a new loader: the rest of the epoch is the same batches.
    async with _loader(_random_pipeline(filtered)) as first:
        await _all(first)
        taken = []
        async for b in first:
            taken.append(b)
            if len(taken) == 2:
                break
        state = first.state_dict()
    async with _loader(_random_pipeline(filtered)) as second:
        second.load_state_dict(state)
        rest = await _all(second)
    assert {**_draws(taken), **_draws(rest)} == _draws(one[1])
    assert [(b.index, b.sample_keys, b.filtered) for b in taken + rest] == [(b.index, b.sample_keys, b.filtered)
                                                                             for b in one[1]]
    assert all(torch.equal(x["image"], y["image"]) for x, y in zip(taken + rest, one[1], strict=True))
    await leaks.check()


def _fails_on_three(fields: dict) -> dict:
    if fields["cls"] == 3:
        raise ValueError("no label lookup for class 3")
    return fields


@pytest.mark.parametrize("stage", [ops.Map, ops.Filter])  # a Filter keeps the others: a dict is true
async def test_an_exception_in_a_stage_names_the_sample_and_the_stage(leaks, stage):
    pipe = ops.Pipeline([stage(_fails_on_three), ops.Decode(), ops.Resize((16, 16))])
    with pytest.raises(TransformError) as info:
        async with _loader(pipe) as loader:
            await _all(loader)
    err = info.value
    assert err.key.startswith("s") and int(err.key[1:]) % 4 == 3 and err.source.startswith("list[")
    assert "_fails_on_three" in str(err) and "no label lookup for class 3" in str(err)
    assert isinstance(err.__cause__, ValueError) and err.stage == "stage _fails_on_three"
    async with _loader(pipe, on_error="skip", max_errors=0.5) as loader:
        batches = await _all(loader)
        stats = loader.stats()
    assert stats.dropped == N // 4 and stats.errors == {"TransformError": N // 4} and stats.filtered == 0
    assert sorted(k for b in batches for k in b.sample_keys) == [f"s{i:03d}" for i in range(N) if i % 4 != 3]
    await leaks.check()


async def test_a_failing_batch_stage_fails_each_of_its_samples():
    def broken(batch: dict) -> dict:
        raise RuntimeError("augmentation broke")

    pipe = ops.Pipeline([ops.Decode(), ops.Resize((16, 16)), ops.MapBatch(broken)])
    async with _loader(pipe, on_error="skip", max_errors=1.0) as loader:
        batches = await _all(loader)
        stats = loader.stats()
    assert batches == [] and stats.dropped == N and stats.errors == {"TransformError": N}
    assert "broken" in stats.recent_errors[-1].message


async def test_a_stage_that_returns_no_dict_is_an_error():
    pipe = ops.Pipeline([ops.Map(lambda fields: None), ops.Decode()])
    with pytest.raises(TransformError, match="not a dict"):
        async with _loader(pipe) as loader:
            await _all(loader)


def test_stages_stand_before_decode_or_after_the_last_op():
    ok = ops.Pipeline([ops.Map(_tokenize), ops.Decode(), ops.Resize(8), ops.Map(_noisy), ops.MapBatch(_jitter)])
    assert [type(s).__name__ for s in ok.stages] == ["Map", "Map", "MapBatch"]
    assert ok.core().ops == ok.ops and not ok.core().stages
    with pytest.raises(ConfigError, match="between built-in ops"):
        ops.Pipeline([ops.Decode(), ops.Map(_noisy), ops.Resize(8)])
    with pytest.raises(ConfigError, match="MapBatch"):
        ops.Pipeline([ops.MapBatch(_jitter), ops.Decode()])
    with pytest.raises(ConfigError, match="callable"):
        ops.Map("not a function")
    with pytest.raises(ConfigError, match="concurrency"):
        ops.Map(_tokenize, concurrency=4)  # a plain function runs in the threads: no bound of its own

    async def lookup(fields: dict) -> dict:
        return fields

    with pytest.raises(ConfigError, match="concurrency"):
        ops.Map(lookup, concurrency=0)
    late = ops.Pipeline([ops.Decode(), ops.Resize(8), ops.MapBatch(lookup)])
    assert "async def" in ops.gpu_unsupported(late)  # so device="auto" picks the CPU for it


def test_a_stage_keeps_the_ops_random_numbers():
    # Built-in ops keep their keys when stages are added: the same crops with or without them.
    plain = ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(16)])
    staged = ops.Pipeline([ops.Map(_pre), ops.Decode(), ops.RandomResizedCrop(16), ops.MapBatch(_jitter)])
    assert plain.ops == staged.ops


def test_the_gpu_lanes_take_the_batch_stages_at_the_head_of_those_after_decode():
    # What a GPU lane runs itself (no thread hop, its own stream): plain MapBatch stages up to the
    # first other stage, in a pipeline without fields (those are batched after the lane).
    from headrace.ops._batch_stages import lane_stages

    async def later(batch: dict) -> dict:
        return batch

    first, second = ops.MapBatch(_jitter), ops.MapBatch(lambda b: b)
    base = [ops.Decode(), ops.Resize((16, 16))]
    taken = lane_stages(ops.Pipeline([*base, first, second, ops.Map(_noisy), ops.MapBatch(_jitter)]))
    assert [t.stage for t in taken] == [first, second]
    assert [t.position for t in taken] == [1000, 1001]  # 1000 + the place among the stages: the rng key
    assert lane_stages(ops.Pipeline([*base, first], fields=["tokens"])) == ()
    assert lane_stages(ops.Pipeline([*base, ops.Map(_noisy), first])) == ()
    assert lane_stages(ops.Pipeline([*base, ops.MapBatch(later), first])) == ()


async def test_the_preprocessor_runs_batch_stages():
    def invert(batch: dict) -> dict:
        batch["image"] = 255 - batch["image"]
        return batch

    image = jpeg_bytes(np.random.default_rng(1), 48, 64)
    plain = Preprocessor(ops.Pipeline([ops.Decode(), ops.Resize((16, 16))], label=None), device="cpu")
    staged = Preprocessor(ops.Pipeline([ops.Decode(), ops.Resize((16, 16)), ops.MapBatch(invert)], label=None),
                          device="cpu")
    async with plain, staged:
        assert torch.equal(await staged(image), 255 - await plain(image))


async def test_the_preprocessor_names_each_request_when_no_image_comes_back():
    # A batch whose every request fails before Decode, and a stage that drops the image: each
    # caller gets a typed error of its own, not a KeyError from the service's bookkeeping.
    def refuse(fields: dict) -> dict:
        raise ValueError("not this one")

    image = jpeg_bytes(np.random.default_rng(2), 48, 64)
    refusing = ops.Pipeline([ops.Map(refuse), ops.Decode(), ops.Resize((16, 16))], label=None)
    async with Preprocessor(refusing, device="cpu", max_batch=2, max_delay=3600) as pre:
        errors = await asyncio.gather(pre(image, key="a"), pre(b"junk", key="b"), return_exceptions=True)
    assert all(isinstance(e, TransformError) and "not this one" in e.message for e in errors)
    assert [e.key for e in errors] == ["a", "b"]

    dropping = ops.Pipeline([ops.Decode(), ops.Resize((16, 16)), ops.MapBatch(lambda b: {"other": 1})], label=None)
    async with Preprocessor(dropping, device="cpu", max_batch=2, max_delay=3600) as pre:
        errors = await asyncio.gather(pre(image, key="c"), pre(image, key="d"), return_exceptions=True)
    assert all(isinstance(e, TransformError) and "no 'image'" in e.message for e in errors)
    assert [e.key for e in errors] == ["c", "d"]


async def test_random_exits_with_stages_leave_nothing_behind(leaks):
    from exits import EXITS, random_exits

    async def lookup(fields: dict) -> dict:
        await asyncio.sleep(0.001)
        return fields

    def make() -> Loader:
        pipe = ops.Pipeline([ops.Map(lookup, concurrency=4), ops.Map(_tokenize), ops.Decode(),
                             ops.Resize((16, 16)), ops.Map(_noisy), ops.MapBatch(_jitter)], fields=["tokens"])
        return _loader(pipe)

    keys = {it["__key__"] for it in _items()}
    done = await random_exits(make, rounds=60, expected_keys=keys, seed=21, max_delay=0.03)
    assert set(EXITS) <= set(done)
    await leaks.check(settle=2.0)


async def test_a_field_a_stage_adds_but_no_batch_carries_is_named_once(caplog):
    pipe = ops.Pipeline([ops.Map(_tokenize), ops.Decode(), ops.Resize((16, 16))])  # no fields=["tokens"]
    with caplog.at_level("WARNING", logger="headrace"):
        async with _loader(pipe) as loader:
            batches = await _all(loader)
    assert "tokens" not in batches[0]
    warnings = [r.getMessage() for r in caplog.records if "no batch carries" in r.getMessage()]
    assert len(warnings) == 1 and "'tokens'" in warnings[0] and "fields=" in warnings[0]


async def test_stages_get_the_sample_key_and_index_when_they_ask():
    seen = {}

    def lookup(fields: dict, key: str, index: int) -> dict:
        seen[key] = index
        fields["from_store"] = int(key[1:]) * 10
        return fields

    def batch_keys(batch: dict, keys: list) -> dict:
        batch["key_numbers"] = torch.tensor([int(k[1:]) for k in keys])
        return batch

    pipe = ops.Pipeline([ops.Map(lookup), ops.Decode(), ops.Resize((16, 16)), ops.MapBatch(batch_keys)],
                        fields=["from_store"])
    async with _loader(pipe) as loader:
        batches = await _all(loader)
    assert seen == {f"s{i:03d}": i for i in range(N)}
    for b in batches:
        numbers = [int(k[1:]) for k in b.sample_keys]
        assert b["key_numbers"].tolist() == numbers and b["from_store"].tolist() == [10 * n for n in numbers]
