"""The post ops: colour, rotate / warp affine and blur, applied after the geometry ops and before
``Normalize`` on the fixed-size uint8 image (``Pipeline.post_ops``).

Like the other ops they are descriptions: each draws its per-sample parameters from its uniforms
(vectorised over a batch, ``params``) and turns them into the float64 tables (``tables``) that both
executors use, ``cpu/_post.py`` and ``cuda/_post.py``, so a sample gets the same parameters on
either path.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from headrace._errors import ConfigError, is_int

from ._spec import Op, _float2

__all__ = ["ColorMatrix", "ColorTwist", "GaussianBlur", "PostOp", "RandomGrayscale", "Rotate", "WarpAffine"]


class PostOp(Op):
    """An op on the uint8 HWC image after the geometry ops (and before Normalize); keeps its size.

    ``params(u)`` turns a batch's uniforms (shape ``(n, randoms)``) into its random parameters, and
    ``tables(u, h, w, channels)`` into the per-sample arrays both executors apply (float64; ``h``
    and ``w`` are the images' sizes, int arrays of length n): one computation, so the CPU path and
    the GPU kernels use the same numbers for a sample.
    """

    # Whether the op moves pixels to other places (a warp), which boxes (``Pipeline(boxes=)``) would have to follow.
    moves_pixels: ClassVar[bool] = False

    def tables(self, u: np.ndarray | None, h: np.ndarray, w: np.ndarray, channels: int) -> tuple[np.ndarray, ...]:
        raise NotImplementedError

    def steps(self, u: np.ndarray | None, h: np.ndarray, w: np.ndarray, channels: int) -> list[Step]:
        """The passes that make this op on a batch, in order: each a primitive op (a ``ColorMatrix``,
        warp, ``GaussianBlur``, ``ToneCurve`` or ``Sharpness``) and its tables. One pass, the op
        itself, for all but the ops made of others (``RandAugment``), which leave out the passes
        no sample of the batch needs."""
        return [(self, self.tables(u, h, w, channels))]


Step = tuple[PostOp, tuple[np.ndarray, ...]]


def _finite(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _jitter(value: object, what: str, *, centre: float, low: float, high: float, most: float = math.inf) -> tuple[float, float]:
    """torchvision ColorJitter's rule: a number f in [0, most] gives [centre - f, centre + f] cut to
    [low, high]; a pair (lo, hi) with low <= lo <= hi <= high gives the range itself."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        f = _finite(value, what)
        if not 0.0 <= f <= most:
            raise ConfigError(f"{what} must be in [0, {most}], got {value!r}")
        return max(low, centre - f), min(high, centre + f)
    lo, hi = _float2(value, what)
    if not (math.isfinite(lo) and math.isfinite(hi) and low <= lo <= hi <= high):
        raise ConfigError(f"{what} must be a pair lo <= hi within [{low}, {high}], got {value!r}")
    return lo, hi


def _draw(lo_hi: tuple[float, float], u: np.ndarray) -> np.ndarray:
    return lo_hi[0] + (lo_hi[1] - lo_hi[0]) * u


def _probability(value: object, what: str) -> float:
    p = _finite(value, what)
    if not 0.0 <= p <= 1.0:
        raise ConfigError(f"{what} must be in [0, 1], got {value!r}")
    return p


def _applied(op: PostOp, u: np.ndarray) -> np.ndarray | None:
    """Which rows an op with ``p`` < 1 applies to (its last uniform below ``p``: torchvision's
    ``RandomApply``), or None with ``p`` = 1 (then it draws no uniform for it)."""
    p = op.p  # type: ignore[attr-defined]
    if p >= 1.0:
        return None
    return np.asarray(u, dtype=np.float64).reshape(-1, op.randoms)[:, -1] < p


# RGB -> YIQ (NTSC, DALI's matrix) and its exact inverse (DALI rounds the inverse to 3 decimals).
_RGB2YIQ = np.array([[0.299, 0.587, 0.114], [0.596, -0.274, -0.321], [0.211, -0.523, 0.311]])
_YIQ2RGB = np.linalg.inv(_RGB2YIQ)
GREY = 128.0  # contrast pivots around this level (DALI's half range for uint8), not the image mean


class ColorMatrix(PostOp):
    """A post op that maps each pixel through an affine colour transform of its sample:
    ``tables`` is ``(matrices,)``, (n, 3, 4) ``[M | o]`` for RGB and (n, 1, 2) for gray (float64),
    applied as ``round(M x + o)`` by the same code on both paths (the GPU's colour kernel)."""


@dataclass(frozen=True)
class ColorTwist(ColorMatrix):
    """Random brightness, contrast, saturation and hue, as one linear colour transform per sample.

    Arguments follow torchvision's ``ColorJitter``: a number f draws a factor uniformly from
    ``[max(0, 1 - f), 1 + f]`` (brightness, contrast, saturation) or a hue shift from ``[-f, f]``
    turns (f in [0, 0.5]); a pair ``(lo, hi)`` gives the range itself (hue within [-0.5, 0.5]).
    Each sample draws its own four values (``randoms = 4``). The attributes hold the ranges.
    ``p`` below 1 applies the twist to that share of the samples only, each drawing a fifth
    uniform for it (torchvision's ``RandomApply([ColorJitter(...)], p)``); the others keep their
    colours exactly.

    The transform is DALI's ``color_twist``, so it is per pixel and fuses: with brightness b,
    contrast c, saturation s and hue h (turns), for an RGB pixel x (0..255)::

        T   = YIQ2RGB @ [[1, 0, 0], [0, s cos t, s sin t], [0, -s sin t, s cos t]] @ RGB2YIQ,  t = 2 pi h
        out = round(b c T x + 128 b (1 - c))        (clamped to 0..255, rounding half up, once)

    that is, saturation scales and hue rotates the chroma plane (I, Q) of YIQ (DALI's sign: a
    positive h turns red towards green, as torchvision's hue does in HSV), contrast scales around
    the fixed grey 128 (not the image mean, unlike torchvision), and brightness scales the result.
    YIQ2RGB is the exact inverse of DALI's RGB2YIQ, so s = 1, h = 0 leaves colours exactly alone.
    Gray (1-channel) images take brightness and contrast only: ``round(b c x + 128 b (1 - c))``.
    """

    brightness: float | tuple[float, float] = 0.0
    contrast: float | tuple[float, float] = 0.0
    saturation: float | tuple[float, float] = 0.0
    hue: float | tuple[float, float] = 0.0
    p: float = 1.0
    randoms: int = field(default=4, init=False)

    def __post_init__(self) -> None:
        for name in ("brightness", "contrast", "saturation"):
            value = _jitter(getattr(self, name), f"ColorTwist: {name}", centre=1.0, low=0.0, high=math.inf)
            object.__setattr__(self, name, value)
        object.__setattr__(self, "hue", _jitter(self.hue, "ColorTwist: hue", centre=0.0, low=-0.5, high=0.5, most=0.5))
        object.__setattr__(self, "p", _probability(self.p, "ColorTwist: p"))
        object.__setattr__(self, "randoms", 4 if self.p >= 1.0 else 5)  # p = 1 draws what it drew before p existed

    def params(self, u: np.ndarray) -> np.ndarray:
        """(n, 4) float64: brightness, contrast, saturation and hue (turns) per sample, from (n,
        ``randoms``) uniforms; (1, 1, 1, 0), no change, for the samples ``p`` leaves alone."""
        u = np.asarray(u, dtype=np.float64).reshape(-1, self.randoms)
        ranges = (self.brightness, self.contrast, self.saturation, self.hue)
        out = np.stack([_draw(r, u[:, k]) for k, r in enumerate(ranges)], axis=1)
        applied = _applied(self, u)
        if applied is not None:
            out[~applied] = (1.0, 1.0, 1.0, 0.0)
        return out

    @staticmethod
    def matrices(factors: np.ndarray, channels: int) -> np.ndarray:
        """The affine colour maps of (n, 4) factors: (n, 3, 4) ``[M | o]`` for RGB, (n, 1, 2) for gray (float64)."""
        f = np.asarray(factors, dtype=np.float64).reshape(-1, 4)
        b, c, s, h = f.T
        gain, offset = b * c, GREY * b * (1.0 - c)
        if channels == 1:
            return np.stack([gain, offset], axis=1)[:, None, :]
        t = 2.0 * math.pi * h
        chroma = np.zeros((len(f), 3, 3))  # the chroma map minus the identity: exact I when s = 1, h = 0
        chroma[:, 1, 1] = chroma[:, 2, 2] = s * np.cos(t) - 1.0
        chroma[:, 1, 2] = s * np.sin(t)
        chroma[:, 2, 1] = -s * np.sin(t)
        twist = np.eye(3) + _YIQ2RGB @ chroma @ _RGB2YIQ
        out = np.empty((len(f), 3, 4))
        out[:, :, :3] = gain[:, None, None] * twist
        out[:, :, 3] = offset[:, None]
        return out

    def tables(self, u, h, w, channels):
        """``(matrices,)``: see ``matrices``."""
        return (self.matrices(self.params(u), channels),)


# torchvision's rgb_to_grayscale weights (ITU-R 601-2 luma).
_GRAY = np.array([0.2989, 0.587, 0.114])


@dataclass(frozen=True)
class RandomGrayscale(ColorMatrix):
    """Turn an image gray, keeping its three channels, with probability ``p`` (one uniform per
    sample): torchvision's ``RandomGrayscale``. Each channel becomes ``0.2989 R + 0.587 G +
    0.114 B`` (torchvision's weights), rounded once, half up: within 1 level of torchvision's
    float result. A one-channel image is already gray and is left as it is.
    """

    p: float = 0.1
    randoms: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", _probability(self.p, "RandomGrayscale: p"))

    def tables(self, u, h, w, channels):
        """``(matrices,)``: the gray map for the samples drawn, the identity for the others."""
        n = len(np.asarray(h).reshape(-1))
        if channels == 1:
            out = np.zeros((n, 1, 2))
            out[:, 0, 0] = 1.0
            return (out,)
        applied = np.asarray(u, dtype=np.float64).reshape(-1)[:n] < self.p
        out = np.zeros((n, 3, 4))
        out[:, :, :3] = np.eye(3)
        out[applied, :, :3] = _GRAY
        return (out,)


def _fill(value: object, what: str) -> tuple[float, ...]:
    values = value if isinstance(value, Sequence) and not isinstance(value, str) else (value,)
    out = tuple(_finite(v, what) for v in values)
    if not 1 <= len(out) <= 4 or not all(0.0 <= v <= 255.0 for v in out):
        raise ConfigError(f"{what} must be a level in [0, 255] or one per channel, got {value!r}")
    return out


class _Warp(PostOp):
    """Bilinear resampling through a 2x3 matrix per sample, with a constant fill outside the image.

    Coordinates are continuous: pixel (row i, column j) covers [j, j+1) x [i, i+1), its centre is
    (j + 0.5, i + 0.5) (Pillow's, DALI's and torchvision's convention). Output pixel (x, y) reads the
    input at ``A @ (x + 0.5, y + 0.5, 1)`` with bilinear weights over the four nearest pixel centres;
    each of those four that lies outside the image reads ``fill`` instead (DALI's constant border,
    and what ``grid_sample(padding_mode="zeros")`` does for fill 0), so edges blend smoothly into
    the fill. Pillow's ``rotate`` differs there: it fills wherever the point itself is outside and
    clamps the neighbours to the edge inside. The result rounds once, half up.
    """

    moves_pixels: ClassVar[bool] = True
    fill: tuple[float, ...]

    def fill_values(self, channels: int) -> np.ndarray:
        return np.resize(np.asarray(self.fill, dtype=np.float64), channels)

    def affine(self, u: np.ndarray | None, h: np.ndarray, w: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def tables(self, u, h, w, channels):
        """``(affine (n, 2, 3), fill (channels,))``: output to input coordinates, and the fill levels."""
        return self.affine(u, h, w), self.fill_values(channels)


def rotation_affine(degrees: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(n, 2, 3) matrices mapping output to input coordinates for a counter-clockwise rotation by
    ``degrees`` about the centre (w / 2, h / 2) of an h x w image (Pillow's ``rotate`` matrix)."""
    a = np.radians(np.asarray(degrees, dtype=np.float64).reshape(-1))
    cos, sin = np.cos(a), np.sin(a)
    cx = np.asarray(w, dtype=np.float64).reshape(-1) / 2.0
    cy = np.asarray(h, dtype=np.float64).reshape(-1) / 2.0
    out = np.empty((len(a), 2, 3))
    out[:, 0, 0], out[:, 0, 1], out[:, 0, 2] = cos, -sin, cx - cos * cx + sin * cy
    out[:, 1, 0], out[:, 1, 1], out[:, 1, 2] = sin, cos, cy - sin * cx - cos * cy
    return out


@dataclass(frozen=True)
class Rotate(_Warp):
    """Rotate by a random angle about the image centre, counter-clockwise for positive angles;
    the output keeps the input's size (torchvision's ``RandomRotation(expand=False)``), bilinear.

    ``degrees`` d draws from ``[-d, d]``; a pair ``(lo, hi)`` from that range (one uniform per
    sample). ``fill`` is the level (0..255) outside the image, or one per channel. The matrix is
    ``rotation_affine``; sampling and fill as described in ``WarpAffine``.
    """

    degrees: float | tuple[float, float]
    fill: float | tuple[float, ...] = 0
    randoms: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "degrees", _jitter(self.degrees, "Rotate: degrees", centre=0.0, low=-math.inf, high=math.inf))
        object.__setattr__(self, "fill", _fill(self.fill, "Rotate: fill"))

    def params(self, u: np.ndarray) -> np.ndarray:
        """(n,) angles in degrees from (n, 1) uniforms."""
        return _draw(self.degrees, np.asarray(u, dtype=np.float64).reshape(-1))

    def affine(self, u, h, w):
        return rotation_affine(self.params(u), h, w)


@dataclass(frozen=True)
class WarpAffine(_Warp):
    """Resample through a fixed 2x3 ``matrix`` that maps output coordinates (x, y) to input ones
    (DALI's ``warp_affine`` with ``inverse_map=True``): output pixel (x, y) reads the input at
    ``matrix @ (x + 0.5, y + 0.5, 1)``, pixel centres at half-integers. Same output size, bilinear;
    each of the four neighbours outside the image reads ``fill`` (a level, or one per channel).
    """

    matrix: Sequence[Sequence[float]]
    fill: float | tuple[float, ...] = 0

    def __post_init__(self) -> None:
        try:
            rows = tuple(tuple(_finite(v, "WarpAffine: matrix entries") for v in row) for row in self.matrix)
        except TypeError as exc:
            raise ConfigError(f"WarpAffine: matrix must be 2x3 numbers, got {self.matrix!r}") from exc
        if len(rows) != 2 or any(len(row) != 3 for row in rows):
            raise ConfigError(f"WarpAffine: matrix must be 2x3 numbers, got {self.matrix!r}")
        object.__setattr__(self, "matrix", rows)
        object.__setattr__(self, "fill", _fill(self.fill, "WarpAffine: fill"))

    def affine(self, u, h, w):
        n = len(np.asarray(h).reshape(-1))
        return np.broadcast_to(np.asarray(self.matrix, dtype=np.float64), (n, 2, 3)).copy()


def _kernel_size(value: object) -> tuple[int, int]:
    if is_int(value):  # NumPy's integers too
        pair = (int(value), int(value))  # type: ignore[call-overload]
    elif isinstance(value, Sequence) and len(value) == 2 and all(is_int(v) for v in value):
        pair = (int(value[0]), int(value[1]))
    else:
        raise ConfigError(f"GaussianBlur: kernel_size must be an odd int or (x, y) pair of them, got {value!r}")
    if min(pair) < 1 or pair[0] % 2 == 0 or pair[1] % 2 == 0:
        raise ConfigError(f"GaussianBlur: kernel_size must be odd and positive, got {value!r}")
    return pair


def gaussian_weights(sigmas: np.ndarray, size: int) -> np.ndarray:
    """(n, size) float64 normalised 1-D Gaussian kernels (torchvision's ``_get_gaussian_kernel1d``)."""
    x = np.linspace(-(size - 1) / 2.0, (size - 1) / 2.0, size)
    s = np.asarray(sigmas, dtype=np.float64).reshape(-1, 1)
    pdf = np.exp(-0.5 * (x / s) ** 2)
    return pdf / pdf.sum(axis=1, keepdims=True)


@dataclass(frozen=True)
class GaussianBlur(PostOp):
    """Gaussian blur with a random sigma per sample: torchvision's ``GaussianBlur``.

    ``kernel_size`` is an odd int, or an ``(x, y)`` pair (torchvision's order: width-wise size
    first). ``sigma`` a number fixes it; a pair ``(lo, hi)`` draws it uniformly per sample (one
    uniform; the same sigma both ways). Weights are ``exp(-t^2 / (2 sigma^2))`` at the integer
    offsets t, normalised to sum 1; borders reflect without repeating the edge pixel (torch's
    "reflect": index -1 reads 1), repeatedly where the kernel is wider than the image (torchvision
    raises there). Separable, computed in float32, rounded once (half up) to uint8. ``p`` below 1
    blurs that share of the samples only, each drawing a second uniform for it (torchvision's
    ``RandomApply([GaussianBlur(...)], p)``); the others get the identity kernel and keep their
    pixels exactly.
    """

    kernel_size: int | tuple[int, int]
    sigma: float | tuple[float, float] = (0.1, 2.0)
    p: float = 1.0
    randoms: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel_size", _kernel_size(self.kernel_size))
        if isinstance(self.sigma, numbers.Real) and not isinstance(self.sigma, bool):
            s = _finite(self.sigma, "GaussianBlur: sigma")
            pair = (s, s)
        else:
            pair = _float2(self.sigma, "GaussianBlur: sigma")
        if not (math.isfinite(pair[1]) and 0.0 < pair[0] <= pair[1]):
            raise ConfigError(f"GaussianBlur: sigma must be positive, or a pair 0 < lo <= hi, got {self.sigma!r}")
        object.__setattr__(self, "sigma", pair)
        object.__setattr__(self, "p", _probability(self.p, "GaussianBlur: p"))
        object.__setattr__(self, "randoms", 1 if self.p >= 1.0 else 2)  # p = 1 draws what it drew before p existed

    def params(self, u: np.ndarray) -> np.ndarray:
        """(n,) sigmas from (n, ``randoms``) uniforms."""
        return _draw(self.sigma, np.asarray(u, dtype=np.float64).reshape(-1, self.randoms)[:, 0])

    def tables(self, u, h, w, channels):
        """``(wx (n, kx), wy (n, ky))``: each sample's horizontal and vertical weights (a lone 1 at
        the centre for the samples ``p`` leaves alone)."""
        sigmas = self.params(u)
        wx, wy = gaussian_weights(sigmas, self.kernel_size[0]), gaussian_weights(sigmas, self.kernel_size[1])
        applied = _applied(self, u)
        if applied is not None:
            for weights in (wx, wy):
                weights[~applied] = 0.0
                weights[~applied, weights.shape[1] // 2] = 1.0
        return wx, wy
