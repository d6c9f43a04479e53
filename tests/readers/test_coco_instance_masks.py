"""readers.coco(instance_masks=True): one binary mask an annotation, row for row with the boxes,
drawn on request from the same polygons and RLE as the class map (``masks=True``). A real COCO
file and real JPEGs (``test_coco``'s helpers); each layer is checked against the annotation's own
segmentation: the RLE's pixels as given, a polygon as the class map fills it alone (itself checked
against pycocotools in ``test_coco_polygons``), and the box it belongs to."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
from test_coco import CATEGORIES, _rle_string, _runs, _write

from headrace import ConfigError, ReadError, readers
from headrace._sample import value_nbytes
from headrace.readers._coco_masks import CocoInstanceMasks, CocoMask

H, W = 40, 60


def _region(y0, y1, x0, x1, shape=(H, W)):
    out = np.zeros(shape, bool)
    out[y0:y1, x0:x1] = True
    return out


CROWD = _region(25, 35, 5, 15)  # annotation 202, as RLE runs
SPOT = _region(4, 12, 10, 30)  # annotation 205, as a compressed RLE string: over 201's polygon
PEAK = np.tril(np.ones((10, 10), bool))  # nothing overlaps annotation 207's triangle
TRI = np.zeros((H, W), bool)
TRI[28:38, 45:55] = PEAK

# id, category, bbox (x, y, w, h), iscrowd, segmentation: in the file's order, on image 1 (60 x 40)
ANNOTATIONS = [
    (201, 1, [2, 2, 18, 13], 0, [[2, 2, 20, 2, 20, 15, 2, 15]]),
    (202, 3, [5, 25, 10, 10], 1, {"counts": _runs(CROWD), "size": [H, W]}),
    (203, 90, [30, 3, 20, 18], 0, [[30, 3, 38, 3, 38, 11, 30, 11], [40, 12, 50, 21, 40, 21]]),  # two apart
    (204, 1, [22, 22, 0, 5], 0, [[22, 22, 23, 22, 23, 27]]),  # no width: left out, with its mask
    (205, 3, [10, 4, 20, 8], 0, {"counts": _rle_string(_runs(SPOT)), "size": [H, W]}),
    (206, 1, [20, 20, 16, 2], 0, [[20, 20, 30, 20, 30, 22, 20, 22], [26, 20, 36, 20, 36, 22, 26, 22]]),  # overlapping
    (207, 90, [45, 28, 10, 10], 0, {"counts": _runs(TRI), "size": [H, W]}),
]


def _doc():
    return {"images": [{"id": 1, "file_name": "a.jpg", "width": W, "height": H},
                       {"id": 2, "file_name": "empty.jpg", "width": 30, "height": 20}],
            "categories": CATEGORIES,
            "annotations": [{"id": a, "image_id": 1, "category_id": c, "bbox": box, "iscrowd": crowd,
                             "segmentation": seg} for a, c, box, crowd, seg in ANNOTATIONS]}


@pytest.fixture(scope="module")
def instance_set(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("coco-instances"), _doc(), [("a.jpg", 1, (W, H)), ("empty.jpg", 2, (30, 20))])


async def _samples(images, annotations, **kwargs):
    reader = readers.coco(images, annotations, **kwargs)
    async with contextlib.aclosing(reader.read(0, seed=0)) as stream:
        return {s.key: s async for chunk in stream for s in chunk}


def _polygon_alone(polygon):
    """One polygon as the class map fills it, alone, as a bool mask."""
    return np.asarray(CocoMask(H, W, [1], [[polygon]])) == 1


RLE_PIXELS = {202: CROWD, 205: SPOT, 207: TRI}


def _expected(annotation, segmentation):
    """An annotation's mask from its own data: the RLE's pixels, or its polygons' union."""
    if isinstance(segmentation, dict):
        return RLE_PIXELS[annotation]
    return np.logical_or.reduce([_polygon_alone(p) for p in segmentation])


def _kept(include_crowd=True, min_box_size=0.0):
    return [(a, c, box, seg) for a, c, box, crowd, seg in ANNOTATIONS
            if (include_crowd or not crowd) and box[2] > min_box_size and box[3] > min_box_size]


@pytest.mark.parametrize(("kwargs"), [{}, {"include_crowd": False}, {"min_box_size": 2}],
                         ids=["defaults", "no crowd", "min_box_size=2"])
async def test_one_mask_a_kept_annotation_in_the_boxes_order(instance_set, kwargs):
    sample = (await _samples(*instance_set, instance_masks=True, **kwargs))["a"]
    boxes, labels = sample.fields["boxes"], sample.fields["labels"]
    masks = np.asarray(sample.fields["masks"])
    kept = _kept(**kwargs)
    assert masks.dtype == np.uint8 and masks.shape == (len(kept), H, W) == (len(boxes), H, W) and len(labels) == len(kept)
    assert set(np.unique(masks).tolist()) == {0, 1}
    label_of = {1: 1, 3: 2, 90: 3}  # CATEGORIES' ids numbered 1..K in id order
    for layer, box, label, (annotation, category, bbox, seg) in zip(masks, boxes, labels, kept):
        assert label == label_of[category]
        np.testing.assert_array_equal(box, [bbox[0], bbox[1], bbox[0] + bbox[2], bbox[1] + bbox[3]])
        np.testing.assert_array_equal(layer, _expected(annotation, seg).astype(np.uint8))
        ys, xs = np.nonzero(layer)  # the mask lies in its own box: the rows are aligned
        assert box[0] - 1 <= xs.min() and xs.max() < box[2] + 1 and box[1] - 1 <= ys.min() and ys.max() < box[3] + 1
    if kwargs.get("min_box_size") == 2:
        assert 206 not in [a for a, *_ in kept]  # a box 2 px high is not more than 2: its mask goes with it


async def test_an_image_without_annotations_has_no_masks_of_its_size(instance_set):
    sample = (await _samples(*instance_set, instance_masks=True))["empty"]
    masks = np.asarray(sample.fields["masks"])
    assert masks.shape == (0, 20, 30) and masks.dtype == np.uint8 and sample.fields["boxes"].shape == (0, 4)


async def test_several_polygons_are_their_union_and_rle_is_as_given(instance_set):
    masks = np.asarray((await _samples(*instance_set, instance_masks=True))["a"].fields["masks"])
    ids = [a for a, *_ in _kept()]
    apart = [_polygon_alone(p) for p in ANNOTATIONS[2][4]]
    overlapping = [_polygon_alone(p) for p in ANNOTATIONS[5][4]]
    assert all(p.any() for p in apart + overlapping)
    both = overlapping[0] & overlapping[1]
    assert both.any()  # the two polygons of 206 share pixels: 1 there (a union), not 0 (an even-odd fill)
    np.testing.assert_array_equal(masks[ids.index(203)], (apart[0] | apart[1]).astype(np.uint8))
    np.testing.assert_array_equal(masks[ids.index(206)], (overlapping[0] | overlapping[1]).astype(np.uint8))
    assert (masks[ids.index(206)][both] == 1).all()
    np.testing.assert_array_equal(masks[ids.index(202)], CROWD.astype(np.uint8))  # runs as a list
    np.testing.assert_array_equal(masks[ids.index(205)], SPOT.astype(np.uint8))  # runs as pycocotools' string


@pytest.mark.parametrize("include_crowd", [True, False])
async def test_the_class_map_is_the_instance_masks_drawn_with_their_labels(instance_set, include_crowd):
    sample = (await _samples(*instance_set, masks=True, instance_masks=True, include_crowd=include_crowd))["a"]
    classes, masks = np.asarray(sample.fields["mask"]), np.asarray(sample.fields["masks"])
    labels = sample.fields["labels"]
    composed = np.zeros((H, W), np.uint8)
    for layer, label in zip(masks, labels):  # later annotations over earlier ones, as the class map draws them
        composed[layer == 1] = label
    np.testing.assert_array_equal(classes, composed)
    # Where one annotation alone covers a pixel, both say the same; where none does, 0 in the class map.
    cover = masks.sum(axis=0)
    for layer, label in zip(masks, labels):
        alone = (layer == 1) & (cover == 1)
        assert alone.any() and (classes[alone] == label).all()
    assert (classes[cover == 0] == 0).all() and (cover > 1).any()  # 205 overlaps 201


async def test_masks_are_drawn_when_asked_for_not_when_read(tmp_path):
    big_h, big_w = 1200, 1600
    doc = {"images": [{"id": 1, "file_name": "big.jpg", "width": big_w, "height": big_h}], "categories": CATEGORIES,
           "annotations": [{"id": i, "image_id": 1, "category_id": 1, "bbox": [10 * i, 10, 300, 300], "iscrowd": 0,
                            "segmentation": [[10 * i, 10, 10 * i + 300, 10, 10 * i + 300, 310, 10 * i, 310]]}
                           for i in range(1, 9)]}
    images, annotations = _write(tmp_path, doc, [("big.jpg", 1, (big_w, big_h))])
    field = (await _samples(images, annotations, instance_masks=True))["big"].fields["masks"]
    assert isinstance(field, CocoInstanceMasks) and not isinstance(field, np.ndarray)
    # A chunk's bytes count what the sample holds: the polygons, not 8 x 1200 x 1600 drawn bytes.
    assert value_nbytes(field) < 1024
    first, second = np.asarray(field), np.asarray(field)
    assert first.shape == (8, big_h, big_w) and first.dtype == np.uint8
    assert first is not second and np.array_equal(first, second)
    first[:] = 0  # a drawn array is the caller's: the next one is drawn afresh
    assert np.array_equal(np.asarray(field), second) and second.sum() == 8 * 300 * 300
    assert np.asarray(field, dtype=bool).dtype == bool
    assert repr(field) == "CocoInstanceMasks(1600x1200, 8 annotations)"


async def test_it_is_one_field_beside_the_others(instance_set):
    plain = (await _samples(*instance_set))["a"]
    both = (await _samples(*instance_set, masks=True, instance_masks=True))["a"]
    only = (await _samples(*instance_set, instance_masks=True))["a"]
    assert set(plain.fields) == {"jpg", "boxes", "labels", "image_id"}
    assert set(only.fields) == set(plain.fields) | {"masks"} and set(both.fields) == set(plain.fields) | {"masks", "mask"}
    np.testing.assert_array_equal(np.asarray(only.fields["masks"]), np.asarray(both.fields["masks"]))


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_instance_masks_takes_true_or_false(instance_set, value):
    with pytest.raises(ConfigError, match="instance_masks must be True or False"):
        readers.coco(*instance_set, instance_masks=value)


@pytest.mark.parametrize(("segmentation", "message"), [
    (None, "neither polygons nor an RLE"),
    ([[1, 2, 3, 4]], "at least three points"),
    ({"counts": [5, 5], "size": [H, W]}, "cover 10 pixels"),
    ({"counts": "0", "size": [H, W]}, "RLE counts string"),
])
def test_a_bad_segmentation_is_a_read_error_naming_it(instance_set, tmp_path, segmentation, message):
    doc = _doc()
    doc["annotations"][4]["segmentation"] = segmentation
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ReadError, match=f"annotation 205 .*{message}") as info:
        readers.coco(instance_set[0], path, instance_masks=True)
    assert info.value.source == str(path)
    assert len(readers.coco(instance_set[0], path)) == 2  # without masks the segmentations are not read
