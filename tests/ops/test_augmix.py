"""AugMix on the CPU path, and its passes on the GPU path's host side.

The uniforms each sample draws are forced to pick each op of torchvision's AugMix space at a bin,
and the pass it becomes is checked against torchvision's magnitudes (written out here from its
``_augmentation_space(10, (h, w))``); the chains' depths; the mix against a float32 sum written out
here (each chain run from the original, truncated at the end); the weights' distributions (Gamma
variates made of uniforms, against their moments and NumPy's own Beta); a Loader over real JPEGs;
the GPU path's routing of a mix (the original kept for every chain); arguments. torchvision itself
is in tests/ops/test_torchvision_parity.py (where it is installed), the kernels in tests/gpu.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ops_refs import augmix_ref, random_image
from sample_data import check_seeded_post_op

from headrace import ConfigError, ops
from headrace.ops._augmix import gamma
from headrace.ops._passes import MixPass, changed
from headrace.ops._post_spec import ColorMatrix, _Warp
from headrace.ops.cpu import _post
from headrace.ops.cuda._plan import Plan
from headrace.ops.cuda._post_passes import BatchPasses

H, W = 48, 64
# torchvision's AugMix space with all_ops, in its order; magnitude at bin b of 10 (t = b / 9).
NAMES = ["ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Posterize", "Solarize", "AutoContrast", "Equalize",
         "Brightness", "Color", "Contrast", "Sharpness"]
SIGNED = {"ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast", "Sharpness"}


def tv_magnitude(name: str, b: int, h: int = H, w: int = W) -> float:
    t = b / 9
    return {"ShearX": 0.3 * t, "ShearY": 0.3 * t, "TranslateX": w / 3 * t, "TranslateY": h / 3 * t, "Rotate": 30 * t,
            "Posterize": 4 - round(b / (9 / 4)), "Solarize": 255 * (1 - t), "Brightness": 0.9 * t, "Color": 0.9 * t,
            "Contrast": 0.9 * t, "Sharpness": 0.9 * t}.get(name, 0.0)


def _forced(op: ops.AugMix, chains: list[list[tuple[int, int, bool]]], depth_u: float = 0.0, weight_u: float = 0.5
            ) -> np.ndarray:
    """One sample's uniforms: chain i applies ``chains[i]``'s (op index, bin, negative) in turn."""
    u = np.full(op.randoms, weight_u)
    per_chain = op._chain_randoms  # the depth, then (op, bin, sign) for each op slot
    for i, chain in enumerate(chains):
        row = u[i * per_chain : (i + 1) * per_chain]
        row[0] = depth_u
        for r, (k, b, negative) in enumerate(chain):
            row[1 + 3 * r : 4 + 3 * r] = ((k + 0.5) / len(NAMES), (b + 0.5) / op.severity, 0.75 if negative else 0.25)
    return u[None]


def _mix(steps):
    """The policy's one pass: its weights (n, W + 1) and its chains' passes (row i W + c)."""
    ((op, (weights, chains)),) = steps
    assert isinstance(op, MixPass)
    return weights, chains


def _chain_passes(steps, row: int = 0):
    """Sample ``row``'s chains, each as the list of passes that change it (a pass holds the
    identity for the rows that drew another kind, or whose chain has ended)."""
    weights, chains = _mix(steps)
    width = weights.shape[1] - 1
    return [[(op, tables) for op, tables in chains if changed(op, tables)[row * width + c]] for c in range(width)]


@pytest.mark.parametrize("negative", [False, True])
@pytest.mark.parametrize("k, name", list(enumerate(NAMES)), ids=NAMES)
def test_each_forced_op_is_the_pass_of_torchvisions_magnitude(k, name, negative):
    op = ops.AugMix(severity=10, mixture_width=1, chain_depth=1)
    b = 7
    steps = op.steps(_forced(op, [[(k, b, negative)]]), np.array([H]), np.array([W]), 3)
    ((pass_op, tables),) = _chain_passes(steps)[0]
    m = tv_magnitude(name, b) * (-1 if negative and name in SIGNED else 1)
    if name in ("ShearX", "ShearY"):
        assert isinstance(pass_op, _Warp)
        assert tables[0][0][(0, 1) if name == "ShearX" else (1, 0)] == pytest.approx(m)
    elif name in ("TranslateX", "TranslateY"):
        assert tables[0][0][0 if name == "TranslateX" else 1, 2] == -np.trunc(m)  # whole pixels, as torchvision's int()
    elif name == "Rotate":
        assert isinstance(pass_op, _Warp) and not np.allclose(tables[0][0], np.eye(2, 3))
    elif name == "Color":
        assert isinstance(pass_op, ColorMatrix)
        assert tables[0][0][0, 0] == pytest.approx((1 + m) + (1 - (1 + m)) * 0.2989)
    elif name == "Sharpness":
        assert isinstance(pass_op, ops.Sharpness) and tables[0][0] == pytest.approx(1 + m)
    else:
        assert isinstance(pass_op, ops.ToneCurve)
        value = tables[0][0, 1]
        expected = {"Posterize": m, "Solarize": m, "Brightness": 1 + m, "Contrast": 1 + m}.get(name, 0.0)
        assert value == pytest.approx(expected)


def test_posterize_counts_down_from_4_bits_and_reaches_0():
    assert [tv_magnitude("Posterize", b) for b in range(10)] == [4, 4, 3, 3, 2, 2, 1, 1, 0, 0]
    op = ops.AugMix(severity=10, mixture_width=1, chain_depth=1)
    levels = torch.from_numpy(np.arange(256, dtype=np.uint8).reshape(16, 16, 1).repeat(3, axis=2))
    for b, bits in ((0, 4), (9, 0)):
        steps = op.steps(_forced(op, [[(NAMES.index("Posterize"), b, False)]]), np.array([16]), np.array([16]), 3)
        ((_, (table,)),) = _chain_passes(steps)[0]
        assert table[0, 1] == bits
        out = _post.apply_tables(levels, *_chain_passes(steps)[0][0])
        assert np.array_equal(out.numpy()[..., 0].reshape(-1), np.arange(256) & ((0xFF << (8 - bits)) & 0xFF))


def test_the_bin_is_drawn_from_the_first_severity_bins():
    op = ops.AugMix(severity=2, mixture_width=1, chain_depth=1)
    brightness = NAMES.index("Brightness")
    values = set()
    for bin_u in np.linspace(0.0, 0.999, 25):
        u = _forced(op, [[(brightness, 0, False)]])
        u[0, 2] = bin_u
        ((_, (table,)),) = _chain_passes(op.steps(u, np.array([H]), np.array([W]), 3))[0]
        values.add(round(float(table[0, 1]), 6))
    assert values == {1.0, round(1 + 0.9 / 9, 6)}  # bins 0 and 1 only


@pytest.mark.parametrize("depth_u, depth", [(0.1, 1), (0.5, 2), (0.9, 3)])
def test_a_random_depth_chain_applies_one_to_three_ops(depth_u, depth):
    op = ops.AugMix(severity=10, mixture_width=2)
    chain = [(NAMES.index("ShearX"), 9, False), (NAMES.index("Solarize"), 9, False), (NAMES.index("Color"), 9, False)]
    steps = op.steps(_forced(op, [chain, chain], depth_u=depth_u), np.array([H]), np.array([W]), 3)
    assert [len(c) for c in _chain_passes(steps)] == [depth, depth]
    weights, chains = _mix(steps)
    assert weights.shape == (1, 3) and all(len(tables[0]) == 2 for _, tables in chains)  # a row a chain


def test_a_fixed_depth_applies_that_many_ops():
    op = ops.AugMix(severity=10, mixture_width=3, chain_depth=4)
    chain = [(NAMES.index(name), 9, False) for name in ("ShearX", "Solarize", "Color", "Sharpness")]
    steps = op.steps(_forced(op, [chain] * 3, depth_u=0.0), np.array([H]), np.array([W]), 3)
    assert [len(c) for c in _chain_passes(steps)] == [4, 4, 4]


def _images(n: int, channels: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(7 + channels)
    return [random_image(rng, H, W, channels) for _ in range(n)]


@pytest.mark.parametrize("channels", [3, 1])
@pytest.mark.parametrize("make", [lambda: ops.AugMix(), lambda: ops.AugMix(severity=10, mixture_width=4, alpha=0.5),
                                  lambda: ops.AugMix(chain_depth=2, all_ops=False, fill=(20, 90, 160))],
                         ids=["default", "severe-wide", "base-ops"])
def test_the_mix_is_each_chain_from_the_original_weighted_and_truncated(make, channels):
    op = make()
    n = 12
    images = _images(n, channels)
    u = ops.uniforms(3, 1, 0, np.arange(n), op.randoms)
    steps = op.steps(u, np.full(n, H), np.full(n, W), channels)
    original, chains = op.weights(u)
    weights, chain_steps = _mix(steps)
    np.testing.assert_array_equal(weights, np.column_stack([original, chains]))
    for i, a in enumerate(images):
        expected = augmix_ref(a, original[i], chains[i], chain_steps, i)
        got = _post.apply(torch.from_numpy(a), [op], [u[i : i + 1]]).numpy()
        assert np.array_equal(got, expected), i
        # and each sample of the batch's steps gives what it gets alone
        assert np.array_equal(_post.run_steps(torch.from_numpy(a), steps, row=i).numpy(), got)


def test_weights_sum_to_one_and_have_the_dirichlet_moments():
    n = 40_000
    for alpha in (0.3, 1.0, 2.5):
        op = ops.AugMix(alpha=alpha, mixture_width=3)
        original, chains = op.weights(ops.uniforms(9, 0, 0, np.arange(n), op.randoms))
        np.testing.assert_allclose(original + chains.sum(axis=1), 1.0, atol=1e-12)
        assert (original > 0).all() and (chains >= 0).all()
        # original ~ Beta(alpha, alpha): mean 1/2, variance 1 / (4 (2 alpha + 1)); against NumPy's own
        # Beta by quantiles too.
        assert abs(original.mean() - 0.5) < 0.01
        assert original.var() == pytest.approx(1 / (4 * (2 * alpha + 1)), rel=0.05)
        reference = np.random.default_rng(0).beta(alpha, alpha, n)
        qs = np.linspace(0.05, 0.95, 19)
        assert np.abs(np.quantile(original, qs) - np.quantile(reference, qs)).max() < 0.02
        # each chain: Dirichlet(alpha x 3) times the Beta's other part: mean 1/6
        assert np.abs(chains.mean(axis=0) - 1 / 6).max() < 0.01


def test_weights_stay_finite_where_every_variate_of_a_dirichlet_underflows():
    # Below alpha ~0.02 a variate u ** (1 / alpha) underflows to 0 about once in a thousand draws;
    # a sample whose Beta pair (or whose chains) all did would get 0 / 0. Its weights come from the
    # variates' logarithms instead, which give the direct formula's weights wherever that works.
    from headrace.ops._augmix import _shares, gamma_randoms, log_gamma

    op = ops.AugMix(alpha=0.01)
    u = ops.uniforms(1, 0, 0, np.arange(220_000, 230_000), op.randoms)  # sample 224,596's pair underflows
    g, k = gamma_randoms(op.alpha), op.mixture_width * op._chain_randoms
    pair = [gamma(op.alpha, u[:, k + j * g : k + (j + 1) * g]) for j in range(2)]
    degenerate = (pair[0] + pair[1]) == 0
    assert degenerate.sum() == 1
    original, chains = op.weights(u)
    assert np.isfinite(original).all() and np.isfinite(chains).all() and (chains >= 0).all()
    np.testing.assert_allclose(original + chains.sum(axis=1), 1.0, atol=1e-12)
    # the logarithms' weights where the direct ones are defined: the same to rounding (closer to
    # exact where the direct ones divide variates near the smallest float64s, weights below 1e-40)
    fine = ~degenerate
    logs = [log_gamma(op.alpha, u[fine][:, k + j * g : k + (j + 1) * g]) for j in range(op.mixture_width + 2)]
    mine, _ = _shares(logs[:2])
    np.testing.assert_allclose(mine, original[fine], rtol=1e-9, atol=1e-15)


@pytest.mark.parametrize("alpha", [0.2, 0.7, 1.0, 1.6, 4.0])
def test_gamma_from_uniforms_has_the_moments(alpha):
    k = 1 if alpha == 1.0 else 19
    u = ops.uniforms(4, 0, 0, np.arange(60_000), k)
    g = gamma(alpha, u)
    assert (g > 0).all() and np.isfinite(g).all()
    assert g.mean() == pytest.approx(alpha, rel=0.03)
    assert g.var() == pytest.approx(alpha, rel=0.06)


async def test_loader_is_seeded_and_keeps_shape_and_dtype():
    await check_seeded_post_op(ops.AugMix, changed=30)


def test_the_gpu_passes_run_the_chains_as_a_batch_from_each_samples_place():
    # The host side of the GPU path: the chains are a batch of their own (a row a chain) whose
    # input is each sample's place when the mix starts (here the output of a colour pass before
    # it), in the allocation; one mix_chains launch reads each sample's place and its chains' and
    # writes the other buffer.
    from headrace.ops.cuda._plan import address, WORK

    op = ops.AugMix(severity=10, mixture_width=3)
    n, width = 8, 3
    rows = np.array([(0x10000 * (i + 1), H, W, 3 * W + 4, 3) for i in range(n)], dtype=np.int64)  # padded input rows
    colour = np.tile(np.eye(3, 4), (n, 1, 1))
    colour[::2, 0, 0] = 1.5  # the even samples leave the input for buffer 0 before the mix
    steps = [(ops.ColorTwist(0.4), (colour,)),
             *op.steps(ops.uniforms(2, 0, 0, np.arange(n), op.randoms), rows[:, 1], rows[:, 2], 3)]
    passes = BatchPasses(rows, steps, 3, inplace=False)
    (_, (weights, chains), _, src, dst), = [p for p in passes.passes if isinstance(p[0], MixPass)]
    assert src.tolist() == [0, -1] * (n // 2) and dst.tolist() == [1, 0] * (n // 2)
    assert passes.where.tolist() == dst.tolist() and len(chains.rows) == n * width
    plan = Plan()
    base = address(WORK)
    passes.launches(plan, base, gather=True)
    compiled = plan.compile()
    assert compiled.kernels[0] == "color_twist" and compiled.kernels[-2:] == ["mix_chains", "copy_pixels"]
    # each chain row reads its sample's place: buffer 0 for the even samples, the input for the odd
    place = np.where(src == 0, base + passes.at(0) + passes.offsets, rows[:, 0])
    np.testing.assert_array_equal(chains.rows[:, 0], np.repeat(place, width))
    np.testing.assert_array_equal(chains.rows[:, 3], np.repeat(np.where(src == 0, 3 * W, 3 * W + 4), width))
    assert passes.size >= chains.size + passes.total  # the chains' batch lies in the allocation


def test_boxes_refuse_it():
    with pytest.raises(ConfigError, match="moves pixels"):
        ops.Pipeline([ops.RandomResizedCrop(32), ops.AugMix()], label=None, boxes="boxes")


def test_training_takes_it_as_a_post_op():
    pipe = ops.training(32, auto_augment=ops.AugMix())
    assert any(isinstance(op, ops.AugMix) for op in pipe.post_ops)


def test_randoms():
    assert ops.AugMix().randoms == 3 * 10 + 5  # three chains of (depth, 3 x (op, bin, sign)), five exponentials
    assert ops.AugMix(chain_depth=1, mixture_width=2).randoms == 2 * 4 + 4
    assert ops.AugMix(alpha=0.5).randoms == 30 + 5 * 19
    assert ops.AugMix().moves_pixels


BAD = [
    {"severity": 0}, {"severity": 11}, {"severity": 2.5}, {"mixture_width": 0}, {"mixture_width": "3"},
    {"chain_depth": 1.5}, {"chain_depth": True}, {"alpha": 0}, {"alpha": -1.0}, {"alpha": float("inf")},
    {"alpha": float("nan")}, {"alpha": "1"}, {"all_ops": 1}, {"fill": 300}, {"fill": (1, 2, 3, 4, 5)},
]


@pytest.mark.parametrize("bad", BAD, ids=[f"{next(iter(b))}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_raise_config_error_naming_the_op(bad):
    with pytest.raises(ConfigError, match="AugMix"):
        ops.AugMix(**bad)
