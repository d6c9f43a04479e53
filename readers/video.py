"""Clips of video files: a class-per-folder tree, or a list of paths with labels.

A sample is one clip, addressed by (video, start frame): ``sequence_length`` frames ``stride``
frames apart, read from the video's start frame ``start``. The reader hands out where the clip is
(the file's path, ``start``, ``stride``, ``sequence_length`` and the frames' timestamps); the
decode is a pipeline stage (``headrace.ops.DecodeClip``), so it runs in the loader's threads.

A frame's index is its rank in presentation order: the video stream's packets, sorted by
timestamp, numbered 0, 1, 2, ... That is exact for variable frame rate too (the k-th frame is
the k-th picture shown, whatever its time), and the probe records each frame's timestamp so the
decoder finds frames by timestamp, not by a frame rate.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import os
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from headrace._errors import ConfigError, ReadError, require_int
from headrace._sample import Sample
from headrace._threads import join_threads

from ._base import IndexedReader

__all__ = ["VIDEO_EXTENSIONS", "VideoInfo", "VideoReader", "import_av", "probe", "video"]

VIDEO_EXTENSIONS = ("mp4", "mkv", "avi", "mov", "webm")


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


def probe(path: str) -> VideoInfo:
    """Demux (no decode) the first video stream of ``path``: every frame's timestamp, the frame rate and size.

    Raises ReadError naming the file if it cannot be opened, has no video stream, has frames
    without timestamps, or holds fewer frames than its container lists (truncated).
    """
    av = import_av()
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ReadError("no video stream", source=path)
            stream = container.streams.video[0]
            stamps = []
            for packet in container.demux(stream):
                if packet.size == 0:  # the demuxer's flush packet
                    continue
                stamp = packet.pts if packet.pts is not None else packet.dts
                if stamp is None:
                    raise ReadError("a frame has no timestamp; cannot address frames in it", source=path)
                stamps.append(stamp)
            if stream.frames and len(stamps) < stream.frames:  # the container's index lists more than the file holds
                raise ReadError(f"truncated: the container lists {stream.frames} frames, {len(stamps)} could be read",
                                source=path)
            rate = stream.average_rate
            info = VideoInfo(np.unique(np.asarray(stamps, np.int64)), float(stream.time_base or 0),
                             float(rate) if rate else 0.0, stream.codec_context.width, stream.codec_context.height)
    except ReadError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as exc:
        raise ReadError(f"cannot read video: {exc}", source=path) from exc
    if info.frames == 0:
        raise ReadError("the video stream has no frames", source=path)
    return info


class VideoReader(IndexedReader):
    """Clips of videos by index; see ``video()``."""

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        labels: Sequence[int],
        *,
        root: Path | None,
        classes: Sequence[str],
        sequence_length: int,
        stride: int,
        step: int | None,
        clips_per_video: int | None,
        shuffle: bool,
        seed: int | None,
        chunk_size: int,
        io_threads: int,
    ) -> None:
        super().__init__(shuffle=shuffle, seed=seed, chunk_size=chunk_size, io_threads=io_threads)
        self.sequence_length = require_int("video: sequence_length", sequence_length)
        self.stride = require_int("video: stride", stride)
        self.span = (sequence_length - 1) * stride + 1  # frames from a clip's first to its last, inclusive
        self.step = require_int("video: step", step) if step is not None else self.span
        self.clips_per_video = require_int("video: clips_per_video", clips_per_video) if clips_per_video is not None else None
        self.paths = [os.fspath(p) for p in paths]
        self.labels = [int(v) for v in labels]
        if len(self.labels) != len(self.paths):
            raise ConfigError(f"video: {len(self.paths)} paths but {len(self.labels)} labels")
        if not self.paths:
            raise ConfigError("video: no videos")
        self.root = root
        self.classes = tuple(classes)
        self._keys = [_relative(p, root) for p in self.paths]
        self._probed = _Probed()  # shared by this reader's shards: one probe for all
        self._epoch = 0
        self._draw_seed = 0

    # -- the clip table --------------------------------------------------------------------------------------

    def probed(self) -> tuple[list[VideoInfo | ReadError], np.ndarray]:
        """Each video's probe (or its ReadError) and the clip table's offsets (video v's clips are
        ``offsets[v]`` to ``offsets[v + 1]``). Probes every video the first time, in ``io_threads`` threads."""
        return self._probed.get(self)

    def _dataset_size(self) -> int:
        return int(self.probed()[1][-1])

    def clip_count(self, info: VideoInfo | ReadError) -> int:
        """Clips a video gives: a failed probe gives one sample (its error); a video shorter than a
        clip's span gives none."""
        if isinstance(info, ReadError):
            return 1
        if info.frames < self.span:
            return 0
        if self.clips_per_video is not None:
            return self.clips_per_video
        return (info.frames - self.span) // self.step + 1

    def clip_start(self, video: int, j: int, info: VideoInfo) -> int:
        """The first frame of video ``video``'s ``j``-th clip in this reader's current epoch."""
        if self.clips_per_video is None:
            return j * self.step
        draw = np.random.default_rng([self._draw_seed, self._epoch, video, j])
        return int(draw.integers(0, info.frames - self.span + 1))

    # -- reading ---------------------------------------------------------------------------------------------

    async def read(self, epoch: int, *, start: int = 0, seed: int = 0,
                   history: Sequence[tuple[int, int]] = ()) -> AsyncIterator[list[Sample]]:
        if not self._probed.done:  # the first epoch probes, off the event loop
            await _in_thread(self.probed)
        view = copy.copy(self)  # this epoch's draws: a copy, so concurrent reads of shards do not share them
        view._epoch, view._draw_seed = epoch, self.seed if self.seed is not None else seed
        async with contextlib.aclosing(IndexedReader.read(view, epoch, start=start, seed=seed,
                                                          history=history)) as chunks:
            async for chunk in chunks:
                yield chunk

    def _fetch(self, indices: Sequence[int]) -> list[Sample]:
        infos, offsets = self.probed()
        videos = np.searchsorted(offsets, indices, side="right") - 1
        out = []
        for i, v in zip(indices, videos.tolist()):
            info, path = infos[v], self.paths[v]
            if isinstance(info, ReadError):
                out.append(Sample(f"{self._keys[v]}@0", {}, path, i, error=_keyed(info, f"{self._keys[v]}@0")))
                continue
            first = self.clip_start(v, i - int(offsets[v]), info)
            frames = info.pts[first : first + self.span : self.stride]
            fields = {
                "video": path,
                "clip": np.array([first, self.stride, self.sequence_length], np.int64),
                "pts": frames,
                "timestamps": frames * info.time_base,
                "cls": self.labels[v],
            }
            out.append(Sample(f"{self._keys[v]}@{first}", fields, path, i))
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "root": str(self.root) if self.root else None,
                "sequence_length": self.sequence_length, "stride": self.stride, "step": self.step,
                "clips_per_video": self.clips_per_video}

    def __repr__(self) -> str:
        where = f"root={str(self.root)!r}" if self.root else f"{len(self.paths)} videos"
        return (f"VideoReader({where}, sequence_length={self.sequence_length}, stride={self.stride}, "
                f"step={self.step}, clips_per_video={self.clips_per_video}, shuffle={self.shuffle}, "
                f"rank={self.rank}/{self.world})")


class _Probed:
    """The probes of a reader's videos, made once (under a lock: ``len()`` may ask from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value: tuple[list[VideoInfo | ReadError], np.ndarray] | None = None

    @property
    def done(self) -> bool:
        return self._value is not None

    def get(self, reader: VideoReader) -> tuple[list[VideoInfo | ReadError], np.ndarray]:
        with self._lock:
            if self._value is None:
                with concurrent.futures.ThreadPoolExecutor(reader.io_threads,
                                                           thread_name_prefix="headrace-io-video-probe") as pool:
                    infos = list(pool.map(_probe_or_error, reader.paths))
                counts = [reader.clip_count(info) for info in infos]
                self._value = infos, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            return self._value


def _probe_or_error(path: str) -> VideoInfo | ReadError:
    try:
        return probe(path)
    except ReadError as exc:
        return exc


def _keyed(error: ReadError, key: str) -> ReadError:
    """The probe's error for one sample of the stream (a copy: the probe's is shared by epochs)."""
    out = ReadError(error.message, key=key, source=error.source)
    out.__cause__ = error.__cause__
    return out


async def _in_thread(fn: Any) -> Any:
    """``fn()`` in a thread of its own, waited out even when cancelled (no thread outlives the read)."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="headrace-io-video")
    job = pool.submit(fn)
    try:
        return await asyncio.wrap_future(job)
    finally:
        pool.shutdown(wait=False)
        await join_threads([job])


def _relative(path: str, root: Path | None) -> str:
    rel = os.path.relpath(path, root) if root is not None else path
    return rel.replace(os.sep, "/")


def video(
    source: str | os.PathLike | Sequence[tuple[str | os.PathLike, int]],
    *,
    sequence_length: int,
    stride: int = 1,
    step: int | None = None,
    clips_per_video: int | None = None,
    shuffle: bool = False,
    seed: int | None = None,
    extensions: Sequence[str] = VIDEO_EXTENSIONS,
    chunk_size: int = 16,
    io_threads: int = 2,
) -> VideoReader:
    """A reader of clips from video files; decode them with ``headrace.ops.DecodeClip`` (needs PyAV).

    ``source`` is a folder whose sub-folders are classes (label = the sub-folder's index in sorted
    order, videos found recursively below it by ``extensions``), or a list of ``(path, label)``.

    Clips, as DALI's video reader has them: a clip is ``sequence_length`` frames, ``stride`` frames
    apart (so it spans ``(sequence_length - 1) * stride + 1`` frames); clips start every ``step``
    frames from frame 0 (default: the span, so clips do not overlap). A clip that would run past
    the video's end is dropped, never padded: a video of ``n`` frames gives
    ``(n - span) // step + 1`` clips, and none if it is shorter than the span. With
    ``clips_per_video=k`` each video gives ``k`` clips at random starts instead, drawn anew each
    epoch from (seed, epoch, video, clip), so a resumed run draws the same ones. A frame's index
    is its rank in presentation order (see the module docstring), exact for variable frame rate.

    Each sample's key is ``"<path relative to the folder>@<start frame>"`` (the path as given for
    a list), its source the file's path, and its fields ``video`` (the path, a str), ``clip``
    (``int64 [start, stride, sequence_length]``), ``pts`` and ``timestamps`` (the clip's frames'
    timestamps in stream units and in seconds) and ``cls`` (the label, an int).

    Every video is probed once (demuxed, not decoded: frame count, timestamps, rate, size), in
    ``io_threads`` threads, when the first epoch starts or ``len()`` is first asked. A video that
    cannot be probed is one sample in the stream carrying a ``ReadError`` naming the file, under
    the loader's ``on_error``. Shuffle, shard, resume (also on another world size) are the files
    reader's: a seeded permutation of all clips each epoch, every ``world``-th clip of it per rank,
    ``read(epoch, start=k)`` continuing at stream position ``k``.

    Raises ReadError if the folder does not exist or holds no videos, ConfigError for a wrong
    argument or if PyAV is missing.
    """
    import_av()
    common: dict[str, Any] = dict(sequence_length=sequence_length, stride=stride, step=step,
                                  clips_per_video=clips_per_video, shuffle=shuffle, seed=seed,
                                  chunk_size=chunk_size, io_threads=io_threads)
    exts = {e.lower().lstrip(".") for e in extensions}
    if isinstance(source, (str, os.PathLike)):
        root = Path(source)
        if not root.is_dir():
            raise ReadError("no such folder", source=str(root))
        classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        paths, labels = [], []
        for label, name in enumerate(classes):
            for p in sorted((root / name).rglob("*")):
                if p.is_file() and p.suffix.lower().lstrip(".") in exts:
                    paths.append(p)
                    labels.append(label)
        if not paths:
            raise ReadError(f"no video files ({', '.join(sorted(exts))}) in class sub-folders", source=str(root))
        return VideoReader(paths, labels, root=root, classes=classes, **common)
    if isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        if not all(isinstance(item, tuple) and len(item) == 2 for item in source):
            raise ConfigError("video: a list source must hold (path, label) tuples")
        return VideoReader([p for p, _ in source], [c for _, c in source], root=None, classes=(), **common)
    raise ConfigError(f"video: source must be a folder or a list of (path, label), got {type(source).__name__}")
