"""The CPU decode path (``ops.decode_frames``) against a decode of the whole file from its start:
MPEG-PS with B-frames (a seek there gives timestamps half a frame off), and a file whose
timestamps are decode order (H.264 with B-frames copied out of AVI into MKV or MP4): no clip may
come out with another frame's pixels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")

from sample_data import frame_index, make_video  # noqa: E402

from headrace import DecodeError, ops  # noqa: E402
from headrace.readers.video import probe  # noqa: E402

FRAMES = 40
SHAPES = [(1, 1), (4, 1), (3, 3)]  # (sequence_length, stride)


def reference(path: Path) -> list[np.ndarray]:
    with av.open(str(path)) as container:
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]


def clips(path: Path):
    """Every clip of every shape: (start, wanted frames, frames or the DecodeError)."""
    info = probe(str(path))
    for length, stride in SHAPES:
        span = (length - 1) * stride + 1
        for start in range(info.frames - span + 1):
            wanted = list(range(start, start + span, stride))
            try:
                got, _ = ops.decode_frames(str(path), start, stride, length, info.pts[wanted], key=f"v@{start}")
            except DecodeError as exc:
                yield start, wanted, exc
            else:
                yield start, wanted, got


def test_every_clip_of_an_mpeg_ps_file_with_b_frames_is_exactly_its_frames(tmp_path):
    """MPEG-2 with B-frames in MPEG-PS (a DVD's .mpg): a seek past the third keyframe gave every
    packet a timestamp half a frame off, so 36 of 111 clips found none of their frames."""
    path = make_video(tmp_path / "v.mpg", FRAMES, codec="mpeg2video", gop=8)
    with av.open(str(path), "w") as container:  # make_video's frames again, with two B-frames
        stream = container.add_stream("mpeg2video", rate=25, options={"bf": "2"})
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.gop_size = 8
        for frame in reference(tmp_path / "v.mpg"):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    frames = reference(path)
    assert len(frames) == probe(str(path)).frames == FRAMES
    count = 0
    for start, wanted, got in clips(path):
        assert not isinstance(got, DecodeError), (start, got)
        assert all(np.array_equal(g, frames[k]) for g, k in zip(got, wanted)), start
        count += 1
    assert count == 40 + 37 + 34


def decode_order_stamps(path: Path, out: Path) -> Path:
    """H.264 with B-frames written to AVI (whose timestamps are decode order), its packets copied
    as they are into ``out`` (MKV or MP4): that file's timestamps are decode order too."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=25, options={"bf": "2"})
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.gop_size = 8
        for frame in reference(make_video(path.with_suffix(".src.mp4"), FRAMES)):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    with av.open(str(path)) as source, av.open(str(out), "w") as copy:
        stream_in = source.streams.video[0]
        stream_out = copy.add_stream_from_template(stream_in)
        for packet in source.demux(stream_in):
            if packet.dts is not None:
                packet.stream = stream_out
                copy.mux(packet)
    return out


@pytest.mark.parametrize("ext", ["mkv", "mp4"])
def test_a_clip_of_a_file_with_decode_order_timestamps_is_its_frames_or_a_decode_error(tmp_path, ext):
    """Such a file's decoded timestamps go back; a clip short enough to end before the first one
    that does came out with its neighbour's frame (5 of 111 clips, silently). Now each clip is
    exactly its frames or a DecodeError saying the timestamps go back."""
    path = decode_order_stamps(tmp_path / "v.avi", tmp_path / f"v.{ext}")
    frames = reference(path)
    assert [frame_index(f) for f in frames] == list(range(FRAMES))
    with av.open(str(path)) as container:
        stamps = [f.pts for f in container.decode(video=0)]
    assert stamps != sorted(stamps)  # the case at hand: decoded in presentation order, the timestamps scrambled
    refused = 0
    for start, wanted, got in clips(path):
        if isinstance(got, DecodeError):
            assert got.key == f"v@{start}" and got.source == str(path)
            refused += "timestamps go back" in str(got)
            continue
        assert [frame_index(g) for g in got] == wanted, start
        assert all(np.array_equal(g, frames[k]) for g, k in zip(got, wanted)), start
    assert refused > 0

