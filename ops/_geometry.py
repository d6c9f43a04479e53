"""Geometry of the image ops as one source box and one output size, without touching pixels.

The GPU path needs, per sample and before decoding, the window of the source image that the ops
read (to decode only that region) and the mapping from output pixels into it (for the fused
kernel). This folds Resize / CenterCrop / RandomResizedCrop into a box in source coordinates
(the CPU path runs the same ops one after another; tests check the fold against it) and Flip
into flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from headrace._errors import ConfigError

from ._gil import columns, zeros
from ._spec import CenterCrop, Flip, Op, RandomCrop, RandomIoUCrop, RandomResize, RandomResizedCrop, Resize

__all__ = ["PlanBatch", "check_foldable", "index_affine", "output_error", "output_pixels", "plan_batch", "roi_batch"]


def check_foldable(ops: tuple[Op, ...]) -> None:
    """Refuse what one fused resample cannot do exactly: a geometric op after a Flip, two resizes,
    or after a resize a crop larger than a crop before it (its padding: see below)."""
    seen_flip = False
    resizes = 0
    cropped: tuple[int, int] | None = None  # the last crop's size since the resize
    for op in ops:
        if isinstance(op, Flip):
            seen_flip = True
            continue
        if seen_flip:
            raise ConfigError(f"the GPU path applies Flip after all crops and resizes; move {op!r} before Flip")
        resizes += isinstance(op, (Resize, RandomResize, RandomResizedCrop))
        if resizes > 1:
            raise ConfigError(f"the GPU path fuses one resize per pipeline; {op!r} is a second one")
        if isinstance(op, (CenterCrop, RandomCrop)) and resizes:
            # The kernel's filter may read past a crop made after the resize (``clip`` is not
            # narrowed there), so it cannot also tell that crop's edge from padding: a larger crop
            # after it would show the pixels the first one cut away, where the CPU path pads.
            if cropped is not None and (op.size[0] > cropped[0] or op.size[1] > cropped[1]):
                raise ConfigError(f"the GPU path cannot pad {op!r} around the crop before it, after a resize; "
                                  "crop once, or crop before the resize")
            cropped = op.size
        elif isinstance(op, RandomResizedCrop):
            cropped = None  # its window is real pixels, and its output the new frame


def output_error(h: int, w: int, ops: tuple[Op, ...], max_pixels: int | None) -> str | None:
    """Why the ops on an h x w image would make an image over ``max_pixels``, or None.

    Every op's output counts, not only the last: the CPU path allocates each one (Resize(256) of
    a 32768 x 2 image is 256 x 4,194,304 before any crop), and the GPU path refuses the same
    samples so that both give one verdict. Only Resize depends on the image; the crops' outputs
    are their fixed sizes.
    """
    if max_pixels is None:
        return None
    for op in ops:
        if isinstance(op, Resize):
            h, w = op.target(h, w)
        elif isinstance(op, RandomResize):  # the largest it may draw: one verdict for every epoch
            h, w = op.largest(h, w)
        elif isinstance(op, (RandomResizedCrop, CenterCrop, RandomCrop)):
            h, w = op.size
        else:
            continue
        if h * w > max_pixels:
            return f"{op!r} would make a {w}x{h} image ({h * w} pixels), over max_pixels={max_pixels}"
    return None


def output_pixels(h: np.ndarray, w: np.ndarray, ops: tuple[Op, ...]) -> np.ndarray:
    """Vectorised over a batch: the largest image (in pixels) any of ``ops`` makes from each h x w
    image; 0 where no op makes one. Compare with ``Decode.max_pixels``; ``output_error`` says why."""
    h = np.asarray(h, dtype=np.int64)
    w = np.asarray(w, dtype=np.int64)
    largest = zeros(len(h), np.int64)
    for op in ops:
        if isinstance(op, Resize):
            h, w = _resize_targets(op, h, w)
        elif isinstance(op, RandomResize):
            h, w = _resize_targets(Resize(op.max_size - 1, max_size=op.max_side), h, w)
        elif isinstance(op, (RandomResizedCrop, CenterCrop, RandomCrop)):
            h, w = np.full(len(h), op.size[0]), np.full(len(h), op.size[1])
        else:
            continue
        largest = np.maximum(largest, h.astype(np.int64) * w.astype(np.int64))
    return largest


@dataclass(slots=True)
class PlanBatch:
    """The folded geometry of a batch, as arrays (row = sample).

    Output pixel (x, y) of sample i samples source point ``box[i, 0] + (x + 0.5) * sx`` (and
    likewise y), where ``sx = (box[i, 2] - box[i, 0]) / out_w[i]``. ``clip`` is the part of the
    source the filter may read: torchvision (and the CPU path) crop before they resize, so a resize
    after a crop must not see pixels outside that crop. It is also the extent of real pixels: output
    pixels whose source point falls outside it are zero padding.

    Arrays rather than one object per sample because per-image Python on the GPU path is paid under
    the GIL; at 25,000 images/s the whole budget is a few tens of microseconds an image.
    """

    box: np.ndarray  # (B, 4) float64: x0, y0, x1, y1
    clip: np.ndarray  # (B, 4) float64
    out_w: np.ndarray  # (B,) int64: equal for a pipeline with a fixed output size
    out_h: np.ndarray  # (B,) int64
    flip_h: np.ndarray  # (B,) bool
    flip_v: np.ndarray  # (B,) bool
    # (B, 4) float64: the source's real pixels in the output, narrowed by every crop (``clip`` is
    # not by a crop after a resize, whose filter reads past it). Boxes and masks clip to it.
    real: np.ndarray


def plan_batch(h: np.ndarray, w: np.ndarray, ops: tuple[Op, ...], randoms: list[np.ndarray | None]) -> PlanBatch:
    """Fold the ops for a batch of h x w (display-oriented) images.

    ``h``, ``w`` are int arrays; ``randoms[i]`` is op i's (B, k) uniforms, or None for an op
    without randomness.
    """
    h = np.asarray(h, dtype=np.int64)
    w = np.asarray(w, dtype=np.int64)
    n = len(h)
    x0, y0 = zeros(n), zeros(n)
    x1, y1 = w.astype(np.float64), h.astype(np.float64)
    clip = [x0.copy(), y0.copy(), x1.copy(), y1.copy()]
    real = [x0.copy(), y0.copy(), x1.copy(), y1.copy()]
    cw, ch = w.copy(), h.copy()
    resized = False
    flip_h = np.zeros(n, dtype=bool)
    flip_v = np.zeros(n, dtype=bool)
    for op, u in zip(ops, randoms):
        if isinstance(op, Resize):
            ch, cw = _resize_targets(op, ch, cw)
            resized = True
        elif isinstance(op, RandomResize):
            ch, cw = _random_resize_targets(op, ch, cw, u)
            resized = True
        elif isinstance(op, (RandomResizedCrop, CenterCrop, RandomCrop, RandomIoUCrop)):
            if isinstance(op, RandomResizedCrop):
                top, left, wh, ww = _rrc_windows(op, ch, cw, u)
            elif isinstance(op, RandomIoUCrop):  # the window chosen on the boxes (``_iou_crop``)
                top, left, wh, ww = (u[:, k].astype(np.int64) for k in range(4))
            elif isinstance(op, RandomCrop):
                top, left, wh, ww = _random_windows(op, ch, cw, u)
            else:
                top, left, wh, ww = _centre_windows(op, ch, cw)
            sx, sy = (x1 - x0) / cw, (y1 - y0) / ch
            x0, y0, x1, y1 = x0 + left * sx, y0 + top * sy, x0 + (left + ww) * sx, y0 + (top + wh) * sy
            ch, cw = wh, ww
            real = [np.maximum(x0, real[0]), np.maximum(y0, real[1]), np.minimum(x1, real[2]), np.minimum(y1, real[3])]
            if not resized:  # a crop before any resize is carried out: later filters stay inside it
                clip = [np.maximum(x0, clip[0]), np.maximum(y0, clip[1]), np.minimum(x1, clip[2]), np.minimum(y1, clip[3])]
            if isinstance(op, RandomResizedCrop):
                ch, cw = np.full(n, op.size[0]), np.full(n, op.size[1])
                resized = True
        elif isinstance(op, Flip):
            flips = u[:, 0] < op.p
            if op.vertical:
                flip_v ^= flips
            else:
                flip_h ^= flips
    out_h, out_w = np.broadcast_to(ch, (n,)).astype(np.int64), np.broadcast_to(cw, (n,)).astype(np.int64)
    return PlanBatch(columns([x0, y0, x1, y1], np.float64), columns(clip, np.float64), out_w, out_h, flip_h, flip_v,
                     columns(real, np.float64))


def roi_batch(p: PlanBatch, h: np.ndarray, w: np.ndarray, dtype: type = np.int64) -> np.ndarray:
    """The integer regions (y0, x0, y1, x1) of the sources that the resampling filter reads, as (B, 4) ``dtype``.

    Pillow's bilinear filter reaches ``max(scale, 1)`` pixels around each sample point, so each box
    grows by that margin (plus one for rounding), then is clipped to ``clip``. Decoding exactly this
    region and resampling it gives the pixels of the CPU path. A window wholly in the padding reads
    one pixel; the kernel zero-fills the rest.
    """
    x0, y0, x1, y1 = p.box.T
    mx = np.ceil(np.maximum((x1 - x0) / p.out_w, 1.0)) + 1
    my = np.ceil(np.maximum((y1 - y0) / p.out_h, 1.0)) + 1
    rx0 = np.maximum(np.floor(p.clip[:, 0]), np.floor(x0) - mx)
    ry0 = np.maximum(np.floor(p.clip[:, 1]), np.floor(y0) - my)
    rx1 = np.minimum(np.ceil(p.clip[:, 2]), np.ceil(x1) + mx)
    ry1 = np.minimum(np.ceil(p.clip[:, 3]), np.ceil(y1) + my)
    rx0, ry0 = np.maximum(rx0, 0), np.maximum(ry0, 0)
    rx1, ry1 = np.minimum(rx1, w), np.minimum(ry1, h)
    empty = (rx1 <= rx0) | (ry1 <= ry0)
    rx0, ry0 = np.where(empty, 0, rx0), np.where(empty, 0, ry0)
    rx1, ry1 = np.where(empty, np.minimum(w, 1), rx1), np.where(empty, np.minimum(h, 1), ry1)
    return columns([ry0, rx0, ry1, rx1], dtype)


def _resize_targets(op: Resize, h: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``Resize.target`` over arrays: the same truncations, in the same order."""
    if isinstance(op.size, tuple):
        return np.full(len(h), op.size[0]), np.full(len(h), op.size[1])
    if op.size is None:
        short, long_ = np.minimum(h, w), np.maximum(h, w)
        new_short = np.maximum((op.max_size * short / long_).astype(np.int64), 1)
        return _oriented(h, w, new_short, np.full(len(h), op.max_size))
    return _shorter_side(np.full(len(h), op.size), op.max_size, h, w)


def _random_resize_targets(op: RandomResize, h: np.ndarray, w: np.ndarray, u: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray]:
    """``RandomResize.target`` over arrays, each row its own shorter side."""
    shorter = np.minimum(op.min_size + (u[:, 0] * (op.max_size - op.min_size)).astype(np.int64), op.max_size - 1)
    return _shorter_side(shorter, op.max_side, h, w)


def _shorter_side(shorter: np.ndarray, cap: int | None, h: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(height, width) with the shorter side ``shorter`` and the longer truncated (torchvision), or,
    where that passes ``cap``, the longer side ``cap`` and the shorter scaled with it (at least 1)."""
    short, long_ = np.minimum(h, w), np.maximum(h, w)
    new_short, new_long = shorter, (shorter * long_ / short).astype(np.int64)
    if cap is not None:
        over = new_long > cap
        new_short = np.where(over, np.maximum((cap * new_short / np.maximum(new_long, 1)).astype(np.int64), 1), new_short)
        new_long = np.where(over, cap, new_long)
    return _oriented(h, w, new_short, new_long)


def _oriented(h: np.ndarray, w: np.ndarray, new_short: np.ndarray, new_long: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    portrait_or_square = h <= w
    return np.where(portrait_or_square, new_short, new_long), np.where(portrait_or_square, new_long, new_short)


def _random_offsets(size: np.ndarray, crop: int, u: np.ndarray) -> np.ndarray:
    """``_spec.random_offset`` over arrays."""
    inside = np.minimum((u * (size - crop + 1)).astype(np.int64), size - crop)
    padded = -np.minimum((u * (crop - size + 1)).astype(np.int64), crop - size)
    return np.where(crop <= size, inside, padded)


def _random_windows(op: RandomCrop, h: np.ndarray, w: np.ndarray, u: np.ndarray):
    ch, cw = op.size
    return _random_offsets(h, ch, u[:, 0]), _random_offsets(w, cw, u[:, 1]), np.full(len(h), ch), np.full(len(h), cw)


def _centre_offsets(size: np.ndarray, crop: int) -> np.ndarray:
    # torchvision: round half to even when cropping; pad (crop - size) // 2 first when padding
    return np.where(crop <= size, np.round((size - crop) / 2.0), -((crop - size) // 2)).astype(np.int64)


def _centre_windows(op: CenterCrop, h: np.ndarray, w: np.ndarray):
    ch, cw = op.size
    return _centre_offsets(h, ch), _centre_offsets(w, cw), np.full(len(h), ch), np.full(len(h), cw)


def _rrc_windows(op: RandomResizedCrop, h: np.ndarray, w: np.ndarray, u: np.ndarray):
    # torchvision's ten tries one at a time, each over the whole batch and kept where no earlier try
    # fitted: the same first fit as all ten at once, on arrays small enough to keep the GIL, and
    # without indexing by arrays, which NumPy does with the GIL let go whatever the size (``_gil``).
    area = (h * w).astype(np.float64)
    lo, hi = op.scale
    log_lo, log_hi = math.log(op.ratio[0]), math.log(op.ratio[1])
    found = zeros(len(h), bool)
    cw, ch = zeros(len(h), np.int64), zeros(len(h), np.int64)
    for attempt in range(10):
        target = area * (lo + (hi - lo) * u[:, 2 * attempt])
        aspect = np.exp(log_lo + (log_hi - log_lo) * u[:, 2 * attempt + 1])
        tw = np.round(np.sqrt(target * aspect)).astype(np.int64)
        th = np.round(np.sqrt(target / aspect)).astype(np.int64)
        fits = (tw > 0) & (tw <= w) & (th > 0) & (th <= h) & ~found
        cw, ch = np.where(fits, tw, cw), np.where(fits, th, ch)
        found |= fits
        if found.all():
            break
    top = np.minimum((u[:, 20] * (h - ch + 1)).astype(np.int64), h - ch)
    left = np.minimum((u[:, 21] * (w - cw + 1)).astype(np.int64), w - cw)
    # torchvision's fallback: a centre crop clamped to the ratio range
    in_ratio = w / h
    fw = np.where(in_ratio < op.ratio[0], w, np.where(in_ratio > op.ratio[1], np.round(h * op.ratio[1]), w)).astype(np.int64)
    fh = np.where(in_ratio < op.ratio[0], np.round(w / op.ratio[0]), h).astype(np.int64)
    fh = np.where(in_ratio > op.ratio[1], h, fh)
    return (
        np.where(found, top, (h - fh) // 2),
        np.where(found, left, (w - fw) // 2),
        np.where(found, ch, fh),
        np.where(found, cw, fw),
    )


def index_affine(affine: np.ndarray) -> np.ndarray:
    """(n, 2, 3) float32 matrices from output pixel indices (x, y) to input pixel-index coordinates.

    ``affine`` maps continuous coordinates (pixel centres at +0.5); the sample point of output
    pixel (x, y), in units where input pixel j's centre is at j, is ``affine @ (x + 0.5, y + 0.5, 1)
    - 0.5``: the half-pixel shifts are folded into the translation here, in float64, once.
    """
    a = np.array(affine, dtype=np.float64).reshape(-1, 2, 3)
    a[:, :, 2] += 0.5 * (a[:, :, 0] + a[:, :, 1]) - 0.5
    return a.astype(np.float32)
