"""The ops users compose, as device-independent descriptions.

An op says what it does and which random numbers it needs; executors (``cpu/_executor.py``, and the GPU
one) say how. Geometry is computed here once, in plain Python on one sample's numbers, so every
executor crops the same window for the same sample.

Random ops draw from ``_random.uniforms`` keyed by (seed, epoch, op position, sample index).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from headrace._errors import ConfigError, is_int, require_int, require_number

__all__ = [
    "CenterCrop",
    "Decode",
    "Flip",
    "Normalize",
    "Op",
    "RandomCrop",
    "RandomIoUCrop",
    "RandomResize",
    "RandomResizedCrop",
    "Resize",
    "crop_mirror_normalize",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _size2(size: int | Sequence[int], what: str) -> tuple[int, int]:
    """``size`` as a (height, width) of Python ints; NumPy's integers taken, not a bool (a side of 1)."""
    if is_int(size):
        pair = (int(size), int(size))  # type: ignore[call-overload]
    elif isinstance(size, Sequence) and len(size) == 2 and all(is_int(v) for v in size):
        pair = (int(size[0]), int(size[1]))
    else:
        raise ConfigError(f"{what}: size must be an int or (height, width), got {size!r}")
    if min(pair) < 1:
        raise ConfigError(f"{what}: size must be positive, got {size!r}")
    return pair


def _float2(pair: object, what: str) -> tuple[float, float]:
    try:
        lo, hi = pair  # type: ignore[misc]
        return float(lo), float(hi)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} must be a pair of numbers, got {pair!r}") from exc


class Op:
    """Base of every op. ``randoms`` is how many uniform numbers one sample needs."""

    randoms: int = 0

    def output_size(self, size: tuple[int, int] | None) -> tuple[int, int] | None:
        """The (height, width) this op produces from ``size``; None when it depends on the image."""
        return size


@dataclass(frozen=True)
class Decode(Op):
    """Decode encoded bytes (JPEG, PNG, and what the backend knows) to uint8 pixels.

    ``color`` is ``"rgb"`` (3 channels) or ``"gray"`` (1). ``exif=True`` turns images upright by
    their EXIF orientation tag, as browsers and Pillow's ``exif_transpose`` do.

    ``max_pixels`` is the largest width x height a file may claim, read from its header before any
    pixel memory is allocated: a file over it is a ``DecodeError`` naming the sample and its claimed
    size. The same limit bounds every op's output (a resize that would make a larger image is a
    ``TransformError``). ``max_batch_bytes`` is the most bytes of decoded pixels an executor holds
    at once for decoding (the CPU executor: all its threads together; a GPU lane: its decode
    workspace); a batch over it is decoded in parts. None for either means no limit.

    Raises ConfigError for a color other than rgb/gray or a limit that is not a positive int or None.
    """

    color: Literal["rgb", "gray"] = "rgb"
    exif: bool = True
    max_pixels: int | None = 2**26
    max_batch_bytes: int | None = 1 << 30

    def __post_init__(self) -> None:
        if self.color not in ("rgb", "gray"):
            raise ConfigError(f"Decode: color must be 'rgb' or 'gray', got {self.color!r}")
        if not isinstance(self.exif, bool):
            raise ConfigError(f"Decode: exif must be True or False, got {self.exif!r}")
        for name in ("max_pixels", "max_batch_bytes"):
            value = getattr(self, name)
            if value is not None:  # kept as a Python int, so repr and equality are NumPy-free
                object.__setattr__(self, name, require_int(f"Decode: {name}", value, wanted="a positive int or None"))

    @property
    def channels(self) -> int:
        return 3 if self.color == "rgb" else 1

    def output_size(self, size):  # the image decides
        return None


@dataclass(frozen=True, repr=False)
class Resize(Op):
    """Resize with bilinear interpolation (antialiased when shrinking, as Pillow and torchvision do).

    ``size`` as an int scales the shorter side to it and keeps the aspect ratio (torchvision's
    convention); as ``(height, width)`` it gives the exact output size. ``max_size`` caps the
    longer side: with an int ``size`` (larger than it), an image whose longer side would pass
    ``max_size`` is scaled to ``max_size`` on that side instead (``Resize(800, max_size=1333)``, the
    detection models' rule); with ``size=None``, the longer side is scaled to ``max_size``
    (DALI's ``resize_longer``; with a ``CenterCrop`` of that size after it, a letterbox). The
    rounding is torchvision's: the side computed is truncated, though never below one pixel
    (where torchvision's would make an empty image of a very long, thin one).
    """

    size: int | tuple[int, int] | None
    max_size: int | None = None

    def __post_init__(self) -> None:
        if self.max_size is not None:
            object.__setattr__(self, "max_size", require_int("Resize: max_size", self.max_size,
                                                             wanted="a positive int or None"))
        if self.size is None:
            if self.max_size is None:
                raise ConfigError("Resize: give a size, a max_size, or both")
        elif is_int(self.size):
            if self.size < 1:
                raise ConfigError(f"Resize: size must be positive, got {self.size!r}")
            object.__setattr__(self, "size", int(self.size))
            if self.max_size is not None and self.max_size <= self.size:
                raise ConfigError(f"Resize: max_size ({self.max_size}) must be larger than size ({self.size})")
        else:
            if self.max_size is not None:
                raise ConfigError("Resize: max_size goes with an int size (the shorter side) or none, not (height, width)")
            object.__setattr__(self, "size", _size2(self.size, "Resize"))

    def target(self, h: int, w: int) -> tuple[int, int]:
        if isinstance(self.size, tuple):
            return self.size
        short, long_ = (h, w) if h <= w else (w, h)
        if self.size is None:
            assert self.max_size is not None
            new_short, new_long = max(1, int(self.max_size * short / long_)), self.max_size
        else:
            new_short, new_long = self.size, int(self.size * long_ / short)  # torchvision truncates
            if self.max_size is not None and new_long > self.max_size:
                new_short, new_long = max(1, int(self.max_size * new_short / new_long)), self.max_size
        return (new_short, new_long) if h <= w else (new_long, new_short)

    def output_size(self, size):
        if isinstance(self.size, tuple):
            return self.size
        return None if size is None else self.target(*size)

    def __repr__(self) -> str:  # max_size only where given: error messages name the op as it was written
        cap = "" if self.max_size is None else f", max_size={self.max_size}"
        return f"Resize(size={self.size!r}{cap})"


def _centre_offset(size: int, crop: int) -> int:
    """Where a centred crop starts, as torchvision's ``center_crop`` places it.

    Cropping rounds half to even (Python's ``round``); padding first pads ``(crop - size) // 2``
    on the leading side, so the image starts at that floor, not at the rounded negative offset.
    """
    if crop <= size:
        return int(round((size - crop) / 2.0))
    return -((crop - size) // 2)


@dataclass(frozen=True)
class CenterCrop(Op):
    """Crop the centre ``size`` window. An image smaller than ``size`` is padded with zeros, as torchvision."""

    size: int | tuple[int, int]

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size2(self.size, "CenterCrop"))

    def window(self, h: int, w: int) -> tuple[int, int, int, int]:
        """(top, left, height, width); top/left are negative where the image is padded."""
        ch, cw = self.size
        return _centre_offset(h, ch), _centre_offset(w, cw), ch, cw

    def output_size(self, size):
        return self.size


def random_offset(size: int, crop: int, u: float) -> int:
    """Where a random crop starts: any place inside the image with equal chance, or, for a crop
    larger than the image, a negative offset that puts the whole image anywhere inside the crop."""
    if crop <= size:
        return min(int(u * (size - crop + 1)), size - crop)
    return -min(int(u * (crop - size + 1)), crop - size)


@dataclass(frozen=True)
class RandomCrop(Op):
    """Crop a ``size`` window at a random place (torchvision's ``RandomCrop``), without resizing.

    Every place where the window lies inside the image is equally likely. Where the image is
    smaller than the window, the whole image goes to a random place inside it and the rest is
    zeros (torchvision's ``pad_if_needed`` pads both sides and may cut the image; here none of it
    is lost).
    """

    size: int | tuple[int, int]
    randoms: int = field(default=2, init=False)  # (top, left)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size2(self.size, "RandomCrop"))

    def window(self, h: int, w: int, u: Sequence[float]) -> tuple[int, int, int, int]:
        """(top, left, height, width); top/left are negative where the image is padded."""
        ch, cw = self.size
        return random_offset(h, ch, u[0]), random_offset(w, cw, u[1]), ch, cw

    def output_size(self, size):
        return self.size


@dataclass(frozen=True)
class RandomResize(Op):
    """Resize the shorter side to a random size in ``[min_size, max_size)`` and keep the aspect
    ratio (torchvision's ``RandomResize``: multi-scale training), each sample its own.

    ``max_side`` caps the longer side as ``Resize(max_size=)`` does (the detection models' rule).
    """

    min_size: int
    max_size: int
    max_side: int | None = None
    randoms: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        for name in ("min_size", "max_size"):
            object.__setattr__(self, name, require_int(f"RandomResize: {name}", getattr(self, name)))
        if self.max_size <= self.min_size:
            raise ConfigError(f"RandomResize: max_size ({self.max_size}) must be larger than min_size "
                              f"({self.min_size}); the size is drawn from [min_size, max_size)")
        if self.max_side is not None:  # the same checks as Resize's, and its Python int
            object.__setattr__(self, "max_side", Resize(self.max_size - 1, max_size=self.max_side).max_size)

    def shorter(self, u: Sequence[float]) -> int:
        """This sample's shorter side."""
        return min(self.min_size + int(u[0] * (self.max_size - self.min_size)), self.max_size - 1)

    def target(self, h: int, w: int, u: Sequence[float]) -> tuple[int, int]:
        return Resize(self.shorter(u), max_size=self.max_side).target(h, w)

    def largest(self, h: int, w: int) -> tuple[int, int]:
        """The largest output this op can make of an h x w image (for the pixel limits)."""
        return Resize(self.max_size - 1, max_size=self.max_side).target(h, w)

    def output_size(self, size):
        return None


@dataclass(frozen=True)
class RandomIoUCrop(Op):
    """Crop a window chosen against the sample's boxes: SSD's crop (torchvision's ``RandomIoUCrop``,
    DALI's ``fn.random_bbox_crop``). Needs ``Pipeline(boxes=)`` and comes first among the geometry ops.

    Each sample draws an overlap from ``sampler_options`` (a value of 1 or more: the image as it
    is), then tries up to ``trials`` windows whose sides are ``min_scale``..``max_scale`` of the
    image's and whose aspect ratio is ``min_aspect_ratio``..``max_aspect_ratio``; a window is
    taken when the centre of at least one box lies inside it and one of those boxes overlaps it
    by at least that much (IoU). Boxes whose centres lie outside the window are dropped with their
    ``per_box`` rows. Where no window passes, another overlap is drawn, at most ``draws`` times,
    then the image stays whole (torchvision draws until one passes). The choice is the sample's
    own, from (seed, epoch, op, sample index), the same on every path.
    """

    min_scale: float = 0.3
    max_scale: float = 1.0
    min_aspect_ratio: float = 0.5
    max_aspect_ratio: float = 2.0
    sampler_options: tuple[float, ...] = (0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 2.0)
    trials: int = 40
    draws: int = 50

    def __post_init__(self) -> None:
        lo, hi = _float2((self.min_scale, self.max_scale), "RandomIoUCrop: min_scale, max_scale")
        if not 0 < lo <= hi <= 1:
            raise ConfigError(f"RandomIoUCrop: scales must satisfy 0 < min_scale <= max_scale <= 1, got {lo}, {hi}")
        alo, ahi = _float2((self.min_aspect_ratio, self.max_aspect_ratio), "RandomIoUCrop: aspect ratios")
        if not 0 < alo <= ahi < math.inf:
            raise ConfigError(f"RandomIoUCrop: aspect ratios must satisfy 0 < min <= max, got {alo}, {ahi}")
        try:
            options = tuple(float(v) for v in self.sampler_options)
        except (TypeError, ValueError):
            options = ()
        if not options or not all(math.isfinite(v) and v >= 0 for v in options):
            raise ConfigError(f"RandomIoUCrop: sampler_options must be numbers >= 0, got {self.sampler_options!r}")
        for name in ("trials", "draws"):
            object.__setattr__(self, name, require_int(f"RandomIoUCrop: {name}", getattr(self, name)))
        object.__setattr__(self, "sampler_options", options)
        for name, value in (("min_scale", lo), ("max_scale", hi), ("min_aspect_ratio", alo), ("max_aspect_ratio", ahi)):
            object.__setattr__(self, name, value)

    def output_size(self, size):
        return None


@dataclass(frozen=True)
class RandomResizedCrop(Op):
    """Crop a random window (area fraction in ``scale``, aspect ratio in ``ratio``) and resize it to ``size``.

    Same semantics as torchvision's ``RandomResizedCrop``: ten tries, then a centre crop clamped
    to the ratio range.
    """

    size: int | tuple[int, int]
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    randoms: int = field(default=22, init=False)  # 10 tries x (area, log-ratio) + (top, left)

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size2(self.size, "RandomResizedCrop"))
        lo, hi = _float2(self.scale, "RandomResizedCrop: scale")
        if not 0 < lo <= hi <= 1:
            raise ConfigError(f"RandomResizedCrop: scale must satisfy 0 < lo <= hi <= 1, got {self.scale!r}")
        rlo, rhi = _float2(self.ratio, "RandomResizedCrop: ratio")
        if not 0 < rlo <= rhi < math.inf:
            raise ConfigError(f"RandomResizedCrop: ratio must satisfy 0 < lo <= hi, got {self.ratio!r}")
        object.__setattr__(self, "scale", (lo, hi))
        object.__setattr__(self, "ratio", (rlo, rhi))

    def window(self, h: int, w: int, u: Sequence[float]) -> tuple[int, int, int, int]:
        """(top, left, height, width) of the crop for an h x w image, from this sample's uniforms."""
        area = h * w
        log_lo, log_hi = math.log(self.ratio[0]), math.log(self.ratio[1])
        for t in range(10):
            target = area * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[2 * t])
            aspect = math.exp(log_lo + (log_hi - log_lo) * u[2 * t + 1])
            cw = int(round(math.sqrt(target * aspect)))
            ch = int(round(math.sqrt(target / aspect)))
            if 0 < cw <= w and 0 < ch <= h:
                top = min(int(u[20] * (h - ch + 1)), h - ch)
                left = min(int(u[21] * (w - cw + 1)), w - cw)
                return top, left, ch, cw
        in_ratio = w / h
        if in_ratio < self.ratio[0]:
            cw, ch = w, int(round(w / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            ch, cw = h, int(round(h * self.ratio[1]))
        else:
            cw, ch = w, h
        return (h - ch) // 2, (w - cw) // 2, ch, cw

    def output_size(self, size):
        return self.size


@dataclass(frozen=True)
class Flip(Op):
    """Mirror the image with probability ``p`` (horizontally, or vertically with ``vertical=True``)."""

    p: float = 0.5
    vertical: bool = False
    randoms: int = field(default=1, init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "p", require_number("Flip: p", self.p, 0.0, 1.0, wanted="a number in [0, 1]"))
        if not isinstance(self.vertical, bool):  # "no" would be true, and flip vertically
            raise ConfigError(f"Flip: vertical must be True or False, got {self.vertical!r}")

    def flips(self, u: Sequence[float]) -> bool:
        return u[0] < self.p


_DTYPES = {
    "uint8": torch.uint8,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in _DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ConfigError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")


@dataclass(frozen=True)
class Normalize(Op):
    """``(pixel / 255 - mean) / std`` per channel, then ``layout`` and ``dtype``.

    ``mean`` and ``std`` are on the 0..1 scale (torchvision's convention; DALI's are 255 times
    larger). ``layout`` is ``"CHW"`` or ``"HWC"``; ``dtype`` float32, float16 or bfloat16
    (arithmetic in float32, one rounding at the end).
    """

    mean: Sequence[float] = IMAGENET_MEAN
    std: Sequence[float] = IMAGENET_STD
    dtype: str | torch.dtype = torch.float32
    layout: Literal["CHW", "HWC"] = "CHW"

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mean", tuple(float(m) for m in self.mean))
            object.__setattr__(self, "std", tuple(float(s) for s in self.std))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"Normalize: mean and std must be sequences of numbers, got {self.mean!r}, {self.std!r}") from exc
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        if self.dtype == torch.uint8:
            raise ConfigError("Normalize: dtype must be a float type")
        if not self.mean or len(self.mean) != len(self.std) or any(s == 0 for s in self.std):
            raise ConfigError(f"Normalize: mean and std must have equal lengths and no zero std, got {self.mean!r}, {self.std!r}")
        if not all(math.isfinite(v) for v in (*self.mean, *self.std)):  # a NaN or inf makes every pixel one
            raise ConfigError(f"Normalize: mean and std must be finite, got {self.mean!r}, {self.std!r}")
        if self.layout not in ("CHW", "HWC"):
            raise ConfigError(f"Normalize: layout must be 'CHW' or 'HWC', got {self.layout!r}")


def crop_mirror_normalize(
    crop: int | tuple[int, int] | None = None,
    *,
    mirror: float = 0.0,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    dtype: str | torch.dtype = torch.float32,
    layout: Literal["CHW", "HWC"] = "CHW",
) -> list[Op]:
    """DALI's crop_mirror_normalize as ops: centre crop (if ``crop``), flip with probability ``mirror``, normalize.

    The executors fuse the three (one pass on the CPU per image; one kernel launch on the GPU).
    """
    ops: list[Op] = []
    if crop is not None:
        ops.append(CenterCrop(crop))
    if mirror:
        ops.append(Flip(mirror))
    ops.append(Normalize(mean, std, dtype=dtype, layout=layout))
    return ops


# Post ops (colour, warps, blur on the uint8 HWC image the geometry made) live in _post_spec.py.
