"""The tar parser's two paths agree: headers read by the C helper out of a mapped file or a
downloaded block, and the Python loop (which the helper leaves every odd member and every error to).

Each case parses one real tar (written by ``tarfile`` in its three formats, then cut or corrupted)
both ways and compares everything ``iter_groups`` yields or raises.
"""

from __future__ import annotations

import io
import os
import random
import tarfile

import pytest

from headrace import ReadError
from headrace.readers import _tar
from headrace.readers._read_files import tar_scanner
from headrace.readers._storage import RemoteFile
from headrace.readers._storage._remote import Span

pytestmark = pytest.mark.skipif(tar_scanner() is None, reason="no C compiler: only the Python path exists here")


def _members(rng: random.Random) -> list[tuple[str, bytes]]:
    """Samples of one to three fields, sizes from empty to past a span (4 KiB), with the odd
    members a shard meets: a long name, a folder, a meta member, no extension, a hostile path, a
    duplicate field."""
    out: list[tuple[str, bytes]] = []
    for i in range(40):
        key = f"class_{i % 3}/{i:06d}" if i != 17 else "deep/" + "x" * 120 + f"/{i:06d}"
        for ext in rng.sample(["jpg", "cls", "json"], rng.randint(1, 3)):
            out.append((f"{key}.{ext}", rng.randbytes(rng.choice([0, 1, 100, 511, 512, 513, 5000, 70_000]))))
    out[10:10] = [("__meta__/info.json", b"{}"), ("README", b"no extension")]
    # Names at the edges of the helper's "plain field" test, each read as Python reads it.
    odd = ["__index__", "____/x.jpg", "___.jpg", "a/__b__/c.jpg", ".hidden.jpg", "a/.b", "trailing.", "a.b.C",
           "UPPER.JPG", "\u00fcber/\u00e9t\u00e9.jpg", "a\\b.jpg", "C:/x.jpg", "c:x.jpg", "./a.jpg", "a/./b.jpg",
           "a/../b.jpg", "..a/b.jpg", "a../b.jpg", "/abs.jpg", "x/y/z.tar.gz"]
    out[20:20] = [(name, rng.randbytes(rng.choice([3, 5000]))) for name in odd]
    out[30:30] = [("../escape.jpg", b"evil")]
    out[50:50] = [(out[49][0], b"the same field again")]
    return out


def _tar_bytes(members: list[tuple[str, bytes]], fmt: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        folder = tarfile.TarInfo("a_folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _parse(source, spans: bool, select=None) -> list:
    """Everything iter_groups yields, spans as bytes, and what it raised last."""
    out: list = []
    try:
        with _tar.open_shard(source) as f:
            for ordinal, key, fields, error in _tar.iter_groups(f, "shard.tar", select, spans=spans):
                if fields is not None:
                    fields = {k: bytes(v.view) if type(v) is Span else v for k, v in fields.items()}
                out.append((ordinal, key, fields, repr(error)))
    except ReadError as exc:
        out.append(("raised", str(exc), exc.key, exc.source))
    return out


def _python_only(monkeypatch):
    monkeypatch.setattr(_tar, "tar_scanner", lambda: None)


def _counting(monkeypatch) -> list[int]:
    """The helper as before, counting the headers it read (so a test knows it ran)."""
    scan, read = tar_scanner(), [0]

    def counted(*args):
        n = scan(*args)
        read[0] += n
        return n

    monkeypatch.setattr(_tar, "tar_scanner", lambda: counted)
    return read


def _cases():
    rng = random.Random(7)
    members = _members(rng)
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT):
        if fmt == tarfile.USTAR_FORMAT:  # ustar has no long names past its prefix field
            members = [(n, d) for n, d in members if len(n) < 150]
        data = _tar_bytes(members, fmt)
        yield f"{fmt}-whole", data
        for cut in sorted(rng.sample(range(1, len(data)), 6)) + [512 * 7, len(data) - 1024]:
            yield f"{fmt}-cut-{cut}", data[:cut]
        for _ in range(3):
            corrupt = bytearray(data)
            corrupt[rng.randrange(len(data) // 512) * 512 + rng.choice([0, 100, 124, 130, 148, 156])] ^= 0x41
            yield f"{fmt}-corrupt", bytes(corrupt)


@pytest.mark.parametrize("select", [None, "every-third"])
def test_a_mapped_file_parses_as_the_python_loop_does(tmp_path, monkeypatch, select):
    choose = None if select is None else (lambda j: j % 3 == 1)
    by_helper, samples = _counting(monkeypatch), 0
    for name, data in _cases():
        path = tmp_path / f"{name}.tar"
        path.write_bytes(data)
        with monkeypatch.context() as m:
            _python_only(m)
            expected = _parse(str(path), spans=False, select=choose)
        with _tar.open_shard(str(path)) as f:
            assert type(f).__name__ == "_MappedShard"
        got = _parse(str(path), spans=True, select=choose)
        assert got == expected, name
        assert _parse(str(path), spans=False, select=choose) == expected, name
        samples += sum(s[0] != "raised" and bool(s[2]) for s in expected)
    assert samples > 300 and by_helper[0] > 1000


@pytest.mark.parametrize("block", [700, 4096, 100_003, 1 << 20])
def test_a_download_in_blocks_parses_as_the_python_loop_does(monkeypatch, block):
    """Blocks of every size against the members: headers and data cut by a block's end go to
    the Python loop, the rest to the helper."""
    by_helper = _counting(monkeypatch)
    for name, data in _cases():
        with monkeypatch.context() as m:
            _python_only(m)
            expected = _parse(RemoteFile.arrived(data, block), spans=True)
        assert _parse(RemoteFile.arrived(data, block), spans=True) == expected, (name, block)
    assert by_helper[0] > (0 if block < 4096 else 1000)


def test_a_mapped_shard_closes_with_spans_still_out(tmp_path):
    """A reader stopped mid-chunk drops its spans after the shard is closed: the file closes at
    once and the map goes with the last span."""
    path = tmp_path / "s.tar"
    path.write_bytes(_tar_bytes([("a.jpg", b"x" * 10_000), ("b.jpg", b"y" * 10_000)], tarfile.GNU_FORMAT))
    f = _tar.open_shard(str(path))
    groups = _tar.iter_groups(f, str(path), spans=True)
    _, key, fields, _ = next(groups)
    span = fields["jpg"]
    assert key == "a" and type(span) is Span
    groups.close()
    f.close()
    assert f._file.closed
    assert bytes(span.view) == b"x" * 10_000  # still readable: the map outlives the close


def _mapped_rss_kb(path) -> int:
    """The resident size of this process's map of ``path`` (Linux's /proc/self/smaps)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0]:  # a mapping's first line: "start-end perms ... path"
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1])
    return rss


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_a_mapped_shard_keeps_only_its_last_pages_resident(tmp_path):
    """Read to its end, a 48 MB shard holds a few MB of its map in RSS, not 48."""
    path = tmp_path / "big.tar"
    path.write_bytes(_tar_bytes([(f"{i:05d}.jpg", os.urandom(100_000)) for i in range(480)], tarfile.GNU_FORMAT))
    with _tar.open_shard(str(path)) as f:
        n = 0
        for _, _, fields, _ in _tar.iter_groups(f, str(path), spans=True):
            n += len(bytes(fields["jpg"].view)) > 0
        resident = _mapped_rss_kb(path)
    assert n == 480
    assert 0 < resident < 16 << 10, resident
