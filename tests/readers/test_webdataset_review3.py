"""Review of the count check (a shard that held another number of samples than its count ends with
a ReadError sample) where a job reads only part of a shard: a resampled epoch's last draw, a
resume, ranks striding a shard. Each sample the job reads and did not get is one error sample in
its place: never an extra sample past the epoch's length, never a second copy of one the
uninterrupted run gave before the resume point, and never numbered as a sample that was read."""

from __future__ import annotations

import os
import shutil
import tarfile

import pytest

from headrace import readers
from sample_data import tar_bytes


async def _read_all(reader, epoch=0, start=0, seed=0):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]


def _members(path):
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def _cut(path, keep):
    """Cut the shard cleanly after its first ``keep`` samples (a valid tar; written by a rename)."""
    members = _members(path)
    keys = list(dict.fromkeys(name.split(".", 1)[0] for name, _ in members))
    kept = [(name, data) for name, data in members if name.split(".", 1)[0] in set(keys[:keep])]
    tmp = path.with_suffix(".new")
    tmp.write_bytes(tar_bytes(kept))
    os.replace(tmp, path)


@pytest.fixture
def copy(tmp_path, packed_in_order):
    dest = tmp_path / "wds"
    shutil.copytree(packed_in_order, dest)
    return dest


def _partial_last_draw(reader, epochs=range(200)):
    """An epoch whose last draw is read in part, of a shard drawn nowhere else in it: (epoch, shard,
    samples of it read)."""
    for epoch in epochs:
        jobs = reader._jobs(epoch, 0)
        last = jobs[-1]
        read = len(reader) - last.rank_base
        if read < last.count - 1 and all(j.shard != last.shard for j in jobs[:-1]):
            return epoch, last.shard, read
    raise AssertionError("no such epoch")


@pytest.mark.parametrize("world", [1, 2, 3])
async def test_a_cut_past_what_a_resampled_epoch_reads_of_its_last_draw_adds_no_sample(copy, world):
    # Every sample the epoch needs is there: it has exactly len() samples, none of them an error
    # (an extra error sample past the end made this rank's epoch longer than the others').
    for rank in range(world):
        reader = readers.webdataset(copy, resampled=True, shuffle=True, shuffle_buffer=5).shard(rank, world)
        epoch, shard, read = _partial_last_draw(reader)
        path = sorted(copy.glob("*.tar"))[shard]
        saved = path.read_bytes()
        _cut(path, read + 1)
        try:
            samples = await _read_all(reader, epoch=epoch)
            assert len(samples) == len(reader) and all(s.error is None for s in samples), (
                [str(s.error) for s in samples if s.error])
            assert [s.position for s in samples] == list(range(len(reader)))
            for start in (1, len(reader) // 2, len(reader) - 1):
                tail = await _read_all(reader, epoch=epoch, start=start)
                assert [s.key for s in tail] == [s.key for s in samples[start:]]
        finally:
            path.write_bytes(saved)


async def test_a_resume_past_a_cut_shards_error_does_not_give_it_again(copy):
    reader = readers.webdataset(copy)
    shard = sorted(copy.glob("*.tar"))[1]  # samples 8..15
    _cut(shard, 5)  # 3 lost: an error sample in the place of each, at positions 13, 14, 15
    full = await _read_all(reader)
    assert [i for i, s in enumerate(full) if s.error is not None] == [13, 14, 15]
    # Resumed right after the errors (16 samples given): the rest is the next shard, no second error.
    tail = await _read_all(reader, start=16)
    assert all(s.error is None for s in tail), [str(s.error) for s in tail if s.error]
    assert [s.key for s in tail[:8]] == [s.key for s in full[16:24]]
    # Resumed between them (14 given): the two still to come, once each.
    mid = await _read_all(reader, start=14)
    assert [i for i, s in enumerate(mid) if s.error is not None] == [0, 1]
    assert [str(s.error) for s in mid[:2]] == [str(s.error) for s in full[14:16]]
    # Resumed at the first: all three come first, once.
    at = await _read_all(reader, start=13)
    assert [i for i, s in enumerate(at) if s.error is not None] == [0, 1, 2]

