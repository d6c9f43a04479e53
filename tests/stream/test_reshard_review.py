"""Review of resuming an epoch on another world size: a state saved by every rank right after the
epoch's last batch (before the loop ended) must, on another world size as on the same one, start
the next epoch, not an empty rest of this one (pad) nor an extra epoch of what "drop" left out."""

from __future__ import annotations

import json

import pytest

from headrace import Loader, ops, readers

from sample_data import make_folder

pytest.importorskip("lmdb")

N = 23  # prime: no world size or batch size here divides it


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("reshard")
    make_folder(root / "img", classes=1, per_class=N)
    readers.pack(root / "img", root / "wds", format="webdataset", shard_count=3, shuffle=True, seed=1)
    return {"files": str(root / "img"), "wds": str(root / "wds")}


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _loader(kind, data, rank, world, equal):
    reader = (readers.files(data["files"], shuffle=True) if kind == "files"
              else readers.webdataset(data["wds"], shuffle=True, shuffle_buffer=4, split="samples"))
    return Loader(reader, rank=rank, world=world, equal=equal, device="cpu", num_threads=1, seed=5, batch_size=3,
                  pipeline=ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(8)]))


async def _keys(loader, limit=None):
    keys, batches = [], 0
    async for batch in loader:
        keys += batch.sample_keys
        batches += 1
        if batches == limit:
            break
    await loader.aclose()
    return keys


@pytest.mark.parametrize("kind", ["files", "wds"])
@pytest.mark.parametrize(("equal", "old", "new"), [("pad", 2, 1), ("pad", 7, 3), ("drop", 7, 2), ("drop", 2, 1)])
async def test_a_state_saved_after_the_last_batch_starts_the_next_epoch_on_another_world(data, kind, equal, old, new):
    saving = [_loader(kind, data, r, old, equal) for r in range(old)]
    for lo in saving:
        lo.load_state_dict({**lo.state_dict(), "epoch": 1})
        await _keys(lo, len(lo))  # the last batch handed out, the loop not yet ended
    state = json.loads(json.dumps(saving[-1].state_dict()))
    assert state["epoch"] == 1 and state["position"] == len(saving[0].reader)

    resumed = [_loader(kind, data, r, new, equal) for r in range(new)]
    for lo in resumed:
        lo.load_state_dict(state)
        assert lo.state_dict()["epoch"] == 2 and lo.state_dict()["history"] == []
    first = [await _keys(lo, 1) for lo in resumed]  # a whole epoch's first batch, on every rank

    fresh = [_loader(kind, data, r, new, equal) for r in range(new)]
    for lo in fresh:
        lo.load_state_dict({**lo.state_dict(), "epoch": 2})
    assert first == [await _keys(lo, 1) for lo in fresh]
