"""What the loader does with a sample that failed: the ``on_error`` policy, and the record it keeps.

``on_error`` is ``"raise"`` (the first failure ends the epoch, after the good batches before it),
``"skip"`` (the sample leaves its batch), ``"replace"`` (another sample of the same batch takes its
row, so batches stay full), or a callable that gets the error and returns one of those three
words. Skipped and replaced samples count against ``max_errors``; every failure is counted by
class, the last few are kept as ``ErrorRecord``s, and skips are logged on the ``headrace``
logger, at most one line a second (SPDL's fail counter, made visible).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._errors import ConfigError, LoaderError

__all__ = ["ACTIONS", "DEFAULT_MAX_ERRORS", "ErrorLog", "ErrorRecord", "check_on_error", "decide"]

ACTIONS = ("raise", "skip", "replace")
# The skip budget when none is given: 1% of the samples seen (checked once 100 were seen). A data
# set with more bad files than that needs a look, not silence.
DEFAULT_MAX_ERRORS = 0.01
RECENT = 32  # error records kept
LOG_INTERVAL = 1.0  # seconds between log lines about skipped samples

logger = logging.getLogger("headrace")

OnError = str | Callable[[LoaderError], str]


def check_on_error(on_error: Any) -> None:
    """ConfigError unless ``on_error`` is one of ``ACTIONS`` or a callable."""
    if not callable(on_error) and on_error not in ACTIONS:
        raise ConfigError(f"on_error must be 'raise', 'skip', 'replace' or a callable, got {on_error!r}")


def decide(on_error: OnError, error: LoaderError) -> str:
    """The action for ``error`` under ``on_error``: one of ``ACTIONS``.

    A callable's own exception, or an answer that is not an action, is a ConfigError naming the
    sample, raised from the callable's error.
    """
    if not callable(on_error):
        return on_error
    try:
        action = on_error(error)
    except Exception as exc:  # noqa: BLE001 - the user's function failed: say so, typed
        raise ConfigError(f"the on_error callable raised {type(exc).__name__}: {exc}",
                          key=error.key, source=error.source) from exc
    if action not in ACTIONS:
        raise ConfigError(f"the on_error callable must return 'raise', 'skip' or 'replace', got {action!r}",
                          key=error.key, source=error.source)
    return action


@dataclass(frozen=True, slots=True)
class ErrorRecord:
    """One failed sample: the error's class name, the sample's key and source, the stage, the
    message, and what the loader did (``"skip"``, ``"replace"`` or ``"raise"``)."""

    kind: str
    key: str | None
    source: str | None
    stage: str
    message: str
    action: str


class ErrorLog:
    """Counts failures by class, keeps the last ``RECENT`` records, logs skips rate-limited."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[ErrorRecord] = collections.deque(maxlen=RECENT)
        self._last_log = -LOG_INTERVAL
        self._unlogged = 0

    def add(self, error: LoaderError, action: str) -> None:
        kind = type(error).__name__
        self.counts[kind] += 1
        self.recent.append(ErrorRecord(kind, error.key, error.source, error.stage, error.message, action))
        if action == "raise":
            return
        now = time.monotonic()
        if now - self._last_log < LOG_INTERVAL:
            self._unlogged += 1
            return
        more = f" ({self._unlogged} more since the last line)" if self._unlogged else ""
        logger.warning("headrace: %s sample %s from %s: %s: %s%s", "skipped" if action == "skip" else "replaced",
                       error.key, error.source, kind, error.message, more)
        self._last_log, self._unlogged = now, 0
