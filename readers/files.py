"""Samples from image files: a class-per-folder tree, or a list of paths with labels."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import os
import stat
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Self, TypeVar

import numpy as np

from headrace._errors import ConfigError, ReadError, StorageError, require_int
from headrace._heap import trim_heap
from headrace._sample import Sample, SampleList, samples_nbytes, value_nbytes
from headrace._threads import join_threads

from ._base import Equal, IndexedReader, int_label
from ._cache_folder import from_arguments
from ._object_cache import ObjectCache
from ._read_files import ChunkReader, PathTable, list_folder
from ._sample_pool import SamplePool, reader_pool
from ._storage import Storage, Store, is_url, redact_url, run_sync, with_retries

__all__ = ["FileReader", "file_list", "files"]

_T = TypeVar("_T")

_WAITED = 0.002  # seconds the consumer may wait for a chunk of objects before more are fetched ahead
DEFAULT_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "gif", "avif")


class FileReader(IndexedReader):
    """Reads whole files in chunks from I/O threads; one Sample per file.

    A sample's fields are ``{ext: bytes, "cls": b"<label>"}`` (WebDataset's convention), and with
    ``extra`` that file's own fields besides (``coco()``'s boxes, labels and image id; the values
    are shared by every epoch's samples, so treat them as read-only). Its key is the path relative
    to the root without extension (or the path itself for a path list); where two files would
    share one (``a.jpg`` and ``a.png``), theirs keep the extension.
    """

    grows = True  # local data's chunks grow where samples are small (``IndexedReader.grows``)

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        labels: Sequence[int] | None,
        *,
        root: Path | str | None = None,
        classes: Sequence[str] = (),
        shuffle: bool = False,
        seed: int | None = None,
        chunk_size: int | None = None,
        io_threads: int = 2,
        storage: Storage | None = None,
        requests: int = 224,
        native_read: bool = True,
        buffer_bytes: int = 64 << 20,
        cache: ObjectCache | None = None,
        extra: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(shuffle=shuffle, seed=seed, chunk_size=chunk_size, io_threads=io_threads)
        requests = require_int("files: requests", requests)
        buffer_bytes = require_int("files: buffer_bytes", buffer_bytes, 1)
        if not isinstance(native_read, (bool, np.bool_)):  # "no" would be true: the C helper
            raise ConfigError(f"files: native_read must be True or False, got {native_read!r}")
        self.paths = [_path_text(p) for p in paths]
        if labels is not None:
            labels = _int_labels(labels, self.paths)
        self.labels = labels
        if extra is not None and len(extra) != len(self.paths):
            raise ConfigError(f"files: {len(self.paths)} paths but {len(extra)} sets of extra fields")
        # Fields a file's sample carries besides its bytes (``coco()``: boxes, labels, image id),
        # merged into the sample's fields as they are: one dict per file, never copied per epoch.
        self._extra = None if extra is None else [dict(e) for e in extra]
        self._extra_bytes = None if extra is None else [sum(value_nbytes(v) for v in e.values()) for e in self._extra]
        self.root = root
        self.classes = tuple(classes)
        self.storage = storage
        self.requests = requests
        self.buffer_bytes = buffer_bytes
        # Remote objects: chunks fetched ahead, grown while the consumer waits (see ``_handed``).
        self._depth = self.io_threads
        self._sample_bytes = 0.0  # the mean object size seen
        # Objects in a store are fetched on the event loop (``requests`` GETs at once per read);
        # their sources are URLs without credentials or query strings.
        remote = storage is not None and any(storage.store is not None or is_url(p) for p in self.paths)
        if remote and storage is not None:
            self._fetch_on_loop = True
            self._located = [storage.locate(p) for p in self.paths]
            self._sources = [store.url(key) for store, key in self._located]
        else:
            self._sources = self.paths
        # Remote objects kept on local disk (``cache_dir=``): looked up and written on I/O threads
        # of the reader's own, shared by its reads at the time (a Loader running ahead has two).
        self.cache = cache if self._fetch_on_loop else None
        # What names a kept copy: a URL as given, query string and all (``?id=0`` and ``?id=1`` are
        # two objects, one name without it); a key of an explicit store, the store's URL of it.
        self._cache_ids = [p if is_url(p) else source for p, source in zip(self.paths, self._sources)]
        self._cache_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._cache_jobs: set[concurrent.futures.Future[Any]] = set()
        self._cache_reads = 0
        self._keys = _unique_keys([_key(p, root) for p in self._sources], self._sources, root)
        self._exts = [_ext(p) for p in self._sources]
        # Per-sample work done once here rather than in ``_fetch`` every epoch (it holds the GIL).
        self._cls = _label_bytes(labels)
        # Local files only: remote ones are fetched on the loop and never need the C helper built.
        self._chunks = None if self._fetch_on_loop else ChunkReader(native=native_read)
        self._table = PathTable(self.paths) if self._chunks is not None and self._chunks.native else None
        self._pool: SamplePool | None = None  # made by the first read of local files, kept for the next epochs
        self._blobs_from: tuple[int, int] | None = None  # its ``blob_maker()``, for the chunk reads

    def _dataset_size(self) -> int:
        return len(self.paths)

    def _open_io(self) -> None:
        if self._table is not None and self._pool is None:
            self._pool = reader_pool(self.io_threads, self.max_chunk)
            self._blobs_from = self._pool.blob_maker()

    def _fetch(self, indices: Sequence[int]) -> list[Sample]:
        # Two GIL-free calls for the chunk where the C helper builds (``_read_files``), the files
        # read into the sample pool's recycled bytes where its helper builds too.
        paths, keys, exts, cls = self.paths, self._keys, self._exts, self._cls
        if self._table is not None:
            blobs, failed = self._chunks.read_table(self._table, indices, self._blobs_from)
        else:
            blobs, failed = self._chunks.read([os.fsencode(paths[i]) for i in indices]), -1
        if failed == 0:  # the common case, in one comprehension; its size counted from the blobs
            nbytes = sum(map(len, blobs))
            if self._extra is not None:
                nbytes += sum(self._extra_bytes[i] for i in indices)
                nbytes += 0 if cls is None else sum(len(cls[i]) for i in indices)
                return SampleList([self._sample(i, blob) for i, blob in zip(indices, blobs)], nbytes)
            if cls is None:
                return SampleList([Sample(keys[i], {exts[i]: blob}, paths[i], i) for i, blob in zip(indices, blobs)],
                                  nbytes)
            return SampleList([Sample(keys[i], {exts[i]: blob, "cls": cls[i]}, paths[i], i)
                               for i, blob in zip(indices, blobs)], nbytes + sum(map(len, map(cls.__getitem__, indices))))
        out = []
        for i, blob in zip(indices, blobs):
            fields: dict = {}
            error = None
            if isinstance(blob, OSError):
                error = ReadError(f"cannot read file: {blob.strerror or blob}", key=keys[i], source=paths[i])
                error.__cause__ = blob
            else:
                fields[exts[i]] = blob
            if cls is not None:
                fields["cls"] = cls[i]
            if self._extra is not None:
                fields.update(self._extra[i])
            out.append(Sample(keys[i], fields, paths[i], i, error=error))
        return out

    def connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The storage's session when the files are objects in a store (``Reader.connections``);
        local files hold no connection."""
        if not self._fetch_on_loop:  # fetched on the loop exactly when they are objects in a store
            return super().connections()
        assert self.storage is not None
        return self.storage.session()

    @contextlib.asynccontextmanager
    async def _io_session(self) -> AsyncIterator[None]:
        assert self.storage is not None
        async with self.storage.session():
            if self.cache is None:
                yield
                return
            if self._cache_reads == 0:
                self._cache_pool = concurrent.futures.ThreadPoolExecutor(
                    self.io_threads, thread_name_prefix="headrace-io-cache")
            self._cache_reads += 1
            try:
                yield
            finally:
                # What this read left freed in the allocator's arenas goes back to the system:
                # glibc keeps each thread's arena at its high-water mark, so an epoch that reads
                # the copies back on these threads after one that fetched them on the client's
                # threads held both peaks (the VM, reading alone: 100-120 MB past local disk
                # against the 92 MB the reader buffers; with the trim, 53-66 MB).
                self._on_cache_thread(trim_heap)
                self._cache_reads -= 1
                if self._cache_reads == 0:
                    pool, self._cache_pool = self._cache_pool, None
                    assert pool is not None
                    # The copies queued are written (at most ``buffer_bytes``), and a lookup whose
                    # fetch was cancelled meanwhile ends: no thread outlives the read.
                    pool.shutdown(wait=False)
                    await join_threads(list(self._cache_jobs))
                    pool.shutdown(wait=True)

    def _on_cache_thread(self, job: Callable[..., _T], *args: Any) -> concurrent.futures.Future[_T]:
        """``job`` on the cache's threads, tracked: the read's end waits for it, also when the
        fetch that started it was cancelled meanwhile."""
        assert self._cache_pool is not None
        future = self._cache_pool.submit(job, *args)
        self._cache_jobs.add(future)
        future.add_done_callback(self._cache_jobs.discard)
        return future

    async def _fetch_async(self, indices: Sequence[int]) -> list[Sample]:
        """The chunk's objects: the kept copies (``cache_dir=``), then GETs of the rest,
        ``requests`` at once for this read, each with retries; what was fetched is then kept."""
        assert self.storage is not None
        limit = self._limit()
        kept: dict[int, bytes] = {}
        if self.cache is not None:
            urls = [self._sources[i] for i in indices]
            ids = [self._cache_ids[i] for i in indices]
            copies = await asyncio.wrap_future(self._on_cache_thread(self.cache.read, urls, ids))
            kept = {i: b for i, b in zip(indices, copies) if b is not None}

        async def one(i: int) -> Sample:
            store, key = self._located[i]
            fields: dict = {}
            error = None
            async with limit:
                try:
                    fields[self._exts[i]] = await with_retries(lambda: store.read(key), self.storage.retry,
                                                               self._sources[i])
                except StorageError as exc:
                    exc.key = self._keys[i]
                    error = exc
            if self._cls is not None:
                fields["cls"] = self._cls[i]
            if self._extra is not None:
                fields.update(self._extra[i])
            return Sample(self._keys[i], fields, self._sources[i], i, error=error)

        async with asyncio.TaskGroup() as group:  # no yield inside: the group ends with the chunk
            tasks = [group.create_task(one(i)) if i not in kept else None for i in indices]
        samples = [t.result() if t is not None else self._sample(i, kept[i]) for i, t in zip(indices, tasks)]
        if self.cache is not None:
            new = [(i, s) for i, s, t in zip(indices, samples, tasks) if t is not None and s.error is None]
            if new:
                self._keep_later([(s.source, s.fields[self._exts[i]]) for i, s in new], [self._cache_ids[i] for i, _ in new])
        return samples

    def _keep_later(self, fetched: list[tuple[str, bytes]], ids: list[str]) -> None:
        """Write the chunk's fetched objects on the cache's threads while the chunk goes on (the
        read's end waits for them). Past ``buffer_bytes`` waiting to be written the chunk is not
        kept (counted in ``cache.skipped``; a later epoch keeps it): the disk never holds the read
        up, and memory stays bounded."""
        assert self.cache is not None
        cache, nbytes = self.cache, sum(len(data) for _, data in fetched)
        if cache.reserve(nbytes, len(fetched), self.buffer_bytes):
            self._on_cache_thread(cache.keep, fetched, ids).add_done_callback(lambda _: cache.release(nbytes))

    def _sample(self, i: int, blob: bytes) -> Sample:
        """File ``i``'s sample: its bytes, its label, its extra fields."""
        fields = {self._exts[i]: blob}
        if self._cls is not None:
            fields["cls"] = self._cls[i]
        if self._extra is not None:
            fields.update(self._extra[i])
        return Sample(self._keys[i], fields, self._sources[i], i)

    def _ahead(self) -> int:
        return self._depth if self._fetch_on_loop else self.io_threads

    def _handed(self, samples: list[Sample], waited: float) -> None:
        """Remote objects: one more chunk of GETs ahead each time the consumer had to wait for one.

        A GET takes the store's latency whatever the object's size, so the GETs in flight must
        cover latency x the consumer's rate (Little's law); waiting for the head chunk is the sign
        they do not. Bounded by ``requests`` (the GETs in flight never exceed it anyway) and by
        ``buffer_bytes`` (the chunks ahead, at the mean object size seen, must fit).
        """
        if not self._fetch_on_loop or not samples:
            return
        size = samples_nbytes(samples) / len(samples)
        self._sample_bytes = size if not self._sample_bytes else 0.8 * self._sample_bytes + 0.2 * size
        deeper = self._depth + 1
        if (waited > _WAITED and deeper * self.chunk_size <= 2 * self.requests
                and (deeper + 1) * self.chunk_size * self._sample_bytes <= self.buffer_bytes):
            self._depth = deeper

    def _limit(self) -> asyncio.Semaphore:
        # One semaphore per event loop (the sync facade runs reads on a loop of its own).
        loop = asyncio.get_running_loop()
        if getattr(self, "_limit_loop", None) is not loop:
            self._limit_loop, self._limit_sem = loop, asyncio.Semaphore(self.requests)
        return self._limit_sem

    def shard(self, rank: int, world: int, *, equal: Equal = None) -> Self:
        part = super().shard(rank, world, equal=equal)
        # Its own cache threads: a copy made while this reader reads must not share (or close) them.
        part._cache_pool, part._cache_jobs, part._cache_reads = None, set(), 0
        return part

    def state_dict(self) -> dict:
        return {**super().state_dict(), "root": str(self.root) if self.root else None}

    def __repr__(self) -> str:
        where = f"root={str(self.root)!r}" if self.root else f"{len(self.paths)} paths"
        return f"FileReader({where}, samples={len(self)}, shuffle={self.shuffle}, rank={self.rank}/{self.world})"


def file_list(path: str | os.PathLike, root: str | os.PathLike | None = None) -> tuple[list[str], list[int] | None]:
    """The paths and labels of a list file, DALI's ``file_list`` format: a line per file, its path
    then its int label, separated by white space (``readers.files(*readers.file_list("train.txt"))``).

    Paths are relative to ``root`` (default: the list file's folder) unless absolute; a path may
    hold spaces where a label follows it (the label is the line's last word). Lines with a path
    alone (no spaces in it) give no labels (None); every line must then have none. Blank lines and lines starting with ``#`` are skipped. Raises
    ReadError if the file cannot be read, ConfigError naming the line for a label that is not an int,
    a mix of lines with and without labels, or an empty list.
    """
    text_path = _path_text(path, "file_list: path")
    if root is not None:
        base = _path_text(root, "file_list: root")
    else:
        base = os.path.dirname(os.path.abspath(text_path))
    try:
        with open(text_path, encoding="utf-8-sig") as f:  # a Windows editor's byte-order mark is no path
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReadError(f"cannot read the list file: {exc}", source=text_path) from exc
    paths: list[str] = []
    labels: list[int | None] = []
    for number, line in enumerate(lines, 1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        words = entry.rsplit(None, 1)
        label: int | None = None
        if len(words) == 2:
            try:
                label = int(words[1])
            except ValueError:
                raise ConfigError(f"{text_path}, line {number}: the label {words[1]!r} is not an int "
                                  "(a line is a path, then an int label)") from None
            entry = words[0]
        if labels and (label is None) != (labels[-1] is None):
            raise ConfigError(f"{text_path}, line {number}: some lines have a label and some do not")
        paths.append(entry if os.path.isabs(entry) else os.path.join(base, entry))
        labels.append(label)
    if not paths:
        raise ConfigError(f"{text_path}: the list file names no files")
    return paths, None if labels[0] is None else [int(v) for v in labels if v is not None]


def extension_set(reader: str, extensions: object) -> set[str]:
    """The file extensions a folder's files are kept by: lowercased, without their dot. One str is
    one extension, not its letters. ConfigError naming ``reader`` for no extension, or one that is
    not a str (it would fail as an AttributeError, or an empty set find nothing and call the folder
    empty)."""
    if isinstance(extensions, str):
        extensions = (extensions,)
    if not isinstance(extensions, Iterable) or isinstance(extensions, bytes):
        raise ConfigError(f"{reader}: extensions must be a list of file extensions, got {extensions!r}")
    extensions = list(extensions)
    for ext in extensions:
        if not isinstance(ext, str) or not ext.lstrip("."):
            raise ConfigError(f"{reader}: an extension must be a non-empty str like 'jpg', got {ext!r}")
    if not extensions:
        raise ConfigError(f"{reader}: extensions is empty: no file would be read")
    return {e.lower().lstrip(".") for e in extensions}


def class_folders(root: Path, exts: set[str]) -> tuple[list[str], list[str], list[int]]:
    """A class-per-folder tree: its classes (sorted sub-folder names, hidden ones left out), and the
    files with one of ``exts`` under each, sorted, with the class index as label. Hidden files and
    folders inside a class are left out too (macOS's ``._x.jpg``, a viewer's ``.thumbs/``): they
    are not the data set's images.

    What ``sorted(folder.rglob("*"))`` keeping ``is_file()`` found, in its order (by path parts),
    from each folder's entries and their types (``_entries``) and strings: the ``Path`` objects
    cost ~30 µs a file (5 s a million). ReadError naming a folder that cannot be listed."""
    top = str(root)
    classes = sorted(name for name, kind in _entries(top)
                     if not name.startswith(".") and _is_folder(top + "/" + name, kind))
    paths, labels = [], []
    for label, name in enumerate(classes):
        folder = str(root / name)  # as Path joins them: the same text as before for every file
        found = sorted(_tree_files(folder, "", exts), key=_parts)
        paths += [folder + "/" + rel for rel in found]
        labels += [label] * len(found)
    return classes, paths, labels


# d_type's values (Linux, the BSDs and macOS alike); another (a FIFO, a socket, a device) is no file.
_UNKNOWN, _FOLDER, _FILE, _LINK = 0, 4, 8, 10


def _entries(path: str) -> list[tuple[str, int]]:
    """A folder's (name, d_type) pairs: listed in one GIL-free C call (``list_folder``; os.scandir
    lets the GIL go for every entry, and beside a thread busy in Python took 2.4 s for 8,192 files
    on two cores), else from os.scandir's entries. ReadError naming the folder where it cannot be
    listed (``rglob`` quietly left out the rest of the tree)."""
    try:
        listed = list_folder(path)
        if listed is None:
            with os.scandir(path) as entries:
                listed = [(entry.name, _entry_kind(entry)) for entry in entries]
    except OSError as exc:
        raise ReadError(f"cannot list folder: {exc.strerror or exc}", source=path.rstrip("/")) from exc
    return listed


def _entry_kind(entry: os.DirEntry) -> int:
    try:
        if entry.is_symlink():
            return _LINK
        if entry.is_dir(follow_symlinks=False):
            return _FOLDER
        return _FILE if entry.is_file(follow_symlinks=False) else -1
    except OSError:
        return _UNKNOWN  # asked again by path


def _is_folder(path: str, kind: int) -> bool:
    """Whether an entry of ``kind`` is a folder, through a link too (``Path.is_dir``)."""
    return kind == _FOLDER or (kind in (_LINK, _UNKNOWN) and os.path.isdir(path))


def _tree_files(folder: str, under: str, exts: set[str]) -> Iterable[str]:
    """The files (a link to one too) with one of ``exts`` under ``folder/under``, as paths relative
    to ``folder``; hidden names and linked folders (as ``rglob``) not entered."""
    path = folder + "/" + under if under else folder
    for name, kind in _entries(path):
        if name.startswith("."):
            continue
        rel = under + name
        if kind == _UNKNOWN:  # the file system does not say: lstat, as scandir's entry would
            try:
                kind = _kind_of(os.lstat(folder + "/" + rel).st_mode)
            except FileNotFoundError:  # gone since the listing
                continue
            except OSError as exc:  # a folder left out unsaid would shrink the data set
                raise ReadError(f"cannot list folder: {exc.strerror or exc} (an entry of unknown type)",
                                source=folder + "/" + rel) from exc
        if kind == _FOLDER:
            yield from _tree_files(folder, rel + "/", exts)
            continue
        is_file = kind == _FILE or (kind == _LINK and os.path.isfile(folder + "/" + rel))
        if is_file and _suffix_ext(name) in exts:
            yield rel


def _kind_of(mode: int) -> int:
    return _LINK if stat.S_ISLNK(mode) else _FOLDER if stat.S_ISDIR(mode) else _FILE if stat.S_ISREG(mode) else -1


def _suffix_ext(name: str) -> str:
    """``Path(name).suffix.lower().lstrip(".")``: the text after the last dot, where the dot is
    neither first nor last."""
    dot = name.rfind(".")
    return name[dot + 1 :].lower() if 0 < dot < len(name) - 1 else ""


def _parts(rel: str) -> list[str]:
    return rel.split("/")


def _unique_keys(keys: list[str], sources: list[str], root: Path | str | None) -> list[str]:
    """``keys``, where two files share one (``a.jpg`` and ``a.png``), with the extension kept for
    those: a key names one sample (its errors, ``sample_keys``, outputs saved by key)."""
    counts = collections.Counter(keys)
    if len(counts) == len(keys):
        return keys
    return [key if counts[key] == 1 else key + _suffix(source) for key, source in zip(keys, sources)]


def _suffix(path: str) -> str:
    return os.path.splitext(path.split("?", 1)[0] if is_url(path) else path)[1]


def _key(path: str, root: Path | str | None) -> str:
    if isinstance(root, str):  # a bucket prefix: keys are relative to it, like a folder's
        return os.path.splitext(path[len(root) :].lstrip("/"))[0]
    rel = _relative(path, root) if root is not None else path
    stem, _ = os.path.splitext(rel)
    return stem.replace(os.sep, "/")


def _relative(path: str, root: Path) -> str:
    """``os.path.relpath(path, root)``, without its two ``abspath`` calls (~3 µs a file) where
    ``path`` is ``root``'s text, a separator and a normal path below it (a folder's listing)."""
    prefix = str(root) + os.sep
    if path.startswith(prefix):
        rest = path[len(prefix) :]
        if rest and os.path.normpath(rest) == rest and not rest.startswith(".." + os.sep) and rest != "..":
            return rest
    return os.path.relpath(path, root)


def _path_text(path: object, what: str = "files: a path") -> str:
    """A path as text; ConfigError naming ``what`` for what is not a str or ``os.PathLike`` of one
    (a bytes path failed as a TypeError where it met a str one, in the middle of the set-up; the
    readers take no bytes paths, as a folder's listing or a store has none)."""
    text = os.fspath(path) if isinstance(path, os.PathLike) else path
    if not isinstance(text, str):
        raise ConfigError(f"{what} must be a str or a pathlib.Path, got {path!r}")
    return text


def _int_labels(labels: object, paths: list[str]) -> list[int]:
    """One int label per path (NumPy's ints too). ConfigError for the rest: ``int()`` would take a
    float's whole part (1.7 is not class 1), a str's digits ("012" is three labels, not one) and a
    bool, and fail in the middle of the reader's set-up on None or a word."""
    if isinstance(labels, (str, bytes)) or not isinstance(labels, Iterable):
        raise ConfigError(f"files: labels must be a list of ints, one per path, got a {type(labels).__name__}")
    labels = list(labels)
    if len(labels) != len(paths):
        raise ConfigError(f"files: {len(paths)} paths but {len(labels)} labels")
    return [int_label(label, "files", path) for label, path in zip(labels, paths)]


def _label_bytes(labels: Sequence[int] | None) -> list[bytes] | None:
    """Each sample's ``cls`` field, one bytes object per distinct label."""
    if labels is None:
        return None
    names = {v: str(v).encode() for v in set(labels)}
    return [names[v] for v in labels]


def _ext(path: str) -> str:
    return os.path.splitext(path)[1].lstrip(".").lower() or "bin"


def files(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    labels: Sequence[int] | None = None,
    *,
    extensions: Sequence[str] = DEFAULT_EXTENSIONS,
    shuffle: bool = False,
    seed: int | None = None,
    chunk_size: int | None = None,
    io_threads: int = 2,
    storage_options: Mapping[str, Any] | None = None,
    store: Store | None = None,
    requests: int = 224,
    native_read: bool = True,
    buffer_bytes: int = 64 << 20,
    cache_dir: str | os.PathLike | None = None,
    cache_bytes: int | None = None,
) -> FileReader:
    """A reader over image files, local or in object storage.

    ``source`` is either a folder whose sub-folders are classes (label = the sub-folder's index in
    sorted order, files found recursively below it), or a sequence of file paths with optional
    ``labels``. ``shuffle`` gives a new seeded order each epoch (``seed`` defaults to the loader's).
    ``chunk_size`` files are read per thread call, by ``io_threads`` threads; by default 64, and
    more where local files are small (as many as make ~4 MiB at the mean size read so far, up to
    16 MiB where the GIL's hand-overs run late, up to 1,024 files: each call costs the same
    hand-overs whatever its size); a number given is kept, and bounds a chunk's memory. ``extensions``: the
    file extensions a folder's files are kept by (any case, with or without the dot; the image
    formats by default); a list of paths is read whatever its files' extensions.

    The folder may be a bucket prefix, ``"s3://bucket/train/"`` (listed once, here), and the paths
    URLs (``s3://``, ``http(s)://``). Objects are then fetched on the event loop, ``chunk_size`` (64) per
    chunk, with at most ``requests`` GETs at once (224: at 50 ms a GET, ~4,500 objects/s). The
    connections open can pass ``requests`` by a few dozen: when a GET finds no idle connection,
    the client's pool (hyper's) starts a new one even if one is about to come back, and keeps
    both (+30 on a 2-core machine, +33 on a 16-core one, against 224; a store answers a client
    past its own cap with 503 SlowDown, which is retried). The pool's options make it worse; lower
    ``requests`` where a store's cap is close. The chunks fetched ahead start at
    ``io_threads + 1`` and grow by one each time the consumer waits for a chunk (a store's latency
    needs latency x rate GETs in flight), while they fit in ``requests`` and, at the mean object
    size seen, in ``buffer_bytes``; the client keeps ~110 KB a connection besides (measured: 20-28
    MB for 224), and each of its threads (one a core) an allocator arena: 30-50 MB with 16 threads,
    which ``MALLOC_ARENA_MAX=1`` in the environment removed. Each GET is retried with backoff (``storage_options["retry"]``)
    and a sample that still fails carries a ``StorageError`` naming its URL. ``storage_options`` and
    ``store`` are as for ``webdataset()``. Local files are read a chunk per call by a small C helper
    (compiled on first use); ``native_read=False`` reads them in Python instead, as happens anyway
    where no compiler is found (``examples/benchmark_files.py`` measures one against the other).

    ``cache_dir``: a local folder where objects from a store are kept as they are first fetched,
    so later epochs and later runs read them from local disk (in the same GIL-free chunk reads as
    local files) and GET only what is not there; each copy appears whole or not at all, and
    processes may share the folder. ``cache_bytes``: the most it may hold; once full it keeps what
    it has (with a shuffled order, as good as any eviction). A cache leaves 5% of its disk or 1 GiB
    free, whichever is more; a nearly full disk stops caching, never reading (logged once); a
    kept copy is used as it is (clear the folder when the objects change). ``reader.cache``
    counts ``hits``, ``kept``, ``skipped``, ``failed`` and ``damaged`` (copies of another size than
    written, or without that record, read again from the store). Each read ends by handing the heap's
    freed pages back (``malloc_trim``: the fetching and the reading of copies run on different
    threads, whose allocator arenas would each keep their peak). Local files are read where they are.

    Raises ReadError if the folder does not exist or holds no images (StorageError if it cannot
    be listed), ConfigError for a wrong argument. A listed path that is missing raises ReadError
    (naming it) when it is read.
    """
    storage = Storage(storage_options, store)
    common: dict[str, Any] = {"shuffle": shuffle, "seed": seed, "chunk_size": chunk_size, "io_threads": io_threads,
                              "storage": storage, "requests": requests, "native_read": native_read,
                              "buffer_bytes": buffer_bytes,
                              "cache": from_arguments("files", cache_dir, cache_bytes,
                                                      partial(ObjectCache, native=native_read))}
    exts = extension_set("files", extensions)
    if isinstance(source, (str, os.PathLike)):
        if labels is not None:
            raise ConfigError("files: labels come from the sub-folders when source is a folder")
        if store is not None or is_url(source):
            return _bucket_folder(os.fspath(source), storage, exts, common)
        root = Path(source)
        if root.is_file():
            raise ConfigError(f"files: {root} is a file; give a folder (one sub-folder per class) or a list "
                              f"of paths, e.g. files([{str(root)!r}], labels=[0])")
        if not root.is_dir():
            raise ReadError("no such folder", source=str(root))
        classes, paths, found = class_folders(root, exts)
        if not paths:
            raise ReadError(f"no files with the extensions ({', '.join(sorted(exts))}) in class sub-folders",
                            source=str(root))
        return FileReader(paths, found, root=root, classes=classes, **common)
    if isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        if not source:
            raise ConfigError("files: the path list is empty")
        return FileReader(list(source), labels, **common)
    raise ConfigError(f"files: source must be a folder or a sequence of paths, got {type(source).__name__}")


def _bucket_folder(prefix: str, storage: Storage, exts: set[str], common: dict[str, Any]) -> FileReader:
    """A class-per-sub-folder tree under a bucket prefix, from one listing."""
    prefix = prefix if prefix.endswith("/") else prefix + "/"
    store, key, classes, keys, labels = bucket_class_folders(prefix, storage, exts, "image")
    head = prefix[: len(prefix) - len(key)] if prefix.endswith(key) else None
    paths = [head + k if head is not None else store.url(k) for k in keys]
    return FileReader(paths, labels, root=store.url(key), classes=classes, **common)


def bucket_class_folders(prefix: str, storage: Storage, exts: set[str], what: str
                         ) -> tuple[Any, str, list[str], list[str], list[int]]:
    """``class_folders`` for a bucket prefix, from one listing: the store, the prefix's key, the
    classes (sorted sub-folder names, hidden ones left out), and the object keys with one of
    ``exts`` under each, sorted, with the class index as label. None found is a ReadError naming
    ``what`` files."""
    if not prefix.endswith("/"):
        prefix += "/"
    store, key = storage.locate(prefix)

    async def listing() -> list[str]:
        async with storage.session():
            objects = await with_retries(lambda: store.list(key), storage.retry, store.url(key), "LIST")
        return [o.key for o in objects or []]

    by_class: dict[str, list[str]] = {}
    for k in run_sync(listing):
        name, sep, rest = k[len(key) :].partition("/")
        hidden = name.startswith(".") or any(part.startswith(".") for part in rest.split("/"))  # as class_folders
        if sep and rest and not hidden and os.path.splitext(rest)[1].lower().lstrip(".") in exts:
            by_class.setdefault(name, []).append(k)
    if not by_class:
        raise ReadError(f"no {what} files ({', '.join(sorted(exts))}) in class sub-folders",
                        source=redact_url(store.url(key)))
    classes = sorted(by_class)
    keys, labels = [], []
    for label, name in enumerate(classes):
        for k in sorted(by_class[name]):
            keys.append(k)
            labels.append(label)
    return store, key, classes, keys, labels
