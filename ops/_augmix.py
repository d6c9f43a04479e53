"""torchvision's ``AugMix`` as a post op each sample draws on its own: a few chains of one to three
ops, each run from the original image, mixed with it by Dirichlet and Beta weights.

Each chain is a row of its own (a batch of n samples has n x width chains), so a round of every
chain is the batch-wide passes of the other policies (``_passes.round_passes``: each row applies
the op it drew, or the identity once its chain is shorter); one ``MixPass`` holds the chains'
passes and the weights, and the executors mix the chains with the original in one step.

The weights come from Gamma variates made of the sample's uniform numbers (``gamma``), so a
sample's mix is the same on every executor and in every batching, as its ops are.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from headrace._errors import ConfigError

from ._auto_augment import Magnitudes, _Policy, _Range, _whole, space_codes
from ._passes import CODE, MIX, PassWarp, round_passes
from ._post_spec import Step, _fill

__all__ = ["AugMix", "Chains", "chain_depths", "gamma", "gamma_randoms", "log_gamma", "mix_weights"]

_PARAMETER_MAX = 10  # torchvision's bins: severity s draws a bin from the first s of them
RANDOM_DEPTH = 3  # a chain of random depth has one to three ops
_TRIES = 6  # Marsaglia-Tsang proposals per Gamma variate: all six rejected has probability below 1e-7

# torchvision's AugMix space, in its order (a sample's op index counts in it); ``all_ops`` adds the
# four enhancements. Translations reach a third of the image's width or height.
_AUGMIX_BASE: dict[str, tuple[Magnitudes, bool]] = {
    "ShearX": (_Range(0.0, 0.3), True),
    "ShearY": (_Range(0.0, 0.3), True),
    "TranslateX": (_Range(0.0, 1.0, side=1, scale=1.0 / 3.0), True),
    "TranslateY": (_Range(0.0, 1.0, side=0, scale=1.0 / 3.0), True),
    "Rotate": (_Range(0.0, 30.0), True),
    "Posterize": (_Range(posterize=4, bits=4), False),
    "Solarize": (_Range(255.0, 0.0), False),
    "AutoContrast": (None, False),
    "Equalize": (None, False),
}
_AUGMIX_ALL = {**_AUGMIX_BASE, **{name: (_Range(0.0, 0.9), True) for name in ("Brightness", "Color", "Contrast", "Sharpness")}}


def gamma(alpha: float, u: np.ndarray) -> np.ndarray:
    """(n,) Gamma(alpha, 1) variates from (n, k) uniforms in [0, 1): ``k`` is 1 for alpha 1 (an
    exponential), else ``1 + 3 * _TRIES``: Marsaglia and Tsang's method (a normal from two
    uniforms by Box-Muller, a third to accept), boosted by ``u ** (1 / alpha)`` below 1. A row
    whose every proposal is rejected takes ``d = a - 1/3``, near the median of Gamma(a) for the
    ``a`` the method draws from (probability below 1e-7)."""
    u = np.asarray(u, dtype=np.float64)
    if alpha == 1.0:
        return -np.log1p(-u[:, 0])
    a = alpha if alpha >= 1.0 else alpha + 1.0
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    out = np.full(len(u), d)
    pending = np.ones(len(u), dtype=bool)
    for t in range(_TRIES):
        u1, u2, u3 = u[:, 1 + 3 * t], u[:, 2 + 3 * t], u[:, 3 + 3 * t]
        x = np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2)
        v = (1.0 + c * x) ** 3
        with np.errstate(invalid="ignore", divide="ignore"):
            ok = (v > 0) & (np.log1p(-u3) < 0.5 * x * x + d - d * v + d * np.log(np.where(v > 0, v, 1.0)))
        take = pending & ok
        out[take] = d * v[take]
        pending &= ~ok
    if alpha < 1.0:
        out *= (1.0 - u[:, 0]) ** (1.0 / alpha)  # 1 - u lies in (0, 1]
    return out


def log_gamma(alpha: float, u: np.ndarray) -> np.ndarray:
    """(n,) the logarithms of ``gamma(alpha, u)``'s variates, finite where a variate itself
    underflows to 0: below alpha 1, ``u ** (1 / alpha)`` does for alpha near 0.01 about once in
    a thousand draws. (-inf only where alpha is 1 and the uniform is exactly 0.)"""
    u = np.asarray(u, dtype=np.float64)
    with np.errstate(divide="ignore"):
        if alpha == 1.0:
            return np.log(-np.log1p(-u[:, 0]))
        if alpha > 1.0:
            return np.log(gamma(alpha, u))
        return np.log(gamma(alpha + 1.0, u)) + np.log1p(-u[:, 0]) / alpha


def _shares(logs: list[np.ndarray]) -> list[np.ndarray]:
    """Each of ``logs``' variates over their sum, computed from their logarithms; equal shares
    where every one is -inf."""
    top = np.maximum.reduce(logs)
    top = np.where(np.isfinite(top), top, 0.0)
    parts = [np.exp(x - top) for x in logs]
    total = sum(parts)
    none = total == 0
    return [np.where(none, 1.0 / len(parts), x / np.where(none, 1.0, total)) for x in parts]


def gamma_randoms(alpha: float) -> int:
    """The uniforms ``gamma`` takes for one variate of Gamma(alpha)."""
    return 1 if alpha == 1.0 else 1 + 3 * _TRIES


def mix_weights(alpha: float, width: int, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """AugMix's weights from (n, (width + 2) x ``gamma_randoms(alpha)``) uniforms: (n,) for the
    original and (n, width) for the chains, the chains' Dirichlet(alpha, ...) weights times the
    mix's weight; the mix's and the original's are Dirichlet(alpha, alpha), a Beta pair."""
    u = np.asarray(u, dtype=np.float64)
    g = gamma_randoms(alpha)
    draws = [gamma(alpha, u[:, j * g : (j + 1) * g]) for j in range(width + 2)]
    beta = draws[0] + draws[1]
    chains = np.stack(draws[2:], axis=1)
    total = chains.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        chains = chains / total * (draws[1] / beta)[:, None]
        original = draws[0] / beta
    # A Beta pair or the chains' Dirichlet all underflowed to 0 (alpha far below 1): those rows
    # again from the variates' logarithms, the same weights without the 0 / 0.
    degenerate = ~(beta > 0) | ~(total[:, 0] > 0)
    if degenerate.any():
        rows = u[degenerate]
        logs = [log_gamma(alpha, rows[:, j * g : (j + 1) * g]) for j in range(width + 2)]
        mine, mix = _shares(logs[:2])
        original[degenerate] = mine
        chains[degenerate] = np.stack(_shares(logs[2:]), axis=1) * mix[:, None]
    return original, chains


def chain_depths(u: np.ndarray, chain_depth: int) -> np.ndarray:
    """Each chain's number of ops: ``chain_depth`` when positive, else one to three from its uniform."""
    if chain_depth > 0:
        return np.full(len(u), chain_depth)
    return 1 + np.minimum((np.asarray(u) * RANDOM_DEPTH).astype(np.int64), RANDOM_DEPTH - 1)


class Chains:
    """What torchvision's and timm's AugMix share (``AugMix``, ``TimmAugMix``): ``mixture_width``
    chains of ``chain_depth`` ops (one to three, drawn, when it is not positive), each chain a row
    of its own, mixed with the original by ``mix_weights(alpha, ...)``. A kind says how many
    uniforms an op of a chain takes (``step_randoms``) and which ops and magnitudes a round of
    chains applies (``chain_round``). A sample's uniforms: each chain's depth and then its ops',
    chain after chain, then the Gamma variates' (``chain_randoms``)."""

    step_randoms: ClassVar[int]

    @property
    def _depth(self) -> int:
        return self.chain_depth if self.chain_depth > 0 else RANDOM_DEPTH

    @property
    def _chain_randoms(self) -> int:
        return 1 + self.step_randoms * self._depth  # the depth, then each op's

    def chain_randoms(self) -> int:
        """The uniforms a sample takes: its chains', then its weights'."""
        return self.mixture_width * self._chain_randoms + (self.mixture_width + 2) * gamma_randoms(self.alpha)

    def weights(self, u: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The samples' mixing weights from their uniforms: (n,) for the original and (n, width)
        for the chains (the chains' Dirichlet weights times the Beta weight of the mix)."""
        return mix_weights(self.alpha, self.mixture_width, np.asarray(u)[:, self.mixture_width * self._chain_randoms :])

    def chain_round(self, d: np.ndarray, h: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The op codes (``_passes.CODE``) and signed magnitudes a round of chains applies, from
        each chain's (rows, ``step_randoms``) uniforms of that round; ``h``, ``w`` its image's size."""
        raise NotImplementedError

    def steps(self, u, h, w, channels):
        h, w = np.asarray(h).reshape(-1), np.asarray(w).reshape(-1)
        n, width = len(h), self.mixture_width
        u = np.asarray(u, dtype=np.float64).reshape(n, self.randoms)
        original, chains = self.weights(u)
        # The chains as rows of their own (row i W + c: sample i's chain c), so that a round of every
        # chain of the batch is one set of passes, not one a chain.
        draws = u[:, : width * self._chain_randoms].reshape(n * width, self._chain_randoms)
        rows_h, rows_w = np.repeat(h, width), np.repeat(w, width)
        depth = chain_depths(draws[:, 0], self.chain_depth)
        warp = PassWarp(self.fill)
        k = self.step_randoms
        chain_steps: list[Step] = []
        for r in range(self._depth):
            op, magnitude = self.chain_round(draws[:, 1 + k * r : 1 + k * (r + 1)], rows_h, rows_w)
            op = np.where(r < depth, op, CODE["Identity"])  # the chain has ended for this row
            chain_steps += round_passes(op, magnitude, rows_h, rows_w, channels, warp)
        return [(MIX, (np.column_stack([original, chains]), chain_steps))]


@dataclass(frozen=True)
class AugMix(Chains, _Policy):
    """torchvision's ``AugMix``: ``mixture_width`` chains, each of ``chain_depth`` ops (one to three,
    drawn, when it is not positive) drawn uniformly from torchvision's space (shears, translations
    up to a third of the image, rotation, posterize, solarize, autocontrast, equalize; with
    ``all_ops`` brightness, color, contrast and sharpness too), each op at a bin drawn from the
    first ``severity`` of 10 and a random sign where it has one. Every chain starts from the
    original; the result is ``m0 x original + m1 sum_i w_i x chain_i`` with ``(m0, m1)`` drawn
    from Dirichlet(alpha, alpha) and ``w`` from Dirichlet(alpha, ..., alpha), truncated to uint8.

    Each sample draws its own chains and weights. As the other policies, warps sample bilinearly
    (torchvision's AugMix default) and an op's result rounds where torchvision truncates: within a
    level. ``fill`` is the level (or one per channel) where a warp reads outside the image. Boxes
    and masks cannot follow it. Raises ConfigError for arguments out of range.
    """

    severity: int = 3
    mixture_width: int = 3
    chain_depth: int = -1
    alpha: float = 1.0
    all_ops: bool = True
    fill: float | tuple[float, ...] = 0
    randoms: int = field(default=0, init=False)
    step_randoms: ClassVar[int] = 3  # an op's uniforms: which op, its bin, its sign

    def __post_init__(self) -> None:
        severity = _whole(self.severity, "AugMix: severity", 1)
        if severity > _PARAMETER_MAX:
            raise ConfigError(f"AugMix: severity must be in [1, {_PARAMETER_MAX}], got {self.severity!r}")
        object.__setattr__(self, "severity", severity)
        object.__setattr__(self, "mixture_width", _whole(self.mixture_width, "AugMix: mixture_width", 1))
        if isinstance(self.chain_depth, bool) or not isinstance(self.chain_depth, numbers.Integral):
            raise ConfigError(f"AugMix: chain_depth must be an int (not positive: one to three ops, drawn), "
                              f"got {self.chain_depth!r}")
        object.__setattr__(self, "chain_depth", int(self.chain_depth))
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 < alpha < math.inf:
            raise ConfigError(f"AugMix: alpha must be a positive finite number, got {alpha!r}")
        object.__setattr__(self, "alpha", float(alpha))
        if not isinstance(self.all_ops, bool):
            raise ConfigError(f"AugMix: all_ops must be a bool, got {self.all_ops!r}")
        object.__setattr__(self, "fill", _fill(self.fill, "AugMix: fill"))
        object.__setattr__(self, "randoms", self.chain_randoms())

    @property
    def space(self) -> dict[str, tuple[Magnitudes, bool]]:  # type: ignore[override]
        return _AUGMIX_ALL if self.all_ops else _AUGMIX_BASE

    def chain_round(self, d, h, w):
        op_u, bin_u, sign_u = d[:, 0], d[:, 1], d[:, 2]
        magnitude_bin = np.minimum((bin_u * self.severity).astype(np.int64), self.severity - 1)
        space = space_codes(self.space)
        op = space[np.minimum((op_u * len(space)).astype(np.int64), len(space) - 1)]
        return op, self.magnitudes(op, _PARAMETER_MAX, magnitude_bin, sign_u >= 0.5, h, w)
