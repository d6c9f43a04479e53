"""A pipeline: which field holds the image, the ops applied to it, and where the label comes from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from headrace._errors import ConfigError

from ._random import uniforms
from ._post_spec import PostOp
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
    """Decode → image ops → post ops → optional Normalize, applied to each sample of a batch.

    ``ops`` must start with ``Decode`` (one is added if missing) and may end with one ``Normalize``;
    between them go first the geometry ops (``image_ops``: ``Resize``, ``CenterCrop``,
    ``RandomResizedCrop`` and ``Flip``, in any order), then the post ops (``post_ops``:
    ``ColorTwist``, ``Rotate``, ``WarpAffine`` and ``GaussianBlur``, in any order), which work on
    the uint8 image the geometry made. An op's random numbers are keyed by its index in ``ops``.
    ``image`` names the field(s) holding the encoded image (default: the first field whose name is
    an image extension); ``label`` names the field holding the class as ASCII digits (WebDataset's
    ``cls``), or None for no label. ``fields`` names other fields handed out as they are:
    ``batch[name]`` is a list of bytes, one per row (a caption, a JSON of boxes); every sample must
    have them. ``layout`` applies to uint8 output (no Normalize); Normalize carries its own.

    Raises ConfigError for an op list that breaks these rules, or a fixed output size over
    ``Decode.max_pixels`` (that limit bounds every op's output; see ``Decode``).
    """

    def __init__(
        self,
        ops: Sequence[Op] = (),
        *,
        image: str | Sequence[str] | None = None,
        label: str | None = "cls",
        fields: Sequence[str] = (),
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
            if not isinstance(op, (*_IMAGE_OPS, PostOp, Normalize)):
                raise ConfigError(f"Pipeline: unsupported op {op!r}")
            if isinstance(op, _IMAGE_OPS) and any(isinstance(o, PostOp) for o in ops[1:pos]):
                raise ConfigError(f"Pipeline: {op!r} must come before the post ops (colour, rotate, warp, blur)")
        if layout not in ("CHW", "HWC"):
            raise ConfigError(f"Pipeline: layout must be 'CHW' or 'HWC', got {layout!r}")
        self.ops: tuple[Op, ...] = tuple(ops)
        self.decode: Decode = ops[0]
        self.normalize: Normalize | None = ops[-1] if isinstance(ops[-1], Normalize) else None
        middle = ops[1 : len(ops) - (self.normalize is not None)]
        self.image_ops: tuple[Op, ...] = tuple(op for op in middle if not isinstance(op, PostOp))
        self.post_ops: tuple[PostOp, ...] = tuple(op for op in middle if isinstance(op, PostOp))
        # Post op j sits at index 1 + len(image_ops) + j of ``ops``: its key for ``uniforms``.
        first = 1 + len(self.image_ops)
        self.post_positions: tuple[int, ...] = tuple(range(first, first + len(self.post_ops)))
        if isinstance(image, str):
            image = (image,)
        self.image_fields: tuple[str, ...] = tuple(image) if image is not None else IMAGE_EXTENSIONS
        if not self.image_fields or not all(isinstance(name, str) for name in self.image_fields):
            raise ConfigError(f"Pipeline: image must name one or more fields, got {image!r}")
        if label is not None and not isinstance(label, str):
            raise ConfigError(f"Pipeline: label must be a field name or None, got {label!r}")
        self.label_field = label
        if not isinstance(fields, (list, tuple)) or not all(isinstance(name, str) and name for name in fields):
            raise ConfigError(f"Pipeline: fields must be a sequence of field names, got {fields!r}")
        if {"image", "label"} & set(fields):
            raise ConfigError("Pipeline: fields cannot be named 'image' or 'label' (the batch's own keys)")
        self.fields: tuple[str, ...] = tuple(dict.fromkeys(fields))
        self.layout = self.normalize.layout if self.normalize else layout
        if self.normalize and len(self.normalize.mean) not in (1, self.decode.channels):
            raise ConfigError(
                f"Pipeline: Normalize has {len(self.normalize.mean)} channels, Decode gives {self.decode.channels}"
            )
        limit = self.decode.max_pixels
        for op in self.image_ops:
            size = getattr(op, "size", None)  # a tuple where the output size is fixed
            if isinstance(size, tuple) and limit is not None and size[0] * size[1] > limit:
                raise ConfigError(f"Pipeline: {op!r} makes {size[0] * size[1]} pixels, over Decode's max_pixels={limit}")
        for op in self.post_ops:
            fill = getattr(op, "fill", (0.0,))
            if len(fill) not in (1, self.decode.channels):
                raise ConfigError(f"Pipeline: {op!r} has {len(fill)} fill levels, Decode gives {self.decode.channels} channels")

    @property
    def channels(self) -> int:
        return self.decode.channels

    @property
    def dtype(self) -> torch.dtype:
        return self.normalize.dtype if self.normalize else torch.uint8

    def post_uniforms(self, seed: int, epoch: int, indices: np.ndarray) -> list[np.ndarray | None]:
        """Each post op's ``(len(indices), randoms)`` uniforms (None for an op that draws none)."""
        return [
            uniforms(seed, epoch, pos, indices, op.randoms) if op.randoms else None
            for pos, op in zip(self.post_positions, self.post_ops)
        ]

    def output_size(self) -> tuple[int, int] | None:
        """The (height, width) every output image has, or None when it depends on the input."""
        size = None
        for op in self.ops:
            size = op.output_size(size)
        return size

    def __repr__(self) -> str:
        fields = f", fields={self.fields!r}" if self.fields else ""
        return f"Pipeline({list(self.ops)!r}, image={self.image_fields!r}, label={self.label_field!r}{fields})"


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
