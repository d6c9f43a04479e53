"""Every ```python block of the README and of docs/ runs, in order, as one script per page, from a
folder holding the demo data set (``.data/demo``), as a reader who copies them would run them.
A block that cannot run on this machine (a GPU API sketch) says so with the info string ``python skip``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from headrace import datasets

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    """The page's runnable blocks: info string exactly ``python`` (``python skip`` and others are not)."""
    return [m.group(2) for m in BLOCK.finditer(page.read_text()) if m.group(0).split("\n", 1)[0].strip() == "```python"]


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("reader")
    datasets.ensure_image_folder(where / ".data" / "demo", count=96, classes=10)
    return where


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_pages_python_runs(page, demo_folder):
    script = "\n\n".join(python_blocks(page))
    done = subprocess.run([sys.executable, "-c", script], cwd=demo_folder, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{page.name}:\n{done.stderr[-3000:]}"


def test_the_readme_has_runnable_blocks():
    assert len(python_blocks(ROOT / "README.md")) >= 3
