"""Leaving epochs in every way training code does, hundreds of times, on one loader: each next
epoch starts at once and is whole, and nothing (files, threads, tasks) grows (tests/exits.py).

``HEADRACE_EXIT_ROUNDS`` sets the number of rounds (300 by default; the closing notes of issue 15
ran 1,000)."""

from __future__ import annotations

import os

from exits import EXITS, random_exits

from headrace import Loader, ops, readers


def _keys(folder):
    return {f"{p.parent.name}/{p.stem}" for p in folder.rglob("*.jpg")}


async def test_random_exits_leave_nothing_behind_and_the_next_epoch_is_whole(image_folder, leaks):
    rounds = int(os.environ.get("HEADRACE_EXIT_ROUNDS", "300"))
    pipe = ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(32), ops.Flip(), ops.Normalize()])

    def make():
        return Loader(readers.files(image_folder, shuffle=True, chunk_size=4), batch_size=8, pipeline=pipe,
                      device="cpu", num_threads=2, prefetch=3)

    done = await random_exits(make, rounds=rounds, expected_keys=_keys(image_folder), seed=15, max_delay=0.03)
    print(f"random exits on the CPU: {dict(done)}")
    assert set(EXITS) <= set(done) and sum(done.values()) == rounds + 1
    await leaks.check()


async def test_random_exits_with_run_ahead(image_folder, leaks):
    pipe = ops.Pipeline([ops.Decode(), ops.Resize(40), ops.CenterCrop(32)], label=None)

    def make():
        return Loader(readers.files(image_folder, shuffle=True, chunk_size=4), batch_size=8, pipeline=pipe,
                      device="cpu", num_threads=2, run_ahead=True)

    done = await random_exits(make, rounds=60, expected_keys=_keys(image_folder), seed=16, whole_every=3)
    assert done["whole"] >= 20
    await leaks.check()
