"""User stages: a function of the user's own at a point of the pipeline.

``Map(fn)`` calls ``fn`` on each sample, ``Filter(fn)`` keeps the samples for which ``fn`` is
true, ``MapBatch(fn)`` calls ``fn`` on each batch. Where a stage stands in ``Pipeline(ops)`` says
what it gets:

- a ``Map`` before ``Decode``: the sample's fields as a dict (encoded bytes, text, arrays, whatever
  the reader gave), and it returns the fields the rest of the pipeline sees;
- a ``Map`` after the last built-in op: one output row as a dict (``"image"`` a tensor,
  ``"label"`` a 0-d tensor, the pipeline's ``fields``), and it returns the row;
- a ``Filter`` in either place: what a ``Map`` there gets, and it returns whether to keep the sample;
- a ``MapBatch`` after the last built-in op: the batch as a dict of tensors and lists.

A function whose signature has an ``rng`` parameter gets a ``numpy.random.Generator`` keyed by
(seed, epoch, the stage's place, the sample's index; the batch's index for ``MapBatch``), as the
built-in ops key theirs: a seed gives the same results whatever the thread count or resume point.
A ``Map`` or ``Filter`` whose function has a ``key`` (or ``index``) parameter gets the sample's key
(or its index in the data set), for a lookup by key; a ``MapBatch`` with a ``keys`` parameter gets
the keys of the batch's rows, one with a ``layout`` parameter the pipeline's image layout (``"CHW"``
or ``"HWC"``: which dimensions of ``batch["image"]`` are the rows and columns).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from headrace._errors import ConfigError, require_int

__all__ = ["Filter", "Map", "MapBatch", "SampleStage", "Stage"]


class Stage:
    """Base of the user stages: the function, its name, and how it is called."""

    def __init__(self, fn: Callable[..., Any], *, name: str | None) -> None:
        if not callable(fn):
            raise ConfigError(f"{type(self).__name__}: fn must be callable, got {fn!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"{type(self).__name__}: name must be a non-empty str, got {name!r}")
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self.is_async = is_async_callable(fn)
        params = _parameters(fn)
        self.wants_rng = "rng" in params
        self.wants_key = "key" in params
        self.wants_keys = "keys" in params
        self.wants_index = "index" in params
        self.wants_layout = "layout" in params

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class SampleStage(Stage):
    """A stage called once per sample (``Map``, ``Filter``): a plain function in the loader's
    threads, an ``async def`` on the event loop at most ``concurrency`` calls at once (default 64)."""

    def __init__(self, fn: Callable[..., Any], *, concurrency: int | None, name: str | None) -> None:
        super().__init__(fn, name=name)
        if concurrency is not None:
            concurrency = require_int(f"{type(self).__name__}({self.name}): concurrency", concurrency)
            if not self.is_async:
                raise ConfigError(f"{type(self).__name__}({self.name}): concurrency bounds an async def's calls; a "
                                  "plain function runs in the loader's threads (num_threads)")
        self.concurrency = concurrency or 64


class Map(SampleStage):
    """Call ``fn`` on each sample: ``fn(fields)`` or ``fn(fields, rng=...)``, returning a dict.

    A plain function runs in the loader's threads (one call per sample, samples of a batch spread
    over the threads); an ``async def`` runs on the event loop, at most ``concurrency`` calls at
    once across the batches in flight (default 64): the place for a remote lookup. An exception is
    a ``TransformError`` naming the sample and the stage, under the loader's ``on_error``.

    After decode on the GPU path, a ``Map`` works row by row on CUDA tensors: it is the slow way.
    Prefer a ``MapBatch`` there.
    """

    def __init__(self, fn: Callable[..., Any], *, concurrency: int | None = None, name: str | None = None) -> None:
        super().__init__(fn, concurrency=concurrency, name=name)


class Filter(SampleStage):
    """Keep the samples for which ``fn(fields)`` (or ``fn(fields, rng=...)``, ``key=``, ``index=``,
    asked for by name as for ``Map``) is true; the others leave their batch, which comes out shorter.

    It stands where a ``Map`` can: before ``Decode``, on the sample's encoded fields (the cheap place:
    nothing is decoded for a dropped sample), or after the last built-in op, on one output row (the
    CPU path only: on the GPU path a row is CUDA tensors, and a keep-or-drop answer read on the host
    would make it wait for the GPU, so the loader refuses it, see ``gpu_unsupported``). It runs as a
    ``Map`` does: a plain function in the loader's threads, an ``async def`` on the event loop, at most
    ``concurrency`` calls at once.

    A dropped sample is not an error: it is counted in ``batch.filtered`` and ``stats().filtered``,
    never against ``max_errors`` nor in ``stats().errors``, and it counts as read for resume. An
    exception in ``fn`` (or an answer with no truth value, such as an array of several numbers) is
    a ``TransformError`` naming the sample and the stage, under the loader's ``on_error``.
    """

    def __init__(self, fn: Callable[..., Any], *, concurrency: int | None = None, name: str | None = None) -> None:
        super().__init__(fn, concurrency=concurrency, name=name)


class MapBatch(Stage):
    """Call ``fn`` on each batch: ``fn(batch)`` or ``fn(batch, rng=...)``, where ``batch`` is a dict
    (``"image"``, ``"label"``, fields) and the result is the dict handed on.

    A plain function runs in a thread; an ``async def`` on the event loop (the CPU path only: the GPU
    path refuses an async stage after decode, see ``gpu_unsupported``). On the GPU path it runs
    with no host synchronisation, the place for a GPU augmentation: in the lane that made the batch,
    right after its kernel, with the lane's CUDA stream as torch's current stream (when it comes
    first among the stages after decode, or after other ``MapBatch`` stages, in a pipeline without
    ``fields``); otherwise in a thread with a stream of its own, ordered after the lane by an event.
    An exception fails every sample of the batch with a ``TransformError`` naming the stage.
    """

    def __init__(self, fn: Callable[..., Any], *, name: str | None = None) -> None:
        super().__init__(fn, name=name)


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """An ``async def``, or an object whose ``__call__`` is one (a partial of one counts too)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def _parameters(fn: Callable[..., Any]) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return set()
