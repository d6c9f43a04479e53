"""The training pipeline fed by local WebDataset shards against the same JPEGs as files.

On the H200 the GPU pipeline read local shards at 19-22k images/s where the same JPEGs as files
ran at 27-29k (docs/benchmarks.md, fortieth session). This script runs the two side by side, and
variants of the shard reader that test a cause each, every variant in a process of its own (a
warm-up epoch, then ``--epochs`` timed ones), and prints one JSON line a variant: the rate of each
epoch, host cores by thread, how long a thread sleeping 1 ms at a time waited past its 1 ms
(mostly the wait for the GIL), and the loader's own metrics of the last epoch (how busy its read and
decode stages were, ``docs/metrics.md``).

Variants: ``files`` (``readers.files``, shuffled), ``shards`` (``readers.webdataset``, shuffled
through its buffer), ``shards-noshuffle``, ``shards-switch0.5ms`` (``sys.setswitchinterval(0.0005)``:
the GIL handed over ten times as often), ``shards-readahead5`` (``read_ahead=5``), ``shards-nopool``
(fields copied into fresh ``bytes``, not the reader's recycled ones; the C grouping off with it),
``shards-python`` (a window's members grouped into samples by the parser's Python loop, 64 headers
a scan, as before the grouping moved to C).

The data set is ``examples/benchmark_latency.py``'s (16,384 JPEGs as ~100 MB shards and as files,
made once under ``.data/bench-latency-pipeline``).

    python examples/benchmark_shard_pipeline.py                       # the GPU pipeline, two rounds
    python examples/benchmark_shard_pipeline.py --device cpu --rounds 1   # the loader's reading alone
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVE = HERE.parent / ".data" / "bench-latency-pipeline" / "serve"
VARIANTS = "files,shards,shards-noshuffle,shards-switch0.5ms,shards-readahead5,shards-nopool"


class GilProbe(threading.Thread):
    """Sleeps 1 ms at a time; how much longer each sleep took is mostly its wait for the GIL."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="gil-probe")
        self.extra, self.sleeps, self.stopped = 0.0, 0, False

    def run(self) -> None:
        while not self.stopped:
            began = time.perf_counter()
            time.sleep(0.001)
            self.extra += time.perf_counter() - began - 0.001
            self.sleeps += 1

    def mean_extra_us(self) -> int:
        return round(1e6 * self.extra / max(1, self.sleeps))


def _reader(variant: str):  # noqa: ANN202 - a headrace reader
    from headrace import readers

    if variant == "files":
        return readers.files(SERVE / "images", shuffle=True)
    if variant == "shards-python":  # the members grouped into samples by the Python loop, 64 headers a scan, as before
        import headrace.readers._shard_files as shard_files
        import headrace.readers._tar as tar

        shard_files.SamplePool.grouper = lambda self: None
        tar._SCAN_BATCH = 64
    if variant == "shards-nopool":
        import headrace.readers._shard_files as shard_files

        shard_files.SamplePool.copy = lambda self, spans: None  # the caller then copies into fresh bytes
        shard_files.SamplePool.grouper = lambda self: None
    options: dict[str, object] = {"shuffle": variant != "shards-noshuffle"}
    if variant == "shards-readahead5":
        options["read_ahead"] = 5
    if variant == "shards-switch0.5ms":
        sys.setswitchinterval(0.0005)
    return readers.webdataset(sorted(str(p) for p in (SERVE / "shards").glob("*.tar")), **options)


def run_variant(variant: str, device: str, epochs: int) -> dict[str, object]:
    import headrace
    from headrace import ops
    from headrace._loop import new_event_loop

    sys.path.insert(0, str(HERE))
    from _thread_cpu import ThreadCpu

    pipeline = ops.training(224, dtype="float16") if device == "cuda" else ops.Pipeline(image=None, label=None, fields=[])
    loader = headrace.Loader(_reader(variant), batch_size=256, pipeline=pipeline, device=device)
    loop = new_event_loop()

    async def epoch() -> int:
        images = 0
        async for batch in loader:
            images += batch.size
        return images

    loop.run_until_complete(epoch())  # warm-up: threads, lanes, kernels
    rates, waits = [], []
    cpu = ThreadCpu()
    cpu.start()
    began, total = time.perf_counter(), 0
    for _ in range(epochs):
        probe = GilProbe()
        probe.start()
        start = time.perf_counter()
        images = loop.run_until_complete(epoch())
        if device == "cuda":
            import torch

            torch.cuda.synchronize()
        rates.append(round(images / (time.perf_counter() - start)))
        total += images
        probe.stopped = True
        probe.join()
        waits.append(probe.mean_extra_us())
    wall = time.perf_counter() - began
    cores = cpu.stop()
    metrics = loader.stats().epoch_metrics
    loop.run_until_complete(loader.aclose())
    loop.close()
    return {"variant": variant, "epochs": rates, "rate": round(total / wall), "sleep_overrun_us": waits,
            "cores": dict(list(cores.items())[:8]), "counters": cpu.counters,
            "last_epoch": {k: round(v, 3) for k, v in metrics.as_dict().items()} if metrics is not None else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cuda: ops.training(224) on the GPU; cpu: the loader's reading alone")
    parser.add_argument("--variants", default=VARIANTS)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the variants, alternated")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a child process's one variant
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.device, args.epochs)), flush=True)
        return
    if not (SERVE / "shards").exists():
        sys.path.insert(0, str(HERE))
        import benchmark_latency

        benchmark_latency.make_data(SERVE.parent, 16384, 100)
    for _ in range(args.rounds):
        for variant in args.variants.split(","):
            child = subprocess.run([sys.executable, __file__, "--variant", variant, "--device", args.device,
                                    "--epochs", str(args.epochs)], capture_output=True, text=True, timeout=600,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
            lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
            print(lines[-1] if lines else json.dumps({"variant": variant, "rc": child.returncode,
                                                      "stderr": child.stderr[-800:]}), flush=True)


if __name__ == "__main__":
    main()
