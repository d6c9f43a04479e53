"""Each reader alone and beside a thread busy in Python: what the GIL costs a reader in a loader.

Not a test: it prints a table of samples/s and writes it as JSON to ``examples/results/``.

A loader's other threads (the event loop, the GPU lanes, a training loop under ``loader.sync()``)
run Python while the reader's I/O threads work. A thread that lets the GIL go, however briefly,
waits to take it back until the busy one reaches its switch interval (5 ms), so a reader's rate
beside such a thread is set by how often it lets the GIL go, not by its work. Rows: headrace's
files, WebDataset, TFRecord, LMDB and Caffe readers over ``examples/benchmark_readers.py``'s data
(made there, ~70 KiB samples by default), each made before the timing, one epoch alone and one
beside a thread that runs Python non-stop, ``--turns`` times taking turns (the median is shown).
``--lmdb-gets`` adds LMDB and Caffe rows whose lookups go through py-lmdb's ``get`` and whose keys
are listed by py-lmdb's cursor (one GIL hand-over a key), as they all did before the readers walked
the tree themselves. Making each reader (listing the folder, the shards, the LMDB's keys) is timed
apart, alone and beside the busy thread, and shown in milliseconds.
``--switch-interval MS`` sets ``sys.setswitchinterval`` for the whole run; the busy thread's own
rate (loop turns/s, beside each reader against alone) shows what a shorter interval costs it.

    python examples/benchmark_readers.py                  # once, to make the data
    python examples/benchmark_readers_busy.py --lmdb-gets
    python examples/benchmark_readers_busy.py --switch-interval 1
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from benchmark_readers import ROOT, drain, timed, warm, write_results

import headrace
from headrace import readers


class BusyThread:
    """A thread running Python non-stop while the block runs; ``rate``: its loop turns a second."""

    rate = 0.0

    def __enter__(self) -> BusyThread:
        self._stop = threading.Event()
        self._turns = 0
        self._thread = threading.Thread(target=self._spin, name="busy-python", daemon=True)
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def _spin(self) -> None:
        n = 0
        while not self._stop.is_set():
            for _ in range(1000):
                n += 1
        self._turns = n

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.rate = self._turns / (time.perf_counter() - self._started)


def busy_rate_alone(seconds: float = 0.5) -> float:
    """The busy thread's loop turns a second with nothing else running."""
    with BusyThread() as busy:
        time.sleep(seconds)
    return busy.rate


def with_py_lmdb_gets(make: Callable[[], readers.Reader]) -> readers.Reader:
    """The reader made with its keys listed by py-lmdb's cursor, and every lookup through its
    ``get`` (the paths before ``_lmdb_tree``)."""
    lmdb_module = importlib.import_module("headrace.readers.lmdb")  # the module, not the function
    walk = lmdb_module._walked_keys
    lmdb_module._walked_keys = lambda *args: None
    try:
        reader = make()
    finally:
        lmdb_module._walked_keys = walk
    reader._spans = lambda txn, indices: [reader._span_of(reader._look_up(txn, i)) for i in indices]
    return reader


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--kib", type=float, default=70.0)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--data", default=str(ROOT / ".data" / "bench-readers"))
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--lmdb-gets", action="store_true", help="also LMDB and Caffe through py-lmdb's get")
    parser.add_argument("--switch-interval", type=float, metavar="MS",
                        help="sys.setswitchinterval for the run, in milliseconds (Python's default: 5)")
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1000)
    root = Path(args.data) / f"{args.samples}x{args.kib:g}k-{args.shards}"
    if not (root / "files" / "done").exists() or not (root / "lmdb" / "done").exists():
        sys.exit(f"no data under {root}: run examples/benchmark_readers.py with the same --samples/--kib/--shards first")
    tfrecords = sorted(glob.glob(str(root / "tfrecord" / "*.tfrecord")))
    makers: list[tuple[str, Callable[[], readers.Reader]]] = [
        ("files", lambda: readers.files(root / "files")),
        ("webdataset", lambda: readers.webdataset(sorted(glob.glob(str(root / "shards" / "*.tar"))))),
        *([("tfrecord", lambda: readers.tfrecord(tfrecords))] if tfrecords else []),
        ("lmdb", lambda: readers.lmdb(str(root / "lmdb"))),
        ("caffe", lambda: readers.caffe(str(root / "caffe"))),
    ]
    if args.lmdb_gets:
        makers += [("lmdb, py-lmdb gets", lambda: with_py_lmdb_gets(lambda: readers.lmdb(str(root / "lmdb")))),
                   ("caffe, py-lmdb gets", lambda: with_py_lmdb_gets(lambda: readers.caffe(str(root / "caffe"))))]
    data_files = [p for p in glob.glob(str(root / "**"), recursive=True) if os.path.isfile(p)]
    interval_ms = sys.getswitchinterval() * 1000
    print(f"{args.samples} samples of ~{args.kib:g} KiB under {root}; {os.cpu_count()} cores; "
          f"switch interval {interval_ms:g} ms", flush=True)
    rates: dict[str, dict[str, list[float]]] = {
        name: {"alone": [], "busy": [], "busy_share": [], "made_alone_ms": [], "made_busy_ms": []} for name, _ in makers}
    for turn in range(args.turns):
        for name, make in makers:
            warm(data_files)  # the page cache may have let them go (another row, the VM's reclaim)
            for where in ("alone", "busy"):
                with BusyThread() if where == "busy" else contextlib.nullcontext():
                    started = time.perf_counter()
                    reader = make()  # listing the keys and files, timed apart
                    rates[name][f"made_{where}_ms"].append((time.perf_counter() - started) * 1000)
                if where == "busy":
                    alone_rate = busy_rate_alone()
                    with BusyThread() as busy:
                        result = timed(lambda: drain(reader))
                    rates[name]["busy_share"].append(busy.rate / alone_rate)
                else:
                    result = timed(lambda: drain(reader))
                assert result["samples"] == args.samples, (name, result["samples"])
                rates[name][where].append(result["samples_per_s"])
        print(f"turn {turn + 1} of {args.turns} done", flush=True)
    table = []
    print(f"\n{'reader':<21} {'alone':>10} {'beside a busy thread':>21} {'ratio':>7} {'busy thread kept':>17}"
          f" {'made in, ms: alone / busy':>26}")
    for name, runs in rates.items():
        alone, busy = float(np.median(runs["alone"])), float(np.median(runs["busy"]))
        kept = float(np.median(runs["busy_share"]))
        made_alone, made_busy = float(np.median(runs["made_alone_ms"])), float(np.median(runs["made_busy_ms"]))
        table.append({"reader": name, "alone": alone, "busy": busy, "ratio": busy / alone,
                      "busy_thread_kept": kept, "made_alone_ms": made_alone, "made_busy_ms": made_busy,
                      "turns": runs})
        made = f"{made_alone:,.0f} / {made_busy:,.0f}"
        print(f"{name:<21} {alone:>10,.0f} {busy:>21,.0f} {busy / alone:>6.2f}x {kept:>16.0%} {made:>26}")
    if not args.no_json:
        name = "readers-busy" if args.switch_interval is None else f"readers-busy-sw{interval_ms:g}ms"
        write_results(name, args.kib, {
            "versions": {"python": sys.version.split()[0], "headrace": headrace.__version__},
            "config": {"samples": args.samples, "kib": args.kib, "shards": args.shards, "turns": args.turns,
                       "switch_interval_ms": interval_ms},
            "table": table,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
