"""Pipeline and op validation: every wrong argument is a ConfigError (also a ValueError), raised
when the object is built."""

from __future__ import annotations

import pytest
import torch

from headrace import ConfigError
from headrace.ops import (
    CenterCrop,
    CpuExecutor,
    Decode,
    Flip,
    Normalize,
    Op,
    Pipeline,
    RandomResizedCrop,
    Resize,
    crop_mirror_normalize,
    training,
    validation,
)

BAD_SIZES = [0, -3, (0, 4), (4, -1), (1, 2, 3), (4,), 2.5, "224", True, None, (4.0, 4), (16, True), (True, 16)]


@pytest.mark.parametrize("size", BAD_SIZES)
@pytest.mark.parametrize("op", [Resize, CenterCrop, RandomResizedCrop])
def test_bad_sizes(op, size):
    with pytest.raises(ConfigError):
        op(size)


@pytest.mark.parametrize(
    "make",
    [
        lambda: RandomResizedCrop(8, scale=(0.0, 1.0)),
        lambda: RandomResizedCrop(8, scale=(0.5, 0.2)),
        lambda: RandomResizedCrop(8, scale=(0.1, 1.5)),
        lambda: RandomResizedCrop(8, scale=0.5),
        lambda: RandomResizedCrop(8, scale=("a", "b")),
        lambda: RandomResizedCrop(8, ratio=(0.0, 1.0)),
        lambda: RandomResizedCrop(8, ratio=(2.0, 1.0)),
        lambda: RandomResizedCrop(8, ratio=(1.0, float("inf"))),
        lambda: RandomResizedCrop(8, ratio=(float("nan"), 1.0)),
        lambda: Flip(-0.1),
        lambda: Flip(1.5),
        lambda: Flip("0.5"),
        lambda: Flip(float("nan")),
        lambda: Flip(True),
        lambda: Flip(vertical="no"),  # a truthy string would flip vertically
        lambda: Normalize(mean=(0.5,), std=(float("nan"),)),
        lambda: Normalize(mean=(float("inf"),), std=(0.5,)),
        lambda: Normalize(mean=(0.5,), std=(float("inf"),)),
        lambda: Normalize(dtype="int8"),
        lambda: Normalize(dtype="uint8"),
        lambda: Normalize(dtype=torch.float64),
        lambda: Normalize(dtype=torch.uint8),
        lambda: Normalize(mean=(0.5, 0.5), std=(0.5,)),
        lambda: Normalize(mean=(0.5,), std=(0.0,)),
        lambda: Normalize(mean=(), std=()),
        lambda: Normalize(mean=None),
        lambda: Normalize(mean=("a",), std=(1.0,)),
        lambda: Normalize(layout="NCHW"),
        lambda: Decode(color="bgr"),
        lambda: crop_mirror_normalize(0),
        lambda: crop_mirror_normalize(8, mirror=2.0),
        lambda: crop_mirror_normalize(8, layout="CWH"),
    ],
)
def test_bad_op_arguments(make):
    with pytest.raises(ConfigError) as info:
        make()
    assert isinstance(info.value, ValueError) and info.value.stage == "config"


class Blur(Op):
    """An op no executor knows."""


@pytest.mark.parametrize(
    "ops, kwargs",
    [
        ([Decode(), Normalize(), Flip()], {}),  # Normalize not last
        ([Normalize(), Normalize()], {}),
        ([Decode(), Decode()], {}),  # Decode twice
        ([Resize(8), Decode()], {}),  # Decode not first
        ([Decode(), Blur()], {}),
        ([Decode(), "resize"], {}),
        ([lambda img: img], {}),
        ([Decode(color="gray"), Normalize()], {}),  # three means for one channel
        ([Resize(8)], {"layout": "NHWC"}),
        ([Resize(8)], {"image": ()}),
        ([Resize(8)], {"image": ["jpg", 3]}),
        ([Resize(8)], {"label": 0}),
    ],
)
def test_bad_pipelines(ops, kwargs):
    with pytest.raises(ConfigError):
        Pipeline(ops, **kwargs)


@pytest.mark.parametrize("threads", [0, -1, 1.5, None, True])
def test_bad_thread_counts(threads):
    with pytest.raises(ConfigError):
        CpuExecutor(training(8), num_threads=threads, seed=0)


def test_good_pipelines():
    pipe = Pipeline([Resize(8)])
    assert isinstance(pipe.ops[0], Decode) and pipe.image_ops == (Resize(8),) and pipe.normalize is None
    assert pipe.dtype == torch.uint8 and pipe.channels == 3 and pipe.layout == "CHW"
    assert Pipeline().ops == (Decode(),)
    assert Pipeline(image="png").image_fields == ("png",)
    t = training(64, dtype="float16")
    assert [type(op) for op in t.ops] == [Decode, RandomResizedCrop, Flip, Normalize]
    assert t.output_size() == (64, 64) and t.dtype == torch.float16
    v = validation(32, resize=40)
    assert [type(op) for op in v.ops] == [Decode, Resize, CenterCrop, Normalize]
    assert v.output_size() == (32, 32) and v.dtype == torch.float32
    hwc = Pipeline(crop_mirror_normalize(8, mirror=0.5, layout="HWC"))
    assert hwc.layout == "HWC" and hwc.output_size() == (8, 8)
    assert [type(op) for op in crop_mirror_normalize()] == [Normalize]
    assert RandomResizedCrop(8, scale=[0.5, 1], ratio=[1, 2]).scale == (0.5, 1.0)
    assert Normalize(dtype="bfloat16").dtype == torch.bfloat16
    assert Resize([4, 6]).size == (4, 6)
