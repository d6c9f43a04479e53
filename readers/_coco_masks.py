"""COCO's segmentations as one class map an image: polygons filled, RLE runs decoded.

``readers.coco(masks=True)`` gives each sample a ``mask`` field holding a ``CocoMask``: the image's
kept annotations (label and segmentation), drawn only when the pipeline reads it (``np.asarray``
calls ``__array__``, in the loader's threads before decoding), since a data set's maps drawn at
once would not fit in memory. Later annotations are drawn over earlier ones, in the file's order.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["CocoMask", "check_segmentation", "decode_rle", "finite_number"]


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


class CocoMask:
    """One image's class map, drawn on request: ``np.asarray(mask)`` is ``[height, width]``, 0 where
    no annotation is, each annotation's label inside it (uint8, int64 for labels past 255).
    Polygons are filled by Pillow (within a pixel of pycocotools' at their edges)."""

    __slots__ = ("height", "labels", "segmentations", "width")

    def __init__(self, height: int, width: int, labels: list[int], segmentations: list[Any]) -> None:
        self.height, self.width = height, width
        self.labels, self.segmentations = labels, segmentations

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        # Polygons are drawn with their labels straight onto one canvas (a map a pass); an RLE,
        # rare (crowds), goes through an array at its place in the order.
        wide = any(label > 255 for label in self.labels)
        mode = "I" if wide else "L"
        canvas = Image.new(mode, (self.width, self.height), 0)
        draw = ImageDraw.Draw(canvas)
        for label, seg in zip(self.labels, self.segmentations):
            if isinstance(seg, dict):
                pixels = np.array(canvas)
                pixels[decode_rle(seg["counts"], self.height, self.width)] = label
                canvas = Image.fromarray(pixels, mode)
                draw = ImageDraw.Draw(canvas)
                continue
            for polygon in seg:
                draw.polygon(list(zip(polygon[0::2], polygon[1::2])), fill=label)
        out = np.asarray(canvas)
        out = out.astype(np.int64) if wide else out
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"CocoMask({self.width}x{self.height}, {len(self.labels)} annotations)"
