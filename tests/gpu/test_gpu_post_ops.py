"""The post-op kernels (colour twist, warps, blur, tone curves, sharpness, finish) against the CPU
path, on real CUDA.

Bounds, per op, GPU kernel against ``_cpu_post`` on the same tables (both round once, half up):
- colour twist: 1 level (float32 both; the CPU's matrix product and the kernel's expression may
  round a value that lies within ~1e-5 of a half level differently);
- warp (Rotate, RandomAffine, WarpAffine): 1 level. Each neighbour outside the image reads the fill, so the
  result is continuous in the sample point: a point that lands within float error (1e-4 px) of a
  pixel boundary on one side and not on the other changes the value by at most 255 * 1e-4 levels
  before rounding, so no special case is needed (Pillow's hard edge would need one);
- blur: 1 level (the same operations in the same order: 0 expected, barring FMA contraction);
- tone curves: exact (the tables are built from the same counts in the same integer and float
  operations, then looked up);
- sharpness: exact (integer smoothing, then the same float32 operations, no FMA);
- RandAugment and TrivialAugmentWide with one round: each sample's one op, so that op's bound (1);
- finish: exact for float32, and for float16/bfloat16 (the same float32 value, one rounding).
"""

from __future__ import annotations

import dataclasses
import io

from gpu_data import class_folders
import numpy as np
import pytest
import torch
from PIL import Image

from headrace import Loader, ops, readers
from headrace.ops import ColorTwist, Decode, GaussianBlur, Normalize, Pipeline, RandomGrayscale, Rotate, WarpAffine
from headrace.ops.cpu import _post as _cpu_post
from headrace.ops.cuda._post import PostOps, describe

BOUND = {"color": 1, "warp": 1, "blur": 1, "tone": 0, "sharpness": 0, "policy": 1}


def _image(rng, h, w, c):
    yy, xx = np.mgrid[0:h, 0:w]
    phase = rng.uniform(0, 2 * np.pi, size=c)
    smooth = 127 + 110 * np.sin(xx[..., None] / max(w, 1) * 7 + yy[..., None] / max(h, 1) * 5 + phase)
    return np.clip(smooth + rng.normal(0, 35, size=(h, w, c)), 0, 255).astype(np.uint8)


def _images(rng, n, c, small=False):
    """n images of random sizes (some 1-pixel wide or tall, some large), uint8 HWC NumPy arrays."""
    sizes = [(int(rng.integers(1, 24 if small else 320)), int(rng.integers(1, 24 if small else 320))) for _ in range(n)]
    sizes[:3] = [(1, 1), (1, 37), (41, 1)]
    return [_image(rng, h, w, c) for h, w in sizes]


@pytest.fixture
def stream():
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    yield s
    s.synchronize()


def _gpu(pipeline, stream, arrays, tables, *, as_tensor=False, inplace=False):
    post = PostOps(pipeline, stream, seed=5)
    if as_tensor:
        images = torch.from_numpy(np.stack(arrays)).cuda()
    else:
        images = [torch.from_numpy(a).cuda() for a in arrays]
    torch.cuda.synchronize()  # the inputs were written on torch's stream
    out = post.apply_tables(images, tables, inplace=inplace)
    stream.synchronize()
    return [o.cpu().numpy() for o in out], images


def _cpu(pipeline, arrays, steps):
    return [_cpu_post.run_steps(torch.from_numpy(a), steps, row=i).numpy() for i, a in enumerate(arrays)]


def _tables(pipeline, arrays, seed=5, epoch=1):
    """The batch's passes (``PostOp.steps``): primitive ops and their tables."""
    h = np.array([a.shape[0] for a in arrays])
    w = np.array([a.shape[1] for a in arrays])
    us = pipeline.post_uniforms(seed, epoch, np.arange(len(arrays)))
    return [step for op, u in zip(pipeline.post_ops, us) for step in op.steps(u, h, w, pipeline.channels)]


def _compare(name, got, ref, bound):
    diffs = [np.abs(g.astype(int) - r.astype(int)) for g, r in zip(got, ref)]
    assert all(g.shape == r.shape and g.dtype == np.uint8 for g, r in zip(got, ref))
    worst = max(int(d.max()) for d in diffs)
    off = sum(int((d > 0).sum()) for d in diffs) / sum(d.size for d in diffs)
    print(f"{name}: max {worst} levels, {off:.2e} of values differ (bound {bound})")
    assert worst <= bound


OPS = {
    "color": (ColorTwist(0.8, 0.8, 0.9, 0.5), "color"),
    "color-hue-only": (ColorTwist(hue=(-0.5, 0.5)), "color"),
    "rotate": (Rotate(180, fill=(10, 200, 30)), "warp"),
    "rotate-small": (Rotate((-10, 10), fill=127), "warp"),
    "warp-affine": (WarpAffine([[0.7, 0.3, 5.25], [-0.2, 1.3, -3.5]], fill=(250, 0, 99)), "warp"),
    "random-affine": (ops.RandomAffine(30, translate=(0.1, 0.2), scale=(0.8, 1.2), shear=(-10, 10, -5, 5),
                                       fill=(10, 200, 30)), "warp"),
    "blur": (GaussianBlur((5, 9), sigma=(0.1, 3.0)), "blur"),
    "blur-wide": (GaussianBlur(31, sigma=(4.0, 9.0)), "blur"),
    # p < 1: the same kernels, identity tables for the samples left alone
    "color-p": (ColorTwist(0.8, 0.8, 0.9, 0.5, p=0.5), "color"),
    "grayscale": (RandomGrayscale(0.5), "color"),
    "blur-p": (GaussianBlur((5, 9), sigma=(0.1, 3.0), p=0.5), "blur"),
    "posterize": (ops.RandomPosterize(3), "tone"),
    "solarize": (ops.RandomSolarize(100.5), "tone"),
    "invert": (ops.RandomInvert(), "tone"),
    "autocontrast": (ops.RandomAutocontrast(), "tone"),
    "equalize": (ops.RandomEqualize(), "tone"),
    "sharpen": (ops.RandomAdjustSharpness(2.0), "sharpness"),
    "soften": (ops.RandomAdjustSharpness(0.2, p=1.0), "sharpness"),
    "randaugment-1": (ops.RandAugment(num_ops=1, magnitude=15, fill=(20, 90, 160)), "policy"),
    "trivialaugment": (ops.TrivialAugmentWide(fill=(20, 90, 160)), "policy"),
}


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("channels", [3, 1])
def test_kernel_matches_cpu_on_random_images_of_random_sizes(name, channels, stream):
    op, kind = OPS[name]
    if channels == 1 and isinstance(op, (Rotate, WarpAffine, ops.RandomAffine, ops.RandAugment, ops.TrivialAugmentWide)):
        op = dataclasses.replace(op, fill=op.fill[:1])
    pipeline = Pipeline([Decode("gray" if channels == 1 else "rgb"), op])
    rng = np.random.default_rng(abs(hash((name, channels))) % 2**32)
    arrays = _images(rng, 40, channels, small=name == "blur-wide")
    tables = _tables(pipeline, arrays)
    got, _ = _gpu(pipeline, stream, arrays, tables)
    _compare(f"{name} C={channels}", got, _cpu(pipeline, arrays, tables), BOUND[kind])


IDENTITY = {
    "color": ColorTwist(),
    "color-explicit": ColorTwist((1.0, 1.0), (1.0, 1.0), (1.0, 1.0), (0.0, 0.0)),
    "rotate-0": Rotate(0),
    "warp-identity": WarpAffine([[1, 0, 0], [0, 1, 0]], fill=9),
    "blur-1": GaussianBlur(1),
    "blur-tiny-sigma": GaussianBlur(3, sigma=0.1),  # outer weights 2e-22: no effect on uint8
    "posterize-8": ops.RandomPosterize(8, p=1.0),
    "sharpness-1": ops.RandomAdjustSharpness(1.0, p=1.0),
    "randaugment-0": ops.RandAugment(num_ops=0),
}


@pytest.mark.parametrize("name", list(IDENTITY))
@pytest.mark.parametrize("as_tensor", [False, True])
def test_identity_parameters_give_the_input_back_exactly(name, as_tensor, stream):
    pipeline = Pipeline([IDENTITY[name]])
    rng = np.random.default_rng(7)
    if as_tensor:
        arrays = [_image(rng, 37, 53, 3) for _ in range(9)]
    else:
        arrays = _images(rng, 20, 3)
    got, _ = _gpu(pipeline, stream, arrays, _tables(pipeline, arrays), as_tensor=as_tensor)
    for g, a in zip(got, arrays):
        assert np.array_equal(g, a)


def test_fill_values_outside_the_image(stream):
    # Shifted a whole image width to the right: every pixel reads fill, per channel.
    pipeline = Pipeline([WarpAffine([[1, 0, -1000], [0, 1, 0]], fill=(3, 140, 255))])
    rng = np.random.default_rng(8)
    arrays = _images(rng, 12, 3)
    got, _ = _gpu(pipeline, stream, arrays, _tables(pipeline, arrays))
    for g in got:
        assert (g == np.array([3, 140, 255], dtype=np.uint8)).all()
    # Half a pixel outside on the left: the first column blends image and fill half and half.
    pipeline = Pipeline([WarpAffine([[1, 0, -0.5], [0, 1, 0]], fill=200)])
    arrays = [np.full((5, 6, 3), 100, dtype=np.uint8)]
    got, _ = _gpu(pipeline, stream, arrays, _tables(pipeline, arrays))
    assert (got[0][:, 0] == 150).all() and (got[0][:, 1:] == 100).all()


def test_a_rotation_by_180_degrees_is_a_flip_of_both_axes(stream):
    pipeline = Pipeline([Rotate((180, 180))])
    rng = np.random.default_rng(9)
    arrays = _images(rng, 10, 3)
    got, _ = _gpu(pipeline, stream, arrays, _tables(pipeline, arrays))
    for g, a in zip(got, arrays):
        assert np.abs(g.astype(int) - a[::-1, ::-1].astype(int)).max() <= 1  # cos(pi) is not exactly -1


@pytest.mark.parametrize("inplace", [False, True])
def test_a_chain_on_a_batch_tensor_drawn_per_sample(inplace, stream):
    # Colour first: it can amplify differences (saturation), the others cannot (weights >= 0, sum 1).
    pipeline = Pipeline([Decode(), ops.RandomResizedCrop(48), ColorTwist(0.4, 0.4, 0.4, 0.1), GaussianBlur(5), Rotate(30, fill=64)])
    rng = np.random.default_rng(10)
    arrays = [_image(rng, 48, 48, 3) for _ in range(24)]
    indices = np.arange(100, 124)
    post = PostOps(pipeline, stream, seed=5)
    x = torch.from_numpy(np.stack(arrays)).cuda()
    torch.cuda.synchronize()
    out = post.apply(x, indices, 3, inplace=inplace)
    stream.synchronize()
    assert isinstance(out, torch.Tensor) and out.shape == x.shape and out.is_contiguous()
    got = list(out.cpu().numpy())
    us = pipeline.post_uniforms(5, 3, indices)
    ref = [_cpu_post.apply(torch.from_numpy(a), pipeline.post_ops, [u[i : i + 1] for u in us]).numpy() for i, a in enumerate(arrays)]
    _compare(f"chain inplace={inplace}", got, ref, 3)
    if inplace:  # the colour twist wrote into the input
        assert not np.array_equal(x.cpu().numpy(), np.stack(arrays))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["CHW", "HWC"])
def test_finish_matches_the_cpu_normalize(dtype, layout, stream):
    pipeline = Pipeline([Decode(), ops.CenterCrop(20), ColorTwist(0.2), Normalize(dtype=dtype, layout=layout)])
    post = PostOps(pipeline, stream)
    rng = np.random.default_rng(11)
    x = torch.from_numpy(rng.integers(0, 256, (6, 20, 20, 3), dtype=np.uint8))
    xd = x.cuda()
    torch.cuda.synchronize()
    got = post.finish(xd)
    stream.synchronize()
    mean = torch.tensor(ops.IMAGENET_MEAN, dtype=torch.float32).mul_(255.0)
    inv = 1.0 / torch.tensor(ops.IMAGENET_STD, dtype=torch.float32).mul_(255.0)
    ref = ((x.float() - mean) * inv).to(pipeline.dtype)  # the CPU executor's _finish arithmetic
    if layout == "CHW":
        ref = ref.permute(0, 3, 1, 2)
    assert got.dtype == pipeline.dtype and got.shape == ref.shape and got.is_contiguous()
    assert torch.equal(got.cpu(), ref)


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
def test_finish_without_normalize_is_the_layout(layout, stream):
    pipeline = Pipeline([Decode(), ops.CenterCrop(8), GaussianBlur(3)], layout=layout)
    post = PostOps(pipeline, stream)
    x = torch.randint(0, 256, (4, 8, 8, 3), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    got = post.finish(x)
    stream.synchronize()
    assert torch.equal(got, x.permute(0, 3, 1, 2) if layout == "CHW" else x)


def test_describe_reads_tensors_and_tuples():
    x = torch.zeros((3, 5, 7, 3), dtype=torch.uint8, device="cuda")
    rows = describe(x)
    assert rows[:, 1:].tolist() == [[5, 7, 21, 3]] * 3
    assert rows[1, 0] - rows[0, 0] == 105
    crop = x[0, 1:4, 2:6]  # a view: rows 21 bytes apart
    assert describe([crop])[0].tolist() == [crop.data_ptr(), 3, 4, 21, 3]
    with pytest.raises(ValueError):
        describe([x[0].permute(1, 0, 2)])
    with pytest.raises(ValueError):
        describe([x[0].float()])


# --- the whole pipeline through the Loader (needs PostOps wired into the GPU executor) -------------


def _png(rng, h, w):
    buf = io.BytesIO()
    Image.fromarray(_image(rng, h, w, 3)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path):
    return class_folders(tmp_path, np.random.default_rng(12), 2, 24, _png, "png", 60, 300)


async def test_whole_pipeline_on_gpu_matches_cpu(folder):
    # PNG: both paths decode the same pixels. The geometry differs by up to 2 levels (see
    # test_gpu_pipeline.py); the colour twist can scale that difference (gain up to about 1.4 x
    # saturation), blur and rotate cannot; plus a level of rounding each: 6 levels at most, and
    # on average far less than one.
    pipeline = Pipeline([
        Decode(), ops.RandomResizedCrop(64), ops.Flip(),
        ColorTwist(0.4, 0.4, 0.4, 0.1), GaussianBlur(5), Rotate(20, fill=(124, 116, 104)), Normalize(),
    ])
    got = {}
    for device in ("cpu", "cuda"):
        async with Loader(readers.files(folder), batch_size=16, pipeline=pipeline, device=device, seed=4) as loader:
            got[device] = [(b.sample_keys, b["image"].float().cpu()) async for b in loader]
    assert [k for k, _ in got["cpu"]] == [k for k, _ in got["cuda"]]
    cpu = torch.cat([x for _, x in got["cpu"]])
    gpu = torch.cat([x for _, x in got["cuda"]])
    assert gpu.shape == cpu.shape == (48, 3, 64, 64)
    levels = (gpu - cpu).abs() * torch.tensor(ops.IMAGENET_STD).view(1, 3, 1, 1) * 255
    print(f"whole pipeline GPU vs CPU: max {levels.max():.2f} levels, mean {levels.mean():.4f}")
    assert levels.max() <= 6.01 and levels.mean() < 0.25


def test_tone_curves_read_off_the_image_on_a_batch_tensor_in_place(stream):
    # Autocontrast, equalize and contrast count each sample's levels on the device; a batch
    # tensor, in place, and samples that are flat (max = min: left alone) or of two levels.
    rng = np.random.default_rng(13)
    arrays = [_image(rng, 40, 56, 3) for _ in range(10)]
    arrays[0][:] = 77
    arrays[1] = np.where(rng.random((40, 56, 3)) < 0.5, 10, 240).astype(np.uint8)
    for op in (ops.RandomAutocontrast(p=1.0), ops.RandomEqualize(p=1.0)):
        pipeline = Pipeline([op])
        steps = _tables(pipeline, arrays)
        got, _ = _gpu(pipeline, stream, arrays, steps, as_tensor=True, inplace=True)
        _compare(f"{type(op).__name__} batch", got, _cpu(pipeline, arrays, steps), 0)
    assert np.array_equal(got[0], arrays[0])


def test_contrast_brightness_and_solarize_add_tone_tables_match(stream):
    from headrace.ops._tone import BRIGHTNESS, CONTRAST, SOLARIZE_ADD, ToneCurve

    class Fixed(ToneCurve):
        def tables(self, u, h, w, channels):
            rows = np.zeros((len(h), 2))
            rows[::3] = (CONTRAST, 1.7)
            rows[1::3] = (BRIGHTNESS, 0.63)
            rows[2::3] = (SOLARIZE_ADD, 77)
            return (rows,)

    rng = np.random.default_rng(14)
    for channels in (3, 1):
        arrays = _images(rng, 30, channels)
        pipeline = Pipeline([Decode("gray" if channels == 1 else "rgb"), Fixed()])
        steps = _tables(pipeline, arrays)
        got, _ = _gpu(pipeline, stream, arrays, steps)
        _compare(f"contrast/brightness/solarize-add C={channels}", got, _cpu(pipeline, arrays, steps), 0)


@pytest.mark.parametrize("policy", [ops.RandAugment(num_ops=2, magnitude=12), ops.AutoAugment("imagenet"),
                                    ops.AutoAugment("svhn"), ops.TimmRandAugment("rand-m9-mstd0.5-inc1-p1.0"),
                                    ops.TimmRandAugment("rand-m9-mstd0.5-p1.0-tweights"), ops.AugMix(),
                                    ops.AugMix(severity=10, mixture_width=4, alpha=0.5, fill=(20, 90, 160)),
                                    ops.TimmAugMix("augmix-m5-w4-d2"), ops.TimmAugMix("augmix-m9-mstd0.5-a0.5"),
                                    ops.TimmAutoAugment("original-mstd0.5"), ops.TimmAutoAugment("v0r"),
                                    ops.TimmAutoAugment("3a-mstd0.5"), ops.TimmRandAugment("rand-m9-mstd0.5-p1.0-t3aw")],
                         ids=["randaugment-2", "autoaugment", "autoaugment-svhn", "timm", "timm-tweights", "augmix",
                              "augmix-wide", "timm-augmix", "timm-augmix-mstd", "timm-autoaugment", "timm-autoaugment-v0r",
                              "timm-3a", "timm-t3aw"])
def test_two_rounds_of_a_policy_through_the_chain(policy, stream):
    # Two rounds: a warp's 1-level difference can move a later equalize or solarize step, so
    # single values may differ more; nearly all agree within a level.
    pipeline = Pipeline([Decode(), ops.RandomResizedCrop(48), policy])
    rng = np.random.default_rng(15)
    arrays = [_image(rng, 48, 48, 3) for _ in range(64)]
    indices = np.arange(64)
    post = PostOps(pipeline, stream, seed=5)
    x = torch.from_numpy(np.stack(arrays)).cuda()
    torch.cuda.synchronize()
    out = post.apply(x, indices, 2, inplace=True)
    stream.synchronize()
    assert out.shape == x.shape
    us = pipeline.post_uniforms(5, 2, indices)
    ref = np.stack([_cpu_post.apply(torch.from_numpy(a), pipeline.post_ops, [u[i : i + 1] for u in us]).numpy()
                    for i, a in enumerate(arrays)])
    d = np.abs(out.cpu().numpy().astype(int) - ref.astype(int))
    print(f"{policy!r}: max {d.max()} levels, {(d > 1).mean():.2e} of values beyond 1")
    assert (d > 1).mean() < 1e-3
    assert not np.array_equal(ref, np.stack(arrays))


@pytest.mark.parametrize("channels", [3, 1])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_a_mix_of_exact_passes_is_the_cpus_to_the_byte(as_tensor, channels, stream):
    # AugMix's mix of chains made of tone curves (exact on both paths): the mix kernel's arithmetic
    # is the CPU path's (a multiply, then an add, each rounded; truncated at the end), so the same
    # bytes. Two chains a sample: posterize; solarize then equalize.
    from headrace.ops._passes import MIX, PassWarp, codes, round_passes

    rng = np.random.default_rng(30 + channels)
    arrays = [_image(rng, 40, 40, channels) for _ in range(24)] if as_tensor else _images(rng, 40, channels)
    n = len(arrays)
    h, w = np.array([a.shape[0] for a in arrays]), np.array([a.shape[1] for a in arrays])
    rows_h, rows_w = np.repeat(h, 2), np.repeat(w, 2)
    chain_steps = []
    for names, value in ((["Posterize", "Solarize"], [3.0, 100.0]), (["Identity", "Equalize"], [0.0, 0.0])):
        chain_steps += round_passes(codes(names * n), np.tile(value, n), rows_h, rows_w, channels, PassWarp())
    steps = [(MIX, (rng.dirichlet([0.7, 0.7, 0.7], n), chain_steps))]
    pipeline = Pipeline([Decode("gray" if channels == 1 else "rgb"), ops.AugMix()])
    got, images = _gpu(pipeline, stream, arrays, steps, as_tensor=as_tensor, inplace=True)
    _compare(f"mix C={channels} tensor={as_tensor}", got, _cpu(pipeline, arrays, steps), 0)
    assert all(np.array_equal(i.cpu().numpy(), a) for i, a in zip(images, arrays))  # the originals were kept


@pytest.mark.parametrize("channels", [3, 1])
def test_augmix_on_images_of_their_own_sizes_is_near_the_cpu(channels, stream):
    # Whole chains (warps, then tone curves whose thresholds a warp's 1-level difference can cross):
    # nearly all values within a level of the CPU path's.
    op = ops.AugMix(severity=8, fill=(20, 90, 160)[:channels])
    pipeline = Pipeline([Decode("gray" if channels == 1 else "rgb"), op])
    rng = np.random.default_rng(40 + channels)
    arrays = _images(rng, 40, channels)
    steps = _tables(pipeline, arrays)
    got, _ = _gpu(pipeline, stream, arrays, steps)
    ref = _cpu(pipeline, arrays, steps)
    d = np.concatenate([np.abs(g.astype(int) - r.astype(int)).reshape(-1) for g, r in zip(got, ref)])
    print(f"AugMix own sizes C={channels}: max {d.max()} levels, {(d > 1).mean():.2e} of values beyond 1")
    assert all(g.shape == r.shape and g.dtype == np.uint8 for g, r in zip(got, ref))
    assert (d > 1).mean() < 1e-3


async def _gpu_twice_and_cpu(folder, pipeline, name: str) -> torch.Tensor:
    """The loader's images on the GPU path twice (the same seed, the same bytes) and on the CPU
    path: returns their absolute difference, GPU against CPU, in levels."""
    runs = {}
    for device in ("cuda", "cuda", "cpu"):
        async with Loader(readers.files(folder), batch_size=16, pipeline=pipeline, device=device, seed=4) as loader:
            runs.setdefault(device, []).append(torch.cat([b["image"].cpu() async for b in loader]))
    first, second = runs["cuda"]
    assert first.shape == (48, 64, 64, 3) and first.dtype == torch.uint8
    assert torch.equal(first, second)
    diff = (first.float() - runs["cpu"][0].float()).abs()
    print(f"{name} GPU vs CPU: mean {diff.mean():.3f} levels, {(diff > 2).float().mean():.2e} beyond 2")
    return diff


@pytest.mark.parametrize("policy", [ops.AugMix(), ops.TimmAugMix("augmix-m5-w4-d2")], ids=["torchvision", "timm"])
async def test_augmix_through_the_gpu_loader_is_repeatable_and_near_the_cpu(folder, policy):
    pipeline = Pipeline([Decode(), ops.RandomResizedCrop(64), policy], layout="HWC")
    assert (await _gpu_twice_and_cpu(folder, pipeline, type(policy).__name__)).mean() < 1.0


async def test_randaugment_through_the_gpu_loader_is_repeatable_and_near_the_cpu(folder):
    # PNG: both paths decode the same pixels; the geometry before RandAugment differs by up to 2
    # levels (test_gpu_pipeline.py), which a later tone curve can move further: compare means.
    pipeline = Pipeline([Decode(), ops.RandomResizedCrop(64), ops.RandAugment(), ops.TrivialAugmentWide(), ops.AutoAugment(),
                         ops.TimmRandAugment()], layout="HWC")
    assert (await _gpu_twice_and_cpu(folder, pipeline, "RandAugment + TrivialAugmentWide")).mean() < 1.0


async def test_random_affine_through_the_gpu_loader_is_repeatable_and_near_the_cpu(folder):
    # A warp alone after the crop: the crops differ by up to 2 levels between the paths, which
    # the warp's bilinear weights carry over; compare means, as above.
    pipeline = Pipeline([Decode(), ops.RandomResizedCrop(64), ops.RandomAffine(25, translate=(0.1, 0.1), scale=(0.8, 1.2),
                                                                           shear=8, fill=(124, 116, 104))], layout="HWC")
    assert (await _gpu_twice_and_cpu(folder, pipeline, "RandomAffine")).mean() < 1.0


@pytest.mark.parametrize("inplace", [False, True])
def test_a_batch_tensor_whose_passes_skip_some_samples(inplace, stream):
    # Each pass launches over the samples it changes: after these, the samples sit in the input
    # and in either buffer, and the batch is gathered into one tensor at the end.
    pipeline = Pipeline([Decode(), ops.CenterCrop(40), ops.RandomSolarize(90, p=0.5), GaussianBlur(5, p=0.5),
                         ops.RandomGrayscale(0.3), Rotate(15, fill=7)])
    rng = np.random.default_rng(16)
    arrays = [_image(rng, 40, 40, 3) for _ in range(32)]
    arrays[5] = np.full((40, 40, 3), 3, np.uint8)
    x = torch.from_numpy(np.stack(arrays)).cuda()
    torch.cuda.synchronize()
    steps = _tables(pipeline, arrays)
    # No rotation for the first eight samples: some of them are left alone by every pass.
    steps[-1][1][0][:8] = np.eye(2, 3)
    post = PostOps(pipeline, stream, seed=5)
    out = post.apply_tables(x, steps, inplace=inplace)
    stream.synchronize()
    assert isinstance(out, torch.Tensor) and out.shape == x.shape and out.is_contiguous()
    if not inplace:
        assert np.array_equal(x.cpu().numpy(), np.stack(arrays))  # the input is left as it was
    _compare(f"skipping passes inplace={inplace}", list(out.cpu().numpy()), _cpu(pipeline, arrays, steps), 3)


def _policy_batch(seed, n=48, size=48):
    pipeline = Pipeline([Decode(), ops.RandomResizedCrop(size), ops.RandAugment(num_ops=3), GaussianBlur(5, p=0.5),
                         Normalize(dtype="float16")])
    rng = np.random.default_rng(seed)
    return pipeline, torch.from_numpy(np.stack([_image(rng, size, size, 3) for _ in range(n)]))


def test_a_plan_issued_through_cupy_gives_the_shims_bytes(stream):
    # The same plan (tables, launches, zeroing) issued by the decode shim in one call, or call by
    # call through CuPy: the same kernels on the same tables, so the same bytes, batch after batch
    # (more batches than the plan's pinned blocks, which are reused).
    from headrace.ops.cuda import _plan

    assert _plan._shim() is not None, "the GPU machine builds the shim: the native path must be the one tested"
    pipeline, x = _policy_batch(17)
    native, python = PostOps(pipeline, stream, seed=5), PostOps(pipeline, stream, seed=5, native=False)
    for epoch in range(6):
        outs = []
        for post in (native, python):
            xd = x.cuda()
            torch.cuda.synchronize()
            ready = torch.cuda.Event()
            outs.append(post.apply(xd, np.arange(48), epoch, inplace=True, finish=True, ready=ready))
            ready.synchronize()
        assert outs[0].dtype == torch.float16 and outs[0].shape == (48, 3, 48, 48)
        assert torch.equal(outs[0], outs[1]), epoch


def test_apply_with_finish_is_apply_then_finish(stream):
    pipeline, x = _policy_batch(18)
    post = PostOps(pipeline, stream, seed=5)
    xd = x.cuda()
    torch.cuda.synchronize()
    together = post.apply(xd, np.arange(48), 1, finish=True)
    apart = post.finish(post.apply(xd, np.arange(48), 1))
    stream.synchronize()
    assert torch.equal(together, apart)
    assert torch.equal(xd.cpu(), x)  # not in place: the input is left as it was
