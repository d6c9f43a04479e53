"""Waiting for work running in threads or tasks, from the event loop, even when cancelled: the one
place the loader, the executors and the readers take their helpers for it."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Iterable
from typing import Any

__all__ = ["cancel_and_wait", "gather_jobs", "join_threads", "wait_all"]


async def wait_all(futures: Iterable[asyncio.Future[Any]]) -> None:
    """Wait until every future is done, even if the caller is cancelled meanwhile.

    A cancellation that arrives while waiting is re-raised once they are all done, so nothing the
    owner started outlives it (``asyncio.shield`` would return at once and leave them running).
    """
    pending = {f for f in futures if not f.done()}
    cancelled = False
    while pending:
        try:
            _, pending = await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def join_threads(futures: Iterable[concurrent.futures.Future[Any]]) -> None:
    """Wait until every thread job is finished (``wait_all`` for jobs of thread pools).

    Readers' and executors' cleanup uses it so that no thread outlives its owner.
    """
    await wait_all([asyncio.wrap_future(f) for f in futures if not f.done()])


async def gather_jobs(jobs: list[concurrent.futures.Future[Any]]) -> None:
    """Wait for thread jobs an owner submitted; if one fails or the wait is cancelled, cancel the
    jobs not started (running ones finish: the owner's ``drain`` waits for them) and re-raise."""
    try:
        await asyncio.gather(*(asyncio.wrap_future(job) for job in jobs))
    except BaseException:
        for job in jobs:
            job.cancel()
        raise


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
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
