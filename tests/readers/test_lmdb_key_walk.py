"""An LMDB's keys listed by walking its B+tree in the mapped data file (``MappedTree.keys``,
``hr_lmdb_keys`` in ``_native/read_files.c``) for a reader given no key list: the same keys, in the
same order, as py-lmdb's cursor lists, in databases of every shape LMDB writes; named databases'
names left out (by their node's flag, where the cursor tells them by their record's shape); and the
cursor's list wherever the walk cannot read the tree exactly, however the file is damaged."""

from __future__ import annotations

import importlib
import random
import shutil
import struct

import pytest
from test_lmdb_tree import _shapes, _write, damage_pages

from headrace import readers
from headrace.readers._lmdb_tree import MappedTree
from headrace.readers._read_files import lmdb_key_lister

lmdb_lib = pytest.importorskip("lmdb")
pytestmark = pytest.mark.skipif(lmdb_key_lister() is None, reason="the C helper does not build here")
lmdb_reader = importlib.import_module("headrace.readers.lmdb")  # the module, not the function of that name


def _both(path) -> tuple[list[bytes] | None, list[bytes] | Exception]:
    """The walk's keys (None where it leaves them to the cursor) and the cursor's (or its error),
    in one transaction."""
    env = lmdb_lib.open(str(path), readonly=True, lock=False, max_dbs=4)
    try:
        with env.begin(buffers=True) as txn:
            walked = lmdb_reader._walked_keys(txn, str(path), env.stat()["psize"])
            try:
                listed = lmdb_reader._cursor_keys(txn, env.info()["last_pgno"])
            except lmdb_lib.Error as exc:
                listed = exc
    finally:
        env.close()
    return walked, listed


def test_the_walk_lists_what_the_cursor_lists(tmp_path):
    items = _shapes(random.Random(4))  # three levels of pages, values in nodes and on overflow pages
    path = tmp_path / "db"
    _write(path, items)
    walked, listed = _both(path)
    assert walked is not None and walked == listed == sorted(items)


def test_pages_reused_after_deletes(tmp_path):
    rng = random.Random(5)
    items = _shapes(rng)
    path = tmp_path / "db"
    _write(path, items)
    env = lmdb_lib.open(str(path), map_size=1 << 30)
    with env.begin(write=True) as txn:
        for key in rng.sample(list(items), 20_000):
            txn.delete(key)
            del items[key]
    env.close()
    walked, listed = _both(path)
    assert walked is not None and walked == listed == sorted(items)


def test_named_databases_names_are_left_out(tmp_path):
    path = tmp_path / "db"
    _write(path, {b"a": b"1", b"m": b"x" * 48, b"z": b"2"})  # a value of a record's size is data
    env = lmdb_lib.open(str(path), map_size=1 << 24, max_dbs=3)
    for name in (b"named", b"zz-last"):
        with env.begin(write=True, db=env.open_db(name)) as txn:
            txn.put(b"inside", b"x")
    env.close()
    walked, listed = _both(path)
    assert walked == listed == [b"a", b"m", b"z"]


def test_an_empty_database_has_no_keys(tmp_path):
    path = tmp_path / "db"
    _write(path, {})
    assert _both(path) == ([], [])


def test_another_transaction_or_a_duplicate_sorted_database_leaves_it_to_the_cursor(tmp_path):
    path = tmp_path / "db"
    _write(path, {f"{i:04d}".encode(): b"v" for i in range(500)})
    env = lmdb_lib.open(str(path), readonly=True, lock=False)
    tree = MappedTree.open(str(path), env.stat()["psize"])
    with env.begin() as txn:
        assert tree.keys(txn.id()) is not None
        assert tree.keys(txn.id() + 1) is None  # no meta page of that transaction
    tree.close()
    env.close()
    data = bytearray((path / "data.mdb").read_bytes())
    for meta in (0, 4096):  # the main database's flags in both meta pages: sorted duplicates
        flags_at = meta + 16 + 72 + 4
        struct.pack_into("<H", data, flags_at, struct.unpack_from("<H", data, flags_at)[0] | 0x04)
    (path / "data.mdb").write_bytes(bytes(data))
    walked, _ = _both(path)
    assert walked is None


@pytest.mark.parametrize("seed", range(8))
def test_a_damaged_file_never_gives_keys_the_cursor_would_not(tmp_path, seed):
    rng = random.Random(seed)
    items = {f"{i:05d}".encode(): rng.randbytes(rng.choice([10, 500, 3000])) for i in range(3000)}
    path = tmp_path / "db"
    _write(path, items)
    damage_pages(path, rng)
    walked, listed = _both(path)
    if walked is not None:
        assert walked == sorted(walked) and len(set(walked)) == len(walked)
        if not isinstance(listed, Exception):
            assert walked == listed


def test_the_reader_lists_the_same_with_the_walk_and_without(tmp_path, monkeypatch):
    items = {f"img{i:05d}".encode(): b"v%d" % i for i in range(2000)}
    items.update({b"__meta__": b"{}", b"__other__": b"x"})
    path = tmp_path / "db"
    _write(path, items)
    walked = readers.lmdb(path)
    calls = []
    monkeypatch.setattr(lmdb_reader, "_walked_keys", lambda *args: calls.append(args))  # the cursor lists
    listed = readers.lmdb(path)
    assert len(calls) == 1
    assert walked.keys == listed.keys == [k for k in sorted(items) if not k.startswith(b"__")]


def test_a_copy_of_the_file_is_walked_as_the_folder_is(tmp_path):
    items = {f"{i:04d}".encode(): b"v" for i in range(100)}
    path = tmp_path / "db"
    _write(path, items)
    single = tmp_path / "single.mdb"
    shutil.copy(path / "data.mdb", single)
    env = lmdb_lib.open(str(single), readonly=True, lock=False, subdir=False)
    with env.begin() as txn:
        assert lmdb_reader._walked_keys(txn, str(single), env.stat()["psize"]) == sorted(items)
    env.close()


def test_keys_out_of_order_or_a_wrong_count_leave_it_to_the_cursor(tmp_path):
    items = {f"{i:05d}".encode(): b"v" for i in range(3000)}
    path = tmp_path / "db"
    _write(path, items)
    good = (path / "data.mdb").read_bytes()
    data = bytearray(good)
    at = data.index(b"01500")  # the key in its leaf node (the values are all b"v")
    data[at : at + 5] = b"01499"  # a key twice: the walk stops; the cursor lists what the pages say
    (path / "data.mdb").write_bytes(bytes(data))
    walked, listed = _both(path)
    assert walked is None and listed.count(b"01499") == 2
    data = bytearray(good)
    for meta in (0, 4096):  # the main database's entry count, one more than its leaves hold
        entries_at = meta + 16 + 72 + 32
        struct.pack_into("<Q", data, entries_at, struct.unpack_from("<Q", data, entries_at)[0] + 1)
    (path / "data.mdb").write_bytes(bytes(data))
    walked, listed = _both(path)
    assert walked is None and listed == sorted(items)
