"""With known counts, a shard that ends early (cut exactly between two samples, or truncated inside
one) gives one ReadError sample for each sample its count says it still holds and the job reads:
positions, ``len()``, every rank's batch count and resume stay exact, and ``on_error``/``max_errors``
count every sample lost. A longer shard's error takes its last counted sample's place. (One error
sample for several lost samples made the epoch shorter than ``len()``: under ``equal="pad"`` a rank
reading such a shard yielded fewer batches than the others, and a resume past it was off.)"""

from __future__ import annotations

import os
import tarfile

import pytest

import headrace
from headrace import ErrorBudgetExceeded, ReadError, readers
from sample_data import tar_bytes


async def _read_all(reader, epoch=0, start=0, seed=0):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]




def _shard(packed_copy, i):
    return sorted(packed_copy.glob("*.tar"))[i]


def _replace(path, data):
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _starts(path):
    """(offset of the first member header, key, offset of that member's data) of each sample, in order."""
    out = []
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            key = m.name.split(".", 1)[0]
            if not out or out[-1][1] != key:
                out.append((m.offset, key, m.offset_data))
    return out


def _cut_between(path, keep):
    """Cut exactly before sample ``keep``'s first header: a tar that parses cleanly."""
    _replace(path, path.read_bytes()[: _starts(path)[keep][0]])


def _cut_inside(path, keep):
    """Cut inside sample ``keep``'s first member's data: a truncated tar. Returns that sample's key."""
    offset, key, data = _starts(path)[keep]
    _replace(path, path.read_bytes()[: data + 100])
    return key


def _view(samples):
    """What a resume must give alike: each sample, and each error's kind and place ("sample 4 of 8
    missing"; the cause's wording may differ: a member seeked over is cut off, one read needs bytes)."""
    return [(s.key, s.index, s.position, s.error is None, None if s.error is None else str(s.error).split(":")[0])
            for s in samples]


@pytest.mark.parametrize("inside", [False, True])
async def test_every_lost_sample_of_a_whole_shard_read_is_an_error_in_its_place(packed_copy, inside):
    reader = readers.webdataset(packed_copy)
    shard = _shard(packed_copy, 3)  # dataset indices 24..31
    whole = await _read_all(reader)
    key = (_cut_inside if inside else _cut_between)(shard, 5)
    samples = await _read_all(reader)
    assert len(samples) == len(reader) == 75
    assert [s.position for s in samples] == list(range(75))
    bad = [s for s in samples if s.error is not None]
    assert [s.index for s in bad] == [29, 30, 31] and [s.position for s in bad] == [29, 30, 31]
    assert all(isinstance(s.error, ReadError) and s.error.source == str(shard) == s.source for s in bad)
    if inside:  # the sample being read fails with its key; the two after it are missing
        assert bad[0].key == key and bad[0].error.key == key and "truncated" in str(bad[0].error)
        for k, s in zip((7, 8), bad[1:]):
            assert f"sample {k} of 8 missing: the shard failed at sample 6 ({key!r}): " in str(s.error)
    else:
        for k, s in zip((6, 7, 8), bad):
            assert f"sample {k} of 8 missing: shard ends after 5 (cut short, or changed since it was counted" in str(s.error)
    assert [s.key for s in samples if s.error is None] == [s.key for s in whole if not 29 <= s.index <= 31]


@pytest.mark.parametrize("inside", [False, True])
async def test_striding_ranks_each_give_the_lost_samples_of_their_own_places(packed_copy, inside):
    reader = readers.webdataset(packed_copy, split="samples")  # every rank reads every shard, strided by 3
    (_cut_inside if inside else _cut_between)(_shard(packed_copy, 2), 3)  # indices 19..23 lost
    lost, good = [], []
    for rank in range(3):
        part = reader.shard(rank, 3)
        samples = await _read_all(part)
        assert len(samples) == len(part) and [s.position for s in samples] == list(range(len(part)))
        lost += [s.index for s in samples if s.error is not None]
        good += [s.index for s in samples if s.error is None]
    assert sorted(lost) == [19, 20, 21, 22, 23]
    assert sorted(good + lost) == list(range(75))


def _partial_last_draw(reader):
    """An epoch whose last draw, of a shard drawn nowhere else in it, is read in part: (epoch, shard,
    samples of it read)."""
    for epoch in range(200):
        jobs = reader._jobs(epoch, 0)
        last = jobs[-1]
        read = len(reader) - last.rank_base
        if 3 <= read < last.count - 1 and all(j.shard != last.shard for j in jobs[:-1]):
            return epoch, last.shard, read
    raise AssertionError("no such epoch")


@pytest.mark.parametrize("world", [1, 3])
async def test_a_resampled_last_draw_gives_errors_only_for_the_places_it_reads(packed_copy, world):
    for rank in range(world):
        reader = readers.webdataset(packed_copy, resampled=True).shard(rank, world)
        epoch, shard, read = _partial_last_draw(reader)
        path = _shard(packed_copy, shard)
        saved = path.read_bytes()
        _cut_between(path, read - 2)  # two of the places the epoch reads are lost, the rest past its end
        try:
            samples = await _read_all(reader, epoch=epoch)
            assert len(samples) == len(reader) and [s.position for s in samples] == list(range(len(reader)))
            assert [i for i, s in enumerate(samples) if s.error is not None] == [len(reader) - 2, len(reader) - 1]
            for start in range(len(reader) - 4, len(reader) + 1):
                assert _view(await _read_all(reader, epoch=epoch, start=start)) == _view(samples[start:])
        finally:
            _replace(path, saved)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("inside", [False, True])
async def test_a_resume_at_every_position_is_the_uninterrupted_run(packed_copy, shuffle, inside):
    reader = readers.webdataset(packed_copy, shuffle=shuffle, shuffle_buffer=6)
    (_cut_inside if inside else _cut_between)(_shard(packed_copy, 1), 2)  # 6 lost
    full = await _read_all(reader, epoch=1)
    assert len(full) == 75 and sum(s.error is not None for s in full) == 6
    for start in range(76):
        assert _view(await _read_all(reader, epoch=1, start=start)) == _view(full[start:]), start


async def test_a_longer_shard_keeps_every_length_and_gives_one_error(packed_copy):
    reader = readers.webdataset(packed_copy, split="samples", shuffle=True, shuffle_buffer=5)
    shard = _shard(packed_copy, 4)  # indices 32..39
    with tarfile.open(shard) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    _replace(shard, tar_bytes(members + [("extra/1.cls", b"1"), ("extra/2.cls", b"2")]))
    bad = []
    for rank in range(3):
        part = reader.shard(rank, 3)
        samples = await _read_all(part)
        assert len(samples) == len(part) and sorted(s.position for s in samples) == list(range(len(part)))
        bad += [s for s in samples if s.error is not None]
        for start in (1, len(part) // 2, len(part) - 1):
            assert _view(await _read_all(part, start=start)) == _view(samples[start:])
    assert len(bad) == 1 and bad[0].index == 39 and bad[0].key == members[-1][0].split(".", 1)[0]
    assert "shard holds 10 samples; its count says 8" in str(bad[0].error)


async def test_a_command_failing_after_its_last_counted_sample_takes_that_samples_place(packed_copy):
    shard = _shard(packed_copy, 0)
    reader = readers.webdataset([f"pipe:cat {shard}; exit 3"], counts=[8])
    samples = await _read_all(reader)
    assert len(samples) == len(reader) == 8 and [s.position for s in samples] == list(range(8))
    assert [s.error is None for s in samples] == [True] * 7 + [False]
    assert isinstance(samples[-1].error, ReadError) and samples[-1].index == 7


def _loader(reader, **kw):
    return headrace.Loader(reader, batch_size=4, num_threads=2, seed=3, device="cpu", **kw)


@pytest.mark.parametrize("inside", [False, True])
async def test_pad_gives_every_rank_len_loader_batches(packed_copy, inside):
    made = [readers.webdataset(packed_copy) for _ in range(3)]  # before the cut: the index's sizes still hold
    (_cut_inside if inside else _cut_between)(_shard(packed_copy, 1), 5)  # 3 lost, on rank 1 (split by shards)
    counts = []
    for rank, reader in enumerate(made):
        loader = _loader(reader, rank=rank, world=3, equal="pad", on_error="skip", max_errors=10)
        async with loader:
            batches = [b async for b in loader]
        counts.append((len(batches), len(loader)))
        if rank == 1:
            assert loader.stats().dropped == 3
    assert all(n == expected for n, expected in counts), counts


async def test_skip_counts_every_lost_sample_against_max_errors(packed_copy):
    made = [readers.webdataset(packed_copy) for _ in range(2)]
    _cut_between(_shard(packed_copy, 6), 1)  # a shard of 8 that lost 7 counts 7 errors
    loader = _loader(made[0], on_error="skip", max_errors=7)
    async with loader:
        keys = [k async for b in loader for k in b.sample_keys]
    assert len(keys) == 68 and loader.stats().dropped == 7
    loader = _loader(made[1], on_error="skip", max_errors=6)
    async with loader:
        with pytest.raises(ErrorBudgetExceeded, match="7 of"):
            async for _ in loader:
                pass


async def test_without_counts_one_error_sample_as_before(packed_copy):
    (packed_copy / "headrace-index.json").unlink()
    _cut_inside(_shard(packed_copy, 1), 2)
    samples = await _read_all(readers.webdataset(packed_copy))
    assert len(samples) == 70 and sum(s.error is not None for s in samples) == 1


async def test_a_remote_shard_failing_past_its_retries_loses_its_samples_as_storage_errors(s3_env):
    from test_storage import RETRY, WDS, _url

    from headrace import StorageError

    s3_env.faults("s3", {"match": "shard-000002", "faults": [{"kind": "reset", "after": 1500}],
                         "then": {"kind": "status", "status": 503}})
    reader = readers.webdataset(_url(s3_env, "s3", WDS), storage_options={"retry": RETRY})
    samples = await _read_all(reader)
    assert len(samples) == len(reader) and [s.position for s in samples] == list(range(len(reader)))
    bad = [s for s in samples if s.error is not None]
    # Every sample of the shard is lost, each a StorageError (the cause's kind), the first the failure itself.
    assert [type(s.error) for s in bad] == [StorageError] * 8
    assert all(f"sample {k} of 8 missing: the shard failed at sample 1" in str(s.error) for k, s in enumerate(bad[1:], 2))
