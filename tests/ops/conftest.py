"""Fixtures for the CPU ops tests: executors that are always closed, and a seeded NumPy generator."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from headrace.ops import CpuExecutor, Pipeline
from headrace.ops._nvimgcodec import nvimgcodec
from headrace.ops.cpu import _executor as _cpu


@pytest.fixture
async def make_executor():
    """``make_executor(pipeline, num_threads=2, seed=0)``; every executor made is closed after the test."""
    made: list[CpuExecutor] = []

    def make(pipeline: Pipeline, *, num_threads: int = 2, seed: int = 0) -> CpuExecutor:
        executor = CpuExecutor(pipeline, num_threads=num_threads, seed=seed)
        made.append(executor)
        return executor

    yield make
    for executor in made:
        await executor.aclose()


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A generator seeded from the test's name: each test gets its own fixed images."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=["nvimgcodec", "pillow"])
def jpeg_decoder(request, monkeypatch) -> str:
    """Runs the test once per CPU JPEG decoder: nvImageCodec's CPU backend (skipped when it does not
    import) and Pillow alone (as on a machine without nvImageCodec). Executors made after it use it."""
    if request.param == "pillow":
        monkeypatch.setattr(_cpu, "nvimgcodec", lambda: None)
    elif nvimgcodec() is None:
        pytest.skip("nvImageCodec does not import here")
    return request.param
