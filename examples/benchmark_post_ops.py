"""The GPU time of a batch's post ops, per policy, against the memory-bandwidth floor (needs CUDA).

On the H200 the augmentation policies cost the train row 10-33% (docs/benchmarks.md), and moving
their host planning off the lanes did not move the rate. This measures the other side: what the
post ops' kernels cost the GPU, which the decoders' kernels share. Each policy's plans for
``--repeat`` batches are made first (``plan_post``, as the prep thread makes them), then issued
back to back on one stream, so the GPU, not the host, sets the pace; the GPU time a batch is the
elapsed time between two events over the batches. The floor is the bytes the launches read and
write (each changed sample's pixels once each way, the finish's read and its float16 write) at
the rate of a device-to-device copy measured in the same run. "issue, host ms" is the host's
time a batch to issue them: where it reaches the GPU time, the host set the pace, and the GPU
time is an upper bound. The row without post ops is such a row: its finish is planned at each
call (``PostOps.finish``; the lane's own kernel normalizes, so no lane runs it per batch).

    python examples/benchmark_post_ops.py [--batch 256] [--size 224] [--repeat 40]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from headrace import ops
from headrace.ops.cuda._plan import Plan
from headrace.ops.cuda._post import PostOps
from headrace.ops.cuda._post_passes import BatchPasses, plan_post, post_steps

POLICIES = {
    "none (finish only)": None,
    "ColorTwist": lambda: ops.ColorTwist(0.4, 0.4, 0.4, 0.1),
    "Rotate": lambda: ops.Rotate(30),
    "GaussianBlur(5)": lambda: ops.GaussianBlur(5),
    "RandAugment": ops.RandAugment,
    "TrivialAugmentWide": ops.TrivialAugmentWide,
    "AutoAugment": ops.AutoAugment,
    "TimmRandAugment": ops.TimmRandAugment,
}


def pipeline_with(post) -> ops.Pipeline:
    listed = list(ops.training(224, dtype="float16").ops)
    return ops.Pipeline([*listed[:-1], *([post()] if post else []), listed[-1]])


def copy_rate(nbytes: int = 1 << 30) -> float:
    """Bytes a second of a device-to-device copy (read plus write counted), the floor's rate."""
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    return 2 * 10 * nbytes / (start.elapsed_time(end) / 1e3)


def bytes_moved(pipeline: ops.Pipeline, indices: np.ndarray, epoch: int, size: int) -> int:
    """What a batch's launches read and write at least: each pass's changed samples once each way
    (a blur twice, through its float32 scratch), then the finish's uint8 read and float16 write."""
    n, c = len(indices), pipeline.channels
    rows = np.array([(0, size, size, size * c, c)] * n, dtype=np.int64)
    passes = BatchPasses(rows, post_steps(pipeline, 0, epoch, indices, rows[:, 1], rows[:, 2]), c, inplace=True)
    pixels = size * size * c
    moved = 0
    for op, _, active, _, _ in passes.passes:
        moved += int(active.sum()) * pixels * (2 + (8 if isinstance(op, ops.GaussianBlur) else 0))
    target = passes.launches(Plan(), 0, gather=True)
    if target is not None:  # the samples outside the buffer that holds most are gathered into it
        moved += int(np.count_nonzero(passes.where != target)) * pixels * 2
    return moved + n * pixels * (1 + 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--repeat", type=int, default=40)
    args = ap.parse_args()
    if not ops.cuda_available():
        raise SystemExit("benchmark_post_ops.py measures the GPU path's post ops: it needs a CUDA GPU and CuPy")
    import cupy

    n, size = args.batch, args.size
    rate = copy_rate()
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {rate / 1e9:,.0f} GB/s (read + write)")
    stream = cupy.cuda.Stream(non_blocking=True)
    events = torch.cuda.ExternalStream(stream.ptr)
    images = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, device="cuda")
    print(f"| post ops (batch {n}, {size} x {size}) | plan, host ms | issue, host ms | launches | GPU ms a batch "
          "| floor ms | of the floor |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, post in POLICIES.items():
        pipeline = pipeline_with(post)
        runner = PostOps(pipeline, stream, seed=0)
        epochs = list(range(args.repeat + 3))
        t0 = time.perf_counter()
        planned = [plan_post(pipeline, 0, e, np.arange(n, dtype=np.int64) + e * n, (size, size)) for e in epochs]
        host_ms = (time.perf_counter() - t0) / len(planned) * 1e3
        # Without post ops there is no plan to make: the finish alone, as the lane's kernel would not run it.
        issue = [(lambda p=p: runner.run_planned(images, p)) if p is not None else (lambda: runner.finish(images))
                 for p in planned]
        torch.cuda.synchronize()
        outs = [run() for run in issue[:3]]  # warm-up: kernels loaded, slots grown
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(events)
        t1 = time.perf_counter()
        outs += [run() for run in issue[3:]]
        issue_ms = (time.perf_counter() - t1) / args.repeat * 1e3
        end.record(events)
        end.synchronize()
        gpu_ms = start.elapsed_time(end) / args.repeat
        moved = np.mean([bytes_moved(pipeline, np.arange(n, dtype=np.int64) + e * n, e, size) for e in epochs[3:]])
        floor_ms = moved / rate * 1e3
        launches = len(planned[-1].plan) if planned[-1] is not None else 1
        print(f"| {name} | {host_ms:.2f} | {issue_ms:.2f} | {launches} | {gpu_ms:.3f} | {floor_ms:.3f} | {floor_ms / gpu_ms:.0%} |", flush=True)
        del outs

if __name__ == "__main__":
    main()
