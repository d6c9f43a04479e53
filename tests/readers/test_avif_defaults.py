"""AVIF files are images by default: ``readers.files`` lists ``.avif`` among its extensions and a
pipeline takes an ``avif`` field as the image, as it takes ``webp`` (Pillow decodes AVIF since 11.2)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, features

from headrace import Loader, ops, readers

pytestmark = pytest.mark.skipif(not features.check("avif"), reason="this Pillow has no AVIF codec")


def _avif(rng: np.random.Generator) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(out, format="AVIF", quality=90)
    return out.getvalue()


async def test_a_folder_of_avif_files_is_read_and_decoded_by_default(tmp_path):
    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp_path / c).mkdir()
        for i in range(3):
            (tmp_path / c / f"{i}.avif").write_bytes(_avif(rng))
    reader = readers.files(tmp_path)
    assert len(reader) == 6
    async with Loader(reader, batch_size=6, pipeline=ops.Pipeline([ops.Decode(), ops.Resize((24, 32))], layout="HWC")) as loader:
        batches = [b async for b in loader]
    assert len(batches) == 1 and tuple(batches[0]["image"].shape) == (6, 24, 32, 3)
    assert batches[0]["label"].tolist() == [0, 0, 0, 1, 1, 1]


async def test_an_avif_field_is_the_image_of_a_sample():
    rng = np.random.default_rng(1)
    items = [{"avif": _avif(rng), "cls": b"2"} for _ in range(2)]
    async with Loader(readers.sequence(items), batch_size=2,
                      pipeline=ops.Pipeline([ops.Decode(), ops.Resize((24, 32))], layout="HWC")) as loader:
        batch = [b async for b in loader][0]
    assert tuple(batch["image"].shape) == (2, 24, 32, 3) and batch["label"].tolist() == [2, 2]
