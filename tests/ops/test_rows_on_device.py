"""rows_on_device: a batch's columns to the device, a list column (a tensor a row) in one copy
handed out as views. On the CPU here (the GPU tests run it to CUDA): the same joins and splits."""

from __future__ import annotations

import torch

from headrace.ops._follow import rows_on_device

CPU = torch.device("cpu")


def _assert_rows_equal(moved: list[torch.Tensor], rows: list[torch.Tensor]) -> None:
    assert isinstance(moved, list) and len(moved) == len(rows)
    for got, row in zip(moved, rows):
        assert got.shape == row.shape and got.dtype == row.dtype and got.device == CPU
        assert torch.equal(got, row)


def _one_storage(moved: list[torch.Tensor]) -> bool:
    return len({row.untyped_storage().data_ptr() for row in moved}) == 1


def test_rows_of_one_trailing_shape_come_back_as_views_of_one_tensor():
    boxes = [torch.arange(12, dtype=torch.float32).reshape(3, 4), torch.zeros((0, 4)), torch.full((1, 4), 7.5),
             torch.zeros((0, 4)), torch.arange(8, dtype=torch.float32).reshape(2, 4) - 3]
    labels = [torch.tensor([1, 2, 3]), torch.zeros(0, dtype=torch.int64), torch.tensor([9]),
              torch.zeros(0, dtype=torch.int64), torch.tensor([4, 5])]
    out = rows_on_device({"boxes": boxes, "labels": labels}, CPU)
    _assert_rows_equal(out["boxes"], boxes)
    _assert_rows_equal(out["labels"], labels)
    # One copy of the column, not a copy a row: the input rows are not handed back.
    assert _one_storage(out["boxes"]) and _one_storage(out["labels"])
    assert out["boxes"][0].untyped_storage().data_ptr() != boxes[0].untyped_storage().data_ptr()
    assert [row.storage_offset() for row in out["labels"]] == [0, 3, 3, 4, 4]


def test_rows_of_no_boxes_at_all():
    rows = [torch.zeros((0, 4)), torch.zeros((0, 4))]
    out = rows_on_device({"boxes": rows}, CPU)["boxes"]
    _assert_rows_equal(out, rows)


def test_rows_of_other_shapes_are_copied_whole():
    masks = [torch.arange(6, dtype=torch.uint8).reshape(2, 3), torch.arange(20, dtype=torch.uint8).reshape(4, 5),
             torch.zeros((0, 5), dtype=torch.uint8), torch.tensor(3, dtype=torch.uint8)]  # a 0-d row too
    out = rows_on_device({"mask": masks}, CPU)["mask"]
    _assert_rows_equal(out, masks)
    assert _one_storage(out)  # one copy for them too, flattened


def test_rows_of_several_dtypes_are_copied_a_row_each():
    rows = [torch.tensor([1.5, 2.5]), torch.tensor([3, 4, 5]), torch.tensor([True])]
    out = rows_on_device({"values": rows}, CPU)["values"]
    _assert_rows_equal(out, rows)


def test_a_tensor_column_stays_one_tensor_and_other_values_stay_as_they_are():
    images = torch.arange(24, dtype=torch.uint8).reshape(2, 3, 4)
    keys, mixed = [b"a", b"bc"], [torch.tensor([1]), "not a tensor"]
    out = rows_on_device({"image": images, "keys": keys, "empty": [], "mixed": mixed, "meta": {"a": 1}}, CPU)
    assert torch.equal(out["image"], images)
    assert out["keys"] is keys and out["empty"] == [] and out["mixed"] is mixed and out["meta"] == {"a": 1}
