"""The host CPU a batch's post-op plan takes, per policy, alone on one thread (no GPU needed).

On the GPU path the prep thread plans each batch's post ops ahead of its lane (``plan_post``: the
policy's draws, the passes' tables, the plan's layout). With AugMix that thread is what limits the
rate (docs/benchmarks.md). This times the planning by itself, with nothing else running: against
the prep thread's time a batch inside the pipeline (``benchmark_gpu.py``'s timings) it says how
much of that is the planning's own CPU and how much the pipeline's other threads add. Each row:
``--batches`` batches of ``--batch`` samples at ``--size``, after a warm-up, CPU time a batch
(the median of ``--runs``, and their range). ``splits=3`` rows plan both augmented views
(``Pipeline(splits=3)``: two plans a batch).

    python examples/benchmark_post_planning.py [--batch 256] [--size 224] [--batches 60] [--runs 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from headrace import ops
from headrace.ops.cuda._post_passes import plan_post

POLICIES = {
    "RandAugment": ops.RandAugment,
    "TimmRandAugment": ops.TimmRandAugment,
    "TimmAutoAugment(original-mstd0.5)": lambda: ops.TimmAutoAugment("original-mstd0.5"),
    "AugMix": ops.AugMix,
    "TimmAugMix(augmix-m5-w4-d2)": lambda: ops.TimmAugMix("augmix-m5-w4-d2"),
    "TimmAugMix(augmix-m5-w4-d2), splits=3": lambda: ops.TimmAugMix("augmix-m5-w4-d2"),
}


def plan_seconds(pipeline: ops.Pipeline, batch: int, size: int, batches: int, epoch: int) -> float:
    """CPU seconds a batch to plan every augmented view of ``batches`` batches."""
    start = time.process_time()
    for k in range(batches):
        indices = np.arange(k * batch, (k + 1) * batch)
        for split in pipeline.augmented_views:
            plan_post(pipeline, 0, epoch, indices, (size, size), split)
    return (time.process_time() - start) / batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    print(f"{'policy':<40} {'ms a batch':>10}  range")
    for name, make in POLICIES.items():
        listed = [ops.Decode(), ops.RandomResizedCrop(args.size), ops.Flip(), make(), ops.Normalize(dtype="float16")]
        pipeline = ops.Pipeline(listed, splits=3 if name.endswith("splits=3") else 1)
        plan_seconds(pipeline, args.batch, args.size, 20, epoch=0)  # warm-up: imports, caches, the C helper
        runs = [1e3 * plan_seconds(pipeline, args.batch, args.size, args.batches, epoch=1 + r) for r in range(args.runs)]
        print(f"{name:<40} {statistics.median(runs):>10.2f}  {min(runs):.2f}-{max(runs):.2f}", flush=True)


if __name__ == "__main__":
    main()
