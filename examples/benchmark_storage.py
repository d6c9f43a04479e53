"""Storage benchmark: the same WebDataset shards streamed from local disk, an HTTP server and an S3
server (moto) over loopback, by headrace and by the ``webdataset`` library; plus the client
libraries alone, which is how headrace's backends were chosen.

Not a test: it prints a table and writes JSON to ``examples/results/``.

Servers: ``tests/readers/storage_servers.py`` in a child process (moto's ``ThreadedMotoServer``
and an aiohttp static-file server, both on 127.0.0.1; the fault proxies are not used here). They
share the machine's cores with the client, so every row here is bounded by them too: compare rows
within one run, not with a real object store.

Rows (raw samples, no decode; every row's payload bytes are checked against the others):

- ``headrace``: ``readers.webdataset(urls)`` (S3 through obstore, HTTP through aiohttp), sequential;
- ``webdataset``: ``wds.WebDataset(urls, shardshuffle=False)``; ``http://`` through its gopen
  (a ``curl`` subprocess per shard), ``s3://`` through a gopen handler registered for the
  scheme that streams boto3's ``get_object`` body (in process, no subprocess);
- ``files``: ``readers.files`` over a bucket prefix of single ~70 KiB objects vs the same folder on disk;
- ``client`` rows: the transfer alone (all shards downloaded, bytes counted): obstore vs
  aiobotocore for S3, aiohttp vs obstore's HTTPStore for HTTP, and many small GETs at once, with the
  client's CPU seconds (on 2 cores the client's CPU is what the decode threads lose).

    python examples/benchmark_storage.py            # 4096 samples of ~70 KiB in 16 shards, 3 rounds
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import headrace
from headrace import readers
from headrace._loop import new_event_loop  # uvloop when installed, as the loader uses

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "readers"))
from benchmark_readers import make_shards  # noqa: E402
from storage_servers import ACCESS_KEY, BUCKET, SECRET_KEY  # noqa: E402

REGION = "us-east-1"


def start_servers(root: Path) -> tuple[subprocess.Popen, dict]:
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "readers" / "storage_servers.py"),
                             "--root", str(root), "--bucket", BUCKET], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    if not line:
        raise SystemExit("the storage servers did not start")
    return proc, json.loads(line)


def make_files(root: Path, count: int, kib: float, seed: int = 1) -> None:
    stamp = root / "files.json"
    if stamp.exists() and json.loads(stamp.read_text()) == [count, kib]:
        return
    rng = np.random.default_rng(seed)
    for i, size in enumerate(np.clip(rng.lognormal(np.log(kib * 1024), 0.5, count), 256, None).astype(int)):
        folder = root / "files" / f"class{i % 8}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:06d}.jpg").write_bytes(b"\xff\xd8\xff" + rng.bytes(int(size) - 3))
    stamp.write_text(json.dumps([count, kib]))


def run_async(make: Callable[[], object]) -> object:
    loop = new_event_loop()
    try:
        return loop.run_until_complete(make())
    finally:
        loop.close()


def timed(fn: Callable[[], tuple[int, int]]) -> dict:
    cpu, start = time.process_time(), time.perf_counter()
    samples, nbytes = fn()
    elapsed = time.perf_counter() - start
    return {"samples": samples, "payload_bytes": nbytes, "seconds": elapsed, "cpu_seconds": time.process_time() - cpu,
            "samples_per_s": samples / elapsed, "mb_per_s": nbytes / elapsed / 1e6}


# --- readers -----------------------------------------------------------------------------------


def headrace_read(source, **kw) -> tuple[int, int]:
    reader = readers.webdataset(source, **kw)

    async def run() -> tuple[int, int]:
        n = b = 0
        async for chunk in reader.read(0):
            for s in chunk:
                if s.error is not None:
                    raise s.error
                n += 1
                b += s.nbytes
        return n, b

    return run_async(run)


def headrace_files(source, **kw) -> tuple[int, int]:
    reader = readers.files(source, **kw)

    async def run() -> tuple[int, int]:
        n = b = 0
        async for chunk in reader.read(0):
            for s in chunk:
                if s.error is not None:
                    raise s.error
                n += 1
                b += len(s.fields["jpg"])
        return n, b

    return run_async(run)


def register_boto3_gopen(endpoint: str) -> None:
    """``s3://`` for the webdataset library: boto3's streaming body, opened in process."""
    import boto3
    import importlib

    gopen = importlib.import_module("webdataset.gopen")  # the package re-exports a function of that name

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                          aws_secret_access_key=SECRET_KEY, region_name=REGION)

    def gopen_s3(url, mode="rb", bufsize=8192):
        bucket, _, key = url[len("s3://") :].partition("/")
        return client.get_object(Bucket=bucket, Key=key)["Body"]

    gopen.gopen_schemes["s3"] = gopen_s3


def library_read(urls: list[str]) -> tuple[int, int]:
    import webdataset as wds

    n = b = 0
    for sample in wds.WebDataset(urls, shardshuffle=False):
        n += 1
        b += sum(len(v) for k, v in sample.items() if not k.startswith("__"))
    return n, b


# --- clients alone -----------------------------------------------------------------------------


def obstore_get(store, keys: list[str], concurrency: int) -> tuple[int, int]:
    import obstore

    async def run() -> tuple[int, int]:
        limit, total = asyncio.Semaphore(concurrency), 0

        async def one(key: str) -> None:
            nonlocal total
            async with limit:
                result = await obstore.get_async(store, key)
                async for block in result.stream(min_chunk_size=256 << 10):
                    total += len(block)

        async with asyncio.TaskGroup() as group:
            for key in keys:
                group.create_task(one(key))
        return len(keys), total

    return run_async(run)


def aiobotocore_get(endpoint: str, keys: list[str], concurrency: int) -> tuple[int, int]:
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    async def run() -> tuple[int, int]:
        limit, total = asyncio.Semaphore(concurrency), 0
        config = AioConfig(s3={"addressing_style": "path"}, max_pool_connections=max(10, concurrency))
        async with get_session().create_client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY,
                                               aws_secret_access_key=SECRET_KEY, region_name=REGION,
                                               config=config) as client:

            async def one(key: str) -> None:
                nonlocal total
                async with limit:
                    response = await client.get_object(Bucket=BUCKET, Key=key)
                    async with response["Body"] as body:
                        async for block in body.iter_chunks(256 << 10):
                            total += len(block)

            async with asyncio.TaskGroup() as group:
                for key in keys:
                    group.create_task(one(key))
        return len(keys), total

    return run_async(run)


def aiohttp_get(base: str, keys: list[str], concurrency: int) -> tuple[int, int]:
    import aiohttp

    async def run() -> tuple[int, int]:
        limit, total = asyncio.Semaphore(concurrency), 0
        async with aiohttp.ClientSession() as session:

            async def one(key: str) -> None:
                nonlocal total
                async with limit, session.get(f"{base}/{key}") as response:
                    response.raise_for_status()
                    async for block in response.content.iter_any():
                        total += len(block)

            async with asyncio.TaskGroup() as group:
                for key in keys:
                    group.create_task(one(key))
        return len(keys), total

    return run_async(run)


# --- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--kib", type=float, default=70)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--files", type=int, default=512, help="single objects for the files rows")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "storage-vm-2026-11-22.json"))
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args()

    data = ROOT / ".data" / "bench-storage"
    paths = make_shards(data, args.samples, args.kib, args.shards)
    make_files(data, args.files, args.kib)
    names = [Path(p).name for p in paths]
    t0 = time.perf_counter()
    proc, urls = start_servers(data)
    print(f"servers up in {time.perf_counter() - t0:.1f} s (uploaded {len(names)} shards and {args.files} files to moto)")
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION=REGION,
                      AWS_ENDPOINT_URL_S3=urls["s3_direct"])
    s3_urls = [f"s3://{BUCKET}/shards/{n}" for n in names]
    http_urls = [f"{urls['http_direct']}/shards/{n}" for n in names]
    keys = [f"shards/{n}" for n in names]
    small = sorted(p.relative_to(data).as_posix() for p in (data / "files").rglob("*.jpg"))
    register_boto3_gopen(urls["s3_direct"])

    from obstore.store import HTTPStore, S3Store

    ob_s3 = S3Store(BUCKET, endpoint=urls["s3_direct"], access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY,
                    region=REGION, client_options={"allow_http": True})
    ob_http = HTTPStore.from_url(urls["http_direct"], client_options={"allow_http": True})
    try:
        import aiobotocore  # noqa: F401
        have_aiobotocore = True
    except ImportError:
        have_aiobotocore = False

    rows: dict[str, tuple[str, str, Callable[[], tuple[int, int]]]] = {
        "local/headrace": ("local disk", "headrace", lambda: headrace_read(paths)),
        "local/webdataset": ("local disk", "webdataset library", lambda: library_read(paths)),
        "http/headrace": ("HTTP", "headrace (aiohttp)", lambda: headrace_read(http_urls)),
        "http/webdataset": ("HTTP", "webdataset library (gopen: curl)", lambda: library_read(http_urls)),
        "s3/headrace": ("S3 (moto)", "headrace (obstore)", lambda: headrace_read(s3_urls)),
        "s3/webdataset": ("S3 (moto)", "webdataset library (gopen: boto3)", lambda: library_read(s3_urls)),
        "files-local/headrace": ("local disk, single files", "headrace files()",
                                 lambda: headrace_files(data / "files")),
        "files-s3/headrace": ("S3 (moto), single objects", "headrace files()",
                              lambda: headrace_files(f"s3://{BUCKET}/files/")),
        "client-s3/obstore": ("S3 (moto), shards", "client: obstore", lambda: obstore_get(ob_s3, keys, 3)),
        "client-http/aiohttp": ("HTTP, shards", "client: aiohttp", lambda: aiohttp_get(urls["http_direct"], keys, 3)),
        "client-http/obstore": ("HTTP, shards", "client: obstore HTTPStore", lambda: obstore_get(ob_http, keys, 3)),
        "client-small-s3/obstore": ("S3 (moto), single objects", "client: obstore, 16 at once",
                                    lambda: obstore_get(ob_s3, small, 16)),
        "client-small-http/aiohttp": ("HTTP, single objects", "client: aiohttp, 16 at once",
                                      lambda: aiohttp_get(urls["http_direct"], small, 16)),
    }
    if have_aiobotocore:
        rows["client-s3/aiobotocore"] = ("S3 (moto), shards", "client: aiobotocore",
                                         lambda: aiobotocore_get(urls["s3_direct"], keys, 3))
        rows["client-small-s3/aiobotocore"] = ("S3 (moto), single objects", "client: aiobotocore, 16 at once",
                                               lambda: aiobotocore_get(urls["s3_direct"], small, 16))
    runs: dict[str, list[dict]] = {name: [] for name in rows}
    try:
        for fn in (rows["local/headrace"][2], rows["local/webdataset"][2]):
            fn()  # warm the page cache and imports
        for r in range(args.rounds):
            order = list(rows) if r % 2 == 0 else list(reversed(rows))
            for name in order:
                runs[name].append(timed(rows[name][2]))
                print(f"  round {r + 1} {name:28s} {runs[name][-1]['mb_per_s']:8.1f} MB/s", flush=True)
    finally:
        proc.stdin.close()
        proc.wait(30)

    results = {}
    for name, (source, system, _) in rows.items():
        med = sorted(runs[name], key=lambda x: x["seconds"])[len(runs[name]) // 2]
        results[name] = {"source": source, "system": system, **med,
                         "all_mb_per_s": [round(x["mb_per_s"], 1) for x in runs[name]]}
    wds_bytes = {results[k]["payload_bytes"] for k in results if k.split("/")[0] in ("local", "http", "s3")}
    assert len(wds_bytes) == 1, f"the readers disagree on the payload: {wds_bytes}"

    print(f"\n{args.samples} samples of ~{args.kib:g} KiB in {args.shards} shards "
          f"({sum(os.path.getsize(p) for p in paths) / 1e6:.0f} MB); median of {args.rounds} rounds\n")
    print(f"| {'source':27s} | {'system':36s} | {'samples/s':>9s} | {'MB/s':>7s} | {'client CPU s':>12s} |")
    print(f"| {'-' * 27} | {'-' * 36} | {'-' * 9}:| {'-' * 7}:| {'-' * 12}:|")
    for row in results.values():
        print(f"| {row['source']:27s} | {row['system']:36s} | {row['samples_per_s']:9,.0f} | {row['mb_per_s']:7.1f} "
              f"| {row['cpu_seconds']:12.2f} |")
    for src in ("local", "http", "s3"):
        print(f"{src}: headrace / webdataset = "
              f"{results[f'{src}/headrace']['samples_per_s'] / results[f'{src}/webdataset']['samples_per_s']:.2f}x")

    if not args.no_json:
        import obstore
        import aiohttp
        import webdataset

        doc = {
            "benchmark": "storage", "date": datetime.date.today().isoformat(), "host": socket.gethostname(),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "versions": {"headrace": headrace.__version__, "obstore": obstore.__version__,
                         "aiohttp": aiohttp.__version__, "webdataset": getattr(webdataset, "__version__", "?")},
            "config": {"samples": args.samples, "kib": args.kib, "shards": args.shards, "files": args.files,
                       "rounds": args.rounds, "servers": "moto ThreadedMotoServer + aiohttp static, child process, "
                       "127.0.0.1"},
            "results": results,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
