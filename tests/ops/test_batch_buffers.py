"""The CPU path's recycled batch memory: an array goes back to use only once no tensor or view of it
is left, so a batch the consumer keeps is never written over."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from sample_data import jpeg_items

import headrace
from headrace import ops, readers
from headrace.ops.cpu._buffers import BatchBuffers


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_an_array_comes_back_once_its_tensor_and_views_are_gone():
    pool = BatchBuffers()
    first = pool.tensor((4, 3, 8, 8), torch.float32)
    where = _address(first)
    row, moved = first[1], first.movedim(1, -1)
    del first
    second = pool.tensor((4, 3, 8, 8), torch.float32)
    assert _address(second) != where  # the views hold the first array
    del row
    assert _address(pool.tensor((4, 3, 8, 8), torch.float32)) not in (where, _address(second))
    del moved
    assert _address(pool.tensor((4, 3, 8, 8), torch.float32)) == where


def test_a_numpy_view_of_the_tensor_holds_the_array_too():
    pool = BatchBuffers()
    t = pool.tensor((2, 5), torch.float16)
    where, array = _address(t), t.numpy()
    del t
    assert _address(pool.tensor((2, 5), torch.float16)) != where
    del array
    assert _address(pool.tensor((2, 5), torch.float16)) == where


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_tensors_have_the_shape_and_dtype_asked_for_and_hold_what_is_written(dtype):
    pool = BatchBuffers()
    for shape in [(3, 7, 5), (1, 2, 3, 4), (2, 3, 7, 5)]:  # the last one over the first's freed array
        t = pool.tensor(shape, dtype)
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        values = torch.arange(t.numel()).reshape(shape).to(dtype)
        t.copy_(values)
        assert torch.equal(t, values)
        del t


def test_a_smaller_batch_takes_the_front_of_a_free_array_and_a_larger_one_replaces_a_free_small_one():
    pool = BatchBuffers(keep=2)
    big = pool.tensor((8, 16), torch.float32)
    where = _address(big)
    del big
    small = pool.tensor((3, 16), torch.float32)  # the last, partial batch of an epoch
    assert _address(small) == where
    del small
    tiny = BatchBuffers(keep=1)
    t = tiny.tensor((2, 2), torch.uint8)
    del t
    large = tiny.tensor((64, 64), torch.uint8)
    where = _address(large)
    del large
    assert _address(tiny.tensor((64, 64), torch.uint8)) == where  # kept in the small one's place


def test_arrays_past_keep_are_not_kept():
    pool = BatchBuffers(keep=2)
    held = [pool.tensor((4, 4), torch.float32) for _ in range(3)]
    addresses = [_address(t) for t in held]
    del held
    again = [pool.tensor((4, 4), torch.float32) for _ in range(3)]
    assert [_address(t) for t in again[:2]] == addresses[:2]
    assert len(pool._arrays) == 2


def test_an_empty_batch_needs_no_array():
    pool = BatchBuffers()
    assert pool.tensor((0, 3, 4, 4), torch.float32).shape == (0, 3, 4, 4)
    assert pool._arrays == []


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
@pytest.mark.parametrize("normalize", [True, False])
async def test_batches_a_consumer_keeps_are_the_batches_it_was_given(layout, normalize):
    """Two epochs, every batch kept, against the same run cloning each batch as it came: the same
    pixels, so no kept batch was written over by a later one."""
    items = jpeg_items(40, seed=3, height=48, width=64)
    steps = [ops.Decode(), ops.RandomResizedCrop(32), ops.Flip()]
    if normalize:
        steps.append(ops.Normalize(layout=layout))
    pipeline = ops.Pipeline(steps, layout=layout)

    async def run(keep_as_given: bool) -> list[torch.Tensor]:
        loader = headrace.Loader(readers.sequence(items, shuffle=True, seed=2), batch_size=8, pipeline=pipeline,
                                 device="cpu", num_threads=2, seed=7)
        out = []
        async with loader:
            for _ in range(2):
                async for batch in loader:
                    out.append(batch["image"] if keep_as_given else batch["image"].clone())
                    del batch
                    gc.collect()
        return out

    kept, cloned = await run(True), await run(False)
    assert len(kept) == len(cloned) == 10
    assert len({_address(t) for t in kept}) == 10  # ten live batches: ten arrays
    for a, b in zip(kept, cloned):
        assert torch.equal(a, b)


async def test_batches_let_go_are_made_in_the_same_memory_again():
    items = jpeg_items(48, seed=4, height=40, width=40)
    pipeline = ops.Pipeline([ops.Decode(), ops.Resize((24, 24)), ops.Normalize()])
    loader = headrace.Loader(readers.sequence(items), batch_size=8, pipeline=pipeline, device="cpu", num_threads=2)
    addresses = set()
    async with loader:
        for _ in range(3):
            async for batch in loader:
                addresses.add(_address(batch["image"]))
                assert np.isfinite(batch["image"].numpy()).all()
                del batch
    assert len(addresses) <= 8  # 18 batches in at most the arrays a pool keeps
