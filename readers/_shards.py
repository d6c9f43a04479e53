"""Shard lists (brace patterns, lists, folders) and the small JSON index that ``pack`` writes beside them."""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import re
from collections.abc import Sequence

from headrace._errors import ConfigError, ReadError

from ._pipe import is_pipe
from ._storage import Storage, Store, is_url, redact_url, run_sync, with_retries

__all__ = ["INDEX_NAME", "expand_braces", "read_index", "resolve_shards", "write_index"]

INDEX_NAME = "headrace-index.json"
INDEX_FORMAT = "headrace.webdataset-index"
_SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def _zero_padded(end: str) -> bool:
    digits = end.lstrip("-")
    return len(digits) > 1 and digits.startswith("0")


def expand_braces(pattern: str) -> list[str]:
    """Expand ``{0000..0127}`` (zero-padded like its ends) and ``{a,b,c}`` groups, nested or several.

    A pattern without braces is itself. Raises ConfigError for an unbalanced brace.
    """
    start = pattern.find("{")
    if start < 0:
        if "}" in pattern:
            raise ConfigError(f"unbalanced '}}' in shard pattern {pattern!r}")
        return [pattern]
    depth = 0
    for end in range(start, len(pattern)):
        depth += {"{": 1, "}": -1}.get(pattern[end], 0)
        if depth == 0:
            break
    else:
        raise ConfigError(f"unbalanced '{{' in shard pattern {pattern!r}")
    body, head, tail = pattern[start + 1 : end], pattern[:start], pattern[end + 1 :]
    match = _RANGE.match(body)
    if match:
        lo, hi = match.group(1), match.group(2)
        # Padded when an end is written with a leading zero ({00..10}), as bash and braceexpand
        # do; a bare 0 is no padding ({0..10} is 0, 1, ..., 10).
        width = max(len(lo), len(hi)) if _zero_padded(lo) or _zero_padded(hi) else 0
        step = 1 if int(hi) >= int(lo) else -1
        options = [str(i).zfill(width) for i in range(int(lo), int(hi) + step, step)]
    else:
        options, depth, last = [], 0, 0
        for i, ch in enumerate(body):
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                options.append(body[last:i])
                last = i + 1
        options.append(body[last:])
        options = [o for option in options for o in expand_braces(option)]
    return [head + option + rest for option in options for rest in expand_braces(tail)]


def resolve_shards(source: str | os.PathLike | Sequence[str | os.PathLike], storage: Storage | None = None) -> list[str]:
    """Shard paths or URLs from a brace pattern, a glob, a folder (its ``*.tar`` files, sorted) or a list.

    URLs (``s3://``, ``http(s)://``), or any string when ``storage`` has an explicit store, are
    served by ``storage``: a folder is a URL ending in ``/`` and globs need a store that lists
    (S3, memory); remote shards are not checked for existence here (a missing one is a
    StorageError sample when it is read). Raises ReadError naming the first local shard that
    does not exist, ConfigError for an empty list or a URL no store can read.
    """
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if text.startswith("file://"):
            text = text[len("file://") :]
        if is_pipe(text):  # a command per shard: braces expanded, nothing globbed or checked here
            return expand_braces(text)
        if storage is not None and (storage.store is not None or is_url(text)):
            return _remote_shards(text, storage)
        if "://" in text:
            raise ConfigError(f"webdataset: cannot read {redact_url(text)!r}: use s3://, http(s)://, a local path, "
                              "or pass store=")
        if os.path.isdir(text):
            paths = sorted(os.path.join(text, n) for n in os.listdir(text) if n.endswith(_SHARD_SUFFIXES))
            if not paths:
                raise ReadError("no *.tar shards in folder", source=text)
            return paths
        paths = expand_braces(text)
        if any(ch in text for ch in "*?[") and not all(os.path.exists(p) for p in paths):
            paths = [g for p in paths for g in sorted(glob.glob(p))]
    elif isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        paths = [p for item in source for p in resolve_shards(item, storage)]
    else:
        raise ConfigError(f"webdataset: source must be a pattern, a folder or a list of shards, got {type(source).__name__}")
    if not paths:
        raise ConfigError("webdataset: the shard list is empty")
    for path in paths:
        if not is_url(path) and not is_pipe(path) and not (storage is not None and storage.store is not None) and not os.path.isfile(path):
            raise ReadError("no such shard", source=path)
    return paths


def _remote_shards(text: str, storage: Storage) -> list[str]:
    """Expand braces; list the folders (trailing ``/``) and globs among the results."""
    urls = expand_braces(text)
    listed = [u for u in urls if u.endswith("/") or _is_glob(*storage.locate(u))]
    if listed:
        found = run_sync(lambda: _list_all(listed, storage))
        urls = [hit for u in urls for hit in (found[u] if u in found else [u])]
    for url in urls:
        storage.locate(url)  # a URL no store reads fails now, not in the middle of an epoch
    if not urls:
        raise ConfigError(f"webdataset: no shards match {redact_url(text)!r}")
    return urls


def _is_glob(store: Store, key: str) -> bool:
    return store.scheme != "http" and any(ch in key for ch in "*?[")  # in a URL, "?" starts the query


def _glob_match(key: str, pattern: str) -> bool:
    """``key`` matches ``pattern`` as a local path matches ``glob``: part by part between the
    slashes, so ``train/*.tar`` is not ``train/val/0.tar`` (``fnmatch``'s ``*`` crosses slashes)."""
    parts, wanted = key.split("/"), pattern.split("/")
    return len(parts) == len(wanted) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, wanted))


async def _list_all(patterns: list[str], storage: Storage) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    async with storage.session():
        for pattern in patterns:
            store, key = storage.locate(pattern)
            cut = min((key.index(ch) for ch in "*?[" if ch in key), default=len(key))
            prefix = key[:cut]
            objects = await with_retries(lambda store=store, prefix=prefix: store.list(prefix), storage.retry, store.url(prefix), "LIST")
            if cut == len(key):  # a folder
                keys = [o.key for o in objects or [] if o.key.endswith(_SHARD_SUFFIXES) and "/" not in o.key[cut:]]
            else:
                keys = [o.key for o in objects or [] if _glob_match(o.key, key)]
            if not keys:
                raise ReadError("no *.tar shards here" if cut == len(key) else "no shards match the pattern",
                                source=store.url(key))
            head = pattern[: len(pattern) - len(key)] if pattern.endswith(key) else None
            out[pattern] = [head + k if head is not None else store.url(k) for k in keys]
    return out


def read_index(paths: Sequence[str], storage: Storage | None = None) -> list[int] | None:
    """Per-shard sample counts from the index files in the shards' folders, or None if any is missing.

    Remote shards' index files are fetched (one GET per folder). Raises ReadError when an entry
    disagrees with a local shard's size on disk (a stale index would make ``len()`` and resume
    wrong); a remote shard's count is checked when it is read (one that held another number
    of samples gives ReadError samples in the places of those it lacks: ``_shard_files._lost``).
    """
    if any(is_pipe(p) for p in paths):
        return None  # a command's output has no folder to hold an index: counts= gives them
    remote = storage is not None and (storage.store is not None or any(is_url(p) for p in paths))
    if remote:
        assert storage is not None
        folders = sorted({p.rpartition("/")[0] for p in paths})
        docs = run_sync(lambda: _fetch_indexes(folders, storage))
        counts = []
        for path in paths:
            folder, _, name = path.rpartition("/")
            entry = (docs[folder] or {}).get(name)
            if entry is None:
                return None
            counts.append(int(entry["samples"]))
        return counts
    return _read_local_index(paths)


async def _fetch_indexes(folders: list[str], storage: Storage) -> dict[str, dict[str, dict] | None]:
    out = {}
    async with storage.session():
        for folder in folders:
            store, key = storage.locate(folder + "/" + INDEX_NAME if folder else INDEX_NAME)
            data = await with_retries(lambda store=store, key=key: store.read(key), storage.retry, store.url(key), missing_ok=True)
            out[folder] = None if data is None else _parse(data, store.url(key))
    return out


def _read_local_index(paths: Sequence[str]) -> list[int] | None:
    indexes: dict[str, dict[str, dict] | None] = {}
    counts = []
    for path in paths:
        folder, name = os.path.split(path)
        if folder not in indexes:
            indexes[folder] = _load(os.path.join(folder, INDEX_NAME))
        entry = (indexes[folder] or {}).get(name)
        if entry is None:
            return None
        if "bytes" in entry and os.path.getsize(path) != entry["bytes"]:
            raise ReadError(f"stale {INDEX_NAME}: the shard has {os.path.getsize(path)} bytes, the index says "
                            f"{entry['bytes']}; delete the index or re-pack", source=path)
        counts.append(int(entry["samples"]))
    return counts


def _load(path: str) -> dict[str, dict] | None:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ReadError(f"unreadable shard index: {exc}", source=path) from exc
    return _parse(data, path)


def _parse(data: bytes, source: str) -> dict[str, dict] | None:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ReadError(f"unreadable shard index: {exc}", source=source) from exc
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT:
        return None
    return {s["name"]: s for s in doc.get("shards", [])}


def write_index(folder: str, shards: list[dict], **extra: object) -> str:
    """Write ``folder/headrace-index.json``: ``shards`` is a list of {"name", "samples", "bytes"}."""
    path = os.path.join(folder, INDEX_NAME)
    doc = {"format": INDEX_FORMAT, "version": 1, "samples": sum(s["samples"] for s in shards), **extra,
           "shards": shards}
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    return path
