"""The torch bridge as a PyTorch user meets it: ``torch_dataset``'s arguments, Lightning's
``Trainer.fit`` over ``loader.sync()`` (step limits, validation, checkpoints and resume), and the
epoch metrics of a filled last batch. Real JPEG folders and tar shards; Lightning runs in-process
(these tests skip without it)."""

from __future__ import annotations

import asyncio
import importlib.util
import io
import tarfile
import warnings
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import headrace
from headrace import ConfigError, Loader, ops, readers

needs_lightning = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                     reason="needs Lightning (pip install lightning)")
SAMPLES, BATCH = 75, 8  # the image_folder fixture: 3 classes x 25 JPEGs; 10 batches an epoch


def _pipeline():
    return ops.Pipeline([ops.Decode(), ops.Resize((16, 16)), ops.Normalize()])


def _loader(reader, **kwargs):
    return Loader(reader, batch_size=BATCH, pipeline=_pipeline(), device="cpu", num_threads=2, seed=3, **kwargs)


# -- torch_dataset's arguments -------------------------------------------------------------------


def test_view_keys_naming_a_field_is_a_config_error(image_folder, leaks):
    # keys="label" replaced every item's label tensor with the list of sample keys, silently.
    with headrace.torch_dataset(_loader(readers.files(image_folder)), keys="label") as view:
        with pytest.raises(ConfigError, match=r"keys='label' names a field of the batches \(\['image', 'label'\]\)"):
            next(iter(DataLoader(view, batch_size=None)))
    asyncio.run(leaks.check())


def test_torch_dataset_refuses_what_is_not_a_loader_and_keys_not_a_str(image_folder):
    loader = _loader(readers.files(image_folder))
    batches = loader.sync()
    with pytest.raises(ConfigError, match=r"must be a headrace Loader, got SyncLoader \(pass the loader, not loader.sync\(\)\)"):
        headrace.torch_dataset(batches)  # an AttributeError ('SyncLoader' has no attribute 'sync') before
    with pytest.raises(ConfigError, match="keys must be a str or None, got True"):
        headrace.torch_dataset(loader, keys=True)  # made items with a key True before
    batches.close()


# -- epoch metrics ---------------------------------------------------------------------------------


def test_metrics_of_a_filled_last_batch_count_its_padded_rows(image_folder):
    # docs/metrics.md: samples and the decode stage's items include last_batch="fill"'s repeats;
    # the reader's items are the samples it read.
    loader = _loader(readers.files(image_folder, shuffle=True), last_batch="fill")
    with loader.sync() as batches:
        sizes = [batch.size for batch in batches]
    metrics = loader.stats().epoch_metrics
    assert sizes == [BATCH] * 10 and len(loader) == 10
    assert (metrics.batches, metrics.samples) == (10, 80)
    assert metrics.stages["read"].items == SAMPLES and metrics.stages["decode"].items == 80
    assert metrics.stages["handoff"].items == 80 and metrics.finished


# -- Lightning -------------------------------------------------------------------------------------


def _lightning():
    import lightning.pytorch as L
    from torch import nn

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 3))
            self.train_keys: list[tuple[int, list[str]]] = []
            self.val_keys: list[tuple[int, list[str]]] = []

        def training_step(self, batch, batch_idx):
            assert isinstance(batch, headrace.Batch)  # Lightning's device move keeps it a Batch
            self.train_keys.append((self.current_epoch, list(batch.sample_keys)))
            return nn.functional.cross_entropy(self.net(batch["image"]), batch["label"])

        def validation_step(self, batch, batch_idx):
            self.val_keys.append((self.current_epoch, list(batch.sample_keys)))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Data(L.LightningDataModule):
        """The recipe of docs/stages.md: the loader made in train_dataloader(), entered, ended at teardown."""

        def __init__(self, make) -> None:
            super().__init__()
            self.make = make
            self.batches = None

        def train_dataloader(self):
            self.batches = self.make().sync().__enter__()
            return self.batches

        def teardown(self, stage):
            if self.batches is not None:
                self.batches.close()

    return L, Classifier, Data


def _trainer(L, **kwargs):
    warnings.filterwarnings("ignore", module="lightning")
    warnings.filterwarnings("ignore", module="torch")
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, **{"enable_checkpointing": False, **kwargs})


def _fit(make, tmp_path, *, max_steps=-1, save_every=None, resume=None, epochs=3, limit=None):
    L, Classifier, Data = _lightning()
    callbacks = [L.callbacks.ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=save_every, save_top_k=-1)
                 ] if save_every else []
    model = Classifier()
    trainer = _trainer(L, max_epochs=epochs, max_steps=max_steps, callbacks=callbacks,
                       enable_checkpointing=bool(callbacks), limit_train_batches=limit)
    trainer.fit(model, datamodule=Data(make), ckpt_path=resume)
    return [keys for _, keys in model.train_keys]


@needs_lightning
def test_lightning_fit_and_validate_at_step_limits_leave_nothing_and_the_next_epoch_whole(image_folder, leaks):
    L, Classifier, _ = _lightning()
    model = Classifier()
    train, val = _loader(readers.files(image_folder, shuffle=True)), _loader(readers.files(image_folder))
    with train.sync() as train_batches, val.sync() as val_batches:
        trainer = _trainer(L, max_epochs=2, limit_train_batches=3, limit_val_batches=2, num_sanity_val_steps=2)
        trainer.fit(model, train_dataloaders=train_batches, val_dataloaders=val_batches)
        assert [epoch for epoch, _ in model.train_keys] == [0, 0, 0, 1, 1, 1]
        assert len(model.val_keys) == 2 + 2 * 2  # the sanity check, then each epoch's validation
        for _, keys in model.train_keys + model.val_keys:
            assert len(keys) == BATCH
        # Lightning left each epoch at its limit, holding the iterator: the next pass is a whole epoch.
        keys = [key for batch in train_batches for key in batch.sample_keys]
        assert len(keys) == len(set(keys)) == SAMPLES
        assert train.stats().epoch_metrics.epoch == 2 and train.stats().epoch_metrics.batches == 10
        trainer.validate(model, dataloaders=val_batches, verbose=False)
    asyncio.run(leaks.check())


@needs_lightning
@pytest.mark.parametrize("stop", [5, 10, 13], ids=["mid-epoch", "last step of an epoch", "mid-epoch 1"])
def test_lightning_checkpoint_resumes_with_the_batches_the_uninterrupted_run_had(image_folder, tmp_path, stop):
    def make():
        return _loader(readers.files(image_folder, shuffle=True))

    whole = _fit(make, tmp_path / "whole")
    first = _fit(make, tmp_path, max_steps=stop, save_every=stop)
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    rest = _fit(make, tmp_path / "again", resume=str(checkpoint))
    assert len(whole) == 30 and len(first) == stop
    assert first + rest == whole


def _shards(image_folder: Path, folder: Path) -> list[str]:
    """The folder's JPEGs in 3 tar shards with no index: a webdataset reader without a length."""
    files = sorted(image_folder.rglob("*.jpg"))
    folder.mkdir()
    paths = []
    for s in range(3):
        path = folder / f"shard-{s}.tar"
        with tarfile.open(path, "w") as tar:
            for i, file in enumerate(files[s::3]):
                for ext, data in (("jpg", file.read_bytes()), ("cls", file.parent.name[1:].encode())):
                    member = tarfile.TarInfo(f"s{s}_{i:03d}.{ext}")
                    member.size = len(data)
                    tar.addfile(member, io.BytesIO(data))
        paths.append(str(path))
    return paths


@needs_lightning
def test_lightning_resume_of_a_reader_without_length_goes_on_one_batch_later(image_folder, tmp_path):
    # docs/stages.md: without len() Lightning fetches a batch ahead of the step, so the checkpoint
    # holds the loader's place after that batch; with counts= (a length) the resume is exact.
    shards = _shards(image_folder, tmp_path / "shards")
    for counts, exact in ((None, False), ("scan", True)):
        def make(counts=counts):
            return _loader(readers.webdataset(shards, shuffle=True, counts=counts))

        run = tmp_path / f"counts-{counts}"
        whole = _fit(make, run / "whole", epochs=2)
        first = _fit(make, run, max_steps=5, save_every=5, epochs=2)
        (checkpoint,) = (run / "ckpt").glob("*.ckpt")
        rest = _fit(make, run / "again", resume=str(checkpoint), epochs=2)
        if exact:
            assert first + rest == whole
        else:
            assert first + rest == whole[:5] + whole[6:]  # the batch Lightning had fetched is not seen


@needs_lightning
def test_lightning_checkpoint_at_a_step_limit_finishes_the_loaders_epoch(image_folder, tmp_path):
    # docs/stages.md: under limit_train_batches a checkpoint before the limit resumes exactly; one
    # at the limit's step takes the loader's epoch as unfinished, and the resumed run finishes it.
    def make():
        return _loader(readers.files(image_folder, shuffle=True))

    def loader_epochs(keys_per_step):
        order = [[batch.sample_keys for batch in epoch] for epoch in _epochs_of(make, 3)]
        return [next((e, order[e].index(keys)) for e in range(3) if keys in order[e]) for keys in keys_per_step]

    whole = _fit(make, tmp_path / "whole", limit=3)
    assert loader_epochs(whole) == [(e, b) for e in range(3) for b in range(3)]
    for stop, expected in ((2, whole), (3, None)):
        run = tmp_path / f"stop-{stop}"
        first = _fit(make, run, max_steps=stop, save_every=stop, limit=3)
        (checkpoint,) = (run / "ckpt").glob("*.ckpt")
        rest = _fit(make, run / "again", resume=str(checkpoint), limit=3)
        if expected is not None:
            assert first + rest == expected
        else:  # epoch 0's batches 3-5 where the uninterrupted run had epoch 1's first three
            assert loader_epochs(first + rest) == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5),
                                                   (1, 0), (1, 1), (1, 2)]


def _epochs_of(make, epochs):
    with make().sync() as batches:
        return [list(batches) for _ in range(epochs)]
