"""``headrace pack``: a class-per-folder tree of images (or videos) → WebDataset tar shards or an LMDB.

Samples are labelled exactly as ``readers.files`` labels them (label = index of the sorted
sub-folder); a sample's key is its path below the source without the extension (dots in the file
name become ``_``, since WebDataset splits keys at the first dot), e.g. ``c0/0001``.

WebDataset output: ``DEST/<prefix>-000000.tar``, ... each holding ``<key>.<ext>`` (the file's own
bytes) and ``<key>.cls`` (the label as ASCII digits), plus ``DEST/headrace-index.json`` with every
shard's sample count and byte size (it gives the reader ``len()`` and fast resume).
LMDB output: ``DEST/data.mdb`` with one record per key (``lmdb.encode_record``: the same fields),
plus ``__keys__`` (JSON list of keys, in write order) and ``__meta__`` (JSON: classes, counts).

Nothing is written outside DEST: shards are written under a temporary name there and renamed when
complete, and a failure removes what this run wrote.

``verify="raise"`` or ``"skip"`` decodes every file before it is written, by headrace's own CPU rules
(``ops._pillow``: the pixel limit, the end-of-file rule, a full Pillow decode), in a few threads
ahead of the writer: the first file that does not decode stops the run (a DecodeError naming it),
or is left out and listed in ``PackResult.skipped``. Without it the bytes are copied unread.

``video=True`` packs videos the same way (``readers.video``'s extensions; each file's own bytes,
never re-encoded) into tar shards only, which ``readers.video`` reads; its ``verify`` is
``readers.video``'s probe (a demux of every frame, no decode).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import tarfile
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from headrace._errors import ConfigError, DecodeError, ReadError, require_int, require_number

from ._shards import INDEX_NAME, write_index
from ._tar import WEBDATASET_META
from .files import files
from .video import VIDEO_EXTENSIONS, probe

__all__ = ["PackResult", "pack"]

_MB = 1 << 20
_TAR_END = 2 * 512 + 10240  # end marker plus the worst-case padding to tarfile's record size
_VERIFY = (None, "raise", "skip")

# (key, extension, path, label) of a file to pack, and the same with its bytes once read.
Item = tuple[str, str, str, int]
Loaded = tuple[str, str, str, int, bytes]


@dataclass
class PackResult:
    """What ``pack`` wrote: the format, the outputs (shard paths or the LMDB folder), sample and byte
    counts; with ``verify="skip"``, the files left out because they do not decode, as (path, reason)."""

    format: str
    dest: str
    samples: int
    bytes: int
    outputs: list[str] = field(default_factory=list)
    classes: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def pack(
    src: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    format: Literal["webdataset", "lmdb"],
    shard_size: float | None = 256,
    shard_count: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    prefix: str = "shard",
    progress: Callable[[int, int], object] | None = None,
    verify: Literal["raise", "skip"] | None = None,
    verify_threads: int | None = None,
    video: bool = False,
) -> PackResult:
    """Pack the image tree ``src`` (with ``video=True``: a tree of videos) into ``dest`` (a new or empty folder).

    ``shard_size``: most megabytes per tar shard (None: no limit); ``shard_count``: most samples per
    shard (None: no limit); a sample bigger than the limit gets a shard of its own; the shards are
    ``<prefix>-000000.tar``, ``<prefix>-000001.tar``, ... (``prefix`` a plain file name part). ``shuffle``
    writes the samples in a random order drawn from ``seed`` (otherwise in ``readers.files`` order), which makes
    shards of mixed classes. ``progress(done, total)`` is called as samples are written (or skipped).

    ``verify``: None (default) copies the files' bytes unread. ``"raise"`` decodes each file first
    (headrace's CPU decode rules, ``verify_threads`` threads, default all cores) and stops at the
    first that does not decode; ``"skip"`` leaves such files out and lists them, with the reason, in
    ``PackResult.skipped``.

    ``video=True``: the files are videos (``readers.video``'s extensions: mp4, mkv, avi, mov,
    webm), packed as their own bytes (no re-encode) into tar shards of ``<key>.mp4`` (or the
    file's extension) + ``<key>.cls``, which ``readers.video`` reads with the same labels and
    clips as the folder; ``format`` must be ``"webdataset"``. ``verify`` then probes each video
    as ``readers.video`` does (demuxes every frame; a truncated file or one with no video stream
    fails).

    Raises ReadError when ``src`` holds no images (videos) or a file cannot be read, DecodeError (naming the
    file) for a file that does not decode under ``verify="raise"``, ConfigError for a wrong
    argument, a ``dest`` that is not empty or lies inside ``src``, two files that map to the same
    key, or (LMDB) a key past LMDB's 511-byte limit. On any error nothing of this run is left in ``dest``.
    """
    if format not in ("webdataset", "lmdb"):
        raise ConfigError(f"pack: format must be 'webdataset' or 'lmdb', got {format!r}")
    if verify not in _VERIFY:
        raise ConfigError(f"pack: verify must be None, 'raise' or 'skip', got {verify!r}")
    if video and format != "webdataset":
        raise ConfigError("pack: videos pack into WebDataset shards only (format='webdataset'): readers.video reads those")
    if verify_threads is not None:
        verify_threads = require_int("pack: verify_threads", verify_threads)
    if shard_size is not None:
        shard_size = require_number("pack: shard_size", shard_size, 0, float("inf"), low_open=True, high_open=True,
                                    wanted="a positive, finite number of MB")
    if shard_count is not None:
        shard_count = require_int("pack: shard_count", shard_count)
    if not prefix or "/" in prefix or os.sep in prefix or prefix.startswith("."):
        raise ConfigError(f"pack: prefix must be a plain file name part, got {prefix!r}")
    src_path, dest_path = Path(src).resolve(), Path(dest).resolve()
    if dest_path == src_path or src_path in dest_path.parents:
        raise ConfigError(f"pack: DEST {str(dest_path)!r} must not be inside SRC {str(src_path)!r}")
    if dest_path.exists() and (not dest_path.is_dir() or any(dest_path.iterdir())):
        raise ConfigError(f"pack: DEST {str(dest_path)!r} exists and is not an empty folder")
    listing = files(src_path, extensions=VIDEO_EXTENSIONS) if video else files(src_path)
    keys = [_key(k) for k in listing._keys]
    seen: dict[str, str] = {}
    for key, path in zip(keys, listing.paths):
        if format == "webdataset" and WEBDATASET_META.match(key):
            raise ConfigError(f"pack: {path!r} would be stored under key {key!r}: a WebDataset reader (this one and "
                              "the webdataset library) skips members under a folder named __x__ as the format's "
                              "own; rename that folder")
        if key in seen:
            raise ConfigError(f"pack: {seen[key]!r} and {path!r} would both be stored under key {key!r}")
        seen[key] = path
    order = np.random.default_rng(seed).permutation(len(keys)).tolist() if shuffle else list(range(len(keys)))
    items = [(keys[i], listing._exts[i], listing.paths[i], listing.labels[i]) for i in order]  # type: ignore[index]
    created = _missing_folders(dest_path)
    dest_path.mkdir(parents=True, exist_ok=True)
    result = PackResult(format, str(dest_path), 0, 0, classes=list(listing.classes))
    check = _probe_check if video else _decode_check
    loaded = _loaded(items, verify, check, verify_threads or os.cpu_count() or 1, result, progress)
    try:
        with contextlib.closing(loaded):
            if format == "webdataset":
                _write_shards(loaded, dest_path, result, shard_size, shard_count, prefix)
            else:
                _write_lmdb(loaded, sum(os.path.getsize(path) for _, _, path, _ in items), dest_path, result)
        if not result.samples:
            raise DecodeError(f"pack --verify: none of the {len(items)} files decodes; nothing written",
                              source=str(src_path))
    except BaseException:
        for out in result.outputs + [str(dest_path / INDEX_NAME)]:
            with contextlib.suppress(OSError):
                os.unlink(out)
        for leftover in dest_path.iterdir():
            if leftover.name.startswith(".headrace-") or leftover.name in ("data.mdb", "lock.mdb"):
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
        for folder in created:  # DEST, then the parents made for it: nothing of this run is left
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return result


def _missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, innermost first: what ``mkdir(parents=True)``
    makes, and a failed run removes."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _key(key: str) -> str:
    folder, _, name = key.rpartition("/")
    return (folder + "/" if folder else "") + name.replace(".", "_")


def _loaded(items: list[Item], verify: str | None, check: Callable[[bytes, str, str], str | None], threads: int,
            result: PackResult, progress: Callable[[int, int], object] | None) -> Iterator[Loaded]:
    """The items with their bytes, in order; under ``verify`` only those ``check`` passes (see ``pack``).

    Files are read and decoded by ``threads`` threads, at most two per thread ahead of the writer.
    ``progress`` is called once the writer has taken an item (or it was skipped).
    """
    done = 0
    if verify is None:
        for key, ext, path, label in items:
            yield key, ext, path, label, _read(path, key)
            done += 1
            if progress is not None:
                progress(done, len(items))
        return
    pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="headrace-pack-verify")
    pending: deque[concurrent.futures.Future[tuple[bytes, str | None]]] = deque()
    try:
        for position in range(len(items)):
            while len(pending) < 2 * threads and position + len(pending) < len(items):
                _, _, path, _ = ahead = items[position + len(pending)]
                pending.append(pool.submit(_read_and_check, ahead[0], path, check))
            key, ext, path, label = items[position]
            data, reason = pending.popleft().result()
            if reason is None:
                yield key, ext, path, label, data
            elif verify == "raise":
                raise DecodeError(f"pack --verify: {path} does not decode: {reason}", key=key, source=path)
            else:
                result.skipped.append((path, reason))
            done += 1
            if progress is not None:
                progress(done, len(items))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _read_and_check(key: str, path: str, check: Callable[[bytes, str, str], str | None]) -> tuple[bytes, str | None]:
    """A file's bytes and why they do not decode (None when they do), in a pool thread."""
    data = _read(path, key)
    return data, check(data, key, path)


def _decode_check(data: bytes, key: str, path: str) -> str | None:
    """Why an image does not decode by headrace's CPU rules, or None."""
    from headrace.ops._limits import release_frames
    from headrace.ops._pillow import open_image, pixels
    from headrace.ops._spec import Decode

    spec = Decode()
    try:
        pixels(open_image(data, spec, key, path), spec)
    except DecodeError as exc:
        release_frames(exc)
        return exc.message
    return None


def _probe_check(data: bytes, key: str, path: str) -> str | None:
    """Why ``readers.video`` cannot probe a video, or None."""
    try:
        probe(data, source=path)
    except (ReadError, DecodeError) as exc:
        return exc.message
    return None


def _read(path: str, key: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise ReadError(f"cannot read file: {exc.strerror or exc}", key=key, source=path) from exc


def _tar_bytes(name: str, size: int) -> int:
    """The bytes a member takes in a shard: its header exactly as ``_add`` writes it (with the pax
    header a long or non-ASCII name gets: ``kätze/1.png`` takes three blocks, not one) and its data
    padded to whole blocks."""
    return len(_tar_info(name, size).tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")) + (size + 511) // 512 * 512


def _write_shards(items: Iterator[Loaded], dest: Path, result: PackResult, shard_size, shard_count, prefix) -> None:
    limit = None if shard_size is None else int(shard_size * _MB)
    shards: list[dict] = []
    tar: tarfile.TarFile | None = None
    tmp = final = ""
    used = count = 0

    def close() -> None:
        nonlocal tar
        assert tar is not None
        tar.close()
        tar = None
        os.replace(tmp, final)
        shards.append({"name": os.path.basename(final), "samples": count, "bytes": os.path.getsize(final)})
        result.bytes += shards[-1]["bytes"]

    try:
        for key, ext, path, label, data in items:
            cls = str(label).encode()
            need = _tar_bytes(f"{key}.{ext}", len(data)) + _tar_bytes(f"{key}.cls", len(cls))
            full = (limit is not None and used + need + _TAR_END > limit) or (shard_count is not None and count >= shard_count)
            if tar is not None and count and full:
                close()
            if tar is None:
                final = str(dest / f"{prefix}-{len(shards):06d}.tar")
                tmp = str(dest / f".headrace-{len(shards):06d}.tar.tmp")
                result.outputs.append(final)
                tar = tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")
                used = count = 0
            for name, payload in ((f"{key}.{ext}", data), (f"{key}.cls", cls)):
                _add(tar, name, payload)
            used += need
            count += 1
            result.samples += 1
        if tar is not None:
            close()
    finally:
        if tar is not None:
            tar.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    write_index(str(dest), shards, classes=result.classes)


def _add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    tar.addfile(_tar_info(name, len(payload)), io.BytesIO(payload))


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o444, 0  # fixed metadata: the same input packs the same bytes
    info.uname = info.gname = "headrace"
    return info


def _write_lmdb(items: Iterator[Loaded], total_bytes: int, dest: Path, result: PackResult) -> None:
    from .lmdb import encode_record, lmdb_module

    lmdb_lib = lmdb_module()

    env = lmdb_lib.open(str(dest), map_size=max(64 * _MB, 2 * total_bytes + 64 * _MB), subdir=True, lock=False,
                        readahead=False, meminit=False)
    result.outputs.append(str(dest))
    keys: list[str] = []
    try:
        batch: list[tuple[bytes, bytes]] = []
        for key, ext, path, label, data in items:
            # A file name's undecodable bytes (surrogates, as os.fsdecode gives them) are stored as
            # those bytes; __keys__ holds them as JSON's \udcXX escapes, which the reader turns back.
            raw = key.encode("utf-8", "surrogateescape")
            if len(raw) > env.max_key_size():
                raise ConfigError(f"pack: {path!r} would be stored under a key of {len(raw)} bytes, past LMDB's "
                                  f"{env.max_key_size()}-byte limit; shorten its folder or file name")
            batch.append((raw, encode_record({ext: data, "cls": str(label).encode()})))
            keys.append(key)
            if len(batch) >= 256:
                _put(env, batch, result)
        _put(env, batch, result)
        meta = {"format": "headrace.lmdb", "version": 1, "samples": len(keys), "classes": result.classes,
                "record": "headrace-record-1"}
        _put(env, [(b"__keys__", json.dumps(keys).encode()), (b"__meta__", json.dumps(meta).encode())], None)
        env.sync(True)
    finally:
        env.close()
    result.bytes = os.path.getsize(dest / "data.mdb")


def _put(env, batch: list[tuple[bytes, bytes]], result: PackResult | None) -> None:
    """Write ``batch`` in one transaction and empty it.

    The map was sized from the files' bytes, but LMDB's pages can take more than twice those
    (small values in half-full pages, a value just past a page in two), and ``__keys__`` more
    still: where the map is full, it is doubled (nothing else has the database open) and the
    transaction, aborted, is written again."""
    if not batch:
        return
    from .lmdb import lmdb_module

    lmdb_lib = lmdb_module()
    while True:
        try:
            with env.begin(write=True) as txn:
                for k, v in batch:
                    txn.put(k, v)
            break
        except lmdb_lib.MapFullError:
            env.set_mapsize(2 * env.info()["map_size"])
    if result is not None:
        result.samples += len(batch)
    batch.clear()
