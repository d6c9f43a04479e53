"""Review of the growing download buffer (commits 763ddce, ddd0eb0), against the latency server of
``test_storage_latency.py`` (20 ms first byte, 20 MB/s a connection). No test asserts a time."""

from __future__ import annotations

import asyncio

import pytest

from headrace import readers

from test_adaptive_buffer import FAR, _far_shard
from test_storage import _read_all
from test_storage_latency import HEAD_BLOCK, RETRY, _pairs, slow, slow_server  # noqa: F401 - fixtures


async def _watch(link, seen: list, stop: asyncio.Event) -> None:
    """Every 2 ms on the loop: each running download's bound and GETs wanted, and the link's bound."""
    while not stop.is_set():
        for fetcher in list(link.fetchers):
            seen.append((id(fetcher), fetcher.file.capacity, fetcher.want, link.capacity))
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_a_download_read_ahead_leads_with_the_bound_the_earlier_one_grew_to(slow, kind, leaks):
    # Three far shards, read_ahead=2: all three downloads open at once at START_CAPACITY; the first
    # grows the bound while its parser waits. The two read ahead, once they lead, start with what
    # it grew to, as they start with the GETs it came to (before: they stayed at 8 MiB and 4 GETs,
    # the span of 8 MiB in 4 MiB segments, against the 32 MiB and 10 GETs the first came to).
    expected = _far_shard(slow.root)
    bound = 32 << 20
    reader = readers.webdataset([slow.source(kind, FAR)] * 3, buffer_bytes=bound, chunk_size=4, read_ahead=2,
                                storage_options={"retry": RETRY})
    seen: list = []
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch(reader.files.link, seen, stop))
    try:
        assert _pairs(await _read_all(reader)) == expected * 3  # every sample once, in order
    finally:
        stop.set()
        await watcher
    downloads = list(dict.fromkeys(f for f, *_ in seen))
    assert len(downloads) == 3 and reader.files.link.capacity > 8 << 20  # the first grew the bound
    # Each download, once it has ranged GETs (it led), has at least the bound the link held: it took
    # the lead with it (the first grew it itself).
    first = {}
    for f, capacity, want, link in seen:
        if want > 1:
            first.setdefault(f, (capacity, link))
    assert len(first) == 3
    assert [(downloads.index(f), capacity, link) for f, (capacity, link) in first.items() if capacity < link] == []
    assert 0 < reader.peak_buffered <= bound + HEAD_BLOCK
    await leaks.check()
