"""An LMDB's values found in its mapped data file, a chunk of keys in one C call that keeps the GIL
(``_native/lmdb_tree.h``; ``hr_lmdb_find`` in ``_native/read_files.c``), and its keys listed the
same way (``hr_lmdb_keys``).

py-lmdb lets the GIL go around every ``get``, so beside a thread busy in Python each lookup waited
for that thread's switch interval: the LMDB reader fell to ~460 values/s on the 2-core VM. Here a
chunk's lookups run in C with the GIL held and give spans of the map, which the sample pool copies
out in one call. Its cursor, too, lets the GIL go a key: listing 32,768 keys beside a busy thread
took 12 s on the 2-core VM, against 45 ms alone. The caller holds a py-lmdb read transaction over each ``find`` (its reader slot
keeps the pages in place) and gives its id; a key the walk does not read exactly as LMDB would is
looked up by py-lmdb, which also names every error.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable, Sequence

import numpy as np

from ._read_files import lmdb_finder, lmdb_key_lister

__all__ = ["KeyTable", "MappedTree"]


class KeyTable:
    """A reader's keys packed once, so that a chunk's are two NumPy gathers, not a ctypes
    conversion per key."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        lengths = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys))
        self.lengths = lengths
        self.starts = np.concatenate([np.zeros(1, np.int64), np.cumsum(lengths)[:-1]]) if len(keys) else lengths
        self.packed = np.frombuffer(b"".join(keys) or b"\0", dtype=np.uint8)


class MappedTree:
    """The data file of the LMDB at ``path`` (a folder or a file, as py-lmdb opens it) mapped
    read-only, for ``find``; ``None`` from ``open`` where the C helper does not build or the file
    cannot be mapped. Mapping the data file is not opening the environment again: LMDB's locks
    are in its lock file, which this never opens."""

    def __init__(self, mapped: mmap.mmap, psize: int, find: Callable[..., int]) -> None:
        self._mapped = mapped
        self._view = np.frombuffer(mapped, dtype=np.uint8)
        self.address = self._view.ctypes.data
        self._length = len(mapped)
        self._psize = psize
        self._find = find

    @classmethod
    def open(cls, path: str, psize: int) -> MappedTree | None:
        find = lmdb_finder()
        if find is None:
            return None
        data = os.path.join(path, "data.mdb") if os.path.isdir(path) else path
        try:
            with open(data, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # gone, empty, or not mappable: py-lmdb reads it
            return None
        return cls(mapped, psize, find)

    def find(self, txn_id: int, keys: KeyTable, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """Keys ``indices``' values as (offsets into the map, sizes): an offset of -1 for a key
        not there, -2 for one to ask py-lmdb; None where the whole chunk goes to py-lmdb (the
        transaction's meta page was written over, another format)."""
        picked = np.asarray(indices, dtype=np.int64)
        starts, lengths = keys.starts[picked], keys.lengths[picked]
        offsets, sizes = np.empty(len(picked), np.int64), np.empty(len(picked), np.int64)
        found = self._find(self.address, self._length, self._psize, txn_id, len(picked), keys.packed.ctypes.data,
                           starts.ctypes.data, lengths.ctypes.data, offsets.ctypes.data, sizes.ctypes.data)
        return None if found < 0 else (offsets, sizes)

    def keys(self, txn_id: int) -> list[bytes] | None:
        """The main database's keys in order as of read transaction ``txn_id``, but named
        databases' names; None where the walk does not read the tree exactly as LMDB would (a
        writer moved past the transaction, a damaged page, a duplicate-sorted database), for the
        caller's cursor to list them. Two walks: one counts, one copies."""
        walk = lmdb_key_lister()
        if walk is None:
            return None
        total = np.zeros(1, np.int64)
        count = walk(self.address, self._length, self._psize, txn_id, None, 0, None, 0, total.ctypes.data)
        if count < 0:
            return None
        packed = np.empty(max(int(total[0]), 1), np.uint8)
        lengths = np.empty(max(count, 1), np.int64)
        expected = int(total[0])
        again = walk(self.address, self._length, self._psize, txn_id, packed.ctypes.data, len(packed),
                     lengths.ctypes.data, count, total.ctypes.data)
        if again != count or int(total[0]) != expected:
            return None
        data = packed.tobytes()
        ends = np.cumsum(lengths[:count]).tolist()
        return [data[start:end] for start, end in zip([0, *ends[:-1]], ends)]

    def close(self) -> None:
        """Unmap; only once no ``find`` runs and no span of it is read."""
        self._view = None
        self._mapped.close()
