"""The probe's truncation check against two kinds of valid file whose container lists more frames
than the demuxer gives: a variable-rate AVI (each skipped frame an empty chunk) and an MP4/MOV
whose edit list starts past its first GOP (a stream-copy trim). Both were refused as truncated;
they must probe and decode clip by clip exactly as a decode of the whole file does, while a file
of each kind really cut off is still refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")

from sample_data import frame_index, make_video  # noqa: E402

from headrace import DecodeError, ops, readers  # noqa: E402
from headrace.readers.video import probe  # noqa: E402

FRAMES = 40
SHAPES = [(1, 1), (4, 1), (3, 3)]  # (sequence_length, stride)
CUT = 13  # the trim's first frame: past the first GOP (8 frames), mid-way through the second


def reference(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def listed_and_demuxed(path: Path) -> tuple[int, int]:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        return stream.frames, sum(1 for p in container.demux(stream) if p.size)


def variable_rate_avi(path: Path, codec: str) -> Path:
    """``make_video``'s 40 frames in AVI at 25 fps, a frame's slot skipped after every fifth frame:
    the AVI muxer writes an empty chunk for each skipped slot."""
    frames = reference(make_video(path.with_suffix(".src.mp4"), FRAMES))
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=25, options={"bf": "0"} if codec == "libx264" else {})
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.gop_size = 8
        for i, image in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = i + i // 5
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def trimmed(path: Path, faststart: bool = False) -> Path:
    """``make_video``'s 40 frames (H.264 with B-frames, a keyframe every 8) copied packet by packet
    with their timestamps moved back by 13 frames, as ``ffmpeg -ss 0.52 -c copy`` does: the MP4/MOV
    muxer writes an edit list that starts at frame 13."""
    source = make_video(path.with_suffix(".src.mp4"), FRAMES)
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(source)) as original, av.open(str(path), "w", options=options) as copy:
        stream_in = original.streams.video[0]
        stream_out = copy.add_stream_from_template(stream_in)
        shift = int(CUT / (stream_in.average_rate * stream_in.time_base))
        for packet in original.demux(stream_in):
            if packet.dts is None:
                continue
            packet.pts -= shift
            packet.dts -= shift
            packet.stream = stream_out
            copy.mux(packet)
    return path


def every_clip_is_exact(path: Path, frames: list[np.ndarray]) -> int:
    info = probe(str(path))
    assert info.frames == len(frames)
    count = 0
    for length, stride in SHAPES:
        span = (length - 1) * stride + 1
        for start in range(info.frames - span + 1):
            wanted = list(range(start, start + span, stride))
            got, _ = ops.decode_frames(str(path), start, stride, length, info.pts[wanted], key=f"v@{start}")
            assert len(got) == length, start
            assert all(np.array_equal(g, frames[k]) for g, k in zip(got, wanted)), (length, stride, start)
            count += 1
    return count


@pytest.mark.parametrize("codec", ["mpeg4", "libx264"])
def test_a_variable_rate_avi_is_not_truncated_and_every_clip_is_its_frames(tmp_path, codec):
    """Its count has the empty chunks of the 7 skipped frames: "lists 47 frames, 40 could be read"."""
    path = variable_rate_avi(tmp_path / "v.avi", codec)
    assert listed_and_demuxed(path) == (47, 40)  # the case at hand
    frames = reference(path)
    assert [frame_index(f) for f in frames] == list(range(FRAMES))
    assert every_clip_is_exact(path, frames) == 40 + 37 + 34
    assert probe(path.read_bytes()).frames == FRAMES  # a remote video or tar member: its bytes


@pytest.mark.parametrize("ext", ["mp4", "mov"])
def test_a_file_whose_edit_list_starts_past_its_first_gop_is_not_truncated(tmp_path, ext):
    """The demuxer drops the first GOP (before the keyframe the edit starts from): "lists 40
    frames, 32 could be read"."""
    path = trimmed(tmp_path / f"v.{ext}")
    assert listed_and_demuxed(path) == (40, 32)  # the case at hand
    frames = reference(path)
    assert [frame_index(f) for f in frames] == list(range(CUT, FRAMES))
    shown = FRAMES - CUT
    assert every_clip_is_exact(path, frames) == shown + (shown - 3) + (shown - 6)
    assert probe(path.read_bytes()).frames == shown


async def test_the_reader_gives_every_clip_of_both_files(tmp_path):
    variable_rate_avi(tmp_path / "a" / "v.avi", "mpeg4")
    trimmed(tmp_path / "b" / "v.mp4")
    for src in tmp_path.glob("*/*.src.mp4"):
        src.unlink()
    reader = readers.video(tmp_path, sequence_length=8)
    samples = [s async for chunk in reader.read(0, start=0, seed=0) for s in chunk]
    assert [s.error for s in samples] == [None] * len(samples)
    keys = [s.key for s in samples]
    assert keys == [f"a/v.avi@{s}" for s in range(0, 40, 8)] + [f"b/v.mp4@{s}" for s in range(0, 24, 8)]


@pytest.mark.parametrize("kind", ["avi", "vfr-avi", "trimmed-mp4", "trimmed-mov"])
def test_each_kind_cut_off_is_still_truncated(tmp_path, kind):
    if kind == "avi":
        whole = make_video(tmp_path / "w.avi", FRAMES, codec="mpeg4")
    elif kind == "vfr-avi":
        whole = variable_rate_avi(tmp_path / "w.avi", "mpeg4")
    else:  # the index (moov) first, so a cut keeps it and loses frames
        whole = trimmed(tmp_path / f"w.{kind[-3:]}", faststart=True)
        assert probe(str(whole)).frames == FRAMES - CUT
    data = whole.read_bytes()
    cut = tmp_path / f"cut{whole.suffix}"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(DecodeError) as info:
        probe(str(cut))
    assert "truncated" in str(info.value) and info.value.source == str(cut)
    with pytest.raises(DecodeError, match="truncated"):
        probe(cut.read_bytes())
