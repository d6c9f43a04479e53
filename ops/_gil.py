"""NumPy calls small enough to keep the GIL, for the per-batch planning of the GPU path.

NumPy lets the GIL go for a loop over more than 500 elements. Letting it go is free; taking it
back is not: the thread waits behind whichever threads took it meanwhile. In the GPU path's prep
thread, which plans every batch for all the lanes, those waits came to 15-20 ms a batch over S3
(6 ms from local disk) against 4 ms of its own CPU, and it was then the pipeline's limit (H100,
docs/benchmarks.md, issue 21). So the planning works on arrays of at most ``KEPT`` elements, makes
zeroed arrays with ``zeros``, and indexes with slices or masks rather than index arrays (which NumPy
gathers with the GIL let go, whatever their size): a batch of up to 500 samples is planned without
giving up the GIL. AugMix's chains are planned as one batch of samples x width rows, which passes
the limit (768 for 256 samples: ~60 hand-offs a batch beside a spinning thread); a batch a chain
kept the GIL but cost twice the planning, and ran slower on the H200 (docs/benchmarks.md,
thirty-fourth session).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

KEPT = 500  # NumPy's NPY_BEGIN_THREADS_THRESHOLDED: loops over more elements release the GIL


def zeros(n: int, dtype: np.dtype | type = np.float64) -> np.ndarray:
    """``np.zeros(n, dtype)`` without giving up the GIL: NumPy lets it go around the ``calloc`` of a
    zeroed array of 1 KiB or more (``npy_alloc_cache_zero``); ``np.full`` fills in a small loop."""
    return np.full(n, 0, dtype=dtype)


def columns(cols: Sequence[np.ndarray], dtype: np.dtype | type) -> np.ndarray:
    """An (n, len(cols)) array of ``dtype`` filled a column at a time (``np.stack`` copies and casts
    the whole array in one loop, over ``KEPT`` elements from 126 rows of 4)."""
    out = np.empty((len(cols[0]), len(cols)), dtype=dtype)
    for j, col in enumerate(cols):
        out[:, j] = col
    return out
