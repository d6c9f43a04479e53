"""16-bit grey images (PNG, TIFF) decode to their high byte, as Pillow reads 16-bit colour; its own
conversion of 16-bit grey clipped at 255, so a full-range image came out nearly white."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

import headrace
from headrace import ops, readers


def _grey16(fmt: str) -> tuple[bytes, np.ndarray]:
    values = (np.arange(16 * 64, dtype=np.uint16).reshape(16, 64) * 64).astype(np.uint16)
    buf = io.BytesIO()
    Image.fromarray(values).save(buf, fmt)
    return buf.getvalue(), values


@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
@pytest.mark.parametrize("color", ["rgb", "gray"])
def test_sixteen_bit_grey_decodes_to_its_high_byte(tmp_path, fmt, color):
    data, values = _grey16(fmt)
    (tmp_path / "c0").mkdir()
    (tmp_path / "c0" / f"ramp.{fmt.lower()}").write_bytes(data)
    pipe = ops.Pipeline([ops.Decode(color=color)], layout="HWC")
    with headrace.Loader(readers.files(tmp_path), batch_size=1, pipeline=pipe, device="cpu").sync() as epochs:
        [batch] = list(epochs)
    image = batch["image"][0].numpy()
    want = (values >> 8).astype(np.uint8)
    assert image.shape == (16, 64, 3 if color == "rgb" else 1)
    for channel in range(image.shape[2]):
        np.testing.assert_array_equal(image[:, :, channel], want)
