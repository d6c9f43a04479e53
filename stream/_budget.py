"""The failure budget behind ``on_error="skip"``: a count, or a fraction of the samples seen."""

from __future__ import annotations

import numbers

from ._errors import ConfigError, ErrorBudgetExceeded, LoaderError, is_int, require_number

__all__ = ["ErrorBudget"]


class ErrorBudget:
    """Counts dropped samples in an epoch and says when too many were dropped.

    ``max_errors`` is an int (at most that many) or a float in [0, 1] (at most that fraction of the
    samples seen so far, checked once at least ``min_samples`` were seen, so one early failure does
    not end a run). The fraction is checked at each failure and when ``min_samples`` is first
    reached: only then can the share of failures rise past it, so the failures made before that
    point count as soon as it is passed, whether or not more follow.
    """

    def __init__(self, max_errors: int | float, *, min_samples: int = 100) -> None:
        if isinstance(max_errors, bool) or not isinstance(max_errors, numbers.Real) or max_errors < 0:
            raise ConfigError(f"max_errors must be a non-negative int or a fraction, got {max_errors!r}")
        self.max_errors: int | float
        if is_int(max_errors):  # a count; a NumPy one as a Python int, which record() knows
            self.max_errors = int(max_errors)
        else:  # a fraction, NumPy's too; NaN refused: it would pass every check
            self.max_errors = require_number("max_errors as a fraction", max_errors, 0, 1, wanted="in [0, 1]")
        self.min_samples = min_samples
        self.seen = 0
        self.dropped = 0
        self.last: LoaderError | None = None  # the latest failure: the one an over-budget error names

    def record(self, seen: int, failures: list[LoaderError]) -> None:
        """Count ``seen`` samples of which ``failures`` were dropped; raise when over budget."""
        self.seen += seen
        self.dropped += len(failures)
        if failures:
            self.last = failures[-1]
        elif not (self.dropped and self.seen - seen < self.min_samples <= self.seen):
            return  # no failure and not the first check of the fraction: the share only fell
        if isinstance(self.max_errors, int):
            over = self.dropped > self.max_errors
            limit = f"{self.max_errors} samples"
        else:
            over = self.seen >= self.min_samples and self.dropped > self.max_errors * self.seen
            limit = f"{self.max_errors:.2%} of samples"
        if over:
            last = self.last
            assert last is not None
            raise ErrorBudgetExceeded(
                f"{self.dropped} of {self.seen} samples failed, over the budget of {limit}; last: {last.message}",
                key=last.key,
                source=last.source,
            ) from last
