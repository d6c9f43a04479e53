"""A download's buffer grows to what a far store needs: it starts at ``START_CAPACITY`` and doubles
while its parser still waits with every GET its bound allows in flight, never past ``buffer_bytes``.

Against the latency server of ``test_storage_latency.py`` (20 ms first byte, 20 MB/s a connection):
a 48 MiB shard, far too slow for a parser on 8 MiB of GETs in flight. No test asserts a time.
"""

from __future__ import annotations

import numpy as np
import pytest

from headrace import readers
from headrace.readers._storage._downloads import START_CAPACITY

from sample_data import tar_bytes
from test_storage import _read_all
from test_storage_latency import HEAD_BLOCK, RETRY, _pairs, slow, slow_server  # noqa: F401 - fixtures

FAR = "grow/far-0.tar"


def _served_shard(root, name: str, count: int, seed: int) -> list[tuple[str, bytes]]:
    """A shard of ``count`` samples of 256 KiB at ``name`` in the served folder, written once; its (key, bytes)."""
    rng = np.random.default_rng(seed)
    samples = [(f"{i:04d}", rng.integers(0, 256, 256 << 10, dtype=np.uint8).tobytes()) for i in range(count)]
    path = root / name
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(tar_bytes([(f"{key}.bin", data) for key, data in samples]))
    return samples


def _far_shard(root) -> list[tuple[str, bytes]]:
    """The 48 MiB shard (192 samples)."""
    return _served_shard(root, FAR, 192, 5)


async def _read_far(slow, kind, **options):
    """The far shard read whole by a webdataset reader with ``options``: every sample once, in order."""
    expected = _far_shard(slow.root)
    reader = readers.webdataset(slow.source(kind, FAR), chunk_size=4, storage_options={"retry": RETRY}, **options)
    assert _pairs(await _read_all(reader)) == expected
    return reader, expected


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_a_far_store_grows_the_buffer_up_to_buffer_bytes_and_no_further(slow, kind, leaks):
    bound = 32 << 20
    reader, expected = await _read_far(slow, kind, buffer_bytes=bound)
    link = reader.files.link
    assert START_CAPACITY < link.capacity <= bound  # it grew, within the bound
    assert 0 < reader.peak_buffered <= bound + HEAD_BLOCK
    # The next epoch's download starts with what this one grew to, and stays within the bound.
    grown = link.capacity
    assert _pairs(await _read_all(reader, epoch=1)) == expected
    assert grown <= link.capacity <= bound and reader.peak_buffered <= bound + HEAD_BLOCK
    await leaks.check()


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_a_bound_at_or_under_the_start_is_the_buffer_throughout(slow, kind, leaks):
    bound = 4 << 20
    reader, _ = await _read_far(slow, kind, buffer_bytes=bound)
    assert reader.files.link.capacity == 0  # nothing grew: the bound was the start
    assert 0 < reader.peak_buffered <= bound + HEAD_BLOCK
    await leaks.check()


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_the_default_bound_is_64_mib_and_a_far_store_finds_it(slow, kind, leaks):
    reader, _ = await _read_far(slow, kind)
    assert reader.files.buffer_bytes == 64 << 20
    assert START_CAPACITY < reader.files.link.capacity <= 64 << 20
    assert 0 < reader.peak_buffered <= (64 << 20) + HEAD_BLOCK
    await leaks.check()


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_a_small_far_shard_still_gains_ranged_gets_at_the_default_bound(slow, kind, leaks):
    # A 6 MiB shard: at the 64 MiB bound's 4 MiB segments it would have less than two segments past
    # its first GET and stream on that one connection (20 MB/s here); segments are an eighth of the
    # object at most (1 MiB here, as at the old 8 MiB default), so it gains ranged GETs.
    samples = _served_shard(slow.root, "grow/small-0.tar", 24, 6)
    reader = readers.webdataset(slow.source(kind, "grow/small-0.tar"), chunk_size=4, storage_options={"retry": RETRY})
    before = slow.stats()["requests"]  # the peaks: from the fixture's idle() (another here would start a thread)
    assert _pairs(await _read_all(reader)) == samples
    stats = slow.stats()
    assert stats["requests"] - before > 2 and stats["peak_answering"] > 1  # ranged GETs, answered at once
    await leaks.check()
