"""Running ahead into the next epoch (``Loader(run_ahead=True)``): the same batches, the same
state, and nothing left running when the work ahead is thrown away.

On the CPU executor, where it is off by default; tests/gpu runs the GPU path, where it is on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest
import torch

from headrace import ConfigError, Loader, ops, readers


def _loader(folder, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("batch_size", 8)
    kw.setdefault("num_threads", 2)
    kw.setdefault("seed", 3)
    pipe = ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(32), ops.Flip(), ops.Normalize()])
    return Loader(readers.files(folder, shuffle=True), pipeline=pipe, **kw)


async def _collect(loader):
    return [b async for b in loader]


def _same(a, b):
    assert a.sample_keys == b.sample_keys and (a.epoch, a.index) == (b.epoch, b.index)
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])


async def test_running_ahead_changes_no_batch(image_folder, leaks):
    ahead, plain = _loader(image_folder, run_ahead=True), _loader(image_folder, run_ahead=False)
    assert _loader(image_folder).run_ahead is False  # the CPU default
    for epoch in range(3):
        got = await _collect(ahead)
        # The last batches of this epoch were still in flight when the next epoch's run started.
        assert ahead._epochs.ahead is not None and ahead._epochs.ahead.epoch == epoch + 1
        for x, y in zip(got, await _collect(plain), strict=True):
            _same(x, y)
        assert ahead.state_dict() == plain.state_dict()  # the work ahead is not counted
    await ahead.aclose()
    await plain.aclose()
    await leaks.check()


async def test_a_loaded_state_discards_the_work_ahead(image_folder, leaks):
    reference = _loader(image_folder, run_ahead=False)
    await _collect(reference)
    expected = await _collect(reference)  # epoch 1
    saved = _loader(image_folder, run_ahead=False)
    await _collect(saved)
    async for batch in saved:
        if batch.index == 4:
            break
    state = saved.state_dict()
    await saved.aclose()
    await reference.aclose()

    loader = _loader(image_folder, run_ahead=True)
    await _collect(loader)  # epoch 0; epoch 1 runs ahead from its start
    assert loader._epochs.ahead is not None
    loader.load_state_dict(state)  # epoch 1 from batch 5: not where the run ahead started
    rest = await _collect(loader)
    for x, y in zip(expected[5:], rest, strict=True):
        _same(x, y)
    await loader.aclose()
    await leaks.check()


async def test_aclose_and_break_throw_the_work_ahead_away(image_folder, leaks):
    loader = _loader(image_folder, run_ahead=True)
    await _collect(loader)
    await loader.aclose()  # with an epoch running ahead and nobody iterating
    await leaks.check()

    loader = _loader(image_folder, run_ahead=True, prefetch=4)
    await _collect(loader)
    async for _ in loader:  # takes the run ahead over, then leaves it
        break
    await leaks.check(settle=5.0, threads=False)  # tasks gone; the worker threads stay for the next epoch
    await loader.aclose()
    await leaks.check()


def _sync_loop_threads() -> list:
    import threading

    return [t for t in threading.enumerate() if t.name == "headrace-sync-loop"]


async def _plain_epochs(folder, n: int) -> list:
    plain = _loader(folder, run_ahead=False)
    epochs = [await _collect(plain) for _ in range(n)]
    await plain.aclose()
    return epochs


async def _in_a_thread(fn):
    """``fn`` (plain ``for`` loops over ``sync()``) in a thread of its own, off this test's loop."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)


def _same_epochs(want: list, have: list) -> None:
    for x_epoch, y_epoch in zip(want, have, strict=True):
        for x, y in zip(x_epoch, y_epoch, strict=True):
            _same(x, y)


async def test_the_sync_facade_runs_ahead_inside_with(image_folder, leaks):
    expected = await _plain_epochs(image_folder, 3)

    def three_epochs():
        with _loader(image_folder, run_ahead=True).sync() as loader:
            epochs = []
            for epoch in range(3):
                epochs.append(list(loader))
                # The block's one loop thread goes on: the next epoch's run has started on it.
                assert loader.loader._epochs.ahead is not None and loader.loader._epochs.ahead.epoch == epoch + 1
                assert len(_sync_loop_threads()) == 1
            return epochs

    _same_epochs(expected, await _in_a_thread(three_epochs))
    await leaks.check()  # the block's end closed the loader, the work ahead and the loop thread


async def test_a_break_inside_with_throws_the_work_ahead_away(image_folder, leaks):
    expected = await _plain_epochs(image_folder, 3)

    def epochs_with_a_break():
        with _loader(image_folder, run_ahead=True).sync() as loader:
            first = list(loader)
            for batch in loader:  # epoch 1, taken over from the run ahead, then left
                if batch.index == 2:
                    break
            assert loader.loader._epochs.ahead is None and loader.loader._epochs.active is None
            return [first, list(loader)]  # epoch 2, in full

    _same_epochs([expected[0], expected[2]], await _in_a_thread(epochs_with_a_break))
    await leaks.check()


async def test_a_bare_sync_loop_does_not_run_ahead(image_folder, leaks):
    expected = await _plain_epochs(image_folder, 2)

    def two_epochs():
        loader = _loader(image_folder, run_ahead=True).sync()  # no ``with``: nothing would end a thread kept
        epochs = []
        for _ in range(2):
            epochs.append(list(loader))
            assert loader.loader._epochs.ahead is None and _sync_loop_threads() == []  # each epoch's loop ended
        loader.close()
        return epochs

    _same_epochs(expected, await _in_a_thread(two_epochs))
    await leaks.check()


def test_run_ahead_must_be_a_bool(image_folder):
    with pytest.raises(ConfigError, match="run_ahead"):
        _loader(image_folder, run_ahead="yes")


async def test_the_next_epoch_reads_ahead_but_decodes_after_the_last_batch_went_to_decode(image_folder, leaks):
    # 8 batches an epoch and 2 in flight: the reader is done long before the last batch goes to
    # decode. From then on the next epoch's run reads into its channels, and sends no batch to
    # the executor while this epoch still has batches to send.
    loader = _loader(image_folder, run_ahead=True, prefetch=2)
    plain = _loader(image_folder, run_ahead=False)
    seen_reading = False
    got = []
    async for batch in loader:
        got.append(batch)
        run, ahead = loader._epochs.active, loader._epochs.ahead
        if ahead is not None and not run.dispatched_all.is_set():
            for _ in range(100):  # the run ahead's reader gets a turn of the loop
                if ahead._read_items:
                    break
                await asyncio.sleep(0.01)
            seen_reading = seen_reading or ahead._read_items > 0
            assert ahead._decode_items == 0 and ahead._decoding == 0
    assert seen_reading  # read ahead while this epoch still had batches to send
    for x, y in zip(got, await _collect(plain), strict=True):
        _same(x, y)
    for x, y in zip(await _collect(loader), await _collect(plain), strict=True):  # epoch 1: the run ahead
        _same(x, y)
    await loader.aclose()
    await plain.aclose()
    await leaks.check()
