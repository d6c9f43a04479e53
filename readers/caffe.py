"""Caffe's LMDB databases (what ``convert_imageset`` writes, DALI's ``fn.readers.caffe`` reads):
each value one ``caffe.Datum`` protocol buffer, read without Caffe.

``Datum`` (caffe.proto, proto2): ``channels = 1``, ``height = 2``, ``width = 3`` (int32), ``data = 4``
(bytes), ``label = 5`` (int32), ``float_data = 6`` (repeated float), ``encoded = 7`` (bool). An
encoded Datum's ``data`` is an image file (``convert_imageset --encoded``: the JPEG as it was); a raw
one's is the pixels, ``channels x height x width`` uint8 in BGR order (or ``float_data``). The
database is read by ``readers.lmdb``'s reader, so keys, shuffle, shard, resume and errors are its;
only the values are parsed here. Where the sample pool's C helper builds, a plain encoded Datum's
image and label are found in C and the image copied once, out of the database's map into the pool's
recycled ``bytes`` (``CaffeReader._copy_out``): protobuf had copied it into fresh memory after the
value's own copy out of the map, and those page faults were most of a value's cost. Every other value
(a raw Datum, a field twice, one a Datum has not, bytes that do not parse), and every value without
the helper, is parsed by protobuf from the schema ``datum_class`` builds, which decides its fields
or its error. Both paths give the same samples (``tests/readers/test_caffe_scan.py``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .lmdb import _DB_RECORD, MAGIC, LmdbReader, decode_default, lmdb, lmdb_module

__all__ = ["CaffeReader", "caffe", "datum_class", "decode_datum"]

_INSTALL = "reading Caffe LMDBs needs lmdb and protobuf: pip install 'headrace[caffe]'"


class CaffeReader(LmdbReader):
    """An ``LmdbReader`` whose values are ``caffe.Datum`` messages (see ``caffe``). A class of its
    own so that its repr says so, and a loader's state from ``readers.lmdb`` over the same database
    (other fields, other samples) is refused on resume: the state names the reader's type."""

    def _copy_out(self, spans: list[tuple[int, int]]) -> list[bytes | dict[str, Any]]:
        """A plain encoded Datum's fields found in its span, the image copied once into the pool
        (``SamplePool.datums``, ``_native/caffe_datum.h``); every other value copied out whole, for
        ``decode_datum`` (protobuf), which names what is wrong with it."""
        datums = self._pool.datums(spans)
        if datums is None:
            return super()._copy_out(spans)
        out: list[bytes | dict[str, Any] | None] = []
        rest = []
        for j, ((_, size), datum) in enumerate(zip(spans, datums)):
            if datum is None or size == _DB_RECORD.size:  # for protobuf, or a sub-database's record
                rest.append(j)
                out.append(None)
                continue
            image, label = datum
            fields = {_image_field(image): image}
            if label is not None:
                fields["cls"] = str(label).encode()
            out.append(fields)
        for j, value in zip(rest, super()._copy_out([spans[j] for j in rest]) if rest else ()):
            out[j] = value
        return out  # type: ignore[return-value] - every None filled

    def __repr__(self) -> str:
        return f"CaffeReader({self.path!r}, samples={len(self)}, shuffle={self.shuffle}, rank={self.rank}/{self.world})"


# -- the protocol buffer -------------------------------------------------------------------------

_DATUM: Any = None  # the Datum message class, made on first use

_DATUM_FIELDS = (("channels", "TYPE_INT32"), ("height", "TYPE_INT32"), ("width", "TYPE_INT32"),
                 ("data", "TYPE_BYTES"), ("label", "TYPE_INT32"), ("float_data", "TYPE_FLOAT"),
                 ("encoded", "TYPE_BOOL"))  # numbered 1-7, in this order


def datum_class() -> Any:
    """``caffe.Datum`` as a protobuf message class, built from its schema (proto2, as caffe.proto
    declares it: so ``HasField("label")`` tells a label 0 from none) in a descriptor pool of its own,
    so that it never clashes with Caffe's own in the same process. ImportError without protobuf."""
    global _DATUM
    if _DATUM is not None:
        return _DATUM
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc
    field = descriptor_pb2.FieldDescriptorProto
    schema = descriptor_pb2.FileDescriptorProto(name="headrace/caffe_datum.proto", package="headrace.caffe",
                                               syntax="proto2")
    datum = schema.message_type.add(name="Datum")
    for number, (name, kind) in enumerate(_DATUM_FIELDS, 1):
        label = field.LABEL_REPEATED if name == "float_data" else field.LABEL_OPTIONAL
        datum.field.add(name=name, number=number, type=getattr(field, kind), label=label)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(schema)
    _DATUM = message_factory.GetMessageClass(pool.FindMessageTypeByName("headrace.caffe.Datum"))
    return _DATUM


def decode_datum(key: bytes, value: bytes) -> dict[str, Any]:
    """The fields of an encoded Datum: its image under the name its signature gives (``jpg``,
    ``png``, ... as ``decode_default`` names a raw image; ``bin`` for bytes of no known format) and
    ``cls``, the label as ASCII digits (as ``readers.lmdb`` and ``readers.tfrecord`` give it; no
    ``cls`` for a Datum without a label). ValueError for a value that is not a Datum and for a raw
    (not encoded) one; the reader makes it a ReadError naming the key and the database."""
    datum = _parse(value)
    if not datum.encoded:
        raise ValueError(_raw_datum_message(datum))
    if not datum.data:
        raise ValueError("an encoded caffe.Datum with no image bytes (its data is empty)")
    fields = {_image_field(datum.data): datum.data}
    if datum.HasField("label"):
        fields["cls"] = str(datum.label).encode()
    return fields


def _parse(value: bytes) -> Any:
    """The Datum ``value`` holds; ValueError where it is none. protobuf parses most short byte
    strings as some message, and keeps a field of the wrong number or wire type aside as unknown:
    so a value is a Datum only if nothing is left unknown and it holds data."""
    try:
        datum = datum_class().FromString(value)
    except Exception as exc:  # protobuf's DecodeError, or its C parser's own
        raise ValueError(f"not a caffe.Datum: {exc or type(exc).__name__}") from None
    size = datum.ByteSize()  # with the unknown fields
    datum.DiscardUnknownFields()
    if datum.ByteSize() != size:
        raise ValueError("not a caffe.Datum: it holds fields a Datum has not (another message, or not a "
                         "protocol buffer)")
    if not datum.data and not datum.float_data:
        raise ValueError("not a caffe.Datum: it holds no data (neither data nor float_data)")
    return datum


def _raw_datum_message(datum: Any) -> str:
    kind = "float_data" if datum.float_data else "uint8"
    return (f"a raw caffe.Datum ({datum.channels}x{datum.height}x{datum.width} {kind}, encoded=False): this "
            "reader takes encoded=True Datums only (convert_imageset --encoded), because headrace's Decode "
            "takes image files, not pixel arrays; read raw ones with readers.lmdb(path, decode=...) and a "
            "function of your own giving an array for a Pipeline(image=None)")


def _image_field(data: bytes) -> str:
    """The field name ``decode_default`` gives these bytes as one raw image. Bytes that begin with a
    headrace record's magic are no image file (``decode_default`` would split them as a record)."""
    if data[:4] == MAGIC:
        return "bin"
    (name,) = decode_default(b"", data)
    return name


# -- the reader ----------------------------------------------------------------------------------


def caffe(
    path: str | os.PathLike,
    *,
    keys: Sequence[str | bytes] | None = None,
    shuffle: bool = False,
    seed: int | None = None,
    chunk_size: int | None = None,
    io_threads: int = 2,
) -> CaffeReader:
    """A reader over a Caffe LMDB of ``caffe.Datum`` values (``convert_imageset --encoded``'s
    output, DALI's ``fn.readers.caffe(path=...)``), without Caffe.

    Each sample's fields are the Datum's image, under the name its signature gives (``jpg``,
    ``png``, ``webp``, ``gif``, ``bmp``, ``tif``; ``bin`` for other bytes), and ``cls``, its label as
    ASCII digits (none where the Datum has no label), so ``ops.training()`` and ``ops.validation()``
    read it as they read ``readers.lmdb``. The database is opened, and ``keys``, ``shuffle``,
    ``seed``, ``chunk_size`` and ``io_threads`` taken, as by ``readers.lmdb`` (its reader does the
    reading): the samples are every key in the database's sorted order by default; seeded shuffle,
    ``shard`` and exact resume work on that key list.

    A value that is not a Datum (protobuf cannot parse it, or it holds fields a Datum has not, or no
    data) and a raw Datum (``encoded=False``: pixels, which headrace's Decode does not take) are
    samples whose error is a ReadError naming the key and the database, under the loader's
    ``on_error``. Needs lmdb and protobuf (``pip install 'headrace[caffe]'``): ImportError without
    them. Raises ReadError (``source`` = the path) if there is no LMDB at ``path``, it cannot be
    opened or it holds no samples; ConfigError for a wrong argument.
    """
    datum_class()  # ImportError now, not in the I/O threads, where protobuf is missing
    try:
        lmdb_module()
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc
    plain = lmdb(path, decode=decode_datum, keys=keys, shuffle=shuffle, seed=seed, chunk_size=chunk_size,
                 io_threads=io_threads)
    return CaffeReader(plain.path, plain.keys, decode=decode_datum, classes=plain.classes, shuffle=plain.shuffle,
                       seed=plain.seed, chunk_size=None if plain.chunk_auto else plain.chunk_size,
                       io_threads=plain.io_threads)
