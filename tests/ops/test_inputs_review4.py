"""Messy real inputs on the CPU decode path: files made with Pillow the ways datasets hold them."""

from __future__ import annotations

import io

import numpy as np
import pytest
from ops_refs import ORIENTATION_TAG, UPRIGHT, batch, random_image, sample
from PIL import Image, TiffImagePlugin

from headrace.ops import Decode, Pipeline, _pillow


def tiff_with_orientation(a: np.ndarray, value, tag_type: int) -> bytes:
    """``a`` as a TIFF whose orientation tag holds ``value`` as TIFF type ``tag_type``."""
    ifd = TiffImagePlugin.ImageFileDirectory_v2()
    ifd[ORIENTATION_TAG] = value
    ifd.tagtype[ORIENTATION_TAG] = tag_type
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "TIFF", tiffinfo=ifd)
    return buf.getvalue()


# A RATIONAL 6/1 or a FLOAT 6.0 equals 6 where Pillow looks the tag up, so its TIFF loader turns the
# image by it; the EXIF rule (a SHORT of 1..8) reads it as 1. Before, headrace undid only what an int
# tag had turned: these came out turned, with exif=False too.
NOT_SHORT = {
    "RATIONAL": (5, TiffImagePlugin.IFDRational(6, 1)),
    "SRATIONAL": (10, TiffImagePlugin.IFDRational(3, 1)),
    "FLOAT": (11, 8.0),
    "DOUBLE": (12, 2.0),
}


@pytest.mark.parametrize("name", list(NOT_SHORT))
@pytest.mark.parametrize("exif", [True, False])
async def test_tiff_orientation_that_is_not_a_short_is_undone(make_executor, rng, name, exif):
    a = random_image(rng, 12, 26)
    tag_type, value = NOT_SHORT[name]
    data = tiff_with_orientation(a, value, tag_type)
    loaded = Image.open(io.BytesIO(data))
    loaded.load()
    assert np.asarray(loaded).shape != a.shape or not np.array_equal(np.asarray(loaded), a)  # Pillow turned it
    out = await make_executor(Pipeline([Decode(exif=exif)], layout="HWC")).run(batch([sample(0, data)]))
    assert not out.failures, out.failures
    np.testing.assert_array_equal(out.data["image"][0].numpy(), a)
    opened = _pillow.open_image(data, Decode(exif=exif), "k", "s")
    assert (opened.height, opened.width) == a.shape[:2]  # the size the crops are planned on
    opened.img.close()
    # the GPU path's Pillow fallback agrees
    np.testing.assert_array_equal(np.asarray(_pillow.decode(data, Decode(exif=exif), "k", "s")), a)


async def test_tiff_orientation_short_still_turns_once(make_executor, rng):
    """The guard for the fix above: a SHORT tag turns the image by its value, once."""
    a = random_image(rng, 12, 26)
    datas = [tiff_with_orientation(a, o, 3) for o in range(1, 9)]
    out = await make_executor(Pipeline([Decode()], layout="HWC")).run(batch([sample(i, d) for i, d in enumerate(datas)]))
    assert not out.failures, out.failures
    for o, img in zip(range(1, 9), out.data["image"]):
        np.testing.assert_array_equal(img.numpy(), UPRIGHT[o](a), err_msg=f"orientation {o}")
