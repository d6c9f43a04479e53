"""Counts and seeds given as NumPy integers (``np.int64(8)``: from a config loaded into NumPy, an
``np.arange``, an array's shape) are taken where a Python int is, and kept as Python ints (they reach
state dicts, JSON and the stages), as torch and DALI take them. A bool (True would be 1) and a float
(even 8.0) are still a ConfigError naming the argument.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from headrace import ConfigError, Loader, ops, readers
from headrace._errors import require_int
from headrace.readers._base import consumed_prefix
from sample_data import recordio_record, write_recordio

NOT_INTS = [True, np.bool_(True), 8.0, np.float64(8.0), np.float32(8.0), "8", None]


async def _samples(reader, epoch=0, start=0, seed=0):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]


def _keys(samples):
    return [s.key for s in samples]


def _all_python_ints(value) -> bool:
    """No NumPy scalar anywhere in a (nested) state dict: json.dumps would fail on one."""
    json.dumps(value)
    return True


# -- the shared check -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [np.int64(8), np.int32(8), np.uint8(8), np.intp(8), 8])
def test_require_int_takes_numpy_integers_and_gives_a_python_int(value):
    got = require_int("batch_size", value)
    assert got == 8 and type(got) is int


@pytest.mark.parametrize("value", NOT_INTS)
def test_require_int_refuses_bools_and_floats_naming_the_argument(value):
    with pytest.raises(ConfigError, match=r"^batch_size must be a positive int, got "):
        require_int("batch_size", value)


def test_require_int_bounds_apply_to_numpy_integers_too():
    with pytest.raises(ConfigError, match=r"a non-negative int, got np.int64\(-1\)"):
        require_int("seed", np.int64(-1), 0)
    assert require_int("offset", np.int64(-1), None) == -1
    with pytest.raises(ConfigError, match=r"rank must be an int in \[0, 2\), got np.int64\(2\)"):
        require_int("rank", np.int64(2), 0, below=2)


def test_history_spans_may_hold_numpy_integers():
    got = consumed_prefix(100, [(np.int64(4), np.int64(5)), (2, np.int32(3))])
    assert got == 26 and type(got) is int


# -- the Loader -----------------------------------------------------------------------------------


def _pipe():
    return ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(32), ops.Normalize()])


async def test_a_loader_of_numpy_integers_yields_the_batches_of_python_ints(image_folder, leaks):
    counts = dict(batch_size=8, seed=3, num_threads=2, prefetch=2, max_bytes=64 << 20, lanes=2)
    batches = {}
    for kind in (int, np.int64):
        loader = Loader(readers.files(image_folder, shuffle=True), pipeline=_pipe(), device="cpu",
                        **{name: kind(value) for name, value in counts.items()})
        assert all(type(getattr(loader, name)) is int for name in ("batch_size", "seed", "lanes", "num_threads"))
        async with loader:
            batches[kind] = [b async for b in loader]
            state = loader.state_dict()
        assert len(loader) == 10 and _all_python_ints(state)
        assert state["batch_size"] == 8 and type(state["batch_size"]) is int and type(state["seed"]) is int
    got, plain = batches[np.int64], batches[int]
    assert [b.size for b in got] == [8] * 9 + [3]
    assert [b["image"].shape[0] for b in got] == [8] * 9 + [3]
    assert [b.sample_keys for b in got] == [b.sample_keys for b in plain]  # the same seed: the same epoch
    await leaks.check()


async def test_a_state_saved_with_numpy_arguments_resumes_a_loader_of_python_ints(image_folder):
    def make(kind):
        return Loader(readers.files(image_folder, shuffle=True), pipeline=_pipe(), device="cpu",
                      batch_size=kind(8), seed=kind(5), num_threads=1)

    async with make(np.int64) as first:
        it = aiter(first)
        for _ in range(3):
            await anext(it)
        state = json.loads(json.dumps(first.state_dict()))  # a checkpoint written as JSON
        rest = [b.sample_keys async for b in it]
    async with make(int) as second:
        second.load_state_dict(state)
        assert [b.sample_keys async for b in second] == rest


@pytest.mark.parametrize("name", ["batch_size", "seed", "num_threads", "prefetch", "max_bytes", "lanes"])
@pytest.mark.parametrize("value", [True, np.bool_(True), 8.0, np.float64(8.0)])
def test_a_loader_refuses_a_bool_or_a_float_naming_the_argument(image_folder, name, value):
    kw = dict(batch_size=8, device="cpu") | {name: value}
    with pytest.raises(ConfigError, match=rf"^{name} must be a (positive|non-negative) int, got "):
        Loader(readers.files(image_folder), **kw)


async def test_a_loader_takes_a_reader_sharded_by_numpy_integers(image_folder):
    part = readers.files(image_folder, shuffle=True).shard(np.int64(1), np.int64(2), equal="pad")
    assert (part.rank, part.world) == (1, 2) and type(part.rank) is int and type(part.world) is int
    async with Loader(part, batch_size=np.int64(8), pipeline=_pipe(), device="cpu", num_threads=1) as loader:
        batches = [b async for b in loader]
        assert (loader.rank, loader.world) == (1, 2)
    assert [b.size for b in batches] == [8] * 4 + [6]  # 38 of the 75 samples (padded to 76 over 2 ranks)


# -- readers over indexed data --------------------------------------------------------------------


@pytest.fixture(scope="module")
def rec(tmp_path_factory):
    path = tmp_path_factory.mktemp("np-rec") / "a.rec"
    write_recordio(path, [recordio_record(i % 3, b"\xff\xd8\xff image %d" % i) for i in range(20)])
    return path


@pytest.fixture(scope="module")
def lmdb_db(tmp_path_factory, image_folder):
    pytest.importorskip("lmdb")
    dest = tmp_path_factory.mktemp("np-lmdb") / "db"
    readers.pack(image_folder, dest, format="lmdb")
    return dest


def _indexed(kind, image_folder, rec, request):
    if kind == "files":
        return lambda **kw: readers.files(image_folder, **kw)
    if kind == "recordio":
        return lambda **kw: readers.recordio(rec, **kw)
    db = request.getfixturevalue("lmdb_db")
    return lambda **kw: readers.lmdb(db, **kw)


@pytest.mark.parametrize("kind", ["files", "recordio", "lmdb"])
async def test_indexed_readers_take_numpy_chunk_size_io_threads_seed_and_shard(kind, image_folder, rec, request):
    make = _indexed(kind, image_folder, rec, request)
    plain = make(shuffle=True, seed=7, chunk_size=5, io_threads=2).shard(1, 3, equal="drop")
    given = make(shuffle=True, seed=np.int64(7), chunk_size=np.int64(5), io_threads=np.int32(2))
    given = given.shard(np.int64(1), np.uint8(3), equal="drop")
    assert all(type(v) is int for v in (given.seed, given.chunk_size, given.io_threads, given.rank, given.world))
    assert _all_python_ints(given.state_dict()) and given.state_dict() == plain.state_dict()
    samples = await _samples(given, epoch=1, start=np.int64(2))
    assert _keys(samples) == _keys(await _samples(plain, epoch=1, start=2))
    assert len(samples) == len(given) - 2 > 0


@pytest.mark.parametrize("kind", ["files", "recordio", "lmdb"])
@pytest.mark.parametrize("name", ["chunk_size", "io_threads"])
def test_indexed_readers_refuse_a_bool_or_a_float_count(kind, name, image_folder, rec, request):
    make = _indexed(kind, image_folder, rec, request)
    for value in (True, np.bool_(True), 5.0, np.float64(5.0)):
        with pytest.raises(ConfigError, match=rf"{name} must be a positive int, got "):
            make(**{name: value})


@pytest.mark.parametrize(("rank", "world", "wrong"), [(0, True, "world"), (np.bool_(False), 2, "rank"),
                                                      (0, 2.0, "world"), (np.float64(1.0), 2, "rank"),
                                                      (np.int64(2), 2, "rank"), (0, np.int64(0), "world")])
def test_shard_refuses_bools_floats_and_ranks_out_of_range(image_folder, rank, world, wrong):
    with pytest.raises(ConfigError, match=rf"^{wrong} must be "):
        readers.files(image_folder).shard(rank, world)


def test_files_takes_numpy_requests_and_buffer_bytes(image_folder):
    reader = readers.files(image_folder, requests=np.int64(16), buffer_bytes=np.int64(1 << 20))
    assert (reader.requests, reader.buffer_bytes) == (16, 1 << 20)
    assert type(reader.requests) is int and type(reader.buffer_bytes) is int
    with pytest.raises(ConfigError, match="files: requests must be a positive int"):
        readers.files(image_folder, requests=np.bool_(True))


# -- WebDataset -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shards(tmp_path_factory, image_folder):
    """image_folder (75 JPEGs) in 10 shards of at most 8 samples; and the same without the index."""
    dest = tmp_path_factory.mktemp("np-wds") / "wds"
    readers.pack(image_folder, dest, format="webdataset", shard_count=8, shuffle=True, seed=1)
    bare = tmp_path_factory.mktemp("np-wds-bare")
    for path in sorted(dest.glob("*.tar")):
        (bare / path.name).write_bytes(path.read_bytes())
    return dest, bare


async def test_webdataset_takes_numpy_integers(shards):
    dest, _ = shards
    kw = dict(shuffle=True, seed=4, shuffle_buffer=16, read_ahead=1, chunk_size=6, buffer_bytes=1 << 20)
    plain = readers.webdataset(dest, **kw).shard(0, 2, equal="pad")
    given = readers.webdataset(dest, **{k: np.int64(v) if type(v) is int else v for k, v in kw.items()})
    given = given.shard(np.int64(0), np.int64(2), equal="pad")
    assert all(type(v) is int for v in (given.seed, given.shuffle_buffer, given.rank, given.world))
    assert _all_python_ints(given.state_dict()) and given.state_dict() == plain.state_dict()
    assert _keys(await _samples(given, start=np.int64(5))) == _keys(await _samples(plain, start=5))


async def test_webdataset_takes_a_numpy_total_count_and_refuses_a_bool_or_float_one(shards):
    _, bare = shards
    reader = readers.webdataset(bare, counts=np.int64(75))  # was a TypeError: 'numpy.int64' is not iterable
    assert len(reader) == 75 and type(reader.state_dict()["total"]) is int
    assert len(await _samples(reader)) == 75
    for wrong in (True, np.bool_(True), 75.0, np.float64(75.0), -1):
        with pytest.raises(ConfigError, match="webdataset: counts must be a non-negative int"):
            readers.webdataset(bare, counts=wrong)


@pytest.mark.parametrize("name", ["shuffle_buffer", "read_ahead", "chunk_size", "buffer_bytes"])
def test_webdataset_refuses_a_bool_or_float_count(shards, name):
    for value in (True, np.bool_(True), 65536.0, np.float64(65536.0)):
        with pytest.raises(ConfigError, match=rf"webdataset: {name} must be "):
            readers.webdataset(shards[0], **{name: value})


# -- mix and video --------------------------------------------------------------------------------


def _seq(name, n):
    return readers.sequence([{"__key__": f"{name}{i}", "bin": name.encode()} for i in range(n)], shuffle=True)


async def test_mix_takes_numpy_length_chunk_size_seed_start_and_shard():
    plain = readers.mix([_seq("a", 10), _seq("b", 30)], [1, 1], length=20, chunk_size=4, seed=2).shard(1, 2)
    given = readers.mix([_seq("a", 10), _seq("b", 30)], np.array([1.0, 1.0]), length=np.int64(20),
                        chunk_size=np.int64(4), seed=np.int64(2)).shard(np.int64(1), np.int64(2))
    assert all(type(v) is int for v in (given.length, given.chunk_size, given.seed, given.rank, given.world))
    assert _all_python_ints(given.state_dict()) and given.state_dict() == plain.state_dict()
    assert _keys(await _samples(given, start=np.int64(3))) == _keys(await _samples(plain, start=3))
    with pytest.raises(ConfigError, match="mix: length must be a positive int"):
        readers.mix([_seq("a", 10)], length=np.bool_(True))


async def test_video_takes_numpy_clip_arguments(tmp_path):
    pytest.importorskip("av")
    from sample_data import make_video

    make_video(tmp_path / "a" / "v.mp4", 24)
    kw = dict(sequence_length=4, stride=2, step=5, clips_per_video=None, seed=1, chunk_size=3)
    plain = readers.video(tmp_path, **kw)
    given = readers.video(tmp_path, **{k: np.int64(v) if type(v) is int else v for k, v in kw.items()})
    assert all(type(v) is int for v in (given.sequence_length, given.stride, given.span, given.step))
    assert _keys(await _samples(given)) == _keys(await _samples(plain)) == ["a/v.mp4@0", "a/v.mp4@5", "a/v.mp4@10",
                                                                               "a/v.mp4@15"]
    with pytest.raises(ConfigError, match="video: sequence_length must be a positive int"):
        readers.video(tmp_path, sequence_length=4.0)
