"""The post ops (ColorTwist, Rotate, WarpAffine, GaussianBlur) on the CPU path, against independent
float64 references written out here from the formulas in ops/README.md, and Pillow.

Bounds: the CPU path rounds once (half up) from float32; the references round the float64 value the
same way, so every op is within 1 level of them (a float32 value within ~1e-5 of a half level may
round the other way). Against Pillow's rotate: Pillow truncates its bilinear result instead of
rounding, so where both read only image pixels ours is Pillow's or one more.
"""

from __future__ import annotations

import colorsys
import io

import numpy as np
import pytest
import torch
from PIL import Image

from headrace import ConfigError, ops
from headrace.ops import (
    CenterCrop,
    ColorTwist,
    Decode,
    Flip,
    GaussianBlur,
    Normalize,
    Pipeline,
    RandomResizedCrop,
    Resize,
    Rotate,
    WarpAffine,
    uniforms,
)
from headrace.ops._geometry import index_affine
from headrace.ops.cpu import _post as _cpu_post
from headrace.ops.cuda import _post as _cuda_post

from ops_refs import batch, random_image, ref_warp, sample

# --- float64 references, from the documented formulas --------------------------------------------

RGB2YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.321], [0.211, -0.523, 0.311]])


def ref_color(a: np.ndarray, b: float, c: float, s: float, h: float) -> np.ndarray:
    """b * (c * (T x - 128) + 128), T: YIQ, scale I and Q by s, rotate them by 2 pi h (DALI's sign), back."""
    x = a.astype(np.float64)
    if a.shape[2] == 1:
        v = b * (c * (x - 128.0) + 128.0)
    else:
        yiq = x @ RGB2YIQ.T
        t = 2 * np.pi * h
        i, q = yiq[..., 1].copy(), yiq[..., 2].copy()
        yiq[..., 1] = s * (np.cos(t) * i + np.sin(t) * q)
        yiq[..., 2] = s * (-np.sin(t) * i + np.cos(t) * q)
        rgb = yiq @ np.linalg.inv(RGB2YIQ).T
        v = b * (c * (rgb - 128.0) + 128.0)
    return np.clip(np.floor(v + 0.5), 0, 255)


def ref_rotation(degrees: float, h: int, w: int) -> np.ndarray:
    """Pillow's ``rotate`` matrix (Image.py): output to input, about (w / 2, h / 2)."""
    a = -np.radians(degrees)
    m = np.array([[np.cos(a), np.sin(a), 0.0], [-np.sin(a), np.cos(a), 0.0]])
    cx, cy = w / 2.0, h / 2.0
    m[0, 2] = m[0, 0] * -cx + m[0, 1] * -cy + cx
    m[1, 2] = m[1, 0] * -cx + m[1, 1] * -cy + cy
    return m


def ref_gaussian(sigma: float, k: int) -> np.ndarray:
    x = np.arange(k) - (k - 1) / 2.0
    pdf = np.exp(-0.5 * (x / sigma) ** 2)
    return pdf / pdf.sum()


def ref_blur(a: np.ndarray, wx: np.ndarray, wy: np.ndarray) -> np.ndarray:
    """Separable correlation with NumPy's "reflect" padding, float64, one rounding."""
    rx, ry = len(wx) // 2, len(wy) // 2
    p = np.pad(a.astype(np.float64), ((ry, ry), (rx, rx), (0, 0)), mode="reflect")
    h, w = a.shape[:2]
    rows = sum(wx[k] * p[:, k : k + w] for k in range(len(wx)))
    v = sum(wy[k] * rows[k : k + h] for k in range(len(wy)))
    return np.clip(np.floor(v + 0.5), 0, 255)


def _within(got: torch.Tensor, ref: np.ndarray, bound: int = 1) -> float:
    got = got.numpy().astype(np.float64)
    assert got.shape == ref.shape
    diff = np.abs(got - ref)
    assert diff.max() <= bound, diff.max()
    return float((diff > 0).mean())


def _sizes(rng, n):
    return [(1, 1), (1, 9), (7, 1), (2, 2)] + [(int(rng.integers(3, 90)), int(rng.integers(3, 90))) for _ in range(n)]


# --- pixels against the references ---------------------------------------------------------------


@pytest.mark.parametrize("channels", [3, 1])
def test_color_twist_matches_the_float64_formula(rng, channels):
    op = ColorTwist(0.9, 0.9, 0.9, 0.5)
    offs = []
    for h, w in _sizes(rng, 12):
        a = random_image(rng, h, w, channels)
        u = rng.random((1, 4))
        b, c, s, hue = op.params(u)[0]
        got = _cpu_post.apply(torch.from_numpy(a), (op,), [u])
        offs.append(_within(got, ref_color(a, b, c, s, hue)))
    assert np.mean(offs) < 1e-3  # an off-by-one is a float32 value next to a half level


def test_gray_takes_only_brightness_and_contrast(rng):
    a = random_image(rng, 30, 40, 1)
    u = rng.random((1, 4))
    twisted = _cpu_post.apply(torch.from_numpy(a), (ColorTwist(0.5, 0.5, 0.9, 0.5),), [u])
    plain = _cpu_post.apply(torch.from_numpy(a), (ColorTwist(0.5, 0.5),), [u])
    assert torch.equal(twisted, plain)


def test_positive_hue_turns_red_towards_green_as_torchvision(rng):
    a = np.array([[[200, 40, 40], [40, 180, 60], [50, 60, 190]]], dtype=np.uint8)
    out = _cpu_post.color_twist(torch.from_numpy(a), ColorTwist.matrices(np.array([[1, 1, 1, 0.04]]), 3)[0]).numpy()
    for before, after in zip(a[0], out[0]):
        h0 = colorsys.rgb_to_hsv(*(before / 255))[0]
        h1 = colorsys.rgb_to_hsv(*(after / 255))[0]
        assert 0.0 < (h1 - h0) % 1.0 < 0.1  # YIQ rotation: close to, not exactly, the HSV shift


def test_saturation_zero_is_gray(rng):
    a = random_image(rng, 20, 20, 3)
    out = _cpu_post.color_twist(torch.from_numpy(a), ColorTwist.matrices(np.array([[1, 1, 0, 0.3]]), 3)[0]).numpy()
    luma = np.floor(a.astype(np.float64) @ RGB2YIQ[0] + 0.5)
    assert np.abs(out - luma[..., None]).max() <= 1


@pytest.mark.parametrize("channels", [3, 1])
def test_rotate_and_warp_match_the_float64_bilinear(rng, channels):
    rot = Rotate(180, fill=(10, 200, 30)[:channels])
    warp = WarpAffine([[0.8, 0.35, 3.25], [-0.25, 1.2, -2.5]], fill=(250, 0, 99)[:channels])
    offs = []
    for h, w in _sizes(rng, 10):
        a = random_image(rng, h, w, channels)
        u = rng.random((1, 1))
        m = ref_rotation(rot.params(u)[0], h, w)
        offs.append(_within(_cpu_post.apply(torch.from_numpy(a), (rot,), [u]), ref_warp(a, m, rot.fill)))
        offs.append(_within(_cpu_post.apply(torch.from_numpy(a), (warp,), [None]), ref_warp(a, np.array(warp.matrix), warp.fill)))
    assert np.mean(offs) < 1e-3


def test_rotate_matches_pillow_inside_the_image(rng):
    # Pillow truncates its bilinear value; near the border it also clamps to the edge where we
    # blend with the fill, so compare where the sample point has all four neighbours inside.
    for angle in (-33.0, 7.5, 90.0, 151.0):
        h, w = int(rng.integers(20, 70)), int(rng.integers(20, 70))
        a = random_image(rng, h, w, 3)
        pil = np.asarray(Image.fromarray(a).rotate(angle, resample=Image.Resampling.BILINEAR, fillcolor=(5, 6, 7)))
        got = _cpu_post.warp(torch.from_numpy(a), index_affine(ref_rotation(angle, h, w))[0], (5, 6, 7)).numpy()
        m = ref_rotation(angle, h, w)
        ys, xs = np.mgrid[0:h, 0:w] + 0.5
        sx = m[0, 0] * xs + m[0, 1] * ys + m[0, 2] - 0.5
        sy = m[1, 0] * xs + m[1, 1] * ys + m[1, 2] - 0.5
        inside = (sx >= 0.01) & (sx <= w - 1.01) & (sy >= 0.01) & (sy <= h - 1.01)
        diff = got.astype(int)[inside] - pil.astype(int)[inside]
        assert inside.sum() > h * w // 4 and diff.min() >= 0 and diff.max() <= 1


def test_rotate_by_90_degrees_is_rot90_exactly(rng):
    a = random_image(rng, 31, 31, 3)
    got = _cpu_post.apply(torch.from_numpy(a), (Rotate((90, 90)),), [np.zeros((1, 1))]).numpy()
    assert np.array_equal(got, np.rot90(a, k=1))  # counter-clockwise


def test_rotation_matrix_is_pillows():
    h, w = np.array([30, 41]), np.array([50, 17])
    got = Rotate((-20, 40)).affine(np.array([[0.25], [0.9]]), h, w)
    for i, deg in enumerate((-5.0, 34.0)):
        np.testing.assert_allclose(got[i], ref_rotation(deg, h[i], w[i]), atol=1e-12)


def test_warp_fill_outside_and_blended_at_the_edge():
    a = np.full((4, 6, 3), 100, dtype=np.uint8)
    out = _cpu_post.apply(torch.from_numpy(a), (WarpAffine([[1, 0, -1000], [0, 1, 0]], fill=(3, 140, 255)),), [None])
    assert (out.numpy() == [3, 140, 255]).all()
    out = _cpu_post.apply(torch.from_numpy(a), (WarpAffine([[1, 0, -0.5], [0, 1, 0]], fill=200),), [None]).numpy()
    assert (out[:, 0] == 150).all() and (out[:, 1:] == 100).all()


@pytest.mark.parametrize("channels", [3, 1])
def test_blur_matches_the_float64_separable_filter(rng, channels):
    offs = []
    for op in (GaussianBlur((5, 9), sigma=(0.1, 3.0)), GaussianBlur(3), GaussianBlur(31, sigma=(4.0, 9.0))):
        for h, w in _sizes(rng, 6):  # includes images narrower than the kernel: reflected again
            a = random_image(rng, h, w, channels)
            u = rng.random((1, 1))
            sigma = op.params(u)[0]
            ref = ref_blur(a, ref_gaussian(sigma, op.kernel_size[0]), ref_gaussian(sigma, op.kernel_size[1]))
            offs.append(_within(_cpu_post.apply(torch.from_numpy(a), (op,), [u]), ref))
    assert np.mean(offs) < 1e-3


def test_reflect_is_numpys_and_torchs():
    for n in (1, 2, 3, 7):
        for r in (0, 1, 3, 20):
            i = np.arange(-r, n + r)
            np.testing.assert_array_equal(_cpu_post.reflect(i, n), np.pad(np.arange(n), r, mode="reflect"))
            if r < n:
                t = torch.nn.functional.pad(torch.arange(n, dtype=torch.float32)[None, None], (r, r), mode="reflect")
                np.testing.assert_array_equal(_cpu_post.reflect(i, n), t[0, 0].long().numpy())


def test_gaussian_weights_are_torchvisions_formula():
    op = GaussianBlur((3, 7), sigma=(0.5, 1.5))
    wx, wy = op.tables(np.array([[0.0], [1.0]]), None, None, 3)
    np.testing.assert_allclose(wx[0], ref_gaussian(0.5, 3))
    np.testing.assert_allclose(wy[1], ref_gaussian(1.5, 7))
    np.testing.assert_allclose(wy.sum(1), 1.0)


# --- identity, determinism, ranges, positions ----------------------------------------------------

IDENTITY = [
    ColorTwist(),
    ColorTwist((1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (0.0, 0.0)),
    Rotate(0),
    WarpAffine([[1, 0, 0], [0, 1, 0]], fill=9),
    GaussianBlur(1),
    GaussianBlur(3, sigma=0.1),  # outer weights 2e-22
]


@pytest.mark.parametrize("op", IDENTITY, ids=repr)
@pytest.mark.parametrize("channels", [3, 1])
def test_identity_parameters_give_the_input_back_exactly(rng, op, channels):
    for h, w in _sizes(rng, 5):
        a = random_image(rng, h, w, channels)
        u = None if not op.randoms else rng.random((1, op.randoms))
        assert np.array_equal(_cpu_post.apply(torch.from_numpy(a), (op,), [u]).numpy(), a)


def _png(a):
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "PNG")
    return buf.getvalue()


async def test_identity_post_ops_leave_the_pipeline_output_alone(rng, make_executor):
    blobs = [_png(random_image(rng, int(rng.integers(30, 80)), int(rng.integers(30, 80)))) for _ in range(8)]
    b = batch([sample(i, d) for i, d in enumerate(blobs)])
    geometry = [RandomResizedCrop(24), Flip()]
    plain = await make_executor(Pipeline([Decode(), *geometry, Normalize()]), seed=3).run(b)
    ident = await make_executor(Pipeline([Decode(), *geometry, *IDENTITY, Normalize()]), seed=3).run(b)
    assert torch.equal(plain.data["image"], ident.data["image"])  # geometry's random keys unchanged


async def test_same_sample_same_parameters_whatever_the_batch(rng, make_executor):
    blobs = [_png(random_image(rng, 40, 50)) for _ in range(12)]
    pipe = Pipeline([Decode(), CenterCrop(32), ColorTwist(0.5, 0.5, 0.5, 0.2), GaussianBlur(5), Rotate(45, fill=(0, 50, 90))])
    whole = await make_executor(pipe, seed=9, num_threads=2).run(batch([sample(i, d) for i, d in enumerate(blobs)], epoch=2))
    part = await make_executor(pipe, seed=9, num_threads=1).run(batch([sample(i, blobs[i]) for i in range(5, 12)], epoch=2))
    assert torch.equal(whole.data["image"][5:], part.data["image"])
    other = await make_executor(pipe, seed=9).run(batch([sample(i, d) for i, d in enumerate(blobs)], epoch=3))
    assert not torch.equal(whole.data["image"], other.data["image"])


def test_post_op_positions_and_uniforms():
    pipe = Pipeline([RandomResizedCrop(8), Flip(), ColorTwist(0.1), WarpAffine([[1, 0, 0], [0, 1, 0]]), GaussianBlur(3), Normalize()])
    assert pipe.image_ops == (RandomResizedCrop(8), Flip())
    assert [type(op) for op in pipe.post_ops] == [ColorTwist, WarpAffine, GaussianBlur]
    assert pipe.post_positions == (3, 4, 5) and all(pipe.ops[p] is op for p, op in zip(pipe.post_positions, pipe.post_ops))
    idx = np.array([4, 9, 2])
    us = pipe.post_uniforms(1, 2, idx)
    np.testing.assert_array_equal(us[0], uniforms(1, 2, 3, idx, 4))
    assert us[1] is None
    np.testing.assert_array_equal(us[2], uniforms(1, 2, 5, idx, 1))
    assert pipe.output_size() == (8, 8)


def test_ranges_follow_colorjitter():
    assert ColorTwist(0.5).brightness == (0.5, 1.5)
    assert ColorTwist(1.5).brightness == (0.0, 2.5)
    assert ColorTwist(contrast=(0.2, 3)).contrast == (0.2, 3.0)
    assert ColorTwist(hue=0.5).hue == (-0.5, 0.5)
    assert ColorTwist().saturation == (1.0, 1.0)
    assert Rotate(30).degrees == (-30.0, 30.0) and Rotate((5, 10)).degrees == (5.0, 10.0)
    assert GaussianBlur(5).sigma == (0.1, 2.0) and GaussianBlur((3, 5), sigma=1.5).sigma == (1.5, 1.5)
    assert GaussianBlur((3, 5)).kernel_size == (3, 5)


def test_parameters_stay_in_their_ranges():
    u = np.random.default_rng(0).random((5000, 4))
    u[0], u[1] = 0.0, np.nextafter(1.0, 0.0)
    f = ColorTwist((0.5, 1.5), 0.3, (0.0, 2.0), 0.2).params(u)
    for k, (lo, hi) in enumerate([(0.5, 1.5), (0.7, 1.3), (0.0, 2.0), (-0.2, 0.2)]):
        assert lo <= f[:, k].min() and f[:, k].max() <= hi and f[0, k] == lo and hi - f[1, k] < 1e-12
        assert abs(f[:, k].mean() - (lo + hi) / 2) < 0.05 * (hi - lo)
    a = Rotate((-10, 25)).params(u[:, :1])
    assert -10 <= a.min() and a.max() <= 25
    s = GaussianBlur(3, sigma=(0.1, 2.0)).params(u[:, :1])
    assert 0.1 <= s.min() and s.max() <= 2.0


BAD = [
    lambda: ColorTwist(brightness=-0.1),
    lambda: ColorTwist(contrast=(1.5, 0.5)),
    lambda: ColorTwist(saturation=(-0.1, 1.0)),
    lambda: ColorTwist(brightness=("a", "b")),
    lambda: ColorTwist(brightness=float("nan")),
    lambda: ColorTwist(brightness=float("inf")),
    lambda: ColorTwist(brightness=(1.0, float("inf"))),
    lambda: ColorTwist(brightness=True),
    lambda: ColorTwist(hue=0.6),
    lambda: ColorTwist(hue=(-0.7, 0.0)),
    lambda: ColorTwist(hue="0.1"),
    lambda: Rotate(-5),
    lambda: Rotate((10, 5)),
    lambda: Rotate(float("nan")),
    lambda: Rotate(None),
    lambda: Rotate(10, fill=300),
    lambda: Rotate(10, fill=-1),
    lambda: Rotate(10, fill="x"),
    lambda: Rotate(10, fill=(1, 2, 3, 4, 5)),
    lambda: WarpAffine([[1, 0], [0, 1]]),
    lambda: WarpAffine([[1, 0, 0]]),
    lambda: WarpAffine([[1, 0, 0], [0, 1, float("nan")]]),
    lambda: WarpAffine(None),
    lambda: WarpAffine([[1, 0, 0], [0, 1, 0]], fill=256),
    lambda: GaussianBlur(4),
    lambda: GaussianBlur((3, 4)),
    lambda: GaussianBlur(0),
    lambda: GaussianBlur(-3),
    lambda: GaussianBlur(2.5),
    lambda: GaussianBlur(True),
    lambda: GaussianBlur((3, 3, 3)),
    lambda: GaussianBlur(3, sigma=0),
    lambda: GaussianBlur(3, sigma=(2.0, 1.0)),
    lambda: GaussianBlur(3, sigma=(0.0, 1.0)),
    lambda: GaussianBlur(3, sigma="a"),
    lambda: GaussianBlur(3, sigma=(1.0, float("inf"))),
    lambda: Pipeline([ColorTwist(), Resize(8)]),
    lambda: Pipeline([Rotate(5), Flip()]),
    lambda: Pipeline([Decode("gray"), Rotate(5, fill=(1, 2, 3))]),
    lambda: Pipeline([Normalize(), ColorTwist()]),
]


@pytest.mark.parametrize("make", BAD)
def test_bad_arguments_raise_config_error(make):
    with pytest.raises(ConfigError):
        make()


# --- the GPU path's host-side tables (pure NumPy) -------------------------------------------------


def test_index_affine_folds_the_half_pixels():
    m = np.array([[[0.8, 0.35, 3.25], [-0.25, 1.2, -2.5]]])
    a = index_affine(m)[0].astype(np.float64)
    for x, y in [(0, 0), (5, 9), (100, 3)]:
        want = m[0] @ np.array([x + 0.5, y + 0.5, 1.0]) - 0.5
        np.testing.assert_allclose(a @ np.array([x, y, 1.0]), want, atol=1e-4)


def test_kernel_tables():
    mats = ColorTwist.matrices(np.array([[1.2, 0.8, 1.1, 0.1], [1, 1, 1, 0]]), 3)
    t = _cuda_post.color_table(mats, 3)
    assert t.dtype == np.float32 and t.shape == (2, 12)
    np.testing.assert_allclose(t[1], [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0], atol=1e-7)
    gray = _cuda_post.color_table(ColorTwist.matrices(np.array([[1.5, 0.5, 1, 0]]), 1), 1)
    np.testing.assert_allclose(gray[0], [0.75, 0, 0, 1.5 * 128 * 0.5] + [0] * 8)
    w = _cuda_post.warp_table(np.array([[[1, 0, 2], [0, 1, -3]]] * 3), np.array([7.0, 8.0, 9.0]))
    assert w.shape == (3, 10) and w[2].tolist() == [1, 0, 2, 0, 1, -3, 7, 8, 9, 0]
    b = _cuda_post.blur_table(np.ones((2, 3)), np.zeros((2, 5)))
    assert b.shape == (2, 8) and b.dtype == np.float32


def test_describe_takes_address_tuples():
    rows = _cuda_post.describe([(1000, 4, 5, 16, 3), (2000, 1, 1, 3, 3)])
    assert rows.tolist() == [[1000, 4, 5, 16, 3], [2000, 1, 1, 3, 3]]
    with pytest.raises(ValueError):
        _cuda_post.describe([(1000, 4, 5, 14, 3)])  # a row stride shorter than a row
    with pytest.raises(ValueError):
        _cuda_post.describe([(1000, 0, 5, 15, 3)])


def test_each_sample_moves_between_the_buffers_on_its_own():
    c, w, b = ColorTwist(0.1), Rotate(5), GaussianBlur(3)
    where = np.full(4, -1)
    # A colour pass on samples 0 and 1: out of the input into buffer 0 (not in place in the input).
    assert [a.tolist() for a in _cuda_post.route(c, where, np.array([0, 1]), inplace=False)] == [[-1, -1], [0, 0]]
    # A warp on samples 1 and 2: each into the buffer it is not in.
    assert [a.tolist() for a in _cuda_post.route(w, where, np.array([1, 2]), inplace=False)] == [[0, -1], [1, 0]]
    # A colour pass on all: in place where the pixels are ours, out of the input for sample 3.
    assert [a.tolist() for a in _cuda_post.route(c, where, np.arange(4), inplace=False)] == [[0, 1, 0, -1], [0, 1, 0, 0]]
    assert where.tolist() == [0, 1, 0, 0]
    # With inplace, the colour pass writes into the input; a blur still needs a buffer.
    where = np.full(2, -1)
    assert [a.tolist() for a in _cuda_post.route(c, where, np.arange(2), inplace=True)] == [[-1, -1], [-1, -1]]
    assert [a.tolist() for a in _cuda_post.route(b, where, np.array([1]), inplace=True)] == [[-1], [0]]


def test_the_samples_a_pass_changes():
    u = np.array([[0.1, 0.2, 0.3, 0.4, 0.9], [0.1, 0.2, 0.3, 0.4, 0.1]])  # ColorTwist p=0.5: the last uniform decides
    h, w = np.array([8, 8]), np.array([9, 9])
    twist = ColorTwist(0.4, 0.4, 0.4, 0.1, p=0.5)
    assert _cuda_post.changed(twist, twist.tables(u, h, w, 3)).tolist() == [False, True]
    blur = GaussianBlur(5, p=0.5)
    assert _cuda_post.changed(blur, blur.tables(u[:, [0, 4]], h, w, 3)).tolist() == [False, True]
    rotate = ops.Rotate((0, 10))
    assert _cuda_post.changed(rotate, rotate.tables(np.array([[0.0], [0.5]]), h, w, 3)).tolist() == [False, True]
    solarize = ops.RandomSolarize(100, p=0.5)
    assert _cuda_post.changed(solarize, solarize.tables(np.array([[0.7], [0.2]]), h, w, 3)).tolist() == [False, True]
    sharp = ops.RandomAdjustSharpness(2.0, p=0.5)
    assert _cuda_post.changed(sharp, sharp.tables(np.array([[0.7], [0.2]]), h, w, 3)).tolist() == [False, True]
