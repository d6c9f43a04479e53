"""H.264 with B-frames in AVI on the CPU path. AVI has no presentation timestamps: the packets'
are decode order, and a decoded frame carries its packet's, so frames come out of the decoder in
presentation order with their timestamps scrambled. Clips must still be exactly their frames, as a
decode of the whole file from its start gives them."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")

from sample_data import frame_index  # noqa: E402

from headrace import DecodeError, Loader, ops, readers  # noqa: E402
from headrace.ops import _video  # noqa: E402
from headrace.readers.video import probe  # noqa: E402

FRAMES = 40
OPTIONS = {  # libx264 options: B-frames, closed GOPs (an IDR every 8 frames) or open ones (one IDR, then I-frames)
    "bf2": {"bf": "2"},
    "bf3": {"bf": "3", "x264-params": "b-pyramid=normal"},
    "open-gop": {"bf": "2", "x264-params": "open-gop=1:keyint=8:min-keyint=8:scenecut=0"},
}


def write_avi(path: Path, frames: int, options: dict[str, str], codec: str = "libx264") -> Path:
    """``make_video``'s frames (``frame_index`` reads each one's number back) in AVI, H.264 by default."""
    path.parent.mkdir(parents=True, exist_ok=True)
    texture = np.random.default_rng(0).integers(0, 256, (6, 16, 3), dtype=np.uint8).repeat(4, 0).repeat(4, 1)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=25, options=options)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.gop_size = 8
        for i in range(frames):
            image = np.empty((48, 64, 3), np.uint8)
            image[:24, :32], image[:24, 32:], image[24:] = 8 + 16 * (i // 16), 8 + 16 * (i % 16), texture
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode())
    return path


def reference(path: Path) -> tuple[list[np.ndarray], list[int]]:
    """Every frame of the file decoded from its start in one pass, and the timestamps they came with."""
    with av.open(str(path)) as container:
        decoded = list(container.decode(video=0))
        return [f.to_ndarray(format="rgb24") for f in decoded], [f.pts for f in decoded]


def nal_types(data: bytes) -> list[int]:
    """The NAL unit types of an Annex B packet (what AVI holds): 5 is an IDR slice."""
    return [data[i + 3] & 0x1F for i in range(len(data) - 3) if data[i : i + 3] == b"\x00\x00\x01"]


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("avi-bframes")
    return {name: write_avi(root / name / "v.avi", FRAMES, options) for name, options in OPTIONS.items()}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_every_clip_is_exactly_its_frames(videos, name):
    path = videos[name]
    frames, stamps = reference(path)
    assert [frame_index(f) for f in frames] == list(range(FRAMES))
    assert stamps != sorted(stamps)  # the case at hand: the decoder's timestamps are not presentation order
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        keys = [5 in nal_types(bytes(p)) for p in container.demux(stream) if p.is_keyframe]
    assert len(keys) == 5 and keys[0] and all(keys[1:]) == (name != "open-gop")  # open GOPs: I-frames, not IDR
    info = probe(str(path))
    assert info.frames == FRAMES
    data = path.read_bytes()
    clips = 0
    for length, stride in [(1, 1), (4, 1), (3, 3), (8, 2), (5, 7)]:
        span = (length - 1) * stride + 1
        for start in range(FRAMES - span + 1):
            wanted = list(range(start, start + span, stride))
            source = data if start % 2 else str(path)  # a tar member's bytes decode as the file does
            got, seconds = ops.decode_frames(source, start, stride, length, info.pts[wanted], key=f"v@{start}")
            assert [frame_index(f) for f in got] == wanted
            assert all(np.array_equal(g, frames[k]) for g, k in zip(got, wanted))  # pixel-exact
            np.testing.assert_allclose(seconds, info.pts[wanted] * info.time_base)
            clips += 1
    assert clips == 40 + 37 + 34 + 26 + 12


async def test_shuffled_loader_gives_each_clip_its_frames(videos, leaks):
    root = videos["bf2"].parents[1]
    references = {name: reference(path)[0] for name, path in videos.items()}
    reader = readers.video(root, sequence_length=4, stride=2, step=3, shuffle=True, seed=4)
    loader = Loader(reader, batch_size=4, pipeline=ops.video_pipeline(), device="cpu", num_threads=2)
    batches = [b async for b in loader]
    await loader.aclose()
    seen = 0
    for batch in batches:
        for clip, key, start in zip(batch["video"], batch.sample_keys, batch["start"].tolist()):
            full = references[key.split("/")[0]]
            for f, frame in enumerate(clip):
                assert torch.equal(frame.permute(1, 2, 0), torch.from_numpy(full[start + 2 * f]))
            seen += 1
    assert seen == len(reader) == 3 * ((FRAMES - 7) // 3 + 1)


def test_decoding_by_timestamp_refuses_frames_whose_timestamps_go_back(videos):
    """The timestamp path (every other container) matched the scrambled timestamps to wrong frames;
    now a stream whose decoded timestamps go back is a DecodeError, never frames out of order."""
    path = videos["bf2"]
    info = probe(str(path))
    with av.open(str(path)) as container, pytest.raises(DecodeError, match="timestamps go back"):
        stream = container.streams.video[0]
        _video._collect(container, stream, [int(p) for p in info.pts[9:13]])
    with av.open(io.BytesIO(path.read_bytes())) as container:
        assert _video._avi_h264(container, container.streams.video[0])


def test_mpeg4_with_b_frames_in_avi_stays_on_the_timestamp_path(tmp_path):
    """MPEG-4 ASP's parser gives its AVI packets presentation timestamps: decoded by timestamp, exactly."""
    path = write_avi(tmp_path / "m4.avi", FRAMES, {"bf": "2"}, codec="mpeg4")
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert not _video._avi_h264(container, stream)
        packets = [p.pts for p in container.demux(stream) if p.size]
    assert packets != sorted(packets)  # B-frames: decode order is not presentation order
    frames, stamps = reference(path)
    assert stamps == sorted(stamps)
    info = probe(str(path))
    for start in range(FRAMES - 6):
        wanted = list(range(start, start + 7, 3))
        got, _ = ops.decode_frames(str(path), start, 3, 3, info.pts[wanted])
        assert all(np.array_equal(g, frames[k]) for g, k in zip(got, wanted))
