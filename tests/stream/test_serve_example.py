"""examples/serve.py: the aiohttp app on 127.0.0.1, real JPEGs posted, answers checked against the model."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from headrace import Preprocessor, ops
from service_refs import hold_batches, jpeg

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "serve.py"


@pytest.fixture(scope="module")
def serve():
    spec = importlib.util.spec_from_file_location("headrace_example_serve", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
async def client(serve):
    app = serve.make_app(device="cpu", model="tiny", topk=3, max_batch=8, max_delay=0.005, num_threads=2)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


@pytest.fixture(scope="module")
def photo() -> bytes:
    return jpeg(np.random.default_rng(3), 375, 500)


async def _expected_top(serve, image: bytes, k: int = 3) -> list[dict]:
    """What the server should answer: the same service and the same seeded model, called directly."""
    model, _ = serve.build_model("tiny", device="cpu")
    async with Preprocessor(ops.validation(label=None), device="cpu", num_threads=2) as pre:
        x = await pre(image)
    return serve.classify(model, k)(x[None])[0]


async def test_post_body_and_multipart(client, serve, photo):
    expected = await _expected_top(serve, photo)
    r = await client.post("/predict", data=photo)
    assert r.status == 200
    body = await r.json()
    assert body["results"][0]["top"] == expected and "random weights" in body["model"]
    form = aiohttp.FormData()
    for name in ("a.jpg", "b.jpg"):
        form.add_field("image", photo, filename=name, content_type="image/jpeg")
    r = await client.post("/predict", data=form)
    results = (await r.json())["results"]
    assert r.status == 200 and len(results) == 2
    for res in results:  # a batch of two: the model's float sums may round differently from a batch of one
        assert res["top"][0]["class"] == expected[0]["class"]
        assert res["top"][0]["score"] == pytest.approx(expected[0]["score"], abs=1e-4)
    assert [res["key"].rsplit("/", 1)[1] for res in results] == ["0", "1"]


async def test_concurrent_uploads_are_batched(client, photo):
    responses = await asyncio.gather(*(client.post("/predict", data=photo) for _ in range(16)))
    assert [r.status for r in responses] == [200] * 16
    tops = [(await r.json())["results"][0]["top"] for r in responses]
    assert all(t == tops[0] for t in tops)
    stats = await (await client.get("/stats")).json()
    assert stats["completed"] == 16
    assert max(int(k) for k in stats["batch_sizes"]) <= 8 and stats["batches"] < 16


async def test_bad_uploads_are_400_and_name_the_request(client):
    r = await client.post("/predict", data=b"definitely not a jpeg")
    body = await r.json()
    assert r.status == 400 and body["key"] in body["error"] and "decode" in body["error"]
    r = await client.post("/predict", data=b"")
    assert r.status == 400
    assert (await client.get("/healthz")).status == 200


async def test_full_service_answers_503(serve, photo):
    # The first upload is held in the executor, on the only place. Not by a long max_delay: a batch
    # that holds every place of max_pending goes at once, as no one else could join it.
    app = serve.make_app(device="cpu", model="none", max_batch=64, max_delay=0, max_pending=1, num_threads=2)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        gate = hold_batches(app[serve.PRE])
        first = asyncio.ensure_future(client.post("/predict", data=photo))
        async with asyncio.timeout(30):  # only turns a hang into a failure
            while gate.entered < 1:
                await asyncio.sleep(0.005)
        r = await client.post("/predict", data=photo)
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        gate.open.set()
        r = await asyncio.wait_for(first, 30)
        assert r.status == 200 and (await r.json())["results"][0]["shape"] == [3, 224, 224]
