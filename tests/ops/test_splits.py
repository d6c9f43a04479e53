"""``Pipeline(splits=)``: a sample's clean view and its augmented views from one geometry (timm's
``AugMixDataset(num_splits=)`` for AugMix's Jensen-Shannon loss), on the CPU path.

What is checked, through real JPEGs and a CPU Loader: the batch's shape and its view-major memory
(timm's order is a view away), view 0 is the pipeline without the post ops, view 1 the pipeline
without splits, later views their own draws, repeatable by seed; RandomErasing leaves the clean
view alone; a failed sample leaves its views out with it; what the option cannot give is a
ConfigError at construction.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import headrace
from headrace import ops, readers
from headrace._errors import ConfigError

from sample_data import jpeg_items

POLICY = "augmix-m5-w4-d2"


async def _batches(items, pipeline, *, seed=5, **kwargs):
    """The loader's batches as (keys, images, labels), CPU path, 2 threads, batches of 8."""
    loader = headrace.Loader(readers.sequence(items), batch_size=8, pipeline=pipeline, device="cpu", num_threads=2,
                             seed=seed, **kwargs)
    async with loader:
        return [(b.sample_keys, b["image"], b["label"]) async for b in loader]


def _by_key(batches) -> dict:
    return {key: image for keys, images, _ in batches for key, image in zip(keys, images)}


@pytest.fixture(scope="module")
def items():
    return jpeg_items(24, 61, 50, 70)


async def test_views_stack_per_sample_over_view_major_memory(items):
    batches = await _batches(items, ops.training(32, auto_augment=POLICY, splits=3))
    assert len(batches) == 3
    for keys, images, labels in batches:
        assert images.shape == (8, 3, 3, 32, 32) and images.dtype == torch.float32
        assert labels.shape == (8,)  # one label a sample; timm's JSD loss reads the first B
        timm_order = images.transpose(0, 1).flatten(0, 1)  # all clean, then each augmented view's block
        assert timm_order.data_ptr() == images.data_ptr()  # a view: no copy
        assert torch.equal(timm_order[8:16], images[:, 1])


async def test_view_0_is_the_geometry_alone_and_view_1_the_pipeline_without_splits(items):
    split = _by_key(await _batches(items, ops.training(32, auto_augment=POLICY, splits=3)))
    whole = _by_key(await _batches(items, ops.training(32, auto_augment=POLICY)))
    clean = _by_key(await _batches(items, ops.training(32)))
    assert split.keys() == whole.keys() == clean.keys() and len(split) == 24
    assert all(torch.equal(split[k][0], clean[k]) for k in split)
    assert all(torch.equal(split[k][1], whole[k]) for k in split)
    # View 2 draws its own chains: different from view 1 almost everywhere, and from the clean view.
    assert sum(not torch.equal(split[k][2], split[k][1]) for k in split) >= 20
    assert sum(not torch.equal(split[k][2], split[k][0]) for k in split) >= 20


async def test_views_repeat_for_a_seed_and_move_with_it(items):
    pipe = ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(24), ops.Flip(), ops.TimmAugMix(POLICY)], layout="HWC",
                        splits=2)
    first = _by_key(await _batches(items, pipe))
    again = _by_key(await _batches(items, pipe))
    other = _by_key(await _batches(items, pipe, seed=6))
    assert all(image.shape == (2, 24, 24, 3) and image.dtype == torch.uint8 for image in first.values())
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert sum(not torch.equal(first[k][1], other[k][1]) for k in first) >= 20


async def test_uint8_chw_views_are_the_hwc_views_laid_out(items):
    def pipe(layout):
        return ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(24), ops.RandAugment()], layout=layout, splits=3)

    hwc = _by_key(await _batches(items, pipe("HWC")))
    chw = _by_key(await _batches(items, pipe("CHW")))
    assert all(chw[k].shape == (3, 3, 24, 24) for k in chw)
    assert all(torch.equal(chw[k], hwc[k].permute(0, 3, 1, 2)) for k in hwc)


async def test_random_erasing_leaves_the_clean_view_and_erases_the_others(items):
    plain = ops.training(32, auto_augment=POLICY, splits=3)
    erased = ops.Pipeline([*plain.ops, ops.RandomErasing(p=1.0, value=0.0)], splits=3)
    before = _by_key(await _batches(items, plain))
    after = _by_key(await _batches(items, erased))
    assert all(torch.equal(after[k][0], before[k][0]) for k in before)
    for view in (1, 2):
        changed = [k for k in before if not torch.equal(after[k][view], before[k][view])]
        assert len(changed) >= 20  # p=1: every row where one of the ten boxes fits
        for k in changed:  # only a box: erased values are 0, the rest as it was
            diff = after[k][view] != before[k][view]
            assert torch.all(after[k][view][diff] == 0)


async def test_a_failed_sample_takes_its_views_with_it(items):
    broken = [dict(item) for item in items]
    broken[3]["jpg"] = broken[3]["jpg"][: len(broken[3]["jpg"]) // 3]  # truncated: a DecodeError
    pipe = ops.training(32, auto_augment=POLICY, splits=3)
    good = _by_key(await _batches(items, pipe))
    batches = await _batches(broken, pipe, on_error="skip", max_errors=0.5)
    got = _by_key(batches)
    assert len(got) == 23 and broken[3]["__key__"] not in got
    assert batches[0][1].shape == (7, 3, 3, 32, 32)
    assert batches[0][1].transpose(0, 1).is_contiguous()  # still timm's order a view away
    assert all(torch.equal(got[k], good[k]) for k in got)


def test_what_splits_cannot_give_is_a_config_error():
    augmix = ops.TimmAugMix(POLICY)
    cases = {
        "no post ops": ops.training(32).ops,
        "one size": [ops.Decode(), ops.Resize(32), augmix],
        "boxes": [ops.Decode(), ops.RandomResizedCrop(32), ops.ColorTwist(0.4)],
        "Map": [*ops.training(32, auto_augment=POLICY).ops, ops.Map(lambda image: image)],
        "MixUp": [*ops.training(32, auto_augment=POLICY).ops, ops.MixUp(0.2, num_classes=3)],
    }
    for name, listed in cases.items():
        kwargs = {"boxes": "boxes"} if name == "boxes" else {}
        with pytest.raises(ConfigError, match="splits=3") as caught:
            ops.Pipeline(listed, splits=3, **kwargs)
        print(name, caught.value)
    for bad in (0, True, 2.0, "3"):
        with pytest.raises(ConfigError, match="splits must be"):
            ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(32), augmix], splits=bad)
    # One view is the plain pipeline: allowed with anything.
    assert ops.Pipeline(ops.training(32).ops, splits=1).splits == 1
    assert ops.Pipeline(ops.training(32).ops, splits=np.int64(1)).splits == 1
    assert "splits=3" in repr(ops.training(32, auto_augment=POLICY, splits=3))


async def test_views_resume_mid_epoch_exactly(items):
    pipe = ops.training(32, auto_augment=POLICY, splits=3)

    def loader():
        return headrace.Loader(readers.sequence(items, shuffle=True, seed=1), batch_size=8, pipeline=pipe,
                               device="cpu", num_threads=2, seed=5)

    async with loader() as whole:
        [b async for b in whole]
        second_epoch = [(b.sample_keys, b["image"]) async for b in whole]
    async with loader() as first:
        [b async for b in first]
        taken = []
        async for b in first:
            taken.append((b.sample_keys, b["image"]))
            break
        state = first.state_dict()
    async with loader() as second:
        second.load_state_dict(state)
        rest = [(b.sample_keys, b["image"]) async for b in second]
    assert len(taken + rest) == len(second_epoch) == 3
    for (keys, images), (want_keys, want) in zip(taken + rest, second_epoch, strict=True):
        assert keys == want_keys and torch.equal(images, want)


async def test_a_replaced_sample_keeps_the_batch_full_and_view_major(items):
    broken = [dict(item) for item in items]
    broken[3]["jpg"] = broken[3]["jpg"][: len(broken[3]["jpg"]) // 3]
    batches = await _batches(broken, ops.training(32, auto_augment=POLICY, splits=3), on_error="replace", max_errors=0.5)
    keys, images, labels = batches[0]
    assert images.shape == (8, 3, 3, 32, 32) and labels.shape == (8,)
    assert images.transpose(0, 1).is_contiguous()  # timm's order still a view away
    assert broken[3]["__key__"] not in keys and len(set(keys)) == 7
    twin = next(k for k in keys if keys.count(k) == 2)
    first, second = (i for i, k in enumerate(keys) if k == twin)
    assert torch.equal(images[first], images[second])  # the substitute's views, all three


def test_rows_picked_for_a_replacement_keep_the_memory_order():
    from headrace._sample import _rows

    index = torch.tensor([2, 0, 2, 1])
    view_major = torch.arange(3 * 3 * 2 * 4 * 4.0).reshape(3, 3, 2, 4, 4).transpose(0, 1)  # [B, views, ...]
    channels_last = torch.arange(3 * 4 * 5 * 2, dtype=torch.uint8).reshape(3, 4, 5, 2).movedim(-1, -3)
    for value in (view_major, channels_last, torch.arange(12.0).reshape(3, 4)):
        picked = _rows(value, index)
        assert torch.equal(picked, value.index_select(0, index))
        assert np.argsort(picked.stride()).tolist() == np.argsort(value.stride()).tolist()
    assert _rows(view_major, index).transpose(0, 1).is_contiguous()
