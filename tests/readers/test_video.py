"""readers.video: clips by (video, start frame), over small real videos made here with PyAV.

Each frame's pixels say its index (``make_video``), so a decoded frame is identified within the
codec's error. The decode itself is tested in tests/ops/test_video_decode.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")

from sample_data import frame_index, make_video, tar_bytes  # noqa: E402

from headrace import ConfigError, DecodeError, Loader, ReadError, ops, readers  # noqa: E402

FRAMES = {"a/v0.mp4": 40, "a/v1.mp4": 43, "b/v0.mp4": 33, "b/short.mp4": 5}


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
    assert len(expected) > 1
    async for batch in first:
        if batch.index == 0:  # mid-epoch (a state after the epoch's last batch resumes at the next epoch)
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
    assert len(rest) == len(expected) - 1
    for x, y in zip(expected[1:], rest, strict=True):
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
    for bad in samples[3:]:  # the files were read; their content is not a whole video: DecodeError
        assert isinstance(bad.error, DecodeError) and bad.error.key == bad.key
        assert bad.error.source == str(broken_tree / bad.key.split("@")[0])
    assert "truncated" in str(samples[3].error)


async def test_unreadable_videos_raise_or_are_skipped_and_counted(broken_tree, leaks):
    strict = _loader(readers.video(broken_tree, sequence_length=8))
    with pytest.raises(DecodeError) as info:
        [b async for b in strict]
    assert info.value.source == str(broken_tree / "a/truncated.mp4")
    await strict.aclose()
    skip = _loader(readers.video(broken_tree, sequence_length=8), on_error="skip", max_errors=2)
    batches = [b async for b in skip]
    assert [k for b in batches for k in b.sample_keys] == ["a/good.mp4@0", "a/good.mp4@8", "a/good.mp4@16"]
    assert skip.stats().errors == {"DecodeError": 2} and skip.stats().dropped == 2
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


# -- WebDataset tar shards of video members ------------------------------------------------------------------

SHARDED = {"s0": [("000", 40, 1), ("001", 26, None)], "s1": [("002", 33, 0), ("003", 5, 2)]}  # key, frames, label


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    """Two tar shards of ``<key>.mp4`` (+ ``<key>.cls`` but for one), and the same videos as files."""
    root = tmp_path_factory.mktemp("shards")
    for shard, items in SHARDED.items():
        members = []
        for key, frames, label in items:
            members.append((f"{key}.mp4", make_video(root / "files" / f"{key}.mp4", frames).read_bytes()))
            if label is not None:
                members.append((f"{key}.cls", str(label).encode()))
        (root / "tars").mkdir(exist_ok=True)
        (root / "tars" / f"{shard}.tar").write_bytes(tar_bytes(members))
    return root


def _shard_of(key):
    return next(shard for shard, items in SHARDED.items() if any(k == key for k, _, _ in items))


@pytest.mark.parametrize("form", ["folder", "glob", "list"])
async def test_tar_shards_give_clips_with_the_members_bytes_and_cls_labels(shard_dir, form):
    tars = shard_dir / "tars"
    source = {"folder": tars, "glob": str(tars / "s*.tar"), "list": [str(tars / "s0.tar"), tars / "s1.tar"]}[form]
    reader = readers.video(source, sequence_length=4, stride=2, step=5)
    samples = await read_all(reader)
    frames = {key: n for items in SHARDED.values() for key, n, _ in items}
    assert [s.key for s in samples] == expected_keys(7, 5, frames) and len(reader) == len(samples)
    labels = {key: label for items in SHARDED.values() for key, _, label in items}
    for s in samples:
        key = s.key.split("@")[0]
        name = f"{tars / _shard_of(key)}.tar:{key}.mp4"
        assert s.source == s.fields["path"] == name
        assert s.fields["video"] == (shard_dir / "files" / f"{key}.mp4").read_bytes()
        assert s.fields.get("cls") == labels[key]  # no .cls member: no cls field
    assert "2 shards" in repr(reader)


async def test_clips_from_shards_decode_to_the_pixels_of_the_same_files(shard_dir, leaks):
    pipeline = ops.video_pipeline(size=(24, 32), crop=(16, 16), flip=0.5, label=None)
    from_tars = _loader(readers.video(shard_dir / "tars", sequence_length=4, stride=3), pipeline=pipeline)
    files = [(shard_dir / "files" / f"{key}.mp4", 0) for items in SHARDED.values() for key, _, _ in items]
    from_files = _loader(readers.video(files, sequence_length=4, stride=3), pipeline=pipeline)
    got, expected = [b async for b in from_tars], [b async for b in from_files]
    await from_tars.aclose()
    await from_files.aclose()
    assert [b.sample_keys for b in got] == [[k.split("/")[-1].replace(".mp4", "") for k in b.sample_keys]
                                            for b in expected]
    for x, y in zip(got, expected, strict=True):
        assert torch.equal(x["video"], y["video"]) and torch.equal(x["start"], y["start"])
        assert all(p.endswith(f":{k.split('@')[0]}.mp4") for p, k in zip(x["path"], x.sample_keys))
    frames = readers.video(shard_dir / "tars", sequence_length=1)
    one = await read_all(frames)
    decoded = ops.decode_frames(one[3].fields["video"], 3, 1, 1, key=one[3].key, source=one[3].source)[0]
    assert frame_index(decoded[0]) == 3
    await leaks.check()


async def test_tar_shards_shuffle_shard_and_resume_exactly(shard_dir, leaks):
    def reader():
        return readers.video(shard_dir / "tars", sequence_length=4, stride=2, step=3, shuffle=True, seed=4)

    everything = [s.key for s in await read_all(reader(), epoch=1)]
    parts = [[s.key for s in await read_all(reader().shard(r, 2), epoch=1)] for r in range(2)]
    assert sorted(everything) == sorted(parts[0] + parts[1]) and not set(parts[0]) & set(parts[1])
    pipeline = ops.video_pipeline(crop=(16, 16), flip=0.5, label=None)
    full = _loader(reader(), pipeline=pipeline)
    expected = [b async for b in full]
    await full.aclose()
    first = _loader(reader(), pipeline=pipeline)
    async for batch in first:
        if batch.index == 2:
            break
    state = first.state_dict()
    await first.aclose()
    second = _loader(reader(), pipeline=pipeline)
    second.load_state_dict(state)
    rest = [b async for b in second]
    await second.aclose()
    assert len(rest) == len(expected) - 3 > 0
    for x, y in zip(expected[3:], rest, strict=True):
        assert x.sample_keys == y.sample_keys and torch.equal(x["video"], y["video"])
    await leaks.check()


@pytest.fixture
def broken_shards(shard_dir, tmp_path) -> Path:
    """s0: a good video, a member that is not a video, a bad label; s1: cut off inside its second video."""
    files = shard_dir / "files"
    good, other = (files / "000.mp4").read_bytes(), (files / "002.mp4").read_bytes()
    (tmp_path / "s0.tar").write_bytes(tar_bytes([("a.mp4", good), ("a.cls", b"3"), ("b.mp4", b"not a video\n"),
                                                  ("c.mp4", good), ("c.cls", b"cat")]))
    whole = tar_bytes([("d.mp4", other), ("e.mp4", good), ("f.mp4", other)])
    (tmp_path / "s1.tar").write_bytes(whole[: 512 + len(other) + 512 + len(good) // 2])
    return tmp_path


async def test_truncated_shards_and_corrupt_members_are_errors_naming_shard_and_member(broken_shards):
    reader = readers.video(broken_shards, sequence_length=8, step=16)
    samples = await read_all(reader)
    assert [s.key for s in samples] == ["a@0", "a@16", "a@32", "b@0", "c@0", "d@0", "d@16", "e@0"]
    assert [s.error is None for s in samples] == [True, True, True, False, False, True, True, False]
    s0, s1 = str(broken_shards / "s0.tar"), str(broken_shards / "s1.tar")
    for bad, shard, member, words, kind in ((samples[3], s0, "b.mp4", "cannot read video", DecodeError),
                                            (samples[4], s0, "c.cls", "not a label", ReadError),
                                            (samples[7], s1, "e.mp4", "truncated tar", ReadError)):
        assert type(bad.error) is kind and bad.error.key == bad.key and bad.error.source == shard
        assert repr(member) in str(bad.error) and words in str(bad.error)
    assert samples[0].fields["cls"] == 3 and "cls" not in samples[4].fields


async def test_broken_shards_raise_or_are_skipped_and_counted(broken_shards, leaks):
    pipeline = ops.video_pipeline(label=None)
    strict = _loader(readers.video(broken_shards, sequence_length=8, step=16), pipeline=pipeline)
    with pytest.raises(DecodeError) as info:  # b.mp4 is not a video
        [b async for b in strict]
    assert info.value.source == str(broken_shards / "s0.tar") and "'b.mp4'" in str(info.value)
    await strict.aclose()
    skip = _loader(readers.video(broken_shards, sequence_length=8, step=16), pipeline=pipeline,
                   on_error="skip", max_errors=3)
    batches = [b async for b in skip]
    assert [k for b in batches for k in b.sample_keys] == ["a@0", "a@16", "a@32", "d@0", "d@16"]
    assert all(b["video"].shape[1:] == (8, 3, 48, 64) for b in batches)
    assert skip.stats().errors == {"DecodeError": 1, "ReadError": 2} and skip.stats().dropped == 3
    await skip.aclose()
    await leaks.check()


async def test_a_member_cut_after_listing_is_a_decode_error_naming_shard_and_member(shard_dir, tmp_path, leaks):
    good = (shard_dir / "files" / "000.mp4").read_bytes()
    shard = tmp_path / "s.tar"
    shard.write_bytes(tar_bytes([("v.mp4", good)]))
    reader = readers.video([str(shard)], sequence_length=8)
    assert len(reader) == 5  # listed and probed whole; then the member's data is overwritten with zeros
    with open(shard, "r+b") as f:
        f.seek(512 + len(good) // 3)
        f.write(bytes(len(good) - len(good) // 3))
    strict = _loader(reader, pipeline=ops.video_pipeline(label=None))
    with pytest.raises(DecodeError) as info:
        [b async for b in strict]
    assert info.value.source == f"{shard}:v.mp4" and info.value.key.startswith("v@")
    await strict.aclose()
    await leaks.check()


def test_gzip_shards_are_refused(shard_dir, tmp_path):
    import gzip

    (tmp_path / "s.tar.gz").write_bytes(gzip.compress((shard_dir / "tars" / "s0.tar").read_bytes()))
    with pytest.raises(ConfigError, match="gzip"):
        readers.video(tmp_path, sequence_length=4)


async def test_a_corrupt_header_mid_shard_is_an_error_after_the_members_before_it(shard_dir, tmp_path):
    good = (shard_dir / "files" / "002.mp4").read_bytes()
    data = bytearray(tar_bytes([("x.mp4", good), ("y.mp4", good)]))
    second = 512 + (len(good) + 511) // 512 * 512
    data[second + 148 : second + 156] = b"0000000\0"  # the checksum of y.mp4's header no longer matches
    (tmp_path / "s.tar").write_bytes(bytes(data))
    samples = await read_all(readers.video(tmp_path / "s.tar", sequence_length=33))
    assert [s.key for s in samples] == ["x@0", "x#error@0"]
    bad = samples[1].error
    assert isinstance(bad, ReadError) and bad.source == str(tmp_path / "s.tar") and "'x.mp4'" in str(bad)


async def test_frames_an_edit_list_hides_are_not_counted(tmp_path, leaks):
    """An MP4 cut by stream copy keeps the packets before its edit list's start: the demuxer marks
    them discarded and the decoder never shows them. Frame k is the k-th frame shown."""
    import av

    source = make_video(tmp_path / "src.mp4", 40, gop=40)
    trimmed = tmp_path / "tree" / "a" / "cut.mp4"
    trimmed.parent.mkdir(parents=True)
    with av.open(str(source)) as src, av.open(str(trimmed), "w") as out:
        stream_in = src.streams.video[0]
        stream_out = out.add_stream_from_template(stream_in)
        shift = 3 * round(1 / (stream_in.time_base * stream_in.average_rate))  # 3 frames before the start
        for packet in src.demux(stream_in):
            if packet.dts is None:
                continue
            packet.pts, packet.dts, packet.stream = packet.pts - shift, packet.dts - shift, stream_out
            out.mux(packet)
    with av.open(str(trimmed)) as check:
        hidden = sum(p.is_discard for p in check.demux(check.streams.video[0]) if p.size)
    assert hidden == 3  # the file is what the test means it to be
    reader = readers.video(tmp_path / "tree", sequence_length=4)
    assert len(reader) == 9  # 37 frames shown: 9 clips of 4
    loader = Loader(reader, batch_size=3, device="cpu", num_threads=2, pipeline=ops.video_pipeline())
    by_key = {key: [frame_index(f.numpy()) for f in clip]
              async for b in loader for key, clip in zip(b.sample_keys, b["video"])}
    await loader.aclose()
    assert by_key["a/cut.mp4@0"] == [3, 4, 5, 6]  # the first frame shown is the source's frame 3
    assert all(frames == list(range(int(k.split("@")[1]) + 3, int(k.split("@")[1]) + 7)) for k, frames in by_key.items())
    assert len(by_key) == 9
    await leaks.check()
