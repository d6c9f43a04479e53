"""Random exits from a loader's epochs, and the check that nothing grows: shared by the CPU test
(tests/stream/test_exits.py) and the GPU one (tests/gpu/test_gpu_exits.py).

Each round leaves an epoch in one of the ways training code does (a bare ``break``, an exception
in the loop's body, cancelling the consumer, a timeout, ``aclose()`` from another task) at a
random point, then the next round starts at once on the same loader (after ``aclose()``, on a new
one). Every few rounds a whole epoch runs and must yield every sample exactly once. After each
round the open files, threads and (once settled) asyncio tasks must be where they were after the
first epoch (checked every fifth round, once the finalisers of left loops ran; the rounds between
start at once), and ``memory()`` (CUDA bytes allocated, on the GPU) within ``memory_slack`` of it.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections import Counter
from collections.abc import Callable

from open_files import open_fds

import headrace

EXITS = ("break", "raise", "cancel", "timeout", "aclose")


class _Leave(Exception):
    """Raised in the loop's body: the 'raise' exit."""


async def random_exits(
    make_loader: Callable[[], headrace.Loader],
    *,
    rounds: int,
    expected_keys: set[str],
    seed: int = 0,
    whole_every: int = 10,
    max_delay: float = 0.05,
    memory: Callable[[], int] | None = None,
    memory_slack: int = 0,
    weights: dict[str, float] | None = None,
    kept_open: Callable[[str], bool] | None = None,
    kept_open_max: int = 0,
) -> Counter[str]:
    """Run ``rounds`` random exits; return how many of each kind ran (and "whole" epochs).
    ``weights`` makes some exits likelier than others (default: all alike). ``kept_open`` names
    the files the loader may hold open between epochs by design (the GPU video decoders' cache,
    which moves from file to file): they are left out of the comparison, and at most
    ``kept_open_max`` of them may be open at a check."""
    rng = random.Random(seed)
    kinds, odds = list(EXITS), [1.0 if weights is None else weights.get(k, 1.0) for k in EXITS]
    done: Counter[str] = Counter()
    loader = make_loader()
    assert await _whole_epoch(loader) == expected_keys
    done["whole"] += 1
    def files() -> set[str]:
        opened = open_fds()
        kept = {f for f in opened if kept_open is not None and kept_open(f)}
        assert len(kept) <= kept_open_max, f"more files held open than the loader may keep: {sorted(kept)}"
        return opened - kept

    threads, fds = _threads(), files()
    tasks = await _settled_tasks()
    baseline_memory = memory() if memory is not None else 0
    for round_ in range(rounds):
        if round_ % whole_every == whole_every - 1:
            kind = "whole"
            keys = await _whole_epoch(loader)
            assert keys == expected_keys, f"round {round_}: epoch after exits lost or repeated samples"
        else:
            kind = rng.choices(kinds, odds)[0]
            loader = await _leave(loader, kind, rng.randrange(0, 6), rng.uniform(0, max_delay), make_loader)
            if kind == "aclose":  # a new loader: its first epoch makes its threads, the new baseline
                assert await _whole_epoch(loader) == expected_keys
                threads = _threads()
        done[kind] += 1
        if round_ % 5 != 4:
            continue  # the next round starts at once, with the finaliser of a left loop still pending
        left = await _settled_tasks() - tasks
        if loader._epochs.ahead is not None:  # the next epoch's run, started ahead (run_ahead): the loader's own
            left = {t for t in left if not t.get_name().startswith("loader:")}
        assert not left, f"round {round_} ({kind}): tasks left running: {sorted(t.get_name() for t in left)}"
        if loader._epochs.ahead is not None:  # the run started ahead reads files now and then: let a read end
            for _ in range(40):
                if files() == fds:
                    break
                await asyncio.sleep(0.05)
        assert files() == fds, f"round {round_}: files left open"
        grown = _threads() - threads
        assert not grown, f"round {round_} ({kind}): threads grew: {sorted(t.name for t in grown)}"
        if memory is not None:
            extra = memory() - baseline_memory
            assert extra <= memory_slack, f"round {round_}: {extra} CUDA bytes more than after the first epoch"
    await loader.aclose()
    assert await _settled_tasks() <= tasks
    return done


async def _leave(loader, kind: str, after: int, delay: float, make_loader):
    """Leave one epoch of ``loader`` by ``kind``; return the loader for the next round."""
    if kind == "break":
        async for batch in loader:
            if batch.index >= after:
                break  # no aclose of the iterator: the next ``async for`` must start at once anyway
    elif kind == "raise":
        try:
            async for batch in loader:
                if batch.index >= after:
                    raise _Leave
        except _Leave:
            pass
    elif kind in ("cancel", "timeout"):
        async def consume():
            async for _ in loader:
                pass

        if kind == "cancel":
            task = asyncio.create_task(consume())
            await asyncio.sleep(delay)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        else:
            try:
                async with asyncio.timeout(delay):
                    await consume()
            except TimeoutError:
                pass
    else:  # aclose from another task while this one iterates: final, so the next round has a new loader
        async def consume():
            async for _ in loader:
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(delay)
        await loader.aclose()
        try:
            await task
        except headrace.ClosedError:
            pass
        try:
            loader.__aiter__()
            raise AssertionError("a closed loader iterated again")
        except headrace.ClosedError:
            pass
        loader = make_loader()
    return loader


async def _whole_epoch(loader) -> set[str]:
    keys: list[str] = []
    async for batch in loader:
        keys.extend(batch.sample_keys)
    assert len(keys) == len(set(keys)), "a sample came twice in one epoch"
    return set(keys)


def _threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


async def _settled_tasks(timeout: float = 2.0) -> set[asyncio.Task]:
    """The other tasks still running once the finalisers of abandoned loops have run."""
    current = asyncio.current_task()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        await asyncio.sleep(0)
        tasks = {t for t in asyncio.all_tasks() if t is not current and not t.done()}
        if not tasks or loop.time() > deadline:
            return tasks
        await asyncio.sleep(0.005)
