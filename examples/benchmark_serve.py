"""Serving benchmark: latency and throughput of ``headrace.Preprocessor``, directly and over HTTP.

Not a test: it prints a table and writes JSON to ``examples/results/serve-<device>-<date>.json``.
Loopback only, and bounded: each concurrency level stops after ``--requests`` requests or
``--time-limit`` seconds, whichever comes first.

Rows, at each concurrency (callers that each send one image, wait for the answer, send the next):
  service   ``await pre(jpeg)`` in this process: validation preprocessing (decode → resize shorter
            side 256 → centre crop 224 → normalize, float32 NCHW), dynamically batched.
  http      the same images POSTed to ``examples/serve.py`` running in a child process (its own
            interpreter and cores), through aiohttp's client; it runs its model per batch too
            (``--http-model``: tiny CNN, mobilenet_v3_small, or none).
A reference row, ``loader``, times the training-side Loader with the same ops over the same JPEGs
(from files, batches of ``--max-batch``): the throughput the service is measured against.

Latency is per request, from the call to the answer. On the GPU the service answers only after
the device has finished the batch (``wait_ready=True``: a thread waits on the stream, the event loop
never does), so the clock stops on finished work, not on queued kernels; the Loader reference
synchronises the stream before its clock stops. The images are 500 x 375 JPEGs made here (crops
of scikit-image's photographs when it is installed, smooth random fields otherwise).

    python examples/benchmark_serve.py --device cpu --requests 400
    python examples/benchmark_serve.py --device cuda --requests 4000 --max-batch 64 --max-delay 0.0005
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import io
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import headrace
import numpy as np
import torch
from headrace import Loader, Preprocessor, datasets, ops, readers
from headrace._loop import new_event_loop  # uvloop when installed, as the loader uses
from PIL import Image

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


# --- images -----------------------------------------------------------------------------------------


def make_jpegs(count: int, seed: int = 0, size: tuple[int, int] = (500, 375)) -> list[bytes]:
    """``count`` JPEGs of exactly ``size`` (width, height), quality 85-96, 4:2:0."""
    photos = datasets.photographs()
    rng = np.random.default_rng(seed)
    w, h = size
    out = []
    for _ in range(count):
        if photos:
            src = photos[int(rng.integers(len(photos)))]
            sh, sw = src.shape[:2]
            ch = int(min(sh, sw * h / w) * rng.uniform(0.6, 1.0))
            cw = int(ch * w / h)
            y0, x0 = int(rng.integers(0, sh - ch + 1)), int(rng.integers(0, sw - cw + 1))
            img = Image.fromarray(src[y0 : y0 + ch, x0 : x0 + cw]).resize((w, h), Image.Resampling.BILINEAR)
        else:
            small = rng.integers(0, 256, size=(6, 8, 3), dtype=np.uint8)
            img = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
        arr = np.asarray(img).astype(np.int16) + rng.integers(-5, 6, size=(h, w, 3), dtype=np.int16)
        buf = io.BytesIO()
        Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(
            buf, "JPEG", quality=int(rng.integers(85, 97)), subsampling="4:2:0"
        )
        out.append(buf.getvalue())
    return out


def write_folder(jpegs: list[bytes], root: Path) -> Path:
    folder = root / "class_00"
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.jpg"):
        old.unlink()
    for i, data in enumerate(jpegs):
        (folder / f"{i:06d}.jpg").write_bytes(data)
    return root


# --- load generation --------------------------------------------------------------------------------


async def drive(call, payloads: list[bytes], concurrency: int, total: int, time_limit: float) -> dict:
    """``concurrency`` closed-loop callers, ``total`` requests in all (or until ``time_limit``)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + time_limit
    latencies: list[float] = []
    errors: collections.Counter[str] = collections.Counter()
    issued = 0

    async def caller() -> None:
        nonlocal issued
        while issued < total and loop.time() < deadline:
            payload = payloads[issued % len(payloads)]
            issued += 1
            t0 = time.perf_counter()
            try:
                await call(payload)
            except Exception as exc:  # noqa: BLE001 - counted and reported, the run goes on
                errors[type(exc).__name__] += 1
                continue
            latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    lat = np.array(latencies) * 1e3 if latencies else np.array([float("nan")])
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "errors": dict(errors),
        "seconds": round(wall, 3),
        "p50_ms": round(float(np.percentile(lat, 50)), 3),
        "p95_ms": round(float(np.percentile(lat, 95)), 3),
        "p99_ms": round(float(np.percentile(lat, 99)), 3),
        "images_per_s": round(len(latencies) / wall, 1) if wall > 0 else 0.0,
        "stopped_by_time": loop.time() >= deadline,
    }


def _mean_batch(before: dict, after: dict) -> float | None:
    sizes = {int(k): after.get(k, 0) - before.get(k, 0) for k in after}
    batches = sum(sizes.values())
    return round(sum(k * v for k, v in sizes.items()) / batches, 2) if batches else None


async def bench_service(args, jpegs: list[bytes], device: str) -> list[dict]:
    gpu = device.startswith("cuda")
    rows = []
    async with Preprocessor(
        ops.validation(label=None),
        device=device,
        max_batch=args.max_batch,
        max_delay=args.max_delay,
        max_pending=max(1024, 2 * max(args.concurrency)),
        num_threads=args.threads,
        lanes=args.lanes,
        wait_ready=gpu,
    ) as pre:
        await asyncio.gather(*(pre(j) for j in jpegs[: 2 * args.max_batch]))  # warm-up: kernels, pools, caches
        for j in jpegs[:8]:
            await pre(j)
        for c in args.concurrency:
            before = {str(k): v for k, v in pre.stats().batch_sizes.items()}
            row = await drive(pre, jpegs, c, args.requests, args.time_limit)
            after = {str(k): v for k, v in pre.stats().batch_sizes.items()}
            row.update(target="service", mean_batch=_mean_batch(before, after))
            rows.append(row)
            _print_row(row)
    return rows


async def bench_http(args, jpegs: list[bytes], device: str) -> list[dict]:
    import aiohttp

    port = _free_port()
    cmd = [
        sys.executable, str(HERE / "serve.py"), "--host", "127.0.0.1", "--port", str(port), "--device", device,
        "--max-batch", str(args.max_batch), "--max-delay", str(args.max_delay), "--model", args.http_model,
        "--max-pending", str(max(1024, 2 * max(args.concurrency))), "--when-full", "wait",
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    # The log is a file, not a pipe: nobody reads it while the server runs, so it must not fill up.
    log = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the server; closed in the finally below
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log)  # noqa: ASYNC220 - returns at once
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await _wait_healthy(session, base, server, log)
            model = None

            async def post(data: bytes) -> None:
                nonlocal model
                async with session.post(f"{base}/predict", data=data) as r:
                    body = await r.json()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}: {body.get('error')}")
                    model = body["model"]

            await asyncio.gather(*(post(j) for j in jpegs[: 2 * args.max_batch]))
            for c in args.concurrency:
                before = (await (await session.get(f"{base}/stats")).json())["batch_sizes"]
                row = await drive(post, jpegs, c, args.requests, args.time_limit)
                after = (await (await session.get(f"{base}/stats")).json())["batch_sizes"]
                row.update(target="http", mean_batch=_mean_batch(before, after), model=model)
                rows.append(row)
                _print_row(row)
    finally:
        server.send_signal(signal.SIGINT)  # aiohttp's graceful shutdown closes the service
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    return rows


async def _wait_healthy(session, base: str, server: subprocess.Popen, log, limit: float = 180.0) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"serve.py exited: {log.read().decode(errors='replace')[-2000:]}")
        try:
            async with session.get(f"{base}/healthz") as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("serve.py did not become healthy in time")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_loader(args, folder: Path, device: str, count: int) -> dict:
    """The training-side Loader, same ops and batch size: images/s over ``--loader-epochs`` epochs."""
    gpu = device.startswith("cuda")
    loader = Loader(readers.files(folder), batch_size=args.max_batch, pipeline=ops.validation(label=None),
                    device=device, num_threads=args.threads, lanes=args.lanes)
    rates = []

    async def epochs() -> None:
        async with loader:
            for epoch in range(args.loader_epochs + 1):  # the first one warms up
                start = time.perf_counter()
                async for _ in loader:
                    pass
                if gpu:
                    torch.cuda.current_stream().synchronize()
                if epoch:
                    rates.append(count / (time.perf_counter() - start))

    _run(epochs())
    row = {"target": "loader", "images_per_s": round(float(np.median(rates)), 1), "epochs": [round(r, 1) for r in rates]}
    print(f"{'loader':8} {'-':>5} {count * args.loader_epochs:>8} {'':>8} {'':>8} {'':>8} {row['images_per_s']:>9.1f}"
          f" {'':>6}   (same ops, batches of {args.max_batch}, median of {args.loader_epochs} epochs)", flush=True)
    return row


def _print_row(row: dict) -> None:
    mb = "-" if row["mean_batch"] is None else f"{row['mean_batch']:.1f}"
    errs = f"  errors {row['errors']}" if row["errors"] else ""
    cut = "  (time limit)" if row["stopped_by_time"] else ""
    print(f"{row['target']:8} {row['concurrency']:>5} {row['requests']:>8} {row['p50_ms']:>8.2f} {row['p95_ms']:>8.2f}"
          f" {row['p99_ms']:>8.2f} {row['images_per_s']:>9.1f} {mb:>6}{errs}{cut}", flush=True)


def _run(coro):
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(coro)


# --- main -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--requests", type=int, default=1000, help="requests per concurrency level (at most)")
    p.add_argument("--concurrency", default="1,16,64,256", help="comma-separated levels")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-delay", type=float, default=0.0, help="seconds a request waits for company")
    p.add_argument("--threads", type=int, default=None, help="CPU decode threads (default: all cores)")
    p.add_argument("--lanes", type=int, default=1, help="GPU lanes")
    p.add_argument("--images", type=int, default=256, help="distinct 500x375 JPEGs, cycled")
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per level, at most")
    p.add_argument("--loader-epochs", type=int, default=3)
    p.add_argument("--http-model", default="auto", choices=["auto", "mobilenet", "tiny", "none"])
    p.add_argument("--no-http", action="store_true", help="skip the HTTP rows")
    p.add_argument("--no-loader", action="store_true", help="skip the Loader reference")
    p.add_argument("--out", default=None, help="JSON path (default: examples/results/serve-<device>-<date>.json)")
    p.add_argument("--no-json", action="store_true")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]

    device = args.device
    if device == "auto":
        device = "cuda" if ops.cuda_available() else "cpu"
    print(f"making {args.images} JPEGs (500x375) ...", flush=True)
    jpegs = make_jpegs(args.images)
    folder = write_folder(jpegs, ROOT / ".data" / f"serve-500x375-{args.images}")
    print(f"device {device}, max_batch {args.max_batch}, max_delay {args.max_delay * 1e3:g} ms, "
          f"threads {args.threads or os.cpu_count()}, mean JPEG {np.mean([len(j) for j in jpegs]) / 1024:.0f} KiB")
    print(f"{'target':8} {'conc':>5} {'requests':>8} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} {'images/s':>9} {'batch':>6}")

    rows: list[dict] = []
    loader_row = None if args.no_loader else bench_loader(args, folder, device, len(jpegs))
    rows += _run(bench_service(args, jpegs, device))
    if not args.no_http:
        rows += _run(bench_http(args, jpegs, device))

    if loader_row:
        for row in rows:
            row["vs_loader"] = round(row["images_per_s"] / loader_row["images_per_s"], 3)
        top = [r for r in rows if r["target"] == "service" and r["concurrency"] == max(args.concurrency)]
        if top:
            print(f"service at concurrency {top[0]['concurrency']}: {top[0]['vs_loader']:.0%} of the Loader's images/s")
    if args.no_json:
        return
    out = Path(args.out) if args.out else HERE / "results" / f"serve-{device.replace(':', '')}-{datetime.date.today()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "benchmark": "serve",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {
            "host": platform.node(), "cpu_count": os.cpu_count(), "processor": platform.processor(),
            "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        },
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "headrace": headrace.__version__},
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "no_json")} | {"device": device},
        "images": {"count": len(jpegs), "size": "500x375", "mean_bytes": int(np.mean([len(j) for j in jpegs]))},
        "loader": loader_row,
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
