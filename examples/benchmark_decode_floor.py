"""The GPU path's decode floor: nvImageCodec through headrace's C shim, and nothing else.

L lanes (a thread, a CUDA stream and a decoder each) parse and decode batches of 256 in turn, the
training pipeline's random-resized-crop windows, from JPEGs already in memory: no reader, no
kernels, no event loop. What the whole pipeline reaches over this is what the host side costs
(docs/gpu-notes.md §6 has the Python API's numbers). Needs a GPU; prints one line per
configuration (lanes, hw_load, decoder threads; lanes of their own kind, lanes taking the next
batch when free): median images/s of two passes after one, and the
host cores the process kept busy (CPU time over wall time) for it. ``--whole-frames`` gives the
engines whole JPEG frames (``GpuTuning(cut_frames=False)``).

    python examples/benchmark_decode_floor.py /path/to/class-folders [K ...]   # e.g. benchmark_gpu.py's --data;
                                                                              # K: run only configuration K
"""
import glob
import os
import statistics
import sys
import threading
import time

import cupy
import numpy as np
import torch

from headrace import ops
from headrace.ops.cuda._batch_decode import BatchDecoder, Launch, ParsedBatch
from headrace.ops._geometry import plan_batch, roi_batch
from headrace.ops._random import uniforms

args = [a for a in sys.argv[1:] if a != "--whole-frames"]
CUT_FRAMES = "--whole-frames" not in sys.argv[1:]  # the A/B of the engines' frames cut below the window
root = args[0]
files = sorted(glob.glob(f"{root}/*/*.jpg"))
blobs = [open(f, "rb").read() for f in files]
B = 256
batches = [blobs[i:i + B] for i in range(0, len(blobs), B)]
PIPES = {"train": ops.training(224), "val": ops.validation(224)}

def regions_for(info, k, pipe):
    idx = np.arange(k * B, k * B + len(info))
    rnd = [uniforms(0, 0, pos, idx, op.randoms) if op.randoms else None for pos, op in enumerate(pipe.image_ops, 1)]
    return roi_batch(plan_batch(info[:, 0], info[:, 1], pipe.image_ops, rnd), info[:, 0], info[:, 1]).astype(np.int32)

def run(lanes, hw, threads, cuda_load=1.0, passes=3, mix=None, dynamic=False, windows="train"):
    """mix: each lane's own (hw_load, threads); dynamic: each lane takes the next batch when it is
    free (a shared queue) instead of every lanes-th batch; windows: the training pipeline's crop
    windows, or validation's (centre)."""
    rates = []
    queue = {"next": iter(()), "lock": threading.Lock()}

    def batch_numbers(i):
        if not dynamic:
            yield from range(i, len(batches), lanes)
            return
        while True:
            with queue["lock"]:
                k = next(queue["next"], None)
            if k is None:
                return
            yield k

    class Lane(threading.Thread):
        def __init__(s, i):
            super().__init__(daemon=True)  # a lane that failed leaves the others waiting: do not wait for them at exit
            s.i = i; s.ready = threading.Event(); s.go = threading.Event(); s.done = threading.Event(); s.error = None
        def run(s):
            try:
                s.work()
            except BaseException as e:
                s.error = e
                s.ready.set(); s.done.set()
                raise
        def work(s):
            torch.cuda.set_device(0); cupy.cuda.Device(0).use()
            s.stream = cupy.cuda.Stream(non_blocking=True)
            lane_hw, lane_threads = mix[s.i] if mix else (hw, threads)
            s.dec = BatchDecoder(0, threads=lane_threads, hw_load=lane_hw, cuda_load=cuda_load, cut_frames=CUT_FRAMES)
            s.parsed = ParsedBatch()
            s.ws = [torch.empty(B * 224 * 224 * 3 * 8, dtype=torch.uint8, device="cuda") for _ in range(2)]
            s.ready.set()
            for p in range(passes):
                s.go.wait(); s.go.clear()
                ev = [None, None]
                for turn, k in enumerate(batch_numbers(s.i)):
                    info = s.parsed.parse(batches[k], exif=True)
                    reg = regions_for(info, k, PIPES[windows])
                    h, w = reg[:, 2] - reg[:, 0], reg[:, 3] - reg[:, 1]
                    sizes = (h.astype(np.int64) * w * 3 + 255) // 256 * 256
                    slot = turn % 2
                    if ev[slot] is not None: ev[slot].synchronize()
                    ptr = np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.uint64) + np.uint64(s.ws[slot].data_ptr())
                    launch = Launch()
                    st, _ = s.dec.decode_launch(s.parsed, np.arange(len(info), dtype=np.int32), reg, ptr, s.stream.ptr, launch)
                    assert (st == 1).all(), (st != 1).sum()
                    s.parsed.release()
                    ev[slot] = s.stream.record()
                s.stream.synchronize()
                s.done.set()
            s.final_share = s.dec.hw_share  # where "adaptive" left it
            s.dec.close(); s.parsed.close()
    ls = [Lane(i) for i in range(lanes)]
    for l in ls: l.start()
    for l in ls: l.ready.wait()

    def failed():
        if any(l.error for l in ls):
            raise SystemExit(f"a lane failed: {next(l.error for l in ls if l.error)!r}")
    failed()
    busy = []  # host cores busy (process CPU time over wall time): what the rate costs the host
    for p in range(passes):
        queue["next"] = iter(range(len(batches)))
        t, cpu = time.perf_counter(), time.process_time()
        for l in ls: l.go.set()
        for l in ls: l.done.wait(); l.done.clear()
        failed()
        dt = time.perf_counter() - t
        if p:
            rates.append(len(blobs) / dt)
            busy.append((time.process_time() - cpu) / dt)
    for l in ls: l.join()
    return statistics.median(rates), rates, statistics.median(busy), [round(l.final_share, 3) for l in ls]

cores = os.cpu_count()
# (lanes, hw_load, decoder threads, CUDA decoder's share of the rest: the remainder decodes on the CPU[, order
# (14-16: an order the shim once took, now skipped), lanes of their own kind, each lane taking the next batch])
configs = [(1, 0.65, cores, 1.0), (2, 0.65, cores, 1.0), (2, "adaptive", cores, 1.0), (2, 0.65, cores, 0.9),
           (2, 0.65, cores, 0.8), (2, 0.5, cores, 0.8), (3, 0.65, cores, 1.0), (3, "adaptive", cores, 1.0),
           (4, 0.65, cores, 1.0), (4, "adaptive", cores, 1.0), (2, 0.65, cores // 2, 1.0), (2, 0.5, cores, 1.0),
           (2, 0.8, cores, 1.0), (3, 0.65, cores // 3, 1.0),
           (2, 0.65, cores, 1.0, "area"), (2, 0.8, cores, 1.0, "area"), (1, 0.65, cores, 1.0, "area"),
           # 17-19: the hardware engines alone (every JPEG here is baseline); 20-23: the CUDA decoder
           # alone (Huffman on the host) on 16, 8, 4, 2 threads: what a host core is worth to it
           (1, 1.0, cores, 1.0), (2, 1.0, cores, 1.0), (3, 1.0, cores, 1.0),
           (2, 0.0, cores, 1.0), (2, 0.0, 8, 1.0), (2, 0.0, 4, 1.0), (2, 0.0, 2, 1.0),
           # 24-29: more lanes with the engines taking more, the host threads shared among the lanes
           (4, 1.0, cores, 1.0), (3, 0.8, cores, 1.0), (3, 0.8, cores // 3, 1.0), (4, 0.8, cores // 4, 1.0),
           (4, 0.65, cores // 4, 1.0), (3, 0.9, cores, 1.0),
           # 30-35: lanes taking the next batch when free; then lanes of one kind each, the engines'
           # (hw_load 1, one host thread) beside the CUDA decoder's (hw_load 0, the cores left)
           (4, 0.65, cores // 4, 1.0, None, None, True), (3, 0.65, cores // 3, 1.0, None, None, True),
           (5, "mix", 0, 1.0, None, [(1.0, 1)] * 3 + [(0.0, (cores - 3) // 2)] * 2, True),
           (4, "mix", 0, 1.0, None, [(1.0, 1)] * 2 + [(0.0, (cores - 2) // 2)] * 2, True),
           (6, "mix", 0, 1.0, None, [(1.0, 1)] * 4 + [(0.0, (cores - 4) // 2)] * 2, True),
           (6, "mix", 0, 1.0, None, [(1.0, 1)] * 3 + [(0.0, (cores - 3) // 3)] * 3, True),
           # 36-41: the default lanes (4, hw_load 0.65, the threads shared), the batch shared or
           # stolen (the engine and the CUDA decoder taking from its two ends: tried, measured no
           # faster and removed, so skipped now), training's windows then validation's; 3 lanes stolen
           (4, 0.65, cores // 4, 1.0, None, None, False, "share"), (4, 0.65, cores // 4, 1.0, None, None, False, "steal"),
           (4, 0.65, cores // 4, 1.0, None, None, False, "share", "val"),
           (4, 0.65, cores // 4, 1.0, None, None, False, "steal", "val"),
           (3, 0.65, cores // 3, 1.0, None, None, False, "steal"), (3, 0.65, cores // 3, 1.0, None, None, False, "steal", "val"),
           # 42-49: the default lanes with a larger engine share (frames cut below the window made
           # the engines faster), training's windows then validation's; the share adapted batch by batch
           (4, 0.7, cores // 4, 1.0, None, None, False, "share"), (4, 0.75, cores // 4, 1.0, None, None, False, "share"),
           (4, 0.8, cores // 4, 1.0, None, None, False, "share"), (4, "adaptive", cores // 4, 1.0, None, None, False, "share"),
           (4, 0.7, cores // 4, 1.0, None, None, False, "share", "val"),
           (4, 0.75, cores // 4, 1.0, None, None, False, "share", "val"),
           (4, 0.8, cores // 4, 1.0, None, None, False, "share", "val"),
           (4, "adaptive", cores // 4, 1.0, None, None, False, "share", "val"),
           # 50-51: a smaller engine share, training's windows then validation's
           (4, 0.6, cores // 4, 1.0, None, None, False, "share"), (4, 0.6, cores // 4, 1.0, None, None, False, "share", "val"),
           # 52-53: the default since 2026-12-04 (thirty-eighth session), training's windows then
           # validation's. From then on hw_load is a share of the bytes the windows need read; the
           # numbers of configurations measured before it are shares of the images.
           (4, 0.76, cores // 4, 1.0, None, None, False, "share"), (4, 0.76, cores // 4, 1.0, None, None, False, "share", "val")]
# optional: the indices of the configurations to run, in that order (one may come again: turns)
chosen = [int(k) for k in args[1:]] or range(len(configs))
for k in chosen:
    lanes, hw, th, cl, *rest = configs[k]
    order, mix, dynamic, split, windows = (list(rest) + [None, None, False, "share", "train"][len(rest):])
    if split == "steal":  # kept so that the numbers the docs cite still name the same configurations
        print(f"configuration {k}: the shim no longer steals a batch from both ends (docs/benchmarks.md, "
              "thirty-fifth session); skipped", flush=True)
        continue
    if order:  # kept so that the numbers the docs cite still name the same configurations
        print(f"configuration {k}: the shim no longer takes a decode order (the engine takes the largest "
              "windows, batch_decode.c's engine_first); skipped", flush=True)
        continue
    med, rates, busy, shares = run(lanes, hw, th, cl, mix=mix, dynamic=dynamic, windows=windows)
    how = f" mix={mix}" if mix else ""
    how += f" windows={windows}" if k >= 36 else ""
    how += " (a share of the bytes)" if isinstance(hw, float) else ""
    how += f" (the lanes' shares at the end {shares})" if hw == "adaptive" else ""
    how += " (each lane takes the next batch)" if dynamic else ""
    print(f"decode floor lanes={lanes} hw={hw} threads={th} cuda_load={cl}{how}: {med:,.0f} img/s  "
          f"runs {[round(r) for r in rates]}  cores busy {busy:.1f} ({busy / med * 1000:.2f} per 1,000 img/s)", flush=True)
