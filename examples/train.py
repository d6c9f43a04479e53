"""A minimal training loop on headrace: a tiny CNN on the demo JPEGs, with checkpoint and resume.

    python examples/train.py --epochs 2 --max-batches 4                  # trains, saves a checkpoint per batch
    python examples/train.py --epochs 2 --max-batches 4 --stop-after 3   # "crashes" after its 3rd batch
    python examples/train.py --epochs 2 --max-batches 4 --resume         # continues exactly where it stopped
    python examples/train.py --epochs 2 --max-batches 4 --mixup 0.2 --cutmix 1.0   # mixed batches, soft labels
    python examples/train.py --epochs 2 --max-batches 4 --aa rand-m9-mstd0.5-inc1  # timm's RandAugment, per sample
    python examples/train.py --epochs 2 --max-batches 4 --aa augmix-m3-w3-d1 --aug-splits 3   # AugMix with its JSD loss

The checkpoint holds the model, the optimizer and ``loader.state_dict()``; a new loader with the
same arguments and ``load_state_dict()`` yields exactly the batches the uninterrupted run would
have yielded next, mid-epoch included. With ``--mixup`` and ``--cutmix`` the batches are mixed
(``ops.MixUp``, ``ops.CutMix``: each applied to half the batches) and the labels are soft; the mixes
are drawn from the loader's seed, so a resume mixes as the uninterrupted run would. ``--aa`` takes
timm's config strings (``ops.training(auto_augment=...)``: RandAugment, AutoAugment, AugMix), drawn
from the seed as well. ``--aug-splits 3`` is timm's: each sample's clean view and two augmented ones
(``splits=3``), trained with the Jensen-Shannon consistency loss of AugMix (timm's ``JsdCrossEntropy``,
written out below). Runs on a CPU in well under a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import headrace
from headrace import datasets, ops, readers


class TinyNet(nn.Module):
    """Three strided convolutions and a linear classifier: enough to watch the loss fall."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def jsd_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, splits: int, alpha: float = 12.0) -> torch.Tensor:
    """AugMix's loss (timm's ``JsdCrossEntropy``): cross-entropy on the clean views, plus ``alpha``
    times the Jensen-Shannon divergence between the views' predictions. ``logits`` are the model's
    on timm's order (all clean views, then each augmented view's block), ``labels`` one a sample."""
    views = logits.chunk(splits)
    loss = nn.functional.cross_entropy(views[0], labels, label_smoothing=0.1)
    probs = [view.softmax(dim=1) for view in views]
    log_mixture = torch.stack(probs).mean(0).clamp(1e-7, 1).log()
    divergence = sum(nn.functional.kl_div(log_mixture, p, reduction="batchmean") for p in probs) / splits
    return loss + alpha * divergence


def make_loader(args: argparse.Namespace) -> headrace.Loader:
    root, _ = datasets.ensure_image_folder(args.data, count=args.images, classes=args.classes)
    reader = readers.files(root, shuffle=True)
    if args.max_batches:
        # A short epoch: a fixed random subset of max_batches * batch_size files. Every epoch is
        # whole, so the loader's epoch count, len() and resume work as in a full run.
        pick = np.sort(np.random.default_rng(0).permutation(len(reader.paths))[: args.max_batches * args.batch_size])
        reader = readers.files([reader.paths[i] for i in pick], [reader.labels[i] for i in pick], shuffle=True)
    mixing = []
    if args.mixup:
        mixing.append(ops.MixUp(args.mixup, num_classes=args.classes, p=0.5))
    if args.cutmix:
        mixing.append(ops.CutMix(args.cutmix, num_classes=args.classes, p=0.5))
    pipeline = ops.Pipeline([*ops.training(args.size, auto_augment=args.aa).ops, *mixing], splits=args.aug_splits)
    return headrace.Loader(reader, batch_size=args.batch_size, pipeline=pipeline, num_threads=args.threads,
                           seed=args.seed)


def save(path: Path, model: nn.Module, opt: torch.optim.Optimizer, loader: headrace.Loader, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "loader": loader.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)  # a crash while saving leaves the previous checkpoint intact


async def train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    loader = make_loader(args)
    model = TinyNet(args.classes)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ckpt = Path(args.checkpoint)
    step = 0
    if args.resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        loader.load_state_dict(state["loader"])
        step = state["step"]
        print(f"resumed from {ckpt}: step {step}, epoch {loader.epoch}, batch {state['loader']['batches']}")
    ckpt.parent.mkdir(parents=True, exist_ok=True)

    def train_step(images: torch.Tensor, labels: torch.Tensor) -> float:
        model.train()
        if args.aug_splits > 1:  # [B, splits, C, H, W]: timm's order is a view of it, no copy
            loss = jsd_cross_entropy(model(images.transpose(0, 1).flatten(0, 1)), labels, args.aug_splits)
        else:
            loss = nn.functional.cross_entropy(model(images), labels)  # class indices, or mixed soft labels
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    print(f"{len(loader.reader)} images per epoch, {len(loader)} batches of {args.batch_size}")
    async with loader:  # closes threads and files at the end, also on an error or a stop
        for epoch in range(loader.epoch, args.epochs):  # after a resume: the epoch it stopped in
            start, seen = time.perf_counter(), 0
            async for batch in loader:
                # The step blocks for a while; in a thread it leaves the event loop free to keep
                # the loader's reads and decodes flowing meanwhile (torch releases the GIL).
                loss = await asyncio.to_thread(train_step, batch["image"], batch["label"])
                step += 1
                seen += len(batch["label"])
                save(ckpt, model, opt, loader, step)
                print(f"epoch {batch.epoch} batch {batch.index}: loss {loss:.3f}")
                if step == args.stop_after:
                    print(f"stopping after step {step} (as if the job were killed); resume with --resume")
                    return
            print(f"epoch {epoch} done: {seen / (time.perf_counter() - start):.0f} images/s including training")
    print(f"finished {args.epochs} epochs; checkpoint in {ckpt}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Train a tiny CNN on the demo JPEGs with headrace.")
    p.add_argument("--data", default=".data/demo", help="data set folder, made once (default: %(default)s)")
    p.add_argument("--images", type=int, default=1024, help="images in the data set (default: %(default)s)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-batches", type=int, default=None, help="batches per epoch (a subset of the data set)")
    p.add_argument("--size", type=int, default=224, help="crop side in pixels (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="loader threads (default: all cores)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=".data/train/checkpoint.pt")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint if it exists")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (to try --resume)")
    p.add_argument("--mixup", type=float, default=0.0, help="MixUp's alpha, on half the batches (0: none)")
    p.add_argument("--cutmix", type=float, default=0.0, help="CutMix's alpha, on half the batches (0: none)")
    p.add_argument("--aa", default=None, help="timm's auto_augment config, e.g. rand-m9-mstd0.5-inc1 or "
                   "augmix-m3-w3-d1 (default: none)")
    p.add_argument("--aug-splits", type=int, default=1, help="views a sample for AugMix's JSD loss, timm's "
                   "--aug-splits (default: %(default)s, none)")
    asyncio.run(train(p.parse_args(argv)))


if __name__ == "__main__":
    main()
