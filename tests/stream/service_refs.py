"""Real JPEGs for the service and server tests (the same recipe as tests/conftest.py's folders),
and a gate that holds a service's batches in its executor until the test opens it."""

from __future__ import annotations

import asyncio

import numpy as np
from sample_data import jpeg_bytes as jpeg


def jpegs(count: int, seed: int = 7, sizes: tuple[int, int] = (40, 160)) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [jpeg(rng, int(rng.integers(*sizes)), int(rng.integers(*sizes))) for _ in range(count)]


class Gate:
    """Wraps a started service's executor: ``run`` waits until the test opens the gate."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.open = asyncio.Event()
        self.entered = 0

    async def run(self, batch):
        self.entered += 1
        await self.open.wait()
        return await self.inner.run(batch)

    async def aclose(self) -> None:
        await self.inner.aclose()


def hold_batches(pre) -> Gate:
    """Put a ``Gate`` in front of the started Preprocessor ``pre``'s executor."""
    gate = pre._batches.executor = Gate(pre._batches.executor)
    return gate
