"""The GPU path's post ops: colour twist, warps, blur, tone curves and sharpness, a few kernel
launches a batch each (``PostOp.steps``: the passes of ops such as ``RandAugment``), then finish.

``PostOps`` belongs to a lane: it launches on the lane's CuPy stream and allocates its outputs with
torch on that stream (docs/gpu-notes.md §3: ``record_stream`` ignores memory torch did not allocate). Images
of a batch may differ in size: each launch reads per-sample tables (addresses, sizes, row strides,
the op's numbers) that ``_post.py`` packs into pinned host memory and copies to the device
asynchronously. The numbers are the CPU path's (``PostOp.tables``), so both draw the same
parameters for a sample.

Buffers: a pass launches over the samples it changes only (a sample ``p`` left alone, or one that
drew another kind of pass in a policy's round, is skipped), so each sample's pixels move between
the input and two uint8 buffers on their own (``route``): the colour twist and tone curves work in
place once a buffer is ours; a warp, a blur or sharpness writes into the other buffer; a batch
tensor's samples are gathered into one buffer at the end. The blur's horizontal pass
writes float32 scratch that its vertical pass reads, rounding once at the end, as the CPU path
does. A tone curve builds each sample's tables on the device (from the image's level counts where
the curve is read off the image), then looks every pixel up.

Host waits: the only one is in ``_Tables.upload``, for the event of the launch that used the same
pinned buffer ``_RING`` launches ago (long passed, in practice). Nothing else synchronises.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._geometry import index_affine
from .._pipeline import Pipeline
from .._post_spec import ColorMatrix, GaussianBlur, PostOp, Step, _Warp
from .._tone import IDENTITY, Sharpness, ToneCurve, needs_histograms
from ._post_kernels import FINISH_TYPES, module

__all__ = ["PostOps", "blur_table", "changed", "color_table", "describe", "finish", "route", "table_layout", "warp_table"]

# Pinned table buffers per PostOps, used in turn: a batch takes one per launch (a blur two, a tone curve up to three), and a
# lane runs at most two batches ahead of the GPU, so 32 leaves the wait in _Tables.upload idle.
_RING = 64
_MAX_Z = 65535  # CUDA's limit on gridDim.z: larger batches launch in slices
_BLOCK = (32, 8, 1)
_HISTOGRAM_BLOCKS = 8  # blocks counting one sample's levels (each adds its counts to the sample's once)

# --- pure NumPy: what the kernels read (tested on the CPU) --------------------------------------


def describe(images: Any) -> np.ndarray:
    """(n, 5) int64 rows ``(address, height, width, row stride in bytes, channels)`` of ``images``:
    a uint8 [N, H, W, C] CUDA tensor, a list of uint8 [H, W, C] CUDA tensors, or a list of such
    tuples. Pixels within a row must be packed (C bytes apart). Raises ValueError otherwise."""
    if isinstance(images, torch.Tensor):
        if images.dim() != 4:
            raise ValueError(f"expected a [N, H, W, C] tensor, got shape {tuple(images.shape)}")
        _check_tensor(images[0] if len(images) else images.new_empty((1, 1, images.shape[3])))
        n, h, w, c = images.shape
        rows = np.empty((n, 5), dtype=np.int64)
        rows[:, 0] = images.data_ptr() + np.arange(n, dtype=np.int64) * images.stride(0)
        rows[:, 1:] = (h, w, images.stride(1), c)
        return rows
    rows = np.empty((len(images), 5), dtype=np.int64)
    for i, img in enumerate(images):
        if isinstance(img, torch.Tensor):
            _check_tensor(img)
            h, w, c = img.shape
            rows[i] = (img.data_ptr(), h, w, img.stride(0), c)
        else:
            rows[i] = tuple(int(v) for v in img)
    if len(rows) and (np.any(rows[:, 1:3] < 1) or np.any(rows[:, 3] < rows[:, 2] * rows[:, 4])):
        raise ValueError("images must be at least 1 x 1 with row strides of at least width x channels bytes")
    return rows


def _check_tensor(img: torch.Tensor) -> None:
    if img.dtype != torch.uint8 or img.dim() != 3 or not img.is_cuda:
        raise ValueError(f"expected uint8 HWC CUDA images, got {img.dtype} {tuple(img.shape)} on {img.device}")
    if img.stride(2) != 1 or img.stride(1) != img.shape[2]:
        raise ValueError(f"pixels of a row must be packed, got strides {img.stride()} for shape {tuple(img.shape)}")


def color_table(matrices: np.ndarray, channels: int) -> np.ndarray:
    """(n, 12) float32 colour tables: ``[M | o]`` row-major for RGB; gain and offset at 0 and 3 for gray."""
    m = np.asarray(matrices, dtype=np.float64)
    out = np.zeros((len(m), 12), dtype=np.float32)
    if channels == 1:
        out[:, 0], out[:, 3] = m[:, 0, 0], m[:, 0, 1]
    else:
        out[:] = m.reshape(len(m), 12)
    return out


def warp_table(affine: np.ndarray, fill: np.ndarray) -> np.ndarray:
    """(n, 10) float32 warp tables: the index-coordinate matrix (``index_affine``), then 4 fill levels."""
    a = index_affine(affine)
    out = np.zeros((len(a), 10), dtype=np.float32)
    out[:, :6] = a.reshape(len(a), 6)
    f = np.asarray(fill, dtype=np.float32).reshape(-1)
    out[:, 6 : 6 + len(f)] = f
    return out


def blur_table(wx: np.ndarray, wy: np.ndarray) -> np.ndarray:
    """(n, kx + ky) float32 blur tables: row weights, then column weights."""
    return np.concatenate([np.asarray(wx, dtype=np.float32), np.asarray(wy, dtype=np.float32)], axis=1)


def table_layout(n: int, width: int) -> tuple[int, int, int]:
    """Byte offsets of the three tables (ptrs, meta, par) in one buffer, and its size: 16-byte aligned."""
    meta = 16 * n
    par = 32 * n
    return meta, par, par + ((4 * n * width + 15) // 16) * 16


def changed(op: PostOp, tables: tuple[np.ndarray, ...]) -> np.ndarray:
    """(n,) bool: the samples a pass changes. The others hold the identity (a sample ``p`` left
    alone, or one that drew another kind of pass in a policy's round), which the kernels would
    copy exactly: they are left out of the launch."""
    if isinstance(op, ColorMatrix):
        m = np.asarray(tables[0])
        identity = np.eye(m.shape[1], m.shape[2])
        return ~np.all(m == identity, axis=(1, 2))
    if isinstance(op, _Warp):
        return ~np.all(np.asarray(tables[0]) == np.eye(2, 3), axis=(1, 2))
    if isinstance(op, GaussianBlur):
        def delta(w: np.ndarray) -> np.ndarray:
            centre = np.zeros(w.shape[1])
            centre[w.shape[1] // 2] = 1.0
            return np.all(w == centre, axis=1)
        return ~(delta(np.asarray(tables[0])) & delta(np.asarray(tables[1])))
    if isinstance(op, ToneCurve):
        return np.asarray(tables[0])[:, 0] != IDENTITY
    if isinstance(op, Sharpness):
        return np.asarray(tables[0]).reshape(-1) != 1.0
    raise TypeError(f"not a post op: {op!r}")


def route(op: PostOp, where: np.ndarray, active: np.ndarray, inplace: bool) -> tuple[np.ndarray, np.ndarray]:
    """Which buffer each of the samples ``active`` reads and writes in this pass: -1 is the input,
    0 and 1 our two uint8 buffers; ``where`` (n,) says where each sample's pixels are now and is
    updated. Each sample keeps its own place, so a pass that changes a few samples moves only
    those. The colour and tone passes write where they read once that is ours (or the input,
    with ``inplace``); a warp, a blur or sharpness writes into the other buffer."""
    src = where[active]
    if isinstance(op, (ColorMatrix, ToneCurve)):
        dst = np.where((src >= 0) | inplace, src, 0)
    else:
        dst = np.where(src == 0, 1, 0)
    where[active] = dst
    return src, dst


# --- device side ---------------------------------------------------------------------------------


class _Tables:
    """One pinned host buffer and its device copy, for one launch's tables."""

    def __init__(self, cupy) -> None:
        self.cupy = cupy
        self.capacity = 0
        self.event = None

    def upload(self, stream, ptrs: np.ndarray, meta: np.ndarray, par: np.ndarray):
        """Copy the tables to the device on ``stream``; returns device views (ptrs, meta, par)."""
        import cupyx

        n, width = par.shape
        o_meta, o_par, total = table_layout(n, width)
        if self.event is not None:
            self.event.synchronize()  # the copy out of this pinned buffer, queued _RING launches ago, is done
        if total > self.capacity:
            self.capacity = max(total, 2 * self.capacity, 4096)
            self.host = cupyx.empty_pinned((self.capacity,), dtype=np.uint8)
            with stream:  # in this stream's pool: the old buffer is reused only after its launches
                self.device = self.cupy.empty((self.capacity,), dtype=self.cupy.uint8)
        h = self.host
        h[:o_meta].view(np.uint64)[:] = ptrs.reshape(-1)
        h[o_meta:o_par].view(np.int32)[:] = meta.reshape(-1)
        h[o_par : o_par + 4 * par.size].view(np.float32)[:] = par.reshape(-1)
        self.device[:total].set(h[:total], stream=stream)
        d = self.device
        return (d[:o_meta].view(self.cupy.uint64), d[o_meta:o_par].view(self.cupy.int32),
                d[o_par : o_par + 4 * par.size].view(self.cupy.float32))

    def record(self, stream) -> None:
        self.event = stream.record()


class PostOps:
    """A pipeline's post ops and its finish on one CUDA stream; owned by a lane, used by its thread.

    ``stream`` is the lane's ``cupy.cuda.Stream``; ``seed`` the executor's. Inputs must be ready on
    that stream (written on it, or waited for) and stay alive until the stream has passed the
    launches (buffers torch allocated on the stream itself may be dropped at once).
    """

    def __init__(self, pipeline: Pipeline, stream, *, seed: int = 0, device: torch.device | None = None) -> None:
        import cupy

        self.pipeline = pipeline
        self.ops = pipeline.post_ops
        self.seed = seed
        self.channels = pipeline.channels
        self.cupy = cupy
        self.cp_stream = stream
        self.device = device if device is not None else torch.device("cuda", cupy.cuda.Device().id)
        self.stream = torch.cuda.ExternalStream(stream.ptr, device=self.device)
        self._module = module(self.channels)
        self._functions: dict[str, Any] = {}
        self._tables = [_Tables(cupy) for _ in range(_RING)]
        self._turn = 0
        norm = pipeline.normalize
        c = self.channels
        mean = np.array(norm.mean if norm else (0.0,), dtype=np.float32) * 255.0
        inv = 1.0 / (np.array(norm.std if norm else (1.0,), dtype=np.float32) * 255.0)
        with stream:
            self.mean = cupy.asarray(np.resize(mean, c))
            self.inv_std = cupy.asarray(np.resize(inv, c))

    def tables(self, rows: np.ndarray, indices: np.ndarray, epoch: int) -> list[Step]:
        """The passes (``PostOp.steps`` of each post op, in order) for images ``rows`` (from
        ``describe``) of samples ``indices``: primitive ops and their per-sample tables."""
        us = self.pipeline.post_uniforms(self.seed, epoch, np.asarray(indices, dtype=np.int64))
        h, w = rows[:, 1], rows[:, 2]
        return [step for op, u in zip(self.ops, us) for step in op.steps(u, h, w, self.channels)]

    def apply(self, images: Any, indices: np.ndarray, epoch: int, *, inplace: bool = False) -> Any:
        """The post ops on ``images`` (see ``describe``) of the samples ``indices`` in ``epoch``.

        Returns a uint8 [N, H, W, C] tensor for a tensor, else a list of [h, w, C] tensors: new
        memory allocated on the stream (``images`` itself without post ops). ``inplace`` lets the
        colour twist write into the input when it comes first."""
        rows = describe(images)
        return self.apply_tables(images, self.tables(rows, indices, epoch), inplace=inplace, rows=rows)

    def apply_tables(self, images: Any, steps: list[Step], *, inplace: bool = False,
                     rows: np.ndarray | None = None) -> Any:
        """``apply`` with given passes (primitive ops and their tables, n rows each; ``tables``).

        Each pass launches over the samples it changes (``changed``), each sample's pixels moving
        between the input and two buffers on their own (``route``); at the end a batch tensor's
        samples are gathered into one buffer."""
        rows = describe(images) if rows is None else rows
        if not steps or len(rows) == 0:
            return images
        if np.any(rows[:, 4] != self.channels):
            raise ValueError(f"images must have {self.channels} channels (the pipeline's)")
        n = len(rows)
        sizes = rows[:, 1] * rows[:, 2] * self.channels
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        total = int(sizes.sum())
        where = np.full(n, -1)
        with torch.cuda.stream(self.stream):
            bufs: list[torch.Tensor | None] = [None, None]
            scratch = None
            for op, tab in steps:
                active = np.flatnonzero(changed(op, tab))
                if not len(active):
                    continue
                src, dst = route(op, where, active, inplace)
                for k in (0, 1):
                    if bufs[k] is None and (np.any(src == k) or np.any(dst == k)):
                        bufs[k] = torch.empty(total, dtype=torch.uint8, device=self.device)
                sub = rows[active]
                s_ptr, s_stride = self._where(rows, bufs, src, offsets, active)
                d_ptr, d_stride = self._where(rows, bufs, dst, offsets, active)
                if isinstance(op, GaussianBlur):
                    if scratch is None:
                        scratch = torch.empty(total, dtype=torch.float32, device=self.device)
                    t_ptr = scratch.data_ptr() + 4 * offsets[active]
                    t_stride = 4 * sub[:, 2] * self.channels
                    par = blur_table(tab[0][active], tab[1][active])
                    kx, ky = op.kernel_size
                    self._launch("blur_rows", sub, s_ptr, s_stride, t_ptr, t_stride, par, (kx, par.shape[1]))
                    self._launch("blur_cols", sub, t_ptr, t_stride, d_ptr, d_stride, par, (ky, par.shape[1], kx))
                elif isinstance(op, _Warp):
                    self._launch("warp_affine", sub, s_ptr, s_stride, d_ptr, d_stride, warp_table(tab[0][active], tab[1]), ())
                elif isinstance(op, ColorMatrix):
                    if self.channels not in (1, 3):
                        raise ValueError(f"{type(op).__name__} takes 1 or 3 channels, got {self.channels}")
                    self._launch("color_twist", sub, s_ptr, s_stride, d_ptr, d_stride,
                                 color_table(tab[0][active], self.channels), ())
                elif isinstance(op, ToneCurve):
                    self._tone(sub, s_ptr, s_stride, d_ptr, d_stride, tab[0][active])
                elif isinstance(op, Sharpness):
                    par = np.asarray(tab[0], dtype=np.float32).reshape(-1, 1)[active]
                    self._launch("sharpen", sub, s_ptr, s_stride, d_ptr, d_stride, par, ())
                else:
                    raise TypeError(f"not a post op: {op!r}")
            if np.all(where == -1):  # nothing changed, or only in place in the input
                return images
            if not isinstance(images, torch.Tensor):
                return [images[i] if k < 0 else bufs[k][o : o + s].view(int(h), int(w), self.channels)
                        for i, (k, o, s, h, w) in enumerate(zip(where, offsets, sizes, rows[:, 1], rows[:, 2]))]
            # One batch tensor: gather the samples into the buffer that holds most of them.
            target = 0 if bufs[1] is None or (bufs[0] is not None and np.sum(where == 0) >= np.sum(where == 1)) else 1
            others = np.flatnonzero(where != target)
            if len(others):
                s_ptr, s_stride = self._where(rows, bufs, where[others], offsets, others)
                d_ptr, d_stride = self._where(rows, bufs, np.full(len(others), target), offsets, others)
                self._launch("copy_pixels", rows[others], s_ptr, s_stride, d_ptr, d_stride, np.zeros((len(others), 1), np.float32), ())
        return bufs[target].view(images.shape)

    def _function(self, name: str):
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self._module.get_function(name)
        return fn

    def _where(self, rows, bufs, which: np.ndarray, offsets, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Addresses and row strides of ``samples`` in the places ``which`` (-1 the input, else a buffer)."""
        ptr = rows[samples, 0].copy()
        stride = rows[samples, 3].copy()
        for k in (0, 1):
            mine = which == k
            if np.any(mine):
                ptr[mine] = bufs[k].data_ptr() + offsets[samples[mine]]
                stride[mine] = rows[samples[mine], 2] * self.channels
        return ptr, stride

    def _tone(self, rows, s_ptr, s_stride, d_ptr, d_stride, params: np.ndarray) -> None:
        """A tone curve: level counts where the curve reads the image, each sample's tables, the lookup."""
        n, c = len(rows), self.channels
        params = np.asarray(params, dtype=np.float64).reshape(n, 2)
        plane = c * 256
        luts = torch.empty(n * plane, dtype=torch.uint8, device=self.device)
        lut_ptrs = luts.data_ptr() + plane * np.arange(n, dtype=np.int64)
        zeros = np.zeros(n, dtype=np.int64)
        hist_ptrs = zeros
        if needs_histograms(params):
            hist = torch.zeros(n * plane, dtype=torch.int32, device=self.device)
            hist_ptrs = hist.data_ptr() + 4 * plane * np.arange(n, dtype=np.int64)
            self._launch("histogram", rows, s_ptr, s_stride, hist_ptrs, zeros, np.zeros((n, 1), np.float32), (),
                         grid=lambda lo, hi: (_HISTOGRAM_BLOCKS, 1, hi - lo), block=(256, 1, 1))
        self._launch("tone_build", rows, hist_ptrs, zeros, lut_ptrs, zeros, params.astype(np.float32), (),
                     grid=lambda lo, hi: (1, 1, hi - lo), block=(256, 1, 1))
        self._launch("tone_apply", rows, s_ptr, s_stride, d_ptr, d_stride, np.zeros((n, 1), np.float32),
                     lambda lo: (np.uint64(luts.data_ptr()), np.int32(lo)))

    def _launch(self, name: str, rows, src, src_stride, dst, dst_stride, par: np.ndarray, extra, *,
                grid=None, block=_BLOCK) -> None:
        """One kernel over the batch, in slices of at most ``_MAX_Z`` samples. ``extra``: the
        kernel's further int arguments, or a function of a slice's first sample giving its
        arguments (typed); ``grid``: a function of a slice's (lo, hi) (default: its images' pixels)."""
        n = len(rows)
        ptrs = np.empty((n, 2), dtype=np.uint64)
        ptrs[:, 0], ptrs[:, 1] = src, dst
        meta = np.empty((n, 4), dtype=np.int32)
        meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3] = rows[:, 1], rows[:, 2], src_stride, dst_stride
        kernel = self._function(name)
        for lo in range(0, n, _MAX_Z):
            hi = min(n, lo + _MAX_Z)
            tables = self._tables[self._turn % _RING]
            self._turn += 1
            d_ptrs, d_meta, d_par = tables.upload(self.cp_stream, ptrs[lo:hi], meta[lo:hi], np.ascontiguousarray(par[lo:hi]))
            args = extra(lo) if callable(extra) else tuple(np.int32(v) for v in extra)
            dims = grid(lo, hi) if grid is not None else (
                (int(rows[lo:hi, 2].max()) + block[0] - 1) // block[0],
                (int(rows[lo:hi, 1].max()) + block[1] - 1) // block[1], hi - lo)
            with self.cp_stream:
                kernel(dims, block, (d_ptrs, d_meta, d_par, *args))
            tables.record(self.cp_stream)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize, layout and dtype of a contiguous uint8 [N, H, W, C] batch, on the stream, as the
        pipeline asks (its Normalize, else its uint8 layout): the CPU path's ``_finish`` arithmetic."""
        pipe = self.pipeline
        norm = pipe.normalize
        with torch.cuda.stream(self.stream):
            if norm is None:
                return x.permute(0, 3, 1, 2).contiguous() if pipe.layout == "CHW" else x
            x = x.contiguous()
            n, h, w, c = x.shape
            shape = (n, c, h, w) if norm.layout == "CHW" else (n, h, w, c)
            out = torch.empty(shape, dtype=norm.dtype, device=self.device)
            if n:
                kernel = self._function(f"finish_{_DTYPE_NAMES[norm.dtype]}")
                grid = ((w + _BLOCK[0] - 1) // _BLOCK[0], (h + _BLOCK[1] - 1) // _BLOCK[1], n)
                with self.cp_stream:
                    for lo in range(0, n, _MAX_Z):
                        hi = min(n, lo + _MAX_Z)
                        kernel(grid[:2] + (hi - lo,), _BLOCK,
                               (np.uint64(x[lo].data_ptr()), np.uint64(out[lo].data_ptr()), np.int32(h), np.int32(w),
                                np.int32(norm.layout == "CHW"), self.mean, self.inv_std))
            return out


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
assert set(_DTYPE_NAMES.values()) == set(FINISH_TYPES)


def finish(x: torch.Tensor, pipeline: Pipeline, stream=None) -> torch.Tensor:
    """``PostOps(pipeline, stream).finish(x)``; ``stream`` defaults to CuPy's current stream."""
    import cupy

    return PostOps(pipeline, stream if stream is not None else cupy.cuda.get_current_stream()).finish(x)
