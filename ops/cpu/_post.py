"""The CPU path's post ops (colour twist, affine warp, Gaussian blur, tone curves, sharpness) on
uint8 HWC tensors.

Each op takes the per-sample tables its spec computes (``PostOp.tables``: the same float64 numbers
the GPU kernels get) and works in float32 on channel planes (elementwise work on interleaved RGB
was 3x slower here). Results round once, half up (``floor(v + 0.5)``), to uint8, and come back as
HWC views of planar memory. Colour and warp use torch's fast ops (a matrix product,
``grid_sample``), the blur the kernel's own order of operations; each is within 1 level of the
float64 result and of the GPU kernel (bounds and tests: ops/README.md).

The pure-NumPy helpers here (``index_affine``, ``reflect``) are shared with ``cuda/_post.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .._geometry import index_affine
from .._passes import MixPass, changed
from .._post_spec import ColorMatrix, GaussianBlur, PostOp, Step, _Warp
from .._tone import Sharpness, ToneCurve, blend, needs_histograms, smoothed, tone_tables

__all__ = ["apply", "apply_tables", "blur", "color_twist", "histograms", "reflect", "run_steps", "sharpen", "tone", "warp"]


def reflect(i: np.ndarray, n: int) -> np.ndarray:
    """Indices ``i`` reflected into ``[0, n)`` without repeating the edge (torch's "reflect": -1 -> 1),
    as often as needed (period ``2 (n - 1)``); every index is 0 when ``n`` is 1."""
    i = np.asarray(i, dtype=np.int64)
    if n == 1:
        return np.zeros_like(i)
    period = 2 * (n - 1)
    i = np.abs(i) % period
    return np.where(i < n, i, period - i)


def _round_u8(v: torch.Tensor) -> torch.Tensor:
    """(C, H, W) float32 -> an HWC uint8 view of planar memory: floor(v + 0.5), clamped to 0..255."""
    return v.add_(0.5).floor_().clamp_(0.0, 255.0).to(torch.uint8).permute(1, 2, 0)


def _planes(x: torch.Tensor) -> torch.Tensor:
    """(C, H, W) float32 planes of HWC uint8 ``x`` (planar rows make the elementwise work fast)."""
    return x.permute(2, 0, 1).contiguous().float()


def color_twist(x: torch.Tensor, matrix: np.ndarray) -> torch.Tensor:
    """``round(M x + o)`` per pixel of HWC uint8 ``x``; ``matrix`` is ``[M | o]``: (3, 4) RGB, (1, 2) gray.

    One float32 matrix product over the planes (4x faster here than the kernel's operation order
    written out, which gave the same bytes): within 1 level of the float64 result and of the GPU.
    """
    h, w, c = x.shape
    m = torch.from_numpy(np.asarray(matrix, dtype=np.float32).reshape(c, c + 1))
    v = torch.addmm(m[:, c:], m[:, :c], _planes(x).view(c, h * w))
    return _round_u8(v.view(c, h, w))


def warp(x: torch.Tensor, matrix: np.ndarray, fill: Sequence[float]) -> torch.Tensor:
    """Bilinear resample of HWC uint8 ``x`` through ``matrix`` (2 x 3, from ``index_affine``: output
    indices to input index coordinates); each neighbour outside the image reads ``fill`` (per channel).

    torch's ``grid_sample`` (zeros outside, so it samples ``x - fill`` and adds ``fill`` back): 3-4x
    faster here than four gathers and the kernel's arithmetic; within 1 level of the kernel.
    """
    h, w, c = x.shape
    a = np.asarray(matrix, dtype=np.float64).reshape(2, 3)
    # grid_sample's coordinates: -1 and 1 are the outer edges, so index i sits at (2 i + 1) / n - 1.
    scale = np.array([[2.0 / w], [2.0 / h]])
    b = a * scale
    b[:, 2] += scale[:, 0] * 0.5 - 1.0
    xs = torch.arange(w, dtype=torch.float32).view(1, w)
    ys = torch.arange(h, dtype=torch.float32).view(h, 1)
    # Clamped as in the kernel (a point more than a pixel outside reads fill from all four
    # neighbours either way), so no coordinate overflows grid_sample's integer conversion.
    gx = (xs * b[0, 0] + ys * b[0, 1]).add_(b[0, 2]).clamp_(-1.0 - 3.0 / w, 1.0 + 3.0 / w)
    gy = (xs * b[1, 0] + ys * b[1, 1]).add_(b[1, 2]).clamp_(-1.0 - 3.0 / h, 1.0 + 3.0 / h)
    grid = torch.stack((gx, gy), dim=-1)[None]
    levels = torch.from_numpy(np.resize(np.asarray(fill, dtype=np.float32), c)).view(c, 1, 1)
    src = _planes(x).sub_(levels)
    v = F.grid_sample(src[None], grid, mode="bilinear", padding_mode="zeros", align_corners=False)[0]
    return _round_u8(v.add_(levels))


def _reflect_pad(p: torch.Tensor, dim: int, r: int) -> torch.Tensor:
    n = p.shape[dim]
    index = torch.from_numpy(reflect(np.arange(-r, n + r), n))
    if dim == 1:
        return p.index_select(1, index)
    # A gather along the last dimension is slow: copy the middle, gather only the borders.
    out = p.new_empty((p.shape[0], p.shape[1], n + 2 * r))
    out[:, :, r : r + n] = p
    out[:, :, :r] = p.index_select(2, index[:r])
    out[:, :, r + n :] = p.index_select(2, index[r + n :])
    return out


def blur(x: torch.Tensor, wx: np.ndarray, wy: np.ndarray) -> torch.Tensor:
    """Separable filter of HWC uint8 ``x``: ``wx`` along rows, then ``wy`` along columns (odd lengths),
    reflect borders, float32 between the passes, one rounding. The kernel's arithmetic, in its
    order (``acc + w[t] x[t]``, each operation rounded): the same bytes as the GPU, barring FMA."""
    out = _planes(x)
    for dim, weights in ((2, wx), (1, wy)):
        n = out.shape[dim]
        wk = np.asarray(weights, dtype=np.float32).tolist()
        padded = _reflect_pad(out, dim, len(wk) // 2)
        acc = torch.mul(padded.narrow(dim, 0, n), wk[0])
        tmp = torch.empty_like(acc)
        for t in range(1, len(wk)):
            acc.add_(torch.mul(padded.narrow(dim, t, n), wk[t], out=tmp))
        out = acc
    return _round_u8(out)


def histograms(x: np.ndarray) -> np.ndarray:
    """(C, 256) int64 level counts of each channel of HWC uint8 ``x`` (what ``tone_tables`` reads)."""
    return np.stack([np.bincount(x[..., k].reshape(-1), minlength=256) for k in range(x.shape[2])])


def tone(x: torch.Tensor, params: np.ndarray) -> torch.Tensor:
    """HWC uint8 ``x`` through the tone curve of ``params`` (one ``(kind, value)`` row): each
    channel's level looked up in its table (``tone_tables``)."""
    c = x.shape[2]
    pixels = x.numpy()
    params = np.asarray(params, dtype=np.float64).reshape(1, 2)
    hist = histograms(pixels)[None] if needs_histograms(params) else None
    table = tone_tables(params, hist, c)[0]  # (C, 256)
    out = np.empty_like(pixels)
    for k in range(c):  # a lookup per plane: 3x faster here than one gather over interleaved pixels
        np.take(table[k], pixels[..., k], out=out[..., k])
    return torch.from_numpy(out)


def sharpen(x: torch.Tensor, factor: float) -> torch.Tensor:
    """HWC uint8 ``x`` blended with its smoothed self by ``factor`` (``Sharpness``)."""
    pixels = x.numpy()
    return torch.from_numpy(blend(pixels, smoothed(pixels), factor))


def apply_tables(x: torch.Tensor, op: PostOp, tables: tuple[np.ndarray, ...], row: int = 0) -> torch.Tensor:
    """One primitive post op (a step of ``PostOp.steps``) on HWC uint8 ``x`` with row ``row`` of its ``tables``."""
    if isinstance(op, ColorMatrix):
        return color_twist(x, tables[0][row])
    if isinstance(op, _Warp):
        return warp(x, index_affine(tables[0][row])[0], tables[1])
    if isinstance(op, GaussianBlur):
        return blur(x, tables[0][row], tables[1][row])
    if isinstance(op, ToneCurve):
        return tone(x.contiguous(), tables[0][row])
    if isinstance(op, Sharpness):
        return sharpen(x.contiguous(), float(tables[0][row]))
    raise TypeError(f"not a post op: {op!r}")


def run_steps(x: torch.Tensor, steps: Sequence[Step], row: int = 0) -> torch.Tensor:
    """A sample's passes in order (``PostOp.steps``, row ``row`` of their tables) on HWC uint8 ``x``;
    a pass whose row holds the identity (``changed``) is skipped, as the GPU path skips it.

    A ``MixPass`` (AugMix) runs each chain's passes from ``x`` (rows ``row W + c`` of its chains'
    tables) and mixes them with ``x`` in float32: w0 x, then + w_c chain_c, a multiply and an add
    each rounded (the GPU kernel's order), truncated to uint8 as torchvision's AugMix."""
    for op, tables in steps:
        if not isinstance(op, MixPass):
            if changed(op, tables)[row]:  # a row holding the identity is left as it is, as on the GPU
                x = apply_tables(x, op, tables, row)
            continue
        weights, chains = tables
        width = weights.shape[1] - 1
        mix = _planes(x).mul_(torch.tensor(float(weights[row, 0]), dtype=torch.float32))
        for c in range(width):
            chain = run_steps(x, chains, row * width + c)
            mix.add_(_planes(chain).mul_(torch.tensor(float(weights[row, 1 + c]), dtype=torch.float32)))
        # The weights sum to 1, so the mix lies in 0..255 but for float rounding: clamped.
        x = mix.clamp_(0.0, 255.0).to(torch.uint8).permute(1, 2, 0)
    return x


def apply(x: torch.Tensor, ops: Sequence[PostOp], randoms: Sequence[np.ndarray | None]) -> torch.Tensor:
    """The post ops in order on one HWC uint8 image; ``randoms[k]`` is op k's (1, randoms) uniforms
    for this sample (or None). Returns a new tensor (``x`` itself when no pass changes it)."""
    h, w = np.array([x.shape[0]]), np.array([x.shape[1]])
    for op, u in zip(ops, randoms):
        x = run_steps(x, op.steps(u, h, w, x.shape[2]))
    return x
