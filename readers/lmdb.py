"""Samples from an LMDB: key → value bytes, split into fields by a user function or the default record format.

Default value convention (what ``headrace pack --format lmdb`` writes), ``encode_record``::

    b"HRS1" | u16 field count | per field: u8 name length, name (UTF-8), u32 data length | the data, in order

all integers little-endian. A value without that magic is taken as one raw image, its field named
by its signature (``jpg``, ``png``, ``webp``, ``gif``, ``bmp``, ``tif``; else ``bin``), with no label.
Entries named ``__...__`` are metadata: ``__keys__`` (a JSON list of keys, the sample order) and
``__meta__`` (JSON: classes, counts), and are never samples.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Self

import numpy as np

from headrace._errors import ConfigError, ReadError
from headrace._sample import Sample

from ._base import Equal, IndexedReader
from ._lmdb_tree import KeyTable, MappedTree
from ._sample_pool import SamplePool, reader_pool

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


class _SharedEnv:
    """One open environment and its read transactions.

    Another process may write the database while we read it. If it grows the data past the map we
    opened with, LMDB refuses new transactions (MDB_MAP_RESIZED) until the map is resized, which is
    allowed only while no transaction of this process is open (the memory is mapped again): the
    transactions hold a shared gate, a resize waits for them and holds it alone."""

    def __init__(self, env: Any, path: str) -> None:
        self.env = env
        self.path = path
        self.users = 0
        self._gate = threading.Condition()
        self._open_txns = 0
        self._resizing = False

    @contextlib.contextmanager
    def read(self, buffers: bool = False) -> Iterator[Any]:
        """A read transaction (values copied out, so nothing refers to the map once it ends; with
        ``buffers``, views into the map, to be used only while it lasts)."""
        txn = self._begin(buffers)
        try:
            yield txn
        finally:
            txn.abort()
            self._leave()

    def _begin(self, buffers: bool) -> Any:
        lmdb_lib = lmdb_module()
        for _ in range(_RESIZE_ATTEMPTS):
            self._enter()
            try:
                return self.env.begin(buffers=buffers)
            except lmdb_lib.MapResizedError:
                self._leave()
                self._adopt_new_size()
            except BaseException:
                self._leave()
                raise
        raise ReadError(f"the LMDB kept growing past its map while {_RESIZE_ATTEMPTS} transactions began",
                        source=self.path)

    def _enter(self) -> None:
        with self._gate:
            self._gate.wait_for(lambda: not self._resizing)
            self._open_txns += 1

    def _leave(self) -> None:
        with self._gate:
            self._open_txns -= 1
            self._gate.notify_all()

    def _adopt_new_size(self) -> None:
        with self._gate:
            if self._resizing:  # another thread resizes: its new map will do for us too
                self._gate.wait_for(lambda: not self._resizing)
                return
            self._resizing = True
            self._gate.wait_for(lambda: self._open_txns == 0)
        try:
            self.env.set_mapsize(0)  # 0: the size the writer set, read from the database
        finally:
            with self._gate:
                self._resizing = False
                self._gate.notify_all()


_RESIZE_ATTEMPTS = 8


def _lock_file(path: str) -> str:
    return os.path.join(path, "lock.mdb") if os.path.isdir(path) else path + "-lock"


def _open_env(lmdb_lib: Any, path: str) -> Any:
    """The environment at ``path``, read-only.

    A reader that takes no lock is invisible to writers, which then reuse the pages of its snapshot
    while it reads them (keys "not found", values of a later write). So where a writer left a lock
    file we may write (it is only opened, never made), we register in its reader table; a database
    without one (finished, or in a read-only folder) is read without locking and no file is made."""
    kwargs = dict(subdir=os.path.isdir(path), readonly=True, readahead=False, max_readers=1024)
    lock = _lock_file(path)
    if os.path.exists(lock) and os.access(lock, os.W_OK):
        try:
            return lmdb_lib.open(path, lock=True, **kwargs)
        except lmdb_lib.Error:
            pass  # a lock file we cannot use (another LMDB version, no file locks here): read as before
    return lmdb_lib.open(path, lock=False, **kwargs)


class _Envs:
    """Open environments by real path, shared and reference-counted: LMDB (and py-lmdb) forbid opening
    one environment twice in a process, and several readers (ranks, epochs) may read one at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, _SharedEnv] = {}

    def acquire(self, path: str) -> _SharedEnv:
        lmdb_lib = lmdb_module()
        with self._lock:
            shared = self._open.get(path)
            if shared is None:
                if not os.path.exists(path):
                    raise ReadError("no LMDB at this path", source=path)
                try:
                    env = _open_env(lmdb_lib, path)
                except lmdb_lib.Error as exc:
                    raise ReadError(f"cannot open LMDB: {exc}", source=path) from exc
                shared = self._open[path] = _SharedEnv(env, path)
            shared.users += 1
            return shared

    def release(self, path: str) -> None:
        with self._lock:
            shared = self._open[path]
            shared.users -= 1
            if shared.users == 0:
                del self._open[path]
                shared.env.close()


_ENVS = _Envs()


def _is_meta(key: bytes) -> bool:
    return key.startswith(b"__") and key.endswith(b"__") and len(key) >= 4


_DB_RECORD = struct.Struct("<IHHQQQQQ")  # LMDB's MDB_db: pad, flags, depth, branch/leaf/overflow pages, entries, root
_NO_ROOT = (1 << 64) - 1


def _is_subdb(value: bytes | memoryview, last_page: int) -> bool:
    """Whether a value of the main database is a named sub-database's record, not data.

    The main database holds each named database's name as a key, its value LMDB's 48-byte
    record of that tree (LMDB marks the entry with a node flag that py-lmdb does not show, and
    ``open_db`` to ask takes one of a few handles for good). So the record is recognised by its
    shape: known flags, and a depth, root page and page counts that fit this database."""
    if len(value) != _DB_RECORD.size:
        return False
    _, flags, depth, branch, leaf, overflow, entries, root = _DB_RECORD.unpack(value)
    if flags & ~0x7E:  # LMDB's persistent database flags
        return False
    if depth == 0:
        return root == _NO_ROOT and branch == leaf == overflow == entries == 0
    return (depth <= 64 and root <= last_page and leaf >= 1 and entries >= 1 and branch >= depth - 1
            and branch + leaf + overflow <= last_page + 1)


class LmdbReader(IndexedReader):
    """Reads LMDB values in chunks from I/O threads (one read transaction per chunk); one Sample per key.

    A sample's key is the LMDB key as text, its source the LMDB path, its index the key's place in
    the key list. Build it with ``headrace.readers.lmdb(...)``.
    """

    grows = True  # local data's chunks grow where samples are small (``IndexedReader.grows``)

    def __init__(
        self,
        path: str | os.PathLike,
        keys: Sequence[bytes],
        *,
        decode: Decode = decode_default,
        classes: Sequence[str] = (),
        shuffle: bool = False,
        seed: int | None = None,
        chunk_size: int | None = None,
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
        self._pool: SamplePool | None = None  # made by the first read, kept for the next epochs
        self._key_table: KeyTable | None = None  # the keys packed for ``_tree``, made by the first read
        self._tree: MappedTree | None = None  # the data file mapped while reads run

    def _dataset_size(self) -> int:
        return len(self.keys)

    def shard(self, rank: int, world: int, *, equal: Equal = None) -> Self:
        part = super().shard(rank, world, equal=equal)
        part._env, part._users, part._users_lock, part._tree = None, 0, threading.Lock(), None
        return part

    def _open_io(self) -> None:
        with self._users_lock:
            if self._users == 0:
                self._env = _ENVS.acquire(self.path)
            if self._pool is None:
                self._pool = reader_pool(self.io_threads, self.max_chunk)
            if self._users == 0 and self._pool.available:
                try:
                    self._tree = MappedTree.open(self.path, self._env.env.stat()["psize"])
                except BaseException:
                    self._env = None
                    _ENVS.release(self.path)
                    raise
                if self._tree is not None and self._key_table is None:
                    self._key_table = KeyTable(self.keys)
            self._users += 1

    def _close_io(self) -> None:
        with self._users_lock:
            self._users -= 1
            if self._users == 0:
                if self._tree is not None:
                    self._tree.close()
                    self._tree = None
                self._env = None
                _ENVS.release(self.path)

    def _fetch(self, indices: Sequence[int]) -> list[Sample]:
        """The chunk's values looked up in one read transaction as spans of the map (found in C,
        ``_lmdb_tree``, else views from py-lmdb), copied out together (into the sample pool's
        recycled ``bytes``, one GIL-free call, where its helper builds) before the transaction
        ends, then checked and decoded."""
        lmdb_lib = lmdb_module()
        pooled = self._pool is not None and self._pool.available  # else LMDB's own copies, as fast
        try:
            with self._env.read(buffers=pooled) as txn:
                last_page = self._env.env.info()["last_pgno"]
                if pooled:
                    looked_up = self._spans(txn, indices)
                else:
                    looked_up = [self._look_up(txn, i) for i in indices]
                found = [value for value in looked_up if not isinstance(value, Sample)]
                copies = iter(self._copy_out(found) if pooled else found)
        except (lmdb_lib.Error, ReadError) as exc:
            # No transaction (the reader table full, the map beyond resizing): every sample of the
            # chunk fails by name, and the epoch goes on with the next chunk.
            return [self._failed(i, ReadError(f"cannot read the LMDB: {exc}", key=self._text_key(i), source=self.path),
                                 exc) for i in indices]
        return [value if isinstance(value, Sample) else self._sample(i, next(copies), last_page)
                for i, value in zip(indices, looked_up)]

    def _look_up(self, txn: Any, i: int) -> bytes | memoryview | Sample:
        """Key ``i``'s value (a view into the map in a transaction of buffers), or the sample of the error."""
        try:
            value = txn.get(self.keys[i])
        except lmdb_module().Error as exc:  # a key LMDB cannot hold (empty, too long) or a damaged page
            return self._failed(i, ReadError(f"cannot read key: {exc}", key=self._text_key(i), source=self.path), exc)
        if value is None:
            return self._failed(i, ReadError("key not found in the LMDB", key=self._text_key(i), source=self.path))
        return value

    def _spans(self, txn: Any, indices: Sequence[int]) -> list[tuple[int, int] | Sample]:
        """Each key's value as an (address, size) span of the map, valid while ``txn`` lasts, or the
        sample of its error: found in C where the data file is mapped, else (and for every key the
        walk leaves to it) by py-lmdb."""
        tree = self._tree  # opened with ``_key_table``
        hits = tree.find(txn.id(), self._key_table, indices) if tree is not None else None
        if hits is None:
            return [self._span_of(self._look_up(txn, i)) for i in indices]
        base = tree.address
        return [(base + offset, size) if offset >= 0 else self._span_of(self._look_up(txn, i))
                for i, offset, size in zip(indices, hits[0].tolist(), hits[1].tolist())]

    @staticmethod
    def _span_of(value: memoryview | Sample) -> tuple[int, int] | Sample:
        """A py-lmdb view's (address, size), for the sample pool's copies; an error's sample as it is."""
        return value if isinstance(value, Sample) else (np.frombuffer(value, dtype=np.uint8).ctypes.data, len(value))

    def _copy_out(self, spans: list[tuple[int, int]]) -> list[bytes] | list[bytes | dict[str, Any]]:
        """Each span's bytes in the pool's blobs, while the transaction that made them lasts (a
        reader of a known format may give a sample's fields instead, found in the span)."""
        copies = self._pool.copy(spans)
        return [ctypes.string_at(address, size) for address, size in spans] if copies is None else copies  # closed meanwhile

    def _sample(self, i: int, value: bytes | dict[str, Any], last_page: int) -> Sample:
        raw, key = self.keys[i], self._text_key(i)
        if isinstance(value, dict):  # the fields already (``_copy_out``)
            return Sample(key, value, self.path, i)
        if _is_subdb(value, last_page):
            return self._failed(i, ReadError("key names a sub-database of the LMDB, not a value (the main "
                                             "database is read)", key=key, source=self.path))
        try:
            fields = dict(self.decode(raw, value))
        except Exception as exc:
            return self._failed(i, ReadError(f"cannot decode value: {type(exc).__name__}: {exc}", key=key,
                                             source=self.path), exc)
        return Sample(key, fields, self.path, i)

    def first_value(self) -> bytes | None:
        """The raw value of the first sample's key (None for an empty reader or a missing key):
        what ``headrace inspect`` looks at to tell what wrote the database."""
        if not self.keys:
            return None
        self._open_io()
        try:
            with self._env.read() as txn:
                value = txn.get(self.keys[0])
        finally:
            self._close_io()
        return None if value is None else bytes(value)

    def _text_key(self, i: int) -> str:
        return self.keys[i].decode("utf-8", "backslashreplace")

    def _failed(self, i: int, error: ReadError, cause: BaseException | None = None) -> Sample:
        error.__cause__ = cause
        return Sample(self._text_key(i), {}, self.path, i, error=error)

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
    chunk_size: int | None = None,
    io_threads: int = 2,
) -> LmdbReader:
    """A reader over any LMDB (a folder with ``data.mdb``, or the file itself), opened read-only,
    without OS read-ahead, and without locking unless a writer left a lock file we may write (then
    a writer in another process leaves our snapshot alone; no lock file is ever made). A database
    another process grows while we read it is remapped to its new size.

    ``decode(key, value) -> {field: bytes}`` splits a value into fields (default: ``decode_default``,
    the record format ``pack`` writes, or one raw image). ``keys``: the samples, in dataset order
    (default: the ``__keys__`` entry if there is one, else every key but ``__...__`` ones and the
    names of named sub-databases, in the database's sorted order, enumerated once here; the main
    database is read, never a named one; keys given as text are UTF-8, with a file name's
    undecodable bytes, ``os.fsdecode``'s surrogates as ``pack`` stores them, as those bytes). ``shuffle``/``seed``/``chunk_size``/``io_threads``
    as for ``readers.files``; shuffle, shard and resume work on the key list by index.

    Raises ReadError (``source`` = the path) if there is no LMDB at ``path`` or it cannot be opened,
    ConfigError if ``keys`` is not a list of str or bytes; a key that is missing (or that LMDB cannot
    hold, like ``""``, or that names a sub-database) or whose value ``decode`` rejects becomes a sample whose ``error`` is a
    ReadError naming the key and the path, and the other samples are read as usual.
    """
    if decode is not None and not callable(decode):
        raise ConfigError(f"lmdb: decode must be callable, got {type(decode).__name__}")
    given = None if keys is None else _given_keys(keys)
    real = os.path.realpath(path)
    shared = _ENVS.acquire(real)
    try:
        with shared.read(buffers=True) as txn:
            meta = txn.get(b"__meta__")
            classes = _classes(None if meta is None else bytes(meta))
            found = given if given is not None else _stored_keys(txn, real, shared.env)
    except lmdb_module().Error as exc:
        raise ReadError(f"cannot read LMDB: {exc}", source=real) from exc
    finally:
        _ENVS.release(real)
    if not found:
        raise ReadError("the LMDB holds no samples", source=real)
    return LmdbReader(real, found, decode=decode or decode_default, classes=classes, shuffle=shuffle, seed=seed,
                      chunk_size=chunk_size, io_threads=io_threads)


def _given_keys(keys: Sequence[str | bytes]) -> list[bytes]:
    """The caller's key list as bytes (text as UTF-8). One string is not a list of keys, and an int
    is not a key (``bytes(3)`` would be three zero bytes)."""
    if isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise ConfigError(f"lmdb: keys must be a list of keys, got one {type(keys).__name__}")
    out = []
    for k in keys:
        if isinstance(k, str):
            out.append(k.encode("utf-8", "surrogateescape"))
        elif isinstance(k, (bytes, bytearray, memoryview)):
            out.append(bytes(k))
        else:
            raise ConfigError(f"lmdb: every one of keys must be str or bytes, got {type(k).__name__} {k!r}")
    return out


def _stored_keys(txn: Any, path: str, env: Any) -> list[bytes]:
    """The ``__keys__`` entry (a JSON list of strings) if there is one, else every key but ``__...__``
    ones and sub-databases' names, in the database's sorted order (``txn`` gives buffers: the values
    are looked at, never copied)."""
    listed = txn.get(b"__keys__")
    if listed is None:
        keys = _walked_keys(txn, path, env.stat()["psize"])
        if keys is None:
            keys = _cursor_keys(txn, env.info()["last_pgno"])
        return [k for k in keys if not _is_meta(k)]
    try:
        keys = json.loads(bytes(listed))
    except ValueError as exc:
        raise ReadError(f"unreadable __keys__ entry: {exc}", key="__keys__", source=path) from exc
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise ReadError("unreadable __keys__ entry: not a JSON list of strings", key="__keys__", source=path)
    return [k.encode("utf-8", "surrogateescape") for k in keys]


def _walked_keys(txn: Any, path: str, psize: int) -> list[bytes] | None:
    """The keys listed in C from the mapped data file (``_lmdb_tree``), the GIL held; None where
    the walk leaves them to the cursor."""
    tree = MappedTree.open(path, psize)
    if tree is None:
        return None
    try:
        return tree.keys(txn.id())
    finally:
        tree.close()


def _cursor_keys(txn: Any, last_page: int) -> list[bytes]:
    """The keys through py-lmdb's cursor, named databases' names told by their records' shape.
    Two passes over the one snapshot, each in C but for a cheap call a key (a million keys in about
    a second alone; each key a GIL hand-over beside a busy thread): the values' lengths (a
    sub-database's record is 48 bytes), the keys."""
    sized = [i for i, n in enumerate(map(len, txn.cursor().iternext(keys=False, values=True)))
             if n == _DB_RECORD.size]
    keys = list(map(bytes, txn.cursor().iternext(keys=True, values=False)))
    for i in reversed(sized):
        if _is_subdb(txn.get(keys[i]), last_page):
            del keys[i]
    return keys


def _classes(meta: bytes | None) -> list[str]:
    """The class names of a ``__meta__`` entry; none where there is no such entry or it is another
    program's (any LMDB may hold one of its own)."""
    try:
        classes = json.loads(meta).get("classes", []) if meta is not None else []
    except (ValueError, AttributeError):
        return []
    return classes if isinstance(classes, list) and all(isinstance(c, str) for c in classes) else []
