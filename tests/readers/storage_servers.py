"""Real storage servers on 127.0.0.1 for the storage tests and ``examples/benchmark_storage.py``.

Run as a script, in its own process, so that the servers' threads and sockets never mix with the
ones the tests count (the ``leaks`` fixture) and their CPU time does not hold the tests' GIL:

    python tests/readers/storage_servers.py --root DIR --bucket NAME

It starts

- moto's S3 server (``moto.server.ThreadedMotoServer``) and uploads every file under ``DIR`` to
  ``s3://NAME/<relative path>``;
- an HTTP server (aiohttp) serving ``DIR``, with Range requests;
- a fault-injecting proxy in front of each (aiohttp): it forwards requests and streams the answers
  back, except where the plan posted to ``/__faults__`` says to fail one. ``/__log__`` returns the
  requests it saw (method, path, Range header, the fault it injected) and clears the log.

prints one JSON line with the four base URLs, and serves until its standard input closes.

A fault plan is ``{"rules": [{"match": "substring of the path", "faults": [FAULT, ...], "then": FAULT
or null}]}``: the n-th GET whose path contains ``match`` gets ``faults[n]`` (counted per path), and
every later one ``then`` (null: served normally). A FAULT is one of

- ``{"kind": "reset", "after": BYTES}``: headers and ``BYTES`` of the body, then the connection drops;
- ``{"kind": "status", "status": 503}``: an error answer (S3-style XML body), nothing forwarded;
- ``{"kind": "stall", "after": BYTES, "seconds": S}``: headers and ``BYTES``, then silence for ``S``
  seconds (the client's read timeout should fire first), then the connection drops.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import urllib.request
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

# The S3 server needs credentials to sign with, any will do; the tests use the same ones, and look
# for the secret ones in every message to prove they never leak.
ACCESS_KEY = "AKIDTESTHEADRACE0000"
SECRET_KEY = "headrace-test-secret-do-not-log-0123456789"
TOKEN = "session-token-never-shown-98765"
REGION = "us-east-1"
BUCKET = "headrace-test"

_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "upgrade", "proxy-authorization",
        "proxy-authenticate", "trailer", "content-length", "host"}


class FaultProxy:
    """Forwards to ``upstream``; injects the faults of the current plan (see the module docstring)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.rules: list[dict] = []
        self.seen: dict[tuple[int, str], int] = defaultdict(int)
        self.log: list[dict] = []
        self.session: ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/__faults__", self.set_faults)
        app.router.add_get("/__log__", self.get_log)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        return app

    async def set_faults(self, request: web.Request) -> web.Response:
        self.rules = (await request.json()).get("rules", [])
        self.seen.clear()
        self.log.clear()
        return web.json_response({"ok": True})

    async def get_log(self, request: web.Request) -> web.Response:
        log, self.log = self.log, []
        return web.json_response(log)

    def _fault(self, request: web.Request) -> dict | None:
        if request.method != "GET":
            return None
        for i, rule in enumerate(self.rules):
            if rule["match"] in request.path:
                n = self.seen[(i, request.path)]
                self.seen[(i, request.path)] = n + 1
                faults = rule.get("faults", [])
                return faults[n] if n < len(faults) else rule.get("then")
        return None

    async def forward(self, request: web.Request) -> web.StreamResponse:
        fault = self._fault(request)
        self.log.append({"method": request.method, "path": request.path, "range": request.headers.get("Range"),
                         "fault": fault})
        if fault is not None and fault["kind"] == "status":
            body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                    f"<Message>injected {fault['status']}</Message></Error>")
            return web.Response(status=fault["status"], text=body, content_type="application/xml")
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        headers["Host"] = request.host  # the S3 signature covers the host the client dialled
        data = await request.read() if request.can_read_body else None
        async with self.session.request(request.method, self.upstream + request.rel_url.raw_path_qs,
                                        headers=headers, data=data, allow_redirects=False) as up:
            out = {k: v for k, v in up.headers.items() if k.lower() not in _HOP or k.lower() == "content-length"}
            response = web.StreamResponse(status=up.status, headers=out)
            await response.prepare(request)
            sent = 0
            limit = None if fault is None else fault.get("after", 0)
            async for block in up.content.iter_chunked(64 << 10):
                if limit is not None and sent + len(block) >= limit:
                    await response.write(block[: limit - sent])
                    if fault["kind"] == "stall":
                        await asyncio.sleep(fault.get("seconds", 5))
                    if request.transport is not None:  # None: the client gave up first
                        request.transport.abort()
                    return response
                await response.write(block)
                sent += len(block)
            await response.write_eof()
            return response


async def _serve(args: argparse.Namespace) -> None:
    from moto.server import ThreadedMotoServer

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    s3_origin = "http://%s:%d" % moto.get_host_and_port()
    _upload(s3_origin, args.bucket, Path(args.root))

    origin = web.Application()
    origin.router.add_static("/", args.root, show_index=False)
    runners = [web.AppRunner(origin, access_log=None)]
    proxies = [FaultProxy(s3_origin), None]
    urls = {"s3_direct": s3_origin}
    await runners[0].setup()
    site = web.TCPSite(runners[0], "127.0.0.1", 0)
    await site.start()
    urls["http_direct"] = "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]
    proxies[1] = FaultProxy(urls["http_direct"])
    async with ClientSession(connector=TCPConnector(limit=64), timeout=ClientTimeout(total=None),
                             auto_decompress=False) as session:
        for name, proxy in zip(("s3", "http"), proxies):
            proxy.session = session
            runner = web.AppRunner(proxy.app(), access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            runners.append(runner)
            urls[name] = "http://127.0.0.1:%d" % site._server.sockets[0].getsockname()[1]
        print(json.dumps(urls), flush=True)
        # Serve until the parent closes our stdin (or dies).
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        for runner in runners:
            await runner.cleanup()
    moto.stop()


def _upload(endpoint: str, bucket: str, root: Path) -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                      aws_secret_access_key=SECRET_KEY, region_name=REGION)
    s3.create_bucket(Bucket=bucket)
    for path in sorted(root.rglob("*")):
        if path.is_file():
            s3.put_object(Bucket=bucket, Key=path.relative_to(root).as_posix(), Body=path.read_bytes())


def open_sockets() -> int:
    """Open sockets of this process (the ``leaks`` fixture does not count them)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


async def no_new_sockets(before: int) -> None:
    """Wait until this process holds no more sockets than ``before`` (an assertion after ~1 s)."""
    # A dropped obstore client closes its pool from its own runtime: allow it a moment.
    for _ in range(100):
        if open_sockets() <= before:
            return
        await asyncio.sleep(0.01)
    assert open_sockets() <= before, "connections left open"


def post_faults(proxy_url: str, *rules: dict) -> None:
    """Install a fault plan on the proxy at ``proxy_url``; no rules: serve normally."""
    request = urllib.request.Request(proxy_url + "/__faults__", method="POST", data=json.dumps({"rules": list(rules)}).encode())
    urllib.request.urlopen(request, timeout=10).read()


@contextlib.contextmanager
def serving(root: Path, bucket: str = BUCKET) -> Iterator[dict[str, str]]:
    """This script serving ``root`` in a child process, for the block: its base URLs (``s3``,
    ``http``, ``s3_direct``, ``http_direct``). The child stops when its standard input closes."""
    with child_server([__file__, "--root", str(root), "--bucket", bucket], "storage servers") as urls:
        yield urls


@contextlib.contextmanager
def child_server(args: list[str], what: str) -> Iterator[dict]:
    """``python *args`` (a server script) in a child process for the block: the JSON line it prints
    once it listens. It stops when its standard input closes; killed if it has not 10 s later."""
    proc = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{what} did not start (exit {proc.wait(10)})")
        yield json.loads(line)
    finally:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", required=True)
    parser.add_argument("--bucket", default=BUCKET)
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    threading.excepthook = lambda a: None  # a dropped client in moto's handler threads is expected
    asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
