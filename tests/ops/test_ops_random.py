"""Per-sample random parameters: a pure function of (seed, epoch, op, sample index), so the same
seed gives the same batch whatever the batch size, chunking or thread count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ops_refs import batch, encode, random_image, sample

from headrace.ops import training, uniforms


def test_uniforms_shape_range_and_keys():
    u = uniforms(0, 0, 1, np.arange(1000), 22)
    assert u.shape == (1000, 22) and u.dtype == np.float64
    assert (u >= 0).all() and (u < 1).all()
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    # A row depends only on its own index, not on its neighbours or its position in the array.
    np.testing.assert_array_equal(uniforms(0, 0, 1, np.array([999, 5, 42]), 22), u[[999, 5, 42]])
    # Fewer numbers per sample are a prefix of more.
    np.testing.assert_array_equal(uniforms(0, 0, 1, np.arange(1000), 3), u[:, :3])
    for other in (uniforms(1, 0, 1, np.arange(1000), 22), uniforms(0, 1, 1, np.arange(1000), 22), uniforms(0, 0, 2, np.arange(1000), 22)):
        assert np.intersect1d(other, u).size == 0  # seed, epoch and op each give fresh numbers
    np.testing.assert_array_equal(uniforms(0, 0, 1, np.arange(1000), 22), u)


def test_uniforms_big_keys():
    u = uniforms(2**63 + 5, 2**40, 7, np.array([0, 2**62]), 4)
    assert u.shape == (2, 4) and (u >= 0).all() and (u < 1).all()


def test_the_c_helper_and_numpy_give_the_same_bits():
    # The C helper (ops/_native/uniforms.c) where a compiler is, NumPy's blocks where not: the
    # same numbers, so a sample's draws do not depend on the machine. Negative and huge indices
    # and keys, skipped numbers (first), and a request large enough to let the GIL go.
    from headrace import _native
    from headrace.ops import _random

    if _random._helper() is None:
        reason = _native.build("uniforms", _random._SOURCE)[1]
        pytest.skip(f"no C helper here: {reason}")
    rng = np.random.default_rng(3)
    for _ in range(50):
        n, count, first = int(rng.integers(0, 300)), int(rng.integers(0, 40)), int(rng.integers(0, 6))
        idx = rng.integers(-2**62, 2**62, n)
        seed, epoch, op = (int(v) for v in rng.integers(-2**62, 2**62, 3))
        got = uniforms(seed, epoch, op, idx, count, first=first)
        assert got.shape == (n, count)
        assert np.array_equal(got, _random._uniforms_numpy(seed, epoch, op, idx, count, first=first))
    big = np.arange(3000) * 7 - 100  # 3000 x 40 numbers: over _HELD, the call lets the GIL go
    assert big.size * 40 > _random._HELD
    assert np.array_equal(uniforms(1, 2, 3, big, 40), _random._uniforms_numpy(1, 2, 3, big, 40))


def make_samples(rng, n=24):
    arrays = [random_image(rng, *rng.integers(30, 120, 2)) for _ in range(n)]
    # Indices far from 0..n-1: the stable data-set index, not the row, keys the randoms.
    return [sample(1000 + 37 * i, encode(a)) for i, a in enumerate(arrays)]


async def run_split(make_executor, samples, splits, *, num_threads, seed, epoch=3):
    """Run the samples in consecutive batches of the given sizes; images by sample key."""
    executor = make_executor(training(24, flip=0.5), num_threads=num_threads, seed=seed)
    images: dict[str, torch.Tensor] = {}
    start = 0
    for b, size in enumerate(splits):
        part = samples[start : start + size]
        out = await executor.run(batch(part, epoch, b))
        assert not out.failures
        images.update({s.key: img for s, img in zip(part, out.data["image"])})
        start += size
    assert start == len(samples)
    return images


async def test_same_params_for_any_batching_and_threads(make_executor, rng):
    samples = make_samples(rng)
    reference = await run_split(make_executor, samples, [24], num_threads=1, seed=7)
    for threads, splits in ((3, [24]), (3, [5, 7, 12]), (1, [1] * 24), (2, [13, 11])):
        got = await run_split(make_executor, samples, splits, num_threads=threads, seed=7)
        for key, img in reference.items():
            assert torch.equal(got[key], img), (threads, splits, key)
    # Order within a batch does not matter either.
    shuffled = [samples[i] for i in rng.permutation(len(samples))]
    got = await run_split(make_executor, shuffled, [24], num_threads=2, seed=7)
    assert all(torch.equal(got[k], v) for k, v in reference.items())


async def test_seed_and_epoch_change_the_batch(make_executor, rng):
    samples = make_samples(rng, 12)
    a = await run_split(make_executor, samples, [12], num_threads=2, seed=7)
    b = await run_split(make_executor, samples, [12], num_threads=2, seed=7)
    c = await run_split(make_executor, samples, [12], num_threads=2, seed=8)
    d = await run_split(make_executor, samples, [12], num_threads=2, seed=7, epoch=4)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert sum(not torch.equal(a[k], c[k]) for k in a) >= 10
    assert sum(not torch.equal(a[k], d[k]) for k in a) >= 10
