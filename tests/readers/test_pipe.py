"""``pipe:`` shards: a real command's output (cat, gzip, head, sh) read as WebDataset tar shards.

The same samples as the files, gzip on the fly, exact resume mid-shard, a failing or truncating
command named in a typed error (with its error output), a command that hangs killed with what it
started when the read is closed, and query strings left out of the names.
"""

from __future__ import annotations

import asyncio
import gzip
import time

import pytest

from headrace import Loader, ReadError, ops, readers


def _counts(shards):
    """Each shard's sample count, from the index beside the files (a command's output has none)."""
    return [len(readers.webdataset(str(p))) for p in sorted(shards.glob("*.tar"))]


async def _read(reader, epoch=0, start=0, seed=3):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]


def _same(a, b):
    assert [(s.key, s.index, s.position, s.fields) for s in a] == [(s.key, s.index, s.position, s.fields) for s in b]


async def test_a_commands_output_reads_as_the_shard_file_would(shards, leaks):
    local = readers.webdataset(str(shards / "shard-{000000..000009}.tar"), shuffle=True, shuffle_buffer=20)
    piped = readers.webdataset(f"pipe:cat {shards}/shard-{{000000..000009}}.tar", counts=_counts(shards),
                               shuffle=True, shuffle_buffer=20)
    assert len(piped) == len(local) == 75
    samples = await _read(piped, epoch=1)
    _same(samples, await _read(local, epoch=1))
    assert samples[0].source.startswith(f"pipe:cat {shards}/shard-")
    await leaks.check()


async def test_gzip_on_the_fly_and_a_count_by_scanning(shards):
    local = readers.webdataset(str(shards))
    gzipped = readers.webdataset(f"pipe:gzip -c {shards}/shard-{{000000..000009}}.tar", counts="scan")
    assert len(gzipped) == 75
    _same(await _read(gzipped), await _read(local))


@pytest.mark.parametrize("start", [1, 13, 40, 74])
async def test_resume_mid_shard_runs_the_command_again_and_reads_over_the_start(shards, start):
    piped = readers.webdataset(f"pipe:cat {shards}/shard-{{000000..000009}}.tar", counts=_counts(shards),
                               shuffle=True)
    whole = await _read(piped, epoch=2)
    _same(await _read(piped, epoch=2, start=start), whole[start:])


async def test_a_failing_command_is_a_read_error_naming_the_shard_with_its_error_output(shards, tmp_path, leaks):
    missing = tmp_path / "missing.tar"
    reader = readers.webdataset([f"pipe:cat {shards}/shard-000000.tar", f"pipe:cat {missing}"])
    samples = await _read(reader)
    assert all(s.error is None for s in samples[:-1]) and len(samples) == 9  # shard 0's 8, then the error
    error = samples[-1].error
    assert isinstance(error, ReadError)
    assert error.source == f"pipe:cat {missing}"
    assert "exited with status 1" in str(error) and "No such file" in str(error)
    loader = Loader(reader, batch_size=4, device="cpu", num_threads=1, pipeline=ops.validation(32))
    with pytest.raises(ReadError, match="exited with status 1"):
        async with loader:
            async for _ in loader:
                pass
    await leaks.check()


async def test_a_command_that_fails_after_its_output_or_cuts_it_short_is_an_error(shards):
    shard = shards / "shard-000000.tar"
    late = await _read(readers.webdataset(f"pipe:cat {shard}; echo gone >&2; exit 3"))
    assert [s.error for s in late[:8]] == [None] * 8  # every sample it sent, then its failure
    assert len(late) == 9 and "exited with status 3: gone" in str(late[-1].error)
    cut = await _read(readers.webdataset(f"pipe:head -c {shard.stat().st_size // 2} {shard}"))
    assert cut[-1].error is not None and "truncated" in str(cut[-1].error)
    assert 0 < len([s for s in cut if s.error is None]) < 8


async def test_closing_the_read_kills_a_hanging_command_and_what_it_started(shards, tmp_path, leaks):
    pids = tmp_path / "pids"
    shard = shards / "shard-000000.tar"
    # The shell, then a child that holds the pipe open: killing the shell alone would leave the
    # parser's thread waiting on the child's output.
    reader = readers.webdataset(f"pipe:echo $$ > {pids}; cat {shard}; sleep 600 & echo $! >> {pids}; wait",
                                chunk_size=4)
    chunks = reader.read(0)
    first = await anext(chunks)
    assert len(first) == 4
    with pytest.raises(TimeoutError):  # the rest: 4 more samples, then the command's output never ends
        async with asyncio.timeout(0.5):
            async for _ in chunks:
                pass
    await chunks.aclose()
    await leaks.check()
    for pid in map(int, pids.read_text().split()):
        for _ in range(100):  # killed at once; the sleep's parent (the shell) reaps nothing once dead
            if not _alive(pid):
                break
            time.sleep(0.01)
        assert not _alive(pid), f"process {pid} outlived the read"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie is dead, waiting for init to reap it
    except (FileNotFoundError, ProcessLookupError):
        return False


async def test_a_command_that_writes_a_byte_at_a_time_is_still_read_whole(shards, tmp_path):
    # The first two bytes decide gzip or tar: a command whose first write is one byte (dd, then a
    # pause, then the rest) must not be taken for a plain tar on that byte alone.
    gz = tmp_path / "shard.tar.gz"
    gz.write_bytes(gzip.compress((shards / "shard-000000.tar").read_bytes()))
    slow = f"(dd if={gz} bs=1 count=1 status=none; sleep 0.2; dd if={gz} bs=64k skip=1 iflag=skip_bytes status=none)"
    samples = await _read(readers.webdataset(f"pipe:{slow}"))
    _same(samples, await _read(readers.webdataset(str(shards / "shard-000000.tar"))))


async def test_a_commands_name_leaves_out_query_strings(shards):
    shard = shards / "shard-000000.tar"
    reader = readers.webdataset(f"pipe:cat {shard} # https://store.example/a.tar?X-Amz-Signature=sekrit")
    samples = await _read(reader)
    assert len(samples) == 8 and all("sekrit" not in s.source for s in samples)
    assert all(s.source.endswith("a.tar?***") for s in samples)
