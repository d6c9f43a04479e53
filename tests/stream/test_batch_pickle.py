"""A batch pickles (``torch.save``, a multiprocessing queue) with its tensors and names."""

from __future__ import annotations

import pickle

import torch

from headrace import Loader, ops, readers
from sample_data import make_folder


def test_a_cpu_batch_pickles_and_saves_with_its_tensors(tmp_path):
    folder = make_folder(tmp_path / "data", classes=2, per_class=4)
    loader = Loader(readers.files(folder), batch_size=4, pipeline=ops.Pipeline([ops.Decode(), ops.Resize(16)]),
                    device="cpu")
    with loader.sync() as epochs:
        for b in epochs:
            for copy in (pickle.loads(pickle.dumps(b)), _saved(b, tmp_path / "batch.pt")):
                assert (copy.sample_keys, copy.sources, copy.epoch, copy.index) == (b.sample_keys, b.sources, b.epoch,
                                                                                    b.index)
                assert torch.equal(copy["label"], b["label"])
                assert len(copy["image"]) == len(b["image"])
                assert all(torch.equal(x, y) for x, y in zip(copy["image"], b["image"]))
                assert copy.extra == b.extra


def _saved(batch, path):
    torch.save(batch, path)
    return torch.load(path, weights_only=False)
