"""Decode of unusual but valid files, each compared with what Pillow makes of the same bytes:
BigTIFF orientation, image bytes handed over as a NumPy array, GIFs whose first frame is larger
than their logical screen."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from ops_refs import UPRIGHT, batch, encode, random_image, sample
from PIL import Image

import headrace
from headrace import DecodeError
from headrace.ops import CenterCrop, Decode, Pipeline, _follow, _pillow
from headrace.ops._limits import claimed_size, jpeg_sof


def bigtiff(a: np.ndarray, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "TIFF", big_tiff=True, exif=exif)
    return buf.getvalue()


@pytest.mark.parametrize("color", ["rgb", "gray"])
async def test_bigtiff_is_turned_upright_by_its_orientation(make_executor, rng, color):
    """Pillow turns a BigTIFF upright on load, as a classic TIFF; the decode used to undo that and
    read the orientation as 1, so a BigTIFF came out as stored."""
    a = random_image(rng, 12, 20)
    datas = [bigtiff(a, o) for o in range(1, 9)]
    assert datas[0][:4] == b"II+\x00"
    out = await make_executor(Pipeline([Decode(color=color)], layout="HWC")).run(batch(
        [sample(i, d) for i, d in enumerate(datas)]))
    assert not out.failures, out.failures
    mode = "RGB" if color == "rgb" else "L"
    for o, data, img in zip(range(1, 9), datas, out.data["image"]):
        pil = np.asarray(Image.open(io.BytesIO(data)).convert(mode)).reshape(img.shape)
        np.testing.assert_array_equal(img.numpy(), pil, err_msg=f"orientation {o}")
        if color == "rgb":
            np.testing.assert_array_equal(img.numpy(), UPRIGHT[o](a), err_msg=f"orientation {o}")


async def test_bigtiff_with_exif_off_stays_as_stored(make_executor, rng):
    a = random_image(rng, 12, 20)
    out = await make_executor(Pipeline([Decode(exif=False)], layout="HWC")).run(batch(
        [sample(i, bigtiff(a, o)) for i, o in enumerate(range(1, 9))]))
    assert not out.failures, out.failures
    for img in out.data["image"]:
        np.testing.assert_array_equal(img.numpy(), a)


def test_jpeg_header_read_from_a_numpy_buffer(rng):
    """Image bytes may come as a NumPy uint8 array (a mapping item's field); NumPy 2 kept
    ``data[i] << 8`` in uint8, so a 400 x 300 JPEG's header read as 144 x 44, and a walk over an
    application segment longer than 255 bytes got lost."""
    data = encode(random_image(rng, 300, 400), "JPEG", progressive=True, icc_profile=bytes(600))
    array = np.frombuffer(data, dtype=np.uint8)
    assert claimed_size(array) == claimed_size(data) == (400, 300)
    assert jpeg_sof(array) == jpeg_sof(data) == 0xC2  # progressive


def test_boxes_get_the_size_of_a_jpeg_given_as_a_numpy_buffer(rng):
    data = np.frombuffer(encode(random_image(rng, 300, 400), "JPEG"), dtype=np.uint8)
    pipe = Pipeline([CenterCrop(100)], label=None, boxes="boxes", layout="HWC")
    s = headrace.Sample("k", {"jpg": data, "boxes": np.array([[10, 10, 50, 50]], np.float32)}, "mem://k", 0)
    carried = _follow.read_carried(s, pipe, data)
    assert (carried.height, carried.width) == (300, 400)


def gif_with_frame(width: int, height: int) -> bytes:
    """An 8 x 8 GIF whose first frame's descriptor claims ``width`` x ``height`` at (0, 0)."""
    buf = io.BytesIO()
    Image.fromarray(random_image(np.random.default_rng(1), 8, 8)).convert("P").save(buf, "GIF")
    data = bytearray(buf.getvalue())
    struct.pack_into("<HH", data, data.index(b"\x2c") + 5, width, height)
    return bytes(data)


def test_gif_size_includes_its_first_frame_as_pillow_opens_it():
    data = gif_with_frame(9000, 9000)
    assert Image.open(io.BytesIO(data)).size == claimed_size(data) == (9000, 9000)
    assert claimed_size(gif_with_frame(4, 4)) == (8, 8)  # a frame inside the screen: the screen


@pytest.mark.parametrize("side", [9000, 30000])
def test_gif_whose_first_frame_passes_max_pixels_is_refused_by_it(side):
    """The refusal is ``max_pixels``' own, before Pillow opens the file: a 30000 x 30000 frame used
    to be refused by Pillow's limit, with a message saying to raise it."""
    with pytest.raises(DecodeError, match=f"header claims {side}x{side} pixels, over max_pixels") as info:
        _pillow.open_image(gif_with_frame(side, side), Decode(), "k", "mem://k")
    assert info.value.key == "k"
