"""The class-per-folder data sets the GPU tests read: a few classes of images at random sizes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np


def class_folders(root: Path, rng: np.random.Generator, classes: int, per_class: int,
                  encode: Callable[[np.random.Generator, int, int], bytes], suffix: str, low: int, high: int) -> Path:
    """``root``/c{k}/{i:03d}.{suffix}: ``per_class`` images a class, each ``encode(rng, h, w)`` with
    h and w drawn from [low, high) (height first), the draws in file order."""
    for c in range(classes):
        (root / f"c{c}").mkdir()
        for i in range(per_class):
            h, w = int(rng.integers(low, high)), int(rng.integers(low, high))
            (root / f"c{c}" / f"{i:03d}.{suffix}").write_bytes(encode(rng, h, w))
    return root
