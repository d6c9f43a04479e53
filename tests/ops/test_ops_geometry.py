"""Resize, CenterCrop, RandomResizedCrop and Flip on batches of differently sized images, checked
against torchvision's rules (re-derived in ops_refs) and its uint8 tensor pixels.

The CPU path's semantics are torchvision's transforms on uint8 tensors: crops and flips move
pixels, and resize is ``interpolate(mode="bilinear", antialias=True)`` (``ops_refs.tv_resize``),
op by op, nothing fused. Bounds, uint8:
- every chain of ops: exact against the same chain of reference calls;
- each resize against the exact float64 resample (``exact_resize``, the filter Pillow and torch
  both approximate): within 1 + 1/64. torch rounds to uint8 after each of its two passes (at most
  1 together, as Pillow) and its weights are fixed-point (int16): the excess measured over 800
  random resizes, 100x shrinks included, was 0.002;
- each resize against Pillow's ``resize(BILINEAR)`` (what torchvision does to PIL images, and
  what this path did before it moved to torch): within 1; on these noisy test images 7% of the
  values differ, on the benchmark's photographs 1.5%.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from ops_refs import (
    batch,
    encode,
    exact_resize,
    pil_resize,
    random_image,
    sample,
    tv_center_crop,
    tv_resize,
    tv_resize_size,
    tv_rrc_params,
)
from PIL import Image

from headrace import ConfigError
from headrace.ops import CenterCrop, Decode, Flip, Pipeline, RandomCrop, RandomResize, RandomResizedCrop, Resize, uniforms
from headrace.ops._geometry import _resize_targets

TORCH_ROUNDING = 1 + 1 / 64  # torch's two rounded passes vs the exact resize (fixed-point weights: the 1/64)
PIL_DIFF = 1  # torch's resize vs Pillow's, uint8 levels


def sizes(rng, n, lo=20, hi=200):
    return [tuple(int(v) for v in rng.integers(lo, hi, 2)) for _ in range(n)]


async def run_hwc(make_executor, ops, arrays, *, seed=0, epoch=0):
    """PNG-encode ``arrays`` (lossless: the reference starts from the same pixels), run, return HWC arrays."""
    samples = [sample(i, encode(a, "PNG")) for i, a in enumerate(arrays)]
    out = await make_executor(Pipeline([Decode(), *ops], layout="HWC"), seed=seed).run(batch(samples, epoch))
    assert not out.failures, out.failures
    return [img.numpy() for img in out.data["image"]]


# --- Resize ---------------------------------------------------------------------------------------


async def test_resize_exact_size(make_executor, rng):
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 24)]
    outs = await run_hwc(make_executor, [Resize((37, 52))], arrays)
    for out, a in zip(outs, arrays):
        np.testing.assert_array_equal(out, tv_resize(a, 37, 52))
        assert np.abs(out - exact_resize(a, 37, 52)).max() <= TORCH_ROUNDING
        assert np.abs(out.astype(int) - pil_resize(a, 37, 52)).max() <= PIL_DIFF


def test_resize_shorter_side_rule():
    for h in range(1, 120, 7):
        for w in range(1, 400, 13):
            for size in (1, 7, 64, 224, 256):
                assert Resize(size).target(h, w) == tv_resize_size(h, w, size), (h, w, size)


@pytest.mark.parametrize(("size", "max_size"), [(800, 1333), (None, 640), (7, 8), (64, 100), (None, 1)])
def test_resize_max_size_rule(size, max_size):
    """torchvision's rule, both ways geometry is computed here: one image at a time (the CPU path)
    and a batch at once (the GPU path's planning)."""
    h, w = np.meshgrid(np.arange(1, 3000, 37), np.arange(1, 3000, 41))
    h, w = h.ravel(), w.ravel()
    op = Resize(size, max_size=max_size)
    batch_h, batch_w = _resize_targets(op, h, w)
    for i in range(len(h)):
        want = tv_resize_size(int(h[i]), int(w[i]), size, max_size)
        assert op.target(int(h[i]), int(w[i])) == want == (batch_h[i], batch_w[i]), (h[i], w[i])


@pytest.mark.parametrize("kwargs", [{"size": None}, {"size": 800, "max_size": 800}, {"size": 10, "max_size": 0},
                                    {"size": (20, 30), "max_size": 40}, {"size": 10, "max_size": 20.5},
                                    {"size": 10, "max_size": True}])
def test_resize_max_size_arguments(kwargs):
    with pytest.raises(ConfigError, match="Resize"):
        Resize(**kwargs)


async def test_resize_with_max_size(make_executor, rng):
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 16, 10, 200)]
    outs = await run_hwc(make_executor, [Resize(40, max_size=60)], arrays)
    for out, a in zip(outs, arrays):
        th, tw = tv_resize_size(*a.shape[:2], 40, 60)
        assert out.shape == (th, tw, 3) and max(th, tw) <= 60
        np.testing.assert_array_equal(out, tv_resize(a, th, tw))


async def test_resize_shorter_side(make_executor, rng):
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 24, 10, 200)]
    outs = await run_hwc(make_executor, [Resize(33)], arrays)
    for out, a in zip(outs, arrays):
        th, tw = tv_resize_size(*a.shape[:2], 33)
        assert out.shape == (th, tw, 3) and min(th, tw) == 33
        np.testing.assert_array_equal(out, tv_resize(a, th, tw))


async def test_two_resizes_run_in_turn(make_executor, rng):
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 8)]
    outs = await run_hwc(make_executor, [Resize(40), Resize((20, 30))], arrays)
    for out, a in zip(outs, arrays):
        np.testing.assert_array_equal(out, tv_resize(tv_resize(a, *tv_resize_size(*a.shape[:2], 40)), 20, 30))


# --- CenterCrop -----------------------------------------------------------------------------------


def test_center_crop_window_matches_torchvision():
    """Every placement, padded or not, for sizes on both sides of the crop (odd and even differences)."""
    for h in range(1, 30):
        for w in range(1, 30, 3):
            for size in ((8, 8), (9, 16), (17, 5)):
                a = np.arange(h * w, dtype=np.int64).reshape(h, w, 1) + 1  # no zero: padding is visible
                top, left, ch, cw = CenterCrop(size).window(h, w)
                got = np.zeros((ch, cw, 1), np.int64)
                ys, xs = slice(max(top, 0), min(top + ch, h)), slice(max(left, 0), min(left + cw, w))
                got[ys.start - top : ys.stop - top, xs.start - left : xs.stop - left] = a[ys, xs]
                np.testing.assert_array_equal(got, tv_center_crop(a, *size), err_msg=f"{h}x{w} -> {size}")


async def test_center_crop_pads_with_zeros(make_executor, rng):
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 24, 5, 60)]
    outs = await run_hwc(make_executor, [CenterCrop((31, 40))], arrays)
    assert any(a.shape[0] < 31 or a.shape[1] < 40 for a in arrays)
    for out, a in zip(outs, arrays):
        np.testing.assert_array_equal(out, tv_center_crop(a, 31, 40))


async def test_center_crop_then_resize_is_crop_first(make_executor, rng):
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 12, 40, 120)]
    outs = await run_hwc(make_executor, [CenterCrop(32), Resize((20, 24))], arrays)
    for out, a in zip(outs, arrays):
        np.testing.assert_array_equal(out, tv_resize(tv_center_crop(a, 32, 32), 20, 24))


@pytest.mark.parametrize("resize", [24, 57, (40, 90)])
async def test_resize_then_center_crop(make_executor, rng, resize):
    """The validation geometry: resize the whole image, then crop (as torchvision; not fused)."""
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 24, 20, 200)]
    outs = await run_hwc(make_executor, [Resize(resize), CenterCrop(24)], arrays)
    worst_pil = worst_exact = 0.0
    for out, a in zip(outs, arrays):
        th, tw = resize if isinstance(resize, tuple) else tv_resize_size(*a.shape[:2], resize)
        np.testing.assert_array_equal(out, tv_center_crop(tv_resize(a, th, tw), 24, 24))
        exact = tv_center_crop(exact_resize(a, th, tw), 24, 24)
        worst_pil = max(worst_pil, np.abs(out.astype(int) - tv_center_crop(pil_resize(a, th, tw), 24, 24)).max())
        worst_exact = max(worst_exact, np.abs(out - exact).max())
    assert worst_pil <= PIL_DIFF
    assert worst_exact <= TORCH_ROUNDING


async def test_resize_then_crop_touching_the_edges(make_executor, rng):
    """Crops that end on the resized image's border, and a whole-image window of a thin image
    resized far (the fused Pillow geometry composed these boxes in floating point)."""
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 24, 20, 200)]
    ops = [Resize((37, 41)), CenterCrop((37, 41)), Resize((29, 31)), RandomResizedCrop(9, scale=(0.9, 1.0))]
    outs = await run_hwc(make_executor, ops, arrays)
    assert all(out.shape == (9, 9, 3) for out in outs)
    # 187 * (3 / 187) > 3 in floating point: the whole-image window of a 3-wide image resized to 187.
    thin = [random_image(rng, 5, 3)]
    (out,) = await run_hwc(make_executor, [Resize((20, 187)), RandomResizedCrop(8, (1.0, 1.0), (0.1, 10.0))], thin)
    np.testing.assert_array_equal(out, tv_resize(tv_resize(thin[0], 20, 187), 8, 8))


# --- RandomResizedCrop ----------------------------------------------------------------------------


def check_window_rule(h, w, window, scale, ratio):
    """The window lies in the image and either honours the area and aspect ranges (up to the
    rounding of its sides to integers) or is torchvision's fallback: the largest centred crop with
    the aspect ratio clamped to the range."""
    top, left, ch, cw = window
    assert 0 <= top and 0 <= left and top + ch <= h and left + cw <= w and ch > 0 and cw > 0
    area = h * w
    in_range = (
        (cw - 0.5) * (ch - 0.5) <= scale[1] * area * (1 + 1e-9)
        and (cw + 0.5) * (ch + 0.5) >= scale[0] * area * (1 - 1e-9)
        and (cw - 0.5) / (ch + 0.5) <= ratio[1] * (1 + 1e-9)
        and (cw + 0.5) / (ch - 0.5 if ch > 0.5 else 1e-9) >= ratio[0] * (1 - 1e-9)
    )
    if in_range:
        return "sampled"
    in_ratio = w / h
    if in_ratio < ratio[0]:
        assert (cw, ch) == (w, round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        assert (cw, ch) == (round(h * ratio[1]), h)
    else:
        assert (cw, ch) == (w, h)
    assert (top, left) == ((h - ch) // 2, (w - cw) // 2)
    return "fallback"


@pytest.mark.parametrize(
    "scale, ratio",
    [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (3 / 4, 4 / 3)), ((0.25, 0.5), (0.5, 2.0)), ((1.0, 1.0), (1.0, 1.0))],
)
def test_rrc_window_matches_torchvision(scale, ratio):
    rrc = RandomResizedCrop(8, scale, ratio)
    shapes = [(h, w) for h in (1, 2, 7, 30, 64, 223) for w in (1, 3, 16, 64, 200, 900)]
    u = uniforms(11, 0, 1, np.arange(200), rrc.randoms)
    kinds = set()
    for h, w in shapes:
        for row in u:
            window = rrc.window(h, w, row)
            assert window == tv_rrc_params(h, w, scale, ratio, row), (h, w)
            kinds.add(check_window_rule(h, w, window, scale, ratio))
    assert kinds == {"sampled", "fallback"}  # both branches were exercised


async def test_rrc_pixels_are_crop_then_resize(make_executor, rng):
    """torchvision's resized_crop: crop, then resize only the crop (the filter does not reach
    outside the window). Same torch call, so exact."""
    rrc = RandomResizedCrop((24, 20), scale=(0.1, 0.9))
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 32)]
    outs = await run_hwc(make_executor, [rrc], arrays, seed=3, epoch=2)
    u = uniforms(3, 2, 1, np.arange(32), rrc.randoms)
    for i, (out, a) in enumerate(zip(outs, arrays)):
        top, left, ch, cw = tv_rrc_params(*a.shape[:2], rrc.scale, rrc.ratio, u[i])
        np.testing.assert_array_equal(out, tv_resize(a[top : top + ch, left : left + cw], 24, 20))


async def test_resize_then_rrc(make_executor, rng):
    """Resize, then RandomResizedCrop on the resized image: two resizes in turn."""
    rrc = RandomResizedCrop(16)
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 16, 40, 200)]
    outs = await run_hwc(make_executor, [Resize(48), rrc], arrays)
    u = uniforms(0, 0, 2, np.arange(16), rrc.randoms)  # RRC is op 2
    for i, (out, a) in enumerate(zip(outs, arrays)):
        th, tw = tv_resize_size(*a.shape[:2], 48)
        top, left, ch, cw = tv_rrc_params(th, tw, rrc.scale, rrc.ratio, u[i])
        np.testing.assert_array_equal(out, tv_resize(tv_resize(a, th, tw)[top : top + ch, left : left + cw], 16, 16))


# --- RandomCrop, RandomResize -------------------------------------------------------------------


def _where(out: np.ndarray, a: np.ndarray) -> set[tuple[int, int]]:
    """Every (top, left) at which ``out`` is a window of ``a``."""
    ch, cw = out.shape[:2]
    return {(t, l) for t in range(a.shape[0] - ch + 1) for l in range(a.shape[1] - cw + 1)
            if np.array_equal(a[t : t + ch, l : l + cw], out)}


async def test_random_crop_takes_a_window_at_its_drawn_place(make_executor, rng):
    crop = RandomCrop((12, 16))
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 24, 16, 40)]
    outs = await run_hwc(make_executor, [crop], arrays)
    u = uniforms(0, 0, 1, np.arange(24), crop.randoms)
    places = set()
    for i, (out, a) in enumerate(zip(outs, arrays)):
        h, w = a.shape[:2]
        top, left = min(int(u[i, 0] * (h - 12 + 1)), h - 12), min(int(u[i, 1] * (w - 16 + 1)), w - 16)
        assert out.shape == (12, 16, 3) and (top, left) in _where(out, a)
        places.add((top, left))
    assert len(places) > 12  # not one place for all


async def test_random_crop_past_the_edge_keeps_the_whole_image(make_executor, rng):
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 24, 4, 30)]
    outs = await run_hwc(make_executor, [RandomCrop(32)], arrays)
    offsets = set()
    for out, a in zip(outs, arrays):
        h, w = a.shape[:2]
        found = [(t, l) for t in range(33 - h) for l in range(33 - w) if np.array_equal(out[t : t + h, l : l + w], a)]
        assert found, "the image is whole somewhere inside the crop"
        t, l = found[0]
        rest = out.copy()
        rest[t : t + h, l : l + w] = 0
        assert not rest.any()  # and zeros around it
        offsets.add(found[0])
    assert len(offsets) > 12


async def test_random_resize_draws_each_samples_shorter_side(make_executor, rng):
    op = RandomResize(20, 36)
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 32, 24, 120)]
    outs = await run_hwc(make_executor, [op], arrays)
    u = uniforms(0, 0, 1, np.arange(32), op.randoms)
    shorter = set()
    for i, (out, a) in enumerate(zip(outs, arrays)):
        size = min(20 + int(u[i, 0] * 16), 35)  # torchvision: randint(min_size, max_size)
        th, tw = tv_resize_size(*a.shape[:2], size)
        np.testing.assert_array_equal(out, tv_resize(a, th, tw))
        shorter.add(min(out.shape[:2]))
    assert shorter <= set(range(20, 36)) and len(shorter) > 8


def test_random_resize_and_crop_arguments():
    for kwargs in ({"min_size": 0, "max_size": 4}, {"min_size": 8, "max_size": 8}, {"min_size": 8, "max_size": 4.5},
                   {"min_size": 8, "max_size": 16, "max_side": 10}):
        with pytest.raises(ConfigError, match="RandomResize|Resize"):
            RandomResize(**kwargs)
    with pytest.raises(ConfigError, match="RandomCrop"):
        RandomCrop(0)


# --- Flip -----------------------------------------------------------------------------------------


async def test_flip_follows_each_samples_uniform(make_executor, rng):
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 40, 10, 50)]
    outs = await run_hwc(make_executor, [Flip(0.5), Flip(0.3, vertical=True)], arrays, seed=9)
    u_h = uniforms(9, 0, 1, np.arange(40), 1)[:, 0]
    u_v = uniforms(9, 0, 2, np.arange(40), 1)[:, 0]
    for out, a, uh, uv in zip(outs, arrays, u_h, u_v):
        ref = a[:, ::-1] if uh < 0.5 else a
        ref = ref[::-1] if uv < 0.3 else ref
        np.testing.assert_array_equal(out, ref)
    assert 0 < (u_h < 0.5).sum() < 40 and 0 < (u_v < 0.3).sum() < 40


@pytest.mark.parametrize("p, flipped", [(0.0, False), (1.0, True)])
async def test_flip_certain(make_executor, rng, p, flipped):
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 10, 10, 50)]
    outs = await run_hwc(make_executor, [Flip(p)], arrays)
    for out, a in zip(outs, arrays):
        np.testing.assert_array_equal(out, np.fliplr(a) if flipped else a)


async def test_flip_then_crop_sees_the_flipped_image(make_executor, rng):
    a = random_image(rng, 30, 50)
    (out,) = await run_hwc(make_executor, [Flip(1.0), CenterCrop((30, 21)), Resize((15, 10))], [a])
    np.testing.assert_array_equal(out, tv_resize(tv_center_crop(np.fliplr(a), 30, 21), 15, 10))


async def test_training_geometry_end_to_end(make_executor, rng):
    """decode → RRC → flip, uint8 NCHW, against the reference chain built from the same uniforms.

    JPEG: the executor decodes only the crop window (nvImageCodec, when installed), the reference
    decodes the whole file with Pillow and crops; both are libjpeg-turbo, so exact."""
    rrc, flip = RandomResizedCrop(32), Flip(0.5)
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 24, 20, 200)]
    samples = [sample(i + 100, encode(a, "JPEG")) for i, a in enumerate(arrays)]
    out = await make_executor(Pipeline([Decode(), rrc, flip]), seed=1).run(batch(samples, 4))
    images = out.data["image"]
    assert images.shape == (24, 3, 32, 32) and images.dtype == torch.uint8
    idx = np.arange(100, 124)
    u_rrc, u_flip = uniforms(1, 4, 1, idx, rrc.randoms), uniforms(1, 4, 2, idx, 1)[:, 0]
    for i, s in enumerate(samples):
        decoded = np.asarray(Image.open(__import__("io").BytesIO(s.fields["jpg"])).convert("RGB"))
        top, left, ch, cw = tv_rrc_params(*decoded.shape[:2], rrc.scale, rrc.ratio, u_rrc[i])
        ref = tv_resize(decoded[top : top + ch, left : left + cw], 32, 32)
        ref = np.fliplr(ref) if u_flip[i] < 0.5 else ref
        np.testing.assert_array_equal(images[i].permute(1, 2, 0).numpy(), ref)


def test_output_size_is_known_when_the_geometry_fixes_it():
    assert Pipeline([Resize(10)]).output_size() is None
    assert Pipeline([Resize((10, 12)), Resize(5)]).output_size() == (5, 6)
    assert Pipeline([CenterCrop(8), Resize(16)]).output_size() == (16, 16)
    assert Pipeline([RandomResizedCrop((7, 9)), Flip()]).output_size() == (7, 9)
    assert math.prod(Pipeline([CenterCrop((3, 4))]).output_size()) == 12
