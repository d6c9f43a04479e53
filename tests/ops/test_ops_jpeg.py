"""The CPU path's JPEG decoder: nvImageCodec's CPU backend, decoding only the first crop's window,
gives exactly the pixels of the Pillow path (whole image, then the same ops), falls back to Pillow
sample by sample, keeps bad files failing as typed errors, and keeps one decoder per worker thread.

Bound: exact (0 levels). Both decoders are libjpeg-turbo with the same settings (accurate integer
IDCT, fancy upsampling), and the geometry after decode is the same torch code; a region decode
runs the same IDCT and upsampling on the rows and columns it keeps.
"""

from __future__ import annotations

import io
import struct
import threading

import numpy as np
import pytest
import torch
from ops_refs import UPRIGHT, batch, encode, random_image, sample, with_orientation
from PIL import Image

from headrace import DecodeError
from headrace.ops import (
    CenterCrop,
    CpuExecutor,
    Decode,
    Flip,
    Normalize,
    Pipeline,
    RandomResizedCrop,
    Resize,
    _pillow,
    training,
    uniforms,
)
from headrace.ops import _exif
from headrace.ops._nvimgcodec import nvimgcodec
from headrace.ops.cpu import _decode as _cpu_decode
from headrace.ops.cpu import _executor as _cpu
from headrace.ops.cpu._ops import leading_window
from headrace.ops._geometry import plan_batch, roi_batch

nvc = nvimgcodec()
needs_nvimgcodec = pytest.mark.skipif(nvc is None, reason="nvImageCodec does not import here")


def jpeg_variants(rng) -> dict[str, bytes]:
    a = random_image(rng, 97, 131)
    cmyk = io.BytesIO()
    Image.fromarray(a).convert("CMYK").save(cmyk, "JPEG")
    return {
        "420": encode(a),
        "444": encode(a, subsampling=0, quality=95),
        "422": encode(a, subsampling=1),
        "progressive": encode(a, progressive=True),
        "restart-markers": encode(a, restart_marker_blocks=2),
        "optimized": encode(a, optimize=True),
        "gray": encode(random_image(rng, 97, 131, channels=1)),
        "cmyk (Pillow decodes it)": cmyk.getvalue(),
        "bytes after EOI (Pillow decodes it)": encode(a) + b"\x00" * 7,
        "png (Pillow decodes it)": encode(a, "PNG"),
        **{f"exif-{o}": with_orientation(random_image(rng, 61, 90), o) for o in range(1, 9)},
    }


PIPELINES = {
    "rrc+flip": [RandomResizedCrop(40, scale=(0.05, 1.0)), Flip()],
    "rrc-upscale": [RandomResizedCrop((70, 50), scale=(0.05, 0.3))],
    "train-f32": [RandomResizedCrop(32), Flip(), Normalize()],
    "center-crop-first": [CenterCrop((40, 30)), Resize(20)],
    "center-crop-padded": [CenterCrop(100)],
    "resize-first": [Resize(48), CenterCrop(40), Normalize(dtype="float16")],
    "decode-only": [],
}


class Spy:
    """Counts the samples each decoder takes."""

    def __init__(self, monkeypatch) -> None:
        self.nvimgcodec = 0
        self.pillow = 0
        decode_jpeg, decode_pillow = _cpu_decode.JpegDecoders.decode, _pillow.pixels

        def jpeg(decoders, jobs):
            got = decode_jpeg(decoders, jobs)
            self.nvimgcodec += sum(x is not None for x in got)
            return got

        def pillow(*args, **kw):
            self.pillow += 1
            return decode_pillow(*args, **kw)

        monkeypatch.setattr(_cpu_decode.JpegDecoders, "decode", jpeg)
        monkeypatch.setattr(_pillow, "pixels", pillow)


async def run_both(pipeline, datas, monkeypatch, epoch=0):
    samples = [sample(i, d) for i, d in enumerate(datas)]
    spy = Spy(monkeypatch)
    fast = CpuExecutor(pipeline, num_threads=2, seed=7)
    with monkeypatch.context() as m:
        m.setattr(_cpu, "nvimgcodec", lambda: None)
        slow = CpuExecutor(pipeline, num_threads=2, seed=7)
    try:
        assert fast._jpeg is not None and slow._jpeg is None
        a = await fast.run(batch(samples, epoch))
        took = (spy.nvimgcodec, spy.pillow)
        b = await slow.run(batch(samples, epoch))
    finally:
        await fast.aclose()
        await slow.aclose()
    assert not a.failures and not b.failures, (a.failures, b.failures)
    return a, b, took


def same(a, b) -> None:
    ia, ib = a.data["image"], b.data["image"]
    if isinstance(ia, list):
        assert len(ia) == len(ib) and all(torch.equal(x, y) for x, y in zip(ia, ib))
    else:
        assert ia.dtype == ib.dtype and torch.equal(ia, ib)
    assert torch.equal(a.data["label"], b.data["label"])


@needs_nvimgcodec
@pytest.mark.parametrize("name", list(PIPELINES))
@pytest.mark.parametrize("exif", [True, False])
async def test_nvimgcodec_path_equals_pillow_path(rng, monkeypatch, name, exif):
    variants = jpeg_variants(rng)
    pipeline = Pipeline([Decode(exif=exif), *PIPELINES[name]])
    for epoch in range(3):  # other windows each epoch
        a, b, (by_nvimgcodec, by_pillow) = await run_both(pipeline, list(variants.values()), monkeypatch, epoch)
        same(a, b)
        assert by_pillow == sum("Pillow decodes it" in k for k in variants)  # no silent fallback
        assert by_nvimgcodec == len(variants) - by_pillow


@needs_nvimgcodec
async def test_exif_windows_are_drawn_on_the_upright_image(rng, monkeypatch):
    """Orientations 5-8 swap height and width: the window is drawn on the upright size, mapped to
    the stored image for the decode, and turned upright after it."""
    a = random_image(rng, 40, 150)
    datas = [with_orientation(a, o) for o in range(1, 9) for _ in range(6)]
    pipeline = Pipeline([Decode(), RandomResizedCrop(24, scale=(0.05, 0.5))])
    out, ref, _ = await run_both(pipeline, datas, monkeypatch)
    same(out, ref)


def test_stored_region_maps_the_upright_region(rng):
    stored = torch.from_numpy(random_image(rng, 13, 21))
    for o in range(1, 9):
        upright = _exif.upright(stored, o)
        np.testing.assert_array_equal(upright.numpy(), UPRIGHT[o](stored.numpy()))
        h, w = upright.shape[:2]
        for _ in range(30):
            y0, x0 = int(rng.integers(0, h)), int(rng.integers(0, w))
            y1, x1 = int(rng.integers(y0 + 1, h + 1)), int(rng.integers(x0 + 1, w + 1))
            sy0, sx0, sy1, sx1 = _exif.stored_region(o, 13, 21, y0, x0, y1, x1)
            got = _exif.upright(stored[sy0:sy1, sx0:sx1], o)
            assert torch.equal(got, upright[y0:y1, x0:x1]), (o, (y0, x0, y1, x1))


@pytest.mark.parametrize(
    "ops", [(RandomResizedCrop(224), Flip()), (RandomResizedCrop(32, scale=(0.01, 1.0)),), (CenterCrop(48),)]
)
def test_decoded_window_is_the_planned_region(ops):
    """The region the CPU path decodes is the GPU path's region (``roi_batch``): for a leading
    crop, the clip (the crop window) bounds it."""
    rng = np.random.default_rng(3)
    n = 300
    h, w = rng.integers(49, 900, n), rng.integers(49, 900, n)
    us = [uniforms(1, 0, k, np.arange(n), op.randoms) if op.randoms else None for k, op in enumerate(ops, 1)]
    regions = roi_batch(plan_batch(h, w, ops, us), h, w)
    for i in range(n):
        top, left, ch, cw = leading_window(ops, int(h[i]), int(w[i]), None if us[0] is None else us[0][i])
        assert (top, left, top + ch, left + cw) == tuple(int(v) for v in regions[i])


@needs_nvimgcodec
async def test_nvimgcodec_failures_fall_back_to_pillow(rng, monkeypatch):
    datas = list(jpeg_variants(rng).values())
    pipeline = training(24)
    ref = CpuExecutor(pipeline, num_threads=2, seed=1)
    expected = await ref.run(batch([sample(i, d) for i, d in enumerate(datas)]))
    await ref.aclose()
    monkeypatch.setattr(_cpu_decode.JpegDecoders, "decode", lambda self, jobs: [None] * len(jobs))
    ex = CpuExecutor(pipeline, num_threads=2, seed=1)
    got = await ex.run(batch([sample(i, d) for i, d in enumerate(datas)]))
    await ex.aclose()
    assert not got.failures
    same(got, expected)


def truncated_and_damaged(rng) -> dict[str, bytes]:
    good = encode(random_image(rng, 160, 120))

    def sized(h, w):
        b = bytearray(good)
        sof = b.index(b"\xff\xc0")
        b[sof + 5 : sof + 9] = struct.pack(">HH", h, w)
        return bytes(b)

    return {
        **{f"truncated-{f}": good[: int(len(good) * f)] for f in (0.2, 0.5, 0.8, 0.99)},
        "garbage-after-SOI": b"\xff\xd8" + rng.integers(0, 256, 3000, dtype=np.uint8).tobytes() + b"\xff\xd9",
        "garbage-after-SOI-no-EOI": b"\xff\xd8\xff" + bytes(100),
        "SOI-EOI": b"\xff\xd8\xff\xd9",
        "empty": b"",
        "decompression-bomb": sized(60000, 60000),
    }


@pytest.mark.parametrize("pipeline", [training(32), Pipeline([Decode()]), Pipeline([CenterCrop(16)])])
async def test_truncated_and_garbage_jpegs_fail_typed_whatever_the_window(make_executor, rng, pipeline, jpeg_decoder):
    """A truncated file fails on both paths and in every epoch: a region decode stops reading after
    the window's last row, so a file without its EOI marker is left to Pillow, which reads it all."""
    bad = truncated_and_damaged(rng)
    good = encode(random_image(rng, 50, 70))
    executor = make_executor(pipeline, seed=2)
    for epoch in range(4):
        samples = [sample(0, good)] + [sample(i + 1, d) for i, d in enumerate(bad.values())] + [sample(99, good)]
        out = await executor.run(batch(samples, epoch))
        assert out.kept == [0, len(samples) - 1]
        assert [row for row, _ in out.failures] == list(range(1, len(samples) - 1))
        for row, err in out.failures:
            assert type(err) is DecodeError and (err.key, err.source) == (samples[row].key, samples[row].source)


async def test_gray_output_does_not_use_nvimgcodec():
    executor = CpuExecutor(Pipeline([Decode(color="gray")]), num_threads=1, seed=0)
    assert executor._jpeg is None  # Pillow's RGB-to-luma conversion is the reference; keep it
    await executor.aclose()


@needs_nvimgcodec
async def test_one_decoder_per_worker_thread_released_on_close(rng):
    datas = [encode(random_image(rng, 80, 90)) for _ in range(64)]
    executor = CpuExecutor(training(16), num_threads=2, seed=0, name="ops-test-jpeg")
    for k in range(3):
        out = await executor.run(batch([sample(i, d) for i, d in enumerate(datas)], k))
        assert len(out.kept) == 64
    made = list(executor._jpeg._made)
    assert 1 <= len(made) <= 2 and all(made)  # lazily, one per thread that decoded
    assert len({id(d) for d in made}) == len(made)
    await executor.aclose()
    assert executor._jpeg._made == []
    assert not [t for t in threading.enumerate() if t.name.startswith("ops-test-jpeg")]


async def test_worker_threads_run_torch_on_one_openmp_thread():
    before = torch.get_num_threads()
    executor = CpuExecutor(training(16), num_threads=2, seed=0)
    try:
        inside = executor._pool.submit(torch.get_num_threads).result()
    finally:
        await executor.aclose()
    if "OpenMP" in torch.__config__.parallel_info():
        assert inside == 1
    assert torch.get_num_threads() == before  # the caller's threads keep theirs
