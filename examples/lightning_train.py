"""PyTorch Lightning training fed by a headrace loader: ``Trainer.fit`` iterates ``loader.sync()``.

    pip install lightning      # Lightning 2.x; not a dependency of headrace
    python examples/lightning_train.py --device cpu --size 64 --epochs 2      # the demo's 1,024 JPEGs
    python examples/lightning_train.py --device cuda --images 8192 --data .data/demo-8192 --batch-size 256 --epochs 3
    python examples/lightning_train.py --device cpu --view      # through DataLoader(torch_dataset(loader))
    python examples/lightning_train.py --device cpu --max-steps 5 --save-every 5   # stop mid-epoch 0 ...
    python examples/lightning_train.py --device cpu --resume .data/lightning/<the .ckpt it wrote>   # ... go on

Lightning takes any iterable as ``train_dataloaders``: ``loader.sync()`` is one (one epoch per
pass, ``len()`` for the progress bar, a pass left early at ``limit_train_batches`` stops that
epoch's pipeline and the next pass starts the next epoch whole). ``--view`` hands Lightning a real
``torch.utils.data.DataLoader`` instead, over ``headrace.torch_dataset(loader)`` with
``batch_size=None`` (headrace batches) and no worker processes (headrace runs its own threads).

``loader.sync()`` has ``state_dict()`` and ``load_state_dict()``, so Lightning keeps the loader's
position in its checkpoints and ``ckpt_path=`` resumes mid-epoch with exactly the batches the
uninterrupted run would have had next (``--save-every``, ``--resume``); a checkpoint at an epoch's
last step resumes at the next epoch. Not with ``--limit-batches``: a checkpoint at the limit says
"mid-epoch" (the loader cannot know Lightning is about to leave that epoch), so the resumed run
finishes the loader's epoch where the uninterrupted one started the next. The DataLoader of
``--view`` has no such state: after a resume it reads the epoch from its start again, for the
steps Lightning had left in it.

The loader is made in the DataModule's ``train_dataloader()``, which Lightning calls in each
process once it has set up the device and, under DDP, the process group: the loader then finds its
rank, world size and GPU itself and reads its own shard. ``loader.sync()`` is entered there, as
its ``with`` block would be, and ``teardown()`` ends it: one loop thread serves every epoch, so the
loader runs ahead into the next epoch between them (the GPU default), as under ``async for``. With
``--device cuda`` batches are already CUDA tensors on this process's GPU, ready on the current
stream, so Lightning's move to the device is a no-op.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

import headrace
from headrace import datasets, ops, readers


def import_lightning():
    """``lightning.pytorch`` (or the older ``pytorch_lightning`` package), or exit saying how to get it."""
    try:
        import lightning.pytorch as L
    except ImportError:
        try:
            import pytorch_lightning as L
        except ImportError:
            sys.exit("this example needs PyTorch Lightning 2.x: pip install lightning "
                     "(headrace itself does not; the other examples run without it)")
    return L


def tiny_net(classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(inplace=True),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, classes),
    )


def build(L, args: argparse.Namespace):
    """The LightningModule and DataModule classes (made here: ``L`` is imported lazily)."""

    class Classifier(L.LightningModule):
        def __init__(self, classes: int, lr: float) -> None:
            super().__init__()
            self.net = tiny_net(classes)
            self.lr = lr
            self.seen = 0

        def training_step(self, batch, batch_idx):
            # A headrace Batch is a Mapping: batch["image"] [B, 3, S, S] float, batch["label"] int64 [B].
            images, labels = batch["image"], batch["label"]
            loss = nn.functional.cross_entropy(self.net(images), labels)
            self.seen += len(labels)
            self.log("loss", loss, prog_bar=True, batch_size=len(labels))
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)

    class HeadraceData(L.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            self.closer = None  # loader.sync() or the torch_dataset view: close() releases the loader

        def train_dataloader(self):
            root, _ = datasets.ensure_image_folder(args.data, count=args.images, classes=args.classes)
            loader = headrace.Loader(readers.files(root, shuffle=True), batch_size=args.batch_size,
                                     pipeline=ops.training(args.size), device=args.device,
                                     num_threads=args.threads, seed=args.seed)
            if args.view:
                view = headrace.torch_dataset(loader)
                self.closer = view
                return torch.utils.data.DataLoader(view, batch_size=None, num_workers=0)
            # Entered as its ``with`` block would (teardown() ends it): one loop thread serves every
            # epoch, so the loader runs ahead between them; a bare loader.sync() starts each cold.
            self.closer = loader.sync().__enter__()
            return self.closer

        def teardown(self, stage: str) -> None:
            # Threads and, on the GPU, the lanes' decoders and streams outlive an epoch: release them.
            if self.closer is not None:
                self.closer.close()
                self.closer = None

    return Classifier(args.classes, args.lr), HeadraceData()



def refuse_cuda_without_gpu(device: str) -> None:
    """Say in one line that a GPU run cannot start here, rather than a traceback from inside the loader."""
    if device.startswith("cuda") and not ops.cuda_available():
        sys.exit(f"--device {device} needs a CUDA GPU with CuPy and nvImageCodec (pip install '.[cuda12]' or "
                 "'.[cuda13]'); none here: run with --device cpu")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Lightning's Trainer.fit fed by a headrace loader.")
    p.add_argument("--data", default=".data/demo", help="data set folder, made once (default: %(default)s)")
    p.add_argument("--images", type=int, default=1024)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=96, help="crop side in pixels")
    p.add_argument("--limit-batches", type=int, default=None, help="Lightning's limit_train_batches")
    p.add_argument("--max-steps", type=int, default=-1, help="stop after this many steps (to try --resume)")
    p.add_argument("--save-every", type=int, default=None, help="a checkpoint every N steps, in --checkpoints")
    p.add_argument("--checkpoints", default=".data/lightning", help="where checkpoints go")
    p.add_argument("--resume", default=None, help="a checkpoint to resume from (Trainer.fit(ckpt_path=))")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="loader threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--view", action="store_true", help="a DataLoader over headrace.torch_dataset(loader)")
    args = p.parse_args(argv)
    L = import_lightning()
    refuse_cuda_without_gpu(args.device)
    if args.device == "auto":
        args.device = "cuda" if ops.cuda_available() else "cpu"
    model, data = build(L, args)
    save = [L.callbacks.ModelCheckpoint(args.checkpoints, every_n_train_steps=args.save_every, save_top_k=-1)
            ] if args.save_every else []
    trainer = L.Trainer(
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        callbacks=save,
        accelerator="gpu" if args.device == "cuda" else "cpu",
        devices=1,
        limit_train_batches=args.limit_batches,
        logger=False,
        enable_checkpointing=bool(save),
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=data, ckpt_path=args.resume)
    print(f"done: steps={trainer.global_step} samples_this_run={model.seen} "
          f"device={args.device} via={'DataLoader(torch_dataset)' if args.view else 'loader.sync()'}")


if __name__ == "__main__":
    main()
