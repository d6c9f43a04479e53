"""GPU tests: they need CUDA, CuPy and nvImageCodec, and skip themselves (visibly) without them."""

from __future__ import annotations

import pytest

from headrace.ops import cuda_available


def pytest_collection_modifyitems(config, items):
    here = str(__file__).rsplit("/", 1)[0]
    skip = pytest.mark.skip(reason="needs CUDA, CuPy and nvImageCodec (GPU tests run on the GPU machine)")
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not cuda_available():
                item.add_marker(skip)
