"""A seeded, bounded sample shuffle buffer whose state at any stream position can be recomputed.

The buffer's random choices depend only on the seed and on how many samples it has emitted, never
on the samples themselves: output ``p`` uses draw ``u_p``, a uniform float from a block RNG keyed on
(key, p // 4096). So the state after ``k`` outputs (which input ordinals sit in which slots, and
which input comes next) can be found by running the same buffer over plain integers 0, 1, 2, ...
instead of samples: ``resume_state``. That costs O(size + k) integer steps, about 0.5 s per million
positions, and no I/O; the reader then fetches only the inputs it names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["Draws", "ShuffleBuffer", "resume_state"]

_BLOCK = 4096


class Draws:
    """Uniform floats ``u_0, u_1, ...`` addressable by index, reproducible from ``key`` alone."""

    def __init__(self, key: Sequence[int]) -> None:
        self.key = [int(k) for k in key]
        self._block = -1
        self._values: list[float] = []

    def __getitem__(self, p: int) -> float:
        block, at = divmod(p, _BLOCK)
        return self.block(block)[at]

    def block(self, block: int) -> list[float]:
        """Draws ``block * 4096`` to ``block * 4096 + 4095``."""
        if block != self._block:
            self._values = np.random.default_rng([*self.key, block]).random(_BLOCK).tolist()
            self._block = block
        return self._values


class ShuffleBuffer:
    """Holds up to ``size`` items; once full, each new item makes it emit one, chosen at random.

    An arriving item and the ``size`` held ones are equally likely to leave (draw ``u_p`` picks slot
    ``floor(u_p * (size + 1))``, where slot ``size`` is the new item itself). ``drain`` empties it
    at the end, one random slot per output. ``size=0`` passes items through unchanged.
    """

    def __init__(self, size: int, draws: Draws, *, position: int = 0, slots: list[Any] | None = None) -> None:
        self.size = size
        self.draws = draws
        self.position = position  # outputs so far, = index of the next draw
        self.slots: list[Any] = [] if slots is None else slots

    def push(self, item: Any, out: list[Any]) -> None:
        if len(self.slots) < self.size:
            self.slots.append(item)
            return
        if self.size:
            i = int(self.draws[self.position] * (self.size + 1))
            if i < self.size:
                item, self.slots[i] = self.slots[i], item
        self.position += 1
        out.append(item)

    def drain(self, out: list[Any], limit: int | None = None) -> None:
        """Emit the held items in random order (at most ``limit`` of them)."""
        slots = self.slots
        while slots and (limit is None or limit > 0):
            i = int(self.draws[self.position] * len(slots))
            item = slots[i]
            slots[i] = slots[-1]
            slots.pop()
            self.position += 1
            out.append(item)
            if limit is not None:
                limit -= 1


def resume_state(size: int, draws: Draws, total: int, start: int) -> tuple[list[int], int]:
    """Where a buffer over ``total`` inputs stands after ``start`` outputs.

    Returns (the input ordinals held, slot by slot; the ordinal of the next input to push).
    Everything else before that next input has already been emitted. The loop is
    ``ShuffleBuffer.push`` on integers, unrolled per block of draws (tests check they agree).
    """
    if size == 0:
        return [], min(start, total)
    slots = list(range(min(size, total)))
    nxt, position = len(slots), 0
    steady = min(start, total - nxt)  # outputs made by pushes into a full buffer
    while position < steady:
        block, at = divmod(position, _BLOCK)
        values = draws.block(block)
        for u in values[at : at + steady - position]:
            i = int(u * (size + 1))
            if i < size:
                slots[i] = nxt
            nxt += 1
        position = min(steady, (block + 1) * _BLOCK)
    if position < start:
        buf = ShuffleBuffer(size, draws, position=position, slots=slots)
        buf.drain([], start - position)
        slots = buf.slots
    return slots, nxt
