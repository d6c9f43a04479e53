"""examples/stream_s3.py as a user runs it without a bucket: demo shards served by a local store 20 ms
away (a child process), three epochs on the CPU path, the later two read from the copies kept."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "stream_s3.py"


def test_stream_s3_example_keeps_the_shards_and_reads_them_back(tmp_path):
    args = ["--images", "96", "--per-shard", "32", "--size", "32", "--batch-size", "16", "--device", "cpu",
            "--threads", "2", "--latency-ms", "20", "--data", str(tmp_path / "demo"),
            "--cache-dir", str(tmp_path / "cache")]
    done = subprocess.run([sys.executable, str(EXAMPLE), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith("done: ")][-1]
    got = dict(re.findall(r"(\w+)=(\S+)", line))
    assert got == {"epochs": "3", "samples": "288", "shards": "3", "hits": "6", "kept": "3", "failed": "0",
                   "device": "cpu"}
    assert len(list((tmp_path / "cache").iterdir())) == 3  # the copies stay where the user asked
