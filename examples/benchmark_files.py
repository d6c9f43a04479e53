"""The files reader's two ways to read: the C helper (a chunk per two GIL-free calls) and Python.

Not a test: it prints a table of files/s and writes it as JSON to ``examples/results/``.

A loader's other threads (GPU lanes, the event loop, the prep thread) run Python while the files
are read. Every ``open``/``read``/``close`` from Python gives up the GIL, and taking it back waits
for the holder to reach its switch interval (5 ms). So each way is timed alone and beside one
thread that runs Python non-stop, the worst case of that competition. Rows: python / helper, alone
/ beside a busy thread; files/s over ``--files`` files of ~``--kib`` KiB (random bytes), read from
the page cache (read once before timing), ``io_threads=2``, median of ``--runs``.

    python examples/benchmark_files.py
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import numpy as np

from headrace import readers
from headrace.readers import _read_files

ROOT = Path(__file__).resolve().parent.parent


def make_folder(root: Path, files: int, kib: float) -> Path:
    if (root / "done").exists():
        return root
    rng = np.random.default_rng(0)
    for i in range(files):
        d = root / f"c{i % 10}"
        d.mkdir(parents=True, exist_ok=True)
        size = int(rng.lognormal(np.log(kib * 1024), 0.4))
        (d / f"{i:06d}.jpg").write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    (root / "done").touch()
    return root


async def _read(reader, limit: int) -> int:
    n = 0
    async for chunk in reader.read(0):
        n += len(chunk)
        if n >= limit:
            break
    return n


def timed(root: Path, native: bool, busy: bool, limit: int) -> float:
    reader = readers.files(root, native_read=native)
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    spinner = threading.Thread(target=spin)
    if busy:
        spinner.start()
    try:
        t0 = time.perf_counter()
        n = asyncio.run(_read(reader, limit))
        return n / (time.perf_counter() - t0)
    finally:
        stop.set()
        if busy:
            spinner.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=8192)
    ap.add_argument("--kib", type=float, default=70.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--busy-files", type=int, default=1024, help="files read per run beside the busy thread")
    ap.add_argument("--data", default=str(ROOT / ".data" / "bench-files"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if _read_files.unavailable_reason() is not None:
        raise SystemExit(f"the C helper is unavailable here: {_read_files.unavailable_reason()}")
    root = make_folder(Path(args.data), args.files, args.kib)
    timed(root, True, False, args.files)  # page cache warm
    rows = {}
    for busy in (False, True):
        for native in (False, True):
            limit = args.busy_files if busy else args.files
            runs = [timed(root, native, busy, limit) for _ in range(args.runs)]
            name = f"{'helper' if native else 'python'}, {'beside a busy thread' if busy else 'alone'}"
            rows[name] = {"files_per_s": statistics.median(runs), "runs": runs}
            print(f"  {name}: {rows[name]['files_per_s']:,.0f} files/s", flush=True)
    print(f"\n{'files reader':32} {'files/s':>10} {'vs python':>10}")
    for busy in ("alone", "beside a busy thread"):
        base = rows[f"python, {busy}"]["files_per_s"]
        for way in ("python", "helper"):
            r = rows[f"{way}, {busy}"]["files_per_s"]
            print(f"{way + ', ' + busy:32} {r:>10,.0f} {r / base:>9.1f}x")
    report = {"date": datetime.date.today().isoformat(), "machine": platform.node(), "cores": os.cpu_count(),
              "files": args.files, "kib": args.kib, "rows": rows}
    out = Path(args.out or ROOT / "examples" / "results" / f"files-{report['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
