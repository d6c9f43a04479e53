"""COCO's segmentations as one class map an image, or as one binary mask an annotation: polygons
filled, RLE runs decoded, both pixel for pixel as pycocotools makes them (``frPyObjects``,
``merge``, ``decode``).

``readers.coco(masks=True)`` gives each sample a ``mask`` field holding a ``CocoMask``: the image's
kept annotations (label and segmentation), drawn only when the pipeline reads it (``np.asarray``
calls ``__array__``, in the loader's threads before decoding), since a data set's maps drawn at
once would not fit in memory. Later annotations are drawn over earlier ones, in the file's order.
``readers.coco(instance_masks=True)`` gives each a ``masks`` field holding a ``CocoInstanceMasks``,
drawn on request the same way: ``[N, H, W]``, one layer an annotation, in the boxes' order.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["CocoInstanceMasks", "CocoMask", "check_segmentation", "decode_rle", "finite_number", "polygon_boundary"]


def check_segmentation(seg: Any, height: int, width: int) -> str | None:
    """Why ``seg`` is not a COCO segmentation of an image of this size, or None."""
    if isinstance(seg, list):
        if not seg:
            return "segmentation is an empty list"
        for polygon in seg:
            if (not isinstance(polygon, list) or len(polygon) < 6 or len(polygon) % 2
                    or not all(map(finite_number, polygon))):
                return "segmentation is not a list of polygons (finite x, y pairs, at least three points)"
        return None
    if isinstance(seg, dict):
        counts, size = seg.get("counts"), seg.get("size")
        if size != [height, width]:
            return f"segmentation's RLE size {size!r} is not the image's [{height}, {width}]"
        if isinstance(counts, str):
            if not counts.isascii():
                return "segmentation's RLE counts are not ASCII"
            # The runs are decoded here, as a list's are summed: a bad string is this entry's
            # fault when the file is read, not an error of every epoch's sample when drawn.
            try:
                _runs_cover(_runs_from_string(counts), height, width)
            except ValueError as exc:
                return f"segmentation's RLE counts string: {exc}"
            return None
        if isinstance(counts, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in counts):
            return None if sum(counts) == height * width else (
                f"segmentation's RLE counts cover {sum(counts)} pixels, not {height} x {width}")
        return "segmentation's RLE counts are neither a list of runs nor a string"
    return "segmentation is neither polygons nor an RLE"


def finite_number(value: Any) -> bool:
    """Whether ``value`` is a JSON number that is a finite float (a huge int is not: float() overflows)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _runs_cover(runs: list[int], height: int, width: int) -> None:
    """Raises ValueError unless ``runs`` are counts (none negative) that cover the image."""
    if any(run < 0 for run in runs):
        raise ValueError("a run is negative")
    if sum(runs) != height * width:
        raise ValueError(f"RLE runs cover {sum(runs)} pixels, not {height} x {width}")


def decode_rle(counts: list[int] | str, height: int, width: int) -> np.ndarray:
    """A COCO RLE as a bool ``[height, width]`` mask: runs of 0s and 1s alternating from 0s, down
    the columns (Fortran order); a string is pycocotools' compressed form of the runs. Raises
    ValueError for runs that do not cover the image."""
    runs = _runs_from_string(counts) if isinstance(counts, str) else counts
    _runs_cover(runs, height, width)
    values = np.zeros(len(runs), dtype=bool)
    values[1::2] = True
    flat = np.repeat(values, runs)
    return flat.reshape(width, height).T


def _runs_from_string(s: str) -> list[int]:
    """pycocotools' ``rleFrString``: each run in 5-bit groups (offset by 48, bit 0x20 = more
    follows, 0x10 of the last group = negative), from the fourth run on a difference from the run two
    before. Raises ValueError for a string that ends inside a run."""
    runs: list[int] = []
    p = 0
    while p < len(s):
        x = k = 0
        more = True
        while more:
            if p == len(s):  # pycocotools would read past the string's end
                raise ValueError("the string ends inside a run")
            c = ord(s[p]) - 48
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(runs) > 2:
            x += runs[-2]
        runs.append(x)
    return runs


# pycocotools' rleFrPoly walks the edges on a grid five times finer than the pixels: where an edge
# passes a pixel column's centre is known to a fifth of a pixel, then rounded to a pixel.
_UPSAMPLE = 5


def polygon_boundary(polygon: list[float], height: int, width: int) -> np.ndarray:
    """Where a polygon's fill starts and stops, as pycocotools' ``rleFrPoly`` finds it: flat indices
    down the columns (``x * height + y``; ``height * width`` is past the image's end), one for each
    time an edge crosses a column's centre line, at the first pixel of the column at or below the
    crossing. A pixel is inside when an odd number of them is at or before it: these are the
    boundaries of pycocotools' runs, and a boundary found twice cancels, as its run of length 0 does."""
    ((column, row),) = _crossings([polygon], height, width)
    return column * height + row


def _crossings(polygons: list[list[float]], height: int, width: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each polygon's ``polygon_boundary`` as (column, row), the row 0..height (height: below the
    column's last pixel); each column is crossed an even number of times (the walk is closed).
    The polygons are walked together, their edges one array: a walk a polygon cost more in NumPy
    calls than in points (an image's 15 polygons: ~40 calls each, on arrays of a few thousand)."""
    if not polygons:
        return []
    sizes = np.fromiter((len(p) // 2 for p in polygons), dtype=np.int64, count=len(polygons))
    first = np.cumsum(sizes) - sizes
    following = np.arange(int(sizes.sum())) + 1  # each vertex's next, the last of a polygon its first
    following[first + sizes - 1] = first
    x, y = _upsampled_vertices([c for p in polygons for c in p], height, width)
    u, v, edge = _walk_edges(x, y, following)
    column, row, edge = _column_crossings(u, v, edge, height, width)
    # The crossings come polygon after polygon, as their edges do.
    bounds = np.searchsorted(edge, np.append(first, len(x))).tolist()
    return [(column[lo:hi], row[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]


def _upsampled_vertices(polygon: list[float], height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The vertices on the fine grid, rounded as pycocotools' ``(int)(5 * x + .5)``: toward zero,
    so left of and above the image they round the other way. A coordinate further outside the
    image than twice its longer side (1024 pixels at least) is first moved to that distance, the one
    difference from pycocotools: the walk takes five points a pixel of an edge, billions for a wild
    coordinate (pycocotools' ints overflow past about 4e8 anyway)."""
    xy = np.asarray(polygon, dtype=np.float64).reshape(-1, 2)
    margin = 2 * max(height, width, 512)
    x = np.clip(xy[:, 0], -margin, width + margin)
    y = np.clip(xy[:, 1], -margin, height + margin)
    # astype truncates toward zero, as C's cast does
    return (_UPSAMPLE * x + 0.5).astype(np.int64), (_UPSAMPLE * y + 0.5).astype(np.int64)


def _walk_edges(x: np.ndarray, y: np.ndarray, following: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every fine-grid point of the closed polygons' edges (vertex i's edge goes to vertex
    ``following[i]``), in pycocotools' order and rounding, and each point's edge: each edge from
    its vertex to the next, a point a step along its longer axis (x on a tie), the other
    coordinate rounded from the line. The line is taken from the edge's end with the smaller stepped
    coordinate, whichever way it is walked: the float rounding of ties depends on it."""
    x_next, y_next = x[following], y[following]
    along_x = np.abs(x_next - x) >= np.abs(y_next - y)
    stepped_from, stepped_to = np.where(along_x, x, y), np.where(along_x, x_next, y_next)
    other_from, other_to = np.where(along_x, y, x), np.where(along_x, y_next, x_next)
    backward = stepped_from > stepped_to
    steps = np.abs(stepped_to - stepped_from)
    line_start = np.where(backward, other_to, other_from)
    # A repeated vertex is an edge of no steps: pycocotools divides 0 by 0 there, but that one
    # point is never compared (the points either side of it are the same vertex), so any slope does.
    slope = np.where(backward, other_from - other_to, other_to - other_from) / np.maximum(steps, 1)

    count = steps + 1
    edge = np.repeat(np.arange(len(x)), count)  # each point's edge
    d = np.arange(len(edge)) - np.repeat(np.cumsum(count) - count, count)  # its step from the vertex
    stepped = stepped_from[edge] + np.where(backward[edge], -d, d)
    t = stepped - np.minimum(stepped_from, stepped_to)[edge]  # steps from the line's start
    # C's (int)(a + s * t + .5), operation for operation; astype truncates toward zero as the cast does
    rounded = (line_start[edge] + slope[edge] * t + 0.5).astype(np.int64)
    point_along_x = along_x[edge]
    return np.where(point_along_x, stepped, rounded), np.where(point_along_x, rounded, stepped), edge


def _column_crossings(u: np.ndarray, v: np.ndarray, edge: np.ndarray, height: int, width: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """pycocotools' downsampling of the walk: a step within an edge that moves x across a column's
    centre line (fine x from 5n+2 to 5n+3, n a column of the image) gives the column, its first pixel
    whose centre is at or below the step's upper point (clamped to 0..height), and the edge. (From
    one edge to the next is no step: the same vertex twice, or another polygon's start.)"""
    moves = (u[1:] != u[:-1]) & (edge[1:] == edge[:-1])
    left = np.where(u[1:] < u[:-1], u[1:], u[1:] - 1)  # the lower x of a step
    column = (left + 0.5) / _UPSAMPLE - 0.5
    keep = moves & (np.floor(column) == column) & (column >= 0) & (column <= width - 1)
    top = np.minimum(v[1:], v[:-1])[keep]
    row = np.ceil(np.clip((top + 0.5) / _UPSAMPLE - 0.5, 0, height))
    return column[keep].astype(np.int64), row.astype(np.int64), edge[1:][keep]


def _fill_between(image: np.ndarray, column: np.ndarray, row: np.ndarray, value: int) -> None:
    """Sets ``value`` in ``image`` (``[height, width]``) where an odd number of the crossings
    (``column``, ``row``: ``_crossings``) of the pixel's column is at or above it: in pycocotools'
    flat order, from the first boundary to the second, the third to the fourth and so on (each
    column's count is even, so its parity starts at 0; a crossing at ``height`` is below every
    pixel). Counted at once over the crossings' bounding box, the parity a running sum down it:
    a run a slice took a Python step a column (~0.7 us each, 70% of an image's drawing)."""
    if not len(column):
        return
    top, bottom = int(row.min()), int(row.max())  # no pixel above the first crossing or from the last on is inside
    left = int(column.min())
    span = int(column.max()) - left + 1
    # uint8 sums wrap at 256, an even number: the parity is the same.
    counts = np.bincount((row - top) * span + (column - left), minlength=(bottom - top + 1) * span)
    parity = np.cumsum(counts[: (bottom - top) * span].astype(np.uint8).reshape(bottom - top, span), axis=0,
                       dtype=np.uint8)
    inside = (parity & 1).view(bool)
    image[top:bottom, left : left + span][inside] = value


def _draw(images: list[np.ndarray], segmentations: list[Any], values: list[int]) -> None:
    """Annotation i's segmentation set to ``values[i]`` in ``images[i]`` (``[height, width]``; one
    image for all of them is a map drawn in order, later over earlier). Each polygon drawn with the
    same value: their union, as pycocotools' ``merge`` makes it."""
    if not segmentations:
        return
    height, width = images[0].shape
    polygons = iter(_crossings([p for seg in segmentations if isinstance(seg, list) for p in seg], height, width))
    for image, seg, value in zip(images, segmentations, values):
        if isinstance(seg, dict):
            image[decode_rle(seg["counts"], height, width)] = value
            continue
        for _ in seg:
            _fill_between(image, *next(polygons), value)


class CocoMask:
    """One image's class map, drawn on request: ``np.asarray(mask)`` is ``[height, width]``, 0 where
    no annotation is, each annotation's label inside it (uint8, int64 for labels past 255). Polygons
    are filled pixel for pixel as pycocotools fills them (``polygon_boundary``), an annotation's
    several polygons as their union (pycocotools' ``merge``)."""

    __slots__ = ("height", "labels", "segmentations", "width")

    def __init__(self, height: int, width: int, labels: list[int], segmentations: list[Any]) -> None:
        self.height, self.width = height, width
        self.labels, self.segmentations = labels, segmentations

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        wide = any(label > 255 for label in self.labels)
        out = np.zeros((self.height, self.width), np.int64 if wide else np.uint8)
        _draw([out] * len(self.labels), self.segmentations, self.labels)
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"CocoMask({self.width}x{self.height}, {len(self.labels)} annotations)"


class CocoInstanceMasks:
    """One image's annotations as binary masks, drawn on request: ``np.asarray(masks)`` is uint8
    ``[N, height, width]``, layer i 1 inside annotation i's segmentation and 0 elsewhere (``[0,
    height, width]`` for none). Each layer is drawn as ``CocoMask`` draws its annotation: polygons
    pixel for pixel as pycocotools fills them, several polygons as their union, RLE as it is."""

    __slots__ = ("height", "segmentations", "width")

    def __init__(self, height: int, width: int, segmentations: list[Any]) -> None:
        self.height, self.width = height, width
        self.segmentations = segmentations

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.zeros((len(self.segmentations), self.height, self.width), np.uint8)
        _draw(list(out), self.segmentations, [1] * len(self.segmentations))
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"CocoInstanceMasks({self.width}x{self.height}, {len(self.segmentations)} annotations)"
