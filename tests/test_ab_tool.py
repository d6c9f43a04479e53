"""``examples/ab.py``: commits exported and run turn by turn, and arms exported beforehand for a
machine without the git history (a lent GPU machine gets a copy of the working tree only)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
AB = ROOT / "examples" / "ab.py"
WHERE = [sys.executable, "-c", "import headrace; print('from', headrace.__file__)"]

pytestmark = pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                                reason="needs git and this repository's history")


def _ab(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(AB), *args], capture_output=True, text=True, timeout=120)


def _imported_from(output: str, label: str) -> str:
    """The headrace file the turn ``label`` (``=== label1 ...``) imported."""
    turn = output.split(f"=== {label}1", 1)[1]
    return next(line for line in turn.splitlines() if line.startswith("from ")).split(" ", 1)[1]


def test_an_exported_arm_runs_from_its_folder_and_the_installed_one_as_installed(tmp_path):
    exported = _ab("--export-only", "--arm", "old=HEAD", "--into", str(tmp_path))
    assert exported.returncode == 0, exported.stderr
    package = tmp_path / "old" / "pkg"
    assert (package / "headrace" / "__init__.py").is_file() and (package / "headrace" / "readers").is_dir()

    done = _ab("--arm", f"old=@{package}", "--arm", "now=@", "--turns", "1", "--", *WHERE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert Path(_imported_from(done.stdout, "old")).is_relative_to(package)
    assert not Path(_imported_from(done.stdout, "now")).is_relative_to(tmp_path)  # the installed headrace


def test_a_folder_without_an_exported_package_is_refused(tmp_path):
    done = _ab("--arm", f"old=@{tmp_path}", "--", *WHERE)
    assert done.returncode == 2
    assert "holds no exported headrace package" in done.stderr
