"""The loader's progress bar: one tqdm bar per epoch."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._run import EpochMetrics, _Run

__all__ = ["EpochProgress"]


class EpochProgress:
    """A tqdm bar over one epoch's batches; its note (samples/s, starved share) is redone at most
    once a second, so a batch costs one ``update``."""

    def __init__(self, run: _Run, total: int | None, initial: int) -> None:
        from tqdm import tqdm

        self._run = run
        self._bar = tqdm(total=total, initial=initial, desc=f"epoch {run.epoch}", unit="batch", dynamic_ncols=True)
        self._next_note = time.perf_counter() + 1.0

    def step(self) -> None:
        self._bar.update()
        now = time.perf_counter()
        if now >= self._next_note:
            self._next_note = now + 1.0
            self._note(self._run.metrics(), refresh=False)

    def _note(self, metrics: EpochMetrics, *, refresh: bool) -> None:
        self._bar.set_postfix_str(
            f"{metrics.samples_per_second:,.0f} samples/s, starved {metrics.starved_fraction:.0%}", refresh=refresh)

    def close(self, metrics: EpochMetrics) -> None:
        self._note(metrics, refresh=True)
        self._bar.close()
