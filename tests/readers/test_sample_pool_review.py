"""Adversarial checks of the sample pool (``_shard_files.SamplePool``, ``_native/sample_pool.c``),
which writes new members into ``bytes`` objects once the pool holds their last reference.

Each test holds fields the ways users hold them (the bytes, a memoryview, a NumPy array, a ctypes
pointer, a dict key), lets them go at random, and checks every field it sees against the source
tar as read by ``tarfile``: a blob reused while anyone can still see it, a stale cached hash, a
race between two threads of one pool, or memory that grows epoch after epoch fails here.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import pickle
import random
import tarfile
import threading
import tracemalloc

import numpy as np
import pytest
from sample_data import jpeg_bytes, tar_bytes

from headrace import Loader, ops, readers
from headrace.readers import _shard_files
from headrace.readers._shard_files import SamplePool

pytestmark = pytest.mark.skipif(_shard_files._pool_lib() is None, reason="the C helper does not build here")

# Sizes at and around the pool's class edges (a page, 64 KiB, a doubling) and below the 4 KiB from
# which members are copied out of the shard's memory at all.
EDGES = [4095, 4096, 4097, 8191, 8192, 65535, 65536, 65537, 73728, 73729, 131072, 131073, 600_000]


def _tar_truth(paths: list[str]) -> dict[str, dict[str, bytes]]:
    """Every sample's fields as ``tarfile`` reads them (not our parser)."""
    truth: dict[str, dict[str, bytes]] = {}
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar.getmembers():
                key, ext = member.name.rsplit(".", 1)
                data = tar.extractfile(member)
                assert data is not None
                truth.setdefault(key, {})[ext] = data.read()
    return truth


@pytest.fixture(scope="module")
def edge_shards(tmp_path_factory):
    """6 shards of 40 samples: a jpg of an edge size or any size to 400 KB, a png of 1 B to 90 KB,
    a cls; returns (paths, truth read back with tarfile)."""
    rng = np.random.default_rng(11)
    root = tmp_path_factory.mktemp("pool-review")
    paths = []
    for s in range(6):
        members = []
        for i in range(40):
            key = f"s{s}/{i:04d}"
            size = int(rng.choice(EDGES)) if i % 2 else int(rng.integers(4096, 400_000))
            members += [(f"{key}.jpg", rng.integers(0, 256, size, dtype=np.uint8).tobytes()),
                        (f"{key}.png", rng.integers(0, 256, int(rng.integers(1, 90_000)), dtype=np.uint8).tobytes()),
                        (f"{key}.cls", str(i).encode())]
        path = root / f"shard-{s}.tar"
        path.write_bytes(tar_bytes(members))
        paths.append(str(path))
    return paths, _tar_truth(paths)


def _hold(value: bytes, kind: int):
    """``value`` held the way a user might: itself, a view, an array, a ctypes pointer, a dict key."""
    if kind == 0:
        return value
    if kind == 1:
        return memoryview(value)[1:]
    if kind == 2:
        return np.frombuffer(value, dtype=np.uint8)
    if kind == 3:
        return ctypes.c_char_p(value)  # keeps the bytes in its _objects
    return {value: hash(value)}


def _held_bytes(holder, size: int) -> bytes:
    if isinstance(holder, ctypes.c_char_p):
        return ctypes.string_at(holder, size)
    if isinstance(holder, dict):
        (key, cached), = holder.items()
        assert hash(key) == cached == hash(bytes(bytearray(key)))
        return key
    if isinstance(holder, memoryview):
        return b"?" + bytes(holder)  # the first byte is compared apart
    return bytes(holder)


def _same(holder, expected: bytes) -> bool:
    got = _held_bytes(holder, len(expected))
    return got[1:] == expected[1:] if isinstance(holder, memoryview) else got == expected


def test_threads_share_one_pool():
    """Four threads copy through one small pool at once (the GIL let go around each copy), keeping
    a third of their blobs in different holders and letting them go at random: every blob is its
    span's bytes when made and when let go, hashes like a fresh bytes, and pickles to its bytes."""
    source = np.random.default_rng(2).integers(0, 256, 16 << 20, dtype=np.uint8)
    base = source.ctypes.data
    pool = SamplePool(48)
    failures: list[str] = []

    def expected(address: int, size: int) -> bytes:
        return source[address - base : address - base + size].tobytes()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        held: list[tuple[int, int, object]] = []
        try:
            for _ in range(700):
                spans = []
                for _ in range(rng.randint(1, 6)):
                    size = rng.choice(EDGES[:-1] + [rng.randint(4096, 1 << 20)])
                    spans.append((base + rng.randrange(len(source) - size), size))
                blobs = pool.copy(spans)
                assert blobs is not None
                for (address, size), blob in zip(spans, blobs):
                    want = expected(address, size)
                    if type(blob) is not bytes or blob != want or hash(blob) != hash(want):
                        failures.append(f"fresh blob of {size} bytes is not its span's")
                        return
                    if rng.random() < 0.35:
                        held.append((address, size, _hold(blob, rng.randrange(5))))
                del blob, blobs
                while held and rng.random() < 0.3:
                    address, size, holder = held.pop(rng.randrange(len(held)))
                    want = expected(address, size)
                    if not _same(holder, want):
                        failures.append(f"a {type(holder).__name__} of {size} bytes was rewritten while held")
                        return
                    if type(holder) is bytes and pickle.loads(pickle.dumps(holder, protocol=5)) != want:
                        failures.append("a held blob pickles to other bytes")
                        return
        except Exception as exc:  # reported by the main thread
            failures.append(repr(exc))

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    stats = pool.stats()
    assert stats["reused"] > stats["new"]  # the blobs were recycled, or this tested nothing
    assert stats["stock_bytes"] <= stats["peak_bytes"]
    pool.close()


async def _read(reader, epoch: int, truth, rng: random.Random, held: list, *, start: int = 0,
                stop: int | None = None) -> int:
    """Samples of one read, each checked against ``truth``; some fields kept in ``held``."""
    seen = 0
    chunks = reader.read(epoch, start=start)
    try:
        async for chunk in chunks:
            for sample in chunk:
                assert sample.error is None, sample.error
                assert sample.fields == truth[sample.key], sample.key
                assert all(type(v) is bytes for v in sample.fields.values())
                if rng.random() < 0.05:
                    field = rng.choice(["jpg", "png"])
                    held.append((sample.key, field, _hold(sample.fields[field], rng.randrange(5))))
                seen += 1
                if stop is not None and seen >= stop:
                    return seen
            if rng.random() < 0.3:
                await asyncio.sleep(0)  # lets the other read of the reader (run ahead) go on
    finally:
        await chunks.aclose()
    return seen


def _reader_run(paths, truth, seed: int, epochs: int) -> dict[str, int]:
    rng = random.Random(seed)
    n = len(truth)

    async def run() -> dict[str, int]:
        reader = readers.webdataset(paths, shuffle=True, shuffle_buffer=rng.choice([0, 7, 40]),
                                    chunk_size=rng.choice([1, 3, 8]), read_ahead=rng.choice([0, 1, 3]),
                                    counts=[40] * len(paths))
        held: list = []
        for epoch in range(epochs):
            mode = epoch % 4
            if mode == 0:
                assert await _read(reader, epoch, truth, rng, held) == n
            elif mode == 1:  # stopped mid-epoch, then resumed there
                k = rng.randrange(1, n)
                assert await _read(reader, epoch, truth, rng, held, stop=k) == k
                assert await _read(reader, epoch, truth, rng, held, start=k) == n - k
            elif mode == 2:  # the next epoch read while this one is (a loader's run ahead)
                counts = await asyncio.gather(_read(reader, epoch, truth, rng, held),
                                              _read(reader, epoch + 1, truth, rng, held))
                assert counts == [n, n]
            else:
                k = rng.randrange(n)
                assert await _read(reader, epoch, truth, rng, held, start=k) == n - k
            rng.shuffle(held)
            del held[: len(held) // 2]
            for key, field, holder in held:
                assert _same(holder, truth[key][field]), (key, field, type(holder).__name__)
        return reader.files._pool.stats()

    return asyncio.run(run())


def test_readers_in_threads_over_many_epochs(edge_shards):
    """Three readers, each in its own thread and event loop, over 8 epochs of full reads, reads
    stopped and resumed mid-epoch, two epochs at once and resumes from a random place, with
    fields held across epochs: every sample is the tar's, every held field keeps its bytes."""
    paths, truth = edge_shards
    results: list[object] = []

    def run(seed: int) -> None:
        try:
            results.append(_reader_run(paths, truth, seed, 8))
        except BaseException as exc:  # reported by the main thread
            results.append(exc)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
    assert all(stats["reused"] > stats["new"] for stats in results)  # type: ignore[index]


def test_reads_closed_while_parsers_copy(edge_shards, leaks):
    """Reads closed after a few samples, while read-ahead threads are mid-copy: no thread or file
    is left, and fields held from the closed reads keep their bytes."""
    paths, truth = edge_shards
    rng = random.Random(5)

    async def run() -> None:
        reader = readers.webdataset(paths, shuffle=True, shuffle_buffer=3, chunk_size=1, read_ahead=3)
        held: list = []
        for epoch in range(40):
            await _read(reader, epoch, truth, rng, held, stop=rng.randrange(1, 30))
            del held[: max(0, len(held) - 30)]
            for key, field, holder in held:
                assert _same(holder, truth[key][field]), (key, field)
        assert reader.files._pool.stats()["reused"] > 0
        await leaks.check()

    asyncio.run(run())


@pytest.fixture(scope="module")
def many_small(tmp_path_factory):
    """2 shards of 500 samples, two fields of 4-12 KiB each: an epoch hands out 2,000 blobs, more
    than the pool follows (about 1,030 at chunk_size=1, no buffer, read_ahead=0)."""
    rng = np.random.default_rng(3)
    root = tmp_path_factory.mktemp("pool-many")
    paths = []
    for s in range(2):
        members = []
        for i in range(500):
            for ext in ("a", "b"):
                members.append((f"s{s}/{i:04d}.{ext}",
                                rng.integers(0, 256, int(rng.integers(4096, 12 << 10)), dtype=np.uint8).tobytes()))
        path = root / f"many-{s}.tar"
        path.write_bytes(tar_bytes(members))
        paths.append(str(path))
    return paths, _tar_truth(paths)


def test_memory_stays_bounded_and_goes_with_the_reader(many_small):
    """Over 16 epochs, a third of them held whole (more blobs than the pool follows, so it forgets
    some while they are held), the traced memory does not grow; the reader's collection frees what
    its pool kept, while the fields still held keep their bytes."""
    paths, truth = many_small
    rng = random.Random(9)
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]

        async def epochs(reader, first: int, count: int) -> list:
            kept: list = []
            for epoch in range(first, first + count):
                whole = epoch % 3 == 1  # the last epoch is not: the stock is full when the reader goes
                held: list = []
                async for chunk in reader.read(epoch):
                    for sample in chunk:
                        assert sample.fields == truth[sample.key], sample.key
                        if whole:
                            held.append(sample)
                for sample in held:
                    assert sample.fields == truth[sample.key], sample.key
                if held and len(kept) < 10:
                    sample = held[rng.randrange(len(held))]
                    kept.append((sample.key, sample.fields["a"]))
                del held
            return kept

        reader = readers.webdataset(paths, shuffle=True, shuffle_buffer=0, chunk_size=1, read_ahead=0)
        kept = asyncio.run(epochs(reader, 0, 4))
        gc.collect()
        early = tracemalloc.get_traced_memory()[0]
        kept += asyncio.run(epochs(reader, 4, 12))
        gc.collect()
        late = tracemalloc.get_traced_memory()[0]
        stats = reader.files._pool.stats()
        assert stats["stock_bytes"] <= stats["peak_bytes"]
        # One epoch's fields are ~16 MB; a leak of even one blob in 20 over 12 epochs passes that.
        assert late - early < 4 << 20, (early, late, stats)
        kept_bytes = sum(len(b) for _, b in kept)
        del reader
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        # What is left: the kept fields (in blobs of their class's capacity) and the interpreter's own.
        assert after - baseline < 2 * kept_bytes + (4 << 20), (baseline, after, kept_bytes)
        assert all(b == truth[key]["a"] for key, b in kept)
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def jpeg_shards(tmp_path_factory):
    """3 shards of 20 samples: a JPEG (to decode in the loader's threads), a pass-through field of
    4-150 KB random bytes; returns (paths, truth)."""
    rng = np.random.default_rng(4)
    root = tmp_path_factory.mktemp("pool-jpeg")
    paths = []
    for s in range(3):
        members = []
        for i in range(20):
            key = f"{s}-{i:04d}"
            members += [(f"{key}.jpg", jpeg_bytes(rng, int(rng.integers(80, 260)), int(rng.integers(80, 260)))),
                        (f"{key}.cls", str(i % 4).encode()),
                        (f"{key}.txt", rng.integers(0, 256, int(rng.integers(4096, 150_000)), dtype=np.uint8).tobytes())]
        path = root / f"j-{s}.tar"
        path.write_bytes(tar_bytes(members))
        paths.append(str(path))
    return paths, _tar_truth(paths)


def _loader_epochs(paths, epochs: int) -> list:
    pipeline = ops.Pipeline([ops.Decode(), ops.Resize((24, 24))], fields=("txt",))
    loader = Loader(readers.webdataset(paths, shuffle=True, seed=3, shuffle_buffer=9, chunk_size=2, read_ahead=2),
                    batch_size=4, pipeline=pipeline, device="cpu", num_threads=2, run_ahead=True)
    out = []
    with loader.sync() as batches_of:
        for _ in range(epochs):
            out.append([(list(b.sample_keys), b["image"].numpy().copy(), list(b["txt"]), b["label"].tolist())
                        for b in batches_of])
    return out


def test_loader_output_is_that_of_the_plain_copy(jpeg_shards, monkeypatch):
    """A loader decoding in two threads, running ahead between epochs, with a pass-through field:
    the pooled reader's batches (keys, pixels, fields, labels) are the plain copy's, and each
    pass-through field is the tar's bytes."""
    paths, truth = jpeg_shards
    pooled = _loader_epochs(paths, 3)
    for epoch in pooled:
        for keys, _, texts, _ in epoch:
            assert texts == [truth[k]["txt"] for k in keys]
    monkeypatch.setattr(SamplePool, "copy", lambda self, spans: None)  # the plain copy (copy_spans)
    plain = _loader_epochs(paths, 3)
    assert len(pooled) == len(plain)
    for a, b in zip(pooled, plain):
        assert [x[0] for x in a] == [x[0] for x in b]
        assert all(np.array_equal(x[1], y[1]) and x[2] == y[2] and x[3] == y[3] for x, y in zip(a, b))
