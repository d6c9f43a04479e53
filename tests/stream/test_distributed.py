"""Many ranks: rank detection, sharding by the loader, equal batch counts, and resume on the same
and on another world size (4 -> 2, 2 -> 4, 4 -> 2 -> 4), for the files, LMDB and WebDataset readers.

Two kinds of test: in one process, loaders told their rank (``rank=``, ``world=``) stand in for the
ranks of a job, which lets many cases run fast; and real torch.distributed jobs (gloo, spawned
processes, ``distributed_workers.py``) in which the loaders find their rank themselves.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from headrace import ConfigError, Loader, ops, readers
from headrace._device import resolve_device
from headrace._distributed import detect_distributed

import distributed_workers as dw

pytest.importorskip("lmdb")

N = 75  # samples in the image_folder fixture
KINDS = ("files", "lmdb", "wds")


@pytest.fixture(scope="module")
def data(tmp_path_factory, image_folder) -> dict[str, str]:
    root = tmp_path_factory.mktemp("distributed")
    readers.pack(image_folder, root / "lmdb", format="lmdb", shuffle=True, seed=3)
    readers.pack(image_folder, root / "wds", format="webdataset", shard_count=8, shuffle=True, seed=1)  # 10 shards
    return {"folder": str(image_folder), "lmdb": str(root / "lmdb"), "wds": str(root / "wds")}


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _reader(kind, data, **kw):
    if kind == "files":
        return readers.files(data["folder"], shuffle=True, **kw)
    if kind == "lmdb":
        return readers.lmdb(data["lmdb"], shuffle=True, **kw)
    return readers.webdataset(data["wds"], shuffle=True, shuffle_buffer=6, **kw)


def _loader(kind, data, rank, world, **kw):
    kw.setdefault("batch_size", 4)
    return Loader(_reader(kind, data), rank=rank, world=world, device="cpu", num_threads=1, seed=11,
                  pipeline=ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(16), ops.Normalize()]), **kw)


async def _keys(loader, limit=None):
    out = []
    async for batch in loader:
        out.append(batch.sample_keys)
        if limit is not None and len(out) == limit:
            break
    await loader.aclose()
    return out


def _flat(parts):
    return [k for part in parts for batch in part for k in batch]


def _check_cover(seen, *, pad_limit):
    """Every sample seen; the only repeats are the last span's padding (at most ``pad_limit``)."""
    counts = collections.Counter(seen)
    assert len(counts) == N, f"{N - len(counts)} samples never seen"
    repeats = len(seen) - N
    assert 0 <= repeats <= pad_limit, f"{repeats} samples seen twice"
    assert all(c <= 2 for c in counts.values())


def _one_state(states):
    """True when the states differ only in the rank that saved them."""
    return len({json.dumps({**s, "rank": 0, "source": {**s["source"], "rank": 0}}, sort_keys=True)
                for s in states}) == 1


# -- who am I ------------------------------------------------------------------------------------


def test_detection_from_torchrun_environment(monkeypatch):
    assert detect_distributed() == detect_distributed(distributed=False)
    assert (detect_distributed().rank, detect_distributed().world) == (0, 1)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    d = detect_distributed()
    assert (d.rank, d.world, d.local_rank, d.source) == (5, 8, 1, "environment")
    assert detect_distributed(distributed=False).world == 1
    explicit = detect_distributed(rank=2, world=3)
    assert (explicit.rank, explicit.world, explicit.source) == (2, 3, "arguments")
    monkeypatch.delenv("LOCAL_RANK")
    assert detect_distributed().local_rank == 5 % max(1, torch.cuda.device_count())
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ConfigError, match="WORLD_SIZE"):
        detect_distributed()


@pytest.mark.parametrize("kwargs", [{"rank": 1}, {"world": 2}, {"rank": 2, "world": 2}, {"rank": 0, "world": 0},
                                    {"rank": True, "world": 2}, {"distributed": "yes"}])
def test_wrong_rank_arguments(kwargs):
    with pytest.raises(ConfigError):
        detect_distributed(**kwargs)


def test_detection_from_an_initialised_process_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdv", rank=0, world_size=1)
    try:
        assert detect_distributed().source == "torch.distributed"
    finally:
        dist.destroy_process_group()


def test_device_follows_the_local_rank(monkeypatch):
    import headrace.ops

    pipe = ops.training(32)
    assert resolve_device(pipe, "cpu", local_rank=3) == "cpu"
    monkeypatch.setattr(headrace.ops, "cuda_available", lambda: True)
    monkeypatch.setattr(headrace.ops, "gpu_unsupported", lambda pipeline: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device(pipe, "auto", local_rank=2) == "cuda:2"
    assert resolve_device(pipe, "cuda", local_rank=3) == "cuda:3"
    assert resolve_device(pipe, "cuda", local_rank=5) == "cuda:1"  # each process sees fewer GPUs
    assert resolve_device(pipe, "cuda:0", local_rank=3) == "cuda:0"  # explicit wins
    assert resolve_device(pipe, "cuda") == "cuda"


# -- one process standing in for every rank -------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("last_batch", ["partial", "drop"])
async def test_ranks_are_disjoint_complete_and_equal(data, kind, world, last_batch):
    loaders = [_loader(kind, data, r, world, last_batch=last_batch, batch_size=5) for r in range(world)]
    parts = [await _keys(lo) for lo in loaders]
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) == len(loaders[0])  # same batch count
    assert len({len(lo.reader) for lo in loaders}) == 1
    seen = _flat(parts)
    pads = world * len(loaders[0].reader) - N
    if last_batch == "partial":
        _check_cover(seen, pad_limit=pads)
    else:  # the short last batches are left out: nothing seen twice but padding
        assert len(seen) - len(set(seen)) <= pads and len(set(seen)) >= N - world * 4


@pytest.mark.parametrize("world", [2, 3, 4])
async def test_every_rank_takes_its_share_of_one_seeded_global_order(data, world):
    """No communication: rank r of W reads entries r, r + W, ... of the same permutation."""
    whole = readers.files(data["folder"], shuffle=True)
    order = whole.order(epoch=2, seed=11)
    keys = [whole._keys[i] for i in order]
    keys += keys[: -N % world]  # "pad" repeats the head
    for r in range(world):
        loader = _loader("files", data, r, world)
        loader.load_state_dict({**loader.state_dict(), "epoch": 2})
        assert _flat([await _keys(loader)]) == keys[r::world]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("plan", [[(4, 3), (2, None)], [(2, 4), (4, None)], [(4, 3), (2, 2), (4, None)],
                                  [(3, 2), (1, None)]])
async def test_resume_on_another_world_size_reads_the_rest_once(data, kind, plan):
    """Every rank stops after k batches; the states go to a job of another size, which finishes the
    epoch: together every sample once (the last span's padding aside), equal batch counts."""
    seen, states = [], None
    for world, stop in plan:
        loaders = [_loader(kind, data, r, world) for r in range(world)]
        for r, lo in enumerate(loaders):
            if states is None:
                lo.load_state_dict({**lo.state_dict(), "epoch": 1})
            else:
                lo.load_state_dict(states[(r + 1) % len(states)])  # any rank's state of that step
        parts = [await _keys(lo, stop) for lo in loaders]
        assert len({len(p) for p in parts}) == 1
        seen += _flat(parts)
        states = [lo.state_dict() for lo in loaders]
        assert _one_state(states)  # one state per step
    assert states[0]["epoch"] == 2  # the epoch was finished
    _check_cover(seen, pad_limit=plan[-1][0] - 1)


@pytest.mark.parametrize("kind", KINDS)
async def test_resume_after_a_world_change_is_exact_on_that_world(data, kind):
    """4 -> 2, then a crash on 2 ranks and a resume on 2: the batches the run would have yielded."""
    first = [_loader(kind, data, r, 4) for r in range(4)]
    for lo in first:
        lo.load_state_dict({**lo.state_dict(), "epoch": 1})
        await _keys(lo, 3)
    state4 = first[0].state_dict()

    def two(r, state):
        lo = _loader(kind, data, r, 2)
        lo.load_state_dict(state)
        return lo

    whole = [await _keys(two(r, state4)) for r in range(2)]
    crashed = [two(r, state4) for r in range(2)]
    heads = [await _keys(lo, 2) for lo in crashed]
    state2 = crashed[1].state_dict()
    assert state2["history"] == [[4, 12]] and state2["position"] == 8 and state2["batches"] == 5
    rests = [await _keys(two(r, state2)) for r in range(2)]
    for r in range(2):
        assert heads[r] + rests[r] == whole[r]


async def test_readers_that_cannot_reshard_say_so(data, tmp_path):
    wds_no_counts = tmp_path / "wds"
    wds_no_counts.mkdir()
    for p in sorted(Path(data["wds"]).glob("*.tar")):
        (wds_no_counts / p.name).write_bytes(p.read_bytes())
    reader = readers.webdataset(wds_no_counts, shuffle=True)
    with pytest.raises(ConfigError, match="counts"):  # equal="pad" needs them
        Loader(reader, batch_size=4, rank=0, world=2, device="cpu")
    loaders = [Loader(reader, batch_size=4, rank=r, world=2, equal=None, device="cpu", seed=1) for r in range(2)]
    await _keys(loaders[0], 2)
    state = loaders[0].state_dict()
    # Any rank's state loads on every rank of the same world size, though with equal=None the
    # ranks' parts (and so their sample counts) differ.
    files = [Loader(readers.files(data["folder"]), batch_size=4, rank=r, world=4, equal=None, device="cpu")
             for r in range(4)]
    assert len({len(f.reader) for f in files}) > 1
    for f in files[1:]:
        f.load_state_dict(files[0].state_dict())
    other = Loader(reader, batch_size=4, rank=0, world=4, equal=None, device="cpu", seed=1)
    with pytest.raises(ConfigError, match="another world size"):
        other.load_state_dict(state)
    # At an epoch boundary any reader can move to another world size.
    other.load_state_dict({**state, "position": 0, "batches": 0, "epoch": 3})
    assert other.epoch == 3


async def test_a_reader_sharded_by_the_caller_is_left_alone(data):
    reader = readers.files(data["folder"]).shard(1, 3)
    loader = Loader(reader, batch_size=4, device="cpu", rank=1, world=3)
    assert loader.reader is reader and (loader.rank, loader.world) == (1, 3)
    with pytest.raises(ConfigError, match="sharded"):
        Loader(reader, batch_size=4, device="cpu", rank=0, world=3)
    with pytest.raises(ConfigError, match="equal"):
        Loader(readers.files(data["folder"]), batch_size=4, device="cpu", rank=0, world=2, equal="wrap")


async def test_torchrun_environment_shards_the_loader(data, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = Loader(readers.files(data["folder"]), batch_size=4, device="cpu")
    assert (loader.rank, loader.world, len(loader.reader)) == (1, 2, 38)
    alone = Loader(readers.files(data["folder"]), batch_size=4, device="cpu", distributed=False)
    assert (alone.world, len(alone.reader)) == (1, N)


async def test_processes_on_a_node_share_its_cores(data, monkeypatch):
    cores = os.cpu_count() or 1
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert detect_distributed().local_world == 1  # no LOCAL_WORLD_SIZE: the node is this process's
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert detect_distributed().local_world == 2
    loader = Loader(readers.files(data["folder"]), batch_size=4, device="cpu")
    assert loader.num_threads == max(1, cores // 2)
    assert Loader(readers.files(data["folder"]), batch_size=4, device="cpu", distributed=False).num_threads == cores
    for bad in ("two", "0"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
            Loader(readers.files(data["folder"]), batch_size=4, device="cpu")


async def test_a_state_of_another_version_is_refused(data):
    loader = _loader("files", data, 0, 1)
    await _keys(loader, 2)
    state = dict(loader.state_dict(), version=1)
    with pytest.raises(ConfigError, match="state version 1"):
        _loader("files", data, 0, 1).load_state_dict(state)


def test_resharded_webdataset_block_helper():
    from headrace.readers._reshard import block as _block

    items = np.arange(10)
    assert [len(_block(items, r, 4, "pad")) for r in range(4)] == [3, 3, 3, 3]
    assert np.concatenate([_block(items, r, 4, "pad") for r in range(4)]).tolist() == list(range(10)) + [0, 1]
    assert [len(_block(items, r, 4, "drop")) for r in range(4)] == [2, 2, 2, 2]
    assert np.concatenate([_block(items, r, 4, None) for r in range(4)]).tolist() == list(range(10))


# -- real process groups --------------------------------------------------------------------------


def _spawn(name, world, data, out, timeout=120.0):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(dw.worker, args=(world, name, data, str(out)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"phase {name} ({world} ranks) did not finish in {timeout:.0f} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
                p.join()
    return [json.loads((out / f"{name}-{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory, data):
    """Three gloo jobs in a row: A on 4 ranks, B on 2 (resuming A's states), C on 4 (resuming B's)."""
    out = tmp_path_factory.mktemp("jobs")
    a = _spawn("A", 4, data, out)
    b = _spawn("B", 2, data, out)
    c = _spawn("C", 4, data, out)
    return {"A": a, "B": b, "C": c}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("phase", ["A", "B"])
def test_gloo_ranks_find_themselves_and_split_each_epoch(jobs, kind, phase):
    results = [r[kind] for r in jobs[phase]]
    world = len(results)
    assert [r["who"][:2] for r in results] == [[rank, world] for rank in range(world)]
    per_rank = results[0]["who"][3]
    for epoch in ("full0", "full1"):
        parts = [r[epoch] for r in results]
        assert {len(p) for p in parts} == {results[0]["who"][2]}  # equal batch counts, = len(loader)
        _check_cover(_flat(parts), pad_limit=world * per_rank - N)
    assert _flat([results[0]["full0"]]) != _flat([results[0]["full1"]])  # a new order each epoch


@pytest.mark.parametrize("phase", ["A", "B"])
def test_gloo_ranks_share_one_global_order_without_communicating(jobs, data, phase):
    whole = readers.files(data["folder"], shuffle=True)
    world = len(jobs[phase])
    for epoch in (0, 1):
        keys = [whole._keys[i] for i in whole.order(epoch=epoch, seed=11)]
        keys += keys[: -N % world]
        for rank, result in enumerate(jobs[phase]):
            assert _flat([result["files"][f"full{epoch}"]]) == keys[rank::world]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("phase", ["A", "B"])
def test_gloo_resume_on_the_same_world_size_is_exact(jobs, kind, phase):
    for r in jobs[phase]:
        assert r[kind]["head1"] + r[kind]["rest1"] == r[kind]["full1"]
    states = [r[kind]["state"] for r in jobs[phase]]
    assert _one_state(states)


@pytest.mark.parametrize("kind", KINDS)
def test_gloo_resume_4_to_2(jobs, kind):
    before = [r[kind]["head1"] for r in jobs["A"]]
    after = [r[kind]["after42"] for r in jobs["B"]]
    assert len({len(p) for p in after}) == 1
    assert [r[kind]["head42"] for r in jobs["B"]] == [p[: dw.STOP_AFTER_CHANGE] for p in after]
    _check_cover(_flat(before) + _flat(after), pad_limit=1)


@pytest.mark.parametrize("kind", KINDS)
def test_gloo_resume_2_to_4(jobs, kind):
    before = [r[kind]["head1"] for r in jobs["B"]]
    after = [r[kind]["after24"] for r in jobs["C"]]
    assert len({len(p) for p in after}) == 1
    _check_cover(_flat(before) + _flat(after), pad_limit=3)


@pytest.mark.parametrize("kind", KINDS)
def test_gloo_resume_4_to_2_to_4(jobs, kind):
    first = [r[kind]["head1"] for r in jobs["A"]]
    second = [r[kind]["head42"] for r in jobs["B"]]
    third = [r[kind]["after424"] for r in jobs["C"]]
    assert len({len(p) for p in third}) == 1
    _check_cover(_flat(first) + _flat(second) + _flat(third), pad_limit=3)


def test_training_example_under_torchrun(tmp_path):
    """examples/train_distributed.py on 2 CPU processes: DDP over gloo, coverage checked by the script."""
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(root / "examples" / "train_distributed.py"), "--device", "cpu", "--data", str(tmp_path / "data"),
           "--images", "42", "--classes", "3", "--epochs", "1", "--batch-size", "8", "--size", "32",
           "--model", "tiny", "--check-coverage", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["backend"] == "gloo" and result["coverage_ok"] is True
    (epoch,) = result["epochs"]
    assert [r["batches"] for r in epoch["ranks"]] == [3, 3]  # 21 samples per rank, batches of 8
    assert epoch["coverage"]["distinct"] == 42 and epoch["coverage"]["repeats"] == 0
