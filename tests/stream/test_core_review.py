"""Found in a review of the loader's core: each test fails without its fix.

On real JPEG folders (``image_folder``), the CPU executor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading

import pytest

from headrace import ClosedError, Loader, ops, readers


def _loader(folder, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("batch_size", 8)
    kw.setdefault("num_threads", 2)
    kw.setdefault("seed", 5)
    pipe = ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(16), ops.Flip(), ops.Normalize()])
    return Loader(readers.files(folder, shuffle=True), pipeline=pipe, **kw)


async def _in_a_thread(fn, timeout: float = 60.0):
    """``fn`` (plain ``for`` loops over ``sync()``) in a thread of its own; a hang fails the test."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    finished = False
    try:
        result = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(pool, fn), timeout)
        finished = True
        return result
    finally:
        pool.shutdown(wait=finished)  # a hung thread is left behind rather than hanging the test run


def _drop_in_a_cycle_and_collect_on_the_loop_thread(sync) -> None:
    """Start an epoch, keep its iterator only in a reference cycle (as a trainer's objects that
    point at each other do), then let the garbage collector find it on the sync loop's thread."""
    epoch = iter(sync)
    next(epoch)
    loop = epoch.gi_frame.f_locals["loop"]  # the loop this epoch runs on
    cycle = [epoch]
    cycle.append(cycle)
    del epoch, cycle
    collected = threading.Event()

    def collect() -> None:
        gc.collect()
        collected.set()

    loop.call_soon_threadsafe(collect)
    assert collected.wait(30), "the garbage collector's close blocked the loop thread"


@pytest.mark.parametrize("inside_with", [False, True])
async def test_an_epoch_collected_in_a_cycle_on_the_loop_thread_does_not_hang(image_folder, leaks, inside_with):
    def run() -> int:
        sync = _loader(image_folder).sync()
        if inside_with:
            sync.__enter__()
        _drop_in_a_cycle_and_collect_on_the_loop_thread(sync)
        batches = list(sync)  # the next epoch, whole, once the left one's close has finished
        sync.close()
        return len(batches)

    assert await _in_a_thread(run) == 10
    await leaks.check()


async def _keys(loader) -> list[list[str]]:
    return [b.sample_keys async for b in loader]


@pytest.mark.parametrize("left", ["dropped", "closed"])
async def test_an_iterator_never_asked_for_a_batch_does_not_skip_its_epoch(image_folder, leaks, left):
    reference = _loader(image_folder)
    epoch0 = await _keys(reference)
    await reference.aclose()
    loader = _loader(image_folder)
    unused = aiter(loader)  # made, never advanced: no batch of epoch 0 was handed out
    if left == "closed":
        await unused.aclose()
    assert loader.state_dict()["epoch"] == 0
    assert await _keys(loader) == epoch0  # epoch 0, whole, as a loader resumed from that state gives
    assert loader.epoch == 1
    if left == "dropped":  # the later loop replaced it, as it replaces one left by a bare break
        with pytest.raises(ClosedError, match="replaced"):
            await anext(unused)
    await loader.aclose()
    await leaks.check()
