"""Keep your torch ``Dataset``, gain headrace's pipeline: a map-style Dataset read by ``readers.sequence``.

    python examples/torch_dataset.py --device cpu --size 96 --check-resume    # the demo's 1,024 JPEGs
    python examples/torch_dataset.py --device cpu --items bytes      # items are (encoded bytes, label)
    python examples/torch_dataset.py --device cuda --images 8192 --data .data/demo-8192 --batch-size 256   # decoded on the GPU

``LabelledImages`` is the kind of Dataset a project already has: a table of (image file, class)
rows, as a CSV or torchvision's ``ImageFolder.samples`` keep them. For a DataLoader its
``__getitem__`` would open, decode and transform the image; for headrace it returns the encoded
image instead, as its path (``--items paths``) or its bytes (``--items bytes``), with the label.
``readers.sequence(dataset)`` calls ``__getitem__`` in its I/O threads, a chunk of indices at a
time, and the loader decodes and transforms whole batches (on the GPU with ``--device cuda``:
nvImageCodec and one kernel a batch). torchvision's ``ImageFolder(root).samples`` is already such a
list of ``(path, class)`` pairs: ``readers.sequence(folder.samples)`` works as it is.

Shuffle, sharding and resume are the files reader's, exact: ``--check-resume`` stops a second
loader after two batches of epoch 0, resumes a third from its ``state_dict()``, and checks that
the two together gave exactly the first loader's batches.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import torch

import headrace
from headrace import datasets, ops, readers


class LabelledImages(torch.utils.data.Dataset):
    """A map-style Dataset over ``root/<class>/<file>.jpg``: ``(path, label)`` or ``(bytes, label)``."""

    def __init__(self, root: str | Path, items: str = "paths") -> None:
        root = Path(root)
        classes = sorted(d.name for d in root.iterdir() if d.is_dir())
        self.rows = [(str(path), label) for label, name in enumerate(classes)
                     for path in sorted((root / name).glob("*.jpg"))]
        self.items = items

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[str | bytes, int]:
        path, label = self.rows[index]
        if self.items == "bytes":
            return Path(path).read_bytes(), label  # runs in headrace's I/O threads: file reads release the GIL
        return path, label


def make_loader(args: argparse.Namespace, dataset: LabelledImages) -> headrace.Loader:
    reader = readers.sequence(dataset, shuffle=True)
    return headrace.Loader(reader, batch_size=args.batch_size, pipeline=ops.training(args.size),
                           device=args.device, num_threads=args.threads, seed=args.seed)


async def check_resume(args: argparse.Namespace, dataset: LabelledImages, expected: list[list[str]]) -> bool:
    """Epoch 0 read in two loaders (stopped after 2 batches, then resumed from the state) is ``expected``."""
    first = make_loader(args, dataset)
    got = []
    async with first:
        async for batch in first:
            got.append(batch.sample_keys)
            if len(got) == 2:
                break
        state = first.state_dict()
    second = make_loader(args, dataset)
    second.load_state_dict(state)
    async with second:
        got += [batch.sample_keys async for batch in second]
    return got == expected


async def run(args: argparse.Namespace) -> None:
    root, _ = datasets.ensure_image_folder(args.data, count=args.images, classes=args.classes)
    dataset = LabelledImages(root, items=args.items)
    # The label each row should have: path items are named by their path, bytes items by their index.
    by_path = dict(dataset.rows)
    loader = make_loader(args, dataset)
    print(f"{type(dataset).__name__}: {len(dataset)} items of ({'path' if args.items == 'paths' else 'encoded bytes'}, label); "
          f"{len(loader)} batches of {args.batch_size} an epoch")
    samples = batches = 0
    epoch0: list[list[str]] = []
    async with loader:
        for epoch in range(args.epochs):
            start, keys = time.perf_counter(), []
            async for batch in loader:
                labels = batch["label"].tolist()
                for key, source, label in zip(batch.sample_keys, batch.sources, labels):
                    want = dataset.rows[int(key)][1] if args.items == "bytes" else by_path[source]
                    if label != want:
                        raise SystemExit(f"{source}: label {label}, the Dataset says {want}")
                keys += batch.sample_keys
                if epoch == 0:
                    epoch0.append(batch.sample_keys)
                batches += 1
            if sorted(keys) != sorted(set(keys)) or len(keys) != len(dataset):
                raise SystemExit(f"epoch {epoch}: {len(keys)} samples, {len(set(keys))} distinct, of {len(dataset)}")
            samples += len(keys)
            image = batch["image"]
            rate = len(keys) / (time.perf_counter() - start)
            print(f"epoch {epoch}: each of the {len(keys)} items once, {rate:,.0f} images/s, "
                  f"batch {tuple(image.shape)} {image.dtype} on {image.device}")
    resumed = "not run (--check-resume)"
    if args.check_resume:
        same = await check_resume(args, dataset, epoch0)
        resumed = "exact" if same else "DIFFERENT"
        print(f"epoch 0 stopped after 2 batches and resumed from state_dict(): {resumed}")
        if not same:
            raise SystemExit(1)
    print(f"done: epochs={args.epochs} samples={samples} batches={batches} items={args.items} "
          f"device={image.device.type} image={tuple(image.shape)} resume={resumed}")



def refuse_cuda_without_gpu(device: str) -> None:
    """Say in one line that a GPU run cannot start here, rather than a traceback from inside the loader."""
    if device.startswith("cuda") and not ops.cuda_available():
        sys.exit(f"--device {device} needs a CUDA GPU with CuPy and nvImageCodec (pip install '.[cuda12]' or "
                 "'.[cuda13]'); none here: run with --device cpu")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="A torch map-style Dataset as a headrace source.")
    p.add_argument("--data", default=".data/demo", help="data set folder, made once (default: %(default)s)")
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--items", default="paths", choices=["paths", "bytes"], help="what __getitem__ returns with the label")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=160, help="crop side in pixels")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="loader threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-resume", action="store_true", help="stop epoch 0 early, resume it, compare")
    args = p.parse_args(argv)
    refuse_cuda_without_gpu(args.device)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
