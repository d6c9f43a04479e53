"""How many times the GPU path's prep thread gives up the GIL planning one batch (CPU only).

Every time a thread lets the GIL go it must take it back, and beside threads running Python that
waits until one of them lets go in turn: up to the switch interval (5 ms). So the planning of a
batch of 256 (random draws, RandomResizedCrop windows, decode regions, the fused kernel's tables;
and all of ``prepare`` past the header parse, which is one GIL-free call into the shim, stood in
for here) runs twice: alone, then beside a thread spinning pure Python, which keeps the GIL for a
whole switch interval each time it gets it. The extra time a batch, over the switch interval, is
the hand-offs a batch. Before ``ops/_gil.py`` it was ~26 (docs/benchmarks.md, issue 21).

The last rows are the prep thread's host work for the post ops of a batch of 224 x 224 crops
(``RandAugment``, ``TimmRandAugment``; ``plan_post``): their passes drawn, laid out and built into
the plan the shim issues, its addresses named (nothing runs on a GPU).

    python examples/benchmark_prep_handoffs.py
"""
import collections
import sys
import threading
import time

import numpy as np

from headrace import ops
from headrace._sample import Sample, SampleBatch
from headrace.ops._geometry import plan_batch, roi_batch
from headrace.ops._random import uniforms
from headrace.ops.cuda._post_passes import plan_post
from headrace.ops.cuda._prep import kernel_tables, prepare

N = 256
rng = np.random.default_rng(0)
heights, widths = rng.integers(300, 600, N), rng.integers(300, 600, N)
pipe = ops.training(224)
indices = np.arange(N)


def draws():
    return [uniforms(0, 0, pos, indices, op.randoms) if op.randoms else None for pos, op in enumerate(pipe.image_ops, 1)]


def plan():
    plans = plan_batch(heights, widths, pipe.image_ops, draws())
    kernel_tables(plans, roi_batch(plans, heights, widths, np.int32))


class Headers:  # the shim's parse, stood in for: (height, width, channels, parsed) a row
    def parse(self, data):
        info = np.empty((len(data), 4), dtype=np.int32)
        info[:, 0], info[:, 1], info[:, 2], info[:, 3] = heights, widths, 3, 1
        return None, info

    def recycle(self, token):
        pass


blob = b"\xff\xd8" + bytes(200_000) + b"\xff\xd9"  # a JPEG's first and last markers, long enough for its size
batch = SampleBatch([Sample(f"k{i}", {"jpg": blob, "cls": b"3"}, "src", i, i) for i in range(N)], 0, 0)


def prep():
    prepare(batch, pipe, Headers(), 0, collections.Counter())


def seconds_a_batch(work, beside_a_spinner, batches):
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    if beside_a_spinner:
        spinner.start()
    started = time.perf_counter()
    for _ in range(batches):
        work()
    took = (time.perf_counter() - started) / batches
    stop.set()
    if beside_a_spinner:
        spinner.join()
    return took


def post_planning(policy):
    pipeline = ops.Pipeline([*pipe.ops[:-1], policy, pipe.ops[-1]])
    epochs = iter(range(1_000_000))

    def work():  # what the prep thread does for a batch of the GPU path (``plan_post``)
        plan_post(pipeline, 0, next(epochs), indices, (224, 224))
    return work


interval = sys.getswitchinterval()
print(f"batch of {N}, switch interval {interval * 1e3:g} ms")
for name, work in {"random draws": draws, "plan (draws, windows, regions, tables)": plan,
                   "prepare past the header parse": prep,
                   "post ops' planning, RandAugment()": post_planning(ops.RandAugment()),
                   "post ops' planning, TimmRandAugment()": post_planning(ops.TimmRandAugment())}.items():
    alone, beside = seconds_a_batch(work, False, 200), seconds_a_batch(work, True, 40)
    print(f"{name:40s} alone {alone * 1e3:6.2f} ms, beside a spinning thread {beside * 1e3:7.2f} ms: "
          f"~{max(beside - alone, 0) / interval:.1f} hand-offs a batch")
