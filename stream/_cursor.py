"""Where the Loader's stream stands in an epoch: what ``state_dict()`` reads and ``load_state_dict()`` sets."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._loader_state import ResumePoint

__all__ = ["Cursor"]


class Cursor:
    """The epoch the next batch comes from, and this rank's samples (``position``) and batches
    (``batches``) already handed out in it.

    ``history``: the spans of the epoch read on other world sizes before a resume, as (world,
    position) pairs; ``position`` counts inside the span after them. ``fresh``: nobody has started
    iterating from here yet; an iteration left mid-epoch makes the next ``async for`` start the
    next epoch. ``batches_in``: how many batches that many samples make (the loader's batch size
    and ``last_batch``; its ``Epochs`` sets it), which says whether a resumed epoch has one left.
    """

    def __init__(self) -> None:
        self.start_epoch(0)
        self.fresh = True
        self.batches_in: Callable[[int], int] = lambda samples: samples  # until set: any sample is a batch

    def start_epoch(self, epoch: int) -> None:
        """Point the stream at ``epoch``'s first sample."""
        self.epoch, self.position, self.batches = epoch, 0, 0
        self.history: list[tuple[int, int]] = []

    def begin_iteration(self) -> tuple[int, int, int, tuple[tuple[int, int], ...]]:
        """Where an ``async for`` starting now starts, as (epoch, position, batches, history): here
        when fresh, else at the next epoch's first sample. Not fresh after it."""
        if not self.fresh:
            self.start_epoch(self.epoch + 1)
        self.fresh = False
        return (self.epoch, self.position, self.batches, tuple(self.history))

    def not_begun(self) -> None:
        """The iteration begun last never asked for a batch: the next one starts here, as it would have."""
        self.fresh = True

    def epoch_completed(self, epoch: int) -> None:
        """``epoch`` was iterated to its end: the next ``async for`` starts the one after it."""
        self.start_epoch(epoch + 1)
        self.fresh = True

    def resume(self, point: ResumePoint) -> None:
        """Stand where a loaded state puts the stream; the next ``async for`` starts there, or at
        the next epoch's start when that epoch has no batch left (``ResumePoint.left``)."""
        if point.past_the_end(self.batches_in):
            self.start_epoch(point.epoch + 1)
        else:
            self.epoch, self.position, self.batches = point.epoch, point.position, point.batches
            self.history = point.history
        self.fresh = True
