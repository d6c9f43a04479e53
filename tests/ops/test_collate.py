"""collate of read-only NumPy arrays (a reader's shared memory, COCO's labels, np.frombuffer):
the batch gets its own copy, and the user no warning from torch."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from headrace.ops._collate import collate


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _collated_without_warnings(values: list) -> object:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        column = collate(values)
    assert [str(w.message) for w in caught] == []
    return column


@pytest.mark.parametrize("make", [
    lambda: _read_only(np.array([3, 1, 4], dtype=np.int64)),
    lambda: np.frombuffer(np.array([3, 1, 4], dtype=np.int64).tobytes(), dtype=np.int64),
])
def test_read_only_arrays_of_one_shape_stack_without_a_warning(make):
    rows = [make(), make()]
    column = _collated_without_warnings(rows)
    assert isinstance(column, torch.Tensor) and column.dtype == torch.int64
    assert column.tolist() == [[3, 1, 4], [3, 1, 4]]


def test_read_only_rows_of_a_list_column_are_the_batchs_own_copies():
    shared = _read_only(np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], dtype=np.float32))
    other = _read_only(np.array([[0.5, 0.5, 2.5, 2.5]], dtype=np.float32))
    column = _collated_without_warnings([shared, other, shared[:, ::2]])  # a strided view too
    assert isinstance(column, list) and len(column) == 3
    for row, given in zip(column, [shared, other, shared[:, ::2]]):
        assert row.dtype == torch.float32 and np.array_equal(row.numpy(), given)
    column[0].zero_()  # writing the batch leaves the reader's array as it was
    assert shared.tolist() == [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]]


def test_a_list_column_of_writable_arrays_stays_over_their_memory():
    rows = [np.array([1, 2]), np.array([3, 4, 5])]
    column = collate(rows)
    assert isinstance(column, list) and [row.tolist() for row in column] == [[1, 2], [3, 4, 5]]
    assert column[0].data_ptr() == rows[0].ctypes.data  # no copy: only read-only arrays get one


@pytest.mark.parametrize("read_only", [False, True])
def test_zero_d_arrays_stack_into_one_value_a_row_as_default_collate_does(read_only):
    # A 0-d array (np.asarray(score), a scalar .npy) is one value: a column of them is [B], not [B, 1].
    values = [np.asarray(v, dtype=np.float32) for v in (0.5, 1.5, 2.5)]
    if read_only:
        values = [_read_only(v) for v in values]
    column = _collated_without_warnings(values)
    expected = torch.utils.data.default_collate([np.asarray(v, dtype=np.float32) for v in (0.5, 1.5, 2.5)])
    assert column.shape == expected.shape == (3,) and column.dtype == torch.float32
    assert torch.equal(column, expected)
