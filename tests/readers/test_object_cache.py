"""``files(cache_dir=)``: objects of a store kept on local disk as they are first fetched, through
the real S3 (moto) and HTTP servers behind their fault proxies; later epochs GET only what is not there."""

from __future__ import annotations

import contextlib
import os

import pytest

from headrace import ConfigError, StorageError, readers

from storage_servers import BUCKET
from test_storage import RETRY, _read_all

OBJECTS = 75


def _copies(folder) -> dict[str, bytes]:
    """The kept objects by file name; asserts no ``.part`` file is left."""
    out = {}
    for sub in sorted(folder.iterdir()):
        if not sub.is_dir():  # the tally of ``cache_bytes`` shared by the processes
            assert sub.name == ".headrace-used", sub
            continue
        for f in sorted(sub.iterdir()):
            assert not f.name.endswith(".part"), f
            out[f.name] = f.read_bytes()
    return out


def _object_gets(servers, kind: str) -> set[str]:
    """The objects GET asked for since the last look (a GET retried after a slow answer counts once)."""
    return {r["path"] for r in servers.log(kind) if r["path"].endswith(".jpg")}


def _remote(servers, kind, image_folder, retry=RETRY, **options):
    if kind == "s3":
        return readers.files(f"s3://{BUCKET}/images/", storage_options={"retry": retry}, **options)
    paths = sorted(p.relative_to(image_folder).as_posix() for p in image_folder.rglob("*.jpg"))
    return readers.files([f"{servers.http}/images/{p}" for p in paths], labels=[int(p[1]) for p in paths],
                         storage_options={"retry": retry}, **options)


def _same(samples, expected):
    assert [(s.key, s.index, s.position) for s in samples] == [(s.key, s.index, s.position) for s in expected]
    assert [s.fields for s in samples] == [s.fields for s in expected]
    assert all(s.error is None for s in samples)


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_later_epochs_read_the_kept_objects_not_the_store(s3_env, kind, image_folder, tmp_path, leaks):
    local = readers.files(image_folder, shuffle=True) if kind == "s3" else None
    remote = _remote(s3_env, kind, image_folder, shuffle=True, chunk_size=16, cache_dir=tmp_path / "cache")
    _object_gets(s3_env, kind)  # the log from here on
    first = await _read_all(remote, epoch=0, seed=2)
    assert len(_object_gets(s3_env, kind)) == OBJECTS
    copies = _copies(tmp_path / "cache")
    assert len(copies) == OBJECTS
    assert set(copies.values()) == {p.read_bytes() for p in image_folder.rglob("*.jpg")}  # byte for byte
    assert (remote.cache.kept, remote.cache.hits) == (OBJECTS, 0)

    second = await _read_all(remote, epoch=1, seed=2)
    assert _object_gets(s3_env, kind) == set()  # every object from the folder
    assert remote.cache.hits == OBJECTS
    if local is not None:
        _same(first, await _read_all(local, epoch=0, seed=2))
        _same(second, await _read_all(local, epoch=1, seed=2))
    assert second[0].source.startswith(f"s3://{BUCKET}/images/" if kind == "s3" else s3_env.http)  # named by URL
    await leaks.check()


async def test_only_the_objects_not_kept_are_fetched_and_a_failed_one_is_not_kept(s3_env, image_folder, tmp_path, leaks):
    cache = tmp_path / "cache"
    local = readers.files(image_folder)
    first = _remote(s3_env, "s3", image_folder, chunk_size=16, cache_dir=cache)
    s3_env.faults("s3", {"match": "/images/c1/", "then": {"kind": "status", "status": 503}})
    samples = await _read_all(first)
    bad = [s for s in samples if s.error is not None]
    assert len(bad) == 25 and all(isinstance(s.error, StorageError) for s in bad)
    assert len(_copies(cache)) == OBJECTS - 25
    s3_env.faults("s3")
    _object_gets(s3_env, "s3")
    # A new reader (a later run): the 50 kept come from the folder, the 25 from the store.
    again = _remote(s3_env, "s3", image_folder, chunk_size=16, cache_dir=cache)
    _same(await _read_all(again), await _read_all(local))
    gets = _object_gets(s3_env, "s3")
    assert len(gets) == 25 and all("/images/c1/" in path for path in gets)
    assert (again.cache.hits, again.cache.kept) == (50, 25)
    await leaks.check()


async def test_cache_bytes_fills_then_keeps_what_it_has(s3_env, image_folder, tmp_path, leaks):
    sizes = sorted(p.stat().st_size for p in image_folder.rglob("*.jpg"))
    bound = sum(sizes[-20:])  # any twenty objects fit, never all 75
    reader = _remote(s3_env, "s3", image_folder, chunk_size=16, cache_dir=tmp_path / "cache", cache_bytes=bound)
    await _read_all(reader, epoch=0)
    copies = _copies(tmp_path / "cache")
    assert 20 <= len(copies) < OBJECTS and sum(map(len, copies.values())) <= bound
    before = dict(copies)
    await _read_all(reader, epoch=1)
    assert _copies(tmp_path / "cache") == before  # full: nothing replaced
    assert reader.cache.hits == len(before)
    await leaks.check()


async def test_leaving_early_with_cache_work_in_flight_leaves_nothing_running(s3_env, image_folder, tmp_path, leaks):
    reader = _remote(s3_env, "s3", image_folder, chunk_size=4, cache_dir=tmp_path / "cache")
    async with contextlib.aclosing(reader.read(0)) as stream:
        async for _ in stream:
            break
    await leaks.check()
    assert all(not f.name.endswith(".part") for sub in (tmp_path / "cache").iterdir() for f in sub.iterdir())


def test_wrong_cache_arguments(tmp_path, image_folder):
    a_file = tmp_path / "file"
    a_file.write_bytes(b"")
    with pytest.raises(ConfigError, match="cache_dir"):
        readers.files(image_folder, cache_dir=a_file / "cache")
    with pytest.raises(ConfigError, match="cache_bytes needs a cache_dir"):
        readers.files(image_folder, cache_bytes=1 << 30)
    with pytest.raises(ConfigError, match="cache_bytes"):
        readers.files(image_folder, cache_dir=tmp_path / "c", cache_bytes=-1)
    assert readers.files(image_folder, cache_dir=tmp_path / "c").cache is None  # local files stay where they are
    assert os.listdir(tmp_path / "c") == []


@pytest.mark.parametrize("reader", ["files", "webdataset"])
async def test_a_loader_running_ahead_across_epochs_with_a_cache(s3_env, image_folder, tmp_path, reader, leaks):
    """Epochs read into each other (two reads of one reader at once): every epoch whole, the same
    batches as a loader without a cache, nothing left running after ``aclose()``."""
    import headrace
    from headrace import ops

    # No faults here: a patient timeout, so that two reads' GETs queued at a loaded test server
    # are not taken for stalls (0.5 s, six times in a row, failed it on the 2-core VM under load).
    retry = {**RETRY, "timeout": 5.0}

    def make(cache_dir):
        if reader == "files":
            source = _remote(s3_env, "s3", image_folder, retry, shuffle=True, chunk_size=8, cache_dir=cache_dir)
        else:
            source = readers.webdataset(f"s3://{BUCKET}/wds/shard-{{000000..000009}}.tar", shuffle=True,
                                        shuffle_buffer=16, storage_options={"retry": retry}, cache_dir=cache_dir)
        return headrace.Loader(source, batch_size=8, pipeline=ops.validation(32), num_threads=2, seed=3,
                               device="cpu", run_ahead=True)

    async def epochs(loader):
        out = []
        async with loader:
            for _ in range(3):
                out.append([key for batch in [b async for b in loader] for key in batch.sample_keys])
        return out

    cached, plain = make(tmp_path / "cache"), make(None)
    got, expected = await epochs(cached), await epochs(plain)
    assert got == expected and all(sorted(e) == sorted(expected[0]) for e in expected)
    assert cached.reader.cache.hits > 0
    await leaks.check()


@pytest.mark.parametrize("reader", ["files", "webdataset"])
async def test_a_nearly_full_disk_stops_the_copies_not_the_reads(s3_env, image_folder, tmp_path, reader, monkeypatch,
                                                                  caplog, leaks):
    from headrace.readers import _cache_folder

    # The disk as a cache sees it when it is nearly full: the reserve it leaves free is all of it.
    monkeypatch.setattr(_cache_folder, "RESERVE_FRACTION", 1.0)
    if reader == "files":
        source = _remote(s3_env, "s3", image_folder, chunk_size=16, cache_dir=tmp_path / "cache")
    else:
        source = readers.webdataset(f"s3://{BUCKET}/wds/shard-{{000000..000009}}.tar",
                                    storage_options={"retry": RETRY}, cache_dir=tmp_path / "cache")
    samples = await _read_all(source)
    assert len(samples) == OBJECTS and all(s.error is None for s in samples)
    assert source.cache.kept == 0 and source.cache.failed > 0
    assert [p for p in (tmp_path / "cache").rglob("*") if p.is_file()] == []
    warnings = [r for r in caplog.records if "not caching" in r.getMessage()]
    assert len(warnings) == 1 and "nearly full" in warnings[0].getMessage()
    await leaks.check()


async def test_with_little_room_for_writes_every_object_is_kept_skipped_or_hit(s3_env, image_folder, tmp_path, leaks):
    # buffer_bytes=1: a chunk's copies are written only when no other chunk's wait to be.
    reader = _remote(s3_env, "s3", image_folder, chunk_size=4, buffer_bytes=1, cache_dir=tmp_path / "cache")
    for epoch in range(20):
        samples = await _read_all(reader, epoch=epoch)
        assert len(samples) == OBJECTS and all(s.error is None for s in samples)
        copies = _copies(tmp_path / "cache")
        assert len(copies) == reader.cache.kept  # every write the read started is done when it ends
        assert reader.cache.kept + reader.cache.skipped + reader.cache.hits == OBJECTS * (epoch + 1)
        if len(copies) == OBJECTS:
            break
    assert len(copies) == OBJECTS  # a skipped chunk is kept by a later epoch
    await leaks.check()


def test_writes_waiting_past_the_bound_are_skipped_and_counted(tmp_path):
    from headrace.readers._object_cache import ObjectCache

    cache = ObjectCache(tmp_path)
    assert cache.reserve(100, 2, bound=10)  # nothing waits: always room, even past the bound
    assert not cache.reserve(1, 1, bound=10) and cache.skipped == 1
    assert cache.reserve(1, 1, bound=101) and cache.skipped == 1
    cache.release(101)
    assert cache.reserve(5, 3, bound=10) and not cache.reserve(6, 4, bound=10) and cache.skipped == 5


async def test_urls_that_differ_in_their_query_are_kept_apart(tmp_path, leaks):
    """An image API or presigned URLs: /img.jpg?id=0 and ?id=1 are two objects, and their copies
    two files (named by the whole URL; the query never shows in a file name)."""
    from test_storage import _http_server

    async def by_id(request):
        from aiohttp import web

        return web.Response(body=b"\xff\xd8\xff image " + request.query["id"].encode())

    async with _http_server(by_id) as base:
        urls = [f"{base}/img.jpg?id={i}&sig=SECRET" for i in range(3)]
        reader = readers.files(urls, labels=[0, 1, 2], cache_dir=tmp_path)
        for epoch in (0, 1):  # the second from the kept copies
            samples = await _read_all(reader, epoch=epoch)
            assert sorted(s.fields["jpg"] for s in samples) == [b"\xff\xd8\xff image " + str(i).encode() for i in range(3)]
            assert all(s.fields["jpg"].endswith(s.fields["cls"]) for s in samples)
    assert reader.cache.hits == 3 and reader.cache.kept == 3
    assert not any("SECRET" in name for name in _copies(tmp_path))
    await leaks.check()


def test_a_copy_cut_short_by_the_file_system_is_not_kept(tmp_path):
    """A write the file system cuts short (here a file size limit, as a disk filling up does): the
    copy is given up and counted, never kept short to be served as whole later. In a child process:
    the limit is the process's."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, resource, signal
        from headrace.readers._object_cache import ObjectCache
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        cache = ObjectCache({str(tmp_path)!r})
        cache.keep([("s3://b/big.jpg", os.urandom(512_003)), ("s3://b/small.jpg", b"small")])
        print(cache.kept, cache.failed, cache.read(["s3://b/big.jpg"]) == [None])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1", "True"]  # given up at the first failure, nothing kept
    assert _copies(tmp_path) == {}


async def test_each_read_hands_its_freed_heap_back_on_the_cache_threads(s3_env, image_folder, tmp_path, monkeypatch,
                                                                         leaks):
    # Why: an epoch that reads the copies back (on the cache's threads) after one that fetched them
    # (on the client's threads) held both allocator high-water marks; the read's end trims them.
    import sys
    import threading

    from headrace._heap import trim_heap

    module = sys.modules["headrace.readers.files"]
    trims: list[str] = []

    def counted() -> None:
        trims.append(threading.current_thread().name)
        trim_heap()  # the real one: glibc's malloc_trim here

    monkeypatch.setattr(module, "trim_heap", counted)
    reader = _remote(s3_env, "s3", image_folder, chunk_size=16, cache_dir=tmp_path / "cache")
    await _read_all(reader, epoch=0)
    await _read_all(reader, epoch=1)
    assert reader.cache.hits == OBJECTS
    async with contextlib.aclosing(reader.read(2)) as stream:  # left early: trimmed all the same
        async for _ in stream:
            break
    assert len(trims) == 3 and all(name.startswith("headrace-io-cache") for name in trims), trims
    await leaks.check()
