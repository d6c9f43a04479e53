"""Samples that are not images: arrays, tensors, token ids, bytes, through ``Pipeline(image=None)``
and beside images; ``.npy`` members of real tar shards; batching rules as torch's ``default_collate``."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import torch
from sample_data import jpeg_bytes, tar_bytes

from headrace import ConfigError, DecodeError, Loader, Preprocessor, ops, readers


def _npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


async def _all(loader) -> list:
    async with loader:
        return [b async for b in loader]


async def test_columns_follow_the_batching_rules(leaks):
    items = [{"__key__": f"k{i}", "x": np.full((2, 3), i, np.float32), "t": torch.arange(4) + i, "y": i,
              "w": i / 2, "ok": i % 2 == 0, "raw": bytes([i]), "text": f"word {i}", "ids": np.arange(i + 1),
              "meta": {"i": i}} for i in range(6)]
    pipe = ops.Pipeline(image=None, label=None)
    batches = await _all(Loader(readers.sequence(items, shuffle=False), batch_size=3, pipeline=pipe, device="cpu"))
    assert [b.sample_keys for b in batches] == [["k0", "k1", "k2"], ["k3", "k4", "k5"]]
    b = batches[1]
    assert b["x"].shape == (3, 2, 3) and b["x"].dtype == torch.float32 and b["x"][:, 0, 0].tolist() == [3, 4, 5]
    assert torch.equal(b["t"], torch.stack([torch.arange(4) + i for i in (3, 4, 5)]))
    assert b["y"].dtype == torch.int64 and b["y"].tolist() == [3, 4, 5]
    assert b["w"].dtype == torch.float64 and b["ok"].dtype == torch.bool
    assert b["raw"] == [b"\x03", b"\x04", b"\x05"]
    assert b["text"] == [b"word 3", b"word 4", b"word 5"]  # str fields are UTF-8 bytes, as a shard's txt
    assert isinstance(b["ids"], list) and [t.tolist() for t in b["ids"]] == [list(range(i + 1)) for i in (3, 4, 5)]
    assert b["meta"] == [{"i": 3}, {"i": 4}, {"i": 5}]
    await leaks.check()


async def test_a_label_and_chosen_fields(leaks):
    items = [{"x": np.full(3, i, np.int16), "cls": i % 2, "junk": b"-"} for i in range(5)]
    pipe = ops.Pipeline(image=None, fields=["x"])
    batches = await _all(Loader(readers.sequence(items, shuffle=False), batch_size=5, pipeline=pipe, device="cpu"))
    assert set(batches[0]) == {"x", "label"}
    assert batches[0]["label"].tolist() == [0, 1, 0, 1, 0] and batches[0]["x"].dtype == torch.int16
    await leaks.check()


async def test_async_generators_with_and_without_length(leaks):
    async def source():
        for i in range(7):
            yield {"tokens": np.arange(3) * i, "cls": i}

    pipe = ops.Pipeline([ops.Map(lambda f: {**f, "n": int(f["tokens"].sum())})], image=None)
    unsized = Loader(readers.iterable(source), batch_size=4, pipeline=pipe, device="cpu")
    batches = await _all(unsized)
    assert [b["label"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6]]
    assert [b["n"].tolist() for b in batches] == [[0, 3, 6, 9], [12, 15, 18]]
    sized = Loader(readers.iterable(source, length=7), batch_size=4, pipeline=pipe, device="cpu")
    assert len(sized) == 2
    assert [b["label"].tolist() for b in await _all(sized)] == [[0, 1, 2, 3], [4, 5, 6]]
    await leaks.check()


def _shard(tmp_path, corrupt: int | None = None, with_images: bool = False) -> str:
    rng = np.random.default_rng(2)
    members = []
    for i in range(10):
        key = f"{i:03d}"
        emb = _npy(np.full(8, i, np.float32)) if i != corrupt else b"\x93NUMPY garbage"
        members += [(f"{key}.emb.npy", emb), (f"{key}.cls", str(i % 3).encode())]
        if with_images:
            members.append((f"{key}.jpg", jpeg_bytes(rng, 30 + i, 40)))
    path = tmp_path / "emb.tar"
    path.write_bytes(tar_bytes(members))
    return str(path)


async def test_npy_members_of_a_shard_load_and_stack(tmp_path, leaks):
    reader = readers.webdataset([_shard(tmp_path)], shuffle=False)
    batches = await _all(Loader(reader, batch_size=4, pipeline=ops.Pipeline(image=None), device="cpu"))
    assert [b["emb.npy"].shape for b in batches] == [(4, 8), (4, 8), (2, 8)]
    assert [row[0].item() for b in batches for row in b["emb.npy"]] == list(range(10))
    assert [v for b in batches for v in b["label"].tolist()] == [i % 3 for i in range(10)]
    await leaks.check()


async def test_a_corrupt_npy_is_a_decode_error_naming_its_sample(tmp_path, leaks):
    reader = readers.webdataset([_shard(tmp_path, corrupt=6)], shuffle=False)
    with pytest.raises(DecodeError) as info:
        await _all(Loader(reader, batch_size=4, pipeline=ops.Pipeline(image=None), device="cpu"))
    assert info.value.key == "006" and info.value.source.endswith("emb.tar") and "emb.npy" in str(info.value)
    reader = readers.webdataset([_shard(tmp_path, corrupt=6)], shuffle=False)
    loader = Loader(reader, batch_size=4, pipeline=ops.Pipeline(image=None), device="cpu", on_error="skip",
                    max_errors=1)
    batches = await _all(loader)
    assert [k for b in batches for k in b.sample_keys] == [f"{i:03d}" for i in range(10) if i != 6]
    assert loader.stats().errors == {"DecodeError": 1}
    await leaks.check()


async def test_a_folder_of_npy_files_reads_as_dalis_numpy_reader_does(tmp_path, leaks):
    # DALI's fn.readers.numpy(file_root=, file_filter="*.npy"): one array a file; here with the
    # files reader's folder convention (a sub-folder a class) and a bad file named by its path.
    for c, name in enumerate(("a", "b")):
        (tmp_path / name).mkdir()
        for i in range(3):
            np.save(tmp_path / name / f"{i}.npy", np.full((2, 5), 10 * c + i, np.int16))
    reader = readers.files(tmp_path, extensions=("npy",))
    batches = await _all(Loader(reader, batch_size=4, pipeline=ops.Pipeline(image=None), device="cpu"))
    assert [b["npy"].shape for b in batches] == [(4, 2, 5), (2, 2, 5)] and batches[0]["npy"].dtype == torch.int16
    assert [row[0, 0].item() for b in batches for row in b["npy"]] == [0, 1, 2, 10, 11, 12]
    assert [v for b in batches for v in b["label"].tolist()] == [0, 0, 0, 1, 1, 1]
    (tmp_path / "b" / "1.npy").write_bytes(b"\x93NUMPY cut")
    with pytest.raises(DecodeError) as info:
        await _all(Loader(readers.files(tmp_path, extensions=("npy",)), batch_size=4, pipeline=ops.Pipeline(image=None),
                          device="cpu"))
    assert info.value.key == "b/1" and info.value.source.endswith("b/1.npy")
    await leaks.check()


async def test_images_and_arrays_in_one_pipeline(tmp_path, leaks):
    reader = readers.webdataset([_shard(tmp_path, with_images=True)], shuffle=False)
    pipe = ops.Pipeline([ops.Decode(), ops.Resize((20, 20))], fields=["emb.npy"])
    batches = await _all(Loader(reader, batch_size=5, pipeline=pipe, device="cpu"))
    assert [b["image"].shape for b in batches] == [(5, 3, 20, 20)] * 2
    assert [row[0].item() for b in batches for row in b["emb.npy"]] == list(range(10))
    await leaks.check()


def test_a_pipeline_without_images_takes_no_image_ops():
    with pytest.raises(ConfigError, match="image=None"):
        ops.Pipeline([ops.Decode(), ops.Resize(8)], image=None)
    with pytest.raises(ConfigError, match="image=None"):
        Preprocessor(ops.Pipeline(image=None, label=None), device="cpu")


def test_arrays_and_tensors_count_their_bytes_against_the_bound():
    from headrace._sample import Sample, samples_nbytes

    fields = {"x": np.zeros((3, 224, 224), np.float32), "t": torch.zeros(5, 10, dtype=torch.float64),
              "raw": b"abcd", "y": 7}
    assert samples_nbytes([Sample("k", fields, "src", 0, 0)]) == 602_112 + 400 + 4 + 64
    rows = memoryview(np.zeros((4, 100), np.uint16))  # len() 4, 800 bytes
    assert samples_nbytes([Sample("k", {"v": rows, "b": bytearray(5)}, "src", 0, 0)]) == 805


async def test_the_reader_stays_within_max_bytes_of_array_samples(leaks):
    # Samples of 1 MB whose len() is 1, one a chunk, a bound of 4 MB: while the consumer waits, the
    # channel from the reader holds at most the 4 that fit and the one it always admits.
    items = [{"x": np.full((1, 250_000), i, np.float32)} for i in range(40)]
    loader = Loader(readers.sequence(items, shuffle=False, chunk_size=1), batch_size=2, device="cpu",
                    pipeline=ops.Pipeline(image=None, label=None), max_bytes=4_000_000)
    async with loader:
        seen = 0
        async for batch in loader:
            seen += len(batch["x"])
            if seen == 2:
                await asyncio.sleep(0.5)  # the pipeline fills up to its bounds meanwhile
                bounded = [c for c in loader.stats().channels if c.max_bytes == 4_000_000]
                assert len(bounded) == 1 and bounded[0].peak_items <= 5, bounded
                assert bounded[0].peak_bytes <= 5_000_000
        assert seen == 40
    await leaks.check()
