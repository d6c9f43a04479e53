"""The video members of a WebDataset tar shard: where each lies (read later by offset or by range)
and its label from the ``<key>.cls`` member; a cut or corrupt shard lists what it can, then one
ReadError naming the shard and the member."""

from __future__ import annotations

import io
import os
import tarfile
from dataclasses import dataclass
from typing import Any

from headrace._errors import ConfigError, ReadError

from ._storage import Store
from ._tar import split_name, unsafe

__all__ = ["TarMember", "list_shard"]


@dataclass(frozen=True)
class TarMember:
    """Where a video member of a tar shard lies: its data is ``size`` bytes at ``offset`` of ``shard``
    (a local path; or, with ``store``, the URL of object ``key`` there, read by range)."""

    shard: str
    name: str  # the member's path in the archive
    offset: int
    size: int
    store: Store | None = None
    key: str | None = None

    def __str__(self) -> str:
        return f"{self.shard}:{self.name}"

    def read(self) -> bytes:
        """The member's bytes, from a local shard (a remote one is read on the event loop: ``_video_store``)."""
        with open(self.shard, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.size)
        if len(data) < self.size:
            raise ReadError(f"truncated tar: member {self.name!r} is cut off", source=self.shard)
        return data


def list_shard(shard: str, extensions: set[str], data: bytes | None = None) -> tuple[list[TarMember | ReadError],
                                                                                     list[int | None]]:
    """The video members of a local, uncompressed tar shard (their offsets, from the headers: data
    is seeked over) and each one's label, read from the ``<key>.cls`` member (ASCII digits) if
    there is one. A shard cut off or corrupt at some member lists the videos before it and then one
    ReadError naming the shard and that member (the videos after it cannot be found).
    ``data``: the shard's bytes, already fetched (a shard in object storage).
    """
    with (open(shard, "rb") if data is None else io.BytesIO(data)) as f:
        if f.read(2) == b"\x1f\x8b":
            raise ConfigError(f"video: {shard!r} is gzip-compressed; video shards must be plain .tar "
                              "(members are read by offset, and mp4 does not compress further)")
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        return _list_tar(f, size, shard, extensions)


def _list_tar(file: Any, size: int, shard: str, extensions: set[str]) -> tuple[list[TarMember | ReadError],
                                                                                list[int | None]]:
    members: dict[str, TarMember] = {}
    labels: dict[str, int | ReadError] = {}
    failed: ReadError | None = None
    last = None
    try:
        with tarfile.open(fileobj=file, mode="r:") as tar:
            for info in tar:
                last = info.name
                if info.offset_data + info.size > size:
                    raise ReadError(f"truncated tar: member {info.name!r} is cut off", key=_key_of(info.name),
                                    source=shard)
                split = split_name(info.name) if info.isfile() else None
                if split is None or unsafe(info.name):
                    continue
                key, ext = split
                if ext in extensions and key not in members:
                    members[key] = TarMember(shard, info.name, info.offset_data, info.size)
                elif ext == "cls":
                    labels[key] = _label(tar.extractfile(info).read(), info.name, key, shard)  # type: ignore[union-attr]
            # tarfile stops quietly at a bad header past the first: what follows the last member must be zeros
            f = tar.fileobj
            f.seek(tar.offset)  # type: ignore[union-attr]
            while block := f.read(1 << 16):  # type: ignore[union-attr]
                if block.strip(b"\0"):
                    after = f"after member {last!r}" if last else "at its start"
                    raise ReadError(f"corrupt or truncated tar {after} (byte {tar.offset}): a header cannot be read",
                                    key=_key_of(last) if last else None, source=shard)
            if size % 512:
                raise ReadError(f"truncated tar: it ends mid-block after member {last!r}",
                                key=_key_of(last) if last else None, source=shard)
    except tarfile.TarError as exc:
        failed = ReadError(f"corrupt tar after member {last!r}: {exc}", key=_key_of(last) if last else None,
                           source=shard)
    except ReadError as exc:
        failed = exc
    entries: list[TarMember | ReadError] = list(members.values())
    out_labels: list[int | None] = []
    for key, member in members.items():
        label = labels.get(key)
        if isinstance(label, ReadError):
            entries[entries.index(member)] = label
        out_labels.append(label if not isinstance(label, ReadError) else None)
    if failed is not None:
        if failed.key is None or failed.key in members:  # a key of its own, so it does not share a listed video's
            failed = ReadError(failed.message, key=f"{failed.key or os.path.basename(shard)}#error", source=shard)
        entries.append(failed)
        out_labels.append(None)
    return entries, out_labels


def _key_of(name: str) -> str:
    return (split_name(name) or (name, ""))[0]


def _label(data: bytes, name: str, key: str, shard: str) -> int | ReadError:
    text = data.strip()
    if not text.isdigit() or not text.isascii():
        return ReadError(f"member {name!r} is not a label (ASCII digits): {data[:20]!r}", key=key, source=shard)
    return int(text)
