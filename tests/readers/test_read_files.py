"""The files reader's chunk reads: the C helper against Python's own open/read, on real files."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from headrace import ReadError, readers
from headrace.readers import _read_files

needs_helper = pytest.mark.skipif(
    _read_files.unavailable_reason() is not None, reason=f"no C helper: {_read_files.unavailable_reason()}"
)


def _python_reads(paths: list[str]) -> list:
    out = []
    for p in paths:
        try:
            with open(p, "rb") as f:
                out.append(f.read())
        except OSError as exc:
            out.append(exc)
    return out


@pytest.fixture
def mixed_files(tmp_path) -> list[str]:
    """Files of many sizes (empty, 1 byte, 3 MiB), a folder, a missing path and a non-ASCII name."""
    rng = np.random.default_rng(1)
    paths = []
    for k, size in enumerate([0, 1, 63, 64, 65, 4096, 70_000, 3 << 20, 5]):
        p = tmp_path / f"f{k}.bin"
        p.write_bytes(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
        paths.append(str(p))
    (tmp_path / "a-folder").mkdir()
    odd = tmp_path / "näme with space.jpg"
    odd.write_bytes(b"\xff\xd8 odd")
    return paths[:3] + [str(tmp_path / "a-folder")] + paths[3:6] + [str(tmp_path / "gone.bin"), str(odd)] + paths[6:]


@needs_helper
def test_the_helper_reads_what_python_reads_and_the_same_errors(mixed_files):
    chunks = _read_files.ChunkReader()
    assert chunks.native
    got = chunks.read([os.fsencode(p) for p in mixed_files])
    want = _python_reads(mixed_files)
    assert len(got) == len(want) == len(mixed_files)
    for path, g, w in zip(mixed_files, got, want):
        if isinstance(w, OSError):
            assert isinstance(g, OSError) and type(g) is type(w), path
            assert g.errno == w.errno and g.filename == path
        else:
            assert type(g) is bytes and g == w, path
    errors = {type(g) for g in got if isinstance(g, OSError)}
    assert errors == {IsADirectoryError, FileNotFoundError}


@needs_helper
def test_an_unreadable_file_is_an_error_and_its_neighbours_are_read(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root reads files whatever their mode")
    locked, fine = tmp_path / "locked.jpg", tmp_path / "fine.jpg"
    locked.write_bytes(b"secret")
    locked.chmod(0)
    fine.write_bytes(b"\xff\xd8")
    got = _read_files.ChunkReader().read([os.fsencode(locked), os.fsencode(fine)])
    assert isinstance(got[0], PermissionError) and got[0].errno == errno.EACCES
    assert got[1] == b"\xff\xd8"


@needs_helper
async def test_reads_from_many_threads_at_once_leave_no_file_open(tmp_path, leaks):
    rng = np.random.default_rng(2)
    paths = []
    for k in range(64):
        p = tmp_path / f"{k}.bin"
        p.write_bytes(rng.integers(0, 256, int(rng.integers(0, 200_000)), dtype=np.uint8).tobytes())
        paths.append(os.fsencode(p))
    want = _python_reads([os.fsdecode(p) for p in paths])
    chunks = _read_files.ChunkReader()
    failures = []

    def worker(seed: int) -> None:
        order = np.random.default_rng(seed).permutation(64)
        for _ in range(20):
            got = chunks.read([paths[i] for i in order])
            if [got[j] for j in range(64)] != [want[i] for i in order]:
                failures.append(seed)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    await leaks.check()


def test_without_the_helper_python_reads_the_same(mixed_files):
    chunks = _read_files.ChunkReader(native=False)
    assert not chunks.native
    got = chunks.read([os.fsencode(p) for p in mixed_files])
    for g, w in zip(got, _python_reads(mixed_files)):
        assert (type(g), g.errno) == (type(w), w.errno) if isinstance(w, OSError) else g == w


@pytest.mark.parametrize("native", [True, False])
async def test_the_files_reader_names_a_file_it_cannot_read(image_folder, native):
    paths = sorted(str(p) for p in image_folder.rglob("*.jpg"))[:5]
    paths.insert(2, str(image_folder / "gone.jpg"))
    reader = readers.files(paths, labels=list(range(6)), chunk_size=4, native_read=native)
    samples = [s async for chunk in reader.read(0) for s in chunk]
    assert [s.source for s in samples] == paths
    bad = samples[2]
    assert isinstance(bad.error, ReadError) and bad.error.source == paths[2] and bad.fields == {"cls": b"2"}
    assert isinstance(bad.error.__cause__, FileNotFoundError)
    for s in samples[:2] + samples[3:]:
        assert s.error is None
        with open(s.source, "rb") as f:
            assert s.fields["jpg"] == f.read()


@needs_helper
def test_the_one_call_helper_and_the_two_call_fallback_read_the_same(monkeypatch, mixed_files):
    chunks = _read_files.ChunkReader()
    if chunks._lib.read_chunk is None:
        pytest.skip("the helper was built without Python's headers")
    paths = [os.fsencode(p) for p in mixed_files]
    one_call = chunks.read(paths)
    monkeypatch.setattr(chunks._lib, "read_chunk", None)
    two_calls = chunks.read(paths)
    for g, w in zip(one_call, two_calls):
        assert (type(g), g.errno, g.filename) == (type(w), w.errno, w.filename) if isinstance(w, OSError) else g == w


@needs_helper
def test_a_path_table_reads_by_index_and_names_each_failure(mixed_files):
    table = _read_files.PathTable(mixed_files)
    order = [int(i) for i in np.random.default_rng(3).permutation(len(mixed_files))]
    got, failed = _read_files.ChunkReader().read_table(table, order)
    want = _python_reads([mixed_files[i] for i in order])
    assert failed == 2
    for i, g, w in zip(order, got, want):
        if isinstance(w, OSError):
            assert type(g) is type(w) and g.errno == w.errno and g.filename == mixed_files[i]
        else:
            assert type(g) is bytes and g == w
    assert [table.path(i) for i in range(len(mixed_files))] == [os.fsencode(p) for p in mixed_files]
