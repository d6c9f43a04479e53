"""Random exits on the GPU path (tests/exits.py): hundreds of epochs left by break, raise, cancel,
timeout and aclose at random points, the loader reused after each; files, threads, tasks and
torch's CUDA bytes allocated stay where the first epoch left them, and return to the baseline
after the last ``aclose()``. ``HEADRACE_EXIT_ROUNDS`` sets the rounds (200 by default)."""

from __future__ import annotations

import gc
import os

import numpy as np
import torch
from exits import EXITS, random_exits
from sample_data import jpeg_bytes

from headrace import Loader, ops, readers


_SLACK = 32 << 20


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


async def test_random_exits_on_the_gpu_give_back_every_cuda_byte(tmp_path, leaks):
    rng = np.random.default_rng(15)
    for c in range(3):
        (tmp_path / f"c{c}").mkdir()
        for i in range(40):
            h, w = int(rng.integers(120, 400)), int(rng.integers(120, 400))
            (tmp_path / f"c{c}" / f"{i:03d}.jpg").write_bytes(jpeg_bytes(rng, h, w))
    keys = {f"c{c}/{i:03d}" for c in range(3) for i in range(40)}
    rounds = int(os.environ.get("HEADRACE_EXIT_ROUNDS", "200"))
    before = _allocated()

    def make():
        return Loader(readers.files(tmp_path, shuffle=True, chunk_size=8), batch_size=16, device="cuda",
                      pipeline=ops.training(96, dtype="float16"))

    # Between epochs the loader keeps its lanes' decode workspaces, which grow (in whole MiB) when a
    # later epoch's crops need more than the first's: one epoch's working set. What a left epoch had
    # in flight must be given back: a batch's output is 0.9 MiB, so a leak of one a round would pass
    # the slack within 40 rounds.
    # 'aclose' makes a new loader, whose lanes take about a second to make: a quarter as often.
    done = await random_exits(make, rounds=rounds, expected_keys=keys, seed=15, max_delay=0.05,
                              memory=_allocated, memory_slack=_SLACK, weights={"aclose": 0.25})
    after = _allocated()
    print(f"random exits on the GPU: {dict(done)}; CUDA bytes allocated before {before}, after close {after}")
    assert set(EXITS) <= set(done)
    assert after == before
    await leaks.check(settle=5.0)
