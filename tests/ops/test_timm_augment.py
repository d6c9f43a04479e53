"""``ops.TimmRandAugment``: timm's config strings, its magnitude noise and per-layer probability,
its ops that torchvision's RandAugment lacks (solarize-add, the increasing posterize), on the CPU
path through a Loader over real JPEGs. (Each op against timm itself: test_timm_parity.py.)"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ops_refs import random_image
from sample_data import cropped_images, jpeg_items

from headrace import ConfigError, ops
from headrace.ops.cpu import _post

H, W = 40, 56


def _forced(op, slot: int, applied: float = 0.0, sign: float = 0.25) -> np.ndarray:
    """Uniforms for one layer: op ``slot``, drawn below p, positive sign, no magnitude noise."""
    return np.array([[(slot + 0.5) / len(op.ops), applied, sign, 0.0, 0.0]])


def test_the_config_string_is_read_as_timm_reads_it():
    deit = ops.TimmRandAugment("rand-m9-mstd0.5-inc1")
    assert (deit.magnitude, deit.num_layers, deit.prob, deit.magnitude_std, deit.increasing) == (9, 2, 0.5, 0.5, True)
    assert deit.randoms == 10 and deit.moves_pixels and deit.fill == (124.0, 116.0, 104.0)
    other = ops.TimmRandAugment("rand-n3-m5-p0.3-mmax12-inc0", fill=0)
    assert (other.magnitude, other.num_layers, other.prob, other.magnitude_max, other.increasing) == (5, 3, 0.3, 12, False)
    assert other.ops[4] == "Posterize" and deit.ops[4] == "PosterizeIncreasing"
    assert math.isinf(ops.TimmRandAugment("rand-m9-mstd101").magnitude_std)  # over 100: uniform
    assert ops.TimmRandAugment("rand").magnitude == 10  # timm's defaults: M10, two layers


@pytest.mark.parametrize("config", ["augmix-m3", "rand-x1", "rand-tfoo", "rand-t3b", "rand-w0-tweights", "rand-mfoo",
                                    "rand-p1.5", "rand-n-1", 7])
def test_configs_timm_would_refuse_are_config_errors(config):
    with pytest.raises(ConfigError, match="TimmRandAugment"):
        ops.TimmRandAugment(config)


def test_the_3_augment_sets():
    listed = ops.TimmRandAugment("rand-m9-t3a")
    assert listed.ops == ("SolarizeIncreasing", "Desaturate", "GaussianBlur") and listed.choice_weights is None
    weighted = ops.TimmRandAugment("rand-m9-mstd0.5-t3aw")
    assert weighted.ops[:3] == ("SolarizeIncreasing", "Desaturate", "GaussianBlur") and len(weighted.ops) == 14
    assert weighted.choice_weights[:4].tolist() == pytest.approx([6 / 33, 6 / 33, 6 / 33, 3 / 33])


@pytest.mark.parametrize("magnitude", [0, 3, 10])
def test_desaturate_and_the_blur_at_their_magnitudes(magnitude):
    # t3a's three ops, each forced: desaturate is the colour op at 1 - (0.5 + 0.5 m / 10) (gray at
    # m 10); the blur is PIL's Gaussian blur of radius 0.1 + 1.9 m / 10, a kernel summing to 1.
    from headrace.ops._passes import ColorMatrix, GaussianBlur, changed
    from headrace.ops._tone import GRAY_WEIGHTS

    op = ops.TimmRandAugment(f"rand-m{magnitude}-n1-p1.0-t3a")
    factor = min(1.0, max(0.0, 1.0 - (0.5 + 0.5 * magnitude / 10)))
    steps = op.steps(np.array([[1.5 / 3, 0.0, 0.25, 0.0, 0.0]]), np.array([30]), np.array([40]), 3)
    ((color, (matrices,)),) = [(p, t) for p, t in steps if changed(p, t)[0]]
    want = factor * np.eye(3) + (1 - factor) * np.asarray(GRAY_WEIGHTS)  # the blend with the gray image
    assert isinstance(color, ColorMatrix) and np.allclose(matrices[0, :, :3], want) and not matrices[0, :, 3].any()
    steps = op.steps(np.array([[2.5 / 3, 0.0, 0.25, 0.0, 0.0]]), np.array([30]), np.array([40]), 3)
    ((blur, (wx, wy)),) = [(p, t) for p, t in steps if changed(p, t)[0]]
    assert isinstance(blur, GaussianBlur) and np.allclose(wx.sum(), 1.0) and np.array_equal(wx, wy)
    radius = 0.1 + 1.9 * magnitude / 10
    variance = (wx[0] * (np.arange(wx.shape[1]) - wx.shape[1] // 2) ** 2).sum()
    assert variance == pytest.approx(radius**2, rel=1e-9)  # PIL's boxes keep the variance at radius squared


# timm's _RAND_CHOICE_WEIGHTS_0 over its plain op set, normalised (they sum to 1.0 already).
TIMM_W0 = {"AutoContrast": 0.025, "Equalize": 0.005, "Invert": 0.0, "Rotate": 0.3, "Posterize": 0.0, "Solarize": 0.005,
           "SolarizeAdd": 0.005, "Color": 0.025, "Contrast": 0.005, "Brightness": 0.005, "Sharpness": 0.025,
           "ShearX": 0.2, "ShearY": 0.2, "TranslateXRel": 0.1, "TranslateYRel": 0.1}


def test_w0_weighs_the_ops_as_timm_does_by_position_in_either_set():
    plain, increasing = ops.TimmRandAugment("rand-m9-w0"), ops.TimmRandAugment("rand-m9-mstd0.5-inc1-w0")
    assert plain.weighted and increasing.weighted and not ops.TimmRandAugment("rand-m9").weighted
    assert ops.TimmRandAugment("rand-m9").choice_weights is None
    want = np.array([TIMM_W0[name] for name in plain.ops])
    assert np.allclose(plain.choice_weights, want / want.sum())
    assert np.array_equal(increasing.choice_weights, plain.choice_weights)  # "PosterizeIncreasing" weighs as "Posterize"
    with pytest.raises(ConfigError, match="one set of op weights"):
        ops.TimmRandAugment("rand-m9-w1")
    with pytest.raises(ConfigError, match="13 above zero"):  # 14 different ops a sample, 13 weighed above zero
        ops.TimmRandAugment("rand-n14-w0")
    assert ops.TimmRandAugment("rand-n13-w0").num_layers == 13


def test_w0_draws_each_samples_ops_by_weight_and_without_replacement():
    # timm: np.random.choice(ops, n, replace=False, p=weights) per image. Against NumPy's own draw.
    op = ops.TimmRandAugment("rand-m9-n3-w0")
    u = np.random.default_rng(7).random((20000, 3, 5))
    first, second, third = op._indices(u)
    drawn = np.stack([first, second, third], axis=1)
    assert np.all((first != second) & (second != third) & (first != third))
    assert not np.isin(drawn, [op.ops.index("Invert"), op.ops.index("Posterize")]).any()
    rng = np.random.default_rng(8)
    numpy_draws = np.array([rng.choice(15, 3, replace=False, p=op.choice_weights) for _ in range(20000)])
    for layer in range(3):
        ours = np.bincount(drawn[:, layer], minlength=15) / len(drawn)
        theirs = np.bincount(numpy_draws[:, layer], minlength=15) / len(numpy_draws)
        assert np.abs(ours - theirs).max() < 0.02, layer  # a frequency of 0.3 varies by 0.003 at this many draws
    # Without w0, the same uniforms pick uniformly and with replacement, as before.
    uniform = ops.TimmRandAugment("rand-m9-n3")._indices(u)
    assert np.array_equal(uniform[0], np.minimum((u[:, 0, 0] * 15).astype(np.int64), 14))
    assert (uniform[0] == uniform[1]).mean() > 0.05


# Later timm's _RAND_WEIGHTED_0 (``tweights``): its own op order, every op weighted.
TIMM_TWEIGHTS = {"Rotate": 3, "ShearX": 2, "ShearY": 2, "TranslateXRel": 1, "TranslateYRel": 1, "ColorIncreasing": 0.25,
                 "SharpnessIncreasing": 0.25, "AutoContrast": 0.25, "SolarizeIncreasing": 0.05, "SolarizeAdd": 0.05,
                 "ContrastIncreasing": 0.05, "BrightnessIncreasing": 0.05, "Equalize": 0.05, "PosterizeIncreasing": 0.05,
                 "Invert": 0.05}


@pytest.mark.parametrize("config", ["rand-m9-tweights", "rand-m9-mstd0.5-inc1-tweights", "rand-m9-inc0-tweights"])
def test_tweights_draws_later_timms_weighted_set_whatever_inc_says(config):
    op = ops.TimmRandAugment(config)
    assert op.transforms == "weights" and not op.weighted
    assert op.ops == tuple(TIMM_TWEIGHTS)  # the set's own order: an op index counts in it
    want = np.array(list(TIMM_TWEIGHTS.values()))
    assert np.allclose(op.choice_weights, want / want.sum())
    u = np.random.default_rng(3).random((20000, 2, 5))
    first, second = op._indices(u)
    assert np.all(first != second)  # without replacement, as with w0
    share = np.bincount(first, minlength=15) / len(first)
    assert abs(share[op.ops.index("Rotate")] - 3 / want.sum()) < 0.015
    assert ops.TimmRandAugment("rand-n15-tweights").num_layers == 15  # every op weighs above zero
    with pytest.raises(ConfigError, match="15 above zero"):
        ops.TimmRandAugment("rand-n16-tweights")


def test_a_tweights_op_is_the_same_op_of_the_default_set():
    # The weighted set only reorders and weighs timm's ops: its Rotate (first, 3 of ~10.15 of the
    # weight, so a first uniform of 0.1 draws it) is the increasing set's Rotate (slot 3 of 15).
    a = random_image(np.random.default_rng(4), H, W, 3)
    x = torch.from_numpy(a)
    weighted, default = ops.TimmRandAugment("rand-m9-n1-tweights"), ops.TimmRandAugment("rand-m9-n1-inc1")
    u = np.array([[0.1, 0.0, 0.25, 0.0, 0.0]])
    assert weighted._indices(u[:, None])[0].tolist() == [weighted.ops.index("Rotate")]
    rotated = _post.apply(x, [weighted], [u]).numpy()
    assert np.array_equal(rotated, _post.apply(x, [default], [_forced(default, default.ops.index("Rotate"))]).numpy())
    assert not np.array_equal(rotated, a)


def test_the_magnitude_noise_is_gaussian_and_clipped():
    u = np.random.default_rng(1).random((20000, 2))
    noisy = ops.TimmRandAugment("rand-m5-mstd2").levels(u[:, 0], u[:, 1])
    assert abs(noisy.mean() - 5.0) < 0.05 and abs(noisy.std() - 2.0) < 0.05  # clipping at 0 and 10 is 1% of draws
    assert noisy.min() >= 0.0 and noisy.max() <= 10.0
    clipped = ops.TimmRandAugment("rand-m9-mstd3").levels(u[:, 0], u[:, 1])
    assert clipped.max() == 10.0 and (clipped == 10.0).mean() > 0.3
    uniform = ops.TimmRandAugment("rand-m8-mstd200").levels(u[:, 0], u[:, 1])
    assert uniform.min() >= 0 and uniform.max() <= 8 and abs(uniform.mean() - 4.0) < 0.1
    assert np.all(ops.TimmRandAugment("rand-m7").levels(u[:, 0], u[:, 1]) == 7.0)


def test_solarize_add_and_the_increasing_posterize():
    a = random_image(np.random.default_rng(2), H, W, 3)
    x = torch.from_numpy(a)
    op = ops.TimmRandAugment("rand-m10-n1-inc1")
    add = _post.apply(x, [op], [_forced(op, op.ops.index("SolarizeAdd"))]).numpy()
    v = a.astype(int)
    assert np.array_equal(add, np.where(v < 128, np.minimum(v + 110, 255), v).astype(np.uint8))  # min(128, int(110))
    op9 = ops.TimmRandAugment("rand-m9-n1-inc1")
    posterized = _post.apply(x, [op9], [_forced(op9, op9.ops.index("PosterizeIncreasing"))]).numpy()
    assert np.array_equal(posterized, a & 0x80)  # 4 - int(3.6) = 1 bit


def test_a_layer_applies_its_op_only_below_p_and_translates_by_a_share_of_the_side():
    a = random_image(np.random.default_rng(3), H, W, 3)
    x = torch.from_numpy(a)
    op = ops.TimmRandAugment("rand-m10-n1-p0.4", fill=(1, 2, 3))
    slot = op.ops.index("TranslateXRel")
    assert op.steps(_forced(op, slot, applied=0.41), np.array([H]), np.array([W]), 3) == []
    moved = _post.apply(x, [op], [_forced(op, slot, applied=0.39)]).numpy()
    # 0.45 W = 25.2 input pixels: the content moves left, the right edge reads fill.
    assert np.array_equal(moved[:, -1], np.broadcast_to(np.array([1, 2, 3], np.uint8), (H, 3)))
    expected = 0.8 * a[:, 25].astype(float) + 0.2 * a[:, 26]  # column 0 reads 0.5 + 25.2 - 0.5 = 25.2
    assert np.abs(moved[:, 0].astype(float) - expected).max() <= 1.0


async def _loaded(*post, seed: int = 5) -> list[torch.Tensor]:
    return list((await cropped_images(jpeg_items(48, 71, 40, 44), *post, size=32, seed=seed, shuffle=False)).values())


async def test_through_the_loader_seeded():
    plain = await _loaded()
    first, second, other = (await _loaded(ops.TimmRandAugment()), await _loaded(ops.TimmRandAugment()),
                            await _loaded(ops.TimmRandAugment(), seed=6))
    assert all(image.shape == (32, 32, 3) and image.dtype == torch.uint8 for image in first)
    assert all(torch.equal(p, q) for p, q in zip(first, second))
    assert sum(not torch.equal(p, q) for p, q in zip(first, other)) > 24
    # Two layers at p = 0.5: a quarter of the samples draw neither and come out as they went in.
    untouched = sum(torch.equal(p, q) for p, q in zip(first, plain))
    assert 3 <= untouched <= 24


def test_boxes_refuse_it():
    with pytest.raises(ConfigError, match="moves pixels"):
        ops.Pipeline([ops.Decode(), ops.Resize(64), ops.TimmRandAugment()], label=None, boxes="boxes")


def test_training_takes_timms_auto_augment_string_or_a_policy():
    pipe = ops.training(224, auto_augment="rand-m9-mstd0.5-inc1")
    (policy,) = pipe.post_ops
    assert isinstance(policy, ops.TimmRandAugment) and policy.config == "rand-m9-mstd0.5-inc1"
    assert policy.fill == (124.0, 116.0, 104.0)  # timm's img_mean from the mean
    assert [type(op).__name__ for op in pipe.ops] == ["Decode", "RandomResizedCrop", "Flip", "TimmRandAugment", "Normalize"]
    gray = ops.training(32, auto_augment="rand-m5", mean=(0.5,), std=(0.25,))
    assert gray.post_ops[0].fill == (128.0,)
    assert ops.training(32, auto_augment=ops.AutoAugment()).post_ops == (ops.AutoAugment(),)
    assert ops.training(32).post_ops == ()
    assert isinstance(ops.training(32, auto_augment="v0").post_ops[0], ops.TimmAutoAugment)  # timm's other strings
    with pytest.raises(ConfigError, match="auto_augment"):
        ops.training(32, auto_augment=3)
