"""readers.video over object storage: video files and tar shards of video members at URLs.

PyAV seeks while it probes and decodes, and a seek on a network stream is a new request; so a
video is fetched whole (a tar member: its byte range) and probed or decoded from memory. The
costs, stated in docs/video.md: a shard is downloaded whole once when the reader is made (to
list and probe its members); a video file once, when the first epoch starts (to probe it); then
each chunk of clips fetches each of its videos (members) once more, on the event loop, with
retries, and hands their bytes to ``DecodeClip`` in the samples.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from headrace._errors import ConfigError, LoaderError, ReadError, StorageError

from .files import bucket_class_folders as bucket_class_keys
from ._storage import Storage, Store, redact_url, run_sync, with_retries
from ._video_probe import VideoInfo, probe_or_error
from ._video_tar import TarMember, list_shard
from .video import RemoteVideo

__all__ = ["bucket_class_folders", "fetch_videos", "list_remote_shards", "probe_remote", "remote_video"]

Entry = TarMember | RemoteVideo | ReadError
T = TypeVar("T")


def remote_video(url: str, storage: Storage) -> RemoteVideo:
    store, key = storage.locate(url)
    return RemoteVideo(redact_url(store.url(key)), store, key)


async def _fetch(entry: TarMember | RemoteVideo, storage: Storage) -> bytes:
    """A video's (or member's) bytes, retried; raises StorageError naming it."""
    if isinstance(entry, TarMember):
        assert entry.store is not None and entry.key is not None
        store, key, first, end = entry.store, entry.key, entry.offset, entry.offset + entry.size
        data = await with_retries(lambda: store.read_range(key, first, end), storage.retry, str(entry))
        if data is not None and len(data) < entry.size:
            raise StorageError(f"member {entry.name!r} is cut off: {len(data)} of {entry.size} bytes", source=entry.shard)
    else:
        data = await with_retries(lambda: entry.store.read(entry.key), storage.retry, entry.url)
    assert data is not None
    return data


async def fetch_videos(entries: Sequence[TarMember | RemoteVideo | str | ReadError], videos: Sequence[int],
                       storage: Storage, requests: int) -> dict[int, bytes | ReadError]:
    """Video ``videos[k]``'s bytes (``entries[k]``), at most ``requests`` at once; a video that cannot
    be fetched gets its StorageError instead."""
    limit = asyncio.Semaphore(requests)

    async def one(entry: TarMember | RemoteVideo | str | ReadError) -> bytes | ReadError:
        if isinstance(entry, ReadError) or isinstance(entry, str):
            raise AssertionError("only remote videos are fetched")
        async with limit:
            try:
                return await _fetch(entry, storage)
            except StorageError as exc:
                return exc

    async with asyncio.TaskGroup() as group:  # no yield inside: the group ends with the chunk
        tasks = [group.create_task(one(e)) for e in entries]
    return {v: t.result() for v, t in zip(videos, tasks)}


def probe_remote(entries: Sequence[Entry | str], storage: Storage, threads: int) -> list[VideoInfo | LoaderError]:
    """Fetch and probe every video, ``threads`` at a time (a fetched video is held only while probed)."""

    async def main() -> list[VideoInfo | LoaderError]:
        limit = asyncio.Semaphore(threads)

        async def one(entry: Entry | str) -> VideoInfo | LoaderError:
            if isinstance(entry, (ReadError, str)):
                return entry if isinstance(entry, ReadError) else ReadError("a local path among remote videos",
                                                                            source=entry)
            async with limit:
                try:
                    data = await _fetch(entry, storage)
                except StorageError as exc:
                    return exc
                return await asyncio.to_thread(probe_or_error, entry, data)

        async with storage.session():
            return await _all([one(e) for e in entries])

    return run_sync(main)


async def _all(jobs: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Every job's result, in order. A failure cancels the rest; a ConfigError (a gzip shard) is
    raised as itself, as for local shards, rather than in an ExceptionGroup."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(job) for job in jobs]
    except ExceptionGroup as failed:
        config = [e for e in failed.exceptions if isinstance(e, ConfigError)]
        if config:
            raise config[0] from None
        raise
    return [t.result() for t in tasks]


def list_remote_shards(urls: Sequence[str], storage: Storage, extensions: set[str], threads: int
                       ) -> tuple[list[Entry], list[int | None], list[VideoInfo | LoaderError]]:
    """Each shard fetched whole once, ``threads`` at a time: its video members (read later by byte
    range), their labels and their probes. A shard that cannot be fetched is one StorageError entry."""

    async def main() -> list[tuple[list[Entry], list[int | None], list[VideoInfo | LoaderError]]]:
        limit = asyncio.Semaphore(threads)

        async def one(url: str) -> tuple[list[Entry], list[int | None], list[VideoInfo | LoaderError]]:
            store, key = storage.locate(url)
            name = redact_url(store.url(key))
            async with limit:
                try:
                    data = await with_retries(lambda: store.read(key), storage.retry, name)
                except StorageError as exc:
                    exc.key = f"{os.path.basename(key)}#error"
                    return [exc], [None], [exc]
                assert data is not None
                return await asyncio.to_thread(_list_and_probe, data, name, store, key, extensions)

        async with storage.session():
            return await _all([one(u) for u in urls])

    entries: list[Entry] = []
    labels: list[int | None] = []
    infos: list[VideoInfo | LoaderError] = []
    for found, found_labels, found_infos in run_sync(main):
        entries += found
        labels += found_labels
        infos += found_infos
    return entries, labels, infos


def _list_and_probe(data: bytes, name: str, store: Store, key: str, extensions: set[str]
                    ) -> tuple[list[Entry], list[int | None], list[VideoInfo | LoaderError]]:
    listed, labels = list_shard(name, extensions, data)
    entries: list[Entry] = [replace(e, store=store, key=key) if isinstance(e, TarMember) else e for e in listed]
    view = memoryview(data)
    infos = [probe_or_error(e, bytes(view[e.offset : e.offset + e.size])) if isinstance(e, TarMember) else e
             for e in entries]
    return entries, labels, infos


def bucket_class_folders(prefix: str, storage: Storage, extensions: set[str]
                         ) -> tuple[str, list[str], list[RemoteVideo], list[int]]:
    """A class-per-sub-folder tree of videos under a bucket prefix, from one listing: the prefix's
    URL, the classes, the videos and their labels (``files.bucket_class_folders``, the objects as videos)."""
    store, key, classes, keys, labels = bucket_class_keys(prefix, storage, extensions, "video")
    videos = [RemoteVideo(redact_url(store.url(k)), store, k) for k in keys]
    return redact_url(store.url(key)), classes, videos, labels
