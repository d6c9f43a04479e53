"""A GPU augmentation in plain torch as a batch stage: random brightness, contrast and cutout per sample.

    python examples/gpu_augment.py --device cpu --size 96 --check     # runs on a CPU too (the demo's 1,024 JPEGs)
    python examples/gpu_augment.py --device cuda --images 8192 --data .data/demo-8192 --batch-size 256

``ops.training(size)`` decodes, crops, flips and normalizes; an ``ops.MapBatch`` after it gets each
batch as a dict (``image`` float [B, 3, S, S], ``label`` [B]) and returns it augmented. Its
``rng`` parameter is a ``numpy.random.Generator`` keyed by (seed, epoch, the stage's place, the
batch's index): the per-sample parameters drawn from it are the same for a seed whatever the
thread count or resume point (``--check`` runs epoch 0 again with one thread and compares).

On the GPU path the stage runs in the lane that made the batch, right after its kernel, with the
lane's CUDA stream as torch's current stream: the torch calls below queue kernels and never wait
for the GPU. The parameters go up in one copy from pinned memory, since a
copy from ordinary (pageable) memory would make the host wait for the stream. kornia's
augmentations work the same way (pass them the batch's tensors inside the function).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

import numpy as np
import torch

import headrace
from headrace import datasets, ops, readers


def make_augment(brightness: float, contrast: float, cutout: float):
    """The stage: per sample a brightness shift in [-b, b], a contrast factor in [1 - c, 1 + c] about
    the image's mean, and a square of side ``cutout`` x the image side set to 0 (the data set's mean,
    after Normalize) at a random place."""

    def augment(batch: dict, rng: np.random.Generator) -> dict:
        images = batch["image"]  # [B, C, H, W], normalized, on the loader's device
        b, _, h, w = images.shape
        side_y, side_x = max(1, round(h * cutout)), max(1, round(w * cutout))
        params = np.stack([
            rng.uniform(-brightness, brightness, b),
            rng.uniform(1 - contrast, 1 + contrast, b),
            rng.integers(0, h - side_y + 1, b),  # the cutout's top row
            rng.integers(0, w - side_x + 1, b),  # and its left column
        ], axis=1).astype(np.float32)
        p = to_device(params, images.device)
        shift, factor = p[:, 0, None, None, None], p[:, 1, None, None, None]
        top, left = p[:, 2, None, None].long(), p[:, 3, None, None].long()
        mean = images.mean(dim=(1, 2, 3), keepdim=True)
        out = (images - mean) * factor.to(images.dtype) + mean + shift.to(images.dtype)
        rows = torch.arange(h, device=images.device)[None, :, None]
        cols = torch.arange(w, device=images.device)[None, None, :]
        hole = (rows >= top) & (rows < top + side_y) & (cols >= left) & (cols < left + side_x)  # [B, H, W]
        batch["image"] = out.masked_fill(hole[:, None], 0.0)
        return batch

    return augment


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` on ``device`` without the host waiting: on CUDA through pinned memory, non-blocking
    (torch keeps the pinned buffer until the copy on the current stream is done)."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def make_loader(args: argparse.Namespace, root, *, threads: int | None) -> headrace.Loader:
    augment = ops.MapBatch(make_augment(args.brightness, args.contrast, args.cutout))
    pipeline = ops.Pipeline([*ops.training(args.size).ops, augment])  # the training ops, then the stage
    return headrace.Loader(readers.files(root, shuffle=True), batch_size=args.batch_size, pipeline=pipeline,
                           device=args.device, num_threads=threads, seed=args.seed)


async def epoch_images(loader: headrace.Loader) -> dict[str, torch.Tensor]:
    """One epoch's images by sample key, on the CPU."""
    out = {}
    async for batch in loader:
        for key, image in zip(batch.sample_keys, batch["image"].cpu()):
            out[key] = image
    return out


async def run(args: argparse.Namespace) -> None:
    root, _ = datasets.ensure_image_folder(args.data, count=args.images, classes=args.classes)
    loader = make_loader(args, root, threads=args.threads)
    samples = batches = 0
    holes = torch.zeros(())
    first_epoch: dict[str, torch.Tensor] = {}
    async with loader:
        for epoch in range(args.epochs):
            start, seen = time.perf_counter(), 0
            hole = None
            async for batch in loader:
                images = batch["image"]
                # The cutout's share of pixels, summed on the device: no host sync per batch.
                share = (images == 0).all(dim=1).float().mean() * len(images)
                hole = share if hole is None else hole + share
                if epoch == 0 and args.check:
                    first_epoch.update(zip(batch.sample_keys, images.cpu()))
                seen += len(images)
                batches += 1
            samples += seen
            holes = holes + hole.cpu()
            elapsed = time.perf_counter() - start
            print(f"epoch {epoch}: {seen} images, {seen / elapsed:,.0f} images/s, batch {tuple(images.shape)} "
                  f"{images.dtype} on {images.device}")
        device = images.device
    side = max(1, round(args.size * args.cutout))
    print(f"cutout covered {holes.item() / samples:.1%} of the pixels (a {side}x{side} square in "
          f"{args.size}x{args.size}: {(side / args.size) ** 2:.1%})")
    check = "not run (--check)"
    if args.check:
        other = 1 if (args.threads or 2) != 1 else 2
        async with make_loader(args, root, threads=other) as again:
            second = await epoch_images(again)
        same = first_epoch.keys() == second.keys() and all(torch.equal(first_epoch[k], second[k]) for k in second)
        check = "yes" if same else "NO"
        print(f"epoch 0 again with {other} thread(s): {'the same images' if same else 'DIFFERENT images'}")
        if not same:
            raise SystemExit(1)
    print(f"done: epochs={args.epochs} samples={samples} batches={batches} device={device.type} "
          f"image={tuple(images.shape)} deterministic={check}")



def refuse_cuda_without_gpu(device: str) -> None:
    """Say in one line that a GPU run cannot start here, rather than a traceback from inside the loader."""
    if device.startswith("cuda") and not ops.cuda_available():
        sys.exit(f"--device {device} needs a CUDA GPU with CuPy and nvImageCodec (pip install '.[cuda12]' or "
                 "'.[cuda13]'); none here: run with --device cpu")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="A plain-torch GPU augmentation as a headrace batch stage.")
    p.add_argument("--data", default=".data/demo", help="data set folder, made once (default: %(default)s)")
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=160, help="crop side in pixels")
    p.add_argument("--brightness", type=float, default=0.4, help="shift range, in normalized units")
    p.add_argument("--contrast", type=float, default=0.4)
    p.add_argument("--cutout", type=float, default=0.35, help="the cutout square's side, a share of the image's")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="loader threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="run epoch 0 again with another thread count and compare")
    args = p.parse_args(argv)
    refuse_cuda_without_gpu(args.device)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
