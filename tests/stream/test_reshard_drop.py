"""Resuming at the end of an epoch's span, judged by ``last_batch``: a state saved when the saving
rank had no batch left to hand out in its span (none of its samples left, or under "drop" fewer
than a batch, which the run would drop) starts the next epoch, on another world size as on the
same one, also after the epoch changed world size before, as the run that saved it would have
gone on. A state with a batch left (under "partial" or "fill" the short one) goes on with the rest
of the epoch, unless no rank of the new world size gets a batch of that rest."""

from __future__ import annotations

import json

import pytest

from headrace import Loader, ops, readers

from sample_data import make_folder

pytest.importorskip("lmdb")

N = 23  # prime: no world size or batch size here divides it
B = 5
KINDS = ("files", "lmdb", "wds")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("reshard-drop")
    make_folder(root / "img", classes=1, per_class=N)
    readers.pack(root / "img", root / "lmdb", format="lmdb", shuffle=True, seed=3)
    readers.pack(root / "img", root / "wds", format="webdataset", shard_count=3, shuffle=True, seed=1)
    return {"files": str(root / "img"), "lmdb": str(root / "lmdb"), "wds": str(root / "wds")}


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _loader(kind, data, rank, world, equal, last_batch):
    if kind == "files":
        reader = readers.files(data["files"], shuffle=True)
    elif kind == "lmdb":
        reader = readers.lmdb(data["lmdb"], shuffle=True)
    else:
        reader = readers.webdataset(data["wds"], shuffle=True, shuffle_buffer=4, split="samples")
    return Loader(reader, rank=rank, world=world, equal=equal, last_batch=last_batch, device="cpu", num_threads=1,
                  seed=5, batch_size=B, pipeline=ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(8)]))


async def _batches(loader, limit=None):
    """The batches' keys of one ``async for`` (not the rows "fill" repeats), left after ``limit``
    batches (the loop not ended)."""
    out = []
    async for batch in loader:
        out.append(batch.sample_keys[: len(batch.sample_keys) - batch.padded])
        if len(out) == limit:
            break
    return out


def _world(kind, data, world, equal, last_batch, state=None, epoch=1):
    loaders = [_loader(kind, data, r, world, equal, last_batch) for r in range(world)]
    for lo in loaders:
        lo.load_state_dict(state if state is not None else {**lo.state_dict(), "epoch": epoch})
    return loaders


async def _close(loaders):
    for lo in loaders:
        await lo.aclose()


def _same_state(states):
    """The states of one step, but the rank that saved them."""
    return len({json.dumps({**s, "rank": 0, "source": {**s["source"], "rank": 0}}, sort_keys=True)
                for s in states}) == 1


async def _next_epochs(kind, data, world, equal, last_batch, state):
    """What loaders on ``world`` ranks given ``state`` yield: (epoch in their state, this
    ``async for``'s batches per rank, the next one's)."""
    loaders = _world(kind, data, world, equal, last_batch, state)
    epoch = {lo.state_dict()["epoch"] for lo in loaders}
    assert len(epoch) == 1
    first = [await _batches(lo) for lo in loaders]
    second = [await _batches(lo) for lo in loaders]
    await _close(loaders)
    return epoch.pop(), first, second


async def _whole_epochs(kind, data, world, equal, last_batch, epoch):
    """The uninterrupted run on ``world`` ranks: epochs ``epoch`` and ``epoch + 1``, batches per rank."""
    loaders = _world(kind, data, world, equal, last_batch, epoch=epoch)
    first = [await _batches(lo) for lo in loaders]
    second = [await _batches(lo) for lo in loaders]
    await _close(loaders)
    return first, second


def _check_rest(rest, unread, equal, world, last_batch):
    """``rest`` (batches per rank) read ``unread`` once, but for the repeats or the cut of ``equal``
    (fewer than a sample per rank) and what "drop" left of each rank's part (fewer than a batch)."""
    read = [k for part in rest for b in part for k in b]
    assert set(read) <= unread
    cut = (world - 1 if equal == "drop" else 0) + (world * (B - 1) if last_batch == "drop" else 0)
    assert len(unread - set(read)) <= cut
    assert len(read) - len(set(read)) < (world if equal == "pad" else 1)


# (equal, saved world, loaded world): the saving ranks' spans (23 samples over the world, after
# ``equal``) all leave 1 to 4 samples after their last full batch of 5.
BOUNDARY = [("pad", 2, 3), ("pad", 2, 1), ("pad", 4, 2), ("drop", 2, 3), ("drop", 3, 1), ("drop", 3, 4),
            (None, 2, 3), (None, 3, 2)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("equal", "old", "new"), BOUNDARY)
async def test_drop_state_after_the_last_full_batch_starts_the_next_epoch_on_another_world(data, kind, equal, old,
                                                                                          new):
    saving = _world(kind, data, old, equal, "drop")
    for lo in saving:
        await _batches(lo, len(lo))  # the last full batch handed out, the loop not yet ended
    states = [json.loads(json.dumps(lo.state_dict())) for lo in saving]
    await _close(saving)
    assert _same_state(states) or equal is None
    for lo, state in zip(saving, states, strict=True):
        assert state["epoch"] == 1 and 0 < len(lo.reader) - state["position"] < B  # samples "drop" would leave

    _, after = await _whole_epochs(kind, data, new, equal, "drop", 1)  # the uninterrupted run's next epoch
    for state in states:  # any rank's state of the step
        epoch, first, second = await _next_epochs(kind, data, new, equal, "drop", state)
        assert epoch == 2
        assert first == after  # not an epoch of the samples the saving ranks would have dropped
        assert second and all(len(b) == B for part in second for b in part)
    _, after = await _whole_epochs(kind, data, old, equal, "drop", 1)
    epoch, first, _ = await _next_epochs(kind, data, old, equal, "drop", states[0])
    assert epoch == 2 and first == after  # on the same world size too (the Loader's own rule)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("last_batch", ["partial", "fill"])
@pytest.mark.parametrize(("equal", "old", "new"), [("pad", 2, 3), ("drop", 3, 2), (None, 3, 2)])
async def test_a_short_last_batch_left_is_read_on_another_world(data, kind, last_batch, equal, old, new):
    """At the same point under "partial" and "fill" the saving ranks had their short batch left:
    the new ranks read the samples not read yet (split as ``equal`` says), then the next epoch as a
    fresh run."""
    saving = _world(kind, data, old, equal, last_batch)
    whole = [await _batches(lo) for lo in saving]  # the uninterrupted run on the old world size
    await _close(saving)
    saving = _world(kind, data, old, equal, last_batch)
    for lo, part in zip(saving, whole, strict=True):
        assert len(part[-1]) < B
        await _batches(lo, len(part) - 1)
    state = saving[0].state_dict()
    await _close(saving)
    seen = {k for part in whole for b in part[:-1] for k in b}
    left = {f"c0/{i:04d}" for i in range(N)} - seen  # with what equal="drop" cut, less what "pad" repeated

    epoch, rest, following = await _next_epochs(kind, data, new, equal, last_batch, state)
    after, _ = await _whole_epochs(kind, data, new, equal, last_batch, 2)
    assert epoch == 1 and following == after
    assert len({len(part) for part in rest}) == 1 or equal is None
    _check_rest(rest, left, equal, new, last_batch)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("equal", ["pad", "drop"])
async def test_drop_state_a_batch_before_the_end_reads_the_rest_on_another_world(data, kind, equal):
    """One full batch before the boundary, the epoch goes on: the rest is read on the new world."""
    saving = _world(kind, data, 2, equal, "drop")
    whole = [await _batches(lo) for lo in saving]
    await _close(saving)
    saving = _world(kind, data, 2, equal, "drop")
    for lo in saving:
        await _batches(lo, len(lo) - 1)
    state = saving[0].state_dict()
    await _close(saving)
    assert state["position"] == B
    epoch, rest, following = await _next_epochs(kind, data, 1, equal, "drop", state)
    after, _ = await _whole_epochs(kind, data, 1, equal, "drop", 2)
    assert epoch == 1 and len(rest[0]) == 2 and following == after  # 13 samples left
    seen = {k for part in whole for b in part[:-1] for k in b}
    _check_rest(rest, {f"c0/{i:04d}" for i in range(N)} - seen, equal, 1, "drop")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("last_batch", "equal", "old", "stop", "new"),
                         [("drop", "drop", 2, 1, 3), ("drop", "pad", 2, 1, 4), ("partial", "drop", 2, 2, 4)])
async def test_a_rest_in_which_no_rank_gets_a_batch_starts_the_next_epoch(data, kind, last_batch, equal, old,
                                                                          stop, new):
    """Saved with a batch left, loaded on a world size whose ranks' parts of the rest are all too
    short for a batch ("drop") or empty (``equal="drop"``): the next batch is the next epoch's first."""
    saving = _world(kind, data, old, equal, last_batch)
    for lo in saving:
        assert len(lo) > stop
        await _batches(lo, stop)
    state = saving[0].state_dict()
    await _close(saving)
    epoch, rest, _ = await _next_epochs(kind, data, new, equal, last_batch, state)
    after, _ = await _whole_epochs(kind, data, new, equal, last_batch, 2)
    assert epoch == 2 and rest == after


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("last_batch", ["partial", "fill", "drop"])
@pytest.mark.parametrize(("old", "mid", "new"), [(2, 1, 1), (2, 1, 3), (2, 3, 3), (2, 3, 1)])
async def test_a_state_after_a_resumed_spans_last_batch_starts_the_next_epoch(data, kind, last_batch, old, mid, new):
    """``old`` ranks read a batch, ``mid`` ranks go on to their last batch (of the span they
    resumed) and save: on ``mid`` ranks again or on ``new``, the next batch is the next epoch's
    first, as the ``mid`` ranks would have gone on."""
    first = _world(kind, data, old, "pad", last_batch)
    for lo in first:
        await _batches(lo, 1)
    state = first[0].state_dict()
    await _close(first)
    spans = _world(kind, data, mid, "pad", last_batch, state)
    whole = [await _batches(lo) for lo in spans]  # the rest of the epoch on ``mid`` ranks
    await _close(spans)
    assert len({len(s) for s in whole}) == 1 and whole[0]
    spans = _world(kind, data, mid, "pad", last_batch, state)
    for lo in spans:
        await _batches(lo, len(whole[0]))
    state = spans[0].state_dict()
    await _close(spans)
    assert state["epoch"] == 1 and state["history"] == [[old, B]]

    epoch, rest, _ = await _next_epochs(kind, data, new, "pad", last_batch, state)
    after, _ = await _whole_epochs(kind, data, new, "pad", last_batch, 2)
    assert epoch == 2 and rest == after
