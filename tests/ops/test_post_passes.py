"""The host side of the GPU post ops (``ops/cuda/_post_passes.py``): where each sample's pixels go
and the launches of the batch's plan, read back from the plan as the shim would. Runs without a
GPU; the kernels on these plans are tested in tests/gpu/test_gpu_post_ops.py."""

from __future__ import annotations

import numpy as np

from headrace.ops import ColorTwist, Rotate
from headrace.ops.cuda._plan import Plan
from headrace.ops.cuda._post_passes import BatchPasses

DEVICE, BASE = 1 << 44, 1 << 40  # the plan's tables, the allocation: made-up addresses
FUNCTIONS = {"color_twist": 11, "warp_affine": 12, "copy_pixels": 13}


def _rows(sizes):
    rows = np.array([(0x7000 + 0x1000 * i, h, w, 3 * w + 4, 3) for i, (h, w) in enumerate(sizes)], dtype=np.int64)
    return rows  # the input's rows are padded (stride 3 w + 4): ours are packed


def _launches(plan: Plan):
    """Each launch as (kernel, ptrs (n, 2), meta (n, 4)), read from the blob through its arguments."""
    steps, values, _ = plan.arrays(DEVICE)
    blob, out, slot = plan.blob(), [], 0
    inverse = {v: k for k, v in FUNCTIONS.items()}
    for s in steps:
        ptrs_at, meta_at = int(values[slot]) - DEVICE, int(values[slot + 1]) - DEVICE
        n = int(s["grid"][2])
        ptrs = blob[ptrs_at : ptrs_at + 16 * n].view(np.uint64).reshape(n, 2)
        meta = blob[meta_at : meta_at + 16 * n].view(np.int32).reshape(n, 4)
        out.append((inverse[int(s["function"])], ptrs.tolist(), meta.tolist()))
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
    target = passes.launches(plan, BASE, FUNCTIONS.__getitem__, gather=True)
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
    assert passes.launches(plan, 0, FUNCTIONS.__getitem__, gather=True) is None
    ((kernel, ptrs, _),) = _launches(plan)
    assert kernel == "color_twist" and ptrs == [[0x7000, 0x7000], [0x8000, 0x8000]]


def test_no_pass_changes_anything():
    rows = _rows([(3, 3)])
    passes = BatchPasses(rows, [(ColorTwist(0.4), (np.eye(3, 4)[None],))], 3, inplace=False)
    plan = Plan()
    assert passes.launches(plan, 0, FUNCTIONS.__getitem__, gather=True) is None
    assert len(plan) == 0 and passes.size == 0
