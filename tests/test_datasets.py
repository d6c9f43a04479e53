"""The data sets headrace makes for the demo, the tests and the benchmarks: made once, cached, and
never written into a folder of someone else's files."""

from __future__ import annotations

import subprocess
import sys

import pytest

from headrace import ConfigError, datasets


def test_made_once_then_cached_and_remade_for_another_count(tmp_path):
    root = tmp_path / "data"
    _, made = datasets.ensure_image_folder(root, count=6, classes=2)
    assert made and datasets.count_images(root) == 6 and (root / datasets.MARKER).is_file()
    first = sorted(p.stat().st_mtime_ns for p in root.glob("class_*/*.jpg"))
    _, made = datasets.ensure_image_folder(root, count=6, classes=2)
    assert not made and sorted(p.stat().st_mtime_ns for p in root.glob("class_*/*.jpg")) == first
    _, made = datasets.ensure_image_folder(root, count=4, classes=2)
    assert made and datasets.count_images(root) == 4


def test_a_folder_of_someone_elses_files_is_refused_and_left_alone(tmp_path):
    (tmp_path / "class_00").mkdir()
    mine = tmp_path / "class_00" / "holiday.jpg"
    mine.write_bytes(b"not ours")
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="holds files headrace did not make"):
        datasets.ensure_image_folder(tmp_path, count=4, classes=2)
    assert mine.read_bytes() == b"not ours" and (tmp_path / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["class_00", "holiday.jpg", "notes.txt"]


def test_a_folder_made_before_the_marker_is_recognised(tmp_path):
    datasets.ensure_image_folder(tmp_path, count=4, classes=2)
    (tmp_path / datasets.MARKER).unlink()  # as an older headrace left it
    _, made = datasets.ensure_image_folder(tmp_path, count=4, classes=2)
    assert not made and (tmp_path / datasets.MARKER).is_file()


def test_demo_says_where_its_data_is_and_refuses_a_users_folder(tmp_path):
    data = tmp_path / "demo"
    cmd = [sys.executable, "-m", "headrace", "demo", "--data", str(data), "--images", "16", "--epochs", "1",
           "--batch-size", "8", "--size", "32"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"data: 16 JPEGs in {data} (made now" in done.stdout and "throughput:" in done.stdout
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert f"data: 16 JPEGs in {data} (cached" in again.stdout
    user = tmp_path / "photos"
    user.mkdir()
    (user / "cat.jpg").write_bytes(b"a user's file")
    refused = subprocess.run([*cmd[:5], str(user), *cmd[6:]], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "holds files headrace did not make" in refused.stderr
    assert [p.name for p in user.iterdir()] == ["cat.jpg"]
