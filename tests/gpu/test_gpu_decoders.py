"""The shim's two nvImageCodec decoders on the GPU: the hardware engine's share and the CUDA
decoder's, what the engine fails retried by the CUDA decoder, every image decoded once; and the
engines driven through nvJPEG itself (``engine="nvjpeg"``) in place of nvImageCodec's hardware decoder.

Why two: in one decoder whose chain is engine -> CUDA decoder, a sample the engine fails during
the decode can be decoded by two of nvImageCodec's threads at once; fuzzed runs crashed that way
(ops/cuda/_native/batch_decode.c, hr_decoder)."""

from __future__ import annotations

import concurrent.futures
import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from headrace.ops.cuda import _batch_decode


ENGINES = ["nvimgcodec", "nvjpeg"]


def _jpeg(rng, h, w, progressive=False, mode="RGB", orientation=None) -> bytes:
    small = rng.integers(0, 256, size=(5, 5, 3), dtype=np.uint8)
    buf = io.BytesIO()
    exif = Image.Exif()
    if orientation:
        exif[0x0112] = orientation
    picture = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC).convert(mode)
    picture.save(buf, "JPEG", quality=90, progressive=progressive, exif=exif.tobytes())
    return buf.getvalue()


def _has_engines() -> bool:
    """The A100, H100 and H200 have hardware JPEG decoders (compute capability 8.0 and 9.0)."""
    return torch.cuda.get_device_capability(0) in ((8, 0), (9, 0))


def _damaged(rng, blob: bytes) -> bytes:
    """Bits flipped in the scan data (after SOS): the header parses, the decode may fail."""
    data = bytearray(blob)
    start = blob.index(b"\xff\xda") + 20
    for pos in rng.integers(start, len(data) - 2, 12):
        data[pos] ^= 1 << int(rng.integers(8))
    return bytes(data)


def _decode(dec, parsed, blobs, device, crop=None):
    """Decode what the shim takes of ``blobs``, whole or (``crop``, a generator) a random window of each."""
    info = parsed.parse(blobs, exif=True)
    pick = np.flatnonzero(info[:, 3] == 1).astype(np.int32)
    boxes = np.column_stack([np.zeros((len(pick), 2), np.int32), info[pick, :2]]).astype(np.int32)
    if crop is not None:
        for box in boxes:
            h, w = int(box[2]), int(box[3])
            y0, x0 = int(crop.integers(0, h // 2)), int(crop.integers(0, w // 2))
            box[:] = (y0, x0, y0 + int(crop.integers(1, h - y0 + 1)), x0 + int(crop.integers(1, w - x0 + 1)))
    outs = [torch.full((int(h), int(w), 3), 7, dtype=torch.uint8, device=device) for h, w in info[pick, :2]]
    stream = torch.cuda.current_stream(device)
    status = dec.decode(parsed, pick, boxes, np.array([o.data_ptr() for o in outs], np.uint64), stream.cuda_stream)
    stream.synchronize()
    return pick, status, outs


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("hw_load", [0.0, 0.65, 1.0, "adaptive"])
def test_every_image_decodes_once_whatever_the_engines_share(hw_load, engine):
    rng = np.random.default_rng(11)
    device = torch.device("cuda", 0)
    dec = _batch_decode.BatchDecoder(0, threads=4, hw_load=hw_load, engine=engine)
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


@pytest.mark.parametrize("engine", ENGINES)
def test_damaged_jpegs_in_many_batches_on_two_lanes_end_decoded_or_failed(engine):
    """What crashed before: batches full of JPEGs the engine fails mid-decode, decoded over and
    over by two decoders in two threads (as two lanes). Each image ends decoded (1) or failed."""
    device = torch.device("cuda", 0)

    def lane(seed: int) -> tuple[int, int]:
        rng = np.random.default_rng(seed)
        torch.cuda.set_device(device)
        dec = _batch_decode.BatchDecoder(0, threads=8, hw_load=0.65, engine=engine)
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


def test_nvjpegs_own_engine_path_gives_the_pixels_of_nvimagecodecs():
    """The engines through nvJPEG itself against nvImageCodec's hardware decoder, every image
    offered to them (hw_load 1), whole and in windows: baseline RGB JPEGs; gray and EXIF-rotated ones
    (on nvJPEG's path left to the CUDA decoder); progressive ones (left to the caller on both)."""
    rng = np.random.default_rng(21)
    device = torch.device("cuda", 0)
    blobs = []
    for k in range(40):
        h, w = int(rng.integers(40, 500)), int(rng.integers(40, 500))
        kind = k % 5
        blobs.append(_jpeg(rng, h, w, mode="L" if kind == 1 else "RGB", orientation=6 if kind == 2 else 3 if kind == 3 else None,
                           progressive=kind == 4 and k % 10 == 4))
    results = {}
    for engine in ENGINES:
        dec = _batch_decode.BatchDecoder(0, threads=4, hw_load=1.0, engine=engine)
        parsed = _batch_decode.ParsedBatch()
        try:
            if engine == "nvjpeg" and _has_engines():
                assert dec.engine == "nvjpeg", _batch_decode.engine_reason()
            results[engine] = [_decode(dec, parsed, blobs, device, crop=np.random.default_rng(crop))
                               for crop in (None, 5, 6)]
        finally:
            parsed.close()
            dec.close()
    for (pick_a, status_a, outs_a), (pick_b, status_b, outs_b) in zip(results["nvimgcodec"], results["nvjpeg"]):
        assert pick_a.tolist() == pick_b.tolist() == [k for k in range(40) if not (k % 10 == 4)]
        assert status_a.tolist() == status_b.tolist() == [1] * len(pick_a)
        diffs = [(a.cpu().numpy().astype(np.int16) - b.cpu().numpy().astype(np.int16)) for a, b in zip(outs_a, outs_b)]
        same = sum(int(not d.any()) for d in diffs)
        print(f"identical images: {same} of {len(diffs)}; largest mean difference {max(np.abs(d).mean() for d in diffs):.3f}")
        assert all(a.shape == b.shape for a, b in zip(outs_a, outs_b))
        assert all(np.abs(d).mean() < 1.0 for d in diffs)
    for k, out in zip(results["nvjpeg"][0][0], results["nvjpeg"][0][2]):  # whole images against Pillow
        want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(blobs[k]))).convert("RGB")).astype(np.int16)
        assert np.abs(out.cpu().numpy().astype(np.int16) - want).mean() < 2.0, k
