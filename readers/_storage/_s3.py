"""S3 and S3-compatible stores, through obstore (Rust ``object_store``: requests, TLS and signing
run on its own threads, off the GIL; its futures are awaited on our loop and dropped on cancel)."""

from __future__ import annotations

import datetime
import importlib.util
import os
import urllib.parse
from typing import Any

from headrace._errors import ConfigError

from ._base import Body, ObjectInfo, Store, StoreFault, redact_url, seconds_option
from ._obstore import HELD_PER_GET, fault, open_body, prepare_runtime, read_whole

__all__ = ["S3Store"]

_SECRET_KEYS = ("secret_access_key", "session_token", "access_key_id")
_OPTIONS = {"endpoint", "region", "access_key_id", "secret_access_key", "session_token", "skip_signature",
            "virtual_hosted_style_request", "allow_http", "credential_provider", "connect_timeout", "request_payer"}
class S3Store(Store):
    """Objects in one S3 bucket.

    Credentials, region and endpoint come from ``options`` first, then from the standard AWS
    environment: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
    ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL_S3`` then ``AWS_ENDPOINT_URL`` (an
    S3-compatible store), web identity (``AWS_WEB_IDENTITY_TOKEN_FILE``), ECS container credentials
    and the EC2 instance metadata service. Profiles in ``~/.aws``: pass ``credential_provider`` (e.g.
    ``obstore.auth.boto3.Boto3CredentialProvider(boto3.Session(profile_name=...))``).

    ``options``: ``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ``session_token``,
    ``skip_signature`` (public buckets), ``virtual_hosted_style_request``, ``allow_http`` (implied
    by an ``http://`` endpoint), ``credential_provider``, ``connect_timeout``, ``request_payer``.
    Secrets never appear in its repr or in any error.
    """

    scheme = "s3"
    held_per_get = HELD_PER_GET

    def __init__(self, bucket: str, **options: Any) -> None:
        unknown = set(options) - _OPTIONS
        if unknown:
            raise ConfigError(f"unknown S3 storage options {sorted(unknown)}; known: {sorted(_OPTIONS)}")
        if not bucket or "/" in bucket:
            raise ConfigError(f"S3 bucket name must be a non-empty name without '/', got {bucket!r}")
        if importlib.util.find_spec("obstore") is None:
            raise ConfigError("reading s3:// needs obstore: pip install 'headrace[s3]'")
        self.bucket = bucket
        self._options = dict(options)
        self.endpoint: str | None = _endpoint(options.get("endpoint"))
        timeout = options.get("connect_timeout")
        if timeout is not None and not isinstance(timeout, (str, datetime.timedelta)):  # obstore's "10s" as given
            # A Python float: _duration turns it into the timedelta obstore takes (not a NumPy scalar).
            self._options["connect_timeout"] = seconds_option("connect_timeout", timeout)
        self._secrets = [options.get(k) or os.environ.get("AWS_" + k.upper()) for k in _SECRET_KEYS]
        self._client: Any = None

    def __repr__(self) -> str:
        where = f", endpoint={self.endpoint!r}" if self.endpoint else ""
        return f"S3Store(bucket={self.bucket!r}{where})"

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _store(self) -> Any:
        if self._client is None:
            prepare_runtime()
            from obstore.store import S3Store as _ObS3Store
            config = {k: v for k, v in self._options.items()
                      if k not in ("allow_http", "credential_provider", "connect_timeout")}
            if self.endpoint:
                config["endpoint"] = self.endpoint
            config.setdefault("region", os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                              or "us-east-1")
            client = {
                "allow_http": bool(self._options.get("allow_http", (self.endpoint or "").startswith("http://"))),
                "connect_timeout": _duration(self._options.get("connect_timeout", 10)),
                # Whole-request timeout: ours (Retry.timeout) bounds every block instead, so a long
                # download is never cut for being long.
                "timeout": "24h",
            }
            self._client = _ObS3Store(self.bucket, config=config, client_options=client,
                                      retry_config={"max_retries": 0},  # ours resume from the offset
                                      credential_provider=self._options.get("credential_provider"))
        return self._client

    async def open(self, key: str, start: int = 0, *, end: int | None = None, etag: str | None = None) -> Body:
        try:
            return await open_body(self._store(), key, start, end, etag, self._fault)
        except Exception as exc:  # obstore raises its own tree; translate it here
            raise self._fault(exc) from None

    async def read(self, key: str) -> bytes:
        """The whole object; a small one in one call into obstore (one GIL hand-off, not one per
        block), a large one block by block (``read_whole``: a slow link does not time it out)."""
        body = await self.open(key)
        try:
            return await read_whole(body)
        finally:
            await body.aclose()

    async def list(self, prefix: str) -> list[ObjectInfo]:
        import obstore

        # object_store lists whole path segments: list the folder, then keep the prefix's objects.
        folder = prefix.rpartition("/")[0]
        try:
            pages = obstore.list(self._store(), prefix=folder or None, chunk_size=1000)
            out = [ObjectInfo(m["path"], m["size"], m.get("e_tag")) async for page in pages for m in page
                   if m["path"].startswith(prefix)]
        except Exception as exc:
            raise self._fault(exc) from None
        return sorted(out, key=lambda o: o.key)

    async def _disconnect(self) -> None:
        # Dropping the Rust store drops its connection pool.
        self._client = None

    def _fault(self, exc: BaseException) -> StoreFault:
        return fault(exc, self._secrets)


def _endpoint(given: str | None) -> str | None:
    """The endpoint: the option, else ``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL`` (None: AWS's)."""
    if given:
        return _checked_endpoint(given, "storage option endpoint")
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return _checked_endpoint(os.environ[name], name)
    return None


def _checked_endpoint(endpoint: Any, source: str) -> str:
    """``endpoint`` if it is an http(s) URL with a host, else a ConfigError naming ``source``.

    Checked when the store is made: object_store panics on its runtime's thread for an endpoint it
    cannot make a request URI of ("minio:9000", a space), and each GET then failed as "rust future
    panicked", retried to the end of the budget, a Rust backtrace printed each time.
    """
    if not isinstance(endpoint, str):
        raise ConfigError(f"{source} must be a URL string, got {type(endpoint).__name__}")
    parts = urllib.parse.urlsplit(endpoint)
    try:
        has_host = bool(parts.hostname) and (parts.port is None or parts.port >= 0)
    except ValueError:  # a port that is not a number, or out of range
        has_host = False
    if (parts.scheme not in ("http", "https") or not has_host or parts.query or parts.fragment
            or any(c.isspace() for c in endpoint)):
        raise ConfigError(f"{source} must be an http:// or https:// URL with a host (e.g. http://minio:9000), "
                          f"got {redact_url(endpoint)!r}")
    return endpoint


def _duration(value: Any) -> Any:
    """Seconds as a number become a timedelta (obstore takes "10s" strings or timedeltas)."""
    return datetime.timedelta(seconds=value) if isinstance(value, (int, float)) else value
