"""``Pipeline(splits=)`` on the GPU path, against the CPU path and against itself, on real CUDA.

PNGs, so both paths decode the same pixels: the geometry then differs by up to 2 levels between
the paths (test_gpu_pipeline.py), which the policy's tone curves can carry further, so the views
are compared by their mean difference, as the AugMix tests in test_gpu_post_ops.py are. On the GPU
path itself: view 0 is the pipeline without its policy and view 1 the pipeline without splits, to
the byte (uint8 output: the fused kernel writes the same bytes either way); the runs repeat.
"""

from __future__ import annotations

import io

from gpu_data import class_folders
import numpy as np
import pytest
import torch
from PIL import Image

from headrace import Loader, ops, readers

POLICY = "augmix-m5-w4-d2"


def _png(rng, h, w) -> bytes:
    yy, xx = np.mgrid[0:h, 0:w]
    smooth = 127 + 110 * np.sin(xx[..., None] / w * 7 + yy[..., None] / h * 5 + rng.uniform(0, 6.3, size=3))
    pixels = np.clip(smooth + rng.normal(0, 35, size=(h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path):
    return class_folders(tmp_path, np.random.default_rng(21), 2, 24, _png, "png", 60, 300)


async def _images(folder, pipeline, device, **kwargs):
    async with Loader(readers.files(folder), batch_size=16, pipeline=pipeline, device=device, seed=4, **kwargs) as loader:
        batches = [b async for b in loader]
    for b in batches:
        assert b["image"].transpose(0, 1).is_contiguous() == (b["image"].dim() == 5)
        assert (b["image"].device.type == "cuda") == (device == "cuda")
    return torch.cat([b["image"].cpu() for b in batches])


def _hwc(post=(), **kwargs):
    return ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(64), ops.Flip(), *post], layout="HWC", **kwargs)


async def test_views_on_the_gpu_repeat_and_are_the_views_of_the_pipeline_without_splits(folder):
    split = _hwc([ops.TimmAugMix(POLICY)], splits=3)
    first = await _images(folder, split, "cuda")
    again = await _images(folder, split, "cuda")
    assert first.shape == (48, 3, 64, 64, 3) and first.dtype == torch.uint8
    assert torch.equal(first, again)
    assert torch.equal(first[:, 0], await _images(folder, _hwc(), "cuda"))
    assert torch.equal(first[:, 1], await _images(folder, _hwc([ops.TimmAugMix(POLICY)]), "cuda"))
    assert sum(not torch.equal(a, b) for a, b in zip(first[:, 2], first[:, 1])) >= 40


async def test_views_on_the_gpu_are_near_the_cpus(folder):
    split = _hwc([ops.TimmAugMix(POLICY)], splits=3)
    gpu = (await _images(folder, split, "cuda")).float()
    cpu = (await _images(folder, split, "cpu")).float()
    diff = (gpu - cpu).abs()
    print("views GPU vs CPU, mean levels:", [round(float(diff[:, v].mean()), 3) for v in range(3)])
    assert diff[:, 0].max() <= 2 and all(diff[:, v].mean() < 1.0 for v in range(3))


async def test_normalized_views_with_random_erasing_on_the_gpu(folder):
    # float16 CHW, the training pipeline's output; RandomErasing (in the lane) leaves view 0 alone.
    plain = ops.training(64, auto_augment=POLICY, dtype="float16", splits=3)
    erased = ops.Pipeline([*plain.ops, ops.RandomErasing(p=1.0)], splits=3)
    before = await _images(folder, plain, "cuda")
    after = await _images(folder, erased, "cuda")
    cpu = await _images(folder, erased, "cpu")
    assert before.shape == after.shape == cpu.shape == (48, 3, 3, 64, 64) and after.dtype == torch.float16
    assert torch.equal(after[:, 0], before[:, 0])
    assert sum(not torch.equal(a, b) for a, b in zip(after[:, 1:], before[:, 1:])) >= 40
    erased_gpu, erased_cpu = after[:, 1:] == 0, cpu[:, 1:] == 0  # the same boxes on both paths
    assert (erased_gpu ^ erased_cpu).float().mean() < 0.01


async def test_a_failed_sample_on_the_gpu_leaves_the_others_views(folder):
    # A PNG cut short after its header: Pillow fails it in the prep thread, so the lane lays the
    # views' passes out itself (the plans made ahead cover the whole batch).
    bad = folder / "c0" / "005.png"
    bad.write_bytes(bad.read_bytes()[:400])
    split = _hwc([ops.TimmAugMix(POLICY)], splits=2)
    gpu = (await _images(folder, split, "cuda", on_error="skip", max_errors=0.5)).float()
    cpu = (await _images(folder, split, "cpu", on_error="skip", max_errors=0.5)).float()
    assert gpu.shape == cpu.shape == (47, 2, 64, 64, 3)
    assert (gpu - cpu).abs().mean() < 1.0
