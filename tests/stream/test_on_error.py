"""The on_error policies on real corrupt files: skip with its default budget, replace, a callable,
the counts by class, the records, the log lines, and ``aclose()`` being final."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import pytest
import torch

from headrace import (
    ClosedError,
    ConfigError,
    DecodeError,
    ErrorBudgetExceeded,
    Loader,
    ReadError,
    ops,
    readers,
)

BAD = {"c0/0001": b"", "c1/0004": b"GIF89a not really", "c2/0007": b"not an image at all"}


@pytest.fixture
def bad_folder(tmp_path, image_folder):
    folder = tmp_path / "data"
    shutil.copytree(image_folder, folder)
    for key, data in BAD.items():
        (folder / f"{key}.jpg").write_bytes(data)
    return folder


def _loader(folder, **kw):
    pipe = ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(32), ops.Flip(), ops.Normalize()])
    return Loader(readers.files(folder), batch_size=8, pipeline=pipe, device="cpu", num_threads=2, **kw)


async def _collect(loader):
    return [b async for b in loader]


async def test_skip_alone_skips_within_its_default_budget_and_counts_by_class(bad_folder, caplog):
    loader = _loader(bad_folder, on_error="skip")  # 3 of 75 is over 1% once 100 are seen: fine here
    with caplog.at_level(logging.WARNING, logger="headrace"):
        batches = await _collect(loader)
    keys = [k for b in batches for k in b.sample_keys]
    assert len(keys) == 72 and not set(BAD) & set(keys)
    stats = loader.stats()
    assert stats.dropped == 3 and stats.errors == {"DecodeError": 3}
    assert [(r.key, r.kind, r.action) for r in stats.recent_errors] == [(k, "DecodeError", "skip") for k in BAD]
    assert all(r.source.endswith(f"{r.key}.jpg") and r.stage == "decode" for r in stats.recent_errors)
    # Rate-limited: the first skip is logged at once, the others within the second are counted.
    assert len(caplog.records) >= 1 and "c0/0001" in caplog.records[0].getMessage()
    await loader.aclose()


async def test_the_default_budget_is_one_percent_of_the_samples_seen(bad_folder):
    paths = sorted(bad_folder.rglob("*.jpg"))
    many = [p for _ in range(4) for p in paths]  # 300 samples, 12 bad: 4%
    pipe = ops.Pipeline([ops.Decode(), ops.Resize(16), ops.CenterCrop(16)])
    loader = Loader(readers.files([str(p) for p in many], labels=[0] * len(many)), batch_size=50, pipeline=pipe,
                    device="cpu", num_threads=2, on_error="skip")
    with pytest.raises(ErrorBudgetExceeded, match="1.00% of samples"):
        await _collect(loader)
    await loader.aclose()


async def test_replace_keeps_batches_full_and_is_the_same_on_resume(bad_folder):
    loader = _loader(bad_folder, on_error="replace", seed=4)
    batches = await _collect(loader)
    assert [b.size for b in batches] == [8] * 9 + [3]
    assert sum(b.replaced for b in batches) == 3 == loader.stats().replaced and loader.stats().dropped == 0
    for b in batches:
        keys = b.sample_keys
        assert not set(BAD) & set(keys)
        assert len(set(keys)) == len(keys) - b.replaced  # a substitute repeats a key of its batch
        for i, key in enumerate(keys):  # each row holds the sample its key names
            j = keys.index(key)
            assert torch.equal(b["image"][i], b["image"][j]) and b["label"][i] == b["label"][j]
    again = _loader(bad_folder, on_error="replace", seed=4)
    for x, y in zip(batches, await _collect(again), strict=True):
        assert x.sample_keys == y.sample_keys and torch.equal(x["image"], y["image"])
    await loader.aclose()
    await again.aclose()


async def test_a_callable_decides_per_error(bad_folder):
    seen = []

    def policy(error):
        seen.append(error)
        return "raise" if error.key == "c2/0007" else "skip"

    loader = _loader(bad_folder, on_error=policy, max_errors=5)
    with pytest.raises(DecodeError) as info:
        await _collect(loader)
    assert info.value.key == "c2/0007"
    assert [e.key for e in seen] == list(BAD)
    assert loader.stats().errors == {"DecodeError": 3}
    assert [r.action for r in loader.stats().recent_errors] == ["skip", "skip", "raise"]
    await loader.aclose()


async def test_a_callable_that_fails_or_answers_nonsense_is_a_config_error(bad_folder):
    def broken(error):
        raise KeyError("oops")

    for policy, match in ((broken, "raised KeyError"), (lambda e: "ignore", "must return")):
        loader = _loader(bad_folder, on_error=policy)
        with pytest.raises(ConfigError, match=match) as info:
            await _collect(loader)
        assert info.value.key == "c0/0001"
        await loader.aclose()


async def test_a_batch_with_no_good_sample_is_left_out(tmp_path, image_folder):
    paths = sorted(str(p) for p in image_folder.rglob("*.jpg"))[:6] + [str(tmp_path / f"gone{i}.jpg") for i in range(4)]
    pipe = ops.Pipeline([ops.Decode(), ops.Resize(16), ops.CenterCrop(16)])
    for policy in ("skip", "replace"):
        loader = Loader(readers.files(paths, labels=[1] * 10), batch_size=4, pipeline=pipe, device="cpu",
                        on_error=policy, max_errors=4)
        batches = await _collect(loader)
        # Rows 6-9 are missing: batch 1 keeps 2 (skip) or is refilled (replace), batch 2 has none.
        assert [b.index for b in batches] == [0, 1]
        assert [b.size for b in batches] == ([4, 2] if policy == "skip" else [4, 4])
        assert loader.stats().errors == {"ReadError": 4}
        assert loader.state_dict()["epoch"] == 1
        await loader.aclose()


async def test_an_unexpected_error_in_the_pipeline_is_a_loader_error_with_its_cause(image_folder):
    class Broken(readers.Reader):
        def __init__(self, inner):
            self.inner = inner

        def __len__(self):
            return len(self.inner)

        def shard(self, rank, world, *, equal=None):
            return Broken(self.inner.shard(rank, world, equal=equal))

        async def read(self, epoch, *, start=0, seed=0):
            async for chunk in self.inner.read(epoch, start=start, seed=seed):
                yield chunk
                raise RuntimeError("the reader has a bug")

    loader = Loader(Broken(readers.files(image_folder, chunk_size=4)), batch_size=8, device="cpu")
    with pytest.raises(Exception) as info:
        await _collect(loader)
    from headrace import LoaderError

    assert type(info.value) is LoaderError and isinstance(info.value.__cause__, RuntimeError)
    assert "the reader has a bug" in str(info.value)
    await loader.aclose()


async def test_aclose_is_final(image_folder):
    loader = _loader(image_folder)
    await _collect(loader)
    await loader.aclose()
    with pytest.raises(ClosedError):
        loader.__aiter__()
    with pytest.raises(ClosedError):
        list(loader.sync())
    await loader.aclose()  # twice is fine


@pytest.mark.parametrize("on_error", ["ignore", 3, None])
def test_wrong_on_error_is_a_config_error(image_folder, on_error):
    with pytest.raises(ConfigError, match="on_error"):
        _loader(image_folder, on_error=on_error)


async def test_a_read_error_keeps_its_type_under_skip(tmp_path, image_folder):
    paths = sorted(str(p) for p in image_folder.rglob("*.jpg"))[:7] + [str(tmp_path / "gone.jpg")]
    loader = Loader(readers.files(paths, labels=[0] * 8), batch_size=4, device="cpu", on_error="skip", max_errors=1)
    batches = await _collect(loader)
    assert sum(b.size for b in batches) == 7
    record = loader.stats().recent_errors[-1]
    assert record.kind == ReadError.__name__ and record.source == str(tmp_path / "gone.jpg")
    await loader.aclose()


class _FailingAt:
    """A sequence of small array samples whose item ``bad`` raises when read."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if i == self.bad:
            raise ValueError(f"item {i} is unreadable")
        return {"__key__": f"k{i}", "x": np.full(4, i, dtype=np.int64)}


@pytest.mark.parametrize("policy", ["skip", "replace"])
async def test_a_failed_sample_repeated_by_fill_counts_once(policy, leaks):
    # 10 samples in batches of 8: the last batch is samples 8 and 9, then 6 rows repeating them.
    loader = Loader(readers.sequence(_FailingAt(10, bad=8), shuffle=False), batch_size=8, device="cpu",
                    pipeline=ops.Pipeline(image=None, label=None), last_batch="fill", on_error=policy,
                    max_errors=1)  # one failure is within the budget, however often the padding repeats it
    batches = [b async for b in loader]
    last = batches[-1]
    stats = loader.stats()
    assert stats.errors == {"ReadError": 1} and [e.key for e in stats.recent_errors] == ["8"]
    if policy == "skip":
        assert (stats.dropped, stats.replaced, last.dropped) == (1, 0, 1)
        assert last.sample_keys == ["k9"] * 4  # sample 8's four rows left the batch
    else:
        assert (stats.dropped, stats.replaced, last.replaced) == (0, 1, 1)
        assert last.sample_keys == ["k9"] * 8 and last.size == 8
    await loader.aclose()
    await leaks.check()
