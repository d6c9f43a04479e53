"""Shared fixtures: small real image folders, and a check that nothing outlives a loader."""

from __future__ import annotations

import asyncio
import io
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from open_files import open_fds
from sample_data import make_folder


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    """3 classes x 25 JPEGs of random sizes (40-120 px): 75 samples."""
    return make_folder(tmp_path_factory.mktemp("images"), classes=3, per_class=25)


@pytest.fixture(scope="session")
def slow_folder(tmp_path_factory) -> Path:
    """Two classes of 200 copies each of one 1024x1024 JPEG: with one thread a decode pass over it
    takes seconds, long enough to stop a command (pack --verify, inspect --verify, bench) halfway."""
    pixels = np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).resize((1024, 1024), Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=90)
    root = tmp_path_factory.mktemp("slow")
    for name in ("a", "b"):
        (root / name).mkdir()
        for i in range(200):
            (root / name / f"{i:03d}.jpg").write_bytes(buffer.getvalue())
    return root


class Leaks:
    """Snapshot of threads and open files; ``check()`` asserts nothing new is left over."""

    def __init__(self) -> None:
        self.threads = set(threading.enumerate())
        self.fds = open_fds()

    async def check(self, settle: float = 0.0, *, threads: bool = True) -> None:
        """Assert nothing is left; ``settle`` seconds are allowed for a close scheduled by a finaliser.
        ``threads=False`` checks tasks only (a loader's worker threads live until its ``aclose()``)."""
        current = asyncio.current_task()
        deadline = asyncio.get_running_loop().time() + settle
        while True:
            await asyncio.sleep(0)
            tasks = [t for t in asyncio.all_tasks() if t is not current and not t.done()]
            if not tasks or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.005)
        assert tasks == [], f"tasks left behind: {[t.get_name() for t in tasks]}"
        if not threads:
            return
        # The event loop's default executor (asyncio.to_thread: the test servers' idle()) adds a
        # thread when its last one is still busy, as on a loaded machine; those threads are the
        # loop's, ended when it closes, not something the code under test left behind.
        threads = [t for t in threading.enumerate()
                   if t not in self.threads and t.is_alive() and not t.name.startswith("asyncio_")]
        assert threads == [], f"threads left behind: {[t.name for t in threads]}"
        assert open_fds() - self.fds == set(), "files left open"


@pytest.fixture
def leaks() -> Leaks:
    return Leaks()
