"""HTTP(S) objects: through obstore where it is installed and the URL is a plain one, through aiohttp
otherwise (any URL: presigned query strings too, servers that ignore Range)."""

from __future__ import annotations

import asyncio
import datetime
import importlib.util
import operator
import re
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

from headrace._errors import ConfigError

from ._base import Body, Store, StoreFault, progressed, redact_url, scrub, seconds_option
from ._obstore import BLOCK, HELD_PER_GET, ObstoreBody, fault, open_body, prepare_runtime, read_whole

__all__ = ["HttpStore"]

_OPTIONS = {"headers", "connect_timeout", "limit", "http_client"}
_CLIENTS = ("auto", "obstore", "aiohttp")
# obstore's errors for a server it cannot read the way a range GET needs (the whole object answered
# to a range, no Content-Range, no Content-Length): aiohttp reads such a server instead.
_NOT_FOR_OBSTORE = ("non-partial response", "Range request not supported", "Header missing from response",
                    "Content-Range header not present")
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class HttpStore(Store):
    """Objects by URL; a key is the full ``http://`` or ``https://`` URL.

    ``options``: ``headers`` (sent with every request, e.g. ``Authorization``; never shown),
    ``connect_timeout`` (seconds, default 10), ``limit`` (aiohttp's connections, default 256: as
    many as a reader's ``requests`` may use), ``http_client``: ``"auto"`` (obstore, where it is
    installed, for a plain URL: no query string, user, percent-escape, empty or dot path segment;
    aiohttp for any other, sent as given), ``"obstore"`` (the same, obstore required) or
    ``"aiohttp"``. obstore receives off the GIL, on its own threads: over a server 50 ms away,
    shards streamed 1.3x faster through it than through aiohttp, whose every socket read is a
    callback on the event loop (2-core VM). A download is resumed with ``Range: bytes=N-`` and
    ``If-Match`` (the first answer's ETag); a server that ignores Range (or leaves out the
    headers obstore needs) is read through aiohttp from then on, from the start and the first N
    bytes dropped. aiohttp asks for the object as stored (``Accept-Encoding: identity``, unless
    ``headers`` say otherwise), as obstore does. A download needs the object's size (a
    Content-Length or Content-Range); ``read`` of a whole object does not, so an object a server
    streams chunked is read too. HTTP has no listing.
    """

    scheme = "http"
    # A block of next(): obstore's (see _obstore.py), larger than aiohttp's (up to BLOCK taken from
    # what it buffered, and the socket read it began with: BLOCK + 256 KiB).
    held_per_get = HELD_PER_GET

    def __init__(self, **options: Any) -> None:
        unknown = set(options) - _OPTIONS
        if unknown:
            raise ConfigError(f"unknown HTTP storage options {sorted(unknown)}; known: {sorted(_OPTIONS)}")
        if importlib.util.find_spec("aiohttp") is None:
            raise ConfigError("reading http(s):// needs aiohttp: pip install 'headrace[http]'")
        self._headers = dict(options.get("headers") or {})
        self._session_headers = _identity_encoding(self._headers)
        self._connect_timeout = seconds_option("connect_timeout", options.get("connect_timeout", 10))
        self._limit = _connection_limit(options.get("limit", 256))
        self._secrets = [str(v) for v in self._headers.values()]
        client = options.get("http_client", "auto")
        if client not in _CLIENTS:
            raise ConfigError(f"storage option http_client must be one of {', '.join(_CLIENTS)}, got {client!r}")
        has_obstore = importlib.util.find_spec("obstore") is not None
        if client == "obstore" and not has_obstore:
            raise ConfigError("storage option http_client='obstore' needs obstore: pip install 'headrace[http]'")
        self._use_obstore = client == "obstore" or (client == "auto" and has_obstore)
        self._obstores: dict[str, Any] = {}  # an obstore HTTPStore per origin
        self._aiohttp_only: set[str] = set()  # origins obstore could not read (see _NOT_FOR_OBSTORE)
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
                headers=self._session_headers,
            )
            self._loop = loop
        return self._session

    async def open(self, key: str, start: int = 0, *, end: int | None = None, etag: str | None = None) -> Body:
        body = await self._open_obstore(key, start, end, etag)
        return body if body is not None else await self._open_aiohttp(key, start, end, etag)

    async def read(self, key: str) -> bytes:
        """The whole object; through obstore in one call, off the GIL (a small object: one hand-off;
        a large one block by block, so a slow link does not time it out: ``read_whole``)."""
        body = await self._open_obstore(key, 0, None, None)
        if body is None:
            # The whole object needs no size up front: one a server streams chunked (no
            # Content-Length: a dynamic server, a proxy) is read to its end. A body cut short is
            # still an error: aiohttp checks the chunked framing as it does a Content-Length.
            body = await self._open_aiohttp(key, 0, None, None, sized=False)
            try:
                return b"".join([block async for block in _blocks(body)])
            finally:
                await body.aclose()
        try:
            return await read_whole(body)
        finally:
            await body.aclose()

    async def _open_obstore(self, key: str, start: int, end: int | None, etag: str | None) -> ObstoreBody | None:
        """obstore's download of ``key``; None where aiohttp reads it: a URL that is not a plain
        one, or an origin obstore cannot read (from then on)."""
        place = self._obstore_place(key)
        if place is None:
            return None
        origin, path = place
        try:
            return await open_body(self._obstore(origin), path, start, end, etag, self._obstore_fault)
        except Exception as exc:  # obstore raises its own tree; translate it here
            if any(marker in str(exc) for marker in _NOT_FOR_OBSTORE):
                self._aiohttp_only.add(origin)
                return None
            raise self._obstore_fault(exc) from None

    def _obstore_place(self, key: str) -> tuple[str, str] | None:
        """(origin, path) where obstore reads ``key``; None where aiohttp does."""
        if not self._use_obstore:
            return None
        parts = urllib.parse.urlsplit(key)
        if parts.query or parts.fragment or "@" in parts.netloc or parts.scheme not in ("http", "https"):
            return None  # a presigned URL, or credentials in it: as given, through aiohttp
        origin = f"{parts.scheme}://{parts.netloc}"
        path = parts.path.lstrip("/")
        # obstore parses a path into its own segments and encodes them again on the way out: a path
        # it would refuse (empty, ".", ".." segments, a trailing slash) or might send otherwise than
        # given (percent-escapes: "%2F" is not "/") goes as given, through aiohttp.
        if origin in self._aiohttp_only or "%" in path or {"", ".", ".."} & set(path.split("/")):
            return None
        return origin, path

    def _obstore(self, origin: str) -> Any:
        store = self._obstores.get(origin)
        if store is None:
            prepare_runtime()
            from obstore.store import HTTPStore

            client = {"allow_http": True, "connect_timeout": datetime.timedelta(seconds=self._connect_timeout),
                      # Whole-request timeout: ours (Retry.timeout) bounds every block instead.
                      "timeout": "24h", "default_headers": self._headers}
            store = self._obstores[origin] = HTTPStore.from_url(
                origin, client_options=client, retry_config={"max_retries": 0})  # ours resume from the offset
        return store

    def _obstore_fault(self, exc: BaseException) -> StoreFault:
        return fault(exc, self._secrets, missing="no such object (HTTP 404)")

    async def _open_aiohttp(self, key: str, start: int, end: int | None, etag: str | None, *,
                            sized: bool = True) -> Body:
        """aiohttp's GET; ``sized=False``: the caller reads to the end and needs no size (it may be -1)."""
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
            size, skip = self._check(response, start, sized)
        except BaseException:
            response.release()
            raise
        return _HttpBody(self, response, size, response.headers.get("ETag"), skip)

    def _check(self, response: Any, start: int, sized: bool = True) -> tuple[int, int]:
        """The object's size (-1 when not ``sized`` and the server did not say) and the bytes to drop,
        or the StoreFault the answer means."""
        status = response.status
        if status == 206:
            match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
            if not match or int(match.group(1)) != start or match.group(3) == "*":
                raise StoreFault(f"bad Content-Range {response.headers.get('Content-Range')!r}", retryable=True)
            return int(match.group(3)), 0
        if status == 200:
            length = response.headers.get("Content-Length")
            if length is None and not sized:
                return -1, start
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
        raise StoreFault(f"HTTP {status} {response.reason or ''}".strip(), retryable=retryable,
                         denied=status in (401, 403))

    def _fault(self, exc: BaseException) -> StoreFault:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return StoreFault(scrub(text, self._secrets)[:500], retryable=True)

    async def _disconnect(self) -> None:
        self._obstores = {}  # dropping the Rust stores drops their connection pools
        session, self._session = self._session, None
        if session is not None and not session.closed and self._loop is asyncio.get_running_loop():
            await session.close()


async def _blocks(body: Body) -> AsyncIterator[bytes | memoryview]:
    while block := await body.next():
        progressed()  # a slow link's long download is not a stall
        yield block


def _connection_limit(value: Any) -> int:
    """The ``limit`` option: aiohttp reads 0 as no limit at all, and a negative one is no count."""
    try:
        limit = operator.index(value) if not isinstance(value, bool) else 0
    except TypeError:
        limit = 0
    if limit < 1:
        raise ConfigError(f"storage option limit must be a positive int (connections), got {value!r}")
    return limit


def _identity_encoding(headers: dict[str, str]) -> dict[str, str]:
    """The aiohttp session's headers: the user's, asking for the object as stored unless they say otherwise.

    aiohttp offers gzip and deflate by default, and a server that compresses on the fly (a JSON
    index, a CDN) would then send bytes nobody decodes (``auto_decompress`` is off: a ``.tar.gz``
    stays gzip), its Content-Length and ranges counting the compressed ones. obstore asks for none.
    """
    if any(name.lower() == "accept-encoding" for name in headers):
        return dict(headers)
    return {"Accept-Encoding": "identity", **headers}


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
        """``block`` plus whatever else has arrived, up to ``BLOCK``, without waiting.

        aiohttp hands over socket reads of ~64 KiB; a block per loop iteration costs the loop a GIL
        hand-off from the parsing thread, so fewer, larger blocks stream faster (see ``_obstore.BLOCK``).
        """
        content = self._response.content
        parts, size = [block], len(block)
        while size < BLOCK:
            more = content.read_nowait(BLOCK - size)
            if not more:
                break
            parts.append(more)
            size += len(more)
        return block if len(parts) == 1 else b"".join(parts)

    async def aclose(self) -> None:
        response, self._response = self._response, None
        if response is not None:
            response.close()  # not release(): the body is unread, the connection cannot be reused
