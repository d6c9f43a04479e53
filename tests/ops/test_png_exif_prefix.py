"""A PNG whose eXIf chunk keeps JPEG's ``Exif\\0\\0`` prefix (some writers do; the PNG spec says
not to) is turned upright, as Pillow's ``exif_transpose`` reads it and as the WebP reader already
did; it came out as stored."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import Image, ImageOps

import headrace
from headrace import ops, readers


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)


def _png_with_prefixed_exif(pixels: np.ndarray, orientation: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    plain = buf.getvalue()
    tiff = b"MM\x00\x2a\x00\x00\x00\x08" + struct.pack(">HHHIHH", 1, 0x0112, 3, 1, orientation, 0) + b"\x00\x00\x00\x00"
    end_of_ihdr = 8 + 8 + 13 + 4
    return plain[:end_of_ihdr] + _chunk(b"eXIf", b"Exif\x00\x00" + tiff) + plain[end_of_ihdr:]


def test_a_png_exif_chunk_with_the_jpeg_prefix_is_turned_upright_as_pillow_turns_it(tmp_path):
    rng = np.random.default_rng(3)
    pixels = rng.integers(0, 256, size=(12, 20, 3), dtype=np.uint8)
    data = _png_with_prefixed_exif(pixels, 6)
    want = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    assert want.shape == (20, 12, 3)  # Pillow turns it: the reference is not the stored image
    (tmp_path / "c0").mkdir()
    (tmp_path / "c0" / "turned.png").write_bytes(data)
    pipe = ops.Pipeline([ops.Decode()], layout="HWC")
    with headrace.Loader(readers.files(tmp_path), batch_size=1, pipeline=pipe, device="cpu").sync() as epochs:
        [batch] = list(epochs)
    np.testing.assert_array_equal(batch["image"][0].numpy(), want)
