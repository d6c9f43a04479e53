"""A lane's per-batch host memory and CUDA handles: pinned tables, an event, the shim's launch.

Every CUDA call from Python drops the GIL and waits to take it back, up to the switch interval
when another thread runs Python. So a lane's batch goes up in as few calls as possible: its kernel
tables and labels sit in one pinned block (two copies), and when the shim can reach the CUDA
driver (``_batch_decode.driver_reason``) the copies, the kernel and the event are issued by the
same GIL-free call that decodes (``FusedLaunch``).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from ._kernels import BLOCK, grid

__all__ = ["FusedLaunch", "Staging"]


class Staging:
    """One pinned host block and its device twin (the kernel's tables, then the labels), and the
    event recorded after the batch that used them.

    A lane uses its blocks in turn; each is reused four batches later. The lane waits, before
    each decode, for its batch two back (``Lane`` in ``_lane.py``), so when batch i fills block i mod 4,
    the batch i - 4 that read it last has run: no wait here. ``ready`` is made (and recorded once)
    up front, so the shim can record it by its handle; consumers wait on it (``Processed.ready``).
    A later record only makes a late consumer wait for a later batch of the same stream.
    """

    # Everything before "labels" goes up in one copy (``upload_tables``); "offsets" only for list outputs.
    _FIELDS = (("ptrs", np.uint64, 1), ("meta", np.int32, 8), ("geo", np.float32, 8), ("offsets", np.int64, 1),
               ("labels", np.int64, 1))

    def __init__(self, cupy, stream) -> None:
        self.cupy = cupy
        self.stream = stream  # CuPy's, the lane's
        self.capacity = 0
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.ExternalStream(stream.ptr))

    def host(self, n: int) -> dict[str, np.ndarray]:
        """The first ``n`` rows of each table (pinned), free to fill."""
        self.reserve(n)
        return {name: view[:n] for name, view in self.views.items()}

    def reserve(self, n: int) -> None:
        """Room for ``n`` rows (the blocks exist after this, even for none: a batch may have no rows left)."""
        if n > self.capacity or not self.capacity:
            self._grow(max(n, 2 * self.capacity, 64))

    def _grow(self, capacity: int) -> None:
        import cupyx

        self.ready.synchronize()  # the old blocks' last copies have run
        self.capacity, self.offsets, offset = capacity, {}, 0
        for name, dtype, width in self._FIELDS:
            self.offsets[name] = offset
            offset += -(-capacity * width * np.dtype(dtype).itemsize // 256) * 256
        self.h_block = cupyx.empty_pinned((offset,), dtype=np.uint8)
        with self.stream:  # CuPy's pools are per stream: the block belongs to the lane's
            self.d_block = self.cupy.empty((offset,), dtype=self.cupy.uint8)
        self.views = {
            name: self.h_block[self.offsets[name] :].view(dtype)[: capacity * width].reshape(
                (capacity, width) if width > 1 else (capacity,))
            for name, dtype, width in self._FIELDS
        }

    def device(self, name: str) -> int:
        """The device address of table ``name``."""
        return self.d_block.data.ptr + self.offsets[name]

    def source(self, name: str) -> int:
        """The pinned host address of table ``name``."""
        return self.h_block.ctypes.data + self.offsets[name]

    def upload_tables(self) -> tuple[np.uint64, np.uint64, np.uint64, np.uint64]:
        """Copy the kernel's tables up (one copy, on the lane's stream) and return their device
        addresses (ptrs, meta, geo, offsets)."""
        self._copy(self.d_block.data.ptr, self.h_block.ctypes.data, self.offsets["labels"])
        return tuple(np.uint64(self.device(name)) for name in ("ptrs", "meta", "geo", "offsets"))

    def upload(self, name: str, destination: int, n: int) -> None:
        """Copy the first ``n`` rows of table ``name`` to device address ``destination`` (lane's stream)."""
        self._copy(destination, self.source(name), n * self.views[name].strides[0])

    def _copy(self, destination: int, source: int, size: int) -> None:
        runtime = self.cupy.cuda.runtime
        runtime.memcpyAsync(destination, source, size, runtime.memcpyHostToDevice, self.stream.ptr)


class _ResampleArgs(ctypes.Structure):
    """The fused resample kernel's arguments, in its signature's order (``_kernels.py``)."""

    _fields_ = [
        ("src", ctypes.c_uint64), ("meta", ctypes.c_uint64), ("geo", ctypes.c_uint64), ("out", ctypes.c_uint64),
        ("oh", ctypes.c_int), ("ow", ctypes.c_int), ("c", ctypes.c_int), ("chw", ctypes.c_int),
        ("normalize", ctypes.c_int), ("mean", ctypes.c_uint64), ("inv_std", ctypes.c_uint64),
        ("offsets", ctypes.c_uint64),  # null: every output has the fixed size
    ]


class FusedLaunch:
    """The shim's ``Launch`` for one lane: the fused kernel and its fixed arguments, set once; per
    batch only the buffers, the batch size and the events change (``prepare``)."""

    def __init__(self, kernel, *, size: tuple[int, int], channels: int, chw: bool, normalize: bool,
                 mean: Any, inv_std: Any) -> None:
        from ._batch_decode import Launch

        oh, ow = size
        self.args = _ResampleArgs(oh=oh, ow=ow, c=channels, chw=int(chw), normalize=int(normalize),
                                  mean=mean.data.ptr, inv_std=inv_std.data.ptr)
        base = ctypes.addressof(self.args)
        self.params = (ctypes.c_void_p * len(_ResampleArgs._fields_))(
            *(base + getattr(_ResampleArgs, name).offset for name, _ in _ResampleArgs._fields_)
        )
        self.launch = Launch(function=kernel.kernel.ptr, params=ctypes.addressof(self.params))
        self.launch.grid[:] = grid(oh, ow, 1)
        self.launch.block[:] = BLOCK

    def prepare(self, stage: Staging, out: torch.Tensor, meta: np.ndarray, geo: np.ndarray,
                labels: np.ndarray | None, labels_out: torch.Tensor | None,
                wait: torch.cuda.Event | None, record: bool) -> Any:
        """The launch for a batch: the shim decodes, fills ``stage``'s tables from ``meta`` and
        ``geo`` (the prep thread's, contiguous, one row per image) and ``labels``, copies them up,
        runs the kernel into ``out``, copies the labels into ``labels_out`` and, with ``record``,
        records ``stage.ready``. The arrays must live until the shim's call returns."""
        n = len(meta)
        stage.reserve(n)
        args, launch = self.args, self.launch
        args.src, args.meta, args.geo = stage.device("ptrs"), stage.device("meta"), stage.device("geo")
        args.out = out.data_ptr()
        launch.grid[2] = n
        launch.wait_event = wait.cuda_event if wait is not None else None
        launch.tables = stage.source("ptrs")
        launch.meta_offset, launch.geo_offset, launch.labels_offset = (
            stage.offsets["meta"], stage.offsets["geo"], stage.offsets["labels"])
        launch.meta_src, launch.geo_src = meta.ctypes.data, geo.ctypes.data
        launch.copy_dst[0], launch.copy_src[0], launch.copy_size[0] = stage.device("ptrs"), launch.tables, stage.offsets["labels"]
        if labels is not None:
            launch.labels_src = labels.ctypes.data
            launch.copy_dst[1], launch.copy_src[1], launch.copy_size[1] = labels_out.data_ptr(), stage.source("labels"), 8 * n
        else:
            launch.labels_src, launch.copy_size[1] = None, 0
        launch.event = stage.ready.cuda_event if record else None
        return launch
