"""DecodeClip(device="cuda") on broken videos, under the loader's on_error: a DecodeError naming the
file and the clip, never a crash or a short clip. (A file of its own: a native crash here would not
take the other GPU video tests with it.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sample_data import make_video
from video_data import H, W

from headrace import DecodeError, Loader, ops, readers


def _loader(reader, **kw):
    return Loader(reader, batch_size=2, device="cuda", num_threads=2, pipeline=ops.video_pipeline(device="cuda"), **kw)


async def _all(loader):
    try:
        return [b async for b in loader]
    finally:
        await loader.aclose()


@pytest.fixture
def broken(tmp_path) -> Path:
    """``a/good.mp4``, ``a/cut.mp4`` (its last third cut off), ``b/zeroed.mp4`` (frame data from a third on zeroed)."""
    make_video(tmp_path / "a" / "good.mp4", 48, width=W, height=H)
    whole = make_video(tmp_path / "whole.mp4", 48, faststart=True, width=W, height=H).read_bytes()
    (tmp_path / "whole.mp4").unlink()
    (tmp_path / "a" / "cut.mp4").write_bytes(whole[: len(whole) * 2 // 3])
    mdat = whole.index(b"mdat") + 4
    third = mdat + (len(whole) - mdat) // 3
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "zeroed.mp4").write_bytes(whole[:third] + bytes(len(whole) - third))
    return tmp_path


async def test_cut_video_raises_naming_the_file_or_is_skipped_and_counted(broken, leaks):
    with pytest.raises(DecodeError) as info:
        await _all(_loader(readers.video(broken, sequence_length=8)))
    assert info.value.source == str(broken / "a" / "cut.mp4") and info.value.key == "a/cut.mp4@0"
    skip = _loader(readers.video(broken, sequence_length=8), on_error="skip", max_errors=10)
    kept = [k for b in await _all(skip) for k in b.sample_keys]
    stats = skip.stats()
    assert [k for k in kept if k.startswith("a/good")] == [f"a/good.mp4@{s}" for s in range(0, 48, 8)]
    assert "a/cut.mp4@0" not in kept and stats.errors == {"DecodeError": stats.dropped}
    assert len(kept) + stats.dropped == 6 + 1 + 6
    zeroed = [k for k in kept if k.startswith("b/zeroed")]
    print(f"\nzeroed frame data: {len(zeroed)} of 6 clips decoded without an error (NVDEC conceals what it can), "
          f"{stats.dropped - 1} refused")
    await leaks.check()


@pytest.mark.parametrize("damage", ["cut", "cut-faststart", "garbage", "zero-tail"])
async def test_a_video_damaged_after_the_probe_is_a_decode_error_not_a_short_clip(tmp_path, damage):
    path = tmp_path / "v" / "v.mp4"
    whole = make_video(path, 48, faststart=damage == "cut-faststart", width=W, height=H).read_bytes()
    reader = readers.video([(path, 0)], sequence_length=8, step=40)  # clips at 0 and 40: the second past the cut
    assert len(reader) == 2  # probed whole
    if damage.startswith("cut"):
        path.write_bytes(whole[: len(whole) // 2])
    elif damage == "garbage":
        path.write_bytes(np.random.default_rng(0).integers(0, 256, len(whole), dtype=np.uint8).tobytes())
    else:
        path.write_bytes(whole[: len(whole) // 2] + bytes(len(whole) - len(whole) // 2))
    loader = _loader(reader, on_error="skip", max_errors=2)
    batches = await _all(loader)
    kept = [k for b in batches for k in b.sample_keys]
    print(f"\n{damage}: kept {kept}, errors {loader.stats().errors}")
    assert f"{path}@40" not in kept  # never a short or made-up clip past the damage
    assert loader.stats().errors.get("DecodeError", 0) == 2 - len(kept)
    for b in batches:
        assert b["video"].shape[1] == 8
    strict = _loader(reader)  # the same reader: its probe of the whole file
    with pytest.raises(DecodeError) as info:
        await _all(strict)
    assert info.value.source == str(path) and info.value.key.startswith(f"{path}@")
