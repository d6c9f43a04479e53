"""The C shim over nvImageCodec's C API (ops/cuda/_native/batch_decode.c), driven with its CPU-only decoder.

The GPU lanes use the same shim with the GPU backends (tests/gpu); here the CPU backend
(libjpeg-turbo, the library Pillow uses) must give Pillow's pixels exactly, for whole images and
for windows, with EXIF orientation applied, and must report what it cannot decode per image.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from ops_refs import encode, random_image, with_orientation
from PIL import Image

from headrace.ops.cuda import _batch_decode

pytestmark = pytest.mark.skipif(
    _batch_decode.unavailable_reason() is not None,
    reason=f"batch decode shim unavailable: {_batch_decode.unavailable_reason()}",
)


@pytest.fixture
def decoder():
    made = []

    def make(channels: int = 3, exif: bool = True, **more):
        dec = _batch_decode.BatchDecoder(None, threads=1, channels=channels, exif=exif, **more)
        dec.parsed = _batch_decode.ParsedBatch()
        made.append(dec)
        return dec

    yield make
    for dec in made:
        dec.parsed.close()
        dec.close()


def _decode(dec, blobs, regions):
    """Parse ``blobs``, decode the parsed ones at ``regions`` (None: whole image) into host arrays."""
    info = dec.parsed.parse(blobs, exif=dec.exif)
    pick = np.flatnonzero(info[:, 3] == 1).astype(np.int32)
    boxes = np.array(
        [regions[i] if regions[i] is not None else (0, 0, info[i, 0], info[i, 1]) for i in pick], dtype=np.int32
    ).reshape(-1, 4)
    outs = [np.full((y1 - y0, x1 - x0, dec.channels), 7, dtype=np.uint8) for y0, x0, y1, x1 in boxes]
    status = dec.decode(dec.parsed, pick, boxes, np.array([o.ctypes.data for o in outs], dtype=np.uint64), 0)
    return info, pick, boxes, status, outs


def _pillow(blob: bytes, mode: str = "RGB") -> np.ndarray:
    from PIL import ImageOps

    return np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(blob))).convert(mode))


def test_whole_images_and_windows_equal_pillow(decoder, rng):
    dec = decoder()
    blobs, regions = [], []
    for k in range(12):
        h, w = int(rng.integers(17, 140)), int(rng.integers(17, 140))
        blobs.append(encode(random_image(rng, h, w), "JPEG"))
        if k % 3 == 0:
            regions.append(None)
        else:
            y0, x0 = int(rng.integers(0, h - 8)), int(rng.integers(0, w - 8))
            regions.append((y0, x0, int(rng.integers(y0 + 1, h + 1)), int(rng.integers(x0 + 1, w + 1))))
    info, pick, boxes, status, outs = _decode(dec, blobs, regions)
    assert info[:, 3].tolist() == [1] * 12 and status.tolist() == [1] * 12
    for j, i in enumerate(pick):
        y0, x0, y1, x1 = boxes[j]
        assert tuple(info[i, :3]) == (*_pillow(blobs[i]).shape[:2], 3)
        np.testing.assert_array_equal(outs[j], _pillow(blobs[i])[y0:y1, x0:x1])


@pytest.mark.parametrize(("gpu_load", "gpu_threads"), [(0.5, 0), (1.0, 3)])
def test_a_huffman_share_for_the_gpu_leaves_the_cpu_decoder_as_it_was(decoder, rng, gpu_load, gpu_threads):
    # gpu_load asks for a second, GPU-Huffman CUDA decoder; the CPU-only decoder has no GPU, so it
    # makes none and decodes every image itself, Pillow's pixels, as with gpu_load 0.
    dec = decoder(gpu_load=gpu_load, gpu_threads=gpu_threads)
    blobs = [encode(random_image(rng, int(rng.integers(17, 120)), int(rng.integers(17, 120))), "JPEG") for _ in range(8)]
    info, pick, boxes, status, outs = _decode(dec, blobs, [None] * 8)
    assert status.tolist() == [1] * 8
    for j, i in enumerate(pick):
        np.testing.assert_array_equal(outs[j], _pillow(blobs[i]))


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_exif_orientation_turns_windows_upright(decoder, rng, orientation):
    dec = decoder()
    blob = with_orientation(random_image(rng, 40, 64), orientation)
    upright = _pillow(blob)
    h, w = upright.shape[:2]
    info, _, _, status, outs = _decode(dec, [blob, blob], [None, (3, 5, h - 4, w - 9)])
    assert tuple(info[0, :2]) == (h, w) and status.tolist() == [1, 1]
    np.testing.assert_array_equal(outs[0], upright)
    np.testing.assert_array_equal(outs[1], upright[3 : h - 4, 5 : w - 9])


def test_gray_output(decoder, rng):
    dec = decoder(channels=1)
    blob = encode(random_image(rng, 30, 50), "JPEG")
    _, _, _, status, outs = _decode(dec, [blob], [None])
    assert status.tolist() == [1]
    # A colour JPEG decoded to gray is its luma plane, as libjpeg-turbo outputs it (not Pillow's
    # RGB -> L conversion, which goes through clipped RGB).
    img = Image.open(io.BytesIO(blob))
    img.draft("YCbCr", img.size)
    np.testing.assert_array_equal(outs[0][..., 0], np.asarray(img)[..., 0])


def test_unparsable_and_truncated_images_are_reported_per_image(decoder, rng):
    dec = decoder()
    good = encode(random_image(rng, 32, 32), "JPEG")
    blobs = [good, b"not an image at all", good[: len(good) // 2], good]
    info, pick, _, status, outs = _decode(dec, blobs, [None] * 4)
    assert info[:, 3].tolist() == [1, 0, 1, 1]  # a truncated JPEG still has a header
    assert pick.tolist() == [0, 2, 3]
    assert status[0] == 1 and status[2] == 1 and status[1] != 1
    np.testing.assert_array_equal(outs[0], outs[2])


def test_handles_are_reused_across_batches_and_close_is_idempotent(decoder, rng):
    dec = decoder()
    for size in (8, 3, 20):  # the parsed streams grow, shrink and grow again
        blobs = [encode(random_image(rng, 20 + k, 24), "JPEG") for k in range(size)]
        _, pick, _, status, outs = _decode(dec, blobs, [None] * size)
        assert status.tolist() == [1] * size
        for j, i in enumerate(pick):
            np.testing.assert_array_equal(outs[j], _pillow(blobs[i]))
    dec.parsed.release()
    _, _, _, status, _ = _decode(dec, blobs[:2], [None, None])  # parses again after a release
    assert status.tolist() == [1, 1]
    dec.parsed.close()
    dec.parsed.close()
    dec.close()
    dec.close()


def test_a_batch_parsed_in_one_thread_decodes_in_another(decoder, rng):
    import concurrent.futures

    dec = decoder()
    blobs = [encode(random_image(rng, 40, 30 + k), "JPEG") for k in range(6)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        parsed = _batch_decode.ParsedBatch()
        info = pool.submit(parsed.parse, blobs, exif=True).result()
    boxes = np.column_stack([np.zeros((6, 2), np.int32), info[:, :2]])
    outs = [np.empty((h, w, 3), np.uint8) for h, w in info[:, :2]]
    status = dec.decode(parsed, np.arange(6, dtype=np.int32), boxes, np.array([o.ctypes.data for o in outs], np.uint64), 0)
    assert status.tolist() == [1] * 6
    for blob, out in zip(blobs, outs):
        np.testing.assert_array_equal(out, _pillow(blob))
    parsed.close()


def test_an_unusable_cache_means_the_fallback_with_a_reason(monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    monkeypatch.setenv("HEADRACE_CACHE", str(blocker / "cache"))  # under a file: mkdir fails
    monkeypatch.setattr(_batch_decode, "_state", {})
    assert _batch_decode.load() is None
    assert "building batch_decode failed" in _batch_decode.unavailable_reason()


def test_decode_launch_without_a_function_decodes_only_and_times_itself(decoder, rng):
    dec = decoder()
    blobs = [encode(random_image(rng, 30 + k, 40), "JPEG") for k in range(4)] + [b"\xff\xd8 truncated"]
    info = dec.parsed.parse(blobs, exif=True)
    pick = np.flatnonzero(info[:, 3] == 1).astype(np.int32)
    boxes = np.column_stack([np.zeros((len(pick), 2), np.int32), info[pick, :2]])
    outs = [np.empty((h, w, 3), np.uint8) for h, w in info[pick, :2]]
    launch = _batch_decode.Launch()  # no function, no events: the decode alone
    status, launched = dec.decode_launch(dec.parsed, pick, boxes, np.array([o.ctypes.data for o in outs], np.uint64), 0, launch)
    assert status.tolist() == [1] * len(pick) and not launched
    assert launch.cuda_error == 0 and launch.seconds[1] > 0.0
    for j, i in enumerate(pick):
        np.testing.assert_array_equal(outs[j], _pillow(blobs[i]))


def test_the_driver_reason_says_why_the_shim_cannot_launch():
    reason = _batch_decode.driver_reason()
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
    except OSError:
        assert reason is not None and "CUDA driver" in reason
    else:
        assert reason is None


def test_the_decode_order_changes_no_image_and_no_status(decoder, rng):
    dec = decoder()
    good = [encode(random_image(rng, 24 + 3 * k, 40), "JPEG") for k in range(5)]
    blobs = good[:2] + [good[2][: len(good[2]) // 2]] + good[3:]  # a truncated one in the middle
    info = dec.parsed.parse(blobs, exif=True)
    boxes = np.column_stack([np.zeros((5, 2), np.int32), info[:, :2]])
    outs = [np.zeros((h, w, 3), np.uint8) for h, w in info[:, :2]]
    launch = _batch_decode.Launch()
    order = np.array([4, 2, 0, 3, 1], dtype=np.int32)
    launch.order = order.ctypes.data
    status, _ = dec.decode_launch(dec.parsed, np.arange(5, dtype=np.int32), boxes, np.array([o.ctypes.data for o in outs], np.uint64), 0, launch)
    assert status[2] != 1 and [status[i] for i in (0, 1, 3, 4)] == [1, 1, 1, 1]
    for i in (0, 1, 3, 4):
        np.testing.assert_array_equal(outs[i], _pillow(blobs[i]))


def _with_sof(jpeg: bytes, marker: int) -> bytes:
    """``jpeg`` with its frame marker changed (0xC3 lossless, 0xC9 arithmetic, ...): the header still parses."""
    data = bytearray(jpeg)
    i = 2
    while data[i + 1] not in (0xC0, 0xC1, 0xC2):
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    data[i + 1] = marker
    return bytes(data)


def test_only_sequential_huffman_jpegs_are_left_to_nvimagecodec(decoder, rng):
    # Progressive: nvJPEG's host decode of a damaged one wrote out of bounds (batch_decode.c); a
    # lossless JPEG would reach nvImageCodec's lossless decoder, a batched backend with a fallback;
    # arithmetic coding it does not decode. All of them go to Pillow; their sizes stand.
    dec = decoder()
    good = encode(random_image(rng, 30, 44), "JPEG")
    progressive = io.BytesIO()
    Image.fromarray(random_image(rng, 30, 44)).save(progressive, "JPEG", progressive=True)
    blobs = [good, _with_sof(good, 0xC3), _with_sof(good, 0xC9), _with_sof(good, 0xC1), progressive.getvalue()]
    info, pick, _, status, outs = _decode(dec, blobs, [None] * len(blobs))
    assert info[:, 3].tolist() == [1, 0, 0, 1, 0]
    assert info[:, :2].tolist() == [[30, 44]] * len(blobs)
    assert status.tolist() == [1, 1]
    np.testing.assert_array_equal(outs[0], _pillow(good))


def test_jpeg_sof_names_the_coding():
    from headrace.ops._limits import claimed_size, jpeg_sof

    rng = np.random.default_rng(3)
    good = encode(random_image(rng, 21, 35), "JPEG")
    assert jpeg_sof(good) == 0xC0 and jpeg_sof(_with_sof(good, 0xC3)) == 0xC3
    assert claimed_size(_with_sof(good, 0xC3)) == (35, 21)
    assert jpeg_sof(good[:20]) is None and jpeg_sof(b"\xff\xd8") is None


def test_the_c_helpers_can_be_turned_off(monkeypatch, tmp_path):
    from headrace import _native

    monkeypatch.setenv("HEADRACE_CACHE", str(tmp_path))
    monkeypatch.setenv("HEADRACE_NO_C_HELPERS", "1")
    target, reason = _native.build("batch_decode", _batch_decode._SOURCE)
    assert target is None and "HEADRACE_NO_C_HELPERS" in reason and not any(tmp_path.iterdir())



# --- frames cut below a window (what the hardware engine's share decodes from on the GPU) ---------


def _cut(blob: bytes, bottom: int, height: int) -> bytes | None:
    """``blob`` with the height ``frame_cut`` gives it written in, or None where nothing is cut."""
    cut = _batch_decode.frame_cut(blob, bottom, height)
    if cut is None:
        return None
    rows, at = cut
    return blob[:at] + rows.to_bytes(2, "big") + blob[at + 2 :]


@pytest.mark.parametrize("subsampling, mcu", [(0, 8), (1, 8), (2, 16)])  # 4:4:4, 4:2:2, 4:2:0
@pytest.mark.parametrize("channels", [3, 1])
def test_a_cut_frame_decodes_the_window_rows_unchanged(rng, subsampling, mcu, channels):
    h, w = int(rng.integers(60, 200)), int(rng.integers(40, 160))
    blob = encode(random_image(rng, h, w, channels), "JPEG", subsampling=subsampling)
    mcu = 8 if channels == 1 else mcu  # one component: its MCU is one 8 x 8 block whatever the sampling says
    whole = _pillow(blob, "L" if channels == 1 else "RGB")
    cuts = 0
    for bottom in [1, mcu, mcu + 1, *rng.integers(1, h + 1, 12).tolist(), h - mcu, h]:
        got = _batch_decode.frame_cut(blob, bottom, h)
        rows = -(-bottom // mcu) * mcu + mcu
        if rows >= h:
            assert got is None  # the window reaches the last MCU row: nothing to cut
            continue
        assert got is not None and got[0] == rows
        cut = _pillow(_cut(blob, bottom, h), "L" if channels == 1 else "RGB")
        assert cut.shape[0] == rows
        # libjpeg-turbo's smooth chroma upsampling reads the row below: the extra MCU row keeps it there.
        np.testing.assert_array_equal(cut[:bottom], whole[:bottom])
        cuts += 1
    assert cuts >= 5


def test_frames_that_are_not_cut(rng):
    blob = encode(random_image(rng, 120, 90), "JPEG")
    progressive = encode(random_image(rng, 120, 90), "JPEG", progressive=True)
    assert _batch_decode.frame_cut(progressive, 10, 120) is None  # another encoding
    assert _batch_decode.frame_cut(_with_sof(blob, 0xC3), 10, 120) is None  # lossless
    assert _batch_decode.frame_cut(blob, 10, 119) is None  # the frame does not say that height
    assert _batch_decode.frame_cut(blob, 0, 120) is None and _batch_decode.frame_cut(blob, 121, 120) is None
    assert _batch_decode.frame_cut(encode(random_image(rng, 40, 40), "PNG"), 10, 40) is None
    assert _batch_decode.frame_cut(_with_sof(blob, 0xC1), 10, 120) is not None  # extended sequential
    frame = blob.index(b"\xff\xc0")
    for end in range(0, frame + 19):  # every header cut short of the frame's end: no cut, no byte read past it
        assert _batch_decode.frame_cut(blob[:end], 10, 120) is None
    for seed in range(200):  # garbage after a JPEG's first marker
        noise = np.random.default_rng(seed).integers(0, 256, 64, dtype=np.uint8).tobytes()
        _batch_decode.frame_cut(b"\xff\xd8\xff" + noise, 10, 120)


# --- which images the hardware engine takes: a share of the bytes the windows need read ----------


def test_the_engine_takes_its_share_of_the_bytes_not_of_the_images():
    count = _batch_decode.engine_count
    assert count([10.0] * 4, 4, 0.5) == 2
    assert count([10.0] * 4, 4, 0.76) == 3  # 30 of 40 is nearer 30.4 than 40 is
    assert count([10.0] * 4, 4, 0.0) == 0 and count([10.0] * 4, 4, 1.0) == 4
    assert count([10.0] * 4, 2, 1.0) == 2  # only the baseline JPEGs offered to it
    # Validation's largest windows are its largest images: 0.76 of these images (5 of 6) would be
    # 0.95 of the bytes; the engine takes 3 (80 of 100 bytes: nearer 76 than 70 is).
    largest_first = [40.0, 30.0, 10.0, 10.0, 5.0, 5.0]
    assert count(largest_first, 6, 0.76) == 3
    assert count([100.0, 1.0, 1.0, 1.0], 4, 0.3) == 0  # taking the one large image would overshoot more
    assert count([1.0] * 64, 64, 2.0) == 64 and count([1.0] * 64, 64, -1.0) == 0  # clamped to [0, 1]
    with pytest.raises(ValueError, match="at most 64"):
        count([1.0] * 65, 65, 0.5)


def test_a_decoder_without_an_engine_gives_it_no_share(decoder):
    dec = decoder()
    assert dec.hw_share == 0.0
    dec.close()
    assert dec.hw_share == 0.0  # closed: still an answer, no handle read
