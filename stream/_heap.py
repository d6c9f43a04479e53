"""Handing the C heap's free pages back to the system: glibc's ``malloc_trim`` (elsewhere nothing).

glibc serves each thread's allocations from that thread's arena and keeps every arena at its
high-water mark: pages freed inside it stay resident until a trim. Where a phase of work moves to
other threads (a decoder thread done with a large image; a read from a store whose GETs ran on the
client's threads, followed by one that reads local copies on the reader's threads), the process
would otherwise hold both phases' peaks at once. The decode budget (``ops/_limits.py``) and the
files reader's cache (``readers/files.py``) call it there.
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["trim_heap"]


def _load_malloc_trim():  # noqa: ANN202 - a ctypes function or None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _load_malloc_trim()


def trim_heap() -> None:
    """Give the free pages of every arena back to the system. Blocks its thread for a few ms per
    hundred MB held (it takes each arena's lock in turn): call it off the event loop."""
    if _malloc_trim is not None:
        _malloc_trim(0)
