"""torchvision's ``RandomAffine`` as a post op: a rotation, translation, scale and shear drawn per
sample, applied through the warp every path already has (``_Warp``: one 2x3 matrix a sample).

The draws and the matrix follow torchvision's ``RandomAffine.get_params`` and
``_get_inverse_affine_matrix`` (its tensor path: the centre at the image's middle, the angle
clockwise), rewritten over a batch: one NumPy expression per entry, not a Python loop a sample.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from headrace._errors import ConfigError

from ._post_spec import _draw, _fill, _finite, _jitter, _Warp

__all__ = ["RandomAffine", "inverse_affine"]


def _pair_in(value: object, what: str, low: float, high: float) -> tuple[float, float]:
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != 2:
        raise ConfigError(f"{what} must be a pair of numbers, got {value!r}")
    pair = (_finite(value[0], what), _finite(value[1], what))
    if not all(low <= v <= high for v in pair):
        raise ConfigError(f"{what} must lie in [{low}, {high}], got {value!r}")
    return pair


def _shear(value: object) -> tuple[float, float, float, float]:
    """torchvision's rule: s gives x in [-s, s]; (lo, hi) gives x in it; four give x and y ranges."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        s = _finite(value, "RandomAffine: shear")
        if s < 0:
            raise ConfigError(f"RandomAffine: shear as one number must be >= 0, got {value!r}")
        return (-s, s, 0.0, 0.0)
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) in (2, 4):
        ranges = tuple(_finite(v, "RandomAffine: shear") for v in value)
        if ranges[0] > ranges[1] or (len(ranges) == 4 and ranges[2] > ranges[3]):
            raise ConfigError(f"RandomAffine: shear ranges must run low to high, got {value!r}")
        return (*ranges, 0.0, 0.0) if len(ranges) == 2 else ranges  # type: ignore[return-value]
    raise ConfigError(f"RandomAffine: shear must be a number, or 2 or 4 numbers, got {value!r}")


def inverse_affine(angle: np.ndarray, tx: np.ndarray, ty: np.ndarray, scale: np.ndarray, shear_x: np.ndarray,
                   shear_y: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
    """(n, 2, 3) matrices from output to input coordinates (pixel centres at half-integers) for
    torchvision's ``affine(img, angle, (tx, ty), scale, (shear_x, shear_y))`` on an h x w image:
    its inverse matrix M about the image's middle (angle clockwise, degrees), moved to corner
    coordinates: input = M (output - c) + c, with c = (w / 2, h / 2)."""
    rot, sx, sy = np.radians(angle), np.radians(shear_x), np.radians(shear_y)
    # The rotation-scale-shear block without the scale (determinant 1), as torchvision writes it.
    a = np.cos(rot - sy) / np.cos(sy)
    b = -np.cos(rot - sy) * np.tan(sx) / np.cos(sy) - np.sin(rot)
    c = np.sin(rot - sy) / np.cos(sy)
    d = -np.sin(rot - sy) * np.tan(sx) / np.cos(sy) + np.cos(rot)
    m = np.stack([np.stack([d, -b], axis=-1), np.stack([-c, a], axis=-1)], axis=-2) / np.asarray(scale)[:, None, None]
    shift = np.stack([-np.asarray(tx, dtype=np.float64), -np.asarray(ty, dtype=np.float64)], axis=-1)
    centre = np.stack([np.asarray(w, dtype=np.float64) / 2.0, np.asarray(h, dtype=np.float64) / 2.0], axis=-1)
    out = np.empty((len(a), 2, 3))
    out[:, :, :2] = m
    out[:, :, 2] = np.einsum("nij,nj->ni", m, shift - centre) + centre
    return out


@dataclass(frozen=True)
class RandomAffine(_Warp):
    """torchvision's ``RandomAffine(degrees, translate, scale, shear, fill=)``, per sample, the
    output the input's size; bilinear (torchvision's default is nearest: pass
    ``interpolation=BILINEAR`` there to compare).

    ``degrees`` d draws the angle (clockwise, as torchvision's ``affine``) from ``[-d, d]``, or a
    pair from its range; ``translate=(a, b)`` shifts by whole pixels drawn from ``[-a w, a w]`` and
    ``[-b h, b h]`` (rounded, as torchvision); ``scale=(lo, hi)`` draws the scale; ``shear`` s draws
    an x shear from ``[-s, s]`` degrees, a pair from its range, four numbers an x and a y range.
    ``fill`` is the level outside the image, or one per channel; as ``WarpAffine`` describes, the
    edge blends into it (torchvision's bilinear fill does the same but for the one-pixel band
    where the image meets the fill). Six uniforms a sample.
    """

    degrees: float | tuple[float, float]
    translate: tuple[float, float] | None = None
    scale: tuple[float, float] | None = None
    shear: float | tuple[float, ...] | None = None
    fill: float | tuple[float, ...] = 0
    randoms: int = field(default=6, init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "degrees", _jitter(self.degrees, "RandomAffine: degrees", centre=0.0,
                                                    low=-math.inf, high=math.inf))
        if self.translate is not None:
            object.__setattr__(self, "translate", _pair_in(self.translate, "RandomAffine: translate", 0.0, 1.0))
        if self.scale is not None:
            lo, hi = _pair_in(self.scale, "RandomAffine: scale", 0.0, math.inf)
            if not 0.0 < lo <= hi:
                raise ConfigError(f"RandomAffine: scale must be (lo, hi) with 0 < lo <= hi, got {self.scale!r}")
            object.__setattr__(self, "scale", (lo, hi))
        if self.shear is not None:
            object.__setattr__(self, "shear", _shear(self.shear))
        object.__setattr__(self, "fill", _fill(self.fill, "RandomAffine: fill"))

    def params(self, u: np.ndarray, h: np.ndarray, w: np.ndarray) -> np.ndarray:
        """(n, 6) draws from (n, 6) uniforms: angle, tx, ty (whole pixels), scale, shear x, shear y."""
        u = np.asarray(u, dtype=np.float64).reshape(-1, 6)
        n = len(u)
        out = np.zeros((n, 6))
        out[:, 0] = _draw(self.degrees, u[:, 0])
        if self.translate is not None:
            most_x = self.translate[0] * np.asarray(w, dtype=np.float64).reshape(-1)
            most_y = self.translate[1] * np.asarray(h, dtype=np.float64).reshape(-1)
            out[:, 1] = np.round(most_x * (2.0 * u[:, 1] - 1.0))  # half to even, as Python's round
            out[:, 2] = np.round(most_y * (2.0 * u[:, 2] - 1.0))
        out[:, 3] = _draw(self.scale, u[:, 3]) if self.scale is not None else 1.0
        if self.shear is not None:
            out[:, 4] = _draw(self.shear[:2], u[:, 4])
            out[:, 5] = _draw(self.shear[2:], u[:, 5])
        return out

    def affine(self, u, h, w):
        h, w = np.asarray(h).reshape(-1), np.asarray(w).reshape(-1)
        p = self.params(u, h, w)
        return inverse_affine(p[:, 0], p[:, 1], p[:, 2], p[:, 3], p[:, 4], p[:, 5], h, w)
