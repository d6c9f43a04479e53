"""An object store on 127.0.0.1 that behaves like a real one and is not the bottleneck: the files
under a folder, served over plain HTTP and as an S3 bucket (path style), with a first-byte latency
per request, a bandwidth cap per connection and a cap on concurrent connections.

Used by the storage tests (``tests/readers/test_storage_latency.py``) and by
``examples/benchmark_latency.py``. Run it as a script, in its own process (its CPU must not hold
the reader's GIL):

    python tests/readers/object_server.py --root DIR --bucket NAME --latency-ms 50 --mbps 100 --max-connections 256

It prints one JSON line (``{"url": "http://127.0.0.1:PORT", "bucket": NAME}``) and serves until its
standard input closes. ``GET /__stats__`` returns what it counted (connections open now and at peak,
``active``: being served, not held back by the cap; ``answering``: requests being answered; requests,
bytes) and ``POST /__stats__`` clears the peaks and the refusals; ``POST /__settings__`` with a JSON body of
``latency_ms``, ``mbps``, ``max_connections`` changes the behaviour for later requests.

What it speaks, on one port (``/<bucket>/<key>``):

- ``GET`` and ``HEAD`` of an object, with ``Range: bytes=a-b`` / ``bytes=a-`` (206 and
  ``Content-Range``), ``If-Match`` (412), ``ETag`` and ``Last-Modified`` (obstore needs both);
- ``GET /<bucket>?list-type=2&prefix=P&continuation-token=T&max-keys=N``: ListObjectsV2, 1,000 keys
  a page at most;
- an HTTP reader uses ``http://127.0.0.1:PORT/<bucket>/<key>`` as the object's URL, an S3 client
  the endpoint ``http://127.0.0.1:PORT`` (any credentials: requests are not checked).

Why not moto or ``aiohttp.web``: moto answers ~150 small GETs a second on this machine's 2 cores,
far below what a reader does; this server parses a request with a few bytes operations and sends
bodies from ``mmap`` slices (no copy), on uvloop when installed.

Behaviour of the caps, as a real store's: the latency is waited before the status line of every
request (a new connection and a reused one alike); the bandwidth cap paces each connection's body
(``mbps`` megabytes a second, in slices of 1/200 s); a connection opened while ``max_connections``
are served gets ``503 SlowDown`` and is closed, as S3 answers a client that asks too much (the
client backs off and retries).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import email.utils
import hashlib
import html
import json
import mmap
import os
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from storage_servers import child_server

_PAGE = 1000


class ObjectServer:
    """The files under ``root`` as objects of ``bucket``; see the module docstring."""

    def __init__(self, root: Path, bucket: str, *, latency_ms: float = 0.0, mbps: float = 0.0,
                 max_connections: int = 0) -> None:
        self.root, self.bucket = Path(root), bucket
        self.latency, self.rate, self.max_connections = latency_ms / 1e3, mbps * 1e6, max_connections
        self.keys = sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())
        self._maps: dict[str, tuple[mmap.mmap | bytes, str, str]] = {}
        self.open = self.active = self.peak_open = self.peak_active = 0
        self.answering = self.peak_answering = 0  # requests read and not yet answered in full
        self.connections = self.requests = self.sent = 0
        self.refused = 0  # requests answered 503 SlowDown: their connection was past the cap

    # -- counters and settings ----------------------------------------------------------------

    def stats(self) -> dict:
        return {"open": self.open, "active": self.active, "peak_open": self.peak_open,
                "peak_active": self.peak_active, "answering": self.answering,
                "peak_answering": self.peak_answering, "connections": self.connections, "requests": self.requests,
                "bytes": self.sent, "latency_ms": self.latency * 1e3, "mbps": self.rate / 1e6,
                "max_connections": self.max_connections, "refused": self.refused,
                "cpu_seconds": time.process_time()}

    def settings(self, body: dict) -> None:
        self.latency = float(body.get("latency_ms", self.latency * 1e3)) / 1e3
        self.rate = float(body.get("mbps", self.rate / 1e6)) * 1e6
        self.max_connections = int(body.get("max_connections", self.max_connections))

    # -- objects ------------------------------------------------------------------------------

    def _object(self, key: str) -> tuple[mmap.mmap | bytes, str, str] | None:
        found = self._maps.get(key)
        if found is None:
            path = self.root / key
            if not key or ".." in key.split("/") or not path.is_file():
                return None
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data: mmap.mmap | bytes = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
            st = path.stat()
            etag = '"' + hashlib.md5(f"{key}:{st.st_size}:{st.st_mtime_ns}".encode(),
                                     usedforsecurity=False).hexdigest() + '"'
            found = self._maps[key] = (data, etag, email.utils.formatdate(st.st_mtime, usegmt=True))
        return found

    def _listing(self, query: dict[str, str]) -> bytes:
        prefix = query.get("prefix", "")
        after = query.get("continuation-token") or query.get("start-after") or ""
        limit = min(int(query.get("max-keys", _PAGE)), _PAGE)
        keys = [k for k in self.keys if k.startswith(prefix) and k > after]
        page, more = keys[:limit], len(keys) > limit
        items = []
        for key in page:
            _, etag, _ = self._object(key)  # type: ignore[misc]
            st = (self.root / key).stat()
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime(st.st_mtime))
            items.append(f"<Contents><Key>{html.escape(key)}</Key><LastModified>{stamp}</LastModified>"
                         f"<ETag>{html.escape(etag)}</ETag><Size>{st.st_size}</Size>"
                         f"<StorageClass>STANDARD</StorageClass></Contents>")
        token = (f"<NextContinuationToken>{html.escape(page[-1])}</NextContinuationToken>" if more else "")
        return ("<?xml version=\"1.0\" encoding=\"UTF-8\"?><ListBucketResult "
                "xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">"
                f"<Name>{self.bucket}</Name><Prefix>{html.escape(prefix)}</Prefix><KeyCount>{len(page)}</KeyCount>"
                f"<MaxKeys>{limit}</MaxKeys><IsTruncated>{'true' if more else 'false'}</IsTruncated>{token}"
                + "".join(items) + "</ListBucketResult>").encode()

    # -- connections --------------------------------------------------------------------------

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.connections += 1
        self.peak_open = max(self.peak_open, self.open)
        admitted = not self.max_connections or self.active < self.max_connections
        try:
            if admitted:
                self.active += 1
                self.peak_active = max(self.peak_active, self.active)
            try:
                while await self._request(reader, writer, admitted):
                    pass
            finally:
                self.active -= admitted
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        except RuntimeError:  # uvloop's word for writing to a transport the client closed
            pass
        except asyncio.CancelledError:  # the server is shutting down; the connection just closes
            pass
        finally:
            self.open -= 1
            writer.close()

    async def _request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, admitted: bool) -> bool:
        """Answer one request; False when the connection is to close."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", 0) or 0)
        body = await reader.readexactly(length) if length else b""
        self.requests += 1
        path, _, query = target.partition("?")
        path = urllib.parse.unquote(path)
        if path == "/__stats__":  # counted without the connection asking
            if method == "POST":
                self.peak_open, self.peak_active, self.peak_answering = self.open - 1, self.active - 1, self.answering
                self.refused = 0
            stats = {**self.stats(), "open": self.open - 1, "active": self.active - 1}
            return await self._send(writer, 200, {"Content-Type": "application/json"}, json.dumps(stats).encode())
        if path == "/__settings__":
            self.settings(json.loads(body or b"{}"))
            return await self._send(writer, 200, {"Content-Type": "application/json"}, json.dumps(self.stats()).encode())
        if not admitted:
            self.refused += 1
            await self._error(writer, 503, "SlowDown")
            return False
        self.answering += 1
        self.peak_answering = max(self.peak_answering, self.answering)
        try:
            if self.latency:
                await self._first_byte(reader)
            return await self._answer(writer, method, path, query, headers)
        finally:
            self.answering -= 1

    async def _first_byte(self, reader: asyncio.StreamReader) -> None:
        """Wait the latency; a client that hangs up meanwhile closes the connection (a real store
        notices too, and the tests count what is left open)."""
        due = time.monotonic() + self.latency
        while (left := due - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.05))
            if reader.at_eof():
                raise ConnectionResetError("the client left")

    async def _answer(self, writer: asyncio.StreamWriter, method: str, path: str, query: str,
                      headers: dict[str, str]) -> bool:
        bucket, _, key = path.lstrip("/").partition("/")
        if bucket != self.bucket or method not in ("GET", "HEAD"):
            return await self._error(writer, 404 if method in ("GET", "HEAD") else 405, "NoSuchBucket")
        if not key:
            q = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
            return await self._send(writer, 200, {"Content-Type": "application/xml"}, self._listing(q))
        found = self._object(key)
        if found is None:
            return await self._error(writer, 404, "NoSuchKey")
        data, etag, modified = found
        match = headers.get("if-match")
        if match is not None and match.strip() not in (etag, "*"):
            return await self._error(writer, 412, "PreconditionFailed")
        size = len(data)
        start, end, status = 0, size, 200
        extra = {"ETag": etag, "Last-Modified": modified, "Accept-Ranges": "bytes",
                 "Content-Type": "application/octet-stream"}
        spec = headers.get("range", "")
        if spec.startswith("bytes="):
            first, _, last = spec[6:].partition("-")
            if first:
                start, end = int(first), min(size, int(last) + 1) if last else size
            else:
                start, end = max(0, size - int(last)), size
            if start >= size:
                extra["Content-Range"] = f"bytes */{size}"
                return await self._send(writer, 416, extra, b"")
            status = 206
            extra["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        view = memoryview(data)[start:end] if size else memoryview(b"")
        return await self._send(writer, status, extra, view, head_only=method == "HEAD")

    async def _error(self, writer: asyncio.StreamWriter, status: int, code: str) -> bool:
        body = f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code><Message>{code}</Message></Error>"
        return await self._send(writer, status, {"Content-Type": "application/xml"}, body.encode())

    async def _send(self, writer: asyncio.StreamWriter, status: int, headers: dict, body: bytes | memoryview, *,
                    head_only: bool = False) -> bool:
        reason = {200: "OK", 206: "Partial Content", 404: "Not Found", 405: "Method Not Allowed",
                  412: "Precondition Failed", 416: "Range Not Satisfiable"}.get(status, "Error")
        lines = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(body)}", "Connection: keep-alive"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if not head_only and len(body):
            if not self.rate:  # slices: a write the socket cannot take at once is copied by the transport
                for offset in range(0, len(body), 1 << 20):
                    writer.write(body[offset : offset + (1 << 20)])
                    await writer.drain()
            else:
                await self._paced(writer, body)
        await writer.drain()
        self.sent += 0 if head_only else len(body)
        return True

    async def _paced(self, writer: asyncio.StreamWriter, body: bytes | memoryview) -> None:
        """``body`` at ``self.rate`` bytes a second: a slice each 1/200 s, as a shaped link sends it."""
        step = max(16 << 10, int(self.rate / 200))
        began = time.monotonic()
        for offset in range(0, len(body), step):
            due = began + offset / self.rate
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(body[offset : offset + step])
            await writer.drain()


async def serve(server: ObjectServer, ready) -> None:  # noqa: ANN001 - a callable taking the URL
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0, backlog=1024, limit=1 << 16)
    port = listener.sockets[0].getsockname()[1]
    ready(f"http://127.0.0.1:{port}")
    async with listener:
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent lets go
        listener.close()


@contextlib.contextmanager
def object_server(root: Path, bucket: str = "headrace-test", *, latency_ms: float = 0.0, mbps: float = 0.0,
                  max_connections: int = 0) -> Iterator[str]:
    """This script serving ``root`` in a child process for the block; yields its base URL."""
    args = [__file__, "--root", str(root), "--bucket", bucket, "--latency-ms", str(latency_ms), "--mbps", str(mbps),
            "--max-connections", str(max_connections)]
    with child_server(args, "the object server") as info:
        yield info["url"]


def server_stats(url: str, *, reset: bool = False) -> dict:
    """What the server at ``url`` counted; ``reset``: start its peaks again from now."""
    request = urllib.request.Request(url + "/__stats__", method="POST" if reset else "GET", data=b"" if reset else None)
    return json.loads(urllib.request.urlopen(request, timeout=10).read())


def configure(url: str, **settings: float) -> dict:
    """Change ``latency_ms``, ``mbps`` or ``max_connections`` of the server at ``url``."""
    request = urllib.request.Request(url + "/__settings__", method="POST", data=json.dumps(settings).encode())
    return json.loads(urllib.request.urlopen(request, timeout=10).read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--bucket", default="headrace-test")
    parser.add_argument("--latency-ms", type=float, default=0.0)
    parser.add_argument("--mbps", type=float, default=0.0, help="per-connection cap, MB/s (0: none)")
    parser.add_argument("--max-connections", type=int, default=0, help="served at once (0: no cap)")
    args = parser.parse_args()
    server = ObjectServer(Path(args.root), args.bucket, latency_ms=args.latency_ms, mbps=args.mbps,
                          max_connections=args.max_connections)

    def ready(url: str) -> None:
        print(json.dumps({"url": url, "bucket": args.bucket}), flush=True)

    try:
        import uvloop
        runner = uvloop.run
    except ImportError:
        runner = asyncio.run
    runner(serve(server, ready))


if __name__ == "__main__":
    main()
