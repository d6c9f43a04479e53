"""The GPU post ops' launch plan as data (``ops/cuda/_plan.py``): what the shim's ``hr_run_plan``
reads, and the relocation of addresses named before their memory existed. Runs without a GPU; the
launches themselves are tested in tests/gpu/test_gpu_post_ops.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from headrace.ops.cuda import _batch_decode
from headrace.ops.cuda._plan import _STEP, INPUT, OUTPUT, TABLES, WORK, Plan, TableRef, _RunPlan, address, relocate

BASES = np.array([0, 1 << 40, 1 << 41, 1 << 42, 1 << 43], dtype=np.uint64)  # made up, by space


def _read(address: int, ctype):
    return ctype.from_address(address).value


def test_tables_are_laid_out_aligned_and_named_in_the_tables_space():
    plan = Plan()
    a = plan.table(np.arange(3, dtype=np.uint64))  # 24 bytes: the next table starts at 32
    b = plan.table(np.array([7, 8], dtype=np.int32))
    assert (int(a), int(b), plan.size) == (0, 32, 48)
    blob = plan.blob()
    assert blob[:24].view(np.uint64).tolist() == [0, 1, 2] and blob[32:40].view(np.int32).tolist() == [7, 8]
    plan.launch("kernel", (2, 3, 4), (32, 8, 1), a, b)
    compiled = plan.compile()
    assert compiled is plan.compile()  # laid out once
    compiled.resolve({"kernel": 0xF00}.__getitem__)
    steps = compiled.steps
    assert steps[0]["function"] == 0xF00 and steps[0]["grid"].tolist() == [2, 3, 4]
    assert steps[0]["block"].tolist() == [32, 8, 1]
    first = int(steps[0]["params"])
    assert _read(_read(first, ctypes.c_uint64), ctypes.c_uint64) == address(TABLES, 0)
    assert _read(_read(first + 8, ctypes.c_uint64), ctypes.c_uint64) == address(TABLES, 32)
    relocate(compiled.values, BASES)
    assert _read(_read(first + 8, ctypes.c_uint64), ctypes.c_uint64) == (1 << 40) + 32


def test_scalar_arguments_sit_where_cuda_reads_them_and_are_not_relocated():
    plan = Plan()
    plan.launch("a", (1, 1, 1), (1, 1, 1), np.int32(-5), np.float32(0.25), np.uint64(2**63 + 1))
    plan.launch("b", (1, 1, 1), (1, 1, 1), np.int32(9), np.uint64(0x7F00_0000_1000))
    compiled = plan.compile()
    relocate(compiled.values, BASES)
    p0, p1 = int(compiled.steps[0]["params"]), int(compiled.steps[1]["params"])
    assert _read(_read(p0, ctypes.c_uint64), ctypes.c_int32) == -5
    assert _read(_read(p0 + 8, ctypes.c_uint64), ctypes.c_float) == 0.25
    assert _read(_read(p0 + 16, ctypes.c_uint64), ctypes.c_uint64) == 2**63 + 1  # top byte 128: no space
    assert p1 == p0 + 24 and _read(_read(p1, ctypes.c_uint64), ctypes.c_int32) == 9
    assert _read(_read(p1 + 8, ctypes.c_uint64), ctypes.c_uint64) == 0x7F00_0000_1000  # a real address


def test_zeroing_steps_and_order():
    plan = Plan()
    plan.zero(address(WORK, 4096), 1024)
    plan.launch("k", (1, 1, 1), (1, 1, 1))
    compiled = plan.compile()
    compiled.resolve(lambda name: 3)
    assert len(plan) == 2
    steps = compiled.steps
    assert (int(steps[0]["function"]), int(steps[0]["dst"]), int(steps[0]["size"])) == (0, address(WORK, 4096), 1024)
    assert int(steps[1]["function"]) == 3 and compiled.kernels == ["k"]


def test_a_wrong_argument_type_is_refused():
    plan = Plan()
    plan.launch("k", (1, 1, 1), (1, 1, 1), 5)  # a plain int: its size is unknown
    with pytest.raises(TypeError, match="kernel argument"):
        plan.compile()
    with pytest.raises(TypeError, match="uint64"):
        Plan().table(np.zeros(2, dtype=np.int64), addresses=True)


def _named_plan() -> tuple[Plan, np.ndarray]:
    plan = Plan()
    plan.table(np.array([1.5, 2.5], dtype=np.float32))  # not addresses: never relocated
    pointers = np.array([address(INPUT, 16), address(WORK, 0), 0, 0x7F00_0000_2000, address(OUTPUT, 8)], dtype=np.uint64)
    table = plan.table(pointers, addresses=True)
    plan.launch("k", (1, 1, 1), (1, 1, 1), table, np.uint64(address(WORK, 256)), np.int32(7))
    want = np.array([(1 << 41) + 16, 1 << 42, 0, 0x7F00_0000_2000, (1 << 43) + 8], dtype=np.uint64)
    return plan, want


def test_named_addresses_are_relocated_in_the_tables_and_arguments():
    plan, want = _named_plan()
    compiled = plan.compile()
    pinned = compiled.blob.copy()
    compiled.relocate_tables(pinned, BASES)
    assert pinned[16:56].view(np.uint64).tolist() == want.tolist()
    assert pinned[:8].view(np.float32).tolist() == [1.5, 2.5]
    relocate(compiled.values, BASES)
    assert compiled.values[:3].tolist() == [(1 << 40) + 16, (1 << 42) + 256, 7]


def test_the_shim_relocates_as_python_does():
    lib = _batch_decode.load()
    if lib is None:
        pytest.skip(f"the decode shim does not build here: {_batch_decode.unavailable_reason()}")
    plan, want = _named_plan()
    compiled = plan.compile()
    pinned = np.full(plan.size, 0xAB, dtype=np.uint8)
    run = _RunPlan(src=compiled.blob.ctypes.data, pinned=pinned.ctypes.data, size=plan.size,
                   relocs=compiled.relocs.ctypes.data, n_relocs=len(compiled.relocs),
                   values=compiled.values.ctypes.data, n_values=len(compiled.values))
    run.bases[:] = BASES.tolist()
    lib.hr_relocate_plan(ctypes.addressof(run))
    assert pinned[16:56].view(np.uint64).tolist() == want.tolist()
    assert pinned[:8].view(np.float32).tolist() == [1.5, 2.5]
    assert compiled.values[:3].tolist() == [(1 << 40) + 16, (1 << 42) + 256, 7]


def test_the_layouts_match_the_shims_structs():
    # hr_step: void*, unsigned[3], unsigned[3], void**, unsigned long long, size_t (batch_decode.c).
    assert [_STEP.fields[f][1] for f in ("function", "grid", "block", "params", "dst", "size")] == [0, 8, 20, 32, 40, 48]
    assert _STEP.itemsize == 56
    offsets = {name: getattr(_RunPlan, name).offset for name, _ in _RunPlan._fields_}
    assert offsets == {"wait_event": 0, "src": 8, "pinned": 16, "device": 24, "size": 32, "steps": 40,
                       "n_steps": 48, "events": 56, "cuda_error": 72, "relocs": 80, "n_relocs": 88, "values": 96,
                       "n_values": 104, "bases": 112}
    assert isinstance(TableRef(8), int)
