"""The files reader reads local files into the sample pool's recycled ``bytes``
(``readers/_sample_pool.py``, ``hr_pool_blob``): a file's bytes still held by anyone are never
written over, ones let go are filled again by later files, and every sample is its file's bytes,
whatever sizes the files had the epoch before."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from headrace import readers
from headrace.readers import _read_files
from headrace.readers._sample_pool import _pool_lib

pytestmark = pytest.mark.skipif(_pool_lib() is None or _read_files.unavailable_reason() is not None,
                                reason="the C helpers do not build here")


def _write_tree(root, rng: np.random.Generator, n: int) -> dict[str, bytes]:
    """n files of 0 to 90 KB (a few empty) under two class folders: their contents by key."""
    contents = {}
    for i, size in enumerate(rng.integers(0, 90_000, n)):
        key = f"c{i % 2}/{i:04d}"
        data = rng.bytes(int(size)) if i % 50 else b""
        path = root / f"{key}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        contents[key] = data
    return contents


async def _epoch(reader: readers.Reader, epoch: int) -> list:
    return [s async for chunk in reader.read(epoch, seed=epoch) for s in chunk]


async def test_files_held_across_epochs_keep_their_bytes_and_let_go_ones_are_reused(tmp_path):
    contents = _write_tree(tmp_path, np.random.default_rng(5), 400)
    reader = readers.files(tmp_path, shuffle=True, chunk_size=16)
    kept = await _epoch(reader, 0)  # every file of epoch 0 held
    for epoch in (1, 2):
        for sample in await _epoch(reader, epoch):
            assert sample.fields["jpg"] == contents[sample.key]  # read, then let go
    assert {s.key: s.fields["jpg"] for s in kept} == contents  # not one written over by epochs 1 and 2
    assert reader._pool.stats()["reused"] > 300  # epoch 2 refilled what epoch 1 let go


async def test_files_rewritten_with_other_sizes_read_as_they_are_now(tmp_path):
    # A recycled blob's capacity is its size class's: each sample must still be exactly its file.
    _write_tree(tmp_path, np.random.default_rng(6), 200)
    reader = readers.files(tmp_path, shuffle=False, chunk_size=8)
    await _epoch(reader, 0)
    for epoch, seed in ((1, 7), (2, 8)):
        contents = _write_tree(tmp_path, np.random.default_rng(seed), 200)
        got = {s.key: s.fields["jpg"] for s in await _epoch(reader, epoch)}
        assert got == contents
        assert all(type(v) is bytes and hash(v) == hash(bytes(v)) for v in got.values())
    assert reader._pool.stats()["reused"] > 0


async def test_an_array_over_a_file_keeps_the_file_after_its_sample_is_gone(tmp_path):
    contents = _write_tree(tmp_path, np.random.default_rng(9), 120)
    reader = readers.files(tmp_path, shuffle=True, chunk_size=4)
    arrays = {}
    for sample in await _epoch(reader, 0):
        arrays[sample.key] = np.frombuffer(sample.fields["jpg"], dtype=np.uint8)  # holds a buffer export
    gc.collect()
    for epoch in (1, 2):
        await _epoch(reader, epoch)
    assert {key: array.tobytes() for key, array in arrays.items()} == contents


async def test_a_file_gone_between_epochs_is_a_read_error_and_its_neighbours_are_read(tmp_path):
    contents = _write_tree(tmp_path, np.random.default_rng(10), 60)
    reader = readers.files(tmp_path, shuffle=False, chunk_size=16)
    await _epoch(reader, 0)
    (tmp_path / "c1/0007.jpg").unlink()
    samples = await _epoch(reader, 1)
    failed = [s for s in samples if s.error is not None]
    assert [s.key for s in failed] == ["c1/0007"] and "0007.jpg" in failed[0].source
    assert {s.key: s.fields["jpg"] for s in samples if s.error is None} == {
        k: v for k, v in contents.items() if k != "c1/0007"}
