"""The passes that the augmentation policies (``_auto_augment.py``, ``_timm_augment.py``) are made
of: a round in which every sample applies one op of its own becomes at most four batch-wide
passes, one per kind (warp, tone curve, colour matrix, sharpness), each holding the identity for
the samples that drew another kind. A pass no sample needs is left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._post_spec import ColorMatrix, PostOp, Step, _Warp, rotation_affine
from ._tone import (
    AUTOCONTRAST,
    BRIGHTNESS,
    CONTRAST,
    EQUALIZE,
    GRAY_WEIGHTS,
    INVERT,
    POSTERIZE,
    SOLARIZE,
    SOLARIZE_ADD,
    Sharpness,
    ToneCurve,
)

__all__ = ["GEOMETRIC", "MultiPass", "PassWarp", "round_passes"]

# The ops that move pixels (the warp pass); "ShiftX"/"ShiftY" read the input m pixels further
# along (timm's translations, not whole pixels), "TranslateX"/"TranslateY" move the image by
# int(m) (torchvision's).
GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "ShiftX", "ShiftY", "Rotate")


class MultiPass(PostOp):
    """A post op made of several passes a batch (``steps``), not one table: the policies. They
    may warp, so boxes and masks cannot follow them."""

    moves_pixels: ClassVar[bool] = True

    def tables(self, u, h, w, channels):
        raise TypeError(f"{type(self).__name__} is made of several passes: use steps()")


@dataclass(frozen=True)
class PassWarp(_Warp):
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


def round_passes(names: list[str], magnitude: np.ndarray, h: np.ndarray, w: np.ndarray, channels: int,
                 warp: PassWarp) -> list[Step]:
    """The passes of one round in which sample i applies op ``names[i]`` with ``magnitude[i]``
    (signed), as torchvision's ``_apply_op`` does (names outside ``GEOMETRIC`` and the tone,
    colour and sharpness ops below are the identity); passes no sample needs are left out."""
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
    for i in np.flatnonzero(name == "ShiftX"):
        affine[i, 0, 2] = magnitude[i]
    for i in np.flatnonzero(name == "ShiftY"):
        affine[i, 1, 2] = magnitude[i]
    if len(i := np.flatnonzero(name == "Rotate")):
        affine[i] = rotation_affine(magnitude[i], h[i], w[i])
    geometric = np.isin(name, GEOMETRIC)
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
    i = np.flatnonzero(name == "SolarizeAdd")
    tone[i, 0], tone[i, 1] = SOLARIZE_ADD, magnitude[i]
    tone[name == "AutoContrast", 0] = AUTOCONTRAST
    tone[name == "Invert", 0] = INVERT
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
