from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tarfile

import pytest

from headrace import ConfigError, DecodeError, ReadError, readers
from headrace.cli import main
from headrace.readers._shards import INDEX_NAME



def _expected(folder):
    """key → (file bytes, label) for a class-per-folder tree, labelled as readers.files does."""
    classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
    return {f"{c}/{p.stem.replace('.', '_')}": (p.read_bytes(), label)
            for label, c in enumerate(classes) for p in sorted((folder / c).glob("*.jpg"))}


def _tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


async def _read_all(reader):
    return [s async for chunk in reader.read(0) for s in chunk]


@pytest.mark.parametrize(("limits", "shards"), [({"shard_count": 10}, 8), ({"shard_size": 0.05}, None), ({}, 1)])
async def test_webdataset_round_trip_every_byte_under_its_key_and_label(tmp_path, image_folder, limits, shards):
    kw = {"shard_size": None, **limits}
    result = readers.pack(image_folder, tmp_path / "out", format="webdataset", **kw)
    expected = _expected(image_folder)
    assert result.samples == 75 and result.classes == ["c0", "c1", "c2"]
    tars = sorted((tmp_path / "out").glob("*.tar"))
    assert [str(p) for p in tars] == result.outputs and (shards is None or len(tars) == shards)
    index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
    assert [s["samples"] for s in index["shards"]] == [sum(1 for m in tarfile.open(p) if m.name.endswith(".cls"))
                                                       for p in tars]
    if "shard_count" in limits:
        assert max(s["samples"] for s in index["shards"]) <= 10
    if "shard_size" in limits:
        assert len(tars) > 2 and all(p.stat().st_size <= 0.05 * 2**20 or
                                     s["samples"] == 1 for p, s in zip(tars, index["shards"]))
    samples = await _read_all(readers.webdataset(tmp_path / "out"))
    assert {s.key: (s.fields["jpg"], int(s.fields["cls"])) for s in samples} == expected
    assert len(samples) == 75
    # ... and the webdataset library reads the same bytes under the same keys.
    wds = pytest.importorskip("webdataset")
    theirs = {s["__key__"]: (s["jpg"], int(s["cls"])) for s in wds.WebDataset([str(p) for p in tars], shardshuffle=False)}
    assert theirs == expected


async def test_lmdb_round_trip(tmp_path, image_folder):
    pytest.importorskip("lmdb")
    result = readers.pack(image_folder, tmp_path / "db", format="lmdb")
    assert result.samples == 75 and os.listdir(tmp_path / "db") == ["data.mdb"]
    samples = await _read_all(readers.lmdb(tmp_path / "db"))
    assert {s.key: (s.fields["jpg"], int(s.fields["cls"])) for s in samples} == _expected(image_folder)
    assert [s.key for s in samples] == list(_expected(image_folder))  # __keys__ keeps the write order


async def test_shuffle_is_seeded_and_packs_the_same_bytes_twice(tmp_path, image_folder):
    orders = []
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        readers.pack(image_folder, tmp_path / name, format="webdataset", shard_count=25, shuffle=True, seed=seed)
        orders.append([s.key for s in await _read_all(readers.webdataset(tmp_path / name))])
    assert orders[0] == orders[1] != orders[2] and sorted(orders[0]) == sorted(orders[2])
    assert orders[0] != sorted(orders[0])
    for p in (tmp_path / "a").iterdir():  # deterministic output, byte for byte
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes()


def test_command_line(tmp_path, image_folder, capsys):
    pytest.importorskip("lmdb")
    assert main(["pack", str(image_folder), str(tmp_path / "w"), "--format", "webdataset", "--shard-count", "30",
                 "--shuffle", "--seed", "4", "--prefix", "train"]) == 0
    assert sorted(os.listdir(tmp_path / "w")) == [INDEX_NAME, "train-000000.tar", "train-000001.tar", "train-000002.tar"]
    assert "packed 75 samples" in capsys.readouterr().out
    assert main(["pack", str(image_folder), str(tmp_path / "l"), "--format", "lmdb"]) == 0
    assert main(["pack", str(image_folder), str(tmp_path / "l"), "--format", "lmdb"]) == 1  # not empty
    assert "not an empty folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["pack", str(image_folder), str(tmp_path / "x")])  # --format is required


def test_names_with_dots_and_colliding_keys(tmp_path, image_folder):
    src = tmp_path / "src"
    (src / "cat").mkdir(parents=True)
    jpg = next(image_folder.rglob("*.jpg")).read_bytes()
    (src / "cat" / "img.v2.jpg").write_bytes(jpg)
    readers.pack(src, tmp_path / "ok", format="webdataset")
    samples = asyncio.run(_read_all(readers.webdataset(tmp_path / "ok")))
    assert [(s.key, s.fields["jpg"]) for s in samples] == [("cat/img_v2", jpg)]
    (src / "cat" / "img_v2.png").write_bytes(jpg)
    with pytest.raises(ConfigError, match="both be stored"):
        readers.pack(src, tmp_path / "clash", format="webdataset")
    assert not (tmp_path / "clash").exists()


def test_a_class_folder_webdataset_would_skip_is_refused_for_shards(tmp_path, image_folder):
    src = tmp_path / "src"
    for name in ("__background__", "cat"):
        (src / name).mkdir(parents=True)
        (src / name / "0.jpg").write_bytes(next(image_folder.rglob("*.jpg")).read_bytes())
    with pytest.raises(ConfigError, match="__background__/0.*rename that folder"):
        readers.pack(src, tmp_path / "wds", format="webdataset")  # its samples would be read as the format's own
    assert not (tmp_path / "wds").exists()
    readers.pack(src, tmp_path / "db", format="lmdb")  # LMDB keeps every key
    assert len(readers.lmdb(tmp_path / "db")) == 2


def test_nothing_is_written_outside_dest(tmp_path, image_folder):
    pytest.importorskip("lmdb")
    before = _tree(tmp_path)
    readers.pack(image_folder, tmp_path / "w", format="webdataset", shard_count=7)
    readers.pack(image_folder, tmp_path / "l", format="lmdb")
    after = [p for p in _tree(tmp_path) if not p.startswith(("w", "l"))]
    assert after == before
    assert not any(name.startswith(".headrace-") for name in os.listdir(tmp_path / "w"))


@pytest.mark.parametrize(
    "case", ["dest_not_empty", "dest_inside_src", "no_images", "bad_format", "bad_size", "bad_count", "bad_prefix",
             "infinite_size"],
)
def test_wrong_arguments(tmp_path, image_folder, case):
    dest, kw = tmp_path / "out", {"format": "webdataset"}
    src = image_folder
    if case == "dest_not_empty":
        dest.mkdir()
        (dest / "keep.txt").write_text("mine")
    elif case == "dest_inside_src":
        src = tmp_path / "src"
        src.mkdir()
        dest = src / "out"
    elif case == "no_images":
        (tmp_path / "empty" / "a").mkdir(parents=True)
        src = tmp_path / "empty"
    else:
        kw.update({"bad_format": {"format": "zip"}, "bad_size": {"shard_size": 0}, "bad_count": {"shard_count": 0},
                   "bad_prefix": {"prefix": "../up"}, "infinite_size": {"shard_size": float("inf")}}[case])
    with pytest.raises(ReadError if case == "no_images" else ConfigError):
        readers.pack(src, dest, **kw)
    if case == "dest_not_empty":
        assert os.listdir(dest) == ["keep.txt"]
    else:
        assert not dest.exists()


def test_unreadable_source_file_leaves_nothing_behind(tmp_path, image_folder, monkeypatch):
    import headrace.readers._pack as packing

    real = packing._read
    calls = []

    def flaky(path, key):
        calls.append(key)
        if len(calls) == 30:
            raise ReadError("cannot read file: injected", key=key, source=path)
        return real(path, key)

    monkeypatch.setattr(packing, "_read", flaky)
    pytest.importorskip("lmdb")
    for fmt in ("webdataset", "lmdb"):
        calls.clear()
        with pytest.raises(ReadError, match="injected"):
            readers.pack(image_folder, tmp_path / fmt, format=fmt, shard_count=8)
        assert not (tmp_path / fmt).exists()


@pytest.fixture
def bad_folder(tmp_path, image_folder):
    """Two classes of real JPEGs (5 each) plus a text file named .jpg in ``a`` and a JPEG cut in half in ``b``."""
    src = tmp_path / "bad"
    jpegs = sorted(image_folder.rglob("*.jpg"))[:10]
    for i, path in enumerate(jpegs):
        dest = src / "ab"[i % 2] / f"{i:02d}.jpg"
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(path.read_bytes())
    (src / "a" / "text.jpg").write_text("not an image\n")
    (src / "b" / "cut.jpg").write_bytes(jpegs[0].read_bytes()[:900])
    return src


def test_without_verify_every_file_is_packed_unread(tmp_path, bad_folder):
    result = readers.pack(bad_folder, tmp_path / "w", format="webdataset")
    assert result.samples == 12 and result.skipped == []


@pytest.mark.parametrize("fmt", ["webdataset", "lmdb"])
def test_verify_raise_names_the_first_bad_file_and_writes_nothing(tmp_path, bad_folder, fmt):
    if fmt == "lmdb":
        pytest.importorskip("lmdb")
    with pytest.raises(DecodeError, match="does not decode") as caught:
        readers.pack(bad_folder, tmp_path / "out", format=fmt, verify="raise", shard_count=3)
    assert caught.value.source == str(bad_folder / "a" / "text.jpg") and caught.value.key == "a/text"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["webdataset", "lmdb"])
async def test_verify_skip_leaves_out_and_lists_the_bad_files(tmp_path, bad_folder, fmt):
    if fmt == "lmdb":
        pytest.importorskip("lmdb")
    done = []
    result = readers.pack(bad_folder, tmp_path / "out", format=fmt, verify="skip", verify_threads=2, shard_count=4,
                          progress=lambda n, total: done.append((n, total)))
    assert result.samples == 10
    assert [path for path, _ in result.skipped] == [str(bad_folder / "a" / "text.jpg"), str(bad_folder / "b" / "cut.jpg")]
    assert "not an image format" in result.skipped[0][1] and "EOI" in result.skipped[1][1]
    assert done[-1] == (12, 12)
    reader = readers.webdataset(tmp_path / "out") if fmt == "webdataset" else readers.lmdb(tmp_path / "out")
    assert len(reader) == 10
    keys = sorted(s.key for s in await _read_all(reader))
    assert keys == sorted(f"{'ab'[i % 2]}/{i:02d}" for i in range(10))
    if fmt == "webdataset":
        index = json.loads((tmp_path / "out" / INDEX_NAME).read_text())
        assert [s["samples"] for s in index["shards"]] == [4, 4, 2]


def test_verify_when_nothing_decodes_and_wrong_values(tmp_path):
    (tmp_path / "src" / "a").mkdir(parents=True)
    (tmp_path / "src" / "a" / "x.jpg").write_text("no")
    with pytest.raises(DecodeError, match="none of the 1 files decodes"):
        readers.pack(tmp_path / "src", tmp_path / "out", format="webdataset", verify="skip")
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="verify"):
        readers.pack(tmp_path / "src", tmp_path / "out", format="webdataset", verify=True)


def test_verify_on_the_command_line(tmp_path, bad_folder):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "headrace", "pack", *args], capture_output=True, text=True,
                              timeout=300)

    refused = run("--verify", str(bad_folder), str(tmp_path / "r"), "--format", "webdataset")  # bare --verify: raise
    assert refused.returncode == 1
    assert str(bad_folder / "a" / "text.jpg") in refused.stderr and "--verify=skip" in refused.stderr
    assert not (tmp_path / "r").exists()
    skipped = run(str(bad_folder), str(tmp_path / "s"), "--format", "lmdb", "--verify=skip")
    assert skipped.returncode == 0, skipped.stderr
    assert "packed 10 samples" in skipped.stdout and "skipped 2 file(s) that do not decode" in skipped.stdout
    assert str(bad_folder / "b" / "cut.jpg") in skipped.stdout
    spaced = run(str(bad_folder), str(tmp_path / "s2"), "--format", "lmdb", "--verify", "skip")  # as the usage shows
    assert spaced.returncode == 0 and "packed 10 samples" in spaced.stdout, spaced.stderr
    infinite = run(str(bad_folder), str(tmp_path / "i"), "--format", "webdataset", "--shard-size", "inf")
    assert infinite.returncode == 2 and "non-negative number of megabytes" in infinite.stderr  # an argument error
    plain = run(str(bad_folder), str(tmp_path / "p"), "--format", "webdataset")
    assert plain.returncode == 0 and "packed 12 samples" in plain.stdout
    assert "--verify" in run("--help").stdout and "decode every file" in run("--help").stdout
