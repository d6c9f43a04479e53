"""ops.DecodeClip: the frames a clip asks for, exactly, and one crop and flip per clip."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")

from sample_data import frame_index, make_video  # noqa: E402

from headrace import ConfigError, Loader, ops, readers  # noqa: E402
from headrace.readers.video import probe  # noqa: E402


def reference_frames(path) -> list[np.ndarray]:
    """Every frame of the file, decoded from the start in one pass: what a seek must agree with."""
    with av.open(str(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("clips")
    return {
        "h264": make_video(root / "h264" / "v.mp4", 48, gop=8),  # B-frames: decode order is not display order
        "mpeg4": make_video(root / "mpeg4" / "v.avi", 48, codec="mpeg4", gop=8),
        "vfr": make_video(root / "vfr" / "v.mkv", 30, pts=[int(i * 40 + (i % 3) * 13 + (i // 10) * 7) for i in range(30)]),
    }


@pytest.mark.parametrize("kind", ["h264", "mpeg4", "vfr"])
@pytest.mark.parametrize(("start", "stride", "length"), [(0, 1, 8), (11, 1, 4), (13, 3, 5), (9, 2, 6), (17, 4, 3)])
def test_a_clip_is_exactly_its_frames_even_after_a_keyframe(videos, kind, start, stride, length):
    path = videos[kind]
    info = probe(str(path))
    reference = reference_frames(path)
    assert info.frames == len(reference)
    wanted = list(range(start, start + stride * length, stride))
    frames, stamps = ops.decode_frames(str(path), start, stride, length, info.pts[wanted])
    assert [frame_index(f) for f in frames] == wanted
    for got, k in zip(frames, wanted):
        assert np.array_equal(got, reference[k])  # bit-exact: a seek decodes what a full pass does
    np.testing.assert_allclose(stamps, info.pts[wanted] * info.time_base)
    if kind != "vfr":  # constant rate: the frame's place follows from the rate alone
        by_rate, _ = ops.decode_frames(str(path), start, stride, length)
        assert np.array_equal(by_rate, frames)


async def test_batches_are_b_f_c_h_w_with_labels_and_one_crop_and_flip_per_clip(videos, leaks):
    reader = readers.video(videos["h264"].parents[1], sequence_length=4, stride=3, step=2)  # the three videos
    references = {kind: reference_frames(path) for kind, path in videos.items()}
    pipeline = ops.video_pipeline(crop=(16, 24), flip=0.5)
    loader = Loader(reader, batch_size=4, pipeline=pipeline, device="cpu", num_threads=2, seed=11)
    batches = [b async for b in loader]
    await loader.aclose()
    seen = set()
    for batch in batches:
        video = batch["video"]
        assert video.dtype == torch.uint8 and video.shape[1:] == (4, 3, 16, 24)
        assert batch["timestamps"].shape == (len(video), 4) and batch["timestamps"].dtype == torch.float64
        kinds = [key.split("/")[0] for key in batch.sample_keys]
        assert batch["label"].tolist() == [sorted(videos).index(kind) for kind in kinds]
        for clip, key, kind, start, path in zip(video, batch.sample_keys, kinds, batch["start"].tolist(), batch["path"]):
            assert key.endswith(f"@{start}") and path == str(videos[kind])
            full = references[kind]
            places = [_placement(frame.permute(1, 2, 0).numpy(), full[start + 3 * f]) for f, frame in enumerate(clip)]
            assert len(places[0]) == 1 and all(p == places[0] for p in places)  # one window and flip for all frames
            seen |= places[0]
    assert len(reader) == 20 + 20 + 11 == sum(len(b.sample_keys) for b in batches)
    assert len({flipped for _, _, flipped in seen}) == 2 and len({(t, l) for t, l, _ in seen}) > 3
    await leaks.check()


def _placement(frame: np.ndarray, full: np.ndarray) -> set[tuple[int, int, bool]]:
    """Every (top, left, flipped) at which ``frame`` is a window of ``full``."""
    h, w = frame.shape[:2]
    found = set()
    for flipped in (False, True):
        source = full[:, ::-1] if flipped else full
        for top in range(full.shape[0] - h + 1):
            for left in range(full.shape[1] - w + 1):
                if np.array_equal(source[top : top + h, left : left + w], frame):
                    found.add((top, full.shape[1] - w - left if flipped else left, flipped))
    return found


async def test_resize_and_layout(videos):
    reader = readers.video([(videos["mpeg4"], 3)], sequence_length=2, stride=5)
    loader = Loader(reader, batch_size=2, pipeline=ops.video_pipeline(size=(30, 40), layout="FHWC"), device="cpu")
    batch = [b async for b in loader][0]
    await loader.aclose()
    assert batch["video"].shape == (2, 2, 30, 40, 3) and batch["label"].tolist() == [3, 3]
    reference = torch.from_numpy(reference_frames(videos["mpeg4"])[5]).permute(2, 0, 1)[None].float()
    resized = torch.nn.functional.interpolate(reference, size=(30, 40), mode="bilinear", antialias=True)
    expected = resized.round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 0)
    assert torch.equal(batch["video"][0, 1], expected)


def test_decode_clip_arguments():
    for bad in ({"size": 0}, {"size": (3, 4, 5)}, {"crop": (2, -1)}, {"flip": 1.5}, {"layout": "CHW"}):
        with pytest.raises(ConfigError):
            ops.DecodeClip(**bad)
    assert "crop=(8, 8)" in repr(ops.DecodeClip(crop=8))


@pytest.mark.parametrize(("name", "codec"), [("v.ts", "libx264"), ("v.mpg", "mpeg2video")])
def test_every_clip_of_an_mpeg_ts_or_ps_file_decodes_exactly(tmp_path, name, codec):
    """MPEG-TS and MPEG-PS have no index: a seek searches. TS seeks by decode time, so a seek to its
    first frame's presentation time lands on its second keyframe; a PS seek near the end lands past
    the last frame. Either way the clip must still be its frames, decoded from the file's start."""
    path = make_video(tmp_path / name, 40, codec=codec)
    info = probe(str(path))
    reference = reference_frames(path)
    assert info.frames == len(reference) == 40
    for start in range(0, 37):
        wanted = list(range(start, start + 4))
        frames, _ = ops.decode_frames(str(path), start, 1, 4, info.pts[wanted], key=f"v@{start}")
        assert [frame_index(f) for f in frames] == wanted
        assert all(np.array_equal(got, reference[k]) for got, k in zip(frames, wanted))
