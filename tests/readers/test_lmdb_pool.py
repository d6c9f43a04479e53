"""The LMDB reader copies a chunk's values out of the map into the sample pool's recycled ``bytes``
(``readers/_sample_pool.py``): a value still held by anyone is never written over, one let go is
filled again by a later value, and the values are the database's bytes either way."""

from __future__ import annotations

import numpy as np
import pytest

from headrace import readers
from headrace.readers._sample_pool import _pool_lib

lmdb_lib = pytest.importorskip("lmdb")
pytestmark = pytest.mark.skipif(_pool_lib() is None, reason="the C helper does not build here")


@pytest.fixture(scope="module")
def values(tmp_path_factory) -> tuple[str, dict[str, bytes]]:
    rng = np.random.default_rng(11)
    items = {f"{i:05d}": b"\xff\xd8\xff" + rng.bytes(int(n)) for i, n in enumerate(rng.integers(1, 90_000, 600))}
    path = tmp_path_factory.mktemp("lmdb") / "db"
    env = lmdb_lib.open(str(path), map_size=1 << 28)
    with env.begin(write=True) as txn:
        for key, value in items.items():
            txn.put(key.encode(), value)
    env.close()
    return str(path), items


async def test_values_held_across_epochs_keep_their_bytes_and_let_go_ones_are_reused(values):
    path, items = values
    reader = readers.lmdb(path, chunk_size=16)
    kept = [s async for chunk in reader.read(0) for s in chunk]  # every value of epoch 0 held
    for epoch in (1, 2):
        async for chunk in reader.read(epoch, seed=epoch):
            for sample in chunk:
                assert sample.fields["jpg"] == items[sample.key]  # read, then let go
    assert {s.key: s.fields["jpg"] for s in kept} == items  # not one written over by epochs 1 and 2
    stats = reader._pool.stats()
    assert stats["reused"] > 500  # epoch 2 refilled what epoch 1 let go


async def test_a_decode_function_that_keeps_a_view_of_its_value_keeps_the_value(values):
    path, items = values
    views = []

    def decode(key: bytes, value: bytes) -> dict:
        views.append((key.decode(), memoryview(value)[3:]))  # holds the value past the sample
        return {"n": str(len(value)).encode()}

    reader = readers.lmdb(path, decode=decode, chunk_size=16)
    for epoch in range(3):
        async for _ in reader.read(epoch, seed=epoch):
            pass
    assert len(views) == 3 * len(items)
    for key, view in views:
        assert bytes(view) == items[key][3:]
