"""The LMDB reader's own lookups (``readers/_lmdb_tree.py``, ``_native/lmdb_tree.h``): a walk of the
B+tree in the mapped data file must find what py-lmdb's ``get`` finds, byte for byte, in databases
of every shape LMDB writes (values in their nodes and on overflow pages, trees three levels deep,
keys that are prefixes of others, pages reused after deletes, a named database's record), leave
every key it cannot read exactly to py-lmdb (-2), and never return bytes py-lmdb would not, however
the file is damaged. The reader gives the same samples and errors with the walk and without it.

On a damaged file the walk may read a key that py-lmdb refuses: after one failure py-lmdb's
transaction refuses every later key (MDB_BAD_TXN), and its ``get`` moves a cursor kept from the
last key through sibling pages, where a fresh search from the root (LMDB's own ``mdb_get``,
checked by hand against liblmdb 0.9 on such a file) reaches an intact leaf."""

from __future__ import annotations

import random
import shutil
import struct

import numpy as np
import pytest

from headrace import readers
from headrace.readers._lmdb_tree import KeyTable, MappedTree
from headrace.readers._read_files import lmdb_finder

lmdb_lib = pytest.importorskip("lmdb")
pytestmark = pytest.mark.skipif(lmdb_finder() is None, reason="the C helper does not build here")


def _write(path, items: dict[bytes, bytes], *, txn_size: int = 5000, writemap: bool = False) -> None:
    env = lmdb_lib.open(str(path), map_size=1 << 30, max_dbs=4, writemap=writemap)
    pairs = list(items.items())
    for start in range(0, len(pairs), txn_size):
        with env.begin(write=True) as txn:
            for key, value in pairs[start : start + txn_size]:
                txn.put(key, value)
    env.close()


def damage_pages(path, rng: random.Random) -> None:
    """1, 5 or 40 random bytes of the data file's page headers, node tables and nodes rewritten
    (not the meta pages)."""
    data = bytearray((path / "data.mdb").read_bytes())
    pages = len(data) // 4096
    for _ in range(rng.choice([1, 5, 40])):
        page = rng.randrange(2, pages)
        at = page * 4096 + rng.choice([rng.randrange(0, 16), rng.randrange(16, 64), rng.randrange(0, 4096)])
        data[at] = rng.randrange(256)
    (path / "data.mdb").write_bytes(bytes(data))


def _walk_all(path, keys: list[bytes]) -> tuple[np.ndarray, np.ndarray, list]:
    """The walk's (offsets, sizes) for ``keys`` and py-lmdb's values (or its error), one transaction."""
    env = lmdb_lib.open(str(path), readonly=True, lock=False, max_dbs=4)
    try:
        tree = MappedTree.open(str(path), env.stat()["psize"])
        assert tree is not None
        try:
            with env.begin(buffers=True) as txn:
                hits = tree.find(txn.id(), KeyTable(keys), range(len(keys)))
                assert hits is not None
                offsets, sizes = hits
                got = [tree._view[o : o + s].tobytes() if o >= 0 else None for o, s in zip(offsets.tolist(), sizes.tolist())]
                want = []
                for key in keys:
                    try:
                        value = txn.get(key)
                        want.append(None if value is None else bytes(value))
                    except lmdb_lib.Error as exc:
                        want.append(exc)
        finally:
            tree.close()
    finally:
        env.close()
    return offsets, got, want


def _check_same(offsets: np.ndarray, got: list, want: list, keys: list[bytes]) -> None:
    for key, offset, g, w in zip(keys, offsets.tolist(), got, want):
        if offset >= 0:
            assert g == w, key  # a value found is py-lmdb's, byte for byte
        elif offset == -1:
            assert w is None, key  # "not there" only where py-lmdb agrees


def _shapes(rng: random.Random) -> dict[bytes, bytes]:
    """60,000 keys (three levels of pages), values from empty to 100 KB (in-node and overflow, and
    around the limit between them), keys of 1 to 200 bytes with 0x00 and 0xff, prefixes of others."""
    items: dict[bytes, bytes] = {}
    for i in range(60_000):
        key = f"{i:06d}".encode()
        if i % 7 == 0:
            key = key[: rng.randint(1, 6)]  # prefixes of the other keys
        if i % 11 == 0:
            key += bytes(rng.choice([0, 255, 1, 254]) for _ in range(rng.randint(1, 194)))
        size = rng.choice([0, 1, 8, 100, 1000, 1900, 2000, 2030, 2040, 2100, 4096, 70_000, 100_000]) if i % 50 == 0 else rng.randint(0, 60)
        items[key] = rng.randbytes(size)
    return items


@pytest.fixture(scope="module", params=[False, True], ids=["written", "written-through-the-map"])
def shaped_db(tmp_path_factory, request) -> tuple[str, dict[bytes, bytes]]:
    items = _shapes(random.Random(1))
    path = tmp_path_factory.mktemp("lmdb") / "db"
    _write(path, items, writemap=request.param)
    env = lmdb_lib.open(str(path), readonly=True, lock=False)
    assert env.stat()["depth"] >= 3 and env.stat()["overflow_pages"] > 0
    env.close()
    return str(path), items


def test_the_walk_finds_every_value_py_lmdb_finds(shaped_db):
    path, items = shaped_db
    keys = list(items)
    missing = [b"", b"\x00", b"\xff" * 511, b"\xff" * 512, b"0000000", b"059999\x00", b"1", b"99999999", b"!"]
    offsets, got, want = _walk_all(path, keys + missing)
    _check_same(offsets, got, want, keys + missing)
    assert (offsets[: len(keys)] >= 0).all()  # every key found by the walk
    assert got[: len(keys)] == list(items.values())
    assert offsets[len(keys)] == -2 and offsets[len(keys) + 3] == -2  # empty and too long: py-lmdb's errors
    assert all(o == -1 for k, o in zip(missing, offsets[len(keys) :].tolist()) if 0 < len(k) <= 511)


def test_pages_reused_after_deletes_and_rewrites(tmp_path):
    rng = random.Random(2)
    items = _shapes(rng)
    path = tmp_path / "db"
    _write(path, items)
    env = lmdb_lib.open(str(path), map_size=1 << 30)
    keys = list(items)
    for round_ in range(3):  # later transactions free pages and fill them again
        with env.begin(write=True) as txn:
            for key in rng.sample(keys, 8000):
                if rng.random() < 0.5:
                    txn.delete(key)
                    items.pop(key, None)
                else:
                    items[key] = rng.randbytes(rng.choice([0, 30, 3000, 50_000]))
                    txn.put(key, items[key])
    env.close()
    offsets, got, want = _walk_all(path, keys)
    _check_same(offsets, got, want, keys)
    assert sum(o >= 0 for o in offsets.tolist()) == len(items)


def test_a_named_database_record_is_what_py_lmdb_gives(tmp_path):
    path = tmp_path / "db"
    _write(path, {b"a": b"1", b"z": b"2"})
    env = lmdb_lib.open(str(path), map_size=1 << 24, max_dbs=2)
    named = env.open_db(b"named")
    with env.begin(write=True, db=named) as txn:
        txn.put(b"inside", b"x")
    env.close()
    offsets, got, want = _walk_all(path, [b"a", b"named", b"z", b"inside"])
    _check_same(offsets, got, want, [b"a", b"named", b"z", b"inside"])
    assert len(want[1]) == 48 and offsets[3] == -1  # the record; a key of the named database is not in the main one


def test_another_transaction_or_format_leaves_the_chunk_to_py_lmdb(shaped_db, tmp_path):
    path, items = shaped_db
    env = lmdb_lib.open(path, readonly=True, lock=False)
    tree = MappedTree.open(path, env.stat()["psize"])
    with env.begin() as txn:
        assert tree.find(txn.id() + 1, KeyTable(list(items)[:5]), range(5)) is None
    tree.close()
    env.close()
    # A main database with sorted duplicates (py-lmdb will not make one): its flags set in both meta pages.
    copy = tmp_path / "dup"
    shutil.copytree(path, copy)
    data = bytearray((copy / "data.mdb").read_bytes())
    for meta in (0, 4096):
        flags_at = meta + 16 + 72 + 4
        struct.pack_into("<H", data, flags_at, struct.unpack_from("<H", data, flags_at)[0] | 0x04)
    (copy / "data.mdb").write_bytes(bytes(data))
    env = lmdb_lib.open(str(copy), readonly=True, lock=False)
    tree = MappedTree.open(str(copy), env.stat()["psize"])
    with env.begin() as txn:
        assert tree.find(txn.id(), KeyTable(list(items)[:5]), range(5)) is None
    tree.close()
    env.close()


@pytest.mark.parametrize("seed", range(6))
def test_a_damaged_file_never_gives_bytes_py_lmdb_would_not(tmp_path, seed):
    rng = random.Random(seed)
    items = {f"{i:05d}".encode(): rng.randbytes(rng.choice([10, 500, 3000, 20_000])) for i in range(3000)}
    path = tmp_path / "db"
    _write(path, items)
    damage_pages(path, rng)
    keys = list(items) + [b"missing", b"02999\x00"]
    offsets, got, want = _walk_all(path, keys)
    for key, offset, g, w in zip(keys, offsets.tolist(), got, want):
        if offset >= 0 and not isinstance(w, Exception):
            assert g == w, key
        if offset == -1:
            assert w is None or isinstance(w, Exception), key


async def _samples(reader) -> list[tuple]:
    out = []
    async for chunk in reader.read(0):
        for s in chunk:
            out.append((s.key, {k: bytes(v) for k, v in s.fields.items()},
                        None if s.error is None else (type(s.error), str(s.error))))
    return out


async def test_the_reader_reads_the_same_with_the_walk_and_without(shaped_db, tmp_path):
    path, items = shaped_db
    keys = list(items)[:3000] + [b"not-a-key", b"\xff" * 600]
    walked = readers.lmdb(path, keys=keys, shuffle=True, seed=3, chunk_size=50)
    plain = readers.lmdb(path, keys=keys, shuffle=True, seed=3, chunk_size=50)
    plain._spans = lambda txn, indices: [plain._span_of(plain._look_up(txn, i)) for i in indices]
    got, want = await _samples(walked), await _samples(plain)
    assert got == want
    assert sum(s[2] is not None for s in got) == 2
