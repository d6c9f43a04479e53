"""Pipeline(instance_masks=) as a Mask R-CNN user feeds it from a reader of their own: real JPEGs,
the objects in a JSON field parsed by a Map before Decode (as docs/detection.md's "Boxes from
another source" does for boxes), through the Loader on the CPU path."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

import headrace
from headrace import TransformError, ops, readers


def _jpeg(height: int, width: int) -> bytes:
    data = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 90, np.uint8)).save(data, "JPEG")
    return data.getvalue()


def _parse_objects(fields):
    """One mask an object, as a list: the natural form, and "[]" for an image without objects."""
    objects = json.loads(fields.pop("json"))
    fields["boxes"] = [o["xyxy"] for o in objects]
    fields["classes"] = [o["class"] for o in objects]
    fields["masks"] = [np.asarray(o["mask"], np.uint8) for o in objects]
    return fields


def _loader(samples, **kwargs):
    pipe = ops.Pipeline([ops.Map(_parse_objects), ops.Decode(), ops.Resize((40, 60)), ops.Flip(1.0)], label=None,
                        boxes="boxes", per_box=("classes",), instance_masks="masks")
    return headrace.Loader(readers.sequence(samples, shuffle=False), batch_size=len(samples), pipeline=pipe,
                           device="cpu", **kwargs)


def test_an_image_without_objects_given_as_an_empty_list_has_no_masks():
    # A sample's masks as a list of one mask an object came out of NumPy float64 [0] for an image
    # with none, and the sample failed ("is 1-D float64, not a 3-D array"): every image without
    # objects lost, under on_error="skip" silently. Its boxes "[]" were already taken as [0, 4].
    mask = np.zeros((20, 30), np.uint8)
    mask[2:8, 3:9] = 1
    samples = [{"jpg": _jpeg(20, 30), "json": json.dumps([{"xyxy": [3, 2, 9, 8], "class": 1, "mask": mask.tolist()}])},
               {"jpg": _jpeg(20, 30), "json": "[]"}]
    with _loader(samples).sync() as epochs:
        (batch,) = list(epochs)
    assert batch.sample_keys == ["0", "1"] and batch.dropped == 0
    full, empty = batch["masks"]
    assert full.dtype == empty.dtype == torch.uint8
    assert tuple(full.shape) == (1, 40, 60) and tuple(empty.shape) == (0, 40, 60)
    expected = np.zeros((40, 60), np.uint8)
    expected[4:16, 6:18] = 1  # doubled by the resize, then mirrored
    np.testing.assert_array_equal(full[0].numpy(), expected[:, ::-1])
    assert batch["boxes"][0].tolist() == [[42.0, 4.0, 54.0, 16.0]] and tuple(batch["boxes"][1].shape) == (0, 4)


def test_an_empty_list_for_an_image_with_boxes_is_one_short_named():
    def masks_left_out(fields):
        return {**_parse_objects(fields), "masks": []}

    pipe = ops.Pipeline([ops.Map(masks_left_out), ops.Decode(), ops.Resize((40, 60))], label=None, boxes="boxes",
                        per_box=("classes",), instance_masks="masks")
    samples = [{"jpg": _jpeg(20, 30), "json": json.dumps([{"xyxy": [3, 2, 9, 8], "class": 1, "mask": []}])}]
    loader = headrace.Loader(readers.sequence(samples, shuffle=False), batch_size=1, pipeline=pipe, device="cpu")
    with pytest.raises(TransformError, match="holds 0 masks for 1 boxes") as info:
        with loader.sync() as epochs:
            list(epochs)
    assert info.value.key == "0"


@pytest.mark.parametrize("empty", [[], np.zeros(0), torch.zeros(0, dtype=torch.bool)],
                         ids=["list", "float array", "bool tensor"])
def test_no_masks_in_any_empty_form_for_no_boxes(empty):
    def no_objects(fields):
        return {"jpg": fields["jpg"], "boxes": [], "classes": [], "masks": empty}

    pipe = ops.Pipeline([ops.Map(no_objects), ops.Decode(), ops.CenterCrop(32)], label=None, boxes="boxes",
                        per_box=("classes",), instance_masks="masks")
    samples = [{"jpg": _jpeg(20, 30)}, {"jpg": _jpeg(24, 16)}]
    with headrace.Loader(readers.sequence(samples, shuffle=False), batch_size=2, pipeline=pipe,
                         device="cpu").sync() as epochs:
        (batch,) = list(epochs)
    assert [(tuple(m.shape), m.dtype) for m in batch["masks"]] == [((0, 32, 32), torch.uint8)] * 2
