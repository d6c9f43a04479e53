"""The GPU post ops' launch plan as data (``ops/cuda/_plan.py``): what the shim's ``hr_run_plan``
reads. Runs without a GPU; the launches themselves are tested in tests/gpu/test_gpu_post_ops.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from headrace.ops.cuda._plan import _STEP, Plan, TableRef, _RunPlan


def _read(address: int, ctype):
    return ctype.from_address(address).value


def test_tables_are_laid_out_aligned_and_addressed_from_the_device_base():
    plan = Plan()
    a = plan.table(np.arange(3, dtype=np.uint64))  # 24 bytes: the next table starts at 32
    b = plan.table(np.array([7, 8], dtype=np.int32))
    assert (int(a), int(b), plan.size) == (0, 32, 48)
    blob = plan.blob()
    assert blob[:24].view(np.uint64).tolist() == [0, 1, 2] and blob[32:40].view(np.int32).tolist() == [7, 8]
    plan.launch(0xF00, (2, 3, 4), (32, 8, 1), a, b)
    steps, values, params = plan.arrays(device=1 << 40)
    assert steps[0]["function"] == 0xF00 and steps[0]["grid"].tolist() == [2, 3, 4]
    assert steps[0]["block"].tolist() == [32, 8, 1]
    first = int(steps[0]["params"])
    assert _read(_read(first, ctypes.c_uint64), ctypes.c_uint64) == (1 << 40) + 0
    assert _read(_read(first + 8, ctypes.c_uint64), ctypes.c_uint64) == (1 << 40) + 32


def test_scalar_arguments_sit_where_cuda_reads_them():
    plan = Plan()
    plan.launch(1, (1, 1, 1), (1, 1, 1), np.int32(-5), np.float32(0.25), np.uint64(2**63 + 1))
    plan.launch(2, (1, 1, 1), (1, 1, 1), np.int32(9))
    steps, values, params = plan.arrays(device=0)
    p0, p1 = int(steps[0]["params"]), int(steps[1]["params"])
    assert _read(_read(p0, ctypes.c_uint64), ctypes.c_int32) == -5
    assert _read(_read(p0 + 8, ctypes.c_uint64), ctypes.c_float) == 0.25
    assert _read(_read(p0 + 16, ctypes.c_uint64), ctypes.c_uint64) == 2**63 + 1
    assert p1 == p0 + 24 and _read(_read(p1, ctypes.c_uint64), ctypes.c_int32) == 9


def test_zeroing_steps_and_order():
    plan = Plan()
    plan.zero(4096, 1024)
    plan.launch(3, (1, 1, 1), (1, 1, 1))
    steps, _, _ = plan.arrays(device=0)
    assert len(plan) == 2
    assert (int(steps[0]["function"]), int(steps[0]["dst"]), int(steps[0]["size"])) == (0, 4096, 1024)
    assert int(steps[1]["function"]) == 3


def test_a_wrong_argument_type_is_refused():
    plan = Plan()
    plan.launch(1, (1, 1, 1), (1, 1, 1), 5)  # a plain int: its size is unknown
    with pytest.raises(TypeError, match="kernel argument"):
        plan.arrays(device=0)


def test_the_layouts_match_the_shims_structs():
    # hr_step: void*, unsigned[3], unsigned[3], void**, unsigned long long, size_t (batch_decode.c).
    assert [_STEP.fields[f][1] for f in ("function", "grid", "block", "params", "dst", "size")] == [0, 8, 20, 32, 40, 48]
    assert _STEP.itemsize == 56
    offsets = {name: getattr(_RunPlan, name).offset for name, _ in _RunPlan._fields_}
    assert offsets == {"wait_event": 0, "src": 8, "pinned": 16, "device": 24, "size": 32, "steps": 40,
                       "n_steps": 48, "events": 56, "cuda_error": 72}
    assert isinstance(TableRef(8), int)
