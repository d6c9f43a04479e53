"""User stages as a user moving torchdata ``.map()``/``.filter()`` pipelines over meets them: a row
``Map`` whose rows disagree on their fields, a ``Filter`` whose plain function returns a coroutine,
a ``MapBatch`` that changes its batch's number of rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sample_data import jpeg_bytes

from headrace import Loader, TransformError, ops, readers
from headrace.ops._batch_stages import checked_batch

N = 24


def _items(n: int = N) -> list[dict]:
    rng = np.random.default_rng(11)
    return [{"__key__": f"s{i:03d}", "jpg": jpeg_bytes(rng, 40, 48), "cls": i % 4} for i in range(n)]


def _loader(pipeline, **kw) -> Loader:
    return Loader(readers.sequence(_items(), shuffle=False), batch_size=8, pipeline=pipeline, device="cpu",
                  num_threads=2, **kw)


async def _all(loader) -> list:
    return [b async for b in loader]


def _image_on_two_of_three(row: dict, index: int) -> dict:
    if index % 3 == 0:  # the first row of each batch among them: its fields used to name the columns
        del row["image"]
    return row


async def test_a_row_map_whose_rows_disagree_on_their_fields_fails_the_rows_lacking_one(leaks):
    pipe = ops.Pipeline([ops.Decode(), ops.Resize((16, 16)), ops.Map(_image_on_two_of_three)])
    with pytest.raises(TransformError) as info:
        async with _loader(pipe) as loader:
            await _all(loader)
    err = info.value
    assert err.stage == "stage _image_on_two_of_three" and int(err.key[1:]) % 3 == 0
    assert "'image'" in str(err) and isinstance(err.__cause__, KeyError)

    async with _loader(pipe, on_error="skip", max_errors=0.5) as loader:
        batches = await _all(loader)
        stats = loader.stats()
    assert stats.dropped == N // 3 and stats.errors == {"TransformError": N // 3}
    assert sorted(k for b in batches for k in b.sample_keys) == [f"s{i:03d}" for i in range(N) if i % 3]
    for b in batches:  # the rows kept have their images, none lost with the first row's fields
        assert b["image"].shape == (len(b.sample_keys), 3, 16, 16) and len(b["label"]) == len(b.sample_keys)
    await leaks.check()


async def _keep_none(fields: dict) -> bool:
    return False


async def test_a_filter_whose_plain_function_returns_a_coroutine_is_an_error_not_a_keep(leaks, recwarn):
    wrapped = ops.Filter(lambda fields: _keep_none(fields), name="wrapped async")  # a plain function
    pipe = ops.Pipeline([wrapped, ops.Decode(), ops.Resize((16, 16))])
    with pytest.raises(TransformError, match="async def") as info:
        async with _loader(pipe) as loader:
            await _all(loader)
    assert info.value.stage == "stage wrapped async" and isinstance(info.value.__cause__, TypeError)
    assert not [w for w in recwarn if "never awaited" in str(w.message)]
    await leaks.check()


def test_a_batch_of_another_number_of_rows_is_refused_naming_the_columns():
    batch = {"image": torch.zeros(8, 3, 4, 4), "label": torch.zeros(8, dtype=torch.int64), "txt": [b""] * 8}
    assert checked_batch(batch, rows=8) is batch
    halved = {name: column[:4] for name, column in batch.items()}
    with pytest.raises(TypeError, match=r"'image' has 4, 'label' has 4, 'txt' has 4; the batch has 8"):
        checked_batch(halved, rows=8)
    beside = {**batch, "step": torch.tensor(3), "scale": 0.5}  # values not by row pass as they are
    assert checked_batch(beside, rows=8) is beside
    assert checked_batch(halved) is halved  # no row count given: the dict check alone


def _first_half(batch: dict) -> dict:
    return {k: v[: len(v) // 2] for k, v in batch.items()}


async def test_a_map_batch_that_drops_rows_fails_its_batch_by_name(leaks):
    """Rows are left out with ``ops.Filter``: a batch whose image has 4 rows and its keys 8 would
    misalign every per-row step after it (failures, a later stage, the keys)."""
    pipe = ops.Pipeline([ops.Decode(), ops.Resize((16, 16)), ops.MapBatch(_first_half)])
    with pytest.raises(TransformError, match="rows") as info:
        async with _loader(pipe) as loader:
            await _all(loader)
    assert info.value.stage == "stage _first_half"

    async with _loader(pipe, on_error="skip", max_errors=1.0) as loader:
        batches = await _all(loader)
        stats = loader.stats()
    assert batches == [] and stats.errors == {"TransformError": N}
    await leaks.check()
