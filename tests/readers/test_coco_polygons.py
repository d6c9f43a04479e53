"""COCO polygons fill exactly as pycocotools fills them (``frPyObjects``, ``merge``, ``decode``): every
pixel of ``CocoMask``'s map against pycocotools' masks stored as compressed RLE strings in
``coco_polygon_refs.json`` (pycocotools is not needed to run these tests).

The file holds named cases (integer and half-pixel squares, a triangle, collinear points, a sliver
of no area, polygons across or outside the image's border, concave shapes, several polygons of
one annotation, a large star) with their polygons, and the masks of random annotations that
``random_annotations`` makes again from the file's seed: float, integer, half-pixel and near-tie
coordinates, self-crossing, star-shaped (concave), collinear, sliver and repeated-vertex polygons,
some reaching past the border, one to three an annotation.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from headrace.readers._coco_masks import CocoMask, decode_rle

REFS = json.loads((Path(__file__).parent / "coco_polygon_refs.json").read_text())


def random_annotations(seed: int, count: int) -> list[tuple[int, int, list[list[float]]]]:
    """``count`` annotations as (height, width, polygons), from ``random.Random(seed).random()``
    alone, whose sequence Python keeps the same across versions."""
    rng = random.Random(seed)

    def uniform(lo: float, hi: float) -> float:
        return lo + (hi - lo) * rng.random()

    def pick(options: list) -> object:
        return options[min(int(rng.random() * len(options)), len(options) - 1)]

    out = []
    for _ in range(count):
        height, width = 5 + int(rng.random() * 36), 5 + int(rng.random() * 36)
        rounding = pick(["float", "integer", "hundredths", "half", "near a fifth"])
        margin = pick([0, 3, width])

        def coordinate(lo: float, hi: float) -> float:
            c = uniform(lo, hi)
            if rounding == "integer":
                return float(round(c))
            if rounding == "hundredths":
                return round(c, 2)
            if rounding == "half":
                return round(2 * c) / 2
            if rounding == "near a fifth":  # the fine grid's ties, and a hair either side of them
                return round(5 * c) / 5 + pick([0.0, 0.1, -0.1, 1e-7, -1e-7])
            return c

        def point() -> tuple[float, float]:
            return coordinate(-margin, width + margin), coordinate(-margin, height + margin)

        polygons = []
        for _ in range(pick([1, 1, 1, 2, 3])):
            k = 3 + int(rng.random() * 10)
            shape = pick(["random", "star", "collinear", "sliver", "repeated vertex"])
            if shape == "star":  # concave, its vertices at random radii around a centre
                cx, cy = point()
                radius = uniform(1, max(height, width))
                points = [(cx + radius * uniform(0.2, 1) * math.cos(2 * math.pi * j / k),
                           cy + radius * uniform(0.2, 1) * math.sin(2 * math.pi * j / k)) for j in range(k)]
            elif shape == "collinear":
                (x0, y0), (x1, y1) = point(), point()
                points = [(x0 + (x1 - x0) * f, y0 + (y1 - y0) * f) for f in sorted(rng.random() for _ in range(k))]
            elif shape == "sliver":  # a flat triangle, down to no area at all
                x0, y0 = point()
                points = [(x0, y0), (x0 + uniform(-width, width), y0 + pick([0.0, uniform(-0.3, 0.3)])),
                          (x0 + uniform(-width, width), y0)]
            else:
                points = [point() for _ in range(k)]
                if shape == "repeated vertex":
                    j = int(rng.random() * k)
                    points.insert(j, points[j])
            polygons.append([c for p in points for c in p])
        out.append((height, width, polygons))
    return out


def _filled(height: int, width: int, polygons: list[list[float]]) -> np.ndarray:
    return np.asarray(CocoMask(height, width, [1], [polygons])) == 1


@pytest.mark.parametrize("case", REFS["cases"], ids=[case["name"] for case in REFS["cases"]])
def test_named_polygons_fill_as_pycocotools(case):
    height, width = case["size"]
    expected = decode_rle(case["counts"], height, width)
    np.testing.assert_array_equal(_filled(height, width, case["polygons"]), expected)


def test_random_polygons_fill_as_pycocotools():
    annotations = random_annotations(REFS["random"]["seed"], len(REFS["random"]["counts"]))
    wrong = [i for i, ((height, width, polygons), counts) in enumerate(zip(annotations, REFS["random"]["counts"]))
             if not np.array_equal(_filled(height, width, polygons), decode_rle(counts, height, width))]
    assert not wrong, f"{len(wrong)} of {len(annotations)} annotations differ from pycocotools: {wrong[:10]}"


def test_pixel_counts_of_squares_are_pycocotools():
    # Pillow filled 187 and 100: a pixel more along two edges
    assert _filled(30, 40, [[20, 2, 36, 2, 36, 12, 20, 12]]).sum() == 160
    assert _filled(30, 40, [[20, 2, 36, 2, 36, 12, 20, 12]])[2:12, 20:36].all()
    assert _filled(12, 12, [[0.5, 0.5, 9.5, 0.5, 9.5, 9.5, 0.5, 9.5]]).sum() == 81


def test_an_annotations_polygons_are_one_label_and_later_annotations_cover_earlier_ones():
    left, right = [0, 0, 6, 0, 6, 6, 0, 6], [4, 2, 10, 2, 10, 8, 4, 8]
    classes = np.asarray(CocoMask(10, 12, [3, 300], [[left, right], [[5, 5, 9, 5, 9, 9, 5, 9]]]))
    assert classes.dtype == np.int64  # a label past 255
    assert set(np.unique(classes).tolist()) == {0, 3, 300}
    np.testing.assert_array_equal(classes == 300, _filled(10, 12, [[5, 5, 9, 5, 9, 9, 5, 9]]))
    np.testing.assert_array_equal((classes == 3) | (classes == 300),
                                  _filled(10, 12, [left, right]) | (classes == 300))
