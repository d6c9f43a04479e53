"""MixUp and CutMix: each image of a batch mixed with the one before it, and its label with it.

Both are ``MapBatch`` stages, so they stand after the last built-in op and run wherever a
``MapBatch`` runs: on the GPU path in the lane that made the batch, on its stream, with no host
wait. Their random numbers are the stage's ``rng`` (keyed by seed, epoch, the stage's place and
the batch's index), drawn in the same order whether the batch is mixed or not: a seed gives the
same mixes on either device, with any thread count, and after a resume.

The pairs are torchvision's (``transforms.v2.MixUp``/``CutMix``): row i with row i - 1, the first
with the last (``roll(1, 0)``). The labels become soft: ``[B, num_classes]`` float32, one-hot
(smoothed with ``label_smoothing`` as timm's ``Mixup`` does: ``1 - s + s / K`` and ``s / K``) and
mixed by the same weight as the pixels. A batch already soft (a ``MixUp`` before a ``CutMix``)
mixes as it is.

A label outside ``[0, num_classes)`` is a ``ValueError`` on the CPU naming the sample (a
``TransformError`` for each row of the batch, under the loader's ``on_error``). On the GPU the stage does not read labels back (that
would make the lane wait for the GPU): such a row's soft label is NaN, so the loss shows it at once,
where ``one_hot`` or a cross-entropy would stop the process with a device-side assert.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from headrace._errors import ConfigError, require_int

from ._post_spec import _finite, _probability
from ._stages import MapBatch

__all__ = ["CutMix", "MixUp"]


class _Mix(MapBatch):
    """What MixUp and CutMix share: the arguments, the soft labels, the draw of a batch's weight."""

    def __init__(self, alpha: float, *, num_classes: int, p: float, label_smoothing: float) -> None:
        kind = type(self).__name__
        self.alpha = _finite(alpha, f"{kind}: alpha")
        if self.alpha <= 0:
            raise ConfigError(f"{kind}: alpha must be positive (the Beta distribution's), got {alpha!r}")
        self.num_classes = require_int(f"{kind}: num_classes", num_classes)
        self.p = _probability(p, f"{kind}: p")
        self.label_smoothing = _finite(label_smoothing, f"{kind}: label_smoothing")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"{kind}: label_smoothing must be in [0, 1), got {label_smoothing!r}")
        self._classes: dict[torch.device, torch.Tensor] = {}  # arange(num_classes) per device, made once
        super().__init__(self._mix, name=kind)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(alpha={self.alpha:g}, num_classes={self.num_classes}, p={self.p:g}, "
                f"label_smoothing={self.label_smoothing:g})")

    def _mix(self, batch: dict[str, Any], rng: np.random.Generator, layout: str, keys: list[str]) -> dict[str, Any]:
        # Every draw is made, mixed or not, so the next batches' numbers never depend on this one.
        mixed = rng.random() < self.p
        lam = float(rng.beta(self.alpha, self.alpha))
        where = rng.random(2)
        images, labels = self._columns(batch)
        soft = self._soft(labels, images.device, keys)
        if mixed and len(images) > 1:
            images, lam = self._apply(images, lam, where, layout)
            soft = torch.lerp(soft.roll(1, 0), soft, lam)  # lam of the row's own label, the rest its pair's
            batch["image"] = images
        batch["label"] = soft
        return batch

    def _apply(self, images: torch.Tensor, lam: float, where: np.ndarray, layout: str) -> tuple[torch.Tensor, float]:
        raise NotImplementedError

    def _columns(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        kind = type(self).__name__
        images, labels = batch_images(batch, kind), batch.get("label")
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"{kind} needs the batch's labels, got {_described(labels)} (a pipeline with "
                            "label=None has none)")
        return images, labels

    def _soft(self, labels: torch.Tensor, device: torch.device, keys: list[str]) -> torch.Tensor:
        """``[B, K]`` float32 targets: one-hot (smoothed) from class indices, or soft labels as given."""
        k, kind = self.num_classes, type(self).__name__
        if labels.dim() == 2 and labels.is_floating_point():
            if labels.shape[1] != k:
                raise ValueError(f"{kind}: the batch's soft labels have {labels.shape[1]} classes, not num_classes={k}")
            return labels.float()
        if labels.dim() != 1 or labels.is_floating_point() or labels.dtype == torch.bool:
            raise TypeError(f"{kind} needs class indices ([B] integers) or soft labels ([B, {k}] floats), "
                            f"got {labels.dtype} of shape {tuple(labels.shape)}")
        labels = labels.to(device=device, dtype=torch.int64)
        if labels.device.type == "cpu":
            valid = (labels >= 0) & (labels < k)
            if not bool(valid.all()):
                row = int((~valid).nonzero()[0, 0])
                raise ValueError(f"{kind}: label {int(labels[row])} of sample {keys[row]!r} (row {row}) is not in "
                                 f"[0, num_classes={k})")
        # Few torch calls: on the GPU path they run in the lane, and each one's host time is the lane's.
        classes = self._classes.get(device)
        if classes is None:
            classes = self._classes[device] = torch.arange(k, device=device)
        off = self.label_smoothing / k
        hot = labels[:, None] == classes
        soft = torch.where(hot, 1.0 - self.label_smoothing + off, off)
        soft = soft if soft.dtype == torch.float32 else soft.float()  # torch's default float dtype, unless changed
        # A row without its class (a label out of range: unchecked on the GPU, no host wait there) is NaN, not a wrong one.
        return torch.where(hot.any(1, keepdim=True), soft, math.nan)


class MixUp(_Mix):
    """MixUp (Zhang et al., 2018): each image becomes ``lam * image + (1 - lam) * the row before it``,
    ``lam ~ Beta(alpha, alpha)`` once a batch, and its label the same mix of the two soft labels.

    Put it after the ops: ``ops.Pipeline([*ops.training(224).ops, ops.MixUp(0.2, num_classes=1000)])``.
    ``p`` is the chance that a batch is mixed (its labels are soft either way, so every batch has
    the same form); ``label_smoothing`` smooths the one-hot labels first. Float images mix in
    place, in their own dtype; uint8 ones (no ``Normalize``) in float32, rounded.

    Raises ``ConfigError`` when made with ``alpha <= 0``, ``num_classes < 1``, ``p`` outside
    [0, 1] or ``label_smoothing`` outside [0, 1). In a loader, a batch whose images are a list
    (ops that do not end in one size), that has no labels (``label=None``), or whose labels are
    not class indices or ``[B, num_classes]`` soft labels fails each of its samples with a
    ``TransformError`` naming the stage; so does a label outside ``[0, num_classes)`` on the CPU,
    naming the sample. On the GPU such a label is not read back (the lane would wait for the GPU):
    its row's target, and its pair's, are NaN.
    """

    def __init__(self, alpha: float = 1.0, *, num_classes: int, p: float = 1.0, label_smoothing: float = 0.0) -> None:
        super().__init__(alpha, num_classes=num_classes, p=p, label_smoothing=label_smoothing)

    def _apply(self, images, lam, where, layout):
        rolled = images.roll(1, 0)
        if images.is_floating_point():
            return images.lerp_(rolled, 1.0 - lam), lam
        mixed = torch.lerp(rolled.float(), images.float(), lam).round_().clamp_(0, 255)
        return mixed.to(images.dtype), lam


class CutMix(_Mix):
    """CutMix (Yun et al., 2019): a box of each image is replaced by the same box of the row before it.

    Once a batch: ``lam ~ Beta(alpha, alpha)``, a centre drawn uniformly over the image, and a box
    of sides ``sqrt(1 - lam)`` times the image's around it, cut at the edges (torchvision's
    ``CutMix``); the labels mix by the share of the image left uncovered. The box is written in
    place. Arguments, errors and the GPU's NaN targets as ``MixUp``'s.
    """

    def __init__(self, alpha: float = 1.0, *, num_classes: int, p: float = 1.0, label_smoothing: float = 0.0) -> None:
        super().__init__(alpha, num_classes=num_classes, p=p, label_smoothing=label_smoothing)

    def _apply(self, images, lam, where, layout):
        rows, cols = (2, 3) if layout == "CHW" else (1, 2)
        h, w = images.shape[rows], images.shape[cols]
        cx, cy = int(where[0] * w), int(where[1] * h)
        half = 0.5 * math.sqrt(1.0 - lam)
        hw, hh = int(half * w), int(half * h)
        x0, x1, y0, y1 = max(cx - hw, 0), min(cx + hw, w), max(cy - hh, 0), min(cy + hh, h)
        box = images.narrow(rows, y0, y1 - y0).narrow(cols, x0, x1 - x0)
        box.copy_(box.roll(1, 0))  # roll makes a copy: no row reads a box already overwritten
        return images, 1.0 - (x1 - x0) * (y1 - y0) / (w * h)


def batch_images(batch: dict[str, Any], kind: str) -> torch.Tensor:
    """The batch's images as one 4-d tensor, for the batch stage ``kind``; TypeError otherwise."""
    images = batch.get("image")
    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        raise TypeError(f"{kind} needs the batch's images as one [B, C, H, W] or [B, H, W, C] tensor, got "
                        f"{_described(images)} (ops that do not end in one size give a list)")
    return images


def _described(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-d tensor"
    return "nothing" if value is None else type(value).__name__
