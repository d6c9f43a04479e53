"""Worker processes for tests/stream/test_distributed.py: real torch.distributed (gloo) ranks.

Each worker joins a process group, builds loaders that find their rank and world size themselves,
runs the phase it is told, and writes what it saw (sample keys per batch, states) as JSON. The
test process starts the ranks (spawn) and checks the files; nothing here asserts.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

BATCH = 4
STOP = 3  # batches each rank reads before its "crash" (3 x 4 = 12 samples: no rank pads yet)
STOP_AFTER_CHANGE = 2  # batches read on the new world size before a second change


def make_loader(kind: str, data: dict[str, str]) -> Any:
    from headrace import Loader, ops, readers

    if kind == "files":
        reader = readers.files(data["folder"], shuffle=True, io_threads=1)
    elif kind == "lmdb":
        reader = readers.lmdb(data["lmdb"], shuffle=True, io_threads=1)
    else:
        reader = readers.webdataset(data["wds"], shuffle=True, shuffle_buffer=6, read_ahead=1)
    pipe = ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(16), ops.Normalize()])
    return Loader(reader, batch_size=BATCH, pipeline=pipe, device="cpu", num_threads=1, seed=11)


async def _keys(loader: Any, limit: int | None = None) -> list[list[str]]:
    out = []
    async with loader:
        async for batch in loader:
            out.append(list(batch.sample_keys))
            if limit is not None and len(out) == limit:
                break
    return out


async def _epoch1(kind: str, data: dict[str, str], state: dict | None = None, limit: int | None = None):
    """Keys of epoch 1 (from ``state`` if given) and the state after them."""
    loader = make_loader(kind, data)
    loader.load_state_dict(state if state is not None else {**loader.state_dict(), "epoch": 1})
    keys = await _keys(loader, limit)
    return keys, loader.state_dict()


async def _phase(name: str, rank: int, world: int, data: dict[str, str], out: Path) -> dict:
    result: dict[str, Any] = {}
    for kind in ("files", "lmdb", "wds"):
        r: dict[str, Any] = {}
        result[kind] = r
        loader = make_loader(kind, data)
        r["who"] = [loader.rank, loader.world, len(loader), len(loader.reader)]
        r["full0"] = await _keys(loader)
        r["full1"], _ = await _epoch1(kind, data)
        if name in ("A", "B"):
            # Same world size: stop after STOP batches, resume on a new loader.
            r["head1"], state = await _epoch1(kind, data, limit=STOP)
            r["state"] = state
            r["rest1"], _ = await _epoch1(kind, data, state)
        if name == "B":
            # 4 -> 2: any rank's state of A's step will do; take a different rank's to show it.
            saved = _load(out, "A", kind, (rank + 1) % 4)
            r["after42"], _ = await _epoch1(kind, data, saved)
            r["head42"], r["state42"] = await _epoch1(kind, data, saved, limit=STOP_AFTER_CHANGE)
        if name == "C":
            r["after24"], _ = await _epoch1(kind, data, _load(out, "B", kind, rank % 2, "state"))
            r["after424"], _ = await _epoch1(kind, data, _load(out, "B", kind, rank % 2, "state42"))
    return result


def _load(out: Path, phase: str, kind: str, rank: int, key: str = "state") -> dict:
    with open(out / f"{phase}-{rank}.json") as f:
        return json.load(f)[kind][key]


def worker(rank: int, world: int, name: str, data: dict[str, str], out: str) -> None:
    """One rank of phase ``name``: joins the gloo group through a file, runs, writes ``{name}-{rank}.json``."""
    import torch.distributed as dist

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # the loader must find them in the process group
        os.environ.pop(var, None)
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous-{name}", rank=rank, world_size=world)
    try:
        started = time.perf_counter()
        result = asyncio.run(_phase(name, rank, world, data, Path(out)))
        result["seconds"] = time.perf_counter() - started
        dist.barrier()
        tmp = Path(out) / f"{name}-{rank}.json.tmp"
        tmp.write_text(json.dumps(result))
        os.replace(tmp, Path(out) / f"{name}-{rank}.json")
    finally:
        dist.destroy_process_group()
