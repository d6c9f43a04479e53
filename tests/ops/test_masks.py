"""Pipeline(mask=): a segmentation mask moves with the pixels. Real images of flat coloured
regions with their class maps (PNG masks, palette and grey, and arrays), through the CPU path;
each output mask is checked against the classes the output image's colours say."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

import headrace
from headrace import TransformError, ops, readers

COLOURS = np.array([[0, 0, 0], [250, 30, 30], [30, 250, 30], [30, 30, 250]], np.uint8)
SIZES = [(120, 90), (64, 200), (150, 150), (81, 47), (200, 130), (96, 140)]


def _scene(rng, h, w):
    """A class map of a few rectangles on class 0."""
    classes = np.zeros((h, w), np.uint8)
    for c in (1, 2, 3):
        y0, x0 = int(rng.integers(0, h - 8)), int(rng.integers(0, w - 8))
        classes[y0 : y0 + int(rng.integers(8, h // 2 + 9)), x0 : x0 + int(rng.integers(8, w // 2 + 9))] = c
    return classes


def _png(classes: np.ndarray, mode: str) -> bytes:
    img = Image.fromarray(classes, mode="L")
    if mode == "P":  # the values are palette indices; the palette's colours are not the classes
        img = Image.frombytes("P", img.size, classes.tobytes())
        img.putpalette([255, 255, 255, 9, 9, 9, 128, 0, 0, 0, 128, 0] + [0] * 756)
    buffer = io.BytesIO()
    img.save(buffer, format="PNG")
    return buffer.getvalue()


def _scenes(tmp_path, as_="L"):
    rng = np.random.default_rng(2)
    paths, extra = [], []
    for i, (h, w) in enumerate(SIZES):
        classes = _scene(rng, h, w)
        Image.fromarray(COLOURS[classes]).save(tmp_path / f"{i}.png")
        paths.append(str(tmp_path / f"{i}.png"))
        extra.append({"mask": classes if as_ == "array" else _png(classes, as_)})
    return readers.FileReader(paths, None, extra=extra)


def _epoch(reader, pipe_ops, **kwargs):
    pipe = ops.Pipeline(pipe_ops, label=None, mask="mask", layout="HWC", **kwargs)
    with headrace.Loader(reader, batch_size=4, pipeline=pipe, device="cpu", seed=3).sync() as epochs:
        return list(epochs)


def _agreement(image: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of pixels whose colour is one class's (not a blend at an edge) where the mask
    says that class."""
    pixels = image.numpy().astype(int)
    distance = np.abs(pixels[:, :, None, :] - COLOURS[None, None].astype(int)).sum(-1)
    nearest, clean = distance.argmin(-1), distance.min(-1) < 12
    return float((nearest[clean] == mask.numpy()[clean]).mean())


PIPELINES = {
    "crop, flips": [ops.RandomResizedCrop(64, scale=(0.2, 1.0)), ops.Flip(0.5), ops.Flip(0.5, vertical=True)],
    "resize, centre crop": [ops.Resize(72), ops.CenterCrop(64)],
    "resize only": [ops.Resize(50)],
    "scale, random crop": [ops.RandomResize(60, 120), ops.RandomCrop(64), ops.Flip(0.5)],
    "letterbox": [ops.Resize(None, max_size=90), ops.CenterCrop(90), ops.Flip(1.0)],
    "upscale": [ops.Resize(120)],
}


@pytest.mark.parametrize("as_", ["L", "P", "array"])
@pytest.mark.parametrize("name", PIPELINES)
def test_the_mask_follows_the_pixels(tmp_path, name, as_):
    batches = _epoch(_scenes(tmp_path, as_), PIPELINES[name])
    rows = 0
    for batch in batches:
        images, masks = batch["image"], batch["mask"]
        assert isinstance(masks, torch.Tensor) == isinstance(images, torch.Tensor)  # one tensor, or a list, as the images
        if isinstance(images, torch.Tensor):
            assert masks.shape == images.shape[:3] and masks.dtype == torch.uint8
        for image, mask in zip(images, masks):
            assert mask.shape == image.shape[:2]
            assert _agreement(image, mask) > 0.99
            rows += 1
    assert rows == len(SIZES)


def test_padding_is_mask_fill(tmp_path):
    reader = _scenes(tmp_path)
    for batch in _epoch(reader, [ops.CenterCrop(220)], mask_fill=255):  # larger than every image: padded
        for key, mask in zip(batch.sample_keys, batch["mask"]):
            i = int(key.rsplit("/", 1)[-1])
            h, w = SIZES[i]
            top, left = (220 - h) // 2, (220 - w) // 2  # torchvision pads the floor first
            real = np.zeros((220, 220), bool)
            real[top : top + h, left : left + w] = True
            assert (mask.numpy()[~real] == 255).all()
            classes = np.asarray(Image.open(io.BytesIO(reader._extra[i]["mask"])))
            np.testing.assert_array_equal(mask.numpy()[real].reshape(h, w), classes)


def test_masks_of_one_size_stay_a_list_when_the_images_are(tmp_path):
    for i in range(3):
        Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(tmp_path / f"{i}.png")
    reader = readers.FileReader([str(tmp_path / f"{i}.png") for i in range(3)], None,
                                extra=[{"mask": np.full((20, 30), i, np.uint8)} for i in range(3)])
    (batch,) = _epoch(reader, [ops.Resize(10)])  # no fixed output size, though these come out one size
    assert isinstance(batch["image"], list) and isinstance(batch["mask"], list)
    assert [m.unique().tolist() for m in batch["mask"]] == [[0], [1], [2]]


def test_classes_past_255_come_out_as_int64(tmp_path):
    for name in ("a", "b"):
        Image.fromarray(np.zeros((20, 30, 3), np.uint8)).save(tmp_path / f"{name}.png")
    wide = np.arange(600, dtype=np.int32).reshape(20, 30)
    narrow = (np.arange(600) % 7).astype(np.uint8).reshape(20, 30)
    reader = readers.FileReader([str(tmp_path / "a.png"), str(tmp_path / "b.png")], None,
                                extra=[{"mask": wide}, {"mask": narrow}])
    (batch,) = _epoch(reader, [ops.CenterCrop((20, 30)), ops.Flip(1.0)])  # one size: one tensor, int64 for both
    assert batch["mask"].dtype == torch.int64
    np.testing.assert_array_equal(batch["mask"][0].numpy(), wide[:, ::-1])
    np.testing.assert_array_equal(batch["mask"][1].numpy(), narrow[:, ::-1])


BAD = {
    "no mask": ({}, "sample has no 'mask' field"),
    "colours": ({"mask": "rgb"}, "is a RGB image; a mask has one channel"),
    "another size": ({"mask": np.zeros((10, 10), np.uint8)}, "is 10x10, its image decodes to 32x24"),
    "another size, encoded": ({"mask": "small"}, "is 8x8, its image decodes to 32x24"),
    "not an image": ({"mask": b"not a png"}, "cannot be decoded"),
    "three dimensions": ({"mask": np.zeros((24, 32, 3), np.uint8)}, "is 3-D uint8"),
    "floats": ({"mask": np.zeros((24, 32), np.float32)}, "is 2-D float32"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_mask_fails_its_sample_named(tmp_path, case, leaks):
    for name in ("good", "bad"):
        Image.fromarray(np.zeros((24, 32, 3), np.uint8)).save(tmp_path / f"{name}.png")
    fields, message = BAD[case]
    encoded = {"rgb": (24, 32, 3), "small": (8, 8)}
    if isinstance(fields.get("mask"), str):
        buffer = io.BytesIO()
        Image.fromarray(np.zeros(encoded[fields["mask"]], np.uint8)).save(buffer, format="PNG")
        fields = {"mask": buffer.getvalue()}
    good = {"mask": np.ones((24, 32), np.uint8)}
    reader = readers.FileReader([str(tmp_path / "good.png"), str(tmp_path / "bad.png")], None, extra=[good, fields])
    pipe = ops.Pipeline([ops.Resize(12)], label=None, mask="mask")
    with pytest.raises(TransformError, match=message) as info:
        list(headrace.Loader(reader, batch_size=2, pipeline=pipe, device="cpu").sync())
    assert info.value.key == str(tmp_path / "bad") and info.value.source == str(tmp_path / "bad.png")
    loader = headrace.Loader(reader, batch_size=2, pipeline=pipe, device="cpu", on_error="skip")
    (batch,) = loader.sync()
    assert batch.sample_keys == [str(tmp_path / "good")] and [m.tolist() for m in batch["mask"]] == [[[1] * 16] * 12]
    assert loader.stats().dropped == 1


def test_boxes_and_a_mask_together(tmp_path):
    rng = np.random.default_rng(5)
    classes = _scene(rng, 90, 120)
    Image.fromarray(COLOURS[classes]).save(tmp_path / "a.png")
    ys, xs = np.nonzero(classes == 2)
    box = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]
    reader = readers.FileReader([str(tmp_path / "a.png")], None, extra=[
        {"mask": _png(classes, "L"), "boxes": np.array([box], np.float32), "labels": np.array([2])}])
    pipe = ops.Pipeline([ops.Resize(60), ops.CenterCrop(56), ops.Flip(1.0)], label=None, mask="mask", boxes="boxes",
                        per_box=("labels",), layout="HWC")
    (batch,) = headrace.Loader(reader, batch_size=1, pipeline=pipe, device="cpu").sync()
    ys, xs = np.nonzero(batch["mask"][0].numpy() == 2)
    np.testing.assert_allclose(batch["boxes"][0][0].numpy(), [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], atol=1.0)


def test_each_output_pixel_takes_the_class_under_its_centre(tmp_path):
    # Columns of classes 0, 1, 0, 1, ...: halved, each output pixel's centre falls on an odd
    # source column; doubled, each source column covers two output columns.
    Image.fromarray(np.zeros((8, 16, 3), np.uint8)).save(tmp_path / "a.png")
    columns = np.tile(np.arange(16, dtype=np.uint8) % 2, (8, 1))
    reader = readers.FileReader([str(tmp_path / "a.png")], None, extra=[{"mask": columns}])
    (half,) = _epoch(reader, [ops.Resize((4, 8))])
    assert (half["mask"].numpy() == 1).all()
    (double,) = _epoch(reader, [ops.Resize((16, 32))])
    np.testing.assert_array_equal(double["mask"][0].numpy(), np.tile(np.arange(32) // 2 % 2, (16, 1)))


def test_boxes_and_masks_stop_at_a_crop_made_after_a_resize(tmp_path):
    """Resize, a crop, then a larger crop (padding around the first): the first crop's edge is the
    real pixels' edge, for the image, its boxes and its mask alike."""
    path = tmp_path / "white.png"
    Image.fromarray(np.full((40, 40, 3), 200, np.uint8)).save(path)
    extra = [{"boxes": np.array([[0, 0, 40, 40]], np.float32), "labels": np.array([1]),
              "mask": np.ones((40, 40), np.uint8)}]
    pipe = ops.Pipeline([ops.Resize(40), ops.CenterCrop(20), ops.CenterCrop(30)], label=None, layout="HWC",
                        boxes="boxes", per_box=("labels",), mask="mask", mask_fill=255)
    reader = readers.FileReader([str(path)], None, extra=extra)
    with headrace.Loader(reader, batch_size=1, pipeline=pipe, device="cpu").sync() as epochs:
        (batch,) = list(epochs)
    image, mask = batch["image"][0].numpy()[..., 0], batch["mask"][0].numpy()
    real = np.zeros((30, 30), bool)
    real[5:25, 5:25] = True  # the 20 x 20 crop, centred in the 30 x 30 output
    assert ((image != 0) == real).all()
    assert batch["boxes"][0].tolist() == [[5.0, 5.0, 25.0, 25.0]]
    assert (mask[real] == 1).all() and (mask[~real] == 255).all()
