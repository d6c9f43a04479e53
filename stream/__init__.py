"""headrace: an asyncio streaming data loader that feeds GPUs."""

from ._batcher import LastBatch
from ._channel import ChannelStats, ReceiveChannel, SendChannel, open_channel
from ._distributed import Distributed, detect_distributed
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
from ._loop import new_event_loop
from ._markers import END
from ._policy import ErrorRecord
from ._run import EpochMetrics, StageStats
from ._sample import Batch, Sample, SampleBatch
from ._service import Preprocessor, PreprocessorStats
from ._sync import SyncLoader
from ._torch_view import torch_dataset

__version__ = "0.1.0"

__all__ = [
    "END",
    "Batch",
    "ChannelStats",
    "ClosedError",
    "ConfigError",
    "DecodeError",
    "Distributed",
    "ErrorBudgetExceeded",
    "EpochMetrics",
    "ErrorRecord",
    "LastBatch",
    "Loader",
    "LoaderError",
    "LoaderStats",
    "OverloadedError",
    "Preprocessor",
    "PreprocessorStats",
    "ReadError",
    "ReceiveChannel",
    "Sample",
    "SampleBatch",
    "SendChannel",
    "StageStats",
    "StorageError",
    "SyncLoader",
    "TransformError",
    "__version__",
    "detect_distributed",
    "new_event_loop",
    "open_channel",
    "torch_dataset",
]
