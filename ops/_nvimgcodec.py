"""nvImageCodec's Python module, imported once per process, quietly (both devices decode with it)."""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

__all__ = ["nvimgcodec"]

_import_lock = threading.Lock()
_UNSET = object()
_module: Any = _UNSET


def nvimgcodec() -> Any:
    """The ``nvidia.nvimgcodec`` module, or None when it does not import. Imported once per process.

    On a machine without CUDA libraries its import prints "Failed to load nvjpeg library!" and the
    like from C++, though its CPU backend needs none of them: stderr is silenced for the import only,
    and its logger is set to silent (``PYNVIMGCODEC_VERBOSITY=0``) unless the environment says otherwise.
    """
    global _module
    with _import_lock:
        if _module is _UNSET:
            os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
            try:
                with _quiet_stderr():
                    from nvidia import nvimgcodec as module
            except Exception:  # noqa: BLE001 - ImportError, or a broken install raising from C++
                module = None
            _module = module
        return _module


class _quiet_stderr:
    def __enter__(self) -> None:
        try:
            sys.stderr.flush()
            self.saved: int | None = os.dup(2)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            os.close(devnull)
        except OSError:  # no fd 2 (embedded interpreters): nothing to silence
            self.saved = None

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            os.dup2(self.saved, 2)
            os.close(self.saved)
