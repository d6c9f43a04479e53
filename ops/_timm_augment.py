"""timm's RandAugment, from the config string its users already have (``rand-m9-mstd0.5-inc1``,
the DeiT, Swin and ConvNeXt recipes), as a post op each sample draws on its own.

timm's variant differs from torchvision's (``_auto_augment.py``): each of the ``n`` layers applies
its op only with probability ``p``, the magnitude gets Gaussian noise per draw (``mstd``), the
"increasing" op set grows every op's strength with the magnitude, and warps fill with the
ImageNet mean. Each layer becomes the same batch-wide passes as torchvision's policies
(``_passes.py``).
"""

from __future__ import annotations

import functools
import math
import numbers
import re
from dataclasses import dataclass, field

import numpy as np

from headrace._errors import ConfigError

from ._passes import CODE, MultiPass, PassWarp, round_passes
from ._post_spec import Step, _fill
from ._spec import IMAGENET_MEAN

__all__ = ["TimmRandAugment"]

LEVEL_DENOM = 10.0  # timm's magnitude scale: M10 is the full strength of an op

# timm's op sets, in its order (a sample's op index counts in it).
_PLAIN = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd", "Color",
          "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
_INCREASING = ("AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing",
               "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing", "SharpnessIncreasing",
               "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")

# Older timm's only weighted op set (``w0``), by the plain set's names; it weighs the increasing set's
# ops by position, as timm does (its weights are looked up by the plain names whatever the set).
_CHOICE_WEIGHTS_0 = {"Rotate": 0.3, "ShearX": 0.2, "ShearY": 0.2, "TranslateXRel": 0.1, "TranslateYRel": 0.1,
                     "Color": 0.025, "Sharpness": 0.025, "AutoContrast": 0.025, "Solarize": 0.005, "SolarizeAdd": 0.005,
                     "Contrast": 0.005, "Brightness": 0.005, "Equalize": 0.005, "Posterize": 0.0, "Invert": 0.0}

# Later timm's named op sets with weights (``t<name>``; it dropped ``w``): the ops are the dict's keys,
# in its order, each drawn with its weight over the sum. ``3aw``: DeiT III's 3-Augment ops weighted
# among the others.
_WEIGHTED_SETS = {
    "weights": {"Rotate": 3, "ShearX": 2, "ShearY": 2, "TranslateXRel": 1, "TranslateYRel": 1, "ColorIncreasing": 0.25,
                "SharpnessIncreasing": 0.25, "AutoContrast": 0.25, "SolarizeIncreasing": 0.05, "SolarizeAdd": 0.05,
                "ContrastIncreasing": 0.05, "BrightnessIncreasing": 0.05, "Equalize": 0.05, "PosterizeIncreasing": 0.05,
                "Invert": 0.05},
    "3aw": {"SolarizeIncreasing": 6, "Desaturate": 6, "GaussianBlur": 6, "Rotate": 3, "ShearX": 2, "ShearY": 2,
            "PosterizeIncreasing": 1, "AutoContrast": 1, "ColorIncreasing": 1, "SharpnessIncreasing": 1,
            "ContrastIncreasing": 1, "BrightnessIncreasing": 1, "Equalize": 1, "Invert": 1},
}
# Its named op sets drawn uniformly (``t3a``: DeiT III's 3-Augment, solarize, desaturate and blur).
_LISTED_SETS = {"3a": ("SolarizeIncreasing", "Desaturate", "GaussianBlur")}

# timm's create_transform fills warps with the dataset mean in levels: (124, 116, 104) for ImageNet.
IMAGENET_FILL = tuple(min(255, round(255 * m)) for m in IMAGENET_MEAN)


# timm's LEVEL_TO_ARG as rules over a whole batch (f = level / 10, s = the random sign, +-1, t =
# hparams' translate_pct, e = a uniform for an op that draws once more), in round_passes'
# convention (factors as f - 1, translations in input pixels, blurs as their sigma): each op names
# the pass op it becomes and its rule.
_RULES = (
    ("none", lambda f, s, h, w, t, e: np.zeros_like(f)),
    ("rotate", lambda f, s, h, w, t, e: s * f * 30.0),
    ("shear", lambda f, s, h, w, t, e: s * f * 0.3),
    ("shift_x", lambda f, s, h, w, t, e: s * f * t * w),  # a share of the width, not whole pixels
    ("shift_y", lambda f, s, h, w, t, e: s * f * t * h),
    ("posterize", lambda f, s, h, w, t, e: np.trunc(f * 4)),
    ("posterize_inc", lambda f, s, h, w, t, e: 4 - np.trunc(f * 4)),
    ("posterize_orig", lambda f, s, h, w, t, e: np.trunc(f * 4) + 4),  # AutoAugment's: 4 to 8 bits kept
    ("solarize", lambda f, s, h, w, t, e: np.minimum(256, np.trunc(f * 256))),
    ("solarize_inc", lambda f, s, h, w, t, e: 256 - np.minimum(256, np.trunc(f * 256))),
    ("solarize_add", lambda f, s, h, w, t, e: np.minimum(128, np.trunc(f * 110))),
    ("enhance", lambda f, s, h, w, t, e: f * 1.8 + 0.1 - 1.0),  # factor in [0.1, 1.9]
    ("enhance_inc", lambda f, s, h, w, t, e: np.maximum(0.1, 1.0 + s * f * 0.9) - 1.0),  # 1 +- 0.9 f, at least 0.1
    # Desaturate: colour at 1 - (0.5 + 0.5 f), clipped to [0, 1]: gray at f = 1.
    ("desaturate", lambda f, s, h, w, t, e: np.clip(0.5 - 0.5 * f, 0.0, 1.0) - 1.0),
    ("blur", lambda f, s, h, w, t, e: 0.1 + 1.9 * f),  # GaussianBlur: sigma (PIL's radius) 0.1 to 2
    ("blur_rand", lambda f, s, h, w, t, e: 0.1 + e * (2.0 * f - 0.1)),  # GaussianBlurRand: uniform(0.1, 2 f)
)
TRANSLATE_PCT = 0.45  # timm's default reach of TranslateXRel / YRel: 0.45 of the width or height
_RULE = {name: k for k, (name, _) in enumerate(_RULES)}
_OPS = {  # timm's name: (pass op, rule)
    "AutoContrast": ("AutoContrast", "none"), "Equalize": ("Equalize", "none"), "Invert": ("Invert", "none"),
    "Rotate": ("Rotate", "rotate"), "ShearX": ("ShearX", "shear"), "ShearY": ("ShearY", "shear"),
    "TranslateXRel": ("ShiftX", "shift_x"), "TranslateYRel": ("ShiftY", "shift_y"),
    "Posterize": ("Posterize", "posterize"), "PosterizeIncreasing": ("Posterize", "posterize_inc"),
    "PosterizeOriginal": ("Posterize", "posterize_orig"),
    "Desaturate": ("Color", "desaturate"), "GaussianBlur": ("Blur", "blur"), "GaussianBlurRand": ("Blur", "blur_rand"),
    "Solarize": ("Solarize", "solarize"), "SolarizeIncreasing": ("Solarize", "solarize_inc"),
    "SolarizeAdd": ("SolarizeAdd", "solarize_add"),
    **{name: (name, "enhance") for name in ("Color", "Contrast", "Brightness", "Sharpness")},
    **{name + "Increasing": (name, "enhance_inc") for name in ("Color", "Contrast", "Brightness", "Sharpness")},
}


@functools.cache
def _op_arrays(ops: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Each op's pass-op code and rule index."""
    return np.array([CODE[_OPS[name][0]] for name in ops]), np.array([_RULE[_OPS[name][1]] for name in ops])


def arguments(ops: tuple[str, ...], index: np.ndarray, level: np.ndarray, negative: np.ndarray, h: np.ndarray,
              w: np.ndarray, translate_pct: float = TRANSLATE_PCT, extra: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
    """timm's ``LEVEL_TO_ARG`` for sample i's op ``ops[index[i]]`` at ``level[i]``: the pass ops'
    codes and magnitudes, every rule computed over the batch and each sample's picked. ``extra``:
    each sample's uniform for an op that draws once more (``GaussianBlurRand``'s radius)."""
    code, rule = _op_arrays(ops)
    f, s = level / LEVEL_DENOM, np.where(negative, -1.0, 1.0)
    e = extra if extra is not None else np.full(f.shape, 0.5)  # no op of theirs reads it
    values = np.stack([fn(f, s, h, w, translate_pct, e) for _, fn in _RULES])
    return code[index], values[rule[index], np.arange(len(index))]


def levels(magnitude: float | np.ndarray, std: float, maximum: float, noise_a: np.ndarray,
           noise_b: np.ndarray) -> np.ndarray:
    """timm's ``AugmentOp`` magnitude for each draw: ``magnitude`` (one for all, or each draw's),
    with Gaussian noise of ``std`` (Box-Muller on two uniforms) or uniform in [0, magnitude]
    (``std`` infinite), clipped to [0, ``maximum``]."""
    if np.ndim(magnitude) == 0:
        level = np.full(len(noise_a), float(magnitude))
    else:
        level = np.array(magnitude, dtype=np.float64)
    if math.isinf(std):
        level = noise_a * magnitude
    elif std > 0:
        level = level + std * np.sqrt(-2.0 * np.log1p(-noise_a)) * np.cos(2.0 * math.pi * noise_b)
    return np.clip(level, 0.0, maximum)


def config_number(value: str, what: str, kind: type, owner: str = "TimmRandAugment") -> float:
    """A timm config section's value as ``kind`` (int or float); ConfigError naming ``owner``
    where it is not one."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"{owner}: {what} must be {'an int' if kind is int else 'a number'}, got {value!r}") from None


def translate_share(value: object, owner: str) -> float:
    """A ``translate_pct`` (the share of the side a translation reaches at magnitude 10) as a float;
    ConfigError naming ``owner`` where it is not a number >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
        raise ConfigError(f"{owner}: translate_pct must be a number >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TimmRandAugment(MultiPass):
    """timm's ``rand_augment_transform(config)``: ``n`` layers (default 2), each applying, with
    probability ``p`` (0.5), one op drawn uniformly (with replacement) from timm's 15 at magnitude
    ``m`` (10) out of 10, the magnitude drawn per sample and layer from a Gaussian of std ``mstd``
    (0; over 100: uniform in [0, m]) and clipped to [0, ``mmax``] (10). ``inc1`` takes the ops
    whose strength increases with the magnitude (``PosterizeIncreasing``...), as the DeiT recipe's
    ``rand-m9-mstd0.5-inc1`` does. Config sections: ``m``, ``n``, ``p``, ``mstd``, ``mmax``,
    ``inc``, ``w0`` (older timm's weighted op choice: its one set of weights, mostly the warps, never
    posterize or invert), ``tweights`` (later timm's, which dropped ``w``: the increasing ops,
    all weighted, the warps most), ``t3a`` (DeiT III's 3-Augment: increasing solarize, desaturate,
    Gaussian blur of sigma 0.1 to 2 with the magnitude, drawn uniformly) and ``t3aw`` (those three
    weighted 6 among the warps and the increasing ops). With weights each layer draws a different
    op, as timm's ``np.random.choice`` without replacement does.

    ``fill`` is the level where a warp reads outside the image: timm's ``create_transform`` passes
    the dataset mean, (124, 116, 104) for ImageNet's, the default here. Five uniforms per sample and
    layer (op, probability, sign, two for the magnitude's noise). Differences from timm's PIL ops:
    warps sample bilinearly (timm draws bilinear or bicubic), results round where PIL truncates,
    and gray uses torchvision's weights; a level or so apart. ``inc0`` means the plain ops (timm
    reads any ``inc`` as increasing). Raises ConfigError for a config timm would not take.
    """

    config: str = "rand-m9-mstd0.5-inc1"
    fill: float | tuple[float, ...] = IMAGENET_FILL
    magnitude: float = field(default=10.0, init=False)
    num_layers: int = field(default=2, init=False)
    prob: float = field(default=0.5, init=False)
    magnitude_std: float = field(default=0.0, init=False)
    magnitude_max: float = field(default=LEVEL_DENOM, init=False)
    increasing: bool = field(default=False, init=False)
    weighted: bool = field(default=False, init=False)  # w0
    transforms: str = field(default="", init=False)  # t<name>: one of _WEIGHTED_SETS
    randoms: int = field(default=10, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.config, str) or self.config.split("-")[0] != "rand":
            raise ConfigError(f"TimmRandAugment: config must start with 'rand' (timm's RandAugment), got {self.config!r}")
        for section in self.config.split("-")[1:]:
            key, value = (re.split(r"(\d.*)", section) + [""])[:2]
            if key == "m":
                object.__setattr__(self, "magnitude", config_number(value, "m", float))
            elif key == "n":
                object.__setattr__(self, "num_layers", int(config_number(value, "n", int)))
            elif key == "p":
                object.__setattr__(self, "prob", config_number(value, "p", float))
            elif key == "mstd":
                std = config_number(value, "mstd", float)
                object.__setattr__(self, "magnitude_std", math.inf if std > 100 else std)
            elif key == "mmax":
                object.__setattr__(self, "magnitude_max", config_number(value, "mmax", float))
            elif key == "inc":
                object.__setattr__(self, "increasing", bool(int(config_number(value, "inc", int))))
            elif key == "w":
                if config_number(value, "w", int) != 0:
                    raise ConfigError(f"TimmRandAugment: timm has one set of op weights, w0; got {section!r}")
                object.__setattr__(self, "weighted", True)
            elif section.startswith("t"):  # a name, not a number: timm reads the rest of the section
                self._set_transforms(section[1:])
            else:
                raise ConfigError(f"TimmRandAugment: unknown section {section!r} in {self.config!r} "
                                  "(m, n, p, mstd, mmax, inc, w and t are understood)")
        if self.weighted and self.transforms:
            raise ConfigError(f"TimmRandAugment: {self.config!r} has both w0 (older timm's weights) and "
                              f"t{self.transforms} (later timm's, which has no w): give one")
        if self.num_layers < 0 or not 0.0 <= self.prob <= 1.0 or self.magnitude < 0 or self.magnitude_std < 0:
            raise ConfigError(f"TimmRandAugment: {self.config!r} needs n >= 0, p in [0, 1], m >= 0 and mstd >= 0")
        weights = self.choice_weights
        if weights is not None and self.num_layers > np.count_nonzero(weights):
            raise ConfigError(f"TimmRandAugment: {self.config!r} draws {self.num_layers} different ops a sample, "
                              f"but its weights have only {np.count_nonzero(weights)} above zero")
        object.__setattr__(self, "fill", _fill(self.fill, "TimmRandAugment: fill"))
        object.__setattr__(self, "randoms", 5 * self.num_layers)

    def _set_transforms(self, name: str) -> None:
        if name not in _WEIGHTED_SETS and name not in _LISTED_SETS:
            # timm itself would take the default set for a name it does not know: a typo passes there.
            known = ", ".join("t" + n for n in (*_WEIGHTED_SETS, *_LISTED_SETS))
            raise ConfigError(f"TimmRandAugment: unknown op set t{name} in {self.config!r} (known: {known})")
        object.__setattr__(self, "transforms", name)

    @property
    def ops(self) -> tuple[str, ...]:
        """timm's op names this config draws from, in its order."""
        if self.transforms in _LISTED_SETS:
            return _LISTED_SETS[self.transforms]
        if self.transforms:
            return tuple(_WEIGHTED_SETS[self.transforms])
        return _INCREASING if self.increasing else _PLAIN

    @property
    def choice_weights(self) -> np.ndarray | None:
        """Each op's chance of being drawn (``ops``' order) with ``w0`` or a ``t`` set of weights,
        else None (uniform)."""
        if self.transforms in _WEIGHTED_SETS:
            weights = np.array(list(_WEIGHTED_SETS[self.transforms].values()), dtype=np.float64)
        elif self.weighted:
            weights = np.array([_CHOICE_WEIGHTS_0[name] for name in _PLAIN])
        else:
            return None
        return weights / weights.sum()

    def _indices(self, u: np.ndarray) -> list[np.ndarray]:
        """Each layer's op indices (n each) from its first uniform: uniform with replacement, or with
        weights (``w0``, ``tweights``) by weight, a sample's ops all different (each layer drawn
        among the ops it has not drawn yet). A layer at a time: loops of n elements keep the GIL
        (``_gil.py``)."""
        count = len(self.ops)
        choice = self.choice_weights
        if choice is None:
            return [np.minimum((u[:, layer, 0] * count).astype(np.int64), count - 1) for layer in range(self.num_layers)]
        weights = [np.full(len(u), w) for w in choice]  # a column an op
        out = []
        for layer in range(self.num_layers):
            point = u[:, layer, 0] * sum(weights)
            index, below = np.zeros(len(u), dtype=np.int64), np.zeros(len(u))
            for column in weights[:-1]:  # the first op whose cumulative weight passes the point
                below += column
                index += below <= point
            out.append(index)
            for j, column in enumerate(weights):
                column[index == j] = 0.0
        return out

    def levels(self, noise_a: np.ndarray, noise_b: np.ndarray) -> np.ndarray:
        """Each draw's magnitude: ``m``, with Gaussian noise (Box-Muller on two uniforms) or
        uniform in [0, m] (``mstd`` over 100), clipped to [0, ``mmax``]."""
        return levels(self.magnitude, self.magnitude_std, self.magnitude_max, noise_a, noise_b)

    def steps(self, u, h, w, channels):
        if self.num_layers == 0:
            return []
        h, w = np.asarray(h).reshape(-1), np.asarray(w).reshape(-1)
        u = np.asarray(u, dtype=np.float64).reshape(-1, self.num_layers, 5)
        ops = self.ops
        indices = self._indices(u)
        out: list[Step] = []
        for layer in range(self.num_layers):
            d = u[:, layer]
            index = indices[layer]
            applied = d[:, 1] <= self.prob  # timm skips a layer when random() > p
            level = self.levels(d[:, 3], d[:, 4])
            op, magnitude = arguments(ops, index, level, d[:, 2] > 0.5, h.astype(np.float64), w.astype(np.float64))
            op = np.where(applied, op, CODE["Identity"])
            out += round_passes(op, magnitude, h, w, channels, PassWarp(self.fill))
        return out
