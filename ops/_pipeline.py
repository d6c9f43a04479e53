"""A pipeline: which field holds the image, the ops applied to it, and where the label comes from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch

from headrace._errors import ConfigError, require_int

from ._random import uniforms
from ._post_spec import ColorTwist, PostOp
from ._timm_augment import TimmRandAugment
from ._timm_augmix import TimmAugMix
from ._timm_auto_augment import TimmAutoAugment
from ._stages import MapBatch, Stage
from ._spec import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CenterCrop,
    Decode,
    Flip,
    Normalize,
    Op,
    RandomCrop,
    RandomIoUCrop,
    RandomResize,
    RandomResizedCrop,
    Resize,
)

__all__ = ["IMAGE_EXTENSIONS", "Pipeline", "training", "validation"]

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "gif", "avif")
_IMAGE_OPS = (Resize, RandomResize, CenterCrop, RandomCrop, RandomResizedCrop, RandomIoUCrop, Flip)


class Pipeline:
    """Decode → image ops → post ops → optional Normalize, applied to each sample of a batch.

    ``ops`` must start with ``Decode`` (one is added if missing) and may end with one ``Normalize``;
    between them go first the geometry ops (``image_ops``: ``Resize``, ``RandomResize``,
    ``CenterCrop``, ``RandomCrop``, ``RandomResizedCrop`` and ``Flip``, in any order), then the post ops (``post_ops``:
    ``ColorTwist``, ``RandomGrayscale``, ``Rotate``, ``RandomAffine``, ``WarpAffine``, ``GaussianBlur``, the tone
    curves and the policies, in any order), which work on
    the uint8 image the geometry made. An op's random numbers are keyed by its index in ``ops``.
    ``image`` names the field(s) holding the encoded image (default: the first field whose name is
    an image extension); ``label`` names the field holding the class as ASCII digits (WebDataset's
    ``cls``; an int from a ``readers.sequence``), or None for no label. ``fields`` names other
    fields handed out beside the image, every sample must have them, batched by the rules of
    ``_collate`` (bytes and text stay lists, one per row: a caption, a JSON of boxes; arrays and
    tensors of one shape stack; ``.npy`` fields are loaded first). ``layout`` applies to uint8
    output (no Normalize); Normalize carries its own.

    ``boxes`` names a field holding each sample's boxes (``[N, 4]``: x0, y0, x1, y1 in pixels of
    the decoded image) that move with the image: through the crops, resizes and flips, clipped to
    the output image, a box left with no area dropped with the same rows of the ``per_box`` fields
    (its labels). Both come out as lists, a tensor per row (``_boxes``). ``mask`` names a field
    holding a single-channel image of the decoded image's size (a segmentation map: encoded, a PNG,
    or an array ``[H, W]``) that goes through the same geometry, nearest-neighbour, its padding
    ``mask_fill`` (``_masks``). ``instance_masks`` names a field holding one binary mask a box
    (``[N, H, W]``, bool or integers, nonzero inside: ``readers.coco(instance_masks=True)``'s
    ``masks``, Mask R-CNN's targets); it needs ``boxes``. Each layer goes through the geometry as
    ``mask`` does, its padding 0, and is kept or dropped with its box; they come out as a list, a
    uint8 tensor ``[N, H, W]`` per row, 0 and 1. Boxes and masks need the flips after the crops and
    resizes, and no ``Rotate`` or ``WarpAffine``.

    ``splits`` > 1 gives each sample that many views of one geometry, as timm's
    ``AugMixDataset(num_splits=)`` does for AugMix's Jensen-Shannon loss: the image ops run once,
    view 0 is their image without the post ops (the clean view), and each later view runs the post
    ops with draws of its own (view 1 draws what the pipeline would draw without splits). The
    batch's image is then ``[B, splits, ...]``: a view over memory laid out ``[splits, B, ...]``, so
    ``images.transpose(0, 1).flatten(0, 1)`` is timm's order (all clean images, then all of the
    first augmented views...) without a copy. It needs post ops, ops that end in one size, no
    ``boxes`` or masks, and no ``Map``, ``Filter``, ``MixUp`` or ``CutMix`` after the ops.

    User stages (``Map``, ``Filter``, ``MapBatch``, see ``_stages``) go before ``Decode`` (on the
    samples' fields) or after the last built-in op (on output rows or whole batches), never between
    two built-in ops. ``image=None`` is a pipeline for data that is not images (arrays, token ids,
    audio): no Decode and no image ops; every field of the samples (or only ``fields``, when
    given) is batched by the same rules, after the stages.

    Raises ConfigError for an op list that breaks these rules, a field named for two roles (the
    label an image field; boxes, per_box, mask or instance_masks the label, an image field, one of
    ``fields`` or one another), ``instance_masks`` without ``boxes``, a fixed output size over
    ``Decode.max_pixels`` (that limit bounds every op's output; see ``Decode``), or ``splits`` that
    is not a positive int or that the pipeline cannot give (above).
    """

    def __init__(
        self,
        ops: Sequence[Op | Stage] = (),
        *,
        image: str | Sequence[str] | None = IMAGE_EXTENSIONS,
        label: str | None = "cls",
        fields: Sequence[str] = (),
        layout: Literal["CHW", "HWC"] = "CHW",
        boxes: str | None = None,
        per_box: Sequence[str] = (),
        mask: str | None = None,
        mask_fill: int = 0,
        instance_masks: str | None = None,
        splits: int = 1,
    ) -> None:
        listed = _op_list(ops)
        for op in listed:
            if not isinstance(op, (Op, Stage)):
                raise ConfigError(f"Pipeline: {op!r} is not a headrace op or stage (ops.Map, ops.Filter, "
                                  "ops.MapBatch)")
        self.listed: tuple[Op | Stage, ...] = tuple(listed)
        self.before, ops, self.after = _split_stages(listed)
        self.has_image = image is not None
        if not self.has_image:
            if ops:
                raise ConfigError(f"Pipeline: image=None (no image) takes no image ops, got {ops!r}")
            ops = [Decode()]  # not run: its limits and channels answer the executors' questions
        if not ops or not isinstance(ops[0], Decode):
            ops.insert(0, Decode())
        _check_order(ops)
        if layout not in ("CHW", "HWC"):
            raise ConfigError(f"Pipeline: layout must be 'CHW' or 'HWC', got {layout!r}")
        self.ops: tuple[Op, ...] = tuple(ops) if self.has_image else ()
        self.decode: Decode = ops[0]
        self.normalize: Normalize | None = ops[-1] if isinstance(ops[-1], Normalize) else None
        middle = ops[1 : len(ops) - (self.normalize is not None)]
        self.image_ops: tuple[Op, ...] = tuple(op for op in middle if not isinstance(op, PostOp))
        self.post_ops: tuple[PostOp, ...] = tuple(op for op in middle if isinstance(op, PostOp))
        # Post op j sits at index 1 + len(image_ops) + j of ``ops``: its key for ``uniforms``.
        first = 1 + len(self.image_ops)
        self.post_positions: tuple[int, ...] = tuple(range(first, first + len(self.post_ops)))
        self.image_fields: tuple[str, ...] = _image_fields(image)
        if label is not None and (not isinstance(label, str) or not label):
            raise ConfigError(f"Pipeline: label must be a field name or None, got {label!r}")
        if label in self.image_fields:
            # The label would be parsed from the encoded image's bytes: a failure on every sample, at the first batch.
            raise ConfigError(f"Pipeline: label={label!r} is also an image field (image={image!r}); name the "
                              "field holding the class, or label=None")
        self.label_field = label
        if not isinstance(fields, (list, tuple)) or not all(isinstance(name, str) and name for name in fields):
            raise ConfigError(f"Pipeline: fields must be a sequence of field names, got {fields!r}")
        if {"image", "label"} & set(fields):
            raise ConfigError("Pipeline: fields cannot be named 'image' or 'label' (the batch's own keys)")
        self.fields: tuple[str, ...] = tuple(dict.fromkeys(fields))
        self.boxes, self.per_box, self.mask, self.mask_fill, self.instance_masks = _carried_fields(
            boxes, per_box, mask, mask_fill, instance_masks, self)
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
        self.splits = _check_splits(splits, self)

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.before + self.after

    def stage_position(self, stage: Stage) -> int:
        """The key of ``stage``'s random numbers: 1000 + its place among the stages (the built-in
        ops are keyed by their index in ``ops``, so adding a stage changes none of theirs)."""
        return 1000 + next(i for i, s in enumerate(self.stages) if s is stage)

    @property
    def needs_staging(self) -> bool:
        """Whether batches go through ``_staged`` (stages, fields, or no image), not only an executor."""
        return bool(self.stages or self.fields or self.carries or not self.has_image)

    @property
    def iou_crop(self) -> RandomIoUCrop | None:
        """The pipeline's ``RandomIoUCrop`` (first among the geometry ops when there is one), or None."""
        first = self.image_ops[0] if self.image_ops else None
        return first if isinstance(first, RandomIoUCrop) else None

    @property
    def carries(self) -> bool:
        """Whether fields move with the image (``boxes``, ``mask``, ``instance_masks``): ``_follow`` maps them."""
        return self.boxes is not None or self.mask is not None  # instance masks need boxes

    def core(self) -> Pipeline:
        """This pipeline's built-in part (its ops, image and label; no stages, no fields): what an
        image executor runs when ``_staged`` does the rest."""
        # The boxes' name goes along: a RandomIoUCrop needs one, though only ``_staged`` reads them.
        return Pipeline(self.ops, image=self.image_fields, label=self.label_field, layout=self.layout, boxes=self.boxes,
                        splits=self.splits)

    @property
    def channels(self) -> int:
        return self.decode.channels

    @property
    def dtype(self) -> torch.dtype:
        return self.normalize.dtype if self.normalize else torch.uint8

    @property
    def augmented_views(self) -> range:
        """The views that run the post ops, by number (``splits``): 1 alone without splits, else
        1 to ``splits - 1`` (view 0 is the clean one)."""
        return range(1, max(2, self.splits))

    def post_uniforms(self, seed: int, epoch: int, indices: np.ndarray, split: int = 1) -> list[np.ndarray | None]:
        """Each post op's ``(len(indices), randoms)`` uniforms (None for an op that draws none), for
        the augmented view ``split`` (``splits``): view 1 draws what a pipeline without splits draws,
        each later view its own numbers."""
        salt = 0 if split == 1 else split << 32  # far above any op's index: no other op's key
        return [
            uniforms(seed, epoch, pos + salt, indices, op.randoms) if op.randoms else None
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
        if self.boxes:
            fields += f", boxes={self.boxes!r}" + (f", per_box={self.per_box!r}" if self.per_box else "")
        if self.mask:
            fields += f", mask={self.mask!r}" + (f", mask_fill={self.mask_fill}" if self.mask_fill else "")
        if self.instance_masks:
            fields += f", instance_masks={self.instance_masks!r}"
        if self.layout != "CHW" and self.normalize is None:  # with a Normalize, its own repr shows the layout
            fields += f", layout={self.layout!r}"
        if self.splits > 1:
            fields += f", splits={self.splits}"
        image = self.image_fields if self.has_image else None
        ops = list(self.before + self.ops + self.after)
        return f"Pipeline({ops!r}, image={image!r}, label={self.label_field!r}{fields})"


# The rule on op order, as the error messages state it.
_ORDER = ("the allowed order is Decode (added when missing), then the geometry ops (Resize, RandomResize, "
          "CenterCrop, RandomCrop, RandomResizedCrop, RandomIoUCrop, Flip), then the post ops (ColorTwist, RandomGrayscale, "
          "Rotate, RandomAffine, WarpAffine, GaussianBlur, the tone curves, the augmentation policies), then at most one "
          "Normalize, last")


def _check_splits(splits: object, pipe: Pipeline) -> int:
    """``splits`` checked against the pipeline: views differ by their post ops, so there must be
    some; the views of a sample stack, so the ops must end in one size; boxes and masks would be
    one per sample where the image is several, and row stages and MixUp/CutMix read one image a row."""
    splits = require_int("Pipeline: splits", splits)
    if splits == 1:
        return 1
    from ._mix import _Mix
    from ._stages import Filter, Map

    why = None
    if not pipe.post_ops:
        why = "the views differ only by the post ops (a policy such as TimmAugMix), and this pipeline has none"
    elif pipe.output_size() is None:
        why = "a sample's views stack into one tensor, so the ops must end in one size (a crop or a fixed Resize)"
    elif pipe.carries:
        why = "boxes and masks would be one a sample where the image is several"
    elif any(isinstance(stage, (Map, Filter, _Mix)) for stage in pipe.after):
        stage = next(stage for stage in pipe.after if isinstance(stage, (Map, Filter, _Mix)))
        why = f"{stage!r} after the ops reads one image a row"
    if why is not None:
        raise ConfigError(f"Pipeline: splits={splits}: {why}")
    return splits


def _op_list(ops: object) -> list:
    """``ops`` as a list. A single op, a string or None is refused here: iterating it would fail with a
    TypeError, or (a string) complain about its first character rather than about the argument."""
    if ops is None or isinstance(ops, (str, bytes, Op, Stage)):
        raise ConfigError(f"Pipeline: ops must be a list of ops and stages, got {ops!r} (wrap one op in a list)")
    try:
        return list(ops)  # type: ignore[call-overload]
    except TypeError as exc:
        raise ConfigError(f"Pipeline: ops must be a list of ops and stages, got {ops!r}") from exc


def _image_fields(image: object) -> tuple[str, ...]:
    """``image`` as a tuple of field names (empty for None). Raises ConfigError for anything else:
    an int would otherwise be a TypeError, an empty name a field no sample has."""
    if image is None:
        return ()
    names = (image,) if isinstance(image, str) else image
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"Pipeline: image must name one or more fields, got {image!r}")
    return tuple(dict.fromkeys(names))


def _check_order(ops: list[Op]) -> None:
    """Raise ConfigError, naming the op and the allowed order, for built-in ops out of order:
    ``ops[0]`` is the Decode; each kind must not follow a later kind."""
    post_seen = normalize_seen = False
    for op in ops[1:]:
        if isinstance(op, Decode):
            raise ConfigError(f"Pipeline: {op!r} is a second Decode, or one after other ops; {_ORDER}")
        if not isinstance(op, (*_IMAGE_OPS, PostOp, Normalize)):
            raise ConfigError(f"Pipeline: unsupported op {op!r}; {_ORDER}")
        if normalize_seen:
            what = "is a second Normalize" if isinstance(op, Normalize) else "comes after Normalize"
            raise ConfigError(f"Pipeline: {op!r} {what}; {_ORDER}")
        if isinstance(op, _IMAGE_OPS) and post_seen:
            raise ConfigError(f"Pipeline: {op!r} is a geometry op after a colour, rotate, warp or blur op; {_ORDER}")
        post_seen = post_seen or isinstance(op, PostOp)
        normalize_seen = isinstance(op, Normalize)


def _carried_fields(boxes: str | None, per_box: Sequence[str], mask: str | None, mask_fill: int,
                    instance_masks: str | None, pipe: Pipeline
                    ) -> tuple[str | None, tuple[str, ...], str | None, int, str | None]:
    """``boxes``, ``per_box``, ``mask``, ``mask_fill`` and ``instance_masks`` checked against the rest
    of ``pipe``: the fields that move with the image. Raises ConfigError."""
    if isinstance(per_box, str) or not isinstance(per_box, (list, tuple)) or not all(
            isinstance(name, str) and name for name in per_box):
        raise ConfigError(f"Pipeline: per_box must be a sequence of field names, got {per_box!r}")
    if boxes is None and per_box:
        raise ConfigError("Pipeline: per_box names fields that move with boxes; name the boxes too (boxes=...)")
    for what, name in (("boxes", boxes), ("mask", mask), ("instance_masks", instance_masks)):
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigError(f"Pipeline: {what} must be a field name or None, got {name!r}")
    mask_fill = require_int("Pipeline: mask_fill", mask_fill, 0, below=2**31, wanted="an int >= 0")
    if boxes is None and instance_masks is not None:
        raise ConfigError("Pipeline: instance_masks are kept or dropped with their boxes; name the boxes too "
                          "(boxes=...)")
    iou_crops = [i for i, op in enumerate(pipe.image_ops) if isinstance(op, RandomIoUCrop)]
    if iou_crops and boxes is None:
        raise ConfigError("Pipeline: RandomIoUCrop chooses its window by the boxes; name them (boxes=...)")
    if iou_crops and iou_crops != [0]:
        raise ConfigError("Pipeline: RandomIoUCrop comes first among the geometry ops, once (its window is "
                          "chosen on the decoded image's boxes)")
    names = tuple(n for n in (boxes, *per_box, mask, instance_masks) if n is not None)
    if not names:
        return None, (), None, mask_fill, None
    if not pipe.has_image:
        raise ConfigError("Pipeline: boxes and masks move with an image; image=None has none")
    if len(set(names)) != len(names):
        raise ConfigError(f"Pipeline: boxes, per_box, mask and instance_masks name a field twice: {names!r}")
    # The label field too: boxes parsed as a class (or a class read as boxes) fails only at the first batch.
    taken = {"image", "label", *pipe.fields, *pipe.image_fields, pipe.label_field} - {None}
    if clash := [name for name in names if name in taken]:
        role = "instance_masks" if clash[0] == instance_masks else "boxes, per_box or mask"
        raise ConfigError(f"Pipeline: {clash[0]!r} is named as {role} and elsewhere (image, label or fields)")
    seen_flip = False
    for op in pipe.image_ops:
        if isinstance(op, Flip):
            seen_flip = True
        elif seen_flip:
            raise ConfigError(f"Pipeline: boxes and masks follow Flip only after the crops and resizes; "
                              f"move {op!r} before Flip")
    if moving := [op for op in pipe.post_ops if op.moves_pixels]:
        raise ConfigError(f"Pipeline: boxes and masks cannot follow {moving[0]!r} (it moves pixels); leave it "
                          "out, or apply it to the image and what moves with it yourself in a MapBatch")
    return boxes, tuple(per_box), mask, mask_fill, instance_masks


def _split_stages(listed: list[Op | Stage]) -> tuple[tuple[Stage, ...], list[Op], tuple[Stage, ...]]:
    """(stages before the built-in ops, the built-in ops, stages after them). Without built-in ops,
    the ``Map``s and ``Filter``s up to the first ``MapBatch`` come before. Raises ConfigError for a stage between two
    built-in ops or a MapBatch before them."""
    builtin = [i for i, op in enumerate(listed) if isinstance(op, Op)]
    if builtin:
        first, last = builtin[0], builtin[-1] + 1
    else:
        first = last = next((i for i, op in enumerate(listed) if isinstance(op, MapBatch)), len(listed))
    for op in listed[first:last]:
        if isinstance(op, Stage):
            raise ConfigError(f"Pipeline: {op!r} stands between built-in ops; a user stage goes before "
                              "Decode (on the encoded fields) or after the last built-in op (on output rows or batches)")
    for op in listed[:first]:
        if isinstance(op, MapBatch):
            raise ConfigError(f"Pipeline: {op!r} comes before Decode; a MapBatch works on output batches, "
                              "after the last built-in op")
    return tuple(listed[:first]), list(listed[first:last]), tuple(listed[last:])


def training(
    size: int = 224,
    *,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3 / 4, 4 / 3),
    flip: float = 0.5,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    dtype: str | torch.dtype = torch.float32,
    auto_augment: str | PostOp | None = None,
    color_jitter: float | Sequence[float] | None = None,
    color_jitter_prob: float | None = None,
    **kwargs,
) -> Pipeline:
    """The ImageNet training pipeline: decode → random resized crop → flip → normalize (NCHW).

    ``auto_augment`` adds an augmentation policy between the flip and the normalize, as timm's
    ``create_transform(auto_augment=...)`` does: a timm config string (``"rand-m9-mstd0.5-inc1"``:
    ``TimmRandAugment``; ``"augmix-m5-w4-d2"``: ``TimmAugMix``; any other, timm's AutoAugment
    (``"original-mstd0.5"``, ``"v0r"``...): ``TimmAutoAugment``; their warps filling with ``mean``
    in levels, as timm's) or a post op (``RandAugment()``, ``AutoAugment()``...). Raises
    ConfigError for a string timm would not take.

    ``color_jitter`` adds a ``ColorTwist`` after the policy, as timm's ``create_transform(color_jitter=)``
    adds its ``ColorJitter``: a number f for brightness, contrast and saturation, or a tuple of three
    or four (with hue); ``color_jitter_prob`` applies it to that share of the samples (timm's
    ``RandomApply``). timm's default is 0.4 and it drops the jitter where a policy other than its
    ``3a`` is set; here it is off by default (torchvision's recipe) and applies where given. The
    twist is DALI's linear colour transform, not ``ColorJitter``'s four steps in a random order.
    Other arguments go to ``Pipeline`` (``splits=``, ``image=``, ``label=``...).
    """
    listed: list[Op] = [Decode(), RandomResizedCrop(size, scale, ratio), Flip(flip)]
    if isinstance(auto_augment, str):
        fill = tuple(min(255, round(255 * m)) for m in mean)
        if auto_augment.startswith("rand"):
            listed.append(TimmRandAugment(auto_augment, fill=fill))
        elif auto_augment.startswith("augmix"):
            listed.append(TimmAugMix(auto_augment, fill=fill))
        else:  # timm's create_transform: any other string is an AutoAugment policy
            listed.append(TimmAutoAugment(auto_augment, fill=fill))
    elif isinstance(auto_augment, PostOp):
        listed.append(auto_augment)
    elif auto_augment is not None:
        raise ConfigError(f"training: auto_augment must be a timm config string or a post op, got {auto_augment!r}")
    if color_jitter is not None:
        listed.append(_color_jitter(color_jitter, color_jitter_prob))
    elif color_jitter_prob is not None:
        raise ConfigError("training: color_jitter_prob needs color_jitter (the jitter it applies)")
    return Pipeline([*listed, Normalize(mean, std, dtype=dtype)], **kwargs)


def _color_jitter(jitter: object, prob: float | None) -> ColorTwist:
    """timm's ``color_jitter`` (a number for three, or a tuple of three or four) as a ColorTwist."""
    if isinstance(jitter, (int, float)) and not isinstance(jitter, bool):
        factors: tuple = (float(jitter),) * 3
    elif isinstance(jitter, (list, tuple)) and len(jitter) in (3, 4):
        factors = tuple(jitter)
    else:
        raise ConfigError(f"training: color_jitter must be a number or a tuple of three or four (brightness, contrast, "
                          f"saturation[, hue]), got {jitter!r}")
    return ColorTwist(*factors, p=1.0 if prob is None else prob)


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
