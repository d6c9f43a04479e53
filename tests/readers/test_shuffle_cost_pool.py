"""The shards reader recycles its samples' memory (``_shard_files.SamplePool``, ``_native/sample_pool.c``):
the samples stay exactly those of the plain copy, in the same order, and a field anybody still
holds (the sample, a memoryview, a NumPy array over it) is never written again."""

from __future__ import annotations

import asyncio
import gc
import hashlib
import sys

import numpy as np
import pytest

from headrace import readers
from headrace.readers import _shard_files
from headrace.readers._shard_files import SamplePool
from sample_data import tar_bytes

pytestmark = pytest.mark.skipif(_shard_files._pool_lib() is None, reason="the C helper does not build here")


@pytest.fixture(scope="module")
def mixed_shards(tmp_path_factory):
    """4 shards of 30 samples, each a jpg and a png of random bytes from 100 B to 300 KiB (below and
    above the 4 KiB a member is copied out from the shard's memory, across many size classes) and a
    cls; returns (paths, {key: fields})."""
    rng = np.random.default_rng(7)
    root = tmp_path_factory.mktemp("pool-shards")
    truth: dict[str, dict[str, bytes]] = {}
    paths = []
    for s in range(4):
        members = []
        for i in range(30):
            key = f"s{s}/{i:04d}"
            fields = {ext: rng.integers(0, 256, int(rng.integers(100, 300 << 10)), dtype=np.uint8).tobytes()
                      for ext in ("jpg", "png")}
            fields["cls"] = str(i % 3).encode()
            truth[key] = fields
            members += [(f"{key}.{ext}", data) for ext, data in fields.items()]
        path = root / f"shard-{s}.tar"
        path.write_bytes(tar_bytes(members))
        paths.append(str(path))
    return paths, truth


def _epochs(reader, epochs, truth=None, keep=None):
    """Each epoch's (key, index, position, {field: digest}), every field checked against ``truth``
    as it comes; the samples themselves are let go (only then is their memory recycled)."""
    async def run():
        out = []
        for epoch in range(epochs):
            samples = []
            async for chunk in reader.read(epoch):
                for s in chunk:
                    assert s.error is None
                    assert all(type(v) is bytes for v in s.fields.values())
                    if truth is not None:
                        assert s.fields == truth[s.key], s.key
                    digests = {k: hashlib.sha256(v).hexdigest() for k, v in s.fields.items()}
                    samples.append((s.key, s.index, s.position, digests))
                    if keep is not None:
                        keep(s)
            out.append(samples)
        return out

    return asyncio.run(run())


@pytest.mark.parametrize("buffer", [0, 25])
def test_pooled_samples_are_those_of_the_plain_copy(mixed_shards, monkeypatch, buffer):
    paths, truth = mixed_shards
    options = dict(shuffle=True, shuffle_buffer=buffer, chunk_size=4, counts=[30] * 4)
    pooled_reader = readers.webdataset(paths, **options)
    pooled = _epochs(pooled_reader, 3, truth)
    stats = pooled_reader.files._pool.stats()
    assert stats["reused"] > stats["new"]  # the memory was recycled, or this test tests nothing
    monkeypatch.setattr(SamplePool, "copy", lambda self, spans: None)  # the plain copy (copy_spans)
    plain = _epochs(readers.webdataset(paths, **options), 3, truth)
    assert pooled == plain
    assert all(len(epoch) == len(truth) for epoch in pooled)


def test_held_fields_are_never_reused(mixed_shards):
    """Fields kept across epochs, as themselves, through a memoryview or a NumPy array over them,
    keep their bytes while the reader recycles everything else around them."""
    paths, truth = mixed_shards
    reader = readers.webdataset(paths, shuffle=True, shuffle_buffer=10, chunk_size=4)
    held: list[tuple[str, object, object]] = []

    def keep(sample):
        n = len(held)
        if n % 3 == 0:
            held.append((sample.key, "jpg", sample.fields["jpg"]))
        elif n % 3 == 1:
            held.append((sample.key, "png", memoryview(sample.fields["png"])))
        else:
            held.append((sample.key, "jpg", np.frombuffer(sample.fields["jpg"], dtype=np.uint8)))

    kept = []
    _epochs(reader, 1, truth, keep=lambda s: kept.append(s) if len(kept) < 40 else None)
    for s in kept:
        keep(s)
    del kept
    gc.collect()
    _epochs(reader, 4, truth)
    assert reader.files._pool.stats()["reused"] > 0
    for key, field, value in held:
        assert bytes(value) == truth[key][field], key


def test_recycled_fields_hash_afresh(mixed_shards):
    """A blob reused for another member forgets the hash cached for its last one."""
    paths, truth = mixed_shards
    reader = readers.webdataset(paths, shuffle=True, shuffle_buffer=5, chunk_size=4)
    by_blob: dict[bytes, str] = {}

    def check(sample):
        for value in sample.fields.values():
            assert hash(value) == hash(bytes(bytearray(value)))  # and caches each blob's hash
        by_blob[sample.fields["jpg"]] = sample.key  # a dict looks the hash up

    _epochs(reader, 3, truth, keep=check)
    assert reader.files._pool.stats()["reused"] > 0
    assert all(by_blob[truth[key]["jpg"]] == key for key in truth)


def test_remote_shard_through_the_pool(s3_env, storage_root):
    """A download's members (spans of its blocks) recycled the same way: the same samples as the
    local file's."""
    url = f"{s3_env.http_direct}/big/big-0.tar"
    local = str(storage_root / "big" / "big-0.tar")
    options = dict(shuffle=True, shuffle_buffer=8, chunk_size=4)
    remote_reader = readers.webdataset(url, **options)
    remote = _epochs(remote_reader, 2)
    assert len(remote[0]) == 48
    assert remote == _epochs(readers.webdataset(local, **options), 2)
    assert remote_reader.files._pool.stats()["reused"] > 0


def test_pool_bounds_and_close():
    """It follows at most ``track`` blobs, keeps no more free bytes than they held at their peak, and
    ``close()`` lets go of all of them (the holders' keep theirs)."""
    source = np.random.default_rng(0).integers(0, 256, 4 << 20, dtype=np.uint8)
    base = source.ctypes.data
    spans = [(base + i * 4099, 5000 + 7919 * i) for i in range(64)]
    pool = SamplePool(16)
    first = pool.copy(spans)
    assert [bytes(b) for b in first] == [source[a - base : a - base + n].tobytes() for a, n in spans]
    assert pool.stats()["followed"] == 16  # the 48 oldest were forgotten
    oldest, newest = first[0], first[-1]
    assert sys.getrefcount(oldest) == 3  # the list's, this name's and the call's: the pool's is gone
    assert sys.getrefcount(newest) == 4  # the pool follows the newest
    del oldest, newest
    peak = pool.stats()["peak_bytes"]
    del first
    second = pool.copy(spans[:8])
    stats = pool.stats()
    assert stats["stock_bytes"] <= peak
    assert [bytes(b) for b in second] == [source[a - base : a - base + n].tobytes() for a, n in spans[:8]]
    held = second[0]
    before = sys.getrefcount(held)
    pool.close()
    pool.close()
    assert sys.getrefcount(held) == before - 1
    assert pool.copy(spans) is None  # closed: the caller copies without it
    assert bytes(held) == source[spans[0][0] - base : spans[0][0] - base + spans[0][1]].tobytes()
