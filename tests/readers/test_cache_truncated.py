"""Local copies (``cache_dir=``) that are no longer whole: cut short (or lengthened) in place by a
crash, a disk error or a hand, or replaced by a tool that copies files without their extended
attributes (``cp``, ``rsync`` without ``-X``) and was stopped partway. Such a copy is never served:
its size is checked against the size it was written with, and a copy with no record of that size
is read from the store again, as is one of the wrong size."""

from __future__ import annotations

import errno
import io
import os
import tarfile

import pytest

from headrace import readers

from test_object_cache import OBJECTS, _copies, _remote
from test_storage import RETRY, WDS, _read_all, _url

SHARDS = 10


def _cut_in_place(path, size: int) -> None:
    """``path`` cut to ``size`` bytes (or lengthened to it, with zeros), the same file: as a crash
    before its data reached the disk, a disk error, or ``truncate`` leaves it."""
    os.truncate(path, size)


def _rewritten(path, data: bytes) -> None:
    """``path`` replaced by a new file holding ``data``: as a copy of the folder made by a tool that
    leaves extended attributes behind leaves it (cut short where that tool was stopped)."""
    os.unlink(path)
    path.write_bytes(data)


def _object_copies(folder) -> list:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != ".headrace-used")


@pytest.mark.parametrize("kind", ["s3", "http"])
async def test_an_objects_copy_of_the_wrong_size_is_removed_and_read_from_the_store(s3_env, kind, image_folder,
                                                                                tmp_path, caplog, leaks):
    """Three copies changed in place: cut to half, cut by their last byte, lengthened. Served, each
    was a sample's wrong bytes: a JPEG that decodes wrong or fails with a misleading error."""
    cache = tmp_path / "cache"
    # 5 s a request (test_storage's 0.5 s is for its stall tests): a loaded CI machine's S3 server
    # answered later than that six times over once, and the objects came back as errors.
    reader = _remote(s3_env, kind, image_folder, retry={**RETRY, "timeout": 5.0}, chunk_size=16, cache_dir=cache)
    expected = {s.key: s.fields["jpg"] for s in await _read_all(reader)}
    half, short, longer = _object_copies(cache)[:3]
    _cut_in_place(half, half.stat().st_size // 2)
    _cut_in_place(short, short.stat().st_size - 1)
    _cut_in_place(longer, longer.stat().st_size + 100)
    again = await _read_all(reader, epoch=1)
    assert {s.key: s.fields["jpg"] for s in again} == expected and all(s.error is None for s in again)
    assert (reader.cache.damaged, reader.cache.hits, reader.cache.kept) == (3, OBJECTS - 3, OBJECTS + 3)
    assert sum("removed, read from the store" in r.getMessage() for r in caplog.records) == 1  # once, not per copy
    # Kept again whole by the read from the store, and served from the folder after that.
    assert set(_copies(cache).values()) == {p.read_bytes() for p in image_folder.rglob("*.jpg")}
    third = await _read_all(reader, epoch=2)
    assert {s.key: s.fields["jpg"] for s in third} == expected
    assert (reader.cache.damaged, reader.cache.hits) == (3, 2 * OBJECTS - 3)
    await leaks.check()


async def test_an_objects_copy_without_a_record_of_its_size_is_read_from_the_store(s3_env, image_folder, tmp_path,
                                                                                   leaks):
    """Copies replaced by new files (the folder copied without extended attributes): one cut short
    where the copying stopped, one whole. Neither can be told whole, so neither is served; both are
    read from the store once and kept again with their size recorded."""
    cache = tmp_path / "cache"
    reader = _remote(s3_env, "s3", image_folder, chunk_size=16, cache_dir=cache)
    expected = {s.key: s.fields["jpg"] for s in await _read_all(reader)}
    cut, whole = _object_copies(cache)[:2]
    _rewritten(cut, cut.read_bytes()[: cut.stat().st_size * 2 // 3])
    _rewritten(whole, whole.read_bytes())
    again = await _read_all(reader, epoch=1)
    assert {s.key: s.fields["jpg"] for s in again} == expected and all(s.error is None for s in again)
    assert (reader.cache.damaged, reader.cache.hits, reader.cache.kept) == (2, OBJECTS - 2, OBJECTS + 2)
    third = await _read_all(reader, epoch=2)
    assert {s.key: s.fields["jpg"] for s in third} == expected
    assert (reader.cache.damaged, reader.cache.hits) == (2, 2 * OBJECTS - 2)
    await leaks.check()


def test_under_cache_bytes_a_damaged_copy_gives_its_room_back(tmp_path):
    """A full folder (``cache_bytes``) stops writing; a damaged copy removed from it gives its room
    back, so the object read from the store in its place is kept again now, not by a later run."""
    from headrace.readers._object_cache import ObjectCache

    cache = ObjectCache(tmp_path, max_bytes=3000)
    objects = [(f"s3://b/{i}.jpg", bytes([i]) * 1000) for i in range(4)]
    cache.keep(objects)
    assert cache.kept == 3 and cache.used == 3000  # the fourth did not fit: full
    _cut_in_place(cache.path(objects[0][0]), 500)
    assert cache.read([objects[0][0]]) == [None] and cache.damaged == 1
    cache.keep(objects[:1])  # read from the store again, and kept
    assert cache.kept == 4 and cache.used == 3000
    assert cache.read([url for url, _ in objects[:3]]) == [data for _, data in objects[:3]]


def test_room_given_back_where_the_folder_was_never_counted_is_counted_once(tmp_path):
    """A folder filled without ``cache_bytes`` has no tally: the first count is a scan of it, made
    after the damaged copy is gone. Taking the copy's bytes off that count again would leave the
    tally short, and the folder would fill past the bound by as much."""
    from headrace.readers._object_cache import ObjectCache

    ObjectCache(tmp_path).keep([(f"s3://b/{i}.jpg", bytes([i]) * 1000) for i in range(3)])
    cache = ObjectCache(tmp_path, max_bytes=3000)
    _cut_in_place(cache.path("s3://b/0.jpg"), 500)
    assert cache.read(["s3://b/0.jpg"]) == [None] and cache.damaged == 1
    assert cache.used == 2000
    cache.keep([(f"s3://b/{i}.jpg", bytes([i]) * 1000) for i in range(3, 6)])
    assert cache.kept == 1 and cache.used == 3000


def _sample_boundary(data: bytes) -> int:
    """The offset of the header of the second sample's first member: a tar cut there parses without
    an error and holds the first sample alone."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
    first_key = members[0].name.split(".", 1)[0]
    return next(m.offset for m in members if m.name.split(".", 1)[0] != first_key)


@pytest.mark.parametrize("how", ["in place", "a new file"])
async def test_a_shard_copy_cut_at_a_sample_boundary_is_removed_and_read_from_the_store(s3_env, how, tmp_path, caplog,
                                                                                     leaks):
    """A shard's copy cut exactly where a sample starts is a whole tar of fewer samples: parsed, it
    ends there without an error and every epoch silently loses the rest. Cut in place (its record
    of the size kept on the file) or replaced by a new file cut there (no record): read from the
    store either way."""
    cache = tmp_path / "cache"
    reader = readers.webdataset(_url(s3_env, "s3", WDS), storage_options={"retry": RETRY}, cache_dir=cache)
    expected = sorted(s.key for s in await _read_all(reader))
    copy = sorted(cache.iterdir())[0]
    data = copy.read_bytes()
    cut = _sample_boundary(data)
    if how == "in place":
        _cut_in_place(copy, cut)
    else:
        _rewritten(copy, data[:cut])
    again = await _read_all(reader, epoch=1)
    assert sorted(s.key for s in again) == expected and all(s.error is None for s in again)
    assert (reader.cache.damaged, reader.cache.hits, reader.cache.kept) == (1, SHARDS - 1, SHARDS + 1)
    assert sum("removed, read from the store" in r.getMessage() for r in caplog.records) == 1
    assert copy.read_bytes() == data  # kept again whole
    await leaks.check()


def _no_extended_attributes(monkeypatch, code: int, *, reads: bool = True) -> None:
    """This process's file system calls for extended attributes fail with ``code``: as on a file
    system without them (``ENOTSUP``: an old tmpfs, many NFS mounts) or one that has no room for
    another (``ENOSPC``). Not one such file system can be mounted by the test itself."""
    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, "setxattr", refuse)
    if reads:
        monkeypatch.setattr(os, "getxattr", refuse)


async def test_where_sizes_cannot_be_recorded_copies_are_still_used(s3_env, image_folder, tmp_path, monkeypatch,
                                                                    caplog, leaks):
    """A folder on a file system without extended attributes: the copies cannot record their size,
    and are used as they are (an object's found empty is still taken for damaged), rather than
    read from the store again every epoch."""
    _no_extended_attributes(monkeypatch, errno.ENOTSUP)
    caplog.set_level("WARNING", logger="headrace")
    objects = _remote(s3_env, "s3", image_folder, chunk_size=16, cache_dir=tmp_path / "objects")
    expected = {s.key: s.fields["jpg"] for s in await _read_all(objects)}
    _object_copies(tmp_path / "objects")[0].write_bytes(b"")
    assert {s.key: s.fields["jpg"] for s in await _read_all(objects, epoch=1)} == expected
    assert (objects.cache.kept, objects.cache.hits, objects.cache.damaged) == (OBJECTS + 1, OBJECTS - 1, 1)

    shards = readers.webdataset(_url(s3_env, "s3", WDS), storage_options={"retry": RETRY},
                                cache_dir=tmp_path / "shards")
    keys = sorted(s.key for s in await _read_all(shards))
    assert sorted(s.key for s in await _read_all(shards, epoch=1)) == keys
    assert (shards.cache.kept, shards.cache.hits, shards.cache.damaged) == (SHARDS, SHARDS, 0)
    assert sum("keeps no extended attributes" in r.getMessage() for r in caplog.records) == 2  # once a folder
    await leaks.check()


async def test_a_copy_whose_size_cannot_be_recorded_is_not_kept(s3_env, image_folder, tmp_path, monkeypatch,
                                                                 leaks):
    """Where the file system has extended attributes but refuses this one (no room for it), a copy
    without its record would be read from the store again every epoch: it is given up instead,
    counted in ``failed``, and the reads go on."""
    _no_extended_attributes(monkeypatch, errno.ENOSPC, reads=False)
    objects = _remote(s3_env, "s3", image_folder, chunk_size=16, cache_dir=tmp_path / "objects")
    assert len(await _read_all(objects)) == OBJECTS
    assert objects.cache.kept == 0 and objects.cache.failed > 0 and _object_copies(tmp_path / "objects") == []
    shards = readers.webdataset(_url(s3_env, "s3", WDS), storage_options={"retry": RETRY},
                                cache_dir=tmp_path / "shards")
    assert len(await _read_all(shards)) == OBJECTS
    assert shards.cache.kept == 0 and shards.cache.failed == SHARDS and os.listdir(tmp_path / "shards") == []
    await leaks.check()
