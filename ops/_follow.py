"""What moves with the image: boxes and masks through the geometry its pixels go through.

Both executors fold the geometry ops into one source box, output size and flips per sample
(``_geometry.plan_batch``), from random numbers keyed on (seed, epoch, op, sample index). The same
fold, computed here from the image's header and the same keys, maps the fields that move with the
image without the executor's help, so they follow the pixels on the CPU and the GPU path alike:
boxes (``_boxes``), a segmentation mask and instance masks (``_masks``), the instance masks kept
and dropped with their boxes.

Each sample's fields are read and checked before its image is decoded (a bad one fails the sample
there, named, and the executor never sees it); after decoding, the kept rows are mapped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from headrace._sample import Sample

from . import _pillow
from ._exif import jpeg_orientation
from ._boxes import BoxFields, follow_boxes, read_boxes
from ._geometry import PlanBatch, plan_batch
from ._limits import claimed_size
from ._masks import follow_instance_masks, follow_masks, read_instance_masks, read_mask
from ._pipeline import Pipeline
from ._iou_crop import WINDOW_FIELD, choose_windows, op_randoms

__all__ = ["Carried", "carried_columns", "read_carried", "rows_on_device", "with_iou_windows"]


@dataclass(slots=True)
class Carried:
    """One sample's fields that move with its image, as read before decoding, and the size the
    image decodes to (upright)."""

    height: int
    width: int
    boxes: BoxFields | None = None
    mask: np.ndarray | None = None  # (height, width), integers
    instances: np.ndarray | None = None  # (N, height, width) uint8, one a box as read
    instance_rows: np.ndarray | None = None  # which of them go on with ``boxes`` (None: all); no copy of the masks


def read_carried(sample: Sample, pipe: Pipeline, image: Any) -> Carried:
    """``sample``'s boxes, mask and instance masks, checked, and the upright size of ``image`` (its
    encoded bytes) from the header. Raises TransformError naming the sample for fields that cannot
    follow the image, DecodeError for an unreadable header."""
    boxes = read_boxes(sample, pipe) if pipe.boxes is not None else None  # before the header: cheaper checks first
    height, width = _upright_size(sample, pipe, image)
    mask = read_mask(sample, pipe, height, width) if pipe.mask is not None else None
    instances = None
    if pipe.instance_masks is not None:
        assert boxes is not None  # the Pipeline asks for boxes with them
        instances = read_instance_masks(sample, pipe, height, width, len(boxes.boxes))
    return Carried(height, width, boxes, mask, instances)


def _upright_size(sample: Sample, pipe: Pipeline, image: Any) -> tuple[int, int]:
    """(height, width) of ``image`` as ``Decode`` makes it. A JPEG's from its frame header and EXIF
    tag, read here in ~2 µs (Pillow's open takes ~45, a core's worth at 25,000 images/s); any
    other format, or a JPEG whose header does not say, from Pillow's open, as the decoders read it.
    A file that cannot be decoded fails in the decoder, as it would without boxes or a mask."""
    if bytes(image[:2]) == b"\xff\xd8":
        size = claimed_size(image)
        if size is not None and size[0] > 0 and size[1] > 0:
            width, height = size
            if pipe.decode.exif and jpeg_orientation(image) >= 5:
                width, height = height, width
            return height, width
    opened = _pillow.open_image(image, pipe.decode, sample.key, sample.source)
    try:
        return opened.height, opened.width
    finally:
        opened.img.close()


def with_iou_windows(samples: list[Sample], rows: list[int], pipe: Pipeline, carried: dict[int, Carried],
                     seed: int, epoch: int) -> None:
    """For a pipeline that starts with ``RandomIoUCrop``: the windows of ``samples[i]`` for the
    ``rows``, chosen on their boxes for the batch at once (``choose_windows``). Each of those
    samples is replaced by one carrying its window (the reader's stays as it was) and its
    ``carried`` boxes by those whose centres the window holds (their instance masks with them)."""
    op = pipe.iou_crop
    assert op is not None
    if not rows:
        return
    found = [carried[i] for i in rows]
    boxes_of = [c.boxes for c in found]
    assert all(b is not None for b in boxes_of)  # the op needs Pipeline(boxes=): read before this
    chosen = choose_windows(op, [c.height for c in found], [c.width for c in found],
                            [b.boxes for b in boxes_of], seed, epoch, 1,  # type: ignore[union-attr]
                            np.fromiter((samples[i].index for i in rows), dtype=np.int64, count=len(rows)))
    for i, c, boxes, (window, inside) in zip(rows, found, boxes_of, chosen):
        if not inside.all():
            c.boxes = BoxFields(boxes.boxes[inside], {name: values[inside] for name, values in boxes.per_box.items()})
            if c.instances is not None:
                c.instance_rows = _instance_rows(c)[inside]
        s = samples[i]
        samples[i] = Sample(s.key, {**s.fields, WINDOW_FIELD: window}, s.source, s.index, s.position)


def plan_rows(pipe: Pipeline, seed: int, epoch: int, samples: list[Sample], carried: list[Carried]) -> PlanBatch:
    """The geometry both executors fold for these samples."""
    indices = np.fromiter((s.index for s in samples), dtype=np.int64, count=len(samples))
    randoms = op_randoms(pipe.image_ops, seed, epoch, indices, samples)
    heights = np.array([c.height for c in carried], dtype=np.int64)
    widths = np.array([c.width for c in carried], dtype=np.int64)
    return plan_batch(heights, widths, pipe.image_ops, randoms)


def carried_columns(pipe: Pipeline, seed: int, epoch: int, samples: list[Sample], carried: list[Carried]
                    ) -> dict[str, Any]:
    """The batch's columns of what moved with its images: ``boxes`` and the ``per_box`` fields (a
    tensor a row), ``mask`` (one tensor when the ops fix the output size, as the images, else a tensor
    a row), the instance masks (a tensor ``[N, H, W]`` a row, the layers of the boxes kept)."""
    plan = plan_rows(pipe, seed, epoch, samples, carried)
    out: dict[str, Any] = {}
    if pipe.boxes is not None:
        columns, keeps = follow_boxes(pipe, plan, [c.boxes for c in carried])
        out.update(columns)
        if pipe.instance_masks is not None:
            layers = [_instance_rows(c)[kept] for c, kept in zip(carried, keeps)]
            out[pipe.instance_masks] = follow_instance_masks(plan, [c.instances for c in carried], layers)
    if pipe.mask is not None:
        out[pipe.mask] = follow_masks(plan, [c.mask for c in carried], pipe.mask_fill, pipe.output_size() is not None)
    return out


def _instance_rows(c: Carried) -> np.ndarray:
    """Which layers of ``c.instances`` go on with ``c.boxes``, in order (int64)."""
    assert c.instances is not None
    return np.arange(len(c.instances)) if c.instance_rows is None else c.instance_rows


def rows_on_device(columns: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """A batch's columns (fields, boxes, masks) copied to ``device``: a tensor as it is, a list of
    tensors (a row each) in one transfer handed out as views of it, anything else (bytes, str) as it
    is. From pageable memory: pinning a fresh buffer each batch costs more than these copies
    (``StageCalls.copied_beside`` issues them where nothing makes them wait).

    One transfer, and a constant number of torch calls a column, rather than a copy a row: a row
    is a few dozen bytes (a sample's boxes or labels), and each torch call lets the GIL go and
    must take it back. With the stage threads, decode lanes and prep thread in Python, each take
    waited up to the switch interval (5 ms): on the H200, a reshape and a view a row (~130 calls a
    column) took 63-95 ms a batch of 64, and a copy a row of a ``fields`` list column 12 ms."""
    return {name: _column_on_device(column, device) for name, column in columns.items()}


def _column_on_device(column: Any, device: torch.device) -> Any:
    if isinstance(column, torch.Tensor):
        return column.to(device, non_blocking=True)
    if not (isinstance(column, list) and column and all(isinstance(row, torch.Tensor) for row in column)):
        return column
    first = column[0]
    # Rows of several dtypes have no one tensor to join them into; rows not on the host (a stage
    # made them on the GPU) need no transfer, and ``.to`` is no copy for those already there.
    if not all(row.dtype == first.dtype and row.device.type == "cpu" for row in column):
        return [row.to(device, non_blocking=True) for row in column]
    # Attribute reads (shape, dtype, device) keep the GIL: only cat, to and split are torch calls.
    if all(row.ndim and row.shape[1:] == first.shape[1:] for row in column):  # boxes [N, 4], labels [N]
        flat = torch.cat(column, dim=0).to(device, non_blocking=True)
        return list(torch.split(flat, [row.shape[0] for row in column], dim=0))
    # Rows of other shapes (masks of different sizes): still one transfer, flattened, a view a row.
    flat = torch.cat([row.reshape(-1) for row in column]).to(device, non_blocking=True)
    return [part.view(row.shape) for part, row in zip(flat.split([row.numel() for row in column]), column)]
