"""The GPU path plans a batch (random draws, crop windows, regions, kernel tables) in one prep thread
for all the lanes. NumPy gives up the GIL for loops over 500 elements, and each time the prep thread
then waited to take it back behind the other threads (15-20 ms a batch over S3 on the H100), so the
planning works on small arrays (``ops/_gil.py``). These tests check that it still computes exactly
what the whole-array formulas give; ``examples/benchmark_prep_handoffs.py`` counts the hand-offs."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from headrace import ops
from headrace.ops import RandomResizedCrop, uniforms
from headrace.ops._geometry import plan_batch, roi_batch
from headrace.ops._gil import columns
from headrace.ops._random import _GOLDEN, _key, _mix, _uniforms_numpy
from headrace.ops.cuda._prep import kernel_tables


def _uniforms_whole(seed: int, epoch: int, op: int, indices: np.ndarray, count: int) -> np.ndarray:
    """The splitmix64 draws as one whole-array expression (the formula before the blocks)."""
    idx = np.asarray(indices, dtype=np.int64).astype(np.uint64).reshape(-1, 1)
    with np.errstate(over="ignore"):
        base = _mix(idx * _GOLDEN + _key(seed, epoch, op))
        bits = _mix(base + np.arange(1, count + 1, dtype=np.uint64).reshape(1, -1) * _GOLDEN)
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


@pytest.mark.parametrize("how", [uniforms, _uniforms_numpy], ids=["c-helper", "numpy-blocks"])
@pytest.mark.parametrize("n", [0, 1, 22, 23, 256, 501, 1300])
@pytest.mark.parametrize("count", [1, 4, 22, 30])
def test_uniforms_in_blocks_equal_the_whole_array_formula(n, count, how):
    indices = np.random.default_rng(n * 31 + count).integers(0, 2**62, n)
    got = how(5, 3, 2, indices, count)
    assert got.shape == (n, count)
    assert np.array_equal(got, _uniforms_whole(5, 3, 2, indices, count))


@pytest.mark.parametrize("n", [1, 37, 256, 700])
def test_batch_crop_windows_equal_the_per_sample_crop(n):
    """plan_batch's RandomResizedCrop (its ten tries a row at a time) against the CPU path's
    per-sample ``window``, including images too narrow or too small for any try (the fallback)."""
    rng = np.random.default_rng(n)
    h = rng.integers(1, 2000, n)
    w = rng.integers(1, 2000, n)
    h[::7] = rng.integers(1, 4, len(h[::7]))  # tiny or extreme shapes: few tries fit
    w[::5] = w[::5] * 40
    op = RandomResizedCrop(64, scale=(0.5, 1.0), ratio=(0.5, 2.0))
    u = uniforms(0, 1, 1, np.arange(n), op.randoms)
    plans = plan_batch(h, w, (op,), [u])
    for i in range(n):
        top, left, ch, cw = op.window(int(h[i]), int(w[i]), u[i].tolist())
        assert plans.box[i].tolist() == [left, top, left + cw, top + ch], i


def test_columns_and_kernel_tables_equal_the_whole_array_forms():
    rng = np.random.default_rng(7)
    n = 300
    h, w = rng.integers(10, 3000, n), rng.integers(10, 3000, n)
    pipe = ops.training(224).image_ops
    randoms = [uniforms(0, 0, pos, np.arange(n), op.randoms) if op.randoms else None for pos, op in enumerate(pipe, 1)]
    plans = plan_batch(h, w, pipe, randoms)
    regions = roi_batch(plans, h, w, np.int32)
    assert np.array_equal(regions, roi_batch(plans, h, w).astype(np.int32))
    meta, geo = kernel_tables(plans, regions)
    origin = np.tile(regions[:, [1, 0]], 2).astype(np.float64)
    assert np.array_equal(geo, np.concatenate([plans.box - origin, plans.clip - origin], 1).astype(np.float32))
    assert np.array_equal(meta[:, 0], regions[:, 2] - regions[:, 0])
    assert np.array_equal(meta[:, 3:7], np.stack([plans.flip_h, plans.flip_v, plans.out_h, plans.out_w], 1))
    assert not meta[:, [2, 7]].any()
    cols = [rng.random(n) for _ in range(4)]
    assert np.array_equal(columns(cols, np.float32), np.stack(cols, 1).astype(np.float32))


def test_the_prep_thread_plans_a_batch_as_the_whole_array_forms_do():
    """All of ``prepare`` past the header parse (one GIL-free call into the shim, stood in for here):
    the checks of each sample, the size limits, the draws, the plans and the kernel's tables."""
    from headrace._sample import Sample, SampleBatch
    from headrace.ops.cuda._prep import prepare

    n = 256
    rng = np.random.default_rng(5)
    heights, widths = rng.integers(100, 1000, n), rng.integers(100, 1000, n)
    blob = b"\xff\xd8" + bytes(200_000) + b"\xff\xd9"  # a JPEG's first and last markers, long enough for its size
    batch = SampleBatch([Sample(f"k{i}", {"jpg": blob, "cls": b"3"}, "src", i, i) for i in range(n)], 0, 0)

    class Headers:  # what the shim's parse gives: (height, width, channels, parsed) a row
        def parse(self, data):
            info = np.empty((len(data), 4), dtype=np.int32)
            info[:, 0], info[:, 1], info[:, 2], info[:, 3] = heights, widths, 3, 1
            return None, info

        def recycle(self, token):
            pass

    pipe = ops.training(224)
    prepared = prepare(batch, pipe, Headers(), 0, collections.Counter())
    assert not prepared.failures and len(prepared.rows) == n and prepared.on_gpu.all()
    randoms = [_uniforms_whole(0, 0, pos, np.arange(n), op.randoms) if op.randoms else None
               for pos, op in enumerate(pipe.image_ops, 1)]
    assert np.array_equal(prepared.regions, roi_batch(plan_batch(heights, widths, pipe.image_ops, randoms), heights, widths))
