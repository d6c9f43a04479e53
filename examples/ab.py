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

Where the command runs has no git history (a lent GPU machine gets a copy of the working tree),
export the arms first and take them along: ``--export-only`` writes each ``LABEL=REV`` arm's package
under ``--into`` (``.data/ab``) and runs nothing; there, ``LABEL=@FOLDER`` runs an arm from such a
folder, and ``LABEL=@`` from the headrace installed there (the working tree, installed editable):

    python examples/ab.py --export-only --arm base=330697c                     # here
    python examples/ab.py --arm base=@.data/ab/base/pkg --arm new=@ --turns 2 -- python examples/benchmark_latency.py ...
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
                        help="LABEL=REV[:VAR=value,...]: a commit to run, and environment for it alone; "
                        "LABEL=@FOLDER: a package --export-only wrote; LABEL=@: the headrace installed")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--tail", type=int, default=12, help="lines of each turn's output to print")
    parser.add_argument("--export-only", action="store_true", help="write the arms' packages under --into, run nothing")
    parser.add_argument("--into", type=Path, default=ROOT / ".data" / "ab", help="where arms are exported (a folder each)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command and not args.export_only:
        parser.error("give the command after --")
    arms = []
    for spec in args.arm:
        label, _, rest = spec.partition("=")
        rev, _, env = rest.partition(":")
        extra = dict(item.split("=", 1) for item in env.split(",") if item)
        if rev.startswith("@"):  # exported before (no git here), or the installed package itself
            pkg = Path(rev[1:]).resolve() if rev[1:] else None
            if pkg is not None and not (pkg / "headrace").is_dir():
                parser.error(f"{label}: {pkg} holds no exported headrace package (--export-only writes one)")
            arms.append((label, rev, pkg, extra))
        else:
            sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True,
                                 capture_output=True, text=True).stdout.strip()
            arms.append((label, sha, export(sha, args.into / label), extra))
        print(f"{label}: {arms[-1][1]} {arms[-1][2] or 'installed'} {extra or ''}", flush=True)
    if args.export_only:
        return
    took = []
    for turn in range(1, args.turns + 1):
        for label, sha, pkg, extra in arms if turn % 2 else reversed(arms):  # A B, then B A: drift falls on both
            env = {**os.environ, **extra}
            if pkg is not None:  # first on the path: its headrace, not the one installed
                env["PYTHONPATH"] = os.pathsep.join([str(pkg), *filter(None, [os.environ.get("PYTHONPATH")])])
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
