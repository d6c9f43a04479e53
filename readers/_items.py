"""Items of a user's source (a list, a torch ``Dataset``, a generator) turned into ``Sample``s.

The rules, shared by ``readers.sequence`` and ``readers.iterable``:

- a ``Sample``: kept (key, fields, source, error); its ``index`` becomes the item's index;
- a mapping: the sample's fields. ``"__key__"``, if present, is the key (WebDataset's convention)
  and is not a field. A ``str`` becomes UTF-8 bytes (text, as a ``txt`` member of a shard is); an
  ``os.PathLike`` (``pathlib.Path``) is read as a file; any other value is kept as it is: bytes, an
  int label, a NumPy array, a tensor, token ids (the pipeline's batching rules say what a column of
  them becomes, ``headrace.ops`` ``Pipeline``);
- a 2-tuple ``(image, label)``, what torch ``Dataset``s of encoded images return: ``image`` is
  encoded bytes (field named by its signature: ``jpg``, ``png``, ``webp``, ...) or a path (``str``
  or ``os.PathLike``, read as a file; field named by its extension); ``label`` (an integer, or
  None for no label) becomes ``cls``.

Any other item (a list, a decoded PIL image in a pair) gives a sample whose ``error`` is a
``ReadError`` naming the item and the type, as does a path that cannot be read: the sample keeps
its place in the stream and meets the loader's ``on_error`` policy.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Mapping
from typing import Any

from headrace._errors import ReadError
from headrace._sample import Sample

from .lmdb import decode_default

__all__ = ["failed_sample", "item_sample"]


def item_sample(item: Any, index: int, name: str) -> Sample:
    """``item`` (the ``index``-th of the source called ``name``) as a Sample; never raises for bad data."""
    source = f"{name}[{index}]"
    try:
        if isinstance(item, Sample):
            return Sample(item.key, item.fields, item.source, index, error=item.error)
        if isinstance(item, Mapping):
            return _from_mapping(item, index, source)
        if isinstance(item, tuple) and len(item) == 2:
            return _from_pair(item, index, source)
        raise _Unreadable(f"an item must be a dict of fields, a Sample or an (image, label) tuple, "
                          f"got {_kind(item)}")
    except _Unreadable as exc:
        return failed_sample(str(index), source, index, ReadError(str(exc), key=str(index), source=source))
    except OSError as exc:
        path = exc.filename if isinstance(exc.filename, str) else source
        error = ReadError(f"cannot read file: {exc.strerror or exc}", key=str(index), source=path)
        error.__cause__ = exc
        return failed_sample(str(index), path, index, error)


def failed_sample(key: str, source: str, index: int, error: Exception) -> Sample:
    return Sample(key, {}, source, index, error=error)


class _Unreadable(Exception):
    """An item of a shape or type the rules above do not take."""


def _from_mapping(item: Mapping, index: int, source: str) -> Sample:
    fields: dict[str, Any] = {}
    key = str(index)
    for name, value in item.items():
        if name == "__key__":
            key = value.decode() if isinstance(value, bytes) else str(value)
        elif isinstance(value, os.PathLike):
            fields[name] = _read(value)
        else:
            fields[name] = _field(name, value)
    return Sample(key, fields, source, index)


def _from_pair(item: tuple, index: int, source: str) -> Sample:
    image, label = item
    if isinstance(image, (str, os.PathLike)):
        path = os.fspath(image)
        fields = {os.path.splitext(path)[1].lstrip(".").lower() or "bin": _read(path)}
        key, source = os.path.splitext(path)[0], path
    elif isinstance(image, (bytes, bytearray, memoryview)):
        fields = decode_default(b"", bytes(image))
        key = str(index)
    else:
        raise _Unreadable(f"the image of an (image, label) item must be encoded bytes or a path, got "
                          f"{_kind(image)}; return the file's bytes or path from __getitem__, headrace decodes")
    if label is not None:
        try:
            fields["cls"] = operator.index(label)  # int, NumPy integers, one-element integer tensors
        except TypeError:
            raise _Unreadable(f"the label of an (image, label) item must be an integer or None, got {_kind(label)}") from None
    return Sample(key, fields, source, index)


def _field(name: str, value: Any) -> Any:
    if isinstance(value, str):
        return value.encode()
    return value


def _read(path: str | os.PathLike) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _kind(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__
