"""What the S3 and HTTP stores share when obstore (Rust ``object_store``) makes their GETs: the body
that hands a download's bytes to the loop, the ``StoreFault`` an obstore error means, and the size of
the runtime its GETs run on."""

from __future__ import annotations

import atexit
import functools
import os
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from ._base import Body, StoreFault, progressed, scrub

__all__ = ["BLOCK", "HELD_PER_GET", "RUNTIME_THREADS", "WHOLE_MAX", "ObstoreBody", "fault", "open_body",
           "prepare_runtime", "read_whole"]

# Blocks handed from the download to the parser thread. Each costs a loop iteration, and while a
# parser holds the GIL the loop waits for it (up to the 5 ms switch interval): over the in-memory
# store 1 MiB blocks streamed 885 MB/s against 672 MB/s with 256 KiB (local files: ~1,000 MB/s).
# The byte bound is overshot by one block at most.
BLOCK = 1 << 20
# obstore's stream assembles each block of at least BLOCK from hyper's chunks (~130-400 KiB) before
# it hands it over, so an open GET holds up to a block and a chunk in the client: blocks measured up
# to 1.38 MiB, and 1.36 MiB a GET at most beyond what the downloads had received (~100 GETs, 50 ms).
HELD_PER_GET = BLOCK + BLOCK // 2
# ``read_whole`` takes an object up to this in one hand-off off the GIL (its progress unseen: it
# must arrive within a retry's timeout); a larger one block by block, each block giving the try
# its timeout again, so a large object on a slow link is not cut for taking long.
WHOLE_MAX = 4 * BLOCK

_STATUS = re.compile(r"status code: (\d{3})")

# obstore runs every GET on one tokio runtime a process, which tokio sizes at one worker thread a
# core. A worker that allocates a GET's blocks gets a glibc malloc arena of its own and keeps its
# high-water mark there, so memory grows with the workers, not with the bytes in flight: with 16
# workers the 2-core VM's streamed shards held 296-351 MB past local disk (the reader's bound: 384),
# with 4 workers 223-254 MB and 10-30% more samples a second (docs/storage.md). A reader's GETs keep
# about one core of them busy (0.5-0.9 at 17-23k samples/s), so 4 leave room.
RUNTIME_THREADS = 4
_RUNTIME_ENV = "TOKIO_WORKER_THREADS"
# A runtime thread hands each result to the event loop (``call_soon_threadsafe``, which writes to the
# loop's wake-up socket with the GIL let go) and then takes the GIL back. If the program ends in
# between, Python before 3.14 ends that thread with ``pthread_exit`` when it asks for the GIL, which
# aborts the process through Rust's frames (SIGABRT, exit status 134, after all the work was done):
# 12 in 120 runs of a script that read one object over S3 and one over HTTP and returned (pyo3#4874,
# cpython#87135). Waiting this long at exit, before Python starts finalizing, lets such a hand-off
# finish: 0 in 240.
_SETTLE_SECONDS = 0.05


@functools.cache  # once a process, as the runtime itself
def prepare_runtime() -> None:
    """Before the first obstore store is made: at most ``RUNTIME_THREADS`` workers for its runtime
    (unless ``TOKIO_WORKER_THREADS`` already says how many: tokio reads it when the runtime starts,
    once a process, and a runtime already running keeps its size), and the wait at exit above."""
    if _RUNTIME_ENV not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        os.environ[_RUNTIME_ENV] = str(max(1, min(RUNTIME_THREADS, cores)))
    atexit.register(time.sleep, _SETTLE_SECONDS)


def fault(exc: BaseException, secrets: Iterable[str | None], missing: str = "no such object") -> StoreFault:
    """The ``StoreFault`` for an error obstore raised (its own tree, or a builtin for a 404); its
    text without secrets or query strings, and without obstore's debug dump."""
    import obstore.exceptions as oe

    text = scrub(str(exc).split("\n\nDebug source:", 1)[0].strip(), secrets)[:500]
    if isinstance(exc, (oe.NotFoundError, FileNotFoundError)):
        return StoreFault(missing, retryable=False, missing=True)
    if isinstance(exc, oe.PreconditionError):
        return StoreFault("the object changed while it was read (ETag mismatch)", retryable=False)
    if isinstance(exc, (oe.PermissionDeniedError, oe.UnauthenticatedError, PermissionError)):
        return StoreFault(f"access denied: {text}", retryable=False, denied=True)
    status = _STATUS.search(text)
    code = int(status.group(1)) if status else 0
    retryable = not (400 <= code < 500 and code not in (408, 429))
    return StoreFault(text, retryable=retryable, denied=code in (401, 403))


async def open_body(client: Any, path: str, start: int, end: int | None, etag: str | None,
                    to_fault: Callable[[BaseException], StoreFault]) -> ObstoreBody:
    """A GET of bytes ``[start, end)`` of ``path`` (``etag``: fail if it changed) from an obstore
    store. Raises obstore's own errors (the caller translates them); the body, ``to_fault``'s."""
    import obstore

    options: dict[str, Any] = {"range": (start, end)} if end is not None else {"range": {"offset": start}} if start else {}
    if etag is not None:
        options["if_match"] = etag
    result = await obstore.get_async(client, path, options=options)
    meta = result.meta
    return ObstoreBody(to_fault, result, meta["size"], meta.get("e_tag"))


class ObstoreBody(Body):
    """An obstore GET. Its stream copies each block into a new ``bytes`` on one of its threads,
    holding the GIL (~0.6 s a GB on the 2-core VM: reading shards over S3 took twice the GIL of
    reading them from disk); ``bytes_async()`` gathers the range off the GIL and hands it over
    uncopied, so ``rest()`` is the cheap way to a later segment."""

    whole = True

    def __init__(self, to_fault: Callable[[BaseException], StoreFault], result: Any, size: int,
                 etag: str | None) -> None:
        self._fault = to_fault
        self._result = result  # until the first next() or rest() takes it
        self._stream: Any = None
        self.size = size
        self.etag = etag

    async def next(self) -> bytes | memoryview:
        if self._stream is None:
            if self._result is None:
                return b""
            self._stream, self._result = self._result.stream(min_chunk_size=BLOCK), None
        try:
            return memoryview(await self._stream.__anext__())
        except StopAsyncIteration:
            self._stream = None
            return b""
        except Exception as exc:
            raise self._fault(exc) from None

    async def rest(self) -> bytes | memoryview:
        if self._result is None:
            return await super().rest()
        result, self._result = self._result, None
        try:
            return memoryview(await result.bytes_async())
        except Exception as exc:
            raise self._fault(exc) from None

    async def aclose(self) -> None:
        self._stream = self._result = None  # dropping them drops the connection


async def read_whole(body: ObstoreBody) -> bytes:
    """The rest of ``body`` as ``bytes``: at once up to ``WHOLE_MAX``, block by block past it."""
    if body.size <= WHOLE_MAX:
        return bytes(await body.rest())
    blocks = []
    while block := await body.next():
        progressed()
        blocks.append(block)
    return b"".join(blocks)
