"""``ops.TimmAutoAugment``: timm's AutoAugment config strings (``original``, ``originalr``, ``v0``,
``v0r``, with ``mstd``), each sub-policy's two ops at their probabilities and magnitudes (each op
against ``TimmRandAugment``'s pass of the same op and level, whose ops test_timm_parity.py checks
against timm), the sub-policy drawn uniformly, ``training(auto_augment=...)``, and a Loader over
real JPEGs. (The whole op against timm itself: test_timm_parity.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ops_refs import random_image
from sample_data import check_seeded_post_op

from headrace import ConfigError, ops
from headrace.ops._passes import changed
from headrace.ops._timm_augment import _OPS, _PLAIN
from headrace.ops._timm_auto_augment import POLICIES
from headrace.ops.cpu import _post

H, W = 40, 56


def _forced(op: ops.TimmAutoAugment, sub: int, applied=(True, True), negative=(False, False), noise=0.5) -> np.ndarray:
    """One sample's uniforms: sub-policy ``sub``, each op applied or not, with the sign given."""
    u = np.full((1, op.randoms), noise)
    u[0, 0] = (sub + 0.5) / len(op.sub_policies)
    for r in range(2):
        u[0, 1 + 4 * r : 3 + 4 * r] = (0.0 if applied[r] else 1.0 - 1e-12, 0.75 if negative[r] else 0.25)
    return u


def test_the_config_string_is_read_as_timm_reads_it():
    op = ops.TimmAutoAugment()
    assert (op.policy, op.magnitude_std, op.translate_pct, op.fill) == ("original", 0.0, 0.45, (124.0, 116.0, 104.0))
    assert ops.TimmAutoAugment("v0r-mstd0.5").policy == "v0r" and ops.TimmAutoAugment("v0r-mstd0.5").magnitude_std == 0.5
    assert op.randoms == 9 and op.moves_pixels
    assert ops.TimmAutoAugment("3a").randoms == 5 and len(ops.TimmAutoAugment("3a").sub_policies) == 3
    for name in ("original", "originalr", "v0", "v0r"):
        subs = ops.TimmAutoAugment(name).sub_policies
        assert len(subs) == 25 and all(len(sub) == 2 for sub in subs)
        assert all(op_name in _OPS and 0.0 <= p <= 1.0 and 0 <= m <= 10 for sub in subs for op_name, p, m in sub)
    # The research variants differ only in their posterize.
    for plain, research in (("original", "originalr"), ("v0", "v0r")):
        pairs = [(a, b) for sa, sb in zip(POLICIES[plain], POLICIES[research]) for a, b in zip(sa, sb) if a != b]
        assert pairs and all(b == ("PosterizeIncreasing", *a[1:]) and a[0].startswith("Posterize") for a, b in pairs)


@pytest.mark.parametrize("config", ["3b", "v1", "rand-m9", "original-m9", "original-mstdx", "original-mstd-1",
                                    "original-mstd", 7, ""])
def test_configs_timm_would_refuse_are_config_errors(config):
    with pytest.raises(ConfigError, match="TimmAutoAugment"):
        ops.TimmAutoAugment(config)


def test_3a_is_solarize_gray_or_a_random_blur():
    # DeiT III's 3-Augment: a third of the samples each. Solarize at 128 (TimmRandAugment's at m5),
    # gray (desaturate at m10), or PIL's blur of a radius uniform in [0.1, 2] (the sign's uniform).
    from headrace.ops._passes import GaussianBlur

    op = ops.TimmAutoAugment("3a")
    x = torch.from_numpy(random_image(np.random.default_rng(2), H, W, 3))
    solarized = _post.apply(x, [op], [np.array([[0.5 / 3, 0.0, 0.25, 0.5, 0.5]])])
    assert torch.equal(solarized, _reference(x, "Solarize", 5, False))
    gray = _post.apply(x, [op], [np.array([[1.5 / 3, 0.0, 0.25, 0.5, 0.5]])]).numpy().astype(int)
    assert np.abs(gray - gray[..., :1]).max() == 0  # every channel the same level
    n = 3000
    u = ops.uniforms(4, 0, 0, np.arange(n), op.randoms)
    u[:, 0] = 2.5 / 3
    ((blur, (wx, _)),) = [(p, t) for p, t in op.steps(u, np.full(n, H), np.full(n, W), 3) if isinstance(p, GaussianBlur)]
    offsets = np.arange(wx.shape[1]) - wx.shape[1] // 2
    radius = np.sqrt((wx * offsets**2).sum(axis=1))  # the kernel's variance is the radius squared
    np.testing.assert_allclose(radius, 0.1 + 1.9 * u[:, 2], rtol=1e-9)
    assert wx.shape[1] == 13  # three boxes of up to 2 taps either side
    counts = np.bincount(np.minimum((ops.uniforms(4, 0, 0, np.arange(n), 5)[:, 0] * 3).astype(int), 2))
    assert abs(counts - n / 3).max() < 5 * np.sqrt(n / 3)


@pytest.mark.parametrize("bad", [{"translate_pct": -0.1}, {"translate_pct": "0.45"}, {"translate_pct": True},
                                 {"fill": 300}, {"fill": (1, 2, 3, 4, 5)}])
def test_bad_arguments_raise_config_error_naming_the_op(bad):
    with pytest.raises(ConfigError, match="TimmAutoAugment"):
        ops.TimmAutoAugment(**bad)


def _reference(x: torch.Tensor, name: str, magnitude: float, negative: bool) -> torch.Tensor:
    """timm's op ``name`` at ``magnitude`` through ``TimmRandAugment``: one layer, always applied."""
    if name == "PosterizeOriginal":  # not among RandAugment's: 4 + int(m / 10 x 4) bits kept
        bits = 4 + int(magnitude / 10 * 4)
        return torch.bitwise_and(x, 256 - 2 ** (8 - bits)) if bits < 8 else x
    increasing = name == "PosterizeIncreasing"
    reference = ops.TimmRandAugment(f"rand-m{magnitude}-n1-p1.0-inc{int(increasing)}")
    k = reference.ops.index(name) if increasing else _PLAIN.index(name)
    u = np.array([[(k + 0.5) / len(reference.ops), 0.0, 0.75 if negative else 0.25, 0.0, 0.0]])
    return _post.apply(x, [reference], [u])


@pytest.mark.parametrize("policy", ["original", "originalr", "v0", "v0r"])
def test_each_sub_policy_applies_its_two_ops_at_their_magnitudes(policy):
    op = ops.TimmAutoAugment(policy)
    rng = np.random.default_rng(5)
    for sub, ((first, p1, m1), (second, p2, m2)) in enumerate(op.sub_policies):
        x = torch.from_numpy(random_image(rng, H, W, 3))
        negative = (bool(sub % 2), bool(sub % 3 == 0))
        got = _post.apply(x, [op], [_forced(op, sub, negative=negative)])
        want = _reference(_reference(x, first, m1, negative[0]), second, m2, negative[1])
        assert torch.equal(got, want), (policy, sub)
        # The first op's draw above its probability: the second alone (an op of probability 1
        # applies whatever its draw, as timm's).
        only_second = _post.apply(x, [op], [_forced(op, sub, applied=(False, True), negative=negative)])
        if p1 == 1.0:
            assert torch.equal(only_second, got), (policy, sub)
        else:
            assert torch.equal(only_second, _reference(x, second, m2, negative[1])), (policy, sub)
        if p1 < 1.0 and p2 < 1.0:
            assert torch.equal(_post.apply(x, [op], [_forced(op, sub, applied=(False, False))]), x)


def test_sub_policies_are_drawn_uniformly_and_ops_at_their_probabilities():
    op = ops.TimmAutoAugment("v0")
    n = 50_000
    u = ops.uniforms(3, 0, 0, np.arange(n), op.randoms)
    chosen = np.minimum((u[:, 0] * 25).astype(np.int64), 24)
    counts = np.bincount(chosen, minlength=25)
    assert abs(counts - n / 25).max() < 5 * np.sqrt(n / 25)
    # Sub-policy 10 is (Equalize 1.0, ShearY 0.6): every sample that drew it equalizes, 60% shear.
    steps = op.steps(u, np.full(n, H), np.full(n, W), 3)
    drew = chosen == 10
    sheared = np.zeros(n, dtype=bool)
    for pass_op, tables in steps:
        if type(pass_op).__name__ == "PassWarp":
            sheared |= changed(pass_op, tables) & (np.asarray(tables[0])[:, 1, 0] != 0)
    rate = sheared[drew].mean()
    assert abs(rate - 0.6) < 4 * np.sqrt(0.24 / drew.sum()), rate


def test_mstd_spreads_the_magnitude_about_its_value():
    # Sub-policy 15 of v0 is (Rotate 1.0 at 7, TranslateYRel 0.8 at 9): the rotation's angle is
    # 21 degrees without noise, 3 x N(7, 1) clipped to [0, 10] with mstd1.
    n = 20_000

    def angles(config: str) -> np.ndarray:
        op = ops.TimmAutoAugment(config)
        u = ops.uniforms(9, 0, 0, np.arange(n), op.randoms)
        u[:, 0] = 15.5 / 25
        u[:, 2] = 0.25  # positive
        warp = next(t for p, t in op.steps(u, np.full(n, H), np.full(n, W), 3) if type(p).__name__ == "PassWarp")
        return np.degrees(np.arctan2(warp[0][:, 1, 0], warp[0][:, 0, 0]))

    assert np.allclose(np.abs(angles("v0")), 21.0)
    levels = np.abs(angles("v0-mstd1")) / 3.0
    assert levels.mean() == pytest.approx(7.0, abs=0.05) and levels.std() == pytest.approx(1.0, abs=0.05)
    assert levels.max() <= 10 + 1e-9


def test_training_takes_timms_auto_augment_string():
    pipe = ops.training(224, auto_augment="original-mstd0.5")
    (policy,) = pipe.post_ops
    assert isinstance(policy, ops.TimmAutoAugment) and (policy.policy, policy.magnitude_std) == ("original", 0.5)
    assert policy.fill == (124.0, 116.0, 104.0) and policy.translate_pct == 0.45  # what create_transform passes
    assert ops.training(32, auto_augment="v0r", mean=(0.5,), std=(0.25,)).post_ops[0].fill == (128.0,)
    with pytest.raises(ConfigError, match="TimmAutoAugment: unknown policy"):
        ops.training(32, auto_augment="augment-m3")


def test_training_adds_timms_color_jitter_after_the_policy():
    # timm's create_transform(auto_augment="3a", color_jitter=0.4): the policy, then the jitter.
    policy, jitter = ops.training(224, auto_augment="3a", color_jitter=0.4).post_ops
    assert isinstance(policy, ops.TimmAutoAugment) and policy.policy == "3a"
    assert jitter == ops.ColorTwist(0.4, 0.4, 0.4)
    (jitter,) = ops.training(224, color_jitter=(0.4, 0.3, 0.2, 0.1), color_jitter_prob=0.8).post_ops
    assert jitter == ops.ColorTwist(0.4, 0.3, 0.2, 0.1, p=0.8)
    assert ops.training(224).post_ops == ()  # off unless asked: torchvision's recipe
    for bad in ("0.4", (0.4, 0.4), True):
        with pytest.raises(ConfigError, match="color_jitter must be"):
            ops.training(224, color_jitter=bad)
    with pytest.raises(ConfigError, match="color_jitter_prob needs color_jitter"):
        ops.training(224, color_jitter_prob=0.5)
    with pytest.raises(ConfigError, match="p must be in"):
        ops.training(224, color_jitter=0.4, color_jitter_prob=1.5)


@pytest.mark.parametrize("channels", [3, 1])
def test_every_policy_runs_on_color_and_gray_batches(channels):
    n = 64
    rng = np.random.default_rng(channels)
    batch = torch.from_numpy(np.stack([random_image(rng, H, W, channels) for _ in range(n)]))
    for name in POLICIES:
        op = ops.TimmAutoAugment(name + "-mstd0.5", fill=60 if channels == 1 else (20, 90, 160))
        u = ops.uniforms(1, 2, 0, np.arange(n), op.randoms)
        out = [_post.apply(batch[i], [op], [u[i : i + 1]]) for i in range(n)]
        assert all(o.shape == (H, W, channels) and o.dtype == torch.uint8 for o in out)
        assert sum(not torch.equal(o, batch[i]) for i, o in enumerate(out)) > n // 2, name


def test_boxes_refuse_it():
    with pytest.raises(ConfigError, match="moves pixels"):
        ops.Pipeline([ops.RandomResizedCrop(32), ops.TimmAutoAugment()], label=None, boxes="boxes")


async def test_loader_is_seeded_and_keeps_shape_and_dtype():
    await check_seeded_post_op(lambda: ops.TimmAutoAugment("original-mstd0.5"), changed=20)