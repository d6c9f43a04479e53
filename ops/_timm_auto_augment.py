"""timm's AutoAugment, from the config string its users already have (``original-mstd0.5``,
``v0r``), as a post op each sample draws on its own.

timm's AutoAugment (``auto_augment_transform``) is the learned ImageNet policy of the AutoAugment
paper (``original``) or of the TPU EfficientNet code (``v0``), each with a variant whose posterize
discards more bits as the magnitude grows (``originalr``, ``v0r``): 25 sub-policies of two ops,
each op with its own probability and magnitude (out of 10), plus Gaussian noise on the magnitude
(``mstd``); and ``3a``, DeiT III's 3-Augment as a policy. Unlike torchvision's ``AutoAugment``
(``_auto_augment.py``), the ops are timm's: its arguments per magnitude
(``_timm_augment.arguments``), its relative translations, its fill. Each of a sub-policy's ops is
a round of the batch-wide passes of the other policies (``_passes.round_passes``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import numpy as np

from headrace._errors import ConfigError

from ._passes import CODE, MultiPass, PassWarp, round_passes
from ._post_spec import Step, _fill
from ._timm_augment import IMAGENET_FILL, LEVEL_DENOM, arguments, config_number, levels, translate_share

__all__ = ["POLICIES", "TimmAutoAugment"]

_V0 = (
    (("Equalize", 0.8, 1), ("ShearY", 0.8, 4)),
    (("Color", 0.4, 9), ("Equalize", 0.6, 3)),
    (("Color", 0.4, 1), ("Rotate", 0.6, 8)),
    (("Solarize", 0.8, 3), ("Equalize", 0.4, 7)),
    (("Solarize", 0.4, 2), ("Solarize", 0.6, 2)),
    (("Color", 0.2, 0), ("Equalize", 0.8, 8)),
    (("Equalize", 0.4, 8), ("SolarizeAdd", 0.8, 3)),
    (("ShearX", 0.2, 9), ("Rotate", 0.6, 8)),
    (("Color", 0.6, 1), ("Equalize", 1.0, 2)),
    (("Invert", 0.4, 9), ("Rotate", 0.6, 0)),
    (("Equalize", 1.0, 9), ("ShearY", 0.6, 3)),
    (("Color", 0.4, 7), ("Equalize", 0.6, 0)),
    (("Posterize", 0.4, 6), ("AutoContrast", 0.4, 7)),
    (("Solarize", 0.6, 8), ("Color", 0.6, 9)),
    (("Solarize", 0.2, 4), ("Rotate", 0.8, 9)),
    (("Rotate", 1.0, 7), ("TranslateYRel", 0.8, 9)),
    (("ShearX", 0.0, 0), ("Solarize", 0.8, 4)),
    (("ShearY", 0.8, 0), ("Color", 0.6, 4)),
    (("Color", 1.0, 0), ("Rotate", 0.6, 2)),
    (("Equalize", 0.8, 4), ("Equalize", 0.0, 8)),
    (("Equalize", 1.0, 4), ("AutoContrast", 0.6, 2)),
    (("ShearY", 0.4, 7), ("SolarizeAdd", 0.6, 7)),
    (("Posterize", 0.8, 2), ("Solarize", 0.6, 10)),  # posterize to 0 bits: a black image, as timm's
    (("Solarize", 0.6, 8), ("Equalize", 0.6, 1)),
    (("Color", 0.8, 6), ("Rotate", 0.4, 5)),
)

_ORIGINAL = (
    (("PosterizeOriginal", 0.4, 8), ("Rotate", 0.6, 9)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, 5)),
    (("Equalize", 0.8, 8), ("Equalize", 0.6, 3)),
    (("PosterizeOriginal", 0.6, 7), ("PosterizeOriginal", 0.6, 6)),
    (("Equalize", 0.4, 7), ("Solarize", 0.2, 4)),
    (("Equalize", 0.4, 4), ("Rotate", 0.8, 8)),
    (("Solarize", 0.6, 3), ("Equalize", 0.6, 7)),
    (("PosterizeOriginal", 0.8, 5), ("Equalize", 1.0, 2)),
    (("Rotate", 0.2, 3), ("Solarize", 0.6, 8)),
    (("Equalize", 0.6, 8), ("PosterizeOriginal", 0.4, 6)),
    (("Rotate", 0.8, 8), ("Color", 0.4, 0)),
    (("Rotate", 0.4, 9), ("Equalize", 0.6, 2)),
    (("Equalize", 0.0, 7), ("Equalize", 0.8, 8)),
    (("Invert", 0.6, 4), ("Equalize", 1.0, 8)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Rotate", 0.8, 8), ("Color", 1.0, 2)),
    (("Color", 0.8, 8), ("Solarize", 0.8, 7)),
    (("Sharpness", 0.4, 7), ("Invert", 0.6, 8)),
    (("ShearX", 0.6, 5), ("Equalize", 1.0, 9)),
    (("Color", 0.4, 0), ("Equalize", 0.6, 3)),
    (("Equalize", 0.4, 7), ("Solarize", 0.2, 4)),
    (("Solarize", 0.6, 5), ("AutoContrast", 0.6, 5)),
    (("Invert", 0.6, 4), ("Equalize", 1.0, 8)),
    (("Color", 0.6, 4), ("Contrast", 1.0, 8)),
    (("Equalize", 0.8, 8), ("Equalize", 0.6, 3)),
)


def _research_posterize(policy):
    """The policy with Google research's posterize (``PosterizeIncreasing``: more bits discarded as
    the magnitude grows) in place of its own: timm's ``r`` variants."""
    swap = {"Posterize": "PosterizeIncreasing", "PosterizeOriginal": "PosterizeIncreasing"}
    return tuple(tuple((swap.get(name, name), p, m) for name, p, m in sub) for sub in policy)


# DeiT III's 3-Augment as a policy: one of solarize (threshold 128), gray, and a Gaussian blur of
# sigma drawn in [0.1, 2].
_3A = ((("Solarize", 1.0, 5),), (("Desaturate", 1.0, 10),), (("GaussianBlurRand", 1.0, 10),))

# timm's policies by name: sub-policies of (op, probability, magnitude out of 10).
POLICIES = {"original": _ORIGINAL, "originalr": _research_posterize(_ORIGINAL), "v0": _V0, "v0r": _research_posterize(_V0),
            "3a": _3A}


@functools.cache
def _policy_arrays(policy: str) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray]:
    """A policy's ops by name (in the order they first appear) and its tables as (subs, ops) arrays:
    each op's index in those names, its probability, its magnitude."""
    table = POLICIES[policy]
    names = tuple(dict.fromkeys(name for sub in table for name, _, _ in sub))
    index = np.array([[names.index(name) for name, _, _ in sub] for sub in table])
    prob = np.array([[p for _, p, _ in sub] for sub in table], dtype=np.float64)
    magnitude = np.array([[m for _, _, m in sub] for sub in table], dtype=np.float64)
    return names, index, prob, magnitude


@dataclass(frozen=True)
class TimmAutoAugment(MultiPass):
    """timm's ``auto_augment_transform(config)``, as ``create_transform(auto_augment=config)``
    builds it: every sample draws one of the policy's sub-policies uniformly, then applies its ops
    in turn, each with its probability, at its magnitude out of 10 (with Gaussian noise of std
    ``mstd`` when the config has it, clipped to [0, 10]), with a random sign where the op has one.
    Policies: ``original`` (the AutoAugment paper's ImageNet policy), ``originalr`` (with Google
    research's posterize), ``v0`` (TPU EfficientNet's), ``v0r`` (25 sub-policies of two ops each),
    and ``3a`` (DeiT III's 3-Augment: solarize at 128, gray, or a Gaussian blur of sigma drawn
    uniformly in [0.1, 2], one op each). Config sections: ``mstd``.

    ``fill`` is the level where a warp reads outside the image: the dataset mean, as timm's
    ``create_transform`` passes it ((124, 116, 104) for ImageNet's, the default); ``translate_pct``
    the share of the width (height) a relative translation reaches at magnitude 10 (timm's 0.45).
    Nine uniforms per sample (five for ``3a``: the sub-policy; each op's probability, sign (the
    blur's radius) and two for its magnitude's noise). Differences from timm's PIL ops, as for
    ``TimmRandAugment``: warps sample bilinearly (timm draws bilinear or bicubic), results round
    where PIL truncates; a level or so; the blur is a true Gaussian reaching 3 sigmas with reflected
    borders, where PIL's approximates one by three box blurs over repeated edge pixels.
    Raises ConfigError for a policy or section timm would not take.
    """

    config: str = "original"
    fill: float | tuple[float, ...] = IMAGENET_FILL
    translate_pct: float = 0.45
    policy: str = field(default="original", init=False)
    magnitude_std: float = field(default=0.0, init=False)
    randoms: int = field(default=9, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.config, str):
            raise ConfigError(f"TimmAutoAugment: config must be a str such as 'original-mstd0.5', got {self.config!r}")
        name, *sections = self.config.split("-")
        if name not in POLICIES:
            raise ConfigError(f"TimmAutoAugment: unknown policy {name!r} in {self.config!r} (timm's: {', '.join(POLICIES)})")
        object.__setattr__(self, "policy", name)
        for section in sections:
            key, value = (re.split(r"(\d.*)", section) + [""])[:2]  # timm's reading: key, then from the first digit
            if key != "mstd":
                raise ConfigError(f"TimmAutoAugment: unknown section {section!r} in {self.config!r} (mstd is understood)")
            std = config_number(value, "mstd", float, "TimmAutoAugment")
            if not 0 <= std < float("inf"):
                raise ConfigError(f"TimmAutoAugment: mstd must be a finite number >= 0, got {section!r}")
            object.__setattr__(self, "magnitude_std", std)
        object.__setattr__(self, "translate_pct", translate_share(self.translate_pct, "TimmAutoAugment"))
        object.__setattr__(self, "fill", _fill(self.fill, "TimmAutoAugment: fill"))
        object.__setattr__(self, "randoms", 1 + 4 * len(POLICIES[name][0]))

    @property
    def sub_policies(self) -> tuple[tuple[tuple[str, float, int], ...], ...]:
        """The policy's sub-policies: (timm's op name, probability, magnitude) pairs."""
        return POLICIES[self.policy]

    def steps(self, u, h, w, channels):
        h, w = np.asarray(h).reshape(-1), np.asarray(w).reshape(-1)
        u = np.asarray(u, dtype=np.float64).reshape(-1, self.randoms)
        names, index, prob, magnitude = _policy_arrays(self.policy)
        chosen = np.minimum((u[:, 0] * len(index)).astype(np.int64), len(index) - 1)
        hf, wf = h.astype(np.float64), w.astype(np.float64)
        out: list[Step] = []
        for r in range(index.shape[1]):
            d = u[:, 1 + 4 * r : 5 + 4 * r]  # probability, sign, the magnitude's noise
            applied = d[:, 0] <= prob[chosen, r]  # timm skips an op when random() > p
            level = levels(magnitude[chosen, r], self.magnitude_std, LEVEL_DENOM, d[:, 2], d[:, 3])
            # The sign's uniform is also the random blur's radius: no op both has a sign and blurs.
            op, value = arguments(names, index[chosen, r], level, d[:, 1] > 0.5, hf, wf, self.translate_pct, d[:, 1])
            op = np.where(applied, op, CODE["Identity"])
            out += round_passes(op, value, h, w, channels, PassWarp(self.fill))
        return out
