"""A class-per-folder tree listed a folder per C call (``_read_files.list_folder``), else with
``os.scandir`` (``readers.files``, ``readers.video``): the same files, order, labels and keys as the
``pathlib`` listing it replaced, on a tree with nested folders, hidden names, links, odd names and
extensions in any case, by the C listing, by os.scandir, and where the file system gives no entry
types (every one looked up)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from headrace import ReadError, readers
from headrace.readers._read_files import list_folder
from headrace.readers.files import _key, class_folders

files_module = importlib.import_module("headrace.readers.files")  # the module, not the function


@pytest.fixture(autouse=True, params=["c", "scandir", "no-types"])
def listing(request, monkeypatch) -> str:
    """Each test three times: the C listing, os.scandir's, and entries of unknown type (d_type 0)."""
    if request.param != "scandir" and list_folder(".") is None:
        pytest.skip("the C helper does not build here")
    if request.param == "scandir":
        monkeypatch.setattr(files_module, "list_folder", lambda path: None)
    if request.param == "no-types":
        monkeypatch.setattr(files_module, "list_folder", lambda path: [(name, 0) for name, _ in list_folder(path)])
    return request.param


def _rglob_listing(root: Path, exts: set[str]) -> tuple[list[str], list[str], list[int]]:
    """The listing as it was: ``sorted(folder.rglob("*"))``, hidden parts left out, ``is_file()``."""
    classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    paths, labels = [], []
    for label, name in enumerate(classes):
        folder = root / name
        for p in sorted(folder.rglob("*")):
            if any(part.startswith(".") for part in p.relative_to(folder).parts):
                continue
            if p.is_file() and p.suffix.lower().lstrip(".") in exts:
                paths.append(str(p))
                labels.append(label)
    return classes, paths, labels


@pytest.fixture
def tricky_tree(tmp_path) -> Path:
    root = tmp_path / "tree"
    files = ["cat/a.jpg", "cat/a/b.jpg", "cat/a.b/c.JPG", "cat/a-b.jpeg", "cat/A.png", "cat/x.", "cat/noext",
             "cat/.hidden.jpg", "cat/.thumbs/t.jpg", "cat/deep/er/est/z.webp", "cat/ü ñ.jpg", "cat/a/.b/c.jpg",
             "dog/0.jpg", "dog/10.jpg", "dog/9.jpg", "dog/sub.dir/1.jpg", "dog/sub/1.jpg", "dog/notes.txt",
             ".secret/s.jpg", "empty/readme.txt"]
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"\xff\xd8" + rel.encode())
    (root / "bird").mkdir()
    os.symlink(root / "dog/0.jpg", root / "cat/link.jpg")  # a link to a file: listed
    os.symlink(root / "dog", root / "cat/linked-folder")  # a link to a folder: not entered
    os.symlink(root / "gone.jpg", root / "cat/broken.jpg")  # a broken link: not a file
    os.symlink(root / "dog", root / "hound")  # a class folder that is a link: a class, entered
    os.symlink(root / "dog/9.jpg", root / "not-a-class.jpg")  # a link to a file at the top: no class
    return root


@pytest.mark.parametrize("exts", [{"jpg", "jpeg", "png", "webp"}, {"jpg"}, {"txt"}])
def test_the_listing_is_the_pathlib_one(tricky_tree, exts):
    assert class_folders(tricky_tree, exts) == _rglob_listing(tricky_tree, exts)


def test_a_relative_root_lists_the_same_text_and_keys(tricky_tree, monkeypatch):
    monkeypatch.chdir(tricky_tree)
    exts = {"jpg", "jpeg", "png", "webp"}
    for root in (Path("."), Path("./"), Path("../tree"), Path(".//cat/..")):
        listing = class_folders(root, exts)
        assert listing == _rglob_listing(root, exts)
        assert [_key(p, root) for p in listing[1]] == [
            os.path.splitext(os.path.relpath(p, root))[0] for p in listing[1]]


def test_the_reader_keys_are_the_paths_below_the_root(tricky_tree):
    reader = readers.files(tricky_tree)
    assert reader._keys == [os.path.splitext(os.path.relpath(p, tricky_tree))[0] for p in reader.paths]
    assert "cat/a/b" in reader._keys and "cat/link" in reader._keys and "cat/linked-folder/0" not in reader._keys


def test_a_folder_that_cannot_be_listed_is_an_error_naming_it(tmp_path):
    # A folder whose path is longer than the system's PATH_MAX cannot be listed by path, by root
    # either (ENAMETOOLONG); the files above it must not be handed out as the whole data set.
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat/0.jpg").write_bytes(b"\xff\xd8")
    name = "d" * 250
    fd = os.open(tmp_path / "cat", os.O_RDONLY)
    try:
        for _ in range(20):  # made one below the other through descriptors: no long path needed
            os.mkdir(name, dir_fd=fd)
            below = os.open(name, os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = below
    finally:
        os.close(fd)
    with pytest.raises(ReadError, match="cannot list folder") as caught:
        readers.files(tmp_path)
    assert caught.value.source.startswith(str(tmp_path / "cat" / name))
    assert len(caught.value.source) > 4096
