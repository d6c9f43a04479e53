"""The Preprocessor service: dynamic batching, the delay bound, isolation, overload, shutdown.

Timing is never asserted as an upper bound; batching is checked through ``stats().batch_sizes``,
and the executor is held on a gate where a test needs requests to stay in flight.
"""

from __future__ import annotations

import asyncio
import functools
import gc

import numpy as np
import pytest
import torch
from headrace import (
    ClosedError,
    ConfigError,
    DecodeError,
    Loader,
    OverloadedError,
    Preprocessor,
    TransformError,
    ops,
    readers,
)
from service_refs import Gate, hold_batches, jpeg
from service_refs import jpegs as make_jpegs

PIPE = ops.validation(32, resize=40, label=None)  # small output: the tests are about the service


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    return make_jpegs(12)


def _service(**kw) -> Preprocessor:
    kw.setdefault("device", "cpu")
    kw.setdefault("num_threads", 2)
    return Preprocessor(kw.pop("pipeline", PIPE), **kw)


async def _gated(pre: Preprocessor) -> Gate:
    await pre.__aenter__()
    return hold_batches(pre)


async def _until(predicate, what: str, limit: float = 30.0) -> None:
    """Yield to the loop until ``predicate()``; a generous limit only turns a hang into a failure."""
    async with asyncio.timeout(limit):
        while not predicate():
            await asyncio.sleep(0.001)


async def _reference(images: list[bytes]) -> list[torch.Tensor]:
    async with _service(max_batch=1, max_delay=0) as one:
        return [await one(img) for img in images]


async def test_concurrent_callers_get_their_own_rows_bit_exact(jpegs, leaks):
    images = [jpegs[i % len(jpegs)] for i in range(40)]
    expected = await _reference(images)
    async with _service(max_batch=8, max_delay=0.01) as pre:
        got = await asyncio.gather(*(pre(img) for img in images))
        stats = pre.stats()
    for a, b in zip(got, expected, strict=True):
        assert a.shape == (3, 32, 32) and a.dtype == torch.float32
        assert torch.equal(a, b)
    assert stats.completed == 40 and stats.failed == 0 and stats.in_flight == 0
    assert max(stats.batch_sizes) <= 8 and sum(n * c for n, c in stats.batch_sizes.items()) == 40
    assert stats.batches < 40  # they were batched
    await leaks.check()


async def test_same_ops_as_the_loader(image_folder):
    loader = Loader(readers.files(image_folder), batch_size=16, pipeline=PIPE, device="cpu", num_threads=2)
    expected = {key: row for batch in [b async for b in loader] for key, row in zip(batch.sample_keys, batch["image"])}
    paths = sorted(image_folder.glob("c*/*.jpg"))
    async with _service(max_batch=16) as pre:
        rows = await asyncio.gather(*(pre(p.read_bytes()) for p in paths))
    for path, row in zip(paths, rows):
        assert torch.equal(row, expected[f"{path.parent.name}/{path.stem}"])


async def test_a_list_is_one_stacked_tensor(jpegs):
    expected = await _reference(jpegs[:5])
    async with _service(max_batch=4) as pre:
        got = await pre(jpegs[:5])  # longer than max_batch: split, then put back in order
        with pytest.raises(ConfigError):
            await pre([])
        with pytest.raises(ConfigError):
            await pre("not bytes")  # type: ignore[arg-type]
    assert got.shape == (5, 3, 32, 32)
    assert all(torch.equal(got[i], expected[i]) for i in range(5))


async def test_default_pipeline_is_validation_224(jpegs):
    big = jpeg(np.random.default_rng(1), 375, 500)
    async with Preprocessor(device="cpu", num_threads=2) as pre:
        out = await pre(big)
    assert out.shape == (3, 224, 224) and out.dtype == torch.float32


async def test_a_single_request_goes_after_max_delay_not_max_batch(jpegs):
    async with _service(max_batch=64, max_delay=0.05) as pre:
        loop = asyncio.get_running_loop()
        start = loop.time()
        await asyncio.wait_for(pre(jpegs[0]), 60)
        waited = loop.time() - start
        assert pre.stats().batch_sizes == {1: 1}
    assert waited >= 0.05 - 0.02  # it did wait for company (loose: timers may fire a little early)
    async with _service(max_batch=64, max_delay=0) as pre:  # no delay: straight through
        await asyncio.wait_for(pre(jpegs[0]), 60)
        assert pre.stats().batch_sizes == {1: 1}


async def test_a_full_batch_goes_at_once_under_a_long_delay(jpegs):
    async with _service(max_batch=4, max_delay=3600) as pre:
        first = [asyncio.create_task(pre(img)) for img in jpegs[:3]]
        done, _ = await asyncio.wait(first, timeout=0.2)
        assert not done  # three of four: still waiting for company
        fourth = asyncio.create_task(pre(jpegs[3]))
        await asyncio.wait_for(asyncio.gather(*first, fourth), 60)
        assert pre.stats().batch_sizes == {4: 1}


@pytest.mark.parametrize("when_full", ["wait", "reject"])
async def test_a_batch_holding_every_place_of_max_pending_goes_at_once(jpegs, when_full, leaks):
    # max_pending below max_batch: once every place is queued, no other caller can join the batch;
    # it used to wait out max_delay anyway, so under a long one every caller hung.
    expected = await _reference(jpegs[:4])
    async with _service(max_batch=8, max_delay=3600, max_pending=2, when_full=when_full) as pre:
        got = await asyncio.wait_for(asyncio.gather(*(pre(img) for img in jpegs[:2])), 30)
        got += await asyncio.wait_for(asyncio.gather(*(pre(img) for img in jpegs[2:4])), 30)
        stats = pre.stats()
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert stats.batch_sizes == {2: 2} and stats.rejected == 0
    await leaks.check()


async def test_a_list_longer_than_max_pending_goes_in_batches_of_max_pending(jpegs):
    expected = await _reference(jpegs[:4])
    async with _service(max_batch=8, max_delay=3600, max_pending=2) as pre:
        got = await asyncio.wait_for(pre(jpegs[:4]), 30)  # its places, two at a time: neither pair waits
        assert pre.stats().batch_sizes == {2: 2}
    assert all(torch.equal(got[i], expected[i]) for i in range(4))


async def test_batches_never_exceed_max_batch(jpegs):
    async with _service(max_batch=4, max_delay=0.005) as pre:
        await asyncio.gather(*(pre(jpegs[i % 12]) for i in range(50)))
        sizes = pre.stats().batch_sizes
    assert max(sizes) <= 4 and sum(n * c for n, c in sizes.items()) == 50


async def test_a_corrupt_image_fails_only_its_own_request(jpegs, leaks):
    expected = await _reference(jpegs[:2])
    truncated = jpegs[2][: len(jpegs[2]) // 3]
    async with _service(max_batch=5, max_delay=0.05) as pre:  # five in one loop turn: one batch
        results = await asyncio.gather(
            pre(jpegs[0]), pre(b"not an image", key="bad-upload"), pre(jpegs[1]), pre(truncated), pre(b""),
            return_exceptions=True,
        )
        assert pre.stats().batch_sizes == {5: 1}  # all in one batch
        with pytest.raises(DecodeError) as list_error:  # a list fails with its bad image, named
            await pre([jpegs[0], b"junk"], key="upload")
    assert torch.equal(results[0], expected[0]) and torch.equal(results[2], expected[1])
    bad = results[1]
    assert isinstance(bad, DecodeError) and bad.key == "bad-upload" and bad.source == "request"
    for err in (results[3], results[4]):
        assert isinstance(err, DecodeError) and err.key.startswith("request-")
    assert list_error.value.key == "upload/1"
    await leaks.check()


async def test_a_request_cancelled_while_queued_frees_its_place(jpegs):
    expected = await _reference(jpegs[:4])
    async with _service(max_batch=4, max_delay=3600, max_pending=4) as pre:
        tasks = [asyncio.create_task(pre(img)) for img in jpegs[:2]]
        victim = asyncio.create_task(pre(jpegs[5]))
        await _until(lambda: pre.stats().in_flight == 3, "three queued")
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert pre.stats().in_flight == 2  # its place is free at once
        tasks += [asyncio.create_task(pre(img)) for img in jpegs[2:4]]
        got = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        stats = pre.stats()
    assert stats.batch_sizes == {4: 1} and stats.cancelled == 1  # the victim never reached a batch
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


async def test_a_request_cancelled_in_its_batch_leaves_batch_mates_alone(jpegs):
    expected = await _reference(jpegs[:3])
    pre = _service(max_batch=3, max_delay=3600)
    gate = await _gated(pre)
    try:
        tasks = [asyncio.create_task(pre(img)) for img in jpegs[:3]]
        await _until(lambda: gate.entered == 1, "batch dispatched")
        tasks[1].cancel()
        await asyncio.sleep(0)
        assert pre.stats().in_flight == 3  # its row is still being worked on
        gate.open.set()
        a, b, c = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(b, asyncio.CancelledError)
        assert torch.equal(a, expected[0]) and torch.equal(c, expected[2])
        assert pre.stats().in_flight == 0 and pre.stats().cancelled == 1
    finally:
        await pre.aclose()


async def test_when_full_reject_raises_overloaded_at_once(jpegs):
    expected = await _reference(jpegs[:3])
    pre = _service(max_batch=2, max_delay=0, max_pending=2, when_full="reject")
    gate = await _gated(pre)
    try:
        held = [asyncio.create_task(pre(img)) for img in jpegs[:2]]
        await _until(lambda: gate.entered == 1, "both in the executor")
        with pytest.raises(OverloadedError) as info:
            await pre(jpegs[2], key="third")
        assert info.value.key == "third" and info.value.stage == "overload"
        gate.open.set()
        first = await asyncio.gather(*held)
        assert await pre(jpegs[2]) is not None  # room again
        with pytest.raises(OverloadedError):  # a list is taken whole or not at all
            await pre(jpegs[:3])
        stats = pre.stats()
        assert stats.rejected == 4 and stats.completed == 3 and stats.peak_in_flight == 2
        assert all(torch.equal(a, b) for a, b in zip(first, expected))
    finally:
        await pre.aclose()


async def test_when_full_wait_holds_callers_until_there_is_room(jpegs):
    pre = _service(max_batch=2, max_delay=0, max_pending=2, when_full="wait")
    gate = await _gated(pre)
    try:
        tasks = [asyncio.create_task(pre(img)) for img in jpegs[:5]]
        await _until(lambda: pre.stats().waiting == 3, "three waiting for room")
        assert not any(t.done() for t in tasks)
        gate.open.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        stats = pre.stats()
        assert stats.peak_in_flight == 2 and stats.completed == 5 and stats.rejected == 0
        # A list longer than max_pending goes through piecewise instead of waiting forever.
        assert (await pre(jpegs[:5])).shape[0] == 5
    finally:
        await pre.aclose()


async def test_close_fails_queued_and_waiting_lets_running_finish(jpegs, leaks):
    expected = await _reference(jpegs[:2])
    pre = _service(max_batch=2, max_delay=0, max_pending=4, batches_in_flight=1)
    gate = await _gated(pre)
    running = [asyncio.create_task(pre(img)) for img in jpegs[:2]]
    await _until(lambda: gate.entered == 1, "first batch in the executor")
    queued = [asyncio.create_task(pre(img)) for img in jpegs[2:4]]  # no free slot: they stay queued
    waiting = asyncio.create_task(pre(jpegs[4]))  # no room: it waits for admission
    await _until(lambda: pre.stats().waiting == 1, "one waiting for room")
    closing = asyncio.create_task(pre.aclose())
    for t in [*queued, waiting]:
        with pytest.raises(ClosedError):
            await t
    assert not closing.done()  # the running batch is still being awaited
    gate.open.set()
    await closing
    got = [await t for t in running]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    with pytest.raises(ClosedError):
        await pre(jpegs[0])
    await pre.aclose()  # twice is fine
    await leaks.check()


async def test_close_names_each_caller_waiting_for_room(jpegs, leaks):
    pre = _service(max_batch=2, max_delay=0, max_pending=2, batches_in_flight=1)
    gate = await _gated(pre)
    running = asyncio.create_task(pre(jpegs[:2]))
    await _until(lambda: gate.entered == 1, "the batch holds every place")
    single = asyncio.create_task(pre(jpegs[2], key="late"))
    listed = asyncio.create_task(pre(jpegs[3:5], key="upload"))
    await _until(lambda: pre.stats().waiting == 2, "both waiting for room")
    closing = asyncio.create_task(pre.aclose())
    for task, key in [(single, "late"), (listed, "upload/0")]:
        with pytest.raises(ClosedError) as info:
            await task
        assert info.value.key == key and info.value.source == "request"
    gate.open.set()
    await closing
    assert (await running).shape == (2, 3, 32, 32)
    await leaks.check()


@pytest.mark.parametrize("leaves", ["a list, closed while waiting for room", "cancelled as the close answers it"])
async def test_a_caller_who_left_leaves_no_unretrieved_error_behind(jpegs, leaves):
    # Its requests were answered with ClosedError before the caller left, and nobody read the
    # errors: asyncio logged "Future exception was never retrieved" for each, once collected.
    loop = asyncio.get_running_loop()
    reported = []
    loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
    try:
        pre = _service(max_batch=2, max_delay=0, max_pending=3, batches_in_flight=1)
        gate = await _gated(pre)
        running = asyncio.create_task(pre(jpegs[:2]))
        await _until(lambda: gate.entered == 1, "the only batch slot taken")
        if leaves.startswith("a list"):
            caller = asyncio.create_task(pre(jpegs[2:4]))  # one image queued, one waiting for room
            await _until(lambda: pre.stats().waiting == 1, "one waiting for room")
            closing = asyncio.create_task(pre.aclose())
        else:
            caller = asyncio.create_task(pre(jpegs[2]))  # queued: no batch slot is free
            await _until(lambda: pre.stats().in_flight == 3, "one queued")
            closing = asyncio.create_task(pre.aclose())  # its first step answers the queued request,
            caller.cancel()  # then the caller wakes up cancelled
        with pytest.raises((ClosedError, asyncio.CancelledError)):
            await caller
        gate.open.set()
        await closing
        await running
        del caller
        gc.collect()  # the answered futures go now: an unread error would be reported here
    finally:
        loop.set_exception_handler(None)
    assert reported == []


async def test_cancelled_close_abandons_running_batches_and_joins_threads(jpegs, leaks):
    pre = _service(max_batch=2, max_delay=0)
    gate = await _gated(pre)
    running = [asyncio.create_task(pre(img)) for img in jpegs[:2]]
    await _until(lambda: gate.entered == 1, "batch in the executor")
    closing = asyncio.create_task(pre.aclose())
    await asyncio.sleep(0.01)
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    for t in running:
        with pytest.raises(ClosedError):
            await t
    await pre.aclose()
    await leaks.check()


async def test_lifecycle_without_requests(leaks):
    pre = _service()
    await pre.aclose()  # never started
    with pytest.raises(ClosedError):
        await pre(b"x")
    async with _service(postprocess=lambda x: x):  # started, idle, closed: its threads too
        pass
    await leaks.check()


async def test_postprocess_runs_once_per_batch_and_fails_per_request(jpegs, leaks):
    calls = []

    def model(images: torch.Tensor) -> torch.Tensor:
        calls.append(len(images))
        return images.mean(dim=(1, 2, 3))

    expected = await _reference(jpegs[:6])
    async with _service(max_batch=3, max_delay=3600, postprocess=model) as pre:
        got = await asyncio.gather(*(pre(img) for img in jpegs[:6]))
    assert calls == [3, 3]
    assert all(torch.equal(g, e.mean()) for g, e in zip(got, expected))

    def broken(images):
        raise RuntimeError("out of memory")

    async with _service(max_batch=2, max_delay=3600, postprocess=broken) as pre:
        errors = await asyncio.gather(pre(jpegs[0]), pre(jpegs[1]), return_exceptions=True)
        assert all(isinstance(e, TransformError) and e.stage == "postprocess" for e in errors)
        assert {e.key for e in errors} == {"request-0", "request-1"}
        assert pre.stats().failed == 2
    await leaks.check()


@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("shape", ["tuple", "dict", "too few rows"])
async def test_postprocess_outputs_that_are_not_a_row_a_request_fail_every_request(jpegs, batch, shape, leaks):
    # A tuple or a dict has a length too: (logits, features) for two requests once gave each caller
    # the other's rows, and a dict for one request left it unanswered and the service dead.
    def model(images: torch.Tensor):
        if shape == "tuple":
            return images.mean(dim=(1, 2, 3)), images.amax(dim=(1, 2, 3))
        if shape == "dict":
            return {"logits": images.mean(dim=(1, 2, 3))}
        return images.mean(dim=(1, 2, 3))[:-1]

    async with _service(max_batch=batch, max_delay=3600, postprocess=model) as pre:
        errors = await asyncio.gather(*(pre(img) for img in jpegs[:batch]), return_exceptions=True)
        assert all(isinstance(e, TransformError) and e.stage == "postprocess" for e in errors), errors
        assert {e.key for e in errors} == {f"request-{i}" for i in range(batch)}
        good = await asyncio.gather(*(pre(img) for img in jpegs[:batch]), return_exceptions=True)
        assert all(isinstance(e, TransformError) for e in good)  # the service lives on, each call answered
    await leaks.check()


async def test_a_batch_stage_that_drops_rows_fails_every_request_and_the_service_lives(jpegs, leaks):
    pipe = ops.Pipeline([ops.Decode(), ops.Resize((32, 32)), ops.MapBatch(lambda b: {**b, "image": b["image"][:1]})],
                        label=None)
    async with _service(pipeline=pipe, max_batch=3, max_delay=3600) as pre:
        errors = await asyncio.gather(*(pre(img) for img in jpegs[:3]), return_exceptions=True)
        assert all(isinstance(e, TransformError) and "a MapBatch keeps its batch's rows" in str(e) for e in errors), errors
    await leaks.check()


@pytest.mark.parametrize(
    "kwargs",
    [{"max_batch": 0}, {"max_delay": -1}, {"max_delay": float("inf")}, {"max_pending": 0},
     {"when_full": "drop"}, {"device": "tpu"}, {"postprocess": 3}, {"pipeline": "validation"},
     {"num_threads": 0}, {"batches_in_flight": 0}, {"seed": "x"}, {"seed": 2.5}, {"seed": None}],
)
def test_bad_arguments_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        _service(**kwargs)


async def _async_model(images):
    return images


class _AsyncModel:
    async def __call__(self, images):
        return images


@pytest.mark.parametrize("postprocess", [_async_model, _AsyncModel(), functools.partial(_async_model)],
                         ids=["async def", "async __call__", "partial"])
def test_an_async_postprocess_is_a_config_error(postprocess):
    # It runs in a thread with no loop: every request used to fail on the coroutine it returned,
    # never awaited.
    with pytest.raises(ConfigError, match="plain function"):
        _service(postprocess=postprocess)


@pytest.mark.gpu
@pytest.mark.skipif(not ops.cuda_available(), reason="needs CUDA, CuPy and nvImageCodec")
@pytest.mark.parametrize("sizes", ["fixed", "own"])
async def test_gpu_results_stay_on_the_device_and_match_the_cpu(jpegs, leaks, sizes):
    if sizes == "fixed":
        pipe = ops.validation(64, resize=72, label=None)
    else:  # no crop: each request's image keeps its own aspect (a detection service's input)
        pipe = ops.Pipeline([ops.Decode(), ops.Resize(72), ops.Normalize()], label=None)
    async with _service(pipeline=pipe, max_batch=8) as cpu:
        expected = await asyncio.gather(*(cpu(img) for img in jpegs))
    async with Preprocessor(pipe, device="cuda", max_batch=8, wait_ready=True) as gpu:
        got = await asyncio.gather(*(gpu(img) for img in jpegs))
    for a, b in zip(got, expected):
        assert a.is_cuda and a.shape == b.shape
        assert torch.allclose(a.cpu(), b, atol=0.1)  # rounding differences of the two resamplers
    await leaks.check()
