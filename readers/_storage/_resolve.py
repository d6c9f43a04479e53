"""From what a user writes (a URL, or a key with ``store=``) to a store and a key."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

from headrace._errors import ConfigError

from ._base import Store
from ._http import HttpStore
from ._retry import Retry
from ._s3 import S3Store

__all__ = ["Storage", "is_url", "run_sync"]

T = TypeVar("T")
_HTTP_ONLY = {"headers", "limit", "http_client"}
_S3_ONLY = {"endpoint", "region", "access_key_id", "secret_access_key", "session_token", "skip_signature",
            "virtual_hosted_style_request", "allow_http", "credential_provider", "request_payer"}
_SCHEMES = ("s3://", "http://", "https://", "memory://")


def is_url(source: str | os.PathLike) -> bool:
    """True for a source headrace reads through a store (``file://`` and plain paths are local)."""
    return isinstance(source, str) and source.startswith(_SCHEMES)


class Storage:
    """The stores one reader uses: ``store`` for every source if given, else one per bucket or origin.

    ``options`` (``storage_options=``): S3 options (see ``S3Store``), HTTP options (``headers``,
    ``limit``, ``http_client``), ``connect_timeout``, and ``retry`` (a ``Retry``, a dict of its fields, or an attempt
    count). Holds no connection itself: ``session()`` opens them for a block and closes them after.
    """

    def __init__(self, options: Mapping[str, Any] | None = None, store: Store | None = None) -> None:
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(f"storage_options must be a dict of options, got {type(options).__name__}")
        options = dict(options or {})
        if store is not None and not isinstance(store, Store):
            raise ConfigError(f"store must be a headrace.readers Store, got {type(store).__name__}")
        self.retry = Retry.of(options.pop("retry", None))
        unknown = set(options) - _HTTP_ONLY - _S3_ONLY - {"connect_timeout"}
        if unknown:
            raise ConfigError(f"unknown storage_options {sorted(unknown)}; known: "
                              f"{sorted(_HTTP_ONLY | _S3_ONLY | {'connect_timeout', 'retry'})}")
        self._options = options
        self.store = store
        self._stores: dict[str, Store] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # options may hold secrets: never shown
        return f"Storage({self.store!r})" if self.store is not None else f"Storage({len(self._stores)} stores)"

    def __deepcopy__(self, memo: dict) -> Storage:
        return self  # stateless but for its lazily made stores: sharing them is right

    def locate(self, source: str) -> tuple[Store, str]:
        """The store serving ``source`` and its key there. Raises ConfigError for a URL it cannot read."""
        if self.store is not None:
            return self.store, self._key_in(self.store, source)
        scheme, bucket, key = _object_url(source)
        if scheme == "s3":
            if not bucket:
                raise ConfigError(f"an s3:// URL needs a bucket: {source!r}")
            root = f"s3://{bucket}"
            with self._lock:
                if root not in self._stores:
                    s3 = {k: v for k, v in self._options.items() if k not in _HTTP_ONLY}
                    self._stores[root] = S3Store(bucket, **s3)
            return self._stores[root], key
        if scheme in ("http", "https"):
            with self._lock:
                if "http" not in self._stores:
                    http = {k: v for k, v in self._options.items() if k in _HTTP_ONLY or k == "connect_timeout"}
                    self._stores["http"] = HttpStore(**http)
            return self._stores["http"], source
        raise ConfigError(f"no store for {source!r}: use s3://, http(s)://, a local path, or pass store=")

    @staticmethod
    def _key_in(store: Store, source: str) -> str:
        if store.scheme == "http" or "://" not in source:
            return source
        scheme, netloc, key = _object_url(source)
        bucket = getattr(store, "bucket", None)
        if scheme != store.scheme or (bucket is not None and netloc != bucket):
            raise ConfigError(f"{source!r} is not in the store given ({store!r})")
        return key if bucket is not None else source.partition("://")[2].lstrip("/")

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[None]:
        """Connections of this reader's stores stay open for the block, then close (even on cancel).

        Readers ``locate`` every source when they are built, so every store they use is known here.
        """
        stores = [self.store] if self.store is not None else list(self._stores.values())
        async with contextlib.AsyncExitStack() as stack:
            for store in stores:
                await stack.enter_async_context(store.session())
            yield


def run_sync(call: Callable[[], Awaitable[T]]) -> T:
    """Run ``call()`` to completion from sync code (a reader's constructor listing a bucket).

    With no loop running here it gets ``asyncio.run``; inside a running loop (a reader built in
    ``async def main``) a short-lived thread runs its own loop, joined before this returns.
    """

    async def main() -> T:
        return await call()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    box: list[Any] = []

    def target() -> None:
        try:
            box.append((True, asyncio.run(main())))
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller's thread
            box.append((False, exc))

    thread = threading.Thread(target=target, name="headrace-storage-setup")
    thread.start()
    thread.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _object_url(source: str) -> tuple[str, str, str]:
    """(scheme, bucket, key) of ``scheme://bucket/key``, the key as written: an object store's URL
    names its key literally (as the AWS CLI, s3fs and obstore read one), so "%20", "?" and "#" are
    part of the key. Decoding escapes, as a web URL's, read a listed key "a%20b.jpg" as "a b.jpg":
    another object, or none."""
    scheme, _, rest = source.partition("://")
    bucket, _, key = rest.partition("/")
    return scheme.lower(), bucket, key.lstrip("/")
