"""The command line as a new user meets it, third review: Ctrl-C and SIGTERM in the middle of a
loader's epoch, a cut shard in bench's reader row, a GPU asked for on a machine without one, and
an empty PATH."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

from headrace import ConfigError, readers
from headrace._bench import bench
from headrace.cli import main
from headrace.ops import cuda_available

NOISE = ("Traceback", "Task was destroyed", "Exception ignored", "Event loop is closed")


def _stop_when(tmp_path, args, ready, sig):
    """Run ``python -m headrace *args``, send ``sig`` once its stderr matches ``ready``; (rc, stderr)."""
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        run = subprocess.Popen([sys.executable, "-m", "headrace", *map(str, args)], stdout=subprocess.DEVNULL,
                               stderr=err)
        try:
            deadline = time.monotonic() + 120
            while not re.search(ready, err_path.read_text()) and run.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert run.poll() is None, "the command finished before it could be stopped"
            run.send_signal(sig)
            run.wait(timeout=120)
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    return run.returncode, err_path.read_text()


def _stopped_cleanly(rc, err, sig):
    # Before: the interrupt left the event loop with the loader's tasks pending; the loop was
    # closed under them ("Task was destroyed but it is pending!" for each, "Exception ignored"
    # with a RuntimeError traceback from the loader's aclose), so nothing was cleaned up.
    assert rc == (130 if sig == signal.SIGINT else 128 + signal.SIGTERM), err[-3000:]
    assert not any(word in err for word in NOISE), err[-3000:]
    assert err.replace("\r", "\n").strip().splitlines()[-1] == ("interrupted" if sig == signal.SIGINT else "terminated")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_inspect_verify_stopped_midway_unwinds_its_loader(tmp_path, slow_folder, sig):
    report = tmp_path / "report.json"
    rc, err = _stop_when(tmp_path, ["inspect", slow_folder, "--verify", "--threads", "1", "--json", report],
                         r"verifying: .*\| *[1-9]\d*/400", sig)
    _stopped_cleanly(rc, err, sig)
    assert not report.exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_bench_stopped_in_a_loader_row_unwinds_its_loader(tmp_path, slow_folder, sig):
    report = tmp_path / "bench.json"
    rc, err = _stop_when(tmp_path, ["bench", slow_folder, "--threads", "1", "--epochs", "3", "--json", report],
                         r"decode epoch 1/3", sig)
    _stopped_cleanly(rc, err, sig)
    assert not report.exists()


class _Writes(io.RawIOBase):
    """A file that keeps each write it is given, as the operating system sees them."""

    def __init__(self):
        self.writes = []

    def writable(self):
        return True

    def write(self, data):
        self.writes.append(bytes(data))
        return len(data)


def test_bench_writes_each_epoch_line_with_its_newline_at_once(monkeypatch):
    # stderr writes through to the file: a line and its newline written apart (as print does) let
    # the Ctrl-C test above see the line, interrupt, and find "interrupted" on the end of it.
    from headrace import _bench

    raw = _Writes()
    monkeypatch.setattr(sys, "stderr", io.TextIOWrapper(raw, encoding="utf-8", write_through=True))
    _bench._log_line("decode epoch 1/3: 400 samples in 1.85 s, 216 samples/s")
    assert raw.writes == [b"decode epoch 1/3: 400 samples in 1.85 s, 216 samples/s\n"]


def test_demo_stopped_in_an_epoch_unwinds_its_loader(tmp_path):
    rc, err = _stop_when(tmp_path, ["demo", "--data", tmp_path / "demo", "--images", "64", "--epochs", "500",
                                    "--size", "32", "--threads", "1"], r"epoch 1:", signal.SIGINT)
    _stopped_cleanly(rc, err, signal.SIGINT)


@pytest.fixture(scope="module")
def cut_shard(tmp_path_factory):
    """One shard of 30 samples cut inside its 21st sample's image (no index beside it)."""
    base = tmp_path_factory.mktemp("cut")
    rng = np.random.default_rng(3)
    for c in range(2):
        (base / "src" / f"c{c}").mkdir(parents=True)
        for i in range(15):
            pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(base / "src" / f"c{c}" / f"{i:02d}.jpg", quality=90)
    result = readers.pack(base / "src", base / "packed", format="webdataset")
    data = open(result.outputs[0], "rb").read()
    (base / "cut").mkdir()
    start = data.index(b"c1/05.jpg")  # the header of the 21st sample's image
    shard = base / "cut" / "cut.tar"
    shard.write_bytes(data[: start + 512 + 100])  # its header and 100 bytes of the image
    return shard


def test_bench_reader_row_skips_and_counts_an_unreadable_sample(cut_shard):
    report = bench(str(cut_shard), epochs=1, batch_size=8)
    read, decode, pipeline = report["rows"]
    # Before: the reader row timed the unreadable sample as one read (21 samples, 0 skipped) while
    # the loader rows skipped it, so the rows compared different work.
    assert (read["samples"], read["skipped"]) == (20, 1)
    assert (decode["samples"], decode["skipped"]) == (pipeline["samples"], pipeline["skipped"]) == (20, 1)
    assert read["bytes"] == decode["bytes"] == pipeline["bytes"]


@pytest.mark.skipif(cuda_available(), reason="a GPU is here: device='cuda' runs")
def test_bench_refuses_a_missing_gpu_before_timing_anything(image_folder, capsys):
    lines = []
    with pytest.raises(ConfigError, match="device='cuda' needs a GPU"):
        bench(str(image_folder), device="cuda", epochs=1, log=lines.append)
    # Before: the reader row ran its epochs first (minutes on a large data set), then the error.
    assert lines == []
    assert main(["bench", str(image_folder), "--device", "cuda", "--epochs", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("headrace bench: error: device='cuda' needs a GPU") and "read epoch" not in err


@pytest.mark.parametrize("args", [["inspect", ""], ["bench", ""], ["pack", "", "OUT", "--format", "webdataset"],
                                  ["pack", "SRC", "", "--format", "lmdb"]])
def test_an_empty_path_is_an_argument_error(tmp_path, image_folder, capsys, monkeypatch, args):
    monkeypatch.chdir(tmp_path)
    args = [str(image_folder) if a == "SRC" else str(tmp_path / "out") if a == "OUT" else a for a in args]
    # Before: "" was the current folder: inspect and bench read it, pack packed it or packed into it
    # (a "$DATA" left unset in a script).
    with pytest.raises(SystemExit) as stop:
        main(args)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"headrace {args[0]}: error: argument ") and "must not be empty" in err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("where", ["a_file", "a_file/data"])
def test_demo_into_a_path_that_cannot_be_a_folder_is_a_one_line_error(tmp_path, capsys, where):
    (tmp_path / "a_file").write_text("not a folder")
    # Before: a FileExistsError or NotADirectoryError traceback from pathlib's mkdir.
    assert main(["demo", "--data", str(tmp_path / where), "--images", "4", "--epochs", "1"]) == 1
    err = capsys.readouterr().err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith("headrace demo: error: ") and str(tmp_path / "a_file") in last
    assert (tmp_path / "a_file").read_text() == "not a folder"


def test_demo_data_must_not_be_empty(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        main(["demo", "--data", "", "--images", "4", "--epochs", "1"])
    assert stop.value.code == 2 and "argument --data: must not be empty" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def _ftyp(major: bytes, *compatible: bytes) -> bytes:
    body = major + b"\x00\x00\x00\x00" + b"".join(compatible)
    return (8 + len(body)).to_bytes(4, "big") + b"ftyp" + body + b"\x00\x00\x00\x08free"


def test_image_format_tells_videos_from_heif_and_avif(tmp_path):
    from headrace._inspect import image_format

    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "AVIF")  # Pillow's own AVIF: major brand avif
    assert image_format(buffer.getvalue()) == "avif"
    assert image_format(_ftyp(b"heic", b"mif1", b"heic")) == "heif"
    assert image_format(_ftyp(b"mif1", b"mif1", b"avif", b"miaf")) == "avif"
    assert image_format(_ftyp(b"mif1", b"mif1", b"heic")) == "heif"
    # Before: every ISO media file was an image, so MP4 and QuickTime videos were "heif".
    for brand in (b"isom", b"mp42", b"qt  ", b"M4V ", b"3gp4"):
        assert image_format(_ftyp(brand, b"isom", b"mp41")) == "unknown", brand


def test_inspect_video_shards_finds_no_images(tmp_path):
    av = pytest.importorskip("av")
    for cls in ("run", "walk"):
        (tmp_path / "videos" / cls).mkdir(parents=True)
        with av.open(str(tmp_path / "videos" / cls / "v.mp4"), "w") as out:
            stream = out.add_stream("mpeg4", rate=25)
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            for i in range(10):
                frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), 20 * i, np.uint8), format="rgb24")
                out.mux(stream.encode(frame))
            out.mux(stream.encode())
    readers.pack(tmp_path / "videos", tmp_path / "shards", format="webdataset", video=True)
    from headrace._inspect import inspect

    report = inspect(str(tmp_path / "shards"))
    # Before: "image formats (from the bytes): heif 2", the videos counted as images.
    assert report["fields"] == {"cls": 2, "mp4": 2}
    assert report["image_formats"] == {} and report["no_image_field"] == 2



@pytest.mark.parametrize("option", [["--shard-count", "20"], ["--shard-size", "64"], ["--prefix", "train"]])
def test_pack_refuses_shard_options_with_lmdb(tmp_path, image_folder, capsys, option):
    pytest.importorskip("lmdb")
    dest = tmp_path / "db"
    # Before: each was ignored, silently (an LMDB is one database, not shards).
    assert main(["pack", str(image_folder), str(dest), "--format", "lmdb", *option]) == 2
    assert capsys.readouterr().err.strip() == f"headrace pack: error: {option[0]} only apply to --format webdataset"
    assert not dest.exists()


def test_pack_shard_options_default_as_documented(tmp_path, image_folder):
    dest = tmp_path / "wds"
    assert main(["pack", str(image_folder), str(dest), "--format", "webdataset"]) == 0
    assert sorted(p.name for p in dest.glob("*.tar")) == ["shard-000000.tar"]  # prefix "shard"; 75 small images, one shard
