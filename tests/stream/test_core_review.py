"""Found in a review of the loader's core: each test fails without its fix.

On real JPEG folders (``image_folder``), the CPU executor.
"""

from __future__ import annotations

import asyncio
import contextlib
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
    loop = epoch._batches.gi_frame.f_locals["loop"]  # the loop this epoch runs on (inside its generator)
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


@pytest.mark.parametrize("inside_with", [False, True])
async def test_a_nested_for_over_one_sync_loader_is_a_closed_error_not_a_silent_end(image_folder, leaks, inside_with):
    """The inner ``for`` starts a new epoch and closes the outer one's (a trainer may hold one it
    left); the outer loop asking for its next batch then learns why, as an async iterator replaced
    by a later ``async for`` does, instead of ending after one batch as if the epoch were over."""
    def nested():
        sync = _loader(image_folder).sync()
        owner = sync if inside_with else contextlib.nullcontext()
        outer_batches, inner_batches = 0, 0
        with owner:
            try:
                with pytest.raises(ClosedError, match="replaced by a later for loop"):
                    for _ in sync:
                        outer_batches += 1
                        for _ in sync:
                            inner_batches += 1
            finally:
                if not inside_with:
                    sync.close()
        return outer_batches, inner_batches

    outer_batches, inner_batches = await _in_a_thread(nested)
    assert outer_batches == 1 and inner_batches == len(_loader(image_folder))
    await leaks.check()


async def test_a_finished_epoch_replaced_by_the_next_still_says_it_is_finished(image_folder, leaks):
    """Only an epoch cut short by a later ``iter()`` raises: one that ran to its end keeps ending."""
    def two_epochs():
        with _loader(image_folder).sync() as sync:
            first = iter(sync)
            n = sum(1 for _ in first)
            second = iter(sync)
            more = list(first)  # exhausted before the second began: still just the end
            m = sum(1 for _ in second)
        return n, more, m

    n, more, m = await _in_a_thread(two_epochs)
    assert n == m == len(_loader(image_folder)) and more == []
    await leaks.check()
