"""A seeded, bounded sample shuffle buffer whose state at any stream position can be recomputed.

The buffer's random choices depend only on the seed and on how many samples it has emitted, never
on the samples themselves: output ``p`` uses draw ``u_p``, a uniform float from a block RNG keyed on
(key, p // 4096). So the state after ``k`` outputs (which input ordinals sit in which slots, and
which input comes next) can be found by running the same buffer over plain integers 0, 1, 2, ...
instead of samples: ``resume_state``. That costs O(size + k) integer steps, about 0.5 s per million
positions, and no I/O; the reader then fetches only the inputs it names.

With an ``initial`` below ``size`` (WebDataset's ``shuffle(bufsize, initial=)``), the buffer starts
emitting once it holds ``initial`` items and grows to ``size`` as it goes, one output per two inputs,
so a stream's first output waits for ``initial`` inputs instead of ``size``. Whether a push emits
depends only on how many items are held and how many were emitted, so ``resume_state`` still
replays it on integers.
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

    An arriving item and the ``n`` held ones are equally likely to leave (draw ``u_p`` picks slot
    ``floor(u_p * (n + 1))``, where slot ``n`` is the new item itself). ``drain`` empties it at the
    end, one random slot per output. ``size=0`` passes items through unchanged.

    ``initial`` (default ``size``): it emits once it holds that many. Its room starts at ``initial``
    and grows by one with each output, up to ``size``: an item arriving while it holds less than its
    room is kept, else one of the ``n + 1`` leaves. So after the first ``initial`` inputs it takes
    two inputs per output, as WebDataset's buffer does, until it holds ``size`` (after
    ``2 * (size - initial)`` more inputs), then one per output. ``initial=size`` is the buffer
    without an initial fill, output for output.
    """

    def __init__(self, size: int, draws: Draws, *, position: int = 0, slots: list[Any] | None = None,
                 initial: int | None = None) -> None:
        self.size = size
        self.initial = size if initial is None else min(initial, size)
        self.draws = draws
        self.position = position  # outputs so far, = index of the next draw
        self.slots: list[Any] = [] if slots is None else slots

    def room(self) -> int:
        """How many items it keeps before an arriving one makes it emit: it grows with the outputs."""
        return min(self.size, self.initial + self.position)

    def push(self, item: Any, out: list[Any]) -> None:
        held = len(self.slots)
        if held < self.room():
            self.slots.append(item)
            return
        if held:
            i = int(self.draws[self.position] * (held + 1))
            if i < held:
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


def resume_state(size: int, draws: Draws, total: int, start: int, *, initial: int | None = None
                 ) -> tuple[list[int], int]:
    """Where a buffer over ``total`` inputs stands after ``start`` outputs.

    Returns (the input ordinals held, slot by slot; the ordinal of the next input to push): the state
    just before the push that makes output ``start + 1``. Everything else before that next input has
    already been emitted. The loop is ``ShuffleBuffer.push`` on integers, its full-buffer part
    unrolled per block of draws (tests check they agree).
    """
    if size == 0:
        return [], min(start, total)
    buf = ShuffleBuffer(size, draws, initial=initial)
    nxt = _fill(buf, total, start)
    slots, position = buf.slots, buf.position
    steady = position + min(start - position, total - nxt)  # outputs made by pushes into a full buffer
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


def _fill(buf: ShuffleBuffer, total: int, start: int) -> int:
    """Push inputs 0, 1, ... into the empty ``buf`` until it is full, or has made ``start`` outputs
    and would make the next one, or the inputs run out; the number pushed. At most
    ``2 * size - initial`` pushes, one at a time: the growth is short, the steady state is unrolled."""
    nxt, out = 0, []
    while nxt < total and len(buf.slots) < buf.size:
        if buf.position == start and len(buf.slots) >= buf.room():
            break
        buf.push(nxt, out)
        nxt += 1
    return nxt
