"""readers.coco review: what a user of DALI's ``fn.readers.coco`` or of pycocotools would try.

A file name that starts with two dots is a name inside the images folder; a bbox number too large
for a float and a bad segmentation (a compressed RLE string cut short, with a negative run or the
wrong total; a polygon with NaN or an int too large for a float) are ReadErrors naming the
annotation when the file is read, not errors of the sample each epoch; RLE strings decode as
pycocotools encodes them.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
from PIL import Image

from headrace import ReadError, readers
from headrace.readers._coco_masks import decode_rle


def _jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (90, 140, 30)).save(out, "JPEG")
    return out.getvalue()


def _coco_set(root, names, annotations=()):
    """Real 40 x 30 JPEGs named ``names`` (ids 1, 2, ...) in ``root/images`` and their JSON file."""
    (root / "images").mkdir()
    for name in names:
        (root / "images" / name).write_bytes(_jpeg(40, 30))
    doc = {"images": [{"id": i, "file_name": n, "width": 40, "height": 30} for i, n in enumerate(names, 1)],
           "categories": [{"id": 7, "name": "thing"}], "annotations": list(annotations)}
    (root / "instances.json").write_text(json.dumps(doc))
    return root / "images", root / "instances.json"


async def _read_all(reader):
    async with contextlib.aclosing(reader.read(0)) as stream:
        return [s async for chunk in stream for s in chunk]


async def test_a_file_name_starting_with_two_dots_is_read_from_the_folder(tmp_path):
    # "..a.jpg" was refused as "not inside the images folder": the check looked for ".." at the
    # start of the name, not for a first part that is "..".
    images, annotations = _coco_set(tmp_path, ["..a.jpg", "b.jpg"])
    samples = await _read_all(readers.coco(images, annotations))
    assert [(s.key, s.error) for s in samples] == [("..a", None), ("b", None)]
    assert samples[0].fields["jpg"] == (images / "..a.jpg").read_bytes()


def test_a_bbox_number_too_large_for_a_float_is_a_read_error_naming_it(tmp_path):
    # JSON ints have no bound; math.isfinite(10**400) raised a bare OverflowError.
    ann = {"id": 31, "image_id": 1, "category_id": 7, "bbox": [1, 1, 10**400, 3], "iscrowd": 0}
    images, annotations = _coco_set(tmp_path, ["a.jpg"], [ann])
    with pytest.raises(ReadError, match=r"annotation 31 \(image 1\): bbox is not four finite numbers") as info:
        readers.coco(images, annotations)
    assert info.value.source == str(annotations)


@pytest.mark.parametrize(("segmentation", "message"), [
    ({"counts": "0`", "size": [30, 40]}, "ends inside a run"),  # the last group says more follows
    ({"counts": "05", "size": [30, 40]}, "cover 5 pixels, not 30 x 40"),
    ({"counts": "@", "size": [30, 40]}, "a run is negative"),
    ([[1, 1, float("nan"), 2, 3, 3]], "not a list of polygons"),
    ([[1, 1, 10**400, 2, 3, 3]], "not a list of polygons"),
])
def test_a_bad_segmentation_is_a_read_error_when_the_file_is_read(tmp_path, segmentation, message):
    # A compressed RLE string was only checked to be ASCII: a bad one passed, and every epoch each
    # of its image's samples failed when its mask was drawn (IndexError, ValueError), naming the
    # image, not the annotation.
    ann = {"id": 31, "image_id": 1, "category_id": 7, "bbox": [1, 1, 5, 5], "iscrowd": 1,
           "segmentation": segmentation}
    images, annotations = _coco_set(tmp_path, ["a.jpg"], [ann])
    with pytest.raises(ReadError, match=rf"annotation 31 \(image 1\): segmentation.*{message}") as info:
        readers.coco(images, annotations, masks=True)
    assert info.value.source == str(annotations)
    assert len(readers.coco(images, annotations)) == 1  # without masks the segmentations are not read


def test_rle_strings_decode_as_pycocotools_encodes_them():
    # pycocotools.mask.encode of the mask below gave b'>930f0J@0KN02500' (runs past 31, and later
    # runs stored as negative differences from the run two before).
    mask = np.zeros((12, 9), bool)
    mask[2:11, 1:3] = True
    mask[0:3, 5:9] = True
    mask[7, 6] = True
    np.testing.assert_array_equal(decode_rle(">930f0J@0KN02500", 12, 9), mask)
    np.testing.assert_array_equal(decode_rle("06", 3, 2), np.ones((3, 2), bool))  # a first run of 0 zeros
    np.testing.assert_array_equal(decode_rle("6", 3, 2), np.zeros((3, 2), bool))
    for bad in ("0`", "@"):
        with pytest.raises(ValueError):
            decode_rle(bad, 3, 2)
