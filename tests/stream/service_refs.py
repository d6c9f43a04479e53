"""Real JPEGs for the service and server tests (the same recipe as tests/conftest.py's folders)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image


def jpeg(rng: np.random.Generator, h: int, w: int, quality: int = 90) -> bytes:
    # Smooth colour field plus grain: compresses like a photograph, decodes deterministically.
    small = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
    arr = np.clip(np.asarray(img).astype(np.int16) + rng.integers(-8, 9, size=(h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def jpegs(count: int, seed: int = 7, sizes: tuple[int, int] = (40, 160)) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [jpeg(rng, int(rng.integers(*sizes)), int(rng.integers(*sizes))) for _ in range(count)]
