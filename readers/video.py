"""Clips of videos: a class-per-folder tree, a list of paths with labels, or WebDataset tar shards.

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
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from headrace._errors import ConfigError, LoaderError, ReadError, require_int
from headrace._sample import Sample
from headrace._threads import join_threads

from ._base import IndexedReader, check_order, int_label
from .files import class_folders, extension_set
from ._shards import resolve_shards
from ._storage import Storage, Store, is_url
from ._tar import split_name
from ._video_probe import VideoInfo, import_av, probe, probe_or_error
from ._video_tar import TarMember, list_shard

__all__ = ["VIDEO_EXTENSIONS", "RemoteVideo", "TarMember", "VideoInfo", "VideoReader", "import_av", "probe", "video"]

VIDEO_EXTENSIONS = ("mp4", "mkv", "avi", "mov", "webm")
_SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")  # what readers.webdataset takes from a folder


@dataclass(frozen=True)
class RemoteVideo:
    """A video file in object storage: object ``key`` of ``store``; ``url`` names it (no credentials)."""

    url: str
    store: Store
    key: str

    def __str__(self) -> str:
        return self.url


class VideoReader(IndexedReader):
    """Clips of videos by index; see ``video()``."""

    def __init__(
        self,
        paths: Sequence[str | os.PathLike | TarMember | RemoteVideo | ReadError],
        labels: Sequence[int | None],
        *,
        root: Path | str | None,
        classes: Sequence[str],
        sequence_length: int,
        stride: int,
        step: int | None,
        clips_per_video: int | None,
        shuffle: bool,
        seed: int | None,
        chunk_size: int,
        io_threads: int,
        storage: Storage | None = None,
        probes: Sequence[VideoInfo | LoaderError] | None = None,
    ) -> None:
        check_order(shuffle, seed, "video")  # named for the video reader before the base class checks them
        super().__init__(shuffle=shuffle, seed=seed, chunk_size=chunk_size, io_threads=io_threads)
        self.sequence_length = require_int("video: sequence_length", sequence_length)
        self.stride = require_int("video: stride", stride)
        self.span = (self.sequence_length - 1) * self.stride + 1  # frames from a clip's first to its last, inclusive
        self.step = require_int("video: step", step) if step is not None else self.span
        self.clips_per_video = require_int("video: clips_per_video", clips_per_video) if clips_per_video is not None else None
        # A video is a file's path, a tar member, an object in storage, or the ReadError of a member
        # its shard could not list.
        self.paths = [p if isinstance(p, (TarMember, RemoteVideo, ReadError)) else os.fspath(p) for p in paths]
        if len(labels) != len(self.paths):
            raise ConfigError(f"video: {len(self.paths)} paths but {len(labels)} labels")
        self.labels = [None if v is None else int_label(v, "video", _source(p)) for v, p in zip(labels, self.paths)]
        if not self.paths:
            raise ConfigError("video: no videos")
        self.root = root
        self.classes = tuple(classes)
        self.shards = sorted({p.shard for p in self.paths if isinstance(p, TarMember)})
        self._keys = [_key(p, root) for p in self.paths]
        self._probed = _Probed(probes)  # shared by this reader's shards: one probe for all
        # Videos in object storage are fetched on the event loop (``_video_store``), as readers.files does.
        self.storage = storage
        self._fetch_on_loop = storage is not None
        self._epoch = 0
        self._draw_seed = 0
        self._drawn: dict[int, np.ndarray] = {}  # each video's starts in this reader's epoch (clips_per_video)

    # -- the clip table --------------------------------------------------------------------------------------

    def probed(self) -> tuple[list[VideoInfo | LoaderError], np.ndarray]:
        """Each video's probe (or its ReadError or DecodeError) and the clip table's offsets (video v's clips are
        ``offsets[v]`` to ``offsets[v + 1]``). Probes every video the first time, in ``io_threads`` threads."""
        return self._probed.get(self)

    def _dataset_size(self) -> int:
        return int(self.probed()[1][-1])

    def clip_count(self, info: VideoInfo | LoaderError) -> int:
        """Clips a video gives: a failed probe gives one sample (its error); a video shorter than a
        clip's span gives none."""
        if isinstance(info, LoaderError):
            return 1
        if info.frames < self.span:
            return 0
        if self.clips_per_video is not None:  # distinct starts: every one when the video has fewer
            return min(self.clips_per_video, info.frames - self.span + 1)
        return (info.frames - self.span) // self.step + 1

    def clip_start(self, video: int, j: int, info: VideoInfo) -> int:
        """The first frame of video ``video``'s ``j``-th clip in this reader's current epoch. With
        ``clips_per_video``: the ``j``-th smallest of the video's starts drawn without replacement,
        uniformly from every start a clip fits at, by (seed, epoch, video) alone, so every rank and
        a resumed run draw the same."""
        if self.clips_per_video is None:
            return j * self.step
        starts = self._drawn.get(video)
        if starts is None:
            fits = info.frames - self.span + 1
            draw = np.random.default_rng([self._draw_seed, self._epoch, video])
            starts = np.sort(draw.choice(fits, min(self.clips_per_video, fits), replace=False))
            self._drawn[video] = starts  # threads may race here: they store the same draw
        return int(starts[j])

    # -- reading ---------------------------------------------------------------------------------------------

    async def read(self, epoch: int, *, start: int = 0, seed: int = 0,
                   history: Sequence[tuple[int, int]] = ()) -> AsyncIterator[list[Sample]]:
        if not self._probed.done:  # the first epoch probes, off the event loop
            await _in_thread(self.probed)
        view = copy.copy(self)  # this epoch's draws: a copy, so concurrent reads of shards do not share them
        view._epoch, view._draw_seed = epoch, self.seed if self.seed is not None else seed
        view._drawn = {}
        async with contextlib.aclosing(IndexedReader.read(view, epoch, start=start, seed=seed,
                                                          history=history)) as chunks:
            async for chunk in chunks:
                yield chunk

    def _videos_of(self, indices: Sequence[int]) -> list[int]:
        """The video of each clip index."""
        return (np.searchsorted(self.probed()[1], indices, side="right") - 1).tolist()

    def _fetch(self, indices: Sequence[int]) -> list[Sample]:
        data: dict[int, bytes | ReadError] = {}  # a tar member read once per chunk, whatever its clips here
        for v in set(self._videos_of(indices)):
            path = self.paths[v]
            if isinstance(path, TarMember):
                try:
                    data[v] = path.read()
                except (ReadError, OSError) as exc:
                    data[v] = ReadError(f"cannot read member {path.name!r}: {exc}", source=path.shard)
        return self._samples(indices, data)

    def connections(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The storage's session for videos in a store (``Reader.connections``); local ones hold none."""
        if self.storage is None:  # only ``video()`` over URLs or ``store=`` gives a reader storage
            return super().connections()
        return self.storage.session()

    def _io_session(self) -> Any:
        assert self.storage is not None
        return self.storage.session()

    async def _fetch_async(self, indices: Sequence[int]) -> list[Sample]:
        from ._video_store import fetch_videos

        assert self.storage is not None
        infos = self.probed()[0]
        wanted = sorted({v for v in self._videos_of(indices) if isinstance(infos[v], VideoInfo)})
        return self._samples(indices, await fetch_videos([self.paths[v] for v in wanted], wanted, self.storage,
                                                         self.io_threads + 1))

    def _samples(self, indices: Sequence[int], data: dict[int, bytes | ReadError]) -> list[Sample]:
        """The clips' samples; ``data``: the bytes of the chunk's videos that are not local files."""
        infos, offsets = self.probed()
        out = []
        for i, v in zip(indices, self._videos_of(indices)):
            info, path = infos[v], self.paths[v]
            name = _source(path)
            if isinstance(info, LoaderError):
                out.append(Sample(f"{self._keys[v]}@0", {}, name, i, error=_keyed(info, f"{self._keys[v]}@0")))
                continue
            first = self.clip_start(v, i - int(offsets[v]), info)
            key = f"{self._keys[v]}@{first}"
            video = data[v] if v in data else path
            if isinstance(video, ReadError):
                out.append(Sample(key, {}, name, i, error=_keyed(video, key)))
                continue
            frames = info.pts[first : first + self.span : self.stride]
            fields = {
                "video": video,
                "clip": np.array([first, self.stride, self.sequence_length], np.int64),
                "pts": frames,
                "timestamps": frames * info.time_base,
            }
            if not isinstance(path, str):
                fields["path"] = name  # what DecodeClip names the bytes by: "<shard>:<member>" or the URL
            if self.labels[v] is not None:
                fields["cls"] = self.labels[v]
            out.append(Sample(key, fields, name, i))
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "root": str(self.root) if self.root else None, "shards": len(self.shards),
                "sequence_length": self.sequence_length, "stride": self.stride, "step": self.step,
                "clips_per_video": self.clips_per_video}

    def __repr__(self) -> str:
        where = (f"root={str(self.root)!r}" if self.root else
                 f"{len(self.shards)} shards, {len(self.paths)} videos" if self.shards else f"{len(self.paths)} videos")
        return (f"VideoReader({where}, sequence_length={self.sequence_length}, stride={self.stride}, "
                f"step={self.step}, clips_per_video={self.clips_per_video}, shuffle={self.shuffle}, "
                f"rank={self.rank}/{self.world})")


class _Probed:
    """The probes of a reader's videos, made once (under a lock: ``len()`` may ask from any thread)."""

    def __init__(self, probes: Sequence[VideoInfo | LoaderError] | None = None) -> None:
        self._lock = threading.Lock()
        self._value: tuple[list[VideoInfo | LoaderError], np.ndarray] | None = None
        self._given = list(probes) if probes is not None else None  # made while listing remote shards

    @property
    def done(self) -> bool:
        return self._value is not None

    def get(self, reader: VideoReader) -> tuple[list[VideoInfo | LoaderError], np.ndarray]:
        with self._lock:
            if self._value is None:
                if self._given is not None:
                    infos = self._given
                elif reader.storage is not None:
                    from ._video_store import probe_remote

                    infos = probe_remote(reader.paths, reader.storage, reader.io_threads)
                else:
                    with concurrent.futures.ThreadPoolExecutor(reader.io_threads,
                                                               thread_name_prefix="headrace-io-video-probe") as pool:
                        infos = list(pool.map(probe_or_error, reader.paths))
                counts = [reader.clip_count(info) for info in infos]
                self._value = infos, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            return self._value


def _keyed(error: LoaderError, key: str) -> LoaderError:
    """The probe's error for one sample of the stream (a copy: the probe's is shared by epochs)."""
    out = type(error)(error.message, key=key, source=error.source)  # a StorageError stays one
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
        pool.shutdown(wait=True)  # the job is done: this waits only for its thread to exit


def _key(path: str | TarMember | RemoteVideo | ReadError, root: Path | str | None) -> str:
    """A video's part of its clips' keys: the member's WebDataset key, or the file's path (relative
    to the folder; an object's URL relative to the bucket prefix)."""
    if isinstance(path, ReadError):
        return path.key or ""
    if isinstance(path, TarMember):
        return (split_name(path.name) or (path.name, ""))[0]
    if isinstance(path, RemoteVideo):
        return path.url[len(root):].lstrip("/") if isinstance(root, str) and path.url.startswith(root) else path.url
    rel = os.path.relpath(path, root) if root is not None else path
    return rel.replace(os.sep, "/")


def _source(path: str | TarMember | RemoteVideo | ReadError) -> str:
    return path.source or "" if isinstance(path, ReadError) else str(path)


def video(
    source: str | os.PathLike | Sequence[tuple[str | os.PathLike, int]] | Sequence[str | os.PathLike],
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
    storage_options: Mapping[str, Any] | None = None,
    store: Store | None = None,
) -> VideoReader:
    """A reader of clips from video files; decode them with ``headrace.ops.DecodeClip`` (needs PyAV).

    ``source`` is a folder whose sub-folders are classes (label = the sub-folder's index in sorted
    order, videos found recursively below it by ``extensions``), a list of ``(path, label)``, or
    WebDataset tar shards as ``readers.webdataset`` takes local ones: a folder holding ``*.tar``
    files, a glob or brace pattern, a shard's path, or a list of shard paths (plain strings).

    In shards, a sample ``<key>.mp4`` (any of ``extensions``) is a video; its label is the
    ``<key>.cls`` member's ASCII digits, or none (the sample has no ``cls`` field: use
    ``Pipeline(label=None)``). Each shard's headers are listed once (data seeked over), each
    video member read and probed once. A clip's sample carries its member's bytes in ``video``
    (read in the reader's I/O threads, by the offset the listing found) and ``path``
    (``"<shard>:<member>"``); ``DecodeClip`` decodes the bytes as it does a file. Bytes rather
    than a (shard, offset, size) reference read at decode time, because it is the simpler
    correct design: the I/O stays in the reader's threads with its read-ahead and cancellation,
    the decode stage stays a function of the sample alone (no file handles in the decode
    threads), and a chunk holds at most ``chunk_size`` members' bytes (mp4 members of a few MB).
    Shards must be uncompressed (gzip is a ConfigError: members are read by offset).

    Clips, as DALI's video reader has them: a clip is ``sequence_length`` frames, ``stride`` frames
    apart (so it spans ``(sequence_length - 1) * stride + 1`` frames); clips start every ``step``
    frames from frame 0 (default: the span, so clips do not overlap). A clip that would run past
    the video's end is dropped, never padded: a video of ``n`` frames gives
    ``(n - span) // step + 1`` clips, and none if it is shorter than the span. With
    ``clips_per_video=k`` each video gives ``k`` clips at distinct random starts instead (drawn
    without replacement, uniformly from the ``n - span + 1`` starts a clip fits at, ``step``
    unused), in increasing order; a video with fewer than ``k`` such starts gives each of them
    once, so an epoch never repeats a clip and its length is the same every epoch. They are drawn
    anew each epoch from (seed, epoch, video), so every rank and a resumed run draw the same ones. A frame's index
    is its rank in presentation order (see the module docstring), exact for variable frame rate.

    Each sample's key is ``"<path relative to the folder>@<start frame>"`` (the path as given for
    a list; the member's WebDataset key for shards), its source the file's path (for shards
    ``"<shard>:<member>"``), and its fields ``video`` (the path, a str), ``clip``
    (``int64 [start, stride, sequence_length]``), ``pts`` and ``timestamps`` (the clip's frames'
    timestamps in stream units and in seconds) and ``cls`` (the label, an int).

    Every video is probed once (demuxed, not decoded: frame count, timestamps, rate, size), in
    ``io_threads`` threads, when the first epoch starts or ``len()`` is first asked. A video that
    cannot be probed is one sample in the stream carrying an error naming the file, under the
    loader's ``on_error``: a ``DecodeError`` when its content is not a whole video (not a
    container FFmpeg reads, no video stream, truncated), a ``ReadError`` when the file itself
    cannot be read; so is a shard cut off or corrupt at some member (a ``ReadError``
    naming the shard and that member, after the videos listed before it) and a ``.cls`` member
    that is not digits (in place of its video). Shuffle, shard, resume (also on another world size) are the files
    reader's: a seeded permutation of all clips each epoch, every ``world``-th clip of it per rank,
    ``read(epoch, start=k)`` continuing at stream position ``k``.

    Object storage (``s3://``, ``http(s)://``, or any path with ``store=``; ``storage_options``
    as for ``readers.webdataset``): the folder may be a bucket prefix ending in ``/`` (listed once,
    here: a class-per-folder tree of videos), the list's paths URLs, and the shards URLs (a list,
    a brace pattern, or a glob where the store lists). PyAV needs to seek, so each video is fetched
    whole and probed and decoded from memory: a shard is downloaded whole here, once, to list and
    probe its members; a video file once when the first epoch starts, to probe it; then every chunk
    of clips fetches each of its videos (a member: its byte range) again, on the event loop, ``io_threads
    + 1`` at once, each retried (a clip whose video cannot be fetched carries a ``StorageError``).
    Local and remote sources cannot be mixed in one reader.

    Raises ReadError if the folder does not exist or holds no videos, ConfigError for a wrong
    argument or if PyAV is missing.
    """
    import_av()
    common: dict[str, Any] = dict(sequence_length=sequence_length, stride=stride, step=step,
                                  clips_per_video=clips_per_video, shuffle=shuffle, seed=seed,
                                  chunk_size=chunk_size, io_threads=io_threads)
    exts = extension_set("video", extensions)
    if store is not None or _has_url(source):
        return _remote(source, Storage(storage_options, store), exts, common)
    if storage_options:
        raise ConfigError("video: storage_options are for s3:// and http(s):// sources (or store=)")
    if _is_shards(source):
        entries: list[TarMember | ReadError] = []
        labels: list[int | None] = []
        for shard in resolve_shards(source):  # type: ignore[arg-type]
            found, found_labels = list_shard(shard, exts)
            entries += found
            labels += found_labels
        if not entries:
            raise ReadError(f"no video members ({', '.join(sorted(exts))}) in the shards", source=str(source))
        return VideoReader(entries, labels, root=None, classes=(), **common)
    if isinstance(source, (str, os.PathLike)):
        root = Path(source)
        if not root.is_dir():
            raise ReadError("no such folder", source=str(root))
        classes, paths, labels = class_folders(root, exts)
        if not paths:
            raise ReadError(f"no video files ({', '.join(sorted(exts))}) in class sub-folders", source=str(root))
        return VideoReader(paths, labels, root=root, classes=classes, **common)
    if isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        if not all(isinstance(item, tuple) and len(item) == 2 for item in source):
            raise ConfigError("video: a list source must hold (path, label) tuples")
        return VideoReader([p for p, _ in source], [c for _, c in source], root=None, classes=(), **common)
    raise ConfigError(f"video: source must be a folder, a list of (path, label) or tar shards, got {type(source).__name__}")


def _has_url(source: Any) -> bool:
    if isinstance(source, (str, os.PathLike)):
        return is_url(os.fspath(source))
    if isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        return any(_has_url(item[0] if isinstance(item, tuple) and item else item) for item in source)
    return False


def _remote(source: Any, storage: Storage, exts: set[str], common: dict[str, Any]) -> VideoReader:
    """``video()`` over object storage (see there); the fetching is ``_video_store``'s."""
    from . import _video_store as remote

    if isinstance(source, Sequence) and not isinstance(source, (str, bytes, bytearray)):
        items = [item[0] if isinstance(item, tuple) and item else item for item in source]
        if storage.store is None and not all(isinstance(p, str) and is_url(p) for p in items):
            raise ConfigError("video: a source mixes local paths and URLs; give one or the other")
    if isinstance(source, str) and source.endswith("/"):
        root, classes, videos, labels = remote.bucket_class_folders(source, storage, exts)
        return VideoReader(videos, labels, root=root, classes=classes, storage=storage, **common)
    if _is_shards(source):
        urls = resolve_shards(source, storage)
        entries, found, probes = remote.list_remote_shards(urls, storage, exts, common["io_threads"])
        if not any(isinstance(e, TarMember) for e in entries) and not any(isinstance(e, ReadError) for e in entries):
            raise ReadError(f"no video members ({', '.join(sorted(exts))}) in the shards", source=str(source))
        return VideoReader(entries, found, root=None, classes=(), storage=storage, probes=probes, **common)
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes, bytearray)):
        if not all(isinstance(item, tuple) and len(item) == 2 for item in source):
            raise ConfigError("video: a list source must hold (path, label) tuples")
        videos = [remote.remote_video(os.fspath(p), storage) for p, _ in source]
        return VideoReader(videos, [c for _, c in source], root=None, classes=(), storage=storage, **common)
    raise ConfigError(f"video: a URL source must be a bucket prefix ending in '/', tar shards or a list of "
                      f"(URL, label), got {source!r}")


def _is_shards(source: Any) -> bool:
    """Tar shards rather than videos: a folder with ``*.tar`` files in it, a pattern or a shard's
    path, or a list of plain paths (a list of videos holds ``(path, label)`` tuples)."""
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if os.path.isdir(text):
            return any(n.endswith(_SHARD_SUFFIXES) for n in os.listdir(text))
        return any(ch in text for ch in "*?[{") or text.endswith(_SHARD_SUFFIXES)
    return (isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)) and len(source) > 0
            and all(isinstance(item, (str, os.PathLike)) and _is_shards(item) for item in source))
