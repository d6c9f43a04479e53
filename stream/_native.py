"""Small C helpers, compiled on first use with the system C compiler and cached.

Why C at all: each call from Python into the OS or a C library drops and retakes the GIL, and
retaking it waits for the thread that holds it. The helpers make one GIL-free ctypes call out of
many small ones (the files reader's reads, nvImageCodec's per-image calls).

Why compile here rather than ship wheels: the helpers are a page of C each, the GPU one must match
the nvImageCodec wheel the user has, and a compiler is on every machine we target. Without one,
``build`` says why and each caller falls back to its Python path. Builds are cached
(``$HEADRACE_CACHE``, else ``$XDG_CACHE_HOME/headrace`` or ``~/.cache/headrace``) under a hash of
everything that goes into them, written under a temporary name and renamed, so ranks of one job
may build at the same time. ``HEADRACE_NO_C_HELPERS=1`` turns them all off (the Python paths run),
for a machine whose compiler or libraries misbehave.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

__all__ = ["build", "cache_dir"]


def cache_dir() -> Path:
    explicit = os.environ.get("HEADRACE_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "headrace"


def build(name: str, source: Path, *, inputs: Sequence[Path] = (), flags: Sequence[str] = ()) -> tuple[Path | None, str | None]:
    """The shared library built from ``source`` (with ``flags``): (its path, None), or (None, why not).

    ``inputs`` are other files the build reads (headers): a change to any of them, to the source,
    the flags or the compiler makes a new build.
    """
    if os.environ.get("HEADRACE_NO_C_HELPERS", "") not in ("", "0"):
        return None, "the C helpers are turned off (HEADRACE_NO_C_HELPERS)"
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None, "no C compiler (set CC, or install gcc)"
    digest = hashlib.sha256()
    for part in (source, *inputs):
        digest.update(part.read_bytes())
    digest.update("|".join([compiler, *flags]).encode())
    cache = cache_dir()
    target = cache / f"{name}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target, None
    try:
        cache.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
        os.close(fd)
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", tmp, str(source), *flags],
                              capture_output=True, text=True)
    except OSError as exc:  # an unwritable cache, a compiler that cannot start
        return None, f"building {name} failed: {exc}"
    if done.returncode != 0:
        os.unlink(tmp)
        return None, f"compiling {name} failed: {done.stderr.strip()[-400:]}"
    os.replace(tmp, target)
    return target, None
