"""User stages and non-image payloads on the GPU path: stages after decode run after the lane on a
stream that is not the default one (a batch stage at their head in the lane itself, on its stream),
with the same results as the stage applied to the stage-less batch; a Filter runs before decode and
is refused after it."""

from __future__ import annotations

import asyncio
import gc
import threading

import numpy as np
import pytest
import torch
from sample_data import jpeg_bytes

from headrace import ConfigError, Loader, TransformError, ops, readers

N = 48


def _items() -> list[dict]:
    rng = np.random.default_rng(9)
    return [{"__key__": f"s{i:03d}", "jpg": jpeg_bytes(rng, 60 + i % 9, 80 + i % 5), "cls": i % 5,
             "txt": f"caption {i}", "emb": np.full(4, i, np.float32)} for i in range(N)]


def _loader(pipeline, **kw) -> Loader:
    return Loader(readers.sequence(_items(), shuffle=True, seed=2), batch_size=16, pipeline=pipeline,
                  device="cuda", seed=4, **kw)


async def _by_key(loader) -> dict[str, dict]:
    out = {}
    async with loader:
        async for b in loader:
            for row, key in enumerate(b.sample_keys):
                out[key] = {name: (v[row].cpu() if isinstance(v, torch.Tensor) else v[row]) for name, v in b.data.items()}
    return out


def _brighten(calls: list) -> object:
    def brighten(batch: dict) -> dict:
        calls.append((threading.current_thread().name, torch.cuda.current_stream(), batch["image"].device))
        batch["image"] = (batch["image"] * 2 + 1).clamp_(max=255)
        return batch

    return brighten


def _same_row(row: dict) -> dict:
    return row


@pytest.mark.parametrize("where", ["lane", "stage thread"])
async def test_a_batch_stage_runs_after_the_lane_on_a_stream_that_is_not_the_default(leaks, where):
    # At the head of the stages after decode a MapBatch runs in the lane's thread on its stream;
    # after a Map it runs in a stage thread on a stream of its own. Either way: no host wait, the
    # same results as the stage applied to the stage-less batch.
    calls: list = []
    base = [ops.Decode(), ops.RandomResizedCrop(32), ops.Flip()]
    before = [ops.Map(_same_row)] if where == "stage thread" else []
    plain = await _by_key(_loader(ops.Pipeline(base)))
    staged = await _by_key(_loader(ops.Pipeline([*base, *before, ops.MapBatch(_brighten(calls))])))
    assert sorted(plain) == sorted(staged) == [f"s{i:03d}" for i in range(N)]
    for key in plain:
        expected = (plain[key]["image"] * 2 + 1).clamp_(max=255)
        assert torch.equal(staged[key]["image"], expected), key
    prefix = "headrace-lane" if where == "lane" else "headrace-stage"
    assert calls and all(name.startswith(prefix) for name, _, _ in calls), {name for name, _, _ in calls}
    assert all(device.type == "cuda" and stream != torch.cuda.default_stream(device) for _, stream, device in calls)
    await leaks.check(settle=2.0)


async def test_a_batch_stages_random_numbers_do_not_depend_on_where_it_runs():
    # fields=["emb"] keeps the MapBatch off the lanes (fields are batched after them): its rng,
    # keyed by the batch's index, gives the same noise on either side.
    def noisy(batch: dict, rng) -> dict:
        noise = torch.as_tensor(rng.integers(0, 7, size=batch["image"].shape, dtype=np.int64), device=batch["image"].device)
        batch["image"] = batch["image"].to(torch.int64) + noise
        return batch

    base = [ops.Decode(), ops.RandomResizedCrop(24), ops.MapBatch(noisy)]
    on_lane = await _by_key(_loader(ops.Pipeline(base)))
    off_lane = await _by_key(_loader(ops.Pipeline(base, fields=["emb"])))
    assert sorted(on_lane) == sorted(off_lane)
    for key in on_lane:
        assert torch.equal(on_lane[key]["image"], off_lane[key]["image"]), key


async def test_row_stages_and_fields_on_the_gpu():
    def tokens(fields: dict) -> dict:
        fields["n"] = len(bytes(fields["txt"]))
        return fields

    def mean(row: dict) -> dict:
        assert row["image"].is_cuda
        return {**row, "mean": row["image"].float().mean()}

    pipe = ops.Pipeline([ops.Map(tokens), ops.Decode(), ops.Resize((24, 24)), ops.Map(mean)], fields=["n", "emb"])
    rows = await _by_key(_loader(pipe))
    items = {it["__key__"]: it for it in _items()}
    for key, row in rows.items():
        assert row["n"].item() == len(items[key]["txt"]) and row["emb"].tolist() == items[key]["emb"].tolist()
        assert row["mean"].item() == pytest.approx(row["image"].float().mean().item(), rel=1e-5)
        assert row["label"].item() == items[key]["cls"]


async def test_arrays_without_images_arrive_on_the_gpu():
    items = [{"x": np.full((3, 2), i, np.float32), "cls": i % 3} for i in range(20)]
    loader = Loader(readers.sequence(items, shuffle=False), batch_size=8, pipeline=ops.Pipeline(image=None),
                    device="cuda")
    async with loader:
        batches = [b async for b in loader]
    assert all(b["x"].is_cuda and b["label"].is_cuda for b in batches)
    assert [v for b in batches for v in b["x"][:, 0, 0].tolist()] == list(range(20))


async def test_an_async_stage_after_decode_is_refused_on_the_gpu_when_the_loader_is_made(leaks):
    async def later(batch: dict) -> dict:
        return batch

    pipeline = ops.Pipeline([ops.Decode(), ops.Resize(16), ops.MapBatch(later)])
    with pytest.raises(ConfigError, match="async def"):
        _loader(pipeline)
    auto = Loader(readers.sequence(_items()), batch_size=16, pipeline=pipeline, device="auto")
    assert auto.device == "cpu"  # the path that can run it
    await auto.aclose()
    await leaks.check()


async def test_a_filter_runs_before_decode_on_the_gpu_and_is_refused_after_it(leaks):
    def keep(fields: dict, index: int) -> bool:
        return isinstance(fields["jpg"], bytes) and index % 3 != 0

    async with _loader(ops.Pipeline([ops.Filter(keep), ops.Decode(), ops.Resize((24, 24))])) as loader:
        batches = [b async for b in loader]
        stats = loader.stats()
    assert sorted(k for b in batches for k in b.sample_keys) == [f"s{i:03d}" for i in range(N) if i % 3]
    assert all(b["image"].is_cuda and len(b["image"]) == len(b.sample_keys) for b in batches)
    assert stats.filtered == sum(b.filtered for b in batches) == N // 3 and stats.dropped == 0

    late = ops.Pipeline([ops.Decode(), ops.Resize(16), ops.Filter(lambda row: True)])
    with pytest.raises(ConfigError, match="put the Filter before Decode"):
        _loader(late)
    auto = Loader(readers.sequence(_items()), batch_size=16, pipeline=late, device="auto")
    assert auto.device == "cpu"  # the path that can run it
    await auto.aclose()
    await leaks.check(settle=2.0)


async def test_a_failing_gpu_stage_is_a_typed_error_and_nothing_is_kept():
    def broken(batch: dict) -> dict:
        raise RuntimeError("kornia said no")

    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with pytest.raises(TransformError, match="kornia said no"):
        async with _loader(ops.Pipeline([ops.Decode(), ops.Resize(16), ops.MapBatch(broken)])) as loader:
            async for _ in loader:
                pass
    await asyncio.sleep(0)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
