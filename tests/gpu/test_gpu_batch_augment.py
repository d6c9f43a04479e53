"""MixUp and CutMix on the GPU path: they run in the lane, on its stream, and mix the GPU batch as
the CPU path's stage mixes its own (the same weights and boxes, from the same stage ``rng``); a
label out of range gives a NaN row, not a device-side assert, and the loader goes on."""

from __future__ import annotations

import math
import threading

import numpy as np
import torch
from sample_data import jpeg_bytes

from headrace import Loader, ops, readers
from headrace.ops._batch_stages import stage_rng

N, B, K, SEED = 48, 16, 5, 3


def _items() -> list[dict]:
    rng = np.random.default_rng(8)
    return [{"__key__": f"s{i:03d}", "jpg": jpeg_bytes(rng, 60 + i % 9, 80 + i % 5), "cls": i % K} for i in range(N)]


def _pipeline(*stages) -> ops.Pipeline:
    return ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(32), ops.Flip(), ops.Normalize(dtype="float16"), *stages])


async def _batches(pipeline: ops.Pipeline, items=None) -> list:
    loader = Loader(readers.sequence(items or _items(), shuffle=True, seed=2), batch_size=B, pipeline=pipeline,
                    device="cuda", seed=SEED)
    async with loader:
        return [[b async for b in loader] for _ in range(2)]


def _one_hot(labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(labels.cpu(), K).float()


async def test_mixup_and_cutmix_mix_the_gpu_batch_in_the_lane(leaks):
    threads: list[str] = []

    def where(batch: dict) -> dict:
        threads.append(threading.current_thread().name)
        assert torch.cuda.current_stream() != torch.cuda.default_stream()
        return batch

    mix, cut = ops.MixUp(0.4, num_classes=K), ops.CutMix(1.0, num_classes=K)
    plain = await _batches(_pipeline())
    mixed = await _batches(_pipeline(ops.MapBatch(where), mix, cut))
    positions = [_pipeline(ops.MapBatch(where), mix, cut).stage_position(s) for s in (mix, cut)]
    for epoch in range(2):
        for a, b in zip(plain[epoch], mixed[epoch], strict=True):
            assert a.sample_keys == b.sample_keys and b["image"].is_cuda and b["label"].is_cuda
            x = a["image"].float().cpu()
            rng = stage_rng(SEED, epoch, positions[0], a.index)
            rng.random()
            lam = float(rng.beta(0.4, 0.4))
            x = lam * x + (1 - lam) * x.roll(1, 0)
            soft = _one_hot(a["label"])
            soft = lam * soft + (1 - lam) * soft.roll(1, 0)
            rng = stage_rng(SEED, epoch, positions[1], a.index)
            rng.random()
            lam = float(rng.beta(1.0, 1.0))
            cx, cy = (int(v * 32) for v in rng.random(2))
            half = int(0.5 * math.sqrt(1 - lam) * 32)
            x0, x1, y0, y1 = max(cx - half, 0), min(cx + half, 32), max(cy - half, 0), min(cy + half, 32)
            x[:, :, y0:y1, x0:x1] = x[:, :, y0:y1, x0:x1].roll(1, 0).clone()
            kept = 1 - (x1 - x0) * (y1 - y0) / 32**2
            soft = kept * soft + (1 - kept) * soft.roll(1, 0)
            torch.testing.assert_close(b["image"].float().cpu(), x, atol=2e-2, rtol=1e-2)  # float16 rounding
            torch.testing.assert_close(b["label"].cpu(), soft)
    assert threads and all(name.startswith("headrace-lane") for name in threads), set(threads)
    await leaks.check(settle=2.0)


async def test_a_label_out_of_range_gives_a_nan_row_on_the_gpu_and_the_loader_goes_on(leaks):
    items = _items()
    items[5]["cls"] = K + 3
    batches = await _batches(_pipeline(ops.MixUp(num_classes=K)), items)
    for epoch in batches:
        labels = torch.cat([b["label"] for b in epoch]).cpu()
        keys = [k for b in epoch for k in b.sample_keys]
        nan_rows = {keys[i] for i in torch.isnan(labels).any(1).nonzero()[:, 0].tolist()}
        assert "s005" in nan_rows and len(nan_rows) == 2  # its row, and the row it was mixed into
        assert len(keys) == N
    torch.cuda.synchronize()  # no sticky CUDA error
    await leaks.check(settle=2.0)


async def test_random_erasing_erases_the_cpu_paths_boxes_on_the_gpu(leaks):
    erase = ops.RandomErasing(p=0.5, value=(0.5, -1.0, 2.0))
    plain = await _batches(_pipeline())
    erased = await _batches(_pipeline(erase))
    position = _pipeline(erase).stage_position(erase)
    hits = 0
    for epoch in range(2):
        for a, b in zip(plain[epoch], erased[epoch], strict=True):
            boxes = erase.boxes(stage_rng(SEED, epoch, position, a.index), len(a.sample_keys), 32, 32)
            expected = a["image"].clone()
            for row, (y0, x0, y1, x1) in enumerate(boxes.tolist()):
                expected[row, :, y0:y1, x0:x1] = torch.tensor([0.5, -1.0, 2.0], device="cuda").view(3, 1, 1)
                hits += y1 > y0
            assert torch.equal(b["image"], expected)
    assert hits > 10
    noisy = [await _batches(_pipeline(ops.RandomErasing(p=1.0, value="random"))) for _ in range(2)]
    for x, y in zip(noisy[0][1], noisy[1][1], strict=True):
        assert torch.equal(x["image"], y["image"])  # the same noise with the same seed
    await leaks.check(settle=2.0)
