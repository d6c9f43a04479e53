"""The hardware JPEG engines driven directly through nvJPEG, without nvImageCodec: their ceiling.

nvImageCodec's engine decoder keeps one nvJPEG state per decoder and waits for its previous batch
before the next, so headrace needs several lanes to keep the engines busy. This script calls
nvJPEG's hardware batched decode itself (ctypes, the `nvidia-nvjpeg` wheel's library) to see what
the engines give for this data however they are driven. Needs a GPU with the engines (A100, H100);
the images are benchmark_gpu.py's set (`--data`), read into memory first.

    python examples/benchmark_jpeg_engines.py /path/to/class-folders [CONFIG ...]

A CONFIG is either `K:S:roi:B`, K threads each with its own handle and S states used in turn,
batches of B, whole images (roi 0) or the training pipeline's crop windows (roi 1), or
`mix:E:C:T`, E such engine threads beside C nvImageCodec lanes of the CUDA decoder alone
(`hw_load` 0, T host threads each), every thread taking the next whole batch from one queue.
A `K:S:roi:B` prefixed `gpu:` (`host:`) drives nvJPEG's batched decode with its GPU-hybrid
(hybrid) backend instead of the engines: Huffman on the GPU (on the calling thread). `mix:E:C:T:G`
adds G threads of the batched GPU-hybrid decode to the queue.
`--truncate` cuts each JPEG's frame height below its training window (what the engines and the host's
Huffman decode would then skip; roi 1 configurations only). `--passes N` sets the passes a
configuration runs (3), `--stamps` prints each pass's end time; `--priority`, `--alloc-count` and
`--alloc-cache` are the GPU-hybrid diagnostics (stream priorities; nvJPEG's allocations counted, or
counted and cached); `--green N` runs the GPU-hybrid decode's streams in a CUDA green context of N
SMs, so its kernels leave the other SMs to the engines' work (CUDA 12.4+ drivers).
Each line: images/s (median of the passes after the first), the host cores the process kept busy,
and for `K:S:roi:B` the share of the threads' time spent inside the decode call; the first
configuration is checked against Pillow. docs/benchmarks.md has the H100's numbers (issue 22).
"""
import ctypes as C
import glob
import os
import statistics
import sys
import threading
import time

import cupy
import numpy as np

lib_path = None
for p in sys.path:
    cand = os.path.join(p, "nvidia/cu13/lib/libnvjpeg.so.13")
    if os.path.exists(cand):
        lib_path = cand
        break
nv = C.CDLL(lib_path or "libnvjpeg.so.13")
print("libnvjpeg:", lib_path, flush=True)
V = C.c_void_p


class Image(C.Structure):
    _fields_ = [("channel", V * 4), ("pitch", C.c_size_t * 4)]


P, I, SZ = C.POINTER(V), C.c_int, C.c_size_t
for name, args in {
    "nvjpegCreateEx": [I, V, V, C.c_uint, P], "nvjpegGetHardwareDecoderInfo": [V, C.POINTER(C.c_uint), C.POINTER(C.c_uint)],
    "nvjpegGetImageInfo": [V, C.c_char_p, SZ, C.POINTER(I), C.POINTER(I), C.POINTER(I), C.POINTER(I)],
    "nvjpegJpegStreamCreate": [V, P], "nvjpegJpegStreamParse": [V, C.c_char_p, SZ, I, I, V],
    "nvjpegDecodeBatchedSupported": [V, V, C.POINTER(I)], "nvjpegDecodeBatchedSupportedEx": [V, V, V, C.POINTER(I)],
    "nvjpegDecodeParamsCreate": [V, P], "nvjpegDecodeParamsSetOutputFormat": [V, I],
    "nvjpegDecodeParamsSetROI": [V, I, I, I, I], "nvjpegJpegStateCreate": [V, P],
    "nvjpegDecodeBatchedInitialize": [V, V, I, I, I],
    "nvjpegDecodeBatchedEx": [V, V, V, V, V, V, V], "nvjpegDecodeBatched": [V, V, V, V, V, V],
}.items():
    getattr(nv, name).argtypes = args
    getattr(nv, name).restype = I


def ok(status, what):
    if status != 0:
        raise RuntimeError(f"{what}: nvjpeg status {status}")


HYBRID, GPU_HYBRID, HARDWARE, RGBI = 1, 2, 3, 5
BACKENDS = {"hw": HARDWARE, "gpu": GPU_HYBRID, "host": HYBRID}
# Diagnostics are flags among the configurations (until 2026-12-04 they were environment variables:
# PRIORITY=1, ALLOC=cache, TRUNCATE=1, PASSES=n, STAMPS=1, as docs/benchmarks.md's commands of then say).
FLAGS = {"--priority", "--alloc-count", "--alloc-cache", "--truncate", "--stamps"}
_args = sys.argv[1:]


def int_option(name, default):
    """``name N`` taken out of the arguments: N, or ``default`` when it is not there."""
    if name not in _args:
        return default
    at = _args.index(name)
    value = int(_args[at + 1])
    del _args[at:at + 2]
    return value


PASSES, GREEN_SMS = int_option("--passes", 3), int_option("--green", 0)
OPTIONS = {a for a in _args if a in FLAGS}
root, *CONFIGS = [a for a in _args if a not in FLAGS]
files = sorted(glob.glob(f"{root}/*/*.jpg"))
blobs = [open(f, "rb").read() for f in files]
addrs = np.array([C.cast(C.c_char_p(b), V).value for b in blobs], dtype=np.uint64)
sizes = np.array([len(b) for b in blobs], dtype=np.uint64)

h0 = V()
ok(nv.nvjpegCreateEx(HARDWARE, None, None, 0, C.byref(h0)), "nvjpegCreateEx(HARDWARE)")
engines, cores = C.c_uint(), C.c_uint()
st = nv.nvjpegGetHardwareDecoderInfo(h0, C.byref(engines), C.byref(cores))
print(f"hardware decoder info: status {st}, engines {engines.value}, cores per engine {cores.value}", flush=True)

# sizes and support
H = np.zeros(len(blobs), np.int64); W = np.zeros(len(blobs), np.int64)
ncomp, sub = C.c_int(), C.c_int()
ws, hs = (C.c_int * 4)(), (C.c_int * 4)()
for i, b in enumerate(blobs):
    ok(nv.nvjpegGetImageInfo(h0, b, len(b), C.byref(ncomp), C.byref(sub), ws, hs), "info")
    H[i], W[i] = hs[0], ws[0]
js = V(); ok(nv.nvjpegJpegStreamCreate(h0, C.byref(js)), "stream create")
unsupported = 0
for b in blobs[:2048]:
    ok(nv.nvjpegJpegStreamParse(h0, b, C.c_size_t(len(b)), 0, 0, js), "parse")
    s = C.c_int(); ok(nv.nvjpegDecodeBatchedSupported(h0, js, C.byref(s)), "supported")
    unsupported += s.value != 0
print(f"{len(blobs)} JPEGs, mean {sizes.mean() / 1024:.0f} KiB, mean {H.mean():.0f} x {W.mean():.0f}; "
      f"unsupported by the engine (of the first 2048): {unsupported}", flush=True)

# the training pipeline's crop windows, as the decode floor benchmark makes them
from headrace import ops  # noqa: E402
from headrace.ops._geometry import plan_batch, roi_batch  # noqa: E402
from headrace.ops._random import uniforms  # noqa: E402

pipe = ops.training(224)
REG = np.zeros((len(blobs), 4), np.int64)
for k in range(0, len(blobs), 256):
    idx = np.arange(k, min(k + 256, len(blobs)))
    rnd = [uniforms(0, 0, pos, idx, op.randoms) if op.randoms else None for pos, op in enumerate(pipe.image_ops, 1)]
    REG[idx] = roi_batch(plan_batch(H[idx], W[idx], pipe.image_ops, rnd), H[idx], W[idx])


def baseline_frame(data):
    """(offset of the SOF0/SOF1 segment's height field, MCU height) of a baseline JPEG, or None
    (progressive, lossless, arithmetic-coded, or malformed)."""
    i = 2
    while i + 4 <= len(data) and data[i] == 0xFF:
        marker, length = data[i + 1], int.from_bytes(data[i + 2:i + 4], "big")
        if marker in (0xC0, 0xC1):
            ncomp = data[i + 9]
            vmax = max(data[i + 11 + 3 * c] & 0x0F for c in range(ncomp))
            return i + 5, 8 * vmax
        if 0xC2 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC) or marker == 0xDA:
            return None
        i += 2 + length
    return None


def shortened(data, bottom, height):
    """``data`` with its frame's height cut to the MCU row that holds row ``bottom - 1``, plus one
    MCU row (chroma upsampling of the window's last rows reads the row below): a decoder then stops
    there, the rest of the entropy data unread. The same bytes where that is the whole image."""
    frame = baseline_frame(data)
    if frame is None:
        return data
    at, mcu = frame
    cut = min(height, -(-int(bottom) // mcu) * mcu + mcu)
    if cut >= height:
        return data
    return data[:at] + cut.to_bytes(2, "big") + data[at + 2:]


ORIGINALS = blobs
if "--truncate" in OPTIONS:  # the frames cut below each training window (roi 1 only)
    blobs = [shortened(b, REG[i, 2], H[i]) for i, b in enumerate(blobs)]
    addrs = np.array([C.cast(C.c_char_p(b), V).value for b in blobs], dtype=np.uint64)
    kept = sum((REG[i, 2] / H[i]) for i in range(len(blobs))) / len(blobs)
    cut_rows = sum(1 - int.from_bytes(b[baseline_frame(b)[0]:baseline_frame(b)[0] + 2], "big") / H[i]
                   for i, b in enumerate(blobs) if baseline_frame(b)) / len(blobs)
    print(f"--truncate: windows end at {kept:.2f} of the height on average; frames cut by {cut_rows:.2f} of it", flush=True)
# ROI support on the engine
dp = V(); ok(nv.nvjpegDecodeParamsCreate(h0, C.byref(dp)), "params")
ok(nv.nvjpegDecodeParamsSetOutputFormat(dp, RGBI), "fmt")
roi_unsup = 0
for i, b in enumerate(blobs[:512]):
    y0, x0, y1, x1 = REG[i]
    ok(nv.nvjpegDecodeParamsSetROI(dp, int(x0), int(y0), int(x1 - x0), int(y1 - y0)), "roi")
    ok(nv.nvjpegJpegStreamParse(h0, b, C.c_size_t(len(b)), 0, 0, js), "parse")
    s = C.c_int(); ok(nv.nvjpegDecodeBatchedSupportedEx(h0, js, dp, C.byref(s)), "supportedEx")
    roi_unsup += s.value != 0
print(f"ROI windows unsupported by the engine (of 512): {roi_unsup}", flush=True)
DEV_MALLOC = C.CFUNCTYPE(C.c_int, C.POINTER(V), C.c_size_t)
FREE = C.CFUNCTYPE(C.c_int, V)
PINNED_MALLOC = C.CFUNCTYPE(C.c_int, C.POINTER(V), C.c_size_t, C.c_uint)


class DevAllocator(C.Structure):
    _fields_ = [("malloc", DEV_MALLOC), ("free", FREE)]


class PinnedAllocator(C.Structure):
    _fields_ = [("malloc", PINNED_MALLOC), ("free", FREE)]


class CachingAllocator:
    """With --alloc-cache, nvJPEG's device and pinned buffers come from here: a
    freed block is kept for the next request it fits, never given back, so no cudaFree or
    cudaFreeHost (each of which waits for the whole device) runs once the sizes settle. Counts
    the calls either way."""

    def __init__(self, real_malloc, real_free):
        self.real_malloc, self.real_free = real_malloc, real_free
        self.size, self.cached, self.lock = {}, [], threading.Lock()
        self.calls = {"malloc": 0, "free": 0, "real_malloc": 0, "real_free": 0}

    def malloc(self, size):
        with self.lock:
            self.calls["malloc"] += 1
            if "--alloc-cache" in OPTIONS:
                fits = [p for p in self.cached if self.size[p] >= size]
                if fits:
                    p = min(fits, key=self.size.get); self.cached.remove(p); return p
            self.calls["real_malloc"] += 1
            p = self.real_malloc(max(size, 1)); self.size[p] = max(size, 1); return p

    def free(self, p):
        with self.lock:
            self.calls["free"] += 1
            if "--alloc-cache" in OPTIONS:
                self.cached.append(p); return
            self.calls["real_free"] += 1
            del self.size[p]; self.real_free(p)


DEVICE_POOL = CachingAllocator(cupy.cuda.runtime.malloc, cupy.cuda.runtime.free)
PINNED_POOL = CachingAllocator(lambda n: cupy.cuda.runtime.hostAlloc(n, 0), cupy.cuda.runtime.freeHost)


def _dev_malloc(out, size):
    try:
        out[0] = DEVICE_POOL.malloc(size); return 0
    except Exception:  # noqa: BLE001
        return 1


def _pinned_malloc(out, size, flags):
    try:
        out[0] = PINNED_POOL.malloc(size); return 0
    except Exception:  # noqa: BLE001
        return 1


def _free(pool):
    def free(p):
        try:
            pool.free(p); return 0
        except Exception:  # noqa: BLE001
            return 1
    return free


DEV_ALLOCATOR = DevAllocator(DEV_MALLOC(_dev_malloc), FREE(_free(DEVICE_POOL)))
PINNED_ALLOCATOR = PinnedAllocator(PINNED_MALLOC(_pinned_malloc), FREE(_free(PINNED_POOL)))


def allocators(backend):
    """nvJPEG's allocators for a handle: ours (counted, and cached with --alloc-cache) for the
    GPU-hybrid backend with --alloc-count or --alloc-cache, else nvJPEG's own."""
    if backend == GPU_HYBRID and OPTIONS & {"--alloc-count", "--alloc-cache"}:
        return C.byref(DEV_ALLOCATOR), C.byref(PINNED_ALLOCATOR)
    return None, None


def stream_priority(backend):
    """With --priority, the GPU-hybrid decode's streams get the lowest priority
    and every other the highest, so its long Huffman kernels yield the SMs to the others' kernels."""
    if "--priority" not in OPTIONS:
        return 0
    return 0 if backend == GPU_HYBRID else -10  # CUDA clamps it to the device's greatest (-5 on Hopper)


_green = {}


def green_stream(priority):
    """A stream of a green context holding GREEN_SMS of the GPU's SMs (made once): kernels launched
    on it run on those SMs only. Through the driver API (libcuda), as CUDA 12.4 has it: a
    CUdevResource is an opaque 4-byte type, 92 bytes of padding, then the SM resource whose first
    field is its SM count."""
    def check(status, what):
        if status != 0:
            raise RuntimeError(f"{what}: CUresult {status}")
    with _green.setdefault("lock", threading.Lock()):
        if "ctx" not in _green:
            cu = C.CDLL("libcuda.so.1")
            dev = C.c_int(); check(cu.cuDeviceGet(C.byref(dev), 0), "cuDeviceGet")
            whole, group, rest = ((C.c_ubyte * 1024)() for _ in range(3))
            check(cu.cuDeviceGetDevResource(dev, whole, 1), "cuDeviceGetDevResource")  # CU_DEV_RESOURCE_TYPE_SM
            groups = C.c_uint(1)
            check(cu.cuDevSmResourceSplitByCount(group, C.byref(groups), whole, rest, 0, GREEN_SMS),
                  "cuDevSmResourceSplitByCount")
            desc, ctx = V(), V()
            check(cu.cuDevResourceGenerateDesc(C.byref(desc), group, 1), "cuDevResourceGenerateDesc")
            cu.cuGreenCtxCreate.argtypes = [P, V, C.c_int, C.c_uint]
            check(cu.cuGreenCtxCreate(C.byref(ctx), desc, dev, 1), "cuGreenCtxCreate")  # CU_GREEN_CTX_DEFAULT_STREAM: required
            cu.cuGreenCtxStreamCreate.argtypes = [P, V, C.c_uint, C.c_int]
            _green.update(cu=cu, ctx=ctx)
            print(f"--green: the GPU-Huffman streams run on {C.c_uint.from_buffer(group, 96).value} of "
                  f"{C.c_uint.from_buffer(whole, 96).value} SMs", flush=True)
        s = V()
        check(_green["cu"].cuGreenCtxStreamCreate(C.byref(s), _green["ctx"], 1, priority), "cuGreenCtxStreamCreate")
    return cupy.cuda.ExternalStream(s.value)


def record(stream):
    """An event on ``stream`` after its work; None (the stream waited for instead) where the
    event cannot be recorded on it (a green context's stream may refuse the primary context's events)."""
    try:
        return stream.record()
    except cupy.cuda.runtime.CUDARuntimeError:
        stream.synchronize()
        return None


class Engine:
    """One thread's way to the engines: an nvJPEG handle (HARDWARE backend), ``states`` JPEG states
    and output buffers used in turn, decode parameters for ``B`` images, a CUDA stream. Make it in
    the thread that decodes."""

    def __init__(self, B, states, roi, batches, backend=HARDWARE):
        # nvJPEG's other backends refuse decode parameters in a batch (status 9): whole images
        self.roi = roi and backend == HARDWARE
        self.batched = nv.nvjpegDecodeBatchedEx if backend == HARDWARE else (
            lambda h, state, data, lens, dests, params, stream: nv.nvjpegDecodeBatched(h, state, data, lens, dests, stream))
        if backend == GPU_HYBRID and GREEN_SMS:
            self.stream = green_stream(stream_priority(backend))
        else:
            self.stream = cupy.cuda.Stream(non_blocking=True, priority=stream_priority(backend))
        self.h = V(); ok(nv.nvjpegCreateEx(backend, *allocators(backend), 0, C.byref(self.h)), "create")
        self.states = []
        for _ in range(states):
            st = V(); ok(nv.nvjpegJpegStateCreate(self.h, C.byref(st)), "state"); self.states.append(st)
        self.params = (V * B)()
        for j in range(B):
            p = V(); ok(nv.nvjpegDecodeParamsCreate(self.h, C.byref(p)), "params")
            ok(nv.nvjpegDecodeParamsSetOutputFormat(p, RGBI), "fmt"); self.params[j] = p
        area = (REG[:, 2] - REG[:, 0]) * (REG[:, 3] - REG[:, 1]) if self.roi else H * W
        cap = int(max(area[b].sum() for b in batches) * 3 + B * 256)
        self.bufs = [cupy.empty(cap, cupy.uint8) for _ in range(states)]
        self.events = [None] * states
        self.turn = 0

    def decode(self, idx):
        """Batch ``idx`` into the next state's buffer, once that buffer's last batch is done:
        [(image, pointer, height, width, buffer)], and the seconds spent inside the decode call."""
        h, params, n = self.h, self.params, len(idx)
        slot = self.turn % len(self.states); self.turn += 1
        state, buf = self.states[slot], self.bufs[slot]
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        dests = (Image * n)()
        placed, off = [], 0
        for j, i in enumerate(idx):
            if self.roi:
                y0, x0, y1, x1 = (int(v) for v in REG[i]); hh, ww = y1 - y0, x1 - x0
                ok(nv.nvjpegDecodeParamsSetROI(V(params[j]), x0, y0, ww, hh), "roi")
            else:
                hh, ww = int(H[i]), int(W[i])
                ok(nv.nvjpegDecodeParamsSetROI(V(params[j]), 0, 0, -1, -1), "roi")
            dests[j].channel[0] = buf.data.ptr + off; dests[j].pitch[0] = ww * 3
            placed.append((int(i), buf.data.ptr + off, hh, ww, buf))
            off += (hh * ww * 3 + 255) // 256 * 256
        data = (V * n)(*[int(a) for a in addrs[idx]]); lens = (C.c_size_t * n)(*[int(s) for s in sizes[idx]])
        c0 = time.perf_counter()
        ok(nv.nvjpegDecodeBatchedInitialize(h, state, n, 1, RGBI), "init")
        st = self.batched(h, state, C.addressof(data), C.addressof(lens), C.addressof(dests),
                                      C.addressof(params), self.stream.ptr)
        if st != 0:  # find the images it refuses, one by one
            bad = []
            for j in range(n):
                ok(nv.nvjpegDecodeBatchedInitialize(h, state, 1, 1, RGBI), "init1")
                one = self.batched(h, state, C.addressof(data) + 8 * j, C.addressof(lens) + 8 * j,
                                               C.addressof(dests) + C.sizeof(Image) * j, C.addressof(params) + 8 * j,
                                               self.stream.ptr)
                if one != 0:
                    bad.append((int(idx[j]), one))
            raise RuntimeError(f"decode: nvjpeg status {st}; one by one {len(bad)} of {n} fail: {bad[:5]}")
        seconds = time.perf_counter() - c0
        self.events[slot] = record(self.stream)
        return placed, seconds


def stamp(p, dt):
    """With --stamps, each pass's wall-clock end and length, so that two processes run side by
    side (one GPU, separate CUDA contexts) can be lined up afterwards."""
    if "--stamps" in OPTIONS:
        print(f"  pass {p} ended {time.time():.3f} took {dt:.3f} s ({len(blobs) / dt:,.0f} img/s)", flush=True)


def run(K, S, roi, B, passes=PASSES, check=False, backend=HARDWARE):
    batches = [np.arange(k, min(k + B, len(blobs))) for k in range(0, len(blobs), B)]
    go = [threading.Event() for _ in range(K)]; done = [threading.Event() for _ in range(K)]
    ready = threading.Barrier(K + 1)
    call_s = [0.0] * K
    errors = []
    nxt = {"i": 0}; lock = threading.Lock()
    outs = {}

    def lane(t):
        try:
            cupy.cuda.Device(0).use()
            engine = Engine(B, S, roi, batches, backend)
            ready.wait()
            for p in range(passes):
                go[t].wait(); go[t].clear()
                while True:
                    with lock:
                        k = nxt["i"]; nxt["i"] += 1
                    if k >= len(batches):
                        break
                    placed, seconds = engine.decode(batches[k])
                    call_s[t] += seconds
                    if check and p == passes - 1:  # the batch's first four images, for the Pillow check
                        engine.stream.synchronize()
                        for i, ptr, hh, ww, buf in placed[:4]:
                            arr = cupy.ndarray((hh, ww, 3), cupy.uint8, cupy.cuda.MemoryPointer(buf.data.mem, ptr - buf.data.mem.ptr))
                            outs[i] = cupy.asnumpy(arr)
                engine.stream.synchronize()
                done[t].set()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e)); ready.abort() if not ready.broken else None
            for d in done:
                d.set()

    ths = [threading.Thread(target=lane, args=(t,), daemon=True) for t in range(K)]
    for th in ths: th.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        pass
    rates, busy = [], []
    for p in range(passes):
        nxt["i"] = 0; call_s[:] = [0.0] * K
        t0, c0 = time.perf_counter(), time.process_time()
        for g in go: g.set()
        for d in done: d.wait(); d.clear()
        dt = time.perf_counter() - t0
        stamp(p, dt)
        if errors:
            return None, errors, 0, 0, {}
        if p:
            rates.append(len(blobs) / dt); busy.append((time.process_time() - c0) / dt)
    for th in ths: th.join(timeout=10)
    return statistics.median(rates), [round(r) for r in rates], statistics.median(busy), sum(call_s) / K / dt, outs


def run_mix(E, Cn, T, G=0, B=256, passes=PASSES):
    """E threads driving the engines directly (whole batches) beside Cn nvImageCodec lanes with
    hw_load 0 and T host threads each (the CUDA decoder, Huffman on the host) and G threads of
    nvJPEG's batched GPU-hybrid decode (Huffman on the GPU); every thread takes the next batch from
    one queue, so each kind's share is what it keeps up with."""
    import torch
    from headrace.ops.cuda._batch_decode import BatchDecoder, Launch, ParsedBatch
    batches = [np.arange(k, min(k + B, len(blobs))) for k in range(0, len(blobs), B)]
    nxt = {"i": 0}; lock = threading.Lock()
    N = E + Cn + G
    go = [threading.Event() for _ in range(N)]; done = [threading.Event() for _ in range(N)]
    ready = threading.Barrier(N + 1); errors = []; counts = [0] * N

    def take():
        with lock:
            k = nxt["i"]; nxt["i"] += 1
        return k if k < len(batches) else None

    def engine(t, backend=HARDWARE):
        try:
            cupy.cuda.Device(0).use()
            engine = Engine(B, 2 if backend == GPU_HYBRID else 1, True, batches, backend)
            ready.wait()
            for p in range(passes):
                go[t].wait(); go[t].clear()
                while (k := take()) is not None:
                    engine.decode(batches[k]); counts[t] += len(batches[k])
                engine.stream.synchronize(); done[t].set()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e)); ready.abort()
            for d in done: d.set()

    def cuda_lane(t):
        try:
            torch.cuda.set_device(0); cupy.cuda.Device(0).use()
            stream = cupy.cuda.Stream(non_blocking=True, priority=stream_priority(HYBRID))
            dec = BatchDecoder(0, threads=T, hw_load=0.0, cuda_load=1.0); parsed = ParsedBatch()
            wss = [torch.empty(B * 224 * 224 * 3 * 8, dtype=torch.uint8, device="cuda") for _ in range(2)]
            evs = [None, None]
            ready.wait()
            for p in range(passes):
                go[t].wait(); go[t].clear(); turn = 0
                while (k := take()) is not None:
                    idx = batches[k]
                    info = parsed.parse([blobs[i] for i in idx], exif=True)
                    reg = REG[idx].astype(np.int32)
                    hh, ww = reg[:, 2] - reg[:, 0], reg[:, 3] - reg[:, 1]
                    szs = (hh.astype(np.int64) * ww * 3 + 255) // 256 * 256
                    slot = turn % 2; turn += 1
                    if evs[slot] is not None: evs[slot].synchronize()
                    ptr = np.concatenate(([0], np.cumsum(szs)[:-1])).astype(np.uint64) + np.uint64(wss[slot].data_ptr())
                    stt, _ = dec.decode_launch(parsed, np.arange(len(info), dtype=np.int32), reg, ptr, stream.ptr, Launch())
                    assert (stt == 1).all(), (stt != 1).sum()
                    parsed.release(); evs[slot] = stream.record(); counts[t] += len(idx)
                stream.synchronize(); done[t].set()
            dec.close(); parsed.close()
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e)); ready.abort()
            for d in done: d.set()

    ths = [threading.Thread(target=engine, args=(t,), daemon=True) for t in range(E)]
    ths += [threading.Thread(target=cuda_lane, args=(E + t,), daemon=True) for t in range(Cn)]
    ths += [threading.Thread(target=engine, args=(E + Cn + t, GPU_HYBRID), daemon=True) for t in range(G)]
    for th in ths: th.start()
    try:
        ready.wait()
    except threading.BrokenBarrierError:
        return f"FAILED {errors}"
    rates, busy, shares = [], [], []
    for p in range(passes):
        nxt["i"] = 0; counts[:] = [0] * N
        t0, c0 = time.perf_counter(), time.process_time()
        for g in go: g.set()
        for d in done: d.wait(); d.clear()
        dt = time.perf_counter() - t0
        stamp(p, dt)
        if errors:
            return f"FAILED {errors}"
        if p:
            rates.append(len(blobs) / dt); busy.append((time.process_time() - c0) / dt)
            shares.append((sum(counts[:E]) / len(blobs), sum(counts[E + Cn:]) / len(blobs)))
    for th in ths: th.join(timeout=10)
    med = statistics.median(rates)
    return (f"{med:,.0f} img/s runs {[round(r) for r in rates]} cores busy {statistics.median(busy):.1f} "
            f"({statistics.median(busy) / med * 1000:.2f} per 1,000 img/s), engine share "
            f"{statistics.median(e for e, _ in shares):.2f}, GPU-Huffman share {statistics.median(g for _, g in shares):.2f}"
            f"; nvJPEG allocator calls, device {DEVICE_POOL.calls}, pinned {PINNED_POOL.calls}")


configs = CONFIGS or ["1:1:0:256", "1:2:0:256", "2:1:0:256", "4:1:0:256", "1:1:1:256", "1:2:1:256",
                           "2:1:1:256", "2:2:1:256", "4:1:1:256", "4:2:1:256", "8:1:1:256", "4:1:1:64", "8:1:1:64"]
first = True
for cfg in configs:
    if cfg.startswith("mix:"):
        E, Cn, T, *G = (int(x) for x in cfg.split(":")[1:])
        G = G[0] if G else 0
        print(f"mix: {E} direct engine threads + {Cn} CUDA-decoder lanes x {T} threads + {G} GPU-Huffman threads: "
              f"{run_mix(E, Cn, T, G)}", flush=True)
        continue
    kind = "hw"
    if cfg.split(":")[0] in BACKENDS:
        kind, cfg = cfg.split(":", 1)
    K, S, roi, B = (int(x) for x in cfg.split(":"))
    roi = roi if kind == "hw" else 0  # the other backends decode whole images (see Engine)
    med, rates, busy, callfrac, outs = run(K, S, roi, B, check=first or kind != "hw", backend=BACKENDS[kind])
    if med is None:
        print(f"nvjpeg {kind} K={K} states={S} roi={roi} B={B}: FAILED {rates}", flush=True)
        continue
    line = (f"nvjpeg {kind} K={K} states={S} roi={roi} B={B}: {med:,.0f} img/s runs {rates} cores busy {busy:.1f} "
            f"host share in the decode call {callfrac:.2f}")
    if first or kind != "hw":
        try:
            from PIL import Image as PI
            import io
            diffs = []
            for i, got in outs.items():
                if isinstance(got, np.ndarray):
                    y0, x0, y1, x1 = REG[i] if roi else (0, 0, H[i], W[i])
                    ref = np.asarray(PI.open(io.BytesIO(ORIGINALS[i])).convert("RGB"))[y0:y1, x0:x1]
                    diffs.append(np.abs(ref.astype(int) - got.astype(int)).mean())
            line += f"; vs Pillow mean abs diff over {len(diffs)} images: max {max(diffs):.2f}"
        except Exception as e:  # noqa: BLE001
            line += f"; check failed: {e!r}"
        first = False
    print(line, flush=True)
