"""The GPU path under bad input and early exits: typed errors, the CPU path's verdicts, bounded
memory, and an executor that drains, is reused, and gives everything back when closed."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
import io
import random
import zlib

from gpu_data import class_folders
import numpy as np
import pytest
import torch
from PIL import Image

from headrace import ClosedError, DecodeError, Loader, LoaderError, Sample, TransformError, ops, readers
from headrace._sample import SampleBatch
from headrace.ops.cuda import _prep as _cuda_prep


def _jpeg(rng, h, w, quality=90) -> bytes:
    small = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _png(rng, h, w) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _claiming(jpeg: bytes, h: int, w: int) -> bytes:
    """``jpeg`` with its frame header (SOF) rewritten to claim h x w: the rest of the file unchanged."""
    data = bytearray(jpeg)
    i = 2
    while data[i + 1] not in (0xC0, 0xC1, 0xC2):
        i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    data[i + 5 : i + 9] = h.to_bytes(2, "big") + w.to_bytes(2, "big")
    return bytes(data)


def _bad_files(rng) -> dict[str, bytes]:
    """The issue's inputs: each must be a typed error on the GPU path, as it is on the CPU path."""
    good = _jpeg(rng, 240, 320)
    return {
        "empty": b"",
        "text": b"just some text, no image here\n" * 4,
        "header-only": good[: good.index(b"\xff\xda")],  # everything before the scan
        "cut-50": good[: len(good) // 2],
        "cut-90": good[: len(good) * 9 // 10],
        "claims-60000": _claiming(good, 60000, 60000),
    }


def _sample(key: str, blob: bytes, index: int, label: bool = True) -> Sample:
    fields = {"jpg": blob, "cls": str(index % 5).encode()} if label else {"jpg": blob}
    return Sample(key, fields, f"mem://{key}", index, position=index)


PIPELINES = {
    "train": lambda: ops.training(224),
    "val": lambda: ops.validation(224),
    "list": lambda: ops.Pipeline([ops.Resize(256)]),
    "train+post": lambda: ops.Pipeline([ops.RandomResizedCrop(224), ops.Flip(), ops.ColorTwist(0.3, 0.3, 0.3, 0.05),
                                        ops.Normalize()]),
    "list+post": lambda: ops.Pipeline([ops.Resize(64), ops.ColorTwist(0.3, 0.3)]),
}
# The lane's ways: the shim's fused launch, the launch from Python, nvImageCodec's Python API; and
# the Huffman stage on the GPU (nvJPEG's GPU-hybrid backend, fed damaged files only here): all the
# CUDA decoder's images (engine failures retried there too), or a share of each batch to a second one.
LAUNCHES = {"shim": ops.GpuTuning(), "python": ops.GpuTuning(launch="python"), "pyapi": ops.GpuTuning(decode="python"),
            "gpu-huffman": ops.GpuTuning(gpu_huffman_above=0), "gpu-huffman-share": ops.GpuTuning(gpu_huffman_load=0.35)}


def _empty_output(images) -> bool:
    return images == [] if isinstance(images, list) else images.shape[0] == 0


@pytest.mark.parametrize("launch", list(LAUNCHES))
@pytest.mark.parametrize("name", list(PIPELINES))
async def test_bad_files_get_the_cpu_paths_verdict_and_batches_may_lose_every_sample(name, launch):
    rng = np.random.default_rng(11)
    bad = _bad_files(rng)
    samples = [_sample("good-0", _jpeg(rng, 300, 400), 0)]
    samples += [_sample(key, blob, i) for i, (key, blob) in enumerate(bad.items(), start=1)]
    samples += [_sample("good-1", _jpeg(rng, 260, 200), 7), _sample("no-label", _jpeg(rng, 100, 100), 8, label=False)]
    pipeline = PIPELINES[name]()
    cpu = ops.CpuExecutor(pipeline, num_threads=2, seed=3)
    gpu = ops.CudaExecutor(pipeline, seed=3, tuning=LAUNCHES[launch])
    try:
        a = await cpu.run(SampleBatch(samples, 0, 0))
        b = await gpu.run(SampleBatch(samples, 0, 0))
        # every sample of a batch failed before decode (both lanes, as batches alternate)
        nothing = [await gpu.run(SampleBatch(samples[1:7], 0, i)) for i in (1, 2)]
        after = await gpu.run(SampleBatch(samples[:1], 0, 3))  # the lanes go on
        torch.cuda.synchronize()
    finally:
        await cpu.aclose()
        await gpu.aclose()
    assert b.kept == a.kept == [0, 7]
    assert [(row, type(err)) for row, err in b.failures] == [(row, type(err)) for row, err in a.failures]
    for (row, err), (_, ref) in zip(b.failures, a.failures):
        assert isinstance(err, LoaderError) and err.key == samples[row].key and err.source == f"mem://{err.key}"
        assert str(err) == str(ref)
        print(f"{name}/{launch} {err.key}: {type(err).__name__}: {err}")
    failures = {samples[row].key: err for row, err in b.failures}
    assert all(isinstance(failures[key], DecodeError) for key in bad)
    assert "claims 60000x60000 pixels, over max_pixels=67108864" in str(failures["claims-60000"])
    assert isinstance(failures["no-label"], TransformError) and "'cls'" in str(failures["no-label"])
    for out in nothing:
        assert out.kept == [] and [row for row, _ in out.failures] == list(range(6))
        assert all(isinstance(err, DecodeError) for _, err in out.failures)
        assert _empty_output(out.data["image"]) and out.data["label"].numel() == 0
    assert after.kept == [0] and after.data["label"].tolist() == [0]


def _mutated(rng, base: bytes) -> tuple[str, bytes]:
    """One damaged variant of ``base`` (a JPEG), of a kind drawn at random, and the kind."""
    kind = str(rng.choice(["control", "bitflip", "truncate", "insert", "delete", "sof", "thin", "huge"]))
    data = bytearray(base)
    if kind == "bitflip":
        for pos in rng.integers(2, len(data), size=int(rng.integers(1, 20))):
            data[pos] ^= 1 << int(rng.integers(0, 8))
    elif kind == "truncate":
        data = data[: int(rng.integers(2, len(data)))]
    elif kind == "insert":
        pos = int(rng.integers(2, len(data)))
        data[pos:pos] = rng.integers(0, 256, size=int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
    elif kind == "delete":
        pos = int(rng.integers(2, len(data) - 2))
        del data[pos : pos + int(rng.integers(1, 64))]
    elif kind in ("sof", "thin", "huge"):
        if kind == "sof":
            h, w = (int(v) if v > 0 else int(rng.integers(1, 65536)) for v in rng.choice([0, 1, 65535, -1], size=2))
        else:
            h, w = (60000, 60000) if kind == "huge" else [(32768, 2), (2, 32768), (1, 65500), (65500, 1)][int(rng.integers(4))]
        data = bytearray(_claiming(bytes(data), h, w))
    return kind, bytes(data)


@pytest.mark.parametrize("launch", ["shim", "python", "gpu-huffman", "gpu-huffman-share"])
@pytest.mark.parametrize("name", ["train", "val", "list"])
async def test_mutated_jpegs_come_out_as_images_or_typed_errors_within_the_memory_limits(name, launch):
    rng = np.random.default_rng(17)
    bases = [_jpeg(rng, int(rng.integers(48, 400)), int(rng.integers(48, 400)), quality=int(rng.integers(50, 96)))
             for _ in range(8)]
    inputs = [_mutated(rng, bases[i % len(bases)]) for i in range(320)]
    samples = [_sample(f"{kind}-{i}", blob, i) for i, (kind, blob) in enumerate(inputs)]
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    gpu = ops.CudaExecutor(PIPELINES[name](), seed=5, tuning=LAUNCHES[launch])
    kinds: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    try:
        for lo in range(0, len(samples), 32):
            out = await gpu.run(SampleBatch(samples[lo : lo + 32], 0, lo // 32))
            failed = [row for row, _ in out.failures]
            assert sorted(out.kept + failed) == list(range(len(samples[lo : lo + 32])))  # each exactly once
            images = out.data["image"]
            assert (len(images) if isinstance(images, list) else images.shape[0]) == len(out.kept)
            for row, err in out.failures:
                assert isinstance(err, LoaderError) and err.key == samples[lo + row].key, repr(err)
                kinds[samples[lo + row].key.split("-")[0]][type(err).__name__] += 1
            for row in out.kept:
                kinds[samples[lo + row].key.split("-")[0]]["delivered"] += 1
            del out, images
        torch.cuda.synchronize()
        workspaces = [w.numel() for lane in gpu._lanes for w in lane.decoder.workspaces]
    finally:
        await gpu.aclose()
    peak = torch.cuda.max_memory_allocated() - before
    print(f"{name}/{launch}: peak {peak / 2**20:.0f} MiB, workspaces {workspaces}, by kind {dict(kinds)}")
    assert kinds["control"]["delivered"] == sum(kinds["control"].values())  # untouched files come through
    assert all(size <= (1 << 30) // 2 for size in workspaces)  # a lane's share of max_batch_bytes
    assert peak < 3 << 30


@pytest.mark.parametrize("launch", ["shim", "python"])
async def test_labels_are_required_per_sample_unless_the_pipeline_reads_none(launch):
    rng = np.random.default_rng(12)
    samples = [_sample(f"s{i}", _jpeg(rng, 120, 150), i, label=False) for i in range(4)]
    for label, kept in (("cls", []), (None, [0, 1, 2, 3])):
        gpu = ops.CudaExecutor(ops.training(32, label=label), seed=1, tuning=LAUNCHES[launch])
        try:
            out = await gpu.run(SampleBatch(samples, 0, 0))
        finally:
            await gpu.aclose()
        assert out.kept == kept
        if label is None:
            assert "label" not in out.data and out.data["image"].shape[0] == 4
        else:
            assert all(isinstance(err, TransformError) and "'cls'" in str(err) for _, err in out.failures)


@pytest.mark.parametrize("decode", ["shim", "python"], ids=["shim", "pyapi"])
@pytest.mark.parametrize("kind", ["fixed", "own-sizes", "post"])
async def test_a_batch_over_max_batch_bytes_is_decoded_in_parts_like_the_whole(kind, decode):
    rng = np.random.default_rng(13)
    samples = [_sample(f"s{i}", _jpeg(rng, int(rng.integers(300, 600)), int(rng.integers(300, 600))), i)
               for i in range(24)]
    samples[5] = Sample("png", {"png": _png(rng, 200, 300), "cls": b"1"}, "mem://png", 5, position=5)  # not a JPEG
    ops_after = {"fixed": [ops.RandomResizedCrop(64), ops.Flip()], "own-sizes": [ops.Resize(48)],
                 "post": [ops.RandomResizedCrop(64), ops.ColorTwist(0.3, 0.3, 0.3, 0.05)]}[kind]
    budget = 1 << 20  # a lane's half, 512 KiB: a few crop windows a part; a whole image may be more, alone
    outs = {}
    for limit in (None, budget):
        # hw_load 0: every image to the same (CUDA) decoder, however the batch is cut
        gpu = ops.CudaExecutor(ops.Pipeline([ops.Decode(max_batch_bytes=limit), *ops_after]), seed=4, lanes=1, hw_load=0.0,
                               tuning=ops.GpuTuning(decode=decode))
        try:
            outs[limit] = [await gpu.run(SampleBatch(samples, e, e)) for e in range(3)]
            torch.cuda.synchronize()
            parts = gpu.timings().get("parts", 0)
            workspaces = [w.numel() for w in getattr(gpu._lanes[0].decoder, "workspaces", [])]
        finally:
            await gpu.aclose()
        if limit is None:
            assert parts == 0
        else:
            windows = _cuda_prep.window_bytes(np.array([[0, 0, 600, 600]]), 3)[0]
            assert parts >= 3 * 4, parts  # each batch in at least 4 parts
            assert all(size <= max(budget // 2, windows) for size in workspaces), workspaces
        print(f"{kind}/decode={decode} max_batch_bytes={limit}: {parts} parts, workspaces {workspaces}")
    worst = 0.0
    for whole, cut in zip(outs[None], outs[budget]):
        assert whole.kept == cut.kept == list(range(24)) and torch.equal(whole.data["label"], cut.data["label"])
        pairs = zip(whole.data["image"], cut.data["image"]) if kind == "own-sizes" else [(whole.data["image"], cut.data["image"])]
        for x, y in pairs:
            assert x.shape == y.shape and x.dtype == y.dtype
            worst = max(worst, (x.float() - y.float()).abs().max().item())
    print(f"{kind}/decode={decode}: in parts vs whole, max difference {worst} levels")
    assert worst <= 1


def _workspace_bytes(gpu) -> int:
    """What a drained executor may keep allocated through torch: its lanes' decode workspaces."""
    return sum(w.untyped_storage().nbytes() for lane in gpu._lanes for w in getattr(lane.decoder, "workspaces", []))


def _requested() -> int:
    """Bytes torch's allocator was asked for and has not got back (exact sizes: a block it hands
    out may be larger, which ``memory_allocated`` counts)."""
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


@pytest.mark.parametrize("decode", ["shim", "python"], ids=["shim", "pyapi"])
async def test_cancelled_runs_then_drain_keep_only_the_workspaces_and_aclose_frees_all(decode):
    rng = np.random.default_rng(14)
    samples = [_sample(f"s{i}", _jpeg(rng, int(rng.integers(150, 400)), int(rng.integers(150, 400))), i)
               for i in range(32)]
    gc.collect()
    torch.cuda.synchronize()
    before, asked = torch.cuda.memory_allocated(), _requested()
    gpu = ops.CudaExecutor(ops.training(64, dtype="float16"), seed=2, tuning=ops.GpuTuning(decode=decode))
    pace = random.Random(0)
    held = []
    try:
        for r in range(15):
            tasks = [asyncio.create_task(gpu.run(SampleBatch(samples, r, i))) for i in range(6)]
            await asyncio.sleep(pace.uniform(0.0, 0.03))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            del tasks, task  # a finished run's output lives as long as its task
            await gpu.drain()
            await gpu.drain()  # idle: returns at once
            gc.collect()
            torch.cuda.synchronize()
            held.append(_requested() - asked - _workspace_bytes(gpu))
            if decode == "shim":
                assert gpu._headers.in_use == 0  # every parsed batch went back, run or not
        out = await gpu.run(SampleBatch(samples, 99, 0))  # drained, it takes batches again
        assert out.kept == list(range(32)) and out.data["image"].shape == (32, 3, 64, 64)
        del out
    finally:
        await gpu.aclose()
    print(f"decode={decode}: allocated beyond the workspaces after each drain: {held}")
    assert held == [0] * len(held)
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    with pytest.raises(ClosedError):
        await gpu.run(SampleBatch(samples, 0, 0))
    await gpu.aclose()  # twice: nothing to do


@pytest.fixture
def folder(tmp_path):
    return class_folders(tmp_path, np.random.default_rng(15), 2, 30, _jpeg, "jpg", 100, 300)


async def test_cancelled_and_left_epochs_reuse_the_loader_and_give_back_cuda_memory(folder, leaks):
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    every = sorted(f"c{c}/{i:03d}" for c in range(2) for i in range(30))
    loader = Loader(readers.files(folder, shuffle=True), batch_size=8, device="cuda",
                    pipeline=ops.training(64, dtype="float16"))
    pace = random.Random(1)

    async def consume():
        async for _ in loader:
            pass

    for r in range(20):
        if r % 4 == 3:
            async for b in loader:  # a bare break, the loop left with its iterator open
                break
            del b
        else:
            task = asyncio.create_task(consume())
            await asyncio.sleep(pace.uniform(0.0, 0.05))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    keys = [k async for b in loader for k in b.sample_keys]
    assert sorted(keys) == every  # a whole, correct epoch after all that
    await loader.aclose()
    gc.collect()
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    print(f"allocated before the loader {before}, after 20 left epochs and its close {after}")
    assert after == before
    await leaks.check(settle=5.0)


@pytest.mark.parametrize("name", ["train", "val", "list"])
async def test_loader_raises_typed_errors_or_skips_and_counts_them(tmp_path, name):
    rng = np.random.default_rng(16)
    (tmp_path / "c0").mkdir()
    (tmp_path / "c1").mkdir()
    for i in range(8):
        (tmp_path / "c0" / f"{i:03d}.jpg").write_bytes(_jpeg(rng, 200, 260))
    bad = _bad_files(rng)
    for key, blob in bad.items():
        (tmp_path / "c1" / f"{key}.jpg").write_bytes(blob)
    loader = Loader(readers.files(tmp_path), batch_size=4, device="cuda", pipeline=PIPELINES[name]())
    try:
        for _ in range(2):  # the loader stays usable after an epoch ended by an error
            with pytest.raises(DecodeError) as info:
                async for _ in loader:
                    pass
            assert info.value.key.startswith("c1/")
    finally:
        await loader.aclose()
    loader = Loader(readers.files(tmp_path), batch_size=4, device="cuda", pipeline=PIPELINES[name](),
                    on_error="skip", max_errors=len(bad) + 2)
    try:
        keys = [k async for b in loader for k in b.sample_keys]
        stats = loader.stats()
    finally:
        await loader.aclose()
    assert sorted(keys) == [f"c0/{i:03d}" for i in range(8)]
    assert stats.dropped == len(bad) and stats.errors == {"DecodeError": len(bad)}
    assert sorted(r.key for r in stats.recent_errors) == sorted(f"c1/{key}" for key in bad)


def _damaged_png(rng, h, w) -> bytes:
    """A PNG whose compressed pixels are damaged, its chunk CRC recomputed (only the zlib stream is wrong)."""
    data = bytearray(_png(rng, h, w))
    start = data.index(b"IDAT") + 4
    length = int.from_bytes(data[start - 8 : start - 4], "big")
    for pos in rng.integers(start + 2, start + length, size=6):
        data[pos] ^= 0xFF
    data[start + length : start + length + 4] = zlib.crc32(bytes(data[start - 4 : start + length])).to_bytes(4, "big")
    return bytes(data)


def _webp(rng, h, w) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)).save(buf, "WEBP", quality=80)
    return buf.getvalue()


async def test_other_formats_and_lying_jpegs_get_pillows_verdict_in_mixed_batches():
    """What crashed or hung nvImageCodec in fuzzing on the H100 never reaches it: damaged PNGs (libpng
    "Not enough image data", a segfault), batches mixing its codecs (a hang), and a progressive JPEG
    whose header claims far more than its bytes hold (a segfault in nvjpegDecodeJpegHost). Each
    such sample gets the CPU path's verdict, batch after batch, whatever crop windows the seed draws."""
    rng = np.random.default_rng(23)
    small = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((178, 175), Image.Resampling.BICUBIC).save(buf, "JPEG", quality=30, progressive=True)
    progressive = buf.getvalue()
    png = _png(rng, 120, 90)
    webp = _webp(rng, 100, 140)
    blobs = {
        "lying-progressive": _claiming(progressive, 6000, 6000),
        "damaged-png": _damaged_png(rng, 150, 170),
        "cut-png": png[: len(png) * 2 // 3],
        "png": png,
        "cut-webp": webp[: len(webp) // 2],
        "webp": webp,
        "jpeg": _jpeg(rng, 240, 320),
        "cut-jpeg": _jpeg(rng, 200, 200)[:-300] + b"\xff\xd9",
    }
    assert _cuda_prep.too_short([blobs["lying-progressive"]], np.array([[6000, 6000]])).tolist() == [True]
    samples = [_sample(f"{key}-{i}", blobs[key], i) for i, key in enumerate(list(blobs) * 6)]
    random.Random(5).shuffle(samples)
    for name in ("train", "val"):
        cpu = ops.CpuExecutor(PIPELINES[name](), num_threads=2, seed=9)
        gpu = ops.CudaExecutor(PIPELINES[name](), seed=9)
        verdicts: dict[str, set[str]] = collections.defaultdict(set)
        try:
            for lo in range(0, len(samples), 16):
                part = SampleBatch(samples[lo : lo + 16], 0, lo // 16)
                a, b = await cpu.run(part), await gpu.run(part)
                assert b.kept == a.kept
                assert [(row, str(err)) for row, err in b.failures] == [(row, str(err)) for row, err in a.failures]
                for row in b.kept:
                    verdicts[samples[lo + row].key.rsplit("-", 1)[0]].add("delivered")
                for row, err in b.failures:
                    verdicts[samples[lo + row].key.rsplit("-", 1)[0]].add(type(err).__name__)
            torch.cuda.synchronize()
        finally:
            await cpu.aclose()
            await gpu.aclose()
        print(name, dict(verdicts))
        for key in ("lying-progressive", "png", "webp", "jpeg"):
            assert verdicts[key] == {"delivered"}, key
        for key in ("damaged-png", "cut-png", "cut-webp"):
            assert verdicts[key] == {"DecodeError"}, key


async def test_pillows_decodes_on_the_gpu_path_stay_within_max_batch_bytes():
    """Large PNGs on the GPU path decode in Pillow threads that together hold at most
    ``max_batch_bytes``; what the prep thread keeps for the lane stays within a lane's share, the
    rest the lane decodes one at a time. Same samples as the CPU path, same output shapes."""
    rng = np.random.default_rng(29)
    blobs = []
    for i in range(12):
        img = Image.fromarray(rng.integers(0, 256, size=(8, 8, 3), dtype=np.uint8)).resize((2400, 1800))
        buf = io.BytesIO()
        img.save(buf, "PNG", compress_level=1)
        blobs.append(buf.getvalue())
    samples = [_sample(f"big-{i}", blob, i) for i, blob in enumerate(blobs)]
    limit = 40 << 20  # one 2400x1800 image decodes in about 30 MiB: the threads take them nearly one by one
    pipeline = ops.Pipeline([ops.Decode(max_batch_bytes=limit), ops.RandomResizedCrop(96)])
    cpu = ops.CpuExecutor(pipeline, num_threads=2, seed=4)
    gpu = ops.CudaExecutor(pipeline, seed=4)
    try:
        a = await cpu.run(SampleBatch(samples, 0, 0))
        b = await gpu.run(SampleBatch(samples, 0, 0))
        torch.cuda.synchronize()
        peak = gpu._pillow.budget.peak
    finally:
        await cpu.aclose()
        await gpu.aclose()
    assert a.kept == b.kept == list(range(12)) and not b.failures
    assert tuple(b.data["image"].shape) == tuple(a.data["image"].shape) == (12, 3, 96, 96)
    assert 0 < peak <= limit
