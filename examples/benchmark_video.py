"""Video benchmark: headrace's CPU video path against torch's DataLoader decoding the same clips with PyAV.

Not a test: it prints a table of clips/s and frames/s and writes it as JSON to ``examples/results/``.

The script makes its own folder of synthetic H.264 videos (PyAV, libx264, 30 fps, a keyframe
every second; a panned photograph-like texture with grain and a moving square, so the encoder
has real work), cached under ``--data`` while the settings match. Both systems read the same
clips of the same files: ``readers.video`` clips of 16 frames (stride 1, non-overlapping),
shuffled; every frame resized to 224×224 (bilinear with antialiasing, torch's), normalized with
the ImageNet mean/std to float32 ``[B, 16, 3, 224, 224]``; batch 8, labels from the class folders.

- **headrace**: ``readers.video`` + ``ops.video_pipeline(size=224)`` (``DecodeClip``: PyAV,
  seek to the keyframe before the clip, decode forward) in one thread per core, and a
  ``MapBatch`` that normalizes each batch.
- **DataLoader**: a ``Dataset`` of the same clips (path, the frames' timestamps from headrace's
  probe, label) whose ``__getitem__`` opens the file with PyAV, seeks, decodes the clip's frames,
  resizes and normalizes them: one worker process per core (spawned), persistent workers.

After a warm-up epoch each, timed epochs alternate between the two (the order flips every round)
and the median epoch counts.

``--device cuda`` moves headrace's batches to the GPU (decode still on the CPU: the NVDEC path
of issue 17 is not built yet) and the DataLoader's with ``pin_memory`` and ``.cuda(non_blocking=True)``;
it is for the GPU machine and has not been run here. The issue's size:

    python examples/benchmark_video.py                                     # small: 16 videos, 2-4 s, 320x180
    python examples/benchmark_video.py --videos 256 --seconds 5 20 --height 720 --device cuda
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import av
import numpy as np
import torch

import headrace
from headrace import ops, readers

RESULTS = Path(__file__).resolve().parent / "results"
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
FPS = 30
FRAMES = 16


# --- the data: synthetic H.264 videos in class folders ------------------------------------------------


def make_videos(root: Path, count: int, seconds: tuple[float, float], height: int, classes: int = 4) -> list[Path]:
    """``count`` videos of ``seconds[0]``-``seconds[1]`` s at ``height`` p (16:9), made once (a marker
    file records the settings; other settings remake the folder)."""
    settings = {"count": count, "seconds": list(seconds), "height": height, "classes": classes, "fps": FPS}
    marker = root / "videos.json"
    if marker.is_file() and json.loads(marker.read_text()) == settings:
        return sorted(root.rglob("*.mp4"))
    for old in root.rglob("*.mp4"):
        old.unlink()
    width = (height * 16 // 9) // 2 * 2
    rng = np.random.default_rng(0)
    made = []
    for i in range(count):
        path = root / f"class{i % classes}" / f"{i:04d}.mp4"
        path.parent.mkdir(parents=True, exist_ok=True)
        _encode(path, int(rng.uniform(*seconds) * FPS), width, height, rng)
        made.append(path)
        print(f"\rmaking videos: {i + 1}/{count}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    marker.write_text(json.dumps(settings))
    return made


def _encode(path: Path, frames: int, width: int, height: int, rng: np.random.Generator) -> None:
    small = rng.integers(0, 256, (height // 16 + 2, width // 16 + 8, 3), dtype=np.uint8)
    texture = torch.nn.functional.interpolate(torch.from_numpy(small).permute(2, 0, 1)[None].float(),
                                              scale_factor=16, mode="bicubic")[0].permute(1, 2, 0)
    texture = texture.clamp(0, 255).to(torch.uint8).numpy()
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=FPS, options={"preset": "veryfast", "crf": "23"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = FPS
        for f in range(frames):
            x = (f * 2) % (texture.shape[1] - width)
            image = texture[:height, x : x + width].copy()
            top, left = (f * 3) % (height - 40), (f * 5) % (width - 40)
            image[top : top + 40, left : left + 40] = 255 - image[top : top + 40, left : left + 40]
            image = np.clip(image.astype(np.int16) + rng.integers(-6, 7, image.shape), 0, 255).astype(np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        out.mux(stream.encode())


# --- the two systems ----------------------------------------------------------------------------------


def normalize(batch: dict) -> dict:
    """uint8 ``[B, F, C, H, W]`` → float32, ImageNet mean/std: one call per batch (a MapBatch)."""
    video = batch["video"]
    mean, std = MEAN.to(video.device), STD.to(video.device)
    return {**batch, "video": (video.float() - mean) / std}


def headrace_loader(root: Path, threads: int, batch_size: int, device: str) -> headrace.Loader:
    reader = readers.video(root, sequence_length=FRAMES, shuffle=True, io_threads=2)
    pipeline = ops.video_pipeline(size=224, stages=[ops.MapBatch(normalize, name="normalize")])
    return headrace.Loader(reader, batch_size=batch_size, pipeline=pipeline, device=device, num_threads=threads,
                           seed=0)


class PyAVClips(torch.utils.data.Dataset):
    """The same clips, decoded as a DataLoader user would: open, seek, decode forward, resize, normalize."""

    def __init__(self, clips: list[tuple[str, list[int], int]]) -> None:
        self.clips = clips

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, wanted, label = self.clips[i]
        frames: dict[int, np.ndarray] = {}
        with av.open(path) as container:
            stream = container.streams.video[0]
            container.seek(wanted[0], backward=True, any_frame=False, stream=stream)
            for frame in container.decode(stream):
                if frame.pts in wanted:
                    frames[frame.pts] = frame.to_ndarray(format="rgb24")
                if frame.pts >= wanted[-1]:
                    break
        clip = torch.from_numpy(np.stack([frames[p] for p in wanted])).permute(0, 3, 1, 2).float()
        clip = torch.nn.functional.interpolate(clip, size=(224, 224), mode="bilinear", antialias=True)
        return (clip.round_().clamp_(0, 255) - MEAN) / STD, label


def same_clips(root: Path) -> list[tuple[str, list[int], int]]:
    """Every clip headrace's reader has, as (path, frame timestamps, label), from its probe."""
    reader = readers.video(root, sequence_length=FRAMES)
    infos, offsets = reader.probed()
    clips = []
    for v, info in enumerate(infos):
        for j in range(int(offsets[v + 1] - offsets[v])):
            start = reader.clip_start(v, j, info)
            clips.append((reader.paths[v], info.pts[start : start + FRAMES].tolist(), reader.labels[v]))
    return clips


def dataloader(root: Path, workers: int, batch_size: int, device: str) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(PyAVClips(same_clips(root)), batch_size=batch_size, shuffle=True,
                                       num_workers=workers, persistent_workers=True,
                                       pin_memory=device == "cuda",
                                       # forked after this process ran torch's OpenMP threads (headrace's
                                       # resize), a worker segfaults in its first resize: spawn them
                                       multiprocessing_context="spawn")


# --- timing -------------------------------------------------------------------------------------------


def epoch_headrace(batches: Iterable[dict], device: str) -> tuple[int, float]:
    """One epoch of ``loader.sync()``'s iterable (each ``for`` over it is the next epoch)."""
    clips, start = 0, time.perf_counter()
    for batch in batches:
        clips += batch["video"].shape[0]
    if device == "cuda":
        torch.cuda.synchronize()
    return clips, time.perf_counter() - start


def epoch_dataloader(loader: torch.utils.data.DataLoader, device: str) -> tuple[int, float]:
    clips, start = 0, time.perf_counter()
    for video, _ in loader:
        if device == "cuda":
            video = video.cuda(non_blocking=True)
        clips += video.shape[0]
    if device == "cuda":
        torch.cuda.synchronize()
    return clips, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=os.path.join(".data", "bench-video"), help="video folder (default: %(default)s)")
    parser.add_argument("--videos", type=int, default=16, help="videos to make (default: %(default)s; the issue: 256)")
    parser.add_argument("--seconds", type=float, nargs=2, default=(2.0, 4.0), metavar=("MIN", "MAX"),
                        help="each video's length, uniform in [MIN, MAX] (default: 2 4; the issue: 5 20)")
    parser.add_argument("--height", type=int, default=180, help="frame height, 16:9 (default: %(default)s; the issue: 720)")
    parser.add_argument("--batch-size", type=int, default=8, help="clips per batch (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="headrace threads and DataLoader workers (default: all cores, %(default)s)")
    parser.add_argument("--epochs", type=int, default=3, help="timed epochs per system (default: %(default)s)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where batches end up (decode is on the CPU either way; default: %(default)s)")
    parser.add_argument("--json", default=None, help="result file (default: examples/results/video-<device>-<date>.json)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU: run it on the GPU machine")

    root = Path(args.data).resolve()
    videos = make_videos(root, args.videos, tuple(args.seconds), args.height)
    ours = headrace_loader(root, args.threads, args.batch_size, args.device)
    with ours.sync() as batches:
        measure(ours, batches, root, videos, args)


def measure(ours: headrace.Loader, batches: Iterable[dict], root: Path, videos: list[Path],
            args: argparse.Namespace) -> None:
    theirs = dataloader(root, args.threads, args.batch_size, args.device)
    clips = len(ours.reader)
    print(f"{len(videos)} videos in {root}, {clips} clips of {FRAMES} frames, batch {args.batch_size}, "
          f"{args.threads} threads / workers, device {args.device}")
    runs: dict[str, list[float]] = {"headrace": [], "dataloader": []}
    systems = {"headrace": lambda: epoch_headrace(batches, args.device), "dataloader": lambda: epoch_dataloader(theirs, args.device)}
    for name, run in systems.items():  # warm-up: probes, worker start-up, page cache
        n, seconds = run()
        assert n == clips, f"{name}: {n} clips, expected {clips}"
        print(f"warm-up {name}: {n / seconds:,.1f} clips/s")
    for round_ in range(args.epochs):
        for name in (list(systems) if round_ % 2 == 0 else list(systems)[::-1]):
            n, seconds = systems[name]()
            runs[name].append(n / seconds)
            print(f"epoch {round_} {name}: {n / seconds:,.1f} clips/s")
    rows = {name: {"clips_per_s": statistics.median(r), "frames_per_s": statistics.median(r) * FRAMES, "epochs": r}
            for name, r in runs.items()}
    base = rows["dataloader"]["clips_per_s"]
    print(f"\n| system ({args.device}) | clips/s | frames/s | vs DataLoader |\n| --- | ---: | ---: | ---: |")
    for name, row in rows.items():
        print(f"| {name} | {row['clips_per_s']:,.1f} | {row['frames_per_s']:,.0f} | {row['clips_per_s'] / base:.2f}× |")
    print("| headrace, NVDEC decode on the GPU | not built yet (issue 17): no number | | |")
    result = {
        "date": datetime.date.today().isoformat(), "headrace": headrace.__version__, "pyav": av.__version__,
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cores": os.cpu_count(), "device": args.device,
        "config": {"videos": len(videos), "seconds": list(args.seconds), "height": args.height, "fps": FPS,
                   "codec": "h264 (libx264 veryfast crf 23, keyframe every 30 frames)", "clips": clips,
                   "frames_per_clip": FRAMES, "resize": [224, 224], "normalize": "ImageNet mean/std, float32",
                   "batch_size": args.batch_size, "threads_and_workers": args.threads, "timed_epochs": args.epochs},
        "rows": rows, "ratio_headrace_vs_dataloader": rows["headrace"]["clips_per_s"] / base,
        "gpu_nvdec_row": None,
    }
    out = Path(args.json) if args.json else RESULTS / f"video-{args.device}-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
