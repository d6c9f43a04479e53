"""Samples from a COCO detection data set: image files and one ``instances_*.json``.

The reader is a ``FileReader`` over the images the annotation file lists, whose samples carry the
image's boxes, category labels and id as fields beside its bytes. Everything from the JSON is
worked out once, here, as NumPy arrays; an epoch only reads the image files.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np

from headrace._errors import ConfigError, ReadError, require_int, require_number

from ._cache_folder import from_arguments
from ._coco_masks import CocoInstanceMasks, CocoMask, check_segmentation, finite_number
from ._object_cache import ObjectCache
from ._storage import Storage, Store, is_url, run_sync, with_retries
from .files import FileReader

__all__ = ["CocoReader", "coco"]

BoxFormat = Literal["xyxy", "xywh"]


class CocoReader(FileReader):
    """A ``FileReader`` whose samples also hold ``boxes``, ``labels`` and ``image_id``.

    ``categories`` maps each label value to its category's name (``{1: "person", ...}``).
    """

    categories: dict[int, str]

    def __repr__(self) -> str:
        return (f"CocoReader({len(self.paths)} images, {len(self.categories)} categories, samples={len(self)}, "
                f"shuffle={self.shuffle}, rank={self.rank}/{self.world})")


def coco(
    images: str | os.PathLike,
    annotations: str | os.PathLike,
    *,
    box_format: BoxFormat = "xyxy",
    relative: bool = False,
    contiguous_labels: bool = True,
    skip_empty: bool = False,
    include_crowd: bool = True,
    min_box_size: float = 0.0,
    masks: bool = False,
    instance_masks: bool = False,
    shuffle: bool = False,
    seed: int | None = None,
    chunk_size: int | None = None,
    io_threads: int = 2,
    storage_options: Mapping[str, Any] | None = None,
    store: Store | None = None,
    requests: int = 224,
    buffer_bytes: int = 64 << 20,
    cache_dir: str | os.PathLike | None = None,
    cache_bytes: int | None = None,
) -> CocoReader:
    """A reader over a COCO detection set: the folder ``images`` (``train2017/``) and the annotation
    file ``annotations`` (``instances_train2017.json``); either may be a local path or a URL
    (``s3://``, ``http(s)://``), read as ``files()`` reads them.

    One sample per image the file lists, in the file's order (``shuffle`` for a seeded order each
    epoch; ``seed`` defaults to the loader's). Its fields:

    - the image's bytes, named by its extension (``jpg``);
    - ``boxes``: float32, ``[N, 4]``, in pixels of the image as stored: ``(x0, y0, x1, y1)`` with
      ``box_format="xyxy"`` (torchvision's detection models), COCO's own ``(x, y, width, height)``
      with ``"xywh"``; ``relative=True`` divides them by the image's width and height (DALI's
      ``ratio=True``);
    - ``labels``: int64, ``[N]``: category ids mapped to 1..K in id order with
      ``contiguous_labels=True`` (DALI's default; ``reader.categories`` names them), COCO's own ids
      otherwise;
    - ``image_id``: the image's id in the file, an int (for COCO evaluation).

    Boxes whose width or height is not more than ``min_box_size`` pixels are left out (so by default
    the degenerate ones some COCO files hold), and so are crowd regions with ``include_crowd=False``
    (DALI's ``include_iscrowd``). ``skip_empty=True`` leaves out images with no box left.

    ``masks=True`` adds ``mask``: the image's class map (DALI's ``pixelwise_masks``), each kept
    annotation's segmentation (polygons or RLE) filled with its label over 0, later ones over
    earlier ones; drawn when the pipeline reads it, ``Pipeline(mask="mask")`` (``_coco_masks``). Decode
    with ``Pipeline(label=None, boxes="boxes", per_box=("labels",))`` to have the boxes follow
    the crops, resizes and flips.

    ``instance_masks=True`` adds ``masks``: one binary mask a kept annotation, row for row with
    ``boxes`` and ``labels`` (the same annotations, in the same order), uint8 ``[N, height, width]``
    (the image's size in the file), 1 inside the annotation's segmentation (its polygons' union, or
    its RLE) and 0 elsewhere; ``[0, height, width]`` for an image with none. What Mask R-CNN trains on (torchvision's ``masks`` target). Drawn as
    ``mask`` is, when the pipeline reads it: ``Pipeline(boxes="boxes", per_box=("labels",),
    instance_masks="masks")`` moves them with the image and keeps or drops each with its box. It
    may be asked for with ``masks=True`` or without it.

    ``chunk_size``, ``io_threads``, ``storage_options``, ``store``, ``requests``, ``buffer_bytes``,
    ``cache_dir`` and ``cache_bytes`` are as for ``files()``.

    Raises ReadError naming the file when the annotation file cannot be read or is not COCO's
    format (naming the annotation at fault; with ``masks`` or ``instance_masks``, a segmentation
    that cannot be drawn), ConfigError for a wrong argument. A listed image that is missing is a
    ReadError naming it when it is read.
    """
    if box_format not in ("xyxy", "xywh"):
        raise ConfigError(f"coco: box_format must be 'xyxy' or 'xywh', got {box_format!r}")
    for name, flag in (("relative", relative), ("contiguous_labels", contiguous_labels), ("skip_empty", skip_empty),
                       ("include_crowd", include_crowd), ("masks", masks),
                       ("instance_masks", instance_masks)):
        if not isinstance(flag, bool):
            raise ConfigError(f"coco: {name} must be True or False, got {flag!r}")
    min_box_size = require_number("coco: min_box_size", min_box_size, 0.0, math.inf, high_open=True,
                                  wanted="a number >= 0")
    requests = require_int("coco: requests", requests)
    storage = Storage(storage_options, store)
    source = os.fspath(annotations)
    doc = _load(source, storage)
    table = _Annotations(doc, source)
    rows = table.images(box_format, relative, contiguous_labels, include_crowd, float(min_box_size), skip_empty, masks,
                        instance_masks)
    if not rows:
        raise ReadError("no images left to read (every image has no box and skip_empty=True)"
                        if skip_empty and table.image_count else "the annotation file lists no images", source=source)
    root = os.fspath(images)
    remote = store is not None or is_url(root)
    if not remote and not Path(root).is_dir():
        raise ReadError("no such folder", source=root)
    paths = [_join(root, row.file_name, remote) for row in rows]
    extra = [{"boxes": row.boxes, "labels": row.labels, "image_id": row.image_id,
              **({"mask": row.mask} if masks else {}), **({"masks": row.instances} if instance_masks else {})}
             for row in rows]
    cache = from_arguments("coco", cache_dir, cache_bytes, partial(ObjectCache, native=True))
    reader = CocoReader(paths, None, root=root.rstrip("/") + "/" if remote else Path(root), shuffle=shuffle,
                        seed=seed, chunk_size=chunk_size, io_threads=io_threads, storage=storage, requests=requests,
                        buffer_bytes=buffer_bytes, cache=cache, extra=extra)
    reader.categories = table.names(contiguous_labels)
    return reader


def _join(root: str, name: str, remote: bool) -> str:
    return f"{root.rstrip('/')}/{name}" if remote else os.path.join(root, name)


def _load(source: str, storage: Storage) -> Any:
    """The annotation file's JSON, from a path or a URL."""
    try:
        if is_url(source) or storage.store is not None:
            store, key = storage.locate(source)

            async def get() -> bytes:
                async with storage.session():
                    return await with_retries(lambda: store.read(key), storage.retry, store.url(key))

            data = run_sync(get)
        else:
            data = Path(source).read_bytes()
    except OSError as exc:
        raise ReadError(f"cannot read the annotation file: {exc.strerror or exc}", source=source) from exc
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReadError(f"the annotation file is not JSON: {exc}", source=source) from exc


class _Image:
    __slots__ = ("boxes", "file_name", "image_id", "instances", "labels", "mask")

    def __init__(self, image_id: int, file_name: str, boxes: np.ndarray, labels: np.ndarray,
                 mask: CocoMask | None, instances: CocoInstanceMasks | None) -> None:
        self.image_id, self.file_name, self.boxes, self.labels, self.mask = image_id, file_name, boxes, labels, mask
        self.instances = instances


class _Annotations:
    """The parts of a COCO ``instances`` file the reader uses, checked as they are read: every
    fault is a ReadError naming the file and the entry."""

    def __init__(self, doc: Any, source: str) -> None:
        self.source = source
        if not isinstance(doc, dict) or not isinstance(doc.get("images"), list):
            raise ReadError("not a COCO annotation file: no 'images' list at the top", source=source)
        self._images: list[tuple[int, str, int, int]] = []  # id, file name, width, height
        seen: set[int] = set()
        for i, entry in enumerate(doc["images"]):
            image_id = self._int(entry, "id", f"images[{i}]")
            if image_id in seen:
                raise ReadError(f"images[{i}]: image id {image_id} is listed twice", source=source)
            seen.add(image_id)
            name = entry.get("file_name")
            if not isinstance(name, str) or not name:
                raise ReadError(f"images[{i}] (id {image_id}): no file_name", source=source)
            # A name is a path inside the images folder: never absolute, never up out of it (a
            # first part "..", not any name that starts with two dots: "..a.jpg" is a file's name).
            if name.startswith(("/", "\\")) or os.path.isabs(name) or posixpath.normpath(name).split("/")[0] == "..":
                raise ReadError(f"images[{i}] (id {image_id}): file_name {name!r} is not inside the images folder",
                                source=source)
            width, height = self._int(entry, "width", f"images[{i}]"), self._int(entry, "height", f"images[{i}]")
            if width < 1 or height < 1:
                raise ReadError(f"images[{i}] (id {image_id}): size {width}x{height} is not positive", source=source)
            self._images.append((image_id, name, width, height))
        self.image_count = len(self._images)
        categories = doc.get("categories", [])
        if not isinstance(categories, list):
            raise ReadError("'categories' is not a list", source=source)
        self._categories: dict[int, str] = {}
        for i, entry in enumerate(categories):
            cid = self._int(entry, "id", f"categories[{i}]")
            if cid in self._categories:
                raise ReadError(f"categories[{i}]: category id {cid} is listed twice", source=source)
            self._categories[cid] = str(entry.get("name", ""))
        annotations = doc.get("annotations", [])
        if not isinstance(annotations, list):
            raise ReadError("'annotations' is not a list", source=source)
        self._annotations = annotations

    def _int(self, entry: Any, name: str, where: str) -> int:
        value = entry.get(name) if isinstance(entry, dict) else None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ReadError(f"{where}: {name!r} is not an int (got {value!r})", source=self.source)
        return value

    def names(self, contiguous: bool) -> dict[int, str]:
        ids = sorted(self._categories)
        return {(i + 1 if contiguous else cid): self._categories[cid] for i, cid in enumerate(ids)}

    def images(self, box_format: BoxFormat, relative: bool, contiguous: bool, include_crowd: bool,
               min_size: float, skip_empty: bool, masks: bool, instance_masks: bool) -> list[_Image]:
        sizes = {image_id: (w, h) for image_id, _, w, h in self._images}
        label_of = {cid: i + 1 for i, cid in enumerate(sorted(self._categories))} if contiguous else None
        boxes: dict[int, list[list[float]]] = {image_id: [] for image_id in sizes}
        labels: dict[int, list[int]] = {image_id: [] for image_id in sizes}
        segmentations: dict[int, list[Any]] = {image_id: [] for image_id in sizes}
        for i, ann in enumerate(self._annotations):
            where = f"annotations[{i}]"
            image_id = self._int(ann, "image_id", where)
            category = self._int(ann, "category_id", where)
            ann_id = ann.get("id", i)
            where = f"annotation {ann_id} (image {image_id})"
            if image_id not in sizes:
                raise ReadError(f"{where}: no image has this id", source=self.source)
            if category not in self._categories:
                raise ReadError(f"{where}: category {category} is not in 'categories'", source=self.source)
            box = ann.get("bbox")
            if not isinstance(box, list) or len(box) != 4 or not all(map(finite_number, box)):
                raise ReadError(f"{where}: bbox is not four finite numbers (got {box!r})", source=self.source)
            crowd = ann.get("iscrowd", 0)
            if crowd not in (0, 1) or isinstance(crowd, float):
                raise ReadError(f"{where}: iscrowd is not 0 or 1 (got {crowd!r})", source=self.source)
            if crowd and not include_crowd:
                continue
            x, y, w, h = (float(v) for v in box)
            if w <= min_size or h <= min_size:
                continue
            if masks or instance_masks:
                width, height = sizes[image_id]
                if why := check_segmentation(ann.get("segmentation"), height, width):
                    raise ReadError(f"{where}: {why}", source=self.source)
                segmentations[image_id].append(ann["segmentation"])
            boxes[image_id].append([x, y, w, h])
            labels[image_id].append(label_of[category] if label_of is not None else category)
        out = []
        for image_id, name, width, height in self._images:
            if skip_empty and not boxes[image_id]:
                continue
            b = np.array(boxes[image_id], dtype=np.float64).reshape(-1, 4)
            if box_format == "xyxy":
                b[:, 2:] += b[:, :2]
            if relative:
                b /= np.array([width, height, width, height], dtype=np.float64)
            b = b.astype(np.float32)
            lab = np.array(labels[image_id], dtype=np.int64)
            b.flags.writeable = lab.flags.writeable = False  # shared by every epoch's samples
            mask = CocoMask(height, width, lab.tolist(), segmentations[image_id]) if masks else None
            instances = CocoInstanceMasks(height, width, segmentations[image_id]) if instance_masks else None
            out.append(_Image(image_id, name, b, lab, mask, instances))
        return out
