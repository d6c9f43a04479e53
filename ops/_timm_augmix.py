"""timm's AugMix, from the config string its users already have (``augmix-m5-w4-d2``), as a post
op each sample draws on its own.

timm's AugMix (``augment_and_mix_transform``) is torchvision's idea with timm's ops: chains of ops
drawn from timm's 13 (the "increasing" colour ops, relative translations), each op at a magnitude
drawn uniformly up to the severity, mixed as ``blend(original, sum_i w_i x chain_i, m)``. It runs
on ``AugMix``'s machinery (``_augmix.py``): the chains as rows of their own, one ``MixPass``.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, field

import numpy as np

from headrace._errors import ConfigError

from ._augmix import RANDOM_DEPTH, chain_depths, gamma_randoms, mix_weights
from ._passes import CODE, MIX, MultiPass, PassWarp, round_passes
from ._post_spec import Step, _fill
from ._timm_augment import IMAGENET_FILL, LEVEL_DENOM, arguments, levels

__all__ = ["TimmAugMix"]

# timm's _AUGMIX_TRANSFORMS, in its order (a sample's op index counts in it).
AUGMIX_OPS = ("AutoContrast", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing",
              "Equalize", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing", "ShearX", "ShearY", "TranslateXRel",
              "TranslateYRel")
_STEP_RANDOMS = 4  # an op's uniforms: which op, its sign, two for its magnitude's noise


def _section(value: str, what: str, kind: type) -> float:
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"TimmAugMix: {what} must be {'an int' if kind is int else 'a number'}, got {value!r}") from None


@dataclass(frozen=True)
class TimmAugMix(MultiPass):
    """timm's ``augment_and_mix_transform(config)``, as ``create_transform(auto_augment=config)``
    builds it: ``w`` chains (default 3), each of ``d`` ops (``d0`` or no ``d``: one to three,
    drawn) drawn uniformly with replacement from timm's 13 AugMix ops, each at a magnitude drawn
    uniformly in [0, ``m``] (3) out of 10, or from a Gaussian of std ``mstd`` about ``m``, clipped
    to [0, 10], with a random sign where it has one. Every chain starts from the original; the
    result is ``(1 - m') x original + m' x sum_i w_i x chain_i``, ``w`` from Dirichlet(``a``, ...,
    ``a``) and ``m'`` from Beta(``a``, ``a``) (``a`` 1.0). Config sections: ``m``, ``w``, ``d``,
    ``a``, ``mstd`` and ``b`` (timm's "blended" variant: the same weights applied one chain at a
    time, so the same mix here).

    ``translate_pct`` is the share of the width (height) a translation reaches at magnitude 10:
    0.3, what ``create_transform`` passes for AugMix (timm's ops alone default to 0.45). ``fill``
    is the level where a warp reads outside the image, the dataset mean as timm's, (124, 116, 104)
    for ImageNet. Differences from timm: warps sample bilinearly (timm draws bilinear or bicubic),
    results round where PIL truncates, and the mix truncates once where timm truncates the chains'
    sum and then the blend: within a level or two. Raises ConfigError for a config timm would not
    take, or a section it does not know.
    """

    config: str = "augmix"
    fill: float | tuple[float, ...] = IMAGENET_FILL
    translate_pct: float = 0.3
    magnitude: int = field(default=3, init=False)
    mixture_width: int = field(default=3, init=False)
    chain_depth: int = field(default=-1, init=False)
    alpha: float = field(default=1.0, init=False)
    blended: bool = field(default=False, init=False)
    magnitude_std: float = field(default=math.inf, init=False)  # timm's AugMix default: uniform in [0, m]
    randoms: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.config, str) or self.config.split("-")[0] != "augmix":
            raise ConfigError(f"TimmAugMix: config must start with 'augmix' (timm's AugMix), got {self.config!r}")
        for section in self.config.split("-")[1:]:
            key, value = (re.split(r"(\d.*)", section) + [""])[:2]  # timm's reading: key, then from the first digit
            if key == "m":
                object.__setattr__(self, "magnitude", int(_section(value, "m", int)))
            elif key == "w":
                object.__setattr__(self, "mixture_width", int(_section(value, "w", int)))
            elif key == "d":
                object.__setattr__(self, "chain_depth", int(_section(value, "d", int)))
            elif key == "a":
                object.__setattr__(self, "alpha", _section(value, "a", float))
            elif key == "b":
                object.__setattr__(self, "blended", True)  # timm: bool(value), true for any value
            elif key == "mstd":
                object.__setattr__(self, "magnitude_std", _section(value, "mstd", float))
            else:
                raise ConfigError(f"TimmAugMix: unknown section {section!r} in {self.config!r} "
                                  "(m, w, d, a, b and mstd are understood)")
        if self.mixture_width < 1 or self.magnitude < 0 or self.magnitude_std < 0:
            raise ConfigError(f"TimmAugMix: {self.config!r} needs w >= 1, m >= 0 and mstd >= 0")
        if not 0 < self.alpha < math.inf:
            raise ConfigError(f"TimmAugMix: {self.config!r} needs a positive finite alpha (a), got {self.alpha!r}")
        pct = self.translate_pct
        if isinstance(pct, bool) or not isinstance(pct, numbers.Real) or not 0 <= pct < math.inf:
            raise ConfigError(f"TimmAugMix: translate_pct must be a number >= 0, got {pct!r}")
        object.__setattr__(self, "translate_pct", float(pct))
        object.__setattr__(self, "fill", _fill(self.fill, "TimmAugMix: fill"))
        object.__setattr__(self, "randoms", self.mixture_width * self._chain_randoms
                           + (self.mixture_width + 2) * gamma_randoms(self.alpha))

    @property
    def ops(self) -> tuple[str, ...]:
        """timm's op names the chains draw from, in its order."""
        return AUGMIX_OPS

    @property
    def _depth(self) -> int:
        return self.chain_depth if self.chain_depth > 0 else RANDOM_DEPTH

    @property
    def _chain_randoms(self) -> int:
        return 1 + _STEP_RANDOMS * self._depth  # the depth, then each op's

    def weights(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The samples' mixing weights from their uniforms: (n,) for the original (``1 - m'``) and
        (n, width) for the chains (``m' x w_i``)."""
        return mix_weights(self.alpha, self.mixture_width, np.asarray(u)[:, self.mixture_width * self._chain_randoms :])

    def steps(self, u, h, w, channels):
        h, w = np.asarray(h).reshape(-1), np.asarray(w).reshape(-1)
        n, width = len(h), self.mixture_width
        u = np.asarray(u, dtype=np.float64).reshape(n, self.randoms)
        original, chains = self.weights(u)
        # The chains as rows of their own (row i W + c: sample i's chain c), as AugMix's.
        draws = u[:, : width * self._chain_randoms].reshape(n * width, self._chain_randoms)
        rows_h, rows_w = np.repeat(h, width), np.repeat(w, width)
        depth = chain_depths(draws[:, 0], self.chain_depth)
        warp = PassWarp(self.fill)
        chain_steps: list[Step] = []
        for r in range(self._depth):
            d = draws[:, 1 + _STEP_RANDOMS * r : 1 + _STEP_RANDOMS * (r + 1)]
            index = np.minimum((d[:, 0] * len(AUGMIX_OPS)).astype(np.int64), len(AUGMIX_OPS) - 1)
            level = levels(self.magnitude, self.magnitude_std, LEVEL_DENOM, d[:, 2], d[:, 3])
            op, magnitude = arguments(AUGMIX_OPS, index, level, d[:, 1] > 0.5, rows_h.astype(np.float64),
                                      rows_w.astype(np.float64), self.translate_pct)
            op = np.where(r < depth, op, CODE["Identity"])  # the chain has ended for this row
            chain_steps += round_passes(op, magnitude, rows_h, rows_w, channels, warp)
        return [(MIX, (np.column_stack([original, chains]), chain_steps))]
