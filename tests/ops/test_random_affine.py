"""``ops.RandomAffine``: torchvision's draws and matrix, its parts checked one by one against what
each transform means (rotation, whole-pixel translation, scale about the centre, x and y shear),
its pixels against the float64 bilinear reference, and through a CPU Loader over real JPEGs.
(Against torchvision's own ``affine``: test_torchvision_parity.py; on the GPU:
tests/gpu/test_gpu_post_ops.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ops_refs import random_image, ref_warp
from sample_data import cropped_images, jpeg_items

from headrace import ConfigError, ops
from headrace.ops._post_spec import rotation_affine
from headrace.ops._random_affine import inverse_affine
from headrace.ops.cpu import _post

H, W = np.array([40]), np.array([60])


def _one(**draws) -> np.ndarray:
    """The (2, 3) matrix of one draw on the H x W image; parameters left out at their identity."""
    p = {"angle": 0.0, "tx": 0.0, "ty": 0.0, "scale": 1.0, "shear_x": 0.0, "shear_y": 0.0, **draws}
    return inverse_affine(*(np.array([p[k]]) for k in ("angle", "tx", "ty", "scale", "shear_x", "shear_y")), H, W)[0]


def _maps(m: np.ndarray, x: float, y: float) -> tuple[float, float]:
    return tuple(m @ np.array([x, y, 1.0]))


def test_the_angle_turns_clockwise_as_torchvisions_affine():
    # Rotate (torchvision's rotate) turns counter-clockwise: the same angle is Rotate's negative.
    for angle in (-33.0, 12.5, 90.0):
        np.testing.assert_allclose(_one(angle=angle), rotation_affine(np.array([-angle]), H, W)[0], atol=1e-12)


def test_translation_moves_the_content_by_whole_pixels():
    m = _one(tx=5.0, ty=-3.0)
    assert _maps(m, 10.5, 20.5) == pytest.approx((5.5, 23.5))  # output (10, 20) shows input (5, 23)


def test_scale_is_about_the_centre():
    m = _one(scale=2.0)
    assert _maps(m, 30.0, 20.0) == pytest.approx((30.0, 20.0))
    assert _maps(m, 50.0, 30.0) == pytest.approx((40.0, 25.0))  # twice as far out shows half as far


def test_x_and_y_shear_slide_rows_and_columns_about_the_centre():
    t = math.tan(math.radians(20.0))
    assert _maps(_one(shear_x=20.0), 30.0, 30.0) == pytest.approx((30.0 + t * 10.0, 30.0))
    assert _maps(_one(shear_y=20.0), 40.0, 20.0) == pytest.approx((40.0, 20.0 + t * 10.0))


def test_the_draws_follow_torchvisions_ranges_and_rounding():
    op = ops.RandomAffine(15, translate=(0.1, 0.25), scale=(0.8, 1.2), shear=(-4, 6, -2, 3))
    u = np.random.default_rng(0).random((5000, 6))
    p = op.params(u, np.full(5000, 40), np.full(5000, 60))
    assert p[:, 0].min() >= -15 and p[:, 0].max() <= 15
    assert np.array_equal(p[:, 1], np.round(p[:, 1])) and np.abs(p[:, 1]).max() == 6  # 0.1 * 60
    assert np.array_equal(p[:, 2], np.round(p[:, 2])) and np.abs(p[:, 2]).max() == 10  # 0.25 * 40
    assert 0.8 <= p[:, 3].min() and p[:, 3].max() <= 1.2
    assert -4 <= p[:, 4].min() and p[:, 4].max() <= 6 and -2 <= p[:, 5].min() and p[:, 5].max() <= 3
    assert op.params(np.full((1, 6), 0.5), H, W).tolist() == [[0.0, 0.0, 0.0, 1.0, 1.0, 0.5]]
    plain = ops.RandomAffine(10).params(u[:3], H.repeat(3), W.repeat(3))
    assert (plain[:, 1:3] == 0).all() and (plain[:, 3] == 1).all() and (plain[:, 4:] == 0).all()
    assert ops.RandomAffine(0, shear=7).shear == (-7.0, 7.0, 0.0, 0.0)  # one number: an x shear
    assert ops.RandomAffine(0, shear=(1, 2)).shear == (1.0, 2.0, 0.0, 0.0)


@pytest.mark.parametrize("kwargs", [{"degrees": -1}, {"degrees": (5, 1)}, {"degrees": 0, "translate": (1.5, 0)},
                                    {"degrees": 0, "translate": 0.1}, {"degrees": 0, "scale": (0, 1)},
                                    {"degrees": 0, "scale": (1.2, 1.0)}, {"degrees": 0, "shear": (-5,)},
                                    {"degrees": 0, "shear": (5, -5)}, {"degrees": 0, "shear": -3},
                                    {"degrees": 0, "shear": "x"}, {"degrees": 0, "fill": 300}])
def test_bad_arguments_are_config_errors(kwargs):
    with pytest.raises(ConfigError, match="RandomAffine"):
        ops.RandomAffine(**kwargs)


@pytest.mark.parametrize("channels", [3, 1])
def test_pixels_match_the_float64_bilinear(channels):
    rng = np.random.default_rng(1)
    op = ops.RandomAffine(40, translate=(0.2, 0.2), scale=(0.7, 1.3), shear=(-15, 15, -10, 10),
                          fill=(10, 200, 30)[:channels])
    for h, w in [(1, 1), (2, 9), (37, 53), (64, 48)]:
        a = random_image(rng, h, w, channels)
        u = rng.random((1, 6))
        got = _post.apply(torch.from_numpy(a), (op,), [u]).numpy().astype(np.float64)
        ref = ref_warp(a, op.affine(u, np.array([h]), np.array([w]))[0], op.fill)
        assert np.abs(got - ref).max() <= 1


def test_a_whole_pixel_translation_is_exact():
    rng = np.random.default_rng(2)
    a = random_image(rng, 30, 40, 3)
    op = ops.RandomAffine(0, translate=(0.2, 0.2), fill=7)
    u = np.array([[0.0, 0.9, 0.2, 0.0, 0.0, 0.0]])
    _, tx, ty, *_ = op.params(u, np.array([30]), np.array([40]))[0]
    tx, ty = int(tx), int(ty)
    assert (tx, ty) == (6, -4)  # round(8 * 0.8), round(6 * -0.6)
    got = _post.apply(torch.from_numpy(a), (op,), [u]).numpy()
    want = np.full_like(a, 7)
    want[max(ty, 0):30 + min(ty, 0), max(tx, 0):40 + min(tx, 0)] = a[max(-ty, 0):30 - max(ty, 0), max(-tx, 0):40 - max(tx, 0)]
    assert np.array_equal(got, want)


async def test_through_the_loader_seeded_and_repeatable():
    items = jpeg_items(32, 71, 40, 44)
    op = ops.RandomAffine(20, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=5, fill=(124, 116, 104))
    first, second = await cropped_images(items, op, size=32), await cropped_images(items, op, size=32)
    other = await cropped_images(items, op, size=32, seed=6)
    plain = await cropped_images(items, size=32)
    assert first.keys() == plain.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert sum(not torch.equal(first[k], other[k]) for k in first) > 24
    assert sum(not torch.equal(first[k], plain[k]) for k in first) > 24


def test_boxes_refuse_it():
    with pytest.raises(ConfigError, match="moves pixels"):
        ops.Pipeline([ops.Decode(), ops.RandomAffine(10)], label=None, boxes="boxes")
