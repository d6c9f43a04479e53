"""TFRecord files of ``tf.train.Example`` records, without TensorFlow: the format of TensorFlow's
ImageNet pipelines, which DALI's TFRecord reader also reads.

A TFRecord file is a run of records, each ``u64 length | u32 CRC of the length | data | u32 CRC of
the data`` (little-endian). The data is an ``Example`` protocol buffer: a map from feature names to
a list of bytes, floats or int64s. Records are found once, by reading their length headers and
seeking over the data (or from DALI's ``tfrecord2idx`` index files), then fetched by offset in the
I/O threads, so shuffle, shard and exact resume are the files reader's.

Where the sample pool's C helper builds, a chunk's records are read into a buffer each I/O thread
keeps, and the wanted features of each are found in C and copied into the pool's recycled ``bytes``
(``TFRecordReader._take``): protobuf had copied each image into fresh memory after the read had, and those
page faults were most of a record's cost. A record whose wanted features are not one bytes or int64
value each, or that does not scan cleanly, is parsed by protobuf (its C parser, from the schema
``example_class`` builds), which decides its value or its error; so is every record without the
helper. Both paths give the same samples (``tests/readers/test_tfrecord_scan.py``).
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from headrace._errors import ConfigError, ReadError

from ._read_files import scan_records
from ._record_files import CUT, DAMAGED, RecordFileReader, check_index_end, find_records, index_lines, resolve_files

__all__ = ["TFRecordReader", "example_class", "parse_example", "tfrecord"]

IMAGENET_FEATURES = {"image/encoded": "jpg", "image/class/label": "cls"}
_HEADER = struct.Struct("<QI")  # length, its CRC
_FOOTER = 4  # the data's CRC


class TFRecordReader(RecordFileReader):
    """Reads TFRecord records by offset in chunks from I/O threads; one Sample per record (see ``tfrecord``)."""

    def __init__(self, paths: Sequence[str], records: np.ndarray, features: Mapping[str, str] | None,
                 label_offset: int, *, shuffle: bool, seed: int | None, chunk_size: int | None, io_threads: int) -> None:
        # records: (file, the data's offset, its length); an Example each
        super().__init__(paths, records, shuffle=shuffle, seed=seed, chunk_size=chunk_size, io_threads=io_threads)
        self.features = None if features is None else dict(features)
        self.label_offset = int(label_offset)  # checked by find_records; a NumPy one as Python's (state_dict)
        # The wanted names as the C scan takes them (C strings, their lengths); every feature kept is protobuf's.
        self._names = None if self.features is None else _c_names(list(self.features))

    def _parse(self, data: bytes, key: str, path: str) -> dict[str, Any]:
        return self._fields(_feature_map(data), key, path)

    def _fields(self, features: Any, key: str, path: str) -> dict[str, Any]:
        """The sample's fields from the Example's features: renamed, a label as ASCII digits."""
        if self.features is None:
            return {name: _value(features[name]) for name in features}
        missing = [name for name in self.features if name not in features]
        if missing:
            raise ReadError(f"record has no feature {missing[0]!r} (it has {', '.join(sorted(features)) or 'none'})",
                            key=key, source=path)
        return {field: self._field_value(name, field, _value(features[name]), key, path)
                for name, field in self.features.items()}

    def _field_value(self, name: str, field: str, value: Any, key: str, path: str) -> Any:
        if field != "cls":
            return value
        # The loader's label convention, as a WebDataset .cls member holds it.
        if isinstance(value, np.ndarray) and value.dtype == np.int64 and len(value) > 1:
            raise ReadError(f"feature {name!r} holds {len(value)} labels, field 'cls' takes one "
                            "(map it to another field name for the int64 array)", key=key, source=path)
        first = value if isinstance(value, int) else None
        if not isinstance(first, int) or isinstance(first, bool):
            raise ReadError(f"feature {name!r} is not an int64 label", key=key, source=path)
        return str(int(first) + self.label_offset).encode()

    def _take(self, buffer: np.ndarray, starts: list[int], lengths: list[int]) -> list[dict[str, Any] | None]:
        """The wanted features of records whose features are each one bytes or int64 value, found
        in C (``_native/tf_example.h``) and copied into the pool; the rest to protobuf."""
        found = None
        if self._names is not None:
            base = buffer.ctypes.data
            found = self._pool.examples([(base + start, n) for start, n in zip(starts, lengths)], *self._names)
        if found is None:
            return [None] * len(starts)
        return [None if values is None else self._plain_fields(values) for values in found]

    def _plain_fields(self, values: tuple) -> dict[str, Any] | None:
        try:
            return {field: self._field_value(name, field, value, "", "")
                    for (name, field), value in zip(self.features.items(), values)}
        except ReadError:  # a label that is not one: protobuf's path names the record
            return None

    def state_dict(self) -> dict:
        return {**super().state_dict(), "features": self.features, "label_offset": self.label_offset}


# -- the protocol buffer -------------------------------------------------------------------------

_EXAMPLE: Any = None  # the Example message class, made on first use


def _c_names(names: list[str]) -> tuple[ctypes.Array, np.ndarray]:
    encoded = [name.encode() for name in names]
    return (ctypes.c_char_p * len(encoded))(*encoded), np.array([len(name) for name in encoded], dtype=np.int64)


def example_class() -> Any:
    """``tf.train.Example`` as a protobuf message class, built from its schema (TensorFlow's
    ``feature.proto`` and ``example.proto``, proto3) in a descriptor pool of its own, so that it
    never clashes with TensorFlow's own in the same process. Raises ImportError without protobuf."""
    global _EXAMPLE
    if _EXAMPLE is not None:
        return _EXAMPLE
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    except ImportError as exc:
        raise ImportError("reading TFRecord files needs protobuf: pip install 'headrace[tfrecord]'") from exc
    field = descriptor_pb2.FieldDescriptorProto
    schema = descriptor_pb2.FileDescriptorProto(name="headrace/tf_example.proto", package="headrace.tf",
                                               syntax="proto3")
    for name, kind in (("BytesList", field.TYPE_BYTES), ("FloatList", field.TYPE_FLOAT),
                       ("Int64List", field.TYPE_INT64)):
        message = schema.message_type.add(name=name)
        message.field.add(name="value", number=1, type=kind, label=field.LABEL_REPEATED)
    feature = schema.message_type.add(name="Feature")
    feature.oneof_decl.add(name="kind")
    for number, (name, kind) in enumerate((("bytes_list", "BytesList"), ("float_list", "FloatList"),
                                           ("int64_list", "Int64List")), 1):
        feature.field.add(name=name, number=number, type=field.TYPE_MESSAGE, label=field.LABEL_OPTIONAL,
                          type_name=f".headrace.tf.{kind}", oneof_index=0)
    features = schema.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=field.TYPE_MESSAGE, label=field.LABEL_OPTIONAL,
                    type_name=".headrace.tf.Feature")
    features.field.add(name="feature", number=1, type=field.TYPE_MESSAGE, label=field.LABEL_REPEATED,
                       type_name=".headrace.tf.Features.FeatureEntry")
    example = schema.message_type.add(name="Example")
    example.field.add(name="features", number=1, type=field.TYPE_MESSAGE, label=field.LABEL_OPTIONAL,
                      type_name=".headrace.tf.Features")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(schema)
    _EXAMPLE = message_factory.GetMessageClass(pool.FindMessageTypeByName("headrace.tf.Example"))
    return _EXAMPLE


def parse_example(data: bytes, wanted: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The features of a serialized ``tf.train.Example``: name → value (only the ``wanted`` names, if
    given). A bytes list of one value is that ``bytes``, of several a list; an int64 list an ``int``
    or an int64 array; a float list a ``float`` or a float32 array; a feature with no list ``b""``.
    Raises ValueError for bytes that are not an Example (and ImportError without protobuf)."""
    features = _feature_map(data)
    names = features.keys() if wanted is None else [n for n in wanted if n in features]
    return {name: _value(features[name]) for name in names}


def _feature_map(data: bytes) -> Any:
    """The Example's map of feature name → ``Feature`` message; ValueError if ``data`` is not one."""
    try:
        return example_class().FromString(data).features.feature
    except ImportError:
        raise
    except Exception as exc:  # protobuf's DecodeError, or its C parser's own
        raise ValueError(f"not a tf.train.Example: {exc or type(exc).__name__}") from None


def _value(feature: Any) -> Any:
    kind = feature.WhichOneof("kind")
    if kind is None:
        return b""
    values = getattr(feature, kind).value
    if kind == "bytes_list":
        return values[0] if len(values) == 1 else list(values)
    if len(values) == 1:
        return float(values[0]) if kind == "float_list" else int(values[0])
    return np.array(values, dtype=np.float32 if kind == "float_list" else np.int64)


# -- finding the records -------------------------------------------------------------------------


def _scan(path: str, file: int) -> list[tuple[int, int, int]]:
    """Every record's (file, data offset, data length) from its length header, the data seeked over.
    A record that runs past the end is kept, cut (its sample is an error); nothing after it can be found."""
    size = os.path.getsize(path)
    records = []
    with open(path, "rb", buffering=0) as f:
        _check_start(path, f.fileno())
        pos = 0
        plain = scan_records("tfrecord", f.fileno(), size, path)  # in C, the GIL let go once
        if plain is not None:
            pairs, pos = plain
            records += [(file, offset, length) for offset, length in pairs.tolist()]
        while pos < size:  # what the C scan leaves: the last record, cut short or damaged
            header = os.pread(f.fileno(), _HEADER.size, pos)
            if len(header) < _HEADER.size:
                records.append((file, pos, CUT))
                break
            length, crc = _HEADER.unpack(header)
            cut = pos + _HEADER.size + length + _FOOTER > size
            # The length's CRC where a wrong length would mislead (for every header it would double the
            # scan's time): the file's first (_check_start), and one that runs past the end (a damaged
            # length, not a file cut short).
            if cut and _masked_crc32c(header[:8]) != crc:
                records.append((file, pos, DAMAGED))
                break
            if cut:
                records.append((file, pos, CUT))
                break
            records.append((file, pos + _HEADER.size, length))
            pos += _HEADER.size + length + _FOOTER
    return records


def _check_start(path: str, fd: int) -> None:
    """ReadError naming ``path`` where its first length header fails its CRC: a compressed file, or
    not a TFRecord file (a JPEG, a tar or a JSON file given by mistake), rather than one damaged record
    standing for the whole file. A file shorter than a header is left to the caller (cut short)."""
    header = os.pread(fd, _HEADER.size, 0)
    if len(header) < _HEADER.size or _masked_crc32c(header[:8]) == _HEADER.unpack(header)[1]:
        return
    if _compressed(header):
        raise ReadError("the file is compressed (TFRecord's GZIP or ZLIB option); this reader "
                        "takes uncompressed TFRecord files: decompress it first", source=path)
    raise ReadError("not a TFRecord file: the length header at byte 0 fails its CRC (or the first "
                    "record's header is damaged, and nothing in the file can be found)", source=path)


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        for _ in range(8):
            n = (n >> 1) ^ (0x82F63B78 if n & 1 else 0)  # Castagnoli, reflected
        table.append(n)
    return table


_CRC32C = _crc32c_table()


def _masked_crc32c(data: bytes) -> int:
    """TFRecord's CRC of ``data`` (CRC-32C, masked): for a length header's 8 bytes, so Python's speed does."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _compressed(head: bytes) -> bool:
    """A gzip member or a zlib stream starts ``head`` (what TFRecordWriter writes with compression)."""
    return head[:2] == b"\x1f\x8b" or (head[0] & 0x0F == 8 and ((head[0] << 8) | head[1]) % 31 == 0)


def _from_index(index: str, file: int, path: str) -> list[tuple[int, int, int]]:
    """DALI's ``tfrecord2idx`` index: a line ``offset size`` per record, the size counting its header
    and CRCs. A record once however many lines name it. ReadError naming the index where a line is
    bad, or where its records end before the file does (an index cut short, or another file's: the
    records after would be lost unsaid)."""
    records = []
    with open(path, "rb", buffering=0) as f:
        _check_start(path, f.fileno())
        size = os.fstat(f.fileno()).st_size
    seen: dict[int, int] = {}  # offset -> its size
    for number, line in enumerate(index_lines(index), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            offset, total = int(parts[0]), int(parts[1])
        except (ValueError, IndexError):
            raise ReadError(f"line {number} is not 'offset size': {line.strip()!r}", source=index) from None
        length = total - _HEADER.size - _FOOTER
        if offset < 0 or length < 0:
            raise ReadError(f"line {number}: a record of {total} bytes at {offset} cannot be", source=index)
        if offset in seen:
            if seen[offset] != total:
                raise ReadError(f"line {number}: the record at byte {offset} has {seen[offset]} bytes on an earlier "
                                f"line, {total} here", source=index)
            continue
        seen[offset] = total
        records.append((file, offset + _HEADER.size, length if offset + total <= size else CUT))
    check_index_end(max((offset + total for offset, total in seen.items()), default=0), size, index)
    return records


def tfrecord(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    features: Mapping[str, str] | None = IMAGENET_FEATURES,
    index: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    label_offset: int = 0,
    shuffle: bool = False,
    seed: int | None = None,
    chunk_size: int | None = None,
    io_threads: int = 2,
) -> TFRecordReader:
    """A reader over local TFRecord files of ``tf.train.Example`` records (TensorFlow's format,
    DALI's ``fn.readers.tfrecord``), without TensorFlow.

    ``source``: a file, a brace pattern (``"train-{00000..01023}-of-01024"``), a folder (its files
    in sorted order, ``*.idx`` left out) or a list of these. ``features`` maps the Example's feature
    names to the sample's field names; the default reads the ImageNet layout TensorFlow's scripts
    write (``image/encoded`` → ``jpg``, ``image/class/label`` → ``cls``). The field ``cls`` holds the
    int64 label (a feature of one int64; several are a ReadError) as ASCII digits, plus ``label_offset`` (``-1`` for those scripts' labels, which
    count from 1); another int64 feature becomes an ``int`` (several values: an int64 array), a float
    one a ``float`` (or a float32 array), a bytes one ``bytes`` (or a list). ``features=None``
    keeps every feature under its own name. A record without one of the features is a sample with
    a ReadError naming it.

    The records are found here, once, by reading each one's length header and seeking over its
    data, or from ``index``: DALI's ``tfrecord2idx`` files, one per file, in the same order (one
    path for one file). They are then read by offset, ``chunk_size`` at a time (as for ``files``) by ``io_threads``
    threads, with the files reader's seeded shuffle (``seed`` defaults to the loader's), sharding
    and exact resume. Each I/O thread keeps a buffer of a chunk's records (at most 32 MiB) and the
    reader recycles the memory of the values it hands out once nobody holds them (a sample pool,
    as the WebDataset reader's). The data's CRCs are not checked (nor are they by DALI's reader); a length
    header's is, for a file's first record (with an index too) and where the scan finds a record
    that would run past the end (so a damaged length is told from a file cut short). A record whose bytes are not an Example, that runs past the end of a truncated
    file, or whose length header is damaged is a sample with a ReadError naming its file and byte
    offset (nothing after a cut or damaged record can be found). Local files only.

    Needs protobuf (``pip install 'headrace[tfrecord]'``): ImportError without it. Raises ReadError
    for a missing file, an empty folder, a bad index line, an index whose records end before the
    file does (an index cut short, or another file's), a compressed file (TFRecord's GZIP or
    ZLIB option: decompress it first), or a file whose first length header fails its CRC (not a
    TFRecord file, such as a JPEG or a JSON file in the folder); ConfigError for a wrong argument.
    """
    example_class()  # ImportError now, not in the I/O threads, where protobuf is missing
    paths = resolve_files(source, "TFRecord", lambda name: not name.startswith(".") and not name.endswith(".idx"))
    if features is not None:
        if not isinstance(features, Mapping) or not features or not all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in features.items()):
            raise ConfigError(f"tfrecord: features must map feature names to field names, got {features!r}")
        if len(set(features.values())) != len(features):
            raise ConfigError(f"tfrecord: two features map to one field in {features!r}")
    records = find_records("tfrecord", paths, index, label_offset, _scan, _from_index)
    return TFRecordReader(paths, records, features, label_offset, shuffle=shuffle, seed=seed,
                          chunk_size=chunk_size, io_threads=io_threads)
