"""The shim's two nvImageCodec decoders on the GPU: the hardware engine's share and the CUDA
decoder's, what the engine fails retried by the CUDA decoder, every image decoded once.

Why two: in one decoder whose chain is engine -> CUDA decoder, a sample the engine fails during
the decode can be decoded by two of nvImageCodec's threads at once; fuzzed runs crashed that way
(ops/cuda/_native/batch_decode.c, hr_decoder)."""

from __future__ import annotations

import concurrent.futures
import io

import numpy as np
import pytest
import torch
from PIL import Image

from headrace.ops.cuda import _batch_decode


def _jpeg(rng, h, w, progressive=False) -> bytes:
    small = rng.integers(0, 256, size=(5, 5, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=90, progressive=progressive)
    return buf.getvalue()


def _damaged(rng, blob: bytes) -> bytes:
    """Bits flipped in the scan data (after SOS): the header parses, the decode may fail."""
    data = bytearray(blob)
    start = blob.index(b"\xff\xda") + 20
    for pos in rng.integers(start, len(data) - 2, 12):
        data[pos] ^= 1 << int(rng.integers(8))
    return bytes(data)


def _decode(dec, parsed, blobs, device):
    info = parsed.parse(blobs, exif=True)
    pick = np.flatnonzero(info[:, 3] == 1).astype(np.int32)
    boxes = np.column_stack([np.zeros((len(pick), 2), np.int32), info[pick, :2]]).astype(np.int32)
    outs = [torch.full((int(h), int(w), 3), 7, dtype=torch.uint8, device=device) for h, w in info[pick, :2]]
    stream = torch.cuda.current_stream(device)
    status = dec.decode(parsed, pick, boxes, np.array([o.data_ptr() for o in outs], np.uint64), stream.cuda_stream)
    stream.synchronize()
    return pick, status, outs


@pytest.mark.parametrize("hw_load", [0.0, 0.65, 1.0, "adaptive"])
def test_every_image_decodes_once_whatever_the_engines_share(hw_load):
    rng = np.random.default_rng(11)
    device = torch.device("cuda", 0)
    dec = _batch_decode.BatchDecoder(0, threads=4, hw_load=hw_load)
    parsed = _batch_decode.ParsedBatch()
    try:
        blobs = [_jpeg(rng, int(rng.integers(40, 300)), int(rng.integers(40, 300)), progressive=k % 4 == 3) for k in range(24)]
        sequential = [k for k in range(24) if k % 4 != 3]  # progressive JPEGs are left to Pillow
        for _ in range(3):  # the adaptive share moves between batches
            pick, status, outs = _decode(dec, parsed, blobs, device)
            assert pick.tolist() == sequential and status.tolist() == [1] * len(sequential)
            for k, out in zip(sequential, outs):
                want = np.asarray(Image.open(io.BytesIO(blobs[k])).convert("RGB")).astype(np.int16)
                # nvJPEG's IDCT and upsampling differ from libjpeg's by a level or two.
                assert np.abs(out.cpu().numpy().astype(np.int16) - want).mean() < 2.0
    finally:
        parsed.close()
        dec.close()


def test_damaged_jpegs_in_many_batches_on_two_lanes_end_decoded_or_failed():
    """What crashed before: batches full of JPEGs the engine fails mid-decode, decoded over and
    over by two decoders in two threads (as two lanes). Each image ends decoded (1) or failed."""
    device = torch.device("cuda", 0)

    def lane(seed: int) -> tuple[int, int]:
        rng = np.random.default_rng(seed)
        torch.cuda.set_device(device)
        dec = _batch_decode.BatchDecoder(0, threads=8, hw_load=0.65)
        parsed = _batch_decode.ParsedBatch()
        controls = damaged_failed = 0
        try:
            for _ in range(40):
                damage = rng.random(48) < 0.6
                blobs = [_damaged(rng, _jpeg(rng, int(rng.integers(64, 400)), int(rng.integers(64, 400)))) if bad
                         else _jpeg(rng, 96, 128) for bad in damage]
                pick, status, _ = _decode(dec, parsed, blobs, device)
                ok = np.zeros(48, dtype=bool)
                ok[pick] = status == 1
                assert ok[~damage].all()  # the untouched ones beside them decode
                controls += int((~damage).sum())
                damaged_failed += int((damage & ~ok).sum())
                parsed.release()
        finally:
            parsed.close()
            dec.close()
        return controls, damaged_failed

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lane, [1, 2]))
    print("controls decoded, damaged failed:", results)
    assert all(controls > 0 for controls, _ in results)


def _oriented(rng, h, w, orientation, subsampling) -> bytes:
    """A JPEG stored h x w (4:4:4, 4:2:2 or 4:2:0), carrying EXIF ``orientation``."""
    small = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC).save(
        buf, "JPEG", quality=90, subsampling=subsampling, exif=exif.tobytes())
    return buf.getvalue()


def test_the_engine_decodes_cut_frames_to_the_same_pixels():
    """The engine's share decodes from frames cut below each window (``cut_frames``): every
    window's pixels equal those decoded from the JPEG as it is, EXIF-turned ones (not cut) too,
    and damaged JPEGs end decoded or failed as without the cut."""
    rng = np.random.default_rng(5)
    device = torch.device("cuda", 0)
    stream = torch.cuda.current_stream(device)
    blobs = [_oriented(rng, int(rng.integers(64, 480)), int(rng.integers(64, 480)), 1 if k % 5 else int(rng.integers(2, 9)),
                       k % 3) for k in range(60)]
    blobs += [_damaged(rng, _jpeg(rng, int(rng.integers(96, 400)), int(rng.integers(96, 400)))) for _ in range(12)]
    results = {}
    for cut in (True, False):
        dec = _batch_decode.BatchDecoder(0, threads=4, hw_load=1.0, cut_frames=cut)
        parsed = _batch_decode.ParsedBatch()
        try:
            window_rng = np.random.default_rng(9)  # the same windows both times
            outs_all, status_all = [], []
            for _ in range(3):
                info = parsed.parse(blobs, exif=True)
                pick = np.flatnonzero(info[:, 3] == 1).astype(np.int32)
                h, w = info[pick, 0], info[pick, 1]
                y0 = (window_rng.random(len(pick)) * h * 0.5).astype(np.int32)
                x0 = (window_rng.random(len(pick)) * w * 0.5).astype(np.int32)
                y1 = y0 + 1 + (window_rng.random(len(pick)) * (h - y0 - 1) * 0.8).astype(np.int32)
                x1 = x0 + 1 + (window_rng.random(len(pick)) * (w - x0 - 1)).astype(np.int32)
                boxes = np.column_stack([y0, x0, y1, x1]).astype(np.int32)
                outs = [torch.full((int(b[2] - b[0]), int(b[3] - b[1]), 3), 7, dtype=torch.uint8, device=device) for b in boxes]
                status = dec.decode(parsed, pick, boxes, np.array([o.data_ptr() for o in outs], np.uint64), stream.cuda_stream)
                stream.synchronize()
                assert (status[pick < 60] == 1).all()  # the good JPEGs decode
                outs_all += [o.cpu() for o in outs]
                status_all += status.tolist()
                cuts = sum(_batch_decode.frame_cut(blobs[i], int(b[2]), int(hh)) is not None
                           for i, b, hh in zip(pick, boxes, h))
                assert cuts >= 20  # most windows end well above their image's last rows
                parsed.release()
        finally:
            parsed.close()
            dec.close()
        results[cut] = (status_all, outs_all)
    (status_cut, outs_cut), (status_whole, outs_whole) = results[True], results[False]
    assert status_cut == status_whole
    for k, (a, b, ok) in enumerate(zip(outs_cut, outs_whole, status_cut)):
        if ok == 1:
            assert torch.equal(a, b), k


_ORDER_SCRIPT = """
import asyncio, sys, warnings
first = sys.argv[1]
if first == "torchvision":
    import torchvision.io
import headrace
from headrace import _nvjpeg, ops, readers
if first == "headrace":
    import torchvision.io
torchvisions = [p for p in _nvjpeg.mapped() if "torchvision" in p]

async def main():
    async with headrace.Loader(readers.files(sys.argv[2]), batch_size=32, pipeline=ops.training(64), device="cuda") as loader:
        n = sum([b.size async for b in loader])
        return n, loader.stats().lanes.get("cpu_fallback", 0)

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    n, fallback = asyncio.run(main())
unusable = sum("encoding unsupported" in str(w.message) for w in caught)
import glob, torch
data = open(sorted(glob.glob(sys.argv[2] + "/cls/*.jpg"))[0], "rb").read()
decoded = torchvision.io.decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), device="cuda")
print(n, int(fallback), unusable, len(torchvisions), tuple(decoded.shape))
"""


@pytest.mark.parametrize("first", ["headrace", "torchvision"])
def test_import_order_beside_torchvisions_libnvjpeg(first, tmp_path):
    # torchvision bundles its own libnvjpeg; nvImageCodec takes whichever copy was loaded first.
    # headrace imported first loads nvImageCodec's copy (every image decodes on the GPU, and
    # torchvision's decode_jpeg still works); torchvision first: every GPU decode fails, the images
    # decode on the CPU, and one RuntimeWarning says why.
    pytest.importorskip("torchvision")
    import subprocess
    import sys

    rng = np.random.default_rng(3)
    (tmp_path / "cls").mkdir()
    for i in range(48):
        (tmp_path / "cls" / f"{i:03d}.jpg").write_bytes(_jpeg(rng, 80 + i, 96))
    done = subprocess.run([sys.executable, "-c", _ORDER_SCRIPT, first, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    n, fallback, unusable, torchvisions, shape = done.stdout.split(maxsplit=4)
    print(first, done.stdout)
    assert int(n) == 48 and shape.strip() == "(3, 80, 96)"
    if int(torchvisions) == 0:
        pytest.skip("this torchvision bundles no libnvjpeg of its own")
    if first == "headrace":
        assert int(fallback) == 0 and int(unusable) == 0
    else:
        assert int(fallback) >= 48 and int(unusable) == 1
