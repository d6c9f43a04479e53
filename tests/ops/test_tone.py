"""The tone curves and sharpness (RandomPosterize, RandomSolarize, RandomInvert, RandomEqualize,
RandomAutocontrast, RandomAdjustSharpness, and the brightness and contrast curves of ``tone_tables``)
on the CPU path, against references written out here from torchvision's published algorithms
(torchvision is not installed: each reference is its function body in plain NumPy / torch).

Bounds: posterize, solarize, invert and equalize are integer table look-ups: the same bytes as
torchvision. Autocontrast rounds where torchvision truncates (within 1 level of it, and exactly a
rounding version of it); sharpness, brightness and contrast blend in float32 and round once (within
1 level of torchvision's truncation and of a float64 rounding). Then ``p`` through a Loader over real
JPEGs (each sample exactly unchanged or exactly the p=1 result, about p of them changed), argument
checks, seeds, and the ops inside a Pipeline before Normalize.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from ops_refs import batch, random_image, sample
from sample_data import cropped_images, jpeg_bytes, jpeg_items

from headrace import ConfigError, ops
from headrace.ops._tone import BRIGHTNESS, CONTRAST, tone_tables
from headrace.ops.cpu import _post

# --- references: torchvision's functional tensor ops, written out ---------------------------------


def ref_posterize(a: np.ndarray, bits: int) -> np.ndarray:
    """torchvision ``posterize``: ``img & -int(2 ** (8 - bits))`` on uint8."""
    mask = np.uint8(-int(2 ** (8 - bits)) & 0xFF)
    return a & mask


def ref_solarize(a: np.ndarray, threshold: float) -> np.ndarray:
    """torchvision ``solarize``: ``where(img >= threshold, invert(img), img)``."""
    return np.where(a >= threshold, 255 - a, a).astype(np.uint8)


def ref_invert(a: np.ndarray) -> np.ndarray:
    return (255 - a.astype(np.int64)).astype(np.uint8)


def _scale_channel(chan: np.ndarray) -> np.ndarray:
    """torchvision ``_scale_channel`` (equalize) on one uint8 channel, in int64 torch arithmetic."""
    c = torch.from_numpy(np.ascontiguousarray(chan)).to(torch.int64)
    hist = torch.bincount(c.reshape(-1), minlength=256)
    nonzero = hist[hist != 0]
    step = torch.div(nonzero[:-1].sum(), 255, rounding_mode="floor")
    if step == 0:
        return chan.copy()
    lut = torch.div(torch.cumsum(hist, 0) + torch.div(step, 2, rounding_mode="floor"), step, rounding_mode="floor")
    lut = F.pad(lut, [1, 0])[:-1].clamp(0, 255)
    return lut[c].to(torch.uint8).numpy()


def ref_equalize(a: np.ndarray) -> np.ndarray:
    return np.stack([_scale_channel(a[..., k]) for k in range(a.shape[2])], axis=-1)


def ref_autocontrast_tv(a: np.ndarray) -> np.ndarray:
    """torchvision ``autocontrast``: per channel (v - min) * 255 / (max - min) in float32, truncated;
    a flat channel is left alone (scale 1, minimum 0)."""
    img = torch.from_numpy(a).permute(2, 0, 1).to(torch.float32)
    lo = img.amin(dim=(-2, -1), keepdim=True)
    hi = img.amax(dim=(-2, -1), keepdim=True)
    scale = 255.0 / (hi - lo)
    flat = ~torch.isfinite(scale)
    lo[flat] = 0
    scale[flat] = 1
    return ((img - lo) * scale).clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()


def ref_autocontrast_round(a: np.ndarray) -> np.ndarray:
    """The same stretch rounded half up in float64 (a quotient of small ints: exact to the half)."""
    x = a.astype(np.float64)
    lo = x.min(axis=(0, 1), keepdims=True)
    hi = x.max(axis=(0, 1), keepdims=True)
    span = np.where(hi > lo, hi - lo, 1.0)
    out = np.floor(255.0 * (x - lo) / span + 0.5)
    return np.where(hi > lo, out, x).astype(np.uint8)


def ref_blurred(a: np.ndarray) -> np.ndarray:
    """torchvision ``_blurred_degenerate_image``: 3x3 [[1,1,1],[1,5,1],[1,1,1]] / 13 conv (float32),
    rounded back to uint8, on the inner pixels; the border keeps the original."""
    img = torch.from_numpy(a).permute(2, 0, 1).to(torch.float32)[None]
    c = img.shape[1]
    kernel = torch.ones((3, 3), dtype=torch.float32)
    kernel[1, 1] = 5.0
    kernel /= kernel.sum()
    out = F.conv2d(img, kernel.expand(c, 1, 3, 3), groups=c)
    result = torch.from_numpy(a.copy()).permute(2, 0, 1)
    result[:, 1:-1, 1:-1] = torch.round(out[0]).to(torch.uint8)
    return result.permute(1, 2, 0).numpy()


def ref_sharpness_tv(a: np.ndarray, factor: float) -> np.ndarray:
    """torchvision ``adjust_sharpness``: images of a side <= 2 unchanged, else
    ``_blend(img, blurred, f)``: ``(f img + (1 - f) blurred).clamp(0, 255)`` truncated."""
    if a.shape[0] <= 2 or a.shape[1] <= 2:
        return a.copy()
    img, blurred = torch.from_numpy(a).float(), torch.from_numpy(ref_blurred(a)).float()
    return (factor * img + (1.0 - factor) * blurred).clamp(0, 255).to(torch.uint8).numpy()


def ref_sharpness_round(a: np.ndarray, factor: float) -> np.ndarray:
    if a.shape[0] <= 2 or a.shape[1] <= 2:
        return a.copy()
    v = factor * a.astype(np.float64) + (1.0 - factor) * ref_blurred(a).astype(np.float64)
    return np.clip(np.floor(v + 0.5), 0, 255).astype(np.uint8)


def ref_mean_gray(a: np.ndarray) -> float:
    """torchvision's mean of ``rgb_to_grayscale`` (float weights), or the one channel's mean."""
    x = a.astype(np.float64)
    if a.shape[2] == 1:
        return float(x.mean())
    return float((0.2989 * x[..., 0] + 0.587 * x[..., 1] + 0.114 * x[..., 2]).mean())


def _round(v: np.ndarray) -> np.ndarray:
    return np.clip(np.floor(v + 0.5), 0, 255).astype(np.uint8)


def _diff(x: np.ndarray, y: np.ndarray) -> int:
    assert x.shape == y.shape and x.dtype == y.dtype == np.uint8
    return int(np.abs(x.astype(np.int64) - y.astype(np.int64)).max(initial=0))


# --- images ---------------------------------------------------------------------------------------


def _images(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """RGB and gray photos-alike, sizes from 1x1 up, flat images, two-level images, few-level ones."""
    two = np.where(rng.random((21, 17, 3)) < 0.3, 40, 200).astype(np.uint8)
    out = {
        "rgb": random_image(rng, 37, 45),
        "rgb_large": random_image(rng, 64, 80),
        "gray": random_image(rng, 33, 29, 1),
        "gray_large": random_image(rng, 40, 48, 1),
        "flat_rgb": np.full((9, 11, 3), 77, np.uint8),
        "flat_gray": np.full((6, 5, 1), 200, np.uint8),
        "flat_channel": np.concatenate([random_image(rng, 20, 20, 2), np.full((20, 20, 1), 13, np.uint8)], axis=2),
        "one_pixel": np.array([[[10, 130, 250]]], np.uint8),
        "two_by_five": random_image(rng, 2, 5),
        "two_levels": two,
        "two_levels_gray": two[..., :1].copy(),
        "dark_narrow": rng.integers(30, 34, (25, 23, 3)).astype(np.uint8),
        "skewed": np.where(rng.random((30, 30, 3)) < 0.8, 255, rng.integers(0, 256, (30, 30, 3))).astype(np.uint8),
        "uniform_noise": rng.integers(0, 256, (20, 20, 3)).astype(np.uint8),
        "full_range": np.concatenate([np.zeros((1, 8, 3)), np.full((1, 8, 3), 255), random_image(rng, 6, 8)]).astype(np.uint8),
    }
    return out


def _run(op: ops.PostOp, a: np.ndarray) -> np.ndarray:
    """``op`` on one HWC uint8 image through the CPU path, drawn (its uniform is 0, below any p > 0)."""
    out = _post.apply(torch.from_numpy(np.ascontiguousarray(a)), [op], [np.zeros((1, op.randoms))]).numpy()
    assert out.shape == a.shape and out.dtype == np.uint8
    return out


# --- exact ops --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(9))
def test_posterize_is_torchvisions_exactly(rng, bits):
    for name, a in _images(rng).items():
        assert np.array_equal(_run(ops.RandomPosterize(bits, p=1.0), a), ref_posterize(a, bits)), name
    if bits == 8:
        a = random_image(rng, 10, 12)
        assert np.array_equal(_run(ops.RandomPosterize(8, p=1.0), a), a)


@pytest.mark.parametrize("threshold", [0, 1, 40, 128, 178.5, 200, 254.5, 255])
def test_solarize_is_torchvisions_exactly(rng, threshold):
    for name, a in _images(rng).items():
        assert np.array_equal(_run(ops.RandomSolarize(threshold, p=1.0), a), ref_solarize(a, threshold)), name


def test_solarize_threshold_is_inclusive_and_invert_flips_every_level():
    levels = np.arange(256, dtype=np.uint8).reshape(16, 16, 1)
    got = _run(ops.RandomSolarize(100, p=1.0), levels).reshape(-1)
    assert got[99] == 99 and got[100] == 155 and got[255] == 0 and got[0] == 0
    rgb = np.repeat(levels, 3, axis=2)
    assert np.array_equal(_run(ops.RandomInvert(p=1.0), rgb).reshape(-1, 3)[:, 1], 255 - np.arange(256))


def test_invert_is_torchvisions_exactly_and_twice_is_the_identity(rng):
    for name, a in _images(rng).items():
        once = _run(ops.RandomInvert(p=1.0), a)
        assert np.array_equal(once, ref_invert(a)), name
        assert np.array_equal(_run(ops.RandomInvert(p=1.0), once), a), name


def test_equalize_is_torchvisions_exactly(rng):
    images = _images(rng)
    stepped = 0
    for name, a in images.items():
        got = _run(ops.RandomEqualize(p=1.0), a)
        assert np.array_equal(got, ref_equalize(a)), name
        stepped += not np.array_equal(got, a)
    assert stepped >= 5  # not all left alone by step 0
    # Fewer than 256 pixels off the brightest level: step 0, unchanged (torchvision's early return).
    for name in ("flat_rgb", "flat_gray", "one_pixel", "two_by_five", "two_levels", "two_levels_gray"):
        assert np.array_equal(_run(ops.RandomEqualize(p=1.0), images[name]), images[name]), name
    # Many pixels: the table's clamp at 255 and the shift by one both show.
    big_two = np.where(rng.random((40, 40, 1)) < 0.5, 60, 90).astype(np.uint8)
    got = _run(ops.RandomEqualize(p=1.0), big_two)
    assert np.array_equal(got, ref_equalize(big_two)) and set(np.unique(got)) == {0, 255}
    noise = rng.integers(0, 256, (48, 48, 3)).astype(np.uint8)
    assert np.array_equal(_run(ops.RandomEqualize(p=1.0), noise), ref_equalize(noise))


# --- rounding ops: within a level of torchvision ------------------------------------------------------


def test_autocontrast_rounds_torchvisions_stretch(rng):
    for name, a in _images(rng).items():
        got = _run(ops.RandomAutocontrast(p=1.0), a)
        assert np.array_equal(got, ref_autocontrast_round(a)), name
        assert _diff(got, ref_autocontrast_tv(a)) <= 1, name
    images = _images(rng)
    for name in ("flat_rgb", "flat_gray", "one_pixel", "full_range"):  # max == min everywhere, or already 0..255
        assert np.array_equal(_run(ops.RandomAutocontrast(p=1.0), images[name]), images[name]), name
    # A flat channel stays; the others stretch to 0..255.
    got = _run(ops.RandomAutocontrast(p=1.0), images["flat_channel"])
    assert np.all(got[..., 2] == 13) and got[..., :2].min() == 0 and got[..., :2].max() == 255
    two = _run(ops.RandomAutocontrast(p=1.0), images["two_levels"])
    assert set(np.unique(two)) == {0, 255}


@pytest.mark.parametrize("factor", [0.0, 0.5, 1.27, 2.0, 5.0])
def test_sharpness_is_torchvisions_within_a_level(rng, factor):
    changed = 0
    for name, a in _images(rng).items():
        got = _run(ops.RandomAdjustSharpness(factor, p=1.0), a)
        assert _diff(got, ref_sharpness_tv(a, factor)) <= 1, name
        assert _diff(got, ref_sharpness_round(a, factor)) <= 1, name
        # The border keeps its own pixels, whatever the factor.
        assert np.array_equal(got[[0, -1]], a[[0, -1]]) and np.array_equal(got[:, [0, -1]], a[:, [0, -1]]), name
        changed += not np.array_equal(got, a)
    assert changed >= 4


def test_sharpness_factor_one_and_tiny_or_flat_images_are_unchanged(rng):
    images = _images(rng)
    for name, a in images.items():
        assert np.array_equal(_run(ops.RandomAdjustSharpness(1.0, p=1.0), a), a), name
    for factor in (0.0, 2.0, 7.5):
        for a in (images["one_pixel"], images["two_by_five"], random_image(rng, 5, 2), random_image(rng, 2, 2, 1),
                  images["flat_rgb"], images["flat_gray"]):
            assert np.array_equal(_run(ops.RandomAdjustSharpness(factor, p=1.0), a), a)
    # 3x3: only the centre pixel is off the border.
    a = random_image(rng, 3, 3)
    got = _run(ops.RandomAdjustSharpness(0.0, p=1.0), a)
    centre = (a.astype(np.int64).sum(axis=(0, 1)) + 4 * a[1, 1].astype(np.int64)) / 13.0
    assert np.array_equal(got[1, 1], np.floor(centre + 0.5).astype(np.uint8))
    got[1, 1] = a[1, 1]
    assert np.array_equal(got, a)


@pytest.mark.parametrize("factor", [0.0, 0.5, 0.73, 1.0, 1.27, 2.0])
def test_brightness_curve_is_a_rounded_product(rng, factor):
    v = np.arange(256, dtype=np.float64)
    for channels in (3, 1):
        tables = tone_tables(np.array([[BRIGHTNESS, factor]]), None, channels)
        assert tables.shape == (1, channels, 256) and tables.dtype == np.uint8
        expected = _round(factor * v)
        tv = np.clip(factor * v, 0, 255).astype(np.uint8)  # torchvision's blend with black, truncated
        for k in range(channels):
            assert _diff(tables[0, k], expected) <= 1 and _diff(tables[0, k], tv) <= 1
            if factor in (0.0, 0.5, 1.0, 2.0):  # exact in float32
                assert np.array_equal(tables[0, k], expected)
    for name, a in _images(rng).items():
        got = _post.tone(torch.from_numpy(a), np.array([BRIGHTNESS, factor])).numpy()
        assert _diff(got, _round(factor * a.astype(np.float64))) <= 1, name


@pytest.mark.parametrize("factor", [0.0, 0.1, 0.73, 1.0, 1.27, 1.9])
def test_contrast_curve_blends_with_the_mean_gray_level(rng, factor):
    for name, a in _images(rng).items():
        m = ref_mean_gray(a)
        hist = np.stack([np.bincount(a[..., k].reshape(-1), minlength=256) for k in range(a.shape[2])])[None]
        table = tone_tables(np.array([[CONTRAST, factor]]), hist, a.shape[2])[0]
        expected = _round(factor * np.arange(256.0) + (1.0 - factor) * m)
        for k in range(a.shape[2]):
            assert _diff(table[k], expected) <= 1, name
        got = _post.tone(torch.from_numpy(a), np.array([CONTRAST, factor])).numpy()
        assert _diff(got, _round(factor * a.astype(np.float64) + (1.0 - factor) * m)) <= 1, name
        if factor == 1.0:
            assert np.array_equal(got, a), name
        if factor == 0.0:  # every pixel becomes the mean gray level
            assert np.all(np.abs(got.astype(np.float64) - m) <= 0.5 + 1e-4), name


def test_contrast_uses_the_gray_weights_not_the_channel_means():
    a = np.zeros((4, 4, 3), np.uint8)
    a[..., 0] = 200  # red only: gray mean 0.2989 * 200 = 59.78
    got = _post.tone(torch.from_numpy(a), np.array([CONTRAST, 0.0])).numpy()
    assert np.all(got == 60)
    a = a[..., [1, 0, 2]]  # green only: 0.587 * 200 = 117.4
    assert np.all(_post.tone(torch.from_numpy(np.ascontiguousarray(a)), np.array([CONTRAST, 0.0])).numpy() == 117)


# --- p, through a Loader over real JPEGs ------------------------------------------------------------------

N = 96


async def _loaded(*post, seed: int = 5, channels: int = 3) -> dict[str, torch.Tensor]:
    return await cropped_images(jpeg_items(N, 47, 30, 36), *post, size=20, seed=seed, channels=channels)


# (make(p), exact reference of the drawn op, tolerance against it)
P_OPS = {
    "posterize": (lambda p: ops.RandomPosterize(3, p=p), lambda a: ref_posterize(a, 3), 0),
    "solarize": (lambda p: ops.RandomSolarize(128, p=p), lambda a: ref_solarize(a, 128), 0),
    "invert": (lambda p: ops.RandomInvert(p=p), ref_invert, 0),
    "equalize": (lambda p: ops.RandomEqualize(p=p), ref_equalize, 0),
    "autocontrast": (lambda p: ops.RandomAutocontrast(p=p), ref_autocontrast_round, 0),
    "sharpness": (lambda p: ops.RandomAdjustSharpness(2.0, p=p), lambda a: ref_sharpness_tv(a, 2.0), 1),
}


@pytest.mark.parametrize("name", list(P_OPS))
async def test_p_applies_the_op_to_that_share_of_the_samples_and_leaves_the_rest_exactly(name):
    make, ref, tolerance = P_OPS[name]
    plain, never, always, half = (await _loaded(), await _loaded(make(0.0)), await _loaded(make(1.0)),
                                  await _loaded(make(0.5)))
    assert len(plain) == N and all(torch.equal(never[k], plain[k]) for k in plain)  # p=0: nothing changes
    movable = 0
    for key, image in plain.items():  # p=1: every sample is the op's result, so changed wherever the op changes it
        expected = ref(image.numpy())
        assert _diff(always[key].numpy(), expected) <= tolerance, key
        if not np.array_equal(expected, image.numpy()):
            movable += 1
            assert not torch.equal(always[key], image), key
    assert movable >= 0.9 * N
    kept = [k for k in plain if torch.equal(half[k], plain[k])]
    changed = [k for k in plain if torch.equal(half[k], always[k]) and not torch.equal(always[k], plain[k])]
    assert len(set(kept) | set(changed)) == N  # each sample exactly one or the other
    assert 0.3 * N < len(changed) < 0.7 * N


async def test_one_channel_images_through_the_loader():
    plain = await _loaded(channels=1)
    got = await _loaded(ops.RandomEqualize(p=1.0), ops.RandomPosterize(5, p=1.0), channels=1)
    for key, image in plain.items():
        assert image.shape == (20, 20, 1)
        assert np.array_equal(got[key].numpy(), ref_posterize(ref_equalize(image.numpy()), 5)), key


def _chain(p: float) -> list[ops.PostOp]:
    return [ops.RandomPosterize(4, p=p), ops.RandomSolarize(150, p=p), ops.RandomInvert(p=p), ops.RandomAutocontrast(p=p),
            ops.RandomEqualize(p=p), ops.RandomAdjustSharpness(1.8, p=p)]


async def test_same_seed_same_bytes_other_seed_other_draws():
    first, second, other = await _loaded(*_chain(0.5)), await _loaded(*_chain(0.5)), await _loaded(*_chain(0.5), seed=6)
    assert first.keys() == second.keys() == other.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


# --- arguments ----------------------------------------------------------------------------------------------

BAD = [
    ("RandomPosterize", lambda: ops.RandomPosterize(9)),
    ("RandomPosterize", lambda: ops.RandomPosterize(-1)),
    ("RandomPosterize", lambda: ops.RandomPosterize(2.5)),
    ("RandomPosterize", lambda: ops.RandomPosterize("4")),
    ("RandomSolarize", lambda: ops.RandomSolarize(300)),
    ("RandomSolarize", lambda: ops.RandomSolarize(-0.5)),
    ("RandomSolarize", lambda: ops.RandomSolarize(float("nan"))),
    ("RandomAdjustSharpness", lambda: ops.RandomAdjustSharpness(-1)),
    ("RandomAdjustSharpness", lambda: ops.RandomAdjustSharpness(float("inf"))),
    ("RandomPosterize", lambda: ops.RandomPosterize(4, p=1.5)),
    ("RandomSolarize", lambda: ops.RandomSolarize(100, p=1.5)),
    ("RandomInvert", lambda: ops.RandomInvert(p=1.5)),
    ("RandomAutocontrast", lambda: ops.RandomAutocontrast(p=-0.1)),
    ("RandomEqualize", lambda: ops.RandomEqualize(p=1.5)),
    ("RandomAdjustSharpness", lambda: ops.RandomAdjustSharpness(2.0, p=1.5)),
    ("RandomInvert", lambda: ops.RandomInvert(p=float("nan"))),
]


@pytest.mark.parametrize("name, make", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_arguments_raise_config_error_naming_the_op(name, make):
    with pytest.raises(ConfigError, match=name):
        make()


def test_good_arguments_are_kept():
    assert ops.RandomPosterize(np.int64(3)).bits == 3 and ops.RandomPosterize(0).bits == 0
    assert ops.RandomSolarize(255).threshold == 255.0 and ops.RandomSolarize(0).threshold == 0.0
    assert ops.RandomAdjustSharpness(0).sharpness_factor == 0.0
    assert all(op.randoms == 1 and op.p == 0.5 for op in (ops.RandomInvert(), ops.RandomEqualize(), ops.RandomAutocontrast()))


# --- inside a Pipeline, after the crop and before Normalize ----------------------------------------------------


async def test_cpu_pipeline_with_tone_ops_between_crop_and_normalize(rng, make_executor):
    blobs = [jpeg_bytes(rng, int(rng.integers(30, 60)), int(rng.integers(30, 60))) for _ in range(10)]
    b = batch([sample(i, d) for i, d in enumerate(blobs)])
    crop = [ops.Decode(), ops.RandomResizedCrop(24)]
    tone = _chain(1.0)
    pipe = ops.Pipeline([*crop, *tone, ops.Normalize((0.0, 0.0, 0.0), (1.0, 1.0, 1.0), layout="HWC")])
    assert tuple(pipe.post_ops) == tuple(tone)
    plain = (await make_executor(ops.Pipeline(crop, layout="HWC"), seed=3).run(b)).data["image"]
    toned = (await make_executor(ops.Pipeline([*crop, *tone], layout="HWC"), seed=3).run(b)).data["image"]
    normalized = (await make_executor(pipe, seed=3).run(b)).data["image"]
    assert toned.shape == plain.shape == (10, 24, 24, 3) and toned.dtype == torch.uint8
    assert normalized.shape == (10, 24, 24, 3) and normalized.dtype == torch.float32
    torch.testing.assert_close(normalized, toned.float() / 255.0, rtol=0, atol=1e-6)
    for i in range(10):  # the chain, step by step from the references
        a = plain[i].numpy()
        a = ref_equalize(ref_autocontrast_round(ref_invert(ref_solarize(ref_posterize(a, 4), 150))))
        assert _diff(toned[i].numpy(), ref_sharpness_round(a, 1.8)) <= 1, i
