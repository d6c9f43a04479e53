"""The three folders install as one import package, `headrace`, in a wheel and in editable mode."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = (
    "import importlib.util, headrace, headrace.readers, headrace.ops;"
    "assert all(importlib.util.find_spec(n) is None for n in ('stream', 'readers', 'ops')), 'bare module';"
    "print(headrace.__file__)"
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        cwd=out,
    )
    (path,) = out.glob("headrace-*.whl")
    return path


def test_wheel_holds_only_the_headrace_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"headrace"}
    for expected in ("headrace/__init__.py", "headrace/readers/__init__.py", "headrace/ops/__init__.py", "headrace/py.typed"):
        assert expected in names


def test_installed_wheel_imports(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
    )
    result = subprocess.run(
        [sys.executable, "-c", CHECK], env={"PYTHONPATH": str(target), "PATH": ""}, cwd=tmp_path,
        capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(target / "headrace" / "__init__.py")


def test_this_environment_imports_headrace_from_the_source_tree(tmp_path):
    # The test suite runs against `pip install -e .`: headrace must come from stream/.
    result = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == ROOT / "stream" / "__init__.py"
