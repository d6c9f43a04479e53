"""The C helper's folder listing (``_read_files.list_folder``) against os.scandir: the same names
(undecodable bytes as os.fsdecode gives them), the same entry types, a folder larger than the
first buffers, the errors naming the folder."""

from __future__ import annotations

import os

import pytest

from headrace.readers._read_files import list_folder

pytestmark = pytest.mark.skipif(list_folder(".") is None, reason="the C helper does not build here")
TYPES = {"dir": 4, "file": 8, "link": 10, "fifo": 1}


def _scandir(path) -> list[tuple[str, int]]:
    out = []
    with os.scandir(path) as entries:
        for entry in entries:
            kind = ("link" if entry.is_symlink() else "dir" if entry.is_dir(follow_symlinks=False)
                    else "file" if entry.is_file(follow_symlinks=False) else "fifo")
            out.append((entry.name, TYPES[kind]))
    return sorted(out)


def test_a_large_folder_lists_as_scandir_does(tmp_path):
    for i in range(700):  # past the first 256 entries and 16 KiB of names
        (tmp_path / (f"{i:04d}-" + "n" * (i % 90) + ".jpg")).write_bytes(b"x")
    (tmp_path / "sub").mkdir()
    os.symlink(tmp_path / "0001-n.jpg", tmp_path / "link.jpg")
    os.mkfifo(tmp_path / "pipe")
    odd = os.fsencode(str(tmp_path)) + b"/caf\xe9 \xff.jpg"  # not UTF-8
    with open(odd, "wb") as f:
        f.write(b"x")
    listed = list_folder(str(tmp_path))
    assert sorted(listed) == _scandir(tmp_path) and len(listed) == 704
    assert os.fsdecode(b"caf\xe9 \xff.jpg") in dict(listed)


def test_an_empty_folder_and_errors(tmp_path):
    assert list_folder(str(tmp_path)) == []
    with pytest.raises(FileNotFoundError) as caught:
        list_folder(str(tmp_path / "gone"))
    assert caught.value.filename == str(tmp_path / "gone")
    (tmp_path / "file").write_bytes(b"x")
    with pytest.raises(NotADirectoryError):
        list_folder(str(tmp_path / "file"))
