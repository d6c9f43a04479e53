"""Exact resume, randomized: a state saved after any batch, passed through JSON and loaded into a
fresh loader (or the same one) continues with exactly the batches of the uninterrupted run:
the same samples in the same order, and the same augmentation (RandomResizedCrop + Flip: the
pixels show it), across epochs.

Real data (JPEGs in class folders, tar shards, an LMDB, in-memory items), some of it corrupt, under
``on_error="skip"`` and ``"replace"``; cut points drawn from a seeded RNG, plus the first batch and
each epoch's last; the state taken inside the loop, right after a ``break``, or through the sync
facade; ``run_ahead`` on and off.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random

import numpy as np
import pytest
from sample_data import jpeg_bytes, tar_bytes

from headrace import Loader, ops, readers
from headrace.readers import encode_record

EPOCHS = 2
BATCH = 4


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR, logger="headrace")  # every skip and replacement is logged


def _images(n: int, seed: int, bad: set[int]) -> list[bytes]:
    """Small JPEGs; those in ``bad`` cut short or garbage after a JPEG marker."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        blob = jpeg_bytes(rng, int(rng.integers(16, 40)), int(rng.integers(16, 40)))
        if i in bad:
            blob = blob[:40] if i % 2 else b"\xff\xd8\xff" + rng.integers(0, 256, 60, dtype=np.uint8).tobytes()
        out.append(blob)
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    folder = root / "folder"
    for i, blob in enumerate(_images(13, 1, {4, 9})):
        (folder / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        (folder / f"c{i % 3}" / f"{i:03d}.jpg").write_bytes(blob)
    sizes, shards, k = (4, 3, 6), [], 0
    blobs = _images(sum(sizes), 2, {5})
    for s, size in enumerate(sizes):
        members = []
        for _ in range(size):
            members += [(f"s{k:04d}.jpg", blobs[k]), (f"s{k:04d}.cls", str(k % 4).encode())]
            k += 1
        shards.append(root / f"shard-{s:04d}.tar")
        shards[-1].write_bytes(tar_bytes(members))
    import lmdb

    env = lmdb.open(str(root / "db"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for i, blob in enumerate(_images(9, 3, {6})):
            txn.put(f"k{i:04d}".encode(), encode_record({"jpg": blob, "cls": str(i % 5).encode()}))
    env.close()
    items = [{"__key__": f"q{i:02d}", "jpg": blob, "cls": str(i % 3).encode()}
             for i, blob in enumerate(_images(11, 4, {7}))]
    return {"folder": str(folder), "shards": [str(p) for p in shards], "counts": list(sizes),
            "db": str(root / "db"), "items": items}


def _reader(kind: str, d: dict):
    if kind == "files":
        return readers.files(d["folder"], shuffle=True)
    if kind == "files-ordered":
        return readers.files(d["folder"])
    if kind == "webdataset":
        return readers.webdataset(d["shards"], counts=d["counts"], shuffle=True, shuffle_buffer=5)
    if kind == "webdataset-uncounted":
        return readers.webdataset(d["shards"], shuffle=True, shuffle_buffer=5)
    if kind == "lmdb":
        return readers.lmdb(d["db"], shuffle=True)
    if kind == "mix":
        return readers.mix({"files": readers.files(d["folder"], shuffle=True), "lmdb": readers.lmdb(d["db"], shuffle=True)},
                           {"files": 2, "lmdb": 1}, length=15)
    if kind == "sequence":
        return readers.sequence(d["items"])
    if kind == "iterable":
        return readers.iterable(d["items"], length=len(d["items"]))
    if kind == "iterable-unsized":
        return readers.iterable(d["items"])
    raise AssertionError(kind)


def _maker(kind: str, d: dict, **kw):
    def make() -> Loader:
        return Loader(_reader(kind, d), batch_size=BATCH, device="cpu", num_threads=2, seed=11, max_errors=0.5,
                      pipeline=ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(12), ops.Flip()]), **kw)
    return make


def _view(batch) -> tuple:
    return (batch.epoch, batch.index, tuple(batch.sample_keys), np.asarray(batch["image"]).tobytes(),
            np.asarray(batch["label"]).tobytes())


async def _uninterrupted(make) -> list[list[tuple]]:
    loader = make()
    try:
        return [[_view(b) async for b in loader] for _ in range(EPOCHS)]
    finally:
        await loader.aclose()


async def _cut(make, cut: int, how: str) -> tuple[list[tuple], dict]:
    """The first ``cut`` batches of the run and the state saved there: inside the loop (then
    ``break``), right after the ``break``, or inside a ``with loader.sync()`` loop."""
    loader, seen, state = make(), [], None
    if how == "sync":
        def run() -> dict:
            with loader.sync() as epochs:
                while True:
                    for batch in epochs:
                        seen.append(_view(batch))
                        if len(seen) == cut:
                            return epochs.state_dict()
        return seen, await asyncio.to_thread(run)
    try:
        while len(seen) < cut:
            async for batch in loader:
                seen.append(_view(batch))
                if len(seen) == cut:
                    if how == "inside":
                        state = loader.state_dict()
                    break
        return seen, state if state is not None else loader.state_dict()
    finally:
        await loader.aclose()


async def _resumed(make, state: dict, how: str) -> list[list[tuple]]:
    """The batches of each ``async for`` (or sync ``for``) of a fresh loader given ``state``, as a
    checkpoint would bring it back (through JSON), until the run's last epoch is done."""
    loader = make()
    loader.load_state_dict(json.loads(json.dumps(state)))
    if how == "sync":
        def run() -> list[list[tuple]]:
            with loader.sync() as epochs:
                out = []
                while loader.epoch < EPOCHS:
                    out.append([_view(b) for b in epochs])
                return out
        return await asyncio.to_thread(run)
    try:
        out = []
        while loader.epoch < EPOCHS:
            out.append([_view(b) async for b in loader])
        return out
    finally:
        await loader.aclose()


def _cut_points(per_epoch: list[list[tuple]], rng: random.Random, draws: int) -> list[int]:
    total = sum(map(len, per_epoch))
    ends = list(np.cumsum([len(e) for e in per_epoch])[:-1])  # each epoch's last batch but the run's
    return sorted({1, *map(int, ends), *rng.sample(range(1, total), min(draws, total - 1))})


def _first_difference(got: list[tuple], want: list[tuple]) -> str:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"batch {i} after the cut: got epoch/index/keys {a[:3]}, want {b[:3]} (same keys: {a[:3] == b[:3]})"
    return f"got {len(got)} batches after the cut, want {len(want)}"


CASES = [
    ("files", "skip", False), ("files", "replace", True), ("files-ordered", "skip", True),
    ("files-ordered", "replace", False), ("webdataset", "skip", True), ("webdataset", "replace", False),
    ("webdataset-uncounted", "skip", False), ("webdataset-uncounted", "replace", True), ("lmdb", "skip", False),
    ("lmdb", "replace", True), ("mix", "skip", True), ("mix", "replace", False), ("sequence", "replace", True),
    ("iterable", "skip", False), ("iterable-unsized", "replace", False),
]


@pytest.mark.parametrize(("kind", "on_error", "run_ahead"), CASES)
async def test_a_state_saved_after_any_batch_resumes_exactly(data, kind, on_error, run_ahead):
    make = _maker(kind, data, on_error=on_error, run_ahead=run_ahead)
    per_epoch = await _uninterrupted(make)
    whole = [b for epoch in per_epoch for b in epoch]
    assert [len(e) for e in per_epoch][0] >= 3 and all(per_epoch)
    rng = random.Random(f"{kind}/{on_error}/{run_ahead}")
    for n, cut in enumerate(_cut_points(per_epoch, rng, 3)):
        how = ("inside", "after_break", "sync")[(n + rng.randrange(3)) % 3]
        seen, state = await _cut(make, cut, how)
        assert seen == whole[:cut]
        rest = [b for epoch in await _resumed(make, state, how) for b in epoch]
        assert rest == whole[cut:], f"cut after batch {cut} ({how}): {_first_difference(rest, whole[cut:])}"


@pytest.mark.parametrize(("kind", "on_error", "how"), [
    ("files", "skip", "inside"), ("webdataset", "replace", "inside"), ("mix", "skip", "inside"),
    ("webdataset-uncounted", "skip", "inside"), ("webdataset-uncounted", "replace", "sync"),
    ("iterable-unsized", "replace", "inside"), ("iterable-unsized", "skip", "sync"),
])
async def test_a_state_saved_at_an_epochs_last_batch_resumes_with_the_next_epoch(data, kind, on_error, how):
    """The resumed loader stands at the next epoch, and its next ``async for`` yields that epoch
    whole (no empty rest of the old one in between): readers that know their length by ``len()``,
    and readers that do not (shards without counts, an iterable without length) by the end of the
    epoch the loader had seen when the state was taken."""
    make = _maker(kind, data, on_error=on_error)
    per_epoch = await _uninterrupted(make)
    _, state = await _cut(make, len(per_epoch[0]), how)
    loader = make()
    loader.load_state_dict(json.loads(json.dumps(state)))
    assert loader.epoch == 1
    assert [_view(b) async for b in loader] == per_epoch[1]
    await loader.aclose()


async def _chained(make, cuts: list[int]) -> list[tuple]:
    """One loader run over the epochs, stopped by a ``break`` after each count of batches in
    ``cuts`` (counted from the start), its state saved there and loaded back into it."""
    loader, seen = make(), []
    try:
        for cut in [*cuts, None]:
            stopped = False
            while loader.epoch < EPOCHS and not stopped:
                async for batch in loader:
                    seen.append(_view(batch))
                    if len(seen) == cut:
                        stopped = True
                        break
            if cut is not None:
                loader.load_state_dict(json.loads(json.dumps(loader.state_dict())))
        return seen
    finally:
        await loader.aclose()


@pytest.mark.parametrize("run_ahead", [False, True])
@pytest.mark.parametrize(("kind", "on_error"), [("files", "skip"), ("webdataset", "replace"), ("lmdb", "skip")])
async def test_a_state_loaded_back_into_the_same_loader_after_a_break_goes_on_exactly(data, kind, on_error, run_ahead):
    """A trainer that breaks out, saves and loads the state into the loader it has (a rollback to
    the checkpoint just taken), cut after the first batch and at the epoch's last batch: the stream
    goes on as if never stopped. With ``run_ahead`` the next epoch's run, started during the last
    batch, was taken over at the epoch's last batch, while the break's teardown drained the
    executor under it: the epoch hung, or ended after a batch or two."""
    make = _maker(kind, data, on_error=on_error, run_ahead=run_ahead)
    per_epoch = await _uninterrupted(make)
    whole = [b for epoch in per_epoch for b in epoch]
    last = len(per_epoch[0])
    for cuts in ([last], [1, last], [2, last, last + 1]):
        got = await asyncio.wait_for(_chained(make, cuts), 20)
        assert got == whole, f"cuts {cuts}: {_first_difference(got, whole)}"
