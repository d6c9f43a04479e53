"""Pipeline(boxes=) as a detector's training loop needs it: every box handed out has an area in
float32, and a per-box field has one dtype across the batch. Real JPEGs through the CPU path."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

import headrace
from headrace import ops, readers


def _black_jpeg(height: int, width: int) -> bytes:
    data = io.BytesIO()
    Image.fromarray(np.zeros((height, width, 3), np.uint8)).save(data, "JPEG", quality=95)
    return data.getvalue()


def _one_batch(samples, pipe_ops, per_box=("labels",)):
    pipe = ops.Pipeline([ops.Decode(), *pipe_ops], label=None, boxes="boxes", per_box=per_box)
    with headrace.Loader(readers.sequence(samples), batch_size=len(samples), pipeline=pipe, device="cpu").sync() as epochs:
        (batch,) = list(epochs)
    return batch


@pytest.mark.parametrize("flip", [0.0, 1.0])
def test_a_box_that_only_touches_the_crop_s_edge_is_dropped(flip):
    # Resize(50) of 110 x 110 then CenterCrop(40) keeps source pixels 11..99 of each side. The first
    # two boxes start on the crop's far edge, wholly outside it; the fold's float64 arithmetic put
    # them 1e-14 pixels inside, so they came out [40, y0, 40, y1] (no width in float32: torchvision's
    # detectors raise on it) or, flipped, 7e-15 wide, with their labels.
    samples = [{"jpg": _black_jpeg(110, 110), "labels": np.array([1, 2, 3]),
                "boxes": np.array([[99, 20, 105, 60], [20, 99, 60, 105], [30, 30, 60, 60]], np.float32)}]
    batch = _one_batch(samples, [ops.Resize(50), ops.CenterCrop(40), ops.Flip(flip)])
    assert batch["labels"][0].tolist() == [3]
    x0, x1 = (30 - 11) / 2.2, (60 - 11) / 2.2
    expected = [40 - x1, x0, 40 - x0, x1] if flip else [x0, x0, x1, x1]
    np.testing.assert_allclose(batch["boxes"][0].numpy(), [expected], rtol=1e-6)


def test_every_box_handed_out_has_an_area_in_float32():
    # A box 1e-5 wide near x = 1000 has an area in float64 but none in float32.
    samples = [{"jpg": _black_jpeg(40, 1100), "labels": np.array([1, 2]),
                "boxes": np.array([[1000.0, 5, 1000.00001, 30], [900, 5, 950, 30]], np.float64)}]
    batch = _one_batch(samples, [ops.Flip(0.0)])
    boxes = batch["boxes"][0]
    assert batch["labels"][0].tolist() == [2]
    assert bool((boxes[:, 2:] > boxes[:, :2]).all())


def _with_json_boxes(fields):
    objects = json.loads(fields.pop("json"))
    fields["boxes"] = [o["xyxy"] for o in objects]
    fields["classes"] = [o["class"] for o in objects]
    fields["weights"] = [[o["class"] / 10, 1.0] for o in objects]
    return fields


def test_a_per_box_field_from_an_empty_list_takes_the_batch_s_dtype():
    # docs/detection.md's "Boxes from another source": an image without objects has the JSON "[]",
    # which NumPy makes float64. Its classes came out float64 beside the others' int64, and
    # torch.cat of a batch's labels (a detector's loss) then made every label a float.
    samples = [{"jpg": _black_jpeg(100, 120), "json": json.dumps([{"xyxy": [10, 10, 50, 50], "class": 2}])},
               {"jpg": _black_jpeg(100, 120), "json": "[]"}]
    pipe = ops.Pipeline([ops.Map(_with_json_boxes), ops.Decode(), ops.Resize((64, 64))], label=None, boxes="boxes",
                        per_box=("classes", "weights"))
    with headrace.Loader(readers.sequence(samples), batch_size=2, pipeline=pipe, device="cpu").sync() as epochs:
        (batch,) = list(epochs)
    assert [c.dtype for c in batch["classes"]] == [torch.int64, torch.int64]
    assert [tuple(c.shape) for c in batch["classes"]] == [(1,), (0,)]
    assert [tuple(w.shape) for w in batch["weights"]] == [(1, 2), (0, 2)]
    assert torch.cat(batch["classes"]).dtype == torch.int64
    assert [tuple(b.shape) for b in batch["boxes"]] == [(1, 4), (0, 4)]
