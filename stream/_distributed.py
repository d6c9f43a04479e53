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

from ._errors import ConfigError, require_int

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
    when the environment holds a value that is not an integer, when it holds only one of ``RANK``
    and ``WORLD_SIZE`` (but ``WORLD_SIZE=1`` or ``RANK=0``, a single process), or a ``LOCAL_RANK``
    that is negative or not below ``LOCAL_WORLD_SIZE``.
    """
    if not isinstance(distributed, bool):
        raise ConfigError(f"distributed must be True or False, got {distributed!r}")
    if rank is not None or world is not None:
        if rank is None or world is None:
            raise ConfigError("give both rank= and world=, or neither (to take them from torch.distributed)")
        rank, world = _check(rank, world, "")
        # LOCAL_RANK and LOCAL_WORLD_SIZE count the launcher's processes on this node, whatever the
        # data-parallel group given here: world=1 under tensor parallelism still shares the node.
        return Distributed(rank, world, _local_rank(launched=True), "arguments", _local_world(launched=True))
    if not distributed:
        return Distributed()
    found = _from_process_group() or _from_environment()
    if found is None:
        return Distributed()
    r, w, source = found
    local = _local_rank(launched=w > 1)
    if local is None:
        local = r % max(1, _visible_gpus())
    return Distributed(r, w, local, source, _local_world(launched=w > 1))


def _from_environment() -> tuple[int, int, str] | None:
    """torchrun's ``RANK`` and ``WORLD_SIZE``; None when neither is set. One without the other is a
    launch gone wrong: taken as one process, every rank would read the whole data set."""
    env_rank, env_world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if env_rank is None and env_world is None:
        return None
    if env_rank is None or env_world is None:
        if (env_rank, env_world) in ((0, None), (None, 1)):  # a single process, said half-way
            return None
        given, missing = ("RANK", "WORLD_SIZE") if env_world is None else ("WORLD_SIZE", "RANK")
        raise ConfigError(f"environment variable {given}={os.environ[given]} is set but {missing} is not: "
                          "set both (torchrun does), or pass rank= and world=, or distributed=False")
    _check(env_rank, env_world, " (from the RANK and WORLD_SIZE environment variables)")
    return env_rank, env_world, "environment"


def _local_world(*, launched: bool) -> int:
    """``LOCAL_WORLD_SIZE``, checked, where a launcher started several processes (``launched``), else 1."""
    local_world = _env_int("LOCAL_WORLD_SIZE") if launched else None
    if local_world is not None and local_world < 1:
        raise ConfigError(f"environment variable LOCAL_WORLD_SIZE={local_world} is not a positive integer")
    return local_world or 1


def _local_rank(*, launched: bool) -> int | None:
    """``LOCAL_RANK``, checked: a negative one would pick a GPU counted from the end (-1: the last,
    which another process uses), one not below ``LOCAL_WORLD_SIZE`` cannot come from a launcher."""
    local = _env_int("LOCAL_RANK")
    if local is None:
        return None
    if local < 0:
        raise ConfigError(f"environment variable LOCAL_RANK={local} is negative")
    local_world = _env_int("LOCAL_WORLD_SIZE") if launched else None
    if local_world is not None and local >= local_world:
        raise ConfigError(f"environment variable LOCAL_RANK={local} must be below LOCAL_WORLD_SIZE={local_world}")
    return local


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


def _check(rank: object, world: object, where: str) -> tuple[int, int]:
    """``(rank, world)`` as Python ints, NumPy's integers taken; ConfigError naming the wrong one."""
    world = require_int("world", world, wanted=f"a positive int{where}")
    return require_int("rank", rank, 0, below=world, wanted=f"in [0, {world}){where}"), world
