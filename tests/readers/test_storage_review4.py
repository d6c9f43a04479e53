"""Object storage under faults, fourth review: a whole object (``files()``, a COCO annotation file,
a shard index, a video) read over a slow link. ``Retry.timeout`` bounds a stall, as documented; a
large object that keeps bringing bytes must not be cut for taking longer than it.

Real servers on 127.0.0.1 in a child process: ``object_server.py`` (a bandwidth cap per connection)
and ``storage_servers.py`` (moto and an HTTP server behind the fault proxy). No test asserts a time:
the cap makes the download take longer than the timeout, whatever the machine.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from headrace import StorageError, readers
from headrace.readers._storage import Retry, S3Store, with_retries

from object_server import object_server
from storage_servers import ACCESS_KEY, BUCKET, SECRET_KEY
from test_storage import _read_all

# 10 MiB at 4 MB/s a connection: over 2.6 s in all, a 1 MiB block every ~0.26 s. The timeout (1.5 s)
# is far above a block's time and below the object's.
SIZE = 10 << 20
MBPS = 4
RETRY = {"attempts": 2, "backoff": 0.01, "max_backoff": 0.05, "timeout": 1.5}


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    root = tmp_path_factory.mktemp("capped")
    data = os.urandom(SIZE)
    (root / "big").mkdir()
    (root / "big" / "annotations.bin").write_bytes(data)
    with object_server(root, BUCKET, mbps=MBPS) as url:
        yield url, data


@pytest.fixture
def s3_at(capped, monkeypatch):
    url, data = capped
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    for name, value in (("AWS_ACCESS_KEY_ID", ACCESS_KEY), ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
                        ("AWS_REGION", "us-east-1"), ("AWS_ENDPOINT_URL_S3", url)):
        monkeypatch.setenv(name, value)
    return url, data


@pytest.mark.parametrize(("kind", "client"), [("s3", None), ("http", "obstore"), ("http", "aiohttp")])
async def test_a_large_object_on_a_slow_link_is_read_whole_not_timed_out(s3_at, kind, client, leaks):
    """Before, each try of a whole object was bounded by the timeout in all: a 10 MiB object
    arriving steadily at 4 MB/s failed every try ('no answer within 1.5 s', though bytes came
    throughout), and the budget was spent downloading it again and again."""
    url, data = s3_at
    source = f"s3://{BUCKET}/big/annotations.bin" if kind == "s3" else f"{url}/{BUCKET}/big/annotations.bin"
    options = {"retry": RETRY} | ({"http_client": client} if client else {})
    reader = readers.files([source], labels=[0], storage_options=options)
    samples = await _read_all(reader)
    assert len(samples) == 1 and samples[0].error is None, samples[0].error
    assert samples[0].fields["bin"] == data
    await leaks.check()


async def test_a_large_range_on_a_slow_link_is_read_not_timed_out(s3_at, leaks):
    """``read_range`` (a video's bytes, a tar member) the same: a long range that keeps coming."""
    _, data = s3_at
    store, retry = S3Store(BUCKET), Retry(**RETRY)
    async with store.session():
        got = await with_retries(lambda: store.read_range("big/annotations.bin", 100, SIZE - 100), retry,
                                 store.url("big/annotations.bin"))
    assert got == data[100:-100]
    await leaks.check()


@pytest.mark.parametrize("client", ["obstore", "aiohttp"])
async def test_a_stall_in_the_middle_of_a_whole_object_still_times_out_and_is_retried(s3_env, client, leaks):
    """The timeout given again with each block still ends a stall: the proxy sends 2 MiB of the
    12 MiB object, then nothing; the try times out, the next one reads it whole."""
    s3_env.faults("http", {"match": "big-0", "faults": [{"kind": "stall", "after": 2 << 20, "seconds": 4}]})
    source = f"{s3_env.http}/big/big-0.tar"
    options = {"retry": {**RETRY, "attempts": 3, "timeout": 1}, "http_client": client}
    reader = readers.files([source], labels=[0], storage_options=options)
    samples = await _read_all(reader)
    assert samples[0].error is None, samples[0].error
    assert samples[0].fields["tar"] == (s3_env.root / "big" / "big-0.tar").read_bytes()
    assert [r["fault"] is not None for r in s3_env.log("http") if "big-0" in r["path"]] == [True, False]
    await leaks.check()


async def test_a_whole_object_that_stops_coming_names_why(s3_env):
    """Past the budget, the error says nothing arrived (not 'no answer': the answer came)."""
    s3_env.faults("http", {"match": "big-0", "then": {"kind": "stall", "after": 1 << 20, "seconds": 4}})
    source = f"{s3_env.http}/big/big-0.tar"
    reader = readers.files([source], labels=[0], storage_options={"retry": {**RETRY, "attempts": 1, "timeout": 0.5},
                                                                  "http_client": "aiohttp"})
    error = (await _read_all(reader))[0].error
    assert isinstance(error, StorageError) and error.source == source
    assert "nothing arrived within 0.5 s" in str(error)


# -- an optional object the store will not show ------------------------------------------------------

SIGNATURE = "presigned-signature-never-shown-4242"


@pytest.mark.parametrize("client", ["obstore", "aiohttp"])
async def test_presigned_shard_urls_are_read_though_the_index_beside_them_is_refused(client, caplog, leaks):
    """A presigned URL's signature covers its own object: the index the reader looks for beside
    the shards goes unsigned and the store refuses it (403), as S3 refuses a missing key to a caller
    who may not list the bucket. Before, that refusal failed the reader's construction with a
    StorageError about an index the user never asked for; the shards were readable."""
    import concurrent.futures

    from aiohttp import web

    from sample_data import tar_bytes
    from test_storage import _DATED, _http_server

    shards = [tar_bytes([(f"s{k}_{i}.bin", bytes([k, i]) * 500) for i in range(3)]) for k in range(2)]
    asked = []

    async def signed_only(request):
        asked.append(request.path)
        if request.query.get("X-Amz-Signature") != SIGNATURE:
            return web.Response(status=403, text="<Error><Code>AccessDenied</Code></Error>")
        return web.Response(body=shards[int(request.path[-5])], headers=_DATED)

    async with _http_server(signed_only) as base:
        urls = [f"{base}/d/shard-{k}.tar?X-Amz-Signature={SIGNATURE}&X-Amz-Expires=600" for k in range(2)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # made off the loop: it GETs the index
            reader = await asyncio.get_running_loop().run_in_executor(
                pool, lambda: readers.webdataset(urls, storage_options={"retry": RETRY, "http_client": client}))
        samples = await _read_all(reader)
    assert "/d/headrace-index.json" in asked  # it was looked for, refused, and taken as absent
    assert [(s.key, s.fields["bin"]) for s in samples] == [
        (f"s{k}_{i}", bytes([k, i]) * 500) for k in range(2) for i in range(3)]
    assert all(SIGNATURE not in r.getMessage() for r in caplog.records)
    await leaks.check()


async def test_an_s3_index_denied_is_taken_as_absent_and_denied_shards_are_errors_not_retried(s3_env, leaks):
    """Over S3 the same: the index denied, the shards read (75 samples, len() unknown). A shard
    denied is a StorageError naming it, asked for once (no retry: it will not heal)."""
    s3_env.faults("s3", {"match": "headrace-index", "then": {"kind": "status", "status": 403}})
    reader = readers.webdataset(f"s3://{BUCKET}/wds/", storage_options={"retry": RETRY})
    samples = await _read_all(reader)
    assert len(samples) == 75 and all(s.error is None for s in samples)
    s3_env.log("s3")
    s3_env.faults("s3", {"match": "shard-000003", "then": {"kind": "status", "status": 403}})
    reader = readers.webdataset(f"s3://{BUCKET}/wds/", storage_options={"retry": {**RETRY, "attempts": 5}})
    samples = await _read_all(reader)
    bad = [s for s in samples if s.error is not None]
    assert len(samples) == 75 and bad and all(isinstance(s.error, StorageError) for s in bad)
    assert bad[0].error.source == f"s3://{BUCKET}/wds/shard-000003.tar" and "access denied" in str(bad[0].error)
    assert sum("shard-000003" in r["path"] for r in s3_env.log("s3")) == 1
    await leaks.check()
