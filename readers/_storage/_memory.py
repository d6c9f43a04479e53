"""Stores without a network: local files (the seam's reference) and objects in memory (for tests)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Mapping

from ._base import Body, ObjectInfo, Store, StoreFault

__all__ = ["LocalStore", "MemoryStore"]

_BLOCK = 1 << 20


class MemoryStore(Store):
    """Objects held in a dict, key → bytes; ``block`` bytes per streamed block.

    For tests and examples: ``readers.webdataset("train-{0..3}.tar", store=MemoryStore({...}))``.
    ``fail`` maps a key to a list of faults its successive ``open`` calls meet before they work:
    ``("status", 503)``, ``("reset", after_bytes)``, ``("stall", after_bytes)`` (never answers), so
    the retry logic can be tested without sockets. ``opens`` counts ``(key, start)`` per call.
    """

    scheme = "memory"

    def __init__(self, objects: Mapping[str, bytes] | None = None, *, block: int = 64 << 10,
                 fail: Mapping[str, list[tuple[str, int]]] | None = None) -> None:
        self.objects = dict(objects or {})
        self.block = block
        self.fail = {k: list(v) for k, v in (fail or {}).items()}
        self.opens: list[tuple[str, int]] = []
        self._etags: dict[str, tuple[bytes, str]] = {}

    def __repr__(self) -> str:
        return f"MemoryStore({len(self.objects)} objects)"

    def url(self, key: str) -> str:
        return f"memory://{key}"

    async def open(self, key: str, start: int = 0, *, end: int | None = None, etag: str | None = None) -> Body:
        await asyncio.sleep(0)
        self.opens.append((key, start))
        fault = self.fail[key].pop(0) if self.fail.get(key) else None
        if fault is not None and fault[0] == "status":
            raise StoreFault(f"HTTP {fault[1]}", retryable=fault[1] >= 500)
        if key not in self.objects:
            raise StoreFault("no such object", retryable=False, missing=True)
        data = self.objects[key]
        tag = self._etag(key, data)
        if etag is not None and etag != tag:
            raise StoreFault("the object changed while it was read (ETag mismatch)", retryable=False)
        return _MemoryBody(memoryview(data), start, end, self.block, tag, fault)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        return [ObjectInfo(k, len(v), self._etag(k, v)) for k, v in sorted(self.objects.items()) if k.startswith(prefix)]

    def _etag(self, key: str, data: bytes) -> str:
        # Hashed once per object version: an MD5 of a large shard per open would dominate a benchmark.
        cached = self._etags.get(key)
        if cached is None or cached[0] is not data:
            cached = self._etags[key] = (data, '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"')
        return cached[1]


class _MemoryBody(Body):
    def __init__(self, data: memoryview, start: int, end: int | None, block: int, etag: str,
                 fault: tuple[str, int] | None) -> None:
        self._data, self._pos, self._block = data, start, block
        self.size, self.etag = len(data), etag
        self._end = len(data) if end is None else min(end, len(data))
        self._cut = None if fault is None else start + fault[1]
        self._stall = fault is not None and fault[0] == "stall"

    async def next(self) -> bytes | memoryview:
        await asyncio.sleep(0)
        end = min(self._pos + self._block, self._end)
        if self._cut is not None and end >= self._cut:
            if self._pos < self._cut:
                end = self._cut
            elif self._stall:
                await asyncio.Event().wait()  # a stall: only the caller's timeout ends it
            else:
                raise StoreFault("connection reset (injected)", retryable=True)
        block, self._pos = self._data[self._pos : end], end
        return block

    async def aclose(self) -> None:
        self._pos = self._end


class LocalStore(Store):
    """Files under ``root``, read by a worker thread per block (the seam's reference implementation).

    Readers read plain local paths directly in their I/O threads, which is faster (no loop hop
    per block); this store is for code that wants every source behind one interface.
    """

    scheme = "file"

    def __init__(self, root: str | os.PathLike = "/") -> None:
        self.root = os.fspath(root)

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    def url(self, key: str) -> str:
        return "file://" + os.path.join(self.root, key)

    async def open(self, key: str, start: int = 0, *, end: int | None = None, etag: str | None = None) -> Body:
        path = os.path.join(self.root, key)
        try:
            f = open(path, "rb")  # noqa: SIM115 - the body closes it
        except FileNotFoundError:
            raise StoreFault("no such object", retryable=False, missing=True) from None
        except OSError as exc:
            raise StoreFault(f"cannot open: {exc.strerror or exc}", retryable=False) from None
        st = os.fstat(f.fileno())
        tag = f'"{st.st_mtime_ns:x}-{st.st_size:x}"'
        if etag is not None and etag != tag:
            f.close()
            raise StoreFault("the object changed while it was read", retryable=False)
        f.seek(start)
        return _FileBody(f, st.st_size, tag, st.st_size if end is None else min(end, st.st_size) - start)

    async def list(self, prefix: str) -> list[ObjectInfo]:
        base = os.path.join(self.root, prefix)
        folder = base if base.endswith(os.sep) else os.path.dirname(base)
        out = []
        for dirpath, _, names in os.walk(folder):
            for name in names:
                path = os.path.join(dirpath, name)
                key = os.path.relpath(path, self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    out.append(ObjectInfo(key, os.path.getsize(path)))
        return sorted(out, key=lambda o: o.key)


class _FileBody(Body):
    def __init__(self, f, size: int, etag: str, left: int) -> None:  # noqa: ANN001
        self._f, self.size, self.etag, self._left = f, size, etag, left

    async def next(self) -> bytes | memoryview:
        # A 1 MiB read from the page cache takes ~0.2 ms: short enough for the loop thread.
        if self._f.closed or self._left <= 0:
            return b""
        block = self._f.read(min(_BLOCK, self._left))
        self._left -= len(block)
        return block

    async def aclose(self) -> None:
        self._f.close()
