"""Pipeline(instance_masks=): one binary mask a box, moved with the image and kept or dropped with
its box, on the CPU path through the Loader. Real images (coloured shapes, PNG) with their boxes and
masks as arrays, and a COCO set (``datasets.make_coco``) read with ``instance_masks=True``.

The reference for the geometry is the single mask's path (``Pipeline(mask=)``, its own tests in
``test_masks.py``): each instance layer must come out as that path moves the same layer given as
the mask, with the same boxes, seed and sample indices."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from sample_data import instance_scenes

import headrace
from headrace import ConfigError, TransformError, datasets, ops, readers
from headrace.ops._follow import rows_on_device

SIZES = [(120, 90), (64, 200), (150, 150), (81, 47), (200, 130), (96, 140), (70, 70), (110, 60)]


def _bounds(masks):
    """Each mask's bounding box (x0, y0, x1, y1), float32 ``[N, 4]``."""
    bounds = [[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] for ys, xs in (np.nonzero(m) for m in masks)]
    return np.array(bounds, np.float32).reshape(-1, 4)


def _rows(reader, pipe_ops, seed, **carried):
    """Each sample's output row, by key: its boxes, ids and whatever else ``carried`` names."""
    pipe = ops.Pipeline(pipe_ops, label=None, boxes="boxes", per_box=("labels", "ids"), layout="HWC", **carried)
    names = ["image", "boxes", "labels", "ids", *(v for k, v in carried.items() if k in ("mask", "instance_masks"))]
    out = {}
    with headrace.Loader(reader, batch_size=3, pipeline=pipe, device="cpu", seed=seed).sync() as epochs:
        for batch in epochs:
            for r, key in enumerate(batch.sample_keys):
                out[key] = {name: batch[name][r] for name in names}
    return out


PIPELINES = {
    "resize": [ops.Resize(50)],
    "upscale": [ops.Resize(150)],
    "resize, centre crop": [ops.Resize(72), ops.CenterCrop(64)],
    "centre crop past the edge": [ops.CenterCrop(160)],
    "random resized crop, flips": [ops.RandomResizedCrop(64, scale=(0.1, 1.0)), ops.Flip(0.5),
                                   ops.Flip(0.5, vertical=True)],
    "scale, random crop": [ops.RandomResize(60, 120), ops.RandomCrop(64), ops.Flip(0.5)],
    "letterbox": [ops.Resize(None, max_size=90), ops.CenterCrop(90), ops.Flip(1.0)],
    "iou crop": [ops.RandomIoUCrop(sampler_options=(0.1, 0.3, 0.5)), ops.Resize((64, 64)), ops.Flip(0.5)],
}


@pytest.mark.parametrize("name", PIPELINES)
def test_each_instance_moves_as_the_single_mask_does(tmp_path, name):
    paths, extra = instance_scenes(tmp_path, SIZES)
    most = max(len(e["masks"]) for e in extra)
    dropped = 0
    for seed in (1, 2):
        got = _rows(readers.FileReader(paths, None, extra=extra), PIPELINES[name], seed, instance_masks="masks")
        # The reference: the single mask's path, once a layer, the layer given as the mask.
        single = []
        for k in range(most):
            layer_k = [{**{n: e[n] for n in ("boxes", "labels", "ids")},
                        "mask": e["masks"][k] if k < len(e["masks"]) else np.zeros(e["masks"].shape[1:], np.uint8)}
                       for e in extra]
            single.append(_rows(readers.FileReader(paths, None, extra=layer_k), PIPELINES[name], seed, mask="mask"))
        assert len(got) == len(SIZES)
        for i, (key, row) in enumerate(got.items()):
            masks, ids = row["masks"], row["ids"]
            assert isinstance(masks, torch.Tensor) and masks.dtype == torch.uint8
            assert masks.shape == (len(ids), *row["image"].shape[:2]) == (len(row["boxes"]), *row["image"].shape[:2])
            assert len(row["labels"]) == len(ids)
            for k in range(most):  # the same boxes, kept and dropped alike, on both paths
                assert torch.equal(single[k][key]["boxes"], row["boxes"]) and torch.equal(single[k][key]["ids"], ids)
            for layer, k in zip(masks, ids.tolist()):
                assert torch.equal(layer, single[k][key]["mask"]), (key, k)
            source = extra[int(key.rsplit("/", 1)[-1])]
            assert torch.equal(row["labels"], torch.from_numpy(source["labels"][ids.numpy()]))
            dropped += len(source["masks"]) - len(ids)
    if name in ("random resized crop, flips", "iou crop"):
        # With the IoU crop every drop is the window's (a box whose centre it does not hold; a box
        # with no area after the clip has its centre outside too): masks dropped there as well.
        assert dropped > 0


def test_masks_are_flipped_and_padded_pixel_for_pixel(tmp_path):
    paths, extra = instance_scenes(tmp_path, [(30, 40), (24, 24)])
    masks = extra[1]["masks"]  # one instance
    reader = readers.FileReader(paths, None, extra=extra)
    flipped = _rows(reader, [ops.Flip(1.0), ops.Flip(1.0, vertical=True)], 0, instance_masks="masks")
    np.testing.assert_array_equal(flipped[paths[1][:-4]]["masks"].numpy(), masks[:, ::-1, ::-1])
    assert flipped[paths[0][:-4]]["masks"].shape == (0, 30, 40)
    padded = _rows(reader, [ops.CenterCrop((30, 34))], 0, instance_masks="masks")[paths[1][:-4]]["masks"].numpy()
    assert padded.shape == (1, 30, 34)
    np.testing.assert_array_equal(padded[:, 3:27, 5:29], masks)  # torchvision pads the floor first
    inside = np.zeros((30, 34), bool)
    inside[3:27, 5:29] = True
    assert (padded[:, ~inside] == 0).all() and padded.sum() == masks.sum()


def test_a_mask_is_dropped_with_its_box(tmp_path):
    Image.fromarray(np.full((40, 40, 3), 90, np.uint8)).save(tmp_path / "a.png")
    masks = np.zeros((3, 40, 40), np.uint8)
    masks[0, 0:10, 0:10] = 1  # a corner: cropped away, the box left with no area
    masks[1, 15:25, 12:28] = 1  # the middle: kept
    masks[2, 30:40, 30:40] = 1  # the other corner: cropped away
    extra = [{"boxes": _bounds(masks), "labels": np.array([5, 6, 7]), "ids": np.arange(3), "masks": masks}]
    reader = readers.FileReader([str(tmp_path / "a.png")], None, extra=extra)
    (row,) = _rows(reader, [ops.CenterCrop(20)], 0, instance_masks="masks").values()
    assert row["labels"].tolist() == [6] and row["ids"].tolist() == [1]
    assert row["boxes"].tolist() == [[2.0, 5.0, 18.0, 15.0]]
    np.testing.assert_array_equal(row["masks"].numpy(), masks[1:2, 10:30, 10:30])


@pytest.mark.parametrize("form", ["bool array", "bool tensor", "uint8 tensor", "int32 of 0 and 7", "uint8 of 0 and 255"])
def test_bool_and_integer_masks_come_out_as_0_and_1(tmp_path, form):
    paths, extra = instance_scenes(tmp_path, SIZES[:5])
    pipe_ops = [ops.RandomResizedCrop(48, scale=(0.3, 1.0)), ops.Flip(0.5)]
    want = _rows(readers.FileReader(paths, None, extra=extra), pipe_ops, 3, instance_masks="masks")
    convert = {"bool array": lambda m: m.astype(bool), "bool tensor": lambda m: torch.from_numpy(m.astype(bool)),
               "uint8 tensor": torch.from_numpy, "int32 of 0 and 7": lambda m: m.astype(np.int32) * 7,
               "uint8 of 0 and 255": lambda m: m * 255}[form]
    given = [{**e, "masks": convert(e["masks"])} for e in extra]
    got = _rows(readers.FileReader(paths, None, extra=given), pipe_ops, 3, instance_masks="masks")
    assert got.keys() == want.keys()
    for key in want:
        assert got[key]["masks"].dtype == torch.uint8 and torch.equal(got[key]["masks"], want[key]["masks"])
    assert sum(int(row["masks"].sum()) for row in want.values()) > 0


def test_with_a_class_map_and_a_coco_set(tmp_path):
    images, annotations = datasets.make_coco(tmp_path / "coco", count=10)
    reader = readers.coco(images, annotations, masks=True, instance_masks=True)
    drawn = {s: np.asarray(e["masks"]) for s, e in zip(reader.paths, reader._extra)}
    pipe = ops.Pipeline([ops.Decode()], label=None, boxes="boxes", per_box=("labels",), mask="mask",
                        instance_masks="masks")
    rows = 0
    with headrace.Loader(reader, batch_size=4, pipeline=pipe, device="cpu").sync() as epochs:
        for batch in epochs:
            for key, masks, labels, classes in zip(batch.sample_keys, batch["masks"], batch["labels"], batch["mask"]):
                source = next(drawn[p] for p in drawn if str(p).endswith(f"/{key}.jpg"))
                np.testing.assert_array_equal(masks.numpy(), source)  # no geometry: the masks as drawn, every box kept
                composed = torch.zeros_like(classes)
                for layer, label in zip(masks, labels):
                    composed[layer == 1] = label
                assert torch.equal(composed, classes)  # the class map, drawn from the same annotations
                rows += 1
    assert rows == 10
    # Through a crop: each instance's pixels, where no later one covers them, are its label's colour.
    colours = {1: (230, 20, 20), 2: (20, 200, 40), 3: (30, 40, 230)}  # make_coco's, by label 1..3
    pipe = ops.Pipeline([ops.RandomResizedCrop(96, scale=(0.3, 1.0)), ops.Flip()], label=None, boxes="boxes",
                        per_box=("labels",), instance_masks="masks", layout="HWC")
    checked = 0
    with headrace.Loader(reader, batch_size=4, pipeline=pipe, device="cpu", seed=1).sync() as epochs:
        for batch in epochs:
            for image, masks, labels in zip(batch["image"], batch["masks"], batch["labels"]):
                for k, (layer, label) in enumerate(zip(masks.numpy(), labels.tolist())):
                    alone = (layer == 1) & (masks[k + 1 :].numpy().sum(axis=0) == 0)
                    if alone.sum() > 50:
                        away = np.abs(image.numpy()[alone].astype(int) - colours[label]).sum(-1)
                        assert np.median(away) < 40
                        checked += 1
    assert checked > 0


def _two_samples(tmp_path, bad_fields):
    for name in ("good", "bad"):
        Image.fromarray(np.zeros((24, 32, 3), np.uint8)).save(tmp_path / f"{name}.png")
    boxes = np.array([[2, 2, 20, 20], [10, 4, 30, 22]], np.float32)
    good = {"boxes": boxes, "labels": np.array([1, 2]), "masks": np.ones((2, 24, 32), np.uint8)}
    bad = {"boxes": boxes, "labels": np.array([1, 2]), **bad_fields}
    if "masks" not in bad_fields:
        bad.pop("masks", None)
    return readers.FileReader([str(tmp_path / "good.png"), str(tmp_path / "bad.png")], None, extra=[good, bad])


BAD = {
    "no field": ({}, "sample has no 'masks' field"),
    "two dimensions": ({"masks": np.ones((24, 32), np.uint8)}, "is 2-D uint8, not a 3-D array"),
    "floats": ({"masks": np.ones((2, 24, 32), np.float32)}, "is 3-D float32, not a 3-D array"),
    "another size": ({"masks": np.ones((2, 32, 24), np.uint8)}, "is 24x32, its image decodes to 32x24"),
    "one short": ({"masks": np.ones((1, 24, 32), np.uint8)}, "holds 1 masks for 2 boxes"),
    "one too many": ({"masks": torch.ones((3, 24, 32), dtype=torch.bool)}, "holds 3 masks for 2 boxes"),
    "encoded": ({"masks": b"\x89PNG not masks"}, "is encoded bytes"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_instance_masks_fail_their_sample_named(tmp_path, case):
    fields, message = BAD[case]
    reader = _two_samples(tmp_path, fields)
    pipe = ops.Pipeline([ops.Resize(12)], label=None, boxes="boxes", per_box=("labels",), instance_masks="masks")
    with pytest.raises(TransformError, match=message) as info:
        list(headrace.Loader(reader, batch_size=2, pipeline=pipe, device="cpu").sync())
    assert info.value.key == str(tmp_path / "bad") and info.value.source == str(tmp_path / "bad.png")
    loader = headrace.Loader(reader, batch_size=2, pipeline=pipe, device="cpu", on_error="skip")
    (batch,) = loader.sync()
    assert batch.sample_keys == [str(tmp_path / "good")]
    (masks,) = batch["masks"]
    assert masks.shape == (2, 12, 16) and masks.dtype == torch.uint8 and bool((masks == 1).all())
    assert loader.stats().dropped == 1 and loader.stats().errors == {"TransformError": 1}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"instance_masks": "masks"}, "name the boxes too"),
    ({"boxes": "boxes", "instance_masks": ""}, "instance_masks must be a field name"),
    ({"boxes": "boxes", "instance_masks": 3}, "instance_masks must be a field name"),
    ({"boxes": "boxes", "instance_masks": "boxes"}, "name a field twice"),
    ({"boxes": "boxes", "per_box": ("labels",), "instance_masks": "labels"}, "name a field twice"),
    ({"boxes": "boxes", "mask": "masks", "instance_masks": "masks"}, "name a field twice"),
    ({"boxes": "boxes", "instance_masks": "jpg"}, "'jpg' is named as instance_masks and elsewhere"),
    ({"boxes": "boxes", "instance_masks": "cls", "label": "cls"}, "'cls' is named as instance_masks and elsewhere"),
    ({"boxes": "boxes", "instance_masks": "masks", "fields": ("masks",)}, "'masks' is named as instance_masks"),
])
def test_instance_masks_refused_where_they_cannot_work(kwargs, message):
    kwargs.setdefault("label", None)
    with pytest.raises(ConfigError, match=message):
        ops.Pipeline([ops.Resize(32)], **kwargs)


def test_the_pipeline_names_them():
    pipe = ops.Pipeline([ops.Resize(32)], label=None, boxes="boxes", instance_masks="masks")
    assert pipe.instance_masks == "masks" and pipe.carries and "instance_masks='masks'" in repr(pipe)
    assert ops.Pipeline([ops.Resize(32)], label=None, boxes="boxes").instance_masks is None


def test_rows_of_masks_go_to_the_device_in_one_copy():
    cpu = torch.device("cpu")
    rows = [torch.randint(0, 2, (n, 6, 5), dtype=torch.uint8) for n in (2, 0, 3, 0, 1)]
    out = rows_on_device({"masks": rows}, cpu)["masks"]
    assert [tuple(r.shape) for r in out] == [(2, 6, 5), (0, 6, 5), (3, 6, 5), (0, 6, 5), (1, 6, 5)]
    assert all(torch.equal(a, b) for a, b in zip(out, rows))
    assert len({r.untyped_storage().data_ptr() for r in out}) == 1  # one transfer, views of it
    sized = [torch.ones((2, 6, 5), dtype=torch.uint8), torch.zeros((0, 4, 4), dtype=torch.uint8),
             torch.full((1, 3, 7), 1, dtype=torch.uint8)]  # outputs of other sizes: the flattened join
    out = rows_on_device({"masks": sized}, cpu)["masks"]
    assert [tuple(r.shape) for r in out] == [(2, 6, 5), (0, 4, 4), (1, 3, 7)]
    assert all(torch.equal(a, b) for a, b in zip(out, sized))
    none = rows_on_device({"masks": [torch.zeros((0, 6, 5), dtype=torch.uint8)] * 2}, cpu)["masks"]
    assert [tuple(r.shape) for r in none] == [(0, 6, 5), (0, 6, 5)]
