"""``headrace pack --video``: a class-per-folder tree of videos → tar shards that readers.video reads
with the same clips, labels and pixels as the folder."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
import torch

av = pytest.importorskip("av")

from sample_data import make_video, video_batches  # noqa: E402

from headrace import ConfigError, DecodeError, ReadError, readers  # noqa: E402
from headrace.cli import main  # noqa: E402

FRAMES = {"jump/v0.mp4": 40, "jump/v1.mp4": 26, "walk/v0.mkv": 33, "walk/clip.v2.mp4": 21}


@pytest.fixture(scope="module")
def video_tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("videos")
    for rel, n in FRAMES.items():
        make_video(root / rel, n)
    (root / "walk" / "notes.txt").write_text("not a video: left out\n")
    return root


def _shard_key(folder_key: str) -> str:
    """The folder reader's clip key as the packed shard's: the extension dropped, dots in the name as ``_``."""
    rel, start = folder_key.split("@")
    folder, name = rel.rsplit("/", 1)
    return f"{folder}/{name.rsplit('.', 1)[0].replace('.', '_')}@{start}"


@pytest.mark.parametrize("limits", [{}, {"shard_count": 1}])
async def test_packed_videos_read_back_as_the_same_clips_labels_and_pixels(tmp_path, video_tree, limits, leaks):
    result = readers.pack(video_tree, tmp_path / "out", format="webdataset", video=True, **limits)
    assert result.samples == 4 and result.classes == ["jump", "walk"]
    assert len(result.outputs) == (4 if limits else 1)
    members = sorted(m.name for p in result.outputs for m in tarfile.open(p))
    assert members == ["jump/v0.cls", "jump/v0.mp4", "jump/v1.cls", "jump/v1.mp4",
                       "walk/clip_v2.cls", "walk/clip_v2.mp4", "walk/v0.cls", "walk/v0.mkv"]
    with tarfile.open(result.outputs[0]) as tar:  # the file's own bytes: not re-encoded
        assert tar.extractfile("jump/v0.mp4").read() == (video_tree / "jump/v0.mp4").read_bytes()  # type: ignore[union-attr]

    def both(**kw):
        return (readers.video(video_tree, sequence_length=4, stride=2, step=5, **kw),
                readers.video(tmp_path / "out", sequence_length=4, stride=2, step=5, **kw))

    folder, shards = both()
    assert len(folder) == len(shards) > 0
    got, expected = await video_batches(shards), await video_batches(folder)
    assert [b.sample_keys for b in got] == [[_shard_key(k) for k in b.sample_keys] for b in expected]
    for x, y in zip(got, expected, strict=True):
        assert torch.equal(x["video"], y["video"]) and torch.equal(x["label"], y["label"])
        assert torch.equal(x["start"], y["start"]) and torch.equal(x["timestamps"], y["timestamps"])
    # shuffled with one seed, both give the clips in one order (same clip table, same permutation)
    folder, shards = both(shuffle=True, seed=3)
    keys = [[s.key async for c in r.read(1) for s in c] for r in (folder, shards)]
    assert keys[1] == [_shard_key(k) for k in keys[0]]
    await leaks.check()


def test_videos_pack_into_shards_only_and_an_empty_tree_is_refused(tmp_path, video_tree):
    with pytest.raises(ConfigError, match="WebDataset shards only"):
        readers.pack(video_tree, tmp_path / "db", format="lmdb", video=True)
    (tmp_path / "empty" / "a").mkdir(parents=True)
    (tmp_path / "empty" / "a" / "x.jpg").write_bytes(b"an image, not a video")
    with pytest.raises(ReadError):
        readers.pack(tmp_path / "empty", tmp_path / "out", format="webdataset", video=True)
    assert not (tmp_path / "out").exists() and not (tmp_path / "db").exists()


@pytest.fixture
def bad_tree(tmp_path, video_tree) -> Path:
    src = tmp_path / "bad"
    (src / "a").mkdir(parents=True)
    (src / "a" / "good.mp4").write_bytes((video_tree / "jump/v0.mp4").read_bytes())
    whole = make_video(tmp_path / "whole.mp4", 24, faststart=True).read_bytes()
    (src / "a" / "cut.mp4").write_bytes(whole[: len(whole) * 2 // 3])  # its index lists frames it lacks
    (src / "b").mkdir()
    (src / "b" / "text.mp4").write_text("not a video at all\n")
    return src


def test_verify_probes_videos_refusing_or_leaving_out_the_bad_ones(tmp_path, bad_tree):
    with pytest.raises(DecodeError, match="does not decode") as caught:
        readers.pack(bad_tree, tmp_path / "r", format="webdataset", video=True, verify="raise")
    assert caught.value.source == str(bad_tree / "a" / "cut.mp4") and caught.value.key == "a/cut"
    assert not (tmp_path / "r").exists()
    result = readers.pack(bad_tree, tmp_path / "s", format="webdataset", video=True, verify="skip", verify_threads=2)
    assert result.samples == 1
    assert [p for p, _ in result.skipped] == [str(bad_tree / "a" / "cut.mp4"), str(bad_tree / "b" / "text.mp4")]
    assert "truncated" in result.skipped[0][1]
    assert readers.pack(bad_tree, tmp_path / "p", format="webdataset", video=True).samples == 3  # unread: all packed


async def test_command_line(tmp_path, video_tree, capsys):
    assert main(["pack", str(video_tree), str(tmp_path / "w"), "--format", "webdataset", "--video",
                 "--shard-count", "2", "--prefix", "train", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "packed 4 samples (2 classes) into 2 shard(s)" in out and "verified" in out
    reader = readers.video(str(tmp_path / "w" / "train-*.tar"), sequence_length=8)
    labels = {s.key.split("@")[0]: s.fields["cls"] async for c in reader.read(0) for s in c}
    assert labels == {"jump/v0": 0, "jump/v1": 0, "walk/clip_v2": 1, "walk/v0": 1}
    assert main(["pack", str(video_tree), str(tmp_path / "l"), "--format", "lmdb", "--video"]) == 1
    assert "WebDataset shards only" in capsys.readouterr().err
