"""The host side of a batch's GPU post ops, NumPy only (tested without a GPU): which samples each
pass changes, where each sample's pixels go, the device memory the passes need, and the launches
of the batch's ``Plan`` once that memory's address is known.

``PostOps`` (``_post.py``) allocates the memory and issues the plan; everything here runs on the
lane's thread before that, so it is the lane's host time a batch.
"""

from __future__ import annotations

import numpy as np

from .._passes import MixPass, changed
from .._pipeline import Pipeline
from .._post_spec import ColorMatrix, GaussianBlur, PostOp, Step, _Warp
from .._spec import Normalize
from .._tone import Sharpness, ToneCurve, needs_histograms
from ._plan import INPUT, OUTPUT, WORK, Plan, TableRef, address

__all__ = ["BatchPasses", "PlannedPost", "blur_table", "changed", "color_table", "finish_launch", "finish_own_sizes",
           "packed_layout", "plan_post", "post_steps", "route", "warp_table"]

MAX_Z = 65535  # CUDA's limit on gridDim.z: larger batches launch in slices
BLOCK = (32, 8, 1)
_HISTOGRAM_BLOCKS = 8  # blocks counting one sample's levels (each adds its counts to the sample's once)


def post_steps(pipeline: Pipeline, seed: int, epoch: int, indices: np.ndarray, heights: np.ndarray,
               widths: np.ndarray, split: int = 1) -> list[Step]:
    """The passes (``PostOp.steps`` of each post op, in order) of samples ``indices`` in ``epoch``,
    their images ``heights`` x ``widths``, in the augmented view ``split`` (``Pipeline.splits``):
    primitive ops and their per-sample tables."""
    us = pipeline.post_uniforms(seed, epoch, np.asarray(indices, dtype=np.int64), split)
    return [step for op, u in zip(pipeline.post_ops, us) for step in op.steps(u, heights, widths, pipeline.channels)]


def color_table(matrices: np.ndarray, channels: int) -> np.ndarray:
    """(n, 12) float32 colour tables: ``[M | o]`` row-major for RGB; gain and offset at 0 and 3 for gray."""
    m = np.asarray(matrices, dtype=np.float64)
    flat = m.reshape(len(m), -1)
    if channels == 1:
        return _columns(len(m), 12, {0: flat[:, 0], 3: flat[:, 1]})
    return _columns(len(m), 12, {j: flat[:, j] for j in range(12)})


def warp_table(affine: np.ndarray, fill: np.ndarray) -> np.ndarray:
    """(n, 10) float32 warp tables: the index-coordinate matrix (``index_affine``: the half-pixel
    shifts folded into the translation in float64), then 4 fill levels."""
    a = np.asarray(affine, dtype=np.float64).reshape(-1, 6)
    cols = {}
    for r in (0, 1):
        x, y, t = a[:, 3 * r], a[:, 3 * r + 1], a[:, 3 * r + 2]
        cols.update({3 * r: x, 3 * r + 1: y, 3 * r + 2: t + (0.5 * (x + y) - 0.5)})
    f = np.asarray(fill, dtype=np.float32).reshape(-1)
    cols.update({6 + j: f[j] for j in range(len(f))})
    return _columns(len(a), 10, cols)


def blur_table(wx: np.ndarray, wy: np.ndarray) -> np.ndarray:
    """(n, kx + ky) float32 blur tables: row weights, then column weights."""
    wx, wy = np.asarray(wx), np.asarray(wy)
    kx = wx.shape[1]
    return _columns(len(wx), kx + wy.shape[1], {**{j: wx[:, j] for j in range(kx)},
                                               **{kx + j: wy[:, j] for j in range(wy.shape[1])}})


def _columns(n: int, width: int, cols: dict) -> np.ndarray:
    """An (n, width) float32 table filled a column at a time from ``cols`` (the rest 0): copies of n
    elements keep the GIL where a whole table's cast of more than 500 would let it go (``ops/_gil.py``)."""
    out = np.empty((n, width), dtype=np.float32)
    for j in range(width):
        out[:, j] = cols.get(j, 0.0)
    return out


def route(op: PostOp, where: np.ndarray, active: np.ndarray, inplace: bool) -> tuple[np.ndarray, np.ndarray]:
    """Which buffer each of the samples ``active`` (a mask, or indices) reads and writes in this
    pass: -1 is the input, 0 and 1 our two uint8 buffers; ``where`` (n,) says where each sample's
    pixels are now and is updated. Each sample keeps its own place, so a pass that changes a few samples moves only
    those. The colour and tone passes write where they read once that is ours (or the input,
    with ``inplace``); a warp, a blur or sharpness writes into the other buffer; AugMix's mix
    writes into the buffer its input is not in."""
    src = where[active]
    if isinstance(op, (ColorMatrix, ToneCurve)):
        dst = np.where((src >= 0) | inplace, src, 0)
    else:
        dst = np.where(src == 0, 1, 0)
    where[active] = dst
    return src, dst


class BatchPasses:
    """A batch's passes laid out on the host: ``where`` each sample's pixels end (-1 the input, else
    buffer 0 or 1), the device memory they need (``size`` bytes, in one allocation), and
    ``launches``, which adds the passes' launches to a plan once that memory's address is known.

    ``rows`` are ``describe``'s (address, height, width, row stride, channels); ``steps`` the
    batch's passes (``PostOps.tables``).
    """

    def __init__(self, rows: np.ndarray, steps: list[Step], channels: int, inplace: bool) -> None:
        self.rows, self.channels = rows, channels
        n = len(rows)
        self.sizes = rows[:, 1] * rows[:, 2] * channels
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.total = int(self.sizes.sum())
        self.where = np.full(n, -1)
        self.passes = []
        chains = []  # AugMix's: each mix's chains, laid out as a batch of their own (a row a chain)
        # Samples are picked by boolean masks, not index arrays: NumPy gathers by an index array
        # with the GIL let go, whatever its size (``ops/_gil.py``).
        for op, tab in steps if n else ():
            if isinstance(op, MixPass):
                weights, chain_steps = tab
                # The chains' input (-1) is each sample's place when the mix starts, set in launches().
                chains.append(BatchPasses(np.repeat(rows, weights.shape[1] - 1, axis=0), chain_steps, channels, False))
                active = np.ones(n, dtype=bool)
                self.passes.append((op, (weights, chains[-1]), active, *route(op, self.where, active, inplace)))
                continue
            active = changed(op, tab)
            if active.any():
                self.passes.append((op, tab, active, *route(op, self.where, active, inplace)))
        used = {k for k in (0, 1) if any((src == k).any() or (dst == k).any() for _, _, _, src, dst in self.passes)}
        blur = any(isinstance(p[0], GaussianBlur) for p in self.passes)
        tone = any(isinstance(p[0], ToneCurve) for p in self.passes)
        self.size, self._at = 0, {}
        for name, nbytes in ((0, self.total if 0 in used else 0), (1, self.total if 1 in used else 0),
                             *((("chains", j), c.size) for j, c in enumerate(chains)),
                             ("scratch", 4 * self.total if blur else 0), ("luts", n * channels * 256 if tone else 0),
                             ("histograms", 4 * n * channels * 256 if tone else 0)):
            if nbytes:
                self._at[name] = self.size
                self.size += -(-nbytes // 256) * 256
        self.base = 0  # set by ``launches``

    @property
    def changes(self) -> bool:
        """Some sample's pixels leave the input (a batch tensor is then gathered into a buffer)."""
        return bool(np.any(self.where != -1))

    def at(self, k: int | str) -> int:
        """The offset of buffer ``k`` (0 or 1) or of a temporary in the allocation."""
        return self._at[k]

    def launches(self, plan: Plan, base: int, *, gather: bool) -> int | None:
        """Add the passes' launches to ``plan``, the allocation at device address ``base`` (real, or
        named: ``_plan.address``). ``gather`` (a batch tensor): the samples are then gathered into
        the buffer that holds most of them, which is returned (None when no sample left the input)."""
        self.base = base
        mixes = 0
        for op, tab, active, src, dst in self.passes:
            if isinstance(op, MixPass):
                self._mix(plan, tab, src, dst, self._at[("chains", mixes)])
                mixes += 1
            else:
                self._add_pass(plan, op, tab, active, src, dst)
        if not gather or not self.changes:
            return None
        where = self.where
        counts = [np.count_nonzero(where == k) for k in (0, 1)]
        target = 0 if counts[0] >= counts[1] and 0 in self._at else 1
        others = where != target
        if others.any():
            rows, offsets = self.rows[others], self.offsets[others]
            s_ptr, s_stride = self._where(where[others], rows, offsets)
            d_ptr, d_stride = self._where(np.full(len(rows), target), rows, offsets)
            self._launch(plan, "copy_pixels", rows, s_ptr, s_stride, d_ptr, d_stride, np.full((len(rows), 1), 0, np.float32), ())
        return target

    def _add_pass(self, plan: Plan, op, tab, active, src, dst) -> None:
        sub, offsets = self.rows[active], self.offsets[active]
        (s_ptr, s_stride), (d_ptr, d_stride) = self._wheres((src, dst), sub, offsets)
        if isinstance(op, GaussianBlur):
            t_ptr = self.base + self._at["scratch"] + 4 * offsets
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
            self._tone(plan, sub, s_ptr, s_stride, d_ptr, d_stride, tab[0][active])
        elif isinstance(op, Sharpness):
            par = np.asarray(tab[0], dtype=np.float32).reshape(-1, 1)[active]
            self._launch(plan, "sharpen", sub, s_ptr, s_stride, d_ptr, d_stride, par, ())
        else:
            raise TypeError(f"not a post op: {op!r}")

    def _mix(self, plan: Plan, tab, src: np.ndarray, dst: np.ndarray, at: int) -> None:
        """AugMix's mix: the chains' passes (a batch of their own at ``at`` in the allocation, their
        input each sample's place ``src``), then one launch that mixes every sample's chains with it
        into ``dst`` (``mix_chains``)."""
        weights, chains = tab
        width = weights.shape[1] - 1
        s_ptr, s_stride = self._where(src, self.rows, self.offsets)
        chains.rows[:, 0], chains.rows[:, 3] = np.repeat(s_ptr, width), np.repeat(s_stride, width)
        chains.launches(plan, self.base + at, gather=False)
        c_ptr, c_stride = chains._where(chains.where, chains.rows, chains.offsets)
        d_ptr, d_stride = self._where(dst, self.rows, self.offsets)
        n = len(self.rows)
        ptrs = np.empty((n, width + 2), dtype=np.uint64)
        ptrs[:, 0], ptrs[:, 1], ptrs[:, 2:] = s_ptr, d_ptr, c_ptr.reshape(n, width)
        meta = np.empty((n, width + 4), dtype=np.int32)
        meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3] = self.rows[:, 1], self.rows[:, 2], s_stride, d_stride
        meta[:, 4:] = c_stride.reshape(n, width)
        self._launch_tables(plan, "mix_chains", self.rows, ptrs, meta, weights, (width,))

    def _where(self, which: np.ndarray, rows: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Addresses and row strides of the samples ``rows`` (at ``offsets`` in a buffer) in the
        places ``which`` (-1 the input, else a buffer)."""
        return self._wheres((which,), rows, offsets)[0]

    def _wheres(self, places: tuple[np.ndarray, ...], rows: np.ndarray, offsets: np.ndarray
                ) -> list[tuple[np.ndarray, np.ndarray]]:
        """``_where`` of the same samples in each of ``places`` (a pass's source and destination),
        sharing their addresses in the buffers. Picked with ``np.where``, a column at a time:
        buffer k's sample starts at ``base + at(0) + k (at(1) - at(0)) + offset`` (a buffer no
        sample is in is never picked), in fewer NumPy calls than a masked store per buffer."""
        first = self._at.get(0, self._at.get(1, 0))
        step = self._at.get(1, first) - first
        start = offsets + (self.base + first)
        own = rows[:, 2] * self.channels
        out = []
        for which in places:
            ours = which >= 0
            out.append((np.where(ours, start + which * step if step else start, rows[:, 0]),
                        np.where(ours, own, rows[:, 3])))
        return out

    def _tone(self, plan: Plan, rows, s_ptr, s_stride, d_ptr, d_stride, params: np.ndarray) -> None:
        """A tone curve: level counts where the curve reads the image, each sample's tables, the lookup.
        The passes of a batch share the tables' memory: they run in order on the stream."""
        n, c = len(rows), self.channels
        params = np.asarray(params, dtype=np.float64).reshape(n, 2)
        plane = c * 256
        luts, histograms = self.base + self._at["luts"], self.base + self._at["histograms"]
        lut_ptrs = luts + plane * np.arange(n, dtype=np.int64)
        zeros = np.full(n, 0, dtype=np.int64)  # np.zeros lets the GIL go around a calloc of 1 KiB or more
        hist_ptrs = zeros
        if needs_histograms(params):
            plan.zero(histograms, 4 * plane * n)
            hist_ptrs = histograms + 4 * plane * np.arange(n, dtype=np.int64)
            self._launch(plan, "histogram", rows, s_ptr, s_stride, hist_ptrs, zeros, np.full((n, 1), 0, np.float32), (),
                         grid=lambda lo, hi: (_HISTOGRAM_BLOCKS, 1, hi - lo), block=(256, 1, 1))
        self._launch(plan, "tone_build", rows, hist_ptrs, zeros, lut_ptrs, zeros, _columns(n, 2, {0: params[:, 0], 1: params[:, 1]}), (),
                     grid=lambda lo, hi: (1, 1, hi - lo), block=(256, 1, 1))
        self._launch(plan, "tone_apply", rows, s_ptr, s_stride, d_ptr, d_stride, np.full((n, 1), 0, np.float32),
                     lambda lo: (np.uint64(luts), np.int32(lo)))

    def _launch(self, plan: Plan, name: str, rows, src, src_stride, dst, dst_stride, par: np.ndarray, extra, *,
                grid=None, block=BLOCK) -> None:
        """One kernel over the batch, in slices of at most ``MAX_Z`` samples, added to ``plan``.
        ``extra``: the kernel's further int arguments, or a function of a slice's first sample giving
        its arguments (typed); ``grid``: a function of a slice's (lo, hi) (default: its images' pixels)."""
        n = len(rows)
        ptrs = np.empty((n, 2), dtype=np.uint64)
        ptrs[:, 0], ptrs[:, 1] = src, dst
        meta = np.empty((n, 4), dtype=np.int32)
        meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3] = rows[:, 1], rows[:, 2], src_stride, dst_stride
        self._launch_tables(plan, name, rows, ptrs, meta, par, extra, grid=grid, block=block)

    @staticmethod
    def _launch_tables(plan: Plan, name: str, rows, ptrs: np.ndarray, meta: np.ndarray, par, extra, *, grid=None,
                       block=BLOCK) -> None:
        """``_launch`` with its per-sample tables made: addresses (n, k), ints (n, m), floats."""
        n = len(rows)
        par = np.asarray(par, dtype=np.float32)
        for lo in range(0, n, MAX_Z):
            hi = min(n, lo + MAX_Z)
            args = extra(lo) if callable(extra) else tuple(np.int32(v) for v in extra)
            dims = grid(lo, hi) if grid is not None else (
                (int(rows[lo:hi, 2].max()) + block[0] - 1) // block[0],
                (int(rows[lo:hi, 1].max()) + block[1] - 1) // block[1], hi - lo)
            plan.launch(name, dims, block, plan.table(ptrs[lo:hi], addresses=True), plan.table(meta[lo:hi]),
                        plan.table(par[lo:hi]), *args)


def finish_launch(plan: Plan, normalize: Normalize, src: int, dst: int, shape: tuple[int, int, int, int],
                  tables: tuple[TableRef, TableRef] | None = None) -> tuple[TableRef, TableRef]:
    """The finish kernel (``normalize``'s arithmetic, layout and dtype) from the contiguous uint8
    [N, H, W, C] batch at ``src`` into ``dst`` (addresses, real or named), added to ``plan``: the
    CPU path's ``_finish``. Its mean and 1 / std go up as tables of the plan (``tables``: those an
    earlier call returned, for images finished one by one in one plan); returns them."""
    n, h, w, c = shape
    if tables is None:
        mean = np.resize(np.array(normalize.mean, dtype=np.float32) * 255.0, c).astype(np.float32)
        inv_std = np.resize(1.0 / (np.array(normalize.std, dtype=np.float32) * 255.0), c).astype(np.float32)
        tables = plan.table(mean), plan.table(inv_std)
    kernel = "finish_" + str(normalize.dtype).removeprefix("torch.")
    grid_xy = ((w + BLOCK[0] - 1) // BLOCK[0], (h + BLOCK[1] - 1) // BLOCK[1])
    step_in, step_out = h * w * c, h * w * c * normalize.dtype.itemsize
    for lo in range(0, n, MAX_Z):
        hi = min(n, lo + MAX_Z)
        plan.launch(kernel, (*grid_xy, hi - lo), BLOCK, np.uint64(src + lo * step_in), np.uint64(dst + lo * step_out),
                    np.int32(h), np.int32(w), np.int32(normalize.layout == "CHW"), *tables)
    return tables


def packed_layout(h: np.ndarray, w: np.ndarray, c: np.ndarray, chw: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Images of their own sizes packed one after another in one allocation, each laid out CHW or
    HWC: their shapes and strides (n, 3) and their starts (n,), in elements."""
    sizes = h * w * c
    ones = np.ones_like(h)
    if chw:
        return np.stack([c, h, w], 1), np.stack([h * w, w, ones], 1), np.cumsum(sizes) - sizes
    return np.stack([h, w, c], 1), np.stack([w * c, c, ones], 1), np.cumsum(sizes) - sizes


def finish_own_sizes(plan: Plan, normalize: Normalize, rows: np.ndarray, dst: int) -> np.ndarray:
    """The finish of images of their own sizes (``describe``'s ``rows``, packed rows), each into its
    place (``packed_layout``) in one output at ``dst``, all in one plan; returns their starts in it
    (elements)."""
    h, w, c = rows[:, 1], rows[:, 2], rows[:, 4]
    _, _, starts = packed_layout(h, w, c, normalize.layout == "CHW")
    itemsize = normalize.dtype.itemsize
    tables = None
    for address, hi, wi, ci, start in zip(rows[:, 0].tolist(), h.tolist(), w.tolist(), c.tolist(), starts.tolist()):
        tables = finish_launch(plan, normalize, address, dst + start * itemsize, (1, hi, wi, ci), tables)
    return starts


class PlannedPost:
    """A batch's post ops and finish planned ahead of its pixels (``plan_post``), for the lane's
    uint8 [N, H, W, C] output of ``input_shape``: the plan, the workspace it needs (``work``
    bytes) and the output it writes (``out_shape`` of ``dtype``)."""

    def __init__(self, plan: Plan, work: int, input_shape: tuple[int, ...], out_shape: tuple[int, ...], dtype) -> None:
        self.plan, self.work = plan, work
        self.input_shape, self.out_shape, self.dtype = input_shape, out_shape, dtype


def plan_post(pipeline: Pipeline, seed: int, epoch: int, indices: np.ndarray, size: tuple[int, int], split: int = 1
              ) -> PlannedPost | None:
    """The post ops and finish of the samples ``indices`` in ``epoch``, their images all ``size``
    (h, w), planned in the prep thread before the lane decodes them: their host work (the policies'
    draws, the tables, the plan's layout; ~1-2 ms a batch of 256) then runs beside the lanes instead
    of in them. None where the lane plans itself: no post ops, no Normalize, or no samples.

    ``split``: the augmented view (``Pipeline.splits``). With splits the views read one input, so
    no pass may write into it (a colour twist coming first otherwise does)."""
    norm = pipeline.normalize
    n = len(indices)
    if not pipeline.post_ops or norm is None or n == 0:
        return None
    (h, w), c = size, pipeline.channels
    rows = np.empty((n, 5), dtype=np.int64)
    rows[:, 0] = address(INPUT) + np.arange(n, dtype=np.int64) * (h * w * c)
    rows[:, 1], rows[:, 2], rows[:, 3], rows[:, 4] = h, w, w * c, c
    passes = BatchPasses(rows, post_steps(pipeline, seed, epoch, indices, rows[:, 1], rows[:, 2], split), c,
                         inplace=pipeline.splits == 1)
    plan = Plan()
    target = passes.launches(plan, address(WORK), gather=True)
    src = address(WORK, passes.at(target)) if target is not None else address(INPUT)
    finish_launch(plan, norm, src, address(OUTPUT), (n, h, w, c))
    plan.compile()
    return PlannedPost(plan, passes.size, (n, h, w, c), (n, c, h, w) if norm.layout == "CHW" else (n, h, w, c), norm.dtype)
