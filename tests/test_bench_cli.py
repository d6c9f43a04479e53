"""``headrace bench``: real JPEG folders and shards made by ``headrace pack``; counts and shapes, never speed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from sample_data import make_folder

from headrace import ConfigError
from headrace._bench import bench, render
from headrace.cli import main

ROWS = ["read", "decode", "pipeline"]
NUMBERS = ("seconds", "images_per_second", "mb_per_second", "ratio_to_pipeline")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A folder of 3 classes x 10 JPEGs (a text file named .jpg in c1), and its shards (12 a shard)."""
    base = tmp_path_factory.mktemp("bench")
    src = make_folder(base / "src", classes=3, per_class=10, seed=5)
    assert main(["pack", str(src), str(base / "wds"), "--format", "webdataset", "--shard-count", "12"]) == 0
    bad = make_folder(base / "bad", classes=2, per_class=5, seed=6)
    (bad / "c1" / "text.jpg").write_text("this is not an image\n")
    return base


def _check(report, samples, epochs=2):
    assert [row["name"] for row in report["rows"]] == ROWS
    for row in report["rows"]:
        assert row["samples"] == samples, row["name"]
        assert [e["epoch"] for e in row["epochs"]] == list(range(epochs))
        assert all(e["samples"] == samples for e in row["epochs"])
        assert all(isinstance(row[k], int) for k in ("samples", "bytes", "skipped"))
        assert all(isinstance(row[k], float) for k in NUMBERS), row
        assert row["bytes"] > 0 and row["images_per_second"] > 0
        assert isinstance(row["what"], str)
    read, decode, pipeline = report["rows"]
    assert read["starved_fraction"] is None and read["blocked_fraction"] is None and read["threads"] is None
    for row in (decode, pipeline):
        assert 0.0 <= row["starved_fraction"] <= 1.0 and 0.0 <= row["blocked_fraction"] <= 1.0
        assert isinstance(row["threads"], int)
    assert pipeline["ratio_to_pipeline"] == 1.0
    # Every row moves the same samples, so the same encoded bytes.
    assert read["bytes"] == decode["bytes"] == pipeline["bytes"]


def test_folder_every_row_times_every_sample(data):
    report = bench(str(data / "src"), threads=2, batch_size=8)
    assert report["format"] == "files" and report["epoch_reported"] == "best" and report["threads"] == 2
    _check(report, 30)
    table = render(report)
    for what in ("reader alone (files)", "decode only (Decode)", "whole pipeline (training 224)"):
        assert what in table


def test_shards_with_limit_and_validation(data):
    report = bench(str(data / "wds"), limit=20, pipeline="validation", size=32, batch_size=8, threads=1, epochs=3)
    assert report["format"] == "webdataset" and report["limit"] == 20
    _check(report, 20, epochs=3)
    assert "whole pipeline (validation 32)" in render(report)


def test_bad_sample_is_skipped_and_counted(data):
    report = bench(str(data / "bad"), batch_size=4, threads=1, epochs=1)
    read, decode, pipeline = report["rows"]
    assert read["samples"] == 11 and read["skipped"] == 0
    assert (decode["samples"], decode["skipped"]) == (10, 1) and (pipeline["samples"], pipeline["skipped"]) == (10, 1)
    assert "skipped (failed to read or decode): decode 1, pipeline 1" in render(report)


def test_bad_arguments():
    with pytest.raises(ConfigError):
        bench(".", pipeline="eval")
    with pytest.raises(ConfigError):
        bench(".", epochs=0)


def test_cli_prints_the_table_and_writes_json(data, tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "headrace", "bench", str(data / "wds"), "--limit", "25", "--batch-size", "8",
         "--threads", "1", "--size", "48", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith(f"headrace bench {data / 'wds'} (webdataset): cpu, 1 thread(s), batch 8")
    assert any(line.startswith("reader alone (webdataset)") for line in lines)
    assert any(line.startswith("whole pipeline (training 48)") for line in lines)
    assert "pipeline epoch 2/2: 25 samples" in proc.stderr
    report = json.loads(out.read_text())
    assert set(report) == {"path", "format", "device", "pipeline", "size", "batch_size", "threads", "epochs",
                           "limit", "epoch_reported", "rows"}
    assert (report["device"], report["pipeline"], report["size"], report["limit"]) == ("cpu", "training", 48, 25)
    _check(report, 25)


def test_cli_exit_codes(data, tmp_path, capsys):
    assert main(["bench", str(tmp_path / "missing")]) == 1
    assert "headrace bench: error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", str(data / "src"), "--pipeline", "eval"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["bench", str(data / "src"), "--epochs", "0"])
    assert exc.value.code == 2


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None, reason="matplotlib is installed")
def test_plot_without_matplotlib_says_so(data, tmp_path, capsys):
    assert main(["bench", str(data / "src"), "--plot", str(tmp_path / "b.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "b.png").exists()


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="--plot needs matplotlib, not installed")
def test_plot_writes_a_png(data, tmp_path):
    png = tmp_path / "b.png"
    assert main(["bench", str(data / "src"), "--limit", "10", "--epochs", "1", "--threads", "1",
                 "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
