"""The local copies (``cache_dir=``), third review: the ``.part`` files of a run killed mid-copy
when a live process now holds the pid in their name (a restarted container gives its process the
pid of the one killed: 1, or the same small number every time), and a live writer whose pid this
process cannot see (a rank in another container on the host, sharing the folder)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from test_cache_review2 import _kill_while_writing


def _as_if_owned_by(part, pid: int):
    """``part`` renamed to carry ``pid`` as its writer's: the name a killed writer's ``.part`` has
    when a restarted container's process got that writer's pid (what ``CacheFolder._part`` names)."""
    head, tail = part.name.rsplit(".", 2)[0], part.name.rsplit("-", 1)[1]
    reused = part.with_name(f"{head}.{pid}-{tail}")
    os.rename(part, reused)
    return reused


def test_an_objects_part_whose_pid_runs_again_is_removed_not_counted(tmp_path):
    """A killed objects run's ``.part`` file, its pid held now by a live process (here: this one).
    It was counted against ``cache_bytes`` forever, as if its writer were still writing: with an
    8 MiB part and a 10 kB bound, no object was kept again."""
    from headrace.readers._object_cache import ObjectCache

    parts = [_as_if_owned_by(p, os.getpid()) for p in _kill_while_writing(tmp_path)]
    cache = ObjectCache(tmp_path, max_bytes=10_000)
    cache.keep([(f"s3://b/{i}.jpg", b"x" * 1000) for i in range(10)])
    assert cache.kept == 10 and cache.used == 10_000
    assert not [p for p in parts if p.exists()]


_SHARD_WRITER = textwrap.dedent("""
    import os, sys
    from headrace.readers._shard_cache import CacheWrites, ShardCache
    cache = ShardCache(sys.argv[1])
    writes = CacheWrites(1 << 20)
    writer = cache.writer("s3://b/shard-0.tar", writes)
    writer.write(0, memoryview(b"s" * 10_000))
    print("writing", flush=True)
    sys.stdin.read()  # killed here, mid-shard
""")


def test_a_shards_part_whose_pid_runs_again_is_removed(tmp_path):
    """A killed shard writer's ``.part`` file, its pid held now by a live process: it stayed in the
    folder for good (each run took it for a live writer's), taking its disk space."""
    from headrace.readers._shard_cache import ShardCache

    proc = subprocess.Popen([sys.executable, "-c", _SHARD_WRITER, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "writing\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    [part] = [p for p in tmp_path.iterdir() if p.name.endswith(".part")]
    reused = _as_if_owned_by(part, os.getpid())
    ShardCache(tmp_path)
    assert not reused.exists()


_UNSEEN_WRITER = textwrap.dedent("""
    import asyncio, contextlib, os, sys
    from headrace import readers
    os.getpid = lambda: int(sys.argv[3])  # its pid in its own container: no process of the test's has it
    reader = readers.webdataset(sys.argv[2], storage_options={"retry": {"timeout": 30}}, cache_dir=sys.argv[1])

    async def main():
        async with contextlib.aclosing(reader.read(0)) as stream:
            samples = [s async for chunk in stream for s in chunk]
        print(len(samples), reader.cache.kept, reader.cache.failed, flush=True)

    asyncio.run(main())
""")


def _a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_writer_whose_pid_is_not_seen_here_keeps_its_copy(s3_env, tmp_path):
    """Two ranks in two containers on one host share the folder: each sees the other's ``.part``
    files named with a pid it has no process of. Opening the folder removed the other's live part
    (taken for a killed run's), and its copy was lost: the shard read, never kept."""
    from headrace.readers._shard_cache import ShardCache

    url = f"{s3_env.http}/big/big-0.tar"  # 12 MiB, held back past its first MiB until the part is seen
    s3_env.faults("http", {"match": "big-0", "faults": [{"kind": "stall", "after": 1 << 20, "seconds": 2}],
                           "then": None})
    proc = subprocess.Popen([sys.executable, "-c", _UNSEEN_WRITER, str(tmp_path), url, str(_a_dead_pid())],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]:
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.01)
        ShardCache(tmp_path)  # the other rank opening the folder
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert out.split() == ["48", "1", "0"]  # every sample, and the copy kept
    assert [p.name.endswith(".part") for p in tmp_path.iterdir()] == [False]
