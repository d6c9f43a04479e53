"""Video clips: ``DecodeClip``, a ``Map`` stage over ``readers.video`` samples.

It runs in the loader's threads, one clip per call. On the CPU: open the file with PyAV (FFmpeg),
seek to the keyframe at or before the clip's first frame, decode forward and keep the clip's
frames, found by timestamp (H.264 in AVI, which has no presentation timestamps: by the order the
decoder gives them, from an IDR frame). With ``device="cuda"``: NVDEC through PyNvVideoCodec (``_video_gpu``),
frames by number, kept on the GPU. One set of random numbers per clip (crop offsets, flip) applies
to all its frames, the same on either device.
"""

from __future__ import annotations

import heapq
import io
import threading
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch

from headrace._errors import ConfigError, DecodeError, TransformError, is_int, require_int, require_number

from ._pipeline import Pipeline
from ._stages import Map, Stage
from ._video_gpu import NvdecClips, clip_indices, resolve_video_device

__all__ = ["DecodeClip", "decode_frames", "video_pipeline"]

Layout = Literal["FCHW", "FHWC"]


class DecodeClip(Map):
    """Decode a ``readers.video`` sample's clip into a uint8 tensor ``[F, C, H, W]`` (or ``[F, H, W, C]``).

    ``size``: resize every frame to ``(h, w)`` (an int for a square), bilinear with antialiasing
    (torch's), before the crop; None keeps the file's size. ``crop``: a random ``(h, w)`` window,
    the same for all frames of a clip; ``flip``: the chance that a clip is mirrored left to right,
    all its frames together. The numbers come from the stage's ``rng`` (seed, epoch, stage, the
    clip's index), so a seed gives the same clips whatever the thread count or resume point.

    The sample's fields become ``video`` (the tensor), ``start`` (the first frame's index),
    ``timestamps`` (float64 ``[F]``, the frames' presentation times in seconds on the stream's
    clock), ``path`` (the file), and the fields the reader gave besides (``cls`` for the label);
    ``clip`` and ``pts`` are consumed. A sample of tar shards carries the video's bytes in
    ``video`` and its name (``"<shard>:<member>"``) in ``path``; it decodes the same. Frames are found by the timestamps the reader's probe
    recorded (``pts``); without them (fields built by hand) frame ``k`` is the one at
    ``start_time + k / average_rate``, which holds for constant frame rate only.

    A file that cannot be opened or decoded, or that does not deliver every frame of the clip
    (truncated, corrupt), fails the sample with a ``DecodeError`` naming its key and file; a crop
    larger than the frame with a ``TransformError``. Raises ConfigError for a wrong argument.

    ``device``: ``"cpu"`` (PyAV in the loader's threads), ``"cuda"`` / ``"cuda:N"`` (NVDEC through
    PyNvVideoCodec, the ``video-gpu`` extra: ``video`` is a CUDA tensor, resized, cropped and
    flipped by torch on the GPU; use it with ``Loader(device="cuda")``, which stacks the clips
    there), or ``"auto"`` (the GPU when torch sees one and PyNvVideoCodec imports). On the GPU,
    frames are taken by number (a frame's rank in presentation order, as the reader numbers them)
    and checked against the probe's timestamps; a video NVDEC cannot open, that gives fewer
    frames, frames numbered otherwise than the probe's, or more than 8 bits per sample, fails its
    sample with a ``DecodeError`` (decode such videos on the CPU). Each thread keeps a CUDA stream
    and ``decoders_per_thread`` decoders; a call returns once its clip is complete on the GPU.
    Raises ConfigError for ``"cuda"`` without PyNvVideoCodec or a GPU.
    """

    def __init__(self, size: int | Sequence[int] | None = None, *, layout: Layout = "FCHW", flip: float = 0.0,
                 crop: int | Sequence[int] | None = None, device: str = "cpu", decoders_per_thread: int = 2,
                 name: str | None = None) -> None:
        self.size = _pair("size", size)
        self.crop = _pair("crop", crop)
        if layout not in ("FCHW", "FHWC"):
            raise ConfigError(f"DecodeClip: layout must be 'FCHW' or 'FHWC', got {layout!r}")
        self.flip = require_number("DecodeClip: flip", flip, 0.0, 1.0, wanted="a probability in [0, 1]")
        decoders_per_thread = require_int("DecodeClip: decoders_per_thread", decoders_per_thread)
        self.layout = layout
        self.device = resolve_video_device(device)
        self._gpu = NvdecClips(self.device, decoders_per_thread) if self.device != "cpu" else None
        self._turns: dict[str, int] = {}  # the GPU path: each video's quarter turns (its display matrix), probed once
        self._turns_lock = threading.Lock()
        super().__init__(self._decode_clip, name=name or "DecodeClip")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_turns_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _turns_lock=threading.Lock())

    def _decode_clip(self, fields: dict[str, Any], rng: np.random.Generator, key: str) -> dict[str, Any]:
        video = fields.get("video")
        clip = fields.get("clip")
        if not isinstance(video, (str, bytes)) or clip is None:
            raise TransformError("DecodeClip needs a readers.video sample (a 'video' path or bytes and a 'clip')",
                                 key=key)
        # A tar member's bytes come with their name ("<shard>:<member>") in 'path'.
        path = video if isinstance(video, str) else str(fields.get("path") or "<bytes>")
        start, stride, length = (int(v) for v in clip)
        out = {name: value for name, value in fields.items() if name not in ("clip", "pts")}
        if self._gpu is not None:
            tensor, stamps = self._decode_gpu(video, path, start, stride, length, fields, rng, key)
        else:
            frames, stamps = decode_frames(video, start, stride, length, fields.get("pts"), key=key, source=path)
            tensor = self._augment(torch.from_numpy(frames).permute(0, 3, 1, 2), rng, key, path)
        out.update(video=tensor, start=start, timestamps=stamps, path=path)
        return out

    def _decode_gpu(self, video: str | bytes, path: str, start: int, stride: int, length: int, fields: dict[str, Any],
                    rng: np.random.Generator, key: str) -> tuple[torch.Tensor, np.ndarray]:
        """The clip decoded by NVDEC and augmented on this thread's stream; see ``_video_gpu`` for the ordering."""
        gpu = self._gpu
        assert gpu is not None
        pts = fields.get("pts")
        turns = self._quarter_turns(video, path, key)
        caller = torch.cuda.current_stream(gpu.device)
        stream = gpu.stream()
        with torch.cuda.device(gpu.device), torch.cuda.stream(stream):
            clip, rate = gpu.frames(video, path, clip_indices(start, stride, length), pts, key=key)
            if turns:
                clip = torch.rot90(clip, turns, dims=(2, 3))
            clip = self._augment(clip, rng, key, path)
        stream.synchronize()  # the copy out of the decoder's buffers and the clip are done (see _video_gpu)
        clip.record_stream(caller)
        if "timestamps" in fields:  # the reader's: the probe's pts in seconds
            stamps = np.asarray(fields["timestamps"], np.float64)
        else:  # fields built by hand: constant frame rate's rule, as on the CPU
            stamps = np.asarray(clip_indices(start, stride, length), np.float64) / (rate or float("nan"))
        return clip, stamps

    def _quarter_turns(self, video: str | bytes, path: str, key: str) -> int:
        """The quarter turns counter-clockwise that the video's display matrix asks for (NVDEC ignores
        it), read once per video with PyAV, which also refuses what NVDEC would get wrong (``gpu_precheck``)."""
        turns = self._turns.get(path)
        if turns is None:
            turns = gpu_precheck(video, key=key, source=path)
            with self._turns_lock:
                self._turns[path] = turns
        return turns

    def _augment(self, clip: torch.Tensor, rng: np.random.Generator, key: str, path: str) -> torch.Tensor:
        """``[F, C, H, W]`` uint8 frames (on the CPU or the GPU) resized, cropped and flipped alike,
        in the stage's layout."""
        if self.size is not None and tuple(clip.shape[2:]) != self.size:
            scaled = torch.nn.functional.interpolate(clip.float(), size=self.size, mode="bilinear",
                                                     align_corners=False, antialias=True)
            clip = scaled.round_().clamp_(0, 255).to(torch.uint8)
        draws = rng.random(3)  # always three, so the stream of draws does not depend on the options
        if self.crop is not None:
            (h, w), (ch, cw) = clip.shape[2:], self.crop
            if ch > h or cw > w:
                raise TransformError(f"DecodeClip: crop {self.crop} is larger than the frame ({h}, {w})",
                                     key=key, source=path)
            top, left = int(draws[0] * (h - ch + 1)), int(draws[1] * (w - cw + 1))
            clip = clip[:, :, top : top + ch, left : left + cw]
        if draws[2] < self.flip:
            clip = clip.flip(3)
        clip = clip.permute(0, 2, 3, 1) if self.layout == "FHWC" else clip
        return clip.contiguous()

    def __repr__(self) -> str:
        device = f", device={self.device!r}" if self.device != "cpu" else ""
        return f"DecodeClip(size={self.size}, layout={self.layout!r}, flip={self.flip}, crop={self.crop}{device})"


def decode_frames(path: str | bytes, start: int, stride: int, length: int, pts: np.ndarray | None = None, *,
                  key: str | None = None, source: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Frames ``start, start + stride, ...`` (``length`` of them) of ``path``'s first video stream
    as RGB uint8 ``[F, H, W, C]``, and their timestamps in seconds. ``path`` is a file or a
    video's bytes; ``source`` names it in errors (default: the path).

    ``pts``: the frames' timestamps in stream units (from ``readers.video``'s probe); without
    them they are computed from the stream's average rate. Seeks to the keyframe at or before
    the first frame and decodes forward, no further than the last. H.264 in AVI (decode-order
    timestamps only) is numbered by the decoder's output order from an IDR frame at or before the
    clip, or from the stream's start (``_collect_in_output_order``). A frame whose display matrix
    says to rotate it by a multiple of 90 degrees is returned turned upright (``upright``); a
    mirrored or other rotation is refused. Raises DecodeError naming ``key`` and ``path`` if the
    file cannot deliver them all, or if its decoded frames' timestamps go back (another container
    without presentation timestamps).
    """
    from headrace.readers._video_probe import import_av

    av = import_av()
    if isinstance(path, bytes):
        path, source = io.BytesIO(path), source or "<bytes>"
    else:
        source = source or path
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise DecodeError("no video stream", key=key, source=source)
            stream = container.streams.video[0]
            wanted = _wanted_pts(stream, start, stride, length) if pts is None else [int(p) for p in pts]
            frames = (_collect_in_output_order if _avi_h264(container, stream) else _collect)(container, stream, wanted)
            time_base = float(stream.time_base)
    except DecodeError as exc:
        if exc.source is not None:
            raise
        raise DecodeError(exc.message, key=key, source=source) from exc  # one raised below, without the file's name
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise DecodeError(f"cannot decode video: {exc}", key=key, source=source) from exc
    missing = [start + stride * k for k, frame in enumerate(frames) if frame is None]
    if missing:
        raise DecodeError(f"the file delivered {length - len(missing)} of the clip's {length} frames "
                          f"(frames {missing[:4]}{' ...' if len(missing) > 4 else ''} missing: truncated or corrupt?)",
                          key=key, source=source)
    return np.stack(frames), np.asarray(wanted, np.float64) * time_base


def upright(frame: Any) -> np.ndarray:
    """A decoded frame as RGB ``[H, W, C]``, turned as its display matrix says (phones store portrait
    video as landscape frames plus a rotation tag): a rotation by a multiple of 90 degrees is
    applied; a mirrored matrix or another angle raises DecodeError (the caller names the file)."""
    pixels = frame.to_ndarray(format="rgb24")
    turns = quarter_turns(frame)
    return np.ascontiguousarray(np.rot90(pixels, turns)) if turns else pixels


def quarter_turns(frame: Any) -> int:
    """The quarter turns counter-clockwise (0-3) a decoded frame's display matrix asks for; a
    mirrored matrix or an angle not a multiple of 90 raises DecodeError (the caller names the file)."""
    # By name: iterating ``side_data`` yields the entries up to PyAV 18 and their types from 19 on,
    # while a lookup by name is the same in both.
    matrix = frame.side_data.get("DISPLAYMATRIX")
    if matrix is None:
        return 0
    a, b, _, c, d, _, _, _, _ = np.frombuffer(bytes(matrix), np.int32)  # 16.16 fixed point, row major
    if int(a) * int(d) - int(b) * int(c) < 0:
        raise DecodeError("the display matrix mirrors the picture; mirrored video is not supported")
    angle = frame.rotation  # counter-clockwise degrees, as FFmpeg's av_display_rotation_get
    if angle % 90:
        raise DecodeError(f"rotation by {angle} degrees is not supported (only multiples of 90)")
    return (angle // 90) % 4


def gpu_precheck(path: str | bytes, *, key: str | None = None, source: str | None = None) -> int:
    """What the GPU path must know of a video before NVDEC decodes it, from its first frame decoded
    with PyAV (once per video: PyNvVideoCodec reports neither): the quarter turns its display matrix
    asks for (``quarter_turns``). Raises DecodeError naming ``key`` and ``source`` for what NVDEC
    would decode wrongly, measured on the H100 with PyNvVideoCodec 2.2.4:

    - more than 8 bits per sample (HEVC Main 10): NVDEC's conversion to 8-bit RGB differed from
      FFmpeg's by a mean of 10.7 levels;
    - Matroska/WebM: PyNvVideoCodec's seek there is not frame-accurate (it warns so), and a clip of
      an MKV came back with a wrong frame although its timestamps matched;
    - a mirrored display matrix or an angle not a multiple of 90 (as on the CPU).

    Decode such videos with ``device="cpu"``.
    """
    from headrace.readers._video_probe import import_av

    av = import_av()
    opened, source = (io.BytesIO(path), source or "<bytes>") if isinstance(path, bytes) else (path, source or path)
    try:
        with av.open(opened) as container:
            if not container.streams.video:
                raise DecodeError("no video stream")
            if "matroska" in container.format.name:
                raise DecodeError("Matroska/WebM on the GPU path: PyNvVideoCodec's seek there is not frame-accurate "
                                  "(a clip came back with a wrong frame); decode it with device='cpu'")
            for frame in container.decode(container.streams.video[0]):
                bits = max(c.bits for c in frame.format.components)
                if bits > 8:
                    raise DecodeError(f"{bits}-bit video ({frame.format.name}) on the GPU path: NVDEC's 8-bit RGB "
                                      "differs from FFmpeg's (mean 10.7 levels measured); decode it with device='cpu'")
                return quarter_turns(frame)
    except DecodeError as exc:
        raise DecodeError(exc.message, key=key, source=source) from exc
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise DecodeError(f"cannot decode video: {exc}", key=key, source=source) from exc
    raise DecodeError("the video stream has no frames", key=key, source=source)


def _wanted_pts(stream: Any, start: int, stride: int, length: int) -> list[int]:
    """Frame timestamps at the stream's average rate: constant frame rate's rule."""
    rate, time_base = stream.average_rate, stream.time_base
    if not rate or not time_base:
        raise DecodeError("the stream has no frame rate; frames cannot be found without readers.video's pts")
    origin = stream.start_time or 0
    return [origin + round((start + stride * k) / (rate * time_base)) for k in range(length)]


def _collect(container: Any, stream: Any, wanted: list[int]) -> list[np.ndarray | None]:
    """The frames at ``wanted`` timestamps, decoding from the keyframe before the first; from the
    stream's start again if the seek landed past it or at the end, or if a frame is missing (a
    demuxer without an index seeks by searching: MPEG-PS can land past the last frame, or, with
    B-frames, give every packet after the seek a timestamp half a frame off; MPEG-TS past the first keyframe)."""
    slots = {stamp: k for k, stamp in enumerate(wanted)}
    frames: list[np.ndarray | None] = [None] * len(wanted)
    # The retry seeks to 0 rather than to start_time: MPEG-TS seeks by decode time, and its first
    # keyframe's decode time is below start_time (a presentation time), so start_time skips that keyframe.
    for target in (wanted[0], min(0, stream.start_time or 0)):
        container.seek(target, backward=True, any_frame=False, stream=stream)
        first = None
        for frame in _in_presentation_order(container, stream, wanted[-1]):
            first = frame.pts if first is None else first
            k = slots.get(frame.pts)
            if k is not None and frames[k] is None:
                frames[k] = upright(frame)
        if first is not None and first <= wanted[0] and all(f is not None for f in frames):
            return frames  # decoded from the clip's start on
    return frames


# Past the clip's last frame, how many packets more a frame fed before it may take to come out
# of the decoder (H.264 and HEVC hold at most 16 frames for reordering; frame threads add theirs).
_REORDER_PACKETS = 32


def _in_presentation_order(container: Any, stream: Any, end: int) -> Iterator[Any]:
    """The frames decoded from where the last seek landed, checked to come out in increasing
    timestamps, until one at ``end`` or later has come and no packet fed with a timestamp below
    ``end`` is still to come out (at most ``_REORDER_PACKETS`` packets more). Raises DecodeError
    when a frame's timestamp goes back: the timestamps are not presentation times (a container
    without them holding a stream with B-frames), so frames cannot be found by them. Waiting for the
    packets fed below ``end`` is what catches that for a short clip, whose frames can all come out
    before the first one out of order does."""
    unshown: set[int] = set()  # the fed packets' timestamps below end whose frames have not come out
    last: int | None = None
    past = -1  # packets fed since a frame at end or later came out (-1: none has yet)
    for packet in container.demux(stream):
        if past >= 0:
            if not unshown or past >= _REORDER_PACKETS:
                return
            past += 1
        if packet.size and packet.pts is not None and packet.pts < end:
            unshown.add(packet.pts)
        for frame in packet.decode():
            if frame.pts is None:
                raise DecodeError("a decoded frame has no timestamp")
            if last is None:  # packets fed before the first frame out are never shown (an open GOP's leading frames)
                unshown = {stamp for stamp in unshown if stamp > frame.pts}
            elif frame.pts < last:  # the decoder's output is presentation order
                raise DecodeError("decoded frames' timestamps go back (a container without presentation timestamps "
                                  f"holding a {stream.codec_context.name} stream with B-frames?): "
                                  "its frames cannot be found by timestamp")
            last = frame.pts
            unshown.discard(frame.pts)
            yield frame
            if frame.pts >= end and past < 0:
                past = 0


def _avi_h264(container: Any, stream: Any) -> bool:
    """H.264 in AVI: AVI has no presentation timestamps, so the packets' are decode order and a
    decoded frame's ``pts`` is its packet's, not the frame's (with B-frames they come out scrambled)."""
    return "avi" in container.format.name.split(",") and stream.codec_context.name == "h264"


def _collect_in_output_order(container: Any, stream: Any, wanted: list[int]) -> list[np.ndarray | None]:
    """``_collect`` for a stream whose decoded frames carry no presentation timestamp of their own
    (``_avi_h264``). The decoder gives frames in presentation order, so the frame it gives is the
    one with the smallest timestamp among the packets fed and not yet given out: the probe's
    numbering (its timestamps sorted). That holds from an IDR frame (nothing after it in decode
    order is shown before it), so a seek must land on one at or before the clip's first frame;
    else (an open GOP, or landing past it) the decode starts at the stream's start."""
    origin = min(0, stream.start_time or 0)
    target = wanted[0]
    while True:
        container.seek(target, backward=True, any_frame=False, stream=stream)
        frames, landed = _decode_numbered(container, stream, wanted, whole=target <= origin)
        if frames is not None:
            return frames
        stamp, dts = landed
        # AVI seeks by decode time: a keyframe whose decode time is the target's can be shown after it.
        earlier = wanted[0] - (stamp - dts) if dts is not None and stamp > wanted[0] else target
        target = earlier if origin < earlier < target else origin


def _decode_numbered(container: Any, stream: Any, wanted: list[int],
                     whole: bool) -> tuple[list[np.ndarray | None] | None, tuple[int, int | None]]:
    """The frames at ``wanted`` timestamps, numbered as ``_collect_in_output_order`` says, decoding
    from where the last seek landed; None and the landing packet's (timestamp, dts) when it did not
    land on an IDR frame at or before the first wanted one (``whole``: the seek went to the stream's
    start, which is where numbering starts anyway)."""
    slots = {stamp: k for k, stamp in enumerate(wanted)}
    frames: list[np.ndarray | None] = [None] * len(wanted)
    pending: list[int] = []  # a heap: the fed packets' timestamps not yet given to a frame
    landed: tuple[int, int | None] | None = None
    for packet in container.demux(stream):
        if packet.size:  # the last packet (size 0) flushes the decoder
            stamp = packet.pts if packet.pts is not None else packet.dts
            if stamp is None:
                raise DecodeError("a frame has no timestamp; cannot address frames in it")
            if landed is None:
                landed = stamp, packet.dts
                if not whole and (stamp > wanted[0] or not _idr(bytes(packet), stream.codec_context.extradata)):
                    return None, landed
            heapq.heappush(pending, stamp)
        for frame in packet.decode():
            if not pending:
                raise DecodeError("the decoder gave more frames than the file holds")
            number = heapq.heappop(pending)
            if landed is not None and number == landed[0] and not whole and frame.pts not in (None, number):
                return None, landed  # the first frame given is not the IDR frame: number from the stream's start
            k = slots.get(number)
            if k is not None and frames[k] is None:
                frames[k] = upright(frame)
            if number >= wanted[-1]:
                return frames, landed or (0, None)
    if landed is None and not whole:  # the seek landed at the end
        return None, (wanted[0] + 1, None)
    return frames, landed or (0, None)


def _idr(data: bytes, extradata: bytes | None) -> bool:
    """Whether an H.264 packet holds an IDR slice (NAL unit type 5): Annex B start codes, or the
    length prefixes ``extradata`` (an avcC record, first byte 1) says."""
    if extradata and extradata[0] == 1 and len(extradata) > 4:
        size, at = (extradata[4] & 3) + 1, 0
        while at + size < len(data):
            length = int.from_bytes(data[at : at + size], "big")
            if data[at + size] & 0x1F == 5:
                return True
            at += size + length
        return False
    at = data.find(b"\x00\x00\x01")
    while 0 <= at < len(data) - 3:
        if data[at + 3] & 0x1F == 5:
            return True
        at = data.find(b"\x00\x00\x01", at + 3)
    return False


def _pair(name: str, value: int | Sequence[int] | None) -> tuple[int, int] | None:
    if value is None:
        return None
    if is_int(value):  # NumPy's integers too; not a bool (True would be a side of 1)
        value = (value, value)
    if not isinstance(value, Sequence) or len(value) != 2 or not all(is_int(v) and v > 0 for v in value):
        raise ConfigError(f"DecodeClip: {name} must be None, a positive int or (h, w), got {value!r}")
    return int(value[0]), int(value[1])


def video_pipeline(size: int | Sequence[int] | None = None, *, layout: Layout = "FCHW", flip: float = 0.0,
                   crop: int | Sequence[int] | None = None, label: str | None = "cls",
                   stages: Sequence[Stage] = (), device: str = "cpu") -> Pipeline:
    """The pipeline for ``readers.video``: ``DecodeClip`` then your ``stages``, batched as
    ``video`` ``[B, F, C, H, W]`` uint8, ``label`` ``[B]``, ``start`` ``[B]``, ``timestamps``
    ``[B, F]`` float64 and ``path`` (a list of str). ``device="cuda"`` decodes on NVDEC
    (``DecodeClip``'s ``device``): give the loader ``device="cuda"`` too."""
    return Pipeline([DecodeClip(size, layout=layout, flip=flip, crop=crop, device=device), *stages], image=None,
                    label=label, fields=("video", "start", "timestamps", "path"))
