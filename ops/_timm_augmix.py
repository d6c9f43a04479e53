"""timm's AugMix, from the config string its users already have (``augmix-m5-w4-d2``), as a post
op each sample draws on its own.

timm's AugMix (``augment_and_mix_transform``) is torchvision's idea with timm's ops: chains of ops
drawn from timm's 13 (the "increasing" colour ops, relative translations), each op at a magnitude
drawn uniformly up to the severity, mixed as ``blend(original, sum_i w_i x chain_i, m)``. It runs
on ``AugMix``'s machinery (``_augmix.py``): the chains as rows of their own, one ``MixPass``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from headrace._errors import ConfigError

from ._augmix import Chains
from ._passes import MultiPass
from ._post_spec import _fill
from ._timm_augment import IMAGENET_FILL, LEVEL_DENOM, arguments, config_number, levels, translate_share

__all__ = ["TimmAugMix"]

# timm's _AUGMIX_TRANSFORMS, in its order (a sample's op index counts in it).
AUGMIX_OPS = ("AutoContrast", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing",
              "Equalize", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing", "ShearX", "ShearY", "TranslateXRel",
              "TranslateYRel")


@dataclass(frozen=True)
class TimmAugMix(Chains, MultiPass):
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
    step_randoms: ClassVar[int] = 4  # an op's uniforms: which op, its sign, two for its magnitude's noise

    def __post_init__(self) -> None:
        if not isinstance(self.config, str) or self.config.split("-")[0] != "augmix":
            raise ConfigError(f"TimmAugMix: config must start with 'augmix' (timm's AugMix), got {self.config!r}")
        for section in self.config.split("-")[1:]:
            key, value = (re.split(r"(\d.*)", section) + [""])[:2]  # timm's reading: key, then from the first digit
            if key == "m":
                object.__setattr__(self, "magnitude", int(config_number(value, "m", int, "TimmAugMix")))
            elif key == "w":
                object.__setattr__(self, "mixture_width", int(config_number(value, "w", int, "TimmAugMix")))
            elif key == "d":
                object.__setattr__(self, "chain_depth", int(config_number(value, "d", int, "TimmAugMix")))
            elif key == "a":
                object.__setattr__(self, "alpha", config_number(value, "a", float, "TimmAugMix"))
            elif key == "b":
                object.__setattr__(self, "blended", True)  # timm: bool(value), true for any value
            elif key == "mstd":
                object.__setattr__(self, "magnitude_std", config_number(value, "mstd", float, "TimmAugMix"))
            else:
                raise ConfigError(f"TimmAugMix: unknown section {section!r} in {self.config!r} "
                                  "(m, w, d, a, b and mstd are understood)")
        if self.mixture_width < 1 or self.magnitude < 0 or self.magnitude_std < 0:
            raise ConfigError(f"TimmAugMix: {self.config!r} needs w >= 1, m >= 0 and mstd >= 0")
        if not 0 < self.alpha < math.inf:
            raise ConfigError(f"TimmAugMix: {self.config!r} needs a positive finite alpha (a), got {self.alpha!r}")
        object.__setattr__(self, "translate_pct", translate_share(self.translate_pct, "TimmAugMix"))
        object.__setattr__(self, "fill", _fill(self.fill, "TimmAugMix: fill"))
        object.__setattr__(self, "randoms", self.chain_randoms())

    @property
    def ops(self) -> tuple[str, ...]:
        """timm's op names the chains draw from, in its order."""
        return AUGMIX_OPS

    def chain_round(self, d, h, w):
        index = np.minimum((d[:, 0] * len(AUGMIX_OPS)).astype(np.int64), len(AUGMIX_OPS) - 1)
        level = levels(self.magnitude, self.magnitude_std, LEVEL_DENOM, d[:, 2], d[:, 3])
        return arguments(AUGMIX_OPS, index, level, d[:, 1] > 0.5, h.astype(np.float64), w.astype(np.float64),
                         self.translate_pct)
