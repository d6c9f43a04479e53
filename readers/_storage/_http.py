"""HTTP(S) objects through aiohttp: pure asyncio, any URL (presigned query strings too), Range requests."""

from __future__ import annotations

import asyncio
import importlib.util
import re
from typing import Any

from headrace._errors import ConfigError

from ._base import Body, Store, StoreFault, redact_url, scrub

__all__ = ["HttpStore"]

_OPTIONS = {"headers", "connect_timeout", "limit"}
_BLOCK = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class HttpStore(Store):
    """Objects by URL; a key is the full ``http://`` or ``https://`` URL.

    ``options``: ``headers`` (sent with every request, e.g. ``Authorization``; never shown),
    ``connect_timeout`` (seconds, default 10), ``limit`` (connections, default 256: as many as a
    reader's ``requests`` may use). A download is
    resumed with ``Range: bytes=N-`` and ``If-Match`` (the first answer's ETag); a server that
    ignores Range is read from the start and the first N bytes dropped. HTTP has no listing.
    """

    scheme = "http"
    # A block of next(): up to _BLOCK taken from what aiohttp buffered, and the socket read it began with.
    held_per_get = _BLOCK + (256 << 10)

    def __init__(self, **options: Any) -> None:
        unknown = set(options) - _OPTIONS
        if unknown:
            raise ConfigError(f"unknown HTTP storage options {sorted(unknown)}; known: {sorted(_OPTIONS)}")
        if importlib.util.find_spec("aiohttp") is None:
            raise ConfigError("reading http(s):// needs aiohttp: pip install 'headrace[http]'")
        self._headers = dict(options.get("headers") or {})
        self._connect_timeout = float(options.get("connect_timeout", 10))
        self._limit = int(options.get("limit", 256))
        self._secrets = [str(v) for v in self._headers.values()]
        self._session: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return "HttpStore()"

    def url(self, key: str) -> str:
        return redact_url(key)

    def _client(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            # A session belongs to one loop; the sync facade runs readers on a loop of its own.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._limit),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout),
                auto_decompress=False,  # shards are bytes; a .tar.gz stays gzip for the tar reader
                headers=self._headers,
            )
            self._loop = loop
        return self._session

    async def open(self, key: str, start: int = 0, *, end: int | None = None, etag: str | None = None) -> Body:
        import aiohttp

        headers = {}
        if end is not None:
            headers["Range"] = f"bytes={start}-{end - 1}"
        elif start:
            headers["Range"] = f"bytes={start}-"
        if etag is not None:
            headers["If-Match"] = etag
        try:
            response = await self._client().get(key, headers=headers, allow_redirects=True)
        except (aiohttp.ClientError, OSError) as exc:
            raise self._fault(exc) from None
        try:
            size, skip = self._check(response, start)
        except BaseException:
            response.release()
            raise
        return _HttpBody(self, response, size, response.headers.get("ETag"), skip)

    def _check(self, response: Any, start: int) -> tuple[int, int]:
        """The object's size and the bytes to drop, or the StoreFault the answer means."""
        status = response.status
        if status == 206:
            match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
            if not match or int(match.group(1)) != start or match.group(3) == "*":
                raise StoreFault(f"bad Content-Range {response.headers.get('Content-Range')!r}", retryable=True)
            return int(match.group(3)), 0
        if status == 200:
            length = response.headers.get("Content-Length")
            if length is None:
                raise StoreFault("the server sent no Content-Length (the size is needed)", retryable=False)
            return int(length), start
        if status == 404:
            raise StoreFault("no such object (HTTP 404)", retryable=False, missing=True)
        if status == 412:
            raise StoreFault("the object changed while it was read (ETag mismatch, HTTP 412)", retryable=False)
        if status == 416 and start:
            raise StoreFault(f"range starting at {start} is past the end (HTTP 416)", retryable=False)
        retryable = status >= 500 or status in (408, 429)
        raise StoreFault(f"HTTP {status} {response.reason or ''}".strip(), retryable=retryable)

    def _fault(self, exc: BaseException) -> StoreFault:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return StoreFault(scrub(text, self._secrets)[:500], retryable=True)

    async def _disconnect(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed and self._loop is asyncio.get_running_loop():
            await session.close()


class _HttpBody(Body):
    def __init__(self, store: HttpStore, response: Any, size: int, etag: str | None, skip: int) -> None:
        self._owner = store
        self._response = response
        self._skip = skip
        self.size = size
        self.etag = etag

    async def next(self) -> bytes | memoryview:
        import aiohttp

        if self._response is None:
            return b""
        try:
            while True:
                block = await self._response.content.readany()
                if not block:
                    self._response.release()
                    self._response = None
                    return b""
                if self._skip >= len(block):
                    self._skip -= len(block)
                    continue
                if self._skip:
                    block, self._skip = block[self._skip :], 0
                return self._coalesce(block)
        except (aiohttp.ClientError, OSError) as exc:
            raise self._owner._fault(exc) from None

    def _coalesce(self, block: bytes) -> bytes:
        """``block`` plus whatever else has arrived, up to ``_BLOCK``, without waiting.

        aiohttp hands over socket reads of ~64 KiB; a block per loop iteration costs the loop a GIL
        hand-off from the parsing thread, so fewer, larger blocks stream faster (see ``_s3._BLOCK``).
        """
        content = self._response.content
        parts, size = [block], len(block)
        while size < _BLOCK:
            more = content.read_nowait(_BLOCK - size)
            if not more:
                break
            parts.append(more)
            size += len(more)
        return block if len(parts) == 1 else b"".join(parts)

    async def aclose(self) -> None:
        response, self._response = self._response, None
        if response is not None:
            response.close()  # not release(): the body is unread, the connection cannot be reused
