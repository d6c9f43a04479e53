"""GPU benchmark: headrace against the loaders users would otherwise pick, one process, same files.

    python examples/benchmark_gpu.py --images 16384 --batch 256

Rows (training pipeline: decode → random resized crop 224 → flip → normalize → float16 NCHW on
the GPU, unless the row says otherwise):
  headrace (train)           headrace on the GPU path
  headrace (validation)      resize shorter side 256 → centre crop 224 → normalize, float16
  headrace (own sizes)       --rows sizes: resize shorter side 256 → normalize, float16, no crop:
                             a list of tensors a batch (whole images decoded)
  DataLoader + PIL + tv v2   torch DataLoader, workers = cores, Pillow + torchvision v2, then .cuda()
  torchvision decode_jpeg    decode_jpeg(device="cuda") batched, torchvision v2 transforms per image
  nvImageCodec decode only   whole images, one synchronous decode call per batch, no transforms
  DALI (--dali-threads 4,8)  NVIDIA DALI: file reader, mixed decode (image_random_crop; validation:
                             whole image), resize, crop_mirror_normalize float16 NCHW, DALIGenericIterator;
                             --dali-rows randaug,trivial,autoaug: its train pipeline with DALI's own
                             auto_aug policy on the 224 crop, the peer of train_randaug and the others;
                             affine: fn.transforms + fn.warp_affine, the peer of train_affine
  --rows train_stage         the train row with a trivial ops.MapBatch added (what a user stage costs)
  --rows train_mix           the train row with RandomErasing(0.25), MixUp(0.2) and CutMix(1.0, p=0.5) after it
                             (train_mix_side: off the lane; train_erase, train_mixup, train_cutmix: each alone;
                             train_gpuwork: six in-place passes over the images, GPU time without host work)
  --rows train_randaug       the train row with RandAugment() (2 ops, magnitude 9) before Normalize
                             (train_trivial: TrivialAugmentWide(); train_autoaug: AutoAugment(); train_timm:
                             TimmRandAugment("rand-m9-mstd0.5-inc1"); train_affine: RandomAffine(15, (0.1, 0.1),
                             (0.9, 1.1), 10); train_augmix: AugMix(); train_timm_augmix:
                             TimmAugMix("augmix-m5-w4-d2"); train_timm_autoaug: TimmAutoAugment(
                             "original-mstd0.5"); train_timm_augmix_jsd: the train row with
                             auto_augment="augmix-m5-w4-d2", splits=3 (timm's --aug-splits 3: a clean
                             and two augmented views a sample, images/s counting samples);
                             dataloader_randaug, dataloader_augmix:
                             the DataLoader row with torchvision's RandAugment() or AugMix() in its workers,
                             the usual way to get them)
  --rows train_noop          the train row with an ops.MapBatch that returns the batch as it is
  --rows train_lookup        the train row with an async ops.Map awaiting 1 ms per sample, concurrency=64
Each row: one warm-up epoch, then the median of --epochs epochs. headrace rows also report the
cores busy (process CPU time / wall), the event loop's own busy share (the loop thread's CPU
time / wall) and peak GPU memory. Prints a table; writes JSON (--out).

For a small difference between headrace rows (a stage's cost), ``--interleave`` keeps their loaders
(and DALI's pipelines, with --dali-threads) side by side and runs one epoch of each in turn for
--epochs rounds, reporting each row's median, its median paired ratio to the first row and its host
cores per 1,000 images/s; whole runs of one row moved 10-25% within an H100 lease:

    python examples/benchmark_gpu.py --images 16384 --epochs 12 --interleave --rows train,train_noop,train_stage
    python examples/benchmark_gpu.py --images 16384 --epochs 8 --interleave --rows train,val --dali-threads 4,8,12,16 --repeat 2
    python examples/benchmark_gpu.py --images 16384 --epochs 6 --interleave --rows train,train_randaug,train_autoaug \
        --dali-threads 8,12 --dali-rows train,randaug,autoaug
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import itertools
import json
import os
import platform
import statistics
import sys
import time
from typing import Any
from pathlib import Path

import torch

import headrace
from headrace import datasets, ops, readers
from headrace._loop import new_event_loop  # uvloop when installed, as the loader uses
from headrace._errors import HW_LOAD  # the Loader's default share for the hardware JPEG engine

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _thread_cpu import ThreadCpu  # noqa: E402


def _files(root: Path) -> list[tuple[str, int]]:
    classes = sorted(d.name for d in root.iterdir() if d.is_dir())
    return [(str(p), c) for c, name in enumerate(classes) for p in sorted((root / name).glob("*.jpg"))]


class _GcPauses:
    """Python's cyclic garbage collections during the timed epochs: how many, and how long the
    process stood still for them (every thread that needs the GIL waits)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.seconds[info["generation"]] += time.perf_counter() - self._start


def _timed_epochs(run_epoch, epochs: int) -> dict:
    run_epoch()  # warm-up
    rates, cpu, loop_share = [], [], []
    pauses = _GcPauses()
    gc.callbacks.append(pauses)
    threads = ThreadCpu()
    threads.start()
    try:
        for _ in range(epochs):
            torch.cuda.synchronize()
            wall0, cpu0, thr0 = time.perf_counter(), time.process_time(), time.thread_time()
            n = run_epoch()
            torch.cuda.synchronize()
            wall = time.perf_counter() - wall0
            rates.append(n / wall)
            cpu.append((time.process_time() - cpu0) / wall)
            loop_share.append((time.thread_time() - thr0) / wall)
    finally:
        gc.callbacks.remove(pauses)
    return {"images_per_s": statistics.median(rates), "runs": rates, "cores_busy": statistics.median(cpu),
            "cores_by_thread": threads.stop(), "kernel_by_thread": threads.kernel, "process_counters": threads.counters,
            "main_thread_busy": statistics.median(loop_share), "gc_collections": pauses.count,
            "gc_seconds": pauses.seconds}


IO_THREADS = 2  # the files reader's I/O threads (--io-threads)


def bench_reader(root: Path, epochs: int) -> dict:
    """The files reader alone: how fast the bytes arrive, with nothing decoded."""
    loop = new_event_loop()
    reader = readers.files(root, shuffle=True, io_threads=IO_THREADS)

    async def epoch_async(e: int) -> int:
        n = 0
        async for chunk in reader.read(e):
            n += len(chunk)
        return n

    counter = iter(range(1_000_000))
    try:
        return _timed_epochs(lambda: loop.run_until_complete(epoch_async(next(counter))), epochs)
    finally:
        loop.close()


def _gpu_loader(root: Path, pipeline, batch: int, lanes: int, hw_load: float | str = HW_LOAD, threads: int | None = None,
                run_ahead: bool | None = None, tuning: ops.GpuTuning | None = None) -> headrace.Loader:
    # threads: each lane's decoder threads (the loader's num_threads is the lanes' total)
    return headrace.Loader(readers.files(root, shuffle=True, io_threads=IO_THREADS), batch_size=batch, pipeline=pipeline,
                           device="cuda", lanes=lanes, prefetch=lanes + 2, hw_load=hw_load,
                           num_threads=threads * lanes if threads else None,
                           run_ahead=run_ahead, gpu_tuning=tuning)


async def _count_epoch(loader: headrace.Loader) -> int:
    n = 0
    async for b in loader:
        n += b.size
    return n


def bench_headrace(root: Path, pipeline, batch: int, epochs: int, lanes: int, hw_load: float | str = HW_LOAD,
                   threads: int | None = None, run_ahead: bool | None = None, tuning: ops.GpuTuning | None = None) -> dict:
    loop = new_event_loop()
    loader = _gpu_loader(root, pipeline, batch, lanes, hw_load, threads, run_ahead, tuning)

    def epoch():
        return _count_epoch(loader)

    torch.cuda.empty_cache()  # earlier rows' cached blocks would count as this row's
    torch.cuda.reset_peak_memory_stats()
    free0 = torch.cuda.mem_get_info()[0]
    result = _timed_epochs(lambda: loop.run_until_complete(epoch()), epochs)
    result["peak_gpu_mib_torch"] = torch.cuda.max_memory_allocated() / 2**20
    result["gpu_mib_in_use_after"] = (free0 - torch.cuda.mem_get_info()[0]) / 2**20
    result["lane_seconds"] = loader.stats().lanes
    loop.run_until_complete(loader.aclose())
    loop.close()
    return result


def _headrace_epochs(root: Path, row: Any, batch: int, lanes: int) -> tuple[Any, Any, Any]:
    """A loader for ``row`` (a pipeline, or (pipeline, {lanes, hw_load, threads, tuning})): its
    (run one epoch, close, describe) triple, through ``with loader.sync()`` as a plain ``for`` loop
    uses it (describe: the lanes' engine shares, after the rounds).
    Its loop thread goes on between its epochs, so it runs ahead into the next one while the other
    rows take their turns, as DALI's pipelines prefetch in their own threads (a loop stopped
    between turns, as ``run_until_complete`` per epoch left it, started every epoch cold)."""
    pipeline, setup = row if isinstance(row, tuple) else (row, {})
    loader = _gpu_loader(root, pipeline, batch, setup.get("lanes", lanes), setup.get("hw_load", HW_LOAD),
                         setup.get("threads"), tuning=setup.get("tuning"))
    owner = contextlib.ExitStack()
    epochs = owner.enter_context(loader.sync())
    return (lambda: sum(b.size for b in epochs)), owner.close, lambda: {"engine_shares": _engine_shares(loader)}


def _engine_shares(loader: headrace.Loader) -> list[float]:
    """Where each lane's engine share stands (``hw_load``, or where "adaptive" moved it): which fixed
    share a machine's balance is. Empty where the lanes' decoders are not the shim's."""
    executor = getattr(getattr(loader, "_epochs", None), "_executor", None)
    decoders = [getattr(lane.decoder, "decoder", None) for lane in getattr(executor, "_lanes", [])]
    return [round(d.hw_share, 3) for d in decoders if hasattr(d, "hw_share")]


def bench_interleaved(rows: dict[str, Any], epochs: int) -> dict:
    """Rows that live side by side, one epoch each in turn, the order rotated every round: the
    machine's drift over a lease (whole runs of one row moved 10-25% on the H100) falls on every
    row alike, and each round gives a paired ratio to the first row. A row is a callable making its
    (run one epoch, close) pair: a headrace loader (``_headrace_epochs``, with a third, what to add
    to its results after the rounds) or a DALI pipeline (``_dali_epochs``). Cores busy are the process's CPU time over an epoch's wall time (the rows
    waiting their turn work only on what they prefetch: DALI's queue, headrace's run ahead)."""
    cuda = torch.cuda.is_available()  # rows on the CPU path time without it (benchmark_detection.py --device cpu)
    made: dict[str, tuple[Any, ...]] = {}
    try:
        for name, make in rows.items():
            made[name] = make()
        names = list(made)
        for name in names:  # warm-up
            made[name][0]()
        rates: dict[str, list[float]] = {name: [] for name in names}
        cores: dict[str, list[float]] = {name: [] for name in names}
        by_thread: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        kernel: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        counters: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for turn in range(epochs):
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                threads = ThreadCpu()
                if cuda:
                    torch.cuda.synchronize()
                threads.start()
                start, cpu = time.perf_counter(), time.process_time()
                n = made[name][0]()
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter() - start
                rates[name].append(n / wall)
                cores[name].append((time.process_time() - cpu) / wall)
                by_thread[name].append(threads.stop())
                kernel[name].append(threads.kernel)
                counters[name].append(threads.counters)
        described = {name: made[name][2]() for name in names if len(made[name]) > 2}
    finally:
        for row in made.values():
            row[1]()  # close
        gc.collect()
    first = rates[names[0]]
    return {name: {"images_per_s": statistics.median(v), "runs": v, "cores_busy": statistics.median(cores[name]),
                   "cores_per_1k": statistics.median(c / r * 1000 for c, r in zip(cores[name], v)),
                   "cores_by_thread": _mean_by_thread(by_thread[name]),
                   "kernel_by_thread": _mean_by_thread(kernel[name]),
                   "process_counters": {k: round(statistics.mean(c[k] for c in counters[name]), 3)
                                        for k in counters[name][0]} if counters[name][0] else {},
                   "paired_ratio": statistics.median(a / b for a, b in zip(v, first)), **described.get(name, {})}
            for name, v in rates.items()}


def _mean_by_thread(epochs: list[dict[str, float]]) -> dict[str, float]:
    """The cores each kind of thread kept busy, averaged over epochs, largest first."""
    names = {name for epoch in epochs for name in epoch}
    mean = {name: sum(e.get(name, 0.0) for e in epochs) / max(len(epochs), 1) for name in names}
    return {name: round(c, 3) for name, c in sorted(mean.items(), key=lambda kv: -kv[1])}


# DALI's pipelines by kind: its label in the table, the policy of ``nvidia.dali.auto_aug`` that the
# training pipeline applies to the uint8 224 x 224 crop before crop_mirror_normalize (None: none),
# and the headrace row it is the peer of.
DALI_KINDS = {
    "train": ("train", None, "train"),
    "val": ("validation", None, "val"),
    "randaug": ("train + RandAugment", "rand_augment", "train_randaug"),
    "trivial": ("train + TrivialAugmentWide", "trivial_augment", "train_trivial"),
    "autoaug": ("train + AutoAugment", "auto_augment", "train_autoaug"),
    "affine": ("train + RandomAffine", "random_affine", "train_affine"),
}


def _dali_policy(module: str, images):
    """DALI's own GPU implementation of the policy the headrace row of the same name runs, at
    torchvision's settings (RandAugment: 2 ops at magnitude 9 of 31 bins; AutoAugment: the ImageNet
    policy); translations up to DALI's default 100 pixels at the top bin, torchvision's 0.45 of 224.
    ``random_affine``: ``_dali_random_affine``."""
    from nvidia.dali.auto_aug import auto_augment, rand_augment, trivial_augment

    if module == "random_affine":
        return _dali_random_affine(images)
    if module == "rand_augment":
        return rand_augment.rand_augment(images, n=2, m=9)
    if module == "trivial_augment":
        return trivial_augment.trivial_augment_wide(images)
    return auto_augment.auto_augment_image_net(images)


def _dali_random_affine(images, size: int = 224):
    """The train_affine row's ``RandomAffine(15, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=10)``
    as DALI composes it: a matrix a sample from ``fn.transforms`` (rotation, scale and x shear
    about the centre, then a shift up to a tenth of the side), applied by ``fn.warp_affine``,
    bilinear, filling with 0 as torchvision does."""
    from nvidia.dali import fn, types

    centre = [size / 2, size / 2]
    scale = fn.random.uniform(range=[0.9, 1.1], shape=[1])
    shear = fn.random.uniform(range=[-10.0, 10.0], shape=[1])
    matrix = fn.transforms.rotation(angle=fn.random.uniform(range=[-15.0, 15.0]), center=centre)
    matrix = fn.transforms.scale(matrix, scale=fn.cat(scale, scale), center=centre)
    matrix = fn.transforms.shear(matrix, angles=fn.cat(shear, shear * 0.0), center=centre)
    matrix = fn.transforms.translation(matrix, offset=fn.random.uniform(range=[-0.1 * size, 0.1 * size], shape=[2]))
    return fn.warp_affine(images, matrix=matrix, fill_value=0, inverse_map=False, interp_type=types.INTERP_LINEAR)


def _dali_epochs(files, batch: int, threads: int, kind: str = "train") -> tuple[Any, Any]:
    """NVIDIA DALI on the same files and pipeline: file reader, mixed (GPU) decode with its random
    crop, resize 224, crop_mirror_normalize to float16 NCHW (validation: whole-image decode, resize
    shorter side 256, centre crop 224; the augmented kinds: ``DALI_KINDS``' policy after the resize,
    a pipeline with conditionals as ``nvidia.dali.auto_aug`` needs); DALIGenericIterator, as its
    ImageNet example has it. Its (run one epoch, close) pair."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    paths = [p for p, _ in files]
    labels = [label for _, label in files]
    mean = [0.485 * 255, 0.456 * 255, 0.406 * 255]
    std = [0.229 * 255, 0.224 * 255, 0.225 * 255]
    train = kind != "val"
    policy = DALI_KINDS[kind][1]

    @pipeline_def(enable_conditionals=policy is not None)
    def pipe():
        jpegs, label = fn.readers.file(files=paths, labels=labels, random_shuffle=train, name="Reader")
        if train:
            images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB,
                                                   random_area=[0.08, 1.0], random_aspect_ratio=[0.75, 4 / 3])
            images = fn.resize(images, resize_x=224, resize_y=224)
            if policy is not None:
                images = _dali_policy(policy, images)
            mirror = fn.random.coin_flip(probability=0.5)
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT16, output_layout="CHW", mean=mean, std=std,
                                              mirror=mirror)
        else:
            images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
            images = fn.resize(images, resize_shorter=256)
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT16, output_layout="CHW", crop=(224, 224),
                                              mean=mean, std=std)
        return images, label.gpu()

    p = pipe(batch_size=batch, num_threads=threads, device_id=torch.cuda.current_device(), seed=0)
    p.build()
    it = DALIGenericIterator(p, ["image", "label"], reader_name="Reader",
                             last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)

    def epoch() -> int:
        n = 0
        for out in it:
            n += out[0]["image"].shape[0]
        return n

    def close() -> None:
        nonlocal it, p
        del it, p
        gc.collect()

    return epoch, close


def bench_dali(files, batch: int, epochs: int, threads: int, kind: str = "train") -> dict:
    epoch, close = _dali_epochs(files, batch, threads, kind)
    try:
        return _timed_epochs(epoch, epochs)
    finally:
        close()


def _touch(batch: dict) -> dict:
    """A trivial batch stage: one small kernel on the lane's output (what the stage machinery costs)."""
    batch["label"] = batch["label"] + 0
    return batch


def _pass(batch: dict) -> dict:
    """A batch stage that launches nothing: the stage machinery (a thread, a stream, an event) alone."""
    return batch


async def _lookup(fields: dict) -> dict:
    """A remote label lookup, simulated: 1 ms of awaited I/O per sample."""
    await asyncio.sleep(0.001)
    return fields


def _mixed(*stages, fields=()):
    """The train row with batch augmentations after it (RandomErasing, MixUp and CutMix by default);
    ``fields`` other than none keep them off the lane (a thread and a stream of their own)."""
    stages = stages or (ops.RandomErasing(0.25), ops.MixUp(0.2, num_classes=100), ops.CutMix(1.0, num_classes=100, p=0.5))
    return ops.Pipeline([*ops.training(224, dtype="float16").ops, *stages], fields=fields)


def _gpu_work(batch: dict) -> dict:
    """GPU work with few Python calls: six in-place passes over the batch's images (about the bytes
    the three augmentations move), to tell their GPU time from their host time."""
    for _ in range(6):
        batch["image"].mul_(1.0)
    return batch


def _staged(pipeline, stage):
    """``pipeline`` with ``stage`` added where it goes (a Map before Decode, a MapBatch at the end)."""
    listed = list(pipeline.listed)
    listed = [stage, *listed] if isinstance(stage, ops.Map) else [*listed, stage]
    return ops.Pipeline(listed, image=pipeline.image_fields, label=pipeline.label_field)


def _augmented(*post):
    """The train row with post ops (``RandAugment``, say) on the uint8 crop, before Normalize."""
    listed = list(ops.training(224, dtype="float16").ops)
    return ops.Pipeline([*listed[:-1], *post, listed[-1]])


def bench_dataloader(files, batch: int, epochs: int, workers: int, augment: str | None = None) -> dict:
    """The DataLoader row; ``augment`` names a torchvision v2 policy its workers apply to the PIL crop
    (``"RandAugment"``, ``"AugMix"``), at its defaults."""
    from PIL import Image
    from torchvision.transforms import v2

    augment = [getattr(v2, augment)()] if augment else []
    tf = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip(), *augment, v2.PILToTensor(),
                     v2.ToDtype(torch.float32, scale=True), v2.Normalize(ops.IMAGENET_MEAN, ops.IMAGENET_STD)])

    class Folder(torch.utils.data.Dataset):
        def __len__(self):
            return len(files)

        def __getitem__(self, i):
            path, label = files[i]
            with Image.open(path) as img:
                return tf(img.convert("RGB")), label

    dl = torch.utils.data.DataLoader(Folder(), batch_size=batch, shuffle=True, num_workers=workers,
                                     pin_memory=True, persistent_workers=True, prefetch_factor=4)

    def epoch() -> int:
        n = 0
        for x, y in dl:
            x = x.cuda(non_blocking=True).half()
            n += len(y)
        return n

    return _timed_epochs(epoch, epochs)


def bench_torchvision_gpu(files, batch: int, epochs: int) -> dict:
    from torchvision.io import ImageReadMode, decode_jpeg, read_file
    from torchvision.transforms import v2

    tf = v2.Compose([v2.RandomResizedCrop(224, antialias=True), v2.RandomHorizontalFlip()])
    mean = torch.tensor(ops.IMAGENET_MEAN, device="cuda").view(1, 3, 1, 1) * 255
    std = torch.tensor(ops.IMAGENET_STD, device="cuda").view(1, 3, 1, 1) * 255

    def epoch() -> int:
        order = torch.randperm(len(files)).tolist()
        n = 0
        for lo in range(0, len(order), batch):
            datas = [read_file(files[i][0]) for i in order[lo : lo + batch]]
            imgs = decode_jpeg(datas, mode=ImageReadMode.RGB, device="cuda")
            x = torch.stack([tf(img) for img in imgs])
            x = ((x.float() - mean) / std).half()
            n += len(imgs)
        return n

    return _timed_epochs(epoch, epochs)


def bench_nvimgcodec(files, batch: int, epochs: int) -> dict:
    from nvidia import nvimgcodec as nvc

    dec = nvc.Decoder()
    stream = torch.cuda.Stream()

    def epoch() -> int:
        n = 0
        for lo in range(0, len(files), batch):
            blobs = []
            for path, _ in files[lo : lo + batch]:
                with open(path, "rb") as f:
                    blobs.append(f.read())
            imgs = dec.decode(blobs, cuda_stream=stream.cuda_stream)
            n += sum(img is not None for img in imgs)
        stream.synchronize()
        return n

    return _timed_epochs(epoch, epochs)


def host() -> dict[str, Any]:
    """The host a run was on: machines of one GPU kind differed here by 2x in what DALI's host threads
    cost an image, so each result says which CPU and which kernel (a 4.4 kernel is gVisor's) it had."""
    cpu = "unknown"
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"cpu": cpu, "kernel": platform.release(), "cpus": os.cpu_count()}


# CU_CTX_SCHED_*: how a host thread waits for the GPU in a synchronize.
CUDA_SCHED = {"auto": 0, "spin": 1, "yield": 2, "blocking": 4}


def set_cuda_sched(name: str) -> None:
    """The primary context's scheduling flags, before torch or CuPy create it (driver API, device 0)."""
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    dev = ctypes.c_int()
    for call in (lambda: cuda.cuInit(0), lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0),
                 lambda: cuda.cuDevicePrimaryCtxSetFlags_v2(dev, CUDA_SCHED[name])):
        if rc := call():
            raise RuntimeError(f"setting CUDA's scheduling to {name}: driver error {rc}")
    print(f"CUDA scheduling: {name}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--lanes", type=int, default=4, help="GPU lanes (the Loader's default)")
    ap.add_argument("--variants", default="",
                    help="also run headrace (train, or validation with val:) with these [val:]LANES:HW_LOAD[:THREADS[:DISPATCH[:GPU_HUFFMAN_ABOVE[:GPU_HUFFMAN_LOAD[:GPU_HUFFMAN_THREADS]]]]] (decoder threads per lane; free or turn; pixels, or none; a share; threads), e.g. 2:0.5,3:0.65:5,val:4:0.65:4:turn,4:0.55:4::25000,4:0.65::::0.15:8; --interleave runs them side by side")
    ap.add_argument("--io-threads", type=int, default=IO_THREADS, help="the files reader's I/O threads")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the whole run (Python's default is 0.005 s)")
    ap.add_argument("--options-variants", default="",
                    help="also run headrace (train, or validation with val:) with these nvImageCodec decoder options, ';'-separated, e.g. val:nvjpeg_cuda_decoder:hybrid_huffman_threshold=0; --interleave runs them side by side")
    ap.add_argument("--python-codec", action="store_true",
                    help="also run headrace (train) decoding through nvImageCodec's Python API (GpuTuning(decode=\"python\"))")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run the rows this many times in turn (A/B pairs interleaved, labels numbered)")
    ap.add_argument("--interleave", action="store_true",
                    help="run the headrace pipeline rows of --rows and the DALI rows side by side, one epoch each in turn (--epochs rounds; --repeat: that many times)")
    ap.add_argument("--uncut", action="store_true",
                    help="also run headrace (train and val, those of --rows) with the engines given whole JPEG frames "
                         "(GpuTuning(cut_frames=False)): the A/B of cutting each frame below its window")
    ap.add_argument("--without-run-ahead", action="store_true",
                    help="also run headrace (train) with each epoch drained before the next starts (Loader(run_ahead=False))")
    ap.add_argument("--python-launch", action="store_true",
                    help="also run headrace (train) launching its kernel from Python, not from the decode shim")
    ap.add_argument("--cuda-loads", default="",
                    help="also run headrace (train) with these shares of the non-hardware part for the CUDA decoder (the rest on the CPU), e.g. 0.9,0.8")
    ap.add_argument("--hw-loads", default="", help="also run headrace (train) at these hw_load values, e.g. 0,1")
    ap.add_argument("--dali-threads", default="", help="also run NVIDIA DALI with these thread counts, e.g. 4,8,12,16")
    ap.add_argument("--dali-rows", default="train,val",
                    help="which DALI pipelines --dali-threads runs: train, val, and the train pipeline with DALI's "
                         "auto_aug policies randaug, trivial, autoaug (beside train_randaug, train_trivial, train_autoaug)")
    ap.add_argument("--data", default=".data/bench-gpu")
    ap.add_argument("--photos", default=None, help="an .npz of photographs (for machines without scikit-image)")
    ap.add_argument("--rows", default="train,val,dataloader,torchvision,nvimgcodec")
    ap.add_argument("--cuda-sched", choices=sorted(CUDA_SCHED), default=None,
                    help="how the process's CUDA waits for the GPU (the primary context's flags, set before any "
                         "CUDA work): auto (CUDA's default: spin when there are fewer contexts than cores), spin, "
                         "yield or blocking")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.cuda_sched:
        set_cuda_sched(args.cuda_sched)
    root = Path(args.data)
    globals()["IO_THREADS"] = args.io_threads
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    t0 = time.perf_counter()
    if args.photos:  # the GPU machine has no scikit-image: bring its photographs along
        with __import__("numpy").load(args.photos) as z:
            photos = [z[k] for k in z.files]
        datasets.photographs = lambda: photos
    datasets.ensure_image_folder(root, count=args.images, classes=100, workers=os.cpu_count())
    print(f"data set: {args.images} JPEGs in {root} ({time.perf_counter() - t0:.0f} s)", flush=True)
    machine = host()
    print(f"host: {machine['cpu']}, {machine['cpus']} CPUs, kernel {machine['kernel']}", flush=True)
    files = _files(root)
    workers = os.cpu_count() or 1
    rows = [r for r in args.rows.split(",") if r]  # --rows "" with --variants: the variants alone
    results: dict[str, dict] = {}
    pipelines = {  # the rows that are headrace over a pipeline (--interleave runs them side by side)
        "train": ("headrace (train)", lambda: ops.training(224, dtype="float16")),
        "val": ("headrace (validation)", lambda: ops.validation(224, dtype="float16")),
        "train_stage": ("headrace (train + a batch stage)",
                        lambda: _staged(ops.training(224, dtype="float16"), ops.MapBatch(_touch))),
        "train_mix": ("headrace (train + erasing, MixUp, CutMix)", lambda: _mixed()),
        "train_mix_side": ("headrace (train + erasing, MixUp, CutMix, off the lane)", lambda: _mixed(fields=("cls",))),
        "train_erase": ("headrace (train + erasing)", lambda: _mixed(ops.RandomErasing(0.25))),
        "train_mixup": ("headrace (train + MixUp)", lambda: _mixed(ops.MixUp(0.2, num_classes=100))),
        "train_cutmix": ("headrace (train + CutMix)", lambda: _mixed(ops.CutMix(1.0, num_classes=100))),
        "train_gpuwork": ("headrace (train + 6 in-place multiplies)", lambda: _mixed(ops.MapBatch(_gpu_work))),
        "train_affine": ("headrace (train + RandomAffine)", lambda: _augmented(
            ops.RandomAffine(15, translate=(0.1, 0.1), scale=(0.9, 1.1), shear=10))),
        "train_randaug": ("headrace (train + RandAugment)", lambda: _augmented(ops.RandAugment())),
        "train_trivial": ("headrace (train + TrivialAugmentWide)", lambda: _augmented(ops.TrivialAugmentWide())),
        "train_autoaug": ("headrace (train + AutoAugment)", lambda: _augmented(ops.AutoAugment())),
        "train_timm": ("headrace (train + timm rand-m9-mstd0.5-inc1)", lambda: _augmented(ops.TimmRandAugment())),
        "train_augmix": ("headrace (train + AugMix)", lambda: _augmented(ops.AugMix())),
        "train_timm_augmix": ("headrace (train + timm augmix-m5-w4-d2)",
                              lambda: _augmented(ops.TimmAugMix("augmix-m5-w4-d2"))),
        "train_timm_augmix_jsd": ("headrace (train + timm augmix-m5-w4-d2, 3 views)", lambda: ops.training(
            224, dtype="float16", auto_augment="augmix-m5-w4-d2", splits=3)),
        "train_timm_autoaug": ("headrace (train + timm original-mstd0.5)",
                               lambda: _augmented(ops.TimmAutoAugment("original-mstd0.5"))),
        "train_noop": ("headrace (train + a no-op batch stage)",
                       lambda: _staged(ops.training(224, dtype="float16"), ops.MapBatch(_pass))),
        "train_lookup": ("headrace (train + 1 ms async lookup, 64)",
                         lambda: _staged(ops.training(224, dtype="float16"), ops.Map(_lookup, concurrency=64))),
    }
    runners = {
        **{key: (name, lambda make=make: bench_headrace(root, make(), args.batch, args.epochs, args.lanes))
           for key, (name, make) in pipelines.items()},
        "sizes": ("headrace (decode, resize 256, own sizes)", lambda: bench_headrace(
            root, ops.Pipeline([ops.Decode(), ops.Resize(256), ops.Normalize(dtype="float16")]), args.batch, args.epochs, args.lanes)),
        "dataloader": (f"DataLoader ({workers} workers) + PIL + tv v2", lambda: bench_dataloader(files, args.batch, args.epochs, workers)),
        "dataloader_randaug": (f"DataLoader ({workers} workers) + PIL + tv v2 RandAugment",
                               lambda: bench_dataloader(files, args.batch, args.epochs, workers, augment="RandAugment")),
        "dataloader_augmix": (f"DataLoader ({workers} workers) + PIL + tv v2 AugMix",
                              lambda: bench_dataloader(files, args.batch, args.epochs, workers, augment="AugMix")),
        "torchvision": ("torchvision decode_jpeg(cuda) + v2", lambda: bench_torchvision_gpu(files, args.batch, args.epochs)),
        "nvimgcodec": ("nvImageCodec decode only (whole)", lambda: bench_nvimgcodec(files, args.batch, args.epochs)),
        "reader": ("files reader alone (no decode)", lambda: bench_reader(root, args.epochs)),
    }
    dali: dict[str, tuple[int, str]] = {}  # DALI rows: (threads, kind)
    unknown = set(filter(None, args.dali_rows.split(","))) - set(DALI_KINDS)
    if unknown:
        ap.error(f"--dali-rows: {', '.join(sorted(unknown))} not among {', '.join(DALI_KINDS)}")
    for threads in filter(None, args.dali_threads.split(",")):
        for kind, (label, _, _) in DALI_KINDS.items():
            dali[f"dali_{kind}{threads}"] = (int(threads), kind)
            runners[f"dali_{kind}{threads}"] = (f"DALI ({label}, {threads} threads)",
                                                lambda t=int(threads), kind=kind: bench_dali(files, args.batch, args.epochs, t, kind))
            if kind in args.dali_rows.split(","):
                rows.append(f"dali_{kind}{threads}")
    for hw in filter(None, args.hw_loads.split(",")):
        runners[f"hw{hw}"] = (f"headrace (train, hw_load={hw})", lambda hw=float(hw): bench_headrace(
            root, ops.training(224, dtype="float16"), args.batch, args.epochs, args.lanes, hw))
        rows.append(f"hw{hw}")
    def tuned_row(key: str, kind: str, label: str, setup: dict) -> None:
        """The train (or validation) row set up otherwise (``setup``: lanes, hw_load, threads,
        tuning; those left out as the other rows have them); --interleave runs it side by side."""
        make = pipelines[kind][1]
        pipelines[key] = (label, lambda: (make(), setup))
        runners[key] = (label, lambda: bench_headrace(
            root, make(), args.batch, args.epochs, setup.get("lanes", args.lanes), setup.get("hw_load", HW_LOAD),
            setup.get("threads"), tuning=setup.get("tuning")))
        rows.append(key)

    for variant in filter(None, args.variants.split(",")):
        kind, spec = ("val", variant[4:]) if variant.startswith("val:") else ("train", variant)
        n, hw, *more = spec.split(":")
        threads, dispatch, huffman, gpu_share, gpu_threads = (more + [None] * 5)[:5]
        named = [(threads, f"{threads} threads"), (dispatch, f"{dispatch} dispatch"),
                 (huffman, f"GPU Huffman above {huffman}"), (gpu_share, f"GPU Huffman share {gpu_share}"),
                 (gpu_threads, f"{gpu_threads} GPU-Huffman threads")]
        label = ", ".join([f"headrace ({kind}", f"{n} lanes", f"hw_load={hw}"] + [text for value, text in named if value]) + ")"
        tuning = {**({"dispatch": dispatch} if dispatch else {}),
                  **({"gpu_huffman_above": None if huffman == "none" else int(huffman)} if huffman else {}),
                  **({"gpu_huffman_load": float(gpu_share)} if gpu_share else {}),
                  **({"gpu_huffman_threads": int(gpu_threads)} if gpu_threads else {})}
        tuned_row(variant, kind, label, {"lanes": int(n), "hw_load": hw if hw == "adaptive" else float(hw),
                                         "threads": int(threads) if threads else None,
                                         "tuning": ops.GpuTuning(**tuning) if tuning else None})

    def train_with(key: str, label: str, tuning: ops.GpuTuning) -> None:  # the train row, tuned
        runners[key] = (f"headrace (train, {label})", lambda: bench_headrace(
            root, ops.training(224, dtype="float16"), args.batch, args.epochs, args.lanes, tuning=tuning))
        rows.append(key)

    for cl in filter(None, args.cuda_loads.split(",")):
        train_with(f"cuda{cl}", f"cuda_load={cl}", ops.GpuTuning(cuda_load=float(cl)))
    for k, options in enumerate(filter(None, args.options_variants.split(";"))):
        # [val:]OPTIONS: the train (or validation) row with these decoder options
        kind, options = ("val", options[4:]) if options.startswith("val:") else ("train", options)
        tuned_row(f"options{k}", kind, f"headrace ({kind}, {options})", {"tuning": ops.GpuTuning(nvimgcodec_options=options)})
    if args.uncut:  # the engines decode every row of an image unless its frame is cut below the window
        for kind in [k for k in ("train", "val") if k in rows]:
            tuned_row(f"{kind}_uncut", kind, f"{pipelines[kind][0][:-1]}, frames not cut)",
                      {"tuning": ops.GpuTuning(cut_frames=False)})
    if args.without_run_ahead:
        runners["no_ahead"] = ("headrace (train, epochs not run ahead)", lambda: bench_headrace(
            root, ops.training(224, dtype="float16"), args.batch, args.epochs, args.lanes, run_ahead=False))
        rows.append("no_ahead")
    if args.python_launch:
        train_with("python_launch", "kernel launched from Python", ops.GpuTuning(launch="python"))
    if args.python_codec:
        train_with("python", "Python nvImageCodec API", ops.GpuTuning(decode="python"))
    if args.interleave:  # the pipeline rows (and DALI's) side by side, epochs in turn; the others after, as usual
        side = [key for key in rows if key in pipelines or key in dali]
        rows = [key for key in rows if key not in side]
        names = {key: pipelines[key][0] if key in pipelines else runners[key][0] for key in side}
        makers = {key: (lambda key=key: _headrace_epochs(root, pipelines[key][1](), args.batch, args.lanes))
                  if key in pipelines else (lambda key=key: _dali_epochs(files, args.batch, *dali[key])) for key in side}
        for turn in range(args.repeat):
            print(f"running {', '.join(side)} side by side, {args.epochs} rounds ...", flush=True)
            for key, r in bench_interleaved(makers, args.epochs).items():
                name = names[key] if turn == 0 else f"{names[key]} #{turn + 1}"
                results[name] = r
                print(f"  {name}: {r['images_per_s']:,.0f} images/s, paired ratio to {side[0]} "
                      f"{r['paired_ratio']:.3f}, {r['cores_per_1k']:.2f} cores per 1k/s; rounds "
                      f"{', '.join(f'{x:,.0f}' for x in r['runs'])}", flush=True)
    for turn, key in itertools.product(range(args.repeat), rows):
        name, fn = runners[key]
        name = name if turn == 0 else f"{name} #{turn + 1}"
        print(f"running {name} ...", flush=True)
        results[name] = fn()
        print(f"  {results[name]['images_per_s']:,.0f} images/s", flush=True)
    base = next((v["images_per_s"] for k, v in results.items() if k.startswith("DataLoader")), None)
    nvc = next((v["images_per_s"] for k, v in results.items() if k.startswith("nvImageCodec")), None)
    print(f"\n{'system':44} {'images/s':>10} {'vs DataLoader':>14} {'vs nvImageCodec':>16} {'cores busy':>11} {'loop busy':>10}")
    for name, r in results.items():
        ratio = f"{r['images_per_s'] / base:.2f}x" if base else "-"
        ratio2 = f"{r['images_per_s'] / nvc:.2f}x" if nvc else "-"
        loop_busy = f"{r['main_thread_busy']:.0%}" if "main_thread_busy" in r and name.startswith("headrace") else "-"
        cores = f"{r['cores_busy']:.1f}" if "cores_busy" in r else "-"  # not measured per row when interleaved
        print(f"{name:44} {r['images_per_s']:>10,.0f} {ratio:>14} {ratio2:>16} {cores:>11} {loop_busy:>10}")
    for kind, ours in ((label, pipelines[key][0]) for label, _, key in DALI_KINDS.values()):
        for suffix in [""] + [f" #{turn + 1}" for turn in range(1, args.repeat)]:  # each turn on its own
            theirs = {k: v for k, v in results.items()
                      if k.startswith(f"DALI ({kind},") and k.endswith("threads)" + suffix)}
            mine = results.get(ours + suffix)
            if not theirs or mine is None:
                continue
            best = max(theirs, key=lambda k: theirs[k]["images_per_s"])
            line = f"{ours + suffix} / DALI at its best thread count ({best}): {mine['images_per_s'] / theirs[best]['images_per_s']:.2f}x"
            if "paired_ratio" in mine and "paired_ratio" in theirs[best]:  # side by side: round by round
                paired = statistics.median(a / b for a, b in zip(mine["runs"], theirs[best]["runs"]))
                line += (f", paired by round {paired:.2f}x; host cores per 1,000 images/s "
                         f"{mine['cores_per_1k']:.2f} against {theirs[best]['cores_per_1k']:.2f}")
            print(line)
    for name, r in results.items():
        if r.get("cores_by_thread"):  # where the cores went: nvImageCodec's pool, lanes, readers, DALI's workers
            top = list(r["cores_by_thread"].items())[:7]
            print(f"{name}: cores by thread {', '.join(f'{k} {c:.2f}' for k, c in top)}")
    for name, r in results.items():
        if r.get("engine_shares"):  # after the rounds; an adaptive share shows where this machine's balance is
            print(f"{name}: the engine's share of the bytes by lane at the end {', '.join(f'{x:.2f}' for x in r['engine_shares'])}")
    for name, r in results.items():
        if r.get("process_counters"):  # host time the work does not explain: the kernel's share, switches, faults
            c, top = r["process_counters"], list(r.get("kernel_by_thread", {}).items())[:4]
            print(f"{name}: in the kernel {c['kernel_cores']:.2f} cores ({', '.join(f'{k} {v:.2f}' for k, v in top)}); "
                  f"context switches {c['switches_per_s']:,.0f}/s ({c['involuntary_switches_per_s']:,.0f}/s involuntary), "
                  f"page faults {c['minor_faults_per_s']:,.0f}/s minor, {c['major_faults_per_s']:,.0f}/s major")
    for name, r in results.items():
        if "peak_gpu_mib_torch" in r:
            print(f"{name}: epochs {', '.join(f'{x:,.0f}' for x in r['runs'])} images/s; garbage collections "
                  f"(gen 0/1/2) {r['gc_collections']}, {sum(r['gc_seconds']) * 1000:.0f} ms in all")
            print(f"{name}: lane seconds {', '.join(f'{k}={v:.2f}' for k, v in r['lane_seconds'].items())}")
            print(f"{name}: peak torch GPU memory {r['peak_gpu_mib_torch']:.0f} MiB, "
                  f"device memory still in use after the run {r['gpu_mib_in_use_after']:.0f} MiB")
    report = {"gpu": torch.cuda.get_device_name(), "host": machine, "date": datetime.date.today().isoformat(), "cores": workers,
              "images": args.images, "batch": args.batch, "epochs": args.epochs, "lanes": args.lanes,
              "torch": torch.__version__, "cuda_sched": args.cuda_sched or "auto", "results": results}
    out = Path(args.out or f"examples/results/gpu-{report['gpu'].replace(' ', '_')}-{report['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
