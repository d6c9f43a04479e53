"""MixUp and CutMix on the CPU path, through a Loader over real JPEGs: the pixels and soft labels
against the same loader without them (the built-in ops draw the same crops), the same mixes for any
thread count and after a resume, both layouts and uint8, soft labels in, and the errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sample_data import jpeg_bytes

from headrace import ConfigError, Loader, TransformError, ops, readers
from headrace.ops._batch_stages import stage_rng

N, B, K, SEED = 40, 8, 5, 11


def _items() -> list[dict]:
    rng = np.random.default_rng(21)
    return [{"__key__": f"s{i:03d}", "jpg": jpeg_bytes(rng, 40 + i % 7, 52 + i % 5), "cls": i % K} for i in range(N)]


def _loader(pipeline: ops.Pipeline, **kw) -> Loader:
    kw.setdefault("num_threads", 2)
    return Loader(readers.sequence(_items(), shuffle=True, seed=5), batch_size=B, pipeline=pipeline, device="cpu",
                  seed=SEED, **kw)


def _pipeline(*stages, **kw) -> ops.Pipeline:
    return ops.Pipeline([ops.Decode(), ops.RandomResizedCrop(24), ops.Flip(), ops.Normalize(dtype=kw.pop("dtype", "float32"),
                                                                                         layout=kw.pop("layout", "CHW")), *stages], **kw)


async def _epochs(pipeline: ops.Pipeline, epochs: int = 2, **kw) -> list[list]:
    async with _loader(pipeline, **kw) as loader:
        return [[batch async for batch in loader] for _ in range(epochs)]


def _draws(position: int, epoch: int, index: int) -> tuple[bool, float, np.ndarray]:
    """What the stage at ``position`` draws for a batch: the same three draws, in its order."""
    rng = stage_rng(SEED, epoch, position, index)
    return rng.random(), float(rng.beta(*_ALPHA)), rng.random(2)


_ALPHA = (0.4, 0.4)


def _one_hot(labels: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    soft = torch.full((len(labels), K), smoothing / K)
    soft[torch.arange(len(labels)), labels] += 1.0 - smoothing
    return soft


async def test_mixup_mixes_each_image_and_label_with_the_row_before_it(leaks):
    mix = ops.MixUp(0.4, num_classes=K, label_smoothing=0.1)
    plain, mixed = await _epochs(_pipeline()), await _epochs(_pipeline(mix))
    position = _pipeline(mix).stage_position(mix)
    for epoch, (ours, theirs) in enumerate(zip(plain, mixed, strict=True)):
        for a, b in zip(ours, theirs, strict=True):
            assert a.sample_keys == b.sample_keys
            u, lam, _ = _draws(position, epoch, a.index)
            assert u < 1.0  # p=1: every batch
            expected = lam * a["image"] + (1 - lam) * a["image"].roll(1, 0)
            torch.testing.assert_close(b["image"], expected, atol=1e-5, rtol=1e-5)
            soft = _one_hot(a["label"], 0.1)
            assert b["label"].dtype == torch.float32 and b["label"].shape == (len(a.sample_keys), K)
            torch.testing.assert_close(b["label"], lam * soft + (1 - lam) * soft.roll(1, 0))
            torch.testing.assert_close(b["label"].sum(1), torch.ones(len(a.sample_keys)))
    await leaks.check()


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
async def test_cutmix_pastes_one_box_of_the_row_before_and_weighs_labels_by_its_area(leaks, layout):
    cut = ops.CutMix(1.0, num_classes=K)
    plain, mixed = await _epochs(_pipeline(layout=layout)), await _epochs(_pipeline(cut, layout=layout))
    position = _pipeline(cut).stage_position(cut)
    boxes = set()
    for epoch, (ours, theirs) in enumerate(zip(plain, mixed, strict=True)):
        for a, b in zip(ours, theirs, strict=True):
            rng = stage_rng(SEED, epoch, position, a.index)
            rng.random()
            lam = float(rng.beta(1.0, 1.0))
            cx, cy = (int(v * 24) for v in rng.random(2))
            half = int(0.5 * math.sqrt(1 - lam) * 24)
            x0, x1, y0, y1 = max(cx - half, 0), min(cx + half, 24), max(cy - half, 0), min(cy + half, 24)
            inside = torch.zeros(24, 24, dtype=torch.bool)
            inside[y0:y1, x0:x1] = True
            inside = inside[None] if layout == "CHW" else inside[:, :, None]
            expected = torch.where(inside, a["image"].roll(1, 0), a["image"])
            assert torch.equal(b["image"], expected)
            kept = 1 - (x1 - x0) * (y1 - y0) / 24**2
            soft = _one_hot(a["label"])
            torch.testing.assert_close(b["label"], kept * soft + (1 - kept) * soft.roll(1, 0))
            boxes.add((x0, x1, y0, y1))
    assert len(boxes) > 5  # a box of its own each batch
    await leaks.check()


async def test_the_mixes_do_not_depend_on_threads_and_resume_exactly(leaks):
    pipe = _pipeline(ops.MixUp(0.2, num_classes=K), ops.CutMix(1.0, num_classes=K, p=0.5))
    one, three = await _epochs(pipe, num_threads=1), await _epochs(pipe, num_threads=3)
    for x, y in zip(one[1], three[1], strict=True):
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["label"], y["label"])
    async with _loader(pipe) as first:
        [batch async for batch in first]
        taken = []
        async for batch in first:
            taken.append(batch)
            if len(taken) == 2:
                break
        state = first.state_dict()
    async with _loader(pipe) as second:
        second.load_state_dict(state)
        rest = [batch async for batch in second]
    assert len(taken + rest) == len(one[1])
    for x, y in zip(taken + rest, one[1], strict=True):
        assert x.sample_keys == y.sample_keys
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["label"], y["label"])
    # A mixed label has two classes of its own (MixUp then a CutMix on its soft labels): sums stay 1.
    labels = torch.cat([b["label"] for b in one[0]])
    torch.testing.assert_close(labels.sum(1), torch.ones(N))
    assert ((labels > 0).sum(1) >= 2).float().mean() > 0.5
    await leaks.check()


async def test_p_zero_leaves_the_images_and_gives_one_hot_labels():
    plain, kept = await _epochs(_pipeline(), 1), await _epochs(_pipeline(ops.CutMix(num_classes=K, p=0.0)), 1)
    for a, b in zip(plain[0], kept[0], strict=True):
        assert torch.equal(a["image"], b["image"])
        assert torch.equal(b["label"], _one_hot(a["label"]))


async def test_uint8_images_mix_in_float_and_round():
    pipe = ops.Pipeline([ops.Decode(), ops.Resize((20, 20))])
    plain = (await _epochs(pipe, 1))[0]
    mix = ops.MixUp(0.4, num_classes=K)
    mixed = (await _epochs(ops.Pipeline([*pipe.ops, mix]), 1))[0]
    position = ops.Pipeline([*pipe.ops, mix]).stage_position(mix)
    for a, b in zip(plain, mixed, strict=True):
        _, lam, _ = _draws(position, 0, a.index)
        x = a["image"].float()
        assert b["image"].dtype == torch.uint8
        assert torch.equal(b["image"], (lam * x + (1 - lam) * x.roll(1, 0)).round().to(torch.uint8))


async def test_a_label_out_of_range_fails_the_batch_naming_the_stage(leaks):
    items = _items()
    items[3]["cls"] = K + 2
    pipe = _pipeline(ops.CutMix(num_classes=K))

    def loader(**kw):
        return Loader(readers.sequence(items), batch_size=B, pipeline=pipe, device="cpu", **kw)

    with pytest.raises(TransformError) as info:
        async with loader() as first:
            [batch async for batch in first]
    assert info.value.stage == "stage CutMix"
    assert f"label {K + 2} of sample 's003' (row " in str(info.value) and f"is not in [0, num_classes={K})" in str(info.value)
    async with loader(on_error="skip", max_errors=0.5) as second:
        got = [batch async for batch in second]
    assert sum(len(b.sample_keys) for b in got) == N - B  # the batch with the bad label, all of it
    await leaks.check()


@pytest.mark.parametrize(("pipeline", "message"), [
    (ops.Pipeline([ops.Decode(), ops.Resize(20), ops.MixUp(num_classes=K)]), "one .* tensor, got list"),
    (ops.Pipeline([ops.Decode(), ops.Resize((20, 20)), ops.MixUp(num_classes=K)], label=None), "needs the batch's labels"),
    (ops.Pipeline([ops.Decode(), ops.Resize((20, 20)), ops.MixUp(num_classes=K), ops.CutMix(num_classes=K + 1)]),
     "soft labels have 5 classes, not num_classes=6"),
])
async def test_what_a_mix_cannot_take_is_an_error_naming_it(pipeline, message):
    with pytest.raises(TransformError, match=message):
        await _epochs(pipeline, 1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"alpha": 0.0}, "alpha must be positive"),
    ({"alpha": float("nan")}, "alpha must be a finite number"),
    ({"num_classes": 0}, "num_classes must be"),
    ({"num_classes": 2.0}, "num_classes must be"),
    ({"p": 1.5}, r"p must be in \[0, 1\]"),
    ({"label_smoothing": 1.0}, r"label_smoothing must be in \[0, 1\)"),
])
@pytest.mark.parametrize("kind", [ops.MixUp, ops.CutMix])
def test_arguments_are_checked_when_made(kind, kwargs, message):
    args = {"num_classes": K, **kwargs}
    with pytest.raises(ConfigError, match=message):
        kind(**args)


def test_a_mix_reads_as_its_arguments():
    assert repr(ops.CutMix(num_classes=10, p=0.5)) == "CutMix(alpha=1, num_classes=10, p=0.5, label_smoothing=0)"
    assert ops.MixUp(0.2, num_classes=3).name == "MixUp"


# -- RandomErasing -------------------------------------------------------------------------------


def _torchvision_box(u: np.ndarray, h: int, w: int, scale=(0.02, 0.33), ratio=(0.3, 3.3)) -> tuple[int, int, int, int] | None:
    """torchvision's ``RandomErasing.get_params`` loop written out, on our uniforms (10 tries of 4)."""
    for area_u, ratio_u, top_u, left_u in u:
        area = h * w * (scale[0] + (scale[1] - scale[0]) * area_u)
        aspect = math.exp(math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0])) * ratio_u)
        bh, bw = int(round(math.sqrt(area * aspect))), int(round(math.sqrt(area / aspect)))
        if bh < h and bw < w:
            top, left = int(top_u * (h - bh + 1)), int(left_u * (w - bw + 1))
            return top, left, top + bh, left + bw
    return None


@pytest.mark.parametrize("layout", ["CHW", "HWC"])
async def test_random_erasing_fills_torchvisions_box_of_each_chosen_image(leaks, layout):
    erase = ops.RandomErasing(p=0.5, value=(0.5, -1.0, 2.0))
    plain, erased = await _epochs(_pipeline(layout=layout)), await _epochs(_pipeline(erase, layout=layout))
    position = _pipeline(erase).stage_position(erase)
    counts = [0, 0]
    for epoch, (ours, theirs) in enumerate(zip(plain, erased, strict=True)):
        for a, b in zip(ours, theirs, strict=True):
            rng = stage_rng(SEED, epoch, position, a.index)
            n = len(a.sample_keys)
            chosen = rng.random(n) < 0.5
            tries = rng.random((n, 10, 4))
            expected = a["image"].clone()
            for row in range(n):
                box = _torchvision_box(tries[row], 24, 24) if chosen[row] else None
                counts[box is not None] += 1
                if box is not None:
                    y0, x0, y1, x1 = box
                    fill = torch.tensor([0.5, -1.0, 2.0])
                    if layout == "CHW":
                        expected[row, :, y0:y1, x0:x1] = fill.view(3, 1, 1)
                    else:
                        expected[row, y0:y1, x0:x1, :] = fill
            assert torch.equal(b["image"], expected)
            assert torch.equal(b["label"], a["label"])  # labels untouched
    assert counts[0] > 10 and counts[1] > 10  # some erased, some not
    await leaks.check()


async def test_random_erasing_random_values_repeat_with_the_seed_and_after_a_resume():
    pipe = _pipeline(ops.RandomErasing(p=1.0, value="random"))
    one, two = await _epochs(pipe, num_threads=1), await _epochs(pipe, num_threads=3)
    plain = await _epochs(_pipeline())
    for x, y, z in zip(one[1], two[1], plain[1], strict=True):
        assert torch.equal(x["image"], y["image"])
        changed = (x["image"] != z["image"]).any(dim=1)  # [B, H, W]: one box of noise a row
        assert changed.flatten(1).any(1).all()
    async with _loader(pipe) as first:
        [batch async for batch in first]
        taken = [await anext(aiter(first))]
        state = first.state_dict()
    async with _loader(pipe) as second:
        second.load_state_dict(state)
        rest = [batch async for batch in second]
    for x, y in zip(taken + rest, one[1], strict=True):
        assert torch.equal(x["image"], y["image"])


async def test_random_erasing_on_uint8_rounds_its_level_and_refuses_a_list():
    pipe = ops.Pipeline([ops.Decode(), ops.Resize((20, 20)), ops.RandomErasing(p=1.0, value=(300, 7.6, -2))])
    batches = (await _epochs(pipe, 1))[0]
    levels = {tuple(px.tolist()) for b in batches for px in b["image"].permute(0, 2, 3, 1).reshape(-1, 3)}
    assert (255, 8, 0) in levels
    with pytest.raises(TransformError, match="one .* tensor, got list"):
        await _epochs(ops.Pipeline([ops.Decode(), ops.Resize(20), ops.RandomErasing()]), 1)
    with pytest.raises(TransformError, match="value has 2 levels for images of 3 channels"):
        await _epochs(ops.Pipeline([ops.Decode(), ops.Resize((20, 20)), ops.RandomErasing(p=1.0, value=(1, 2))]), 1)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"p": -0.1}, r"p must be in \[0, 1\]"),
    ({"scale": (0.5, 0.1)}, "scale must be a pair 0 <= lo <= hi <= 1"),
    ({"scale": 0.3}, "scale must be a pair of numbers"),
    ({"ratio": (0.0, 1.0)}, "ratio must be a pair 0 < lo <= hi"),
    ({"value": "noise"}, "value must be a number, one per channel, or 'random'"),
    ({"value": ()}, "value must be a number"),
    ({"value": float("inf")}, "value must be a finite number"),
])
def test_random_erasing_checks_its_arguments(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        ops.RandomErasing(**kwargs)
    assert repr(ops.RandomErasing()) == "RandomErasing(p=0.5, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0)"
