"""Small image data sets that headrace makes itself, for the demo, the tests and the benchmarks.

``make_image_folder`` writes a class-per-folder tree of JPEGs. With scikit-image installed (the
``bench`` extra) the images are random crops of its real photographs, as DESIGN.md §9 describes
(shorter side 256–600 px, light grain, quality 85–96, 4:2:0, about 70 KiB); without it they are
smooth random colour fields with shapes and grain, which still compress like photographs do.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["make_image_folder", "photographs"]

_COLOR_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field",
                 "retina", "stereo_motorcycle")
_GRAY_PHOTOS = ("camera", "brick", "grass", "gravel", "moon", "coins", "clock", "cell")


def photographs() -> list[np.ndarray] | None:
    """scikit-image's sample photographs as RGB uint8 arrays, or None without scikit-image."""
    try:
        import skimage.data as data
    except ImportError:
        return None
    out = []
    for name in _COLOR_PHOTOS + _GRAY_PHOTOS:
        try:
            img = getattr(data, name)()
        except Exception:  # a newer scikit-image may fetch some photos from the network
            continue
        if isinstance(img, tuple):
            img = img[0]
        img = np.asarray(img)
        if img.ndim == 2:
            img = np.repeat(img[..., None], 3, axis=2)
        out.append(np.ascontiguousarray(img[..., :3]).astype(np.uint8))
    return out or None


def _synthetic(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    # A low-resolution random field, upsampled smoothly, plus a few flat shapes: photo-like spectra.
    small = rng.integers(0, 256, size=(int(rng.integers(3, 9)), int(rng.integers(3, 9)), 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
    arr = np.asarray(img).copy()
    for _ in range(int(rng.integers(2, 6))):
        y0, x0 = int(rng.integers(0, h)), int(rng.integers(0, w))
        y1, x1 = min(h, y0 + int(rng.integers(h // 8, h // 2))), min(w, x0 + int(rng.integers(w // 8, w // 2)))
        arr[y0:y1, x0:x1] = rng.integers(0, 256, size=3)
    return arr


def _sample_image(rng: np.random.Generator, photos: list[np.ndarray] | None, short_side: int) -> Image.Image:
    if photos:
        src = photos[int(rng.integers(len(photos)))]
        sh, sw = src.shape[:2]
        frac = rng.uniform(0.5, 1.0)
        ch, cw = max(16, int(sh * frac)), max(16, int(sw * rng.uniform(0.5, 1.0)))
        y0, x0 = int(rng.integers(0, sh - ch + 1)), int(rng.integers(0, sw - cw + 1))
        img = Image.fromarray(src[y0 : y0 + ch, x0 : x0 + cw])
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    else:
        aspect = rng.uniform(0.6, 1.6)
        img = Image.fromarray(_synthetic(rng, 64, max(16, int(64 * aspect))))
    scale = short_side / min(img.size)
    img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))), Image.Resampling.BILINEAR)
    arr = np.asarray(img).astype(np.int16)
    grain = rng.normal(0.0, 3.0, size=arr.shape).astype(np.int16)
    return Image.fromarray(np.clip(arr + grain, 0, 255).astype(np.uint8))


def make_image_folder(
    root: str | os.PathLike,
    *,
    count: int = 512,
    classes: int = 10,
    seed: int = 0,
    short_side: tuple[int, int] = (256, 600),
    quality: tuple[int, int] = (85, 96),
    use_photographs: bool = True,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Write ``count`` JPEGs into ``root/class_XX/NNNNNN.jpg`` and return ``root``.

    Deterministic for a seed. Existing files with the same names are overwritten.
    """
    root = Path(root)
    rng = np.random.default_rng(seed)
    photos = photographs() if use_photographs else None
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        img = _sample_image(rng, photos, int(rng.integers(short_side[0], short_side[1] + 1)))
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=int(rng.integers(quality[0], quality[1] + 1)), subsampling="4:2:0")
        (root / f"class_{i % classes:02d}" / f"{i:06d}.jpg").write_bytes(buf.getvalue())
        if progress is not None:
            progress(1)
    return root
