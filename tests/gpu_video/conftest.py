"""GPU video tests: they need CUDA (torch), PyNvVideoCodec and PyAV, and skip themselves (visibly,
with the reason) without them. Not under tests/gpu/: that folder needs nvImageCodec, which the
video path does not."""

from __future__ import annotations

import importlib.util

import pytest


def _why_not() -> str | None:
    try:
        import torch
    except ImportError:
        return "needs torch"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (GPU video tests run on the GPU machine)"
    for module, extra in (("PyNvVideoCodec", "pynvvideocodec"), ("av", "av")):
        if importlib.util.find_spec(module) is None:
            return f"needs {module} (pip install {extra})"
    return None


def pytest_collection_modifyitems(config, items):
    here = str(__file__).rsplit("/", 1)[0]
    why = _why_not()
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if why:
                item.add_marker(pytest.mark.skip(reason=why))
