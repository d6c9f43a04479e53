"""readers.coco: real JPEGs and a real COCO ``instances`` file, read locally, from S3 (moto) and over
HTTP (``storage_servers.py``, its own process serving a folder made here), and through a Loader."""

from __future__ import annotations

import contextlib
import json
import shutil

import numpy as np
import pytest
import torch
from sample_data import jpeg_bytes
from storage_servers import ACCESS_KEY, BUCKET, SECRET_KEY, serving

from headrace import ConfigError, Loader, LoaderError, ReadError, ops, readers
from headrace._sample import samples_nbytes, value_nbytes

# file name, id, (width, height), in the file's order (not the ids' order)
IMAGES = [("a.jpg", 7, (64, 48)), ("b.jpg", 2, (40, 80)), ("c.jpg", 11, (50, 50)), ("sub/d.jpg", 5, (30, 20)),
          ("e.jpg", 3, (24, 24))]
KEYS = ["a", "b", "c", "sub/d", "e"]
IDS = [7, 2, 11, 5, 3]
CATEGORIES = [{"id": 90, "name": "toothbrush"}, {"id": 1, "name": "person"}, {"id": 3, "name": "car"}]
# id, image id, category id, bbox, iscrowd; c.jpg and e.jpg have none
ANNOTATIONS = [(101, 7, 3, [4, 6, 20, 10], 0), (102, 7, 1, [10.5, 2, 8, 30], 0), (103, 7, 90, [0, 0, 64, 48], 1),
               (104, 2, 90, [1, 2, 3, 4], 0), (105, 2, 1, [5, 5, 0, 10], 0),  # 105: zero width
               (106, 5, 3, [2, 2, 1, 1], 0), (107, 5, 1, [0, 0, 10, 10], 0)]
RETRY = {"attempts": 6, "backoff": 0.01, "max_backoff": 0.05, "timeout": 5}


def _doc() -> dict:
    return {
        "info": {"description": "headrace test set"},
        "images": [{"id": i, "file_name": name, "width": w, "height": h} for name, i, (w, h) in IMAGES],
        "categories": [dict(c, supercategory="thing") for c in CATEGORIES],
        "annotations": [{"id": a, "image_id": i, "category_id": c, "bbox": box, "iscrowd": crowd,
                         "area": float(box[2] * box[3])} for a, i, c, box, crowd in ANNOTATIONS],
    }


def _write(root, doc, images=IMAGES):
    """``root/images/<file_name>`` (real JPEGs of the listed sizes) and ``root/instances.json``."""
    rng = np.random.default_rng(0)
    for name, _, (w, h) in images:
        (root / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "images" / name).write_bytes(jpeg_bytes(rng, h, w))
    with open(root / "instances.json", "w") as f:
        json.dump(doc, f)
    return root / "images", root / "instances.json"


@pytest.fixture(scope="module")
def coco_set(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("coco"), _doc())


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """30 images, ids 1000 + i, one box [i, 1, 2, 3] of category 1 + i % 2 each, except every fifth."""
    images = [(f"{i:03d}.jpg", 1000 + i, (16, 12)) for i in range(30)]
    doc = {"images": [{"id": i, "file_name": n, "width": w, "height": h} for n, i, (w, h) in images],
           "categories": [{"id": 1, "name": "one"}, {"id": 2, "name": "two"}],
           "annotations": [{"id": i, "image_id": 1000 + i, "category_id": 1 + i % 2, "bbox": [i, 1, 2, 3], "iscrowd": 0}
                           for i in range(30) if i % 5]}
    return _write(tmp_path_factory.mktemp("coco-many"), doc, images)


async def _read_all(reader, epoch=0, seed=0):
    async with contextlib.aclosing(reader.read(epoch, seed=seed)) as stream:
        return [s async for chunk in stream for s in chunk]


def _by_key(samples):
    return {s.key: s for s in samples}


def _check_many(samples):
    """Each sample of ``many`` carries its own image's id, box and label."""
    for s in samples:
        i = int(s.key)
        assert s.fields["image_id"] == 1000 + i
        if i % 5:
            np.testing.assert_array_equal(s.fields["boxes"], [[i, 1, i + 2, 4]])
            assert s.fields["labels"].tolist() == [1 + i % 2]
        else:
            assert s.fields["boxes"].shape == (0, 4) and s.fields["labels"].shape == (0,)


async def test_every_sample_has_its_bytes_boxes_labels_and_id(coco_set):
    images, annotations = coco_set
    reader = readers.coco(images, annotations, chunk_size=2)
    samples = await _read_all(reader)
    assert len(reader) == len(samples) == 5
    assert [s.key for s in samples] == KEYS and [s.fields["image_id"] for s in samples] == IDS
    assert reader.categories == {1: "person", 2: "car", 3: "toothbrush"}
    for s, (name, _, _) in zip(samples, IMAGES):
        assert set(s.fields) == {"jpg", "boxes", "labels", "image_id"} and s.error is None
        assert s.fields["jpg"] == (images / name).read_bytes() and s.source == str(images / name)
        assert type(s.fields["image_id"]) is int
        assert s.fields["boxes"].dtype == np.float32 and s.fields["boxes"].shape[1:] == (4,)
        assert s.fields["labels"].dtype == np.int64 and len(s.fields["labels"]) == len(s.fields["boxes"])
    a, b, c, d, e = samples
    np.testing.assert_array_equal(a.fields["boxes"], [[4, 6, 24, 16], [10.5, 2, 18.5, 32], [0, 0, 64, 48]])
    assert a.fields["labels"].tolist() == [2, 1, 3]  # car, person, toothbrush (crowd kept by default)
    np.testing.assert_array_equal(b.fields["boxes"], [[1, 2, 4, 6]])  # the zero-width box is left out
    assert b.fields["labels"].tolist() == [3]
    np.testing.assert_array_equal(d.fields["boxes"], [[2, 2, 3, 3], [0, 0, 10, 10]])
    assert d.fields["labels"].tolist() == [2, 1]
    for empty in (c, e):
        assert empty.fields["boxes"].shape == (0, 4) and empty.fields["labels"].shape == (0,)
    assert "CocoReader(5 images, 3 categories" in repr(reader)


async def test_box_format_relative_and_coco_ids(coco_set):
    xywh = _by_key(await _read_all(readers.coco(*coco_set, box_format="xywh")))
    np.testing.assert_array_equal(xywh["a"].fields["boxes"], [[4, 6, 20, 10], [10.5, 2, 8, 30], [0, 0, 64, 48]])
    np.testing.assert_array_equal(xywh["sub/d"].fields["boxes"], [[2, 2, 1, 1], [0, 0, 10, 10]])
    rel = _by_key(await _read_all(readers.coco(*coco_set, relative=True)))
    np.testing.assert_allclose(rel["a"].fields["boxes"], [[4 / 64, 6 / 48, 24 / 64, 16 / 48],
                                                          [10.5 / 64, 2 / 48, 18.5 / 64, 32 / 48], [0, 0, 1, 1]])
    assert rel["a"].fields["boxes"].dtype == np.float32
    rel_xywh = _by_key(await _read_all(readers.coco(*coco_set, relative=True, box_format="xywh")))
    np.testing.assert_allclose(rel_xywh["b"].fields["boxes"], [[1 / 40, 2 / 80, 3 / 40, 4 / 80]])
    raw = readers.coco(*coco_set, contiguous_labels=False)
    assert raw.categories == {1: "person", 3: "car", 90: "toothbrush"}
    ids = _by_key(await _read_all(raw))
    assert ids["a"].fields["labels"].tolist() == [3, 1, 90] and ids["b"].fields["labels"].tolist() == [90]


async def test_crowd_small_and_empty_filters(coco_set):
    no_crowd = _by_key(await _read_all(readers.coco(*coco_set, include_crowd=False)))
    np.testing.assert_array_equal(no_crowd["a"].fields["boxes"], [[4, 6, 24, 16], [10.5, 2, 18.5, 32]])
    assert no_crowd["a"].fields["labels"].tolist() == [2, 1]
    small = _by_key(await _read_all(readers.coco(*coco_set, min_box_size=1)))  # not more than 1 px: out
    np.testing.assert_array_equal(small["sub/d"].fields["boxes"], [[0, 0, 10, 10]])
    assert small["sub/d"].fields["labels"].tolist() == [1] and len(small["b"].fields["boxes"]) == 1
    assert len(_by_key(await _read_all(readers.coco(*coco_set, min_box_size=3.5)))["b"].fields["boxes"]) == 0
    kept = readers.coco(*coco_set, skip_empty=True)
    samples = await _read_all(kept)
    assert len(kept) == 3 and [s.key for s in samples] == ["a", "b", "sub/d"]
    assert [s.fields["image_id"] for s in samples] == [7, 2, 5]
    both = await _read_all(readers.coco(*coco_set, skip_empty=True, min_box_size=3.5))
    assert [s.key for s in both] == ["a", "sub/d"]
    with pytest.raises(ReadError, match="no images left") as info:
        readers.coco(*coco_set, skip_empty=True, min_box_size=1000)
    assert info.value.source == str(coco_set[1])


def _break(doc, how):
    if how == "no images":
        del doc["images"]
    elif how == "unknown image":
        doc["annotations"].append({"id": 555, "image_id": 999, "category_id": 1, "bbox": [0, 0, 1, 1]})
    elif how == "three numbers":
        doc["annotations"][2]["bbox"] = [0, 0, 1]
    elif how == "a string":
        doc["annotations"][2]["bbox"] = [0, 0, "1", 1]
    elif how == "twice":
        doc["images"].append({"id": 2, "file_name": "x.jpg", "width": 4, "height": 4})
    elif how == "category":
        doc["annotations"][0]["category_id"] = 42
    elif how == "empty":
        doc["images"], doc["annotations"] = [], []
    elif how == "not finite":
        doc["annotations"][2]["bbox"] = [0, 0, float("nan"), 1]  # json writes NaN, and reads it back
    elif how == "category twice":
        doc["categories"].append({"id": 3, "name": "again"})
    elif how == "absolute":
        doc["images"][0]["file_name"] = "/etc/passwd"
    elif how == "up and out":
        doc["images"][0]["file_name"] = "sub/../../x.jpg"
    elif how == "crowd text":
        doc["annotations"][2]["iscrowd"] = "0"
    return doc


@pytest.mark.parametrize(("how", "message"), [
    ("no images", "no 'images' list"), ("unknown image", r"annotation 555 \(image 999\): no image has this id"),
    ("three numbers", "annotation 103 .*bbox is not four finite numbers"), ("a string", "annotation 103 .*bbox"),
    ("twice", r"images\[5\]: image id 2 is listed twice"), ("category", "annotation 101 .*category 42 is not in"),
    ("empty", "lists no images"), ("not finite", "annotation 103 .*bbox is not four finite numbers"),
    ("category twice", r"categories\[3\]: category id 3 is listed twice"),
    ("absolute", "'/etc/passwd' is not inside the images folder"),
    ("up and out", "'sub/../../x.jpg' is not inside the images folder"),
    ("crowd text", "annotation 103 .*iscrowd is not 0 or 1")])
def test_a_broken_annotation_file_is_a_read_error_naming_it(coco_set, tmp_path, how, message):
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(_break(_doc(), how)))
    with pytest.raises(ReadError, match=message) as info:
        readers.coco(coco_set[0], path)
    assert info.value.source == str(path)


def test_unreadable_files_and_folders_are_read_errors(coco_set, tmp_path):
    with pytest.raises(ReadError, match="cannot read the annotation file") as info:
        readers.coco(coco_set[0], tmp_path / "missing.json")
    assert info.value.source == str(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"images": [')
    with pytest.raises(ReadError, match="not JSON") as info:
        readers.coco(coco_set[0], tmp_path / "bad.json")
    assert info.value.source == str(tmp_path / "bad.json")
    with pytest.raises(ReadError, match="no such folder") as info:
        readers.coco(tmp_path / "no-images", coco_set[1])
    assert info.value.source == str(tmp_path / "no-images")


@pytest.mark.parametrize("kwargs", [{"box_format": "ltrb"}, {"relative": "yes"}, {"min_box_size": -1},
                                    {"min_box_size": float("nan")}, {"min_box_size": float("inf")},
                                    {"min_box_size": True}, {"skip_empty": 1}, {"chunk_size": 0}])
def test_wrong_arguments_are_config_errors(coco_set, kwargs):
    with pytest.raises(ConfigError):
        readers.coco(*coco_set, **kwargs)


async def test_a_missing_image_is_a_read_error_naming_it(coco_set, tmp_path, leaks):
    images = tmp_path / "images"
    shutil.copytree(coco_set[0], images)
    (images / "c.jpg").unlink()
    reader = readers.coco(images, coco_set[1])
    samples = _by_key(await _read_all(reader))
    error = samples["c"].error
    assert isinstance(error, ReadError) and error.key == "c" and error.source == str(images / "c.jpg")
    assert samples["c"].fields["image_id"] == 11 and samples["a"].error is None
    pipeline = ops.Pipeline([ops.Resize((32, 32))], label=None, fields=("image_id",))
    loader = Loader(reader, batch_size=2, pipeline=pipeline, device="cpu", num_threads=2, on_error="raise")
    with pytest.raises(LoaderError) as info:
        async with loader:
            async for _ in loader:
                pass
    assert isinstance(info.value, ReadError)
    assert info.value.key == "c" and info.value.source == str(images / "c.jpg")
    await leaks.check()


async def test_shuffle_is_seeded_per_epoch_and_fields_follow_their_image(many):
    reader = readers.coco(*many, shuffle=True, chunk_size=4)
    e0, e0_again, e1 = (await _read_all(reader, 0, 3), await _read_all(reader, 0, 3), await _read_all(reader, 1, 3))
    keys = [[s.key for s in e] for e in (e0, e0_again, e1)]
    assert keys[0] == keys[1] and keys[0] != keys[2] and sorted(keys[0]) == [f"{i:03d}" for i in range(30)]
    assert keys[0] != sorted(keys[0])
    _check_many(e0 + e1)
    own_seed = readers.coco(*many, shuffle=True, seed=3)
    assert [s.key for s in await _read_all(own_seed, 0, 99)] == keys[0]


@pytest.mark.parametrize("world", [2, 3, 7])
async def test_shards_are_disjoint_and_complete(many, world):
    base = readers.coco(*many, shuffle=True, seed=1)
    parts = [await _read_all(base.shard(r, world), epoch=2) for r in range(world)]
    keys = [s.key for p in parts for s in p]
    assert sorted(keys) == [f"{i:03d}" for i in range(30)]
    assert [len(base.shard(r, world)) for r in range(world)] == [len(p) for p in parts]
    assert base.shard(1, world).categories == base.categories == {1: "one", 2: "two"}
    _check_many([s for p in parts for s in p])


async def test_a_chunk_counts_its_bytes_with_the_extra_fields(coco_set):
    async for chunk in readers.coco(*coco_set, chunk_size=2).read(0):
        assert samples_nbytes(chunk) == sum(value_nbytes(v) for s in chunk for v in s.fields.values())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The COCO set under ``coco/`` of a folder served by S3 (moto) and HTTP."""
    root = tmp_path_factory.mktemp("coco-storage")
    (root / "coco").mkdir()
    _write(root / "coco", _doc())
    with serving(root) as urls:
        yield root / "coco", urls


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_a_bucket_or_http_set_reads_like_the_local_one(served, kind, tmp_path, leaks):
    local_root, urls = served
    if kind == "s3":
        base = f"s3://{BUCKET}/coco"
        options = {"endpoint": urls["s3"], "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
                   "region": "us-east-1", "retry": RETRY}
    else:
        base, options = f"{urls['http']}/coco", {"retry": RETRY}
    remote = readers.coco(f"{base}/images/", f"{base}/instances.json", shuffle=True, seed=4, chunk_size=2,
                          storage_options=options, cache_dir=tmp_path / "cache")
    local = readers.coco(local_root / "images", local_root / "instances.json", shuffle=True, seed=4)
    assert len(remote) == 5 and remote.categories == local.categories
    expected = await _read_all(local, 1)
    for fetched in (True, False):  # fetched from the store, then the kept copies (cache_dir=)
        got = await _read_all(remote, 1)
        assert remote.cache.hits == (0 if fetched else 5)
        assert [s.key for s in got] == [s.key for s in expected] and sorted(s.key for s in got) == sorted(KEYS)
        for s, e in zip(got, expected):
            assert s.error is None, s.error
            assert s.source.startswith(f"{base}/images/") and s.source.endswith(s.key + ".jpg")
            assert s.fields.keys() == e.fields.keys() and s.fields["jpg"] == e.fields["jpg"]
            assert s.fields["image_id"] == e.fields["image_id"]
            np.testing.assert_array_equal(s.fields["boxes"], e.fields["boxes"])
            np.testing.assert_array_equal(s.fields["labels"], e.fields["labels"])
    with pytest.raises(ReadError) as info:
        readers.coco(f"{base}/images/", f"{base}/missing.json", storage_options=options)
    assert info.value.source == f"{base}/missing.json"
    await leaks.check()


async def test_a_loader_hands_out_the_image_ids_as_int64(coco_set, leaks):
    pipeline = ops.Pipeline([ops.Resize((32, 32))], label=None, fields=("image_id",))
    async with Loader(readers.coco(*coco_set), batch_size=2, pipeline=pipeline, device="cpu", num_threads=2) as loader:
        batches = [b async for b in loader]
    assert [k for b in batches for k in b.sample_keys] == KEYS
    for b in batches:
        assert b["image"].shape == (b.size, 3, 32, 32)
        assert b["image_id"].dtype == torch.int64
        assert b["image_id"].tolist() == [IDS[KEYS.index(k)] for k in b.sample_keys]
    assert torch.cat([b["image_id"] for b in batches]).tolist() == IDS
    await leaks.check()


async def test_reading_closes_its_threads_when_stopped_early(many, leaks):
    stream = readers.coco(*many, chunk_size=2, io_threads=3).read(0)
    chunk = await stream.__anext__()
    assert [s.fields["image_id"] for s in chunk] == [1000, 1001]
    await stream.aclose()
    await leaks.check()


# --- masks=True: the class map, polygons and RLE ------------------------------------------------


def _rle_string(runs):
    """pycocotools' ``rleToString``: the inverse of the reader's decoding, written from its C."""
    out = []
    for i, run in enumerate(runs):
        x = run - runs[i - 2] if i > 2 else run
        more = True
        while more:
            c = x & 0x1F
            x >>= 5
            more = x != -1 if c & 0x10 else x != 0
            out.append(chr((c | 0x20 if more else c) + 48))
    return "".join(out)


def _runs(mask):
    """COCO's runs of a bool mask: down the columns, from a run of 0s."""
    flat = mask.T.ravel()
    runs, value, n = [], False, 0
    for v in flat:
        if v != value:
            runs.append(n)
            value, n = v, 0
        n += 1
    return runs + [n]


@pytest.fixture(scope="module")
def masked_set(tmp_path_factory):
    """One 40 x 30 image: a polygon (category 1), a crowd region as RLE runs (category 3), a
    triangle in compressed RLE (category 90) drawn last, over the polygon."""
    root = tmp_path_factory.mktemp("coco-masks")
    crowd = np.zeros((30, 40), bool)
    crowd[20:28, 2:12] = True
    triangle = np.tril(np.ones((10, 10), bool))
    tri = np.zeros((30, 40), bool)
    tri[5:15, 25:35] = triangle
    doc = {"images": [{"id": 1, "file_name": "m.jpg", "width": 40, "height": 30}], "categories": CATEGORIES,
           "annotations": [
               {"id": 1, "image_id": 1, "category_id": 1, "bbox": [20, 2, 16, 10], "iscrowd": 0,
                "segmentation": [[20, 2, 36, 2, 36, 12, 20, 12]]},
               {"id": 2, "image_id": 1, "category_id": 3, "bbox": [2, 20, 10, 8], "iscrowd": 1,
                "segmentation": {"counts": _runs(crowd), "size": [30, 40]}},
               {"id": 3, "image_id": 1, "category_id": 90, "bbox": [25, 5, 10, 10], "iscrowd": 0,
                "segmentation": {"counts": _rle_string(_runs(tri)), "size": [30, 40]}}]}
    images, annotations = _write(root, doc, [("m.jpg", 1, (40, 30))])
    return images, annotations, crowd, tri


async def test_masks_draw_polygons_and_rle_in_the_files_order(masked_set):
    images, annotations, crowd, tri = masked_set
    (sample,) = await _read_all(readers.coco(images, annotations, masks=True))
    mask = np.asarray(sample.fields["mask"])
    assert mask.shape == (30, 40) and mask.dtype == np.uint8
    np.testing.assert_array_equal(mask[crowd], 2)  # car: label 2 of 1..3
    np.testing.assert_array_equal(mask[tri], 3)  # toothbrush, drawn over the person's polygon
    person = mask == 1
    assert (person | tri)[4:11, 22:35].all() and not person[tri].any()  # the polygon's inside, less the triangle
    assert not person[:, :19].any() and not person[14:].any()  # nothing a pixel past its edges
    assert ((mask == 0) | person | crowd | tri).all()
    no_crowd = np.asarray((await _read_all(readers.coco(images, annotations, masks=True, include_crowd=False)))[0]
                          .fields["mask"])
    assert (no_crowd[crowd] == 0).all()


async def test_masks_follow_the_image_through_a_pipeline(tmp_path):
    from headrace import datasets

    images, annotations = datasets.make_coco(tmp_path / "set", count=10)
    reader = readers.coco(images, annotations, masks=True)
    colours = {1: (230, 20, 20), 2: (20, 200, 40), 3: (30, 40, 230)}  # make_coco's, by label 1..3
    pipe = ops.Pipeline([ops.RandomResizedCrop(96, scale=(0.3, 1.0)), ops.Flip()], label=None, mask="mask",
                        layout="HWC")
    checked = 0
    async for batch in Loader(reader, batch_size=5, pipeline=pipe, device="cpu"):
        for image, mask in zip(batch["image"], batch["mask"]):
            for label, colour in colours.items():
                inside = mask.numpy() == label
                if inside.sum() > 50:
                    away = np.abs(image.numpy()[inside].astype(int) - colour).sum(-1)
                    assert np.median(away) < 40  # the class's pixels are its colour
                    checked += 1
    assert checked > 0


@pytest.mark.parametrize(("segmentation", "message"), [
    (None, "neither polygons nor an RLE"),
    ([[1, 2, 3, 4]], "at least three points"),
    ([], "empty list"),
    ({"counts": [5, 5], "size": [3, 3]}, r"size \[3, 3\] is not the image's \[48, 64\]"),
    ({"counts": [5, 5], "size": [48, 64]}, "cover 10 pixels"),
    ({"counts": 7, "size": [48, 64]}, "neither a list of runs nor a string"),
])
def test_a_bad_segmentation_is_a_read_error_naming_it(coco_set, tmp_path, segmentation, message):
    doc = _doc()
    doc["annotations"][0]["segmentation"] = segmentation
    for ann in doc["annotations"][1:]:
        ann["segmentation"] = [[0, 0, 1, 0, 1, 1]]
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    with pytest.raises(ReadError, match=f"annotation 101 .*{message}"):
        readers.coco(coco_set[0], tmp_path / "bad.json", masks=True)
    readers.coco(coco_set[0], tmp_path / "bad.json")  # without masks the segmentations are not read
