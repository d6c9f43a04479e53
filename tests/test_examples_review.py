"""The examples meant for a GPU, asked for one on a machine without the GPU path, say so in one line.

A new user who copies an example's ``--device cuda`` command onto a CPU machine should read what is
missing and what to run instead, not a traceback from inside the loader (nor, for the fuzz harness,
a crash "isolated" input by input).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from headrace import ops

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(ops.cuda_available(), reason="the GPU path is here: these commands would run")

# Each command would otherwise make its data set or start a server before it fails.
GPU_COMMANDS = {
    "captions": ["examples/captions.py", "--device", "cuda"],
    "gpu_augment": ["examples/gpu_augment.py", "--device", "cuda"],
    "torch_dataset": ["examples/torch_dataset.py", "--device", "cuda"],
    "stream_s3": ["examples/stream_s3.py", "--device", "cuda"],
    "serve": ["examples/serve.py", "--device", "cuda", "--port", "0"],
    "train_distributed": ["examples/train_distributed.py", "--device", "cuda"],
    "fuzz": ["examples/fuzz.py", "--device", "cuda", "--count", "4"],
    "gpu_culprit": ["examples/gpu_culprit.py", "find"],
    "guard_pages": ["examples/guard_pages.py", "700", "4"],
}


def run_example(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(GPU_COMMANDS))
def test_a_gpu_run_without_a_gpu_is_refused_in_one_line(name):
    done = run_example(GPU_COMMANDS[name])
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "needs a CUDA GPU" in done.stderr
    assert done.stdout == ""  # refused before any work: no data set made, no server started


def test_the_refusal_names_the_cpu_alternative():
    done = run_example(GPU_COMMANDS["captions"])
    assert "--device cpu" in done.stderr
