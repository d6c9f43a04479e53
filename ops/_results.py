"""What both executors (CPU and GPU) and the stage executor share: the result of a batch, and the
checks and lookups on a sample's fields that name the sample when they fail."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from headrace._errors import DecodeError, LoaderError, ReadError, TransformError

__all__ = ["Processed", "check_fields", "field_columns", "image_field", "named", "read_failure", "sample_label",
           "split_evenly"]


@dataclass
class Processed:
    """One batch through the ops: outputs for the rows in ``kept`` (ascending, no repeats), the
    failures of others, and the rows an ``ops.Filter`` dropped (``filtered``: not errors)."""

    data: dict[str, Any]
    kept: list[int]
    failures: list[tuple[int, LoaderError]] = field(default_factory=list)
    ready: Any = None  # GPU path: the CUDA event after the batch's last kernel (None on the CPU)
    filtered: list[int] = field(default_factory=list)


def named(exc: LoaderError, sample) -> LoaderError:
    if exc.key is None:  # raised below the sample's level (e.g. a shape check)
        exc.key, exc.source = sample.key, sample.source
    return exc


def split_evenly(n: int, parts: int) -> list[tuple[int, int]]:
    bounds = np.linspace(0, n, parts + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def read_failure(sample) -> LoaderError:
    """The sample's read error as a LoaderError naming the sample (a foreign one is wrapped)."""
    err = sample.error
    if isinstance(err, LoaderError):
        if err.key is None:
            err.key = sample.key
        if err.source is None:
            err.source = sample.source
        return err
    wrapped = ReadError(f"cannot read sample: {type(err).__name__}: {err}", key=sample.key, source=sample.source)
    wrapped.__cause__ = err
    return wrapped


def image_field(sample, names: tuple[str, ...]) -> Any:
    for name in names:
        data = sample.fields.get(name)
        if data is not None:
            return data
    raise DecodeError(
        f"sample has no image field (looked for {', '.join(names)}; it has {', '.join(sample.fields) or 'none'})",
        key=sample.key,
        source=sample.source,
    )


def check_fields(sample, names: tuple[str, ...]) -> None:
    """Raise a TransformError naming the sample when it lacks one of the pipeline's ``fields``."""
    for name in names:
        if sample.fields.get(name) is None:
            raise TransformError(f"sample has no {name!r} field (Pipeline fields={names!r}; it has "
                                 f"{', '.join(sample.fields) or 'none'})", key=sample.key, source=sample.source)


def field_columns(samples, rows: list[int], names: tuple[str, ...]) -> dict[str, list[bytes]]:
    """The pipeline's pass-through ``fields`` of ``samples[rows]``: a list of bytes per name (checked
    present by ``check_fields`` before)."""
    return {name: [bytes(samples[r].fields[name]) for r in rows] for name in names}


def sample_label(sample, name: str) -> int:
    raw = sample.fields.get(name)
    if raw is None:
        raise TransformError(
            f"sample has no {name!r} field (the pipeline reads labels from it; Pipeline(label=None) for data without labels)",
            key=sample.key,
            source=sample.source,
        )
    try:
        if isinstance(raw, (bytes, bytearray, memoryview)):
            value = int(raw) if type(raw) is bytes else int(bytes(raw))  # int() skips surrounding whitespace
        else:
            value = operator.index(raw)  # an int from a user's source: int, NumPy integer, 0-d integer tensor
        if not -(2**63) <= value < 2**63:
            raise ValueError("out of int64's range")
    except (ValueError, TypeError) as exc:
        shown = bytes(raw)[:32] if isinstance(raw, (bytes, bytearray, memoryview)) else repr(raw)[:40]
        raise TransformError(
            f"label field {name!r} is not an int64 integer: {shown!r}", key=sample.key, source=sample.source
        ) from exc
    return value
