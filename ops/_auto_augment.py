"""Automatic augmentation policies: torchvision's ``AutoAugment``, ``RandAugment`` and
``TrivialAugmentWide`` as post ops that each sample of a batch draws on its own.

Each sample picks an op and a magnitude per round; a batch is then a mix of shears, rotations,
tone curves and colour changes. Rather than split the batch by op, each round becomes at most four
batch-wide passes, one per kind of pass (warp, tone curve, colour matrix, sharpness): a sample that
drew a warp gets its matrix in the warp pass and the identity in the others, and a pass no sample
needs is left out (``PostOp.steps``). A sample draws exactly one op a round, so the order of the
passes within a round does not change its result.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from headrace._errors import ConfigError, is_int

from ._passes import CODE, OPS as CODES, MultiPass, PassWarp, codes, round_passes
from ._post_spec import Step, _fill

__all__ = ["AutoAugment", "RandAugment", "TrivialAugmentWide"]

@dataclass(frozen=True)
class _Range:
    """An op's magnitudes over the bins: ``linspace(lo, hi, bins)``, times ``scale`` and the
    image's height (``side`` 0) or width (1) for the translations, or torchvision's posterize
    bits ``bits - round(arange(bins) / ((bins - 1) / posterize))`` (rounding half to even, as torch)."""

    lo: float = 0.0
    hi: float = 0.0
    side: int = -1
    scale: float = 1.0
    posterize: int = 0
    bits: int = 8  # the posterize bits of bin 0 (AugMix's space counts down from 4)

    def values(self, bins: int) -> np.ndarray:
        if self.posterize:
            return self.bits - np.round(np.arange(bins) / ((bins - 1) / self.posterize))
        return np.linspace(self.lo, self.hi, bins)


Magnitudes = _Range | None


@functools.cache
def _magnitude_tables(space: tuple[tuple[str, tuple[Magnitudes, bool]], ...], bins: int):
    """A space's magnitudes as arrays indexed by op code, once per (space, bins): the (codes, bins)
    values (0 for ops without a magnitude or outside the space), and per code whether it is signed,
    which side scales it (-1: none) and by how much (1 outside the space: the value stays 0)."""
    table = np.zeros((len(CODES), bins))
    signed, side, scale = np.zeros(len(CODES), bool), np.full(len(CODES), -1), np.ones(len(CODES))
    for name, (magnitudes, is_signed) in space:
        k = CODE[name]
        if magnitudes is not None:
            table[k] = magnitudes.values(bins)
            side[k], scale[k] = magnitudes.side, magnitudes.scale
        signed[k] = is_signed
    return table, signed, side, scale


_BY_SPACE: dict[int, tuple[dict, dict]] = {}  # id(space) -> (space, what was made from it)


def _made_from(space: dict[str, tuple[Magnitudes, bool]]) -> dict:
    """What was made from ``space`` (its codes, its tables per count of bins), found by the dict's
    identity: the spaces are the module's constants, and hashing one's items again took a few
    microseconds a round of every batch. The entry holds the dict: its id is not reused meanwhile."""
    hit = _BY_SPACE.get(id(space))
    if hit is None or hit[0] is not space:
        if len(_BY_SPACE) > 64:  # spaces made on the fly: keep the memo small
            _BY_SPACE.clear()
        hit = _BY_SPACE[id(space)] = (space, {})
    return hit[1]


def _space_tables(space: dict[str, tuple[Magnitudes, bool]], bins: int) -> tuple:
    """``_magnitude_tables`` of ``space``, made once per count of bins."""
    made = _made_from(space)
    if bins not in made:
        made[bins] = _magnitude_tables(tuple(space.items()), bins)
    return made[bins]


def space_codes(space: dict[str, tuple[Magnitudes, bool]]) -> np.ndarray:
    """``codes(space)``, made once (read-only)."""
    made = _made_from(space)
    if "codes" not in made:
        made["codes"] = codes(space)
        made["codes"].flags.writeable = False
    return made["codes"]


def _space(shear: float, translate_x: _Range, translate_y: _Range, rotate: float, enhance: float,
           posterize: int) -> dict[str, tuple[Magnitudes, bool]]:
    """torchvision's op space at these largest magnitudes: name -> (magnitudes, signed), in its
    order (a sample's op index counts in it)."""
    return {
        "Identity": (None, False),
        "ShearX": (_Range(0.0, shear), True),
        "ShearY": (_Range(0.0, shear), True),
        "TranslateX": (translate_x, True),
        "TranslateY": (translate_y, True),
        "Rotate": (_Range(0.0, rotate), True),
        **{name: (_Range(0.0, enhance), True) for name in ("Brightness", "Color", "Contrast", "Sharpness")},
        "Posterize": (_Range(posterize=posterize), False),
        "Solarize": (_Range(255.0, 0.0), False),
        "AutoContrast": (None, False),
        "Equalize": (None, False),
    }


# Translations: 150/331 of the image's width (side 1) or height (side 0); TrivialAugmentWide's are 32 pixels.
_RAND_AUGMENT = _space(0.3, _Range(0.0, 1.0, side=1, scale=150.0 / 331.0), _Range(0.0, 1.0, side=0, scale=150.0 / 331.0),
                       30.0, 0.9, 4)
_TRIVIAL_AUGMENT_WIDE = _space(0.99, _Range(0.0, 32.0), _Range(0.0, 32.0), 135.0, 0.99, 6)


# AutoAugment's space: RandAugment's without Identity, with Invert (torchvision's order).
_AUTO_AUGMENT: dict[str, tuple[Magnitudes, bool]] = {
    **{name: entry for name, entry in _RAND_AUGMENT.items() if name != "Identity"},
    "Invert": (None, False),
}

# The learned sub-policies, torchvision's AutoAugmentPolicy tables: each a pair of (op, probability,
# magnitude bin of 10, or None).
_SubPolicy = tuple[tuple[str, float, int | None], tuple[str, float, int | None]]
_POLICIES: dict[str, tuple[_SubPolicy, ...]] = {
    "imagenet": (
        (("Posterize", 0.4, 8), ("Rotate", 0.6, 9)),
        (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
        (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
        (("Posterize", 0.6, 7), ("Posterize", 0.6, 6)),
        (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
        (("Equalize", 0.4, None), ("Rotate", 0.8, 8)),
        (("Solarize", 0.6, 3), ("Equalize", 0.6, None)),
        (("Posterize", 0.8, 5), ("Equalize", 1.0, None)),
        (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)),
        (("Equalize", 0.6, None), ("Posterize", 0.4, 6)),
        (("Rotate", 0.8, 8), ("Color", 0.4, 0)),
        (("Rotate", 0.4, 9), ("Equalize", 0.6, None)),
        (("Equalize", 0.0, None), ("Equalize", 0.8, None)),
        (("Invert", 0.6, None), ("Equalize", 1.0, None)),
        (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
        (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
        (("Color", 0.8, 8), ("Solarize", 0.8, 7)),
        (("Sharpness", 0.4, 7), ("Invert", 0.6, None)),
        (("ShearX", 0.6, 5), ("Equalize", 1.0, None)),
        (("Color", 0.4, 0), ("Equalize", 0.6, None)),
        (("Equalize", 0.4, None), ("Solarize", 0.2, 4)),
        (("Solarize", 0.6, 5), ("AutoContrast", 0.6, None)),
        (("Invert", 0.6, None), ("Equalize", 1.0, None)),
        (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
        (("Equalize", 0.8, None), ("Equalize", 0.6, None)),
    ),
    "cifar10": (
        (("Invert", 0.1, None), ("Contrast", 0.2, 6)),
        (("Rotate", 0.7, 2), ("TranslateX", 0.3, 9)),
        (("Sharpness", 0.8, 1), ("Sharpness", 0.9, 3)),
        (("ShearY", 0.5, 8), ("TranslateY", 0.7, 9)),
        (("AutoContrast", 0.5, None), ("Equalize", 0.9, None)),
        (("ShearY", 0.2, 7), ("Posterize", 0.3, 7)),
        (("Color", 0.4, 3), ("Brightness", 0.6, 7)),
        (("Sharpness", 0.3, 9), ("Brightness", 0.7, 9)),
        (("Equalize", 0.6, None), ("Equalize", 0.5, None)),
        (("Contrast", 0.6, 7), ("Sharpness", 0.6, 5)),
        (("Color", 0.7, 7), ("TranslateX", 0.5, 8)),
        (("Equalize", 0.3, None), ("AutoContrast", 0.4, None)),
        (("TranslateY", 0.4, 3), ("Sharpness", 0.2, 6)),
        (("Brightness", 0.9, 6), ("Color", 0.2, 8)),
        (("Solarize", 0.5, 2), ("Invert", 0.0, None)),
        (("Equalize", 0.2, None), ("AutoContrast", 0.6, None)),
        (("Equalize", 0.2, None), ("Equalize", 0.6, None)),
        (("Color", 0.9, 9), ("Equalize", 0.6, None)),
        (("AutoContrast", 0.8, None), ("Solarize", 0.2, 8)),
        (("Brightness", 0.1, 3), ("Color", 0.7, 0)),
        (("Solarize", 0.4, 5), ("AutoContrast", 0.9, None)),
        (("TranslateY", 0.9, 9), ("TranslateY", 0.7, 9)),
        (("AutoContrast", 0.9, None), ("Solarize", 0.8, 3)),
        (("Equalize", 0.8, None), ("Invert", 0.1, None)),
        (("TranslateY", 0.7, 9), ("AutoContrast", 0.9, None)),
    ),
    "svhn": (
        (("ShearX", 0.9, 4), ("Invert", 0.2, None)),
        (("ShearY", 0.9, 8), ("Invert", 0.7, None)),
        (("Equalize", 0.6, None), ("Solarize", 0.6, 6)),
        (("Invert", 0.9, None), ("Equalize", 0.6, None)),
        (("Equalize", 0.6, None), ("Rotate", 0.9, 3)),
        (("ShearX", 0.9, 4), ("AutoContrast", 0.8, None)),
        (("ShearY", 0.9, 8), ("Invert", 0.4, None)),
        (("ShearY", 0.9, 5), ("Solarize", 0.2, 6)),
        (("Invert", 0.9, None), ("AutoContrast", 0.8, None)),
        (("Equalize", 0.6, None), ("Rotate", 0.9, 3)),
        (("ShearX", 0.9, 4), ("Solarize", 0.3, 3)),
        (("ShearY", 0.8, 8), ("Invert", 0.7, None)),
        (("Equalize", 0.9, None), ("TranslateY", 0.6, 6)),
        (("Invert", 0.9, None), ("Equalize", 0.6, None)),
        (("Contrast", 0.3, 3), ("Rotate", 0.8, 4)),
        (("Invert", 0.8, None), ("TranslateY", 0.0, 2)),
        (("ShearY", 0.7, 6), ("Solarize", 0.4, 8)),
        (("Invert", 0.6, None), ("Rotate", 0.8, 4)),
        (("ShearY", 0.3, 7), ("TranslateX", 0.9, 3)),
        (("ShearX", 0.1, 6), ("Invert", 0.6, None)),
        (("Solarize", 0.7, 2), ("TranslateY", 0.6, 7)),
        (("ShearY", 0.8, 4), ("Invert", 0.8, None)),
        (("ShearX", 0.7, 9), ("TranslateY", 0.8, 3)),
        (("ShearY", 0.8, 5), ("AutoContrast", 0.7, None)),
        (("ShearX", 0.7, 2), ("Invert", 0.1, None)),
    ),
}


def _whole(value: object, what: str, low: int) -> int:
    if not is_int(value) or int(value) < low:  # type: ignore[call-overload]
        raise ConfigError(f"{what} must be an int of at least {low}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


class _Policy(MultiPass):
    """An op drawn per sample from a space of ops, in rounds."""

    space: ClassVar[dict[str, tuple[Magnitudes, bool]]]
    fill: tuple[float, ...]

    def draws(self, u: np.ndarray, rounds: int) -> np.ndarray:
        return np.asarray(u, dtype=np.float64).reshape(-1, rounds, self.randoms // max(rounds, 1))

    def round_steps(self, u: np.ndarray, bins: int, magnitude_bin: np.ndarray, h, w, channels) -> list[Step]:
        """One round's passes from (n, 2) uniforms (op, sign) and each sample's magnitude bin."""
        space = space_codes(self.space)
        op = space[np.minimum((u[:, 0] * len(space)).astype(np.int64), len(space) - 1)]
        magnitude = self.magnitudes(op, bins, magnitude_bin, u[:, 1] >= 0.5, h, w)
        return round_passes(op, magnitude, h, w, channels, PassWarp(self.fill))

    def magnitudes(self, op: np.ndarray, bins: int, magnitude_bin: np.ndarray, negative: np.ndarray, h, w) -> np.ndarray:
        """(n,) signed magnitudes: sample i's op (code ``op[i]``) at its bin, negated where
        ``negative`` and the op is signed (0 for ops without a magnitude, or outside the space)."""
        table, signed, side, scale = _space_tables(self.space, bins)
        values = table[op, magnitude_bin]
        side, scale = side[op], scale[op]
        values = np.where(side == 0, (h * scale) * values, np.where(side == 1, (w * scale) * values, values))
        return np.where(signed[op] & negative, -values, values)


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


@functools.cache
def _policy_arrays(policy: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A policy's table as (25, 2) arrays: op codes, probabilities, magnitude bins (0 for None)."""
    table = _POLICIES[policy]
    op = np.array([[CODE[name] for name, _, _ in sub] for sub in table])
    p = np.array([[prob for _, prob, _ in sub] for sub in table])
    bins = np.array([[b or 0 for _, _, b in sub] for sub in table])
    return op, p, bins


@dataclass(frozen=True)
class AutoAugment(_Policy):
    """torchvision's ``AutoAugment``: every sample draws one of the 25 sub-policies learned on
    ``policy`` (``"imagenet"``, ``"cifar10"`` or ``"svhn"``: torchvision's ``AutoAugmentPolicy``
    tables), then applies its two ops in turn, each with its probability, at its magnitude bin out
    of 10, with a random sign where the op has one. Five uniforms per sample (sub-policy, the two
    probabilities, the two signs). The ops are ``RandAugment``'s and ``Invert``; warps sample
    bilinearly and results round, as there. Raises ConfigError for another policy or a bad ``fill``.
    """

    policy: str = "imagenet"
    fill: float | tuple[float, ...] = 0
    randoms: int = field(default=5, init=False)
    space: ClassVar[dict[str, tuple[Magnitudes, bool]]] = _AUTO_AUGMENT

    def __post_init__(self) -> None:
        policy = getattr(self.policy, "value", self.policy)  # torchvision's AutoAugmentPolicy enum too
        if not isinstance(policy, str) or policy.lower() not in _POLICIES:
            raise ConfigError(f"AutoAugment: policy must be one of {sorted(_POLICIES)}, got {self.policy!r}")
        object.__setattr__(self, "policy", policy.lower())
        object.__setattr__(self, "fill", _fill(self.fill, "AutoAugment: fill"))

    def steps(self, u, h, w, channels):
        h, w = np.asarray(h).reshape(-1), np.asarray(w).reshape(-1)
        u = np.asarray(u, dtype=np.float64).reshape(-1, 5)
        op, p, bins = _policy_arrays(self.policy)
        chosen = np.minimum((u[:, 0] * len(op)).astype(np.int64), len(op) - 1)
        out: list[Step] = []
        for r in range(2):
            # torchvision: an op applies when rand <= p; signs[i] == 0 negates.
            drawn = np.where(u[:, 1 + r] <= p[chosen, r], op[chosen, r], CODE["Identity"])
            magnitude = self.magnitudes(drawn, 10, bins[chosen, r], u[:, 3 + r] < 0.5, h, w)
            out += round_passes(drawn, magnitude, h, w, channels, PassWarp(self.fill))
        return out
