"""Ending the tasks a reader owns."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from headrace._threads import wait_all

__all__ = ["cancel_and_wait"]


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]]) -> None:
    """Cancel ``tasks`` and wait until every one has finished, even if the caller is cancelled meanwhile.

    A cancellation that arrives while waiting is re-raised once they are all done, so nothing the
    owner started outlives it. Their results and errors are dropped (retrieved, so never logged).
    """
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    try:
        await wait_all(tasks)
    finally:
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()
