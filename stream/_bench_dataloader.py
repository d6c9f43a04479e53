"""The ``torch DataLoader`` row of ``headrace bench``: the same samples through what torch users write.

A map-style ``Dataset`` that decodes with Pillow and applies torchvision's transforms (re-made with
Pillow and torch here, so torchvision is not needed): ``RandomResizedCrop(size)`` + horizontal flip +
``ToTensor`` + ``Normalize`` for training, ``Resize(resize)`` + ``CenterCrop(size)`` + ``ToTensor`` +
``Normalize`` for validation. A ``DataLoader`` runs it in worker processes (persistent, default
collate of the samples that decoded).

Where the samples come from (``collect``, one pass before any timing, through the reader the other
rows use, the first ``limit`` samples):

- a local class-per-folder tree: each sample's file path; the Dataset opens the file each epoch,
  as ``torchvision.datasets.ImageFolder`` does, so the row pays for reading as headrace's rows do;
- WebDataset shards, an LMDB or remote files: each sample's encoded image bytes, held in memory, so
  this row does **not** pay for reading (the table says so).

A sample that cannot be read or decoded is skipped and counted, as the loader rows do with
``on_error="skip"``: the Dataset hands back a ``Failed`` marker and ``skip_failed`` leaves it out of
the batch.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from PIL import Image

from headrace._inspect import Census, _image_field, _Tap
from headrace._sample import Sample
from headrace.ops import IMAGENET_MEAN, IMAGENET_STD

__all__ = ["EncodedImages", "Failed", "Samples", "TorchvisionStyle", "TorchvisionValidation", "collect",
           "epoch", "make_loader", "skip_failed"]

# What Pillow raises for data that is not an image it can decode (UnidentifiedImageError is an OSError;
# truncated or corrupt files raise OSError, ValueError or SyntaxError from the plug-ins).
_UNDECODABLE = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


def _to_normalized_tensor(img: Image.Image, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    # ToTensor: HWC uint8 → CHW float in [0, 1]; then Normalize (inplace=False: it clones).
    t = torch.from_numpy(np.array(img, np.uint8, copy=True)).view(img.height, img.width, 3)
    t = t.permute(2, 0, 1).contiguous().to(torch.float32).div(255)
    return t.clone().sub_(mean).div_(std)


class TorchvisionStyle:
    """``Compose([RandomResizedCrop(size), RandomHorizontalFlip(), ToTensor(), Normalize(MEAN, STD)])``
    on a PIL image, as torchvision 0.2x computes it (random numbers from torch's generator)."""

    def __init__(self, size: int = 224, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> None:
        self.size, self.scale, self.ratio = size, scale, ratio
        self.mean = torch.tensor(IMAGENET_MEAN).view(-1, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(-1, 1, 1)

    def get_params(self, img: Image.Image) -> tuple[int, int, int, int]:
        # torchvision.transforms.RandomResizedCrop.get_params, verbatim in substance.
        width, height = img.size
        area = height * width
        log_ratio = torch.log(torch.tensor(self.ratio))
        for _ in range(10):
            target_area = area * torch.empty(1).uniform_(self.scale[0], self.scale[1]).item()
            aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
            w = int(round(math.sqrt(target_area * aspect_ratio)))
            h = int(round(math.sqrt(target_area / aspect_ratio)))
            if 0 < w <= width and 0 < h <= height:
                i = torch.randint(0, height - h + 1, size=(1,)).item()
                j = torch.randint(0, width - w + 1, size=(1,)).item()
                return i, j, h, w
        in_ratio = float(width) / float(height)
        if in_ratio < min(self.ratio):
            w = width
            h = int(round(w / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h = height
            w = int(round(h * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def __call__(self, img: Image.Image) -> torch.Tensor:
        i, j, h, w = self.get_params(img)
        # F.resized_crop on PIL: crop, then resize((W, H), BILINEAR) (Pillow antialiases itself).
        img = img.crop((j, i, j + w, i + h)).resize((self.size, self.size), Image.Resampling.BILINEAR)
        if torch.rand(1) < 0.5:  # RandomHorizontalFlip
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return _to_normalized_tensor(img, self.mean, self.std)


class TorchvisionValidation:
    """``Compose([Resize(resize), CenterCrop(size), ToTensor(), Normalize(MEAN, STD)])`` on a PIL
    image, as torchvision computes it: the shorter side to ``resize`` (the longer truncated), bilinear."""

    def __init__(self, size: int = 224, resize: int = 256) -> None:
        self.size, self.resize = size, resize
        self.mean = torch.tensor(IMAGENET_MEAN).view(-1, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(-1, 1, 1)

    def __call__(self, img: Image.Image) -> torch.Tensor:
        width, height = img.size
        short, long_ = sorted((width, height))
        new_long = int(self.resize * long_ / short)
        new_w, new_h = (self.resize, new_long) if width <= height else (new_long, self.resize)
        img = img.resize((new_w, new_h), Image.Resampling.BILINEAR)
        top, left = int(round((new_h - self.size) / 2.0)), int(round((new_w - self.size) / 2.0))
        img = img.crop((left, top, left + self.size, top + self.size))
        return _to_normalized_tensor(img, self.mean, self.std)


@dataclass(frozen=True)
class Failed:
    """What ``EncodedImages`` hands back for a sample it cannot read or decode (``skip_failed`` drops it)."""

    index: int
    reason: str


class EncodedImages(torch.utils.data.Dataset):
    """``(image, label)`` per sample (``image`` alone when ``labels`` is None) from a file path or the
    encoded bytes, decoded to RGB with Pillow, then ``transform``; ``Failed`` where that fails."""

    def __init__(self, items: list[str | bytes | None], labels: list[int] | None,
                 transform: Callable[[Image.Image], torch.Tensor]) -> None:
        self.items, self.labels, self.transform = items, labels, transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Any:
        item = self.items[index]
        if item is None:
            return Failed(index, "the reader gave no image for this sample")
        try:
            with open(item, "rb") if isinstance(item, str) else io.BytesIO(item) as f:
                image = self.transform(Image.open(f).convert("RGB"))
        except _UNDECODABLE as exc:
            return Failed(index, f"{type(exc).__name__}: {exc}")
        return image if self.labels is None else (image, self.labels[index])


def skip_failed(items: list[Any]) -> tuple[Any, list[int]]:
    """``collate_fn``: ``(default_collate of the samples that decoded or None, indices of the others)``."""
    good = [item for item in items if not isinstance(item, Failed)]
    failed = [item.index for item in items if isinstance(item, Failed)]
    return (torch.utils.data.default_collate(good) if good else None), failed


@dataclass
class Samples:
    """What the DataLoader row reads: per sample a local file path or the encoded bytes (None:
    unreadable), its label (None: none), and its bytes as the other rows count them (every field)."""

    items: list[str | bytes | None] = field(default_factory=list)
    labels: list[int | None] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)

    @property
    def by_path(self) -> bool:
        return all(isinstance(item, str) for item in self.items if item is not None)

    @property
    def where(self) -> str:
        return "files opened by path" if self.by_path else "encoded samples held in memory"


class _Collect(Census):
    """A census that keeps what the Dataset needs of each sample instead of counting."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.out = kind, Samples()

    def add(self, sample: Sample) -> None:
        out = self.out
        data = None if sample.error is not None else _image_field(sample.fields)
        by_path = self.kind == "files" and os.path.isfile(sample.source)  # a local file: what users open
        out.items.append(None if data is None else (sample.source if by_path else bytes(data)))
        out.nbytes.append(sum(len(v) for v in sample.fields.values()))
        cls = sample.fields.get("cls")
        try:
            out.labels.append(None if cls is None else int(bytes(cls)))
        except ValueError:
            out.labels.append(None)


async def collect(reader: Any, kind: str, limit: int | None) -> Samples:
    """One pass over the reader's first ``limit`` samples (epoch 0, the reader's order): a local
    files tree's samples keep their paths, every other sample its encoded image bytes."""
    census = _Collect(kind)
    async with contextlib.aclosing(_Tap(reader, census, limit).read(0)) as chunks:
        async for _ in chunks:
            pass
    return census.out


def make_loader(samples: Samples, *, pipeline: str, size: int, resize: int, batch_size: int, workers: int,
                pin_memory: bool) -> torch.utils.data.DataLoader:
    """The DataLoader users write: ``workers`` persistent worker processes, in the reader's order."""
    transform = TorchvisionStyle(size) if pipeline == "training" else TorchvisionValidation(size, resize)
    labels = None if any(label is None for label in samples.labels) else samples.labels
    return torch.utils.data.DataLoader(EncodedImages(samples.items, labels, transform), batch_size=batch_size,
                                       shuffle=False, num_workers=workers, persistent_workers=workers > 0,
                                       pin_memory=pin_memory, collate_fn=skip_failed)


def epoch(loader: torch.utils.data.DataLoader, samples: Samples, device: str) -> tuple[int, int, int]:
    """One epoch: (samples that reached the consumer, their bytes, samples skipped). On CUDA each batch
    (pinned by the loader) is moved with ``.to(device, non_blocking=True)``, which is
    ``.cuda(non_blocking=True)`` for ``"cuda"``, and the epoch ends when the GPU has the last one."""
    done = 0
    skipped: list[int] = []
    on_gpu = device.startswith("cuda")
    for batch, failed in loader:
        skipped += failed
        if batch is None:  # every sample of the batch failed
            continue
        tensors = batch if isinstance(batch, list) else [batch]  # [images, labels] or [images]
        if on_gpu:
            tensors = [t.to(device, non_blocking=True) for t in tensors]
        done += len(tensors[0])
    if on_gpu:
        torch.cuda.synchronize(device)
    moved = sum(samples.nbytes) - sum(samples.nbytes[i] for i in skipped)
    return done, moved, len(skipped)

