"""examples/train.py with MixUp, CutMix and timm's RandAugment: it trains on soft labels, and a run
stopped mid-epoch and resumed from its checkpoint goes on with exactly the losses the uninterrupted
run had (the same batches, augmented and mixed the same way, into the same model)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(data: Path, checkpoint: Path, *extra: str) -> list[str]:
    args = [sys.executable, "examples/train.py", "--data", str(data), "--images", "64", "--classes", "4",
            "--size", "32", "--batch-size", "8", "--max-batches", "3", "--epochs", "2", "--threads", "2",
            "--mixup", "0.4", "--cutmix", "1.0", "--aa", "rand-m9-mstd0.5-inc1", "--checkpoint", str(checkpoint), *extra]
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
