"""Tone curves and sharpness: torchvision's ``RandomPosterize``, ``RandomSolarize``,
``RandomInvert``, ``RandomAutocontrast``, ``RandomEqualize`` and ``RandomAdjustSharpness`` as post
ops, and the primitives ``RandAugment`` builds on (``_auto_augment.py``).

A tone curve maps each channel's level through a 256-entry table, one table per sample and channel.
Some curves are fixed by the sample's parameters (posterize, solarize, invert, brightness); others
are read off the image itself, from each channel's histogram (autocontrast from the darkest and
brightest level, equalize from the counts, contrast from the mean gray level). ``tone_tables`` builds
every kind from the parameters and the image's histograms in integer or float32 arithmetic that the
GPU kernel repeats operation for operation, so both paths give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from headrace._errors import ConfigError, is_int

from ._post_spec import PostOp, _finite, _probability

__all__ = [
    "RandomAdjustSharpness",
    "RandomAutocontrast",
    "RandomEqualize",
    "RandomInvert",
    "RandomPosterize",
    "RandomSolarize",
    "Sharpness",
    "ToneCurve",
    "tone_tables",
]

# Kinds of tone curve (column 0 of a ToneCurve's parameters; the GPU kernel's switch uses the same numbers).
IDENTITY, POSTERIZE, SOLARIZE, INVERT, BRIGHTNESS, CONTRAST, AUTOCONTRAST, EQUALIZE, SOLARIZE_ADD = range(9)
# The kinds read off the image: they need its histograms (the kernel's test: 5 <= kind <= 7).
READS_IMAGE = (CONTRAST, AUTOCONTRAST, EQUALIZE)
_READS_IMAGE = np.isin(np.arange(SOLARIZE_ADD + 1), READS_IMAGE)  # by kind: a lookup, cheaper than np.isin
# torchvision's rgb_to_grayscale weights.
GRAY_WEIGHTS = (0.2989, 0.587, 0.114)


def needs_histograms(params: np.ndarray) -> bool:
    """Whether any sample's curve is read off its image (its histograms must be counted first)."""
    return bool(_READS_IMAGE[np.asarray(params)[:, 0].astype(np.int64)].any())


def _round_u8(v: np.ndarray) -> np.ndarray:
    return np.clip(np.floor(v + np.float32(0.5)), 0, 255).astype(np.uint8)


def tone_tables(params: np.ndarray, histograms: np.ndarray | None, channels: int) -> np.ndarray:
    """(n, channels, 256) uint8 tables of the curves ``params`` (n, 2: kind, value).

    ``histograms`` is (n, channels, 256) int64, each channel's level counts. Only the kinds read off
    the image use it; it may be None when none is asked for. Rules (v a level, lo/hi a channel's
    darkest and brightest level, N the pixel count):

    - posterize b bits: ``v & (255 << (8 - b))``; solarize t: ``255 - v`` where ``v >= t``; invert: ``255 - v``;
      solarize-add a (timm's): ``min(255, v + a)`` where ``v < 128``;
    - brightness f: ``round(f v)``; contrast f: ``round(f v + (1 - f) m)`` (float32), m the mean
      gray level ``(0.2989 R + 0.587 G + 0.114 B) / N`` from the channel sums, in float64 then
      float32 (torchvision blends with the mean of its gray image, whose levels it truncates
      first: within a level);
    - autocontrast: ``round(255 (v - lo) / (hi - lo))`` (unchanged where hi = lo);
    - equalize (torchvision's): step = (N - count of hi) // 255; unchanged where step is 0, else
      0 for v = 0 and ``(cdf(v - 1) + step // 2) // step`` (at most 255) above.

    Rounding is half up, clamped to 0..255.
    """
    params = np.asarray(params, dtype=np.float64).reshape(-1, 2)
    n = len(params)
    kind = params[:, 0].astype(np.int64)
    value = params[:, 1]
    v = np.arange(256, dtype=np.int64)
    out = np.broadcast_to(v.astype(np.uint8), (n, channels, 256)).copy()

    def rows(k: int) -> np.ndarray:
        return np.flatnonzero(kind == k)

    if len(i := rows(POSTERIZE)):
        masks = (255 << (8 - value[i].astype(np.int64))) & 255
        out[i] = (v[None, :] & masks[:, None]).astype(np.uint8)[:, None, :]
    if len(i := rows(SOLARIZE)):
        flip = v[None, :].astype(np.float32) >= value[i, None].astype(np.float32)
        out[i] = np.where(flip, 255 - v, v).astype(np.uint8)[:, None, :]
    if len(i := rows(INVERT)):
        out[i] = (255 - v).astype(np.uint8)
    if len(i := rows(BRIGHTNESS)):
        f = value[i, None].astype(np.float32)
        out[i] = _round_u8(f * v.astype(np.float32))[:, None, :]
    if len(i := rows(SOLARIZE_ADD)):
        add = value[i, None].astype(np.int64)
        out[i] = np.where(v < 128, np.minimum(v + add, 255), v).astype(np.uint8)[:, None, :]
    if not _READS_IMAGE[kind].any():
        return out
    if histograms is None:
        raise ValueError("tone_tables: these curves are read off the image; its histograms are needed")
    hist = np.asarray(histograms, dtype=np.int64).reshape(n, channels, 256)
    if len(i := rows(CONTRAST)):
        f = value[i].astype(np.float32)
        level = f[:, None] * v.astype(np.float32)[None, :] + (np.float32(1) - f)[:, None] * mean_gray(hist[i])[:, None]
        out[i] = _round_u8(level.astype(np.float32))[:, None, :]
    if len(i := rows(AUTOCONTRAST)):
        h = hist[i, :channels]  # (k, C, 256)
        seen = h > 0
        lo = np.where(seen.any(-1), seen.argmax(-1), 0)
        hi = np.where(seen.any(-1), 255 - seen[..., ::-1].argmax(-1), 0)
        span = np.maximum(hi - lo, 1)[..., None]
        scaled = np.clip((2 * 255 * (v - lo[..., None]) + span) // (2 * span), 0, 255)
        out[i] = np.where((hi > lo)[..., None], scaled, v).astype(np.uint8)
    if len(i := rows(EQUALIZE)):
        h = hist[i, :channels]
        seen = h > 0
        top = np.where(seen.any(-1), 255 - seen[..., ::-1].argmax(-1), 0)
        step = (h.sum(-1) - np.take_along_axis(h, top[..., None], -1)[..., 0]) // 255
        cdf = np.cumsum(h, axis=-1)
        safe = np.maximum(step, 1)[..., None]
        levels = np.zeros_like(cdf)
        levels[..., 1:] = np.minimum((cdf[..., :-1] + safe // 2) // safe, 255)
        out[i] = np.where((step > 0)[..., None], levels, v).astype(np.uint8)
    return out


def mean_gray(hist: np.ndarray) -> np.ndarray:
    """(n,) float32 mean gray levels of (n, C, 256) histograms: the channel sums weighted by
    ``GRAY_WEIGHTS`` (one channel: its sum) over the pixel count, in float64, in the GPU kernel's order."""
    hist = np.asarray(hist, dtype=np.int64)
    sums = (hist @ np.arange(256, dtype=np.int64)).astype(np.float64)  # (n, C)
    count = np.maximum(hist[:, 0].sum(axis=1), 1).astype(np.float64)
    if hist.shape[1] == 1:
        total = sums[:, 0]
    else:
        total = (GRAY_WEIGHTS[0] * sums[:, 0] + GRAY_WEIGHTS[1] * sums[:, 1]) + GRAY_WEIGHTS[2] * sums[:, 2]
    return (total / count).astype(np.float32)


class ToneCurve(PostOp):
    """A post op that maps each channel's levels through a curve per sample: ``tables`` is
    ``(params,)``, (n, 2) float64 ``(kind, value)`` rows that ``tone_tables`` turns into the tables
    (with the image's histograms for the kinds read off the image)."""


class Sharpness(PostOp):
    """A post op that blends each image with its smoothed self: ``tables`` is ``(factors,)``, (n,)
    float64. torchvision's ``adjust_sharpness``: the smoothed image is the 3 x 3 filter
    ``[[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13``, rounded, on the pixels off the border (the border
    keeps its own); the output is ``round(f v + (1 - f) s)`` in float32 (factor f, pixel v,
    smoothed s): f = 1 leaves the image alone, f = 0 blurs it, f = 2 sharpens it."""


def _kind_rows(kind: int, value: float, applied: np.ndarray) -> np.ndarray:
    out = np.zeros((len(applied), 2))
    out[applied] = (kind, value)
    return out


def _drawn(p: float, u: np.ndarray) -> np.ndarray:
    return np.asarray(u, dtype=np.float64).reshape(-1) < p


@dataclass(frozen=True)
class RandomPosterize(ToneCurve):
    """Keep the top ``bits`` bits (0 to 8) of each level, with probability ``p`` (one uniform per
    sample): torchvision's ``RandomPosterize``."""

    bits: int
    p: float = 0.5
    randoms: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        if not is_int(self.bits) or not 0 <= int(self.bits) <= 8:
            raise ConfigError(f"RandomPosterize: bits must be an int in [0, 8], got {self.bits!r}")
        object.__setattr__(self, "bits", int(self.bits))
        object.__setattr__(self, "p", _probability(self.p, "RandomPosterize: p"))

    def tables(self, u, h, w, channels):
        return (_kind_rows(POSTERIZE, self.bits, _drawn(self.p, u)),)


@dataclass(frozen=True)
class RandomSolarize(ToneCurve):
    """Invert every level at or above ``threshold`` (0 to 255), with probability ``p`` (one uniform
    per sample): torchvision's ``RandomSolarize`` on uint8 images."""

    threshold: float
    p: float = 0.5
    randoms: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        t = _finite(self.threshold, "RandomSolarize: threshold")
        if not 0.0 <= t <= 255.0:
            raise ConfigError(f"RandomSolarize: threshold must be in [0, 255], got {self.threshold!r}")
        object.__setattr__(self, "threshold", t)
        object.__setattr__(self, "p", _probability(self.p, "RandomSolarize: p"))

    def tables(self, u, h, w, channels):
        return (_kind_rows(SOLARIZE, self.threshold, _drawn(self.p, u)),)


@dataclass(frozen=True)
class _DrawnCurve(ToneCurve):
    """A tone curve of one ``kind`` without parameters, applied with probability ``p`` (one
    uniform per sample)."""

    p: float = 0.5
    randoms: int = field(default=1, init=False)
    kind: ClassVar[int] = IDENTITY

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", _probability(self.p, f"{type(self).__name__}: p"))

    def tables(self, u, h, w, channels):
        return (_kind_rows(self.kind, 0.0, _drawn(self.p, u)),)


class RandomInvert(_DrawnCurve):
    """Invert every level (``255 - v``) with probability ``p``: torchvision's ``RandomInvert``."""

    kind = INVERT


class RandomAutocontrast(_DrawnCurve):
    """Stretch each channel so its darkest level becomes 0 and its brightest 255, with probability
    ``p``: torchvision's ``RandomAutocontrast`` (which truncates where this rounds: within 1 level)."""

    kind = AUTOCONTRAST


class RandomEqualize(_DrawnCurve):
    """Equalize each channel's histogram with probability ``p``: torchvision's ``RandomEqualize``
    (its exact table: the same bytes)."""

    kind = EQUALIZE


@dataclass(frozen=True)
class RandomAdjustSharpness(Sharpness):
    """Sharpen (``sharpness_factor`` above 1) or soften (below 1) with probability ``p``:
    torchvision's ``RandomAdjustSharpness``; the blend rounds where torchvision truncates (within
    1 level). See ``Sharpness`` for the filter."""

    sharpness_factor: float
    p: float = 0.5
    randoms: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        f = _finite(self.sharpness_factor, "RandomAdjustSharpness: sharpness_factor")
        if f < 0.0:
            raise ConfigError(f"RandomAdjustSharpness: sharpness_factor must be non-negative, got {self.sharpness_factor!r}")
        object.__setattr__(self, "sharpness_factor", f)
        object.__setattr__(self, "p", _probability(self.p, "RandomAdjustSharpness: p"))

    def tables(self, u, h, w, channels):
        return (np.where(_drawn(self.p, u), self.sharpness_factor, 1.0),)


def smoothed(x: np.ndarray) -> np.ndarray:
    """torchvision's smoothed image for ``adjust_sharpness`` of HWC uint8 ``x``: off the border,
    ``round((8 neighbours + 5 centre) / 13)`` (in integers: exact; a quotient never ends in .5);
    on the border, the pixel itself."""
    out = x.copy()
    h, w = x.shape[:2]
    if h < 3 or w < 3:
        return out
    s = x.astype(np.int32)
    total = sum(s[1 + dy : h - 1 + dy, 1 + dx : w - 1 + dx] for dy in (-1, 0, 1) for dx in (-1, 0, 1))
    total = total + 4 * s[1:-1, 1:-1]
    out[1:-1, 1:-1] = ((2 * total + 13) // 26).astype(np.uint8)
    return out


def blend(x: np.ndarray, other: np.ndarray, factor: float) -> np.ndarray:
    """``round(f x + (1 - f) other)`` in float32, each operation rounded (the GPU kernel's order)."""
    f = np.float32(factor)
    return _round_u8(f * x.astype(np.float32) + (np.float32(1) - f) * other.astype(np.float32))

