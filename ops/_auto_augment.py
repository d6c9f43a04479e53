"""Automatic augmentation policies: torchvision's ``RandAugment`` and ``TrivialAugmentWide`` as
post ops that each sample of a batch draws on its own.

Each sample picks an op and a magnitude per round; a batch is then a mix of shears, rotations,
tone curves and colour changes. Rather than split the batch by op, each round becomes at most four
batch-wide passes, one per kind of pass (warp, tone curve, colour matrix, sharpness): a sample that
drew a warp gets its matrix in the warp pass and the identity in the others, and a pass no sample
needs is left out (``PostOp.steps``). A sample draws exactly one op a round, so the order of the
passes within a round does not change its result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from headrace._errors import ConfigError, is_int

from ._post_spec import ColorMatrix, PostOp, Step, _fill, _Warp, rotation_affine
from ._tone import (
    AUTOCONTRAST,
    BRIGHTNESS,
    CONTRAST,
    EQUALIZE,
    GRAY_WEIGHTS,
    POSTERIZE,
    SOLARIZE,
    Sharpness,
    ToneCurve,
)

__all__ = ["RandAugment", "TrivialAugmentWide"]

# Magnitudes of one op: (bins, heights, widths) -> (n, bins) float64, or None for an op without one.
Magnitudes = Callable[[int, np.ndarray, np.ndarray], np.ndarray | None]


def _linspace(lo: float, hi: float) -> Magnitudes:
    return lambda bins, h, w: np.broadcast_to(np.linspace(lo, hi, bins), (len(h), bins))


def _posterize(levels: int) -> Magnitudes:
    # torchvision: 8 - (arange(bins) / ((bins - 1) / levels)).round(), rounding half to even as torch does.
    return lambda bins, h, w: np.broadcast_to(8 - np.round(np.arange(bins) / ((bins - 1) / levels)), (len(h), bins))


def _translate(side: int) -> Magnitudes:
    # 150/331 of the image's width (side 1) or height (side 0), per sample.
    def magnitudes(bins, h, w):
        return (np.asarray((h, w)[side], dtype=np.float64).reshape(-1, 1) * (150.0 / 331.0)) * np.linspace(0, 1, bins)

    return magnitudes


def _none(bins, h, w):
    return None


# name: (magnitudes, signed), in torchvision's order (a sample's op index counts in it).
_RAND_AUGMENT: dict[str, tuple[Magnitudes, bool]] = {
    "Identity": (_none, False),
    "ShearX": (_linspace(0.0, 0.3), True),
    "ShearY": (_linspace(0.0, 0.3), True),
    "TranslateX": (_translate(1), True),
    "TranslateY": (_translate(0), True),
    "Rotate": (_linspace(0.0, 30.0), True),
    "Brightness": (_linspace(0.0, 0.9), True),
    "Color": (_linspace(0.0, 0.9), True),
    "Contrast": (_linspace(0.0, 0.9), True),
    "Sharpness": (_linspace(0.0, 0.9), True),
    "Posterize": (_posterize(4), False),
    "Solarize": (_linspace(255.0, 0.0), False),
    "AutoContrast": (_none, False),
    "Equalize": (_none, False),
}
_TRIVIAL_AUGMENT_WIDE: dict[str, tuple[Magnitudes, bool]] = {
    "Identity": (_none, False),
    "ShearX": (_linspace(0.0, 0.99), True),
    "ShearY": (_linspace(0.0, 0.99), True),
    "TranslateX": (_linspace(0.0, 32.0), True),
    "TranslateY": (_linspace(0.0, 32.0), True),
    "Rotate": (_linspace(0.0, 135.0), True),
    "Brightness": (_linspace(0.0, 0.99), True),
    "Color": (_linspace(0.0, 0.99), True),
    "Contrast": (_linspace(0.0, 0.99), True),
    "Sharpness": (_linspace(0.0, 0.99), True),
    "Posterize": (_posterize(6), False),
    "Solarize": (_linspace(255.0, 0.0), False),
    "AutoContrast": (_none, False),
    "Equalize": (_none, False),
}


@dataclass(frozen=True)
class _PassWarp(_Warp):
    fill: tuple[float, ...] = (0.0,)


class _PassTone(ToneCurve):
    pass


class _PassColor(ColorMatrix):
    pass


class _PassSharpness(Sharpness):
    pass


_TONE = _PassTone()
_COLOR = _PassColor()
_SHARPNESS = _PassSharpness()


def _round_passes(names: list[str], magnitude: np.ndarray, h: np.ndarray, w: np.ndarray, channels: int,
                  warp: _PassWarp) -> list[Step]:
    """The passes of one round in which sample i applies op ``names[i]`` with ``magnitude[i]``
    (signed), as torchvision's ``_apply_op`` does; passes no sample needs are left out."""
    n = len(names)
    name = np.asarray(names)
    steps: list[Step] = []

    affine = np.zeros((n, 2, 3))
    affine[:, 0, 0] = affine[:, 1, 1] = 1.0
    for i in np.flatnonzero(name == "ShearX"):  # input x = x + m y: torchvision's shear about the corner
        affine[i, 0, 1] = magnitude[i]
    for i in np.flatnonzero(name == "ShearY"):
        affine[i, 1, 0] = magnitude[i]
    for i in np.flatnonzero(name == "TranslateX"):  # whole pixels (torchvision's int()), towards +x for m > 0
        affine[i, 0, 2] = -math.trunc(magnitude[i])
    for i in np.flatnonzero(name == "TranslateY"):
        affine[i, 1, 2] = -math.trunc(magnitude[i])
    if len(i := np.flatnonzero(name == "Rotate")):
        affine[i] = rotation_affine(magnitude[i], h[i], w[i])
    geometric = np.isin(name, ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate"))
    if geometric.any():
        steps.append((warp, (affine, warp.fill_values(channels))))

    tone = np.zeros((n, 2))
    for op, kind in (("Brightness", BRIGHTNESS), ("Contrast", CONTRAST)):
        i = np.flatnonzero(name == op)
        tone[i, 0], tone[i, 1] = kind, 1.0 + magnitude[i]
    i = np.flatnonzero(name == "Posterize")
    tone[i, 0], tone[i, 1] = POSTERIZE, np.trunc(magnitude[i])
    i = np.flatnonzero(name == "Solarize")
    tone[i, 0], tone[i, 1] = SOLARIZE, magnitude[i]
    tone[name == "AutoContrast", 0] = AUTOCONTRAST
    tone[name == "Equalize", 0] = EQUALIZE
    if tone[:, 0].any():
        steps.append((_TONE, (tone,)))

    color = name == "Color"
    if color.any() and channels == 3:
        # torchvision's adjust_saturation: blend with the gray image, f x + (1 - f) gray(x).
        f = 1.0 + magnitude
        matrices = np.zeros((n, 3, 4))
        matrices[:, :, :3] = np.eye(3)
        gray = np.asarray(GRAY_WEIGHTS, dtype=np.float64)
        matrices[color, :, :3] = f[color, None, None] * np.eye(3) + (1.0 - f[color])[:, None, None] * gray
        steps.append((_COLOR, (matrices,)))

    sharp = name == "Sharpness"
    if sharp.any():
        steps.append((_SHARPNESS, (np.where(sharp, 1.0 + magnitude, 1.0),)))
    return steps


def _whole(value: object, what: str, low: int) -> int:
    if not is_int(value) or int(value) < low:  # type: ignore[call-overload]
        raise ConfigError(f"{what} must be an int of at least {low}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


class _Policy(PostOp):
    """An op drawn per sample from a space of ops, in rounds."""

    moves_pixels: ClassVar[bool] = True
    space: ClassVar[dict[str, tuple[Magnitudes, bool]]]
    fill: tuple[float, ...]

    def draws(self, u: np.ndarray, rounds: int) -> np.ndarray:
        return np.asarray(u, dtype=np.float64).reshape(-1, rounds, self.randoms // max(rounds, 1))

    def round_steps(self, u: np.ndarray, bins: int, magnitude_bin: np.ndarray, h, w, channels) -> list[Step]:
        """One round's passes from (n, 2) uniforms (op, sign) and each sample's magnitude bin."""
        names = list(self.space)
        n = len(u)
        index = np.minimum((u[:, 0] * len(names)).astype(np.int64), len(names) - 1)
        chosen = [names[k] for k in index]
        magnitude = np.zeros(n)
        for k in np.unique(index):
            table, signed = self.space[names[k]]
            rows = np.flatnonzero(index == k)
            values = table(bins, h[rows], w[rows])
            if values is None:
                continue
            magnitude[rows] = values[np.arange(len(rows)), magnitude_bin[rows]]
            if signed:
                magnitude[rows] *= np.where(u[rows, 1] < 0.5, 1.0, -1.0)
        return _round_passes(chosen, magnitude, h, w, channels, _PassWarp(self.fill))

    def tables(self, u, h, w, channels):
        raise TypeError(f"{type(self).__name__} is made of several passes: use steps()")


@dataclass(frozen=True)
class RandAugment(_Policy):
    """torchvision's ``RandAugment``: ``num_ops`` rounds, in each of which every sample applies one
    op drawn uniformly from 14 (Identity, ShearX, ShearY, TranslateX, TranslateY, Rotate,
    Brightness, Color, Contrast, Sharpness, Posterize, Solarize, AutoContrast, Equalize) at
    ``magnitude`` out of ``num_magnitude_bins``, with a random sign where the op has one.

    Each sample draws its own ops and signs (``randoms = 2 num_ops``). Differences from torchvision,
    each within a level or a fraction of a pixel: warps sample bilinearly (torchvision's default is
    nearest), results round where torchvision truncates, and the ops' own rules are those of
    ``Rotate``/``WarpAffine``, ``ToneCurve`` (``tone_tables``) and ``Sharpness``. ``fill`` is the
    level (or one per channel) where a warp reads outside the image. Boxes and masks cannot follow
    it (``Pipeline(boxes=...)`` refuses it). Raises ConfigError for arguments out of range.
    """

    num_ops: int = 2
    magnitude: int = 9
    num_magnitude_bins: int = 31
    fill: float | tuple[float, ...] = 0
    randoms: int = field(default=4, init=False)
    space: ClassVar[dict[str, tuple[Magnitudes, bool]]] = _RAND_AUGMENT

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_ops", _whole(self.num_ops, "RandAugment: num_ops", 0))
        bins = _whole(self.num_magnitude_bins, "RandAugment: num_magnitude_bins", 2)
        object.__setattr__(self, "num_magnitude_bins", bins)
        magnitude = _whole(self.magnitude, "RandAugment: magnitude", 0)
        if magnitude >= bins:
            raise ConfigError(f"RandAugment: magnitude must be below num_magnitude_bins ({bins}), got {magnitude}")
        object.__setattr__(self, "magnitude", magnitude)
        object.__setattr__(self, "fill", _fill(self.fill, "RandAugment: fill"))
        object.__setattr__(self, "randoms", 2 * self.num_ops)

    def steps(self, u, h, w, channels):
        if self.num_ops == 0:
            return []
        h, w = np.asarray(h).reshape(-1), np.asarray(w).reshape(-1)
        draws = self.draws(u, self.num_ops)
        magnitude_bin = np.full(len(h), self.magnitude)
        out: list[Step] = []
        for r in range(self.num_ops):
            out += self.round_steps(draws[:, r], self.num_magnitude_bins, magnitude_bin, h, w, channels)
        return out


@dataclass(frozen=True)
class TrivialAugmentWide(_Policy):
    """torchvision's ``TrivialAugmentWide``: every sample applies one op drawn uniformly from the
    same 14 as ``RandAugment``, at a magnitude bin drawn uniformly from ``num_magnitude_bins``, with
    the wide ranges (shear 0.99, translate 32 pixels, rotate 135 degrees, factors 0.99, posterize
    down to 2 bits). Three uniforms per sample (op, sign, bin); otherwise as ``RandAugment``.
    """

    num_magnitude_bins: int = 31
    fill: float | tuple[float, ...] = 0
    randoms: int = field(default=3, init=False)
    space: ClassVar[dict[str, tuple[Magnitudes, bool]]] = _TRIVIAL_AUGMENT_WIDE

    def __post_init__(self) -> None:
        bins = _whole(self.num_magnitude_bins, "TrivialAugmentWide: num_magnitude_bins", 2)
        object.__setattr__(self, "num_magnitude_bins", bins)
        object.__setattr__(self, "fill", _fill(self.fill, "TrivialAugmentWide: fill"))

    def steps(self, u, h, w, channels):
        h, w = np.asarray(h).reshape(-1), np.asarray(w).reshape(-1)
        u = np.asarray(u, dtype=np.float64).reshape(-1, 3)
        bins = self.num_magnitude_bins
        magnitude_bin = np.minimum((u[:, 2] * bins).astype(np.int64), bins - 1)
        return self.round_steps(u[:, :2], bins, magnitude_bin, h, w, channels)
