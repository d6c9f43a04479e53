"""What a probe learns of a video without decoding it: every frame's timestamp, the frame rate and
the size (PyAV's demuxer), or the typed error that names the file."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from headrace._errors import ConfigError, DecodeError, LoaderError, ReadError

from ._video_tar import TarMember

__all__ = ["VideoInfo", "import_av", "probe", "probe_or_error"]


def import_av() -> Any:
    """PyAV, imported on first use: video is an optional extra."""
    try:
        import av
    except ImportError as exc:
        raise ConfigError("video needs PyAV: pip install 'headrace[video]' (or pip install av)") from exc
    return av


@dataclass(frozen=True)
class VideoInfo:
    """What a probe learned of a video: its frames' timestamps (in ``time_base`` units, presentation
    order), its average frame rate and its size."""

    pts: np.ndarray
    time_base: float
    fps: float
    width: int
    height: int

    @property
    def frames(self) -> int:
        return len(self.pts)


def probe(path: str | bytes, source: str | None = None) -> VideoInfo:
    """Demux (no decode) the first video stream of ``path`` (a file, or a video's bytes): every
    frame's timestamp, the frame rate and size. ``source``: the name errors give (default: ``path``).

    Raises ReadError naming the file if it cannot be opened (an OS error), DecodeError naming it
    if its content is not a readable video: not a container FFmpeg knows, no video stream, frames
    without timestamps, no frames, or fewer frames than its container lists (truncated).
    """
    av = import_av()
    path, source = (io.BytesIO(path), source or "<bytes>") if isinstance(path, bytes) else (path, source or path)
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise DecodeError("no video stream", source=source)
            stream = container.streams.video[0]
            stamps = []
            packets = 0  # every frame the file holds, shown or not (the container's count includes them all)
            for packet in container.demux(stream):
                if packet.size == 0:  # the demuxer's flush packet
                    continue
                packets += 1
                if packet.is_discard:  # before an MP4 edit list's start (a cut by stream copy): decoded, never shown
                    continue
                stamp = packet.pts if packet.pts is not None else packet.dts
                if stamp is None:
                    raise DecodeError("a frame has no timestamp; cannot address frames in it", source=source)
                stamps.append(stamp)
            if stream.frames and packets < stream.frames:  # the container's index lists more than the file holds
                raise DecodeError(f"truncated: the container lists {stream.frames} frames, {packets} could be read",
                                source=source)
            rate = stream.average_rate
            info = VideoInfo(np.unique(np.asarray(stamps, np.int64)), float(stream.time_base or 0),
                             float(rate) if rate else 0.0, stream.codec_context.width, stream.codec_context.height)
    except (ReadError, DecodeError):
        raise
    except OSError as exc:  # the file (not its content): missing, a folder, no permission
        raise ReadError(f"cannot read video file: {exc}", source=source) from exc
    except (av.error.FFmpegError, ValueError, EOFError) as exc:
        raise DecodeError(f"cannot read video: {exc}", source=source) from exc
    if info.frames == 0:
        raise DecodeError("the video stream has no frames", source=source)
    return info


def probe_or_error(path: str | TarMember | ReadError, data: bytes | None = None) -> VideoInfo | LoaderError:
    """A video's probe or its error (ReadError, DecodeError); ``data``: its bytes, already read (a remote video or member)."""
    if isinstance(path, ReadError):  # its shard could not list it
        return path
    try:
        if isinstance(path, TarMember):
            try:
                return probe(path.read() if data is None else data, source=str(path))
            except (ReadError, DecodeError) as exc:  # the shard is the source; the message names the member
                raise type(exc)(f"member {path.name!r}: {exc.message}", source=path.shard) from exc.__cause__
        return probe(path if data is None else data, source=str(path))
    except (ReadError, DecodeError) as exc:
        return exc
