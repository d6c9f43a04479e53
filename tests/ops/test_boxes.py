"""Pipeline(boxes=): boxes move with the pixels. Real images (white rectangles on black, PNG and
JPEG) through the CPU path; each output box is checked against where the rectangle's pixels are."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image
from sample_data import white_rectangles

import headrace
from headrace import ConfigError, LoaderError, TransformError, ops, readers

SIZES = [(120, 90), (64, 200), (150, 150), (81, 47), (200, 130), (96, 96), (140, 60), (70, 180)]


def _rectangles(tmp_path, sizes=SIZES, fmt="png", **reader_options):
    """One image per size, black with one white rectangle; the reader's samples carry its box."""
    paths, extra = white_rectangles(tmp_path, sizes, fmt)
    return readers.FileReader(paths, None, extra=extra, **reader_options)


def _batches(reader, pipe_ops, batch_size=3, seed=5, **kwargs):
    pipe = ops.Pipeline(pipe_ops, label=None, boxes="boxes", per_box=("labels",), layout="HWC", **kwargs)
    with headrace.Loader(reader, batch_size=batch_size, pipeline=pipe, device="cpu", seed=seed).sync() as epochs:
        return list(epochs)


def _white(image: torch.Tensor) -> np.ndarray | None:
    """(x0, y0, x1, y1) around the pixels over half white, or None when there are none."""
    ys, xs = np.nonzero(image[..., 0].numpy() > 127)
    return None if len(xs) == 0 else np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float64)


PIPELINES = {
    "crop, flips": [ops.RandomResizedCrop(64, scale=(0.2, 1.0)), ops.Flip(0.5), ops.Flip(0.5, vertical=True)],
    "resize, centre crop": [ops.Resize(72), ops.CenterCrop(64)],
    "resize only": [ops.Resize(50)],  # outputs of different sizes: a list of images
    "fixed size": [ops.Resize((40, 90)), ops.Flip(1.0)],
    "crop past the edge": [ops.CenterCrop(160)],
    "scale, random crop": [ops.RandomResize(60, 120), ops.RandomCrop(64), ops.Flip(0.5)],
    "letterbox": [ops.Resize(None, max_size=90), ops.CenterCrop(90), ops.Flip(0.5)],
    "longer side capped": [ops.Resize(60, max_size=80)],  # zero padding around the image: boxes stay on real pixels
    "crop, resize": [ops.CenterCrop(60), ops.Resize(120)],
}


@pytest.mark.parametrize("fmt", ["png", "jpg"])
@pytest.mark.parametrize("name", PIPELINES)
def test_boxes_follow_the_pixels(tmp_path, name, fmt):
    batches = _batches(_rectangles(tmp_path, fmt=fmt), PIPELINES[name])
    seen = 0
    for batch in batches:
        assert isinstance(batch["boxes"], list) and isinstance(batch["labels"], list)
        for image, boxes, labels in zip(batch["image"], batch["boxes"], batch["labels"]):
            assert boxes.dtype == torch.float32 and labels.dtype == torch.int64 and len(boxes) == len(labels)
            white = _white(image)
            if white is None:  # the crop missed the rectangle: so did its box
                assert boxes.shape == (0, 4)
                continue
            assert boxes.shape == (1, 4)
            # Within a pixel: the mask is thresholded, the box is exact.
            np.testing.assert_allclose(boxes[0].numpy(), white, atol=1.0)
            seen += 1
    assert seen >= len(SIZES) // 2


def test_a_box_cut_away_is_dropped_with_its_labels(tmp_path):
    pixels = np.zeros((100, 100, 3), np.uint8)
    pixels[0:20, 0:20] = pixels[40:60, 40:60] = 255
    Image.fromarray(pixels).save(tmp_path / "two.png")
    reader = readers.FileReader([str(tmp_path / "two.png")], None, extra=[
        {"boxes": np.array([[0, 0, 20, 20], [40, 40, 60, 60], [30, 70, 90, 95]], np.float32),
         "labels": np.array([1, 2, 3]), "kind": np.array([[1.0], [2.0], [3.0]])}])
    pipe = ops.Pipeline([ops.CenterCrop(30)], label=None, boxes="boxes", per_box=("labels", "kind"))
    (batch,) = headrace.Loader(reader, batch_size=1, pipeline=pipe, device="cpu").sync()
    # The window is 35..65: the first and third boxes are outside it, the second is clipped to it.
    np.testing.assert_array_equal(batch["boxes"][0].numpy(), [[5, 5, 25, 25]])
    assert batch["labels"][0].tolist() == [2] and batch["kind"][0].tolist() == [[2.0]]


def test_a_box_past_the_image_is_clipped_to_its_real_pixels(tmp_path):
    Image.fromarray(np.full((100, 100, 3), 255, np.uint8)).save(tmp_path / "white.png")
    reader = readers.FileReader([str(tmp_path / "white.png")], None,
                                extra=[{"boxes": np.array([[-10, -10, 30, 30]], np.float32)}])
    pipe = ops.Pipeline([ops.CenterCrop(160)], label=None, boxes="boxes", layout="HWC")
    (batch,) = headrace.Loader(reader, batch_size=1, pipeline=pipe, device="cpu").sync()
    # The image sits at 30..130 of the output, zero padding around it: the box stops where it starts.
    np.testing.assert_array_equal(batch["boxes"][0].numpy(), [[30, 30, 60, 60]])
    np.testing.assert_array_equal(_white(batch["image"][0]), [30, 30, 130, 130])


def test_boxes_depend_on_the_seed_not_on_the_batch_size(tmp_path):
    reader = _rectangles(tmp_path)
    crop = [ops.RandomResizedCrop(48), ops.Flip(0.5)]

    def by_key(batches):
        return {key: b.numpy().tolist() for batch in batches for key, b in zip(batch.sample_keys, batch["boxes"])}

    assert by_key(_batches(reader, crop, batch_size=3)) == by_key(_batches(reader, crop, batch_size=8))
    assert by_key(_batches(reader, crop, seed=5)) != by_key(_batches(reader, crop, seed=6))


def test_boxes_of_an_upright_image_follow_its_exif_rotation(tmp_path):
    upright = np.zeros((60, 100, 3), np.uint8)
    upright[10:30, 55:95] = 255
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned a quarter left: shown turned back, 60 x 100
    Image.fromarray(upright).transpose(Image.Transpose.ROTATE_90).save(tmp_path / "turned.jpg", quality=95, exif=exif)
    reader = readers.FileReader([str(tmp_path / "turned.jpg")], None,
                                extra=[{"boxes": np.array([[55, 10, 95, 30]], np.float32), "labels": np.array([0])}])
    (batch,) = _batches(reader, [ops.Resize((30, 50)), ops.Flip(1.0)], batch_size=1)
    assert tuple(batch["image"].shape) == (1, 30, 50, 3)
    np.testing.assert_allclose(batch["boxes"][0].numpy(), [[2.5, 5, 22.5, 15]])
    np.testing.assert_allclose(batch["boxes"][0].numpy()[0], _white(batch["image"][0]), atol=1.0)


def test_a_boxes_field_may_be_an_npy_file(tmp_path):
    Image.fromarray(np.zeros((40, 40, 3), np.uint8)).save(tmp_path / "a.png")
    buffer = io.BytesIO()
    np.save(buffer, np.array([[4, 8, 20, 24]], np.float64))
    reader = readers.FileReader([str(tmp_path / "a.png")], None, extra=[{"boxes.npy": buffer.getvalue()}])
    pipe = ops.Pipeline([ops.Resize(20)], label=None, boxes="boxes.npy")
    (batch,) = headrace.Loader(reader, batch_size=1, pipeline=pipe, device="cpu").sync()
    np.testing.assert_array_equal(batch["boxes.npy"][0].numpy(), [[2, 4, 10, 12]])


BAD = {
    "no boxes": ({"labels": np.array([1])}, "sample has no 'boxes' field"),
    "not [N, 4]": ({"boxes": np.zeros((2, 3)), "labels": np.array([1, 2])}, r"shape \[2, 3\], not \[N, 4\]"),
    "not numbers": ({"boxes": "a box", "labels": np.array([1])}, "not an array of numbers"),
    "not finite": ({"boxes": np.array([[0, 0, np.inf, 4]]), "labels": np.array([1])}, "not finite"),
    "labels short": ({"boxes": np.zeros((2, 4)), "labels": np.array([1])}, "has 1 rows for 2 boxes"),
    "labels text": ({"boxes": np.zeros((1, 4)), "labels": np.array(["cat"])}, "not an array of numbers"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_boxes_fail_their_sample_named(tmp_path, case, leaks):
    for name in ("good", "bad"):
        Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / f"{name}.png")
    fields, message = BAD[case]
    good = {"boxes": np.array([[1, 1, 9, 9]], np.float32), "labels": np.array([7])}
    reader = readers.FileReader([str(tmp_path / "good.png"), str(tmp_path / "bad.png")], None, extra=[good, fields])
    pipe = ops.Pipeline([ops.Resize(16)], label=None, boxes="boxes", per_box=("labels",))
    with pytest.raises(TransformError, match=message) as info:
        list(headrace.Loader(reader, batch_size=2, pipeline=pipe, device="cpu").sync())
    assert isinstance(info.value, LoaderError) and info.value.key == str(tmp_path / "bad")
    assert info.value.source == str(tmp_path / "bad.png")
    # Under a skip policy the other sample goes on, its box with it, and the bad one is counted.
    loader = headrace.Loader(reader, batch_size=2, pipeline=pipe, device="cpu", on_error="skip")
    (batch,) = loader.sync()
    assert batch.sample_keys == [str(tmp_path / "good")] and batch["boxes"][0].tolist() == [[0.5, 0.5, 4.5, 4.5]]
    assert loader.stats().dropped == 1 and loader.stats().errors == {"TransformError": 1}


@pytest.mark.parametrize("pipe_ops", [[ops.Resize(16)], [ops.RandomIoUCrop(), ops.Resize((16, 16))]],
                         ids=["resize", "iou crop"])
def test_bad_boxes_among_good_ones_fail_alone(tmp_path, pipe_ops, leaks):
    # A batch's boxes are read in one thread, a sample after another: each failure is its sample's
    # alone, and the samples after it are read on.
    names = ["bad0", "good1", "bad2", "good3", "good4"]
    for name in names:
        Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / f"{name}.png")
    good = {"boxes": np.array([[8, 8, 24, 24]], np.float32), "labels": np.array([7])}
    bad = {"boxes": np.zeros((1, 3)), "labels": np.array([7])}
    extra = [bad if name.startswith("bad") else good for name in names]
    reader = readers.FileReader([str(tmp_path / f"{name}.png") for name in names], None, extra=extra)
    pipe = ops.Pipeline(pipe_ops, label=None, boxes="boxes", per_box=("labels",))
    loader = headrace.Loader(reader, batch_size=5, pipeline=pipe, device="cpu", on_error="skip")
    (batch,) = loader.sync()
    assert batch.sample_keys == [str(tmp_path / name) for name in ("good1", "good3", "good4")]
    assert [labels.tolist() for labels in batch["labels"]] == [[7], [7], [7]]
    assert [boxes.shape for boxes in batch["boxes"]] == [(1, 4)] * 3
    assert loader.stats().dropped == 2 and loader.stats().errors == {"TransformError": 2}


def test_read_only_fields_batch_without_a_warning(tmp_path, recwarn):
    # COCO's reader shares its arrays, read-only, between epochs: the batch copies them, and torch
    # has nothing to warn the user about.
    paths, extra = white_rectangles(tmp_path, SIZES[:4], "png")
    for fields in extra:
        fields["ids"] = fields["labels"].copy()
        for value in fields.values():
            value.flags.writeable = False
    reader = readers.FileReader(paths, None, extra=extra)
    pipe = ops.Pipeline([ops.Resize((40, 40))], label=None, boxes="boxes", per_box=("labels",), fields=("ids",))
    batches = list(headrace.Loader(reader, batch_size=4, pipeline=pipe, device="cpu").sync())
    assert [str(w.message) for w in recwarn] == []
    assert [batch["ids"].tolist() for batch in batches] == [[[0], [1], [2], [3]]]
    assert [labels.tolist() for labels in batches[0]["labels"]] == [[0], [1], [2], [3]]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ops": [ops.Flip(), ops.RandomResizedCrop(32)], "boxes": "boxes"}, "boxes and masks follow Flip only after"),
    ({"ops": [ops.Resize(32), ops.Rotate(10)], "boxes": "boxes"}, "cannot follow Rotate"),
    ({"ops": [ops.WarpAffine([[1, 0, 2], [0, 1, 0]])], "boxes": "boxes"}, "cannot follow WarpAffine"),
    ({"per_box": ("labels",)}, "name the boxes too"),
    ({"boxes": "boxes", "per_box": "labels"}, "per_box must be a sequence"),
    ({"boxes": "boxes", "fields": ("boxes",)}, "named as boxes, per_box or mask and elsewhere"),
    ({"boxes": "boxes", "per_box": ("boxes",)}, "name a field twice"),
    ({"boxes": "boxes", "mask": "boxes"}, "name a field twice"),
    ({"mask": "mask", "mask_fill": -1}, "mask_fill must be an int"),
    ({"mask": ""}, "mask must be a field name"),
    ({"boxes": "label"}, "named as boxes, per_box or mask and elsewhere"),
    ({"boxes": 3}, "boxes must be a field name"),
    ({"image": None, "boxes": "boxes"}, "image=None has none"),
])
def test_wrong_box_arguments_are_config_errors(kwargs, message):
    kwargs = dict(kwargs)
    with pytest.raises(ConfigError, match=message):
        ops.Pipeline(kwargs.pop("ops", []), **kwargs)


def test_colour_and_blur_ops_leave_boxes_alone(tmp_path):
    reader = _rectangles(tmp_path, sizes=SIZES[:2])
    plain = _batches(reader, [ops.Resize(40)])
    coloured = _batches(reader, [ops.Resize(40), ops.ColorTwist(brightness=0.3), ops.GaussianBlur(3)])
    for a, b in zip(plain, coloured):
        for x, y in zip(a["boxes"], b["boxes"]):
            assert torch.equal(x, y)


@pytest.mark.parametrize("pipe_ops", [
    [ops.Resize(None, max_size=90), ops.CenterCrop(90)],  # a letterbox
    [ops.Resize((40, 70)), ops.Flip(1.0, vertical=True)],
    [ops.Resize(50, max_size=60), ops.Flip(1.0)],
], ids=["letterbox", "exact size, flipped", "capped, mirrored"])
def test_source_boxes_map_output_boxes_back(tmp_path, pipe_ops):
    """Boxes through the pipeline, then back with source_boxes: where they started."""
    reader = _rectangles(tmp_path)
    by_key = {}
    for batch in _batches(reader, pipe_ops):
        by_key.update(zip(batch.sample_keys, batch["boxes"]))
    pipe = ops.Pipeline(pipe_ops, label=None)
    for i, (h, w) in enumerate(SIZES):
        key = str(tmp_path / str(i))
        back = ops.source_boxes(pipe, by_key[key], (h, w))
        np.testing.assert_allclose(back.numpy(), reader._extra[i]["boxes"], atol=1e-3)


def test_source_boxes_needs_a_pipeline_without_random_geometry():
    with pytest.raises(ConfigError, match="draws its geometry per sample"):
        ops.source_boxes(ops.Pipeline([ops.RandomResizedCrop(32)]), [[0, 0, 1, 1]], (10, 10))
    with pytest.raises(ConfigError, match="Flip"):
        ops.source_boxes(ops.Pipeline([ops.Resize(32), ops.Flip(0.5)]), [[0, 0, 1, 1]], (10, 10))
    with pytest.raises(ConfigError, match="RandomIoUCrop"):  # its window is drawn on the boxes
        ops.source_boxes(ops.Pipeline([ops.RandomIoUCrop(), ops.Resize((30, 30))], label=None, boxes="boxes"),
                         [[0, 0, 1, 1]], (10, 10))
    with pytest.raises(ConfigError, match=r"\[N, 4\]"):
        ops.source_boxes(ops.Pipeline([ops.Resize(32)]), [0, 0, 1, 1], (10, 10))
    clipped = ops.source_boxes(ops.Pipeline([ops.CenterCrop(20)]), torch.tensor([[0.0, 0.0, 20.0, 20.0]]), (10, 10))
    assert clipped.tolist() == [[0.0, 0.0, 10.0, 10.0]]  # the padding is not the image


def test_a_replaced_row_carries_its_substitutes_boxes(tmp_path):
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(tmp_path / "good.png")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not a png")
    extra = [{"boxes": np.array([[2, 2, 10, 10]], np.float32), "labels": np.array([5])},
             {"boxes": np.array([[0, 0, 4, 4], [4, 4, 8, 8]], np.float32), "labels": np.array([6, 7])}]
    reader = readers.FileReader([str(tmp_path / "good.png"), str(tmp_path / "bad.png")], None, extra=extra)
    pipe = ops.Pipeline([ops.Resize(16)], label=None, boxes="boxes", per_box=("labels",), mask=None)
    (batch,) = headrace.Loader(reader, batch_size=2, pipeline=pipe, device="cpu", on_error="replace").sync()
    assert batch.replaced == 1 and batch.sample_keys == [str(tmp_path / "good")] * 2
    assert [b.tolist() for b in batch["boxes"]] == [[[1, 1, 5, 5]]] * 2
    assert [lab.tolist() for lab in batch["labels"]] == [[5], [5]]


def test_a_resumed_epoch_gives_the_same_boxes(tmp_path):
    reader = _rectangles(tmp_path, shuffle=True)
    pipe = ops.Pipeline([ops.RandomResizedCrop(48), ops.Flip()], label=None, boxes="boxes", per_box=("labels",))

    def loader():
        return headrace.Loader(reader, batch_size=2, pipeline=pipe, device="cpu", seed=11)

    with loader().sync() as epochs:
        whole = [(b.sample_keys, [x.tolist() for x in b["boxes"]]) for b in epochs]
    first = loader()
    with first.sync() as epochs:
        for batch in epochs:
            if batch.index == 1:
                break
        state = first.state_dict()
    second = loader()
    second.load_state_dict(state)
    with second.sync() as epochs:
        rest = [(b.sample_keys, [x.tolist() for x in b["boxes"]]) for b in epochs]
    assert rest == whole[2:]


# --- RandomIoUCrop ----------------------------------------------------------------------------------


def _iou(box, window):
    x0, y0, x1, y1 = box
    top, left, h, w = window
    iw = max(0.0, min(x1, left + w) - max(x0, left))
    ih = max(0.0, min(y1, top + h) - max(y0, top))
    inter = iw * ih
    return inter / ((x1 - x0) * (y1 - y0) + w * h - inter)


def test_an_iou_window_holds_a_box_centre_and_overlaps_it_enough():
    from headrace.ops._iou_crop import choose_window

    rng = np.random.default_rng(4)
    op = ops.RandomIoUCrop(sampler_options=(0.5,), trials=50)  # no "as it is": every window must pass
    taken = 0
    for index in range(60):
        h, w = int(rng.integers(60, 300)), int(rng.integers(60, 300))
        x0, y0 = rng.uniform(0, w - 20, 3), rng.uniform(0, h - 20, 3)
        boxes = np.stack([x0, y0, np.minimum(x0 + rng.uniform(10, 120, 3), w), np.minimum(y0 + rng.uniform(10, 120, 3), h)], 1)
        window, inside = choose_window(op, h, w, boxes, 7, 0, 1, index)
        top, left, wh, ww = window
        assert 0 <= top and 0 <= left and top + wh <= h and left + ww <= w
        again = choose_window(op, h, w, boxes, 7, 0, 1, index)  # the sample's own: the same every time
        assert again[0] == window and again[1].tolist() == inside.tolist()
        if window == (0, 0, h, w) and inside.all():
            continue  # none passed within the draws: the image as it is
        taken += 1
        cx, cy = (boxes[:, 0] + boxes[:, 2]) / 2, (boxes[:, 1] + boxes[:, 3]) / 2
        assert inside.tolist() == ((left < cx) & (cx < left + ww) & (top < cy) & (cy < top + wh)).tolist()
        assert max(_iou(b, window) for b in boxes[inside]) >= 0.5
        assert 0.5 <= ww / wh <= 2.0 and 0.3 * w - 1 <= ww <= w and 0.3 * h - 1 <= wh <= h
    assert taken > 40


def test_a_sample_s_iou_window_does_not_depend_on_its_batch():
    from headrace.ops._iou_crop import choose_window, choose_windows

    rng = np.random.default_rng(9)
    op = ops.RandomIoUCrop()
    heights, widths = rng.integers(40, 400, 30), rng.integers(40, 400, 30)
    boxes = []
    for h, w in zip(heights, widths):  # 0 to 7 boxes: a batch pads them to its most
        k = int(rng.integers(0, 8))
        x0, y0 = rng.uniform(0, w * 0.7, k), rng.uniform(0, h * 0.7, k)
        boxes.append(np.stack([x0, y0, x0 + rng.uniform(0.05, 0.3, k) * w, y0 + rng.uniform(0.05, 0.3, k) * h], 1))
    indices = rng.permutation(1000)[:30]
    together = choose_windows(op, heights, widths, boxes, 3, 1, 1, indices)
    for i, (window, inside) in enumerate(together):
        alone = choose_window(op, int(heights[i]), int(widths[i]), boxes[i], 3, 1, 1, int(indices[i]))
        assert alone[0] == window and alone[1].tolist() == inside.tolist() and len(inside) == len(boxes[i])
    assert sum(window != (0, 0, int(h), int(w)) for (window, _), h, w in zip(together, heights, widths)) > 10


def test_an_iou_crop_without_a_pass_keeps_the_image():
    from headrace.ops._iou_crop import choose_window

    whole = choose_window(ops.RandomIoUCrop(sampler_options=(2.0,)), 50, 80, np.zeros((1, 4)) + [1, 1, 9, 9], 0, 0, 1, 0)
    assert whole[0] == (0, 0, 50, 80) and whole[1].tolist() == [True]
    none = choose_window(ops.RandomIoUCrop(sampler_options=(0.9,), draws=3), 50, 80, np.zeros((0, 4)), 0, 0, 1, 0)
    assert none[0] == (0, 0, 50, 80)


def test_boxes_follow_the_pixels_through_an_iou_crop(tmp_path):
    reader = _rectangles(tmp_path)
    pipe_ops = [ops.RandomIoUCrop(sampler_options=(0.1, 0.3, 0.5)), ops.Resize((64, 64)), ops.Flip(0.5)]
    rows = 0
    for seed in (1, 2, 3):
        for batch in _batches(reader, pipe_ops, seed=seed):
            assert tuple(batch["image"].shape[1:]) == (64, 64, 3)
            for image, boxes in zip(batch["image"], batch["boxes"]):
                if len(boxes):  # a box whose centre the window holds: it frames the white pixels
                    np.testing.assert_allclose(boxes[0].numpy(), _white(image), atol=1.0)
                    rows += 1
    assert rows >= len(SIZES)


def test_an_iou_crop_needs_boxes_and_comes_first():
    with pytest.raises(ConfigError, match="name them"):
        ops.Pipeline([ops.RandomIoUCrop()])
    with pytest.raises(ConfigError, match="comes first"):
        ops.Pipeline([ops.Resize(30), ops.RandomIoUCrop()], boxes="boxes")
    for kwargs in ({"min_scale": 0}, {"min_aspect_ratio": 3, "max_aspect_ratio": 2}, {"sampler_options": ()},
                   {"sampler_options": (-1,)}, {"trials": 0}, {"draws": 1.5}):
        with pytest.raises(ConfigError, match="RandomIoUCrop"):
            ops.RandomIoUCrop(**kwargs)
