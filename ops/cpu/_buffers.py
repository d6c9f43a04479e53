"""Recycled memory for the CPU path's batch tensors.

A batch of 128 float32 images at 224 x 224 is 77 MB. Made fresh for every batch, it is mapped
anew and the kernel faults in and zeroes each of its pages as the workers write them: filling such
a batch took 42-44 ms fresh against 19-24 ms reused (one thread, the 2-core VM). So the executor
takes its batch tensors from here: arrays it keeps, handed out as torch tensors over them
(``torch.from_numpy``, whose storage holds the array), each array used again once no tensor or view
of it is left (its reference count says so). A batch the consumer still holds is never written
over: the pool makes another.
"""

from __future__ import annotations

import math
import sys

import numpy as np
import torch

__all__ = ["BatchBuffers"]

# How many arrays a pool keeps: the batches a CPU loader has alive at once (its prefetch, 3 by
# default, one being made, the one the consumer holds) with room to spare. Arrays made past it
# (a consumer keeping its batches) are not kept, and are freed with their tensors.
KEEP = 8


class BatchBuffers:
    """Batch tensors over recycled arrays, for one executor (one thread calls ``tensor``)."""

    def __init__(self, keep: int = KEEP) -> None:
        self._arrays: list[np.ndarray] = []
        self._keep = keep

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype``, over a kept array no tensor uses."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        arrays = self._arrays
        too_small = None
        for i in range(len(arrays)):
            if sys.getrefcount(arrays[i]) == 2:  # the list's reference and the call's own: free
                if arrays[i].nbytes >= nbytes:
                    return _over(arrays[i], nbytes, shape, dtype)
                too_small = i
        array = np.empty(nbytes, dtype=np.uint8)
        if too_small is not None:  # a free array too small for this batch makes room for it
            arrays[too_small] = array
        elif len(arrays) < self._keep:
            arrays.append(array)
        return _over(array, nbytes, shape, dtype)

    def clear(self) -> None:
        """Let the kept arrays go (those still in use live on with their tensors)."""
        self._arrays.clear()


def _over(array: np.ndarray, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(array[:nbytes]).view(dtype).view(shape)
