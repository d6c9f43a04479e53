"""Arguments of the readers over indexed data (files, sequence, the record files) refused when the
reader is made, not when the first epoch starts or by doing the wrong thing: a seed NumPy cannot
use, a shuffle that is not a bool, labels that are not one int per path, paths that are not text,
extensions and ``native_read`` of the wrong type, an ``iterable`` over a str or a dict, and an
index file that cannot be read. Each valid value next to them still works.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import numpy as np
import pytest

from headrace import ConfigError, ReadError, readers
from sample_data import recordio_record, write_recordio


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("args")
    out = []
    for i in range(4):
        (root / f"f{i}.jpg").write_bytes(b"image %d" % i)
        out.append(str(root / f"f{i}.jpg"))
    return out


@pytest.fixture(scope="module")
def rec(tmp_path_factory) -> Path:
    """A .rec file of 4 records, with no .idx beside it."""
    path = tmp_path_factory.mktemp("args-rec") / "a.rec"
    write_recordio(path, [recordio_record(i, b"\xff\xd8\xff image %d" % i) for i in range(4)], idx=False)
    return path


def _makers(paths: list[str], rec: Path) -> dict:
    """A reader of each kind that takes ``shuffle`` and ``seed``, from those keywords."""
    return {
        "files": lambda **kw: readers.files(paths, **kw),
        "sequence": lambda **kw: readers.sequence([{"jpg": b"x"}] * 4, **kw),
        "recordio": lambda **kw: readers.recordio(rec, **kw),
    }


async def _keys(reader, seed: int = 0) -> list[str]:
    return [s.key async for chunk in reader.read(0, seed=seed) for s in chunk]


@pytest.mark.parametrize("kind", ["files", "sequence", "recordio"])
@pytest.mark.parametrize("seed", [float("nan"), -1, True, 2.0, "1"])
def test_a_seed_numpy_cannot_use_is_a_config_error_when_the_reader_is_made(paths, rec, kind, seed):
    with pytest.raises(ConfigError, match="seed"):  # was accepted; NumPy failed at the first epoch
        _makers(paths, rec)[kind](shuffle=True, seed=seed)


@pytest.mark.parametrize("kind", ["files", "sequence", "recordio"])
@pytest.mark.parametrize("shuffle", ["no", None, 0, 1])
def test_shuffle_must_be_a_bool(paths, rec, kind, shuffle):
    with pytest.raises(ConfigError, match="shuffle"):  # "no" is true: it shuffled
        _makers(paths, rec)[kind](shuffle=shuffle)


async def test_numpy_seeds_and_bools_and_the_loaders_seed_still_work(paths):
    plain = await _keys(readers.files(paths, shuffle=True, seed=3))
    assert plain != sorted(plain)  # shuffled (this seed does move the 4 files)
    assert await _keys(readers.files(paths, shuffle=np.bool_(True), seed=np.int64(3))) == plain
    assert await _keys(readers.files(paths, shuffle=True), seed=3) == plain  # seed=None: the loader's
    assert await _keys(readers.files(paths, shuffle=False, seed=0)) == sorted(plain)


@pytest.mark.parametrize("labels", [[0.7, 1.2, 2.9, 3.0], "0123", ["cat", "dog", "cat", "dog"],
                                    [0, None, 1, 1], [True, False, True, False], 3])
def test_labels_that_are_not_one_int_per_path_are_a_config_error(paths, labels):
    # 1.7 was class 1 and "0123" four labels, silently; a word or None a ValueError or TypeError
    with pytest.raises(ConfigError, match="label"):
        readers.files(paths, labels)


async def test_labels_of_numpy_ints_a_generator_or_negative_ints_still_work(paths):
    for labels in (np.array([0, 1, 2, 3], dtype=np.uint8), (v for v in range(4)), [-1, 1, 2, 3]):
        reader = readers.files(paths, labels)
        samples = [s async for chunk in reader.read(0) for s in chunk]
        assert [s.fields["cls"] for s in samples] == [str(int(v)).encode() for v in reader.labels]
    assert reader.labels == [-1, 1, 2, 3]


@pytest.mark.parametrize("bad", [b"/data/a.jpg", 7])
def test_a_path_that_is_not_text_is_a_config_error(paths, bad):
    with pytest.raises(ConfigError, match="path"):  # was a TypeError from inside the reader's set-up
        readers.files([paths[0], bad])


@pytest.mark.parametrize("extensions", [None, [], [1], ["jpg", ""]])
def test_extensions_of_the_wrong_type_or_none_at_all_are_a_config_error(paths, extensions):
    folder = Path(paths[0]).parent.parent
    with pytest.raises(ConfigError, match="extension"):  # [] was "no image files ()", a ReadError
        readers.files(folder, extensions=extensions)


def test_one_extension_given_as_a_str_still_works(tmp_path):
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "a.PNG").write_bytes(b"png")
    (tmp_path / "cat" / "b.jpg").write_bytes(b"jpg")
    assert [Path(p).name for p in readers.files(tmp_path, extensions=".png").paths] == ["a.PNG"]


def test_native_read_must_be_a_bool(paths):
    with pytest.raises(ConfigError, match="native_read"):  # "no" was true: the C helper read them
        readers.files(paths, native_read="no")


@pytest.mark.parametrize("source", ["/data/a.jpg", b"abc", {"jpg": b"x", "cls": 1}])
def test_an_iterable_over_a_str_bytes_or_a_dict_is_a_config_error(source):
    # its letters, bytes or keys were the items: every sample failed, at every epoch
    with pytest.raises(ConfigError, match="iterable"):
        readers.iterable(source)


def test_a_recordio_index_file_missing_or_not_text_is_a_read_error_naming_it(rec, tmp_path):
    missing = str(tmp_path / "missing.idx")
    with pytest.raises(ReadError, match="cannot read the index file") as info:  # was a FileNotFoundError
        readers.recordio(rec, index=[missing])
    assert info.value.source == missing
    binary = tmp_path / "binary.idx"
    binary.write_bytes(b"\xff\xfe not text")
    with pytest.raises(ReadError, match="cannot read the index file"):  # was a UnicodeDecodeError
        readers.recordio(rec, index=[binary])


def test_one_index_file_given_as_a_str_is_that_file_not_its_letters(rec, tmp_path):
    scanned = readers.recordio(rec)
    idx = tmp_path / "a.idx"
    idx.write_text("".join(f"{i}\t{offset}\n" for i, (_, offset, _) in enumerate(scanned.records.tolist())))
    for index in (str(idx), idx):  # was one index file per letter: "13 index files for 1 files"
        assert np.array_equal(readers.recordio(rec, index=index).records, scanned.records)


def test_a_source_callable_that_needs_arguments_is_a_config_error_naming_them():
    def items(n):
        yield from ({"jpg": b"x"} for _ in range(n))

    with pytest.raises(ConfigError, match="'n'"):  # was a TypeError when the first epoch started
        readers.iterable(items, length=3)


async def test_source_callables_of_no_arguments_still_make_each_epoch():
    def items(n=2):
        yield from ({"jpg": b"%d" % i} for i in range(n))

    for source in (items, lambda: items(3), list):  # list(): a built-in, no items
        reader = readers.iterable(source)
        fields = [s.fields["jpg"] async for chunk in reader.read(0) for s in chunk]
        assert fields == [b"%d" % i for i in range(len(fields))]
        assert len(fields) == {items: 2, list: 0}.get(source, 3)


def test_a_file_list_path_or_root_that_is_not_text_is_a_config_error(paths, tmp_path):
    listing = tmp_path / "train.txt"
    listing.write_text("".join(f"{Path(p).name} {i}\n" for i, p in enumerate(paths)))
    for kwargs in ({"path": bytes(listing)}, {"path": listing, "root": b"/data"}, {"path": 3}):
        with pytest.raises(ConfigError, match="file_list"):  # was a TypeError mixing bytes and str
            readers.file_list(**kwargs)
    assert readers.file_list(listing, root=Path(paths[0]).parent) == (paths, [0, 1, 2, 3])


@pytest.mark.parametrize("shuffle, seed", [("no", 0), (True, -1), (True, float("nan")), (True, True)])
def test_a_webdataset_reader_refuses_a_bad_shuffle_or_seed_when_made(tmp_path, shuffle, seed):
    shard = tmp_path / "s-0.tar"
    with tarfile.open(shard, "w") as tar:
        data = b"1"
        info = tarfile.TarInfo("a.cls")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(ConfigError, match=r"webdataset: (shuffle|seed) must"):
        readers.webdataset(str(shard), shuffle=shuffle, seed=seed)
