"""``headrace inspect``: real folders, real shards and a real LMDB made by ``headrace pack``, with bad files."""

from __future__ import annotations

import functools
import http.server
import io
import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from sample_data import make_folder, recordio_record, write_recordio
from PIL import Image

from headrace import readers
from headrace._inspect import image_format, inspect, render
from headrace.cli import main

BAD = {"c1/text", "c2/cut"}


def _png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.full((height, width, 3), 128, np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Classes c0 (8 JPEGs + a 300x200 PNG), c1 (6 JPEGs + a text file named .jpg), c2 (8 JPEGs + a
    JPEG cut in half): 25 samples, 9 / 7 / 9 per class; and the same packed as shards and as an LMDB."""
    base = tmp_path_factory.mktemp("inspect")
    src = make_folder(base / "src", classes=3, per_class=8, seed=3)
    (src / "c1" / "0006.jpg").unlink()
    (src / "c1" / "0007.jpg").unlink()
    (src / "c0" / "wide.png").write_bytes(_png(300, 200))
    (src / "c1" / "text.jpg").write_text("this is not an image\n")
    whole = (src / "c2" / "0000.jpg").read_bytes()
    (src / "c2" / "cut.jpg").write_bytes(whole[: len(whole) // 2])
    readers.pack(src, base / "wds", format="webdataset", shard_count=10)
    pytest.importorskip("lmdb")
    readers.pack(src, base / "db", format="lmdb")
    return base


def _bad(report):
    return {b["key"]: (b["source"], b["error"]) for b in report["bad"]}


def test_folder_counts_classes_formats_sizes_and_files(data):
    src = data / "src"
    report = inspect(str(src))
    assert report["format"] == "files" and report["samples"] == 25
    assert report["fields"] == {"cls": 25, "jpg": 24, "png": 1}
    classes = report["classes"]
    assert classes["count"] == 3 and classes["names"] == ["c0", "c1", "c2"]
    assert classes["per_class"] == {"0": 9, "1": 7, "2": 9}
    assert (classes["min"], classes["median"], classes["max"]) == (7, 9, 9)
    assert report["image_formats"] == {"jpeg": 23, "png": 1, "unknown": 1}  # the text file's name says jpg
    sizes = report["image_sizes"]
    assert sizes["read"] == 24  # every header but the text file's (the cut JPEG's header is whole)
    assert sizes["width"]["max"] == 300 and sizes["height"]["max"] == 200
    sides = {(r["from"], r["to"]): r["count"] for r in sizes["shorter_side"]["histogram"]}
    assert sum(sides.values()) == 24 and sides[(128, 256)] == 1  # the PNG; the JPEGs are 40-119 px
    assert sizes["megapixels"]["histogram"] == [{"from": 0.0, "to": 0.1, "count": 24}]
    on_disk = sorted(p.stat().st_size for p in src.rglob("*") if p.is_file())
    storage = report["storage"]
    assert storage["kind"] == "files" and storage["count"] == 25 and storage["bytes"] == sum(on_disk)
    assert (storage["min"], storage["max"]) == (on_disk[0], on_disk[-1])
    assert report["verified"] is False and report["bad"] == []
    text = render(report)
    assert "samples: 25" in text and "jpeg 23, png 1, unknown 1" in text and "min 7, median 9, max 9" in text


def test_verify_lists_the_bad_samples(data):
    report = inspect(str(data / "src"), verify=True)
    src = data / "src"
    assert _bad(report) == {"c1/text": (str(src / "c1" / "text.jpg"), "DecodeError"),
                            "c2/cut": (str(src / "c2" / "cut.jpg"), "DecodeError")}
    assert report["samples"] == 25 and report["verified"] is True


def test_limit_looks_at_the_first_samples_only(data):
    report = inspect(str(data / "src"), limit=5, verify=True)
    assert report["samples"] == 5 and report["limit"] == 5
    assert report["classes"]["per_class"] == {"0": 5} and report["bad"] == []
    assert "the first 5 only" in render(report)


def test_shards_folder_and_glob(data):
    shards = sorted((data / "wds").glob("*.tar"))
    assert len(shards) == 3
    for path in (str(data / "wds"), str(data / "wds" / "shard-*.tar")):
        report = inspect(path, verify=True)
        assert report["format"] == "webdataset" and report["samples"] == 25
        assert report["classes"]["per_class"] == {"0": 9, "1": 7, "2": 9}
        assert report["classes"]["names"] == ["c0", "c1", "c2"]  # from the index pack wrote
        assert report["image_formats"] == {"jpeg": 23, "png": 1, "unknown": 1}
        storage = report["storage"]
        assert storage["kind"] == "shards" and storage["count"] == 3
        assert storage["bytes"] == sum(p.stat().st_size for p in shards)
        assert set(_bad(report)) == BAD
        assert all(source.startswith(str(data / "wds" / "shard-")) for source, _ in _bad(report).values())


def test_lmdb(data):
    report = inspect(str(data / "db"), verify=True)
    assert report["format"] == "lmdb" and report["samples"] == 25
    assert report["classes"]["names"] == ["c0", "c1", "c2"] and report["classes"]["count"] == 3
    assert report["storage"]["bytes"] == (data / "db" / "data.mdb").stat().st_size
    assert set(_bad(report)) == BAD
    assert {source for source, _ in _bad(report).values()} == {str(data / "db")}


@pytest.mark.parametrize("layout", ["imagenet", "other"])
def test_tfrecord_files_are_recognised_by_their_bytes(data, tmp_path, layout):
    writer_module = pytest.importorskip("tfrecord.writer")
    folder = tmp_path / "tfr"
    folder.mkdir()
    ref = readers.files(data / "src")
    image, label = ("image/encoded", "image/class/label") if layout == "imagenet" else ("pixels", "class")
    for part in range(2):  # no extension, as TensorFlow's scripts name them
        writer = writer_module.TFRecordWriter(str(folder / f"train-{part:05d}-of-00002"))
        for path, cls in list(zip(ref.paths, ref.labels))[part::2]:
            writer.write({image: (open(path, "rb").read(), "byte"), label: (cls, "int")})
        writer.close()
    for path in (str(folder), str(folder / "train-{00000..00001}-of-00002")):
        report = inspect(path, verify=True)
        assert report["format"] == "tfrecord" and report["samples"] == 25
        assert report["image_formats"] == {"jpeg": 23, "png": 1, "unknown": 1}  # the text file's bytes
        assert len(report["bad"]) == 2  # the text file and the cut JPEG, as from the folder
        storage = report["storage"]
        assert storage["kind"] == "tfrecord" and storage["count"] == 2
        assert storage["bytes"] == sum(p.stat().st_size for p in folder.iterdir())
        if layout == "imagenet":  # read as jpg + cls: the classes are counted
            assert report["fields"] == {"cls": 25, "jpg": 25} and report["classes"]["per_class"] == {"0": 9, "1": 7, "2": 9}
        else:  # the feature holding images (found by their bytes) read as jpg, the label unknown
            assert report["fields"] == {"jpg": 25} and report["classes"]["count"] == 0
    assert "TFRecord files" in render(report) and "2 TFRecord file(s)" in render(report)


def test_recordio_files(data, tmp_path):
    ref = readers.files(data / "src")
    items = [recordio_record(cls, open(path, "rb").read()) for path, cls in zip(ref.paths, ref.labels)]
    write_recordio(tmp_path / "train.rec", items)
    report = inspect(str(tmp_path), verify=True)
    assert report["format"] == "recordio" and report["samples"] == 25
    assert report["classes"]["per_class"] == {"0": 9, "1": 7, "2": 9}
    # A record's image field is named by its bytes: the text file's is "bin", a sample without an image
    assert report["image_formats"] == {"jpeg": 23, "png": 1} and report["no_image_field"] == 1
    assert report["fields"] == {"bin": 1, "cls": 25, "jpg": 23, "png": 1} and len(report["bad"]) == 2
    assert report["storage"] == {**report["storage"], "kind": "recordio", "count": 1,
                                 "bytes": (tmp_path / "train.rec").stat().st_size}
    assert "RecordIO files" in render(report)


def test_shards_over_http(data):
    pytest.importorskip("aiohttp")
    handler = functools.partial(_QuietHandler, directory=str(data / "wds"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/shard-{{000000..000002}}.tar"
        report = inspect(url, verify=True)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert report["format"] == "webdataset" and report["samples"] == 25
    assert report["classes"]["per_class"] == {"0": 9, "1": 7, "2": 9}
    assert report["storage"]["count"] == 3 and report["storage"]["bytes"] is None  # remote: not listed
    assert set(_bad(report)) == BAD


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def test_command_line_verify_json_and_exit_status(data, tmp_path):
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "headrace", "inspect", str(data / "wds"), "--verify", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    assert "samples: 25" in run.stdout and "bad samples: 2" in run.stdout
    assert "c1/text" in run.stdout and "c2/cut" in run.stdout and "DecodeError" in run.stdout
    saved = json.loads(out.read_text())
    assert saved["samples"] == 25 and saved["classes"]["per_class"] == {"0": 9, "1": 7, "2": 9}
    assert {b["key"] for b in saved["bad"]} == BAD and saved["storage"]["count"] == 3
    # Without --verify nothing is decoded: the bytes are all readable, so the exit status is 0.
    run = subprocess.run([sys.executable, "-m", "headrace", "inspect", str(data / "src"), "--limit", "9"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "samples: 9 (the first 9 only" in run.stdout and "classes: 1 of 3 named (c0)" in run.stdout


def test_command_line_errors(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "missing")]) == 1
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["inspect", str(tmp_path / "empty"), "--format", "webdataset"]) == 1
    assert "no *.tar shards" in capsys.readouterr().err


def test_image_format_reads_the_magic_not_the_name():
    img = Image.fromarray(np.zeros((5, 7, 3), np.uint8))
    for fmt, name in (("JPEG", "jpeg"), ("PNG", "png"), ("GIF", "gif"), ("WEBP", "webp"), ("BMP", "bmp"),
                      ("TIFF", "tiff"), ("PPM", "pnm")):
        buf = io.BytesIO()
        img.save(buf, fmt)
        assert image_format(buf.getvalue()) == name
    assert image_format(b"<html>not found</html>") == image_format(b"") == "unknown"
