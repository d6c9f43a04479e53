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
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

__all__ = ["Plan", "PlanSlots", "TableRef"]

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
    ]


class TableRef(int):
    """A kernel argument that is the device address of a table of the plan: its offset in the blob."""


class Plan:
    """Tables and steps of one batch, in order. Arguments are ``TableRef`` (a table's device
    address), ``np.uint64`` (8 bytes: addresses), ``np.int32`` or ``np.float32`` (4 bytes)."""

    def __init__(self) -> None:
        self._tables: list[tuple[int, np.ndarray]] = []
        self.size = 0
        self._steps: list[tuple[Any, ...]] = []

    def __len__(self) -> int:
        return len(self._steps)

    def table(self, array: np.ndarray) -> TableRef:
        """``array``'s bytes go up with the plan; returns the argument that addresses them."""
        array = np.ascontiguousarray(array)
        offset = self.size
        self._tables.append((offset, array))
        self.size += -(-array.nbytes // _ALIGN) * _ALIGN
        return TableRef(offset)

    def launch(self, function: int, grid: tuple[int, int, int], block: tuple[int, int, int], *args: Any) -> None:
        self._steps.append((int(function), grid, block, args))

    def zero(self, address: int, size: int) -> None:
        """Zero ``size`` bytes of device memory at ``address`` (in order with the launches)."""
        self._steps.append((0, int(address), int(size)))

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

    def arrays(self, device: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The steps as ``hr_step`` rows, with the tables at ``device``; and the argument values and
        their addresses (``params``), which must stay alive while the steps are issued."""
        n_args = sum(len(s[3]) for s in self._steps if s[0])
        values = np.zeros(max(n_args, 1), dtype=np.uint64)
        params = np.zeros(max(n_args, 1), dtype=np.uint64)
        steps = np.zeros(len(self._steps), dtype=_STEP)
        base, slot = values.ctypes.data, 0
        as_int32, as_float32 = values.view(np.int32), values.view(np.float32)
        for i, step in enumerate(self._steps):
            if not step[0]:
                steps[i]["dst"], steps[i]["size"] = step[1], step[2]
                continue
            function, grid, block, args = step
            steps[i]["function"], steps[i]["grid"], steps[i]["block"] = function, grid, block
            steps[i]["params"] = params.ctypes.data + 8 * slot
            for arg in args:
                if isinstance(arg, TableRef):
                    values[slot] = device + int(arg)
                elif isinstance(arg, np.int32):
                    as_int32[2 * slot] = arg  # the slot's first 4 bytes: little-endian
                elif isinstance(arg, np.float32):
                    as_float32[2 * slot] = arg
                elif isinstance(arg, np.uint64):
                    values[slot] = arg
                else:
                    raise TypeError(f"a kernel argument must be TableRef, np.uint64, np.int32 or np.float32, got {arg!r}")
                params[slot] = base + 8 * slot
                slot += 1
        return steps, values, params


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

    def run(self, plan: Plan, *, ready: torch.cuda.Event | None = None, native: bool = True) -> None:
        """Issue ``plan`` on the stream, then record ``ready`` (if given). ``native``: through the shim
        when it reaches the CUDA driver, else (or False) through CuPy."""
        slot = self._slots[self._turn % len(self._slots)]
        self._turn += 1
        if plan.size > slot.capacity or slot.device is None:
            import cupyx

            slot.event.synchronize()  # the old blocks' last copy has run
            slot.capacity = max(plan.size, 2 * slot.capacity, 1 << 16)
            slot.pinned = cupyx.empty_pinned((slot.capacity,), dtype=np.uint8)
            with self.stream:  # CuPy's pools are per stream: the block belongs to this one
                slot.device = self.cupy.empty((slot.capacity,), dtype=self.cupy.uint8)
        device = slot.device.data.ptr
        steps, values, params = plan.arrays(device)
        blob = plan.blob()
        lib = _shim() if native else None
        if lib is not None:
            run = _RunPlan(wait_event=slot.event.cuda_event, src=blob.ctypes.data, pinned=slot.pinned.ctypes.data,
                           device=device, size=plan.size, steps=steps.ctypes.data, n_steps=len(steps))
            run.events[0] = slot.event.cuda_event
            run.events[1] = ready.cuda_event if ready is not None else None
            if not lib.hr_run_plan(ctypes.addressof(run), self.stream.ptr):
                raise RuntimeError(f"a CUDA call of the post ops failed (CUresult {run.cuda_error})")
            return
        self._run_python(plan, slot, steps, blob, device, ready)

    def _run_python(self, plan: Plan, slot: _Slot, steps: np.ndarray, blob: np.ndarray, device: int,
                    ready: torch.cuda.Event | None) -> None:
        runtime, driver = self.cupy.cuda.runtime, self.cupy.cuda.driver
        slot.event.synchronize()
        if plan.size:
            slot.pinned[: plan.size] = blob
            runtime.memcpyAsync(device, slot.pinned.ctypes.data, plan.size, runtime.memcpyHostToDevice, self.stream.ptr)
        for s in steps:
            if s["function"]:
                (gx, gy, gz), (bx, by, bz) = (int(v) for v in s["grid"]), (int(v) for v in s["block"])
                driver.launchKernel(int(s["function"]), gx, gy, gz, bx, by, bz, 0, self.stream.ptr, int(s["params"]), 0)
            else:
                runtime.memsetAsync(int(s["dst"]), 0, int(s["size"]), self.stream.ptr)
        slot.event.record(self._torch_stream)
        if ready is not None:
            ready.record(self._torch_stream)


def _shim() -> Any:
    """The decode shim's library when it reaches the CUDA driver, else None."""
    from . import _batch_decode

    if _batch_decode.driver_reason() is not None:
        return None
    return _batch_decode.load()
