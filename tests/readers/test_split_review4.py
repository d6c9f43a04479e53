"""equal="pad" on a rank that gets no samples of its own (more ranks than samples, or than non-empty
shards), as torchrun users meet it: each rank builds its reader (or Loader) with rank= and world=.

The decision follows the libraries these readers stand in for. torch's DistributedSampler pads by
repeating the head of the global order, so a rank past the data set's size still gets samples: the
index-addressed readers (files, LMDB, sequences) and iterables do the same, and so does a mix of
them. A WebDataset rank reads only its own shards (or its own samples of every shard) and pads by
repeating its own stream, as WebDataset's ``with_epoch`` repeats a node's own shards; a rank with
none has nothing to repeat (WebDataset itself raises "No samples found" when such a node iterates).
That is refused when the reader is sharded, with a ConfigError naming ``equal`` and the numbers, on
every rank alike (each counts every rank's part), not on that rank alone when its epoch starts:
the other ranks would otherwise wait for it in their first collective.
"""

from __future__ import annotations

import collections

import pytest

from headrace import ConfigError, Loader, readers

from sample_data import make_folder, tar_bytes

N = 5  # samples in every data set below: fewer than the largest world sizes


@pytest.fixture(autouse=True)
def no_launcher_env(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("split4")
    make_folder(root / "img", classes=1, per_class=N)
    readers.pack(root / "img", root / "db", format="lmdb")
    # Shards by hand: 2 + 3 samples, and the same with two empty shards between (a filtered set).
    members = [(f"{k:04d}.cls", str(k).encode()) for k in range(N)]
    for name, parts in (("wds", [members[:2], members[2:]]), ("holes", [members[:2], [], members[2:], []])):
        (root / name).mkdir()
        for i, part in enumerate(parts):
            (root / name / f"s-{i}.tar").write_bytes(tar_bytes(part))
    return root


def _reader(kind, root):
    if kind == "files":
        return readers.files(root / "img", shuffle=True)
    if kind == "lmdb":
        pytest.importorskip("lmdb")
        return readers.lmdb(str(root / "db"), shuffle=True)
    if kind == "sequence":
        return readers.sequence([{"cls": str(k).encode()} for k in range(N)], shuffle=True)
    return readers.mix([readers.files(root / "img", shuffle=True), readers.sequence([{"cls": b"0"}] * 2)])


async def _indices(reader):
    out = []
    async for chunk in reader.read(0, seed=3):
        assert all(s.error is None for s in chunk)
        out += [(s.source, s.key) for s in chunk]
    return out


@pytest.mark.parametrize("kind", ["files", "lmdb", "sequence", "mix"])
@pytest.mark.parametrize("world", [N + 2, 3 * N])
async def test_pad_serves_a_rank_past_the_data_set_as_distributed_sampler_does(data, kind, world):
    whole = _reader(kind, data)
    parts = [whole.shard(rank, world, equal="pad") for rank in range(world)]
    got = [await _indices(part) for part in parts]
    assert {len(g) for g in got} == {len(parts[0])} and len(parts[0]) >= 1  # every rank the same, none empty
    assert len(collections.Counter(x for g in got for x in g)) == len(whole)  # every sample read


def _wds(root, name, **kw):
    return readers.webdataset(root / name, counts="scan", **kw)


# (shard folder, world, split): the ranks past the samples (by samples: shards of 2 and 3 samples on 7
# ranks, sample j of shard i to rank (i + j) % 7, so ranks 4 to 6 get none), or the
# ranks of the empty shards (by shards: 4 shards, 2 of them empty, 4 ranks).
EMPTY_RANKS = [("wds", 7, "auto", "3 of 7 ranks"), ("holes", 4, "shards", "2 of 4 ranks")]


@pytest.mark.parametrize(("name", "world", "split", "said"), EMPTY_RANKS)
def test_webdataset_pad_with_a_rank_of_no_samples_is_refused_when_sharded_on_every_rank(data, name, world, split, said):
    """Before: shard() and the Loader took it; only that rank's read raised, a ReadError (not a
    ConfigError) naming the first shard, while the other ranks went on."""
    whole = _wds(data, name, split=split)
    for rank in range(world):
        with pytest.raises(ConfigError, match=f"equal='pad'.*{said}.*{N} samples"):
            whole.shard(rank, world, equal="pad")
        with pytest.raises(ConfigError, match="equal='pad'"):
            Loader(_wds(data, name, split=split), batch_size=2, device="cpu", rank=rank, world=world)
        with pytest.raises(ConfigError, match="equal='pad'"):  # a mix shards its sources
            readers.mix([_wds(data, name, split=split), readers.files(data / "img")]).shard(rank, world, equal="pad")


@pytest.mark.parametrize(("name", "world", "split", "said"), EMPTY_RANKS)
@pytest.mark.parametrize("equal", ["drop", None])
async def test_webdataset_with_a_rank_of_no_samples_is_taken_without_pad(data, name, world, split, said, equal):
    """Only "pad" has nothing to repeat: "drop" cuts every rank to nothing, None leaves the rank empty."""
    whole = _wds(data, name, split=split)
    parts = [whole.shard(rank, world, equal=equal) for rank in range(world)]
    got = [[s.key async for chunk in part.read(0) for s in chunk] for part in parts]
    assert [len(g) for g in got] == [len(part) for part in parts]
    assert 0 in [len(g) for g in got]
    assert len(set(k for g in got for k in g)) == (0 if equal == "drop" else N)
