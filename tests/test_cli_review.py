"""The command line as a user meets it: a stopped ``pack``, shard sizes with any file name, and
errors that are one line, not a traceback."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tarfile
import time

import pytest
from PIL import Image

from headrace import readers
from headrace.cli import main


def _headrace(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "headrace", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def _partly_written(dest, fmt: str) -> bool:
    """A finished shard is there, or (LMDB) the first 256-sample transaction has been committed."""
    if not dest.is_dir():
        return False
    if fmt == "webdataset":
        return any(name.endswith(".tar") for name in os.listdir(dest))
    return (dest / "data.mdb").is_file() and (dest / "data.mdb").stat().st_size > 1 << 20


@pytest.mark.parametrize("fmt", ["webdataset", "lmdb"])
def test_sigterm_stops_pack_and_leaves_nothing_a_reader_takes_as_whole(tmp_path, slow_folder, fmt):
    if fmt == "lmdb":
        pytest.importorskip("lmdb")
    dest = tmp_path / "out"
    shards = ["--shard-count", "20"] if fmt == "webdataset" else []  # an LMDB has no shards
    run = _headrace("pack", str(slow_folder), str(dest), "--format", fmt, *shards, "--verify", "--threads", "1")
    while not _partly_written(dest, fmt) and run.poll() is None:
        time.sleep(0.005)
    assert run.poll() is None, "pack finished before it could be stopped"
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=120)
    # Before: the process died on the spot, leaving finished shards without an index (or an LMDB
    # without __keys__) that the readers read as the whole data set, and a DEST a rerun refused.
    assert run.returncode == 128 + signal.SIGTERM
    assert err.splitlines()[-1] == "terminated" and "Traceback" not in err
    assert not dest.exists()


def test_shard_size_holds_for_names_that_need_a_pax_header(tmp_path):
    src = tmp_path / "src" / "kätze"
    src.mkdir(parents=True)
    for i in range(120):
        Image.new("RGB", (8, 8), (i, 0, 0)).save(src / f"bild {i}.png")
    limit = 0.05 * 2**20
    result = readers.pack(tmp_path / "src", tmp_path / "out", format="webdataset", shard_size=0.05)
    # Before: each non-ASCII member's pax header (two blocks) went uncounted and shards came out
    # at 90 KiB against a 51.2 KiB limit.
    sizes = [os.path.getsize(p) for p in result.outputs]
    assert len(sizes) > 2 and max(sizes) <= limit
    members = [m.name for p in result.outputs for m in tarfile.open(p)]
    assert len(members) == 240 and "kätze/bild 7.png" in members
    samples = asyncio.run(_read_all(readers.webdataset(tmp_path / "out")))
    assert len(samples) == 120


async def _read_all(reader):
    return [s async for chunk in reader.read(0) for s in chunk]


def test_pack_to_a_dest_that_cannot_be_made_is_a_one_line_error(tmp_path, image_folder):
    (tmp_path / "a_file").write_text("not a folder")
    run = _headrace("pack", str(image_folder), str(tmp_path / "a_file" / "out"), "--format", "webdataset")
    out, err = run.communicate(timeout=120)
    assert run.returncode == 1
    assert "Traceback" not in err and err.strip().splitlines() == [err.strip()]
    assert err.startswith("headrace pack: error:") and "Not a directory" in err


@pytest.mark.parametrize(("command", "option"), [("bench", "--json"), ("bench", "--plot"), ("inspect", "--json")])
def test_an_output_file_that_cannot_be_written_is_refused_before_the_run(tmp_path, image_folder, capsys, command,
                                                                         option):
    if option == "--plot":
        pytest.importorskip("matplotlib")
    missing = str(tmp_path / "no_such_folder" / "report.out")
    args = [command, str(image_folder), option, missing] + (["--epochs", "1"] if command == "bench" else [])
    # Before: the whole run (minutes of timing, for a bench) went by, then a traceback-free error
    # threw its results away.
    assert main(args) == 1
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing was read or timed
    assert captured.err == f"headrace {command}: error: {option} {missing}: no such folder {tmp_path / 'no_such_folder'}\n"
    assert main([command, str(image_folder), option, str(tmp_path)]) == 1
    assert "is a folder, not a file" in capsys.readouterr().err


def test_a_failed_pack_removes_the_parent_folders_it_made_for_dest(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.jpg").write_text("not an image")
    run = _headrace("pack", str(tmp_path / "src"), str(tmp_path / "new" / "deeper" / "out"), "--format", "webdataset",
                    "--verify")
    out, err = run.communicate(timeout=120)
    assert run.returncode == 1 and "nothing was written" in err
    # Before: DEST was removed but new/deeper, made for it, stayed behind.
    assert sorted(os.listdir(tmp_path)) == ["src"]
