"""readers.video + ops.DecodeClip on the CPU path: resume on another world size, broken files under
``raise`` and ``skip``, rotation metadata, and leaving an epoch mid-clip (nothing left behind)."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")

from exits import EXITS, random_exits  # noqa: E402
from sample_data import make_video, rotated_video  # noqa: E402

from headrace import DecodeError, Loader, ops, readers  # noqa: E402

# Four videos of 48 frames, clips of 8 frames: 6 clips each, 24 in all (a multiple of 4 and 2, so no
# rank pads and "every clip exactly once" is exact).
VIDEOS = ["a/v0.mp4", "a/v1.mp4", "b/v0.mp4", "b/v1.mp4"]
CLIPS = {f"{rel}@{start}" for rel in VIDEOS for start in range(0, 48, 8)}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video-tree")
    for rel in VIDEOS:
        make_video(root / rel, 48)
    return root


def _loader(tree, rank=0, world=1, **kw):
    reader = readers.video(tree, sequence_length=8, shuffle=True)
    kw.setdefault("pipeline", ops.video_pipeline(size=(24, 32), crop=(16, 16), flip=0.5))
    return Loader(reader, batch_size=2, rank=rank, world=world, device="cpu", num_threads=1, seed=11, **kw)


async def _batches(loader, limit=None):
    out = []
    try:
        async for batch in loader:
            out.append(batch)
            if limit is not None and len(out) == limit:
                break
    finally:
        await loader.aclose()
    return out


@pytest.mark.parametrize("plan", [[(4, 1), (2, None)], [(2, 2), (4, None)], [(4, 1), (2, 1), (4, None)]])
async def test_resume_on_another_world_size_reads_every_clip_exactly_once(tree, plan, leaks):
    """Every rank stops after k batches; any rank's state goes to a job of another size, which
    finishes the epoch: together every clip once, with the pixels a one-rank run gives it."""
    whole = {k: v for b in await _batches(_loader(tree)) for k, v in zip(b.sample_keys, b["video"])}
    assert set(whole) == CLIPS
    seen, states = [], None
    for world, stop in plan:
        loaders = [_loader(tree, r, world) for r in range(world)]
        for r, lo in enumerate(loaders):
            if states is not None:
                lo.load_state_dict(states[(r + 1) % len(states)])
        parts = [await _batches(lo, stop) for lo in loaders]
        assert len({len(p) for p in parts}) == 1  # equal batch counts on every rank
        seen += [(k, v) for part in parts for b in part for k, v in zip(b.sample_keys, b["video"])]
        states = [lo.state_dict() for lo in loaders]
    counts = collections.Counter(k for k, _ in seen)
    assert set(counts) == CLIPS and set(counts.values()) == {1}
    for key, video in seen:  # a clip's crop and flip follow the clip, not the rank that read it
        assert torch.equal(video, whole[key]), key
    assert states[0]["epoch"] == 1  # the epoch was finished
    await leaks.check()


@pytest.fixture
def broken(tmp_path, tree) -> Path:
    """``a/good.mp4``; ``a/cut.mp4`` (its last third cut off: its index lists frames it lacks);
    ``b/zeroed.mp4`` (its index whole, the frames' data from a third on overwritten with zeros)."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "good.mp4").write_bytes((tree / "a/v0.mp4").read_bytes())
    whole = make_video(tmp_path / "whole.mp4", 48, faststart=True).read_bytes()
    (tmp_path / "whole.mp4").unlink()
    (tmp_path / "a" / "cut.mp4").write_bytes(whole[: len(whole) * 2 // 3])
    mdat = whole.index(b"mdat") + 4
    zeroed = bytearray(whole)
    third = mdat + (len(whole) - mdat) // 3
    zeroed[third:] = bytes(len(whole) - third)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "zeroed.mp4").write_bytes(bytes(zeroed))
    return tmp_path


async def test_truncated_and_corrupt_videos_raise_a_decode_error_naming_the_file_or_are_skipped(broken, leaks):
    def loader(**kw):
        return Loader(readers.video(broken, sequence_length=8), batch_size=2, device="cpu", num_threads=1,
                      pipeline=ops.video_pipeline(), **kw)

    with pytest.raises(DecodeError) as info:
        await _batches(loader())
    assert info.value.source == str(broken / "a/cut.mp4") and info.value.key == "a/cut.mp4@0"
    assert "truncated" in str(info.value)
    # without the cut file, the zeroed one fails at a clip that needs packets from the zeros
    reader = readers.video([(broken / "a/good.mp4", 0), (broken / "b/zeroed.mp4", 1)], sequence_length=8)
    strict = Loader(reader, batch_size=2, device="cpu", num_threads=1, pipeline=ops.video_pipeline())
    with pytest.raises(DecodeError) as info:
        await _batches(strict)
    assert info.value.source == str(broken / "b/zeroed.mp4") and info.value.key.startswith(f"{broken}/b/zeroed.mp4@")
    skip = loader(on_error="skip", max_errors=10)
    kept = [k for b in await _batches(skip) for k in b.sample_keys]
    stats = skip.stats()
    assert [k for k in kept if k.startswith("a/good")] == [f"a/good.mp4@{s}" for s in range(0, 48, 8)]
    assert "a/cut.mp4@0" not in kept
    assert stats.errors == {"DecodeError": stats.dropped} and stats.dropped >= 2  # the cut file, zeroed clips
    assert len(kept) + stats.dropped == 6 + 1 + 6
    await leaks.check()


@pytest.mark.parametrize("degrees", [90, 180, -90])
async def test_rotation_metadata_is_applied(tmp_path, degrees, leaks):
    path = rotated_video(tmp_path / "r" / "v.mp4", degrees)
    with av.open(str(path)) as container:  # the coded frames, as stored (PyAV does not turn them)
        coded = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    loader = Loader(readers.video([(path, 0)], sequence_length=4, stride=2), batch_size=2, device="cpu",
                    num_threads=1, pipeline=ops.video_pipeline(layout="FHWC"))
    batches = await _batches(loader)
    assert [b.sample_keys for b in batches] == [[f"{path}@0", f"{path}@7"]]  # span 7, step = span
    for clip, start in zip(batches[0]["video"].numpy(), (0, 7)):
        for f, frame in enumerate(clip):
            # the stored frame turned counter-clockwise, as the display matrix says
            assert np.array_equal(frame, np.rot90(coded[start + 2 * f], degrees // 90))
    assert batches[0]["video"].shape[2:4] == ((64, 48) if degrees % 180 else (48, 64))
    await leaks.check()


async def test_a_mirrored_display_matrix_is_refused_naming_the_file(tmp_path):
    path = rotated_video(tmp_path / "m" / "v.mp4", 90, hflip=True)
    with pytest.raises(DecodeError, match="mirrors") as info:
        ops.decode_frames(str(path), 0, 1, 2, key="k")
    assert info.value.source == str(path) and info.value.key == "k"


async def test_leaving_an_epoch_mid_clip_leaves_no_thread_task_or_file(tree, leaks):
    def make():
        return Loader(readers.video(tree, sequence_length=8, shuffle=True, chunk_size=2), batch_size=2,
                      device="cpu", num_threads=2, pipeline=ops.video_pipeline(size=(24, 32), crop=16, flip=0.5))

    done = await random_exits(make, rounds=20, expected_keys=CLIPS, seed=17, whole_every=5, max_delay=0.02)
    assert set(EXITS) <= set(done) and sum(done.values()) == 21
    loader = make()
    async for batch in loader:  # a plain break in the first batch, then aclose: nothing left behind
        assert batch["video"].shape == (2, 8, 3, 16, 16)
        break
    await loader.aclose()
    await leaks.check()
