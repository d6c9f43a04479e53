"""RandomErasing: a random box of each image of a batch filled (Zhong et al., 2020), as torchvision's
``transforms.v2.RandomErasing`` draws it.

A ``MapBatch`` stage, like MixUp and CutMix: it stands after the last built-in op, on the batch
(normalized, as in torchvision's recipes, where it comes after ``Normalize``), and runs wherever a
``MapBatch`` runs, in the GPU lane on its stream with no host wait. Each row's box is drawn on the
host from the stage's ``rng`` (keyed by seed, epoch, the stage's place and the batch's index, a
fixed number of draws a row), so a seed erases the same boxes on either device, with any thread
count, and after a resume. The boxes reach the device through pinned memory, without a wait.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from headrace._errors import ConfigError

from ._mix import batch_images
from ._post_spec import _finite, _probability
from ._spec import _float2
from ._stages import MapBatch

__all__ = ["RandomErasing"]

_TRIES = 10  # torchvision's: a row whose ten boxes all miss the image is left as it is


class RandomErasing(MapBatch):
    """Erase a random box of each image with probability ``p``: torchvision's ``RandomErasing``.

    Per image: a box of ``scale`` (a range) of the image's area and an aspect ratio drawn
    log-uniformly from ``ratio``, its sides rounded, placed uniformly where it fits; ten tries, and
    an image none of them fits is left alone. ``value`` fills it: a number, one per channel, or
    ``"random"``, a standard normal value per pixel (torchvision's; on uint8 images, with no
    ``Normalize``, uniform levels 0-255 instead). On normalized images the default 0 is the
    dataset mean's colour. Works in place on the batch's images, in their layout (the stage's
    ``layout``). Labels are left alone. With ``Pipeline(splits=)``'s views it leaves each sample's
    clean view (0) as it is and erases the others, each a row of its own, as timm's
    ``RandomErasing(num_splits=)`` does.

    Raises ``ConfigError`` when made with ``p`` outside [0, 1], ``scale`` not within [0, 1],
    ``ratio`` not positive, or a ``value`` that is neither finite numbers nor ``"random"``. In a
    loader, a batch whose images are a list (ops that do not end in one size), or whose channels
    do not match ``value``'s levels, fails each of its samples with a ``TransformError`` naming
    the stage.
    """

    def __init__(self, p: float = 0.5, scale: tuple[float, float] = (0.02, 0.33), ratio: tuple[float, float] = (0.3, 3.3),
                 value: float | Sequence[float] | str = 0.0) -> None:
        self.p = _probability(p, "RandomErasing: p")
        self.scale = _float2(scale, "RandomErasing: scale")
        self.ratio = _float2(ratio, "RandomErasing: ratio")
        if not (0.0 <= self.scale[0] <= self.scale[1] <= 1.0):
            raise ConfigError(f"RandomErasing: scale must be a pair 0 <= lo <= hi <= 1 of the image's area, got {scale!r}")
        if not (math.isfinite(self.ratio[1]) and 0.0 < self.ratio[0] <= self.ratio[1]):
            raise ConfigError(f"RandomErasing: ratio must be a pair 0 < lo <= hi, got {ratio!r}")
        if isinstance(value, str):
            if value != "random":
                raise ConfigError(f"RandomErasing: value must be a number, one per channel, or 'random', got {value!r}")
            self.value: tuple[float, ...] | str = value
        else:
            values = value if isinstance(value, Sequence) else (value,)
            self.value = tuple(_finite(v, "RandomErasing: value") for v in values)
            if not self.value:
                raise ConfigError("RandomErasing: value must be a number, one per channel, or 'random', got ()")
        super().__init__(self._erase, name="RandomErasing")

    def __repr__(self) -> str:
        value = repr(self.value) if isinstance(self.value, str) else (
            f"{self.value[0]:g}" if len(self.value) == 1 else repr(self.value))
        return f"RandomErasing(p={self.p:g}, scale={self.scale}, ratio={self.ratio}, value={value})"

    def boxes(self, rng: np.random.Generator, n: int, h: int, w: int) -> np.ndarray:
        """(n, 4) int64 ``y0, x0, y1, x1`` per row (an empty box: not erased), from ``rng``'s draws:
        ``n`` for ``p``, then ``n`` x 10 tries of four (area, log aspect, top, left)."""
        erase = rng.random(n) < self.p
        u = rng.random((n, _TRIES, 4))
        area = h * w * (self.scale[0] + (self.scale[1] - self.scale[0]) * u[..., 0])
        low, high = math.log(self.ratio[0]), math.log(self.ratio[1])
        aspect = np.exp(low + (high - low) * u[..., 1])
        bh = np.rint(np.sqrt(area * aspect)).astype(np.int64)
        bw = np.rint(np.sqrt(area / aspect)).astype(np.int64)
        fits = (bh < h) & (bw < w)
        top = (u[..., 2] * (h - bh + 1)).astype(np.int64)
        left = (u[..., 3] * (w - bw + 1)).astype(np.int64)
        first = fits.argmax(axis=1)
        rows = np.arange(n)
        erase &= fits[rows, first]
        y0, x0 = top[rows, first], left[rows, first]
        out = np.stack([y0, x0, y0 + bh[rows, first], x0 + bw[rows, first]], axis=1)
        out[~erase] = 0
        return out

    def _erase(self, batch: dict[str, Any], rng: np.random.Generator, layout: str) -> dict[str, Any]:
        images = batch.get("image")
        if isinstance(images, torch.Tensor) and images.dim() == 5:
            # ``Pipeline(splits=)``'s views [B, splits, ...]: the clean view 0 is left alone, as timm's
            # ``RandomErasing(num_splits=)`` leaves the first split; the others are rows of their own.
            views = images.transpose(0, 1)[1:]
            rows = views.flatten(0, 1)  # a view of the view-major memory the executors make
            self._erase_rows(rows, rng, layout)
            if rows.data_ptr() != views.data_ptr() or not views.is_contiguous():  # flatten copied
                views.copy_(rows.view_as(views))
            return batch
        self._erase_rows(batch_images(batch, "RandomErasing"), rng, layout)
        return batch

    def _erase_rows(self, images: torch.Tensor, rng: np.random.Generator, layout: str) -> None:
        """Erase a box of each row of the 4-d ``images``, in place."""
        chw = layout == "CHW"
        n, (h, w), c = len(images), images.shape[2:4] if chw else images.shape[1:3], images.shape[1 if chw else 3]
        boxes = self.boxes(rng, n, h, w)
        seed = int(rng.integers(1 << 62))  # drawn always: the draws do not depend on the images
        if not boxes.any():
            return
        # Which rows and columns each box covers, made on the host (n x (h + w) bytes) and sent in one
        # copy: few torch calls, as on the GPU path they run in the lane and their host time is the lane's.
        lines = np.empty((n, h + w), dtype=np.bool_)
        lines[:, :h] = (np.arange(h) >= boxes[:, :1]) & (np.arange(h) < boxes[:, 2:3])
        lines[:, h:] = (np.arange(w) >= boxes[:, 1:2]) & (np.arange(w) < boxes[:, 3:4])
        table = torch.from_numpy(lines)
        if images.is_cuda:
            table = table.pin_memory().to(images.device, non_blocking=True)
        inside = table[:, :h, None] & table[:, None, h:]  # [B, H, W]
        inside = inside[:, None] if chw else inside[..., None]
        if self.value == "random":
            images.copy_(torch.where(inside, self._noise(images, seed), images))
            return
        levels = self._levels(images, c)
        if len(set(levels)) == 1:
            images.masked_fill_(inside, levels[0])
        else:
            for k, level in enumerate(levels):
                plane = images[:, k : k + 1] if chw else images[..., k : k + 1]
                plane.masked_fill_(inside, level)

    def _levels(self, images: torch.Tensor, channels: int) -> list[float] | list[int]:
        assert not isinstance(self.value, str)
        if len(self.value) not in (1, channels):
            raise ValueError(f"RandomErasing: value has {len(self.value)} levels for images of {channels} channels")
        values = self.value * channels if len(self.value) == 1 else self.value
        if images.is_floating_point():
            return list(values)
        return [int(min(max(round(v), 0), 255)) for v in values]

    @staticmethod
    def _noise(images: torch.Tensor, seed: int) -> torch.Tensor:
        """A standard normal value a pixel (uint8 images: uniform levels), from a generator seeded by the stage's draw."""
        generator = torch.Generator(device=images.device).manual_seed(seed)
        if images.is_floating_point():
            return torch.randn(images.shape, generator=generator, device=images.device, dtype=images.dtype)
        return torch.randint(0, 256, images.shape, generator=generator, device=images.device, dtype=images.dtype)
