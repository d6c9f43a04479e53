"""Real JPEGs for the service and server tests (the same recipe as tests/conftest.py's folders)."""

from __future__ import annotations

import numpy as np
from sample_data import jpeg_bytes as jpeg


def jpegs(count: int, seed: int = 7, sizes: tuple[int, int] = (40, 160)) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [jpeg(rng, int(rng.integers(*sizes)), int(rng.integers(*sizes))) for _ in range(count)]
