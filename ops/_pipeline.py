"""A pipeline: which field holds the image, the ops applied to it, and where the label comes from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from headrace._errors import ConfigError

from ._spec import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CenterCrop,
    Decode,
    Flip,
    Normalize,
    Op,
    RandomResizedCrop,
    Resize,
)

__all__ = ["IMAGE_EXTENSIONS", "Pipeline", "training", "validation"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "gif")
_IMAGE_OPS = (Resize, CenterCrop, RandomResizedCrop, Flip)


class Pipeline:
    """Decode → image ops → optional Normalize, applied to each sample of a batch.

    ``ops`` must start with ``Decode`` (one is added if missing) and may end with one ``Normalize``;
    between them go ``Resize``, ``CenterCrop``, ``RandomResizedCrop`` and ``Flip`` in any order.
    ``image`` names the field(s) holding the encoded image (default: the first field whose name is
    an image extension); ``label`` names the field holding the class as ASCII digits (WebDataset's
    ``cls``), or None for no label. ``layout`` applies to uint8 output (no Normalize); Normalize
    carries its own.

    Raises ConfigError for an op list that breaks these rules.
    """

    def __init__(
        self,
        ops: Sequence[Op] = (),
        *,
        image: str | Sequence[str] | None = None,
        label: str | None = "cls",
        layout: Literal["CHW", "HWC"] = "CHW",
    ) -> None:
        ops = list(ops)
        for op in ops:
            if not isinstance(op, Op):
                raise ConfigError(f"Pipeline: {op!r} is not a headrace op")
        if not ops or not isinstance(ops[0], Decode):
            ops.insert(0, Decode())
        for pos, op in enumerate(ops[1:], start=1):
            if isinstance(op, Decode):
                raise ConfigError("Pipeline: Decode may appear only first")
            if isinstance(op, Normalize) and pos != len(ops) - 1:
                raise ConfigError("Pipeline: Normalize must be the last op")
            if not isinstance(op, (*_IMAGE_OPS, Normalize)):
                raise ConfigError(f"Pipeline: unsupported op {op!r}")
        if layout not in ("CHW", "HWC"):
            raise ConfigError(f"Pipeline: layout must be 'CHW' or 'HWC', got {layout!r}")
        self.ops: tuple[Op, ...] = tuple(ops)
        self.decode: Decode = ops[0]
        self.normalize: Normalize | None = ops[-1] if isinstance(ops[-1], Normalize) else None
        self.image_ops: tuple[Op, ...] = tuple(ops[1 : len(ops) - (self.normalize is not None)])
        if isinstance(image, str):
            image = (image,)
        self.image_fields: tuple[str, ...] = tuple(image) if image is not None else IMAGE_EXTENSIONS
        if not self.image_fields or not all(isinstance(name, str) for name in self.image_fields):
            raise ConfigError(f"Pipeline: image must name one or more fields, got {image!r}")
        if label is not None and not isinstance(label, str):
            raise ConfigError(f"Pipeline: label must be a field name or None, got {label!r}")
        self.label_field = label
        self.layout = self.normalize.layout if self.normalize else layout
        if self.normalize and len(self.normalize.mean) not in (1, self.decode.channels):
            raise ConfigError(
                f"Pipeline: Normalize has {len(self.normalize.mean)} channels, Decode gives {self.decode.channels}"
            )

    @property
    def channels(self) -> int:
        return self.decode.channels

    @property
    def dtype(self) -> torch.dtype:
        return self.normalize.dtype if self.normalize else torch.uint8

    def output_size(self) -> tuple[int, int] | None:
        """The (height, width) every output image has, or None when it depends on the input."""
        size = None
        for op in self.ops:
            size = op.output_size(size)
        return size

    def __repr__(self) -> str:
        return f"Pipeline({list(self.ops)!r}, image={self.image_fields!r}, label={self.label_field!r})"


def training(
    size: int = 224,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: float = 0.5,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    dtype: str | torch.dtype = torch.float32,
    **kwargs,
) -> Pipeline:
    """The ImageNet training pipeline: decode → random resized crop → flip → normalize (NCHW)."""
    return Pipeline(
        [Decode(), RandomResizedCrop(size, scale, ratio), Flip(flip), Normalize(mean, std, dtype=dtype)],
        **kwargs,
    )


def validation(
    size: int = 224,
    *,
    resize: int = 256,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    dtype: str | torch.dtype = torch.float32,
    **kwargs,
) -> Pipeline:
    """The ImageNet evaluation pipeline: decode → resize shorter side → centre crop → normalize (NCHW)."""
    return Pipeline(
        [Decode(), Resize(resize), CenterCrop(size), Normalize(mean, std, dtype=dtype)],
        **kwargs,
    )
