"""The local copies (``cache_dir=``) as a team sharing one folder meets them: other people's files in
the folder, several ranks filling it at once under one ``cache_bytes``, a folder given as ``""``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from headrace import ConfigError, readers

from storage_servers import BUCKET
from test_storage import RETRY, WDS, _read_all, _url


async def test_eviction_removes_only_the_caches_own_copies(s3_env, tmp_path, leaks):
    """A folder that holds more than copies (a user's file, a sub-folder): evicting for
    ``cache_bytes`` leaves them alone, and a sub-folder does not make every copy fail."""
    cache = tmp_path / "cache"
    (cache / "runs").mkdir(parents=True)
    (cache / "notes.txt").write_bytes(b"not a shard")
    for old in (cache / "runs", cache / "notes.txt"):
        os.utime(old, (1, 1))  # older than any copy: first in line for eviction, were they copies
    sizes = sorted(p.stat().st_size for p in (s3_env.root / "wds").glob("*.tar"))
    reader = readers.webdataset(_url(s3_env, "s3", WDS), storage_options={"retry": RETRY}, read_ahead=0,
                                cache_dir=cache, cache_bytes=sum(sizes[-3:]))
    assert len(await _read_all(reader)) == 75
    assert (cache / "notes.txt").read_bytes() == b"not a shard" and (cache / "runs").is_dir()
    assert reader.cache.failed == 0 and reader.cache.kept == 10 and reader.cache.evicted > 0
    await leaks.check()


def test_an_empty_cache_dir_is_a_config_error(tmp_path, monkeypatch):
    """``cache_dir=""`` (an unset environment variable) would be the working directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="cache_dir is empty"):
        readers.webdataset(f"s3://{BUCKET}/{WDS}", cache_dir="", counts=75)
    with pytest.raises(ConfigError, match="cache_dir is empty"):
        readers.files([f"s3://{BUCKET}/images/a.jpg"], cache_dir="")


_RANK = textwrap.dedent("""
    import os, sys, time
    from headrace.readers._object_cache import ObjectCache
    folder, rank, ranks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    cache = ObjectCache(folder, max_bytes=10_000)
    cache.keep([(f"s3://b/{rank}-first.jpg", b"x" * 100)])  # every rank has looked at the folder...
    open(os.path.join(folder, f"ready-{rank}"), "w").close()
    while sum(name.startswith("ready-") for name in os.listdir(folder)) < ranks:
        time.sleep(0.01)
    for i in range(30):  # ... before any fills it
        cache.keep([(f"s3://b/{rank}-{i}.jpg", b"x" * 1000)])
    print(cache.kept)
""")


def test_ranks_filling_one_folder_together_keep_within_cache_bytes(tmp_path):
    """Four processes (ranks of one host) share a folder bounded to 10,000 bytes: the copies of all
    of them stay within it, not four times it."""
    ranks = 4
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, str(tmp_path), str(r), str(ranks)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    kept = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        kept.append(int(out))
    copies = [p for p in tmp_path.rglob("*") if p.is_file() and "-" in p.name[16:17]]
    assert not [p for p in copies if p.name.endswith(".part")]
    assert len(copies) == sum(kept)
    assert 9_000 <= sum(p.stat().st_size for p in copies) <= 10_000  # filled, and no further


async def test_a_copy_cut_short_is_removed_and_read_from_the_store(s3_env, tmp_path, caplog, leaks):
    """A kept shard truncated since it was written (a host crash before its data reached the disk,
    a disk error): read as it is, a tar cut at a header ends there without an error, and every
    epoch silently lost its samples. Told apart by the size it was written with."""
    cache = tmp_path / "cache"
    reader = readers.webdataset(_url(s3_env, "s3", WDS), storage_options={"retry": RETRY}, cache_dir=cache)
    expected = sorted(s.key for s in await _read_all(reader))
    first, second = sorted(cache.iterdir())[:2]
    first.write_bytes(b"")  # as a crash leaves a file renamed before its data was written
    second.write_bytes(second.read_bytes()[:1024])  # a header and its member: the rest cut off
    again = await _read_all(reader)
    assert sorted(s.key for s in again) == expected and all(s.error is None for s in again)
    assert (reader.cache.damaged, reader.cache.hits, reader.cache.kept) == (2, 8, 10 + 2)
    assert sum("removed, read from the store" in r.getMessage() for r in caplog.records) == 2
    # Kept again whole by the read from the store.
    originals = {p.read_bytes() for p in (s3_env.root / "wds").glob("*.tar")}
    assert {p.read_bytes() for p in cache.iterdir()} == originals
    await leaks.check()
