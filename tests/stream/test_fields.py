"""Pass-through fields (``Pipeline(fields=...)``): a caption or a JSON of boxes rides beside its image."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sample_data import jpeg_bytes, tar_bytes

from headrace import ConfigError, Loader, Preprocessor, TransformError, ops, readers

N = 24


def _caption(i: int) -> bytes:
    return f"a photograph, number {i}".encode()


def _boxes(i: int) -> bytes:
    return json.dumps({"boxes": [[i, i + 1, i + 10, i + 12]]}).encode()


def _shards(tmp_path, missing_txt: set[int] = frozenset()) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for shard in range(2):
        members = []
        for i in range(shard * N // 2, (shard + 1) * N // 2):
            key = f"{i:04d}"
            members += [(f"{key}.jpg", jpeg_bytes(rng, 40 + i, 50 + 2 * i)), (f"{key}.cls", str(i % 3).encode())]
            if i not in missing_txt:
                members.append((f"{key}.txt", _caption(i)))
            members.append((f"{key}.json", _boxes(i)))
        path = tmp_path / f"shard-{shard}.tar"
        path.write_bytes(tar_bytes(members))
        paths.append(str(path))
    return paths


def _loader(paths, **kw) -> Loader:
    pipeline = ops.Pipeline([ops.Decode(), ops.Resize(32)], fields=("txt", "json"))
    return Loader(readers.webdataset(paths, shuffle=True, seed=1), batch_size=5, pipeline=pipeline, device="cpu",
                  num_threads=2, **kw)


async def test_fields_come_out_beside_their_images(tmp_path, leaks):
    async with _loader(_shards(tmp_path)) as loader:
        batches = [b async for b in loader]
    keys = [k for b in batches for k in b.sample_keys]
    assert sorted(keys) == [f"{i:04d}" for i in range(N)]
    for b in batches:
        assert isinstance(b["image"], list) and len(b["txt"]) == len(b["json"]) == len(b["image"]) == b.size
        for key, caption, boxes, label in zip(b.sample_keys, b["txt"], b["json"], b["label"].tolist()):
            i = int(key)
            assert caption == _caption(i) and type(caption) is bytes
            assert json.loads(boxes) == json.loads(_boxes(i)) and label == i % 3
    await leaks.check()


async def test_a_sample_without_a_field_is_an_error_naming_it(tmp_path, leaks):
    paths = _shards(tmp_path, missing_txt={7})
    with pytest.raises(TransformError) as info:
        async with _loader(paths) as loader:
            async for _ in loader:
                pass
    assert info.value.key == "0007" and info.value.source.endswith("shard-0.tar")
    assert "'txt'" in str(info.value)
    async with _loader(paths, on_error="skip", max_errors=1) as loader:
        batches = [b async for b in loader]
        assert loader.stats().dropped == 1
    assert sorted(k for b in batches for k in b.sample_keys) == [f"{i:04d}" for i in range(N) if i != 7]
    assert all(c == _caption(int(k)) for b in batches for k, c in zip(b.sample_keys, b["txt"]))
    await leaks.check()


@pytest.mark.parametrize("fields", ["txt", 3, ("image",), ("txt", "label"), ("",), (3,)])
def test_wrong_fields_are_config_errors(fields):
    with pytest.raises(ConfigError):
        ops.Pipeline(fields=fields)


def test_requests_carry_only_an_image_so_the_service_refuses_fields():
    with pytest.raises(ConfigError, match="fields"):
        Preprocessor(ops.validation(label=None, fields=("txt",)), device="cpu")
