"""Who this process is in a job of many: rank, world size and local rank.

The loader shards its reader by these, and picks the GPU by the local rank. They come, first found
first, from explicit arguments, from ``torch.distributed`` when its default process group is
initialised, or from the environment that torchrun (and ``torch.distributed.launch``) sets for
every process it starts: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``. Nothing is communicated: every
rank finds its own part of an epoch from the same seed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ._errors import ConfigError

__all__ = ["Distributed", "detect_distributed"]


@dataclass(frozen=True, slots=True)
class Distributed:
    """This process's place in the job. ``local_rank`` is None when no launcher gave one;
    ``local_world`` is how many processes share this node (``LOCAL_WORLD_SIZE``, else 1)."""

    rank: int = 0
    world: int = 1
    local_rank: int | None = None
    source: str = "none"  # "arguments", "torch.distributed", "environment" or "none"
    local_world: int = 1


def detect_distributed(*, distributed: bool = True, rank: int | None = None, world: int | None = None) -> Distributed:
    """Rank, world size and local rank of this process.

    ``rank`` and ``world`` given: those (for data-parallel groups that are not the default process
    group, e.g. with tensor parallelism). Else, with ``distributed`` true: the default process
    group of ``torch.distributed`` if initialised, else torchrun's ``RANK``/``WORLD_SIZE``; with
    neither, or with ``distributed=False``, rank 0 of 1. The local rank is ``LOCAL_RANK`` when set,
    else (with a process group or torchrun variables) the rank modulo the GPUs this process sees.

    Raises ConfigError when only one of ``rank``/``world`` is given, when they are out of range,
    or when the environment holds a value that is not an integer.
    """
    if not isinstance(distributed, bool):
        raise ConfigError(f"distributed must be True or False, got {distributed!r}")
    if rank is not None or world is not None:
        if rank is None or world is None:
            raise ConfigError("give both rank= and world=, or neither (to take them from torch.distributed)")
        _check(rank, world, "")
        return Distributed(rank, world, _env_int("LOCAL_RANK"), "arguments", _local_world(world))
    if not distributed:
        return Distributed()
    found = _from_process_group()
    if found is None:
        env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
        if env_rank is None or env_world is None:
            return Distributed()
        _check(env_rank, env_world, " (from the RANK and WORLD_SIZE environment variables)")
        found = (env_rank, env_world, "environment")
    r, w, source = found
    local = _env_int("LOCAL_RANK")
    if local is None:
        local = r % max(1, _visible_gpus())
    return Distributed(r, w, local, source, _local_world(w))


def _local_world(world: int) -> int:
    local_world = _env_int("LOCAL_WORLD_SIZE") if world > 1 else None
    if local_world is not None and local_world < 1:
        raise ConfigError(f"environment variable LOCAL_WORLD_SIZE={local_world} is not a positive integer")
    return local_world or 1


def _from_process_group() -> tuple[int, int, str] | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size(), "torch.distributed"


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"environment variable {name}={value!r} is not an integer") from None


def _check(rank: object, world: object, where: str) -> None:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ConfigError(f"world must be a positive int{where}, got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ConfigError(f"rank must be in [0, {world}){where}, got {rank!r}")
