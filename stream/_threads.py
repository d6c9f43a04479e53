"""Waiting for work running in threads, from the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterable
from typing import Any

__all__ = ["join_threads"]


async def join_threads(futures: Iterable[concurrent.futures.Future[Any]]) -> None:
    """Wait until every thread job is finished, even if the caller is cancelled meanwhile.

    Readers' and executors' cleanup uses it so that no thread outlives its owner; a cancellation
    that arrives while waiting is re-raised once the threads are idle (``asyncio.shield`` would
    return at once and leave them running).
    """
    pending = {asyncio.wrap_future(f) for f in futures if not f.done()}
    cancelled = False
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
