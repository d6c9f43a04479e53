"""Review of ``readers.caffe`` and ``headrace inspect`` on Caffe LMDBs: tries that held (no bug
found), kept as tests. Labels 0, none and negative; a 70 MB image; a ``__keys__`` entry and
non-UTF-8 keys; an empty LMDB; an LMDB whose first value is a headrace record and later ones Datums
(the first value decides: read as ``lmdb``, the Datums as ``bin``, as documented); ``--format caffe``
on an LMDB of headrace records (each sample a ReadError saying it is not a Datum, no crash)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sample_data import jpeg_bytes

from headrace import ReadError, readers
from headrace._inspect import inspect, open_reader
from headrace.readers import encode_record

lmdb = pytest.importorskip("lmdb")
pytest.importorskip("google.protobuf")


def _datum(**fields) -> bytes:
    from headrace.readers.caffe import datum_class

    return datum_class()(**fields).SerializeToString()


def _db(path, items, map_size=64 << 20) -> str:
    env = lmdb.open(str(path), map_size=map_size)
    with env.begin(write=True) as txn:
        for key, value in items:
            txn.put(key, value)
    env.close()
    return str(path)


@pytest.fixture(scope="module")
def jpg() -> bytes:
    return jpeg_bytes(np.random.default_rng(0), 20, 24)


async def _samples(reader) -> dict:
    return {s.key: s.fields async for chunk in reader.read(0) for s in chunk}


async def test_labels_zero_none_and_negative(tmp_path, jpg):
    path = _db(tmp_path / "db", [(b"a", _datum(data=jpg, encoded=True, label=0)), (b"b", _datum(data=jpg, encoded=True)),
                                 (b"c", _datum(data=jpg, encoded=True, label=-3))])
    got = await _samples(readers.caffe(path))
    assert got["a"] == {"jpg": jpg, "cls": b"0"}
    assert got["b"] == {"jpg": jpg}
    assert got["c"]["cls"] == b"-3"


async def test_a_70_mb_image(tmp_path, jpg):
    big = jpg + bytes(70 << 20)
    path = _db(tmp_path / "db", [(b"a", _datum(data=big, encoded=True, label=1))], map_size=1 << 28)
    got = await _samples(readers.caffe(path))
    assert len(got["a"]["jpg"]) == len(big)


async def test_a_keys_entry_and_non_utf8_keys(tmp_path, jpg):
    path = _db(tmp_path / "db", [(b"__keys__", json.dumps(["b", "a"]).encode()),
                                 (b"a", _datum(data=jpg, encoded=True, label=1)),
                                 (b"b", _datum(data=jpg, encoded=True, label=2))])
    assert readers.caffe(path).keys == [b"b", b"a"]
    odd = _db(tmp_path / "odd", [(b"\xff\xfe", _datum(data=jpg, encoded=True, label=1)), (b"\x80", _datum(data=jpg, encoded=True))])
    reader = readers.caffe(odd, keys=[b"\x80", b"\xff\xfe"])
    got = await _samples(reader)
    assert sorted(got) == ["\\x80", "\\xff\\xfe"] and got["\\xff\\xfe"]["cls"] == b"1"
    assert open_reader(odd)[1] == "caffe"


def test_an_empty_lmdb_is_a_read_error(tmp_path):
    path = _db(tmp_path / "empty", [])
    for fmt in (None, "caffe"):
        with pytest.raises(ReadError, match="holds no samples"):
            open_reader(path, fmt)


def test_a_record_first_then_datums_is_an_lmdb(tmp_path, jpg):
    path = _db(tmp_path / "db", [(b"a0", encode_record({"jpg": jpg, "cls": b"1"})),
                                 (b"a1", _datum(data=jpg, encoded=True, label=1))])
    assert open_reader(path)[1] == "lmdb"
    report = inspect(path)
    assert report["format"] == "lmdb" and report["bad"] == []


def test_format_caffe_on_an_lmdb_of_records_names_each_sample(tmp_path, jpg):
    path = _db(tmp_path / "db", [(f"a{i}".encode(), encode_record({"jpg": jpg, "cls": b"1"})) for i in range(3)])
    report = inspect(path, format="caffe")
    assert report["format"] == "caffe" and report["samples"] == 3
    assert len(report["bad"]) == 3
    assert all("not a caffe.Datum" in str(bad) for bad in report["bad"])
