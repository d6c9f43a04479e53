"""MXNet RecordIO files (``.rec``, with or without their ``.idx``): the ImageNet format of MXNet's
``im2rec`` tool, which DALI's ``fn.readers.mxnet`` reads, without MXNet.

A ``.rec`` file is a run of records, each ``u32 magic (0xced7230a) | u32 flag << 29 | length |
data``, padded to 4 bytes. A record whose data held the magic number at a 4-byte boundary was
written in parts (flag 1 the first, 2 the middle ones, 3 the last), the magic left out between
them. An image record's data is MXNet's ``IRHeader`` (``u32 flag | f32 label | u64 id | u64 id2``),
``flag`` more float32 labels where ``flag > 0``, then the encoded image. Records are found once (from
the ``.idx`` files, or by reading their headers and seeking over the data), then read by offset in
the I/O threads, so shuffle, shard and exact resume are the files reader's. Where the C helpers
build, a chunk's records are read together into a buffer each I/O thread keeps and a one-part image
record's image is copied once, into the sample pool's recycled ``bytes`` (a read into a fresh
``bytes``, then two slices, had been three copies into fresh memory); every other record is read
and parsed on its own, which names its errors.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from headrace._errors import ReadError

from ._read_files import scan_records
from ._record_files import CUT, RecordFileReader, check_index_end, find_records, index_lines, resolve_files
from .lmdb import decode_default

__all__ = ["RecordIOReader", "recordio"]

MAGIC = 0xCED7230A
_HEAD = struct.Struct("<II")
_IMAGE_HEADER = struct.Struct("<IfQQ")
_LENGTH_BITS = (1 << 29) - 1
_MAGIC_BYTES = struct.pack("<I", MAGIC)


class RecordIOReader(RecordFileReader):
    """Reads RecordIO image records by offset in chunks from I/O threads; one Sample per record (see ``recordio``)."""

    def __init__(self, paths: Sequence[str], records: np.ndarray, label_offset: int, *, shuffle: bool,
                 seed: int | None, chunk_size: int | None, io_threads: int) -> None:
        # records: (file, offset of its first header, bytes to its last part's end)
        super().__init__(paths, records, shuffle=shuffle, seed=seed, chunk_size=chunk_size, io_threads=io_threads)
        self.label_offset = int(label_offset)  # checked by find_records; a NumPy one as Python's (state_dict)

    def _take(self, buffer: np.ndarray, starts: list[int], lengths: list[int]) -> list[dict[str, Any] | None]:
        """One-part image records' fields, each image copied once into the pool; every other record
        (in parts, damaged, a label that is not whole, an image ``decode_default`` refuses) to
        ``_record``, which names what is wrong with it."""
        base = buffer.ctypes.data
        found = [self._one_part_image(buffer, start, n) for start, n in zip(starts, lengths)]
        plain = [f for f in found if f is not None]
        images = iter(self._pool.copy([(base + start, size) for start, size, _ in plain]) or ())
        taken: list[dict[str, Any] | None] = []
        for f in found:
            image = None if f is None else next(images, None)
            try:
                taken.append(None if image is None else {**decode_default(b"", image), **f[2]})
            except Exception:
                taken.append(None)
        return taken

    def _one_part_image(self, buffer: np.ndarray, at: int, size: int) -> tuple[int, int, dict[str, Any]] | None:
        """Where the image lies in the record at ``buffer[at:at + size]``, and its label fields,
        for a one-part image record whose header holds; None for anything else."""
        if size < _HEAD.size + _IMAGE_HEADER.size:
            return None
        magic, word = _HEAD.unpack_from(buffer, at)
        flag, length = word >> 29, word & _LENGTH_BITS
        start, end = at + _HEAD.size, at + _HEAD.size + length
        if magic != MAGIC or flag != 0 or length < _IMAGE_HEADER.size or end > at + size:
            return None
        count, label, _, _ = _IMAGE_HEADER.unpack_from(buffer, start)
        image = start + _IMAGE_HEADER.size + 4 * count
        if image > end:
            return None
        if count:
            return image, end - image, {"labels": np.frombuffer(buffer, "<f4", count, start + _IMAGE_HEADER.size).copy()}
        if not math.isfinite(label) or label != int(label):
            return None
        return image, end - image, {"cls": str(int(label) + self.label_offset).encode()}

    def _parse(self, data: bytes, key: str, path: str) -> dict[str, Any]:
        return self._fields(_join_parts(data))

    def _fields(self, data: bytes) -> dict[str, Any]:
        """An image record's fields: the image (named by its signature: ``jpg``, ``png``...), and
        ``cls`` (one label) or ``labels`` (a float32 array, where the header says several)."""
        if len(data) < _IMAGE_HEADER.size:
            raise ValueError(f"{len(data)} bytes, too short for an image record's header")
        count, label, _, _ = _IMAGE_HEADER.unpack_from(data)
        start = _IMAGE_HEADER.size + 4 * count
        if start > len(data):
            raise ValueError(f"its header says {count} labels, more than its {len(data)} bytes hold")
        fields: dict[str, Any] = dict(decode_default(b"", data[start:]))
        if count == 0:
            if not math.isfinite(label) or label != int(label):
                raise ValueError(f"its label {label!r} is not a whole number")
            fields["cls"] = str(int(label) + self.label_offset).encode()
        else:
            fields["labels"] = np.frombuffer(data, "<f4", count, _IMAGE_HEADER.size).copy()
        return fields

    def state_dict(self) -> dict:
        return {**super().state_dict(), "label_offset": self.label_offset}


def _join_parts(raw: bytes) -> bytes:
    """A record's data from its bytes on disk: one part, or several joined with the magic between."""
    parts, pos = [], 0
    while True:
        if pos + _HEAD.size > len(raw):
            raise ValueError(f"the header of its part {len(parts)} is cut off (cut short)")
        magic, word = _HEAD.unpack_from(raw, pos)
        if magic != MAGIC:
            raise ValueError(f"no RecordIO magic at its part {len(parts)} (found {magic:#010x})")
        flag, length = word >> 29, word & _LENGTH_BITS
        start = pos + _HEAD.size
        if start + length > len(raw):  # read by an .idx, the last record runs to the file's end, cut or not
            raise ValueError(f"its part {len(parts)} needs {length} bytes, {len(raw) - start} are left (cut short)")
        parts.append(raw[start : start + length])
        if flag in (0, 3):
            return _MAGIC_BYTES.join(parts) if len(parts) > 1 else parts[0]
        if flag not in (1, 2) or (flag == 1) != (len(parts) == 1):
            raise ValueError(f"part flag {flag} out of order")
        pos = start + ((length + 3) & ~3)


def _check_start(path: str, fd: int) -> None:
    """ReadError naming ``path`` where it does not start with the magic (a JPEG or a tar given by
    mistake, bytes before the first record): not a RecordIO file, rather than one record cut short."""
    head = os.pread(fd, 4, 0)
    if head != _MAGIC_BYTES[: len(head)]:  # an empty file, or one cut inside the magic, has no records
        found = f"{struct.unpack('<I', head)[0]:#010x}" if len(head) == 4 else repr(head)
        raise ReadError(f"not a RecordIO file: no RecordIO magic ({MAGIC:#010x}) at byte 0, found {found}",
                        source=path)


def _scan(path: str, file: int) -> list[tuple[int, int, int]]:
    """Every record's (file, offset, span on disk), from the headers, the data seeked over. A record
    cut off by the end of the file is kept as cut, one with a header without the magic spans through
    that header (either way its sample is an error); nothing after it can be found. ReadError for a
    file that does not start with the magic."""
    size = os.path.getsize(path)
    records: list[tuple[int, int, int]] = []
    with open(path, "rb", buffering=0) as f:
        _check_start(path, f.fileno())
        pos = start = 0
        plain = scan_records("recordio", f.fileno(), size, path)  # in C, the GIL let go once
        if plain is not None:
            pairs, pos = plain
            start = pos
            records += [(file, offset, span) for offset, span in pairs.tolist()]
        while pos < size:  # what the C scan leaves: the last record, cut short or damaged
            head = os.pread(f.fileno(), _HEAD.size, pos)
            if len(head) < _HEAD.size:
                records.append((file, start, CUT))
                break
            if _HEAD.unpack(head)[0] != MAGIC:  # damaged: its span takes the header, whose read names the magic lost
                records.append((file, start, pos + _HEAD.size - start))
                break
            word = _HEAD.unpack(head)[1]
            flag, length = word >> 29, word & _LENGTH_BITS
            end = pos + _HEAD.size + ((length + 3) & ~3)
            if pos + _HEAD.size + length > size:
                records.append((file, start, CUT))
                break
            pos = min(end, size)
            if flag in (0, 3):  # the record's last part: it spans [start, pos)
                records.append((file, start, pos - start))
                start = pos
        if start < pos and (not records or records[-1][1] != start):  # whole parts, then the file ended
            records.append((file, start, CUT))
    return records


def _from_index(index: str, file: int, path: str) -> list[tuple[int, int, int]]:
    """An ``.idx`` file (MXNet's: a line ``key<TAB>offset`` per record, in any key order): the
    records sorted by offset, each spanning to the next one's offset (the last to the file's end).
    ReadError naming the index where a line is bad, or where its last record ends before the file
    does (an index cut short, or another file's: the records after it would be lost unsaid)."""
    offsets = []
    for number, line in enumerate(index_lines(index), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            offsets.append(int(parts[1]))
        except (ValueError, IndexError):
            raise ReadError(f"line {number} is not 'key<TAB>offset': {line.strip()!r}", source=index) from None
        if offsets[-1] < 0:
            raise ReadError(f"line {number}: a record at byte {offsets[-1]} cannot be", source=index)
    # A record once however many lines name it; none reaches past the file's end (a line pointing
    # there would take the bytes of the record before it, which reads whole).
    offsets = sorted(set(offsets))
    with open(path, "rb", buffering=0) as f:
        _check_start(path, f.fileno())
        size = os.fstat(f.fileno()).st_size
        inside = [start for start in offsets if start < size]
        end = _record_end(f.fileno(), inside[-1], size) if inside else 0
    if end is not None:
        check_index_end(end, size, index)
    ends = offsets[1:] + [size]
    return [(file, start, min(end, size) - start if start < size else CUT) for start, end in zip(offsets, ends)]


def _record_end(fd: int, pos: int, size: int) -> int | None:
    """Where the record at ``pos`` ends (its last part padded), from its headers; None where one is
    cut off, lacks the magic or has a bad flag (its sample is the error)."""
    while True:
        head = os.pread(fd, _HEAD.size, pos)
        if len(head) < _HEAD.size or _HEAD.unpack(head)[0] != MAGIC:
            return None
        word = _HEAD.unpack(head)[1]
        flag, length = word >> 29, word & _LENGTH_BITS
        pos += _HEAD.size + ((length + 3) & ~3)
        if flag in (0, 3) or pos >= size:
            return pos
        if flag not in (1, 2):
            return None


def _idx_beside(path: str) -> str | None:
    idx = Path(path).with_suffix(".idx")
    return str(idx) if idx.is_file() else None


def recordio(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    index: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    label_offset: int = 0,
    shuffle: bool = False,
    seed: int | None = None,
    chunk_size: int | None = None,
    io_threads: int = 2,
) -> RecordIOReader:
    """A reader over local MXNet RecordIO image files (``im2rec``'s ``.rec``, DALI's
    ``fn.readers.mxnet``), without MXNet.

    ``source``: a ``.rec`` file, a brace pattern, a folder (its ``*.rec`` files, sorted) or a list.
    Each record is a sample: the image, its field named by its signature (``jpg``, ``png``, ...),
    and ``cls``, the header's label as ASCII digits plus ``label_offset``; a record whose header
    holds several labels gets ``labels`` (a float32 array) instead. ``index``: the ``.idx`` files
    ``im2rec`` writes, one per ``.rec`` in the same order (one path for one file); by default the
    ``.idx`` beside each file is used where there is one, and the records are otherwise found by
    reading their headers once.
    Records are read by offset, ``chunk_size`` at a time (as for ``files``) by ``io_threads`` threads, with the files
    reader's seeded shuffle (``seed`` defaults to the loader's), sharding and exact resume. A record cut off by the end of its file,
    without its magic number, or with a bad header is a sample with a ReadError naming its file and
    byte offset. Local files only.

    Raises ReadError for a missing file, an empty folder, a file that does not start with the
    RecordIO magic number (not a RecordIO file: a JPEG or a tar given by mistake, bytes before its
    first record), or an index file missing, not text, with a bad line, or whose records end
    before the file does (an index cut short, or another file's); ConfigError for a wrong argument.
    """
    paths = resolve_files(source, ".rec", lambda name: name.endswith(".rec"))
    records = find_records("recordio", paths, index, label_offset, _scan, _from_index, _idx_beside)
    return RecordIOReader(paths, records, label_offset, shuffle=shuffle, seed=seed, chunk_size=chunk_size,
                          io_threads=io_threads)
