"""The tone curves, sharpness and each op of RandAugment against torchvision itself, where it is
installed (the GPU machine has it; CI's machine does not, and skips this file).

Exact where both compute the same integers (posterize, solarize, invert, equalize, the whole-pixel
translations); within 1 level where torchvision truncates a float and we round it (autocontrast,
sharpness, brightness, colour, contrast) or samples bilinearly at a shifted point (shear, rotate);
within 2 for colour at AutoAugment's larger factors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headrace import ops
from headrace.ops.cpu import _post

F = pytest.importorskip("torchvision.transforms.v2.functional")
autoaugment = pytest.importorskip("torchvision.transforms.autoaugment")
InterpolationMode = pytest.importorskip("torchvision.transforms").InterpolationMode


def _image(rng, h, w, c, lo=0, hi=256, smooth=False):
    x = torch.from_numpy(rng.integers(lo, hi, (h, w, c), dtype=np.uint8))
    if smooth:  # bilinear against nearest differs less on a smooth image
        x = torch.nn.functional.avg_pool2d(x.permute(2, 0, 1)[None].float(), 5, 1, 2)[0].round().to(torch.uint8)
        x = x.permute(1, 2, 0).contiguous()
    return x


def _ours(x, op, u=None):
    return _post.apply(x, [op], [np.zeros((1, op.randoms)) if u is None else u])


def _theirs(x, fn, *args):
    return fn(x.permute(2, 0, 1).contiguous(), *args).permute(1, 2, 0)


def _worst(a, b):
    return int((a.int() - b.int()).abs().max())


CASES = [
    (lambda: ops.RandomPosterize(3, p=1.0), lambda x: _theirs(x, F.posterize, 3), 0),
    (lambda: ops.RandomSolarize(128.5, p=1.0), lambda x: _theirs(x, F.solarize, 128.5), 0),
    (lambda: ops.RandomInvert(p=1.0), lambda x: _theirs(x, F.invert), 0),
    (lambda: ops.RandomEqualize(p=1.0), lambda x: _theirs(x, F.equalize), 0),
    (lambda: ops.RandomAutocontrast(p=1.0), lambda x: _theirs(x, F.autocontrast), 1),
    (lambda: ops.RandomAdjustSharpness(2.0, p=1.0), lambda x: _theirs(x, F.adjust_sharpness, 2.0), 1),
    (lambda: ops.RandomAdjustSharpness(0.3, p=1.0), lambda x: _theirs(x, F.adjust_sharpness, 0.3), 1),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("channels", [3, 1])
@pytest.mark.parametrize("levels", [(0, 256), (40, 200), (100, 101), (0, 2)], ids=["full", "narrow", "flat", "two"])
def test_each_op_is_torchvisions(case, channels, levels):
    make, reference, bound = CASES[case]
    x = _image(np.random.default_rng(case), 37, 53, channels, *levels)
    assert _worst(_ours(x, make()), reference(x)) <= bound


NAMES = ["Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast",
         "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize"]
EXACT = {"Identity", "TranslateX", "TranslateY", "Posterize", "Solarize", "Equalize"}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("negative", [False, True])
def test_each_randaugment_op_is_torchvisions_apply_op(name, negative):
    x = _image(np.random.default_rng(2), 48, 64, 3, smooth=True)
    assert list(autoaugment.RandAugment()._augmentation_space(31, (48, 64))) == NAMES
    magnitudes, signed = autoaugment.RandAugment()._augmentation_space(31, (48, 64))[name]
    m = float(magnitudes[9]) if magnitudes.ndim > 0 else 0.0
    if signed and negative:
        m = -m
    u = np.array([[(NAMES.index(name) + 0.5) / len(NAMES), 0.75 if negative else 0.25]])
    ours = _ours(x, ops.RandAugment(num_ops=1, magnitude=9), u)
    theirs = autoaugment._apply_op(x.permute(2, 0, 1), name, m, interpolation=InterpolationMode.BILINEAR,
                                   fill=None).permute(1, 2, 0)
    assert _worst(ours, theirs) <= (0 if name in EXACT else 1)


@pytest.mark.parametrize("policy", ["imagenet", "cifar10", "svhn"])
def test_autoaugment_tables_and_each_step_are_torchvisions(policy):
    from headrace.ops import _auto_augment

    tv = autoaugment.AutoAugment(autoaugment.AutoAugmentPolicy(policy), interpolation=InterpolationMode.BILINEAR)
    assert [tuple(map(tuple, sub)) for sub in tv.policies] == list(_auto_augment._POLICIES[policy])
    space = tv._augmentation_space(10, (48, 64))
    assert list(space) == list(_auto_augment._AUTO_AUGMENT)
    x = _image(np.random.default_rng(3), 48, 64, 3, smooth=True)
    op = ops.AutoAugment(policy)
    # Op by op: torchvision's op on our previous output (a chain amplifies a level's difference
    # wherever a later solarize or equalize has a threshold).
    for k, sub in enumerate(tv.policies):
        for signs in ((0.25, 0.75), (0.75, 0.25)):
            current = x
            for i, (name, p, magnitude_bin) in enumerate(sub):
                draws = [2.0, 2.0]  # above any p: not applied
                draws[i] = 0.5 * p  # applied (rand <= p) for this op alone; p = 0 applies at 0 only
                ours = _ours(current, op, np.array([[(k + 0.5) / len(tv.policies), *draws, *signs]]))
                magnitudes, signed = space[name]
                m = float(magnitudes[magnitude_bin]) if magnitudes.ndim > 0 else 0.0
                if signed and signs[i] < 0.5:
                    m = -m
                theirs = autoaugment._apply_op(current.permute(2, 0, 1), name, m,
                                               interpolation=InterpolationMode.BILINEAR, fill=None).permute(1, 2, 0)
                # Colour at factors up to 1.9: torchvision blends with a gray it truncated, so a
                # level of gray becomes up to 0.9 levels more before the final rounding.
                bound = 0 if name in EXACT | {"Invert"} else 2 if name == "Color" else 1
                assert _worst(ours, theirs) <= bound, (policy, k, name)
                current = ours


@pytest.mark.parametrize("angle,translate,scale,shear", [(25.0, (3, -2), 1.0, (0.0, 0.0)), (-40.0, (0, 0), 1.3, (10.0, -5.0)),
                                                         (0.0, (0, 0), 0.8, (0.0, 20.0)), (170.0, (-4, 5), 0.9, (-12.0, 0.0))])
def test_random_affines_matrix_is_torchvisions_affine(angle, translate, scale, shear):
    # RandomAffine's matrix for one draw against F.affine with bilinear sampling, where the sample
    # point has its four neighbours inside the image: at the edge torchvision blends its fill with
    # a weight it applies twice (value x mask + fill x (1 - mask)), headrace once.
    from headrace.ops._random_affine import inverse_affine

    h, w, fill = 48, 64, [20, 90, 160]
    x = _image(np.random.default_rng(9), h, w, 3, smooth=True)
    theirs = _theirs(x, lambda img: F.affine(img, angle=angle, translate=list(translate), scale=scale, shear=list(shear),
                                             interpolation=InterpolationMode.BILINEAR, fill=fill))
    m = inverse_affine(*(np.array([v]) for v in (angle, *translate, scale, *shear)), np.array([h]), np.array([w]))[0]
    ours = _post.apply(x, [ops.WarpAffine(m.tolist(), fill=fill)], [None])
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    sx, sy = m[0, 0] * xs + m[0, 1] * ys + m[0, 2] - 0.5, m[1, 0] * xs + m[1, 1] * ys + m[1, 2] - 0.5
    inside = torch.from_numpy((sx >= 0.01) & (sx <= w - 1.01) & (sy >= 0.01) & (sy <= h - 1.01))
    assert inside.sum() > h * w // 4
    assert _worst(ours[inside], theirs[inside]) <= 1
