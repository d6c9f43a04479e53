"""Review of ``epoch_end`` in ``Loader.state_dict()``: a state taken at an epoch's last batch resumes
at the next epoch, also for readers without a length, however the trainer got to the state.

Found here (each failed before its fix):
- a ``break`` at the last batch of a reader without a length, then anything that lets the event
  loop run (an ``await`` while saving the checkpoint, the garbage collector closing the iterator)
  or the sync facade's ``break`` (which closes the iterator at once): the run was torn down and with
  it the end it had seen, so the state said ``epoch_end: False`` and a fresh loader given it
  yielded an empty epoch first;
- a state at an epoch's end from another world size, for a reader that cannot reshard (shards
  without counts): refused (ConfigError "cannot resume an epoch on another world size ... or start
  at the next epoch"), though the next epoch's start is where it stands.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random

import numpy as np
import pytest
from test_resume_review4 import EPOCHS, _first_difference, _maker, _reader, _uninterrupted, _view, data  # noqa: F401

from headrace import Loader, ops

UNSIZED = ["webdataset-uncounted", "iterable-unsized"]


def _through_json(state: dict) -> dict:
    return json.loads(json.dumps(state))


async def _resumed(make, state: dict) -> tuple[int, list]:
    """A fresh loader from ``make`` given ``state`` (through JSON): its epoch, and its next pass's batches."""
    loader = make()
    loader.load_state_dict(_through_json(state))
    try:
        return loader.epoch, [_view(b) async for b in loader]
    finally:
        await loader.aclose()


async def _state_after_break(make, cut: int, settle: str) -> dict:
    """The state after a ``break`` at batch ``cut``, taken once the event loop ran (``sleep``) or
    the garbage collector ran too (``gc``)."""
    loader, seen = make(), 0
    try:
        while seen < cut:
            async for _ in loader:
                seen += 1
                if seen == cut:
                    break
        if settle == "gc":
            gc.collect()
        await asyncio.sleep(0.05)
        return loader.state_dict()
    finally:
        await loader.aclose()


@pytest.mark.parametrize("settle", ["sleep", "gc"])
@pytest.mark.parametrize("run_ahead", [False, True])
@pytest.mark.parametrize("kind", UNSIZED)
async def test_a_break_at_the_last_batch_then_an_await_still_says_epoch_end(data, kind, run_ahead, settle):
    make = _maker(kind, data, on_error="skip", run_ahead=run_ahead)
    per_epoch = await _uninterrupted(make)
    state = await _state_after_break(make, len(per_epoch[0]), settle)
    assert state["epoch_end"] is True, {k: v for k, v in state.items() if k != "source"}
    epoch, batches = await _resumed(make, state)
    assert epoch == 1
    assert batches == per_epoch[1]


@pytest.mark.parametrize("kind", [*UNSIZED, "files", "webdataset"])
async def test_a_sync_break_at_the_last_batch_says_epoch_end(data, kind):
    make = _maker(kind, data, on_error="replace")
    per_epoch = await _uninterrupted(make)
    last = len(per_epoch[0])
    loader = make()

    def run() -> dict:
        for n, _ in enumerate(loader.sync(), 1):
            if n == last:
                break
        return loader.state_dict()

    try:
        state = await asyncio.to_thread(run)
    finally:
        await loader.aclose()
    assert state["epoch_end"] is True and state["epoch"] == 0
    epoch, batches = await _resumed(make, state)
    assert epoch == 1
    assert batches == per_epoch[1]


async def test_a_break_before_the_last_batch_is_not_epoch_end_after_teardown(data):
    """The end kept past the teardown counts only at the end: one batch short, the state is mid-epoch."""
    make = _maker("iterable-unsized", data, on_error="skip")
    per_epoch = await _uninterrupted(make)
    state = await _state_after_break(make, len(per_epoch[0]) - 1, "gc")
    assert state["epoch_end"] is False and state["epoch"] == 0
    _, batches = await _resumed(make, state)
    assert batches == per_epoch[0][-1:]


def _webdataset_loader(d, rank: int, world: int) -> Loader:
    return Loader(_reader("webdataset-uncounted", d), batch_size=2, device="cpu", num_threads=2, seed=11,
                  rank=rank, world=world, equal=None, on_error="skip", max_errors=0.5,
                  pipeline=ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(12), ops.Flip()]))


@pytest.mark.parametrize(("saved", "loaded"), [(2, 1), (1, 3)])
async def test_a_state_at_the_epochs_end_loads_on_another_world_size_without_counts(data, saved, loaded):
    """Any reader can change world size at an epoch boundary, and epoch_end says the state is at one."""
    states = []
    for rank in range(saved):
        loader = _webdataset_loader(data, rank, saved)
        async for _ in loader:
            state = loader.state_dict()
        states.append(state)
        await loader.aclose()
    assert all(s["epoch_end"] is True for s in states)
    for rank in range(loaded):
        want_loader = _webdataset_loader(data, rank, loaded)
        [_ async for _ in want_loader]
        want = [_view(b) async for b in want_loader]
        await want_loader.aclose()
        loader = _webdataset_loader(data, rank, loaded)
        loader.load_state_dict(_through_json(states[0]))
        try:
            assert loader.epoch == 1
            assert [_view(b) async for b in loader] == want
        finally:
            await loader.aclose()


async def test_a_state_at_the_epochs_end_still_refuses_another_reader(data):
    from headrace import ConfigError

    loader = _webdataset_loader(data, 0, 2)
    async for _ in loader:
        state = loader.state_dict()
    await loader.aclose()
    assert state["epoch_end"] is True
    other = Loader(_reader("iterable-unsized", data), batch_size=2, device="cpu", seed=11)
    with pytest.raises(ConfigError, match="reader"):
        other.load_state_dict(state)
    wrong_batch = _webdataset_loader(data, 0, 1)
    with pytest.raises(ConfigError, match="batch_size"):
        wrong_batch.load_state_dict({**state, "batch_size": 3})


async def test_held_after_the_loop_and_without_the_key(data):
    """Held before: a state taken after the loop ended is the next epoch's start; an older state
    without the key loads (by len() where there is one)."""
    make = _maker("iterable-unsized", data, on_error="skip", run_ahead=True)
    per_epoch = await _uninterrupted(make)
    loader = make()
    [_ async for _ in loader]
    state = loader.state_dict()
    await loader.aclose()
    assert (state["epoch"], state["position"], state["batches"], state["epoch_end"]) == (1, 0, 0, False)
    fresh = make()
    fresh.load_state_dict(_through_json({k: v for k, v in state.items() if k != "epoch_end"}))
    assert [_view(b) async for b in fresh] == per_epoch[1]
    await fresh.aclose()


async def _every_batch_through_fresh_loaders(make, rng: random.Random) -> list[tuple]:
    """The run carried by a new loader after every batch: each stops with a ``break`` (its state
    taken inside the loop, right after the break, or after the loop has run), and the next loads it."""
    state, seen = None, []
    while True:
        loader = make()
        if state is not None:
            loader.load_state_dict(_through_json(state))
        if loader.epoch >= EPOCHS:
            await loader.aclose()
            return seen
        try:
            how = rng.choice(["inside", "after_break", "after_await"])
            got, yielded = None, False
            async for batch in loader:
                seen.append(_view(batch))
                yielded = True
                if how == "inside":
                    got = loader.state_dict()
                break
            assert yielded, f"an empty epoch {loader.epoch} after the state {state} ({how})"
            if how == "after_await":
                await asyncio.sleep(0.02)
            state = got if got is not None else loader.state_dict()
        finally:
            await loader.aclose()


@pytest.mark.parametrize("run_ahead", [False, True])
@pytest.mark.parametrize("kind", ["webdataset-uncounted", "iterable-unsized", "webdataset", "lmdb"])
async def test_a_save_and_load_at_every_batch_is_the_uninterrupted_run(data, kind, run_ahead):
    make = _maker(kind, data, on_error="skip", run_ahead=run_ahead)
    whole = [b for epoch in await _uninterrupted(make) for b in epoch]
    got = await asyncio.wait_for(_every_batch_through_fresh_loaders(make, random.Random(f"{kind}/{run_ahead}")), 60)
    assert got == whole, _first_difference(got, whole)


@pytest.mark.parametrize("last_batch", ["drop", "fill"])
@pytest.mark.parametrize("kind", UNSIZED)
async def test_held_last_batch_drop_and_fill_without_a_length(data, kind, last_batch):
    """Held: the batcher's count leaves out what ``drop`` drops and counts ``fill``'s last batch, so a
    fresh loader after every batch (states taken after an await too) is the uninterrupted run."""
    make = _maker(kind, data, on_error="skip", last_batch=last_batch)
    whole = [b for epoch in await _uninterrupted(make) for b in epoch]
    got = await asyncio.wait_for(_every_batch_through_fresh_loaders(make, random.Random(f"{kind}/{last_batch}")), 60)
    assert got == whole, _first_difference(got, whole)


async def test_held_state_dict_from_another_thread_at_the_last_batch(data):
    """Held: the sync facade's consumer thread asks for the state while the loop thread runs."""
    make = _maker("iterable-unsized", data, on_error="skip", run_ahead=True)
    per_epoch = await _uninterrupted(make)
    loader = make()

    def run() -> list[dict]:
        states = []
        with loader.sync() as epochs:
            for _ in range(EPOCHS):
                for _batch in epochs:
                    states.append(epochs.state_dict())
        return states

    states = await asyncio.to_thread(run)
    ends = [n for n, s in enumerate(states) if s["epoch_end"]]
    assert ends == list(np.cumsum([len(e) for e in per_epoch]) - 1)
