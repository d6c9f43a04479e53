"""User stages and non-image payloads on the GPU path: stages after decode run on a stream of their
own, after the lane, with the same results as the stage applied to the stage-less batch; a Filter
runs before decode and is refused after it."""

from __future__ import annotations

import asyncio
import gc

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


async def test_a_batch_stage_runs_on_its_own_stream_after_the_lane(leaks):
    streams = []

    def brighten(batch: dict) -> dict:
        stream = torch.cuda.current_stream()
        streams.append((stream, batch["image"].device))
        batch["image"] = (batch["image"] * 2 + 1).clamp_(max=255)
        return batch

    base = [ops.Decode(), ops.RandomResizedCrop(32), ops.Flip()]
    plain = await _by_key(_loader(ops.Pipeline(base)))
    staged = await _by_key(_loader(ops.Pipeline([*base, ops.MapBatch(brighten)])))
    assert sorted(plain) == sorted(staged) == [f"s{i:03d}" for i in range(N)]
    for key in plain:
        expected = (plain[key]["image"] * 2 + 1).clamp_(max=255)
        assert torch.equal(staged[key]["image"], expected), key
    assert streams and all(device.type == "cuda" for _, device in streams)
    assert all(stream != torch.cuda.default_stream(device) for stream, device in streams)
    await leaks.check(settle=2.0)


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
