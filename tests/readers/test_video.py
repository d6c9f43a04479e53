"""readers.video: clips by (video, start frame), over small real videos made here with PyAV.

Each frame's pixels say its index (``make_video``), so a decoded frame is identified within the
codec's error. The decode itself is tested in tests/ops/test_video_decode.py.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")

from headrace import ConfigError, DecodeError, Loader, ReadError, ops, readers  # noqa: E402

FRAMES = {"a/v0.mp4": 40, "a/v1.mp4": 43, "b/v0.mp4": 33, "b/short.mp4": 5}


def make_video(path, frames, *, codec="libx264", width=64, height=48, gop=8, rate=25, pts=None, faststart=False):
    """A video whose frame i has its top half's left side grey 8 + 16 * (i // 16) and right side
    8 + 16 * (i % 16) (``frame_index`` reads them back), and a fixed texture in its bottom half (so
    a crop's position can be found). ``pts``: each frame's timestamp in 1/1000 s (variable rate)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    texture = np.random.default_rng(0).integers(0, 256, (height // 2 // 4, width // 4, 3), dtype=np.uint8)
    texture = texture.repeat(4, 0).repeat(4, 1)
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", options=options) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = gop
        if pts is not None:
            stream.time_base = stream.codec_context.time_base = Fraction(1, 1000)
        for i in range(frames):
            image = np.empty((height, width, 3), np.uint8)
            image[: height // 2, : width // 2] = 8 + 16 * (i // 16)
            image[: height // 2, width // 2 :] = 8 + 16 * (i % 16)
            image[height // 2 :] = texture
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            if pts is not None:
                frame.pts = pts[i]
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def frame_index(frame: np.ndarray) -> int:
    """The index ``make_video`` wrote into an ``[H, W, C]`` (or ``[C, H, W]``) frame's top half."""
    if frame.shape[0] == 3:
        frame = frame.transpose(1, 2, 0)
    h, w = frame.shape[:2]
    top = np.asarray(frame[2 : h // 2 - 2], np.float64)
    hi, lo = top[:, 2 : w // 2 - 3].mean(), top[:, w // 2 + 3 : w - 2].mean()
    return int(round((hi - 8) / 16)) * 16 + int(round((lo - 8) / 16))


@pytest.fixture(scope="module")
def video_tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("videos")
    for rel, n in FRAMES.items():
        make_video(root / rel, n)
    return root


async def read_all(reader, epoch=0, start=0, seed=0):
    return [s async for chunk in reader.read(epoch, start=start, seed=seed) for s in chunk]


def expected_keys(span, step, frames=FRAMES):
    """The clips by hand: starts 0, step, ... while the clip fits, per video in dataset order."""
    return [f"{rel}@{start}" for rel, n in sorted(frames.items()) for start in range(0, n - span + 1, step)]


@pytest.mark.parametrize(("length", "stride", "step"), [(8, 1, None), (4, 3, None), (4, 3, 5), (1, 1, 7), (16, 2, 3)])
async def test_clip_starts_follow_sequence_length_stride_and_step(video_tree, length, stride, step):
    reader = readers.video(video_tree, sequence_length=length, stride=stride, step=step)
    span = (length - 1) * stride + 1
    samples = await read_all(reader)
    assert [s.key for s in samples] == expected_keys(span, step or span)
    assert len(reader) == len(samples)
    for s in samples:
        start, s_stride, s_length = s.fields["clip"].tolist()
        assert (s.fields["video"], s.source) == (str(video_tree / s.key.split("@")[0]), s.source)
        assert (s_stride, s_length) == (stride, length) and s.key.endswith(f"@{start}")
        assert s.fields["cls"] == (0 if s.key.startswith("a/") else 1)
        np.testing.assert_allclose(s.fields["timestamps"], (start + stride * np.arange(length)) / 25)


async def test_video_shorter_than_a_clip_gives_no_clip_and_a_list_source_keeps_its_labels(video_tree):
    reader = readers.video([(video_tree / "b/short.mp4", 5), (video_tree / "a/v0.mp4", 7)], sequence_length=6)
    samples = await read_all(reader)
    assert [(s.key, s.fields["cls"]) for s in samples] == [
        (f"{video_tree / 'a/v0.mp4'}@{start}", 7) for start in range(0, 35, 6)]


async def test_clips_per_video_are_drawn_anew_each_epoch_and_the_same_again(video_tree):
    reader = readers.video(video_tree, sequence_length=4, stride=2, clips_per_video=3, seed=5)
    epoch0, again, epoch1 = await read_all(reader, 0), await read_all(reader, 0), await read_all(reader, 1)
    assert [s.key for s in epoch0] == [s.key for s in again]
    assert [s.key for s in epoch0] != [s.key for s in epoch1]
    for samples in (epoch0, epoch1):
        assert len(samples) == 9  # three videos long enough, three clips each
        for s in samples:
            rel, start = s.key.split("@")
            assert 0 <= int(start) <= FRAMES[rel] - 7


async def test_shuffled_shards_are_disjoint_and_complete(video_tree):
    reader = readers.video(video_tree, sequence_length=4, stride=2, step=3, shuffle=True, seed=1)
    everything = [s.key for s in await read_all(reader, epoch=2)]
    assert sorted(everything) == sorted(expected_keys(7, 3)) and everything != expected_keys(7, 3)
    parts = [[s.key for s in await read_all(reader.shard(r, 3), epoch=2)] for r in range(3)]
    assert sorted(k for part in parts for k in part) == sorted(everything)
    assert len(set().union(*map(set, parts))) == len(everything)


def _loader(reader, **kw):
    kw.setdefault("pipeline", ops.video_pipeline(size=(24, 32), crop=(16, 16), flip=0.5))
    return Loader(reader, batch_size=3, device="cpu", num_threads=2, seed=3, **kw)


async def test_resume_mid_epoch_gives_the_same_clips_and_pixels(video_tree, leaks):
    def reader():
        return readers.video(video_tree, sequence_length=4, stride=2, clips_per_video=2, shuffle=True)

    full = _loader(reader())
    expected = [b async for b in full]  # epoch 0
    await full.aclose()
    first = _loader(reader())
    async for batch in first:
        if batch.index == 1:
            break
    state = first.state_dict()
    await first.aclose()
    other = _loader(readers.video(video_tree, sequence_length=4, stride=3, clips_per_video=2, shuffle=True))
    with pytest.raises(ConfigError):  # another clip length: another data set
        other.load_state_dict(state)
    second = _loader(reader())
    second.load_state_dict(state)
    rest = [b async for b in second]
    await second.aclose()
    await other.aclose()
    assert len(rest) == len(expected) - 2
    for x, y in zip(expected[2:], rest, strict=True):
        assert x.sample_keys == y.sample_keys
        assert torch.equal(x["video"], y["video"]) and torch.equal(x["label"], y["label"])
    await leaks.check()


@pytest.fixture
def broken_tree(tmp_path) -> Path:
    make_video(tmp_path / "a" / "good.mp4", 24)
    good = make_video(tmp_path / "a" / "whole.mp4", 24, faststart=True).read_bytes()
    (tmp_path / "a" / "truncated.mp4").write_bytes(good[: len(good) * 2 // 3])
    (tmp_path / "a" / "whole.mp4").unlink()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "text.mp4").write_text("not a video at all\n")
    return tmp_path


async def test_unreadable_videos_are_failed_samples_naming_the_file(broken_tree):
    reader = readers.video(broken_tree, sequence_length=8)
    samples = await read_all(reader)
    assert [s.key for s in samples] == ["a/good.mp4@0", "a/good.mp4@8", "a/good.mp4@16",
                                        "a/truncated.mp4@0", "b/text.mp4@0"]
    for bad in samples[3:]:
        assert isinstance(bad.error, ReadError) and bad.error.key == bad.key
        assert bad.error.source == str(broken_tree / bad.key.split("@")[0])
    assert "truncated" in str(samples[3].error)


async def test_unreadable_videos_raise_or_are_skipped_and_counted(broken_tree, leaks):
    strict = _loader(readers.video(broken_tree, sequence_length=8))
    with pytest.raises(ReadError) as info:
        [b async for b in strict]
    assert info.value.source == str(broken_tree / "a/truncated.mp4")
    await strict.aclose()
    skip = _loader(readers.video(broken_tree, sequence_length=8), on_error="skip", max_errors=2)
    batches = [b async for b in skip]
    assert [k for b in batches for k in b.sample_keys] == ["a/good.mp4@0", "a/good.mp4@8", "a/good.mp4@16"]
    assert skip.stats().errors == {"ReadError": 2} and skip.stats().dropped == 2
    await skip.aclose()
    await leaks.check()


async def test_a_clip_the_file_cannot_deliver_is_a_decode_error_naming_it(tmp_path, leaks):
    path = make_video(tmp_path / "a" / "v.mp4", 32, faststart=True)
    reader = readers.video(tmp_path, sequence_length=8)
    assert len(reader) == 4  # probed whole
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 3 // 4])  # then cut: the index is there, the later frames are not
    strict = _loader(reader)
    with pytest.raises(DecodeError) as info:
        [b async for b in strict]
    assert info.value.source == str(path) and info.value.key.startswith("a/v.mp4@")
    await strict.aclose()
    skip = _loader(reader, on_error="skip", max_errors=4)
    kept = [k for b in [b async for b in skip] for k in b.sample_keys]
    assert skip.stats().errors.get("DecodeError", 0) >= 1 and len(kept) + skip.stats().dropped == 4
    await skip.aclose()
    await leaks.check()


def test_wrong_arguments_are_config_errors(video_tree, tmp_path):
    with pytest.raises(ConfigError):
        readers.video(video_tree, sequence_length=0)
    with pytest.raises(ConfigError):
        readers.video(video_tree, sequence_length=4, stride=0)
    with pytest.raises(ConfigError):
        readers.video([video_tree / "a/v0.mp4"], sequence_length=4)
    with pytest.raises(ReadError):
        readers.video(tmp_path, sequence_length=4)  # no class folders with videos
