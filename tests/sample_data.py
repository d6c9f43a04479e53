"""Real test data made in memory: photograph-like JPEGs and tar archives (shared by the test folders).

A plain module, not a conftest: tests import it by name (pytest puts ``tests/`` on ``sys.path``
when it loads ``tests/conftest.py``).
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["jpeg_bytes", "make_folder", "tar_bytes"]


def jpeg_bytes(rng: np.random.Generator, h: int, w: int, quality: int = 90) -> bytes:
    # Smooth colour field plus grain: compresses like a photograph, decodes deterministically.
    small = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
    arr = np.clip(np.asarray(img).astype(np.int16) + rng.integers(-8, 9, size=(h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """An uncompressed tar archive of ``(name, data)`` members, in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_folder(root: Path, classes: int, per_class: int, seed: int = 0) -> Path:
    """A class-per-folder tree ``root/c{class}/{i:04d}.jpg`` of JPEGs 40-120 px a side."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        d = root / f"c{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            h, w = int(rng.integers(40, 120)), int(rng.integers(40, 120))
            (d / f"{i:04d}.jpg").write_bytes(jpeg_bytes(rng, h, w))
    return root
