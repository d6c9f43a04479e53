"""DecodeClip(device="cuda"): NVDEC through PyNvVideoCodec against the CPU path (PyAV) on the same
clips, the loader on the GPU (augmentation, resume, shards, tar members), rotation, 10-bit video,
and GPU memory and threads over epochs and early exits.

Bound (video_data.MAX_DIFF, MEAN_DIFF): per frame, |GPU - CPU| max <= 8 and mean <= 0.5 (uint8):
NVDEC's colour conversion is not FFmpeg's (measured max 4-5, mean 0.01 at 720p)."""

from __future__ import annotations

import concurrent.futures
import gc
import os
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from exits import EXITS, random_exits
from sample_data import frame_index, make_video, tar_bytes
from video_data import RESIZED_MEAN_DIFF, H, W, close, diff, hevc_10bit, read_all, rotated

from headrace import DecodeError, Loader, ops, readers
from headrace.readers.video import probe

CLIPS = [(0, 1, 8), (11, 1, 4), (13, 3, 5), (9, 2, 6), (17, 4, 3)]


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu-clips")
    return {
        "h264": make_video(root / "h264" / "v.mp4", 48, gop=8, width=W, height=H),  # B-frames
        "vfr": make_video(root / "vfr" / "v.mkv", 30, width=W, height=H,
                          pts=[int(i * 40 + (i % 3) * 13 + (i // 10) * 7) for i in range(30)]),
        "mpeg4": make_video(root / "mpeg4" / "v.avi", 48, codec="mpeg4", gop=8, width=W, height=H),
    }


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gpu-tree")
    for rel, n in {"a/v0.mp4": 40, "a/v1.mp4": 43, "b/v0.mp4": 33}.items():
        make_video(root / rel, n, width=W, height=H)
    return root


def _fields(path, start, stride, length):
    info = probe(str(path))
    wanted = list(range(start, start + stride * length, stride))
    return {"video": str(path), "clip": np.array([start, stride, length], np.int64), "pts": info.pts[wanted],
            "timestamps": info.pts[wanted] * info.time_base}


def test_what_pynvvideocodec_reports(videos):
    """Not a check: what the decoder says of frames (printed), for the record."""
    import PyNvVideoCodec as nvc

    for kind, path in videos.items():
        info = probe(str(path))
        try:
            d = nvc.SimpleDecoder(str(path), gpu_id=0, use_device_memory=True, output_color_type=nvc.OutputColorType.RGBP)
            frames = d.get_batch_frames_by_index([0, 1, 2, 9])
            m = d.get_stream_metadata()
            print(f"\n{kind}: len {len(d)} probe {info.frames}; codec {m.codec_name} fps {m.average_fps}; "
                  f"getPTS {[f.getPTS() for f in frames]} timestamp {[getattr(f, 'timestamp', None) for f in frames]} "
                  f"probe pts {info.pts[[0, 1, 2, 9]].tolist()}; event {type(frames[0].decoder_stream_event)} "
                  f"{frames[0].decoder_stream_event}")
        except Exception as exc:
            print(f"\n{kind}: {type(exc).__name__}: {exc}")


@pytest.mark.parametrize("kind", ["h264", "vfr", "mpeg4"])
@pytest.mark.parametrize(("start", "stride", "length"), CLIPS)
def test_gpu_frames_are_the_cpu_frames_of_the_clip(videos, kind, start, stride, length):
    path = videos[kind]
    fields = _fields(path, start, stride, length)
    cpu, gpu = ops.DecodeClip(), ops.DecodeClip(device="cuda")
    want = cpu.fn(dict(fields), rng=np.random.default_rng(0), key="k")
    try:
        got = gpu.fn(dict(fields), rng=np.random.default_rng(0), key="k")
    except DecodeError as exc:
        assert exc.source == str(path) and exc.key == "k"
        if kind == "h264":
            raise
        pytest.xfail(f"{kind}: refused with a DecodeError: {exc}")
    video = got["video"]
    assert video.is_cuda and video.dtype == torch.uint8 and video.shape == (length, 3, H, W)
    wanted = list(range(start, start + stride * length, stride))
    found = [frame_index(f.cpu().numpy()) for f in video]
    if kind == "mpeg4":
        # MPEG-4 Part 2 does not define its inverse DCT exactly: NVDEC and FFmpeg drift apart over
        # P-frames (measured max 40, mean 3.9), and a grey level near 255 may read one index off.
        assert all(abs(f - w) <= 1 for f, w in zip(found, wanted)), (found, wanted)
        assert all(diff(g, c)[1] <= 6 for g, c in zip(video, want["video"]))
    else:
        assert found == wanted
        for g, c in zip(video, want["video"]):
            assert close(g, c), diff(g, c)
    np.testing.assert_array_equal(got["timestamps"], want["timestamps"])
    assert (got["start"], got["path"]) == (start, str(path))


@pytest.mark.parametrize("threads", [1, 3])
def test_kept_decoders_give_each_clips_own_frames(tree, threads):
    """Many clips of a few videos, in a seeded random order, on decoders kept from clip to clip (one
    per video per thread: no reconfigure). PyNvVideoCodec 2.2.4 without a seek before each clip gave
    the first frame of 8 of 1,920 such clips from one GOP later (timestamp right, pixels wrong)."""
    videos = {str(p): probe(str(p)).frames for p in sorted(tree.rglob("*.mp4"))}
    decode = ops.DecodeClip(device="cuda", decoders_per_thread=len(videos))
    rng = np.random.default_rng(5)
    clips = []
    for _ in range(240):
        path = list(videos)[rng.integers(len(videos))]
        clips.append((path, int(rng.integers(videos[path] - 9))))

    def frames_of(clip):
        path, start = clip
        got = decode.fn(_fields(path, start, 3, 4), rng=np.random.default_rng(0), key=f"{path}@{start}")
        return [frame_index(frame.cpu().numpy()) for frame in got["video"]]

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        found = list(pool.map(frames_of, clips))
    wrong = [(clip, got) for clip, got in zip(clips, found) if got != list(range(clip[1], clip[1] + 12, 3))]
    assert not wrong, wrong[:5]


def _loader(reader, device, **kw):
    kw.setdefault("pipeline", ops.video_pipeline(size=(48, 64), crop=(32, 32), flip=0.5, device=device))
    return Loader(reader, batch_size=4, device=device, num_threads=3, seed=11, **kw)


async def _epoch(loader, limit=None):
    out = []
    async for batch in loader:
        out.append(batch)
        if limit is not None and len(out) == limit:
            break
    return out


async def test_loader_on_the_gpu_gives_the_cpu_paths_clips_crops_and_flips(tree, leaks):
    reader = lambda: readers.video(tree, sequence_length=4, stride=3, step=5)  # noqa: E731
    cpu, gpu = _loader(reader(), "cpu"), _loader(reader(), "cuda")
    want, got = await _epoch(cpu), await _epoch(gpu)
    await cpu.aclose()
    await gpu.aclose()
    assert [b.sample_keys for b in got] == [b.sample_keys for b in want] and len(got) > 3
    flips = set()
    for g, c in zip(got, want):
        video = g["video"]
        assert video.is_cuda and video.dtype == torch.uint8 and video.shape[1:] == (4, 3, 32, 32)
        for name in ("label", "start", "timestamps"):
            assert torch.equal(g[name].cpu(), c[name].cpu()), name
        assert g["path"] == c["path"]
        for gc_, cc in zip(video, c["video"]):
            for gf, cf in zip(gc_, cc):
                assert close(gf, cf, RESIZED_MEAN_DIFF), diff(gf, cf)  # the same window and flip: else far apart
            bottom = gc_[:, :, -4:]  # the fixed texture: one window for all frames of the clip (its
            # coding noise across frames reached 11 levels at most: another window would be ~80 apart)
            assert float((bottom.float() - bottom[:1].float()).abs().mean()) <= 4
            flips.add(diff(gc_, cc)[1] < diff(gc_, cc.flip(-1))[1])
    assert flips == {True}
    await leaks.check()


async def test_layout_fhwc_and_the_files_own_size(tree):
    reader = readers.video([(tree / "a/v0.mp4", 2)], sequence_length=3, stride=2)
    loader = Loader(reader, batch_size=2, device="cuda", pipeline=ops.video_pipeline(layout="FHWC", device="cuda"))
    batch = (await _epoch(loader))[0]
    await loader.aclose()
    assert batch["video"].shape == (2, 3, H, W, 3) and batch["video"].is_cuda
    assert [frame_index(f.cpu().numpy()) for f in batch["video"][1]] == [5, 7, 9]


async def test_resume_mid_epoch_gives_the_same_clips_and_pixels(tree, leaks):
    def reader():
        return readers.video(tree, sequence_length=4, stride=2, clips_per_video=3, shuffle=True)

    full = _loader(reader(), "cuda")
    expected = await _epoch(full)
    await full.aclose()
    first = _loader(reader(), "cuda")
    await _epoch(first, limit=2)
    state = first.state_dict()
    await first.aclose()
    second = _loader(reader(), "cuda")
    second.load_state_dict(state)
    rest = await _epoch(second)
    await second.aclose()
    assert len(rest) == len(expected) - 2
    for x, y in zip(expected[2:], rest, strict=True):
        assert x.sample_keys == y.sample_keys and torch.equal(x["video"], y["video"])
    await leaks.check()


async def test_shards_of_two_ranks_are_disjoint_complete_and_the_same_pixels(tree):
    reader = lambda: readers.video(tree, sequence_length=4, stride=2, step=3, shuffle=True)  # noqa: E731
    whole = _loader(reader(), "cuda")
    one = {k: v for b in await _epoch(whole) for k, v in zip(b.sample_keys, b["video"])}
    await whole.aclose()
    seen = {}
    for rank in range(2):
        loader = _loader(reader(), "cuda", rank=rank, world=2)
        for b in await _epoch(loader):
            for k, v in zip(b.sample_keys, b["video"]):
                assert k not in seen or torch.equal(seen[k], v)  # a rank's padding repeats a clip, same pixels
                seen[k] = v
        await loader.aclose()
    assert set(seen) == set(one)
    for k, v in seen.items():
        assert torch.equal(v, one[k]), k


async def test_tar_members_decode_as_their_files(tree, tmp_path):
    members = []
    for rel in ("a/v0.mp4", "b/v0.mp4"):
        key = rel.replace("/", "_")[:-4]
        members += [(f"{key}.mp4", (tree / rel).read_bytes()), (f"{key}.cls", b"1")]
    (tmp_path / "s-000.tar").write_bytes(tar_bytes(members))
    shards = _loader(readers.video(str(tmp_path / "s-*.tar"), sequence_length=4, stride=2), "cuda")
    files = _loader(readers.video([(tree / "a/v0.mp4", 1), (tree / "b/v0.mp4", 1)], sequence_length=4, stride=2),
                    "cuda")
    a, b = await _epoch(shards), await _epoch(files)
    await shards.aclose()
    await files.aclose()
    assert sum(len(x.sample_keys) for x in a) == sum(len(x.sample_keys) for x in b) > 0
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x["video"], y["video"])
        assert x["path"][0].endswith(".tar:a_v0.mp4") or x["path"][0].endswith(".tar:b_v0.mp4")


@pytest.mark.parametrize("degrees", [90, 180, -90])
async def test_rotation_metadata_is_applied(tmp_path, degrees):
    path = rotated(tmp_path / "r" / "v.mp4", degrees)
    with av.open(str(path)) as container:
        coded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    loader = Loader(readers.video([(path, 0)], sequence_length=4, stride=2), batch_size=2, device="cuda",
                    pipeline=ops.video_pipeline(layout="FHWC", device="cuda"))
    batches = await _epoch(loader)
    await loader.aclose()
    video = batches[0]["video"]
    assert video.shape[2:4] == ((W, H) if degrees % 180 else (H, W))
    for clip, start in zip(video, (0, 7)):
        for f, frame in enumerate(clip):
            expected = torch.from_numpy(np.ascontiguousarray(np.rot90(coded[start + 2 * f], degrees // 90)))
            assert close(frame, expected), diff(frame, expected)


async def test_a_mirrored_display_matrix_is_refused_naming_the_file(tmp_path):
    path = rotated(tmp_path / "m" / "v.mp4", 90, hflip=True)
    loader = Loader(readers.video([(path, 0)], sequence_length=4), batch_size=2, device="cuda",
                    pipeline=ops.video_pipeline(device="cuda"))
    with pytest.raises(DecodeError, match="mirrors") as info:
        await _epoch(loader)
    await loader.aclose()
    assert info.value.source == str(path)


def test_10_bit_video_is_refused_with_a_decode_error(tmp_path):
    path = hevc_10bit(tmp_path / "ten" / "v.mp4")
    if path is None:
        pytest.skip("PyAV has no libx265 to make a 10-bit video")
    fields = _fields(path, 3, 2, 4)
    want = ops.DecodeClip().fn(dict(fields), rng=np.random.default_rng(0), key="k")
    try:
        got = ops.DecodeClip(device="cuda").fn(dict(fields), rng=np.random.default_rng(0), key="k")
    except DecodeError as exc:  # NVDEC's 8-bit RGB of it differed from FFmpeg's by a mean of 10.7: refused
        print(f"\n10-bit HEVC: DecodeError: {exc}")
        assert exc.source == str(path) and exc.key == "k" and "10-bit" in str(exc)
        return
    pytest.fail(f"10-bit HEVC decoded on the GPU ({diff(got['video'], want['video'])} from the CPU path), not refused")


def _allocated() -> int:
    gc.collect()
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


async def test_gpu_memory_is_flat_over_epochs_and_early_exits_leave_nothing(tree, leaks):
    keys = {s.key for s in await read_all(readers.video(tree, sequence_length=4, stride=2, step=3))}
    before, threads_before = _allocated(), _native_threads()

    def make():
        return _loader(readers.video(tree, sequence_length=4, stride=2, step=3, shuffle=True, chunk_size=4), "cuda")

    loader = make()
    allocated, free = [], []
    for _ in range(6):
        assert {k for b in await _epoch(loader) for k in b.sample_keys} == keys
        allocated.append(_allocated())
        free.append(torch.cuda.mem_get_info()[0])
    await loader.aclose()
    print(f"\nCUDA bytes allocated after each epoch {allocated}; free {[f >> 20 for f in free]} MiB")
    assert max(allocated[1:]) - allocated[0] <= 8 << 20  # torch's: flat
    assert free[0] - min(free[1:]) <= 256 << 20  # the driver's (decoders): flat
    # Each of the loader's 3 threads keeps up to 2 decoders (DecodeClip's decoders_per_thread), each
    # with its video file open, moving from file to file: those stay open between epochs by design.
    done = await random_exits(make, rounds=20, expected_keys=keys, seed=17, whole_every=5, max_delay=0.02,
                              memory=_allocated, memory_slack=16 << 20,
                              kept_open=lambda path: path.startswith(str(tree)), kept_open_max=3 * 2)
    assert set(EXITS) <= set(done)
    loader = make()
    async for batch in loader:  # a plain break in the first batch, mid-clip for the other threads
        assert batch["video"].is_cuda
        break
    await loader.aclose()
    after = _allocated()
    print(f"exits {dict(done)}; allocated before {before}, after {after}; native threads {threads_before} -> "
          f"{_native_threads()}")
    assert after - before <= 1 << 20
    await leaks.check(settle=5.0)
