"""Lightning's ``Trainer.fit`` on the GPU, fed by a headrace loader on the GPU path
(``examples/lightning_train.py`` run as a user runs it). Lightning is not a dependency: without it
these tests skip and say so."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from headrace import datasets

pytestmark = pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                reason="needs Lightning (pip install lightning)")

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "lightning_train.py"
IMAGES, CLASSES, BATCH = 256, 4, 32  # 8 steps an epoch


@pytest.fixture(scope="module")
def image_data(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("lightning") / "demo"
    datasets.ensure_image_folder(root, count=IMAGES, classes=CLASSES)
    return str(root)


def fit(tmp_path: Path, data: str, *extra: str) -> dict[str, str]:
    args = [sys.executable, str(SCRIPT), "--device", "cuda", "--data", data, "--images", str(IMAGES),
            "--classes", str(CLASSES), "--batch-size", str(BATCH), "--size", "64",
            "--checkpoints", str(tmp_path / "ckpt"), *extra]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = re.search(r"^done: (.*)$", done.stdout, re.M)
    assert line, done.stdout[-2000:]
    return dict(item.split("=", 1) for item in line.group(1).split())


@pytest.mark.parametrize("view", [False, True], ids=["loader.sync", "DataLoader(torch_dataset)"])
def test_fit_on_the_gpu_path(tmp_path, image_data, view):
    done = fit(tmp_path, image_data, "--epochs", "2", *(["--view"] if view else []))
    assert done["device"] == "cuda"
    assert done["steps"] == str(2 * IMAGES // BATCH)
    assert done["samples_this_run"] == str(2 * IMAGES)


def test_resume_mid_epoch_from_a_lightning_checkpoint(tmp_path, image_data):
    """Stop after 5 steps of epoch 0 with a checkpoint, resume: the two runs together see each
    sample of both epochs once (the loader's state travels in Lightning's checkpoint)."""
    first = fit(tmp_path, image_data, "--epochs", "2", "--max-steps", "5", "--save-every", "5")
    assert first["steps"] == "5" and first["samples_this_run"] == str(5 * BATCH)
    (checkpoint,) = (tmp_path / "ckpt").glob("*.ckpt")
    second = fit(tmp_path, image_data, "--epochs", "2", "--resume", str(checkpoint))
    assert second["steps"] == str(2 * IMAGES // BATCH)
    assert int(first["samples_this_run"]) + int(second["samples_this_run"]) == 2 * IMAGES
