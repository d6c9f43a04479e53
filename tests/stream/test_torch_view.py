"""The torch bridge: a loader driven the way trainers drive a DataLoader, as ``loader.sync()`` and as
``DataLoader(headrace.torch_dataset(loader), batch_size=None)``, over a real JPEG folder."""

from __future__ import annotations

import asyncio
import pickle

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import headrace
from headrace import ConfigError, Loader, ops, readers

ALL_KEYS = sorted(f"c{c}/{i:04d}" for c in range(3) for i in range(25))


def _loader(folder, run_ahead=None):
    pipeline = ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(32), ops.Normalize()])
    return Loader(readers.files(folder, shuffle=True), batch_size=8, pipeline=pipeline, device="cpu",
                  num_threads=2, run_ahead=run_ahead)


def _fit(data, keys_of, epochs=3, stop_at=None):
    """A trainer's loop: ``len()`` first, then one pass per epoch. ``stop_at``: ``{epoch: batch}``
    where the pass is left (a step limit). The iterator stays referenced until the next epoch's
    ``iter()``, as Lightning's data fetcher keeps it."""
    stop_at = stop_at or {}
    per_epoch = []
    for epoch in range(epochs):
        keys, batches = [], 0
        iterator = iter(data)
        for i, batch in enumerate(iterator):
            if i == stop_at.get(epoch):
                break
            assert batch["image"].shape[1:] == (3, 32, 32) and batch["image"].dtype == torch.float32
            assert batch["label"].tolist() == [int(k[1]) for k in keys_of(batch)]
            keys += keys_of(batch)
            batches += 1
        per_epoch.append((batches, keys))
    return per_epoch


def _check_epochs(per_epoch, length, stopped):
    for epoch, (batches, keys) in enumerate(per_epoch):
        if epoch == stopped:
            assert (batches, len(keys), len(set(keys))) == (2, 16, 16)
        else:
            assert batches == length == 10  # 75 samples, batch 8, the last one partial
            assert sorted(keys) == ALL_KEYS  # each sample once
    assert per_epoch[0][1] != per_epoch[2][1]  # a new pass per epoch: reshuffled


def test_sync_facade_in_a_trainer_loop(image_folder, leaks):
    data = _loader(image_folder).sync()
    assert len(data) == 10
    per_epoch = _fit(data, lambda b: b.sample_keys, stop_at={1: 2})
    _check_epochs(per_epoch, len(data), stopped=1)
    data.close()
    asyncio.run(leaks.check())


def test_an_entered_sync_facade_runs_ahead_through_a_trainer_loop(image_folder, leaks):
    # As Lightning's DataModule holds it (entered, ended at teardown): epoch 1 takes over the run
    # started ahead, is left at a step limit with its iterator still held, and epoch 2 is whole.
    with _loader(image_folder, run_ahead=True).sync() as data:
        per_epoch = _fit(data, lambda b: b.sample_keys, stop_at={1: 2})
        assert data.loader._epochs.ahead is not None  # epoch 3's run, started during epoch 2
    _check_epochs(per_epoch, 10, stopped=1)
    asyncio.run(leaks.check())


def test_a_view_used_with_with_runs_ahead_too(image_folder, leaks):
    with headrace.torch_dataset(_loader(image_folder, run_ahead=True), keys="key") as view:
        per_epoch = _fit(DataLoader(view, batch_size=None, num_workers=0), lambda b: b["key"], stop_at={1: 2})
        assert view.loader._epochs.ahead is not None
    _check_epochs(per_epoch, 10, stopped=1)
    asyncio.run(leaks.check())


def test_held_iterator_left_early_is_closed_by_close(image_folder, leaks):
    data = _loader(image_folder).sync()
    iterator = iter(data)
    next(iterator)  # a trainer stopped at a step limit, still holding the epoch's iterator
    data.close()
    asyncio.run(leaks.check())
    assert list(iterator) == []  # closed: no more batches


def test_dataloader_over_the_view_in_a_trainer_loop(image_folder, leaks):
    view = headrace.torch_dataset(_loader(image_folder), keys="key")
    assert isinstance(view, IterableDataset)
    data = DataLoader(view, batch_size=None, num_workers=0)
    assert len(data) == len(view) == 10
    per_epoch = _fit(data, lambda b: b["key"], stop_at={1: 2})
    _check_epochs(per_epoch, len(data), stopped=1)
    view.close()
    asyncio.run(leaks.check())


def test_view_items_without_keys_become_dicts_of_tensors(image_folder, leaks):
    with headrace.torch_dataset(_loader(image_folder)) as view:
        assert isinstance(next(iter(view)), headrace.Batch)  # the view yields headrace's batches
        batches = list(DataLoader(view, batch_size=None))  # default_convert makes them plain dicts
    assert len(batches) == 10
    assert all(type(b) is dict and set(b) == {"image", "label"} for b in batches)
    assert sum(len(b["label"]) for b in batches) == 75
    asyncio.run(leaks.check())


def test_view_refuses_worker_processes(image_folder, leaks):
    with headrace.torch_dataset(_loader(image_folder)) as view:
        with pytest.raises(ConfigError, match="own threads and event loop"):
            next(iter(DataLoader(view, batch_size=None, num_workers=2)))
        with pytest.raises(ConfigError, match="num_workers=0"):
            pickle.dumps(view)  # what a spawned worker would need
        assert sum(1 for _ in DataLoader(view, batch_size=None)) == 10  # still fine in this process
    asyncio.run(leaks.check())


def test_view_length_unknown_is_type_error():
    reader = readers.iterable(lambda: iter([{"label": i} for i in range(4)]))
    view = headrace.torch_dataset(Loader(reader, batch_size=2, device="cpu"))
    with pytest.raises(TypeError):
        len(view)
    with pytest.raises(TypeError):
        len(DataLoader(view, batch_size=None))
    view.close()
