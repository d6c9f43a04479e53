"""``ops.TimmAugMix``: timm's ``augmix-...`` config strings, its 13 ops at their magnitudes (each
chain op against ``TimmRandAugment``'s pass of the same op and level, whose ops test_timm_parity.py
checks against timm), the magnitude drawn uniformly up to ``m`` (or about it, with ``mstd``), the
mix ``(1 - m') x original + m' x chains``, ``training(auto_augment="augmix-...")``, and a Loader
over real JPEGs. (The whole op against timm itself: test_timm_parity.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ops_refs import augmix_ref, random_image
from sample_data import check_seeded_post_op

from headrace import ConfigError, ops
from headrace.ops._augmix import mix_weights
from headrace.ops._passes import MixPass, changed
from headrace.ops._timm_augment import _INCREASING
from headrace.ops._timm_augmix import AUGMIX_OPS
from headrace.ops.cpu import _post

H, W = 40, 56


def _forced(op: ops.TimmAugMix, chains: list[list[tuple[int, float, bool]]], depth_u: float = 0.0,
            weight_u: float = 0.5) -> np.ndarray:
    """One sample's uniforms: chain i applies ``chains[i]``'s (op index, magnitude uniform,
    negative) in turn."""
    u = np.full(op.randoms, weight_u)
    per_chain = op._chain_randoms  # the depth, then (op, sign, noise a, noise b) for each op slot
    for i, chain in enumerate(chains):
        row = u[i * per_chain : (i + 1) * per_chain]
        row[0] = depth_u
        for r, (k, a, negative) in enumerate(chain):
            row[1 + 4 * r : 5 + 4 * r] = ((k + 0.5) / len(AUGMIX_OPS), 0.75 if negative else 0.25, a, 0.5)
    return u[None]


def _chain_image(x: torch.Tensor, steps, row: int) -> torch.Tensor:
    """Chain row ``row`` of the policy's one mix pass, run from ``x``."""
    ((mix, (_, chains)),) = steps
    assert isinstance(mix, MixPass)
    for pass_op, tables in chains:
        if changed(pass_op, tables)[row]:
            x = _post.apply_tables(x, pass_op, tables, row=row)
    return x


def test_the_config_string_is_read_as_timm_reads_it():
    op = ops.TimmAugMix()  # timm's defaults: severity 3, 3 chains of 1-3 ops, alpha 1, uniform magnitude
    assert (op.magnitude, op.mixture_width, op.chain_depth, op.alpha, op.blended) == (3, 3, -1, 1.0, False)
    assert op.magnitude_std == float("inf") and op.translate_pct == 0.3 and op.fill == (124.0, 116.0, 104.0)
    op = ops.TimmAugMix("augmix-m5-w4-d2")
    assert (op.magnitude, op.mixture_width, op.chain_depth) == (5, 4, 2)
    op = ops.TimmAugMix("augmix-m7-w2-d0-a0.5-mstd0.5-b1")
    assert (op.magnitude, op.mixture_width, op.chain_depth, op.alpha, op.magnitude_std, op.blended) == (7, 2, 0, 0.5, 0.5, True)
    assert ops.TimmAugMix("augmix-b0").blended  # timm reads b as bool(its text): any b is blended
    assert ops.TimmAugMix().ops == AUGMIX_OPS and len(AUGMIX_OPS) == 13 and set(AUGMIX_OPS) <= set(_INCREASING)


def test_randoms():
    # per chain: the depth, then (op, sign, two for the magnitude) for each of up to 3 ops; five exponentials
    assert ops.TimmAugMix().randoms == 3 * 13 + 5
    assert ops.TimmAugMix("augmix-w2-d1").randoms == 2 * 5 + 4
    assert ops.TimmAugMix("augmix-a0.5").randoms == 3 * 13 + 5 * 19  # Marsaglia-Tsang: 19 uniforms a variate
    assert ops.TimmAugMix().moves_pixels


@pytest.mark.parametrize("config", ["rand-m9", "augmix-x1", "augmix-m1.5", "augmix-w0", "augmix-a0", "augmix-1",
                                    "augmix-mfoo", "augmix-mstd-1", "augmix-ainf", 7])
def test_configs_timm_would_refuse_are_config_errors(config):
    with pytest.raises(ConfigError, match="TimmAugMix"):
        ops.TimmAugMix(config)


@pytest.mark.parametrize("bad", [{"translate_pct": -0.1}, {"translate_pct": "0.3"}, {"translate_pct": True},
                                 {"fill": 300}, {"fill": (1, 2, 3, 4, 5)}])
def test_bad_arguments_raise_config_error_naming_the_op(bad):
    with pytest.raises(ConfigError, match="TimmAugMix"):
        ops.TimmAugMix(**bad)


@pytest.mark.parametrize("slot", range(13))
@pytest.mark.parametrize("negative", [False, True])
def test_each_chain_op_is_timm_randaugments_op_at_that_level(slot, negative):
    # Magnitude uniform in [0, 9] drawn at 0.5: level 4.5. TimmRandAugment at m4.5 with one layer
    # always applied, the same op and sign, and timm's default reach of translations (0.45).
    op = ops.TimmAugMix("augmix-m9-w1-d1", translate_pct=0.45)
    name = AUGMIX_OPS[slot]
    x = torch.from_numpy(random_image(np.random.default_rng(slot), H, W, 3))
    steps = op.steps(_forced(op, [[(slot, 0.5, negative)]]), np.array([H]), np.array([W]), 3)
    reference = ops.TimmRandAugment("rand-m4.5-n1-p1.0-inc1")
    k = _INCREASING.index(name)
    u = np.array([[(k + 0.5) / len(_INCREASING), 0.0, 0.75 if negative else 0.25, 0.0, 0.0]])
    assert torch.equal(_chain_image(x, steps, 0), _post.apply(x, [reference], [u])), name


def test_translations_reach_translate_pct_of_the_image():
    # At magnitude 10 (uniform drawn at 1 - tiny), TranslateXRel moves 0.3 of the width by default.
    op = ops.TimmAugMix("augmix-m10-w1-d1")
    x = torch.from_numpy(random_image(np.random.default_rng(0), H, W, 3))
    slot = AUGMIX_OPS.index("TranslateXRel")
    steps = op.steps(_forced(op, [[(slot, 1 - 1e-12, False)]]), np.array([H]), np.array([W]), 3)
    wider = ops.TimmAugMix("augmix-m10-w1-d1", translate_pct=0.45)
    steps_45 = wider.steps(_forced(wider, [[(slot, 1 - 1e-12, False)]]), np.array([H]), np.array([W]), 3)
    ((_, (_, chain)),), ((_, (_, chain_45)),) = steps, steps_45
    shifts = [np.abs(t[0][:, :, 2]).max() for p, t in chain if changed(p, t)[0]]
    shifts_45 = [np.abs(t[0][:, :, 2]).max() for p, t in chain_45 if changed(p, t)[0]]
    assert shifts[0] == pytest.approx(0.3 * W, abs=1e-6) and shifts_45[0] == pytest.approx(0.45 * W, abs=1e-6)
    assert not torch.equal(_chain_image(x, steps, 0), _chain_image(x, steps_45, 0))


def _rotations(op: ops.TimmAugMix, n: int) -> np.ndarray:
    """The rotation angles of n one-op chains forced to Rotate, their magnitudes drawn."""
    u = ops.uniforms(7, 0, 0, np.arange(n), op.randoms)
    per_chain = op._chain_randoms
    u[:, 1] = (AUGMIX_OPS.index("Rotate") + 0.5) / len(AUGMIX_OPS)
    u[:, 2] = 0.25  # positive
    ((_, (_, chain)),) = op.steps(u, np.full(n, H), np.full(n, W), 3)
    assert per_chain == 5
    ((_, (tables, _)),) = [(p, t) for p, t in chain if changed(p, t).any()]
    # the warp's matrix rotates by the angle: read it back from its first column
    return np.degrees(np.arctan2(tables[:, 1, 0], tables[:, 0, 0]))


def test_the_magnitude_is_uniform_up_to_m_by_default_and_about_m_with_mstd():
    levels = np.abs(_rotations(ops.TimmAugMix("augmix-m6-w1-d1"), 20_000)) / 3.0  # Rotate: 30 degrees at 10
    assert levels.min() >= 0 and levels.max() <= 6 + 1e-9
    assert np.quantile(levels, [0.25, 0.5, 0.75]) == pytest.approx([1.5, 3.0, 4.5], abs=0.1)
    levels = np.abs(_rotations(ops.TimmAugMix("augmix-m6-w1-d1-mstd1"), 20_000)) / 3.0
    assert levels.mean() == pytest.approx(6.0, abs=0.05) and levels.std() == pytest.approx(1.0, abs=0.05)
    levels = np.abs(_rotations(ops.TimmAugMix("augmix-m9-w1-d1-mstd2"), 20_000)) / 3.0
    assert levels.max() <= 10 + 1e-9 and (levels > 10 - 1e-9).mean() > 0.25  # clipped at 10, as timm's


def _images(n: int, channels: int) -> list[np.ndarray]:
    rng = np.random.default_rng(channels)
    return [random_image(rng, H, W, channels) for _ in range(n)]


@pytest.mark.parametrize("channels", [3, 1])
@pytest.mark.parametrize("config", ["augmix", "augmix-m9-w4-d2-a0.5", "augmix-m5-mstd0.5"])
def test_the_mix_is_the_chains_weighted_blended_with_the_original_and_truncated(config, channels):
    op = ops.TimmAugMix(config, fill=(20, 90, 160)[:channels] if channels == 3 else 60)
    n = 12
    images = _images(n, channels)
    u = ops.uniforms(3, 1, 0, np.arange(n), op.randoms)
    steps = op.steps(u, np.full(n, H), np.full(n, W), channels)
    original, chains = op.weights(u)
    ((_, (weights, chain_steps)),) = steps
    np.testing.assert_array_equal(weights, np.column_stack([original, chains]))
    np.testing.assert_allclose(original, 1.0 - chains.sum(axis=1), atol=1e-12)  # blend(original, mix, m')
    np.testing.assert_array_equal(original, mix_weights(op.alpha, op.mixture_width, u[:, op.mixture_width * op._chain_randoms :])[0])
    for i, a in enumerate(images):
        expected = augmix_ref(a, original[i], chains[i], chain_steps, i)
        got = _post.apply(torch.from_numpy(a), [op], [u[i : i + 1]]).numpy()
        assert np.array_equal(got, expected), i
        assert np.array_equal(_post.run_steps(torch.from_numpy(a), steps, row=i).numpy(), got)


def test_a_fixed_depth_applies_that_many_ops_and_d0_one_to_three():
    n = 3000
    for config, allowed in (("augmix-w1-d2", {2}), ("augmix-w1-d0", {1, 2, 3}), ("augmix-w1", {1, 2, 3})):
        op = ops.TimmAugMix(config)
        u = ops.uniforms(11, 0, 0, np.arange(n), op.randoms)
        u[:, 1 :: 4][:, : op._depth] = (AUGMIX_OPS.index("Rotate") + 0.5) / 13  # every op a rotation
        u[:, 3 :: 4][:, : op._depth] = 0.5 + 0.5 * u[:, 3 :: 4][:, : op._depth]  # none of angle zero
        ((_, (_, chain)),) = op.steps(u, np.full(n, H), np.full(n, W), 3)
        depth = sum(changed(p, t).astype(int) for p, t in chain)
        assert set(np.unique(depth).tolist()) == allowed, config


def test_training_takes_timms_augmix_string():
    pipe = ops.training(224, auto_augment="augmix-m5-w4-d2")
    (policy,) = pipe.post_ops
    assert isinstance(policy, ops.TimmAugMix) and policy.config == "augmix-m5-w4-d2"
    assert policy.fill == (124.0, 116.0, 104.0) and policy.translate_pct == 0.3  # what create_transform passes
    gray = ops.training(32, auto_augment="augmix", mean=(0.5,), std=(0.25,))
    assert gray.post_ops[0].fill == (128.0,)
    with pytest.raises(ConfigError, match="TimmAugMix"):
        ops.training(32, auto_augment="augmix-x3")


def test_boxes_refuse_it():
    with pytest.raises(ConfigError, match="moves pixels"):
        ops.Pipeline([ops.RandomResizedCrop(32), ops.TimmAugMix()], label=None, boxes="boxes")


async def test_loader_is_seeded_and_keeps_shape_and_dtype():
    await check_seeded_post_op(lambda: ops.TimmAugMix("augmix-m5-w4-d2"), changed=30)