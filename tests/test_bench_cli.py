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


def _check(report, samples, epochs=2, dataloader=False):
    assert [row["name"] for row in report["rows"]] == ROWS + ["dataloader"] * dataloader
    for row in report["rows"]:
        assert row["samples"] == samples, row["name"]
        assert [e["epoch"] for e in row["epochs"]] == list(range(epochs))
        assert all(e["samples"] == samples for e in row["epochs"])
        assert all(isinstance(row[k], int) for k in ("samples", "bytes", "skipped"))
        assert all(isinstance(row[k], float) for k in NUMBERS), row
        assert row["bytes"] > 0 and row["images_per_second"] > 0
        assert isinstance(row["what"], str)
    read, decode, pipeline = report["rows"][:3]
    assert read["starved_fraction"] is None and read["blocked_fraction"] is None and read["threads"] is None
    for row in (decode, pipeline):
        assert 0.0 <= row["starved_fraction"] <= 1.0 and 0.0 <= row["blocked_fraction"] <= 1.0
        assert isinstance(row["threads"], int)
    assert pipeline["ratio_to_pipeline"] == 1.0
    # Every row moves the same samples, so the same encoded bytes.
    assert read["bytes"] == decode["bytes"] == pipeline["bytes"]
    if not dataloader:
        assert all(row["ratio_to_dataloader"] is None for row in report["rows"])
        return
    torch_row = report["rows"][3]
    assert torch_row["bytes"] == pipeline["bytes"] and torch_row["ratio_to_dataloader"] == 1.0
    assert torch_row["starved_fraction"] is None and torch_row["blocked_fraction"] is None
    for row in report["rows"]:
        assert row["ratio_to_dataloader"] == pytest.approx(row["images_per_second"] / torch_row["images_per_second"])


def _bench_cli(*args, timeout=120):
    """``python -m headrace bench ...`` in its own process (the DataLoader row forks its workers)."""
    proc = subprocess.run([sys.executable, "-m", "headrace", "bench", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return proc


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


def test_cli_dataloader_row_reads_the_folder_by_path(data, tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench_cli(data / "src", "--dataloader", "--batch-size", "8", "--threads", "2", "--size", "48",
                      "--json", out)
    report = json.loads(out.read_text())
    _check(report, 30, dataloader=True)
    torch_row = report["rows"][3]
    assert (torch_row["name"], torch_row["threads"], torch_row["reads"]) == ("dataloader", 2, "files opened by path")
    assert torch_row["what"] == "torch DataLoader (2 workers, by path)" and torch_row["skipped"] == 0
    lines = proc.stdout.splitlines()
    assert "vs DataLoader" in lines[1]
    assert any(line.startswith("torch DataLoader (2 workers, by path)") and line.split()[6] == "30" for line in lines)
    assert lines[-1] == ("torch DataLoader: Pillow decode and torchvision-style training transforms in 2 persistent "
                         "worker process(es), files opened by path")
    assert "dataloader epoch 2/2: 30 samples" in proc.stderr


def test_cli_dataloader_row_on_shards_reads_from_memory(data, tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench_cli(data / "wds", "--dataloader", "--pipeline", "validation", "--limit", "20", "--batch-size", "8",
                      "--threads", "1", "--size", "32", "--epochs", "1", "--json", out)
    report = json.loads(out.read_text())
    _check(report, 20, epochs=1, dataloader=True)
    assert report["rows"][3]["reads"] == "encoded samples held in memory"
    assert "(read once before timing: this row does not pay for reading)" in proc.stdout


def test_cli_dataloader_row_skips_what_does_not_decode(data, tmp_path):
    out = tmp_path / "bench.json"
    proc = _bench_cli(data / "bad", "--dataloader", "--batch-size", "4", "--threads", "1", "--epochs", "1",
                      "--json", out)
    rows = {row["name"]: row for row in json.loads(out.read_text())["rows"]}
    assert (rows["pipeline"]["samples"], rows["pipeline"]["skipped"]) == (10, 1)
    assert (rows["dataloader"]["samples"], rows["dataloader"]["skipped"]) == (10, 1)
    assert rows["dataloader"]["bytes"] == rows["pipeline"]["bytes"]
    assert "skipped (failed to read or decode): decode 1, pipeline 1, dataloader 1" in proc.stdout


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
