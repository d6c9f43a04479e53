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
    data, source = (path, source or "<bytes>") if isinstance(path, bytes) else (None, source or path)
    try:
        with av.open(path if data is None else io.BytesIO(data)) as container:
            if not container.streams.video:
                raise DecodeError("no video stream", source=source)
            stream = container.streams.video[0]
            stamps = []
            packets = 0  # every frame the file holds, shown or not (the container's count includes them all)
            slots = 0  # an AVI's chunks up to the last frame read, the empty ones of skipped frames too
            for packet in container.demux(stream):
                if packet.size == 0:  # the demuxer's flush packet
                    continue
                packets += 1
                if packet.dts is not None:
                    slots = max(slots, packet.dts + 1)
                if packet.is_discard:  # before an MP4 edit list's start (a cut by stream copy): decoded, never shown
                    continue
                stamp = packet.pts if packet.pts is not None else packet.dts
                if stamp is None:
                    raise DecodeError("a frame has no timestamp; cannot address frames in it", source=source)
                stamps.append(stamp)
            formats = set(container.format.name.split(","))
            if stream.frames and packets < stream.frames and not (  # the container lists more than the file holds
                    # not truncated: a variable-rate AVI, whose count includes the empty chunk of each skipped
                    # frame (the demuxer gives none; the timestamps, one a chunk, step over them) ...
                    ("avi" in formats and slots >= stream.frames)
                    # ... or an MP4/MOV whose edit list starts past its first GOP: the demuxer drops the GOPs before
                    or ("mov" in formats and _packets_without_edit_list(av, path if data is None else io.BytesIO(data))
                        >= stream.frames)):
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


def _packets_without_edit_list(av: Any, path: Any) -> int:
    """How many packets an MP4/MOV's first video stream holds, its edit list ignored."""
    with av.open(path, options={"ignore_editlist": "1"}) as container:
        return sum(1 for packet in container.demux(container.streams.video[0]) if packet.size)


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
