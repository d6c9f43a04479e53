"""Review of ``webdataset(shuffle_initial=)``: tries that held (no bug found), kept as tests.

Over integers, every small (size, initial, total): the buffer emits each input once, never holds more
than ``size``, and ``resume_state`` at every output position is the buffer's own state there. Through
the reader, over tiny shards of uneven sizes: every split, ``equal`` and world size, a resume at every
position (the fill, the growth, the drain) is the rest of the uninterrupted stream, also after an
epoch's first span on another world size; ``resampled`` resumes exactly too.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from headrace import readers
from headrace.readers._shuffle import Draws, ShuffleBuffer, resume_state

from sample_data import tar_bytes

SIZES = [1, 3, 2, 5, 1, 4, 2]
TOTAL = sum(SIZES)


@pytest.fixture(scope="module")
def tiny_shards(tmp_path_factory) -> list[str]:
    folder: Path = tmp_path_factory.mktemp("tiny-shards")
    paths, k = [], 0
    for s, n in enumerate(SIZES):
        members = []
        for _ in range(n):
            members.append((f"s{k:03d}.cls", str(k).encode()))
            k += 1
        path = folder / f"shard-{s}.tar"
        path.write_bytes(tar_bytes(members))
        paths.append(str(path))
    return paths


async def _read(reader, epoch=1, start=0, history=()):
    return [s.key async for chunk in reader.read(epoch, start=start, seed=5, history=history) for s in chunk]


@pytest.mark.parametrize(("size", "initial"), list(itertools.product([0, 1, 2, 3, 8], [1, 2, 3, 8, 20])))
def test_every_state_of_small_buffers_is_replayed(size, initial):
    for total in (0, 1, 2, 3, 7, 30):
        draws = Draws([3, size, initial, total])
        buf, out, states = ShuffleBuffer(size, draws, initial=initial), [], {}
        for i in range(total):
            before = len(out)
            slots = list(buf.slots)
            buf.push(i, out)
            assert len(buf.slots) <= size
            if len(out) > before:
                states.setdefault(before, (slots, i))
        while buf.slots:
            states.setdefault(len(out), (list(buf.slots), total))
            buf.drain(out, 1)
        assert sorted(out) == list(range(total))
        for start in range(total):
            assert resume_state(size, Draws([3, size, initial, total]), total, start, initial=initial) == states[start]


CASES = [(size, initial, split) for size, initial in [(0, 1), (1, 1), (3, 1), (7, 2), (50, 3)]
         for split in ("auto", "samples", "shards")]


@pytest.mark.parametrize(("size", "initial", "split"), CASES)
async def test_tiny_shards_resume_at_every_position_on_any_world(tiny_shards, size, initial, split):
    base = readers.webdataset(tiny_shards, counts=SIZES, shuffle=True, shuffle_buffer=size, shuffle_initial=initial,
                              split=split)
    everything = sorted(f"s{i:03d}" for i in range(TOTAL))
    for world, equal in [(1, None), (2, None), (3, "pad"), (2, "drop")]:
        parts = [base.shard(r, world, equal=equal) for r in range(world)]
        fulls = [await _read(p) for p in parts]
        if equal is None:
            assert sorted(k for f in fulls for k in f) == everything
        for part, full in zip(parts, fulls):
            for start in range(len(full) + 1):
                assert await _read(part, start=start) == full[start:], (world, equal, start)
        if equal is not None:
            continue
        for position in sorted({1, 2, min(map(len, fulls))}):
            for new_world in (1, 3):
                new_parts = [base.shard(r, new_world) for r in range(new_world)]
                rest = [await _read(q, history=[(world, position)]) for q in new_parts]
                read = [k for f in fulls for k in f[:position]]
                assert sorted(read + [k for f in rest for k in f]) == everything, (world, position, new_world)
                for q, f in zip(new_parts, rest):
                    for start in range(len(f) + 1):
                        assert await _read(q, start=start, history=[(world, position)]) == f[start:]


@pytest.mark.parametrize("counts", [SIZES, None])
@pytest.mark.parametrize(("size", "initial"), [(5, 1), (1, 1), (50, 3)])
async def test_resampled_resumes_at_every_position(tiny_shards, counts, size, initial):
    reader = readers.webdataset(tiny_shards, counts=counts, shuffle=True, shuffle_buffer=size, shuffle_initial=initial,
                                resampled=True)
    for world in (1, 2):
        part = reader.shard(world - 1, world)
        full = await _read(part, epoch=2)
        for start in range(len(full) + 1):
            assert await _read(part, epoch=2, start=start) == full[start:]
