"""Review of how a Pipeline is composed: each mistake a user can make when listing ops or naming
fields is a ConfigError at construction, naming what is wrong, rather than a TypeError or a
failure on every sample at the first batch."""

from __future__ import annotations

import pytest

from headrace import ConfigError, ops
from headrace.ops import CenterCrop, ColorTwist, Decode, Flip, Normalize, Pipeline, Resize

ORDER_WORDS = ("geometry ops", "at most one Normalize", "last")


@pytest.mark.parametrize(
    ("listed", "named"),
    [
        ([Decode(), Normalize(), Resize(8)], "Resize(size=8) comes after Normalize"),
        ([Decode(), Normalize(), Normalize()], "is a second Normalize"),
        ([Decode(), ColorTwist(0.2), CenterCrop(8)], "CenterCrop(size=(8, 8)) is a geometry op after"),
        ([Decode(), Decode()], "is a second Decode"),
        ([Resize(8), Decode()], "is a second Decode"),
    ],
)
def test_op_order_error_names_the_op_and_the_allowed_order(listed, named):
    with pytest.raises(ConfigError) as info:
        Pipeline(listed)
    assert named in str(info.value)
    assert all(word in str(info.value) for word in ORDER_WORDS)


@pytest.mark.parametrize("ops_argument", [None, Resize(8), "Resize", ops.Map(len)])
def test_ops_that_are_not_a_list_are_a_config_error(ops_argument):
    with pytest.raises(ConfigError, match="ops must be a list"):
        Pipeline(ops_argument)


@pytest.mark.parametrize("image", [1, "", ["jpg", ""], [b"jpg"]])
def test_image_that_names_no_field_is_a_config_error(image):
    with pytest.raises(ConfigError, match="image must name"):
        Pipeline(image=image)


def test_empty_label_name_is_a_config_error():
    with pytest.raises(ConfigError, match="label must be a field name"):
        Pipeline(label="")


def test_label_naming_an_image_field_is_a_config_error():
    with pytest.raises(ConfigError, match="label='png' is also an image field"):
        Pipeline([Decode(), Resize((8, 8))], label="png")


@pytest.mark.parametrize("carried", [dict(boxes="cls"), dict(boxes="b", per_box=["cls"]), dict(mask="cls")])
def test_boxes_or_mask_naming_the_label_field_is_a_config_error(carried):
    with pytest.raises(ConfigError, match="'cls' is named as boxes, per_box or mask and elsewhere"):
        Pipeline([Decode(), Resize((8, 8))], label="cls", **carried)


def test_boxes_may_share_a_name_with_no_label():
    pipe = Pipeline([Decode(), Resize((8, 8))], label=None, boxes="cls")
    assert pipe.boxes == "cls"


def test_repr_shows_a_uint8_layout():
    hwc, chw = Pipeline([Decode(), Resize((8, 8))], layout="HWC"), Pipeline([Decode(), Resize((8, 8))])
    assert "layout='HWC'" in repr(hwc)
    assert repr(hwc) != repr(chw)
    assert "layout" not in repr(chw)


def test_repr_leaves_the_layout_to_normalize():
    pipe = Pipeline([Decode(), Resize((8, 8)), Flip(), Normalize(layout="HWC")])
    assert repr(pipe).count("layout=") == 1
