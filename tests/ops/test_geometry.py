"""The GPU path's geometry, checked on the CPU: resampling only the planned region of interest gives
the pixels of resampling the whole image (within one level at rounding ties)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from headrace import ConfigError
from headrace.ops import CenterCrop, Flip, Op, RandomCrop, RandomResize, RandomResizedCrop, Resize, uniforms
from headrace.ops._geometry import check_foldable, plan_batch, roi_batch

# Pillow's rendering of the fused geometry that the GPU kernel reproduces (tests/ops/test_geometry.py
# checks the region-of-interest plan against it). Crops after a resize fold into one
# ``Image.resize(box=...)``, which computes only the output pixels of "resize, then crop"; within 2
# of the two calls (Pillow rounds between passes and orders them by cost). A resize never folds into
# an earlier crop: torchvision crops first, so the filter must not reach outside the crop.


class _Window:
    """A pending resize-then-crop: the source box (in the current image) and the output size."""

    __slots__ = ("box", "size")

    def __init__(self, w: int, h: int) -> None:
        self.box = (0.0, 0.0, float(w), float(h))
        self.size = (w, h)

    def crop(self, top: int, left: int, ch: int, cw: int) -> None:
        """Crop the pending output; the window must lie inside it (padding is done elsewhere)."""
        if (top, left, cw, ch) == (0, 0, *self.size):
            return  # the whole output: keep the box exact rather than recompose it in floating point
        x0, y0, x1, y1 = self.box
        sx = (x1 - x0) / self.size[0]
        sy = (y1 - y0) / self.size[1]
        self.box = (x0 + left * sx, y0 + top * sy, x0 + (left + cw) * sx, y0 + (top + ch) * sy)
        self.size = (cw, ch)

    def apply(self, img: Image.Image) -> Image.Image:
        w, h = img.size
        x0, y0, x1, y1 = self.box
        if self.box == (0.0, 0.0, float(w), float(h)) and self.size == img.size:
            return img
        if (x1 - x0, y1 - y0) == self.size and all(float(v).is_integer() for v in self.box):
            return img.crop((int(x0), int(y0), int(x1), int(y1)))  # pure crop: a copy, no filter
        return img.resize(self.size, Image.Resampling.BILINEAR, box=self.box)


def _settle(img: Image.Image, win: _Window) -> tuple[Image.Image, _Window]:
    """Carry out the pending window; the next op starts from a fresh one on the result."""
    img = win.apply(img)
    return img, _Window(img.width, img.height)


def pillow_image_ops(img: Image.Image, ops: tuple[Op, ...], randoms: list[np.ndarray | None]) -> Image.Image:
    """Apply Resize/CenterCrop/RandomResizedCrop/Flip in order; ``randoms[i]`` are op i's uniforms."""
    win = _Window(img.width, img.height)
    for op, u in zip(ops, randoms):
        w, h = win.size
        if isinstance(op, (Resize, RandomResize)):
            img, win = _settle(img, win)
            th, tw = op.target(h, w) if isinstance(op, Resize) else op.target(h, w, u)
            win.size = (tw, th)
        elif isinstance(op, RandomResizedCrop):
            win.crop(*op.window(h, w, u))
            img, win = _settle(img, win)  # torchvision crops, then resizes only the crop
            win.size = (op.size[1], op.size[0])
        elif isinstance(op, (CenterCrop, RandomCrop)):
            top, left, ch, cw = op.window(h, w) if isinstance(op, CenterCrop) else op.window(h, w, u)
            if top >= 0 and left >= 0 and top + ch <= h and left + cw <= w:
                win.crop(top, left, ch, cw)
            else:  # padding: Pillow's crop fills outside the image with zeros
                img, _ = _settle(img, win)
                img = img.crop((left, top, left + cw, top + ch))
                win = _Window(img.width, img.height)
        elif isinstance(op, Flip):
            if op.flips(u):
                img, win = _settle(img, win)
                flip = Image.Transpose.FLIP_TOP_BOTTOM if op.vertical else Image.Transpose.FLIP_LEFT_RIGHT
                img = img.transpose(flip)
    return win.apply(img)


PIPELINES = [
    (RandomResizedCrop(24), Flip()),
    (Resize(40), CenterCrop(32)),
    (Resize((30, 50)),),
    (CenterCrop(16),),
    (Resize(20), CenterCrop(28)),  # crop larger than the image: zero padding
    (RandomResizedCrop((20, 30), scale=(0.5, 1.0)), CenterCrop(12), Flip(1.0)),
    # no fixed output size: each sample's own (the GPU path's list outputs)
    (Resize(40),),
    (Resize(33), Flip(1.0)),
    (Flip(1.0, vertical=True),),
    (RandomCrop(24), Flip()),
    (RandomCrop((12, 200)),),  # inside one way, padded the other
    (Resize(30), RandomCrop(16)),
    (RandomResize(20, 40),),
    (RandomResize(24, 60, max_side=70), RandomCrop(20), Flip()),
    (Resize(30, max_size=45),),
    (Resize(None, max_size=50), CenterCrop(50)),
]


def _image(rng, h, w):
    return Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))


def _sizes(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Random image sizes, the first few of extreme aspect ratio (they reach RandomResizedCrop's fallback)."""
    h, w = rng.integers(20, 160, size=n), rng.integers(20, 160, size=n)
    h[:3], w[:3] = rng.integers(1, 4, size=3), rng.integers(300, 700, size=3)
    return h, w


@pytest.mark.parametrize("ops", PIPELINES, ids=lambda ops: "+".join(type(o).__name__ for o in ops))
def test_roi_resampling_equals_whole_image_resampling(ops):
    rng = np.random.default_rng(0)
    n = 28
    h, w = _sizes(rng, n)
    us = [uniforms(5, 0, k, np.arange(n), op.randoms) if op.randoms else None for k, op in enumerate(ops, 1)]
    p = plan_batch(h, w, ops, us)
    regions = roi_batch(p, h, w)
    for i in range(n):
        img = _image(rng, int(h[i]), int(w[i]))
        expected = np.asarray(pillow_image_ops(img, ops, [None if u is None else u[i] for u in us]))
        y0, x0, y1, x1 = (int(v) for v in regions[i])
        assert 0 <= x0 < x1 <= w[i] and 0 <= y0 < y1 <= h[i]
        bx0, by0, bx1, by1 = (float(v) for v in p.box[i])
        if not (bx0 >= 0 and by0 >= 0 and bx1 <= w[i] and by1 <= h[i]):
            continue  # padding is zero-filled by the kernel, not by Pillow's resize
        region = img.crop((x0, y0, x1, y1))
        out_size = (int(p.out_w[i]), int(p.out_h[i]))
        got = np.asarray(region.resize(out_size, Image.Resampling.BILINEAR, box=(bx0 - x0, by0 - y0, bx1 - x0, by1 - y0)))
        if p.flip_h[i]:
            got = got[:, ::-1]
        if p.flip_v[i]:
            got = got[::-1]
        assert got.shape == expected.shape
        # Same filter taps, but Pillow rounds to uint8 between its two passes and orders the passes
        # by cost, which differs for a region: each result is within 1 of the exact resample.
        diff = np.abs(got.astype(int) - expected.astype(int))
        assert diff.max() <= 2 and diff.mean() < 0.5


def test_flip_before_a_crop_is_refused_on_the_gpu_path():
    check_foldable((RandomResizedCrop(8), Flip()))
    with pytest.raises(ConfigError):
        check_foldable((Flip(), CenterCrop(8)))


def test_a_crop_padding_around_a_crop_after_a_resize_is_refused_on_the_gpu_path():
    # The kernel's filter reads past a crop made after the resize, so it cannot pad around it.
    with pytest.raises(ConfigError, match="crop once, or crop before the resize"):
        check_foldable((Resize(40), CenterCrop(20), CenterCrop(30)))
    check_foldable((Resize(40), CenterCrop(30), CenterCrop(20)))  # inside the first crop: no padding
    check_foldable((CenterCrop(20), CenterCrop(30), Resize(40)))  # before the resize the edge is kept
    check_foldable((Resize(40), CenterCrop(50)))  # one crop pads around the image itself
    check_foldable((RandomResizedCrop(16), CenterCrop(20)))  # the window is real pixels


def test_real_pixels_narrow_at_every_crop_the_filter_clip_before_the_resize_only():
    plan = plan_batch(np.array([40]), np.array([40]), (Resize(40), CenterCrop(20), CenterCrop(30)), [None, None, None])
    assert plan.real[0].tolist() == [10.0, 10.0, 30.0, 30.0]
    assert plan.clip[0].tolist() == [0.0, 0.0, 40.0, 40.0]
