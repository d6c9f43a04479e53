"""readers.video: arguments checked when the reader is made (a ConfigError then, not a failure or a
surprise once the first epoch starts), and ``extensions`` given as one string."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")

from sample_data import make_video  # noqa: E402

from headrace import ConfigError, readers  # noqa: E402


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video-review")
    make_video(root / "a" / "v.mp4", 16)
    make_video(root / "b" / "v.mkv", 12)
    return root


async def _keys(reader) -> list[str]:
    return [s.key async for chunk in reader.read(0) for s in chunk]


@pytest.mark.parametrize("seed", [float("nan"), -1, True, "1", 2.0])
def test_a_seed_numpy_cannot_use_is_a_config_error_when_the_reader_is_made(tree, seed):
    with pytest.raises(ConfigError, match="seed"):
        readers.video(tree, sequence_length=4, shuffle=True, seed=seed)


@pytest.mark.parametrize("shuffle", ["no", None, 0, 1])
def test_shuffle_must_be_a_bool(tree, shuffle):
    with pytest.raises(ConfigError, match="shuffle"):  # "no" would be true: a shuffled epoch
        readers.video(tree, sequence_length=4, shuffle=shuffle)


@pytest.mark.parametrize("label", [1.7, True, float("nan"), "3", "x"])
def test_a_label_that_is_not_an_int_is_a_config_error_naming_the_video(tree, label):
    path = tree / "a" / "v.mp4"
    with pytest.raises(ConfigError, match="label") as info:
        readers.video([(path, label)], sequence_length=4)
    assert str(path) in str(info.value)


async def test_ints_of_any_kind_and_none_are_labels(tree):
    path = tree / "a" / "v.mp4"
    reader = readers.video([(path, np.int64(3)), (path, None), (path, -1)], sequence_length=8, seed=0, shuffle=False)
    samples = [s async for chunk in reader.read(0) for s in chunk]
    assert [s.fields.get("cls") for s in samples] == [3, 3, None, None, -1, -1]
    assert type(samples[0].fields["cls"]) is int


async def test_one_extension_may_be_a_string(tree):
    """As readers.files takes it: "mkv" is the extension, not the letters m, k and v."""
    assert await _keys(readers.video(tree, sequence_length=4, extensions="mkv")) == ["b/v.mkv@0", "b/v.mkv@4",
                                                                                     "b/v.mkv@8"]
    assert await _keys(readers.video(tree, sequence_length=8, extensions=".MP4")) == ["a/v.mp4@0", "a/v.mp4@8"]
