"""A batch's kernel launches as data, issued together: the post ops' tables in one host blob, each
launch's arguments in one array, run by one call.

Why: every CUDA call from Python (CuPy's copies, launches, event records, torch's allocations) lets
the GIL go and waits to take it back, up to the switch interval when another thread runs Python.
A ``RandAugment`` batch was ~16 launches of ~6 such calls each. On the H200 the lanes then spent
77% of their samples in the post ops, nearly all of it waiting for the GIL, and the policy cost the
training row 35-50% of its images/s (docs/benchmarks.md, thirtieth session). Built as a ``Plan``,
the batch goes up in one call of the decode shim (``hr_run_plan`` in ``_native/batch_decode.c``:
wait for the slot's last reader, copy the tables up, launch, record) that runs without the GIL;
where the shim cannot reach the CUDA driver, the same plan runs through CuPy, call by call.

A plan may be built before its memory exists (in the prep thread, ahead of the lane: its host work
then leaves the lane's critical path). It names addresses in spaces (``address``: the tables'
device block, the batch's input, the passes' workspace, the output), and kernels by name; running
it relocates the addresses and resolves the names.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

__all__ = ["INPUT", "OUTPUT", "Plan", "PlanSlots", "TABLES", "TableRef", "WORK", "address", "relocate"]

# Address spaces: a plan's address is (space << 56) | offset until it runs, then the space's base
# plus the offset. Device and host addresses never set the top byte (user space on x86-64 ends below
# 2**56 even with 5-level paging, and CUDA's unified addresses are in it), so space 0 is a real
# address (or NULL) and is left alone.
TABLES, INPUT, WORK, OUTPUT = 1, 2, 3, 4
_SHIFT = 56
_SPACES = 5  # bases[0] is unused


def address(space: int, offset: Any = 0) -> Any:
    """An address ``offset`` bytes into ``space`` (an int, or an int64 array of offsets)."""
    if isinstance(offset, np.ndarray):
        return (np.int64(space) << _SHIFT) + offset.astype(np.int64)
    return (int(space) << _SHIFT) + int(offset)


def relocate(values: np.ndarray, bases: np.ndarray) -> None:
    """Addresses in ``values`` (uint64, in place) made real: each space's base plus the offset."""
    space = (values >> np.uint64(_SHIFT)).astype(np.int64)
    named = (space > 0) & (space < _SPACES)
    if named.any():
        values[named] = bases[space[named]] + (values[named] & np.uint64((1 << _SHIFT) - 1))


# hr_step: a launch (function, grid, block, params) or, with function 0, zeroing size bytes at dst.
_STEP = np.dtype([("function", np.uint64), ("grid", np.uint32, 3), ("block", np.uint32, 3), ("params", np.uint64),
                  ("dst", np.uint64), ("size", np.uint64)], align=True)
assert _STEP.itemsize == 56
_ALIGN = 16  # each table starts 16-byte aligned in the blob


class _RunPlan(ctypes.Structure):
    """``hr_plan`` in the shim."""

    _fields_ = [
        ("wait_event", ctypes.c_void_p),
        ("src", ctypes.c_void_p),
        ("pinned", ctypes.c_void_p),
        ("device", ctypes.c_uint64),
        ("size", ctypes.c_size_t),
        ("steps", ctypes.c_void_p),
        ("n_steps", ctypes.c_int),
        ("events", ctypes.c_void_p * 2),
        ("cuda_error", ctypes.c_int),
        ("relocs", ctypes.c_void_p),
        ("n_relocs", ctypes.c_int),
        ("values", ctypes.c_void_p),
        ("n_values", ctypes.c_int),
        ("bases", ctypes.c_uint64 * _SPACES),
    ]


class TableRef(int):
    """A kernel argument that is the device address of a table of the plan: its offset in the blob."""


class Plan:
    """Tables and steps of one batch, in order. Arguments are ``TableRef`` (a table's device
    address), ``np.uint64`` (8 bytes: addresses, real or ``address``'s), ``np.int32`` or
    ``np.float32`` (4 bytes). Kernels are named; ``compile`` lays the plan out once (any thread,
    no CUDA), ``PlanSlots.run`` issues it, once: its argument values are relocated in place."""

    def __init__(self) -> None:
        self._tables: list[tuple[int, np.ndarray]] = []
        self._relocs: list[tuple[int, int]] = []
        self.size = 0
        self._steps: list[tuple[Any, ...]] = []
        self.compiled: _Compiled | None = None

    def __len__(self) -> int:
        return len(self._steps)

    def table(self, array: np.ndarray, *, addresses: bool = False) -> TableRef:
        """``array``'s bytes go up with the plan; returns the argument that addresses them.
        ``addresses``: a uint64 array whose values may be ``address``'s, relocated when it runs."""
        array = np.ascontiguousarray(array)
        offset = self.size
        self._tables.append((offset, array))
        if addresses:
            if array.dtype != np.uint64:
                raise TypeError(f"a table of addresses must be uint64, got {array.dtype}")
            self._relocs.append((offset, array.size))
        self.size += -(-array.nbytes // _ALIGN) * _ALIGN
        return TableRef(offset)

    def launch(self, kernel: str, grid: tuple[int, int, int], block: tuple[int, int, int], *args: Any) -> None:
        self._steps.append((kernel, grid, block, args))

    def zero(self, address: int, size: int) -> None:
        """Zero ``size`` bytes of device memory at ``address`` (in order with the launches)."""
        self._steps.append((None, int(address), int(size)))

    def blob(self) -> np.ndarray:
        """The tables' bytes, laid out as ``table`` placed them (read-only). Joined as ``bytes``:
        NumPy's copies of more than 500 elements let the GIL go, and a lane waits to take it back."""
        parts, at = [], 0
        for offset, array in self._tables:
            parts.append(bytes(offset - at))
            parts.append(array.tobytes())
            at = offset + array.nbytes
        parts.append(bytes(self.size - at))
        return np.frombuffer(b"".join(parts), dtype=np.uint8)

    def compile(self) -> _Compiled:
        """The plan laid out for the shim (once; later calls return the same): its steps as
        ``hr_step`` rows with addresses still named, the argument values and their addresses
        (``params``), the blob, and the runs of addresses in the blob to relocate."""
        if self.compiled is not None:
            return self.compiled
        # Built as Python lists, then one array each: an element of a structured array costs
        # microseconds to set, and a plan has ~100 arguments.
        rows: list[tuple[Any, ...]] = []
        words: list[int] = []  # each argument's 8 bytes, as an int (scalars in the low 4: little-endian)
        kernels, launches, slots = [], [], []
        for i, step in enumerate(self._steps):
            if step[0] is None:
                rows.append((0, _NO_DIMS, _NO_DIMS, 0, step[1], step[2]))
                continue
            kernel, grid, block, args = step
            kernels.append(kernel)
            launches.append(i)
            slots.append(len(words))
            rows.append((0, grid, block, 0, 0, 0))
            words.extend(map(_word, args))
        values = np.array(words or [0], dtype=np.uint64)
        # CUDA's kernelParams: per launch, the address of an array of pointers to its arguments.
        params = np.uint64(values.ctypes.data) + np.uint64(8) * np.arange(len(values), dtype=np.uint64)
        steps = np.array(rows, dtype=_STEP)
        if launches:
            steps["params"][launches] = params.ctypes.data + 8 * np.array(slots, dtype=np.uint64)
        relocs = np.array(self._relocs or [(0, 0)], dtype=np.uint64).reshape(-1, 2)
        self.compiled = _Compiled(steps, values, params, self.blob(), relocs[: len(self._relocs)],
                                  kernels, np.array(launches, dtype=np.int64))
        return self.compiled


_NO_DIMS = (0, 0, 0)


# Each argument type's word (``address(TABLES, offset)`` for a table), looked up by the exact type
# first: a plan has ~70 arguments, and a chain of isinstance checks cost as much as the conversion.
_WORDS: dict[type, Callable[[Any], int]] = {
    TableRef: lambda arg: (TABLES << _SHIFT) + int(arg),
    np.int32: lambda arg: int(arg) & 0xFFFF_FFFF,
    np.float32: lambda arg: int(arg.view(np.uint32)),
    np.uint64: int,
}


def _word(arg: Any) -> int:
    """A kernel argument's 8 bytes (``Plan``'s types), as the shim hands them to CUDA."""
    convert = _WORDS.get(type(arg))
    if convert is None:  # a subclass of one of them
        convert = next((f for kind, f in _WORDS.items() if isinstance(arg, kind)), None)
        if convert is None:
            raise TypeError(f"a kernel argument must be TableRef, np.uint64, np.int32 or np.float32, got {arg!r}")
    return convert(arg)


class _Compiled:
    """A plan laid out (``Plan.compile``); the arrays must stay alive while it is issued."""

    def __init__(self, steps: np.ndarray, values: np.ndarray, params: np.ndarray, blob: np.ndarray,
                 relocs: np.ndarray, kernels: list[str], launches: np.ndarray) -> None:
        self.steps, self.values, self.params, self.blob = steps, values, params, blob
        self.relocs = relocs  # (k, 2) uint64: a run's byte offset in the blob, its count of addresses
        self.kernels = kernels  # the launches' kernel names, in order
        self.launches = launches  # the launches' rows in ``steps``

    def relocate_tables(self, tables: np.ndarray, bases: np.ndarray) -> None:
        """The runs of addresses in ``tables``, a copy of the blob (uint8), made real at ``bases``
        (``hr_relocate_plan`` does the same in the shim)."""
        for offset, count in self.relocs.tolist():
            relocate(tables[offset : offset + 8 * count].view(np.uint64), bases)

    def resolve(self, function: Callable[[str], int]) -> None:
        """The launches' CUfunctions, by name (``function``), into ``steps``."""
        if len(self.kernels):
            self.steps["function"][self.launches] = [function(name) for name in self.kernels]


class _Slot:
    """A pinned host block, its device twin, and the event recorded after the plan that used it last."""

    def __init__(self, stream: Any) -> None:
        self.capacity = 0
        self.pinned: np.ndarray | None = None
        self.device: Any = None
        self.event = torch.cuda.Event()
        self.event.record(stream)  # made now, so the shim can wait on it by its handle


class PlanSlots:
    """Blocks for plans' tables on one stream (CuPy's ``stream``), used in turn: a block is reused
    ``count`` plans later, after a host wait for its event (long passed, in practice)."""

    def __init__(self, cupy: Any, stream: Any, count: int = 4) -> None:
        self.cupy = cupy
        self.stream = stream
        self._torch_stream = torch.cuda.ExternalStream(stream.ptr)
        self._slots = [_Slot(self._torch_stream) for _ in range(count)]
        self._turn = 0

    def run(self, plan: Plan, function: Callable[[str], int], *, bases: dict[int, int] | None = None,
            ready: torch.cuda.Event | None = None, native: bool = True) -> None:
        """Issue ``plan`` on the stream, then record ``ready`` (if given). ``function`` gives a kernel's
        CUfunction by name; ``bases`` the base of each address space the plan names (``INPUT``,
        ``WORK``, ``OUTPUT``; the tables' is the slot's). ``native``: through the shim when it
        reaches the CUDA driver, else (or False) through CuPy."""
        slot = self._slots[self._turn % len(self._slots)]
        self._turn += 1
        if plan.size > slot.capacity or slot.device is None:
            import cupyx

            slot.event.synchronize()  # the old blocks' last copy has run
            slot.capacity = max(plan.size, 2 * slot.capacity, 1 << 16)
            slot.pinned = cupyx.empty_pinned((slot.capacity,), dtype=np.uint8)
            with self.stream:  # CuPy's pools are per stream: the block belongs to this one
                slot.device = self.cupy.empty((slot.capacity,), dtype=self.cupy.uint8)
        compiled = plan.compile()
        compiled.resolve(function)
        base = [0] * _SPACES
        base[TABLES] = slot.device.data.ptr
        for space, at in (bases or {}).items():
            base[space] = at
        lib = _shim() if native else None
        if lib is not None:
            relocs = compiled.relocs
            run = _RunPlan(wait_event=slot.event.cuda_event, src=compiled.blob.ctypes.data, pinned=slot.pinned.ctypes.data,
                           device=base[TABLES], size=plan.size, steps=compiled.steps.ctypes.data, n_steps=len(compiled.steps),
                           relocs=relocs.ctypes.data, n_relocs=len(relocs), values=compiled.values.ctypes.data,
                           n_values=len(compiled.values))
            run.events[0] = slot.event.cuda_event
            run.events[1] = ready.cuda_event if ready is not None else None
            run.bases[:] = base
            if not lib.hr_run_plan(ctypes.addressof(run), self.stream.ptr):
                raise RuntimeError(f"a CUDA call of the post ops failed (CUresult {run.cuda_error})")
            return
        self._run_python(plan.size, compiled, slot, np.array(base, dtype=np.uint64), ready)

    def _run_python(self, size: int, compiled: _Compiled, slot: _Slot, bases: np.ndarray,
                    ready: torch.cuda.Event | None) -> None:
        """``hr_run_plan``'s work, call by call through CuPy."""
        runtime, driver = self.cupy.cuda.runtime, self.cupy.cuda.driver
        slot.event.synchronize()
        relocate(compiled.values, bases)
        if size:
            slot.pinned[:size] = compiled.blob
            compiled.relocate_tables(slot.pinned[:size], bases)
            runtime.memcpyAsync(int(bases[TABLES]), slot.pinned.ctypes.data, size, runtime.memcpyHostToDevice,
                                self.stream.ptr)
        for s in compiled.steps:
            if s["function"]:
                (gx, gy, gz), (bx, by, bz) = (int(v) for v in s["grid"]), (int(v) for v in s["block"])
                driver.launchKernel(int(s["function"]), gx, gy, gz, bx, by, bz, 0, self.stream.ptr, int(s["params"]), 0)
            else:
                dst = np.array([s["dst"]], dtype=np.uint64)
                relocate(dst, bases)
                runtime.memsetAsync(int(dst[0]), 0, int(s["size"]), self.stream.ptr)
        slot.event.record(self._torch_stream)
        if ready is not None:
            ready.record(self._torch_stream)


def _shim() -> Any:
    """The decode shim's library when it reaches the CUDA driver, else None."""
    from . import _batch_decode

    if _batch_decode.driver_reason() is not None:
        return None
    return _batch_decode.load()
