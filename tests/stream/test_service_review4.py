"""The Preprocessor as an inference server uses it (fourth review): the names its errors give, a
list that can never be admitted under ``when_full="reject"``, and a mixed load of good, corrupt
and abandoned requests.

Timing is never asserted; the executor is held on a gate where a request must stay in flight.
"""

from __future__ import annotations

import asyncio
import gc
import importlib.util
import random
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from headrace import ClosedError, DecodeError, OverloadedError, Preprocessor, ops
from service_refs import hold_batches
from service_refs import jpegs as make_jpegs

PIPE = ops.validation(32, resize=40, label=None)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve.py"


@pytest.fixture(scope="module")
def jpegs() -> list[bytes]:
    return make_jpegs(12)


def _service(**kw) -> Preprocessor:
    kw.setdefault("device", "cpu")
    kw.setdefault("num_threads", 2)
    return Preprocessor(PIPE, **kw)


async def _until(predicate, limit: float = 30.0) -> None:
    """Yield to the loop until ``predicate()``; the limit only turns a hang into a failure."""
    async with asyncio.timeout(limit):
        while not predicate():
            await asyncio.sleep(0.001)


async def test_a_list_larger_than_max_pending_is_told_it_never_fits(jpegs, leaks):
    # Taken whole or not at all, three images never fit two places; the error said "0 images in
    # flight, max_pending=2", which reads as room to spare and invites a retry that always fails.
    async with _service(max_batch=8, max_pending=2, when_full="reject") as pre:
        with pytest.raises(OverloadedError) as info:
            await pre(jpegs[:3], key="upload")
        assert "never fits" in str(info.value) and "0 images in flight" not in str(info.value)
        assert info.value.key == "upload/0"
        assert (await pre(jpegs[:2])).shape == (2, 3, 32, 32)  # what fits is taken
        assert pre.stats().rejected == 3
    await leaks.check()


async def test_a_refused_request_has_a_name_of_its_own(jpegs, leaks):
    # A request refused before it was queued was named after the next request's number: the
    # rejection and a later request's DecodeError both said key='request-1'.
    pre = _service(max_batch=1, max_pending=1, when_full="reject")
    await pre.__aenter__()
    gate = hold_batches(pre)
    try:
        first = asyncio.create_task(pre(jpegs[0]))  # request-0, held in the executor
        await _until(lambda: gate.entered == 1)
        with pytest.raises(OverloadedError) as refused:
            await pre(jpegs[1])
        gate.open.set()
        await first
        with pytest.raises(DecodeError) as failed:
            await pre(b"not an image")
        assert refused.value.key.startswith("request-") and failed.value.key.startswith("request-")
        assert refused.value.key != failed.value.key
    finally:
        await pre.aclose()
    await leaks.check()


async def test_callers_closed_out_while_waiting_for_room_have_names_of_their_own(jpegs, leaks):
    pre = _service(max_batch=1, max_pending=1, when_full="wait", batches_in_flight=1)
    await pre.__aenter__()
    gate = hold_batches(pre)
    first = asyncio.create_task(pre(jpegs[0]))
    await _until(lambda: gate.entered == 1)
    waiting = [asyncio.create_task(pre(img)) for img in jpegs[1:3]]
    await _until(lambda: pre.stats().waiting == 2)
    closing = asyncio.create_task(pre.aclose())
    errors = await asyncio.gather(*waiting, return_exceptions=True)
    assert all(isinstance(e, ClosedError) for e in errors), errors
    assert len({e.key for e in errors} | {"request-0"}) == 3  # neither is the running request's name
    gate.open.set()
    await closing
    assert (await first).shape == (3, 32, 32)
    await leaks.check()


async def test_a_call_after_close_names_its_request(jpegs):
    pre = _service()
    async with pre:
        await pre(jpegs[0])
    with pytest.raises(ClosedError) as info:
        await pre(jpegs[0], key="late")
    assert info.value.key == "late" and info.value.source == "request"


async def test_mixed_load_answers_every_caller_with_its_own_row(jpegs, leaks):
    # Many callers at once: good images, corrupt ones, lists, and callers who give up (a timeout of
    # a few milliseconds). Each caller who stays gets its own rows or its own named error; the
    # counts balance, no place is left taken, and no error goes unread.
    async with _service(max_batch=1) as one:
        expected = [await one(img) for img in jpegs]
    loop = asyncio.get_running_loop()
    reported = []
    loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
    rng = random.Random(5)
    try:
        async with _service(max_batch=6, max_delay=0.002, max_pending=16) as pre:

            async def caller(n: int) -> str:
                i = rng.randrange(len(jpegs))
                kind = rng.choice(["one", "one", "one", "list", "bad", "leaves"])
                if kind == "list":
                    ids = [rng.randrange(len(jpegs)) for _ in range(rng.randrange(2, 5))]
                    rows = await pre([jpegs[j] for j in ids], key=f"list-{n}")
                    assert all(torch.equal(rows[k], expected[j]) for k, j in enumerate(ids))
                elif kind == "bad":
                    with pytest.raises(DecodeError) as info:
                        await pre(jpegs[i][: len(jpegs[i]) // 2], key=f"bad-{n}")
                    assert info.value.key == f"bad-{n}"
                elif kind == "leaves":
                    try:
                        row = await asyncio.wait_for(pre(jpegs[i]), rng.random() * 0.005)
                    except TimeoutError:
                        return kind
                    assert torch.equal(row, expected[i])
                else:
                    assert torch.equal(await pre(jpegs[i], key=f"one-{n}"), expected[i])
                return kind

            kinds = await asyncio.wait_for(asyncio.gather(*(caller(n) for n in range(150))), 120)
            s = pre.stats()
        assert s.in_flight == 0 and s.waiting == 0
        assert s.completed + s.failed + s.cancelled == s.requests
        assert s.failed == kinds.count("bad")
        # Every request that stayed went in a batch; one that left went in one only if it left late.
        assert s.requests - s.cancelled <= sum(n * c for n, c in s.batch_sizes.items()) <= s.requests
        del kinds
        gc.collect()
    finally:
        loop.set_exception_handler(None)
    assert reported == []
    await leaks.check()


@pytest.fixture(scope="module")
def serve():
    spec = importlib.util.spec_from_file_location("headrace_example_serve_review4", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_serve_example_answers_413_for_more_files_than_max_pending(serve, jpegs):
    # Under reject such an upload never fits: a 503 with Retry-After told the client to try again.
    app = serve.make_app(device="cpu", model="none", max_batch=8, max_pending=2, num_threads=2)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        form = aiohttp.FormData()
        for i in range(3):
            form.add_field("image", jpegs[i], filename=f"{i}.jpg", content_type="image/jpeg")
        r = await client.post("/predict", data=form)
        assert r.status == 413 and "Retry-After" not in r.headers
        assert "max_pending=2" in (await r.json())["error"]
        form = aiohttp.FormData()
        for i in range(2):
            form.add_field("image", jpegs[i], filename=f"{i}.jpg", content_type="image/jpeg")
        r = await client.post("/predict", data=form)
        assert r.status == 200 and len((await r.json())["results"]) == 2
