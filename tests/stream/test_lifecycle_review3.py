"""Found in a third review of the Loader's lifecycle: each test fails without its fix.

On real JPEG folders (``image_folder``), the CPU executor.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import os
import signal
import threading
import warnings

import pytest
from open_files import open_fds

from headrace import ClosedError, ConfigError, Loader, ops, readers


def _loader(folder, *, pipe=None, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("batch_size", 8)
    kw.setdefault("num_threads", 2)
    kw.setdefault("seed", 5)
    pipe = pipe or [ops.Decode(), ops.Resize(16), ops.CenterCrop(16)]
    return Loader(readers.files(folder, shuffle=True), pipeline=ops.Pipeline(pipe), **kw)


class _Snapshot:
    """Threads and open files now; ``left()`` says what was added since (a sync test's ``leaks``)."""

    def __init__(self) -> None:
        self.threads = set(threading.enumerate())
        self.fds = open_fds()

    def left(self) -> tuple[list[str], set[str]]:
        threads = [t.name for t in threading.enumerate() if t not in self.threads and t.is_alive()]
        return threads, open_fds() - self.fds


def _held_until_interrupted(release: threading.Event):
    """A stage that holds every batch after the first until ``release`` is set: the consumer is
    then surely waiting for batch 1 in the sync facade when the interrupt comes (``prefetch=1``:
    batch 1 goes to the threads once batch 0 is done, so the first 8 calls are batch 0's)."""
    calls = itertools.count()

    def hold(fields):
        if next(calls) >= 8:
            release.wait(30)
        return fields
    return [ops.Map(hold), ops.Decode(), ops.Resize(16), ops.CenterCrop(16)]


def _interrupt_then_release(release: threading.Event) -> threading.Thread:
    def interrupt() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # delivered to the main thread, waiting for batch 1
        release.set()  # the batch's thread work may finish: the close waits for it

    timer = threading.Timer(0.05, interrupt)
    timer.start()
    return timer


@pytest.mark.parametrize("inside_with", [False, True])
def test_a_keyboard_interrupt_while_the_sync_facade_waits_stays_a_keyboard_interrupt(image_folder, inside_with):
    """Ctrl-C while ``for batch in loader.sync()`` waited for a batch surfaced as ``RuntimeError:
    aclose(): asynchronous generator is already running`` (the generator was closed while the
    interrupted step still ran on the loop), and that step was left pending ("Task was destroyed
    but it is pending!" when its loop stopped)."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    snapshot = _Snapshot()
    release = threading.Event()
    loader = _loader(image_folder, pipe=_held_until_interrupted(release), prefetch=1)
    sync = loader.sync()
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyboardInterrupt) as caught:
            if inside_with:
                with sync:
                    for batch in sync:
                        got.append(batch.index)
                        timer = _interrupt_then_release(release)
            else:
                for batch in sync:
                    got.append(batch.index)
                    timer = _interrupt_then_release(release)
        timer.join()
        assert got == [0]
        assert caught.value.__context__ is None  # nothing failed while the epoch closed
        if not inside_with:
            # The trainer caught it (a graceful stop): the loader goes on with the next epoch, whole.
            assert sum(len(b.sample_keys) for b in sync) == 75
            sync.close()
        gc.collect()
    assert snapshot.left() == ([], set())


async def _keys(loader) -> list[str]:
    return [key async for batch in loader for key in batch.sample_keys]


def test_a_loader_running_ahead_gives_whole_epochs_under_one_asyncio_run_per_epoch(image_folder):
    """With ``run_ahead``, the next epoch's run started on the first ``asyncio.run``'s loop, which
    cancelled it as it ended; the next ``asyncio.run`` took that run over and its epoch ended at
    once, silently: every epoch after the first was empty."""
    snapshot = _Snapshot()
    loader = _loader(image_folder, run_ahead=True)
    for _ in range(3):
        keys = asyncio.run(_keys(loader))
        assert len(keys) == 75 and len(set(keys)) == 75
    asyncio.run(loader.aclose())
    assert snapshot.left() == ([], set())


def _in_a_daemon_thread(fn, timeout: float = 60.0):
    """``fn()`` in a thread; a hang fails the test instead of hanging the run."""
    out: list = []

    def target() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "hung"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


@pytest.mark.parametrize("left", ["ahead", "break"])
def test_a_loader_left_on_an_event_loop_closed_without_cancelling_goes_on_in_a_new_one(image_folder, left):
    """An event loop closed with the loader's tasks still pending on it (``run_until_complete``,
    then ``close()``) left a run ahead, or an epoch left by a bare ``break``; the next ``async for``
    in another loop waited for those tasks, which no loop would ever run again: a hang."""
    def run() -> list[int]:
        loader = _loader(image_folder, run_ahead=left == "ahead")

        async def first() -> None:
            async for batch in loader:
                if left == "break" and batch.index == 2:
                    break

        loop = asyncio.new_event_loop()
        loop.run_until_complete(first())
        with warnings.catch_warnings():  # the pending tasks it drops are what this test is about
            warnings.simplefilter("ignore")
            loop.close()

        async def next_epochs() -> list[int]:
            counts = [len(await _keys(loader)) for _ in range(2)]
            await loader.aclose()
            return counts

        return asyncio.run(next_epochs())

    assert _in_a_daemon_thread(run) == [75, 75]


@pytest.mark.parametrize("where", ["waiting", "between batches"])
async def test_aclose_from_another_task_mid_epoch_is_a_closed_error_not_the_epochs_end(image_folder, leaks, where):
    """``aclose()`` from another task (a shutdown handler) while the training loop waited for a
    batch ended that loop's ``async for`` as if the epoch were over, after 0 to 13 of its 10
    batches, and moved the loader to the next epoch: a checkpoint saved then skipped the rest of
    the epoch on resume. The loop now gets ClosedError, and the state stays where it stopped."""
    release = threading.Event()
    loader = _loader(image_folder, pipe=_held_until_interrupted(release), prefetch=1)
    got: list[int] = []
    inside = asyncio.Event()
    go_on = asyncio.Event()

    async def train() -> None:
        async for batch in loader:
            got.append(batch.index)
            inside.set()
            if where == "between batches":
                await go_on.wait()

    consumer = asyncio.create_task(train())
    await inside.wait()
    if where == "waiting":
        await asyncio.sleep(0.05)  # the loop waits for batch 1, which the stage holds
    threading.Timer(0.05, release.set).start()  # the close waits for the batch in the threads
    await loader.aclose()
    go_on.set()
    with pytest.raises(ClosedError, match="closed"):
        await asyncio.wait_for(consumer, 30)
    assert got == [0]
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (0, 1)
    await leaks.check()


async def test_aclose_cancelled_midway_still_stops_the_run_ahead(image_folder, leaks):
    """``aclose()`` is documented to finish its cleanup when the task running it is cancelled (a
    shutdown with a timeout). Cancelled while it waited for the epoch's run, it skipped the next
    epoch's run started ahead: that run's tasks went on reading, and a second ``aclose()`` no
    longer knew them."""
    release = threading.Event()
    loader = _loader(image_folder, pipe=_held_until_interrupted(release), prefetch=1, run_ahead=True)
    epoch = aiter(loader)
    await anext(epoch)  # the reader has read the epoch: the next one's run has started ahead
    assert loader._epochs.ahead is not None
    closing = asyncio.create_task(loader.aclose())
    await asyncio.sleep(0)  # it has cancelled the epoch's run and waits for it to end
    closing.cancel()
    threading.Timer(0.05, release.set).start()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await loader.aclose()
    with pytest.raises(ClosedError):
        await anext(epoch)
    await epoch.aclose()
    await leaks.check()


async def _whole(loader) -> list[str]:
    """The next epoch's keys; a hang fails the test."""
    return await asyncio.wait_for(_keys(loader), 30)


async def test_a_state_loaded_after_a_break_at_the_next_epochs_start_does_not_hang(image_folder, leaks):
    """With ``run_ahead``, the next epoch's run waits to decode until this epoch's last batch went
    to decode. A trainer that left epoch 0 early, then loaded a checkpoint taken at epoch 1's
    start, got that run (the same epoch, the same start) waiting for an epoch 0 that was torn
    down: the next ``async for`` hung forever."""
    other = _loader(image_folder, prefetch=1)
    await _keys(other)
    at_epoch_1 = other.state_dict()
    epoch_1 = await _keys(other)
    await other.aclose()
    loader = _loader(image_folder, prefetch=1, run_ahead=True)
    async for _ in loader:
        break  # the reader read the epoch: epoch 1's run started ahead; few batches went to decode
    assert loader._epochs.ahead is not None
    loader.load_state_dict(at_epoch_1)
    assert await _whole(loader) == epoch_1
    await loader.aclose()
    await leaks.check()


async def test_a_consumer_cancelled_twice_leaves_no_run_ahead_waiting(image_folder, leaks):
    """Cancelled again while it stopped its epoch (a timeout, then its task group), the consumer
    skipped throwing the run ahead away; the next ``async for`` took that run over, which waited
    for the cancelled epoch to send its last batch to decode: a hang."""
    release = threading.Event()
    reference = _loader(image_folder, prefetch=1)
    expected = [await _keys(reference) for _ in range(2)]
    await reference.aclose()
    loader = _loader(image_folder, pipe=_held_until_interrupted(release), prefetch=1, run_ahead=True)
    got = asyncio.Event()

    async def train() -> None:
        async for _ in loader:
            got.set()

    consumer = asyncio.create_task(train())
    await got.wait()  # batch 0 out, the epoch read: epoch 1's run started ahead
    await asyncio.sleep(0.05)  # the loop waits for batch 1, which the stage holds
    assert loader._epochs.ahead is not None
    consumer.cancel()
    await asyncio.sleep(0)  # it is stopping its run, waiting for the run's tasks
    consumer.cancel()
    threading.Timer(0.05, release.set).start()  # the batch in the threads may end
    with pytest.raises(asyncio.CancelledError):
        await consumer
    await leaks.check(threads=False)  # nothing of the left epoch runs, ahead or not
    assert await _whole(loader) == expected[1]
    await loader.aclose()
    await leaks.check()


@pytest.mark.parametrize("wrong", ["no", 1, 0.0])
def test_sync_refuses_a_progress_that_is_not_a_bool_or_none(image_folder, wrong):
    loader = Loader(readers.files(image_folder), batch_size=8, device="cpu")
    # Before: accepted, and "no" showed a bar (Loader(progress=) has always refused it).
    with pytest.raises(ConfigError, match=r"sync: progress must be True, False or None, got "):
        loader.sync(progress=wrong)
    with pytest.raises(ConfigError, match="progress must be True or False"):
        Loader(readers.files(image_folder), batch_size=8, device="cpu", progress=wrong)


async def test_a_stage_cancelled_before_its_first_step_leaves_no_coroutine_unawaited():
    # Ctrl-C just as an epoch starts cancels the stage tasks before they run: the stage's
    # coroutine must not exist yet, or it is dropped unawaited ("coroutine '_Run._read' was never
    # awaited", seen in the demo's SIGINT test).
    import gc
    import warnings

    from headrace import _run

    started = []

    async def stage() -> None:
        started.append(True)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        task = asyncio.get_running_loop().create_task(_run._noted(stage, "read"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        del task
        gc.collect()
    assert not started
    assert not [w for w in caught if "never awaited" in str(w.message)]
    # Run to its end, it runs the stage from its function, and notes the stage on what it raises.
    await _run._noted(stage, "read")
    assert started == [True]

    async def failing() -> None:
        raise ValueError("bad")

    with pytest.raises(ValueError) as info:
        await _run._noted(failing, "batch")
    assert "in headrace stage 'batch'" in info.value.__notes__
