"""The files reader's chunk reads at their edges: files that are not plain files, that change
size, that run the process out of descriptors; the C helper (one call or two) and Python alike."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap

import pytest
from headrace.readers import _read_files
from headrace.readers._sample_pool import SamplePool, _pool_lib
from open_files import open_fds

has_helper = _read_files.unavailable_reason() is None
# Where a subprocess finds this module and tests/open_files.py.
_IMPORTABLE = [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))]


def _readers(monkeypatch) -> dict[str, _read_files.ChunkReader]:
    """Every way this machine can read a chunk: the one-call helper, into fresh bytes or the sample
    pool's, the two-call one, Python."""
    ways = {"python": _read_files.ChunkReader(native=False)}
    if has_helper:
        ways["helper"] = _read_files.ChunkReader()
        if ways["helper"]._lib.read_chunk is not None:
            two_calls = _read_files.ChunkReader()
            two_calls._lib = _TwoCalls(two_calls._lib)
            ways["two calls"] = two_calls
            if _pool_lib() is not None:
                ways["pool"] = _IntoPool(SamplePool(16))
    return ways


def _ways_here() -> str:
    """How many ways ``_readers`` finds on this machine, as a subprocess prints it."""
    return str(len(_readers(None)))


class _IntoPool:
    """The one-call helper reading into a sample pool's blobs, as the files reader does; the pool
    follows fewer blobs than some chunks here hold, so it forgets and recycles them as it goes."""

    def __init__(self, pool: SamplePool) -> None:
        self._chunks = _read_files.ChunkReader()
        self._pool = pool

    def read(self, paths: list[bytes]) -> list:
        return self._chunks.read(paths, self._pool.blob_maker())


class _TwoCalls:
    """The helper's library as seen without Python's headers (no ``read_chunk``)."""

    def __init__(self, lib) -> None:
        self._lib = lib
        self.read_chunk = None

    def __getattr__(self, name):
        return getattr(self._lib, name)


def _same_everywhere(monkeypatch, paths: list[bytes]) -> list:
    results = {name: chunks.read(paths) for name, chunks in _readers(monkeypatch).items()}
    first = results["python"]
    for name, got in results.items():
        for g, w in zip(got, first, strict=True):
            if isinstance(w, OSError):
                assert (type(g), g.errno, g.strerror, g.filename) == (type(w), w.errno, w.strerror, w.filename), name
            else:
                assert type(g) is bytes and g == w, name
    return first


def test_a_fifo_is_an_error_and_no_hang(tmp_path):
    # Opening a FIFO with no writer blocked forever; the subprocess keeps a hang from stalling the suite.
    fifo = tmp_path / "pipe.jpg"
    os.mkfifo(fifo)
    (tmp_path / "fine.jpg").write_bytes(b"\xff\xd8")
    script = textwrap.dedent(f"""
        import errno, os
        from headrace.readers import _read_files
        paths = [os.fsencode({str(fifo)!r}), os.fsencode({str(tmp_path / "fine.jpg")!r})]
        for native in (True, False):
            got = _read_files.ChunkReader(native).read(paths)
            assert isinstance(got[0], OSError) and got[0].errno == errno.EINVAL, got
            assert got[0].filename == {str(fifo)!r} and got[1] == b"\\xff\\xd8", got
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_a_device_is_an_error_either_way(monkeypatch):
    got = _same_everywhere(monkeypatch, [b"/dev/null", b"/dev/zero"])
    assert all(isinstance(g, OSError) and g.errno == errno.EINVAL for g in got)


def test_a_file_is_read_up_to_the_size_it_had_when_opened_either_way(monkeypatch):
    # /proc files say size 0 and yet have bytes, like a file that grew between stat and read:
    # Python's readall read on to the end while the helper stopped at the size.
    got = _same_everywhere(monkeypatch, [b"/proc/self/status"])
    assert got == [b""]


def test_errors_name_the_file_as_text_either_way(monkeypatch, tmp_path):
    odd = os.fsencode(tmp_path) + b"/caf\xe9-\xff.jpg"  # not UTF-8
    got = _same_everywhere(monkeypatch, [odd])
    assert isinstance(got[0], FileNotFoundError) and got[0].filename == os.fsdecode(odd)
    with open(odd, "wb") as f:
        f.write(b"odd")
    assert _same_everywhere(monkeypatch, [odd]) == [b"odd"]


def test_unreadable_paths_are_typed_errors_and_their_neighbours_read(monkeypatch, tmp_path):
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    (tmp_path / "deleted.jpg").write_bytes(b"was here")
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "ünïcode ✓.jpg").write_bytes(b"uni")
    (tmp_path / "a-folder").mkdir()
    names = ["loop-a", "deleted.jpg", "empty.jpg", "ünïcode ✓.jpg", "a-folder"]
    paths = [os.fsencode(tmp_path / name) for name in names]
    os.remove(tmp_path / "deleted.jpg")  # listed, then gone before the read
    before = open_fds()
    got = _same_everywhere(monkeypatch, paths)
    assert open_fds() == before
    assert [g.errno if isinstance(g, OSError) else g for g in got] == [
        errno.ELOOP, errno.ENOENT, b"", b"uni", errno.EISDIR]
    assert [g.filename for g in got if isinstance(g, OSError)] == [
        str(tmp_path / n) for n in ("loop-a", "deleted.jpg", "a-folder")]


def test_signals_during_reads_change_no_bytes(monkeypatch, tmp_path):
    paths = []
    for k in range(200):
        p = tmp_path / f"{k}.bin"
        p.write_bytes(os.urandom(k * 997))
        paths.append(os.fsencode(p))
    want = [open(p, "rb").read() for p in paths]
    alarms = []
    previous = signal.signal(signal.SIGALRM, lambda *_: alarms.append(1))
    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
    try:
        for _ in range(10):
            for name, chunks in _readers(monkeypatch).items():
                assert chunks.read(paths) == want, name
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_a_chunk_larger_than_the_descriptors_left_is_read_whole(tmp_path):
    # The helper opened a whole chunk before reading any of it: past RLIMIT_NOFILE the rest of the
    # chunk failed with EMFILE, where Python (one file at a time) read them all.
    for k in range(100):
        (tmp_path / f"{k}.jpg").write_bytes(b"%d" % k)
    script = textwrap.dedent(f"""
        import os, resource, sys
        sys.path[:0] = {_IMPORTABLE!r}
        from test_read_files_review import _readers
        from open_files import open_fds
        paths = [os.fsencode(os.path.join({str(tmp_path)!r}, f"{{k}}.jpg")) for k in range(100)]
        resource.setrlimit(resource.RLIMIT_NOFILE, (40, 40))
        before = open_fds()
        for name, chunks in _readers(None).items():
            got = chunks.read(paths)
            assert got == [b"%d" % k for k in range(100)], (name, [g for g in got if isinstance(g, OSError)][:2])
        assert open_fds() == before
        print(len(_readers(None)))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == _ways_here()


def test_a_chunk_with_no_descriptor_left_fails_each_file_and_leaks_none(tmp_path):
    for k in range(5):
        (tmp_path / f"{k}.jpg").write_bytes(b"%d" % k)
    script = textwrap.dedent(f"""
        import errno, os, resource, sys
        sys.path[:0] = {_IMPORTABLE!r}
        from test_read_files_review import _readers
        paths = [os.fsencode(os.path.join({str(tmp_path)!r}, f"{{k}}.jpg")) for k in range(5)]
        ways = _readers(None)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        held = []
        while True:  # take every descriptor left
            try:
                held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                break
        for name, chunks in ways.items():
            got = chunks.read(paths)
            assert [g.errno for g in got] == [errno.EMFILE] * 5, (name, got)
        for fd in held[:3]:
            os.close(fd)
        for name, chunks in ways.items():
            assert chunks.read(paths) == [b"%d" % k for k in range(5)], name
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
