"""Videos for the GPU video tests (a plain module: the tests import it by name)."""

from __future__ import annotations

from pathlib import Path

import av
import torch
from sample_data import make_video, rotated_video

# GPU frames against the CPU path's (PyAV rgb24) frames of the same clip, per frame: NVDEC's
# colour conversion is not FFmpeg's. Measured on the H100: max 4-5, mean 0.01 at 720p.
MAX_DIFF, MEAN_DIFF = 8, 0.5
# After a resize (torch's antialiased bilinear on each device) rounding at .5 moves many pixels by
# one level: measured on the H100, 128x96 -> 48x64 then a 32x32 crop: max 2, mean 0.515.
RESIZED_MEAN_DIFF = 1.0
W, H = 128, 96  # NVDEC's smallest H.264 frame is 48x16; HEVC's 144x144


def diff(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    d = (a.cpu().to(torch.int16) - b.cpu().to(torch.int16)).abs()
    return int(d.max()), float(d.float().mean())


def close(a: torch.Tensor, b: torch.Tensor, mean_bound: float = MEAN_DIFF) -> bool:
    worst, mean = diff(a, b)
    return worst <= MAX_DIFF and mean <= mean_bound


async def read_all(reader, epoch=0) -> list:
    return [s async for chunk in reader.read(epoch) for s in chunk]


def rotated(path: Path, degrees: int, *, hflip: bool = False) -> Path:
    """``sample_data.rotated_video`` at this module's frame size."""
    return rotated_video(path, degrees, hflip=hflip, width=W, height=H)


def hevc_10bit(path: Path, frames: int = 24) -> Path | None:
    """An HEVC Main 10 video (yuv420p10le) of ``make_video``'s pictures, or None without libx265."""
    if "libx265" not in av.codecs_available:
        return None
    plain = make_video(path.with_suffix(".plain.mp4"), frames, width=192, height=160)
    with av.open(str(plain)) as src, av.open(str(path), "w") as out:
        stream = out.add_stream("libx265", rate=25, options={"x265-params": "log-level=error:keyint=8"})
        stream.width, stream.height, stream.pix_fmt = 192, 160, "yuv420p10le"
        for frame in src.decode(video=0):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame.to_ndarray(format="rgb24"), format="rgb24")))
        out.mux(stream.encode())
    return path
