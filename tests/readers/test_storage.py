"""Object storage: WebDataset shards and image files over S3 (moto's server) and HTTP (aiohttp),
through a proxy that drops, fails and stalls requests; and the retry layer on the in-memory store."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import random
import tarfile
import traceback

import pytest

import headrace
from headrace import ConfigError, ReadError, StorageError, readers
from headrace.readers._read_files import copy_spans
from headrace.readers._storage import HttpStore, RemoteFile, S3Store
from headrace.readers._storage._remote import Span
from headrace.testing import MemoryStore

from sample_data import tar_bytes
from storage_servers import ACCESS_KEY, BUCKET, SECRET_KEY as SECRET, TOKEN, no_new_sockets, open_sockets

# Fast retries: the proxy's faults are deterministic, waiting long proves nothing.
RETRY = {"attempts": 6, "backoff": 0.01, "max_backoff": 0.05, "timeout": 0.5}
WDS = "wds/shard-{000000..000009}.tar"


async def _read_all(reader, epoch=0, start=0, seed=0):
    async with contextlib.aclosing(reader.read(epoch, start=start, seed=seed)) as stream:
        return [s async for chunk in stream for s in chunk]


def _same(samples, expected):
    assert [(s.key, s.index, s.position) for s in samples] == [(s.key, s.index, s.position) for s in expected]
    for s, e in zip(samples, expected):
        assert s.error is None, s.error
        assert s.fields == e.fields


def _url(servers, kind, key):
    return f"s3://{BUCKET}/{key}" if kind == "s3" else f"{servers.http}/{key}"


# The stores and clients a fault must be survived through: HTTP goes through obstore where it is
# installed (and the URL is a plain one), through aiohttp when asked or for any other URL.
CLIENTS = pytest.mark.parametrize(("kind", "client"), [("s3", {}), ("http", {}), ("http", {"http_client": "aiohttp"})],
                                  ids=["s3", "http", "http-aiohttp"])


# -- reading --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_shards_stream_from_storage_like_local_ones(s3_env, kind, leaks):
    local = readers.webdataset(str(s3_env.root / WDS), shuffle=True, shuffle_buffer=20)
    remote = readers.webdataset(_url(s3_env, kind, WDS), shuffle=True, shuffle_buffer=20,
                                storage_options={"retry": RETRY})
    assert len(remote) == len(local) == 75  # counts from the headrace-index.json beside the shards
    samples = await _read_all(remote, epoch=1, seed=3)
    _same(samples, await _read_all(local, epoch=1, seed=3))
    assert samples[0].source.startswith(f"s3://{BUCKET}/wds/" if kind == "s3" else s3_env.http)
    gets = [r for r in s3_env.log(kind) if r["path"].endswith(".tar")]
    assert len(gets) == 10 and all(r["range"] is None for r in gets)  # one streamed GET per shard
    await leaks.check()


async def test_bucket_folders_and_globs_are_listed(s3_env):
    expected = [f"s3://{BUCKET}/wds/shard-{i:06d}.tar" for i in range(10)]
    assert readers.webdataset(f"s3://{BUCKET}/wds/").shards == expected
    assert readers.webdataset(f"s3://{BUCKET}/wds/shard-00000[0-2].tar").shards == expected[:3]
    with pytest.raises(ReadError) as info:
        readers.webdataset(f"s3://{BUCKET}/nothing-here/")
    assert info.value.source == f"s3://{BUCKET}/nothing-here/"
    with pytest.raises(StorageError):
        readers.webdataset(s3_env.http + "/wds/")  # HTTP has no listing


async def test_explicit_endpoint_and_credentials_without_environment(s3_env, monkeypatch):
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name)
    options = {"endpoint": s3_env.s3_direct, "access_key_id": ACCESS_KEY, "secret_access_key": SECRET}
    reader = readers.webdataset(f"s3://{BUCKET}/{WDS}", storage_options=options)
    assert len(await _read_all(reader)) == 75
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.s3_direct)  # the generic override works too
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    assert len(readers.webdataset(f"s3://{BUCKET}/{WDS}")) == 75
    with pytest.raises(ConfigError, match="unknown storage_options"):
        readers.webdataset(f"s3://{BUCKET}/{WDS}", storage_options={"endpont": "x"})


async def test_counts_scan_reads_remote_headers(s3_env):
    assert len(readers.webdataset(f"{s3_env.http}/big/big-0.tar", counts="scan")) == 48
    unknown = readers.webdataset(f"s3://{BUCKET}/big/big-0.tar")
    with pytest.raises(TypeError):
        len(unknown)
    assert [s.key for s in await _read_all(unknown, start=45)] == ["0045", "0046", "0047"]  # resume scans once


async def test_resume_from_storage_is_exact(s3_env):
    reader = readers.webdataset(f"s3://{BUCKET}/{WDS}", shuffle=True, shuffle_buffer=10)
    full = await _read_all(reader, epoch=2)
    for start in (1, 37, 74):
        _same(await _read_all(reader, epoch=2, start=start), full[start:])


def test_sync_facade_over_s3(s3_env):
    from headrace import ops

    source = readers.webdataset(f"s3://{BUCKET}/{WDS}", shuffle=True, shuffle_buffer=16)
    loader = headrace.Loader(source, batch_size=16, pipeline=ops.training(32), num_threads=2, device="cpu")
    with loader.sync() as batches:
        keys = [k for batch in batches for k in batch.sample_keys]
    assert sorted(keys) == sorted(f"c{c}/{i:04d}" for c in range(3) for i in range(25))


async def test_loader_over_http_resumes_exactly(s3_env, leaks):
    import torch

    from headrace import ops

    def loader():
        source = readers.webdataset(f"{s3_env.http}/{WDS}", shuffle=True, shuffle_buffer=16)
        return headrace.Loader(source, batch_size=8, pipeline=ops.training(32), num_threads=2, seed=5, device="cpu")

    async with loader() as whole:
        batches = [b async for b in whole]
    first = loader()
    async for batch in first:
        if batch.index == 3:
            break
    state = first.state_dict()
    await first.aclose()
    second = loader()
    second.load_state_dict(state)
    rest = [b async for b in second]
    await second.aclose()
    for x, y in zip(batches[4:], rest, strict=True):
        assert x.sample_keys == y.sample_keys and torch.equal(x["image"], y["image"])
    await leaks.check()


# -- faults ----------------------------------------------------------------------------------------

FAULTS = [{"kind": "reset", "after": 1500}, {"kind": "status", "status": 503},
          {"kind": "reset", "after": 0}, {"kind": "status", "status": 500}]


@CLIENTS
async def test_faults_within_budget_lose_and_double_nothing(s3_env, kind, client, leaks):
    sockets = open_sockets()
    s3_env.faults(kind, {"match": "shard-000004", "faults": [{"kind": "stall", "after": 2000, "seconds": 3}]},
                  {"match": "shard-", "faults": FAULTS})
    local = readers.webdataset(str(s3_env.root / WDS), shuffle=True, shuffle_buffer=20)
    remote = readers.webdataset(_url(s3_env, kind, WDS), shuffle=True, shuffle_buffer=20,
                                storage_options={"retry": RETRY, **client})
    _same(await _read_all(remote, seed=9), await _read_all(local, seed=9))
    log = [r for r in s3_env.log(kind) if r["path"].endswith(".tar")]
    assert sum(r["fault"] is not None for r in log) == 9 * len(FAULTS) + 1
    assert remote.retries >= 9 * len(FAULTS) + 1  # more only if the machine stalled a read past the timeout
    if client:  # aiohttp hands over bytes that arrive before a drop: the next GET resumes from there
        assert any(r["range"] not in (None, "bytes=0-") for r in log)  # (obstore, a block at a time)
    await leaks.check()
    await no_new_sockets(sockets)


@CLIENTS
async def test_faults_beyond_budget_give_a_storage_error_and_shut_down(s3_env, kind, client, leaks):
    from headrace import ops

    s3_env.faults(kind, {"match": "shard-000002", "then": {"kind": "status", "status": 503}})
    remote = readers.webdataset(_url(s3_env, kind, WDS), storage_options={"retry": RETRY, **client})
    samples = await _read_all(remote)
    bad = [s for s in samples if s.error is not None]
    # The index counts shard 2's 8 samples: each place is a StorageError naming it (the first with
    # the cause), and every other shard is whole, so the epoch keeps its 75.
    assert len(bad) == 8 and all(isinstance(s.error, StorageError) for s in bad)
    assert all(s.error.source == s.source == remote._names[2] for s in bad)
    assert "6 times" in str(bad[0].error) and "503" in str(bad[0].error)
    assert len(samples) == 75
    loader = headrace.Loader(readers.webdataset(_url(s3_env, kind, WDS), storage_options={"retry": RETRY, **client}),
                             batch_size=8, pipeline=ops.training(32), num_threads=2, device="cpu")
    with pytest.raises(StorageError) as info:
        async for _ in loader:
            pass
    assert info.value.source.endswith("shard-000002.tar")
    await loader.aclose()
    await leaks.check()


async def test_a_big_shard_streams_in_bounded_memory_and_resumes_mid_body(s3_env, leaks):
    s3_env.faults("s3", {"match": "big-0", "faults": [{"kind": "reset", "after": 3 << 20},
                                                      {"kind": "stall", "after": 1 << 20, "seconds": 3}]})
    reader = readers.webdataset(f"s3://{BUCKET}/big/big-0.tar", buffer_bytes=1 << 20, chunk_size=2,
                                storage_options={"retry": RETRY})
    with tarfile.open(s3_env.root / "big" / "big-0.tar") as tar:
        expected = {m.name: tar.extractfile(m).read() for m in tar}
    n = 0
    async with contextlib.aclosing(reader.read(0)) as stream:
        async for chunk in stream:
            for s in chunk:
                assert s.fields["bin"] == expected[f"{s.key}.bin"]
                n += 1
            await asyncio.sleep(0.005)  # a slow consumer: the download must wait, not pile up
    assert n == 48
    log = [r for r in s3_env.log("s3") if "big-0" in r["path"]]
    # One streamed GET, then GETs from offsets: the two resumes (and, when the machine is loaded
    # enough to starve the parser, ranged GETs of segments ahead).
    assert len(log) >= 3 and log[0]["range"] is None
    assert all(int(r["range"][6:].split("-")[0]) > 0 for r in log[1:])
    assert 0 < reader.peak_buffered <= (2 << 20) + (64 << 10)  # the bound, plus at most one block
    await leaks.check()


@CLIENTS
async def test_cancelling_a_stalled_download_closes_everything(s3_env, kind, client, leaks):
    s3_env.faults(kind, {"match": "shard-", "then": {"kind": "stall", "after": 100, "seconds": 3}})
    reader = readers.webdataset(_url(s3_env, kind, WDS), read_ahead=3,
                                storage_options={"retry": {"timeout": 30}, **client})
    sockets = open_sockets()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.3):
            await _read_all(reader)
    await leaks.check()
    await no_new_sockets(sockets)


# -- the files reader over a bucket ----------------------------------------------------------------


async def test_files_reader_lists_a_bucket_prefix(s3_env, image_folder, leaks):
    local = readers.files(image_folder, shuffle=True)
    remote = readers.files(f"s3://{BUCKET}/images/", shuffle=True, chunk_size=16,
                           storage_options={"retry": RETRY})
    assert remote.classes == local.classes and len(remote) == len(local) == 75
    s3_env.faults("s3", {"match": "/images/c1/", "faults": [{"kind": "status", "status": 503},
                                                             {"kind": "reset", "after": 100}]})
    samples = await _read_all(remote, seed=4)
    expected = await _read_all(local, seed=4)
    assert [s.key for s in samples] == [s.key for s in expected]
    assert [s.fields for s in samples] == [s.fields for s in expected]
    assert samples[0].source.startswith(f"s3://{BUCKET}/images/c")
    await leaks.check()


async def test_files_reader_over_urls_names_a_missing_object(s3_env, image_folder):
    paths = sorted(p.relative_to(image_folder).as_posix() for p in image_folder.rglob("*.jpg"))[:3]
    urls = [f"{s3_env.http}/images/{p}" for p in paths] + [f"{s3_env.http}/images/c0/missing.jpg?sig={SECRET}"]
    samples = await _read_all(readers.files(urls, labels=[0, 1, 2, 3], storage_options={"retry": RETRY}))
    assert [s.fields["jpg"] for s in samples[:3]] == [(image_folder / p).read_bytes() for p in paths]
    error = samples[3].error
    assert isinstance(error, StorageError) and "404" in str(error)
    assert error.source == f"{s3_env.http}/images/c0/missing.jpg" and SECRET not in str(error)


# -- secrets -----------------------------------------------------------------------------------------


async def test_credentials_never_appear_in_errors_reprs_or_logs(s3_env, caplog):
    caplog.set_level(logging.DEBUG)
    s3_env.faults("s3", {"match": "shard-", "then": {"kind": "status", "status": 503}})
    s3_env.faults("http", {"match": "shard-", "then": {"kind": "status", "status": 503}})
    options = {"retry": {**RETRY, "attempts": 2}, "session_token": TOKEN,
               "headers": {"Authorization": f"Bearer {SECRET}"}}
    texts = []
    for url in (f"s3://{BUCKET}/wds/shard-000000.tar", f"{s3_env.http}/wds/shard-000000.tar?X-Amz-Signature={SECRET}",
                f"s3://{BUCKET}/wds/no-such-shard.tar"):
        reader = readers.webdataset(url, storage_options=options)
        texts += [repr(reader), str(reader.state_dict()), repr(reader.storage)]
        for store in {id(reader.storage.locate(p)[0]): reader.storage.locate(p)[0] for p in reader.shards}.values():
            texts.append(repr(store))
        failed = [s for s in await _read_all(reader) if s.error is not None]  # a place each, with counts
        assert failed
        for sample in failed:
            texts += [str(sample.error), repr(sample.error), sample.source, sample.key,
                      "".join(traceback.format_exception(sample.error))]
    texts += [r.getMessage() for r in caplog.records]
    assert any("retry 1/1" in t for t in texts)  # the retries were logged...
    for text in texts:  # ...and nothing anywhere shows a secret
        for secret in (SECRET, TOKEN):
            assert secret not in text, text


# -- the retry layer on the in-memory store ----------------------------------------------------------


@pytest.fixture
def memory_shards():
    return {f"m/s-{k}.tar": tar_bytes([(f"{k}_{i:03d}.jpg", bytes([k, i]) * (1000 + i)) for i in range(30)])
            for k in range(3)}


async def test_memory_store_resets_stalls_and_5xx_resume_from_the_offset(memory_shards, leaks):
    store = MemoryStore(memory_shards, block=1000, fail={"m/s-1.tar": [
        ("reset", 5000), ("status", 503), ("stall", 20000), ("reset", 0), ("status", 500)]})
    reader = readers.webdataset("m/s-{0..2}.tar", store=store, buffer_bytes=1 << 16,
                                storage_options={"retry": {**RETRY, "timeout": 0.1}})
    samples = await _read_all(reader)
    assert [s.key for s in samples] == [f"{k}_{i:03d}" for k in range(3) for i in range(30)]
    assert all(s.fields["jpg"] == bytes([int(s.key[0]), int(s.key[2:])]) * (1000 + int(s.key[2:])) for s in samples)
    assert [start for key, start in store.opens if key == "m/s-1.tar"] == [0, 5000, 5000, 25000, 25000, 25000]
    assert reader.retries == 5
    await leaks.check()


async def test_later_segments_read_whole_resume_after_faults_and_stream_after_a_timeout(leaks):
    # A body that can hand over its range whole (as S3's does, uncopied) is read that way for the
    # segments behind the head. A reset or a 503 during such a read costs nothing (no byte was
    # delivered: the retry asks for the same range). The segment at 1 MiB comes whole only after
    # the timeout, every time (a link slower than it was observed), while the head streams slowly
    # before it: its retry reads it block by block, whose progress the timeout then watches.
    data = tar_bytes([(f"{i:03d}.bin", bytes([i]) * (100_000 + i)) for i in range(80)])  # ~8 MB
    slow = 1 << 20
    reads: list[tuple[int, str]] = []

    class WholeStore(MemoryStore):
        async def open(self, key, start=0, *, end=None, etag=None):
            body = await super().open(key, start, end=end, etag=etag)
            body.whole = True
            plain_rest, plain_next = body.rest, body.next
            inside = False

            async def rest():
                nonlocal inside
                reads.append((start, "whole"))
                if start == slow:
                    await asyncio.sleep(1)  # past the 0.2 s timeout
                inside = True
                return await plain_rest()

            async def next_block():
                if not inside and (start, "blocks") not in reads:
                    reads.append((start, "blocks"))
                if start == 0:
                    await asyncio.sleep(0.02)  # the head's 16 blocks take ~0.3 s: the slow segment stays behind it
                return await plain_next()

            body.rest, body.next = rest, next_block
            return body

    # Opens in order: the head at 0, then the segments at 1, 2, 3 MiB (2 MiB reset, 3 MiB 503).
    store = WholeStore({"big.tar": data}, block=64 << 10,
                       fail={"big.tar": [None, None, ("reset", 300_000), ("status", 503)]})
    reader = readers.webdataset("big.tar", store=store, buffer_bytes=4 << 20, chunk_size=4,
                                storage_options={"retry": {**RETRY, "timeout": 0.2}})
    link = reader.files.link  # as if an earlier epoch had observed the store: segments from the start
    link.pieces, link.latency, link._bytes, link._seconds = 4, 0.001, 1e9, 1.0
    samples = await _read_all(reader)
    assert [(s.key, s.fields["bin"]) for s in samples] == [(f"{i:03d}", bytes([i]) * (100_000 + i)) for i in range(80)]
    assert reader.retries == 3  # the reset, the 503, the timeout
    whole = [start for start, how in reads if how == "whole"]
    assert len(whole) > 3 and all(start % (1 << 20) == 0 for start in whole)  # segments of 1 MiB, whole
    assert (2 << 20, "whole") in reads  # reset midway: asked again (whole, or streamed once it leads)
    assert reads.count((slow, "whole")) == 1 and (slow, "blocks") in reads  # timed out, then streamed
    await leaks.check()


async def test_memory_store_budget_and_a_changed_object(memory_shards):
    store = MemoryStore(memory_shards, fail={"m/s-0.tar": [("status", 503)] * 3})
    reader = readers.webdataset("m/s-{0..2}.tar", store=store, storage_options={"retry": {**RETRY, "attempts": 3}})
    (bad,) = [s for s in await _read_all(reader) if s.error]
    assert isinstance(bad.error, StorageError) and bad.error.source == "memory://m/s-0.tar"

    class Changing(MemoryStore):  # the object is replaced between the drop and the resume
        async def open(self, key, start=0, *, etag=None):
            if start:
                self.objects[key] = self.objects[key][:-512] + b"x" * 512
            return await super().open(key, start, etag=etag)

    store = Changing(memory_shards, block=1000, fail={"m/s-1.tar": [("reset", 4000)]})
    samples = await _read_all(readers.webdataset("m/s-1.tar", store=store, storage_options={"retry": RETRY}))
    assert isinstance(samples[-1].error, StorageError) and "changed" in str(samples[-1].error)
    assert all(s.error is None for s in samples[:-1])


class _Asking(MemoryStore):
    """A memory store that records each GET: (key, start, end, the ETag it was pinned to)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.asked: list[tuple[str, int, int | None, str | None]] = []

    async def open(self, key, start=0, *, end=None, etag=None):
        self.asked.append((key, start, end, etag))
        return await super().open(key, start, end=end, etag=etag)


def _firsts(store: _Asking, since: int) -> dict[str, list[str | None]]:
    """Per shard, the ETags of the GETs from byte 0 asked after ``since`` GETs."""
    out: dict[str, list[str | None]] = {}
    for key, start, _, etag in store.asked[since:]:
        if start == 0 and key.endswith(".tar"):  # not the reader's look for an index of counts
            out.setdefault(key, []).append(etag)
    return out


async def test_a_later_epoch_asks_with_the_remembered_etag_and_starts_again_if_refused(memory_shards, leaks):
    store = _Asking(memory_shards, block=1000)
    reader = readers.webdataset("m/s-{0..2}.tar", store=store, storage_options={"retry": RETRY})
    first = await _read_all(reader)
    assert _firsts(store, 0) == {key: [None] for key in memory_shards}
    etags = {key: store._etag(key, data) for key, data in memory_shards.items()}

    asked = len(store.asked)
    _same(await _read_all(reader, epoch=1), first)
    assert _firsts(store, asked) == {key: [etags[key]] for key in memory_shards}  # pinned from the start

    # Replaced between epochs (other size, other bytes): refused for the ETag, then asked plainly.
    store.objects["m/s-1.tar"] = tar_bytes([(f"new_{i:03d}.jpg", b"n" * (700 + i)) for i in range(12)])
    asked = len(store.asked)
    samples = await _read_all(reader, epoch=2)
    assert all(s.error is None for s in samples)
    assert [s.key for s in samples if s.key.startswith("new")] == [f"new_{i:03d}" for i in range(12)]
    assert all(s.fields["jpg"] == b"n" * (700 + int(s.key[4:])) for s in samples if s.key.startswith("new"))
    assert _firsts(store, asked)["m/s-1.tar"] == [etags["m/s-1.tar"], None]

    # Gone between epochs: the same error as without a remembered ETag, naming the URL.
    del store.objects["m/s-2.tar"]
    samples = await _read_all(reader, epoch=3)
    assert [s.error.source for s in samples if s.error] == ["memory://m/s-2.tar"]
    assert "no such object" in str(samples[-1].error)
    await leaks.check()


async def test_a_store_that_ignores_if_match_is_caught_by_the_answers_size_and_etag(leaks):
    class Ignoring(_Asking):  # serves whatever the object is now, whatever ETag was asked for
        async def open(self, key, start=0, *, end=None, etag=None):
            return await super().open(key, start, end=end)

    def shard(n: int, fill: int) -> bytes:  # MiB-sized: ranged GETs of 1 MiB segments
        return tar_bytes([(f"{i:03d}.jpg", bytes([fill, i]) * 50_000) for i in range(n)])

    store = Ignoring({"m/s-0.tar": shard(40, 1)}, block=64 << 10)
    reader = readers.webdataset("m/s-0.tar", store=store, storage_options={"retry": RETRY})
    await _read_all(reader)
    reader.files.link.pieces = 4  # as if the first epoch's parser had waited: GETs at once
    # Smaller now: ranged GETs planned to the remembered size would ask past its end.
    store.objects["m/s-0.tar"] = shard(25, 2)
    samples = await _read_all(reader, epoch=1)
    assert [s.error for s in samples if s.error] == []
    assert [s.fields["jpg"] for s in samples] == [bytes([2, i]) * 50_000 for i in range(25)]
    assert reader.retries == 0  # no GET asked past the end, to be answered with nothing
    await leaks.check()


async def test_a_remembered_object_gets_its_ranged_gets_before_the_first_answer():
    from headrace.readers._storage._remote_fetch import Link

    class Gated(_Asking):  # the GET from byte 0 waits for the gate
        gate = asyncio.Event()

        async def open(self, key, start=0, *, end=None, etag=None):
            if start == 0:
                self.asked.append((key, start, end, etag))
                await self.gate.wait()
                return await MemoryStore.open(self, key, start, end=end, etag=etag)
            return await super().open(key, start, end=end, etag=etag)

    data = os.urandom(8 << 20)
    store = Gated({"k": data}, block=64 << 10)
    link = Link()
    link.pieces = 4  # what an earlier download of the read came to
    link.remember("memory://k", len(data), store._etag("k", data))
    remote = RemoteFile(store, "k", capacity=8 << 20, link=link)  # 1 MiB segments
    task = asyncio.create_task(remote.fill())
    for _ in range(20):
        await asyncio.sleep(0)
    # The first GET has no answer yet, and the ranged GETs after it went out, pinned to the ETag
    # (the ones answered at once free their GET for the next segments).
    assert [start for _, start, _, _ in store.asked[:4]] == [0, 1 << 20, 2 << 20, 3 << 20]
    assert {etag for *_, etag in store.asked} == {store._etag("k", data)}
    store.gate.set()

    def consume():
        with remote:
            return remote.read(-1)

    assert await asyncio.to_thread(consume) == data
    await task


async def test_remote_file_jumps_over_long_skips_with_a_range_request():
    data = bytes(range(256)) * (64 << 10)  # 16 MiB
    store = MemoryStore({"k": data}, block=64 << 10)
    remote = RemoteFile(store, "k", capacity=1 << 20, jump=1 << 20)
    task = asyncio.create_task(remote.fill())

    def consume():
        with remote:
            out = [remote.read(10)]
            remote.seek(8 << 20, 1)  # far ahead: reopened there
            out.append(remote.read(10))
            remote.seek(100, 1)  # near: read through
            out.append(remote.read(3))
            return out, remote.tell(), remote.size

    out, pos, size = await asyncio.to_thread(consume)
    await task
    assert out == [data[:10], data[(8 << 20) + 10 : (8 << 20) + 20], data[(8 << 20) + 120 : (8 << 20) + 123]]
    assert pos == (8 << 20) + 123 and size == len(data)
    assert store.opens == [("k", 0), ("k", (8 << 20) + 10)]


async def test_remote_file_peeks_across_blocks_without_consuming():
    data = bytes(range(256)) * 64
    store = MemoryStore({"k": data}, block=100)
    remote = RemoteFile(store, "k", capacity=1 << 20)
    task = asyncio.create_task(remote.fill())

    def consume():
        with remote:
            looks = [remote.peek(2)]
            remote.read(95)
            looks.append(remote.peek(250))  # the rest of one block and the next two
            looks.append(remote.read(250))
            remote.seek(len(data) - 3)
            looks.append(remote.peek(10))  # fewer at the end
            return looks

    looks = await asyncio.to_thread(consume)
    await task
    assert looks == [data[:2], data[95:345], data[95:345], data[-3:]]


async def test_remote_file_hands_out_spans_within_a_block_and_copies_otherwise():
    data = bytes(range(256)) * 1024  # 256 KiB, delivered in blocks of 64 KiB
    store = MemoryStore({"k": data}, block=64 << 10)
    remote = RemoteFile(store, "k", capacity=1 << 20)
    task = asyncio.create_task(remote.fill())

    def consume():
        with remote:
            small = remote.take(100)  # under SPAN_MIN: copied at once
            inside = remote.take(10_000)  # within the first block
            across = remote.take(60_000)  # from the first block into the second
            rest = remote.take(len(data))  # to the end, across blocks
            return small, inside, across, rest, remote.tell()

    small, inside, across, rest, pos = await asyncio.to_thread(consume)
    await task
    assert type(small) is bytes and small == data[:100]
    assert isinstance(inside, Span) and bytes(inside.view) == data[100:10_100] and len(inside) == 10_000
    assert type(across) is bytes and across == data[10_100:70_100]
    assert type(rest) is bytes and rest == data[70_100:] and pos == len(data)
    # The span's address is where its bytes are: copy_spans makes them a bytes of their own.
    copied = copy_spans([(inside.address, len(inside))])
    if copied is not None:  # None only without a C compiler
        assert type(copied[0]) is bytes and copied[0] == data[100:10_100]


@pytest.mark.parametrize("helper", [True, False], ids=["c-helper", "python"])
async def test_remote_shard_members_are_bytes_of_their_own(tmp_path, monkeypatch, helper, leaks):
    # Members of 5-20 KB in blocks of 64 KiB: most lie in one block (handed out uncopied, then
    # copied a chunk at a time), some cross two (copied at once); every field ends up its own bytes.
    rng = random.Random(7)
    members = [(f"{i:04d}.{ext}", rng.randbytes(rng.randrange(5_000, 20_000) if ext == "jpg" else 3))
               for i in range(150) for ext in ("jpg", "cls")]
    shard = tar_bytes(members)
    (tmp_path / "s.tar").write_bytes(shard)
    copied = []  # the spans each chunk handed to the copy

    def copy(spans):
        copied.append(len(spans))
        return copy_spans(spans) if helper else None

    monkeypatch.setattr("headrace.readers._shard_files.copy_spans", copy)
    monkeypatch.setattr("headrace.readers._shard_files.SamplePool.copy", lambda self, spans: None)  # the plain copy
    monkeypatch.setattr("headrace.readers._shard_files.SamplePool.grouper", lambda self: None)  # spans, not the C grouping
    store = MemoryStore({"m/s.tar": shard}, block=64 << 10)
    remote = await _read_all(readers.webdataset("m/s.tar", store=store, shuffle=False, chunk_size=16))
    by_remote = copied[:]
    local = await _read_all(readers.webdataset(str(tmp_path / "s.tar"), shuffle=False))
    _same(remote, local)
    assert all(type(v) is bytes for s in remote + local for v in s.fields.values())
    assert len(by_remote) == 10 and 100 < sum(by_remote) < 150  # a call a chunk; the jpgs crossing a block copied at once
    await leaks.check()


def test_wrong_storage_arguments():
    with pytest.raises(ConfigError):
        readers.webdataset("ftp://host/x.tar")
    with pytest.raises(ConfigError):
        readers.webdataset("s3:///x.tar")
    with pytest.raises(ConfigError):
        readers.webdataset("s3://b/x.tar", storage_options={"retry": {"attempts": 0}})
    with pytest.raises(ConfigError):
        readers.webdataset("x.tar", store=object())
    with pytest.raises(ConfigError):
        S3Store("b", secret="x")
    assert "x" not in repr(S3Store("b", secret_access_key="x" * 8))
    with pytest.raises(ConfigError, match="http_client"):
        readers.webdataset("http://127.0.0.1:1/x.tar", storage_options={"http_client": "curl"})


@contextlib.asynccontextmanager
async def _http_server(handler):
    """A real aiohttp server on 127.0.0.1 answering every GET with ``handler``; yields its base URL."""
    from aiohttp import web

    app = web.Application()
    app.router.add_get("/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


def _client(request) -> str:
    return "aiohttp" if "aiohttp" in request.headers.get("User-Agent", "") else "obstore"


_DATED = {"Last-Modified": "Sat, 28 Nov 2026 00:00:00 GMT"}  # obstore's HTTP store needs it


async def test_http_paths_reach_the_server_as_given(leaks):
    """A plain path goes through obstore; one obstore would parse and encode otherwise than given
    (percent-escapes, empty or dot segments, a trailing slash) and a query string go through
    aiohttp, so the server sees exactly the URL the user wrote."""
    from aiohttp import web

    async def echo(request):
        return web.Response(body=f"{_client(request)} {request.raw_path}".encode(), headers=_DATED)

    paths = ("/data/train-0001.tar", "/data/a%2Fb.tar", "/data/a%20b.tar", "/data//x.tar", "/data/dir/",
             "/data/x.tar?sig=1")
    store = HttpStore()
    async with _http_server(echo) as base, store.session():
        got = [(await store.read(base + path)).decode() for path in paths]
    assert got == ["obstore /data/train-0001.tar"] + [f"aiohttp {path}" for path in paths[1:]]
    await leaks.check()


async def test_a_server_that_ignores_range_is_read_through_aiohttp(leaks):
    """obstore reads a plain URL; answered a range request with the whole object, the store reads
    that origin through aiohttp from then on, which drops the bytes before the range."""
    from aiohttp import web

    data = os.urandom(100_000)
    seen = []

    async def whole(request):
        seen.append((request.headers.get("Range"), _client(request)))
        return web.Response(body=data, headers={"ETag": '"v1"', **_DATED})

    store = HttpStore()
    async with _http_server(whole) as base, store.session():
        assert await store.read(base + "/blob") == data
        assert await store.read_range(base + "/blob", 10, 20) == data[10:20]
        assert await store.read_range(base + "/blob", 5, 9) == data[5:9]
    assert seen == [(None, "obstore"), ("bytes=10-19", "obstore"), ("bytes=10-19", "aiohttp"), ("bytes=5-8", "aiohttp")]
    await leaks.check()


async def test_a_wait_for_bytes_going_on_counts_as_waiting():
    # The parser's pace is bytes read per second of not waiting: a look taken while the thread
    # still waits (the download's GETs answer late) must not count that wait as the thread busy.
    remote = RemoteFile(MemoryStore({"k": b"x" * 100}), "k")  # its download not started: no bytes come
    reading = asyncio.create_task(asyncio.to_thread(remote.read, 10))
    try:
        for _ in range(5000):
            if remote.waited > 0:
                break
            await asyncio.sleep(0.001)
        assert not reading.done() and remote.waited > 0
    finally:
        remote.close_from_loop()  # the read raises: the thread is not left waiting
    with pytest.raises(ReadError):
        await reading


def test_segments_are_an_eighth_of_the_bound_within_1_to_4_mib():
    from headrace.readers._storage._remote_fetch import segment_bytes

    assert segment_bytes(64 << 20) == 4 << 20  # at most 4 MiB: more pieces read at once
    assert segment_bytes(1 << 30) == 4 << 20
    assert segment_bytes(24 << 20) == 3 << 20
    assert segment_bytes(8 << 20) == 1 << 20  # the default buffer
    assert segment_bytes(4 << 20) == 1 << 20  # and 1 MiB at least


def test_the_link_is_observed_before_the_reads_own_gets():
    from headrace.readers._storage._remote_fetch import Link

    link = Link()
    link.answered(0.05)
    link.received(100 << 20, 1.0)  # ~105 MB/s a connection
    link.pieces = 2  # a download grew: what the read's own GETs do to the link is not observed
    link.answered(0.5)
    assert link.latency == 0.05


async def test_listed_keys_are_read_as_they_are_named_and_globs_stop_at_slashes(tmp_path, monkeypatch, leaks):
    """An s3:// URL names its key literally (as the AWS CLI, s3fs and obstore read one): a listed
    key holding "%20" is that object, not one with a space. A glob's "*" stays inside one folder."""
    from storage_servers import serving

    names = ["plain.jpg", "sp ace.jpg", "plus+1.jpg", "ünï.jpg", "lit%20eral.jpg", "a%2Bb.jpg", "pct%.jpg",
             "lit eral.jpg"]  # "lit%20eral" and "lit eral" both: each must be itself
    for name in names:
        (tmp_path / "odd" / "c0").mkdir(parents=True, exist_ok=True)
        (tmp_path / "odd" / "c0" / name).write_bytes(b"\xff\xd8\xff" + name.encode())
    for folder in ("train", "train/val"):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        for i in range(2):
            (tmp_path / folder / f"{i}.tar").write_bytes(tar_bytes([(f"{folder.replace('/', '_')}{i}.cls", b"1")]))
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    with serving(tmp_path) as urls:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", urls["s3_direct"])
        samples = await _read_all(readers.files(f"s3://{BUCKET}/odd/", shuffle=False))
        assert sorted(s.key for s in samples) == sorted(f"c0/{n[:-4]}" for n in names)
        assert all(s.error is None and s.fields["jpg"] == b"\xff\xd8\xff" + s.key[3:].encode() + b".jpg"
                   for s in samples)
        assert {s.source for s in samples} == {f"s3://{BUCKET}/odd/c0/{n}" for n in names}
        shards = readers.webdataset(f"s3://{BUCKET}/train/*.tar").shards
        assert shards == [f"s3://{BUCKET}/train/{i}.tar" for i in range(2)]  # not train/val/
        assert len(readers.webdataset(f"s3://{BUCKET}/train/*/*.tar").shards) == 2
    await leaks.check()


async def test_shard_urls_that_differ_in_their_query_are_remembered_apart(leaks):
    """The reader remembers each shard's size and ETag between epochs: by its URL as given, query
    and all (?v=1 and ?v=2 are two objects of two sizes)."""
    from aiohttp import web

    shards = {str(v): tar_bytes([(f"v{v}_{i}.cls", str(i).encode() * (100 * v)) for i in range(3 * v)])
              for v in (1, 2)}

    gets = []

    async def by_version(request):
        if request.query.get("v") not in shards:  # the index beside the shards: none here
            return web.Response(status=404)
        gets.append(request.query["v"])
        data = shards[request.query["v"]]
        start, end = 0, len(data)
        if "Range" in request.headers:
            first, _, last = request.headers["Range"].removeprefix("bytes=").partition("-")
            start, end = int(first), min(end, int(last) + 1 if last else end)
            return web.Response(status=206, body=data[start:end], headers={
                "Content-Range": f"bytes {start}-{end - 1}/{len(data)}", "ETag": f'"{request.query["v"]}"', **_DATED})
        return web.Response(body=data, headers={"ETag": f'"{request.query["v"]}"', **_DATED})

    async with _http_server(by_version) as base:
        # Made off the loop: the reader looks for the shards' index (a blocking GET) and this loop serves it.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reader = await asyncio.get_running_loop().run_in_executor(
                pool, readers.webdataset, [f"{base}/shard.tar?v=1", f"{base}/shard.tar?v=2"])
        for epoch in range(3):  # the later epochs with the sizes remembered
            gets.clear()
            keys = [s.key for s in await _read_all(reader, epoch=epoch)]
            assert keys == [f"v1_{i}" for i in range(3)] + [f"v2_{i}" for i in range(6)], (epoch, keys)
            assert sorted(gets) == ["1", "2"], (epoch, gets)  # one GET a shard: no remembered size refused
    await leaks.check()
