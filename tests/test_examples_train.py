"""examples/train.py with MixUp, CutMix and timm's RandAugment, and with AugMix's views and JSD loss
(``--aug-splits 3``): it trains, and a run stopped mid-epoch and resumed from its checkpoint goes on
with exactly the losses the uninterrupted run had (the same batches, augmented and mixed the same
way, into the same model)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


MIXED = ("--mixup", "0.4", "--cutmix", "1.0", "--aa", "rand-m9-mstd0.5-inc1")
JSD = ("--aa", "augmix-m3-w3-d1", "--aug-splits", "3")


def _run(data: Path, checkpoint: Path, *extra: str, recipe: tuple[str, ...] = MIXED) -> list[str]:
    args = [sys.executable, "examples/train.py", "--data", str(data), "--images", "64", "--classes", "4",
            "--size", "32", "--batch-size", "8", "--max-batches", "3", "--epochs", "2", "--threads", "2",
            *recipe, "--checkpoint", str(checkpoint), *extra]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return re.findall(r"^epoch \d+ batch \d+: loss [\d.]+$", done.stdout, flags=re.M)


def test_a_mixed_run_resumes_with_the_uninterrupted_runs_losses(tmp_path):
    data = tmp_path / "data"
    whole = _run(data, tmp_path / "whole.pt")
    assert len(whole) == 6 and len(set(whole)) == 6
    stopped = _run(data, tmp_path / "part.pt", "--stop-after", "4")
    resumed = _run(data, tmp_path / "part.pt", "--resume")
    assert stopped == whole[:4] and resumed == whole[4:]


def test_an_augmix_run_with_its_jsd_views_resumes_with_the_uninterrupted_runs_losses(tmp_path):
    data = tmp_path / "data"
    whole = _run(data, tmp_path / "whole.pt", recipe=JSD)
    assert len(whole) == 6 and len(set(whole)) == 6
    stopped = _run(data, tmp_path / "part.pt", "--stop-after", "2", recipe=JSD)
    resumed = _run(data, tmp_path / "part.pt", "--resume", recipe=JSD)
    assert stopped == whole[:2] and resumed == whole[2:]
