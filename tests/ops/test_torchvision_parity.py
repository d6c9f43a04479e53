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


AUGMIX_NAMES = ["ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Posterize", "Solarize", "AutoContrast",
                "Equalize", "Brightness", "Color", "Contrast", "Sharpness"]
_NO_MAGNITUDE = {"AutoContrast", "Equalize"}
_UNSIGNED = {"Posterize", "Solarize"} | _NO_MAGNITUDE


def _torchvision_augmix(x, op, u, monkeypatch):
    """torchvision's AugMix on HWC uint8 ``x`` with the draws our uniforms ``u`` (1, randoms) make:
    its ``torch.randint`` calls answered in its order (each chain's depth, then per op its index,
    bin and sign), its two Dirichlet draws our weights (its tests overwrite ``_sample_dirichlet`` too)."""
    tv = autoaugment.AugMix(severity=op.severity, mixture_width=op.mixture_width, chain_depth=op.chain_depth,
                            alpha=op.alpha, all_ops=op.all_ops, interpolation=InterpolationMode.BILINEAR)
    names = list(tv._augmentation_space(10, tuple(x.shape[:2])))
    assert names == (AUGMIX_NAMES if op.all_ops else AUGMIX_NAMES[:9])
    original, chains = op.weights(u)
    depth = op.chain_depth if op.chain_depth > 0 else 3
    per_chain = 1 + 3 * depth
    answers = []
    for i in range(op.mixture_width):
        row = u[0, i * per_chain : (i + 1) * per_chain]
        d = op.chain_depth if op.chain_depth > 0 else 1 + min(int(row[0] * 3), 2)
        if op.chain_depth <= 0:
            answers.append(d)
        for r in range(d):
            k = min(int(row[1 + 3 * r] * len(names)), len(names) - 1)
            answers.append(k)
            if names[k] not in _NO_MAGNITUDE:
                answers.append(min(int(row[2 + 3 * r] * op.severity), op.severity - 1))
            if names[k] not in _UNSIGNED:
                answers.append(int(row[3 + 3 * r] >= 0.5))
    dirichlets = [torch.tensor([[original[0], 1.0 - original[0]]], dtype=torch.float32),
                  torch.tensor(chains / chains.sum(axis=1, keepdims=True), dtype=torch.float32)]
    monkeypatch.setattr(tv, "_sample_dirichlet", lambda params: dirichlets.pop(0))
    monkeypatch.setattr(torch, "randint", lambda *a, **k: torch.tensor([answers.pop(0)]))
    out = tv(x.permute(2, 0, 1).contiguous()).permute(1, 2, 0)
    monkeypatch.undo()
    assert not answers and not dirichlets  # every draw torchvision made was one of ours, and no more
    return out


@pytest.mark.parametrize("seed", range(6))
def test_augmix_of_one_op_chains_without_warps_is_torchvisions(seed, monkeypatch):
    # Chains of one op each, the warps left out: each chain within a level of torchvision's (two for
    # colour), so the mix, which both truncate, within 3.
    op = ops.AugMix(severity=10, mixture_width=3, chain_depth=1)
    x = _image(np.random.default_rng(seed), 48, 64, 3, smooth=True)
    rng = np.random.default_rng(100 + seed)
    u = rng.random((1, op.randoms))
    for i in range(3):  # op uniforms into the last eight ops of the space: posterize onwards
        u[0, 4 * i + 1] = (5 + rng.random() * 8) / 13
    ours = _post.apply(x, [op], [u])
    theirs = _torchvision_augmix(x, op, u, monkeypatch)
    assert _worst(ours, theirs) <= 3


@pytest.mark.parametrize("make", [lambda: ops.AugMix(), lambda: ops.AugMix(severity=7, mixture_width=4, alpha=0.5)],
                         ids=["default", "wide"])
def test_augmix_is_torchvisions_on_average(make, monkeypatch):
    # Whole chains with warps: torchvision blends its fill at the image's edge with a weight it applies
    # twice (see RandomAffine above) and a level's difference can cross a later threshold, so compare
    # the mean and the share of large differences.
    op = make()
    diffs = []
    for seed in range(8):
        x = _image(np.random.default_rng(seed), 96, 128, 3, smooth=True)
        u = np.random.default_rng(200 + seed).random((1, op.randoms))
        ours = _post.apply(x, [op], [u])
        theirs = _torchvision_augmix(x, op, u, monkeypatch)
        diffs.append((ours.int() - theirs.int()).abs().float())
    d = torch.stack(diffs)
    print(f"AugMix against torchvision: mean {d.mean():.3f} levels, {(d > 3).float().mean():.2e} beyond 3")
    assert d.mean() < 0.5 and (d > 3).float().mean() < 0.02
