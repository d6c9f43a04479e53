"""LMDB reader and ``pack --format lmdb``, review 4: databases with named sub-databases, file names
that are not UTF-8, records that take more pages than the map was sized for, keys past LMDB's limit.

Real LMDBs throughout (py-lmdb writes them as other programs would) and real JPEG trees.
"""

from __future__ import annotations

import io
import os
import shutil

import pytest
from PIL import Image

from headrace import ConfigError, ReadError, readers
from headrace.readers import decode_record
from headrace.readers._pack import PackResult, _write_lmdb

lmdb_lib = pytest.importorskip("lmdb")


async def _read_all(reader, epoch=0):
    return [s async for chunk in reader.read(epoch) for s in chunk]


def _jpeg(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8 + seed, 8), (seed * 40 % 256, 10, 200)).save(buf, "JPEG")
    return buf.getvalue()


def _with_subdatabase(path):
    """Images in the main database, and a named one beside them (as a program keeping labels or an
    index apart writes it): its name is a key of the main database, its value LMDB's own record."""
    env = lmdb_lib.open(str(path), max_dbs=4, map_size=1 << 24)
    labels = env.open_db(b"labels")
    env.open_db(b"unused")  # an empty one too
    with env.begin(write=True) as txn:
        txn.put(b"img-0", _jpeg(0))
        txn.put(b"img-1", _jpeg(1))
        txn.put(b"img-0", b"3", db=labels)
        txn.put(b"vec", bytes(48))  # a 48-byte value that is data, not a database
    env.close()
    return path


async def test_the_names_of_named_sub_databases_are_not_samples(tmp_path, leaks):
    reader = readers.lmdb(_with_subdatabase(tmp_path / "db"))
    samples = await _read_all(reader)
    # Were 5: b"labels" and b"unused" read as samples of 48 bytes of LMDB's own bookkeeping.
    assert [s.key for s in samples] == ["img-0", "img-1", "vec"]
    assert [list(s.fields) for s in samples] == [["jpg"], ["jpg"], ["bin"]]
    assert samples[2].fields["bin"] == bytes(48) and all(s.error is None for s in samples)


async def test_a_key_naming_a_sub_database_is_an_error_sample_and_the_rest_are_read(tmp_path, leaks):
    path = _with_subdatabase(tmp_path / "db")
    reader = readers.lmdb(path, keys=["img-0", "labels", "img-1"])
    samples = await _read_all(reader)
    assert [s.key for s in samples] == ["img-0", "labels", "img-1"]
    assert samples[0].error is None and samples[2].error is None
    error = samples[1].error
    assert isinstance(error, ReadError) and error.key == "labels" and error.source == os.path.realpath(path)
    assert "sub-database" in error.message and samples[1].fields == {}


def _tree_with_a_name_that_is_not_utf8(root) -> str:
    root = os.fsencode(root)
    for name in (b"c0/a.jpg", b"c0/\xff\xfeb.jpg", b"c1/c.jpg"):
        os.makedirs(os.path.dirname(os.path.join(root, name)), exist_ok=True)
        with open(os.path.join(root, name), "wb") as f:
            f.write(_jpeg(len(name)))
    return os.fsdecode(root)


async def test_pack_lmdb_stores_a_file_name_that_is_not_utf8_and_reads_it_back(tmp_path, leaks):
    src = _tree_with_a_name_that_is_not_utf8(tmp_path / "tree")
    # Was a UnicodeEncodeError out of pack (the tar format already took such names).
    result = readers.pack(src, tmp_path / "db", format="lmdb")
    assert result.samples == 3
    reader = readers.lmdb(tmp_path / "db")
    assert reader.keys == [b"c0/a", b"c0/\xff\xfeb", b"c1/c"]
    samples = await _read_all(reader)
    assert all(s.error is None for s in samples) and [s.fields["cls"] for s in samples] == [b"0", b"0", b"1"]
    assert samples[1].fields["jpg"] == open(os.fsencode(tmp_path / "tree") + b"/c0/\xff\xfeb.jpg", "rb").read()
    # The same key as a file name's text (os.fsdecode's surrogates) names the same entry.
    again = await _read_all(readers.lmdb(tmp_path / "db", keys=[os.fsdecode(b"c0/\xff\xfeb")]))
    assert again[0].error is None and again[0].fields["jpg"] == samples[1].fields["jpg"]


def test_pack_lmdb_grows_the_map_when_the_records_outgrow_it(tmp_path):
    """The map is sized from the files' bytes (twice them and 64 MiB); LMDB can take more than
    that (a 1 KB value takes a 4 KiB page to itself in a half-full leaf, millions of small files
    outrun the 64 MiB). Here the estimate is short outright: 80 MiB of records into 64 MiB."""
    blob = os.urandom(1 << 20)
    items = ((f"c0/{i:04d}", "bin", f"/src/c0/{i:04d}.bin", 0, blob) for i in range(80))
    result = PackResult("lmdb", str(tmp_path), 0, 0, classes=["c0"])
    _write_lmdb(items, 0, tmp_path, result)  # was lmdb.MapFullError, out of pack as it is
    assert result.samples == 80
    env = lmdb_lib.open(str(tmp_path), readonly=True, lock=False)
    with env.begin() as txn:
        assert decode_record(txn.get(b"c0/0079"))["bin"] == blob and txn.get(b"__keys__") is not None
    env.close()


def test_pack_lmdb_refuses_a_key_past_lmdbs_limit_by_its_file(tmp_path):
    deep = tmp_path / "tree" / "c0" / ("a" * 200) / ("b" * 200) / ("c" * 150)
    deep.mkdir(parents=True)
    (deep / "x.jpg").write_bytes(_jpeg(1))
    with pytest.raises(ConfigError) as caught:  # was lmdb.BadValsizeError, naming nothing
        readers.pack(tmp_path / "tree", tmp_path / "db", format="lmdb")
    assert "x.jpg" in caught.value.message and "511" in caught.value.message
    assert not (tmp_path / "db").exists()
    shutil.rmtree(tmp_path / "tree")
