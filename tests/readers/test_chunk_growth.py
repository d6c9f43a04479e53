"""Chunks that grow where samples are small (``IndexedReader.grows``): a local reader given no
``chunk_size`` starts at 64 samples a chunk and grows toward ~4 MiB at the mean size read so far,
to at most 1,024, and toward up to 16 MiB where finished chunks reach the event loop late (the GIL
busy elsewhere); the samples and their order are the same as with a fixed chunk, and a
``chunk_size`` given is kept."""

from __future__ import annotations

import time

import numpy as np
import pytest

from headrace import readers
from headrace.readers import _base
from headrace.readers.files import FileReader
from headrace.readers._base import CHUNK_BYTES, CONTENDED_GROWTH, DEFAULT_CHUNK, HANDOVER_DELAY_FREE


def _tree(root, sizes) -> None:
    rng = np.random.default_rng(4)
    for i, size in enumerate(sizes):
        folder = root / f"c{i % 3}"
        folder.mkdir(exist_ok=True)
        (folder / f"{i:05d}.jpg").write_bytes(rng.bytes(int(size)))


async def _chunks(reader, epoch: int = 0) -> list[list]:
    return [[(s.key, s.fields["jpg"], s.position) for s in chunk] async for chunk in reader.read(epoch, seed=epoch)]


@pytest.mark.parametrize("shuffle", [False, True])
async def test_small_files_come_in_growing_chunks_in_the_same_order(tmp_path, shuffle):
    _tree(tmp_path, [2000] * 5000)
    grown = await _chunks(readers.files(tmp_path, shuffle=shuffle, seed=1))
    fixed = await _chunks(readers.files(tmp_path, shuffle=shuffle, seed=1, chunk_size=64))
    assert [s for c in grown for s in c] == [s for c in fixed for s in c]
    lengths = [len(c) for c in grown]
    assert lengths[0] == DEFAULT_CHUNK and max(lengths) == 16 * DEFAULT_CHUNK  # ~2 KB files: capped at 1,024
    assert {len(c) for c in fixed[:-1]} == {64}


async def test_large_samples_keep_the_default_chunk_and_a_given_one_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(_base, "CONTENDED_GROWTH", 1)  # a loaded machine's late hand-overs: the test below
    _tree(tmp_path, [CHUNK_BYTES // 32] * 200)  # 128 KiB files: 32 make the target, fewer than 64
    assert {len(c) for c in (await _chunks(readers.files(tmp_path)))[:-1]} == {DEFAULT_CHUNK}
    small = tmp_path / "small"
    small.mkdir()
    _tree(small, [100] * 300)
    assert {len(c) for c in (await _chunks(readers.files(small, chunk_size=7)))[:-1]} == {7}


async def test_an_lmdb_of_small_values_grows_its_chunks(tmp_path):
    lmdb_lib = pytest.importorskip("lmdb")
    env = lmdb_lib.open(str(tmp_path / "db"), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i in range(3000):
            txn.put(f"{i:05d}".encode(), b"\xff\xd8\xff" + bytes(i % 251 for _ in range(500)))
    env.close()
    reader = readers.lmdb(tmp_path / "db")
    chunks = [[s.key for s in c] async for c in reader.read(0)]
    assert [k for c in chunks for k in c] == [f"{i:05d}" for i in range(3000)]
    assert len(chunks[0]) == DEFAULT_CHUNK and max(map(len, chunks)) > DEFAULT_CHUNK
    assert reader.max_chunk == 16 * DEFAULT_CHUNK and readers.lmdb(tmp_path / "db", chunk_size=64).max_chunk == 64



class _LateHandOvers(FileReader):
    """A files reader whose finished chunks reach the loop 5 ms late, as beside a thread that holds
    the GIL, and whose reads take 2 ms (so the loop waits for each)."""

    def _fetch_numbered(self, indices, first):
        time.sleep(0.002)
        chunk = super()._fetch_numbered(indices, first)
        time.sleep(0.005)  # after the stamp: the hand-over
        return chunk


async def test_late_hand_overs_grow_chunks_toward_more_bytes_in_the_same_order(tmp_path):
    _tree(tmp_path, [CHUNK_BYTES // 64] * 1500)  # 64 KiB files: 64 make 4 MiB
    plain = readers.files(tmp_path, shuffle=True, seed=2, io_threads=1)
    late = _LateHandOvers(plain.paths, plain.labels, root=tmp_path, shuffle=True, seed=2, io_threads=1)
    grown, fixed = await _chunks(late), await _chunks(plain)
    assert [s for c in grown for s in c] == [s for c in fixed for s in c]
    lengths = [len(c) for c in grown]
    assert lengths[0] == DEFAULT_CHUNK  # then up to 16 MiB of them (the label's bytes count too)
    assert 3 * DEFAULT_CHUNK < max(lengths) <= CONTENDED_GROWTH * DEFAULT_CHUNK


def test_the_growth_follows_the_delay():
    reader = readers.files([__file__], labels=[0])
    size = CHUNK_BYTES // 64
    assert reader._chunk_length(64, 64 * size, 0.0) == 64
    assert reader._chunk_length(64, 64 * size, HANDOVER_DELAY_FREE) == 64
    assert reader._chunk_length(64, 64 * size, 2 * HANDOVER_DELAY_FREE) == 128
    assert reader._chunk_length(64, 64 * size, 100 * HANDOVER_DELAY_FREE) == CONTENDED_GROWTH * 64
    assert reader._chunk_length(64, 64 * 100, 100 * HANDOVER_DELAY_FREE) == reader.max_chunk  # small: capped
