"""Shard lists (brace patterns, lists, folders) and the small JSON index that ``pack`` writes beside them."""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Sequence

from headrace._errors import ConfigError, ReadError

__all__ = ["INDEX_NAME", "expand_braces", "read_index", "resolve_shards", "write_index"]

INDEX_NAME = "headrace-index.json"
INDEX_FORMAT = "headrace.webdataset-index"
_SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


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
        width = max(len(lo), len(hi)) if lo.startswith("0") or hi.startswith("0") else 0
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


def resolve_shards(source: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Local shard paths from a brace pattern, a glob, a folder (its ``*.tar`` files, sorted) or a list.

    Raises ReadError naming the first shard that does not exist, ConfigError for an empty list or
    a URL scheme headrace cannot read yet.
    """
    if isinstance(source, (str, os.PathLike)):
        text = os.fspath(source)
        if text.startswith("file://"):
            text = text[len("file://") :]
        if "://" in text:
            raise ConfigError(f"webdataset: only local shards are supported for now, got {text!r}")
        if os.path.isdir(text):
            paths = sorted(os.path.join(text, n) for n in os.listdir(text) if n.endswith(_SHARD_SUFFIXES))
            if not paths:
                raise ReadError("no *.tar shards in folder", source=text)
            return paths
        paths = expand_braces(text)
        if any(ch in text for ch in "*?[") and not all(os.path.exists(p) for p in paths):
            paths = [g for p in paths for g in sorted(glob.glob(p))]
    elif isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        paths = [p for item in source for p in resolve_shards(item)]
    else:
        raise ConfigError(f"webdataset: source must be a pattern, a folder or a list of shards, got {type(source).__name__}")
    if not paths:
        raise ConfigError("webdataset: the shard list is empty")
    for path in paths:
        if not os.path.isfile(path):
            raise ReadError("no such shard", source=path)
    return paths


def read_index(paths: Sequence[str]) -> list[int] | None:
    """Per-shard sample counts from the index files in the shards' folders, or None if any is missing.

    Raises ReadError when an index entry disagrees with its shard's size on disk (a stale index
    would make ``len()`` and resume wrong).
    """
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
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ReadError(f"unreadable shard index: {exc}", source=path) from exc
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
