"""The ``bytes`` objects readers copy sample fields into, recycled once nobody else holds them
(``_native/sample_pool.c``): the WebDataset reader's members, the TFRecord reader's features, the
LMDB reader's values and the files reader's files."""

from __future__ import annotations

import ctypes
import functools
import os
import sysconfig
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from headrace import _native as native

__all__ = ["SamplePool", "reader_pool"]


def reader_pool(io_threads: int, chunk_size: int) -> SamplePool:
    """An indexed reader's pool: it follows the chunks its I/O threads fill and those the loader holds."""
    return SamplePool(4 * (io_threads + 2) * chunk_size + 2048)


class SamplePool:
    """Recycles the memory of the ``bytes`` that readers copy fields into (the shard reader's
    ``_own_bytes`` and ``grouper``, the TFRecord reader's ``examples``, the LMDB reader's values,
    the files reader's reads through ``blob_maker``;
    ``_native/sample_pool.c``): a blob whose last reference is the pool's (no sample, view or
    array holds it) is filled again with a later member of its size class, its pages already
    faulted in, instead of being freed on the consumer's thread and allocated afresh on a parser's.

    Fresh memory cost most of a copy: a parser thread allocates in its own glibc arena, and freeing
    64 KiB chunks trims it. On the 2-core CI machine the reader alone over local shards (68 KB
    members) spent 30-43 µs of CPU a sample with no shuffle buffer (3-5 page faults a sample) and
    its arenas grew to ~270 MB RSS behind a 1,000-sample buffer (docs/storage.md has the numbers).

    Bounds: it follows at most ``track`` blobs handed out (the oldest is forgotten, then freed by
    its last holder as any bytes is) and keeps at most as many bytes free as those it follows held
    at their peak; ``close()``, or its collection (a reader's lives as long as the reader, for
    its next epochs), frees what it keeps. ``copy`` gives None where the helper does not
    build (no compiler or Python headers, ``HEADRACE_NO_C_HELPERS``): the caller copies as before.
    Thread-safe: every call holds the GIL, which it lets go only around the copies.
    """

    def __init__(self, track: int) -> None:
        lib = _pool_lib()
        self._lib = lib
        self._handle = lib.hr_pool_new(track) if lib is not None else None
        self._close = weakref.finalize(self, lib.hr_pool_free, self._handle) if self._handle else None

    @property
    def available(self) -> bool:
        """Whether the helper built and the pool is open (``copy`` copies into recycled blobs)."""
        return self._handle is not None and self._close is not None and self._close.alive

    def grouper(self) -> Callable[..., list | None] | None:
        """``hr_tar_groups`` bound to this pool, for ``_tar.iter_groups``: a scanned window's
        members grouped into samples and copied into the pool's blobs in one call; None where
        the helper does not build."""
        if not self.available:
            return None
        return functools.partial(self._lib.hr_tar_groups, self._handle)

    def blob_maker(self) -> tuple[int, int] | None:
        """``hr_pool_blob``'s address and this pool's handle, for the files reader's chunk reads
        (``_read_files.ChunkReader.read_table``): each file read into a blob of the pool. The pool
        must stay open while a read that was given them runs; None where the helper does not build."""
        if not self.available:
            return None
        return ctypes.cast(self._lib.hr_pool_blob, ctypes.c_void_p).value, self._handle

    def copy(self, spans: Sequence[tuple[int, int]]) -> list[bytes] | None:
        """A ``bytes`` of each ``(address, size)`` span, the memory valid until this returns."""
        return self._call(self._lib.hr_pool_copy, spans) if self.available else None

    def examples(self, spans: Sequence[tuple[int, int]], names: ctypes.Array, name_lengths: np.ndarray) -> list | None:
        """For the TFRecord reader: each ``(address, size)`` span's ``tf.train.Example`` as a tuple of
        the wanted features' values (``names``, C strings of ``name_lengths`` bytes; a bytes value in
        a blob of the pool, an int64 as an int), or None where protobuf must parse it; the memory
        valid until this returns. None where the helper does not build."""
        if not self.available:
            return None
        return self._call(self._lib.hr_tf_examples, spans, len(names), ctypes.addressof(names), name_lengths.ctypes.data)

    def datums(self, spans: Sequence[tuple[int, int]]) -> list | None:
        """For the Caffe reader: each ``(address, size)`` span's encoded ``caffe.Datum`` as a tuple
        (its image in a blob of the pool, its label or None), or None where protobuf must parse it;
        the memory valid until this returns. None where the helper does not build."""
        return self._call(self._lib.hr_datums, spans) if self.available else None

    def _call(self, function: Callable[..., list], spans: Sequence[tuple[int, int]], *more: int) -> list:
        n = len(spans)
        addresses = np.fromiter((address for address, _ in spans), dtype=np.uint64, count=n)
        sizes = np.fromiter((size for _, size in spans), dtype=np.int64, count=n)
        return function(self._handle, n, addresses.ctypes.data, sizes.ctypes.data, *more)

    def stats(self) -> dict[str, int]:
        """Blobs followed and in stock, the stock's bytes, the followed blobs' peak bytes, reuses
        and new blobs (for tests and benchmarks)."""
        out = (ctypes.c_int64 * 6)()
        if self._close is not None and self._close.alive:
            self._lib.hr_pool_stats(self._handle, out)
        return dict(zip(("followed", "stocked", "stock_bytes", "peak_bytes", "reused", "new"), out))

    def close(self) -> None:
        """Free the stock and forget the blobs handed out (their holders keep them); idempotent.
        Only once no ``copy`` runs."""
        if self._close is not None:
            self._close()


_POOL_SOURCE = Path(__file__).parent / "_native" / "sample_pool.c"
_POOL_HEADERS = tuple(Path(__file__).parent / "_native" / name  # included by it
                      for name in ("protobuf_wire.h", "tf_example.h", "caffe_datum.h"))
_pool_state: dict[str, ctypes.PyDLL | None] = {}
_pool_lock = threading.Lock()


def _pool_lib() -> ctypes.PyDLL | None:
    """The pool's helper, built against this interpreter's headers; None where it cannot be."""
    with _pool_lock:
        if "lib" not in _pool_state:
            lib = None
            include = sysconfig.get_paths().get("include")
            if include and os.path.exists(os.path.join(include, "Python.h")):
                # The ABI tag goes into the flags, so each interpreter gets a build of its own.
                target, _ = native.build("sample_pool", _POOL_SOURCE, inputs=_POOL_HEADERS, flags=(
                    f"-I{include}", f"-DHR_PY_ABI={sysconfig.get_config_var('SOABI')}"))
                if target is not None:
                    lib = ctypes.PyDLL(str(target))
                    p = ctypes.c_void_p
                    lib.hr_pool_new.argtypes, lib.hr_pool_new.restype = [ctypes.c_int64], p
                    lib.hr_pool_copy.argtypes, lib.hr_pool_copy.restype = [p, ctypes.c_int, p, p], ctypes.py_object
                    lib.hr_pool_blob.argtypes, lib.hr_pool_blob.restype = [p, ctypes.c_int64], ctypes.py_object
                    lib.hr_pool_stats.argtypes, lib.hr_pool_stats.restype = [p, p], None
                    lib.hr_pool_free.argtypes, lib.hr_pool_free.restype = [p], None
                    i64, o = ctypes.c_int64, ctypes.py_object
                    lib.hr_tar_groups.argtypes = [p, p, p, ctypes.c_int, i64, o, i64, o, o]
                    lib.hr_tar_groups.restype = o
                    lib.hr_tf_examples.argtypes = [p, ctypes.c_int, p, p, ctypes.c_int, p, p]
                    lib.hr_tf_examples.restype = o
                    lib.hr_datums.argtypes, lib.hr_datums.restype = [p, ctypes.c_int, p, p], o
            _pool_state["lib"] = lib
        return _pool_state["lib"]
