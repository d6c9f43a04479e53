"""The Loader's resume state: what ``state_dict()`` writes and what ``load_state_dict()`` accepts.

Kept apart from ``_loader.py`` because the rules for loading a state saved on another world size
(see the ``Loader`` docstring) are a subject of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._errors import ConfigError

__all__ = ["STATE_VERSION", "ResumePoint", "resume_point"]

STATE_VERSION = 2  # 2: world, rank and the epoch's spans on other world sizes ("history")


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a loaded state puts the stream. ``history``: the spans of the epoch read on other world
    sizes, as (world, position) pairs; ``position`` counts inside the span after them.

    ``left``: counts of the epoch's samples still to come, each of which alone ends the epoch when
    it makes no batch (by the loader's batch size and ``last_batch``, ``past_the_end``): the rest of
    the saving rank's span, on the world size that saved it, and, on another world size, the
    longest part of what is left that a rank here gets. Empty where the Loader's own rule (``batches``
    against ``len()``) decides.
    """

    epoch: int
    position: int
    batches: int
    history: list[tuple[int, int]]
    left: tuple[int, ...] = ()

    def past_the_end(self, batches_in: Callable[[int], int]) -> bool:
        """True when the epoch has no batch left to hand out: a count in ``left`` makes none."""
        return any(batches_in(samples) == 0 for samples in self.left)


def resume_point(state: dict[str, Any], *, batch_size: int, seed: int, reader: Any, world: int) -> ResumePoint:
    """Check ``state`` against a loader with these arguments, reading ``reader`` on ``world`` ranks.

    Raises ConfigError if the state came from a loader with another batch size, seed or reader,
    or from another world size with a reader that cannot resume across world sizes.
    """
    version = state.get("version")
    if version != STATE_VERSION:  # 0.1 is unreleased: no older state is out there to load
        raise ConfigError(f"unknown loader state version {version!r} (this headrace writes and reads {STATE_VERSION})")
    for name, mine in (("batch_size", batch_size), ("seed", seed)):
        if state[name] != mine:
            raise ConfigError(f"state was saved with {name}={state[name]!r}, this loader has {mine!r}")
    saved, current = state["source"], reader.state_dict()
    saved_world = int(state.get("world", saved.get("world", 1)))
    history = [(int(w), int(p)) for w, p in state.get("history", [])]
    position = int(state["position"])
    if saved_world == world:
        ignored: set[str] = {"rank"}
        if world > 1 and saved.get("equal") is None:  # unequal parts: each rank counts its own samples
            ignored.add("samples")
    else:  # the split of the earlier spans follows from their world sizes alone
        ignored = {"rank", "world", "samples", "equal"}
    if _without(saved, ignored) != _without(current, ignored):
        raise ConfigError(f"state was saved with reader {saved!r}, this loader reads {current!r}")
    if saved_world != world and (position or history):
        if not getattr(reader, "reshardable", False):
            raise ConfigError(
                f"state was saved on {saved_world} ranks and this loader runs on {world}: "
                f"{type(reader).__name__} cannot resume an epoch on another world size "
                "(files, LMDB and WebDataset with per-shard counts, not resampled, can); resume on "
                f"{saved_world} ranks, or start at the next epoch")
        # Saved after its span's last batch (under last_batch="drop", with fewer samples left than a
        # batch), the run on the old world size would go on with the next epoch, and so does this
        # one, as on the same world size (the Loader's rule), rather than read an empty rest (pad)
        # or, as an extra epoch, what the old ranks would have dropped (equal's cut or that batch).
        # Nor does it read a rest in which no rank here gets a batch: rank 0 gets the most of it
        # (the parts of a span after another differ by one sample at most, the first ones longer).
        saved_left = _saved_span_length(state, seed=seed, reader=reader, history=history) - position
        if position:
            history.append((saved_world, position))
        most = _span_length(reader, int(state["epoch"]), seed, history, 0, world, reader.equal)
        return ResumePoint(int(state["epoch"]), 0, int(state["batches"]), history, (saved_left, most))
    if history and getattr(reader, "reshardable", False):
        # The Loader's rule counts whole epochs: after a span's last batch here, the same as above.
        left = _saved_span_length(state, seed=seed, reader=reader, history=history) - position
        return ResumePoint(int(state["epoch"]), position, int(state["batches"]), history, (left,))
    return ResumePoint(int(state["epoch"]), position, int(state["batches"]), history)


def _saved_span_length(state: dict[str, Any], *, seed: int, reader: Any, history: list[tuple[int, int]]) -> int:
    """Samples in the saving rank's stream for the span it was in (after ``history``), told from the
    saved world, rank and ``equal``."""
    saved = state["source"]
    return _span_length(reader, int(state["epoch"]), seed, history, int(saved.get("rank", 0)),
                        int(state["world"]), saved.get("equal"))


def _span_length(reader: Any, epoch: int, seed: int, history: list[tuple[int, int]], rank: int, world: int,
                 equal: Any) -> int:
    """Samples in rank ``rank`` of ``world``'s stream for the span of ``epoch`` after ``history``:
    the files and LMDB readers by their order, WebDataset by its blocks."""
    if hasattr(reader, "order"):  # IndexedReader: one global order whatever the world size
        return len(reader.shard(rank, world, equal=equal).order(epoch, seed, history))
    from headrace.readers._reshard import span_length  # the readers import this package: import late

    return span_length(reader, epoch, seed, history, rank, world, equal)


def _without(state: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in keys}
