"""Whole local files, a chunk per pair of GIL-free calls (``_native/read_files.c``), else one by one.

Each ``open``/``read``/``close`` from Python drops and retakes the GIL, and retaking it waits for
the thread holding it to reach its switch interval: with one busy Python thread beside it, reading
files one by one fell from 20,082 to 188 files/s on the 2-core CI machine (readers/README.md). The
helper opens a chunk's files in one call and reads them in another; in between, Python makes an
uninitialised ``bytes`` object of each file's size for the helper to fill, so every sample owns
its bytes exactly as after ``f.read()``. Where Python's headers are at hand the helper is built
with them and does all of that in one call (``hr_read_chunk``), letting the GIL go around its I/O.
"""

from __future__ import annotations

import ctypes
import os
import sysconfig
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from headrace import _native as native

__all__ = ["ChunkReader", "PathTable", "copy_spans", "tar_scanner", "unavailable_reason"]

_SOURCE = Path(__file__).parent / "_native" / "read_files.c"
_lock = threading.Lock()
_state: dict[str, Any] = {}

# bytes(size) without zeroing it: the helper writes every byte before anyone else sees the object.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.argtypes, _new_bytes.restype = [ctypes.c_void_p, ctypes.c_ssize_t], ctypes.py_object


def _load() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _state:
            lib, with_python = None, False
            include = sysconfig.get_paths().get("include")
            if include and os.path.exists(os.path.join(include, "Python.h")):
                # The ABI tag goes into the flags, so each interpreter gets a build of its own.
                target, _state["reason"] = native.build("read_files", _SOURCE, flags=(
                    "-DHR_WITH_PYTHON", f"-I{include}", f"-DHR_PY_ABI={sysconfig.get_config_var('SOABI')}"))
                with_python = target is not None
            if not with_python:
                target, _state["reason"] = native.build("read_files", _SOURCE)
            if target is not None:
                lib = ctypes.CDLL(str(target))
                p = ctypes.c_void_p
                lib.hr_open_files.argtypes, lib.hr_open_files.restype = [ctypes.c_int, p, p, p, p], None
                lib.hr_read_files.argtypes, lib.hr_read_files.restype = [ctypes.c_int, p, p, p, p], None
                lib.hr_close_files.argtypes, lib.hr_close_files.restype = [ctypes.c_int, p], None
                lib.hr_copy_spans.argtypes, lib.hr_copy_spans.restype = [ctypes.c_int, p, p, p], None
                lib.hr_tar_scan.argtypes, lib.hr_tar_scan.restype = [p, ctypes.c_int64, ctypes.c_int64, p], ctypes.c_int64
                lib.read_chunk = None
                if with_python:  # holds the GIL when called, and lets it go around its I/O itself
                    read_chunk = ctypes.PyDLL(str(target)).hr_read_chunk
                    read_chunk.argtypes, read_chunk.restype = [ctypes.c_int, p], ctypes.py_object
                    lib.read_chunk = read_chunk
            _state["lib"] = lib
        return _state["lib"]


def unavailable_reason() -> str | None:
    """Why files are read one by one in Python here (None when the helper is used)."""
    _load()
    return _state.get("reason")


class PathTable:
    """Paths encoded once (``os.fsencode``), packed with a NUL after each, so that a chunk's table
    of C strings is one NumPy expression instead of an encode and a ctypes conversion per file."""

    def __init__(self, paths: Sequence[str]) -> None:
        encoded = [os.fsencode(p) + b"\0" for p in paths]
        ends = np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)))
        self._starts = np.concatenate([np.zeros(1, np.int64), ends])  # path i: [starts[i], starts[i+1] - 1)
        self._packed = np.frombuffer(b"".join(encoded), dtype=np.uint8)

    def path(self, i: int) -> bytes:
        return self._packed[self._starts[i] : self._starts[i + 1] - 1].tobytes()

    def pointers(self, indices: Sequence[int]) -> np.ndarray:
        """The addresses of paths ``indices``, valid while this table lives."""
        return self._starts[np.asarray(indices, dtype=np.int64)] + self._packed.ctypes.data


class ChunkReader:
    """Reads lists of paths; safe from several threads. ``native=False`` reads in Python even when the
    C helper builds (to measure one against the other)."""

    def __init__(self, native: bool = True) -> None:
        self._lib = _load() if native else None

    @property
    def native(self) -> bool:
        return self._lib is not None

    def read(self, paths: Sequence[bytes]) -> list[bytes | OSError]:
        """Each file's bytes, or the OSError reading it raised (``paths`` encoded by ``os.fsencode``)."""
        if self._lib is None:
            return [_read_one(p) for p in paths]
        table = (ctypes.c_char_p * len(paths))(*paths)
        blobs, failed = self._read_native(len(paths), ctypes.addressof(table))
        return _with_errors(blobs, paths.__getitem__) if failed else blobs

    def read_table(self, table: PathTable, indices: Sequence[int]) -> tuple[list[bytes | OSError], int]:
        """``read`` of ``table``'s paths ``indices``, and how many of them failed (needs ``native``)."""
        pointers = table.pointers(indices)
        blobs, failed = self._read_native(len(pointers), pointers.ctypes.data)
        if failed:
            blobs = _with_errors(blobs, lambda k: table.path(indices[k]))
        return blobs, failed

    def _read_native(self, n: int, table: int) -> tuple[list[bytes | int], int]:
        """(blobs, failed) as ``hr_read_chunk`` gives them: an errno (int) where a file failed."""
        lib = self._lib
        assert lib is not None
        if lib.read_chunk is not None:
            return lib.read_chunk(n, table)
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
        out: list[bytes | int] = []
        for blob, want, got, err in zip(blobs, wanted, sizes.tolist(), errs.tolist()):
            if err:
                out.append(err)
            else:
                out.append(blob if got == want else blob[:got])  # a file that shrank meanwhile
        return out, int(np.count_nonzero(errs))


def copy_spans(spans: Sequence[tuple[int, int]]) -> list[bytes] | None:
    """A fresh ``bytes`` of each ``(address, size)`` span, all copied in one GIL-free call; None
    without the C helper. The memory must stay valid (its owner alive) until this returns."""
    lib = _load()
    if lib is None:
        return None
    n = len(spans)
    blobs = [_new_bytes(None, size) for _, size in spans]
    outs = (ctypes.c_char_p * n)(*blobs)  # the bytes objects' own storage, no copy
    sources = np.fromiter((address for address, _ in spans), dtype=np.uint64, count=n)
    sizes = np.fromiter((size for _, size in spans), dtype=np.int64, count=n)
    lib.hr_copy_spans(n, outs, sources.ctypes.data, sizes.ctypes.data)
    return blobs


def tar_scanner() -> Callable[[int, int, int, int], int] | None:
    """``hr_tar_scan(address, length, max, records)`` (``_tar.py`` reads shards' headers with it);
    None without the C helper."""
    lib = _load()
    return None if lib is None else lib.hr_tar_scan


def _with_errors(blobs: list, path_of: Callable[[int], bytes]) -> list[bytes | OSError]:
    """``blobs`` with each errno turned into the OSError that Python's ``open`` would raise."""
    return [OSError(b, os.strerror(b), os.fsdecode(path_of(k))) if type(b) is int else b
            for k, b in enumerate(blobs)]


def _read_one(path: bytes) -> bytes | OSError:
    try:
        with open(path, "rb", buffering=0) as f:
            return f.readall()
    except OSError as exc:
        return exc
