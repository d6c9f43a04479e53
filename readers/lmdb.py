"""Samples from an LMDB: key → value bytes, split into fields by a user function or the default record format.

Default value convention (what ``headrace pack --format lmdb`` writes), ``encode_record``::

    b"HRS1" | u16 field count | per field: u8 name length, name (UTF-8), u32 data length | the data, in order

all integers little-endian. A value without that magic is taken as one raw image, its field named
by its signature (``jpg``, ``png``, ``webp``, ``gif``, ``bmp``, ``tif``; else ``bin``), with no label.
Entries named ``__...__`` are metadata: ``__keys__`` (a JSON list of keys, the sample order) and
``__meta__`` (JSON: classes, counts), and are never samples.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Self

from headrace._errors import ConfigError, ReadError
from headrace._sample import Sample

from ._base import Equal, IndexedReader

__all__ = ["LmdbReader", "decode_default", "decode_record", "encode_record", "lmdb"]

MAGIC = b"HRS1"
_HEAD = struct.Struct("<4sH")
_LEN = struct.Struct("<I")

Decode = Callable[[bytes, bytes], Mapping[str, Any]]


def encode_record(fields: Mapping[str, bytes | bytearray | memoryview]) -> bytes:
    """Pack named byte fields into one LMDB value (the default convention; see the module docstring)."""
    head, body = [_HEAD.pack(MAGIC, len(fields))], []
    for name, data in fields.items():
        raw = name.encode()
        if not 0 < len(raw) < 256:
            raise ConfigError(f"record field names must be 1-255 bytes, got {name!r}")
        head += [bytes([len(raw)]), raw, _LEN.pack(len(data))]
        body.append(bytes(data))
    return b"".join(head + body)


def decode_record(value: bytes) -> dict[str, bytes]:
    """The fields of a value written by ``encode_record``; ValueError if it is not one or is cut short."""
    if value[:4] != MAGIC or len(value) < _HEAD.size:
        raise ValueError("not a headrace record (no HRS1 magic)")
    _, count = _HEAD.unpack_from(value)
    pos, sizes = _HEAD.size, []
    for _ in range(count):
        if pos >= len(value) or pos + 1 + value[pos] + _LEN.size > len(value):
            raise ValueError(f"record is cut short in its header (field {len(sizes)} of {count})")
        n = value[pos]
        name = value[pos + 1 : pos + 1 + n].decode()
        (size,) = _LEN.unpack_from(value, pos + 1 + n)
        sizes.append((name, size))
        pos += 1 + n + _LEN.size
    fields = {}
    for name, size in sizes:
        if pos + size > len(value):
            raise ValueError(f"record is cut short: field {name!r} needs {size} bytes, {len(value) - pos} left")
        fields[name] = value[pos : pos + size]
        pos += size
    return fields


_SIGNATURES = ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG", "png"), (b"GIF8", "gif"), (b"BM", "bmp"),
               (b"II*\x00", "tif"), (b"MM\x00*", "tif"))


def decode_default(key: bytes, value: bytes) -> dict[str, bytes]:
    """A headrace record's fields, or ``{<image type>: value}`` for a value that is one raw image."""
    if value[:4] == MAGIC:
        return decode_record(value)
    if value[:4] == b"RIFF" and value[8:12] == b"WEBP":
        return {"webp": value}
    for signature, ext in _SIGNATURES:
        if value.startswith(signature):
            return {ext: value}
    return {"bin": value}


def lmdb_module() -> Any:
    """The ``lmdb`` package (py-lmdb), or an ImportError that says how to install it."""
    try:
        import lmdb as lmdb_lib
    except ImportError as exc:
        raise ImportError("reading or writing LMDB needs the lmdb package: pip install 'headrace[lmdb]'") from exc
    return lmdb_lib


class _Envs:
    """Open environments by real path, shared and reference-counted: LMDB (and py-lmdb) forbid opening
    one environment twice in a process, and several readers (ranks, epochs) may read one at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, list[Any]] = {}

    def acquire(self, path: str) -> Any:
        lmdb_lib = lmdb_module()
        with self._lock:
            entry = self._open.get(path)
            if entry is None:
                if not os.path.exists(path):
                    raise ReadError("no LMDB at this path", source=path)
                try:
                    env = lmdb_lib.open(path, subdir=os.path.isdir(path), readonly=True, lock=False,
                                        readahead=False, max_readers=1024)
                except lmdb_lib.Error as exc:
                    raise ReadError(f"cannot open LMDB: {exc}", source=path) from exc
                entry = self._open[path] = [env, 0]
            entry[1] += 1
            return entry[0]

    def release(self, path: str) -> None:
        with self._lock:
            entry = self._open[path]
            entry[1] -= 1
            if entry[1] == 0:
                del self._open[path]
                entry[0].close()


_ENVS = _Envs()


def _is_meta(key: bytes) -> bool:
    return key.startswith(b"__") and key.endswith(b"__") and len(key) >= 4


class LmdbReader(IndexedReader):
    """Reads LMDB values in chunks from I/O threads (one read transaction per chunk); one Sample per key.

    A sample's key is the LMDB key as text, its source the LMDB path, its index the key's place in
    the key list. Build it with ``headrace.readers.lmdb(...)``.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        keys: Sequence[bytes],
        *,
        decode: Decode = decode_default,
        classes: Sequence[str] = (),
        shuffle: bool = False,
        seed: int | None = None,
        chunk_size: int = 64,
        io_threads: int = 2,
    ) -> None:
        super().__init__(shuffle=shuffle, seed=seed, chunk_size=chunk_size, io_threads=io_threads)
        self.path = os.path.realpath(path)
        self.keys = list(keys)
        self.decode = decode
        self.classes = tuple(classes)
        self._env: Any = None
        self._users = 0
        self._users_lock = threading.Lock()

    def _dataset_size(self) -> int:
        return len(self.keys)

    def shard(self, rank: int, world: int, *, equal: Equal = None) -> Self:
        part = super().shard(rank, world, equal=equal)
        part._env, part._users, part._users_lock = None, 0, threading.Lock()
        return part

    def _open_io(self) -> None:
        with self._users_lock:
            if self._users == 0:
                self._env = _ENVS.acquire(self.path)
            self._users += 1

    def _close_io(self) -> None:
        with self._users_lock:
            self._users -= 1
            if self._users == 0:
                self._env = None
                _ENVS.release(self.path)

    def _fetch(self, indices: Sequence[int]) -> list[Sample]:
        out = []
        with self._env.begin(buffers=False) as txn:
            for i in indices:
                raw = self.keys[i]
                key = raw.decode("utf-8", "backslashreplace")
                fields: dict = {}
                error = None
                value = txn.get(raw)
                if value is None:
                    error = ReadError("key not found in the LMDB", key=key, source=self.path)
                else:
                    try:
                        fields = dict(self.decode(raw, value))
                    except Exception as exc:
                        error = ReadError(f"cannot decode value: {type(exc).__name__}: {exc}", key=key, source=self.path)
                        error.__cause__ = exc
                out.append(Sample(key, fields, self.path, i, error=error))
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "path": self.path}

    def __repr__(self) -> str:
        return f"LmdbReader({self.path!r}, samples={len(self)}, shuffle={self.shuffle}, rank={self.rank}/{self.world})"


def lmdb(
    path: str | os.PathLike,
    *,
    decode: Decode | None = None,
    keys: Sequence[str | bytes] | None = None,
    shuffle: bool = False,
    seed: int | None = None,
    chunk_size: int = 64,
    io_threads: int = 2,
) -> LmdbReader:
    """A reader over any LMDB (a folder with ``data.mdb``, or the file itself), opened read-only,
    without locking or OS read-ahead.

    ``decode(key, value) -> {field: bytes}`` splits a value into fields (default: ``decode_default``,
    the record format ``pack`` writes, or one raw image). ``keys``: the samples, in dataset order
    (default: the ``__keys__`` entry if there is one, else every key but ``__...__`` ones, in the
    database's sorted order, enumerated once here). ``shuffle``/``seed``/``chunk_size``/``io_threads``
    as for ``readers.files``; shuffle, shard and resume work on the key list by index.

    Raises ReadError (``source`` = the path) if there is no LMDB at ``path`` or it cannot be opened;
    a key that is missing or whose value ``decode`` rejects becomes a sample whose ``error`` is a
    ReadError naming the key.
    """
    if decode is not None and not callable(decode):
        raise ConfigError(f"lmdb: decode must be callable, got {type(decode).__name__}")
    real = os.path.realpath(path)
    env = _ENVS.acquire(real)
    classes: list[str] = []
    try:
        with env.begin(buffers=False) as txn:
            meta = txn.get(b"__meta__")
            if meta is not None:
                try:
                    classes = list(json.loads(meta).get("classes", []))
                except (ValueError, AttributeError):
                    classes = []
            if keys is None:
                listed = txn.get(b"__keys__")
                if listed is not None:
                    try:
                        keys = [k.encode() for k in json.loads(listed)]
                    except (ValueError, AttributeError) as exc:
                        raise ReadError(f"unreadable __keys__ entry: {exc}", key="__keys__", source=real) from exc
                else:
                    keys = [k for k in txn.cursor().iternext(keys=True, values=False) if not _is_meta(k)]
    finally:
        _ENVS.release(real)
    keys = [k.encode() if isinstance(k, str) else bytes(k) for k in keys]
    if not keys:
        raise ReadError("the LMDB holds no samples", source=real)
    return LmdbReader(real, keys, decode=decode or decode_default, classes=classes, shuffle=shuffle, seed=seed,
                      chunk_size=chunk_size, io_threads=io_threads)
