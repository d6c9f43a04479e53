"""Normalize, crop_mirror_normalize, layouts, dtypes, and the shape of what comes out.

Bounds against the float64 reference (x / 255 - mean) / std:
- float32: 1e-6 absolute (the executor computes (x - 255 mean) * (1 / (255 std)) in float32;
  values are at most ~2.7, so a few float32 roundings stay far below this);
- float16 / bfloat16: half a unit in the last place of the value, plus the float32 error: one
  rounding at the end, as documented.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ops_refs import batch, encode, half_ulp, normalize_ref, random_image, sample, tv_center_crop

from headrace import ConfigError, TransformError
from headrace.ops import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CenterCrop,
    Decode,
    Flip,
    Normalize,
    Pipeline,
    crop_mirror_normalize,
    uniforms,
)

F32_BOUND = 1e-6
MANTISSA = {torch.float16: 10, torch.bfloat16: 7}


def sizes(rng, n, lo=20, hi=120):
    return [tuple(int(v) for v in rng.integers(lo, hi, 2)) for _ in range(n)]


def check_close(got: np.ndarray, ref: np.ndarray, dtype: torch.dtype) -> float:
    """Assert the documented bound; return the worst error seen (in units of the bound)."""
    err = np.abs(got - ref)
    bound = F32_BOUND if dtype == torch.float32 else half_ulp(ref, MANTISSA[dtype]) + F32_BOUND
    assert (err <= bound).all(), f"{dtype}: max error {err.max()} over bound"
    return float((err / bound).max())


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
async def test_crop_mirror_normalize(make_executor, rng, layout, dtype):
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    ops = crop_mirror_normalize((28, 36), mirror=0.5, mean=mean, std=std, dtype=dtype, layout=layout)
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 24, 10, 90)]  # some need padding
    samples = [sample(i, encode(a, "PNG")) for i, a in enumerate(arrays)]
    out = await make_executor(Pipeline(ops), seed=4).run(batch(samples))
    images = out.data["image"]
    torch_dtype = getattr(torch, dtype)
    assert images.dtype == torch_dtype
    assert images.shape == ((24, 3, 28, 36) if layout == "CHW" else (24, 28, 36, 3))
    assert images.is_contiguous()
    flips = uniforms(4, 0, 2, np.arange(24), 1)[:, 0] < 0.5  # Flip is op 2, after CenterCrop
    assert 0 < flips.sum() < 24
    for i, a in enumerate(arrays):
        ref = tv_center_crop(a, 28, 36)
        ref = normalize_ref(np.fliplr(ref) if flips[i] else ref, mean, std)
        got = images[i].double().numpy()
        got = got.transpose(1, 2, 0) if layout == "CHW" else got
        check_close(got, ref, torch_dtype)


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
async def test_crop_mirror_uint8(make_executor, rng, layout):
    """uint8 output is crop + mirror without Normalize; CHW is an NCHW view of NHWC memory."""
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 16)]
    samples = [sample(i, encode(a, "PNG")) for i, a in enumerate(arrays)]
    out = await make_executor(Pipeline([Decode(), CenterCrop(20), Flip(1.0)], layout=layout)).run(batch(samples))
    images = out.data["image"]
    assert images.dtype == torch.uint8
    if layout == "CHW":
        assert images.shape == (16, 3, 20, 20)
        assert images.permute(0, 2, 3, 1).is_contiguous()  # channels-last memory, no copy made
        hwc = images.permute(0, 2, 3, 1)
    else:
        assert images.shape == (16, 20, 20, 3) and images.is_contiguous()
        hwc = images
    for i, a in enumerate(arrays):
        np.testing.assert_array_equal(hwc[i].numpy(), np.fliplr(tv_center_crop(a, 20, 20)))


def test_crop_mirror_normalize_refuses_uint8():
    with pytest.raises(ConfigError):
        crop_mirror_normalize(8, dtype="uint8")


async def test_imagenet_defaults_and_float32_bound(make_executor, rng):
    arrays = [random_image(rng, 16, 16) for _ in range(8)]
    arrays[0][:] = 0
    arrays[1][:] = 255  # the extremes of the output range
    samples = [sample(i, encode(a, "PNG")) for i, a in enumerate(arrays)]
    out = await make_executor(Pipeline([Normalize()])).run(batch(samples))
    for i, a in enumerate(arrays):
        ref = normalize_ref(a, IMAGENET_MEAN, IMAGENET_STD)
        check_close(out.data["image"][i].double().numpy().transpose(1, 2, 0), ref, torch.float32)


async def test_normalize_without_crop_gives_a_list(make_executor, rng):
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 6)]
    samples = [sample(i, encode(a, "PNG")) for i, a in enumerate(arrays)]
    out = await make_executor(Pipeline([Normalize(dtype="float16", layout="HWC")])).run(batch(samples))
    images = out.data["image"]
    assert isinstance(images, list)
    for img, a in zip(images, arrays):
        assert img.dtype == torch.float16 and img.shape == a.shape
        check_close(img.double().numpy(), normalize_ref(a, IMAGENET_MEAN, IMAGENET_STD), torch.float16)


async def test_uint8_list_output_layouts(make_executor, rng):
    arrays = [random_image(rng, h, w) for h, w in sizes(rng, 6)]
    samples = [sample(i, encode(a, "PNG")) for i, a in enumerate(arrays)]
    chw = (await make_executor(Pipeline([Decode()])).run(batch(samples))).data["image"]
    hwc = (await make_executor(Pipeline([Decode()], layout="HWC")).run(batch(samples))).data["image"]
    for c, h, a in zip(chw, hwc, arrays):
        assert c.shape == (3, *a.shape[:2]) and h.shape == a.shape
        np.testing.assert_array_equal(c.permute(1, 2, 0).numpy(), a)
        np.testing.assert_array_equal(h.numpy(), a)


async def test_gray_normalize_one_channel(make_executor, rng):
    arrays = [random_image(rng, 24, 30, channels=1) for _ in range(4)]
    samples = [sample(i, encode(a, "PNG")) for i, a in enumerate(arrays)]
    pipe = Pipeline([Decode(color="gray"), CenterCrop(16), Normalize((0.5,), (0.25,))])
    images = (await make_executor(pipe).run(batch(samples))).data["image"]
    assert images.shape == (4, 1, 16, 16)
    for i, a in enumerate(arrays):
        ref = normalize_ref(tv_center_crop(a, 16, 16), (0.5,), (0.25,))
        check_close(images[i].double().numpy().transpose(1, 2, 0), ref, torch.float32)


async def test_one_mean_for_three_channels_broadcasts(make_executor, rng):
    arrays = [random_image(rng, 12, 12) for _ in range(3)]
    samples = [sample(i, encode(a, "PNG")) for i, a in enumerate(arrays)]
    images = (await make_executor(Pipeline([Normalize((0.5,), (0.5,), layout="HWC")])).run(batch(samples))).data["image"]
    for i, a in enumerate(arrays):
        check_close(images[i].double().numpy(), normalize_ref(a, (0.5,), (0.5,)), torch.float32)


async def test_labels(make_executor, rng):
    data = encode(random_image(rng, 20, 20))
    samples = [sample(i, data, label=7 * i) for i in range(5)]
    samples[3].fields["cls"] = b" 12\n"  # whitespace around the digits, as text files have
    out = await make_executor(Pipeline([CenterCrop(8)])).run(batch(samples))
    assert out.data["label"].dtype == torch.int64
    assert out.data["label"].tolist() == [0, 7, 14, 12, 28]
    no_label = await make_executor(Pipeline([CenterCrop(8)], label=None)).run(batch(samples))
    assert "label" not in no_label.data
    # A batch where no sample has the label field is as wrong as a mixed one: each sample fails.
    unlabeled = [sample(i, data, label=None) for i in range(3)]
    out = await make_executor(Pipeline([CenterCrop(8)])).run(batch(unlabeled))
    assert out.kept == [] and out.data["label"].shape == (0,) and out.data["image"].shape == (0, 3, 8, 8)
    assert [(type(e), e.key, e.source) for _, e in out.failures] == [(TransformError, s.key, s.source) for s in unlabeled]
    assert all("Pipeline(label=None)" in str(e) for _, e in out.failures)
    out = await make_executor(Pipeline([CenterCrop(8)], label=None)).run(batch(unlabeled))
    assert "label" not in out.data and out.data["image"].shape == (3, 3, 8, 8)
