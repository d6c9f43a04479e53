"""The GPU path's geometry, checked on the CPU: resampling only the planned region of interest gives
the pixels of resampling the whole image (within one level at rounding ties)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from headrace import ConfigError
from headrace.ops import CenterCrop, Flip, RandomResizedCrop, Resize, uniforms
from headrace.ops._geometry import check_foldable, plan, roi
from headrace.ops._pillow import apply_image_ops

PIPELINES = [
    (RandomResizedCrop(24), Flip()),
    (Resize(40), CenterCrop(32)),
    (Resize((30, 50)),),
    (CenterCrop(16),),
    (Resize(20), CenterCrop(28)),  # crop larger than the image: zero padding
    (RandomResizedCrop((20, 30), scale=(0.5, 1.0)), CenterCrop(12), Flip(1.0)),
]


def _image(rng, h, w):
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))


@pytest.mark.parametrize("ops", PIPELINES, ids=lambda ops: "+".join(type(o).__name__ for o in ops))
def test_roi_resampling_equals_whole_image_resampling(ops):
    rng = np.random.default_rng(0)
    for i in range(25):
        h, w = int(rng.integers(20, 160)), int(rng.integers(20, 160))
        img = _image(rng, h, w)
        us = [uniforms(5, 0, k, np.array([i]), op.randoms)[0] if op.randoms else None for k, op in enumerate(ops, 1)]
        expected = np.asarray(apply_image_ops(img, ops, us))
        p = plan(h, w, ops, us)
        y0, x0, y1, x1 = roi(p, h, w)
        assert 0 <= x0 < x1 <= w and 0 <= y0 < y1 <= h
        bx0, by0, bx1, by1 = p.box
        inside = bx0 >= 0 and by0 >= 0 and bx1 <= w and by1 <= h
        if not inside:
            continue  # padding is zero-filled by the kernel, not by Pillow's resize
        region = img.crop((x0, y0, x1, y1))
        got = region.resize((p.out_w, p.out_h), Image.Resampling.BILINEAR, box=(bx0 - x0, by0 - y0, bx1 - x0, by1 - y0))
        got = np.asarray(got)
        if p.flip_h:
            got = got[:, ::-1]
        if p.flip_v:
            got = got[::-1]
        assert got.shape == expected.shape
        # Same filter taps, but Pillow rounds to uint8 between its two passes and orders the passes
        # by cost, which differs for a region: each result is within 1 of the exact resample.
        diff = np.abs(got.astype(int) - expected.astype(int))
        assert diff.max() <= 2 and diff.mean() < 0.5


def test_flip_before_a_crop_is_refused_on_the_gpu_path():
    check_foldable((RandomResizedCrop(8), Flip()))
    with pytest.raises(ConfigError):
        check_foldable((Flip(), CenterCrop(8)))


@pytest.mark.parametrize("ops", PIPELINES, ids=lambda ops: "+".join(type(o).__name__ for o in ops))
def test_vectorised_plan_equals_the_scalar_reference(ops):
    from headrace.ops._geometry import plan_batch, roi_batch

    rng = np.random.default_rng(7)
    n = 400
    h = rng.integers(1, 700, size=n)
    w = rng.integers(1, 700, size=n)
    h[:20], w[:20] = 1, rng.integers(300, 700, size=20)  # extreme aspect ratios reach the fallback
    us = [uniforms(1, 2, k, np.arange(n), op.randoms) if op.randoms else None for k, op in enumerate(ops, 1)]
    batch = plan_batch(h, w, ops, us)
    regions = roi_batch(batch, h, w)
    for i in range(n):
        p = plan(int(h[i]), int(w[i]), ops, [None if u is None else u[i] for u in us])
        assert tuple(batch.box[i]) == p.box and tuple(batch.clip[i]) == p.clip
        assert (batch.out_w, batch.out_h, bool(batch.flip_h[i]), bool(batch.flip_v[i])) == (p.out_w, p.out_h, p.flip_h, p.flip_v)
        assert tuple(regions[i]) == roi(p, int(h[i]), int(w[i]))
