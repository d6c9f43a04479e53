"""The GPU path against the CPU path, and its lifetime rules, on real CUDA."""

from __future__ import annotations

import gc
import io
import os
import subprocess
import threading

from gpu_data import class_folders
import numpy as np
import pytest
import torch
from PIL import Image

from headrace import DecodeError, Loader, Sample, TransformError, ops, readers
from headrace._sample import SampleBatch

# Bounds, explained: the kernel computes the antialiased bilinear filter in two passes (rounding
# between them, as Pillow does) in float arithmetic; the CPU path uses torch's uint8 antialiased
# resize. Each is within 1 of the exact resample, so uint8 results differ by at most 2 levels.
# Normalized outputs inherit that: 2 levels / 255 / std.
UINT8_BOUND = 2
NORM_BOUND = 2 / 255 / min(ops.IMAGENET_STD) + 1e-3


def _png(rng, h, w, gray=False):
    shape = (h, w) if gray else (h, w, 3)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, size=shape, dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _jpeg(rng, h, w, quality=95, orientation=None):
    small = rng.integers(0, 256, size=(6, 6, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    kw = {}
    if orientation:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kw["exif"] = exif.tobytes()
    img.save(buf, "JPEG", quality=quality, **kw)
    return buf.getvalue()


def _batch(blobs, ext="png", epoch=0):
    samples = [Sample(f"s{i}", {ext: b, "cls": str(i % 7).encode()}, f"mem://{i}", i, position=i) for i, b in enumerate(blobs)]
    return SampleBatch(samples, epoch, 0)


async def _both(pipeline, batch, **gpu_kw):
    cpu = ops.CpuExecutor(pipeline, num_threads=2, seed=3)
    gpu = ops.CudaExecutor(pipeline, seed=3, **gpu_kw)
    try:
        a = await cpu.run(batch)
        b = await gpu.run(batch)
        torch.cuda.synchronize()
        return a, b
    finally:
        await cpu.aclose()
        await gpu.aclose()


PIPELINES = {
    "resize-exact": ([ops.Resize((33, 47))], "uint8"),
    "resize-short+center": ([ops.Resize(40), ops.CenterCrop(32)], "uint8"),
    "center-pad": ([ops.CenterCrop(150)], "uint8"),
    "rrc+flip": ([ops.RandomResizedCrop(24), ops.Flip()], "uint8"),
    "rrc-upscale": ([ops.RandomResizedCrop(180, scale=(0.05, 0.2))], "uint8"),
    "train-f32": ([ops.RandomResizedCrop(32), ops.Flip(), ops.Normalize()], "norm"),
    "train-f16": ([ops.RandomResizedCrop(32), ops.Flip(), ops.Normalize(dtype="float16")], "norm"),
    "val-hwc-bf16": ([ops.Resize(36), ops.CenterCrop(32), ops.Normalize(dtype="bfloat16", layout="HWC")], "norm"),
    "vflip": ([ops.CenterCrop(20), ops.Flip(1.0, vertical=True)], "uint8"),
    "random-crop": ([ops.RandomCrop(24), ops.Flip()], "uint8"),
    "random-crop-pad": ([ops.RandomCrop(150)], "uint8"),
    "random-resize+crop": ([ops.RandomResize(32, 64), ops.RandomCrop(28), ops.Flip()], "uint8"),
    "letterbox": ([ops.Resize(None, max_size=40), ops.CenterCrop(40)], "uint8"),
}


@pytest.mark.parametrize("name", list(PIPELINES))
@pytest.mark.parametrize("gray", [False, True])
async def test_kernel_matches_cpu_path_on_random_images_of_random_sizes(name, gray):
    op_list, kind = PIPELINES[name]
    if gray and kind == "norm":
        op_list = op_list[:-1] + [ops.Normalize((0.5,), (0.25,), dtype=op_list[-1].dtype, layout=op_list[-1].layout)]
    pipeline = ops.Pipeline([ops.Decode("gray" if gray else "rgb"), *op_list])
    rng = np.random.default_rng(hash((name, gray)) % 2**32)
    blobs = [_png(rng, int(rng.integers(8, 300)), int(rng.integers(8, 300)), gray) for _ in range(48)]
    a, b = await _both(pipeline, _batch(blobs))
    assert a.kept == b.kept == list(range(48))
    ref, got = a.data["image"].float(), b.data["image"].float().cpu()
    assert got.shape == ref.shape and b.data["image"].dtype == a.data["image"].dtype
    err = (got - ref).abs().max().item()
    bound = UINT8_BOUND if kind == "uint8" else NORM_BOUND * (4 if gray else 1)
    if b.data["image"].dtype in (torch.float16, torch.bfloat16):
        bound += ref.abs().max().item() * (2**-8 if b.data["image"].dtype == torch.bfloat16 else 2**-11)
    print(f"{name} gray={gray}: max error {err:.4g} (bound {bound:.4g})")
    assert err <= bound
    assert torch.equal(a.data["label"], b.data["label"].cpu())


RAGGED = {
    "decode-only": ([], "uint8"),
    "resize-short": ([ops.Resize(40)], "uint8"),
    "resize-short-hwc": ([ops.Resize(37), ops.Flip(1.0), ops.Normalize(dtype="float16", layout="HWC")], "norm"),
    "flip-f32": ([ops.Flip(), ops.Normalize()], "norm"),
    "vflip-bf16": ([ops.Resize(50), ops.Flip(1.0, vertical=True), ops.Normalize(dtype="bfloat16")], "norm"),
    "resize-short+color": ([ops.Resize(40), ops.ColorTwist(0.3, 0.3, 0.3, 0.05)], "post"),
    "random-resize": ([ops.RandomResize(24, 48)], "uint8"),
    "resize-capped": ([ops.Resize(40, max_size=60), ops.Flip()], "uint8"),
}


@pytest.mark.parametrize("name", list(RAGGED))
@pytest.mark.parametrize("gray", [False, True])
async def test_images_of_their_own_sizes_match_the_cpu_path(name, gray):
    # No op fixes the output size: the GPU path hands out a list of CUDA tensors (views of one
    # allocation, one launch a batch), each as the CPU path's list has it.
    op_list, kind = RAGGED[name]
    if gray and name == "resize-short+color":
        op_list = [ops.Resize(40), ops.ColorTwist(0.3, 0.3)]  # saturation and hue need colour
    if gray and kind == "norm":
        op_list = op_list[:-1] + [ops.Normalize((0.5,), (0.25,), dtype=op_list[-1].dtype, layout=op_list[-1].layout)]
    pipeline = ops.Pipeline([ops.Decode("gray" if gray else "rgb"), *op_list])
    assert pipeline.output_size() is None
    rng = np.random.default_rng(hash((name, gray, "ragged")) % 2**32)
    blobs = [_png(rng, int(rng.integers(8, 300)), int(rng.integers(8, 300)), gray) for _ in range(40)]
    a, b = await _both(pipeline, _batch(blobs))
    assert a.kept == b.kept == list(range(40))
    ref, got = a.data["image"], b.data["image"]
    assert isinstance(got, list) and len(got) == len(ref) == 40
    # "post": the geometry's 2 levels, scaled by the colour twist's gain, plus its rounding (the
    # bound of test_gpu_post_ops.py's whole-pipeline test)
    bound = {"uint8": UINT8_BOUND, "post": 6, "norm": NORM_BOUND * (4 if gray else 1)}[kind]
    worst = 0.0
    for x, y in zip(ref, got):
        assert y.is_cuda and y.dtype == x.dtype and y.shape == x.shape, (x.shape, y.shape)
        err = (y.float().cpu() - x.float()).abs().max().item()
        extra = x.float().abs().max().item() * {torch.float16: 2**-11, torch.bfloat16: 2**-8}.get(x.dtype, 0.0)
        assert err <= bound + extra
        worst = max(worst, err)
    print(f"{name} gray={gray}: max error {worst:.4g} (bound {bound:.4g} + rounding of the dtype)")
    if kind == "uint8" and not op_list:
        assert worst == 0  # decode alone: the same pixels (PNG is lossless)
    assert torch.equal(a.data["label"], b.data["label"].cpu())


async def test_gpu_jpeg_decode_is_close_to_cpu_decode():
    # nvJPEG and libjpeg-turbo differ in IDCT and chroma upsampling: close, not equal.
    rng = np.random.default_rng(1)
    blobs = [_jpeg(rng, int(rng.integers(64, 400)), int(rng.integers(64, 400))) for _ in range(32)]
    a, b = await _both(ops.Pipeline([ops.Resize((64, 64))]), _batch(blobs, "jpg"))
    diff = (a.data["image"].float() - b.data["image"].float().cpu()).abs()
    print(f"JPEG GPU vs CPU decode: mean {diff.mean():.3f}, max {diff.max():.0f} levels")
    assert diff.mean() < 2.0 and diff.max() <= 24


async def test_exif_orientation_matches_cpu_path():
    rng = np.random.default_rng(2)
    blobs = [_jpeg(rng, 60 + 7 * o, 90 + 5 * o, quality=100, orientation=o) for o in range(1, 9)]
    a, b = await _both(ops.Pipeline([ops.RandomResizedCrop(40, scale=(0.3, 1.0))]), _batch(blobs, "jpg"))
    diff = (a.data["image"].float() - b.data["image"].float().cpu()).abs()
    print(f"EXIF GPU vs CPU: mean {diff.mean():.3f}, max {diff.max():.0f} levels")
    assert diff.mean() < 2.0


async def test_bad_samples_fail_alone_with_typed_errors():
    rng = np.random.default_rng(3)
    good = _jpeg(rng, 80, 80)
    blobs = [good, good[:300], b"", b"GIF89a not really", b"\xff\xd8\xff" + bytes(100), good]
    a, b = await _both(ops.Pipeline([ops.Resize((32, 32))]), _batch(blobs, "jpg"))
    assert b.kept == a.kept == [0, 5]
    assert [row for row, _ in b.failures] == [1, 2, 3, 4]
    for row, err in b.failures:
        assert isinstance(err, DecodeError) and err.key == f"s{row}" and err.source == f"mem://{row}"
    assert b.data["image"].shape[0] == 2


@pytest.mark.parametrize("pipeline", [ops.training(48, fields=("txt",)), ops.Pipeline([ops.Resize(40)], fields=("txt",))],
                         ids=["fixed", "own-sizes"])
async def test_fields_ride_beside_their_images(pipeline):
    # The lane's two ways out (the shim's launch; the launch from Python for list outputs) both
    # hand out the pass-through field for the rows they kept, as the CPU path does.
    rng = np.random.default_rng(6)
    batch = _batch([_jpeg(rng, int(rng.integers(64, 200)), int(rng.integers(64, 200))) for _ in range(12)], "jpg")
    for s in batch.samples:
        if s.key != "s4":
            s.fields["txt"] = f"caption of {s.key}".encode()
    a, b = await _both(pipeline, batch)
    assert a.kept == b.kept == [i for i in range(12) if i != 4]
    assert b.data["txt"] == a.data["txt"] == [f"caption of s{i}".encode() for i in b.kept]
    [(row, err)] = b.failures
    assert row == 4 and isinstance(err, TransformError) and err.key == "s4" and "'txt'" in str(err)


async def test_the_shims_launch_equals_the_launch_from_python():
    # The lane's common case (decode, copies, kernel, event in one shim call) against the same
    # batch launched from Python (GpuTuning(launch="python")): the same bytes, labels and rows.
    rng = np.random.default_rng(5)
    blobs = [_jpeg(rng, int(rng.integers(64, 400)), int(rng.integers(64, 400))) for _ in range(40)]
    pipeline = ops.training(48, dtype="float16")
    results = {}
    for fused in ("1", "0"):
        gpu = ops.CudaExecutor(pipeline, seed=3, lanes=1, tuning=ops.GpuTuning(launch="shim" if fused == "1" else "python"))
        try:
            assert (gpu._lanes[0].fused is not None) == (fused == "1")
            outs = [await gpu.run(_batch(blobs, "jpg", epoch=e)) for e in range(3)]  # the lane's buffers in turn
            torch.cuda.synchronize()
            results[fused] = [(o.kept, o.data["image"].cpu(), o.data["label"].cpu()) for o in outs]
            seconds = gpu.timings()
        finally:
            await gpu.aclose()
        assert (seconds.get("shim.launch", 0.0) > 0.0) == (fused == "1")
    for (kept_a, img_a, lbl_a), (kept_b, img_b, lbl_b) in zip(results["1"], results["0"]):
        assert kept_a == kept_b == list(range(40))
        assert torch.equal(img_a, img_b) and torch.equal(lbl_a, lbl_b)
        assert lbl_a.tolist() == [i % 7 for i in range(40)]


HUFFMAN_ON_THE_GPU = {
    "gpu_huffman_above=0": ops.GpuTuning(gpu_huffman_above=0),  # the CUDA decoder: every image on the GPU
    "gpu_huffman_load=0.5": ops.GpuTuning(gpu_huffman_load=0.5),  # a second decoder: half of each batch
    "gpu_huffman_load=1": ops.GpuTuning(gpu_huffman_load=1.0),
    "gpu_huffman_load=0.5, 8 threads": ops.GpuTuning(gpu_huffman_load=0.5, gpu_huffman_threads=8),
}


async def _decode_alone(pipeline, batch, tuning, hw_load=0.0):
    gpu = ops.CudaExecutor(pipeline, seed=3, lanes=1, hw_load=hw_load, tuning=tuning)
    try:
        out = await gpu.run(batch)
        torch.cuda.synchronize()
        return out
    finally:
        await gpu.aclose()


@pytest.mark.parametrize("tuning", HUFFMAN_ON_THE_GPU.values(), ids=HUFFMAN_ON_THE_GPU.keys())
async def test_huffman_on_the_gpu_decodes_what_huffman_on_the_host_does(tuning):
    # The CUDA decoders alone (hw_load 0): Huffman stages on the GPU against all of them on the
    # host (the defaults): the same images, the same rows. nvJPEG's two backends share the rest of
    # the decode, so the pixels may differ only by rounding.
    rng = np.random.default_rng(8)
    blobs = [_jpeg(rng, int(rng.integers(64, 700)), int(rng.integers(64, 700))) for _ in range(40)]
    pipeline = ops.Pipeline([ops.Decode(), ops.Resize(64), ops.CenterCrop(64)])
    on_gpu = await _decode_alone(pipeline, _batch(blobs, "jpg"), tuning)
    on_host = await _decode_alone(pipeline, _batch(blobs, "jpg"), ops.GpuTuning())
    assert on_gpu.kept == on_host.kept == list(range(40))
    a, b = on_gpu.data["image"].cpu().float(), on_host.data["image"].cpu().float()
    assert a.shape == b.shape == (40, 3, 64, 64)
    print(f"Huffman on the GPU ({tuning}) vs the host: max {(a - b).abs().max():.0f}, mean {(a - b).abs().mean():.4f} levels")
    assert (a - b).abs().max().item() <= 2 and (a - b).abs().mean().item() < 0.05


@pytest.mark.parametrize("tuning", HUFFMAN_ON_THE_GPU.values(), ids=HUFFMAN_ON_THE_GPU.keys())
async def test_huffman_on_the_gpu_fails_bad_samples_alone(tuning):
    # Truncated and damaged JPEGs with their Huffman stage on the GPU: each fails alone, typed and
    # named, as on the host; the good ones decode. Then the three-way split (engine, GPU, host).
    rng = np.random.default_rng(3)
    good = _jpeg(rng, 200, 240)
    blobs = [good, good[:300], good[: len(good) // 2], b"\xff\xd8\xff" + bytes(100), good]
    out = await _decode_alone(ops.Pipeline([ops.Resize((32, 32))]), _batch(blobs, "jpg"), tuning)
    assert out.kept == [0, 4]
    assert [row for row, _ in out.failures] == [1, 2, 3]
    for row, err in out.failures:
        assert isinstance(err, DecodeError) and err.key == f"s{row}" and err.source == f"mem://{row}"
    many = [_jpeg(rng, int(rng.integers(64, 500)), int(rng.integers(64, 500))) for _ in range(30)]
    split = await _decode_alone(ops.training(48, dtype="float16"), _batch(many, "jpg"), tuning, hw_load=0.5)
    assert split.kept == list(range(30)) and torch.isfinite(split.data["image"].float()).all()


async def test_batches_given_to_the_free_lane_equal_batches_given_in_turn():
    # Nine batches at once on three lanes, one of them large (it holds its lane): whichever lane a
    # batch lands on, its images, labels and rows are those of batch i on lane i mod 3, and no lane
    # keeps a batch counted as queued afterwards.
    import asyncio

    rng = np.random.default_rng(6)
    sizes = [48 if i == 1 else 12 for i in range(9)]
    blobs = [[_jpeg(rng, int(rng.integers(64, 900)), int(rng.integers(64, 900))) for _ in range(n)] for n in sizes]
    pipeline = ops.training(48, dtype="float16")
    results = {}
    for dispatch in ("free", "turn"):
        gpu = ops.CudaExecutor(pipeline, seed=3, lanes=3, tuning=ops.GpuTuning(dispatch=dispatch))
        try:
            batches = [SampleBatch(_batch(b, "jpg").samples, 0, i) for i, b in enumerate(blobs)]
            outs = await asyncio.gather(*(gpu.run(b) for b in batches))
            torch.cuda.synchronize()
            results[dispatch] = [(o.kept, o.data["image"].cpu(), o.data["label"].cpu()) for o in outs]
            assert all(not lane.queued for lane in gpu._lanes)
        finally:
            await gpu.aclose()
    for (kept_a, img_a, lbl_a), (kept_b, img_b, lbl_b), n in zip(results["free"], results["turn"], sizes):
        assert kept_a == kept_b == list(range(n))
        assert torch.equal(img_a, img_b) and torch.equal(lbl_a, lbl_b)


@pytest.fixture
def folder(tmp_path):
    return class_folders(tmp_path, np.random.default_rng(4), 3, 40, _jpeg, "jpg", 100, 400)


def _loader(folder, **kw):
    kw.setdefault("pipeline", ops.training(64, dtype="float16"))
    return Loader(readers.files(folder, shuffle=True), batch_size=16, device="cuda", **kw)


async def test_a_gpu_batch_pickles_and_saves_with_its_tensors(folder, tmp_path):
    import pickle

    async with _loader(folder, pipeline=ops.Pipeline([ops.Decode(), ops.Resize(48)])) as loader:
        async for b in loader:
            assert b.extra["ready"] is not None  # a CUDA event: it does not pickle itself
            again = pickle.loads(pickle.dumps(b))
            torch.save(b, tmp_path / "batch.pt")
            saved = torch.load(tmp_path / "batch.pt", weights_only=False)
            for copy in (again, saved):
                assert copy.sample_keys == b.sample_keys and "ready" not in copy.extra
                assert torch.equal(copy["label"], b["label"])
                assert all(torch.equal(x, y) for x, y in zip(copy["image"], b["image"]))
                assert copy["image"][0].is_cuda
            assert b.extra["ready"] is not None  # the batch itself keeps it
            break


async def test_loader_picks_the_gpu_and_yields_every_sample(folder):
    assert Loader(readers.files(folder), batch_size=4, pipeline=ops.training(64)).device == "cuda"  # auto
    assert Loader(readers.files(folder), batch_size=4).device == "cuda"  # decode only: a list a batch
    async with _loader(folder) as loader:
        batches = [b async for b in loader]
    keys = [k for b in batches for k in b.sample_keys]
    assert sorted(keys) == sorted(f"c{c}/{i:03d}" for c in range(3) for i in range(40))
    b = batches[0]
    assert b["image"].is_cuda and b["image"].dtype == torch.float16 and b["image"].shape == (16, 3, 64, 64)
    assert b["label"].is_cuda and b["label"].tolist() == [int(k[1]) for k in b.sample_keys]


async def test_loader_hands_out_images_of_their_own_sizes_on_the_gpu(folder):
    pipeline = ops.Pipeline([ops.Decode(), ops.Resize(72), ops.Flip(), ops.Normalize(dtype="float16")])
    results = {}
    for device in ("cuda", "cpu"):
        images = results[device] = {}
        async with Loader(readers.files(folder), batch_size=16, pipeline=pipeline, device=device, seed=5) as loader:
            with torch.cuda.stream(torch.cuda.Stream()):  # the consumer reads on its own stream
                async for b in loader:
                    assert isinstance(b["image"], list) and len(b["image"]) == len(b.sample_keys)
                    assert all(x.is_cuda == (device == "cuda") for x in b["image"])
                    images.update({k: x.float().cpu() for k, x in zip(b.sample_keys, b["image"])})
    gpu, cpu = results["cuda"], results["cpu"]
    assert gpu.keys() == cpu.keys() and len(gpu) == 120
    diffs = []
    for k in gpu:
        assert gpu[k].shape == cpu[k].shape and min(gpu[k].shape[1:]) == 72
        diffs.append((gpu[k] - cpu[k]).abs().mean().item())
    # JPEG: nvJPEG and libjpeg-turbo differ a little (as in the decode test), in normalized units here
    print(f"list outputs GPU vs CPU: mean abs difference {np.mean(diffs):.4f}, worst image {max(diffs):.4f}")
    assert np.mean(diffs) < 2.0 / 255 / min(ops.IMAGENET_STD)


async def test_stream_safety_consumer_on_its_own_stream_matches_a_synchronous_run(folder):
    reference = []
    async with _loader(folder, lanes=1, prefetch=1) as loader:
        async for b in loader:
            torch.cuda.synchronize()
            reference.append(b["image"].clone())
    side = torch.cuda.Stream()
    got = []
    junk = torch.randn(4096, 4096, device="cuda")
    async with _loader(folder, lanes=4, prefetch=6) as loader:
        with torch.cuda.stream(side):
            async for b in loader:
                junk = junk @ junk.T / 4096  # keep the consumer's stream busy while lanes run
                got.append((b["image"].float() * 2).half())  # read on the consumer stream
    torch.cuda.synchronize()
    assert len(got) == len(reference)
    for x, y in zip(got, reference):
        assert torch.equal(x, (y.float() * 2).half())


def _workspaces(loader) -> list[int]:
    """The bytes of each lane workspace of ``loader``'s executor, lane by lane."""
    return [w.untyped_storage().nbytes() for lane in loader._epochs._executor._lanes for w in lane.decoder.workspaces]


def _gpu_bytes_held() -> int:
    """The GPU memory this process holds, as the driver counts it (every allocator's: torch's,
    nvImageCodec's, CuPy's), from ``nvidia-smi``; where that cannot tell, the memory in use on the
    whole device, which the suite's other processes also move."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip() == str(os.getpid()) and mib.strip().isdigit():
            return int(mib) << 20
    free, total = torch.cuda.mem_get_info()
    return total - free


def _nbytes(value) -> int:
    return sum(x.nbytes for x in value) if isinstance(value, list) else value.nbytes


@pytest.mark.parametrize(("sizes", "run_ahead"), [("fixed", False), ("fixed", True), ("own", False)])
async def test_gpu_memory_is_flat_over_epochs(folder, sizes, run_ahead):
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    pipeline = ops.training(64, dtype="float16") if sizes == "fixed" else ops.Pipeline([ops.Decode(), ops.Resize(72)])
    async with _loader(folder, run_ahead=run_ahead, pipeline=pipeline) as loader:
        used, batch_bytes = [], 0
        for _ in range(5):
            async for b in loader:
                batch_bytes = max(batch_bytes, _nbytes(b["image"]) + b["label"].nbytes)
                del b
            gc.collect()
            torch.cuda.synchronize()
            used.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), _gpu_bytes_held(),
                         _workspaces(loader)))
    gc.collect()
    after = torch.cuda.memory_allocated()
    print(f"sizes={sizes} run_ahead={run_ahead}: allocated, reserved, GPU memory held, workspaces per epoch:", used,
          f"allocated before the loader {before}, after its close {after}")
    assert after == before  # the run ahead, too, gave everything back
    # Each lane's two workspaces grow to the largest batch they have met; which lane meets which
    # batch depends on timing (a batch goes to the least busy lane), so one may still grow after
    # the first epoch, up to its budget. Anything else that grew would be a leak.
    for u, v in zip(used[1:], used[2:]):
        changed = sum(x != y for x, y in zip(u[3], v[3]))
        drift = (v[0] - u[0]) - (sum(v[3]) - sum(u[3]))  # what grew besides the workspaces
        slack = changed * (2 << 20)  # the allocator may hand a workspace a block up to 2 MiB larger
        if run_ahead:
            # At an epoch's end the next one's run holds up to prefetch + 2 decoded batches (in flight
            # and in its output channel), how many depends on timing; a leak would grow past that.
            slack += (loader._epochs.cfg.prefetch + 2) * batch_bytes
        assert abs(drift) <= slack, (u, v)
    reserved = [u[1] for u in used[1:]]
    if sizes == "fixed" and not run_ahead and all(u[3] == used[1][3] for u in used[1:]):
        assert max(reserved) == reserved[0]
    else:  # timing, or a workspace grown, may still grow the allocator's cache a little
        assert max(reserved) - reserved[0] < 64 << 20
    # What the driver counts for this process takes in nvImageCodec's and CuPy's own memory, which
    # torch does not see; a leak there grows it, most by the last epoch. (The device's free memory,
    # counted before, took in every process of the suite, several at once, and failed on theirs.)
    assert used[-1][2] - used[1][2] < 64 << 20


async def test_clean_shutdown_mid_epoch(folder, leaks):
    gc.collect()  # earlier tests' garbage must not be freed inside the measurement
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    loader = _loader(folder)
    async for b in loader:
        if b.index == 2:
            break
    del b
    await loader.aclose()
    await leaks.check(settle=5.0)
    assert not [t for t in threading.enumerate() if t.name.startswith("headrace")]
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before


def test_sync_facade_on_gpu(folder):
    with _loader(folder).sync() as loader:
        assert sum(b.size for b in loader) == 120
        assert sum(b.size for b in loader) == 120  # a second epoch on the same lanes
    assert not [t for t in threading.enumerate() if t.name.startswith("headrace")]


async def test_lanes_outlive_completed_epochs_and_breaks_until_aclose(folder, leaks):
    loader = _loader(folder)
    [b async for b in loader]
    lanes = [t for t in threading.enumerate() if t.name.startswith("headrace-lane")]
    assert lanes  # kept for the next epoch
    async for b in loader:
        break
    del b
    assert [b.size async for b in loader] and lanes == [t for t in threading.enumerate() if t.name.startswith("headrace-lane")]
    await loader.aclose()  # the executor lives as long as the loader
    await leaks.check(settle=5.0)
    assert not [t for t in threading.enumerate() if t.name.startswith("headrace")]
