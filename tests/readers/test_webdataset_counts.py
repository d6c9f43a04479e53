"""A shard that holds another number of samples than its known count (index, ``counts=``, ``"scan"``)
is an error: a tar cut exactly between two members parses cleanly, so only the count tells it from a
whole one. A shorter shard gives one ReadError sample for each sample it lacks (positions and
``len()`` stay exact); a longer one gives its error in the place of its last counted sample."""

from __future__ import annotations

import os
import shutil
import tarfile

import pytest

from headrace import ReadError, readers
from headrace.readers._shards import INDEX_NAME
from sample_data import tar_bytes


async def _read_all(reader, epoch=0, start=0, seed=0):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]




def _sample_starts(path):
    """Byte offset of the first member header of each sample (members grouped by key), in order."""
    starts, keys = [], []
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            key = member.name.split(".", 1)[0]
            if not keys or keys[-1] != key:
                keys.append(key)
                starts.append(member.offset)
    return starts, keys


def _replace(path, data):
    """Write ``data`` as ``path`` by a rename: a shard is never rewritten in place (memory maps)."""
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _cut(path, keep):
    """Cut the shard exactly before the header of its sample ``keep``: a valid tar of ``keep`` samples
    without an end marker (tarfile and GNU tar read it without complaint). Returns the kept keys."""
    starts, keys = _sample_starts(path)
    _replace(path, path.read_bytes()[: starts[keep]])
    with tarfile.open(path) as tar:  # the cut really is clean: the standard library reads it whole
        assert {m.name.split(".", 1)[0] for m in tar.getmembers()} == set(keys[:keep])
    return keys[:keep]


def _check_short(samples, shard, held, count):
    """One error sample for each of the shard's missing samples, each naming its place."""
    bad = [s for s in samples if s.error is not None]
    assert len(bad) == count - held, [str(s.error) for s in bad]
    for k, s in enumerate(bad, held + 1):
        error = s.error
        assert isinstance(error, ReadError) and error.source == str(shard)
        assert f"sample {k} of {count} missing: shard ends after {held} (cut short" in str(error)
        assert s.source == str(shard)
    assert [s.position for s in bad] == list(range(bad[0].position, bad[0].position + len(bad)))
    return [s for s in samples if s.error is None]


async def test_a_shard_cut_between_samples_after_the_reader_was_made_ends_with_an_error(packed_copy):
    reader = readers.webdataset(packed_copy)  # the index gives counts: 75 samples
    assert len(reader) == 75
    shard = sorted(packed_copy.glob("*.tar"))[3]
    whole = await _read_all(reader)
    kept = _cut(shard, 5)
    samples = await _read_all(reader)
    good = _check_short(samples, shard, 5, 8)
    lost = {s.key for s in whole if s.source == str(shard)} - set(kept)
    assert len(lost) == 3 and [s.key for s in good] == [s.key for s in whole if s.key not in lost]
    assert all(g.fields == w.fields for g, w in zip(good, (s for s in whole if s.key not in lost)))
    assert samples[-1].error is None  # the error samples are where the shard ended, the later shards follow
    assert [s.position for s in samples] == list(range(len(samples)))
    assert len(samples) == len(reader) == 75  # one error sample for each sample lost: the epoch's length holds


async def test_counts_given_and_counts_scanned_are_checked_too(packed_copy):
    (packed_copy / INDEX_NAME).unlink()
    scanned = readers.webdataset(packed_copy, counts="scan")
    shard = sorted(packed_copy.glob("*.tar"))[0]
    _cut(shard, 2)
    _check_short(await _read_all(scanned), shard, 2, 8)
    given = readers.webdataset(packed_copy, counts=[8] * 9 + [3])
    _check_short(await _read_all(given), shard, 2, 8)
    # Without counts a shard cut between samples cannot be told from a whole one: read as it is.
    plain = await _read_all(readers.webdataset(packed_copy))
    assert len(plain) == 69 and all(s.error is None for s in plain)


async def test_a_shard_with_samples_added_is_an_error_too(packed_copy):
    reader = readers.webdataset(packed_copy, shuffle=True, shuffle_buffer=4)
    shard = sorted(packed_copy.glob("*.tar"))[1]
    with tarfile.open(shard) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    _replace(shard, tar_bytes(members + [("extra/1.cls", b"1"), ("extra/2.cls", b"2")]))
    samples = await _read_all(reader, epoch=1)
    bad = [s for s in samples if s.error is not None]
    assert len(bad) == 1 and bad[0].error.source == str(shard)
    assert "shard holds 10 samples; its count says 8" in str(bad[0].error)
    assert "its sample 8 of 8 is given as this error and the 2 past it are not read" in str(bad[0].error)
    # The error takes the last counted sample's place: the epoch keeps its length.
    assert len(samples) == len(reader) == 75 and sorted(s.position for s in samples) == list(range(75))
    assert bad[0].key == members[-1][0].split(".", 1)[0] and bad[0].index == 15
    good = [s for s in samples if s.error is None]
    assert len(good) == 74 and not any(s.key.startswith("extra/") for s in good)  # the added ones are not read


@pytest.mark.parametrize("world", [3, 16])  # 16 ranks > 10 shards: every rank reads every shard, strided
async def test_every_rank_reading_part_of_a_cut_shard_sees_it(packed_copy, world):
    reader = readers.webdataset(packed_copy)
    shard = sorted(packed_copy.glob("*.tar"))[4]
    _cut(shard, 6)
    seen, lost = [], []
    for rank in range(world):
        part = reader.shard(rank, world)
        samples = await _read_all(part)
        assert len(samples) == len(part) and [s.position for s in samples] == list(range(len(part)))
        bad = [s for s in samples if s.error is not None]
        assert all("missing: shard ends after 6 (cut short" in str(s.error) for s in bad)
        if world > 10:  # every rank strides every shard: sample 7 (ordinal 6) and 8 (ordinal 7) each on one rank
            assert len(bad) == ((6 - (rank - 4)) % world == 0) + ((7 - (rank - 4)) % world == 0)
        elif 4 % world == rank:  # the rank that reads the shard
            assert len(bad) == 2
        else:
            assert not bad
        seen += [s.key for s in samples if s.error is None]
        lost += [s.index for s in bad]
    assert len(seen) == len(set(seen)) == 73
    assert sorted(lost) == [38, 39]  # each lost sample once, on the rank that reads its place


async def test_a_resumed_read_compares_the_whole_shard_not_what_it_keeps(packed_copy):
    reader = readers.webdataset(packed_copy)
    shard = sorted(packed_copy.glob("*.tar"))[2]
    full = await _read_all(reader)
    _cut(shard, 7)
    # Resumed past the shard's cut: the rest of it is seeked over, its end still counted.
    start = 16 + 7
    tail = await _read_all(reader, start=start)
    assert [s.key for s in tail[1:]] == [s.key for s in full[start + 1 :]]
    _check_short(tail, shard, 7, 8)
    # On another world size (``history``): the unread samples are read by dataset index.
    errors = 0
    for rank in range(2):
        rest = [s async for chunk in reader.shard(rank, 2).read(0, history=[(3, 4)]) for s in chunk]
        bad = [s for s in rest if s.error is not None]
        assert len(bad) <= 1 and all("sample 8 of 8 missing: shard ends after 7" in str(s.error) for s in bad)
        errors += len(bad)
    assert errors >= 1


async def test_the_loader_skips_the_error_and_counts_it(packed_copy):
    import headrace
    from headrace import ops

    reader = readers.webdataset(packed_copy, shuffle=True, shuffle_buffer=8)
    _cut(sorted(packed_copy.glob("*.tar"))[7], 4)
    loader = headrace.Loader(reader, batch_size=8, pipeline=ops.training(32), num_threads=2, seed=5, device="cpu",
                             on_error="skip", max_errors=4)
    async with loader:
        for _ in range(2):  # the run goes on: every epoch meets the cut shard, and skips its error
            keys = [k async for b in loader for k in b.sample_keys]
            assert len(keys) == len(set(keys)) == 71
    assert loader.stats().dropped == 8  # 4 samples lost each epoch, each counted against max_errors


async def test_a_remote_shard_cut_between_samples_with_its_index(tmp_path, packed_in_order):
    from storage_servers import serving

    root = tmp_path / "served"
    shutil.copytree(packed_in_order, root / "wds")
    shard = sorted((root / "wds").glob("*.tar"))[5]
    _cut(shard, 3)  # the index beside it still says 8 (a remote shard's size is not checked up front)
    with serving(root) as urls:
        reader = readers.webdataset(urls["http_direct"] + "/wds/shard-{000000..000009}.tar")
        assert len(reader) == 75
        samples = await _read_all(reader)
    url = urls["http_direct"] + "/wds/" + shard.name
    bad = [s for s in samples if s.error is not None]
    assert len(bad) == 5 and all(s.error.source == url for s in bad)
    assert all(f"sample {k} of 8 missing: shard ends after 3" in str(s.error) for k, s in enumerate(bad, 4))
    assert len(samples) == 75
