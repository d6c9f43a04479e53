"""readers.video with ``clips_per_video``: a video's clips of an epoch are distinct starts, drawn
without replacement and uniformly over the starts a clip fits at (torchvision's RandomClipSampler),
the same on every rank and after a resume."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

av = pytest.importorskip("av")

from sample_data import frame_index, make_video  # noqa: E402

from headrace import Loader, ops, readers  # noqa: E402

# Clips of 4 frames, 2 apart: a span of 7 frames. A video of n frames has n - 6 starts a clip fits at.
LENGTH, STRIDE, SPAN = 4, 2, 7
FRAMES = {"a/six.mp4": 12, "a/long.mp4": 30, "b/four.mp4": 10, "b/short.mp4": 5}
FITS = {rel: max(0, n - SPAN + 1) for rel, n in FRAMES.items()}  # 6, 24, 4 and 0 starts


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("video-distinct")
    for rel, n in FRAMES.items():
        make_video(root / rel, n)
    return root


def _reader(tree, k, **kw):
    return readers.video(tree, sequence_length=LENGTH, stride=STRIDE, clips_per_video=k, **kw)


async def _starts(reader, epoch, seed=0) -> dict[str, list[int]]:
    """Each video's clip starts in one epoch's stream, in stream order."""
    out: dict[str, list[int]] = collections.defaultdict(list)
    async for chunk in reader.read(epoch, seed=seed):
        for sample in chunk:
            rel, start = sample.key.split("@")
            assert int(start) == int(sample.fields["clip"][0])
            out[rel].append(int(start))
    return out


@pytest.mark.parametrize("seed", [0, 1, 7, 123])
async def test_as_many_clips_as_starts_gives_every_start_once_each_epoch(tree, seed):
    """Six starts, six clips: every epoch is those six starts, each once (with replacement, an epoch
    with all six distinct came once in 65)."""
    reader = _reader(tree, 6, seed=seed, shuffle=True)
    for epoch in range(6):
        starts = await _starts(reader, epoch)
        assert sorted(starts["a/six.mp4"]) == list(range(6))
        for rel, got in starts.items():
            assert len(got) == len(set(got)) == min(6, FITS[rel])


async def test_a_video_with_fewer_starts_than_clips_gives_each_once_and_len_is_fixed(tree):
    reader = _reader(tree, 8, seed=3)
    assert len(reader) == 6 + 8 + 4  # six.mp4 all 6, long.mp4 8 of 24, four.mp4 all 4, short.mp4 none
    for epoch in range(4):
        starts = await _starts(reader, epoch)
        assert sum(map(len, starts.values())) == len(reader)
        assert starts["a/six.mp4"] == list(range(6)) and starts["b/four.mp4"] == list(range(4))
        long = starts["a/long.mp4"]
        assert len(set(long)) == 8 and long == sorted(long) and all(0 <= s < FITS["a/long.mp4"] for s in long)


async def test_draws_are_uniform_over_the_starts(tree):
    """long.mp4: 5 of its 24 starts each epoch, 480 epochs with one seed. Each start is drawn in
    5/24 of the epochs (100 expected, a binomial's standard deviation 8.9), never twice in one epoch;
    each pair of starts comes together in 5*4/(24*23) of them (17.4 expected), as a uniform subset's."""
    reader = _reader(tree, 5, seed=11)
    epochs = 480
    counts = np.zeros(FITS["a/long.mp4"], np.int64)
    pairs = np.zeros((FITS["a/long.mp4"],) * 2, np.int64)
    for epoch in range(epochs):
        drawn = (await _starts(reader, epoch))["a/long.mp4"]
        assert len(set(drawn)) == 5
        counts[drawn] += 1
        pairs[np.ix_(drawn, drawn)] += 1
    assert counts.sum() == 5 * epochs and counts.min() >= 100 - 4 * 9 and counts.max() <= 100 + 4 * 9
    chi2 = ((counts - 100) ** 2 / 100).sum()
    assert chi2 < 49.7  # 23 degrees of freedom: the 0.999 quantile (without replacement it runs lower still)
    off = pairs[~np.eye(len(counts), dtype=bool)]
    assert off.min() >= 17.4 - 4 * 4.2 and off.max() <= 17.4 + 4 * 4.2  # every pair comes, none too often


async def test_ranks_draw_the_same_clips_as_one_rank(tree):
    reader = _reader(tree, 6, seed=2, shuffle=True)
    whole = sorted([s.key async for chunk in reader.read(3) for s in chunk])
    parts = [[s.key async for chunk in reader.shard(r, 3).read(3) for s in chunk] for r in range(3)]
    assert sorted(k for part in parts for k in part) == whole
    assert len(set(whole)) == len(whole) == len(reader)


def _loader(tree):
    return Loader(_reader(tree, 6, shuffle=True), batch_size=3, device="cpu", num_threads=2, seed=5,
                  pipeline=ops.video_pipeline())


async def test_resume_mid_epoch_equals_an_uninterrupted_run(tree, leaks):
    full = _loader(tree)
    epochs = [[b async for b in full] for _ in range(2)]
    await full.aclose()
    first = _loader(tree)
    [b async for b in first]  # epoch 0
    async for batch in first:  # epoch 1, left after two batches
        if batch.index == 1:
            break
    state = first.state_dict()
    await first.aclose()
    second = _loader(tree)
    second.load_state_dict(state)
    rest = [b async for b in second]
    await second.aclose()
    assert len(rest) == len(epochs[1]) - 2 > 0
    for x, y in zip(epochs[1][2:], rest, strict=True):
        assert x.sample_keys == y.sample_keys and (x["video"] == y["video"]).all()
        for key, clip in zip(y.sample_keys, y["video"]):
            start = int(key.split("@")[1])
            assert [frame_index(frame.numpy()) for frame in clip] == [start + STRIDE * f for f in range(LENGTH)]
    for batches in epochs:
        keys = [k for b in batches for k in b.sample_keys]
        assert len(keys) == len(set(keys)) == 6 + 6 + 4
    await leaks.check()
