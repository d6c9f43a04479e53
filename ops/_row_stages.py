"""The stages after the built-in ops that work on one output row at a time: a ``Map`` (each row's
result, stacked again into columns) and a ``Filter`` (the rows it keeps, taken from the columns).

A row is a dict of one position of every column: ``"image"`` a ``[C, H, W]`` tensor, ``"label"``
a 0-d tensor, the pipeline's ``fields``. A row that raises fails alone, named; the rows left move on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from headrace._errors import LoaderError
from headrace._sample import Sample

from ._collate import collate
from ._stage_calls import StageCalls, each_row, stage_failure
from ._stages import Filter, Map

__all__ = ["RowArguments", "columns", "filter_rows", "keep_when_true", "map_rows", "row_arguments"]

# Row ``i``'s value and the keyword arguments its stage asked for (``rng``, ``key``, ``index``).
RowArguments = Callable[[int], tuple[dict[str, Any], dict[str, Any]]]


def row_arguments(data: dict[str, Any], kept: list[int], extras: Callable[[int], dict[str, Any]]) -> RowArguments:
    """The arguments of sample ``i``'s call: its row of ``data`` (whose rows are the samples ``kept``, in
    order) and ``extras(i)``."""
    slot = {row: p for p, row in enumerate(kept)}

    def arguments(i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        return {name: column[slot[i]] for name, column in data.items()}, extras(i)

    return arguments


def keep_when_true(dropped: set[int]) -> Callable[[int, Any], None]:
    """A ``Filter``'s ``store`` for ``StageCalls.apply``: a falsy answer puts the row in ``dropped``.
    ``bool()`` is taken here, in the call's try, so an answer with no truth value (a NumPy array of
    several numbers) fails its sample, named, as a ``Map`` that returns no dict does."""

    def store(i: int, keep: Any) -> None:
        if inspect.isawaitable(keep):
            # A plain function that returns a coroutine (a lambda or a decorator around an async
            # def): the coroutine object is true, so every sample was kept, silently.
            if inspect.iscoroutine(keep):
                keep.close()  # never to be awaited: no "was never awaited" warning on top of the error
            raise TypeError(f"returned {type(keep).__name__}, not a truth value: a plain function that "
                            "returns an awaitable is never awaited; make the Filter's fn an async def")
        if not keep:
            dropped.add(i)

    return store


async def map_rows(calls: StageCalls, stage: Map, arguments: RowArguments, data: dict[str, Any], kept: list[int],
                   ready: Any, samples: list[Sample], failures: dict[int, LoaderError],
                   cuda: bool) -> tuple[dict[str, Any], list[int], Any]:
    """``stage`` on each row of ``data``: (the results as columns, the rows that came out, the GPU event).
    On the GPU the rows run in one thread, on the stage stream, after the lane's ``ready``."""
    results: dict[int, dict[str, Any]] = {}

    def store(i: int, out: Any) -> None:
        if not isinstance(out, dict):
            raise TypeError(f"returned {type(out).__name__}, not a dict")
        results[i] = out

    def outputs() -> tuple[dict[str, Any], list[int]]:
        left = [i for i in kept if i in results]
        for i, exc in _missing_fields(results, left, samples).items():
            failures[i] = stage_failure(stage, samples[i], exc)
        left = [i for i in left if i not in failures]
        return columns(results, left), left

    if not cuda:
        await calls.apply(stage, kept, arguments, store, samples, failures)
        return *outputs(), None

    def on_stream() -> tuple[dict[str, Any], list[int]]:
        def work(i: int) -> None:
            value, extras = arguments(i)
            store(i, stage.fn(value, **extras))

        each_row(kept, work, stage, samples, failures)  # one thread: kernels launched in row order
        return outputs()

    (out, left), ready = await calls.call_on_stream(data, ready, on_stream)
    return out, left, ready


async def filter_rows(calls: StageCalls, stage: Filter, arguments: RowArguments, data: dict[str, Any],
                      kept: list[int], samples: list[Sample], failures: dict[int, LoaderError],
                      dropped: set[int]) -> tuple[dict[str, Any], list[int]]:
    """``stage`` on each row of ``data`` (CPU tensors: the GPU path refuses a Filter here): (the
    columns of the rows it kept, those rows); the rows it dropped go to ``dropped``. The kept rows are
    taken from the columns as they are, not stacked again from rows."""
    await calls.apply(stage, kept, arguments, keep_when_true(dropped), samples, failures)
    slots = [p for p, row in enumerate(kept) if row not in dropped and row not in failures]
    if len(slots) == len(kept):
        return data, kept
    return _take(data, slots), [kept[p] for p in slots]


def _missing_fields(results: dict[int, dict[str, Any]], rows: list[int], samples: list[Sample]) -> dict[int, KeyError]:
    """The rows whose result lacks a field another row's result has, each with a KeyError naming the
    field and a row that has it. The columns are made from the rows' fields: without this a field
    the first row left out was lost for the whole batch (the image too), and one only later rows
    added was dropped, both silently."""
    holder: dict[str, int] = {}  # each field, by the first row that returned it
    for i in rows:
        for name in results[i]:
            holder.setdefault(name, i)
    missing: dict[int, KeyError] = {}
    for i in rows:
        if absent := [name for name in holder if name not in results[i]]:
            name = absent[0]
            missing[i] = KeyError(f"returned no {name!r} field, which the row of sample {samples[holder[name]].key!r} "
                                  f"has: every row must return the same fields (this one returned "
                                  f"{', '.join(map(repr, results[i])) or 'none'})")
    return missing


def columns(results: dict[int, dict[str, Any]], rows: list[int]) -> dict[str, Any]:
    """The row results of ``rows``, batched column by column (``_collate``'s rules)."""
    if not rows:
        return {}
    names = list(results[rows[0]])
    return {name: collate([results[i].get(name) for i in rows]) for name in names}


def _take(data: dict[str, Any], slots: list[int]) -> dict[str, Any]:
    """Rows ``slots`` of every column: a tensor's by one gather, a list's (bytes, text, images of
    different sizes) item by item."""
    index = torch.tensor(slots, dtype=torch.int64)
    return {name: column.index_select(0, index) if isinstance(column, torch.Tensor) else [column[p] for p in slots]
            for name, column in data.items()}
