"""Counter-based random numbers for per-sample parameters.

A sample's augmentation parameters are a pure function of (seed, epoch, sample index, op): no
generator state travels between threads, batches, ranks or resumes, so the same seed gives the
same batch whatever the batch size, the thread count, the world size or the resume point. The
function is splitmix64 over 64-bit counters, vectorised with NumPy (the GPU path can compute the
same numbers in a kernel).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np

from headrace import _native as native

from ._gil import KEPT

__all__ = ["uniforms"]

_SOURCE = Path(__file__).parent / "_native" / "uniforms.c"
_lock = threading.Lock()
_state: dict[str, tuple[ctypes.CDLL, ctypes.PyDLL] | None] = {}
# Up to this many numbers a call holds the GIL (tens of microseconds); a larger request lets it go.
_HELD = 1 << 16

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def _mix(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def _key(*parts: int) -> np.uint64:
    acc = np.zeros(1, dtype=np.uint64)
    for part in parts:
        acc = _mix(acc + np.uint64(part & _MASK64) + _GOLDEN)
    return acc[0]


def _helper() -> tuple[ctypes.CDLL, ctypes.PyDLL] | None:
    """The C helper (one call holding the GIL, one letting it go), built once; None where it cannot be."""
    with _lock:
        if "lib" not in _state:
            target, _ = native.build("uniforms", _SOURCE)
            libs = None
            if target is not None:
                libs = ctypes.CDLL(str(target)), ctypes.PyDLL(str(target))
                for lib in libs:
                    lib.hr_uniforms.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                                ctypes.c_int64, ctypes.c_void_p]
                    lib.hr_uniforms.restype = None
            _state["lib"] = libs
        return _state["lib"]


def uniforms(seed: int, epoch: int, op: int, indices: np.ndarray, count: int, *, first: int = 0) -> np.ndarray:
    """``count`` uniform floats in [0, 1) for each sample index: an array of shape (len(indices), count).

    Row ``r`` depends only on ``(seed, epoch, op, indices[r])``. ``first`` skips that many of the
    row's numbers (an op that draws again and again, ``RandomIoUCrop``, takes them in turns).
    The GPU path's prep thread calls this per batch: a C helper computes them in one call that
    keeps the GIL (``_native/uniforms.c``); without it, NumPy does, in blocks of rows small enough
    that it keeps the GIL too (``_gil``). The two give the same bits.
    """
    libs = _helper()
    if libs is None:
        return _uniforms_numpy(seed, epoch, op, indices, count, first=first)
    idx = np.ascontiguousarray(indices, dtype=np.int64).reshape(-1)
    out = np.empty((len(idx), count), dtype=np.float64)
    if out.size:
        lib = libs[1] if out.size <= _HELD else libs[0]
        lib.hr_uniforms(int(_key(seed, epoch, op)), idx.ctypes.data, len(idx), count, first, out.ctypes.data)
    return out


def _uniforms_numpy(seed: int, epoch: int, op: int, indices: np.ndarray, count: int, *, first: int = 0) -> np.ndarray:
    """``uniforms`` in NumPy, for machines without the C helper."""
    key = _key(seed, epoch, op)
    idx = np.asarray(indices, dtype=np.int64).astype(np.uint64).reshape(-1, 1)
    counters = np.arange(first + 1, first + count + 1, dtype=np.uint64).reshape(1, -1)
    out = np.empty((len(idx), count), dtype=np.float64)
    rows = max(1, KEPT // max(count, 1))
    with np.errstate(over="ignore"):
        steps = counters * _GOLDEN
        for lo in range(0, len(idx), rows):
            base = _mix(idx[lo : lo + rows] * _GOLDEN + key)
            bits = _mix(base + steps)
            out[lo : lo + rows] = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return out
