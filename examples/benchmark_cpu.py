"""CPU benchmark: headrace against torch's DataLoader + Pillow with torchvision's transforms.

Not a test: it prints a table of images/s and writes it as JSON to ``examples/results/``.

Both systems read the same JPEG files and produce the same batches: decode → random resized crop
224 (scale 0.08–1, ratio 3/4–4/3, bilinear) → horizontal flip (p=0.5) → normalize with the
ImageNet mean/std → float32 NCHW, plus int64 labels (``--pipeline validation``: decode → shorter
side 256 → centre crop 224 → normalize, in order). torchvision cannot be installed here, so
its transforms are re-implemented line for line with Pillow and torch (``TorchvisionStyle``,
shared with ``headrace bench --dataloader``).
The DataLoader uses one worker process per core, persistent workers, no pinned memory; headrace
uses one thread per core, and decodes each JPEG's crop window only with nvImageCodec's CPU backend
when it is installed (Pillow otherwise; the JSON says which). After a warm-up epoch each, timed epochs alternate between the two
systems (the order flips every round) and the median epoch counts.

The decode-only rows (whole images from memory to RGB pixels, nothing else) answer which CPU
JPEG decoder is faster on this machine: Pillow (libjpeg-turbo) on 1 and N threads, and, when it
is installed, nvImageCodec's CPU backend: one decoder with 1 or N threads, one single-threaded
decoder per thread, and region-of-interest decode of the RandomResizedCrop windows.

``--dali PYTHON`` adds NVIDIA DALI's CPU pipeline (its ImageNet example's, ``device_id=None``, one
thread per worker), run by ``_dali_cpu.py`` under that Python (a venv with ``nvidia-dali-cuda120``
or ``-cuda130`` and torch: DALI's wheels bring their own nvImageCodec), its epochs taking turns
with the others.

    python examples/benchmark_cpu.py                       # 2048 images under .data/bench
    python examples/benchmark_cpu.py --images 4096 --epochs 5
    python examples/benchmark_cpu.py --dali /path/to/dali-venv/bin/python
    python examples/benchmark_cpu.py --pipeline validation --dali /path/to/dali-venv/bin/python
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import PIL
import torch
from PIL import Image

import headrace
from headrace import datasets, ops, readers
from headrace._loop import new_event_loop  # uvloop when installed, as the loader uses
from headrace._bench_dataloader import TorchvisionStyle, TorchvisionValidation

RESULTS = Path(__file__).resolve().parent / "results"


# --- the baseline: ImageFolder + torchvision's transforms, re-implemented faithfully -----------------
# TorchvisionStyle (RandomResizedCrop, flip, ToTensor, Normalize) lives in headrace, where ``headrace
# bench --dataloader`` uses it too; it needs torch and Pillow only, never torchvision.


class ImageFiles(torch.utils.data.Dataset):
    """torchvision's ``ImageFolder`` in substance: (path, class) pairs, ``pil_loader``, a transform."""

    def __init__(self, paths: list[str], labels: list[int], transform: Callable) -> None:
        self.paths, self.labels, self.transform = paths, labels, transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        with open(self.paths[index], "rb") as f:
            img = Image.open(f).convert("RGB")
        return self.transform(img), self.labels[index]


# --- timing -----------------------------------------------------------------------------------------


def time_dataloader_epoch(loader: torch.utils.data.DataLoader) -> tuple[int, float]:
    n = 0
    start = time.perf_counter()
    for images, labels in loader:
        assert images.dtype == torch.float32 and images.shape[1:] == (3, 224, 224), images.shape
        n += images.shape[0]
    return n, time.perf_counter() - start


async def _headrace_epoch(loader: headrace.Loader) -> tuple[int, float]:
    n = 0
    start = time.perf_counter()
    async for batch in loader:
        images = batch["image"]
        assert images.dtype == torch.float32 and images.shape[1:] == (3, 224, 224), images.shape
        n += images.shape[0]
    return n, time.perf_counter() - start


class DaliEpochs:
    """DALI's CPU pipeline in a child process (``_dali_cpu.py`` under ``python``): one epoch a call."""

    def __init__(self, python: str, paths: list[str], labels: list[int], batch: int, threads: int,
                 pipeline: str) -> None:
        fd, self._listing = tempfile.mkstemp(suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([[str(p), int(label)] for p, label in zip(paths, labels)], f)
        script = Path(__file__).resolve().parent / "_dali_cpu.py"
        self._child = subprocess.Popen([python, str(script), self._listing, str(batch), str(threads), pipeline],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._child.stdout.readline().split()
        if ready[:1] != ["ready"]:
            self._child.kill()
            self._child.wait()
            os.unlink(self._listing)
            sys.exit(f"--dali {python}: DALI's pipeline did not start (see its error above)")
        self.version = ready[1]

    def __call__(self) -> tuple[int, float]:
        self._child.stdin.write("epoch\n")
        self._child.stdin.flush()
        n, seconds = self._child.stdout.readline().split()
        return int(n), float(seconds)

    def close(self) -> None:
        # Said, not just an end of input: the DataLoader's forked workers hold the pipe's write end too.
        self._child.stdin.write("quit\n")
        self._child.stdin.close()
        self._child.wait(timeout=60)
        os.unlink(self._listing)


def median_rate(runs: list[tuple[int, float]]) -> float:
    return statistics.median(n / t for n, t in runs)


def decode_rows(paths: list[str], batch_size: int, cores: int, repeats: int) -> list[dict]:
    """Decode-only throughput from memory: Pillow, and nvImageCodec's CPU backend if installed.

    Whole images to RGB pixels, nothing else. nvImageCodec also decodes only each image's
    RandomResizedCrop window (region of interest), the windows headrace's training pipeline draws.
    """
    blobs = [Path(p).read_bytes() for p in paths]
    rows = []
    pool = ThreadPoolExecutor(cores)

    def pillow_one(data: bytes) -> None:
        img = Image.open(io.BytesIO(data))
        if img.mode != "RGB":
            img = img.convert("RGB")
        img.load()

    def pillow_threads(n: int) -> Callable[[], None]:
        if n == 1:
            return lambda: [pillow_one(b) for b in blobs]
        return lambda: list(pool.map(pillow_one, blobs, chunksize=max(1, len(blobs) // (4 * n))))

    rows.append(_repeat("decode only (Pillow, 1 thread)", pillow_threads(1), len(blobs), repeats))
    if cores > 1:
        rows.append(_repeat(f"decode only (Pillow, {cores} threads)", pillow_threads(cores), len(blobs), repeats))
    nvc = _nvimgcodec()
    if nvc is None:
        pool.shutdown()
        return rows

    def decoder(threads: int):
        return nvc.Decoder(device_id=nvc.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=threads,
                           backends=[nvc.Backend(nvc.BackendKind.CPU_ONLY)])

    params = nvc.DecodeParams(apply_exif_orientation=False)
    rrc = ops.RandomResizedCrop(224)
    u = ops.uniforms(0, 0, 1, np.arange(len(blobs)), rrc.randoms)
    streams = [nvc.CodeStream(b) for b in blobs]
    regions = []
    for i, cs in enumerate(streams):
        top, left, h, w = rrc.window(cs.height, cs.width, u[i])
        regions.append(nvc.Region(top, left, top + h, left + w))

    def batched(decoders, roi: bool) -> Callable[[], None]:
        # One decode call per batch; with several decoders, each takes an equal part of the batch
        # in its own thread (a Decoder must not be shared between threads).
        def one(dec, lo: int, hi: int) -> None:
            if roi:  # the header parse and sub-stream belong to the per-batch work
                srcs = [nvc.CodeStream(b).get_sub_code_stream(region=r) for b, r in zip(blobs[lo:hi], regions[lo:hi])]
            else:
                srcs = blobs[lo:hi]
            if any(im is None for im in dec.decode(srcs, params=params)):
                raise RuntimeError("nvImageCodec failed to decode an image")

        def run() -> None:
            for lo in range(0, len(blobs), batch_size):
                hi = min(lo + batch_size, len(blobs))
                if len(decoders) == 1:
                    one(decoders[0], lo, hi)
                    continue
                bounds = np.linspace(lo, hi, len(decoders) + 1).astype(int)
                list(pool.map(one, decoders, bounds[:-1], bounds[1:]))

        run()  # the first call loads the codec plug-ins
        return run

    n = len(blobs)
    rows.append(_repeat(f"nvImageCodec CPU decode (batched {batch_size}, 1 thread)", batched([decoder(1)], False), n, repeats))
    if cores > 1:
        rows.append(_repeat(f"nvImageCodec CPU decode (batched {batch_size}, 1 decoder, {cores} threads)",
                            batched([decoder(cores)], False), n, repeats))
        per_thread = [decoder(1) for _ in range(cores)]
        rows.append(_repeat(f"nvImageCodec CPU decode (batched, {cores} decoders x 1 thread)", batched(per_thread, False), n, repeats))
        rows.append(_repeat(f"nvImageCodec CPU ROI decode of crop windows ({cores} decoders)", batched(per_thread, True), n, repeats))
    else:
        rows.append(_repeat("nvImageCodec CPU ROI decode of crop windows (1 thread)", batched([decoder(1)], True), n, repeats))
    pool.shutdown()
    return rows


def _repeat(name: str, fn: Callable[[], None], n: int, repeats: int) -> dict:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append((n, time.perf_counter() - start))
    return {"system": name, "images_per_s": median_rate(runs), "runs": [n / t for n, t in runs]}


def _nvimgcodec():
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    try:
        # Without CUDA libraries the import prints "Failed to load nvjpeg" and the like from C++:
        # expected here (the CPU backend needs none of them); keep it out of the table's way.
        with _quiet_stderr():
            from nvidia import nvimgcodec
    except ImportError:
        return None
    return nvimgcodec


class _quiet_stderr:
    def __enter__(self):
        sys.stderr.flush()
        self.saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)


# --- main -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default=".data/bench", help="data set folder, made once (default: %(default)s)")
    p.add_argument("--images", type=int, default=2048, help="images in the data set (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=None, help="default: 256, or 128 below 16 batches of 256")
    p.add_argument("--epochs", type=int, default=5, help="timed epochs per system, after one warm-up (default: 5)")
    p.add_argument("--workers", type=int, default=cores, help="DataLoader workers and headrace threads (default: cores)")
    p.add_argument("--decode-images", type=int, default=512, help="images for the decode-only rows (default: 512)")
    p.add_argument("--out", default=None, help="JSON file (default: examples/results/cpu-[validation-]<host>-<date>.json)")
    p.add_argument("--pipeline", choices=["training", "validation"], default="training")
    p.add_argument("--dali", metavar="PYTHON", default=None,
                   help="also DALI's CPU pipeline, run by this Python (one with nvidia-dali and torch)")
    p.add_argument("--no-json", action="store_true", help="print only")
    args = p.parse_args(argv)
    batch_size = args.batch_size or (256 if args.images >= 16 * 256 else 128)

    made = datasets.count_images(args.data) != args.images
    if made:
        from tqdm import tqdm

        with tqdm(total=args.images, desc=f"making {args.images} JPEGs", unit="img") as bar:
            datasets.ensure_image_folder(args.data, count=args.images, classes=10, progress=bar.update)
    root = Path(args.data)
    training = args.pipeline == "training"
    reader = readers.files(root, shuffle=training)
    paths, labels = reader.paths, reader.labels
    mib = sum(os.path.getsize(p) for p in paths) / len(paths) / 1024
    print(f"data: {len(paths)} JPEGs in {root} ({'made now' if made else 'cached'}), mean {mib:.0f} KiB; "
          f"batch {batch_size}; {cores} cores; {args.workers} workers/threads")

    pipeline = ops.training(224) if training else ops.validation(224)
    hr = headrace.Loader(reader, batch_size=batch_size, pipeline=pipeline, num_threads=args.workers)
    dl = torch.utils.data.DataLoader(
        ImageFiles(paths, labels, TorchvisionStyle(224) if training else TorchvisionValidation(224)),
        batch_size=batch_size,
        shuffle=training,
        num_workers=args.workers,
        pin_memory=False,
        persistent_workers=args.workers > 0,
    )
    loop = new_event_loop()
    systems: dict[str, Callable[[], tuple[int, float]]] = {
        "torch DataLoader + Pillow (torchvision-style)": lambda dl=dl: time_dataloader_epoch(dl),
        "headrace": lambda: loop.run_until_complete(_headrace_epoch(hr)),
    }
    dali = DaliEpochs(args.dali, paths, labels, batch_size, args.workers, args.pipeline) if args.dali else None
    if dali is not None:
        systems[f"NVIDIA DALI {dali.version} CPU pipeline"] = dali
    names = list(systems)
    runs: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    for name in names:  # warm-up: worker start-up, page cache, lazy imports
        n, t = systems[name]()
        print(f"  warm-up  {name:<48} {n / t:8.0f} images/s")
    for r in range(args.epochs):
        for name in names if r % 2 == 0 else names[::-1]:
            n, t = systems[name]()
            runs[name].append((n, t))
            print(f"  epoch {r}  {name:<48} {n / t:8.0f} images/s")
    loop.run_until_complete(hr.aclose())
    loop.close()
    if dali is not None:
        dali.close()
    systems.clear()
    del dl  # the last reference: its persistent workers exit before the decode-only rows

    base = median_rate(runs[names[0]])
    rows = [{"system": name, "images_per_s": median_rate(runs[name]), "runs": [n / t for n, t in runs[name]]}
            for name in names]
    rows += decode_rows(paths[: args.decode_images], batch_size, cores, repeats=3)
    for row in rows:
        row["vs_dataloader"] = row["images_per_s"] / base

    print()
    print(f"{'system':<64} {'images/s':>9} {'vs DataLoader':>14}")
    for row in rows:
        print(f"{row['system']:<64} {row['images_per_s']:>9.0f} {row['vs_dataloader']:>13.2f}x")

    if not args.no_json:
        out = Path(args.out) if args.out else RESULTS / f"cpu-{'' if training else 'validation-'}{_host()}-{datetime.date.today().isoformat()}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        nvc = _nvimgcodec()
        report = {
            "benchmark": "examples/benchmark_cpu.py",
            "when": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": {"cpu_count": cores, "processor": _cpu_name(), "platform": platform.platform()},
            "versions": {
                "python": platform.python_version(),
                "headrace": headrace.__version__,
                "torch": torch.__version__,
                "pillow": PIL.__version__,
                "numpy": np.__version__,
                "nvimgcodec": getattr(nvc, "__version__", None) if nvc else None,
                "dali": dali.version if dali is not None else None,
            },
            "config": {
                "images": len(paths),
                "mean_kib": round(mib, 1),
                "batch_size": batch_size,
                "workers": args.workers,
                "timed_epochs": args.epochs,
                "decode_images": min(args.decode_images, len(paths)),
                "pipeline": ("decode → RandomResizedCrop(224) → flip → normalize → float32 NCHW" if training
                             else "decode → Resize(256) → CenterCrop(224) → normalize → float32 NCHW"),
                "headrace_jpeg_decoder": "nvImageCodec CPU, crop window" if nvc else "Pillow",
            },
            "table": rows,
        }
        out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        print(f"\nwrote {out}")
    return 0


def _host() -> str:
    name = re.sub(r"[^A-Za-z0-9-]+", "-", socket.gethostname().split(".")[0]).strip("-")[:24]
    return name or "local"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    sys.exit(main())
