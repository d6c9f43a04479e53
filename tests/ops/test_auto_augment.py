"""RandAugment and TrivialAugmentWide on the CPU path.

Each of the 14 ops of torchvision's RandAugment is forced through its uniforms (op uniform
``(k + 0.5) / 14`` picks op k in torchvision's order; a sign uniform below 0.5 keeps the magnitude
positive) and checked against a reference written out here from torchvision's ``_apply_op`` at
magnitude 9 of 31 bins: translations by whole pixels and the table ops exactly, the warps against a
float64 bilinear reference, the blends within 1 level of torchvision's truncating arithmetic. Then
the passes ``steps`` builds for a batch (only those some sample needs, in the order warp, tone,
colour, sharpness per round; each sample's result the same as alone), the uniforms each policy
draws, TrivialAugmentWide's drawn magnitude bin, a Loader over real JPEGs (seeded, shape and dtype
kept), ``Pipeline(boxes=...)`` refusing them, and argument checks.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ops_refs import random_image
from sample_data import cropped_images, jpeg_items

from headrace import ConfigError, ops
from headrace.ops._post_spec import ColorMatrix, _Warp
from headrace.ops.cpu import _post

# torchvision's order of RandAugment's ops.
NAMES = ["Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast",
         "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize"]
SIGNED = {"ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness", "Color", "Contrast", "Sharpness"}
H, W = 48, 64

# --- references -------------------------------------------------------------------------------------------


def _round(v: np.ndarray) -> np.ndarray:
    return np.clip(np.floor(v + 0.5), 0, 255).astype(np.uint8)


def _diff(x: np.ndarray, y: np.ndarray) -> int:
    assert x.shape == y.shape and x.dtype == y.dtype == np.uint8
    return int(np.abs(x.astype(np.int64) - y.astype(np.int64)).max(initial=0))


def ra_magnitude(name: str, h: int, w: int, magnitude: int = 9, bins: int = 31) -> float:
    """torchvision ``RandAugment._augmentation_space(bins, (h, w))[name]`` at ``magnitude``."""
    t = magnitude / (bins - 1)
    return {
        "ShearX": 0.3 * t, "ShearY": 0.3 * t,
        "TranslateX": 150.0 / 331.0 * w * t, "TranslateY": 150.0 / 331.0 * h * t,
        "Rotate": 30.0 * t, "Brightness": 0.9 * t, "Color": 0.9 * t, "Contrast": 0.9 * t, "Sharpness": 0.9 * t,
        "Posterize": 8 - round(magnitude / ((bins - 1) / 4)), "Solarize": 255.0 * (1 - t),
    }.get(name, 0.0)


def ref_bilinear(a: np.ndarray, fx, fy, fill: float = 0.0) -> np.ndarray:
    """Output pixel (x, y) reads the input at continuous (fx(X, Y), fy(X, Y)), X = x + 0.5, Y = y + 0.5
    (pixel centres at half-integers); bilinear over the four nearest centres, outside ones read fill."""
    h, w, c = a.shape
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    sx, sy = fx(xs, ys) - 0.5, fy(xs, ys) - 0.5
    x0, y0 = np.floor(sx), np.floor(sy)
    ax, ay = (sx - x0)[..., None], (sy - y0)[..., None]
    x0, y0 = x0.astype(np.int64), y0.astype(np.int64)

    def px(yy, xx):
        inside = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
        return np.where(inside[..., None], a[yy.clip(0, h - 1), xx.clip(0, w - 1)].astype(np.float64), fill)

    v = (1 - ay) * ((1 - ax) * px(y0, x0) + ax * px(y0, x0 + 1)) + ay * ((1 - ax) * px(y0 + 1, x0) + ax * px(y0 + 1, x0 + 1))
    return _round(v)


def ref_translate(a: np.ndarray, dx: int, dy: int) -> np.ndarray:
    """torchvision's translate by whole pixels (``F.affine(translate=[dx, dy])``): out[y, x] = a[y - dy, x - dx], 0 outside."""
    h, w, _ = a.shape
    out = np.zeros_like(a)
    ys, xs = np.mgrid[0:h, 0:w]
    src_y, src_x = ys - dy, xs - dx
    inside = (src_x >= 0) & (src_x < w) & (src_y >= 0) & (src_y < h)
    out[inside] = a[src_y[inside], src_x[inside]]
    return out


def ref_rotate(a: np.ndarray, degrees: float) -> np.ndarray:
    """torchvision ``rotate`` (counter-clockwise for positive angles, about the centre), bilinear:
    its inverse matrix ``[[cos, -sin], [sin, cos]]`` on coordinates about (w / 2, h / 2)."""
    h, w, _ = a.shape
    t = math.radians(degrees)
    cx, cy = w / 2.0, h / 2.0
    return ref_bilinear(a, lambda x, y: cx + math.cos(t) * (x - cx) - math.sin(t) * (y - cy),
                        lambda x, y: cy + math.sin(t) * (x - cx) + math.cos(t) * (y - cy))


def tv_gray(a: np.ndarray) -> np.ndarray:
    """torchvision ``rgb_to_grayscale`` on uint8: float weights, cast back (truncated) to uint8."""
    x = a.astype(np.float32)
    return (np.float32(0.2989) * x[..., 0] + np.float32(0.587) * x[..., 1] + np.float32(0.114) * x[..., 2]).astype(np.uint8)


def tv_blend(a: np.ndarray, other: np.ndarray, ratio: float) -> np.ndarray:
    """torchvision ``_blend``: ``(r a + (1 - r) other).clamp(0, 255)`` truncated to uint8."""
    return np.clip(ratio * a.astype(np.float32) + (1.0 - ratio) * np.asarray(other, np.float32), 0, 255).astype(np.uint8)


def tv_blurred(a: np.ndarray) -> np.ndarray:
    img = torch.from_numpy(a).permute(2, 0, 1).float()[None]
    kernel = torch.ones((3, 3))
    kernel[1, 1] = 5.0
    kernel /= kernel.sum()
    out = F.conv2d(img, kernel.expand(a.shape[2], 1, 3, 3), groups=a.shape[2])
    result = a.copy()
    result[1:-1, 1:-1] = torch.round(out[0]).to(torch.uint8).permute(1, 2, 0).numpy()
    return result


def tv_equalize(a: np.ndarray) -> np.ndarray:
    out = a.copy()
    for k in range(a.shape[2]):
        c = torch.from_numpy(np.ascontiguousarray(a[..., k])).long()
        hist = torch.bincount(c.reshape(-1), minlength=256)
        nonzero = hist[hist != 0]
        step = torch.div(nonzero[:-1].sum(), 255, rounding_mode="floor")
        if step == 0:
            continue
        lut = torch.div(torch.cumsum(hist, 0) + torch.div(step, 2, rounding_mode="floor"), step, rounding_mode="floor")
        out[..., k] = F.pad(lut, [1, 0])[:-1].clamp(0, 255)[c].to(torch.uint8).numpy()
    return out


def round_autocontrast(a: np.ndarray) -> np.ndarray:
    x = a.astype(np.float64)
    lo, hi = x.min(axis=(0, 1), keepdims=True), x.max(axis=(0, 1), keepdims=True)
    return np.where(hi > lo, np.floor(255.0 * (x - lo) / np.where(hi > lo, hi - lo, 1.0) + 0.5), x).astype(np.uint8)


def reference(name: str, a: np.ndarray, m: float) -> tuple[np.ndarray, int]:
    """torchvision ``_apply_op(img, name, m)`` on HWC uint8 ``a``, and how many levels ours may differ."""
    h, w, c = a.shape
    if name == "Identity":
        return a, 0
    if name == "ShearX":  # F.affine(shear=[degrees(atan(m)), 0], center=[0, 0]): input x = x + m y
        return ref_bilinear(a, lambda x, y: x + m * y, lambda x, y: y), 1
    if name == "ShearY":
        return ref_bilinear(a, lambda x, y: x, lambda x, y: y + m * x), 1
    if name == "TranslateX":
        return ref_translate(a, int(m), 0), 0
    if name == "TranslateY":
        return ref_translate(a, 0, int(m)), 0
    if name == "Rotate":
        return ref_rotate(a, m), 1
    if name == "Brightness":
        return tv_blend(a, 0.0, 1.0 + m), 1
    if name == "Color":
        return (a, 0) if c == 1 else (tv_blend(a, tv_gray(a)[..., None], 1.0 + m), 1)
    if name == "Contrast":
        gray = a[..., 0] if c == 1 else tv_gray(a)
        return tv_blend(a, gray.astype(np.float32).mean(), 1.0 + m), 1
    if name == "Sharpness":
        return tv_blend(a, tv_blurred(a), 1.0 + m), 1
    if name == "Posterize":
        return a & np.uint8(-int(2 ** (8 - int(m))) & 0xFF), 0
    if name == "Solarize":
        return np.where(a >= m, 255 - a, a).astype(np.uint8), 0
    if name == "AutoContrast":
        return round_autocontrast(a), 0
    if name == "Equalize":
        return tv_equalize(a), 0
    raise AssertionError(name)


def _images(channels: int) -> list[np.ndarray]:
    """A full-range photo-alike and a narrower one (so AutoContrast has work to do)."""
    rng = np.random.default_rng(2024 + channels)
    a = random_image(rng, H, W, channels)
    narrow = (random_image(rng, H, W, channels).astype(np.float64) * 0.55 + 40).astype(np.uint8)
    return [a, narrow]


def _forced(k: int, sign_u: float, rounds: int = 1) -> np.ndarray:
    return np.array([[(k + 0.5) / 14, sign_u] * rounds])


# --- each op, forced ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("channels", [3, 1])
@pytest.mark.parametrize("sign_u", [0.25, 0.75], ids=["positive", "negative"])
@pytest.mark.parametrize("k, name", list(enumerate(NAMES)), ids=NAMES)
def test_each_op_forced_is_torchvisions(k, name, sign_u, channels):
    op = ops.RandAugment(num_ops=1, magnitude=9, num_magnitude_bins=31)
    m = ra_magnitude(name, H, W)
    if name in SIGNED and sign_u >= 0.5:
        m = -m
    for a in _images(channels):
        got = _post.apply(torch.from_numpy(a), [op], [_forced(k, sign_u)]).numpy()
        assert got.shape == a.shape and got.dtype == np.uint8
        expected, tolerance = reference(name, a, m)
        assert _diff(got, expected) <= tolerance, (name, m)
        if name != "Identity" and not (name == "Color" and channels == 1) and not (name == "AutoContrast" and a.max() == 255):
            assert not np.array_equal(got, a), name  # each op does change the image (AutoContrast: the narrow one)
    if name == "Rotate":  # the same warp as Rotate at that fixed angle
        for a in _images(channels):
            got = _post.apply(torch.from_numpy(a), [op], [_forced(k, sign_u)]).numpy()
            rotated = _post.apply(torch.from_numpy(a), [ops.Rotate((m, m))], [np.zeros((1, 1))]).numpy()
            assert _diff(got, rotated) <= 1


def test_the_forced_magnitudes_are_torchvisions():
    """Magnitude 9 of 31: translate int(150/331 * 64 * 9/30) = 8 columns, int(... 48 ...) = 6 rows;
    posterize to 7 bits; solarize at 178.5 (255 - 9 * 8.5)."""
    assert int(ra_magnitude("TranslateX", H, W)) == 8 and int(ra_magnitude("TranslateY", H, W)) == 6
    assert ra_magnitude("Posterize", H, W) == 7 and ra_magnitude("Solarize", H, W) == 178.5
    a = _images(3)[0]
    op = ops.RandAugment(num_ops=1)
    shifted = _post.apply(torch.from_numpy(a), [op], [_forced(3, 0.25)]).numpy()
    assert np.array_equal(shifted[:, 8:], a[:, :-8]) and not shifted[:, :8].any()
    shifted = _post.apply(torch.from_numpy(a), [op], [_forced(4, 0.75)]).numpy()  # negative: up by 6
    assert np.array_equal(shifted[:-6], a[6:]) and not shifted[-6:].any()
    levels = np.arange(256, dtype=np.uint8).reshape(16, 16, 1)
    solarized = _post.apply(torch.from_numpy(levels), [op], [_forced(11, 0.9)]).numpy().reshape(-1)
    assert solarized[178] == 178 and solarized[179] == 255 - 179
    posterized = _post.apply(torch.from_numpy(levels), [op], [_forced(10, 0.1)]).numpy().reshape(-1)
    assert np.array_equal(posterized, np.arange(256) & 0xFE)


def test_fill_is_the_level_where_a_warp_reads_outside():
    a = _images(3)[1]
    op = ops.RandAugment(num_ops=1, fill=(10, 20, 30))
    shifted = _post.apply(torch.from_numpy(a), [op], [_forced(3, 0.25)]).numpy()
    assert np.all(shifted[:, :8] == np.array([10, 20, 30], np.uint8)) and np.array_equal(shifted[:, 8:], a[:, :-8])


def test_two_rounds_apply_both_ops_in_order():
    a = _images(3)[1]
    op = ops.RandAugment(num_ops=2)
    u = np.array([[(3 + 0.5) / 14, 0.25, (13 + 0.5) / 14, 0.6]])  # TranslateX then Equalize
    got = _post.apply(torch.from_numpy(a), [op], [u]).numpy()
    assert np.array_equal(got, tv_equalize(ref_translate(a, 8, 0)))
    u = np.array([[(13 + 0.5) / 14, 0.6, (3 + 0.5) / 14, 0.25]])  # Equalize then TranslateX
    assert np.array_equal(_post.apply(torch.from_numpy(a), [op], [u]).numpy(), ref_translate(tv_equalize(a), 8, 0))


# --- steps: the passes of a batch ----------------------------------------------------------------------------


def _kinds(steps) -> list[str]:
    out = []
    for step, _ in steps:
        if isinstance(step, _Warp):
            out.append("warp")
        elif isinstance(step, ops.ToneCurve):
            out.append("tone")
        elif isinstance(step, ops.Sharpness):
            out.append("sharpness")
        else:
            assert isinstance(step, ColorMatrix), step
            out.append("colour")
    return out


def _sizes(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.full(n, H), np.full(n, W)


def test_steps_leave_out_the_passes_no_sample_needs():
    ra = ops.RandAugment(num_ops=2)
    identity = np.tile(_forced(0, 0.3, rounds=2), (5, 1))
    assert ra.steps(identity, *_sizes(5), 3) == []
    zero = ops.RandAugment(num_ops=0)
    assert zero.randoms == 0 and zero.steps(None, *_sizes(4), 3) == [] and zero.steps(np.zeros((4, 0)), *_sizes(4), 3) == []
    # Round 1: ShearX, Brightness, Color, Sharpness; round 2: Equalize, Posterize, Identity, Solarize (tone only).
    u = np.array([[(k1 + 0.5) / 14, 0.2, (k2 + 0.5) / 14, 0.7] for k1, k2 in ((1, 13), (6, 10), (7, 0), (9, 11))])
    steps = ra.steps(u, *_sizes(4), 3)
    assert _kinds(steps) == ["warp", "tone", "colour", "sharpness", "tone"]
    (_, (affine, fill)), (_, (tone,)), (_, (colour,)), (_, (sharp,)), (_, (tone2,)) = steps
    np.testing.assert_allclose(affine[0], [[1, 0.09, 0], [0, 1, 0]], atol=1e-12)
    assert all(np.array_equal(affine[i], np.eye(2, 3)) for i in (1, 2, 3)) and np.array_equal(fill, [0, 0, 0])
    assert tone[:, 0].tolist()[0] == 0 and tone[2:, 0].tolist() == [0, 0] and tone[1, 1] == pytest.approx(1.27)
    assert all(np.array_equal(colour[i], np.eye(3, 4)) for i in (0, 1, 3)) and not np.array_equal(colour[2], np.eye(3, 4))
    np.testing.assert_allclose(sharp, [1.0, 1.0, 1.0, 1.27])
    assert tone2[2, 0] == 0 and tone2[3, 1] == 178.5 and tone2[1, 1] == 7
    # One-channel images take no colour pass (saturation has nothing to do).
    assert _kinds(ra.steps(u, *_sizes(4), 1)) == ["warp", "tone", "sharpness", "tone"]
    # Every kind in both rounds: the four passes twice, in order.
    u2 = np.array([[(k + 0.5) / 14, 0.2, (k2 + 0.5) / 14, 0.2] for k, k2 in ((5, 9), (8, 7), (7, 2), (9, 12))])
    assert _kinds(ra.steps(u2, *_sizes(4), 3)) == ["warp", "tone", "colour", "sharpness"] * 2


def test_each_sample_of_a_mixed_batch_gets_what_it_gets_alone():
    ra = ops.RandAugment(num_ops=2)
    rng = np.random.default_rng(11)
    n = 14
    images = [random_image(rng, H, W) for _ in range(n)]
    u = np.array([[(k + 0.5) / 14, rng.random(), ((k * 5) % 14 + 0.5) / 14, rng.random()] for k in range(n)])
    steps = ra.steps(u, *_sizes(n), 3)
    assert _kinds(steps) == ["warp", "tone", "colour", "sharpness"] * 2
    for i, a in enumerate(images):
        x = torch.from_numpy(a)
        for step, tables in steps:
            x = _post.apply_tables(x, step, tables, row=i)
        assert np.array_equal(x.numpy(), _post.apply(torch.from_numpy(a), [ra], [u[i : i + 1]]).numpy()), i


def test_randoms_per_policy():
    assert [ops.RandAugment(num_ops=k).randoms for k in range(5)] == [0, 2, 4, 6, 8]
    assert ops.RandAugment().randoms == 4 and ops.TrivialAugmentWide().randoms == 3
    assert ops.RandAugment().moves_pixels and ops.TrivialAugmentWide().moves_pixels
    with pytest.raises(TypeError, match="steps"):
        ops.RandAugment().tables(np.zeros((1, 4)), *_sizes(1), 3)


def test_trivial_augment_draws_the_magnitude_bin():
    ta = ops.TrivialAugmentWide()
    a = _images(3)[1]
    brightness = np.array([[(6 + 0.5) / 14, 0.2, 0.1], [(6 + 0.5) / 14, 0.2, 0.9]])  # bins 3 and 27 of 31
    (_, (tone,)), = ta.steps(brightness, *_sizes(2), 3)
    np.testing.assert_allclose(tone[:, 1], [1 + 0.99 * 3 / 30, 1 + 0.99 * 27 / 30])
    low, high = (_post.apply(torch.from_numpy(a), [ta], [brightness[i : i + 1]]).numpy() for i in range(2))
    assert not np.array_equal(low, high)
    assert _diff(low, tv_blend(a, 0.0, 1 + 0.99 * 3 / 30)) <= 1 and _diff(high, tv_blend(a, 0.0, 1 + 0.99 * 27 / 30)) <= 1
    # The wide space: translate up to 32 pixels, posterize down to 2 bits, rotate up to 135 degrees.
    shifted = _post.apply(torch.from_numpy(a), [ta], [np.array([[(3 + 0.5) / 14, 0.2, 0.999]])]).numpy()
    assert np.array_equal(shifted[:, 32:], a[:, :-32]) and not shifted[:, :32].any()
    levels = np.arange(256, dtype=np.uint8).reshape(16, 16, 1)
    posterized = _post.apply(torch.from_numpy(levels), [ta], [np.array([[(10 + 0.5) / 14, 0.2, 0.999]])]).numpy()
    assert np.array_equal(posterized.reshape(-1), np.arange(256) & 0xC0)
    rotated = _post.apply(torch.from_numpy(a), [ta], [np.array([[(5 + 0.5) / 14, 0.7, 0.999]])]).numpy()
    assert _diff(rotated, ref_rotate(a, -135.0)) <= 1
    # Bin 0 is no change for the signed ops.
    same = _post.apply(torch.from_numpy(a), [ta], [np.array([[(1 + 0.5) / 14, 0.2, 0.0]])]).numpy()
    assert np.array_equal(same, a)


# --- through a Loader over real JPEGs ---------------------------------------------------------------------------

N = 48


async def _loaded(*post, seed: int = 5, channels: int = 3) -> dict[str, torch.Tensor]:
    return await cropped_images(jpeg_items(N, 53, 40, 44), *post, size=32, seed=seed, channels=channels)


@pytest.mark.parametrize("make", [lambda: ops.RandAugment(), lambda: ops.TrivialAugmentWide(), lambda: ops.AutoAugment()],
                         ids=["ra", "ta", "aa"])
async def test_loader_is_seeded_and_keeps_shape_and_dtype(make):
    plain = await _loaded()
    first, second, other = await _loaded(make()), await _loaded(make()), await _loaded(make(), seed=6)
    assert first.keys() == second.keys() == other.keys() == plain.keys() and len(first) == N
    for image in first.values():
        assert image.shape == (32, 32, 3) and image.dtype == torch.uint8
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert sum(not torch.equal(first[k], other[k]) for k in first) > N // 2
    assert sum(not torch.equal(first[k], plain[k]) for k in first) > N // 2


async def test_loader_gray_images_and_no_rounds():
    plain = await _loaded(channels=1)
    got = await _loaded(ops.RandAugment(num_ops=3, magnitude=20), channels=1)
    assert all(image.shape == (32, 32, 1) and image.dtype == torch.uint8 for image in got.values())
    assert sum(not torch.equal(got[k], plain[k]) for k in got) > N // 2
    none = await _loaded(ops.RandAugment(num_ops=0), channels=1)
    assert all(torch.equal(none[k], plain[k]) for k in plain)


async def test_loader_normalizes_after_the_policy():
    pipe = [ops.RandAugment(), ops.Normalize((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), layout="HWC")]
    raw, normalized = await _loaded(ops.RandAugment()), await _loaded(*pipe)
    for key, image in raw.items():
        assert normalized[key].dtype == torch.float32
        torch.testing.assert_close(normalized[key], image.float() / 255.0, rtol=0, atol=1e-6)


def test_boxes_refuse_the_policies_but_not_the_tone_curves():
    for policy in (ops.RandAugment(), ops.TrivialAugmentWide()):
        with pytest.raises(ConfigError, match="moves pixels"):
            ops.Pipeline([ops.RandomResizedCrop(32), policy], label=None, boxes="boxes")
    pipe = ops.Pipeline([ops.RandomResizedCrop(32), ops.RandomEqualize(), ops.RandomAdjustSharpness(2.0)], label=None,
                        boxes="boxes")
    assert pipe.boxes == "boxes"


# --- arguments -----------------------------------------------------------------------------------------------------

BAD = [
    ("RandAugment", lambda: ops.RandAugment(num_ops=-1)),
    ("RandAugment", lambda: ops.RandAugment(magnitude=31, num_magnitude_bins=31)),
    ("RandAugment", lambda: ops.RandAugment(magnitude=-1)),
    ("RandAugment", lambda: ops.RandAugment(num_magnitude_bins=1)),
    ("RandAugment", lambda: ops.RandAugment(fill=300)),
    ("RandAugment", lambda: ops.RandAugment(fill=(1, 2, 3, 4, 5))),
    ("RandAugment", lambda: ops.RandAugment(magnitude=9.5)),
    ("RandAugment", lambda: ops.RandAugment(magnitude="9")),
    ("RandAugment", lambda: ops.RandAugment(num_ops=1.5)),
    ("TrivialAugmentWide", lambda: ops.TrivialAugmentWide(num_magnitude_bins=1)),
    ("TrivialAugmentWide", lambda: ops.TrivialAugmentWide(fill=300)),
    ("TrivialAugmentWide", lambda: ops.TrivialAugmentWide(fill=float("nan"))),
]


@pytest.mark.parametrize("name, make", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_arguments_raise_config_error_naming_the_op(name, make):
    with pytest.raises(ConfigError, match=name):
        make()


def test_good_arguments_are_kept():
    ra = ops.RandAugment(num_ops=np.int64(3), magnitude=30, num_magnitude_bins=31, fill=(1, 2, 3))
    assert (ra.num_ops, ra.magnitude, ra.num_magnitude_bins, ra.fill) == (3, 30, 31, (1.0, 2.0, 3.0))
    assert ops.RandAugment(magnitude=0, num_magnitude_bins=2).magnitude == 0
    assert ops.TrivialAugmentWide(num_magnitude_bins=2).num_magnitude_bins == 2


# --- AutoAugment -------------------------------------------------------------------------------------------


def _subpolicy(k: int, draws=(0.0, 0.0), signs=(0.75, 0.75), policies: int = 25) -> np.ndarray:
    return np.array([[(k + 0.5) / policies, *draws, *signs]])


def test_autoaugment_applies_a_subpolicys_two_ops_in_turn():
    a = random_image(np.random.default_rng(61), H, W, 3)
    x = torch.from_numpy(a)
    op = ops.AutoAugment("imagenet")
    assert op.randoms == 5 and op.moves_pixels
    # Sub-policy 13 is (Invert, 0.6), (Equalize, 1.0): invert, then equalize the inverted image.
    both = _post.apply(x, [op], [_subpolicy(13)]).numpy()
    assert _diff(both, tv_equalize(255 - a)) == 0
    # A draw above an op's probability leaves that op out: 0.7 > 0.6 skips the invert.
    assert _diff(_post.apply(x, [op], [_subpolicy(13, draws=(0.7, 0.0))]).numpy(), tv_equalize(a)) == 0
    # Sub-policy 3 is (Posterize 0.6, bin 7), (Posterize 0.6, bin 6): 5 bits, then 6 bits.
    assert _diff(_post.apply(x, [op], [_subpolicy(3)]).numpy(), a & 0xF8) == 0
    # Sub-policy 12's first op has p = 0 and its second 0.8: above both draws, nothing happens.
    assert op.steps(_subpolicy(12, draws=(0.5, 0.9)), np.array([H]), np.array([W]), 3) == []


def test_autoaugment_signs_and_magnitudes():
    a = random_image(np.random.default_rng(62), H, W, 3)
    x = torch.from_numpy(a)
    # SVHN sub-policy 20 is (Solarize 0.7, bin 2), (TranslateY 0.6, bin 7); the space has 10 bins.
    op = ops.AutoAugment("svhn")
    shift = int(150.0 / 331.0 * H * 7 / 9)
    down = _post.apply(x, [op], [_subpolicy(20, draws=(0.9, 0.0), signs=(0.75, 0.75))]).numpy()
    up = _post.apply(x, [op], [_subpolicy(20, draws=(0.9, 0.0), signs=(0.75, 0.25))]).numpy()
    assert _diff(down, ref_translate(a, 0, shift)) == 0
    assert _diff(up, ref_translate(a, 0, -shift)) == 0
    solarized = _post.apply(x, [op], [_subpolicy(20, draws=(0.0, 0.9))]).numpy()
    threshold = 255.0 - 2 * 255.0 / 9
    assert _diff(solarized, np.where(a >= threshold, 255 - a, a).astype(np.uint8)) == 0


@pytest.mark.parametrize("policy", ["imagenet", "cifar10", "svhn", "SVHN"])
def test_autoaugment_policies_by_name(policy):
    assert ops.AutoAugment(policy).policy == policy.lower()


@pytest.mark.parametrize("bad", [{"policy": "coco"}, {"policy": 3}, {"fill": 300}])
def test_autoaugment_bad_arguments(bad):
    with pytest.raises(ConfigError, match="AutoAugment"):
        ops.AutoAugment(**bad)
