"""Object storage as a demanding user meets it: servers that ignore If-Match, compress on the fly,
and options that are wrong from the start. Real aiohttp servers on 127.0.0.1, no mocks."""

from __future__ import annotations

import asyncio
import os

import pytest

from headrace import ConfigError, StorageError, readers
from headrace.readers._storage import HttpStore, Retry, S3Store

from sample_data import tar_bytes
from test_storage import _DATED, _http_server, _read_all

RETRY = {"attempts": 4, "backoff": 0.01, "max_backoff": 0.05, "timeout": 5}


def _shard(fill: int) -> bytes:
    """A shard of 40 members of 40 KB each, every byte ``fill``: two versions differ in every member
    but have the same size (a resume by size alone would take either)."""
    return tar_bytes([(f"{i:03d}.bin", bytes([fill]) * 40_000) for i in range(40)])


def _answer(request, data: bytes, etag: str):
    """``data`` as a plain file server sends it: Range honoured, If-Match ignored."""
    from aiohttp import web

    headers = {"ETag": etag, "Accept-Ranges": "bytes", **_DATED}
    spec = request.headers.get("Range")
    if spec is None:
        return 200, data, headers
    first, _, last = spec.removeprefix("bytes=").partition("-")
    start, end = int(first), min(len(data), int(last) + 1) if last else len(data)
    if start >= len(data):
        raise web.HTTPRequestRangeNotSatisfiable()
    return 206, data[start:end], {**headers, "Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}


@pytest.mark.parametrize("client", ["obstore", "aiohttp"])
async def test_a_resume_from_a_server_that_ignores_if_match_never_mixes_two_versions(client, leaks):
    """The first GET drops mid-body; meanwhile the object was replaced by one of the same size, and
    the server answers the resume (Range, If-Match on the first ETag) from the new version anyway.
    The reader must not join the two: the shard ends with a StorageError saying it changed."""
    from aiohttp import web

    old, new = _shard(1), _shard(2)
    assert len(old) == len(new)
    gets = []

    async def replaced_after_the_first_get(request):
        gets.append((request.headers.get("Range"), request.headers.get("If-Match")))
        data, etag = (old, '"v1"') if len(gets) == 1 else (new, '"v2"')
        status, body, headers = _answer(request, data, etag)
        response = web.StreamResponse(status=status, headers={**headers, "Content-Length": str(len(body))})
        await response.prepare(request)
        if len(gets) > 1:
            await response.write(body)
            await response.write_eof()
            return response
        await response.write(body[:600_000])  # then the connection drops
        await asyncio.sleep(0.05)
        if request.transport is not None:  # None: the client gave up first
            request.transport.abort()
        return response

    async with _http_server(replaced_after_the_first_get) as base:
        url = f"{base}/train/shard-0.tar"
        reader = readers.webdataset(url, counts=[40], buffer_bytes=1 << 20,
                                    storage_options={"retry": RETRY, "http_client": client})
        samples = await _read_all(reader)
    assert gets[0] == (None, None) and gets[1][1] == '"v1"'  # the resume was pinned to the first version
    good, bad = [s for s in samples if s.error is None], [s for s in samples if s.error is not None]
    assert all(s.fields["bin"] == bytes([1]) * 40_000 for s in good)  # nothing of the new version
    # counts=[40]: every sample after the cut is a StorageError in its place, the first saying why.
    assert len(samples) == 40 and bad and all(isinstance(s.error, StorageError) for s in bad)
    assert "changed" in str(bad[0].error) and all(s.error.source == url for s in bad)
    await leaks.check()


async def test_a_resume_answered_with_another_size_is_an_error_without_etags(leaks):
    """A server with no ETags at all: a resume answered by an object of another size is another
    object (the bytes after the cut would be someone else's)."""
    from aiohttp import web

    old, new = _shard(1), tar_bytes([(f"{i:03d}.bin", bytes([2]) * 40_000) for i in range(45)])
    gets = 0

    async def no_etags(request):
        nonlocal gets
        gets += 1
        status, body, headers = _answer(request, old if gets == 1 else new, "")
        headers.pop("ETag")
        response = web.StreamResponse(status=status, headers={**headers, "Content-Length": str(len(body))})
        await response.prepare(request)
        await response.write(body if gets > 1 else body[:600_000])
        if gets == 1:
            await asyncio.sleep(0.05)
            if request.transport is not None:
                request.transport.abort()
        else:
            await response.write_eof()
        return response

    async with _http_server(no_etags) as base:
        url = f"{base}/shard.tar"
        reader = readers.webdataset(url, counts=[40], storage_options={"retry": RETRY, "http_client": "aiohttp"})
        samples = await _read_all(reader)
    bad = [s for s in samples if s.error is not None]
    assert all(s.fields["bin"] == bytes([1]) * 40_000 for s in samples if s.error is None)
    assert len(samples) == 40 and bad  # counts=[40]: each sample after the cut an error in its place
    assert "changed" in str(bad[0].error) and "was" in str(bad[0].error)
    await leaks.check()


@pytest.mark.parametrize("how", ["presigned", "aiohttp"])
async def test_objects_come_as_stored_from_a_server_that_compresses_on_the_fly(how, leaks):
    """A JSON index or a CDN compresses what a client says it accepts. The store reads bytes as
    stored (aiohttp's auto-decompression is off so that a .tar.gz stays gzip): it must not say it
    accepts gzip, or the bytes it hands over are compressed ones nobody decodes."""
    from aiohttp import web

    data = b'{"format": "headrace", "shards": [' + b", ".join(b'{"n": %d}' % i for i in range(3000)) + b"]}"
    offered = []

    async def compressing(request):
        offered.append(request.headers.get("Accept-Encoding"))
        status, body, headers = _answer(request, data, '"j"')
        response = web.Response(status=status, body=body, headers=headers, content_type="application/json")
        response.enable_compression()  # as a server does for a client that offers gzip or deflate
        return response

    store = HttpStore(http_client="aiohttp") if how == "aiohttp" else HttpStore()
    query = "?X-Amz-Signature=abc" if how == "presigned" else ""  # a query string goes through aiohttp
    async with _http_server(compressing) as base, store.session():
        assert await store.read(f"{base}/headrace-index.json{query}") == data
        assert await store.read_range(f"{base}/headrace-index.json{query}", 1000, 1100) == data[1000:1100]
    assert offered == ["identity", "identity"]
    await leaks.check()


async def test_an_accept_encoding_header_given_is_sent_as_given():
    from aiohttp import web

    offered = []

    async def record(request):
        offered.append(request.headers.getall("Accept-Encoding"))
        return web.Response(body=b"x", headers=_DATED)

    store = HttpStore(http_client="aiohttp", headers={"accept-encoding": "br"})
    async with _http_server(record) as base, store.session():
        await store.read(f"{base}/x")
    assert offered == [["br"]]


@pytest.mark.parametrize("endpoint", ["minio:9000", "ftp://minio:9000", "http://", "http://minio:port",
                                      "http://mi nio:9000", "not a url"])
def test_a_bad_s3_endpoint_is_a_config_error_when_the_reader_is_made(endpoint, monkeypatch):
    """object_store panics in its own runtime on an endpoint it cannot make a URI of: each GET then
    failed as "rust future panicked" after the whole retry budget, with a Rust backtrace each."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    with pytest.raises(ConfigError, match="storage option endpoint must be an http"):
        readers.files(["s3://bucket/a.jpg"], labels=[0], storage_options={"endpoint": endpoint})
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    with pytest.raises(ConfigError, match="AWS_ENDPOINT_URL_S3 must be an http"):
        readers.files(["s3://bucket/a.jpg"], labels=[0])


def test_a_good_s3_endpoint_is_kept_and_credentials_in_it_are_not_shown(monkeypatch):
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    assert S3Store("b", endpoint="https://minio.local:9000").endpoint == "https://minio.local:9000"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000/")
    assert S3Store("b").endpoint == "http://127.0.0.1:9000/"
    with pytest.raises(ConfigError) as info:
        S3Store("b", endpoint="ftp://user:hunter22@minio:9000")
    assert "hunter22" not in str(info.value)


@pytest.mark.parametrize("options", [{"limit": -1}, {"limit": 0}, {"limit": "many"}, {"limit": True},
                                     {"connect_timeout": -1}, {"connect_timeout": 0}, {"connect_timeout": "x"},
                                     {"connect_timeout": float("nan")}])
def test_wrong_http_options_are_config_errors(options):
    option = next(iter(options))
    with pytest.raises(ConfigError, match=f"storage option {option} must be"):
        readers.files(["http://127.0.0.1:1/a.jpg"], labels=[0], storage_options=options)


def test_wrong_s3_and_retry_options_are_config_errors(monkeypatch):
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    with pytest.raises(ConfigError, match="connect_timeout"):
        S3Store("b", connect_timeout=-5)
    S3Store("b", connect_timeout="10s")  # obstore's own duration strings pass through
    for field in ("timeout", "backoff", "max_backoff"):
        with pytest.raises(ConfigError, match=f"retry {field}"):
            Retry(**{field: float("nan")})
    with pytest.raises(ConfigError, match="storage_options must be a dict"):
        readers.files(["s3://b/a.jpg"], labels=[0], storage_options=["endpoint", "http://x"])


async def test_a_good_http_limit_still_bounds_the_connections(leaks):
    """The checked ``limit`` still reaches aiohttp's connector: 2 connections for 6 GETs at once."""
    from aiohttp import web

    open_now = peak = 0

    async def slow(request):
        nonlocal open_now, peak
        open_now += 1
        peak = max(peak, open_now)
        await asyncio.sleep(0.05)
        open_now -= 1
        return web.Response(body=b"y", headers=_DATED)

    store = HttpStore(http_client="aiohttp", limit=2)
    async with _http_server(slow) as base, store.session():
        got = await asyncio.gather(*(store.read(f"{base}/{i}") for i in range(6)))
    assert got == [b"y"] * 6 and peak == 2
    await leaks.check()


@pytest.mark.parametrize("client", ["obstore", "aiohttp"])
async def test_objects_a_server_streams_chunked_are_read_whole_and_a_cut_one_is_retried(client, leaks):
    """A dynamic server or a proxy sends an object chunked, without a Content-Length. ``files()``
    reads objects whole and needs no size: they are read, and a stream cut before its last chunk
    is a fault retried, never a short object."""
    from aiohttp import web

    image = os.urandom(300_000)
    served = []

    async def chunked(request):
        served.append(request.path)
        response = web.StreamResponse(headers={"ETag": '"c"', **_DATED})
        response.enable_chunked_encoding()
        await response.prepare(request)
        cut = request.path.endswith("cut.jpg") and served.count(request.path) == 1
        for offset in range(0, len(image), 64 << 10):
            await response.write(image[offset : offset + (64 << 10)])
            if cut and offset >= 128 << 10:
                await asyncio.sleep(0.05)
                if request.transport is not None:  # the first GET of cut.jpg drops before its last chunk
                    request.transport.abort()
                return response
        await response.write_eof()
        return response

    async with _http_server(chunked) as base:
        urls = [f"{base}/c0/a.jpg", f"{base}/c0/cut.jpg"]
        reader = readers.files(urls, labels=[0, 0], storage_options={"retry": RETRY, "http_client": client})
        samples = await _read_all(reader)
    assert [s.error for s in samples] == [None, None]
    assert [s.fields["jpg"] for s in samples] == [image, image]
    assert served.count("/c0/cut.jpg") == 2  # cut once, read whole the second time
    await leaks.check()
