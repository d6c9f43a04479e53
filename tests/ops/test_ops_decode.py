"""Decode through CpuExecutor: JPEG and PNG, RGB and gray, alpha, EXIF orientation 1..8."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from ops_refs import UPRIGHT, batch, encode, pil_decode, random_image, sample, tv_resize, with_orientation
from PIL import Image, ImageOps

from headrace.ops import Decode, Pipeline, RandomResizedCrop, uniforms


def hwc(t: torch.Tensor) -> np.ndarray:
    """A CHW uint8 output row as an HWC array."""
    return t.permute(1, 2, 0).numpy()


async def run_list(make_executor, pipeline, datas, seed=0):
    out = await make_executor(pipeline, seed=seed).run(batch([sample(i, d) for i, d in enumerate(datas)]))
    assert not out.failures, out.failures
    return out.data["image"]


async def test_jpeg_rgb_equals_pillow_decode(make_executor, rng):
    datas = [encode(random_image(rng, *rng.integers(20, 120, 2))) for _ in range(12)]
    images = await run_list(make_executor, Pipeline([Decode()]), datas)
    assert isinstance(images, list) and len(images) == 12  # sizes differ, no resize: a list
    for img, data in zip(images, datas):
        assert img.dtype == torch.uint8 and img.shape[0] == 3
        np.testing.assert_array_equal(hwc(img), np.asarray(pil_decode(data)))  # same decoder: exact


async def test_png_is_lossless(make_executor, rng):
    arrays = [random_image(rng, *rng.integers(20, 120, 2)) for _ in range(8)]
    images = await run_list(make_executor, Pipeline([Decode()], layout="HWC"), [encode(a, "PNG") for a in arrays])
    for img, a in zip(images, arrays):
        np.testing.assert_array_equal(img.numpy(), a)


async def test_gray_output_from_rgb_and_gray_files(make_executor, rng):
    rgb = [random_image(rng, *rng.integers(20, 90, 2)) for _ in range(4)]
    gray = [random_image(rng, *rng.integers(20, 90, 2), channels=1) for _ in range(4)]
    datas = [encode(a, "PNG") for a in rgb] + [encode(a, "JPEG") for a in gray] + [encode(a, "PNG") for a in gray]
    images = await run_list(make_executor, Pipeline([Decode(color="gray")]), datas)
    for img, data in zip(images, datas):
        assert img.shape[0] == 1
        np.testing.assert_array_equal(img[0].numpy(), np.asarray(pil_decode(data, "L")))
    for img, a in zip(images[:4], rgb):  # ITU-R 601-2 luma, as Pillow's "L": L = (299R + 587G + 114B) / 1000
        luma = a.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
        assert np.abs(img[0].numpy() - luma).max() <= 1.0
    for img, a in zip(images[8:], gray):  # gray PNG: lossless
        np.testing.assert_array_equal(img[0].numpy(), a[..., 0])


async def test_gray_jpeg_to_rgb_repeats_the_channel(make_executor, rng):
    a = random_image(rng, 40, 56, channels=1)
    (img,) = await run_list(make_executor, Pipeline([Decode()]), [encode(a, "JPEG")])
    stored = np.asarray(Image.open(io.BytesIO(encode(a, "JPEG"))))
    np.testing.assert_array_equal(hwc(img), np.repeat(stored[..., None], 3, axis=2))


async def test_alpha_and_palette_are_dropped(make_executor, rng):
    rgba = np.concatenate([random_image(rng, 30, 40), rng.integers(0, 256, (30, 40, 1), dtype=np.uint8)], axis=2)
    pal = Image.fromarray(random_image(rng, 30, 40)).quantize(16)
    pal.info["transparency"] = 0
    buf = io.BytesIO()
    pal.save(buf, "PNG", transparency=0)
    images = await run_list(make_executor, Pipeline([Decode()]), [encode(rgba, "PNG"), buf.getvalue()])
    np.testing.assert_array_equal(hwc(images[0]), rgba[..., :3])
    np.testing.assert_array_equal(hwc(images[1]), np.asarray(pal.convert("RGBA").convert("RGB")))


def test_orientation_table_matches_pillow(rng):
    """The NumPy table the tests use agrees with Pillow's exif_transpose (so neither is assumed)."""
    a = random_image(rng, 13, 21)
    for o, move in UPRIGHT.items():
        ref = ImageOps.exif_transpose(Image.open(io.BytesIO(with_orientation(a, o, "PNG"))))
        np.testing.assert_array_equal(np.asarray(ref.convert("RGB")), move(a))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
async def test_exif_orientation(make_executor, rng, fmt):
    a = random_image(rng, 24, 40)  # not square: orientations 5..8 swap height and width
    datas = [with_orientation(a, o, fmt) for o in range(1, 9)]
    upright = await run_list(make_executor, Pipeline([Decode()]), datas)
    stored = await run_list(make_executor, Pipeline([Decode(exif=False)]), datas)
    for o, data, img, raw in zip(range(1, 9), datas, upright, stored):
        ref = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
        np.testing.assert_array_equal(hwc(img), np.asarray(ref), err_msg=f"orientation {o}")
        np.testing.assert_array_equal(hwc(img), UPRIGHT[o](hwc(raw)), err_msg=f"orientation {o}")
        assert img.shape[1:] == ((40, 24) if o >= 5 else (24, 40))


async def test_random_resized_crop_uses_the_upright_size(make_executor, rng):
    """Orientation 6 stores 28 x 120 (h x w) for a 120 x 28 upright image: the window must be drawn on
    the upright image, so that the same sample crops the same scene whatever its EXIF says."""
    rrc = RandomResizedCrop(16, scale=(0.3, 1.0))
    a = random_image(rng, 28, 120)
    datas = [with_orientation(a, 6)] * 16
    out = await make_executor(Pipeline([Decode(), rrc]), seed=5).run(batch([sample(i, d) for i, d in enumerate(datas)]))
    u = uniforms(5, 0, 1, np.arange(16), rrc.randoms)  # op position 1: the first op after Decode
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(datas[0]))).convert("RGB")
    assert upright.size == (28, 120)  # (w, h)
    differs = 0
    for i in range(16):
        top, left, ch, cw = rrc.window(120, 28, u[i])
        ref = tv_resize(np.asarray(upright)[top : top + ch, left : left + cw], 16, 16)
        np.testing.assert_array_equal(hwc(out.data["image"][i]), ref)
        differs += rrc.window(28, 120, u[i]) != (top, left, ch, cw)
    assert differs > 8  # the stored size would have given other windows: the check has teeth
