"""The passes that the augmentation policies (``_auto_augment.py``, ``_timm_augment.py``) are made
of: a round in which every sample applies one op of its own becomes at most four batch-wide
passes, one per kind (warp, tone curve, colour matrix, sharpness), each holding the identity for
the samples that drew another kind. A pass no sample needs is left out.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ._post_spec import ColorMatrix, GaussianBlur, PostOp, Step, _Warp, rotation_affine
from ._tone import (
    AUTOCONTRAST,
    BRIGHTNESS,
    CONTRAST,
    EQUALIZE,
    GRAY_WEIGHTS,
    IDENTITY,
    INVERT,
    POSTERIZE,
    SOLARIZE,
    SOLARIZE_ADD,
    Sharpness,
    ToneCurve,
)

__all__ = ["CODE", "GEOMETRIC", "MIX", "OPS", "MixPass", "MultiPass", "PassWarp", "changed", "codes", "round_passes"]

# The ops a policy's round is made of, by code (an index here): policies hand round_passes
# integer codes, so a batch's passes come from a few array operations, not a loop over samples
# (this runs in a GPU lane's thread, holding the GIL, for every batch).
OPS = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "ShiftX", "ShiftY", "Rotate", "Brightness",
       "Color", "Contrast", "Sharpness", "Posterize", "Solarize", "SolarizeAdd", "AutoContrast", "Equalize", "Invert",
       "Blur")
CODE = {name: code for code, name in enumerate(OPS)}
# "ShiftX"/"ShiftY" read the input m pixels further along (timm's translations, not whole pixels);
# "TranslateX"/"TranslateY" move the image by int(m) (torchvision's). "Blur" is PIL's Gaussian blur
# of radius m (timm's 3-Augment ops).
GEOMETRIC = np.isin(OPS, ("ShearX", "ShearY", "TranslateX", "TranslateY", "ShiftX", "ShiftY", "Rotate"))  # by code
# Each code's tone kind (IDENTITY, 0, for the codes that are not tone curves).
_TONE_KIND = np.zeros(len(OPS), dtype=np.int64)
for _name, _kind in (("Brightness", BRIGHTNESS), ("Contrast", CONTRAST), ("Posterize", POSTERIZE), ("Solarize", SOLARIZE),
                     ("SolarizeAdd", SOLARIZE_ADD), ("AutoContrast", AUTOCONTRAST), ("Equalize", EQUALIZE),
                     ("Invert", INVERT)):
    _TONE_KIND[CODE[_name]] = _kind


def codes(names) -> np.ndarray:
    """Integer codes of op names (a list, or an array of them)."""
    return np.array([CODE[name] for name in names], dtype=np.int64)


class MultiPass(PostOp):
    """A post op made of several passes a batch (``steps``), not one table: the policies. They
    may warp, so boxes and masks cannot follow them."""

    moves_pixels: ClassVar[bool] = True

    def tables(self, u, h, w, channels):
        raise TypeError(f"{type(self).__name__} is made of several passes: use steps()")


@dataclass(frozen=True)
class PassWarp(_Warp):
    fill: tuple[float, ...] = (0.0,)


@dataclass(frozen=True)
class MixPass(PostOp):
    """The pass of a policy that mixes images of one sample (``AugMix``): tables ``(weights,
    chains)``, where ``weights`` is (n, W + 1) float64 (the original's weight, then each chain's)
    and ``chains`` the passes of the W chains as rows of their own: row ``i W + c`` is sample i's
    chain c, run from sample i's image as the pass finds it. The result is ``weights[i, 0] x
    original + sum_c weights[i, 1 + c] x chain c`` in float32 (each multiply and add rounded, in
    that order), truncated to uint8 as torchvision's ``.to(torch.uint8)``. Every sample takes part."""

    def tables(self, u, h, w, channels):
        raise TypeError("MixPass is a pass of a policy's steps(), not an op of a pipeline")


MIX = MixPass()


class _PassTone(ToneCurve):
    pass


class _PassColor(ColorMatrix):
    pass


class _PassSharpness(Sharpness):
    pass


class _PassBlur(GaussianBlur):
    pass


_TONE = _PassTone()
_COLOR = _PassColor()
_SHARPNESS = _PassSharpness()


def _filled(shape: tuple[int, ...], each: tuple[float, ...]) -> np.ndarray:
    """An array of ``shape`` whose every row is ``each`` (its entries, row-major), filled a column at
    a time: ``np.zeros`` of 1 KiB or more lets the GIL go around its ``calloc``, and whole-array
    loops over 500 elements do (``ops/_gil.py``), which a lane planning its post ops then waits to
    take back."""
    out = np.empty(shape)
    flat = out.reshape(shape[0], len(each))
    for j, value in enumerate(each):
        flat[:, j] = value
    return out


def round_passes(op: np.ndarray, magnitude: np.ndarray, h: np.ndarray, w: np.ndarray, channels: int,
                 warp: PassWarp) -> list[Step]:
    """The passes of one round in which sample i applies op ``op[i]`` (a code of ``OPS``) with
    ``magnitude[i]`` (signed), as torchvision's ``_apply_op`` does; passes no sample needs are
    left out."""
    op = np.asarray(op, dtype=np.int64)
    n = len(op)
    steps: list[Step] = []

    def where(name: str) -> np.ndarray:
        return op == CODE[name]

    geometric = GEOMETRIC[op]
    if geometric.any():
        steps.append((warp, (_affines(op, magnitude, h, w), warp.fill_values(channels))))

    kind = _TONE_KIND[op]
    if kind.any():
        value = np.where((kind == BRIGHTNESS) | (kind == CONTRAST), 1.0 + magnitude, magnitude)
        value = np.where(kind == POSTERIZE, np.trunc(magnitude), value)
        tone = np.empty((n, 2))  # a column at a time: np.stack's one loop passes 500 elements (ops/_gil.py)
        tone[:, 0], tone[:, 1] = kind, np.where(kind > 0, value, 0.0)
        steps.append((_TONE, (tone,)))

    color = where("Color")
    if color.any() and channels == 3:
        # torchvision's adjust_saturation: blend with the gray image, f x + (1 - f) gray(x).
        f = 1.0 + magnitude[color]
        matrices = _filled((n, 3, 4), _identity(3, 4))
        gray = np.asarray(GRAY_WEIGHTS, dtype=np.float64)
        matrices[color, :, :3] = f[:, None, None] * np.eye(3) + (1.0 - f)[:, None, None] * gray
        steps.append((_COLOR, (matrices,)))

    sharp = where("Sharpness")
    if sharp.any():
        steps.append((_SHARPNESS, (np.where(sharp, 1.0 + magnitude, 1.0),)))

    blur = where("Blur") & (magnitude > _RADIUS_NONE)
    if blur.any():
        steps.append(_blur_pass(np.where(blur, magnitude, 0.0), blur))
    return steps


def _affines(op: np.ndarray, magnitude: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(n, 2, 3) the warp pass's matrices of a round: each sample's shear, translation or rotation,
    the identity for the others. Each entry is a column picked by ``np.where`` (an op is one code a
    sample, so the picks never overlap), cheaper than a masked store per op into the 3-d array."""
    n = len(op)
    shear_x, shear_y = op == CODE["ShearX"], op == CODE["ShearY"]
    whole = -np.trunc(magnitude)  # torchvision's translations: whole pixels (int()), to +x for m > 0
    affine = np.empty((n, 2, 3))
    affine[:, 0, 0] = affine[:, 1, 1] = 1.0
    affine[:, 0, 1] = np.where(shear_x, magnitude, 0.0)  # input x = x + m y: torchvision's shear about the corner
    affine[:, 1, 0] = np.where(shear_y, magnitude, 0.0)
    for axis, translate, shift in ((0, "TranslateX", "ShiftX"), (1, "TranslateY", "ShiftY")):
        affine[:, axis, 2] = np.where(op == CODE[translate], whole, np.where(op == CODE[shift], magnitude, 0.0))
    if (rows := op == CODE["Rotate"]).any():
        affine[rows] = rotation_affine(magnitude[rows], h[rows], w[rows])
    return affine


_RADIUS_NONE = 1e-3  # a blur of smaller radius leaves every pixel as it is: the identity


def _box_radius(radius: np.ndarray) -> np.ndarray:
    """The fractional box radius of each of PIL's three box blurs that make its ``GaussianBlur(radius)``
    (libImaging/BoxBlur.c ``_gaussian_blur_radius``: the boxes' variances sum to radius squared)."""
    sigma2 = radius * radius / 3.0
    whole = np.floor((np.sqrt(12.0 * sigma2 + 1.0) - 1.0) / 2.0)
    fraction = (2 * whole + 1) * (whole * (whole + 1) - 3 * sigma2) / (6 * (sigma2 - (whole + 1) ** 2))
    return whole + fraction


def _blur_pass(radius: np.ndarray, blur: np.ndarray) -> Step:
    """PIL's Gaussian blur of ``radius[i]`` (its ``ImageFilter.GaussianBlur``, timm's) for the samples
    ``blur``, the identity kernel for the others: three box blurs of radius R (the whole taps 1, the
    two next R - floor(R), over 2R + 1), as one kernel of their convolution, each way. PIL rounds to
    uint8 after each box and repeats the edge pixel at the borders, where the pass reflects them;
    within 3 levels inside (tests/ops/test_timm_parity.py). A column at a time: loops of n elements keep the GIL
    (``ops/_gil.py``)."""
    box = np.where(blur, _box_radius(np.where(blur, radius, 1.0)), 0.0)
    reach = int(np.floor(box.max())) + 1  # taps either side of one box
    whole = np.floor(box)
    taps = []  # one box's weights, a column a tap, offsets -reach..reach
    for offset in range(-reach, reach + 1):
        t = abs(offset)
        taps.append(np.where(t <= whole, 1.0, np.where(t == whole + 1, box - whole, 0.0)) / (2 * box + 1))
    kernel = taps
    for _ in range(2):  # convolved with the box twice more
        out = [np.full(len(radius), 0.0) for _ in range(len(kernel) + len(taps) - 1)]
        for i, a in enumerate(kernel):
            for j, b in enumerate(taps):
                out[i + j] = out[i + j] + a * b
        kernel = out
    size = len(kernel)
    weights = np.empty((len(radius), size))
    for j, column in enumerate(kernel):
        weights[:, j] = np.where(blur, column, float(j == size // 2))
    # The pass's tables carry the weights; its own sigma is never drawn.
    return _PassBlur(size, sigma=1.0), (weights, weights.copy())


def changed(op: PostOp, tables: tuple[np.ndarray, ...]) -> np.ndarray:
    """(n,) bool: the samples a pass changes. The others hold the identity (a sample ``p`` left
    alone, or one that drew another kind of pass in a policy's round, or whose AugMix chain has
    ended): the GPU path leaves them out of its launches, and the CPU path skips the pass for them."""
    if isinstance(op, ColorMatrix):
        m = np.asarray(tables[0])
        return _differs(m, _identity(m.shape[1], m.shape[2]))
    if isinstance(op, _Warp):
        return _differs(np.asarray(tables[0]), _identity(2, 3))
    if isinstance(op, GaussianBlur):
        wx, wy = np.asarray(tables[0]), np.asarray(tables[1])
        return _differs(wx, _delta(wx.shape[1])) | _differs(wy, _delta(wy.shape[1]))
    if isinstance(op, ToneCurve):
        return np.asarray(tables[0])[:, 0] != IDENTITY
    if isinstance(op, Sharpness):
        return np.asarray(tables[0]).reshape(-1) != 1.0
    raise TypeError(f"not a post op: {op!r}")


@functools.cache
def _identity(rows: int, cols: int) -> tuple[float, ...]:
    """``np.eye(rows, cols)``'s entries, row-major: made once, not for every pass of every batch."""
    return tuple(np.eye(rows, cols).reshape(-1).tolist())


@functools.cache
def _delta(k: int) -> tuple[float, ...]:
    """The identity blur kernel of ``k`` taps."""
    return tuple(float(j == k // 2) for j in range(k))


def _differs(a: np.ndarray, ref: tuple[float, ...]) -> np.ndarray:
    """(n,) bool: row i of ``a`` (n, ...) differs from ``ref`` (``a``'s trailing entries, row-major)
    somewhere. A column at a time: each loop runs over n elements, and NumPy keeps the GIL for
    loops of up to 500 (``ops/_gil.py``; a lane that lets it go waits to take it back)."""
    flat = a.reshape(len(a), -1)
    out = flat[:, 0] != ref[0]
    for j in range(1, flat.shape[1]):
        out |= flat[:, j] != ref[j]
    return out
