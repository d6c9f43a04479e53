"""Pipeline(instance_masks=) on the GPU path: each row's instance masks ``[N, H, W]`` come out on the
device, equal to the CPU path's (the host maps them for both, from one fold and one set of random
numbers), kept and dropped with the same boxes; and ``rows_on_device`` copies rows of masks of
several counts (none among them) and sizes to CUDA whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sample_data import instance_scenes

import headrace
from headrace import datasets, ops, readers
from headrace.ops._follow import rows_on_device

SIZES = [(120, 90), (64, 200), (150, 150), (81, 47), (200, 130), (96, 140), (70, 70), (110, 60)]
PIPELINES = {
    "crop, flips": [ops.RandomResizedCrop(64, scale=(0.1, 1.0)), ops.Flip(0.5), ops.Flip(0.5, vertical=True)],
    "resize, centre crop": [ops.Resize(72), ops.CenterCrop(64)],
    "resize only": [ops.Resize(50)],  # sizes differ: the rows are joined flattened for the copy
    "crop past the edge": [ops.CenterCrop(160)],
    "letterbox": [ops.Resize(None, max_size=90), ops.CenterCrop(90), ops.Flip(0.5)],
    "iou crop": [ops.RandomIoUCrop(sampler_options=(0.1, 0.3, 0.5)), ops.Resize((64, 64)), ops.Flip(0.5)],
}


@pytest.fixture
def scenes(tmp_path):
    paths, extra = instance_scenes(tmp_path, SIZES, "jpg")  # JPEGs: the GPU's own decoders
    return readers.FileReader(paths, None, extra=extra)


def _rows(reader, pipe_ops, device):
    """Each row by key: its masks, boxes, labels and ids (on the host), and the devices they came on."""
    pipe = ops.Pipeline(pipe_ops, label=None, boxes="boxes", per_box=("labels", "ids"), instance_masks="masks")
    out = {}
    with headrace.Loader(reader, batch_size=3, pipeline=pipe, device=device, seed=7).sync() as epochs:
        for batch in epochs:
            for r, key in enumerate(batch.sample_keys):
                row = {name: batch[name][r] for name in ("masks", "boxes", "labels", "ids")}
                out[key] = ({name: value.cpu() for name, value in row.items()},
                            {value.device.type for value in row.values()}, tuple(batch["image"][r].shape[-2:]))
    return out


@pytest.mark.parametrize("name", PIPELINES)
def test_instance_masks_on_the_gpu_equal_the_cpu_paths(scenes, name):
    gpu = _rows(scenes, PIPELINES[name], "cuda")
    cpu = _rows(scenes, PIPELINES[name], "cpu")
    assert gpu.keys() == cpu.keys() and len(gpu) == len(SIZES)
    instances = 0
    for key, (row, devices, size) in gpu.items():
        cpu_row, cpu_devices, cpu_size = cpu[key]
        assert devices == {"cuda"} and cpu_devices == {"cpu"} and size == cpu_size
        masks = row["masks"]
        assert masks.dtype == torch.uint8 and masks.shape == (len(row["boxes"]), *size) == (len(row["ids"]), *size)
        for field in ("masks", "boxes", "labels", "ids"):
            assert torch.equal(row[field], cpu_row[field]), (key, field)
        assert set(masks.unique().tolist()) <= {0, 1}
        instances += len(masks)
    assert instances > 0


def test_a_coco_set_s_instance_masks_on_the_gpu(tmp_path):
    images, annotations = datasets.make_coco(tmp_path / "coco", count=12)
    reader = readers.coco(images, annotations, masks=True, instance_masks=True)
    pipe = ops.Pipeline([ops.RandomResizedCrop(96, scale=(0.3, 1.0)), ops.Flip()], label=None, boxes="boxes",
                        per_box=("labels",), mask="mask", instance_masks="masks", fields=("image_id",))
    found = {}
    for device in ("cuda", "cpu"):
        with headrace.Loader(reader, batch_size=4, pipeline=pipe, device=device, seed=3).sync() as epochs:
            for batch in epochs:
                for r, image_id in enumerate(batch["image_id"].tolist()):
                    masks, labels, classes = batch["masks"][r], batch["labels"][r], batch["mask"][r]
                    assert masks.device.type == labels.device.type == classes.device.type == device
                    assert masks.shape == (len(labels), 96, 96) and masks.dtype == torch.uint8
                    composed = torch.zeros_like(classes)
                    for layer, label in zip(masks, labels):  # later annotations over earlier: the class map
                        composed[layer == 1] = int(label)
                    assert torch.equal(composed, classes)
                    found.setdefault(image_id, []).append((masks.cpu(), batch["boxes"][r].cpu()))
    assert sorted(found) == list(range(1000, 1012))
    for (gpu_masks, gpu_boxes), (cpu_masks, cpu_boxes) in found.values():
        assert torch.equal(gpu_masks, cpu_masks) and torch.equal(gpu_boxes, cpu_boxes)


def test_rows_of_masks_of_several_counts_go_to_cuda_whole():
    device = torch.device("cuda")
    rows = [torch.randint(0, 2, (n, 6, 5), dtype=torch.uint8) for n in (2, 0, 3, 0, 1)]
    out = rows_on_device({"masks": rows}, device)["masks"]
    torch.cuda.synchronize()
    assert [r.device.type for r in out] == ["cuda"] * 5
    assert all(a.shape == b.shape and torch.equal(a.cpu(), b) for a, b in zip(out, rows))
    sized = [torch.ones((2, 6, 5), dtype=torch.uint8), torch.zeros((0, 4, 4), dtype=torch.uint8),
             torch.from_numpy(np.eye(7, dtype=np.uint8)[:3][None].repeat(2, axis=0))]
    out = rows_on_device({"masks": sized}, device)["masks"]
    torch.cuda.synchronize()
    assert all(a.is_cuda and a.shape == b.shape and torch.equal(a.cpu(), b) for a, b in zip(out, sized))
    none = rows_on_device({"masks": [torch.zeros((0, 6, 5), dtype=torch.uint8)] * 3}, device)["masks"]
    assert [tuple(r.shape) for r in none] == [(0, 6, 5)] * 3 and all(r.is_cuda for r in none)
