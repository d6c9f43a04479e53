"""The storage seam: what every backend (local, S3, HTTP, memory) implements, and how it fails."""

from __future__ import annotations

import asyncio
import contextvars
import math
import re
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from headrace._errors import require_number

__all__ = ["Body", "ObjectInfo", "Store", "StoreFault", "progressed", "redact_url", "scrub", "seconds_option"]

# The try of ``with_retries`` going on in this task: its timeout, and the seconds it allows.
_TRY: contextvars.ContextVar[tuple[asyncio.Timeout, float] | None] = contextvars.ContextVar(
    "headrace_storage_try", default=None)


def progressed() -> None:
    """Bytes arrived: the try going on (``with_retries``) has its whole timeout again from now.

    The timeout bounds a stall, not a download: a large object (a COCO annotation file, a video)
    that streams steadily for longer than ``Retry.timeout`` must not be cut and fetched again.
    """
    current = _TRY.get()
    if current is not None and not current[0].expired():
        current[0].reschedule(asyncio.get_running_loop().time() + current[1])


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One object: its key in the store, its size in bytes and its ETag (None where the store has none)."""

    key: str
    size: int
    etag: str | None = None


class StoreFault(Exception):
    """A backend's failure, already translated and scrubbed of secrets.

    ``retryable``: a timeout, a dropped connection, a 5xx or 429: trying again may work. Otherwise
    (not found, denied, the object changed) it will not. The retry layer turns it into a
    ``StorageError`` naming the URL; it never leaves ``headrace.readers``.
    """

    def __init__(self, message: str, *, retryable: bool, missing: bool = False, denied: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.missing = missing  # the object does not exist (a 404)
        # Access denied (401, 403). S3 answers 403, not 404, for a key that does not exist to a
        # caller who may not list the bucket, and a presigned URL's signature covers its own object
        # only: where an object is optional (``with_retries(missing_ok=True)``), it is taken as absent.
        self.denied = denied


class Body(ABC):
    """An open download: ``next()`` gives the next block of bytes (``b""`` at the end).

    ``whole``: ``rest()`` hands over the rest of the range in one buffer without copying it
    under the GIL (where blocks would be); a later segment of a download, which waits for the
    ones before it anyway, is then read that way.
    """

    size: int  # of the whole object, not of this range
    etag: str | None
    whole: bool = False

    @abstractmethod
    async def next(self) -> bytes | memoryview:
        """The next block; raises StoreFault."""

    async def rest(self) -> bytes | memoryview:
        """The rest of the range at once (before any ``next()``); raises StoreFault."""
        blocks = []
        while block := await self.next():
            blocks.append(block)
        return b"".join(blocks)

    @abstractmethod
    async def aclose(self) -> None:
        """Drop the download (its connection is closed or returned); safe to call twice."""


class Store(ABC):
    """A place objects are read from, by key: ``read``, ``read_range``, ``stream``, ``list``.

    Methods raise ``StoreFault``; they do not retry (``_retry.py`` does, for all stores alike).
    Connections are opened lazily and closed when the last ``session()`` ends, so a store can be
    built anywhere and used from any event loop, one loop at a time.
    """

    scheme: str = ""
    # Bytes one open GET may hold in the client before ``next()`` hands them over: a download counts
    # them against its bound for each GET it has in flight (``_remote_fetch.py``). Zero where
    # ``next()`` makes the block on demand (memory, local files).
    held_per_get: int = 0
    _users: int = 0

    @abstractmethod
    def url(self, key: str) -> str:
        """The object's URL for messages: no credentials, no query string."""

    @abstractmethod
    async def open(self, key: str, start: int = 0, *, end: int | None = None, etag: str | None = None) -> Body:
        """Start downloading ``key`` from byte ``start`` to ``end`` (exclusive; None: the object's end);
        with ``etag``, fail (not retryable) if it changed. A store may send bytes past ``end``
        (a server that ignores Range): the caller stops reading there."""

    async def read_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key``."""
        body = await self.open(key, start, end=end)
        try:
            out = bytearray()
            while len(out) < end - start:
                block = await body.next()
                if not block:
                    break
                progressed()
                out += block
            return bytes(out[: end - start])
        finally:
            await body.aclose()

    async def read(self, key: str) -> bytes:
        """The whole object."""
        body = await self.open(key)
        try:
            blocks = []
            while block := await body.next():
                progressed()
                blocks.append(block)
            return b"".join(blocks)
        finally:
            await body.aclose()

    async def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""
        raise StoreFault(f"{type(self).__name__} cannot list objects (give the URLs)", retryable=False)

    @asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        """Keep connections open for the block; the last session to end closes them (even if cancelled)."""
        self._users += 1
        try:
            yield
        finally:
            self._users -= 1
            if self._users == 0:
                await self._disconnect()

    async def _disconnect(self) -> None:  # noqa: B027 - optional hook: stores without connections have none
        """Close pooled connections; the store reconnects on its next use."""


_USERINFO = re.compile(r"//[^/@]*@")


def redact_url(url: str) -> str:
    """``url`` without user:password and without its query string (presigned URLs carry signatures there)."""
    url = _USERINFO.sub("//", url, count=1)
    parts = urllib.parse.urlsplit(url)
    if parts.query or parts.fragment:
        url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
    return url


def scrub(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with every secret (and every URL query string) replaced by ``***``."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    text = re.sub(r"(https?://[^\s?\"'<>]*)\?[^\s\"'<>]*", r"\1?***", text)
    return _USERINFO.sub("//***@", text)


def seconds_option(name: str, value: object) -> float:
    """A storage option in seconds (``connect_timeout``): a positive, finite number, else a ConfigError
    now, not a client that waits for ever, fails each request or panics in its own runtime later."""
    return require_number(f"storage option {name}", value, 0, math.inf, low_open=True, high_open=True,
                          wanted="a positive number of seconds")
