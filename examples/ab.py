"""Run one benchmark command against several commits of headrace, their turns alternated, in one lease.

Machines of one kind differ by up to 1.5× and drift within a lease, so a change is measured against
the code before it on the same machine, turn by turn (A1 B1 B2 A2 ...), not against a number from
another day. Each commit's package is exported with ``git archive`` into ``.data/ab/LABEL`` (laid
out as ``pyproject.toml`` maps it) and put first on ``PYTHONPATH`` for its turns; the command's
child processes inherit it. ``{label}`` and ``{turn}`` in the command are filled in (for its
output files); ``VAR=value`` after a commit sets an environment variable for that arm only.

    python examples/ab.py --arm base=2df4372 --arm new=HEAD --turns 3 -- \\
        python examples/benchmark_latency.py --pipeline cuda --rounds 1 --rows shards --out out/{label}{turn}.json
    python examples/ab.py --arm a=HEAD --arm pad=HEAD:MALLOC_TOP_PAD_=268435456 -- python examples/benchmark_gpu.py --rows train

It prints each turn's last lines (``--tail``) and, at the end, how long each turn took.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# pyproject.toml's package-dir: the folders that make the headrace package.
PACKAGE = {"stream": "headrace", "readers": "headrace/readers", "ops": "headrace/ops"}


def export(rev: str, into: Path) -> Path:
    """headrace as it was at ``rev``, importable from the returned folder."""
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, *PACKAGE],
                             check=True, capture_output=True).stdout
    tar = into / "src.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        for member in t.getmembers():
            top, _, rest = member.name.partition("/")
            if top in PACKAGE:
                member.name = f"{PACKAGE[top]}/{rest}" if rest else PACKAGE[top]
                t.extract(member, into / "pkg", filter="data")
    tar.unlink()
    return into / "pkg"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", action="append", required=True,
                        help="LABEL=REV[:VAR=value,...]: a commit to run, and environment for it alone")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--tail", type=int, default=12, help="lines of each turn's output to print")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    arms = []
    for spec in args.arm:
        label, _, rest = spec.partition("=")
        rev, _, env = rest.partition(":")
        extra = dict(item.split("=", 1) for item in env.split(",") if item)
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True,
                             capture_output=True, text=True).stdout.strip()
        arms.append((label, sha, export(sha, ROOT / ".data" / "ab" / label), extra))
        print(f"{label}: {sha} {extra or ''}", flush=True)
    took = []
    for turn in range(1, args.turns + 1):
        for label, sha, pkg, extra in arms if turn % 2 else reversed(arms):  # A B, then B A: drift falls on both
            env = {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(
                [str(pkg), *filter(None, [os.environ.get("PYTHONPATH")])])}
            argv = [part.format(label=label, turn=turn) for part in command]
            began = time.perf_counter()
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            took.append((f"{label}{turn}", time.perf_counter() - began, done.returncode))
            lines = (done.stdout + done.stderr).rstrip().splitlines()
            print(f"=== {label}{turn} ({sha}) exit {done.returncode}", *lines[-args.tail:], sep="\n", flush=True)
    print("turns:", ", ".join(f"{name} {seconds:.0f} s" + (f" (exit {rc})" if rc else "") for name, seconds, rc in took))
    sys.exit(max(rc for _, _, rc in took))


if __name__ == "__main__":
    main()
