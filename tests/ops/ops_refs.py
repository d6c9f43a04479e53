"""Independent references for the CPU ops: torchvision's geometry rules, its uint8 tensor resize
(torch's ``interpolate``), and Pillow's resampling written out plainly (float64, no fusion), plus
helpers that make real encoded images.

Nothing here imports headrace.ops: a reference that shared code with the thing it checks would
prove nothing.
"""

from __future__ import annotations

import io
import math
import struct
import zlib
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

import headrace
from headrace._sample import SampleBatch

ORIENTATION_TAG = 0x0112


# --- images -------------------------------------------------------------------------------------


def random_image(rng: np.random.Generator, h: int, w: int, channels: int = 3) -> np.ndarray:
    """A uint8 HxWxC image: a smooth gradient (like a photo) plus noise (the resize worst case)."""
    yy, xx = np.mgrid[0:h, 0:w]
    phase = rng.uniform(0, 2 * np.pi, size=channels)
    smooth = 127 + 100 * np.sin(xx[..., None] / max(w, 1) * 6 + yy[..., None] / max(h, 1) * 4 + phase)
    noisy = smooth + rng.normal(0, 40, size=(h, w, channels))
    return np.clip(noisy, 0, 255).astype(np.uint8)


def encode(a: np.ndarray, fmt: str = "JPEG", **save_kw) -> bytes:
    img = Image.fromarray(a[..., 0] if a.ndim == 3 and a.shape[2] == 1 else a)
    buf = io.BytesIO()
    if fmt == "JPEG":
        save_kw.setdefault("quality", 90)
    img.save(buf, fmt, **save_kw)
    return buf.getvalue()


def with_orientation(a: np.ndarray, orientation: int, fmt: str = "JPEG") -> bytes:
    """Encode ``a`` (as stored) carrying EXIF orientation ``orientation``."""
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = orientation
    return encode(a, fmt, exif=exif.tobytes())


def pil_decode(data: bytes, mode: str = "RGB") -> Image.Image:
    img = Image.open(io.BytesIO(data))
    return img.convert(mode)


def sample(i: int, data: bytes | None, label: int | None = 3, **kw) -> headrace.Sample:
    fields: dict = {}
    if data is not None:
        fields["jpg"] = data
    if label is not None:
        fields["cls"] = str(label).encode()
    return headrace.Sample(f"s{i:04d}", fields, f"mem://shard/{i}", i, **kw)


def batch(samples: Sequence[headrace.Sample], epoch: int = 0, index: int = 0) -> SampleBatch:
    return SampleBatch(list(samples), epoch, index)


# EXIF orientation as NumPy moves: what a viewer shows for each tag (CIPA DC-008, 4.6.4 A).
UPRIGHT = {
    1: lambda a: a,
    2: lambda a: a[:, ::-1],
    3: lambda a: a[::-1, ::-1],
    4: lambda a: a[::-1],
    5: lambda a: a.transpose(1, 0, 2),
    6: lambda a: np.rot90(a, k=-1),
    7: lambda a: a[::-1, ::-1].transpose(1, 0, 2),
    8: lambda a: np.rot90(a, k=1),
}


# --- torchvision's geometry rules -----------------------------------------------------------------


def ref_warp(a: np.ndarray, m: np.ndarray, fill) -> np.ndarray:
    """Output pixel (x, y) reads m @ (x + .5, y + .5, 1); bilinear over pixel centres; outside
    neighbours read fill."""
    h, w, c = a.shape
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    sx = m[0, 0] * xs + m[0, 1] * ys + m[0, 2] - 0.5
    sy = m[1, 0] * xs + m[1, 1] * ys + m[1, 2] - 0.5
    x0, y0 = np.floor(sx), np.floor(sy)
    ax, ay = (sx - x0)[..., None], (sy - y0)[..., None]
    x0, y0 = x0.astype(np.int64), y0.astype(np.int64)
    f = np.resize(np.asarray(fill, dtype=np.float64), c)

    def px(yy, xx):
        inside = (xx >= 0) & (xx < w) & (yy >= 0) & (yy < h)
        return np.where(inside[..., None], a[yy.clip(0, h - 1), xx.clip(0, w - 1)].astype(np.float64), f)

    v = (1 - ay) * ((1 - ax) * px(y0, x0) + ax * px(y0, x0 + 1)) + ay * ((1 - ax) * px(y0 + 1, x0) + ax * px(y0 + 1, x0 + 1))
    return np.clip(np.floor(v + 0.5), 0, 255)


def augmix_ref(a: np.ndarray, original: float, chains: np.ndarray, chain_steps, row: int) -> np.ndarray:
    """AugMix's mix of sample ``row`` written out: each of its chains (row ``row W + c`` of the
    chains' passes, each pass that changes it applied from the original ``a``), weighted and summed
    with ``original x a`` in float32 in that order, truncated to uint8."""
    from headrace.ops._passes import changed
    from headrace.ops.cpu import _post

    width = len(chains)
    mix = np.float32(original) * a.astype(np.float32)
    for c in range(width):
        x = torch.from_numpy(a)
        for pass_op, tables in chain_steps:
            if changed(pass_op, tables)[row * width + c]:
                x = _post.apply_tables(x, pass_op, tables, row=row * width + c)
        mix = mix + np.float32(chains[c]) * x.numpy().astype(np.float32)
    return np.trunc(np.clip(mix, 0, 255)).astype(np.uint8)


def tv_resize_size(h: int, w: int, size: int | None, max_size: int | None = None) -> tuple[int, int]:
    """torchvision ``_compute_resized_output_size`` (v2) for an int size or None: short side = size,
    the long side capped at ``max_size``; with size None the long side = ``max_size``."""
    short, long_ = (w, h) if w <= h else (h, w)
    if size is None:
        new_short, new_long = int(max_size * short / long_), max_size
    else:
        new_short, new_long = size, int(size * long_ / short)
        if max_size is not None and new_long > max_size:
            new_short, new_long = int(max_size * new_short / new_long), max_size
    new_short = max(new_short, 1)  # torchvision's would be 0 (an error there); headrace keeps one pixel
    new_w, new_h = (new_short, new_long) if w <= h else (new_long, new_short)
    return new_h, new_w


def tv_center_crop(a: np.ndarray, ch: int, cw: int) -> np.ndarray:
    """torchvision ``F.center_crop`` on an HWC array: zero-pad if smaller, then crop at round()."""
    h, w = a.shape[:2]
    if ch > h or cw > w:
        pad_l = (cw - w) // 2 if cw > w else 0
        pad_t = (ch - h) // 2 if ch > h else 0
        pad_r = (cw - w + 1) // 2 if cw > w else 0
        pad_b = (ch - h + 1) // 2 if ch > h else 0
        a = np.pad(a, ((pad_t, pad_b), (pad_l, pad_r), (0, 0)))
        h, w = a.shape[:2]
        if (h, w) == (ch, cw):
            return a
    top = int(round((h - ch) / 2.0))
    left = int(round((w - cw) / 2.0))
    return a[top : top + ch, left : left + cw]


def tv_rrc_params(
    height: int, width: int, scale: Sequence[float], ratio: Sequence[float], u: Sequence[float]
) -> tuple[int, int, int, int]:
    """torchvision ``RandomResizedCrop.get_params``, its random draws replaced by ``u``.

    Draw order: try t uses u[2t] for ``uniform_(scale)`` and u[2t+1] for ``uniform_(log_ratio)``;
    u[20] and u[21] stand in for ``randint(0, height - h + 1)`` and ``randint(0, width - w + 1)``.
    """
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for t in range(10):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u[2 * t])
        aspect_ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * u[2 * t + 1])
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = math.floor(u[20] * (height - h + 1))
            j = math.floor(u[21] * (width - w + 1))
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


# --- Pillow's antialiased bilinear resize, exactly (no fixed point, no rounding between passes) ---


def _weights(in_size: int, out_size: int) -> np.ndarray:
    """Row xx holds the weights of output pixel xx over the input pixels, as Pillow's
    ``precompute_coeffs``: a triangle stretched by the scale when shrinking, clipped to the image."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = filterscale  # bilinear support is 1
    out = np.zeros((out_size, in_size))
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        x = np.arange(lo, hi)
        k = np.maximum(0.0, 1.0 - np.abs((x - center + 0.5) / filterscale))
        out[xx, lo:hi] = k / k.sum()
    return out


def exact_resize(a: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """The float64 result Pillow's BILINEAR resize approximates (it rounds after each pass)."""
    wy, wx = _weights(a.shape[0], out_h), _weights(a.shape[1], out_w)
    rows = np.tensordot(wy, a.astype(np.float64), axes=(1, 0))  # (out_h, w, c)
    return np.einsum("xj,yjc->yxc", wx, rows)


def tv_resize(a: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """torchvision ``F.resize(img, [out_h, out_w], BILINEAR, antialias=True)`` on a uint8 CHW tensor,
    which is this ``interpolate`` call (uint8 in, uint8 out) unless the size is unchanged."""
    if a.shape[:2] == (out_h, out_w):
        return a
    x = torch.from_numpy(np.array(a)).permute(2, 0, 1)[None]  # a copy: contiguous and writable
    y = torch.nn.functional.interpolate(x, size=(out_h, out_w), mode="bilinear", antialias=True, align_corners=False)
    return y[0].permute(1, 2, 0).numpy()


def pil_resize(a: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    img = Image.fromarray(a[..., 0] if a.shape[2] == 1 else a)
    out = np.asarray(img.resize((out_w, out_h), Image.Resampling.BILINEAR))
    return out.reshape(out_h, out_w, a.shape[2])


# --- normalisation and float formats ------------------------------------------------------------


def normalize_ref(a: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """(x / 255 - mean) / std per channel, float64, HWC."""
    return (a.astype(np.float64) / 255.0 - np.asarray(mean, np.float64)) / np.asarray(std, np.float64)


def half_ulp(ref: np.ndarray, mantissa_bits: int, slack: float = 1e-6) -> np.ndarray:
    """Half the spacing of a float format with ``mantissa_bits`` stored bits around ``ref``: the
    most that rounding to it can move a value within ``slack`` of ``ref`` (float16: 10, bfloat16: 7)."""
    mag = np.maximum(np.abs(ref) + slack, 2.0**-14)
    return 0.5 * 2.0 ** (np.floor(np.log2(mag)) - mantissa_bits)


# --- real photographs, and files that lie about themselves ----------------------------------------


def photo(name: str = "astronaut", h: int | None = None, w: int | None = None) -> np.ndarray:
    """A photograph from scikit-image's data (RGB uint8), resized to h x w when given."""
    from skimage import data

    a = getattr(data, name)()
    if a.ndim == 2:
        a = np.repeat(a[..., None], 3, axis=2)
    if h is not None and w is not None:
        a = np.asarray(Image.fromarray(a).resize((w, h), Image.Resampling.BILINEAR))
    return a


def with_sof_size(jpeg: bytes, h: int, w: int) -> bytes:
    """A JPEG whose SOF0 (or, progressive, SOF2) header claims ``h`` x ``w``; the scan data is still the original's."""
    b = bytearray(jpeg)
    sof = b.index(b"\xff\xc0") if b"\xff\xc0" in b else b.index(b"\xff\xc2")
    b[sof + 5 : sof + 9] = struct.pack(">HH", h, w)
    return bytes(b)


def with_ihdr_size(png: bytes, h: int, w: int) -> bytes:
    """A PNG whose IHDR claims ``h`` x ``w`` (with a matching CRC); the pixel data is the original's."""
    b = bytearray(png)
    b[16:24] = struct.pack(">II", w, h)
    b[29:33] = struct.pack(">I", zlib.crc32(bytes(b[12:29])))
    return bytes(b)


def flat_jpeg(h: int, w: int, quality: int = 50) -> bytes:
    """A real JPEG of h x w in one colour: large in pixels, small in bytes."""
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (120, 80, 40)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def with_webp_size(webp: bytes, h: int, w: int) -> bytes:
    """A WebP whose first chunk (VP8X canvas, VP8 frame or VP8L header) claims ``h`` x ``w``."""
    b = bytearray(webp)
    kind, body = bytes(b[12:16]), 20
    if kind == b"VP8X":
        b[body + 4 : body + 7] = (w - 1).to_bytes(3, "little")
        b[body + 7 : body + 10] = (h - 1).to_bytes(3, "little")
    elif kind == b"VP8 ":
        struct.pack_into("<HH", b, body + 6, w & 0x3FFF, h & 0x3FFF)
    else:
        bits = struct.unpack_from("<I", b, body + 1)[0] & ~0xFFFFFFF
        struct.pack_into("<I", b, body + 1, bits | ((w - 1) & 0x3FFF) | (((h - 1) & 0x3FFF) << 14))
    return bytes(b)
