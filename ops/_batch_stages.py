"""A ``MapBatch`` call, wherever it runs: a ``StagedExecutor``'s thread, or on the GPU path the
lane's own thread with the lane's stream current, right after the batch's kernel.

Running there saves each batch a hop to another thread and an event between streams: a trivial
stage on a side stream cost the H100 training row 5-8% (docs/benchmarks.md, issue 16). A lane can
take the stages only while nothing else has to happen first: the ``MapBatch`` stages at the head of
the stages after decode, in a pipeline without ``fields`` (those are batched after the lane).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._pipeline import Pipeline
from ._stages import MapBatch

__all__ = ["LaneStage", "batch_extras", "checked_batch", "lane_stages", "stage_rng"]

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class LaneStage:
    """A ``MapBatch`` a GPU lane runs, with its place in the pipeline (the key of its random numbers)."""

    stage: MapBatch
    position: int


def lane_stages(pipeline: Pipeline) -> tuple[LaneStage, ...]:
    """The ``MapBatch`` stages a GPU lane can run for ``pipeline``: the plain functions at the head
    of its stages after decode, when it batches no ``fields``."""
    if pipeline.fields:
        return ()
    head: list[LaneStage] = []
    for stage in pipeline.after:
        if not isinstance(stage, MapBatch) or stage.is_async:
            break
        head.append(LaneStage(stage, pipeline.stage_position(stage)))
    return tuple(head)


def stage_rng(seed: int, epoch: int, position: int, index: int) -> np.random.Generator:
    """The generator a stage's ``rng`` gets: keyed by (seed, epoch, the stage's place, the sample's
    index, or the batch's for a ``MapBatch``), never by thread or call order."""
    return np.random.default_rng([seed & _MASK64, epoch & _MASK64, position, index & _MASK64])


def batch_extras(stage: MapBatch, position: int, *, seed: int, epoch: int, index: int,
                 keys: Callable[[], list[str]], layout: str) -> dict[str, Any]:
    """The keyword arguments ``stage``'s function asked for by name: ``rng`` (keyed by the batch's
    index), ``keys`` (the keys of the batch's rows, ``keys()``), ``layout`` (the pipeline's image
    layout)."""
    extras: dict[str, Any] = {}
    if stage.wants_rng:
        extras["rng"] = stage_rng(seed, epoch, position, index)
    if stage.wants_keys:
        extras["keys"] = keys()
    if stage.wants_layout:
        extras["layout"] = layout
    return extras


def checked_batch(out: Any, rows: int | None = None) -> dict[str, Any]:
    """A ``MapBatch``'s result, refused (TypeError) when it is not a dict, or, given the batch's
    ``rows``, when a column (a tensor of one or more dimensions, a list) has another number of rows:
    the batch's keys, failures and ``Filter``s after it go by row, so a stage that dropped or added
    rows made a batch whose images no longer matched its keys."""
    if not isinstance(out, dict):
        raise TypeError(f"returned {type(out).__name__}, not a dict")
    if rows is not None and (wrong := {name: n for name, column in out.items()
                                       if (n := _column_rows(column)) is not None and n != rows}):
        counts = ", ".join(f"{name!r} has {n}" for name, n in wrong.items())
        raise TypeError(f"returned a batch of another number of rows ({counts}; the batch has {rows}): a MapBatch "
                        "keeps its batch's rows (drop samples with ops.Filter)")
    return out


def _column_rows(column: Any) -> int | None:
    """The rows of a batch column: a tensor's first dimension, a list's length; None for a value
    that is not by row (a 0-d tensor, a number a stage put beside the columns)."""
    if isinstance(column, torch.Tensor):
        return len(column) if column.dim() else None
    return len(column) if isinstance(column, list) else None
