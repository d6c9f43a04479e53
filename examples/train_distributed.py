"""Data-parallel training on many GPUs (or CPU processes) with headrace, started by torchrun.

    # 2 CPU processes (gloo), a 256-image demo set, coverage checked every epoch:
    torchrun --standalone --nproc_per_node=2 examples/train_distributed.py --device cpu \\
        --data .data/dist-demo --images 256 --epochs 2 --check-coverage --out /tmp/dist.json
    # one node, 8 GPUs (nccl), an existing class-per-folder tree:
    torchrun --standalone --nproc_per_node=8 examples/train_distributed.py --data /data/imagenet/train
    # crash and resume, also on another number of processes:
    torchrun --nproc_per_node=4 examples/train_distributed.py ... --checkpoint ck.pt --stop-after 5
    torchrun --nproc_per_node=2 examples/train_distributed.py ... --checkpoint ck.pt --resume

The loader code is the same as on one GPU: ``headrace.Loader`` takes its rank and world size from
the process group, shards the reader (``equal="pad"``: every rank the same number of batches),
and puts its tensors on ``cuda:<LOCAL_RANK>``. The model is wrapped in DistributedDataParallel
(nccl on GPUs, gloo on CPUs). Rank 0 saves a checkpoint (model, optimizer, ``loader.state_dict()``,
which every rank holds alike after a step); ``--resume`` on any number of processes continues the
epoch with what it has not read yet. ``--check-coverage`` gathers every rank's sample keys
(``all_gather_object``) and checks each epoch read every sample once, padding accounted for.
At the end rank 0 prints images/s per rank and in total, and ``--out`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import headrace
from headrace import datasets, ops, readers
from train import TinyNet  # examples/train.py: the same small CNN (torchrun runs this from examples/)


def make_model(name: str, classes: int) -> tuple[nn.Module | None, str]:
    if name == "none":
        return None, "none"
    if name == "tiny":
        return TinyNet(classes), "tiny"
    try:
        import torchvision
    except ImportError:
        if name != "auto":
            sys.exit(f"--model {name} needs torchvision; use --model tiny or auto")
        return TinyNet(classes), "tiny (torchvision missing)"
    name = "resnet18" if name == "auto" else name
    return getattr(torchvision.models, name)(weights=None, num_classes=classes), name


def make_reader(args: argparse.Namespace, rank: int) -> tuple[readers.Reader, int]:
    """The whole data set's reader (the loader shards it) and its sample count. Rank 0 makes or packs
    the data once; the others wait at a barrier."""
    root = Path(args.data)
    if rank == 0:
        if args.images:
            datasets.ensure_image_folder(root, count=args.images, classes=args.classes,
                                         workers=os.cpu_count())
        if args.reader != "files":
            packed = root.with_name(root.name + f".{args.reader}")
            if not packed.exists():
                readers.pack(root, packed, format=args.reader, shard_count=args.shard_count)
    dist.barrier()
    if args.reader == "files":
        reader = readers.files(root, shuffle=True, io_threads=args.io_threads)
    elif args.reader == "lmdb":
        reader = readers.lmdb(root.with_name(root.name + ".lmdb"), shuffle=True, io_threads=args.io_threads)
    else:
        reader = readers.webdataset(root.with_name(root.name + ".webdataset"), shuffle=True)
    return reader, len(reader)


def check_coverage(keys: list[str], total: int, world: int, per_rank: int, whole: bool, equal: str) -> dict[str, Any]:
    """Every sample of the epoch once, but for the ``equal`` policy: with "pad" the repeats are
    exactly its padding, with "drop" nothing repeats and only its cut is missing.

    ``whole``: the epoch ran on this world size from its start, so padding and cut are known exactly
    (``|world * per_rank - total|``); after a resume on another world size they are below ``world``.
    """
    counts = collections.Counter(keys)
    repeats = len(keys) - len(counts)
    gap = abs(world * per_rank - total)
    if equal == "pad":
        expected_missing, expected_repeats = 0, gap if whole else f"<= {world - 1}"
        ok = len(counts) == total and max(counts.values()) <= 2 and (
            repeats == gap if whole else repeats <= world - 1)
    else:
        expected_missing, expected_repeats = gap if whole else f"<= {world - 1}", 0
        missing = total - len(counts)
        ok = repeats == 0 and (missing == gap if whole else 0 <= missing <= world - 1)
    return {"seen": len(keys), "distinct": len(counts), "samples": total, "repeats": repeats,
            "expected_repeats": expected_repeats, "expected_missing": expected_missing, "ok": ok}


def describe(row: dict[str, Any], batches: int) -> str:
    per_rank = " ".join(f"{v:.0f}" for v in row["images_per_s_per_rank"])
    text = (f"epoch {row['epoch']}: {row['images_per_s_total']:.0f} images/s total, per rank [{per_rank}], "
            f"{batches} batches on rank 0")
    if row["loss"] is not None:
        text += f", loss {row['loss']:.3f}"
    cover = row.get("coverage")
    if cover:
        text += (f"; coverage {'OK' if cover['ok'] else 'FAILED'} ({cover['distinct']}/{cover['samples']} samples, "
                 f"{cover['repeats']} repeats, expected {cover['expected_repeats']}, "
                 f"expected missing {cover['expected_missing']})")
    return text


def gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


async def train(args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    compute = torch.device(f"cuda:{local}") if cuda else torch.device("cpu")
    torch.manual_seed(args.seed)
    reader, total = make_reader(args, rank)
    loader = headrace.Loader(reader, batch_size=args.batch_size, pipeline=ops.training(args.size, dtype=args.dtype),
                             device=args.device, num_threads=args.threads, seed=args.seed, equal=args.equal,
                             lanes=args.lanes, hw_load=args.hw_load if args.hw_load == "adaptive" else float(args.hw_load))
    # The model's outputs follow the data (a folder tree made elsewhere may have other classes).
    classes = len(getattr(reader, "classes", ())) or args.classes
    model, model_name = make_model(args.model, classes)
    ddp: nn.Module | None = None
    opt = None
    if model is not None:
        model = model.to(compute, memory_format=torch.channels_last if cuda else torch.contiguous_format)
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=[local] if cuda else None)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    step, seen_before, resumed = 0, [], None
    if args.resume and ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        if model is not None and opt is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
        loader.load_state_dict(state["loader"])
        step, seen_before = state["step"], state.get("seen", [])
        resumed = {"from_world": state["loader"]["world"], "epoch": state["loader"]["epoch"],
                   "position": state["loader"]["position"], "step": step}
        if rank == 0:
            print(f"resumed from {ckpt}: step {step}, epoch {loader.epoch}, saved on {resumed['from_world']} "
                  f"processes, now {world}", flush=True)
    if rank == 0:
        print(f"{world} processes, backend {dist.get_backend()}, loader device {loader.device}, model {model_name}; "
              f"{total} samples, {len(loader.reader)} per rank, {len(loader)} batches of {args.batch_size} per epoch",
              flush=True)

    def train_step(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if cuda:  # the current device is per thread; this runs in a worker thread
            torch.cuda.set_device(compute)
        images = images.to(compute, non_blocking=True)
        labels = labels.to(compute, non_blocking=True)
        if ddp is None:  # loader only: a tiny all-reduce keeps the ranks in step, as a model's would
            flag = torch.ones(1, device=compute)
            dist.all_reduce(flag)
            return flag
        assert opt is not None
        if cuda:
            images = images.contiguous(memory_format=torch.channels_last)
        if not args.amp:  # float16 batches meet float32 weights only under autocast
            images = images.float()
        with torch.autocast(compute.type, dtype=torch.bfloat16, enabled=args.amp):
            loss = nn.functional.cross_entropy(ddp(images), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    def save(epoch_keys: list[str]) -> None:
        seen = seen_before + [k for part in gather(epoch_keys) for k in part] if args.check_coverage else []
        if rank == 0 and ckpt is not None:
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict() if model is not None else None,
                        "optim": opt.state_dict() if opt is not None else None,
                        "loader": loader.state_dict(), "step": step, "seen": seen}, tmp)
            os.replace(tmp, ckpt)  # a crash while saving leaves the previous checkpoint intact
        dist.barrier()

    epochs: list[dict[str, Any]] = []
    stopped = False
    async with loader:
        for epoch in range(loader.epoch, args.epochs):
            whole = not loader.state_dict()["history"]  # this epoch ran on this world size from its start
            keys: list[str] = []
            samples, loss_sum, batches = 0, torch.zeros((), device=compute), 0
            dist.barrier()
            start = time.perf_counter()
            async for batch in loader:
                # The step runs in a thread: the event loop keeps reading and decoding meanwhile.
                loss = await asyncio.to_thread(train_step, batch["image"], batch["label"])
                loss_sum += loss.sum()
                step += 1
                batches += 1
                samples += batch.size
                if args.check_coverage:
                    keys.extend(batch.sample_keys)
                if ckpt is not None and (step % args.save_every == 0 or step == args.stop_after):
                    save(keys)
                if step == args.stop_after:
                    stopped = True
                    break
            if cuda:
                torch.cuda.synchronize(compute)
            seconds = time.perf_counter() - start
            rates = gather({"rank": rank, "samples": samples, "batches": batches, "seconds": seconds})
            row: dict[str, Any] = {
                "epoch": epoch, "ranks": rates,
                "images_per_s_per_rank": [r["samples"] / r["seconds"] for r in rates],
                "images_per_s_total": sum(r["samples"] for r in rates) / max(r["seconds"] for r in rates),
                "loss": (loss_sum / max(1, batches)).item() if model is not None else None,
            }
            if args.check_coverage and not stopped:
                everything = seen_before + [k for part in gather(keys) for k in part]
                row["coverage"] = check_coverage(everything, total, world, len(loader.reader), whole, args.equal)
                seen_before = []
            if rank == 0:
                print(describe(row, batches), flush=True)
            epochs.append(row)
            if stopped:
                if rank == 0:
                    print(f"stopped after step {step} (as if the job were killed); resume with --resume", flush=True)
                break
    later = [e["images_per_s_total"] for e in epochs[1:]] or [e["images_per_s_total"] for e in epochs]
    later_rank = [statistics.median(e["images_per_s_per_rank"]) for e in (epochs[1:] or epochs)]
    return {
        "world": world, "backend": dist.get_backend(), "loader_device": loader.device,
        "loader_devices": gather(loader.device), "model": model_name,
        "samples": total, "per_rank": len(loader.reader), "batch_size": args.batch_size, "size": args.size,
        "reader": args.reader, "equal": args.equal, "threads": loader.num_threads, "lanes": args.lanes, "hw_load": args.hw_load, "resumed": resumed,
        "stopped_after_step": step if stopped else None, "epochs": epochs,
        "images_per_s_total_median": statistics.median(later) if epochs else None,
        "images_per_s_per_rank_median": statistics.median(later_rank) if epochs else None,
        "coverage_ok": all(e["coverage"]["ok"] for e in checked) if (checked := [e for e in epochs if "coverage" in e])
        else None,
    }



def refuse_cuda_without_gpu(device: str) -> None:
    """Say in one line that a GPU run cannot start here, rather than a traceback from inside the loader."""
    if device.startswith("cuda") and not ops.cuda_available():
        sys.exit(f"--device {device} needs a CUDA GPU with CuPy and nvImageCodec (pip install '.[cuda12]' or "
                 "'.[cuda13]'); none here: run with --device cpu")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Data-parallel training with headrace under torchrun.")
    p.add_argument("--data", default=".data/dist-demo", help="class-per-folder image tree (default: %(default)s)")
    p.add_argument("--images", type=int, default=0,
                   help="make (once) a demo set of this many JPEGs in --data; 0: use --data as it is")
    p.add_argument("--classes", type=int, default=10, help="classes of the data set --images makes")
    p.add_argument("--reader", choices=["files", "webdataset", "lmdb"], default="files",
                   help="webdataset/lmdb: --data packed once beside it (DATA.webdataset, DATA.lmdb)")
    p.add_argument("--shard-count", type=int, default=1024, help="samples per tar shard when packing")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--size", type=int, default=224, help="crop side in pixels")
    p.add_argument("--dtype", default="float16", choices=["float16", "float32"],
                   help="batch dtype (the GPU benchmark's pipeline: float16 NCHW)")
    p.add_argument("--device", default="auto", help="loader device: auto, cpu or cuda (auto/cuda = cuda:LOCAL_RANK)")
    p.add_argument("--model", default="auto", choices=["auto", "tiny", "resnet18", "resnet50", "none"],
                   help="auto: resnet18 with torchvision, else a tiny CNN; none: the loader alone")
    p.add_argument("--amp", action="store_true", help="bf16 autocast for the model")
    p.add_argument("--equal", default="pad", choices=["pad", "drop"], help="how ranks get equal batch counts")
    p.add_argument("--threads", type=int, default=None, help="loader CPU threads per rank (default: cores / ranks)")
    p.add_argument("--io-threads", type=int, default=2)
    p.add_argument("--lanes", type=int, default=4, help="GPU lanes per rank (the Loader's default)")
    p.add_argument("--hw-load", default="0.76", help="share of each batch's bytes for the hardware JPEG decoder, or 'adaptive'")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default=None, help="checkpoint file (rank 0 writes it)")
    p.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint, on any number of processes")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this many steps (to try --resume)")
    p.add_argument("--check-coverage", action="store_true", help="gather sample keys; check each epoch saw all once")
    p.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    args = p.parse_args(argv)
    refuse_cuda_without_gpu(args.device)

    cuda = args.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10))
    if args.threads is None:  # the node's cores shared by its ranks
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        args.threads = max(1, (os.cpu_count() or 1) // local_world)
    try:
        result = asyncio.run(train(args))
        # Every rank done with gloo's sockets before any tears them down: a rank still in a last
        # collective when its peer's destroy_process_group closed the connection aborted (SIGABRT),
        # once in many CPU runs, after its training had finished.
        dist.barrier()
        if dist.get_rank() == 0:
            summary = (f"{result['world']} x {result['loader_device']}: median {result['images_per_s_total_median']:.0f} "
                       f"images/s total, {result['images_per_s_per_rank_median']:.0f} per rank")
            print(summary + ("" if result["coverage_ok"] is None else
                             f"; coverage {'OK' if result['coverage_ok'] else 'FAILED'}"), flush=True)
            if args.out:
                result["host"] = {"node": platform.node(), "python": platform.python_version(),
                                  "torch": torch.__version__, "headrace": headrace.__version__,
                                  "cpus": os.cpu_count(), "gpus": torch.cuda.device_count(),
                                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                                  "argv": sys.argv[1:], "date": datetime.date.today().isoformat()}
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        if result["coverage_ok"] is False:
            sys.exit(1)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
