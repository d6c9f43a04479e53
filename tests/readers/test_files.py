from __future__ import annotations

import os

import numpy as np
import pytest

from headrace import ConfigError, ReadError, readers
from headrace.readers import epoch_order


async def _read_all(reader, epoch=0, start=0, seed=0):
    out = []
    async for chunk in reader.read(epoch, start=start, seed=seed):
        out.extend(chunk)
    return out


async def test_folder_tree_labels_are_sorted_subfolder_indices(tmp_path, image_folder):
    reader = readers.files(image_folder, chunk_size=7)
    samples = await _read_all(reader)
    assert len(reader) == len(samples) == 75
    assert reader.classes == ("c0", "c1", "c2")
    for s in samples:
        assert s.key.startswith(f"c{int(s.fields['cls'])}/")
        assert s.fields["jpg"][:2] == b"\xff\xd8"
        assert s.source.endswith(s.key + ".jpg")
    assert [s.position for s in samples] == list(range(75))
    assert [s.index for s in samples] == list(range(75))  # no shuffle: dataset order


async def test_path_list_with_labels(image_folder):
    paths = sorted(image_folder.rglob("*.jpg"))[:5]
    reader = readers.files(paths, labels=[4, 3, 2, 1, 0])
    samples = await _read_all(reader)
    assert [int(s.fields["cls"]) for s in samples] == [4, 3, 2, 1, 0]
    assert [s.source for s in samples] == [str(p) for p in paths]
    no_labels = await _read_all(readers.files(paths))
    assert "cls" not in no_labels[0].fields


async def test_shuffle_is_seeded_per_epoch(image_folder):
    reader = readers.files(image_folder, shuffle=True)
    e0 = [s.index for s in await _read_all(reader, epoch=0, seed=3)]
    e0_again = [s.index for s in await _read_all(reader, epoch=0, seed=3)]
    e1 = [s.index for s in await _read_all(reader, epoch=1, seed=3)]
    assert e0 == e0_again and e0 != e1 and sorted(e0) == list(range(75))
    own_seed = readers.files(image_folder, shuffle=True, seed=3)
    assert [s.index for s in await _read_all(own_seed, epoch=0, seed=99)] == e0


async def test_start_skips_exactly_the_first_positions(image_folder):
    reader = readers.files(image_folder, shuffle=True, chunk_size=4)
    full = await _read_all(reader, epoch=2)
    tail = await _read_all(reader, epoch=2, start=30)
    assert [(s.index, s.position) for s in tail] == [(s.index, s.position) for s in full[30:]]


@pytest.mark.parametrize("world", [2, 3, 4, 7])
async def test_shards_are_disjoint_and_complete(image_folder, world):
    base = readers.files(image_folder, shuffle=True)
    parts = [[s.index for s in await _read_all(base.shard(r, world), epoch=1)] for r in range(world)]
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(75))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert [len(base.shard(r, world)) for r in range(world)] == list(map(len, parts))


@pytest.mark.parametrize("world", [2, 4, 7])
async def test_equal_counts_pad_or_drop(image_folder, world):
    base = readers.files(image_folder, shuffle=True)
    padded = [[s.index for s in await _read_all(base.shard(r, world, equal="pad"))] for r in range(world)]
    dropped = [[s.index for s in await _read_all(base.shard(r, world, equal="drop"))] for r in range(world)]
    assert len({len(p) for p in padded}) == 1 and len(padded[0]) == -(-75 // world)
    assert set(i for p in padded for i in p) == set(range(75))  # complete; the padding repeats
    assert len({len(p) for p in dropped}) == 1 and len(dropped[0]) == 75 // world
    flat = [i for p in dropped for i in p]
    assert len(flat) == len(set(flat))  # disjoint


def test_every_rank_computes_the_same_global_order_without_talking():
    orders = [epoch_order(100, 5, shuffle=True, seed=1, rank=r, world=4) for r in range(4)]
    interleaved = np.empty(100, dtype=int)
    for r, o in enumerate(orders):
        interleaved[r::4] = o
    assert np.array_equal(interleaved, epoch_order(100, 5, shuffle=True, seed=1))


async def test_reading_closes_its_threads_when_stopped_early(image_folder, leaks):
    reader = readers.files(image_folder, chunk_size=2, io_threads=3)
    stream = reader.read(0)
    await stream.__anext__()
    await stream.aclose()
    await leaks.check()


def test_missing_or_empty_folder_is_a_read_error(tmp_path):
    with pytest.raises(ReadError) as info:
        readers.files(tmp_path / "nope")
    assert info.value.source == str(tmp_path / "nope")
    (tmp_path / "empty" / "a").mkdir(parents=True)
    with pytest.raises(ReadError):
        readers.files(tmp_path / "empty")


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [(([],), {}), ((["a.jpg"],), {"labels": [1, 2]}), ((42,), {}), ((["a.jpg"],), {"chunk_size": 0}), ((["a.jpg"],), {"io_threads": 0})],
)
def test_wrong_arguments(args, kwargs):
    with pytest.raises(ConfigError):
        readers.files(*args, **kwargs)


@pytest.mark.parametrize(("rank", "world", "equal"), [(2, 2, None), (-1, 2, None), (0, 0, None), (0, 2, "wrap")])
def test_wrong_shard_arguments(image_folder, rank, world, equal):
    with pytest.raises(ConfigError):
        readers.files(image_folder).shard(rank, world, equal=equal)


@pytest.mark.parametrize("native", [True, False])
async def test_a_chunk_counts_its_bytes_as_the_loop_would(image_folder, native):
    from headrace._sample import samples_nbytes

    paths = sorted(str(p) for p in image_folder.rglob("*.jpg"))[:9]
    for labels in ([7, 1234, 7, -5, 0, 1, 2, 3, 4], None):
        async for chunk in readers.files(paths, labels=labels, chunk_size=4, native_read=native).read(0):
            assert samples_nbytes(chunk) == sum(len(v) for s in chunk for v in s.fields.values())
            if labels is not None:
                assert [s.fields["cls"] for s in chunk] == [str(labels[s.index]).encode() for s in chunk]


def test_a_single_file_gets_a_message_that_says_what_to_give(image_folder):
    one = sorted(image_folder.rglob("*.jpg"))[0]
    with pytest.raises(ConfigError, match="is a file; give a folder .* or a list of paths"):
        readers.files(one)


def test_a_dali_list_file_gives_the_folders_paths_and_labels(image_folder, tmp_path):
    folder = readers.files(image_folder)
    listing = tmp_path / "train.txt"
    lines = [f"{os.path.relpath(p, image_folder)} {label}" for p, label in zip(folder.paths, folder.labels)]
    listing.write_text("# path label\n" + "\n".join(lines) + "\n\n")
    paths, labels = readers.file_list(listing, root=image_folder)
    assert [os.path.realpath(p) for p in paths] == [os.path.realpath(p) for p in folder.paths]
    assert labels == folder.labels
    beside = image_folder / "list.txt"  # no root: paths relative to the list file's folder
    try:
        beside.write_text("\n".join(lines))
        assert readers.file_list(beside) == (paths, labels)
    finally:
        beside.unlink()
    spaced = tmp_path / "with space.jpg"
    spaced.write_bytes(open(folder.paths[0], "rb").read())
    (tmp_path / "spaces.txt").write_text(f"{spaced} 7\n")
    assert readers.file_list(tmp_path / "spaces.txt") == ([str(spaced)], [7])
    (tmp_path / "bare.txt").write_text("a.jpg\nb.jpg\n")
    assert readers.file_list(tmp_path / "bare.txt") == ([str(tmp_path / "a.jpg"), str(tmp_path / "b.jpg")], None)


def test_a_bad_list_file_is_named_with_its_line(tmp_path):
    for text, message in (("a.jpg 1\nb.jpg x\n", "line 2: the label 'x' is not an int"),
                          ("a.jpg 1\nb.jpg\n", "line 2: some lines have a label and some do not"),
                          ("# nothing\n\n", "names no files")):
        (tmp_path / "list.txt").write_text(text)
        with pytest.raises(ConfigError, match=message):
            readers.file_list(tmp_path / "list.txt")
    with pytest.raises(ReadError, match="cannot read the list file"):
        readers.file_list(tmp_path / "missing.txt")


def test_hidden_files_inside_a_class_are_left_out_a_bom_is_no_path_and_one_extension_is_one(tmp_path, image_folder):
    jpg = next(image_folder.rglob("*.jpg")).read_bytes()
    (tmp_path / "tree" / "cat" / ".thumbs").mkdir(parents=True)
    for name in ("x.jpg", "._x.jpg", ".thumbs/t.jpg"):  # macOS's resource fork, a viewer's cache
        (tmp_path / "tree" / "cat" / name).write_bytes(jpg)
    reader = readers.files(tmp_path / "tree")
    assert [os.path.relpath(p, tmp_path / "tree") for p in reader.paths] == [os.path.join("cat", "x.jpg")]
    assert len(readers.files(tmp_path / "tree", extensions="jpg")) == 1  # not the letters j, p and g
    (tmp_path / "img").mkdir()
    for name in ("a.jpg", "b.jpg"):
        (tmp_path / "img" / name).write_bytes(jpg)
    listing = tmp_path / "list.txt"
    listing.write_text("img/a.jpg 0\nimg/b.jpg 1\n", encoding="utf-8-sig")  # a Windows editor's byte-order mark
    paths, labels = readers.file_list(listing)
    assert [os.path.basename(p) for p in paths] == ["a.jpg", "b.jpg"] and all(map(os.path.exists, paths))
    assert labels == [0, 1]
