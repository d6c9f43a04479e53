"""The docs against the code, review 4: what a reader of the folder maps, the readers' docstrings
and the pages' stated outputs finds, checked against the files and the functions themselves."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from headrace import datasets, readers

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("folder", ["ops", "readers", "stream"])
def test_each_folder_map_names_every_source_file(folder):
    """Each package folder's README maps its files (STYLE.md): a file in a sub-folder by its path
    from the folder, a file at the top by its name. ``__init__.py`` files only re-export."""
    base = ROOT / folder
    text = (base / "README.md").read_text()
    missing = []
    for path in sorted(base.rglob("*")):
        if path.suffix not in (".py", ".c", ".h") or "__pycache__" in path.parts or path.name == "__init__.py":
            continue
        name = path.relative_to(base).as_posix()
        if f"`{name}`" not in text and f"{name}`" not in text:
            missing.append(name)
    assert not missing, f"{folder}/README.md does not map {missing}"


FACTORIES = [readers.files, readers.webdataset, readers.lmdb, readers.tfrecord, readers.recordio, readers.sequence,
             readers.iterable, readers.mix, readers.coco, readers.video, readers.pack, readers.file_list]


@pytest.mark.parametrize("factory", FACTORIES, ids=lambda f: f.__name__)
def test_reader_docstrings_name_every_argument(factory):
    """The API page is made from these docstrings: an argument they never name (files' extensions,
    pack's prefix and seed, coco's storage arguments) is one a reader of the docs cannot find."""
    doc = inspect.getdoc(factory)
    missing = [p for p in inspect.signature(factory).parameters if not re.search(rf"\b{p}\b", doc, re.I)]
    assert not missing, f"{factory.__name__}'s docstring never names {missing}"


def test_stages_page_error_count_is_the_demo_data_sets(tmp_path):
    """docs/stages.md's strict_lookup example prints what it does on make demo's 1,024 images: the
    class-3 files fail, the rest are kept."""
    root = tmp_path / "demo"
    datasets.ensure_image_folder(root, count=1024, classes=10)
    failing = len(list((root / "class_03").glob("*.jpg")))
    page = (ROOT / "docs" / "stages.md").read_text()
    said = re.search(r"# (\d+) \{'TransformError': (\d+)\} on make demo's 1,024", page)
    assert said, "the example's comment is gone"
    assert (int(said.group(1)), int(said.group(2))) == (1024 - failing, failing)
