from __future__ import annotations

import asyncio
import json
import pickle

import pytest

from headrace import ConfigError, ReadError, readers
from headrace.readers import decode_record, encode_record

lmdb_lib = pytest.importorskip("lmdb")


async def _read_all(reader, epoch=0, start=0, seed=0):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]


@pytest.fixture(scope="module")
def packed(tmp_path_factory, image_folder):
    dest = tmp_path_factory.mktemp("lmdb") / "db"
    readers.pack(image_folder, dest, format="lmdb", shuffle=True, seed=3)
    return dest


def _raw_lmdb(path, items):
    env = lmdb_lib.open(str(path), map_size=1 << 24, subdir=True, lock=False)
    with env.begin(write=True) as txn:
        for k, v in items:
            txn.put(k, v)
    env.close()
    return path


async def test_reads_what_pack_wrote_with_labels(packed, image_folder, leaks):
    reader = readers.lmdb(packed)
    samples = await _read_all(reader)
    assert len(reader) == len(samples) == 75 and reader.classes == ("c0", "c1", "c2")
    for s in samples:
        assert s.fields["jpg"] == (image_folder / f"{s.key}.jpg").read_bytes()
        assert int(s.fields["cls"]) == int(s.key[1])
        assert s.source == str(packed.resolve()) and s.error is None
    assert [s.position for s in samples] == list(range(75))
    await leaks.check()  # the environment (data.mdb) is closed again


async def test_any_lmdb_with_a_user_decode_function(tmp_path):
    path = _raw_lmdb(tmp_path / "any", [(f"k{i:03d}".encode(), pickle.dumps((b"\xff\xd8\xff" + bytes([i]), i % 4)))
                                        for i in range(20)])

    def decode(key: bytes, value: bytes) -> dict[str, bytes]:
        image, label = pickle.loads(value)
        return {"jpg": image, "cls": str(label).encode()}

    samples = await _read_all(readers.lmdb(path, decode=decode))
    assert [s.key for s in samples] == [f"k{i:03d}" for i in range(20)]  # the database's sorted order
    assert [int(s.fields["cls"]) for s in samples] == [i % 4 for i in range(20)]


async def test_default_decode_takes_raw_images_and_skips_metadata_entries(tmp_path):
    path = _raw_lmdb(tmp_path / "raw", [(b"a", b"\xff\xd8\xff\xe0jpeg"), (b"b", b"\x89PNG\r\n"), (b"c", b"??"),
                                        (b"__meta__", b"{}")])
    samples = await _read_all(readers.lmdb(path))
    assert [(s.key, list(s.fields)) for s in samples] == [("a", ["jpg"]), ("b", ["png"]), ("c", ["bin"])]


def test_record_format_round_trips_and_rejects_short_values():
    fields = {"jpg": b"\xff\xd8" * 100, "cls": b"7", "json": b"{}"}
    value = encode_record(fields)
    assert value[:4] == b"HRS1" and decode_record(value) == fields
    with pytest.raises(ValueError):
        decode_record(value[:-5])
    with pytest.raises(ValueError):
        decode_record(b"nope")


async def test_shuffle_shard_and_resume(packed):
    reader = readers.lmdb(packed, shuffle=True, chunk_size=5)
    e0 = [s.key for s in await _read_all(reader, epoch=0)]
    e1 = [s.key for s in await _read_all(reader, epoch=1)]
    assert e0 != e1 and sorted(e0) == sorted(e1) and len(set(e0)) == 75
    full = await _read_all(reader, epoch=2)
    for start in (1, 33, 74, 75):
        tail = await _read_all(reader, epoch=2, start=start)
        assert [(s.key, s.position, s.fields) for s in tail] == [(s.key, s.position, s.fields) for s in full[start:]]
    parts = [[s.index for s in await _read_all(reader.shard(r, 4), epoch=3)] for r in range(4)]
    assert sorted(i for p in parts for i in p) == list(range(75))
    assert [len(reader.shard(r, 4)) for r in range(4)] == list(map(len, parts))


async def test_ranks_read_one_lmdb_at_the_same_time(packed, leaks):
    base = readers.lmdb(packed, shuffle=True, chunk_size=3)
    parts = await asyncio.gather(*(_read_all(base.shard(r, 3)) for r in range(3)))
    assert sum(map(len, parts)) == 75
    await leaks.check()


async def test_missing_key_and_undecodable_value_are_error_samples_naming_the_key(tmp_path):
    path = _raw_lmdb(tmp_path / "db", [(b"good", encode_record({"jpg": b"x", "cls": b"1"})),
                                       (b"cut", encode_record({"jpg": b"x" * 50})[:-10])])
    samples = await _read_all(readers.lmdb(path, keys=["good", "gone", "cut"]))
    assert [s.error is None for s in samples] == [True, False, False]
    for s in samples[1:]:
        assert isinstance(s.error, ReadError) and s.error.key == s.key and s.error.source == str(path.resolve())
    assert "not found" in str(samples[1].error) and "cut short" in str(samples[2].error)


def test_missing_or_invalid_lmdb_is_a_read_error_naming_the_path(tmp_path):
    with pytest.raises(ReadError) as info:
        readers.lmdb(tmp_path / "nope")
    assert info.value.source == str(tmp_path / "nope")
    (tmp_path / "junk").write_bytes(b"x" * 8192)
    with pytest.raises(ReadError):
        readers.lmdb(tmp_path / "junk")
    with pytest.raises(ReadError, match="no samples"):
        readers.lmdb(_raw_lmdb(tmp_path / "empty", [(b"__meta__", json.dumps({}).encode())]))
    with pytest.raises(ConfigError):
        readers.lmdb(tmp_path / "nope", decode="json")


async def test_loader_trains_on_a_packed_lmdb(packed, leaks):
    import headrace
    from headrace import ops

    loader = headrace.Loader(readers.lmdb(packed, shuffle=True), batch_size=16, pipeline=ops.training(32),
                             num_threads=2, device="cpu")
    batches = [b async for b in loader]
    assert sum(b.size for b in batches) == 75
    for b in batches:
        assert b["label"].tolist() == [int(k[1]) for k in b.sample_keys]
    await loader.aclose()
    await leaks.check()


def test_a_record_cut_in_its_header_is_a_value_error():
    value = encode_record({"jpg": b"\xff\xd8 image", "cls": b"3"})
    for cut in range(4, len(value)):
        try:
            decode_record(value[:cut])
        except ValueError:
            continue
        raise AssertionError(f"a record cut to {cut} bytes decoded")
    assert decode_record(value) == {"jpg": b"\xff\xd8 image", "cls": b"3"}
