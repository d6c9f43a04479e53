"""Decode and transform ops, user stages (Map, Filter, MapBatch), and the executors that run them on a batch: on the CPU
(CpuExecutor) and on a GPU (CudaExecutor)."""

from .cpu._executor import CpuExecutor
from ._results import Processed
from .cuda._executor import CudaExecutor, GpuTuning, cuda_available, gpu_unsupported
from ._boxes import source_boxes
from ._pipeline import IMAGE_EXTENSIONS, Pipeline, training, validation
from ._random import uniforms
from ._stages import Filter, Map, MapBatch
from ._mix import CutMix, MixUp
from ._erase import RandomErasing
from ._auto_augment import AutoAugment, RandAugment, TrivialAugmentWide
from ._augmix import AugMix
from ._timm_augment import TimmRandAugment
from ._timm_auto_augment import TimmAutoAugment
from ._timm_augmix import TimmAugMix
from ._tone import (
    RandomAdjustSharpness,
    RandomAutocontrast,
    RandomEqualize,
    RandomInvert,
    RandomPosterize,
    RandomSolarize,
    Sharpness,
    ToneCurve,
)
from ._video import DecodeClip, decode_frames, video_pipeline
from ._post_spec import ColorTwist, GaussianBlur, PostOp, RandomGrayscale, Rotate, WarpAffine
from ._random_affine import RandomAffine
from ._spec import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    CenterCrop,
    Decode,
    Flip,
    Normalize,
    Op,
    RandomCrop,
    RandomIoUCrop,
    RandomResize,
    RandomResizedCrop,
    Resize,
    crop_mirror_normalize,
)

__all__ = [
    "AugMix",
    "AutoAugment",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "IMAGE_EXTENSIONS",
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
    "Map",
    "MapBatch",
    "MixUp",
    "Normalize",
    "Op",
    "Pipeline",
    "PostOp",
    "RandAugment",
    "RandomAdjustSharpness",
    "RandomAffine",
    "RandomAutocontrast",
    "RandomEqualize",
    "RandomInvert",
    "RandomPosterize",
    "RandomSolarize",
    "Processed",
    "RandomCrop",
    "RandomErasing",
    "RandomGrayscale",
    "RandomIoUCrop",
    "RandomResize",
    "RandomResizedCrop",
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
    "gpu_unsupported",
    "source_boxes",
    "decode_frames",
    "training",
    "uniforms",
    "validation",
    "video_pipeline",
]
