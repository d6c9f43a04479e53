"""Video benchmark: headrace's video path (CPU, or NVDEC with ``--device cuda``) against torch's DataLoader decoding the same clips with PyAV.

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

``--device cuda`` runs headrace's NVDEC path (``ops.video_pipeline(..., device="cuda")``: PyNvVideoCodec
decodes, torch resizes and normalizes on the GPU; the ``video-gpu`` extra) and moves the DataLoader's
batches there with ``pin_memory`` and ``.cuda(non_blocking=True)``. It adds a third row, **PyNvVideoCodec
alone**: the same clips decoded by ``--threads`` threads, each with its own ``SimpleDecoder`` (reconfigured
when its next clip is from another video, as headrace's threads do), frames fetched by index and
nothing else (no copy, resize or normalize): the NVDEC floor. ``--clips-per-video k`` takes k clips per
video (random starts) to bound an epoch. The issue's size:

    python examples/benchmark_video.py                                     # small: 16 videos, 2-4 s, 320x180
    python examples/benchmark_video.py --videos 256 --seconds 5 20 --height 720 --device cuda --clips-per-video 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import multiprocessing
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
    """``count`` videos of ``seconds[0]``-``seconds[1]`` s at ``height`` p (16:9), made once, in one
    process per core (a marker file records the settings; other settings remake the folder)."""
    settings = {"count": count, "seconds": list(seconds), "height": height, "classes": classes, "fps": FPS, "made": 2}
    marker = root / "videos.json"
    if marker.is_file() and json.loads(marker.read_text()) == settings:
        return sorted(root.rglob("*.mp4"))
    for old in root.rglob("*.mp4"):
        old.unlink()
    width = (height * 16 // 9) // 2 * 2
    lengths = np.random.default_rng(0).uniform(*seconds, count)
    jobs = [(root / f"class{i % classes}" / f"{i:04d}.mp4", int(lengths[i] * FPS), width, height, i) for i in range(count)]
    started = time.perf_counter()
    # forked before this process runs torch or CUDA: the children only encode with PyAV and NumPy
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count() or 1, mp_context=multiprocessing.get_context("fork")) as pool:
        for done, _ in enumerate(pool.map(_encode, *zip(*jobs)), 1):
            print(f"\rmaking videos: {done}/{count}", end="", file=sys.stderr, flush=True)
    print(f" ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    marker.write_text(json.dumps(settings))
    return [job[0] for job in jobs]


def _encode(path: Path, frames: int, width: int, height: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    small = rng.integers(0, 256, (height // 16 + 2, width // 16 + 8, 3), dtype=np.uint8)
    texture = torch.nn.functional.interpolate(torch.from_numpy(small).permute(2, 0, 1)[None].float(),
                                              scale_factor=16, mode="bicubic")[0].permute(1, 2, 0)
    texture = (texture.clamp(0, 255) * (243 / 255)).to(torch.uint8).numpy()  # room for the grain: no clipping
    grain = rng.integers(0, 13, (8, height, width, 3), dtype=np.uint8)  # a few grain frames, cycled
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=FPS, options={"preset": "veryfast", "crf": "23", "threads": "2"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = FPS
        for f in range(frames):
            x = (f * 2) % (texture.shape[1] - width)
            image = texture[:height, x : x + width] + grain[f % len(grain)]
            top, left = (f * 3) % (height - 40), (f * 5) % (width - 40)
            image[top : top + 40, left : left + 40] = 255 - image[top : top + 40, left : left + 40]
            out.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        out.mux(stream.encode())


# --- the two systems ----------------------------------------------------------------------------------


def normalize(batch: dict) -> dict:
    """uint8 ``[B, F, C, H, W]`` → float32, ImageNet mean/std: one call per batch (a MapBatch)."""
    video = batch["video"]
    mean, std = MEAN.to(video.device), STD.to(video.device)
    return {**batch, "video": (video.float() - mean) / std}


def headrace_loader(root: Path, threads: int, batch_size: int, device: str,
                    clips_per_video: int | None = None) -> headrace.Loader:
    reader = readers.video(root, sequence_length=FRAMES, shuffle=True, io_threads=2, clips_per_video=clips_per_video,
                           seed=0)
    pipeline = ops.video_pipeline(size=224, stages=[ops.MapBatch(normalize, name="normalize")], device=device)
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


def same_clips(root: Path, clips_per_video: int | None = None) -> list[tuple[str, list[int], int, int]]:
    """Every clip headrace's reader has (epoch 0's draws with ``clips_per_video``), as (path, frame
    timestamps, label, first frame), from its probe."""
    reader = readers.video(root, sequence_length=FRAMES, clips_per_video=clips_per_video, seed=0)
    infos, offsets = reader.probed()
    clips = []
    for v, info in enumerate(infos):
        for j in range(int(offsets[v + 1] - offsets[v])):
            start = reader.clip_start(v, j, info)
            clips.append((reader.paths[v], info.pts[start : start + FRAMES].tolist(), reader.labels[v], start))
    return clips


def dataloader(root: Path, workers: int, batch_size: int, device: str,
               clips_per_video: int | None = None) -> torch.utils.data.DataLoader:
    clips = [clip[:3] for clip in same_clips(root, clips_per_video)]
    return torch.utils.data.DataLoader(PyAVClips(clips), batch_size=batch_size, shuffle=True,
                                       num_workers=workers, persistent_workers=True,
                                       pin_memory=device == "cuda",
                                       # forked after this process ran torch's OpenMP threads (headrace's
                                       # resize), a worker segfaults in its first resize: spawn them
                                       multiprocessing_context="spawn")


class NvdecFloor:
    """PyNvVideoCodec alone: the clips split over ``threads`` threads, each with its own decoder
    (reconfigured for another video) and CUDA stream, frames fetched by index, nothing else.
    Shuffled each epoch like the others."""

    def __init__(self, clips: list[tuple[str, list[int], int, int]], threads: int) -> None:
        import PyNvVideoCodec as nvc

        self.nvc, self.clips, self.threads, self.epoch = nvc, clips, threads, 0
        self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="floor")

    def _work(self, part: list[tuple[str, int]]) -> int:
        nvc, stream = self.nvc, torch.cuda.Stream()
        decoder, current, frames = None, None, 0
        for path, start in part:
            if decoder is None:
                decoder = nvc.SimpleDecoder(path, gpu_id=0, cuda_stream=stream.cuda_stream, use_device_memory=True,
                                            output_color_type=nvc.OutputColorType.RGBP)
            elif path != current:
                decoder.reconfigure_decoder(path)  # far cheaper than a new decoder (decoder_setup_ms)
            current = path
            frames += len(decoder.get_batch_frames_by_index(list(range(start, start + FRAMES))))
        stream.synchronize()
        return frames

    def epoch_run(self) -> tuple[int, float]:
        order = np.random.default_rng(self.epoch).permutation(len(self.clips))
        self.epoch += 1
        parts = [[(self.clips[i][0], self.clips[i][3]) for i in order[t :: self.threads]] for t in range(self.threads)]
        start = time.perf_counter()
        frames = sum(self.pool.map(self._work, parts))
        torch.cuda.synchronize()
        assert frames == len(self.clips) * FRAMES, frames
        return len(self.clips), time.perf_counter() - start


def decoder_setup_ms(videos: list[Path], count: int = 16) -> dict[str, float]:
    """What a decoder costs to get ready for another video (and its first clip): a new SimpleDecoder
    against ``reconfigure_decoder`` of a kept one, averaged over ``count`` videos."""
    import PyNvVideoCodec as nvc

    stream = torch.cuda.Stream()
    kw = dict(gpu_id=0, cuda_stream=stream.cuda_stream, use_device_memory=True, output_color_type=nvc.OutputColorType.RGBP)
    paths = [str(v) for v in videos[:count]]
    out = {}
    for way in ("new", "reconfigure"):
        kept = nvc.SimpleDecoder(paths[-1], **kw)
        kept.get_batch_frames_by_index(list(range(FRAMES)))
        setup = clip = 0.0
        for path in paths:
            t0 = time.perf_counter()
            if way == "new":
                kept = nvc.SimpleDecoder(path, **kw)
            else:
                kept.reconfigure_decoder(path)
            t1 = time.perf_counter()
            kept.get_batch_frames_by_index(list(range(FRAMES)))
            stream.synchronize()
            setup, clip = setup + t1 - t0, clip + time.perf_counter() - t1
        out[f"{way}_setup_ms"] = 1000 * setup / len(paths)
        out[f"{way}_first_clip_ms"] = 1000 * clip / len(paths)
    return out


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
                        help="cuda: headrace decodes on NVDEC, and the PyNvVideoCodec-alone floor is timed (default: %(default)s)")
    parser.add_argument("--clips-per-video", type=int, default=None,
                        help="clips per video, at random starts (default: every clip, non-overlapping)")
    parser.add_argument("--json", default=None, help="result file (default: examples/results/video-<device>-<date>.json)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU: run it on the GPU machine")

    root = Path(args.data).resolve()
    videos = make_videos(root, args.videos, tuple(args.seconds), args.height)
    ours = headrace_loader(root, args.threads, args.batch_size, args.device, args.clips_per_video)
    with ours.sync() as batches:
        measure(ours, batches, root, videos, args)


def measure(ours: headrace.Loader, batches: Iterable[dict], root: Path, videos: list[Path],
            args: argparse.Namespace) -> None:
    theirs = dataloader(root, args.threads, args.batch_size, args.device, args.clips_per_video)
    clips = len(ours.reader)
    print(f"{len(videos)} videos in {root}, {clips} clips of {FRAMES} frames, batch {args.batch_size}, "
          f"{args.threads} threads / workers, device {args.device}")
    runs: dict[str, list[float]] = {"headrace": [], "dataloader": []}
    systems = {"headrace": lambda: epoch_headrace(batches, args.device), "dataloader": lambda: epoch_dataloader(theirs, args.device)}
    setup = None
    if args.device == "cuda":
        floor = NvdecFloor(same_clips(root, args.clips_per_video), args.threads)
        systems["nvdec_floor"] = floor.epoch_run
        runs["nvdec_floor"] = []
        setup = decoder_setup_ms(videos)
        print("decoder setup (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in setup.items()))
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
    floor_rate = rows["nvdec_floor"]["clips_per_s"] if "nvdec_floor" in rows else None
    labels = {"headrace": "headrace" + (" (NVDEC)" if args.device == "cuda" else ""),
              "dataloader": f"DataLoader, {args.threads} workers, PyAV",
              "nvdec_floor": f"PyNvVideoCodec alone, {args.threads} threads (the floor)"}
    print(f"\n| system ({args.device}) | clips/s | frames/s | vs DataLoader | vs floor |\n| --- | ---: | ---: | ---: | ---: |")
    for name, row in rows.items():
        vs_floor = f"{row['clips_per_s'] / floor_rate:.0%}" if floor_rate else ""
        print(f"| {labels[name]} | {row['clips_per_s']:,.1f} | {row['frames_per_s']:,.0f} | "
              f"{row['clips_per_s'] / base:.2f}× | {vs_floor} |")
    result = {
        "date": datetime.date.today().isoformat(), "headrace": headrace.__version__, "pyav": av.__version__,
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cores": os.cpu_count(), "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "command": " ".join(sys.argv),
        "config": {"videos": len(videos), "seconds": list(args.seconds), "height": args.height, "fps": FPS,
                   "codec": "h264 (libx264 veryfast crf 23, keyframe every 30 frames)", "clips": clips,
                   "clips_per_video": args.clips_per_video,
                   "frames_per_clip": FRAMES, "resize": [224, 224], "normalize": "ImageNet mean/std, float32",
                   "batch_size": args.batch_size, "threads_and_workers": args.threads, "timed_epochs": args.epochs},
        "rows": rows, "ratio_headrace_vs_dataloader": rows["headrace"]["clips_per_s"] / base,
        "ratio_headrace_vs_floor": rows["headrace"]["clips_per_s"] / floor_rate if floor_rate else None,
        "decoder_setup_ms": setup,
    }
    if args.device == "cuda":
        import PyNvVideoCodec as nvc

        result["pynvvideocodec"] = getattr(nvc, "__version__", None)
    out = Path(args.json) if args.json else RESULTS / f"video-{args.device}-{result['date']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
