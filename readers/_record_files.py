"""What the TFRecord and RecordIO readers share: local files of records, found once, then read by
offset in the I/O threads (``IndexedReader``: seeded shuffle, shard, exact resume)."""

from __future__ import annotations

import os
import struct
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from headrace._errors import ConfigError, ReadError, require_int
from headrace._sample import Sample

from ._base import IndexedReader
from ._read_files import pread_records
from ._sample_pool import SamplePool, reader_pool
from ._shards import expand_braces

__all__ = ["CUT", "DAMAGED", "RecordFileReader", "ScratchGroups", "check_index_end", "find_records", "index_lines",
           "resolve_files"]

CUT = -1  # a record's length where it runs past the end of its file
DAMAGED = -2  # a record's length where its header is damaged (its CRC is wrong): no length to trust
SCRATCH_BYTES = 32 << 20  # the records an I/O thread reads at once, at most; a larger one goes alone


class ScratchGroups:
    """A chunk's records read together into a buffer each I/O thread keeps (``hr_pread_records``, one
    GIL-free call a group), so its pages stay faulted in from chunk to chunk and a reader copies out
    only what a sample keeps, into its sample pool's recycled ``bytes``: a read into a fresh ``bytes``
    a record was fresh memory each time, and its page faults most of a record's cost
    (docs/benchmarks.md, forty-first session)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def read(self, rows: list[list[int]], fds: dict[int, int],
             paths: list[str]) -> Iterator[tuple[list[int], np.ndarray, list[int], list[int]]]:
        """The ``rows`` (file, offset, length) read in runs of at most ``SCRATCH_BYTES``: for each
        run, the indices of the rows read whole, the buffer, and where each starts in it and its
        length. Each file is opened into ``fds`` (the caller closes them). A record cut or damaged,
        larger than ``SCRATCH_BYTES``, in a file that does not open or read short is left out (and
        every record without the C helper), for the reader's own path, which names the error."""
        group: list[int] = []
        size = 0
        for j, (file, _, length) in enumerate(rows):
            if length < 0 or length > SCRATCH_BYTES or not _opened(file, fds, paths):
                continue
            if size + length > SCRATCH_BYTES:
                yield self._read_group(rows, group, size, fds)
                group, size = [], 0
            group.append(j)
            size += length
        if group:
            yield self._read_group(rows, group, size, fds)

    def _read_group(self, rows: list[list[int]], group: list[int], size: int,
                    fds: dict[int, int]) -> tuple[list[int], np.ndarray, list[int], list[int]]:
        buffer = getattr(self._local, "scratch", None)
        if buffer is None or len(buffer) < size:
            buffer = self._local.scratch = np.empty(max(size, 1 << 20), dtype=np.uint8)
        table = np.array([rows[j] for j in group], dtype=np.int64).reshape(-1, 3)
        table[:, 0] = [fds[file] for file in table[:, 0].tolist()]
        got = pread_records(table, buffer)
        if got is None:
            return [], buffer, [], []
        lengths = table[:, 2]
        starts = (np.cumsum(lengths) - lengths).tolist()
        whole = [k for k, (n, length) in enumerate(zip(got.tolist(), lengths.tolist())) if n == length]
        return ([group[k] for k in whole], buffer, [starts[k] for k in whole],
                [int(lengths[k]) for k in whole])


def _opened(file: int, fds: dict[int, int], paths: list[str]) -> bool:
    if file not in fds:
        try:
            fds[file] = os.open(paths[file], os.O_RDONLY)
        except OSError:
            return False
    return True


class RecordFileReader(IndexedReader):
    """Records at known offsets of local files. ``records``: a row per record, (file number, offset,
    length), ``CUT`` for a record cut off by its file's end, ``DAMAGED`` for one whose header is. A record's key is its file's stem and its
    number in that file; ``_parse(data)`` makes its fields, raising ValueError for bytes it cannot take."""

    grows = True  # local data's chunks grow where samples are small (``IndexedReader.grows``)

    kind = "record"

    def __init__(self, paths: Sequence[str], records: np.ndarray, *, shuffle: bool, seed: int | None,
                 chunk_size: int | None, io_threads: int) -> None:
        super().__init__(shuffle=shuffle, seed=seed, chunk_size=chunk_size, io_threads=io_threads)
        self.paths = list(paths)
        self.records = records
        self._stems = [Path(p).stem for p in self.paths]
        self._first = np.concatenate([[0], np.cumsum(np.bincount(records[:, 0], minlength=len(paths)))])
        self._reads = ScratchGroups()
        self._pool: SamplePool | None = None  # made by the first read, kept for the next epochs

    @abstractmethod
    def _parse(self, data: bytes, key: str, path: str) -> dict[str, Any]: ...

    def _take(self, buffer: np.ndarray, starts: list[int], lengths: list[int]) -> list[dict[str, Any] | None]:
        """The fields of records read together (``buffer[start:start + length]``), their values
        copied into ``self._pool``, or None for a record to read and parse on its own
        (``_record``, which names what is wrong with it). By default every record goes so."""
        return [None] * len(starts)

    def _open_io(self) -> None:
        if self._pool is None:
            self._pool = reader_pool(self.io_threads, self.max_chunk)

    def _dataset_size(self) -> int:
        return len(self.records)

    def _fetch(self, indices: Sequence[int]) -> list[Sample]:
        """The chunk's records read together where the sample pool's helper builds, each taken by
        ``_take`` or else read and parsed on its own."""
        # The chunk's files opened for it alone: no descriptor is shared between reads (epochs
        # overlap when the loader runs ahead) or kept past the chunk.
        fds: dict[int, int] = {}
        rows = self.records[np.asarray(indices, dtype=np.int64)].tolist()  # the chunk's rows as ints, at once
        try:
            taken: list[dict[str, Any] | None] = [None] * len(rows)
            if self._pool is not None and self._pool.available:
                for group, buffer, starts, lengths in self._reads.read(rows, fds, self.paths):
                    for j, fields in zip(group, self._take(buffer, starts, lengths)):
                        taken[j] = fields
            return [self._record(i, file, offset, length, fds) if fields is None
                    else Sample(self._key(i, file), fields, self.paths[file], i)
                    for i, (file, offset, length), fields in zip(indices, rows, taken)]
        finally:
            for fd in fds.values():
                os.close(fd)

    def _key(self, i: int, file: int) -> str:
        """Record ``i``'s key: its file's stem and its number in that file."""
        return f"{self._stems[file]}/{i - int(self._first[file])}"

    def _record(self, i: int, file: int, offset: int, length: int, fds: dict[int, int]) -> Sample:
        path = self.paths[file]
        key = self._key(i, file)
        fields: dict[str, Any] = {}
        error = None
        try:
            if length == CUT:
                raise ValueError("it runs past the end of the file (cut short)")
            if length == DAMAGED:
                raise ValueError("its length header is damaged (its CRC is wrong), or this is not such a "
                                 "file; nothing after it in the file can be found")
            fd = fds.get(file)
            if fd is None:
                fd = fds[file] = os.open(path, os.O_RDONLY)
            data = os.pread(fd, length, offset)
            if len(data) < length:
                raise ValueError(f"it needs {length} bytes, the file has {len(data)} there")
            fields = self._parse(data, key, path)
        except ReadError as exc:
            error = exc
        except (ValueError, IndexError, OverflowError, struct.error) as exc:  # what bad bytes raise in a parse
            error = ReadError(f"{self.kind} at byte {offset}: {exc}", key=key, source=path)
            error.__cause__ = exc
        except OSError as exc:
            error = ReadError(f"cannot read {self.kind} at byte {offset}: {exc.strerror or exc}", key=key, source=path)
            error.__cause__ = exc
        return Sample(key, fields, path, i, error=error)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "paths": self.paths}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.paths)} files, samples={len(self)}, shuffle={self.shuffle}, "
                f"rank={self.rank}/{self.world})")


def resolve_files(source: Any, what: str, in_folder: Callable[[str], bool]) -> list[str]:
    """Paths from a file, a brace pattern, a folder (its files ``in_folder`` keeps, sorted) or a list
    of these. Raises ReadError for a missing file or an empty folder, ConfigError for the rest."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if os.path.isdir(text):
            paths = sorted(os.path.join(text, n) for n in os.listdir(text)
                           if in_folder(n) and os.path.isfile(os.path.join(text, n)))
            if not paths:
                raise ReadError(f"no {what} files in folder", source=text)
            return paths
        paths = expand_braces(text)
    elif isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        paths = [p for item in source for p in resolve_files(item, what, in_folder)]
    else:
        raise ConfigError(f"source must be a path, a pattern, a folder or a list of {what} files, "
                          f"got {type(source).__name__}")
    if not paths:
        raise ConfigError(f"the list of {what} files is empty")
    for path in paths:
        if not os.path.isfile(path):
            raise ReadError(f"no such {what} file", source=path)
    return paths


Found = list[tuple[int, int, int]]


def find_records(name: str, paths: list[str], index: Sequence[Any] | None, label_offset: object,
                 scan: Callable[[str, int], Found], from_index: Callable[[str, int, str], Found],
                 index_beside: Callable[[str], str | None] = lambda path: None) -> np.ndarray:
    """The records of ``paths`` as ``RecordFileReader`` takes them: each file's from its index file
    (``index``, one per file, else ``index_beside(path)``) or, without one, from ``scan``. Checks the
    arguments the readers share (ConfigError naming ``name``); ReadError if there are no records."""
    require_int(f"{name}: label_offset", label_offset, None)  # the readers keep it as int(label_offset)
    if isinstance(index, (str, os.PathLike)):  # one index file: not its letters
        index = [index]
    if index is not None:
        given = list(index) if isinstance(index, Iterable) and not isinstance(index, (bytes, bytearray)) else None
        if given is None or not all(isinstance(p, (str, os.PathLike)) for p in given):
            raise ConfigError(f"{name}: index must be an index file's path or a list of them, got {index!r}")
        indexes: list[str | None] = [os.fspath(p) for p in given]
        if len(indexes) != len(paths):
            raise ConfigError(f"{name}: {len(indexes)} index files for {len(paths)} files")
    else:
        indexes = [index_beside(p) for p in paths]
    found: Found = []
    for file, (path, idx) in enumerate(zip(paths, indexes)):
        found += scan(path, file) if idx is None else from_index(idx, file, path)
    if not found:
        raise ReadError("no records in these files", source=paths[0])
    return np.array(found, dtype=np.int64).reshape(-1, 3)


def index_lines(index: str) -> list[str]:
    """The lines of a record index file (TFRecord's ``tfrecord2idx``, MXNet's ``.idx``); a file
    missing, unreadable or not text is a ReadError naming it, as a bad line is."""
    try:
        with open(index, encoding="utf-8") as f:
            return f.readlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ReadError(f"cannot read the index file: {exc}", source=index) from exc


def check_index_end(end: int, size: int, index: str) -> None:
    """ReadError naming ``index`` where its records end (byte ``end``) before its file does
    (``size``): an index cut short, or another file's; the records after would be lost unsaid."""
    if end < size:
        raise ReadError(f"the index's records end at byte {end}, the file goes on to byte {size}: the index "
                        "misses the records after, or is another file's; rebuild it (or leave index= out: the "
                        "records are then found by reading their headers)", source=index)
