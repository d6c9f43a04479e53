"""Whole local files, a chunk per pair of GIL-free calls (``_native/read_files.c``), else one by one.

Each ``open``/``read``/``close`` from Python drops and retakes the GIL, and retaking it waits for
the thread holding it to reach its switch interval: with one busy Python thread beside it, reading
files one by one fell from 20,082 to 188 files/s on the 2-core CI machine (readers/README.md). The
helper opens a chunk's files in one call and reads them in another; in between, Python makes an
uninitialised ``bytes`` object of each file's size for the helper to fill, so every sample owns
its bytes exactly as after ``f.read()``.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from headrace import _native as native

__all__ = ["ChunkReader", "unavailable_reason"]

_SOURCE = Path(__file__).parent / "_native" / "read_files.c"
_lock = threading.Lock()
_state: dict[str, Any] = {}

# bytes(size) without zeroing it: the helper writes every byte before anyone else sees the object.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes, _new_bytes.restype = [ctypes.c_void_p, ctypes.c_ssize_t], ctypes.py_object


def _load() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state:
            target, _state["reason"] = native.build("read_files", _SOURCE)
            lib = None
            if target is not None:
                lib = ctypes.CDLL(str(target))
                p = ctypes.c_void_p
                lib.hr_open_files.argtypes, lib.hr_open_files.restype = [ctypes.c_int, p, p, p, p], None
                lib.hr_read_files.argtypes, lib.hr_read_files.restype = [ctypes.c_int, p, p, p, p], None
                lib.hr_close_files.argtypes, lib.hr_close_files.restype = [ctypes.c_int, p], None
            _state["lib"] = lib
        return _state["lib"]


def unavailable_reason() -> str | None:
    """Why files are read one by one in Python here (None when the helper is used)."""
    _load()
    return _state.get("reason")


class ChunkReader:
    """Reads lists of paths; safe from several threads. ``HEADRACE_NATIVE_READ=0`` forces Python."""

    def __init__(self) -> None:
        self._lib = _load() if os.environ.get("HEADRACE_NATIVE_READ", "1") != "0" else None

    @property
    def native(self) -> bool:
        return self._lib is not None

    def read(self, paths: Sequence[bytes]) -> list[bytes | OSError]:
        """Each file's bytes, or the OSError reading it raised (``paths`` encoded by ``os.fsencode``)."""
        if self._lib is None:
            return [_read_one(p) for p in paths]
        lib, n = self._lib, len(paths)
        table = (ctypes.c_char_p * n)(*paths)
        fds = np.full(n, -1, dtype=np.int32)
        sizes, errs = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int32)
        lib.hr_open_files(n, table, fds.ctypes.data, sizes.ctypes.data, errs.ctypes.data)
        try:
            wanted = sizes.tolist()
            blobs = [_new_bytes(None, size) if fd >= 0 else None for fd, size in zip(fds.tolist(), wanted)]
            outs = (ctypes.c_char_p * n)(*blobs)  # the bytes objects' own storage, no copy
            lib.hr_read_files(n, fds.ctypes.data, outs, sizes.ctypes.data, errs.ctypes.data)
        finally:
            lib.hr_close_files(n, fds.ctypes.data)
        out: list[bytes | OSError] = []
        for path, blob, want, got, err in zip(paths, blobs, wanted, sizes.tolist(), errs.tolist()):
            if err:
                out.append(OSError(err, os.strerror(err), os.fsdecode(path)))
            else:
                out.append(blob if got == want else blob[:got])  # a file that shrank meanwhile
        return out


def _read_one(path: bytes) -> bytes | OSError:
    try:
        with open(path, "rb", buffering=0) as f:
            return f.readall()
    except OSError as exc:
        return exc
