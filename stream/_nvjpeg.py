"""nvImageCodec's own libnvjpeg, loaded before another package's copy can be.

nvImageCodec's nvJPEG extension takes a libnvjpeg already loaded in the process over the one
its wheel pairs with: of two copies, the one loaded first (measured, not documented). torchvision's wheel bundles an older copy
(``torchvision.libs/libnvjpeg.<hash>.so.13``) that ``import torchvision`` maps; bound to it, every
GPU decode failed with "encoding unsupported" and every image went to Pillow on the CPU (H200,
nvImageCodec 0.9 with nvJPEG 13.3, torchvision 0.26: 1.6k images/s against 27k). Loading
nvImageCodec's copy first, when ``headrace`` is imported, makes it the one taken; loaded
``RTLD_LOCAL``, so torchvision's own code keeps its copy.

When another copy was loaded first (torchvision imported before headrace), loading ours later
does not change the extension's choice (measured too): the GPU path then warns, once, when a
batch decodes nothing (``warn_unusable``), naming the copies and the import order that avoids it.
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import sys
import threading
import warnings
from pathlib import Path

__all__ = ["ENCODING_UNSUPPORTED", "mapped", "preload", "warn_unusable"]

# nvimgcodecProcessingStatus_t: what every decode returned when bound to torchvision's copy.
ENCODING_UNSUPPORTED = 0x23
# Where nvImageCodec's extension looks for its libnvjpeg, relative to site-packages/nvidia (its
# RPATH): the CUDA wheels' shared folder of its CUDA major, then the nvjpeg wheel's own.
_WHEEL_FOLDERS = ("cu{major}/lib", "nvjpeg/lib")

_lock = threading.Lock()
_loaded: ctypes.CDLL | None = None  # kept: the library stays mapped for the process's life
_warned = False


def mapped() -> list[str]:
    """The libnvjpeg files mapped in this process, by name (``/proc/self/maps`` orders them by
    address, which says nothing of which was loaded first)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split(None, 5)[-1].strip() for line in maps if "libnvjpeg" in line]
    except OSError:
        return []
    seen: dict[str, None] = {}
    for path in paths:
        name = Path(path).name
        if name.startswith("libnvjpeg.") or name == "libnvjpeg.so":  # not nvImageCodec's libnvjpeg_ext
            seen.setdefault(path)
    return sorted(seen)


def _cuda_major() -> int | None:
    """The CUDA major version the installed nvImageCodec wheel was built for (its distribution's
    name says it), or None: another copy of nvJPEG's major would be the wrong one to load first."""
    for major in (13, 12):
        try:
            importlib.metadata.version(f"nvidia-nvimgcodec-cu{major}")
        except importlib.metadata.PackageNotFoundError:
            continue
        return major
    return None


def _wheel_library() -> Path | None:
    """nvImageCodec's libnvjpeg from the nvidia wheels beside it, without importing nvImageCodec."""
    major = _cuda_major()
    if major is None:
        return None
    try:
        spec = importlib.util.find_spec("nvidia.nvimgcodec")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    nvidia = Path(next(iter(spec.submodule_search_locations))).parent
    for folder in _WHEEL_FOLDERS:
        candidate = nvidia / folder.format(major=major) / f"libnvjpeg.so.{major}"
        if candidate.is_file():
            return candidate
    return None


def preload() -> str | None:
    """Load nvImageCodec's libnvjpeg now, unless some libnvjpeg is mapped already; its path, or None
    (not Linux, no nvImageCodec wheel, another copy mapped, or it would not load: nothing changes)."""
    global _loaded
    if not sys.platform.startswith("linux"):
        return None
    with _lock:
        if _loaded is not None:
            return _loaded._name
        if mapped():
            return None
        library = _wheel_library()
        if library is None:
            return None
        try:
            _loaded = ctypes.CDLL(str(library), mode=ctypes.RTLD_LOCAL)
        except OSError:  # its CUDA runtime missing, say: nvImageCodec reports the same later
            return None
        return str(library)


def warn_unusable(images: int) -> None:
    """Warn once per process: a batch's ``images`` GPU decodes all came back "encoding unsupported",
    the sign of nvImageCodec bound to another package's libnvjpeg; they decode on the CPU instead."""
    global _warned
    with _lock:
        if _warned:
            return
        _warned = True
    copies = ", ".join(mapped()) or "none found"
    warnings.warn(
        f"headrace: nvImageCodec's nvJPEG decoder failed all {images} images of a batch with 'encoding "
        f"unsupported'; they and the images after them that fail so decode on the CPU (Pillow), many times "
        f"slower. libnvjpeg copies in this process: {copies}. nvImageCodec uses the one loaded first: when "
        "that is another package's (torchvision bundles one), import headrace before that package, which "
        "loads nvImageCodec's own copy first.",
        RuntimeWarning,
        stacklevel=2,
    )
