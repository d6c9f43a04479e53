"""Event loop choice: uvloop when it is installed (faster callbacks and I/O), asyncio's otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["loop_factory", "new_event_loop"]


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def new_event_loop() -> asyncio.AbstractEventLoop:
    return loop_factory()()
