"""The sync facade takes each batch one ahead of the consumer: the same batches, the state of the
batch the consumer holds, errors after the batches before them, nothing left running."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest
import torch

from headrace import DecodeError, Loader, ops, readers


def _loader(folder, **kw):
    kw.setdefault("device", "cpu")
    kw.setdefault("batch_size", 8)
    kw.setdefault("num_threads", 2)
    kw.setdefault("seed", 5)
    pipe = ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(32), ops.Flip(), ops.Normalize()])
    return Loader(readers.files(folder, shuffle=True), pipeline=pipe, **kw)


async def _in_a_thread(fn):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)


def _same(a, b):
    assert a.sample_keys == b.sample_keys and (a.epoch, a.index) == (b.epoch, b.index)
    assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"])


def _wait_for(condition, timeout=30.0):
    """Poll until ``condition()``: the loop thread works on its own schedule (no timing asserted)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the loop thread never took the next batch"
        time.sleep(0.005)


@pytest.mark.parametrize("held", [0, 2])
async def test_state_is_the_held_batch_while_the_next_is_taken_ahead(image_folder, held, leaks):
    async_loader = _loader(image_folder)
    async_states, async_batches = [], []
    async for batch in async_loader:
        async_batches.append(batch)
        async_states.append(async_loader.state_dict())
    await async_loader.aclose()

    def consume_then_stop():
        with _loader(image_folder).sync() as epochs:
            for batch in epochs:
                if batch.index < held:
                    continue
                # The next batch is taken from the epoch meanwhile; the state stays the held one's.
                _wait_for(lambda: epochs.stats().batches == held + 2)
                return batch, epochs.state_dict(), epochs.loader.state_dict()

    batch, facade_state, loader_state = await _in_a_thread(consume_then_stop)
    _same(async_batches[held], batch)
    assert facade_state == loader_state == async_states[held]

    resumed = _loader(image_folder)
    resumed.load_state_dict(facade_state)
    rest = [b async for b in resumed]
    await resumed.aclose()
    for want, got in zip(async_batches[held + 1:], rest, strict=True):
        _same(want, got)
    await leaks.check()


async def test_the_state_after_the_last_batch_then_after_the_epoch(image_folder, leaks):
    def one_epoch():
        with _loader(image_folder).sync() as epochs:
            states = []
            batches = 0
            for _ in epochs:
                batches += 1
                states.append(epochs.state_dict())
            return batches, states, epochs.state_dict()

    batches, states, after = await _in_a_thread(one_epoch)
    assert [s["batches"] for s in states] == list(range(1, batches + 1))
    assert (states[-1]["epoch"], after["epoch"], after["batches"], after["position"]) == (0, 1, 0, 0)
    await leaks.check()


async def test_an_error_comes_after_the_batches_before_it(tmp_path, image_folder, leaks):
    folder = tmp_path / "data"
    (folder / "a").mkdir(parents=True)
    for i, path in enumerate(sorted(image_folder.rglob("*.jpg"))[:20]):
        (folder / "a" / f"{i:03d}.jpg").write_bytes(path.read_bytes())
    (folder / "a" / "019.jpg").write_bytes(b"\xff\xd8 not a jpeg")  # the last sample, in the unshuffled order

    def consume():
        loader = Loader(readers.files(folder, shuffle=False), batch_size=8, device="cpu",
                        num_threads=2, pipeline=ops.Pipeline([ops.Decode(), ops.Resize((16, 16))]))
        seen = []
        with loader.sync() as epochs:
            with pytest.raises(DecodeError) as caught:
                for batch in epochs:
                    seen.append(batch.size)
            return seen, caught.value, epochs.state_dict()

    seen, error, state = await _in_a_thread(consume)
    assert seen == [8, 8]
    assert "019.jpg" in str(error.source)
    assert state["batches"] == 2  # where the error left the stream: after the two good batches
    await leaks.check()
