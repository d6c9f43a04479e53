"""What a user stage costs on the CPU path: a benchmark, not a test.

    python examples/benchmark_stages.py                  # 50,000 small samples; 1,024 JPEGs in .data/bench-stages
    python examples/benchmark_stages.py --samples 200000 --images 2048 --rounds 5

Two measurements, each an A/B pair alternated ``--rounds`` times (median epoch):

1. **Per-sample sync stage overhead.** ``ops.Pipeline(image=None)`` over ``readers.sequence`` of
   small dicts, with and without ``ops.Map(identity)``. The overhead per sample (µs) is set against
   calling the same function in a Python loop: what the stage machinery adds beyond the call.
2. **An async stage with I/O.** ``ops.training(224)`` on JPEGs, with and without an ``async def``
   ``Map`` that awaits 1 ms per sample (a remote label lookup) at ``concurrency=64``: images/s.
3. **The async stage alone**: the same ``Map`` over the small dicts (``Pipeline(image=None)``):
   samples/s against the bound's ceiling (64 calls of 1 ms at once: 64,000/s), and the event
   loop's own CPU time per sample.

Prints a table; writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import time
from pathlib import Path

import headrace
from headrace import datasets, ops, readers


def _identity(fields: dict) -> dict:
    return fields


async def _lookup(fields: dict) -> dict:
    await asyncio.sleep(0.001)
    return fields


async def _epoch_seconds(loader) -> tuple[float, int]:
    started, loop_cpu, n = time.perf_counter(), time.thread_time(), 0
    async for batch in loader:
        n += batch.size
    _LOOP_CPU[id(loader)] = time.thread_time() - loop_cpu  # the event loop's thread: this one
    return time.perf_counter() - started, n


_LOOP_CPU: dict[int, float] = {}  # the last epoch's loop CPU seconds, per loader


async def _alternate(loaders: dict[str, headrace.Loader], rounds: int) -> dict[str, dict]:
    """A warm-up epoch each, then ``rounds`` epochs each in turn (the order flips every round)."""
    for loader in loaders.values():
        await _epoch_seconds(loader)
    times: dict[str, list[float]] = {name: [] for name in loaders}
    counts: dict[str, int] = {}
    names = list(loaders)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds, counts[name] = await _epoch_seconds(loaders[name])
            times[name].append(seconds)
    loop_cpu = {name: _LOOP_CPU[id(loader)] for name, loader in loaders.items()}
    for loader in loaders.values():
        await loader.aclose()
    return {name: {"seconds": statistics.median(t), "runs": t, "samples": counts[name], "loop_cpu_last": loop_cpu[name]}
            for name, t in times.items()}


def _loop_call_seconds(items: list[dict]) -> float:
    started = time.perf_counter()
    for item in items:
        _identity(dict(item))
    return time.perf_counter() - started


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=50_000, help="small samples for the overhead measurement")
    ap.add_argument("--images", type=int, default=1024, help="JPEGs for the async-stage measurement")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--data", default=".data/bench-stages")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    threads = os.cpu_count() or 1

    items = [{"x": i, "y": i % 10} for i in range(args.samples)]
    plain = ops.Pipeline(image=None, label="y")
    staged = ops.Pipeline([ops.Map(_identity)], image=None, label="y")
    small = await _alternate({
        "without": headrace.Loader(readers.sequence(items), batch_size=args.batch, pipeline=plain, device="cpu"),
        "with Map(identity)": headrace.Loader(readers.sequence(items), batch_size=args.batch, pipeline=staged,
                                              device="cpu"),
    }, args.rounds)
    loop_seconds = statistics.median(_loop_call_seconds(items) for _ in range(args.rounds))
    alone = ops.Pipeline([ops.Map(_lookup, concurrency=64)], image=None, label="y")
    lookups = await _alternate({"async 1 ms lookup (64) alone": headrace.Loader(
        readers.sequence(items), batch_size=args.batch, pipeline=alone, device="cpu")}, args.rounds)

    root, _ = datasets.ensure_image_folder(Path(args.data), count=args.images, classes=10)
    train = ops.training(224)
    lookup = ops.Pipeline([ops.Map(_lookup, concurrency=64), *train.listed])
    images = await _alternate({
        "train": headrace.Loader(readers.files(root, shuffle=True), batch_size=args.batch, pipeline=train, device="cpu"),
        "train + async 1 ms lookup (64)": headrace.Loader(readers.files(root, shuffle=True), batch_size=args.batch,
                                                          pipeline=lookup, device="cpu"),
    }, args.rounds)

    n = args.samples
    per_sample = (small["with Map(identity)"]["seconds"] - small["without"]["seconds"]) / n * 1e6
    loop_per_call = loop_seconds / n * 1e6
    print(f"\n{'measurement':44} {'value':>14}")
    print(f"{'samples/s without a stage':44} {n / small['without']['seconds']:>14,.0f}")
    print(f"{'samples/s with Map(identity)':44} {n / small['with Map(identity)']['seconds']:>14,.0f}")
    print(f"{'stage overhead per sample (µs)':44} {per_sample:>14.2f}")
    print(f"{'the same call in a Python loop (µs)':44} {loop_per_call:>14.2f}")
    for name, r in images.items():
        print(f"{'images/s, ' + name:44} {r['samples'] / r['seconds']:>14,.0f}")
    ratio = images["train + async 1 ms lookup (64)"]["seconds"] / images["train"]["seconds"]
    print(f"{'async lookup row / train row (time)':44} {ratio:>14.2f}")
    alone_row = lookups["async 1 ms lookup (64) alone"]
    print(f"{'samples/s, async 1 ms lookup (64) alone':44} {n / alone_row['seconds']:>14,.0f}")
    share = "  share of the ceiling (64 x 1 ms: 64,000/s)"
    print(f"{share:44} {n / alone_row['seconds'] / 64000:>14.0%}")
    print(f"{'  event loop CPU per sample (µs)':44} {alone_row['loop_cpu_last'] / n * 1e6:>14.1f}")
    report = {"date": datetime.date.today().isoformat(), "cores": threads, "samples": n, "images": args.images,
              "batch": args.batch, "rounds": args.rounds, "small": small, "loop_seconds": loop_seconds,
              "stage_us_per_sample": per_sample, "loop_us_per_call": loop_per_call, "images_rows": images,
              "async_alone": lookups}
    out = Path(args.out or f"examples/results/stages-cpu-{report['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main())
