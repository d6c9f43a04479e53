"""headrace: an asyncio streaming data loader that feeds GPUs.

This package exports what a training loop or a serving path writes: the loader and the
preprocessor, samples and batches, the errors to catch, and the statistics they report. The
plumbing under them (channels, the end-of-stream marker, the batches handed to executors, the
event loop factory, rank detection) stays importable from its own module, e.g.
``from headrace._channel import open_channel``.
"""

from __future__ import annotations

from ._nvjpeg import preload as _preload_nvjpeg

_preload_nvjpeg()  # first, before another package maps its own libnvjpeg (_nvjpeg.py says why)

from ._batcher import LastBatch
from ._channel import ChannelStats
from ._errors import (
    ClosedError,
    ConfigError,
    DecodeError,
    ErrorBudgetExceeded,
    LoaderError,
    OverloadedError,
    ReadError,
    StorageError,
    TransformError,
)
from ._loader import Loader, LoaderStats
from ._policy import ErrorRecord
from ._run import EpochMetrics, StageStats
from ._sample import Batch, Sample
from ._service import Preprocessor, PreprocessorStats
from ._sync import SyncLoader
from ._torch_view import torch_dataset

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "ChannelStats",
    "ClosedError",
    "ConfigError",
    "DecodeError",
    "EpochMetrics",
    "ErrorBudgetExceeded",
    "ErrorRecord",
    "LastBatch",
    "Loader",
    "LoaderError",
    "LoaderStats",
    "OverloadedError",
    "Preprocessor",
    "PreprocessorStats",
    "ReadError",
    "Sample",
    "StageStats",
    "StorageError",
    "SyncLoader",
    "TransformError",
    "__version__",
    "torch_dataset",
]
