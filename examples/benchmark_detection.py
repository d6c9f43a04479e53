"""Detection benchmark: SSD's training pipeline on a COCO set, headrace against DALI, one process.

    python examples/benchmark_detection.py --images 8192 --epochs 6 --dali-threads 4,8,12

The set: photograph-like JPEGs (the GPU benchmark's, 256-600 px a side) with 1-6 random boxes each
in 5 categories, as COCO's ``instances`` JSON (made once under .data/). Rows, side by side, one
epoch each in turn, the order rotated every round (the machine's drift falls on every row alike):

  headrace (SSD)             readers.coco → RandomIoUCrop → Resize((300, 300)) → Flip → Normalize
                             float16, boxes and labels moved with the image (Pipeline(boxes=))
  headrace (no boxes)        the same images through RandomResizedCrop(300) → Flip → Normalize:
                             what moving the boxes and choosing IoU windows costs
  DALI (SSD, N threads)      DALI's SSD example: readers.coco(ratio, ltrb) → random_bbox_crop →
                             decoders.image_slice (mixed) → resize 300 → bb_flip →
                             crop_mirror_normalize float16, DALIGenericIterator (--dali-threads)

Each row reports its median images/s over --epochs rounds after a warm-up, its median paired
ratio to the first row, and the host cores it kept busy (process CPU time / wall). ``--device cpu``
runs the headrace rows on the CPU path (no DALI). Writes JSON (--out).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import headrace
from headrace import datasets, ops, readers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_gpu import bench_interleaved  # noqa: E402 - the rows side by side, one epoch each in turn

ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = 5


def make_set(root: Path, images: int) -> tuple[Path, Path]:
    """``root/images`` (photograph-like JPEGs) and ``root/annotations.json``: 1-6 boxes an image."""
    folder, _ = datasets.ensure_image_folder(root / "images", count=images, classes=1)
    annotations = root / "annotations.json"
    if annotations.exists():
        return folder, annotations
    from PIL import Image

    rng = np.random.default_rng(0)
    doc: dict[str, Any] = {"images": [], "annotations": [],
                           "categories": [{"id": c, "name": f"class{c}"} for c in range(1, CATEGORIES + 1)]}
    for i, path in enumerate(sorted(folder.rglob("*.jpg"))):
        with Image.open(path) as img:
            w, h = img.size
        doc["images"].append({"id": i, "file_name": str(path.relative_to(folder)), "width": w, "height": h})
        for _ in range(int(rng.integers(1, 7))):
            bw, bh = rng.uniform(0.1, 0.6) * w, rng.uniform(0.1, 0.6) * h
            x, y = rng.uniform(0, w - bw), rng.uniform(0, h - bh)
            doc["annotations"].append({"id": len(doc["annotations"]) + 1, "image_id": i, "iscrowd": 0,
                                       "category_id": int(rng.integers(1, CATEGORIES + 1)), "bbox": [x, y, bw, bh]})
    annotations.write_text(json.dumps(doc))
    return folder, annotations


def headrace_epochs(images: Path, annotations: Path, batch: int, device: str, boxes: bool):
    """A headrace loader's (run one epoch, close) pair, through ``with loader.sync()``."""
    norm = ops.Normalize(dtype="float16")
    if boxes:
        pipe = ops.Pipeline([ops.RandomIoUCrop(), ops.Resize((300, 300)), ops.Flip(), norm], label=None,
                            boxes="boxes", per_box=("labels",))
    else:
        pipe = ops.Pipeline([ops.RandomResizedCrop(300), ops.Flip(), norm], label=None)
    loader = headrace.Loader(readers.coco(images, annotations, shuffle=True), batch_size=batch, pipeline=pipe,
                             device=device)
    owner = contextlib.ExitStack()
    epochs = owner.enter_context(loader.sync())
    return (lambda: sum(b.size for b in epochs)), owner.close


def dali_epochs(images: Path, annotations: Path, batch: int, threads: int):
    """DALI's SSD training pipeline on the same set (its SSD example, float16 output)."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    mean = [0.485 * 255, 0.456 * 255, 0.406 * 255]
    std = [0.229 * 255, 0.224 * 255, 0.225 * 255]

    @pipeline_def
    def pipe():
        jpegs, bboxes, labels = fn.readers.coco(file_root=str(images), annotations_file=str(annotations),
                                                ratio=True, ltrb=True, random_shuffle=True, name="Reader")
        crop_begin, crop_size, bboxes, labels = fn.random_bbox_crop(
            bboxes, labels, device="cpu", aspect_ratio=[0.5, 2.0], thresholds=[0, 0.1, 0.3, 0.5, 0.7, 0.9],
            scaling=[0.3, 1.0], bbox_layout="xyXY", allow_no_crop=True, num_attempts=50)
        decoded = fn.decoders.image_slice(jpegs, crop_begin, crop_size, device="mixed", output_type=types.RGB)
        flip = fn.random.coin_flip(probability=0.5)
        bboxes = fn.bb_flip(bboxes, ltrb=True, horizontal=flip)
        decoded = fn.resize(decoded, resize_x=300, resize_y=300)
        decoded = fn.crop_mirror_normalize(decoded, dtype=types.FLOAT16, output_layout="CHW", mean=mean, std=std,
                                           mirror=flip)
        # Padded to the batch's most boxes (-1 rows), as DALI's iterator hands out dense tensors only.
        return decoded, fn.pad(bboxes, fill_value=-1).gpu(), fn.pad(labels, fill_value=-1).gpu()

    p = pipe(batch_size=batch, num_threads=threads, device_id=torch.cuda.current_device(), seed=0)
    p.build()
    it = DALIGenericIterator(p, ["image", "boxes", "labels"], reader_name="Reader",
                             last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)

    def epoch() -> int:
        return sum(out[0]["image"].shape[0] for out in it)

    def close() -> None:
        nonlocal it, p
        del it, p
        gc.collect()

    return epoch, close


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=6, help="rounds, after one warm-up epoch of each row")
    ap.add_argument("--device", default="auto", help="the headrace rows' Loader(device=)")
    ap.add_argument("--dali-threads", default="", help="also run DALI's SSD pipeline with these thread counts")
    ap.add_argument("--out", default=None, help="JSON results (default examples/results/detection-DATE.json)")
    ap.add_argument("--photos", default=None, help="an .npz of photographs (for machines without scikit-image)")
    args = ap.parse_args()
    if args.photos:  # as benchmark_gpu.py: the GPU machine has no scikit-image
        with np.load(args.photos) as z:
            photos = [z[k] for k in z.files]
        datasets.photographs = lambda: photos

    images, annotations = make_set(ROOT / ".data" / f"bench-detection-{args.images}", args.images)
    cuda = args.device != "cpu" and torch.cuda.is_available()
    rows: dict[str, Any] = {
        "headrace (SSD)": lambda: headrace_epochs(images, annotations, args.batch, args.device, True),
        "headrace (no boxes)": lambda: headrace_epochs(images, annotations, args.batch, args.device, False),
    }
    for threads in filter(None, args.dali_threads.split(",")):
        rows[f"DALI (SSD, {threads} threads)"] = lambda t=int(threads): dali_epochs(images, annotations, args.batch, t)
    results = bench_interleaved(rows, args.epochs)

    device = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"\n{args.images} images, batch {args.batch}, {args.epochs} rounds, {device}\n")
    print(f"| row | images/s | paired ratio to the first | host cores busy |\n| --- | ---: | ---: | ---: |")
    for name, r in results.items():
        print(f"| {name} | {r['images_per_s']:,.0f} | {r['paired_ratio']:.2f} | {r['cores_busy']:.1f} |")
    out = Path(args.out or ROOT / "examples" / "results" / f"detection-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "detection", "device": device, "config": vars(args), "results": results},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
