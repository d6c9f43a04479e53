"""The host side of the GPU post ops (``ops/cuda/_post_passes.py``): where each sample's pixels go
and the launches of the batch's plan, read back from the plan as the shim would. Runs without a
GPU; the kernels on these plans are tested in tests/gpu/test_gpu_post_ops.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headrace.ops import (AugMix, AutoAugment, ColorTwist, GaussianBlur, Normalize, Pipeline, RandAugment, Rotate,
                          TimmRandAugment, TrivialAugmentWide, training)
from headrace.ops.cuda._plan import Plan, relocate
from headrace.ops.cuda._post_passes import (BatchPasses, finish_launch, finish_own_sizes, packed_layout, plan_post,
                                            post_steps)

BASE = 1 << 40  # the allocation: a made-up address
TABLES = np.array([0, 1 << 44, 0, 0, 0], dtype=np.uint64)  # the plan's tables' block, by address space


def _rows(sizes):
    rows = np.array([(0x7000 + 0x1000 * i, h, w, 3 * w + 4, 3) for i, (h, w) in enumerate(sizes)], dtype=np.int64)
    return rows  # the input's rows are padded (stride 3 w + 4): ours are packed


def _issued(plan: Plan, bases: np.ndarray):
    """``plan`` laid out, with its tables and argument values relocated to ``bases`` as the shim
    relocates them (copies: the plan itself keeps its named addresses)."""
    compiled = plan.compile()
    blob = compiled.blob.copy()
    compiled.relocate_tables(blob, bases)
    values = compiled.values.copy()
    relocate(values, bases)
    return compiled, blob, values


def _launches(plan: Plan, bases: np.ndarray = TABLES):
    """Each launch as (kernel, ptrs (n, 2), meta (n, 4)), read from the blob through its arguments,
    its addresses relocated to ``bases`` as the shim would."""
    compiled, blob, values = _issued(plan, bases)
    out, slot = [], 0  # each launch's first three arguments are its tables: ptrs, meta, params
    for kernel, row in zip(compiled.kernels, compiled.launches.tolist()):
        ptrs_at, meta_at = int(values[slot]) - int(bases[1]), int(values[slot + 1]) - int(bases[1])
        n = int(compiled.steps[row]["grid"][2])
        ptrs = blob[ptrs_at : ptrs_at + 16 * n].view(np.uint64).reshape(n, 2)
        meta = blob[meta_at : meta_at + 16 * n].view(np.int32).reshape(n, 4)
        out.append((kernel, ptrs.tolist(), meta.tolist()))
        slot += 3
    return out


def test_each_sample_moves_on_its_own_and_the_batch_is_gathered():
    rows = _rows([(8, 8), (4, 6), (2, 2)])
    colour, rotate = ColorTwist(0.4), Rotate(30)
    matrices = np.tile(np.eye(3, 4), (3, 1, 1))
    matrices[[0, 2], 0, 0] = 1.5  # sample 1 keeps the identity: the colour pass leaves it out
    affine = np.tile(np.eye(2, 3), (3, 1, 1))
    affine[[1, 2], 0, 2] = 2.0  # sample 0 is not moved
    passes = BatchPasses(rows, [(colour, (matrices,)), (rotate, (affine, np.zeros(3)))], 3, inplace=False)
    sizes = [8 * 8 * 3, 4 * 6 * 3, 2 * 2 * 3]
    offsets = [0, sizes[0], sizes[0] + sizes[1]]
    buf0, buf1 = BASE, BASE + 512  # 276 bytes a buffer, each 256-aligned
    assert passes.size == 1024 and (passes.at(0), passes.at(1)) == (0, 512)
    plan = Plan()
    target = passes.launches(plan, BASE, gather=True)
    assert passes.where.tolist() == [0, 0, 1] and target == 0
    colour_launch, warp, gather = _launches(plan)
    # colour: samples 0 and 2, from the input into buffer 0 (not in place)
    assert colour_launch == ("color_twist", [[0x7000, buf0], [0x9000, buf0 + offsets[2]]],
                             [[8, 8, 28, 24], [2, 2, 10, 6]])
    # warp: sample 1 from the input, sample 2 from buffer 0 into buffer 1
    assert warp == ("warp_affine", [[0x8000, buf0 + offsets[1]], [buf0 + offsets[2], buf1 + offsets[2]]],
                    [[4, 6, 22, 18], [2, 2, 6, 6]])
    # the batch in buffer 0: sample 2 copied over from buffer 1
    assert gather == ("copy_pixels", [[buf1 + offsets[2], buf0 + offsets[2]]], [[2, 2, 6, 6]])


def test_in_place_colour_and_nothing_to_gather():
    rows = _rows([(3, 3), (5, 2)])
    matrices = np.tile(np.eye(3, 4), (2, 1, 1))
    matrices[:, 1, 1] = 0.5
    passes = BatchPasses(rows, [(ColorTwist(0.4), (matrices,))], 3, inplace=True)
    assert passes.size == 0 and not passes.changes  # written where it lies: no buffer at all
    plan = Plan()
    assert passes.launches(plan, 0, gather=True) is None
    ((kernel, ptrs, _),) = _launches(plan)
    assert kernel == "color_twist" and ptrs == [[0x7000, 0x7000], [0x8000, 0x8000]]


def test_no_pass_changes_anything():
    rows = _rows([(3, 3)])
    passes = BatchPasses(rows, [(ColorTwist(0.4), (np.eye(3, 4)[None],))], 3, inplace=False)
    plan = Plan()
    assert passes.launches(plan, 0, gather=True) is None
    assert len(plan) == 0 and passes.size == 0


def _relocated(plan: Plan, bases: np.ndarray):
    """What the shim issues for ``plan`` at ``bases``: kernels, grids, blocks, argument values, tables."""
    compiled, blob, values = _issued(plan, bases)
    steps = compiled.steps.copy()
    steps["params"] = 0  # host addresses of each plan's own argument array
    dst = steps["dst"].copy()
    relocate(dst, bases)
    steps["dst"] = dst
    return compiled.kernels, steps.tobytes(), values.tolist(), blob.tobytes()


@pytest.mark.parametrize("post", [RandAugment(), TrivialAugmentWide(), AutoAugment(), TimmRandAugment(), AugMix(),
                                  ColorTwist(0.4, 0.4, 0.4, 0.1), GaussianBlur(5, p=0.5), Rotate(30)],
                         ids=lambda op: type(op).__name__)
def test_a_batch_planned_ahead_issues_what_the_lane_would_plan(post):
    # plan_post (the prep thread, before the pixels exist) against the lane's planning with real
    # addresses (PostOps.apply_tables): after relocation, the same launches, arguments and tables.
    listed = list(training(32, dtype="float16").ops)
    pipeline = Pipeline([*listed[:-1], post, listed[-1]])
    n, h, w, c = 40, 32, 32, 3
    image_at, work_at, out_at, tables_at = 1 << 41, 1 << 42, 1 << 43, 1 << 44
    bases = np.array([0, tables_at, image_at, work_at, out_at], dtype=np.uint64)
    for epoch in range(3):
        indices = np.arange(n, dtype=np.int64) * 7 + epoch
        planned = plan_post(pipeline, 11, epoch, indices, (h, w))
        assert planned.input_shape == (n, h, w, c) and planned.out_shape == (n, c, h, w)
        rows = np.array([(image_at + i * h * w * c, h, w, w * c, c) for i in range(n)], dtype=np.int64)
        passes = BatchPasses(rows, post_steps(pipeline, 11, epoch, indices, rows[:, 1], rows[:, 2]), c, inplace=True)
        plan = Plan()
        target = passes.launches(plan, work_at, gather=True)
        finish_launch(plan, pipeline.normalize, work_at + passes.at(target) if target is not None else image_at, out_at,
                      (n, h, w, c))
        assert planned.work == passes.size
        assert _relocated(planned.plan, bases) == _relocated(plan, bases)


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
def test_images_of_their_own_sizes_are_finished_in_one_plan_into_one_allocation(layout):
    # Three images, each into its place in one output: one launch each, the mean and 1 / std tables
    # shared, the places those of packed_layout (what the lane's views are made from).
    norm = Normalize(dtype="float16", layout=layout)
    sizes = [(5, 7), (3, 2), (40, 33)]
    rows = np.array([(0x10000 * (i + 1), h, w, 3 * w, 3) for i, (h, w) in enumerate(sizes)], dtype=np.int64)
    out_at = 1 << 42
    plan = Plan()
    starts = finish_own_sizes(plan, norm, rows, out_at)
    assert starts.tolist() == [0, 5 * 7 * 3, 5 * 7 * 3 + 3 * 2 * 3]
    compiled = plan.compile()
    assert compiled.kernels == ["finish_float16"] * 3 and plan.size == 32  # two tables of 3 floats, once
    values = compiled.values.reshape(3, 7)  # each launch: src, dst, h, w, chw, mean, 1 / std
    assert values[:, 0].tolist() == rows[:, 0].tolist()
    assert values[:, 1].tolist() == [out_at + 2 * int(s) for s in starts]
    assert (values[:, 2:5] & 0xFFFF_FFFF).tolist() == [[h, w, layout == "CHW"] for h, w in sizes]
    assert len({tuple(v) for v in values[:, 5:].tolist()}) == 1
    assert [tuple(compiled.steps[i]["grid"]) for i in range(3)] == [(1, 1, 1), (1, 1, 1), (2, 5, 1)]
    # The views: each image's elements where the kernel wrote them, in the layout asked for.
    images = [torch.arange(h * w * 3, dtype=torch.float32).reshape(h, w, 3) + 1000 * i for i, (h, w) in enumerate(sizes)]
    laid = [image.permute(2, 0, 1) if layout == "CHW" else image for image in images]
    packed = torch.cat([image.contiguous().reshape(-1) for image in laid])
    shapes, strides, starts_again = packed_layout(rows[:, 1], rows[:, 2], rows[:, 4], layout == "CHW")
    assert starts_again.tolist() == starts.tolist()
    views = list(map(packed.as_strided, shapes.tolist(), strides.tolist(), starts.tolist()))
    assert all(torch.equal(view, image) for view, image in zip(views, laid))
