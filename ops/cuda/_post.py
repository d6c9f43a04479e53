"""The GPU path's post ops: colour twist, warps, blur, tone curves and sharpness, a few kernel
launches a batch each (``PostOp.steps``: the passes of ops such as ``RandAugment``), then finish.

``PostOps`` belongs to a lane: it launches on the lane's CuPy stream and allocates its outputs with
torch on that stream (docs/gpu-notes.md §3: ``record_stream`` ignores memory torch did not allocate). Images
of a batch may differ in size: each launch reads per-sample tables (addresses, sizes, row strides,
the op's numbers). A batch's tables and launches are built as one ``Plan`` and issued by one call
that holds no GIL (``_plan.py``: from Python each copy, launch and event cost a GIL hand-off). The numbers are the CPU path's (``PostOp.tables``), so both draw the same
parameters for a sample.

Buffers: a pass launches over the samples it changes only (a sample ``p`` left alone, or one that
drew another kind of pass in a policy's round, is skipped), so each sample's pixels move between
the input and two uint8 buffers on their own (``route``): the colour twist and tone curves work in
place once a buffer is ours; a warp, a blur or sharpness writes into the other buffer; a batch
tensor's samples are gathered into one buffer at the end. The blur's horizontal pass
writes float32 scratch that its vertical pass reads, rounding once at the end, as the CPU path
does. A tone curve builds each sample's tables on the device (from the image's level counts where
the curve is read off the image), then looks every pixel up.

Host waits: the only one is the plan's, for the event of the plan that used the same pinned block
four batches ago (long passed, in practice). Nothing else synchronises.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._geometry import index_affine
from .._pipeline import Pipeline
from .._post_spec import ColorMatrix, GaussianBlur, PostOp, Step, _Warp
from .._tone import IDENTITY, Sharpness, ToneCurve, needs_histograms
from ._plan import Plan, PlanSlots
from ._post_kernels import FINISH_TYPES, module

__all__ = ["PostOps", "blur_table", "changed", "color_table", "describe", "finish", "route", "warp_table"]

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


class PostOps:
    """A pipeline's post ops and its finish on one CUDA stream; owned by a lane, used by its thread.

    ``stream`` is the lane's ``cupy.cuda.Stream``; ``seed`` the executor's. Inputs must be ready on
    that stream (written on it, or waited for) and stay alive until the stream has passed the
    launches (buffers torch allocated on the stream itself may be dropped at once). A batch's
    launches are built as one ``Plan`` and issued by one call (``_plan.py`` says why); ``native``
    False issues them through CuPy instead of the decode shim.
    """

    def __init__(self, pipeline: Pipeline, stream, *, seed: int = 0, device: torch.device | None = None,
                 native: bool = True) -> None:
        import cupy

        self.pipeline = pipeline
        self.ops = pipeline.post_ops
        self.seed = seed
        self.channels = pipeline.channels
        self.cupy = cupy
        self.cp_stream = stream
        self.native = native
        self.device = device if device is not None else torch.device("cuda", cupy.cuda.Device().id)
        self.stream = torch.cuda.ExternalStream(stream.ptr, device=self.device)
        self._module = module(self.channels)
        self._functions: dict[str, int] = {}
        self._slots = PlanSlots(cupy, stream)
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

    def apply(self, images: Any, indices: np.ndarray, epoch: int, *, inplace: bool = False, finish: bool = False,
              ready: torch.cuda.Event | None = None) -> Any:
        """The post ops on ``images`` (see ``describe``) of the samples ``indices`` in ``epoch``.

        Returns a uint8 [N, H, W, C] tensor for a tensor, else a list of [h, w, C] tensors: new
        memory allocated on the stream (``images`` itself without post ops). ``inplace`` lets the
        colour twist write into the input when it comes first. ``finish`` (a tensor only): the
        batch normalised and laid out as the pipeline asks (``finish``), in the same launches.
        ``ready``: recorded on the stream once the result is written."""
        rows = describe(images)
        return self.apply_tables(images, self.tables(rows, indices, epoch), inplace=inplace, rows=rows,
                                 finish=finish, ready=ready)

    def apply_tables(self, images: Any, steps: list[Step], *, inplace: bool = False, rows: np.ndarray | None = None,
                     finish: bool = False, ready: torch.cuda.Event | None = None) -> Any:
        """``apply`` with given passes (primitive ops and their tables, n rows each; ``tables``).

        Each pass launches over the samples it changes (``changed``), each sample's pixels moving
        between the input and two buffers on their own (``route``); at the end a batch tensor's
        samples are gathered into one buffer. The buffers and temporaries are one allocation, and
        every launch goes up in one plan."""
        batch = isinstance(images, torch.Tensor)
        if finish and not batch:
            raise ValueError("finish=True takes a batch tensor; finish each image of a list on its own")
        if finish and not images.is_contiguous():  # the finish kernel reads the batch as one block
            images, rows = images.contiguous(), None
        rows = describe(images) if rows is None else rows
        if len(rows) and np.any(rows[:, 4] != self.channels):
            raise ValueError(f"images must have {self.channels} channels (the pipeline's)")
        n = len(rows)
        sizes = rows[:, 1] * rows[:, 2] * self.channels
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        total = int(sizes.sum())
        # Where each pass reads and writes (host only, first): the allocation is sized from it.
        where = np.full(n, -1)
        passes = []
        for op, tab in steps if n else ():
            active = np.flatnonzero(changed(op, tab))
            if len(active):
                passes.append((op, tab, active, *route(op, where, active, inplace)))
        plan = Plan()
        with torch.cuda.stream(self.stream):
            space = _Workspace(n, total, self.channels, passes, self.device)
            for op, tab, active, src, dst in passes:
                self._add_pass(plan, space, rows, offsets, op, tab, active, src, dst)
            result, address = images, (int(rows[0, 0]) if n else 0)
            if batch and np.any(where != -1):
                target = self._gather(plan, space, rows, offsets, where)
                address = space.address(target)
                result = None if finish else space.buffer(target, 0, total).view(images.shape)
            elif not batch and passes:
                result = [images[i] if k < 0 else space.buffer(k, o, s).view(int(h), int(w), self.channels)
                          for i, (k, o, s, h, w) in enumerate(zip(where, offsets, sizes, rows[:, 1], rows[:, 2]))]
            if finish and self.pipeline.normalize is not None:
                result = self._finish_into(plan, address, images.shape)
            elif finish:  # no Normalize: torch lays the batch out, after the plan
                if result is None:
                    result = space.buffer(target, 0, total).view(images.shape)
                self._slots.run(plan, native=self.native)
                result = self.finish(result)
                if ready is not None:
                    ready.record(self.stream)
                return result
            if len(plan) or ready is not None:
                self._slots.run(plan, ready=ready, native=self.native)
        return result

    def _add_pass(self, plan: Plan, space: _Workspace, rows, offsets, op, tab, active, src, dst) -> None:
        sub = rows[active]
        s_ptr, s_stride = self._where(rows, space, src, offsets, active)
        d_ptr, d_stride = self._where(rows, space, dst, offsets, active)
        if isinstance(op, GaussianBlur):
            t_ptr = space.scratch + 4 * offsets[active]
            t_stride = 4 * sub[:, 2] * self.channels
            par = blur_table(tab[0][active], tab[1][active])
            kx, ky = op.kernel_size
            self._launch(plan, "blur_rows", sub, s_ptr, s_stride, t_ptr, t_stride, par, (kx, par.shape[1]))
            self._launch(plan, "blur_cols", sub, t_ptr, t_stride, d_ptr, d_stride, par, (ky, par.shape[1], kx))
        elif isinstance(op, _Warp):
            self._launch(plan, "warp_affine", sub, s_ptr, s_stride, d_ptr, d_stride, warp_table(tab[0][active], tab[1]), ())
        elif isinstance(op, ColorMatrix):
            if self.channels not in (1, 3):
                raise ValueError(f"{type(op).__name__} takes 1 or 3 channels, got {self.channels}")
            self._launch(plan, "color_twist", sub, s_ptr, s_stride, d_ptr, d_stride,
                         color_table(tab[0][active], self.channels), ())
        elif isinstance(op, ToneCurve):
            self._tone(plan, space, sub, s_ptr, s_stride, d_ptr, d_stride, tab[0][active])
        elif isinstance(op, Sharpness):
            par = np.asarray(tab[0], dtype=np.float32).reshape(-1, 1)[active]
            self._launch(plan, "sharpen", sub, s_ptr, s_stride, d_ptr, d_stride, par, ())
        else:
            raise TypeError(f"not a post op: {op!r}")

    def _gather(self, plan: Plan, space: _Workspace, rows, offsets, where: np.ndarray) -> int:
        """One batch tensor: the samples gathered into the buffer that holds most of them (returned)."""
        counts = [np.sum(where == k) for k in (0, 1)]
        target = 0 if counts[0] >= counts[1] and space.has(0) else 1
        others = np.flatnonzero(where != target)
        if len(others):
            s_ptr, s_stride = self._where(rows, space, where[others], offsets, others)
            d_ptr, d_stride = self._where(rows, space, np.full(len(others), target), offsets, others)
            self._launch(plan, "copy_pixels", rows[others], s_ptr, s_stride, d_ptr, d_stride,
                         np.zeros((len(others), 1), np.float32), ())
        return target

    def _function(self, name: str) -> int:
        fn = self._functions.get(name)
        if fn is None:
            kernel = self._module.get_function(name)  # a RawKernel; its CUfunction, for the plan
            fn = self._functions[name] = kernel.kernel.ptr
        return fn

    def _where(self, rows, space: _Workspace, which: np.ndarray, offsets, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Addresses and row strides of ``samples`` in the places ``which`` (-1 the input, else a buffer)."""
        ptr = rows[samples, 0].copy()
        stride = rows[samples, 3].copy()
        for k in (0, 1):
            mine = which == k
            if np.any(mine):
                ptr[mine] = space.address(k) + offsets[samples[mine]]
                stride[mine] = rows[samples[mine], 2] * self.channels
        return ptr, stride

    def _tone(self, plan: Plan, space: _Workspace, rows, s_ptr, s_stride, d_ptr, d_stride, params: np.ndarray) -> None:
        """A tone curve: level counts where the curve reads the image, each sample's tables, the lookup.
        The passes of a batch share the tables' memory: they run in order on the stream."""
        n, c = len(rows), self.channels
        params = np.asarray(params, dtype=np.float64).reshape(n, 2)
        plane = c * 256
        lut_ptrs = space.luts + plane * np.arange(n, dtype=np.int64)
        zeros = np.zeros(n, dtype=np.int64)
        hist_ptrs = zeros
        if needs_histograms(params):
            plan.zero(space.histograms, 4 * plane * n)
            hist_ptrs = space.histograms + 4 * plane * np.arange(n, dtype=np.int64)
            self._launch(plan, "histogram", rows, s_ptr, s_stride, hist_ptrs, zeros, np.zeros((n, 1), np.float32), (),
                         grid=lambda lo, hi: (_HISTOGRAM_BLOCKS, 1, hi - lo), block=(256, 1, 1))
        self._launch(plan, "tone_build", rows, hist_ptrs, zeros, lut_ptrs, zeros, params.astype(np.float32), (),
                     grid=lambda lo, hi: (1, 1, hi - lo), block=(256, 1, 1))
        self._launch(plan, "tone_apply", rows, s_ptr, s_stride, d_ptr, d_stride, np.zeros((n, 1), np.float32),
                     lambda lo: (np.uint64(space.luts), np.int32(lo)))

    def _launch(self, plan: Plan, name: str, rows, src, src_stride, dst, dst_stride, par: np.ndarray, extra, *,
                grid=None, block=_BLOCK) -> None:
        """One kernel over the batch, in slices of at most ``_MAX_Z`` samples, added to ``plan``.
        ``extra``: the kernel's further int arguments, or a function of a slice's first sample giving
        its arguments (typed); ``grid``: a function of a slice's (lo, hi) (default: its images' pixels)."""
        n = len(rows)
        ptrs = np.empty((n, 2), dtype=np.uint64)
        ptrs[:, 0], ptrs[:, 1] = src, dst
        meta = np.empty((n, 4), dtype=np.int32)
        meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3] = rows[:, 1], rows[:, 2], src_stride, dst_stride
        par = np.asarray(par, dtype=np.float32)
        function = self._function(name)
        for lo in range(0, n, _MAX_Z):
            hi = min(n, lo + _MAX_Z)
            args = extra(lo) if callable(extra) else tuple(np.int32(v) for v in extra)
            dims = grid(lo, hi) if grid is not None else (
                (int(rows[lo:hi, 2].max()) + block[0] - 1) // block[0],
                (int(rows[lo:hi, 1].max()) + block[1] - 1) // block[1], hi - lo)
            plan.launch(function, dims, block, plan.table(ptrs[lo:hi]), plan.table(meta[lo:hi]), plan.table(par[lo:hi]),
                        *args)

    def _finish_into(self, plan: Plan, address: int, shape: tuple[int, ...]) -> torch.Tensor:
        """The finish kernel (the pipeline has a Normalize) on the contiguous uint8 [N, H, W, C] batch
        at ``address``, added to ``plan``; returns its output, allocated on the stream."""
        norm = self.pipeline.normalize
        n, h, w, c = shape
        out = torch.empty((n, c, h, w) if norm.layout == "CHW" else (n, h, w, c), dtype=norm.dtype, device=self.device)
        function = self._function(f"finish_{_DTYPE_NAMES[norm.dtype]}")
        grid_xy = ((w + _BLOCK[0] - 1) // _BLOCK[0], (h + _BLOCK[1] - 1) // _BLOCK[1])
        step_in, step_out = h * w * c, h * w * c * out.element_size()
        for lo in range(0, n, _MAX_Z):
            hi = min(n, lo + _MAX_Z)
            plan.launch(function, (*grid_xy, hi - lo), _BLOCK, np.uint64(address + lo * step_in),
                        np.uint64(out.data_ptr() + lo * step_out), np.int32(h), np.int32(w),
                        np.int32(norm.layout == "CHW"), np.uint64(self.mean.data.ptr), np.uint64(self.inv_std.data.ptr))
        return out

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize, layout and dtype of a contiguous uint8 [N, H, W, C] batch, on the stream, as the
        pipeline asks (its Normalize, else its uint8 layout): the CPU path's ``_finish`` arithmetic."""
        pipe = self.pipeline
        with torch.cuda.stream(self.stream):
            if pipe.normalize is None:
                return x.permute(0, 3, 1, 2).contiguous() if pipe.layout == "CHW" else x
            x = x.contiguous()
            plan = Plan()
            out = self._finish_into(plan, x.data_ptr(), tuple(x.shape))
            if len(plan):
                self._slots.run(plan, native=self.native)
            return out


class _Workspace:
    """A batch's device memory for its passes, one allocation on the stream: the two uint8 buffers
    (those the routes use), the blur's float32 scratch, the tone curves' tables and level counts."""

    def __init__(self, n: int, total: int, channels: int, passes: list, device: torch.device) -> None:
        self.total = total
        used = set()
        for _, _, _, src, dst in passes:
            used.update(int(k) for k in np.unique(np.concatenate([src, dst])) if k >= 0)
        blur = any(isinstance(p[0], GaussianBlur) for p in passes)
        tone = any(isinstance(p[0], ToneCurve) for p in passes)
        size, self._at = 0, {}
        for name, nbytes in (("buf0", total if 0 in used else 0), ("buf1", total if 1 in used else 0),
                             ("scratch", 4 * total if blur else 0), ("luts", n * channels * 256 if tone else 0),
                             ("histograms", 4 * n * channels * 256 if tone else 0)):
            if nbytes:
                self._at[name] = size
                size += -(-nbytes // 256) * 256
        self.memory = torch.empty(size, dtype=torch.uint8, device=device) if size else None
        base = self.memory.data_ptr() if size else 0
        self.scratch, self.luts, self.histograms = (base + self._at.get(k, 0) for k in ("scratch", "luts", "histograms"))

    def has(self, k: int) -> bool:
        return f"buf{k}" in self._at

    def address(self, k: int) -> int:
        return self.memory.data_ptr() + self._at[f"buf{k}"]

    def buffer(self, k: int, offset: int, size: int) -> torch.Tensor:
        at = self._at[f"buf{k}"] + int(offset)
        return self.memory[at : at + int(size)]


_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
assert set(_DTYPE_NAMES.values()) == set(FINISH_TYPES)


def finish(x: torch.Tensor, pipeline: Pipeline, stream=None) -> torch.Tensor:
    """``PostOps(pipeline, stream).finish(x)``; ``stream`` defaults to CuPy's current stream."""
    import cupy

    return PostOps(pipeline, stream if stream is not None else cupy.cuda.get_current_stream()).finish(x)
