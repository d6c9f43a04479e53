"""The public names of headrace, headrace.readers and headrace.ops, written out.

A change to what users can import from the packages is a deliberate edit of these lists (and of
docs/api.md, which documents each name), never a side effect of an import added to an ``__init__``.
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "headrace": [
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
    ],
    "headrace.readers": [
        "CaffeReader",
        "CocoReader",
        "FileReader",
        "HttpStore",
        "IndexedReader",
        "IterableReader",
        "LmdbReader",
        "LocalStore",
        "MemoryStore",
        "MixReader",
        "ObjectInfo",
        "PackResult",
        "Reader",
        "RecordIOReader",
        "Retry",
        "S3Store",
        "SequenceReader",
        "Store",
        "TFRecordReader",
        "VideoReader",
        "WebDatasetReader",
        "caffe",
        "coco",
        "decode_default",
        "decode_record",
        "encode_record",
        "epoch_order",
        "file_list",
        "files",
        "iterable",
        "lmdb",
        "mix",
        "pack",
        "parse_example",
        "recordio",
        "sequence",
        "tfrecord",
        "video",
        "webdataset",
    ],
    "headrace.ops": [
        "AugMix",
        "AutoAugment",
        "CenterCrop",
        "ColorTwist",
        "CpuExecutor",
        "CudaExecutor",
        "CutMix",
        "Decode",
        "DecodeClip",
        "Filter",
        "Flip",
        "GaussianBlur",
        "GpuTuning",
        "IMAGENET_MEAN",
        "IMAGENET_STD",
        "IMAGE_EXTENSIONS",
        "Map",
        "MapBatch",
        "MixUp",
        "Normalize",
        "Op",
        "Pipeline",
        "PostOp",
        "Processed",
        "RandAugment",
        "RandomAdjustSharpness",
        "RandomAffine",
        "RandomAutocontrast",
        "RandomCrop",
        "RandomEqualize",
        "RandomErasing",
        "RandomGrayscale",
        "RandomInvert",
        "RandomIoUCrop",
        "RandomPosterize",
        "RandomResize",
        "RandomResizedCrop",
        "RandomSolarize",
        "Resize",
        "Rotate",
        "Sharpness",
        "TimmAugMix",
        "TimmAutoAugment",
        "TimmRandAugment",
        "ToneCurve",
        "TrivialAugmentWide",
        "WarpAffine",
        "crop_mirror_normalize",
        "cuda_available",
        "decode_frames",
        "gpu_unsupported",
        "source_boxes",
        "training",
        "uniforms",
        "validation",
        "video_pipeline",
    ],
}

# Plumbing that left the top level: code inside the engine (and the benchmarks) imports it from
# its module, so those paths must keep working.
PLUMBING = {
    "headrace._channel": ["ReceiveChannel", "SendChannel", "open_channel"],
    "headrace._markers": ["END"],
    "headrace._sample": ["SampleBatch"],
    "headrace._loop": ["new_event_loop"],
    "headrace._distributed": ["Distributed", "detect_distributed"],
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_public_names_are_exactly_the_pinned_ones(package):
    module = importlib.import_module(package)
    assert sorted(module.__all__) == PUBLIC[package]
    assert len(set(module.__all__)) == len(module.__all__), "a name listed twice in __all__"


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_star_import_gives_the_public_names_and_each_resolves(package):
    namespace: dict[str, object] = {}
    exec(f"from {package} import *", namespace)
    namespace.pop("__builtins__")
    assert sorted(namespace) == PUBLIC[package]
    assert all(value is not None for value in namespace.values())


@pytest.mark.parametrize("module_name", sorted(PLUMBING))
def test_plumbing_stays_importable_from_its_module_but_not_from_the_top(module_name):
    import headrace

    module = importlib.import_module(module_name)
    for name in PLUMBING[module_name]:
        assert getattr(module, name) is not None
        assert name not in headrace.__all__
