"""The user-stage examples run as a reader would run them (a subprocess, the CPU path, tiny sizes) and
check themselves: captions.py (a tokenizer stage, sync and async, over shards it writes),
gpu_augment.py (a batch stage after ops.training), torch_dataset.py (a torch Dataset as the source)
and lightning_train.py (Trainer.fit over loader.sync(); or its message when Lightning is missing)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from headrace import datasets

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
IMAGES, CLASSES = 48, 4
TINY = ["--device", "cpu", "--threads", "2", "--epochs", "2", "--batch-size", "8", "--size", "32"]


@pytest.fixture(scope="module")
def image_data(tmp_path_factory) -> str:
    """A small demo folder, made once: the examples find it already made (same count and classes)."""
    root = tmp_path_factory.mktemp("examples") / "demo"
    datasets.ensure_image_folder(root, count=IMAGES, classes=CLASSES, short_side=(48, 96))
    return str(root)


def run(script: str, *args: str, cwd: Path) -> tuple[dict[str, str], str]:
    """Run ``examples/<script>``; its ``done:`` line as a dict, and all it printed."""
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    last = [line for line in done.stdout.splitlines() if line.startswith("done: ")]
    assert last, out[-3000:]
    return dict(re.findall(r"(\w+)=(\([^)]*\)|\S+)", last[-1])), out


@pytest.mark.parametrize("stage", ["sync", "async"])
def test_captions_tokenizer_stage(tmp_path, stage):
    extra = ["--async-tokenizer", "--latency", "0.001", "--concurrency", "4"] if stage == "async" else []
    done, out = run("captions.py", *TINY, "--images", "40", "--per-shard", "16", "--max-len", "24",
                    "--data", str(tmp_path / "shards"), *extra, cwd=tmp_path)
    assert sorted(p.name for p in (tmp_path / "shards").iterdir()) == [f"captions-{i:06d}.tar" for i in range(3)]
    # every sample of both epochs came out once, its tokens decoding to the caption written for its key
    assert done["samples"] == done["captions_checked"] == "80" and done["batches"] == "10"
    assert (done["stage"], done["device"]) == (stage, "cpu")
    assert done["tokens"] == "(8, 24)" and done["image"] == "(8, 3, 32, 32)"


def test_gpu_augment_batch_stage(tmp_path, image_data):
    done, out = run("gpu_augment.py", *TINY, "--data", image_data, "--images", str(IMAGES), "--classes",
                    str(CLASSES), "--cutout", "0.5", "--check", cwd=tmp_path)
    assert done["samples"] == str(2 * IMAGES) and done["batches"] == "12" and done["image"] == "(8, 3, 32, 32)"
    assert done["deterministic"] == "yes"  # epoch 0 again with another thread count: the same images
    covered = re.search(r"cutout covered ([\d.]+)% of the pixels .*: ([\d.]+)%\)", out)
    assert covered and float(covered[2]) == 25.0  # a 16x16 square in 32x32
    assert abs(float(covered[1]) - 25.0) < 0.2  # the zeroed pixels are the cutouts


@pytest.mark.parametrize("items", ["paths", "bytes"])
def test_torch_dataset_source(tmp_path, image_data, items):
    done, out = run("torch_dataset.py", *TINY, "--data", image_data, "--images", str(IMAGES), "--classes",
                    str(CLASSES), "--items", items, "--check-resume", cwd=tmp_path)
    assert f"LabelledImages: {IMAGES} items" in out
    assert out.count(f"each of the {IMAGES} items once") == 2  # each epoch, with the Dataset's labels
    assert done["samples"] == str(2 * IMAGES) and done["items"] == items and done["resume"] == "exact"


def test_lightning_example(tmp_path, image_data):
    args = [str(EXAMPLES / "lightning_train.py"), "--device", "cpu", "--threads", "2", "--data", image_data,
            "--images", str(IMAGES), "--classes", str(CLASSES), "--size", "32", "--batch-size", "8",
            "--epochs", "2", "--limit-batches", "4"]
    done = subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
        assert done.returncode == 1 and "pip install lightning" in done.stderr
        return
    assert done.returncode == 0, done.stderr[-3000:]
    assert "done: steps=8 samples_this_run=64 device=cpu via=loader.sync()" in done.stdout
