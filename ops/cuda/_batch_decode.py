"""Batch decode through nvImageCodec's C API: one GIL-free call per batch (``_native/batch_decode.c``).

Why: nvImageCodec's Python ``decode`` releases and retakes the GIL for every image, and building a
``CodeStream`` and a region view costs about 19 µs of GIL-held Python per image; with one other
thread busy in Python a batch decode fell from 17.6k to under 300 images/s on the H100, and two
lanes did not overlap (ops/README.md). Through ctypes the GIL is released for each whole call, so
the header parse, the region views and the decode of a batch run beside the event loop and the
other lanes, and each image decodes straight into a slice of one buffer the lane owns.

The shim is compiled on first use with the system C compiler against the header that ships in
the nvImageCodec wheel, and cached (``$HEADRACE_CACHE``, else ``~/.cache/headrace``) under a hash
of its inputs. Without a compiler ``load()`` says why, and the GPU path decodes through nvImageCodec's
Python API instead (as it does with ``GpuTuning(decode="python")``).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import numpy as np
from headrace import _native as native
from headrace._errors import HW_LOAD

from .._nvimgcodec import nvimgcodec

__all__ = ["BatchDecoder", "Launch", "ParsedBatch", "driver_reason", "frame_cut", "load", "unavailable_reason"]

_HERE = Path(__file__).parent / "_native"
_SOURCE = _HERE / "batch_decode.c"
_lock = threading.Lock()
_state: dict[str, Any] = {}


def unavailable_reason() -> str | None:
    """Why the shim cannot be used here (None when it can)."""
    load()
    return _state.get("reason")


def load() -> ctypes.CDLL | None:
    """The shim's library, built and loaded once per process; None (see ``unavailable_reason``) if not."""
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["reason"] = _load()
        return _state["lib"]


def _load() -> tuple[ctypes.CDLL | None, str | None]:
    module = nvimgcodec()
    if module is None:
        return None, "nvImageCodec does not import"
    package = Path(module.__file__).parent
    header, library = package / "include" / "nvimgcodec.h", package / "libnvimgcodec.so.0"
    if not header.exists() or not library.exists():
        return None, f"nvImageCodec's C header or library is missing under {package}"
    target, reason = native.build(
        "batch_decode", _SOURCE, inputs=(_HERE / "cuda_runtime_api.h", header),
        flags=(f"-I{_HERE}", f"-I{header.parent}", f"-L{package}", "-l:libnvimgcodec.so.0", f"-Wl,-rpath,{package}", "-ldl"),
    )
    if target is None:
        return None, reason
    lib = ctypes.CDLL(str(target))
    _declare(lib)
    # Short calls keep the GIL: a ctypes call that drops it must wait to take it back, up to the
    # switch interval when another thread is busy in Python (readers/_read_files.py).
    lib.with_gil = ctypes.PyDLL(str(target))
    lib.with_gil.hr_parsed_release.argtypes, lib.with_gil.hr_parsed_release.restype = [ctypes.c_void_p], None
    return lib, None


def _declare(lib: ctypes.CDLL) -> None:
    p, i, f, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_size_t
    lib.hr_instance_create.argtypes, lib.hr_instance_create.restype = [ctypes.c_char_p, ctypes.c_char_p, sz], p
    lib.hr_instance_destroy.argtypes, lib.hr_instance_destroy.restype = [p], None
    lib.hr_decoder_create.argtypes = [p, i, i, i, f, f, f, i, i, ctypes.c_char_p, ctypes.c_char_p, sz]
    lib.hr_decoder_create.restype = p
    lib.hr_parsed_create.argtypes, lib.hr_parsed_create.restype = [], p
    lib.hr_parsed_destroy.argtypes, lib.hr_parsed_destroy.restype = [p], None
    lib.hr_parse.argtypes, lib.hr_parse.restype = [p, p, i, p, p, i, p], i
    lib.hr_decoder_destroy.argtypes, lib.hr_decoder_destroy.restype = [p], None
    lib.hr_decoder_set_cut_frames.argtypes, lib.hr_decoder_set_cut_frames.restype = [p, i], None
    lib.hr_decoder_hw_share.argtypes, lib.hr_decoder_hw_share.restype = [p], f
    lib.hr_frame_cut.argtypes = [ctypes.c_char_p, sz, i, i, ctypes.POINTER(sz)]
    lib.hr_frame_cut.restype = i
    lib.hr_engine_count.argtypes, lib.hr_engine_count.restype = [p, i, i, f], i
    lib.hr_driver_load.argtypes, lib.hr_driver_load.restype = [ctypes.c_char_p, sz], i
    lib.hr_decode_launch.argtypes = [p, p, i, p, p, p, i, i, p, p, ctypes.POINTER(Launch)]
    lib.hr_decode_launch.restype = i
    lib.hr_run_plan.argtypes, lib.hr_run_plan.restype = [p, p], i  # (hr_plan*, stream): _plan.py
    lib.hr_relocate_plan.argtypes, lib.hr_relocate_plan.restype = [p], None  # (hr_plan*)


class Launch(ctypes.Structure):
    """What ``BatchDecoder.decode_launch`` does around a decode (``hr_launch`` in the shim): wait
    for ``wait_event`` first; then, when every image decoded, copy ``copy_size[0]`` bytes up,
    launch ``function`` with ``params``, copy ``copy_size[1]`` bytes up and record ``event``, all on
    the decode's stream; with ``meta_src`` set it first fills the fused kernel's tables in the
    pinned block ``tables`` (``hr_launch`` says how). Addresses and CUDA handles are plain
    integers. The shim fills ``seconds`` (waiting, decoding, launching) and ``cuda_error``."""

    _fields_ = [
        ("wait_event", ctypes.c_void_p),
        ("function", ctypes.c_void_p),
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("params", ctypes.c_void_p),
        ("copy_dst", ctypes.c_uint64 * 2),
        ("copy_src", ctypes.c_void_p * 2),
        ("copy_size", ctypes.c_size_t * 2),
        ("event", ctypes.c_void_p),
        ("tables", ctypes.c_void_p),
        ("meta_offset", ctypes.c_size_t),
        ("geo_offset", ctypes.c_size_t),
        ("labels_offset", ctypes.c_size_t),
        ("meta_src", ctypes.c_void_p),
        ("geo_src", ctypes.c_void_p),
        ("labels_src", ctypes.c_void_p),
        ("seconds", ctypes.c_double * 3),
        ("cuda_error", ctypes.c_int),
    ]


def driver_reason() -> str | None:
    """Why ``decode_launch`` cannot launch here (None when it can): the CUDA driver's entry points."""
    lib = load()
    if lib is None:
        return unavailable_reason()
    with _lock:
        if "driver" not in _state:
            err = ctypes.create_string_buffer(256)
            _state["driver"] = None if lib.hr_driver_load(err, len(err)) else err.value.decode()
        return _state["driver"]


def _instance(lib: ctypes.CDLL) -> int:
    """One library instance per process (extensions loaded once); it lives until the process ends."""
    with _lock:
        if "instance" not in _state:
            err = ctypes.create_string_buffer(256)
            path = str(Path(nvimgcodec().__file__).parent / "extensions").encode()
            handle = lib.hr_instance_create(path, err, len(err))
            if not handle:
                raise RuntimeError(err.value.decode())
            _state["instance"] = handle
        return _state["instance"]


class BatchDecoder:
    """One nvImageCodec decoder driven through the shim. Not for two threads at once (a lane owns it).

    ``device=None`` makes a CPU-only decoder writing to host memory (used by the tests on machines
    without a GPU); otherwise the hardware JPEG engine (``hw_load`` of each batch, or a share that
    the shim moves batch by batch when ``hw_load="adaptive"``; a share of the bytes the windows need
    read, the largest windows first), then the CUDA decoder
    (``cuda_load``: the share of what the engine leaves that it takes), writing to device memory on
    the stream given to ``decode``; what they fail on comes back failed (nvImageCodec's CPU backend
    is left out of that chain: with it, fuzzed JPEGs hung a decode now and then). ``options`` go to
    nvImageCodec's decoder as they are (e.g. ``"nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"``).
    ``gpu_load``: the share of each batch (the windows next in size after the engine's) given to a
    second CUDA decoder that runs every Huffman stage on the GPU (0: none, no second decoder), with
    ``gpu_threads`` host threads (0: ``threads``). ``cut_frames``: the engine's share decodes from
    copies of its JPEGs whose frame ends just below the window (``frame_cut``), so the engine, which
    decodes every row of an image whatever its window, stops there; the pixels are the same.
    """

    def __init__(
        self,
        device: int | None,
        *,
        threads: int,
        hw_load: float | str = HW_LOAD,
        cuda_load: float = 1.0,
        gpu_load: float = 0.0,
        gpu_threads: int = 0,
        channels: int = 3,
        exif: bool = True,
        options: str = "",
        cut_frames: bool = True,
    ):
        lib = load()
        if lib is None:
            raise RuntimeError(f"the batch decode shim is unavailable: {unavailable_reason()}")
        self._lib = lib
        err = ctypes.create_string_buffer(256)
        cpu_only = device is None
        adaptive = hw_load == "adaptive"
        share = HW_LOAD if adaptive else float(hw_load)
        handle = lib.hr_decoder_create(
            _instance(lib), -1 if cpu_only else device, int(cpu_only), threads, share, cuda_load, gpu_load, gpu_threads,
            int(adaptive),
            options.encode(), err, len(err)
        )
        if not handle:
            raise RuntimeError(err.value.decode())
        self._handle = handle
        lib.hr_decoder_set_cut_frames(handle, int(cut_frames))
        self.channels = channels
        self.exif = exif

    def decode(self, parsed: ParsedBatch, pick: np.ndarray, regions: np.ndarray, out: np.ndarray, stream: int) -> np.ndarray:
        """Decode the images ``pick`` (indices into ``parsed``'s batch), each only its window
        ``regions[j]`` = (y0, x0, y1, x1), into the buffers at addresses ``out[j]`` (rows packed,
        ``channels`` uint8 per pixel), ordered on CUDA ``stream`` (an address; 0 for the CPU-only
        decoder). Returns an int32 status per image: 1 decoded, anything else failed."""
        return self.decode_launch(parsed, pick, regions, out, stream, Launch())[0]

    def decode_launch(self, parsed: ParsedBatch, pick: np.ndarray, regions: np.ndarray, out: np.ndarray, stream: int,
                      launch: Launch) -> tuple[np.ndarray, bool]:
        """``decode``, with ``launch``'s wait before it and its copies, kernel and event after it
        when every image decoded (``driver_reason()`` must be None). Returns the statuses and
        whether the kernel was launched. A failed CUDA call raises RuntimeError."""
        m = len(pick)
        pick = np.ascontiguousarray(pick, dtype=np.int32)
        regions = np.ascontiguousarray(regions, dtype=np.int32)
        out = np.ascontiguousarray(out, dtype=np.uint64)
        status = np.zeros(m, dtype=np.int32)
        done = self._lib.hr_decode_launch(self._handle, parsed._handle, m, pick.ctypes.data, regions.ctypes.data,
                                          out.ctypes.data, self.channels, int(self.exif), stream, status.ctypes.data,
                                          ctypes.byref(launch))
        if launch.cuda_error:
            raise RuntimeError(f"a CUDA call around the decode failed (CUresult {launch.cuda_error})")
        if not done:
            status[:] = 0
        return status, done == 2

    @property
    def hw_share(self) -> float:
        """The share of each batch's bytes the hardware engine gets now: ``hw_load``, or where
        ``"adaptive"`` has moved it (0 for the CPU-only decoder or where no engine was found)."""
        return float(self._lib.hr_decoder_hw_share(self._handle)) if self._handle else 0.0

    def close(self) -> None:
        """Destroy the decoder. Its stream's work must be done or still ordered after it. Safe twice."""
        if self._handle:
            self._lib.hr_decoder_destroy(self._handle)
            self._handle = None


def frame_cut(data: bytes, bottom: int, height: int) -> tuple[int, int] | None:
    """The frame height the engine is given for a sequential JPEG ``data`` of ``height`` rows whose
    window ends at row ``bottom``, and where that height is written in the bytes; None when nothing
    is cut (``hr_frame_cut`` in the shim says when)."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"the batch decode shim is unavailable: {unavailable_reason()}")
    at = ctypes.c_size_t()
    cut = lib.hr_frame_cut(data, len(data), bottom, height, ctypes.byref(at))
    return (cut, at.value) if cut else None


def engine_count(window_bytes: list[float], offered: int, share: float) -> int:
    """How many of a batch's images (their ``window_bytes``, the bytes each window needs read, in
    the order the shim offers them to the hardware engine; the first ``offered`` of them baseline
    JPEGs) the engine takes at ``hw_load`` = ``share`` (the shim's ``engine_count``; at most 64)."""
    lib = load()
    if lib is None:
        raise RuntimeError(f"the batch decode shim is unavailable: {unavailable_reason()}")
    values = np.ascontiguousarray(window_bytes, dtype=np.float64)
    n = lib.hr_engine_count(values.ctypes.data, len(values), offered, share)
    if n < 0:
        raise ValueError("engine_count takes at most 64 images")
    return n


class ParsedBatch:
    """The headers of one batch, parsed by nvImageCodec (no decoder needed: any thread may parse
    while a decoder decodes another batch). Reusable: each ``parse`` replaces the last one."""

    def __init__(self) -> None:
        lib = load()
        if lib is None:
            raise RuntimeError(f"the batch decode shim is unavailable: {unavailable_reason()}")
        self._lib = lib
        self._instance = _instance(lib)
        self._handle = lib.hr_parsed_create()
        if not self._handle:
            raise MemoryError("hr_parsed_create: out of host memory")
        self._pinned: Any = None  # the batch's data: the parsed streams point into it

    def parse(self, data: list, *, exif: bool) -> np.ndarray:
        """Headers of ``data``: an (n, 4) int32 array of height, width (upright when ``exif``),
        channels in the file, and 1 where nvImageCodec parses the image (0: decode it another way).
        ``data`` is kept alive until the next ``parse``, ``release`` or ``close``."""
        n = len(data)
        data = [d if type(d) is bytes else bytes(d) for d in data]
        pointers = (ctypes.c_char_p * n)(*data)  # no copy: pointers into the bytes objects
        sizes = np.fromiter(map(len, data), dtype=np.uint64, count=n)
        info = np.zeros((n, 4), dtype=np.int32)
        self._pinned = (data, pointers)
        if not self._lib.hr_parse(self._instance, self._handle, n, pointers, sizes.ctypes.data, int(exif), info.ctypes.data):
            raise MemoryError("hr_parse: out of host memory")
        return info

    def release(self) -> None:
        """Drop the parsed streams and let the batch's data go; the object can parse again."""
        if self._handle:
            self._lib.with_gil.hr_parsed_release(self._handle)
        self._pinned = None

    def close(self) -> None:
        """Free it. Safe twice."""
        if self._handle:
            self._lib.hr_parsed_destroy(self._handle)
            self._handle = None
        self._pinned = None
