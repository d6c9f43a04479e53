"""How samples' values become a batch's columns, for fields that are not the decoded image.

The rules, as torch's ``default_collate`` has them where they agree (a user moving from a
``DataLoader`` finds the same columns):

- tensors, or NumPy arrays of numbers, all of one shape and dtype: stacked into one tensor
  (arrays without a copy beyond the stack); of different shapes: a list of tensors;
- Python ints: an int64 tensor; floats: a float64 tensor; bools: a bool tensor;
- bytes stay a list of bytes, str a list of str; anything else (dicts, lists, a mix of kinds) a
  list of the values as they are.

A field whose name is ``npy`` or ends in ``.npy`` holding bytes is a NumPy ``.npy`` file: it is
loaded to its array first (never with pickles), so it stacks like any array.
"""

from __future__ import annotations

import io
import threading
from typing import Any

import numpy as np
import torch

__all__ = ["collate", "is_npy_field", "load_npy"]

_BYTES = (bytes, bytearray, memoryview)


def is_npy_field(name: str) -> bool:
    return name == "npy" or name.endswith(".npy")


# NumPy reads an .npy header with ast.literal_eval, and CPython's AST constructor keeps one
# recursion count per interpreter: two threads parsing at once can fail one of them with
# "SystemError: AST constructor recursion depth mismatch" (cpython gh-106905). It failed a .npy
# sample in the loader's threads once in a full CI run on Python 3.11.7. Loads are serialised, so
# our threads never race each other (a parse elsewhere in the process still can); np.load from
# memory holds the GIL for most of its time anyway.
_NPY_LOCK = threading.Lock()


def load_npy(data: bytes | bytearray | memoryview) -> np.ndarray:
    """An ``.npy`` file's array. Raises ValueError for bytes that are not one (or hold pickles)."""
    with _NPY_LOCK:
        return np.load(io.BytesIO(data), allow_pickle=False)


def collate(values: list[Any]) -> Any:
    """One column of a batch from the rows' ``values`` (the rules above)."""
    if not values:
        return []
    first = values[0]
    kind = type(first)
    if not all(type(v) is kind for v in values):
        return list(values)
    if kind is bool:
        return torch.tensor(values, dtype=torch.bool)
    if kind is int:
        return torch.tensor(values, dtype=torch.int64)
    if kind is float:
        return torch.tensor(values, dtype=torch.float64)
    if isinstance(first, _BYTES):
        return [bytes(v) for v in values]
    if isinstance(first, np.ndarray):
        if first.dtype.kind not in "biufc":  # strings, objects: not a tensor
            return list(values)
        tensors = [_tensor_of(v) for v in values]
        return _stack_or_list(tensors)
    if isinstance(first, np.generic) and first.dtype.kind in "biufc":
        return torch.from_numpy(np.asarray(values))
    if isinstance(first, torch.Tensor):
        return _stack_or_list(list(values))
    return list(values)


def _tensor_of(array: np.ndarray) -> torch.Tensor:
    """``array`` as a tensor, over its memory when it is writable, else over a copy."""
    if not array.flags.writeable:
        # A read-only array is memory its reader owns (COCO's boxes and labels, shared by every
        # epoch's samples; np.frombuffer over a record): a tensor over it would let the batch write
        # there (torch has no read-only tensors), and torch.from_numpy warns the user about it,
        # noise about memory they never chose. The copy is the batch's own.
        return torch.from_numpy(np.array(array, order="C"))
    # Only a copy where the memory is not C-ordered: np.ascontiguousarray would also make a 0-d array
    # 1-d, and a column of scalars (np.asarray(0.5), a scalar .npy) would stack to [B, 1], not [B].
    return torch.from_numpy(array if array.flags.c_contiguous else np.ascontiguousarray(array))


def _stack_or_list(tensors: list[torch.Tensor]) -> torch.Tensor | list[torch.Tensor]:
    shape, dtype, device = tensors[0].shape, tensors[0].dtype, tensors[0].device
    if all(t.shape == shape and t.dtype == dtype and t.device == device for t in tensors):
        return torch.stack(tensors)
    return tensors
