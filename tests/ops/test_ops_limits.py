"""Memory is bounded by configuration, not by the input (CPU path).

``Decode(max_pixels=)`` refuses a header that claims too much before anything is allocated for
its pixels; the same limit refuses an op whose output would be too large; ``max_batch_bytes``
bounds the decoded pixels that all the executor's threads hold at once. The memory checks read
the kernel's peak resident size (VmHWM, reset through /proc/self/clear_refs), in a fresh
subprocess where the number must be exact.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest
from ops_refs import batch, encode, photo, sample, with_ihdr_size, with_sof_size, with_webp_size
from PIL import Image

from headrace import ConfigError, DecodeError, TransformError
from headrace.ops import (
    CenterCrop,
    Decode,
    Pipeline,
    RandomResizedCrop,
    Resize,
    training,
    validation,
)
from headrace.ops._geometry import output_error, output_pixels
from headrace.ops import _pillow
from headrace._heap import trim_heap
from headrace.ops._limits import ByteBudget, claimed_size, too_few_bits

MiB = 1 << 20
DEFAULT_PIXELS = 2**26


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _resident_after_trim() -> int:
    """VmRSS once garbage is collected and glibc has given its free heap pages back. Without the
    trim, memory that earlier tests freed in this process can stay resident and be counted here:
    in the whole GPU suite a run held 108 MiB that the same test alone never held (2 MiB). A live
    object keeps its pages through a trim, so a leak still shows."""
    import gc

    gc.collect()
    trim_heap()  # the budget's own trim (glibc's malloc_trim; elsewhere nothing)
    return _status("VmRSS")


class PeakGrowth:
    """The peak resident memory above the starting point while the block runs (Linux)."""

    def __enter__(self) -> PeakGrowth:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
        self.start = _status("VmRSS")
        return self

    def __exit__(self, *exc) -> None:
        self.bytes = _status("VmHWM") - self.start


needs_proc = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc")


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["max_pixels", "max_batch_bytes"])
@pytest.mark.parametrize("value", [0, -5, 1.5, True, "1000", 2**20.0])
def test_limits_are_validated(name, value):
    with pytest.raises(ConfigError, match=name):
        Decode(**{name: value})


def test_limits_defaults_none_and_repr():
    d = Decode()
    assert (d.max_pixels, d.max_batch_bytes) == (DEFAULT_PIXELS, 1 << 30)
    assert "max_pixels=67108864" in repr(d) and "max_batch_bytes=1073741824" in repr(d)
    assert Decode(max_pixels=None, max_batch_bytes=None).max_pixels is None
    assert "max_pixels=1000" in repr(Pipeline([Decode(max_pixels=1000)]))


def test_fixed_output_sizes_over_the_limit_are_config_errors():
    with pytest.raises(ConfigError, match="max_pixels=100"):
        Pipeline([Decode(max_pixels=100), CenterCrop(11)])
    with pytest.raises(ConfigError, match="max_pixels=100"):
        Pipeline([Decode(max_pixels=100), RandomResizedCrop((5, 21))])
    with pytest.raises(ConfigError, match="max_pixels=100"):
        Pipeline([Decode(max_pixels=100), Resize((20, 20))])
    Pipeline([Decode(max_pixels=100), Resize(10), CenterCrop(10)])  # Resize(int) depends on the image: checked per sample


# --- the pixel limit on headers -----------------------------------------------------------------


def lying_headers() -> dict[str, bytes]:
    """Real photographs whose headers claim far more pixels than they hold."""
    jpeg = encode(photo("astronaut"))
    png = encode(photo("coffee"), "PNG")
    return {
        "jpeg-60000x60000": with_sof_size(jpeg, 60000, 60000),
        "jpeg-65500x65500": with_sof_size(jpeg, 65500, 65500),
        "jpeg-9000x9000": with_sof_size(jpeg[: len(jpeg) // 3] + b"\xff\xd9", 9000, 9000),
        "png-60000x60000": with_ihdr_size(png, 60000, 60000),
        "png-1x2000000000": with_ihdr_size(png, 2_000_000_000, 1),
        "webp-16383x16383": with_webp_size(encode(photo("rocket"), "WEBP"), 16383, 16383),
        "webp-16384x16384": with_webp_size(encode(photo("rocket"), "WEBP", exif=b"Exif\x00\x00II*\x00\x08\x00\x00\x00\x00\x00"), 16384, 16384),
        "webp-9000x9000": with_webp_size(encode(photo("rocket"), "WEBP", lossless=True), 9000, 9000),
    }


@needs_proc
@pytest.mark.parametrize("pipeline", [validation(224), training(224), Pipeline([Decode()]), Pipeline([Decode(color="gray")])])
async def test_headers_over_max_pixels_fail_before_allocating(make_executor, jpeg_decoder, pipeline):
    bad = lying_headers()
    good = encode(photo("chelsea"))
    samples = [sample(0, good)] + [sample(i + 1, d) for i, d in enumerate(bad.values())] + [sample(9, good)]
    executor = make_executor(pipeline)
    with PeakGrowth() as peak:
        out = await executor.run(batch(samples))
    print(f"\n{jpeg_decoder}: {len(bad)} lying headers, peak growth {peak.bytes / MiB:.1f} MiB")
    assert out.kept == [0, len(samples) - 1]
    for (row, err), (name, _) in zip(out.failures, bad.items(), strict=True):
        assert type(err) is DecodeError and err.stage == "decode"
        assert (err.key, err.source) == (samples[row].key, samples[row].source)
        w, h = name.split("-")[1].split("x")
        assert f"claims {w}x{h} pixels, over max_pixels=67108864" in str(err)
    assert peak.bytes < 64 * MiB  # a 60000 x 60000 RGB image would be 10 GiB


@pytest.mark.parametrize("fmt,kw", [("JPEG", {}), ("JPEG", {"progressive": True}), ("PNG", {}), ("WEBP", {}),
                                    ("WEBP", {"lossless": True}), ("WEBP", {"exif": Image.Exif().tobytes()}), ("GIF", {})])
def test_claimed_size_is_what_pillow_reads(rng, fmt, kw):
    for _ in range(5):
        h, w = (int(v) for v in rng.integers(1, 700, 2))
        data = encode(photo("coffee", h, w), fmt, **kw)
        assert claimed_size(data) == Image.open(io.BytesIO(data)).size == (w, h)
    assert claimed_size(encode(photo("coffee", 30, 40), "BMP")) is None  # formats it does not read: Pillow's size decides


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF", "BMP", "GIF"])
async def test_a_smaller_max_pixels_refuses_real_files(make_executor, jpeg_decoder, fmt):
    a = photo("rocket", 120, 180)
    data = encode(a, fmt)
    ok = await make_executor(Pipeline([Decode(max_pixels=120 * 180)])).run(batch([sample(0, data)]))
    assert ok.kept == [0]
    out = await make_executor(Pipeline([Decode(max_pixels=120 * 180 - 1)])).run(batch([sample(0, data)]))
    (row, err), = out.failures
    assert type(err) is DecodeError and err.key == "s0000"
    assert "claims 180x120 pixels, over max_pixels=21599" in str(err)


async def test_max_pixels_none_decodes_past_pillows_own_limit(make_executor, monkeypatch):
    """Pillow's MAX_IMAGE_PIXELS does not decide: our limit (here none) does, with no warning."""
    data = encode(photo("coffee", 60, 90), "PNG")
    webp = encode(photo("coffee", 60, 90), "WEBP")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # Pillow would raise over 2000
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = await make_executor(Pipeline([Decode(max_pixels=None)])).run(batch([sample(0, data)]))
    assert out.kept == [0] and out.data["image"][0].shape == (3, 60, 90)
    out = await make_executor(Pipeline([Decode(max_pixels=5000)])).run(batch([sample(0, data)]))
    assert "claims 90x60 pixels, over max_pixels=5000" in str(out.failures[0][1])
    # Some of Pillow's format plugins (WebP, GIF, TIFF, ...) apply its limit themselves while they
    # open a file: where max_pixels allows more than Pillow, the error says which limit to raise.
    out = await make_executor(Pipeline([Decode(max_pixels=None)])).run(batch([sample(0, webp)]))
    if out.failures:
        (row, err), = out.failures
        assert type(err) is DecodeError and "PIL.Image.MAX_IMAGE_PIXELS" in str(err)
    else:  # a Pillow whose WebP plugin leaves the limit to the caller (seen on the GPU machine's)
        assert out.kept == [0]
    out = await make_executor(Pipeline([Decode(max_pixels=5000)])).run(batch([sample(0, webp)]))
    assert "claims 90x60 pixels, over max_pixels=5000" in str(out.failures[0][1])  # ours is stricter: ours decides


# --- output sizes -------------------------------------------------------------------------------


@needs_proc
@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
async def test_thin_images_cannot_make_huge_resizes(make_executor, jpeg_decoder, fmt):
    """Resize(256) of 32768 x 2 is 256 x 4,194,304 (3 GiB); of 1 x 65500, 256 x 16,768,000 (12 GiB)."""
    thin = {"32768x2": photo("astronaut", 2, 32768), "1x65500": photo("astronaut", 65500, 1)}
    datas = {name: encode(a, fmt) for name, a in thin.items()}
    good = encode(photo("chelsea"), fmt)
    samples = [sample(0, good), sample(1, datas["32768x2"]), sample(2, datas["1x65500"]), sample(3, good)]
    executor = make_executor(validation(224))
    with PeakGrowth() as peak:
        out = await executor.run(batch(samples))
    print(f"\n{fmt}/{jpeg_decoder}: thin images through validation(224), peak growth {peak.bytes / MiB:.1f} MiB")
    assert out.kept == [0, 3]
    (r1, e1), (r2, e2) = out.failures
    assert (r1, r2) == (1, 2)
    for row, err in out.failures:
        assert type(err) is TransformError and (err.key, err.source) == (samples[row].key, samples[row].source)
        assert "Resize(size=256) would make a" in str(err) and "over max_pixels=67108864" in str(err)
    assert "4194304x256 image" in str(e1) and "256x16768000 image" in str(e2)
    assert peak.bytes < 64 * MiB
    # Crops bound their output: the same images through the training pipeline are fine.
    out = await make_executor(training(224)).run(batch(samples))
    assert out.kept == [0, 1, 2, 3] and out.data["image"].shape == (4, 3, 224, 224)


def test_output_pixels_agrees_with_output_error(rng):
    pipelines = [
        (Resize(256), CenterCrop(224)),
        (Resize(300), Resize(64)),
        (CenterCrop(50), Resize(4000)),
        (RandomResizedCrop(64), Resize(1000)),
        (Resize((10, 7000)),),
    ]
    h = np.concatenate([rng.integers(1, 70000, 300), [1, 2, 65500, 32768]])
    w = np.concatenate([rng.integers(1, 70000, 300), [65500, 32768, 1, 2]])
    for ops in pipelines:
        largest = output_pixels(h, w, ops)
        for limit in (2**16, 2**22, DEFAULT_PIXELS):
            for i in range(len(h)):
                over = output_error(int(h[i]), int(w[i]), ops, limit) is not None
                assert over == (largest[i] > limit), (ops, h[i], w[i], limit)
    assert output_error(2, 32768, (Resize(256),), None) is None


# --- the byte budget ----------------------------------------------------------------------------


def test_byte_budget_bounds_what_threads_hold_together(rng):
    """Many threads, random requests (some over the whole budget): what is held together never
    passes the limit, a request over it runs alone, and every request is served (no deadlock)."""
    limit = 1000
    budget = ByteBudget(limit)
    held, most, alone_ok, served = [0], [0], [True], [0]
    lock = threading.Lock()
    sizes = rng.integers(1, 1600, (8, 60)).tolist()

    def worker(mine: list[int]) -> None:
        for n in mine:
            with budget.hold(n):
                with lock:
                    held[0] += min(n, limit)
                    most[0] = max(most[0], held[0])
                    if n >= limit and held[0] != limit:
                        alone_ok[0] = False
                time.sleep(0.0002)
                with lock:
                    held[0] -= min(n, limit)
                    served[0] += 1

    threads = [threading.Thread(target=worker, args=(s,)) for s in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert served[0] == 8 * 60 and held[0] == 0
    assert most[0] <= limit and budget.peak <= limit and alone_ok[0]
    assert most[0] > limit // 2  # the threads did overlap: the bound had work to do


def test_byte_budget_none_never_waits():
    budget = ByteBudget(None)
    with budget.hold(10**15), budget.hold(10**15):
        pass


_BUDGET_CHILD = r"""
import asyncio, io, json, sys
sys.path[:0] = sys.argv[1:2]
from ops_refs import batch, flat_jpeg, sample
from headrace.ops import CpuExecutor, Decode, Pipeline, validation
from headrace.ops.cpu import _executor as _cpu

side, copies, budget, decoder = (json.loads(a) for a in sys.argv[2:6])
if decoder == "pillow":
    _cpu.nvimgcodec = lambda: None
data = flat_jpeg(side, side)

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

async def main():
    pipe = Pipeline([Decode(max_batch_bytes=budget), *validation(224).ops[1:]])
    executor = CpuExecutor(pipe, num_threads=2, seed=0)
    await executor.run(batch([sample(0, data)]))  # threads, decoders and torch warm
    samples = [sample(i, data) for i in range(copies)]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    start = status("VmRSS")
    out = await executor.run(batch(samples))
    growth = status("VmHWM") - start
    await executor.aclose()
    print(json.dumps({"growth": growth, "kept": len(out.kept), "granted_peak": executor._budget.peak,
                      "file_bytes": len(data), "out_bytes": out.data["image"].numel() * 4}))

asyncio.run(main())
"""


def _peak_in_child(side: int, copies: int, budget: int | None, decoder: str) -> dict:
    here = os.path.dirname(__file__)
    args = [here, *(json.dumps(v) for v in (side, copies, budget, decoder))]
    proc = subprocess.run([sys.executable, "-c", _BUDGET_CHILD, *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_proc
@pytest.mark.parametrize("decoder", ["nvimgcodec", "pillow"])
def test_decode_memory_is_bounded_across_threads(decoder):
    """24 copies of a real 4000 x 4000 JPEG (250 KB: one flat colour) in one batch through
    validation(224) on two threads: with max_batch_bytes=256 MiB the peak stays under the budget
    plus the output batch and a margin (allocator, thread stacks); without it, it does not."""
    if decoder == "nvimgcodec":
        from headrace.ops._nvimgcodec import nvimgcodec

        if nvimgcodec() is None:
            pytest.skip("nvImageCodec does not import here")
    budget = 256 * MiB
    bounded = _peak_in_child(4000, 24, budget, decoder)
    unbounded = _peak_in_child(4000, 24, None, decoder)
    print(f"\n{decoder}: 24 x 4000x4000 JPEG ({bounded['file_bytes']} bytes each), 2 threads: peak growth "
          f"{bounded['growth'] / MiB:.0f} MiB with max_batch_bytes=256 MiB (granted at most "
          f"{bounded['granted_peak'] / MiB:.0f} MiB), {unbounded['growth'] / MiB:.0f} MiB without")
    assert bounded["kept"] == unbounded["kept"] == 24
    assert bounded["granted_peak"] <= budget
    assert bounded["growth"] <= budget + bounded["out_bytes"] + 96 * MiB
    assert unbounded["growth"] > bounded["growth"] + 256 * MiB  # the bound is what made the difference


@needs_proc
def test_an_image_over_the_whole_budget_runs_alone():
    """Each 8000 x 8000 image's decode (about 366 MiB with nvImageCodec, 610 MiB with Pillow) is
    over a 64 MiB budget: they take the whole budget one at a time, so the peak is one image's."""
    got = _peak_in_child(8000, 4, 64 * MiB, "nvimgcodec")
    one = 8000 * 8000 * 3
    print(f"\n4 x 8000x8000 JPEG, budget 64 MiB: peak growth {got['growth'] / MiB:.0f} MiB, one image's pixels {one / MiB:.0f} MiB")
    assert got["kept"] == 4 and got["granted_peak"] == 64 * MiB
    assert got["growth"] < 4 * one  # one at a time (each decode holds about 2 images' worth), never two together


@needs_proc
async def test_failed_decodes_do_not_keep_their_memory(make_executor, jpeg_decoder):
    """Errors outlive their batch (Processed.failures, the loader's recent errors): they must not
    keep the memory their decode had (tracebacks pin frames, and frames their callers' locals)."""
    big_png = with_ihdr_size(encode(photo("coffee"), "PNG"), 5000, 5000)  # CRC fixed: Pillow allocates, then fails
    big_jpeg = with_sof_size(encode(photo("astronaut")), 5000, 5000)  # decodes: grey past the real scan
    samples = [sample(i, big_png if i % 2 else big_jpeg) for i in range(8)]
    executor = make_executor(validation(224))
    before = _resident_after_trim()
    out = await executor.run(batch(samples))
    held = _resident_after_trim() - before
    print(f"\n{jpeg_decoder}: 4 failed 5000x5000 decodes, 4 delivered: {held / MiB:.1f} MiB held after the run")
    assert out.kept == [0, 2, 4, 6] and [row for row, _ in out.failures] == [1, 3, 5, 7]
    for _, err in out.failures:
        assert type(err) is DecodeError and "truncated" in str(err)
        assert err.__traceback__ is None and (err.__cause__ is None or err.__cause__.__traceback__ is None)
    assert held < 48 * MiB  # one failed decode held 100 MiB (5000 x 5000 x 4)


@pytest.mark.parametrize("claim", [(65535, 311), (1, 65535), (65501, 2)])
async def test_a_side_over_65500_is_refused_as_libjpeg_does(make_executor, claim):
    """libjpeg refuses such headers and nvJPEG decodes them: both paths refuse them, by our rule."""
    h, w = claim
    data = _claiming_jpeg(h, w)
    out = await make_executor(Pipeline([Decode(max_pixels=None)])).run(batch([sample(0, data)]))
    (row, err), = out.failures
    assert type(err) is DecodeError and f"claims {w}x{h} pixels: a side over 65500" in str(err)


def _claiming_jpeg(h: int, w: int) -> bytes:
    data = bytearray(encode(photo("rocket", 32, 48), "JPEG"))
    i = data.index(b"\xff\xc0")
    data[i + 5 : i + 9] = h.to_bytes(2, "big") + w.to_bytes(2, "big")
    return bytes(data)


async def test_a_jpeg_too_short_for_its_claimed_size_is_pillows_to_decode(make_executor, jpeg_decoder):
    """A progressive 178x175 JPEG of a few KB whose header claims 6000x6000 crashed nvJPEG's host
    decode on the H100: neither path hands such a file to nvImageCodec. Pillow decodes what it holds."""
    small = encode(photo("astronaut", 175, 178), "JPEG", quality=30, progressive=True)
    lying = with_sof_size(small, 6000, 6000)
    assert too_few_bits(len(lying), 6000, 6000) and not too_few_bits(len(small), 175, 178)
    if jpeg_decoder == "nvimgcodec":
        from headrace.ops._nvimgcodec import nvimgcodec
        from headrace.ops.cpu._decode import JpegDecoders

        decoders = JpegDecoders(nvimgcodec(), exif=True, max_pixels=DEFAULT_PIXELS)
        assert decoders.header(lying) is None and decoders.header(small) is not None
    out = await make_executor(Pipeline([Decode()])).run(batch([sample(0, lying), sample(1, small)]))
    assert out.kept == [0, 1]
    expected = np.asarray(_pillow.decode(lying, Decode(), "k", "s"))
    assert np.array_equal(out.data["image"][0].permute(1, 2, 0).numpy(), expected)  # CHW by default
