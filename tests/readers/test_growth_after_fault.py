"""A fault is not a slow store: a parser that waits out a retry's backoff does not grow the download.

Against the fault proxy of ``test_storage.py`` (no latency, no bandwidth cap): the big shard
(12 MiB) read by a parser thread slower than the link, so a healthy download never makes it wait
and never gains a GET. Then the head GET drops after 4 MiB and its retry waits 0.4 s: the parser
drains what arrived and waits for the retry's bytes, a wait that begins after the fault. Growing for
it would answer a failing store with more GETs and more memory. No test asserts a time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import pytest

from headrace.readers._storage import Downloads, Retry, Storage
from headrace.readers._storage._downloads import START_CAPACITY

from storage_servers import BUCKET

BIG = "big/big-0.tar"
BACKOFF = 0.4  # long enough for the parser to drain its buffer and wait on the retry
STEP = 256 << 10  # the parser reads this much, then parses for PAUSE seconds: ~50 MB/s, far below the link
PAUSE = 0.005


class _Fixed(Retry):
    """A retry that waits exactly ``backoff`` (no jitter): the parser's wait on it is sure to come."""

    __slots__ = ()

    def delay(self, failures: int) -> float:
        return self.backoff


def _url(servers, kind: str) -> str:
    return f"s3://{BUCKET}/{BIG}" if kind == "s3" else f"{servers.http}/{BIG}"


def _parse(remote, after_fault: bool) -> bytes:
    """The parser thread: the whole object, ``STEP`` bytes at a time with a pause after each. With
    ``after_fault`` it first waits, without reading, until the head GET has failed once: it then
    has the bytes that came before the fault to drain, and its wait for more begins in the backoff."""
    with remote:
        size = remote.size
        if after_fault:
            deadline = time.monotonic() + 10  # a guard against a hang, not a measurement
            while remote.fetcher.retries == 0 and time.monotonic() < deadline:
                time.sleep(0.001)
        out = []
        while remote.tell() < size:
            out.append(remote.read(STEP))
            time.sleep(PAUSE)
        return b"".join(out)


async def _download(servers, kind: str, after_fault: bool):
    """The shard through a read's downloads (as a reader opens them), parsed by one thread; the file."""
    storage = Storage({"retry": _Fixed(attempts=3, backoff=BACKOFF, max_backoff=BACKOFF, timeout=5)})
    downloads = Downloads(storage, capacity=64 << 20)
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="parser") as pool:
        async with storage.session():
            try:
                remote = downloads.open(_url(servers, kind), 0)
                data = await asyncio.get_running_loop().run_in_executor(pool, _parse, remote, after_fault)
            finally:
                await downloads.aclose()
    return remote, downloads.link, data


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_waiting_out_a_retrys_backoff_does_not_grow_the_download(s3_env, kind, leaks):
    expected = (s3_env.root / BIG).read_bytes()
    # Healthy: the parser never waits on the link, the download keeps its one GET and its bound.
    remote, link, data = await _download(s3_env, kind, after_fault=False)
    assert data == expected and remote.fetcher.retries == 0
    assert (link.pieces, remote.capacity, link.capacity) == (1, START_CAPACITY, 0), "a healthy read grew"
    assert len([r for r in s3_env.log(kind) if "big-0" in r["path"]]) == 1

    # The head GET drops after 4 MiB; its retry waits 0.4 s, the parser waiting for it most of that.
    s3_env.faults(kind, {"match": "big-0", "faults": [{"kind": "reset", "after": 4 << 20}]})
    remote, link, data = await _download(s3_env, kind, after_fault=True)
    assert data == expected and remote.fetcher.retries == 1  # every byte once, after one fault
    log = [r for r in s3_env.log(kind) if "big-0" in r["path"]]
    # The fault alone: one GET in flight throughout (the first and its resume), the bound where it started.
    assert (link.pieces, remote.capacity, link.capacity) == (1, START_CAPACITY, 0), \
        f"the fault grew the download: {link.pieces} GETs, bound {remote.capacity >> 20} MiB"
    assert len(log) == 2 and log[0]["fault"] is not None and log[1]["fault"] is None, log
    await leaks.check()
