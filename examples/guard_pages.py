"""Does nvImageCodec (nvJPEG) touch memory it should not, on damaged JPEGs? A harness for the GPU machine.

Each fuzzed JPEG (``examples/fuzz.py``'s corpus) that the GPU path would give nvImageCodec is put
in its own mapping so that it ends exactly where a PROT_NONE page starts, then decoded by the
shim's CUDA decoder (``hw_load`` 0; whole images and random windows) and with the hardware engine
(``hw_load`` 1). A read past the data faults at once instead of now and then, and writes past a
decoder's own buffers show up as faults or as malloc aborts. Workers run ranges of inputs in
subprocesses; a crash prints its batch's inputs and the stderr tail (preload
``examples/native_stack.c`` for the faulting thread's native stack).

    cc -shared -fPIC -o /tmp/native_stack.so examples/native_stack.c
    LD_PRELOAD=/tmp/native_stack.so python examples/guard_pages.py SEED COUNT       # GPU
    python examples/guard_pages.py SEED COUNT cpu     # the CPU-only decoder: checks the script here

It found nvJPEG's progressive refinement pass writing past its coefficients (docs/gpu-notes.md).
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # fuzz.py


PICKLE = "/tmp/guard-inputs.pkl"  # the corpus, made once by the parent for its workers


def _span(job):
    return inputs(*job)


def make_all(seed, count, procs=16):
    import multiprocessing, pickle
    spans = [(seed, lo, min(count, lo + 500)) for lo in range(0, count, 500)]
    with multiprocessing.Pool(procs) as pool:
        items = [x for part in pool.map(_span, spans) for x in part]
    with open(PICKLE, "wb") as f:
        pickle.dump(items, f)
    return len(items)


def inputs(seed, lo, hi):
    import fuzz
    from headrace.ops._limits import claimed_size, incomplete, too_few_bits
    out = []
    for i in range(lo, hi):
        item = fuzz.make_input(seed, i)
        d = item.data
        if d[:2] != b"\xff\xd8" or incomplete(d) is not None:
            continue
        size = claimed_size(d)
        if size is None or size[0] * size[1] > 2**26 or max(size) > 65500 or min(size) < 1:
            continue
        if too_few_bits(len(d), size[1], size[0]):
            continue
        out.append((i, d))
    return out


libc = ctypes.CDLL(None)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
KEEP = []


def guarded(blob):
    page = 4096
    pages = (len(blob) + page - 1) // page
    m = mmap.mmap(-1, (pages + 1) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(m))
    start = pages * page - len(blob)
    m[start:start + len(blob)] = blob
    assert libc.mprotect(base + pages * page, page, 0) == 0
    KEEP.append(m)
    return base + start


def worker(seed, lo, hi, hw_load, window, progress, batch=48):
    import torch
    from headrace.ops.cuda import _batch_decode as bd
    cpu = hw_load < 0  # the CPU-only decoder (libjpeg-turbo), host outputs: to check this script without a GPU
    dev = torch.device("cpu") if cpu else torch.device("cuda", 0)
    if not cpu:
        torch.cuda.set_device(dev)
    dec = bd.BatchDecoder(None if cpu else 0, threads=8, hw_load=max(hw_load, 0.0))
    parsed = bd.ParsedBatch()
    lib = parsed._lib
    import pickle
    items = [x for x in pickle.load(open(PICKLE, "rb")) if lo <= x[0] < hi]
    stream = None if cpu else torch.cuda.current_stream(dev)
    decoded = failed = 0
    for b in range(0, len(items), batch):
        chunk = items[b:b + batch]
        with open(progress, "w") as f:
            json.dump([i for i, _ in chunk], f)
        n = len(chunk)
        ptrs = (ctypes.c_void_p * n)(*[guarded(d) for _, d in chunk])
        sizes = np.array([len(d) for _, d in chunk], dtype=np.uint64)
        info = np.zeros((n, 4), dtype=np.int32)
        assert lib.hr_parse(parsed._instance, parsed._handle, n, ptrs, sizes.ctypes.data, 1, info.ctypes.data)
        pick = np.flatnonzero(info[:, 3] == 1).astype(np.int32)
        regions = []
        for j in pick:
            h, w = int(info[j, 0]), int(info[j, 1])
            rng = np.random.default_rng([seed, chunk[j][0]])
            if window and h > 8 and w > 8:
                hh, ww = int(h * rng.uniform(0.3, 1)), int(w * rng.uniform(0.3, 1))
                y0, x0 = int(rng.integers(0, h - hh + 1)), int(rng.integers(0, w - ww + 1))
                regions.append((y0, x0, y0 + max(hh, 1), x0 + max(ww, 1)))
            else:
                regions.append((0, 0, h, w))
        regions = np.array(regions, dtype=np.int32).reshape(-1, 4)
        outs = [torch.empty((int(r[2] - r[0]) * int(r[3] - r[1]) * 3,), dtype=torch.uint8, device=dev) for r in regions]
        status = dec.decode(parsed, pick, regions, np.array([o.data_ptr() for o in outs], np.uint64), 0 if cpu else stream.cuda_stream)
        if not cpu:
            stream.synchronize()
        decoded += int((status == 1).sum())
        failed += int((status != 1).sum())
        parsed.release()
    print(json.dumps({"inputs": len(items), "decoded": decoded, "failed": failed}))


def run(seed, lo, hi, hw_load, window, timeout=120):
    progress = f"/tmp/guard-progress-{os.getpid()}.json"
    crashes = []
    start = lo
    totals = {"inputs": 0, "decoded": 0, "failed": 0}
    while start < hi:
        if os.path.exists(progress):
            os.unlink(progress)
        p = subprocess.run([sys.executable, __file__, "worker", str(seed), str(start), str(hi), str(hw_load), str(int(window)), progress],
                           capture_output=True, text=True, timeout=timeout)
        if p.returncode == 0:
            part = json.loads(p.stdout.strip().splitlines()[-1])
            for k in totals:
                totals[k] += part[k]
            break
        batch = json.load(open(progress)) if os.path.exists(progress) else []
        crashes.append({"exit": p.returncode, "batch": batch, "stderr": p.stderr[-3000:]})
        if not batch:
            break
        start = max(batch) + 1
    return totals, crashes


def refuse_without_gpu() -> None:
    """Say in one line that this harness needs the GPU path, rather than a traceback from a worker."""
    from headrace.ops import cuda_available

    if not cuda_available():
        sys.exit("this harness needs a CUDA GPU with CuPy and nvImageCodec (pip install '.[cuda12]' or "
                 "'.[cuda13]'); none here")


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        import faulthandler
        faulthandler.enable()
        seed, lo, hi, hw, window, progress = sys.argv[2:8]
        worker(int(seed), int(lo), int(hi), float(hw), window == "1", progress)
        sys.exit(0)
    seed, count = int(sys.argv[1]), int(sys.argv[2])
    on_cpu = len(sys.argv) > 3 and sys.argv[3] == "cpu"  # the harness checked on the CPU decoder
    if not on_cpu:
        refuse_without_gpu()
    t0 = time.time()
    print(f"{make_all(seed, count)} JPEGs for nvImageCodec among {count} inputs ({time.time() - t0:.0f} s)", flush=True)
    configs = ((-1.0, True),) if on_cpu else ((0.0, True), (0.0, False), (1.0, True))
    crashed = 0
    for hw_load, window in configs:
        t0 = time.time()
        totals, crashes = run(seed, 0, count, hw_load, window)
        crashed += len(crashes)
        print(f"hw_load={hw_load} window={window}: {totals}, {len(crashes)} crashed batches, {time.time() - t0:.0f} s", flush=True)
        for c in crashes[:6]:
            print("   crash", c["exit"], "batch", c["batch"][:50])
            print("      " + "\n      ".join(c["stderr"].strip().splitlines()[-14:]), flush=True)
    sys.exit(1 if crashed else 0)  # a harness that finds crashes must fail the job that runs it
