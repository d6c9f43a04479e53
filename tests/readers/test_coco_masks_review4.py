"""An image's polygons are walked together (``_coco_masks._crossings``: one walk of all their edges,
not one a polygon): each layer of ``CocoInstanceMasks``, and each label of ``CocoMask``, must come out
as the annotation drawn alone does (alone, checked against pycocotools in ``test_coco_polygons``)."""

from __future__ import annotations

import numpy as np
from test_coco import _rle_string, _runs
from test_coco_polygons import random_annotations

from headrace.readers._coco_masks import CocoInstanceMasks, CocoMask, polygon_boundary

H, W = 40, 40


def _alone(segmentation):
    return np.asarray(CocoInstanceMasks(H, W, [segmentation]))[0]


def _annotations():
    """The polygon tests' random annotations on one 40 x 40 image, an RLE (runs, then a string)
    between them, and two polygons whose first vertices sit either side of a column's centre
    line (fine x 2, then 3): from one polygon's walk to the next is no crossing."""
    segmentations = [polygons for _, _, polygons in random_annotations(4, 60)]
    spot = np.zeros((H, W), bool)
    spot[5:30, 3:11] = True
    segmentations.insert(10, {"counts": _runs(spot), "size": [H, W]})
    segmentations.insert(30, {"counts": _rle_string(_runs(~spot)), "size": [H, W]})
    segmentations += [[[0.4, 1, 5, 1, 5, 5]], [[0.6, 8, 6, 8, 6, 12]], [[0.4, 20, 5, 20, 5, 25], [0.6, 28, 6, 28, 6, 32]]]
    return segmentations


def test_layers_drawn_together_are_each_drawn_alone():
    segmentations = _annotations()
    layers = np.asarray(CocoInstanceMasks(H, W, segmentations))
    assert layers.shape == (len(segmentations), H, W) and layers.dtype == np.uint8
    wrong = [i for i, seg in enumerate(segmentations) if not np.array_equal(layers[i], _alone(seg))]
    assert not wrong, f"layers {wrong} differ from their annotation drawn alone"
    assert layers[-3:].any(axis=(1, 2)).all()


def test_class_map_is_its_annotations_drawn_in_order():
    segmentations = _annotations()
    labels = [1 + i % 300 for i in range(len(segmentations))]  # past 255: int64
    expected = np.zeros((H, W), np.int64)
    for label, seg in zip(labels, segmentations):
        expected[_alone(seg) == 1] = label
    np.testing.assert_array_equal(np.asarray(CocoMask(H, W, labels, segmentations)), expected)


def test_first_vertices_either_side_of_a_centre_line_cross_nothing_between_polygons():
    # The first polygon's walk ends at fine x 2, the second starts at 3: a step over column 0's centre if joined.
    left, right = [0.4, 1, 5, 1, 5, 5], [0.6, 8, 6, 8, 6, 12]
    np.testing.assert_array_equal(_alone([left, right]), _alone([left]) | _alone([right]))
    assert len(polygon_boundary(left, H, W)) % 2 == 0
