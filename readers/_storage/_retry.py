"""Retries with capped exponential backoff and full jitter, the same for every store.

A failure counts against the budget only while no byte arrives: a long download that drops now
and then, but makes progress each time, is resumed from its offset as often as it needs.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from headrace._errors import ConfigError, StorageError, require_int, require_number

from ._base import _TRY, StoreFault

__all__ = ["Retry", "with_retries"]

log = logging.getLogger("headrace.storage")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Retry:
    """How hard to try before a ``StorageError``.

    ``attempts``: tries per request (1: no retry). ``backoff``: the first wait in seconds, doubled
    after each failure up to ``max_backoff``; each wait is drawn uniformly from [0, that] (full
    jitter, so many readers that failed together do not come back together). ``timeout``: seconds
    a request may wait for its answer, or a download for its next block, before it counts as a
    failure (a stall); a download that keeps bringing bytes may take as long as it needs.
    """

    attempts: int = 5
    backoff: float = 0.2
    max_backoff: float = 10.0
    timeout: float = 30.0

    def __post_init__(self) -> None:
        # Kept as Python numbers, NumPy's taken. NaN is refused: a NaN timeout or backoff would be
        # taken as given and fail each request or sleep oddly later.
        object.__setattr__(self, "attempts", require_int("retry attempts", self.attempts))
        for name in ("backoff", "max_backoff", "timeout"):
            seconds = require_number(f"retry {name}", getattr(self, name), 0, low_open=name == "timeout",
                                     wanted="a positive number of seconds")
            object.__setattr__(self, name, seconds)

    @classmethod
    def of(cls, value: Retry | dict | int | None) -> Retry:
        """A Retry from a Retry, a dict of its fields, an attempt count, or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, Retry):
            return value
        if isinstance(value, dict):
            unknown = set(value) - {"attempts", "backoff", "max_backoff", "timeout"}
            if unknown:
                raise ConfigError(f"unknown retry options {sorted(unknown)}")
            return cls(**value)
        return cls(attempts=value)  # type: ignore[arg-type]

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th failure in a row."""
        return random.uniform(0, min(self.max_backoff, self.backoff * 2 ** (failures - 1)))


async def with_retries(call: Callable[[], Awaitable[T]], retry: Retry, url: str, what: str = "GET", *,
                       missing_ok: bool = False) -> T | None:
    """``await call()`` until it succeeds, ``retry.attempts`` times at most.

    Each try is bounded by ``retry.timeout`` while no byte arrives: the stores' ``read`` and
    ``read_range`` give it the whole timeout again with each block (``progressed``), so a large
    object that streams for longer is not cut. Raises StorageError naming ``url`` when a fault is not
    retryable or the budget is spent. With ``missing_ok`` (an object that may be absent: a shard
    folder's index) returns None for a missing object, and for one the store denies access to (401,
    403): S3 answers a missing key so to a caller who may not list the bucket, and the neighbour of
    a presigned URL, asked for without a signature, is refused though it may not exist at all.
    Cancellation is never retried.
    """
    failures = 0
    while True:
        try:
            async with asyncio.timeout(retry.timeout) as deadline:
                token = _TRY.set((deadline, retry.timeout))
                try:
                    return await call()
                finally:
                    _TRY.reset(token)
        except (StoreFault, TimeoutError) as exc:
            if missing_ok and isinstance(exc, StoreFault) and (exc.missing or exc.denied):
                if exc.denied:
                    log.info("storage: %s %s denied (%s): taken as absent", what, url, exc.message)
                return None
            failures += 1
            fault = exc if isinstance(exc, StoreFault) else StoreFault(
                f"nothing arrived within {retry.timeout:g} s", retryable=True)
            await backoff_or_raise(fault, failures, retry, url, what)


async def backoff_or_raise(fault: StoreFault, failures: int, retry: Retry, url: str, what: str) -> None:
    """Sleep before try ``failures + 1``, or raise the StorageError that ends it."""
    # "from None": a backend's own exception may print request details; the fault's message is
    # the scrubbed translation of it.
    if not fault.retryable:
        raise StorageError(f"{what} failed: {fault.message}", source=url) from None
    if failures >= retry.attempts:
        raise StorageError(f"{what} failed {failures} times in a row (retry budget spent); last: {fault.message}",
                           source=url) from None
    wait = retry.delay(failures)
    log.info("storage: %s %s failed (%s); retry %d/%d in %.2f s", what, url, fault.message, failures,
             retry.attempts - 1, wait)
    await asyncio.sleep(wait)
