"""The Loader's arguments: checked, and their defaults resolved for this process.

Kept apart from ``_loader.py`` so that the loader's own code is about epochs, iteration and
resume; what an argument means is in the ``Loader`` docstring.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._batcher import LastBatch
from ._budget import ErrorBudget
from ._device import resolve_device
from ._distributed import detect_distributed
from ._errors import ConfigError, LoaderError, require_int
from ._policy import DEFAULT_MAX_ERRORS, check_on_error

__all__ = ["LoaderArgs", "resolve_loader_args"]

_EQUAL = ("pad", "drop", None)


@dataclass(frozen=True, slots=True)
class LoaderArgs:
    """What the loader runs with, every default filled in, and every count a Python int (the
    arguments may be NumPy's: they would then reach the state dict and the stages)."""

    reader: Any  # this rank's part of the data set
    pipeline: Any
    device: str  # "cpu" or "cuda:N"
    last_batch: LastBatch
    batch_size: int
    seed: int
    lanes: int
    num_threads: int
    prefetch: int
    max_bytes: int
    max_errors: int | float  # 0 when on_error is "raise"
    run_ahead: bool


def resolve_loader_args(
    reader: Any,
    *,
    batch_size: int,
    pipeline: Any,
    device: str,
    last_batch: LastBatch | str,
    seed: int,
    num_threads: int | None,
    prefetch: int | None,
    max_bytes: int,
    on_error: str | Callable[[LoaderError], str],
    max_errors: int | float | None,
    lanes: int,
    gpu_tuning: Any,
    run_ahead: bool | None,
    distributed: bool,
    rank: int | None,
    world: int | None,
    equal: str | None,
    progress: bool,
) -> LoaderArgs:
    """Check the Loader's arguments and resolve the defaults that depend on this process: its rank
    and world (the reader's shard), its device, and its share of the node's cores.

    Raises ConfigError naming the first wrong argument.
    """
    pipeline, batch_size, lanes, seed = _check_arguments(
        reader, batch_size=batch_size, pipeline=pipeline, seed=seed, on_error=on_error, lanes=lanes,
        gpu_tuning=gpu_tuning, run_ahead=run_ahead, equal=equal, progress=progress)
    dist = detect_distributed(distributed=distributed, rank=rank, world=world)
    reader = _shard_for(reader, dist.rank, dist.world, equal, explicit=rank is not None)
    device = resolve_device(pipeline, device, local_rank=dist.local_rank)
    if max_errors is None:
        max_errors = 0 if on_error == "raise" else DEFAULT_MAX_ERRORS
    if num_threads is None:  # the node's cores, shared by the processes torchrun started on it
        num_threads = max(1, (os.cpu_count() or 1) // dist.local_world)
    if prefetch is None:  # on the GPU: one batch per lane, one being prepared, one handed over
        prefetch = lanes + 2 if device.startswith("cuda") else 3
    num_threads = require_int("num_threads", num_threads)
    prefetch = require_int("prefetch", prefetch)
    max_bytes = require_int("max_bytes", max_bytes)
    max_errors = ErrorBudget(max_errors).max_errors  # checked now, not at the first failure; a Python number
    return LoaderArgs(
        reader=reader,
        pipeline=pipeline,
        device=device,
        last_batch=LastBatch.parse(last_batch),
        batch_size=batch_size,
        seed=seed,
        lanes=lanes,
        num_threads=num_threads,
        prefetch=prefetch,
        max_bytes=max_bytes,
        max_errors=max_errors if on_error != "raise" else 0,
        run_ahead=device.startswith("cuda") if run_ahead is None else run_ahead,
    )


def _check_arguments(reader: Any, *, batch_size: int, pipeline: Any, seed: int, on_error: Any, lanes: int,
                     gpu_tuning: Any, run_ahead: bool | None, equal: str | None,
                     progress: bool) -> tuple[Any, int, int, int]:
    """The checks that need nothing from the process; returns the pipeline (a default one for None),
    and batch_size, lanes and seed as Python ints."""
    from headrace.ops import GpuTuning, Pipeline
    from headrace.readers import Reader

    if not isinstance(reader, Reader):
        raise ConfigError(f"reader must be a headrace.readers.Reader, got {type(reader).__name__}")
    batch_size = require_int("batch_size", batch_size)
    pipeline = Pipeline() if pipeline is None else pipeline
    if not isinstance(pipeline, Pipeline):
        raise ConfigError(f"pipeline must be a headrace.ops.Pipeline, got {type(pipeline).__name__}")
    if equal not in _EQUAL:
        raise ConfigError(f"equal must be 'pad', 'drop' or None, got {equal!r}")
    lanes = require_int("lanes", lanes)
    if gpu_tuning is not None and not isinstance(gpu_tuning, GpuTuning):
        raise ConfigError(f"gpu_tuning must be a headrace.ops.GpuTuning, got {type(gpu_tuning).__name__}")
    check_on_error(on_error)
    # Checked now: NumPy seeds the shuffle and the random ops with it only once the first epoch
    # starts, and refuses a negative seed there (a bool would be seed 0 or 1).
    seed = require_int("seed", seed, 0)
    if run_ahead is not None and not isinstance(run_ahead, bool):
        raise ConfigError(f"run_ahead must be True, False or None, got {run_ahead!r}")
    if not isinstance(progress, bool):
        raise ConfigError(f"progress must be True or False, got {progress!r}")
    return pipeline, batch_size, lanes, seed


def _shard_for(reader: Any, rank: int, world: int, equal: Any, *, explicit: bool) -> Any:
    """The reader this rank reads: ``reader`` sharded by (rank, world), unless already sharded."""
    if reader.world > 1:
        if explicit and (reader.rank, reader.world) != (rank, world):
            raise ConfigError(f"the reader is sharded as rank {reader.rank} of {reader.world}, "
                              f"but rank={rank}, world={world} were given")
        return reader  # the caller sharded it: their split, their policy
    if world == 1:
        return reader
    try:
        return reader.shard(rank, world, equal=equal)
    except ConfigError as exc:
        exc.add_note(f"while the loader sharded the reader for rank {rank} of {world} with equal={equal!r}")
        raise
