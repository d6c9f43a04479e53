"""Whole local files, a chunk per pair of GIL-free calls (``_native/read_files.c``), else one by one.

Each ``open``/``read``/``close`` from Python drops and retakes the GIL, and retaking it waits for
the thread holding it to reach its switch interval: with one busy Python thread beside it, reading
files one by one fell from 20,082 to 188 files/s on the 2-core CI machine (readers/README.md). The
helper opens a chunk's files in one call and reads them in another; in between, Python makes an
uninitialised ``bytes`` object of each file's size for the helper to fill, so every sample owns
its bytes exactly as after ``f.read()``. Where Python's headers are at hand the helper is built
with them and does all of that in one call (``hr_read_chunk``), letting the GIL go around its I/O;
given a sample pool's ``blob_maker()`` it reads into the pool's recycled ``bytes`` instead of fresh
ones (a fresh one's malloc and page faults cost more than its read from the page cache).

Both ways follow the same rules (the top of ``_native/read_files.c`` says why): only regular files
are read, each up to the size it had when opened, and a chunk larger than the descriptors left goes
in several rounds. A failure is the same OSError either way (``_error``).
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sysconfig
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from headrace import _native as native

__all__ = ["ChunkReader", "PathTable", "copy_spans", "lmdb_finder", "list_folder", "lmdb_key_lister", "pread_records", "scan_records", "tar_scanner", "unavailable_reason"]

_SOURCE = Path(__file__).parent / "_native" / "read_files.c"
_HEADERS = (Path(__file__).parent / "_native" / "lmdb_tree.h",)  # included by it
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
                target, _state["reason"] = native.build("read_files", _SOURCE, inputs=_HEADERS, flags=(
                    "-DHR_WITH_PYTHON", f"-I{include}", f"-DHR_PY_ABI={sysconfig.get_config_var('SOABI')}"))
                with_python = target is not None
            if not with_python:
                target, _state["reason"] = native.build("read_files", _SOURCE, inputs=_HEADERS)
            if target is not None:
                lib = ctypes.CDLL(str(target))
                p = ctypes.c_void_p
                lib.hr_open_files.argtypes, lib.hr_open_files.restype = [ctypes.c_int, p, p, p, p], ctypes.c_int
                lib.hr_read_files.argtypes, lib.hr_read_files.restype = [ctypes.c_int, p, p, p, p], None
                lib.hr_close_files.argtypes, lib.hr_close_files.restype = [ctypes.c_int, p], None
                lib.hr_copy_spans.argtypes, lib.hr_copy_spans.restype = [ctypes.c_int, p, p, p], None
                lib.hr_pread_records.argtypes = [ctypes.c_int, p, p, p, p, p]
                lib.hr_pread_records.restype = None
                lib.hr_list_folder.argtypes = [ctypes.c_char_p, p, ctypes.c_int64, p, ctypes.c_int64, p]
                lib.hr_list_folder.restype = ctypes.c_int64
                for scan in (lib.hr_scan_tfrecords, lib.hr_scan_recordio):
                    scan.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, p, p]
                    scan.restype = ctypes.c_int64
                # Through PyDLL, the GIL held: a scan of a window's headers takes ~3.5 µs, and a
                # thread that lets the GIL go, however briefly, waits to take it back behind the
                # threads that took it meanwhile (up to the 5 ms switch interval). Profiled on an
                # H200 with the streamed pipeline, this call was the shard parsers' most-sampled line
                # outside their waits (docs/benchmarks.md); on the 2-core VM, 105 of its 112
                # samples there were in handing the GIL over and taking it back, 7 in the scan.
                with_gil = ctypes.PyDLL(str(target))  # the same library, its calls keeping the GIL
                lib.tar_scan = with_gil.hr_tar_scan
                lib.tar_scan.argtypes, lib.tar_scan.restype = [p, ctypes.c_int64, ctypes.c_int64, p], ctypes.c_int64
                lib.lmdb_find = with_gil.hr_lmdb_find  # the same reason: py-lmdb's lookups let the GIL go
                i64 = ctypes.c_int64
                lib.lmdb_find.argtypes = [p, i64, i64, ctypes.c_uint64, ctypes.c_int, p, p, p, p, p]
                lib.lmdb_find.restype = i64
                lib.lmdb_keys = with_gil.hr_lmdb_keys  # the same reason: py-lmdb's cursor lets it go a key
                lib.lmdb_keys.argtypes = [p, i64, i64, ctypes.c_uint64, p, i64, p, i64, p]
                lib.lmdb_keys.restype = i64
                lib.read_chunk = None
                if with_python:  # holds the GIL when called, and lets it go around its I/O itself
                    read_chunk = with_gil.hr_read_chunk
                    read_chunk.argtypes, read_chunk.restype = [ctypes.c_int, p, p, p], ctypes.py_object
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

    def read(self, paths: Sequence[bytes], blobs_from: tuple[int, int] | None = None) -> list[bytes | OSError]:
        """Each file's bytes, or the OSError reading it raised (``paths`` encoded by ``os.fsencode``).
        ``blobs_from``: as for ``read_table``."""
        if self._lib is None:
            return [_read_one(p) for p in paths]
        table = (ctypes.c_char_p * len(paths))(*paths)
        blobs, failed = self._read_native(len(paths), ctypes.addressof(table), blobs_from)
        return _with_errors(blobs, paths.__getitem__) if failed else blobs

    def read_table(self, table: PathTable, indices: Sequence[int],
                   blobs_from: tuple[int, int] | None = None) -> tuple[list[bytes | OSError], int]:
        """``read`` of ``table``'s paths ``indices``, and how many of them failed (needs ``native``).
        ``blobs_from``: a sample pool's ``blob_maker()``, whose recycled ``bytes`` the files are read
        into (where the helper is built with Python's headers; else fresh ones)."""
        pointers = table.pointers(indices)
        blobs, failed = self._read_native(len(pointers), pointers.ctypes.data, blobs_from)
        if failed:
            blobs = _with_errors(blobs, lambda k: table.path(indices[k]))
        return blobs, failed

    def _read_native(self, n: int, table: int, blobs_from: tuple[int, int] | None = None) -> tuple[list[bytes | int], int]:
        """(blobs, failed) as ``hr_read_chunk`` gives them: an errno (int) where a file failed."""
        lib = self._lib
        assert lib is not None
        if lib.read_chunk is not None:
            new_blob, pool = blobs_from or (None, None)
            return lib.read_chunk(n, table, new_blob, pool)
        fds = np.full(n, -1, dtype=np.int32)
        sizes, errs = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int32)
        out: list[bytes | int] = []
        while len(out) < n:  # one round unless the process runs out of descriptors partway
            out += self._read_round(len(out), n, table, fds, sizes, errs)
        return out, int(np.count_nonzero(errs))

    def _read_round(self, start: int, n: int, table: int, fds: np.ndarray, sizes: np.ndarray,
                    errs: np.ndarray) -> list[bytes | int]:
        """Opens and reads from file ``start`` on, as far as ``hr_open_files`` goes: their blobs."""
        lib = self._lib
        assert lib is not None
        at = _address_from(start)
        count = lib.hr_open_files(n - start, table + start * ctypes.sizeof(ctypes.c_void_p),
                                  at(fds), at(sizes), at(errs))
        end = start + count
        try:
            wanted = sizes[start:end].tolist()
            blobs = [_new_bytes(None, size) if fd >= 0 else None
                     for fd, size in zip(fds[start:end].tolist(), wanted)]
            outs = (ctypes.c_char_p * count)(*blobs)  # the bytes objects' own storage, no copy
            lib.hr_read_files(count, at(fds), outs, at(sizes), at(errs))
        finally:
            lib.hr_close_files(count, at(fds))
        out: list[bytes | int] = []
        for blob, want, got, err in zip(blobs, wanted, sizes[start:end].tolist(), errs[start:end].tolist()):
            if err:
                out.append(err)
            else:
                out.append(blob if got == want else blob[:got])  # a file that shrank meanwhile
        return out


def _address_from(start: int) -> Callable[[np.ndarray], int]:
    """The address of element ``start`` of an array, for the C helper's per-file arrays."""
    return lambda array: array.ctypes.data + start * array.itemsize


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


def pread_records(table: np.ndarray, scratch: np.ndarray) -> np.ndarray | None:
    """Records at (file descriptor, offset, length) rows of ``table`` read one after another into
    ``scratch`` in one GIL-free call: the bytes each read (short at its file's end; ``-errno``
    where the read failed). None without the C helper."""
    lib = _load()
    if lib is None:
        return None
    fds = table[:, 0].astype(np.int32)
    offsets, lengths = np.ascontiguousarray(table[:, 1]), np.ascontiguousarray(table[:, 2])
    got = np.empty(len(table), dtype=np.int64)
    lib.hr_pread_records(len(table), fds.ctypes.data, offsets.ctypes.data, lengths.ctypes.data, scratch.ctypes.data,
                         got.ctypes.data)
    return got


_SCAN_CAP = 65536  # records a call: 1 MiB of pairs, a GIL hand-over per 65,536 records


def scan_records(kind: str, fd: int, size: int, path: str) -> tuple[np.ndarray, int] | None:
    """The records of the file ``path`` (open as ``fd``, ``size`` bytes) found from byte 0 by
    ``hr_scan_tfrecords``/``hr_scan_recordio`` (``kind`` "tfrecord" or "recordio"): an (n, 2)
    array of pairs as the Python scan gives them, and where the first record it leaves to Python
    starts (``size`` where none). None without the C helper; OSError naming ``path`` where a read
    failed."""
    lib = _load()
    if lib is None:
        return None
    scan = lib.hr_scan_tfrecords if kind == "tfrecord" else lib.hr_scan_recordio
    parts, pos = [], 0
    end = np.zeros(1, np.int64)
    while True:
        out = np.empty((_SCAN_CAP, 2), np.int64)
        found = scan(fd, pos, size, _SCAN_CAP, out.ctypes.data, end.ctypes.data)
        if found < 0:
            raise OSError(-found, os.strerror(-found), path)
        parts.append(out[:found])
        pos = int(end[0])
        if found < _SCAN_CAP:
            return np.concatenate(parts), pos


def list_folder(path: str) -> list[tuple[str, int]] | None:
    """The entries of folder ``path`` as (name, d_type) pairs, listed in one GIL-free call
    (``hr_list_folder``), "." and ".." left out, names as ``os.scandir`` gives them. None without
    the C helper; OSError naming ``path`` where the folder cannot be listed."""
    lib = _load()
    if lib is None:
        return None
    cap, names_cap = 256, 16384
    total = np.zeros(1, np.int64)
    while True:
        names, types = np.empty(names_cap, np.uint8), np.empty(cap, np.uint8)
        found = lib.hr_list_folder(os.fsencode(path), names.ctypes.data, names_cap, types.ctypes.data, cap,
                                   total.ctypes.data)
        if found < 0:
            raise OSError(-found, os.strerror(-found), path)
        if found <= cap and total[0] <= names_cap:
            listed = names[: int(total[0])].tobytes().split(b"\0")[:found]
            return list(zip(map(os.fsdecode, listed), types[:found].tolist()))
        cap, names_cap = 2 * max(cap, found), 2 * max(names_cap, int(total[0]))  # it grew: room for more


def tar_scanner() -> Callable[[int, int, int, int], int] | None:
    """``hr_tar_scan(address, length, max, records)`` (``_tar.py`` reads shards' headers with it);
    None without the C helper."""
    lib = _load()
    return None if lib is None else lib.tar_scan


def lmdb_finder() -> Callable[..., int] | None:
    """``hr_lmdb_find`` (``_lmdb_tree.py`` walks an LMDB's B+tree with it, the GIL held); None
    without the C helper."""
    lib = _load()
    return None if lib is None else lib.lmdb_find


def lmdb_key_lister() -> Callable[..., int] | None:
    """``hr_lmdb_keys`` (``_lmdb_tree.py`` lists an LMDB's keys with it, the GIL held); None
    without the C helper."""
    lib = _load()
    return None if lib is None else lib.lmdb_keys


def _with_errors(blobs: list, path_of: Callable[[int], bytes]) -> list[bytes | OSError]:
    """``blobs`` with each errno turned into its OSError (``_error``)."""
    return [_error(b, path_of(k)) if type(b) is int else b for k, b in enumerate(blobs)]


def _error(code: int, path: bytes) -> OSError:
    """The OSError for a file that failed with errno ``code``: the subclass Python's ``open`` would
    raise, named by the path as text, the same whether the C helper or Python read it."""
    message = _NOT_REGULAR if code == errno.EINVAL else os.strerror(code)
    return OSError(code, message, os.fsdecode(path))


_NOT_REGULAR = "not a regular file (a FIFO, socket or device), which has no size to read"

# O_NONBLOCK: a FIFO without a writer opens at once, to be refused by its type, instead of hanging.
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


def _read_one(path: bytes) -> bytes | OSError:
    """The C helper's rules for one file, in Python (``os.open`` retries after EINTR itself)."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        return _error(exc.errno, path)
    try:
        mode = os.fstat(fd)
        if stat.S_ISDIR(mode.st_mode):
            return _error(errno.EISDIR, path)
        if not stat.S_ISREG(mode.st_mode):
            return _error(errno.EINVAL, path)
        os.set_blocking(fd, True)  # as the C helper: a FUSE or network file system may honour O_NONBLOCK
        return _read_up_to(fd, mode.st_size)
    except OSError as exc:
        return _error(exc.errno, path)
    finally:
        os.close(fd)


def _read_up_to(fd: int, size: int) -> bytes:
    """``size`` bytes of ``fd``, or fewer if the file shrank; a file that grew is cut at ``size``.
    Several reads only where one returns less (Linux reads at most about 2 GiB at a time)."""
    data = os.read(fd, size) if size else b""
    if len(data) == size or not data:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        part = os.read(fd, size - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)
