"""Pipeline(boxes=, mask=) on the GPU path: the boxes follow the pixels the lanes make (white
rectangles on black, found in the output); boxes and masks equal the CPU path's for the same seed
and come out on the device."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from sample_data import white_rectangles

import headrace
from headrace import datasets, ops, readers

SIZES = [(120, 90), (64, 200), (150, 150), (81, 47), (200, 130), (96, 96), (140, 60), (70, 180)]
PIPELINES = {
    "crop, flips": [ops.RandomResizedCrop(64, scale=(0.2, 1.0)), ops.Flip(0.5), ops.Flip(0.5, vertical=True)],
    "resize, centre crop": [ops.Resize(72), ops.CenterCrop(64)],
    "resize only": [ops.Resize(50)],
    "crop past the edge": [ops.CenterCrop(160)],
    "scale, random crop": [ops.RandomResize(60, 120), ops.RandomCrop(64), ops.Flip(0.5)],
    "letterbox": [ops.Resize(None, max_size=90), ops.CenterCrop(90), ops.Flip(0.5)],
    "longer side capped": [ops.Resize(60, max_size=80)],
}


@pytest.fixture
def rectangles(tmp_path):
    paths, extra = white_rectangles(tmp_path, SIZES, "jpg")  # JPEGs: the GPU's own decoders
    return readers.FileReader(paths, None, extra=extra)


def _epoch(reader, pipe_ops, device):
    pipe = ops.Pipeline(pipe_ops, label=None, boxes="boxes", per_box=("labels",), layout="HWC")
    with headrace.Loader(reader, batch_size=3, pipeline=pipe, device=device, seed=5).sync() as epochs:
        return [(batch.sample_keys, [x.cpu() for x in batch["image"]], [b.cpu() for b in batch["boxes"]],
                 [b.device for b in batch["boxes"]] + [x.device for x in batch["labels"]]) for batch in epochs]


@pytest.mark.parametrize("name", PIPELINES)
def test_boxes_follow_the_gpu_pixels_and_equal_the_cpu_paths(rectangles, name):
    gpu = _epoch(rectangles, PIPELINES[name], "cuda")
    cpu = _epoch(rectangles, PIPELINES[name], "cpu")
    seen = 0
    for (keys, images, boxes, devices), (cpu_keys, _, cpu_boxes, _) in zip(gpu, cpu):
        assert keys == cpu_keys and all(d.type == "cuda" for d in devices)
        for image, b, c in zip(images, boxes, cpu_boxes):
            assert torch.equal(b, c)  # one fold, one set of random numbers: the same boxes
            ys, xs = np.nonzero(image[..., 0].numpy() > 127)
            if len(xs) == 0:
                assert b.shape == (0, 4)
                continue
            np.testing.assert_allclose(b[0].numpy(), [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], atol=1.0)
            seen += 1
    assert seen >= len(SIZES) // 2


def test_a_coco_set_on_the_gpu(tmp_path):
    images, annotations = datasets.make_coco(tmp_path / "coco", count=12)
    pipe = ops.Pipeline([ops.RandomResizedCrop(96, scale=(0.3, 1.0)), ops.Flip()], label=None, boxes="boxes",
                        per_box=("labels",), fields=("image_id",))
    loader = headrace.Loader(readers.coco(images, annotations), batch_size=4, pipeline=pipe, device="cuda")
    ids = []
    with loader.sync() as epochs:
        for batch in epochs:
            assert batch["image"].is_cuda and tuple(batch["image"].shape[1:]) == (3, 96, 96)
            for boxes, labels in zip(batch["boxes"], batch["labels"]):
                assert boxes.is_cuda and labels.is_cuda and len(boxes) == len(labels)
                assert bool(((boxes >= 0) & (boxes <= 96)).all()) and bool((boxes[:, 2:] > boxes[:, :2]).all())
                assert set(labels.tolist()) <= {1, 2, 3}
            ids += batch["image_id"].tolist()
    assert sorted(ids) == list(range(1000, 1012))


def test_masks_on_the_gpu_equal_the_cpu_paths(tmp_path):
    rng = np.random.default_rng(2)
    paths, extra = [], []
    for i, (h, w) in enumerate(SIZES):
        classes = np.zeros((h, w), np.uint8)
        classes[h // 4 : h // 2, w // 3 : w - 2] = 1 + i % 3
        pixels = (rng.integers(0, 255, size=(h, w, 3)) // 2).astype(np.uint8) + classes[..., None] * 40
        Image.fromarray(pixels).save(tmp_path / f"{i}.jpg", quality=95)
        paths.append(str(tmp_path / f"{i}.jpg"))
        extra.append({"mask": classes})
    reader = readers.FileReader(paths, None, extra=extra)
    for pipe_ops in (PIPELINES["crop, flips"], PIPELINES["letterbox"], PIPELINES["resize only"]):
        pipe = ops.Pipeline(pipe_ops, label=None, mask="mask", mask_fill=255)
        masks = {}
        for device in ("cuda", "cpu"):
            with headrace.Loader(reader, batch_size=3, pipeline=pipe, device=device, seed=9).sync() as epochs:
                for batch in epochs:
                    for key, mask in zip(batch.sample_keys, batch["mask"]):
                        assert mask.device.type == device.split(":")[0]
                        masks.setdefault(key, []).append(mask.cpu())
        assert len(masks) == len(SIZES)
        for gpu, cpu in masks.values():
            assert torch.equal(gpu, cpu)


def test_an_iou_crop_on_the_gpu_equals_the_cpu_paths(rectangles):
    pipe_ops = [ops.RandomIoUCrop(sampler_options=(0.1, 0.3, 0.5)), ops.Resize((64, 64)), ops.Flip(0.5)]
    gpu = _epoch(rectangles, pipe_ops, "cuda")
    cpu = _epoch(rectangles, pipe_ops, "cpu")
    for (keys, images, boxes, _), (cpu_keys, cpu_images, cpu_boxes, _) in zip(gpu, cpu):
        assert keys == cpu_keys
        for image, cpu_image, b, c in zip(images, cpu_images, boxes, cpu_boxes):
            assert torch.equal(b, c)  # the window chosen once, on the host, for both
            assert (image.float() - cpu_image.float()).abs().mean() < 2  # the same crop (JPEG decoders differ a little)
