"""Review sweep: every image mode and container Pillow opens, decoded through the public path (a
Loader over ``readers.sequence``, ``Pipeline([Decode(...)], layout="HWC")``) against the reference
a user would compute: ``ImageOps.exif_transpose(Image.open(f)).convert("RGB")`` (or ``"L"``).
torchvision is not installed here, so its ``decode_image(..., ImageReadMode.RGB)`` is not checked.

Deliberate differences from Pillow's ``convert`` (``ops/_pillow.py`` says why):

- 16-bit grey (PNG, TIFF, either byte order), a 16-bit PGM and an unsigned 32-bit TIFF keep their
  high byte (Pillow clips them at 255: a full-range image comes out nearly white; Pillow reads an
  unsigned 32-bit TIFF as signed, wrapped). torchvision decodes a 16-bit PNG to uint16, and
  ``ToDtype(torch.uint8, scale=True)`` of that shifts right by 8 (by its source; not run here).
- A float (``F``) image whose values lie in [0, 1] is scaled by 255, rounded half up, NaN to 0
  (Pillow truncates it to 0 and 1; [0, 1] is torchvision's float convention). Other float
  images are Pillow's conversion: clipped to 0..255 and truncated. torchvision reads no float
  format; Pillow reads float TIFFs (32-bit only: 16 and 64-bit float TIFFs are not opened).
- Signed integer TIFFs (16 and 32-bit) are clipped to 0..255, as Pillow: no full range to scale.

Not covered here: HEIF/HEIC (no ``pillow_heif`` in this environment: such bytes are a typed
"not an image format" error, tested), YCCK written by a real encoder (built here by re-labelling
a CMYK JPEG's components; libjpeg reads both the same way).
"""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image, ImageOps, features

import headrace
from headrace import DecodeError, ops, readers
from headrace.ops import _pillow

AVIF = features.check("avif")


# --- the public path and the reference ---------------------------------------------------------


def decode_all(datas: list[bytes], color: str = "rgb", exif: bool = True) -> list[np.ndarray]:
    """Each file through a Loader (a batch of one each, reader order): HWC uint8 arrays."""
    pipe = ops.Pipeline([ops.Decode(color=color, exif=exif)], layout="HWC")
    items = [{"__key__": f"case{i}", "png": d, "cls": 0} for i, d in enumerate(datas)]
    loader = headrace.Loader(readers.sequence(items, shuffle=False), batch_size=1, pipeline=pipe, device="cpu")
    with loader.sync() as epochs:
        out = [batch["image"][0].numpy() for batch in epochs]
    assert len(out) == len(datas)
    return out


def decode_error(data: bytes, **decode_kw) -> DecodeError:
    """The DecodeError one file gives through a Loader (on_error="raise")."""
    pipe = ops.Pipeline([ops.Decode(**decode_kw)], layout="HWC")
    items = [{"__key__": "the-sample", "png": data, "cls": 0}]
    loader = headrace.Loader(readers.sequence(items, shuffle=False), batch_size=1, pipeline=pipe, device="cpu")
    with pytest.raises(DecodeError) as info, loader.sync() as epochs:
        list(epochs)
    assert info.value.key == "the-sample"
    return info.value


def reference(data: bytes, color: str = "rgb", exif: bool = True) -> np.ndarray:
    img = Image.open(io.BytesIO(data))
    if exif:
        img = ImageOps.exif_transpose(img)
    a = np.asarray(img.convert("RGB" if color == "rgb" else "L"))
    return a if a.ndim == 3 else a[..., None]


def save(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def blocks(rng: np.random.Generator, h: int = 24, w: int = 40, channels: int = 3) -> np.ndarray:
    """A picture of 8x8 flat blocks: lossy codecs keep it close, so a wrong colour transform shows."""
    a = rng.integers(0, 256, (h // 8, w // 8, channels), dtype=np.uint8)
    return np.kron(a, np.ones((8, 8, 1), dtype=np.uint8))


def ramp16(h: int = 24, w: int = 40) -> np.ndarray:
    return (np.arange(h * w, dtype=np.uint32).reshape(h, w) * 65535 // (h * w - 1)).astype(np.uint16)


# --- files Pillow cannot write -----------------------------------------------------------------


def tiff(a: np.ndarray, endian: str = "<") -> bytes:
    """An uncompressed one-strip TIFF of an (H, W) or (H, W, S) array: BitsPerSample and
    SampleFormat (1 unsigned, 2 signed, 3 float) from its dtype."""
    h, w = a.shape[:2]
    spp = 1 if a.ndim == 2 else a.shape[2]
    bits, fmt = a.dtype.itemsize * 8, {"u": 1, "b": 1, "i": 2, "f": 3}[a.dtype.kind]
    e = endian
    data = a.astype(a.dtype.newbyteorder(e)).tobytes()
    arrays = struct.pack(e + f"{spp}H", *[bits] * spp) + struct.pack(e + f"{spp}H", *[fmt] * spp)
    arrays_at = 8 + len(data)
    entries = []

    def entry(tag: int, typ: int, count: int, value: bytes) -> None:
        entries.append(struct.pack(e + "HHI", tag, typ, count) + value.ljust(4, b"\0"))

    def shorts(values_at: int, value: int) -> bytes:  # a SHORT array: inline when it fits
        return struct.pack(e + f"{spp}H", *[value] * spp) if spp <= 2 else struct.pack(e + "I", values_at)

    entry(256, 4, 1, struct.pack(e + "I", w))
    entry(257, 4, 1, struct.pack(e + "I", h))
    entry(258, 3, spp, shorts(arrays_at, bits))
    entry(259, 3, 1, struct.pack(e + "H", 1))
    entry(262, 3, 1, struct.pack(e + "H", 2 if spp >= 3 else 1))
    entry(273, 4, 1, struct.pack(e + "I", 8))
    entry(277, 3, 1, struct.pack(e + "H", spp))
    entry(278, 4, 1, struct.pack(e + "I", h))
    entry(279, 4, 1, struct.pack(e + "I", len(data)))
    entry(284, 3, 1, struct.pack(e + "H", 1))
    entry(339, 3, spp, shorts(arrays_at + 2 * spp, fmt))
    head = (b"II*\0" if e == "<" else b"MM\0*") + struct.pack(e + "I", arrays_at + len(arrays))
    return head + data + arrays + struct.pack(e + "H", len(entries)) + b"".join(entries) + b"\0\0\0\0"


def bmp_with_alpha(rgba: np.ndarray) -> bytes:
    """A 32-bit BI_BITFIELDS BMP with a BITMAPV4HEADER whose alpha mask is set (Pillow: RGBA)."""
    h, w = rgba.shape[:2]
    pixels = rgba[::-1, :, [2, 1, 0, 3]].tobytes()  # bottom-up BGRA
    header = struct.pack("<IiiHHIIiiII", 108, w, h, 1, 32, 3, len(pixels), 2835, 2835, 0, 0)
    header += struct.pack("<IIII", 0x00FF0000, 0x0000FF00, 0x000000FF, 0xFF000000) + b"BGRs" + bytes(48)
    return b"BM" + struct.pack("<IHHI", 14 + len(header) + len(pixels), 0, 0, 14 + len(header)) + header + pixels


def png16(a: np.ndarray, color_type: int) -> bytes:
    import zlib

    h, w = a.shape[:2]
    raw = b"".join(b"\0" + a[y].astype(">u2").tobytes() for y in range(h))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", w, h, 16, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def pgm(a: np.ndarray, maxval: int) -> bytes:
    return f"P5 {a.shape[1]} {a.shape[0]} {maxval}\n".encode() + a.astype(">u2").tobytes()


def ycck_jpeg(rgb: np.ndarray) -> bytes:
    """An Adobe YCCK JPEG (transform 2) that Pillow reads as CMYK (255-r, 255-g, 255-b, 0): a CMYK
    JPEG whose components hold Y, Cb, Cr and K as libjpeg's YCCK stores them, re-labelled."""
    c = 255.0 - rgb.astype(np.float64)  # libjpeg's YCCK -> CMYK takes R, G, B of the YCC as 255 - C', ...
    r, g, b = c[..., 0], c[..., 1], c[..., 2]
    y = 0.299 * r + 0.587 * g + 0.114 * b
    cb = 128 - 0.168736 * r - 0.331264 * g + 0.5 * b
    cr = 128 + 0.5 * r - 0.418688 * g - 0.081312 * b
    stored = np.stack([y, cb, cr, np.full_like(y, 255)], 2)  # ... and Pillow inverts Adobe CMYK: K' = 255
    given = np.clip(np.rint(255 - stored), 0, 255).astype(np.uint8)  # Pillow writes CMYK inverted
    data = bytearray(save(Image.fromarray(given, "CMYK"), "JPEG", quality=95))
    at = data.find(b"Adobe")
    assert at > 0 and data[at + 11] == 0
    data[at + 11] = 2
    return bytes(data)


# --- modes Pillow converts as a user expects: equal to the reference ----------------------------


def pillow_cases(rng: np.random.Generator) -> dict[str, bytes]:
    rgb = blocks(rng)
    rgba = np.concatenate([rgb, rng.integers(0, 256, (*rgb.shape[:2], 1), dtype=np.uint8)], 2)
    g16 = ramp16()
    rgb16 = np.stack([g16, g16[::-1], 65535 - g16], 2)
    frames = [Image.fromarray(np.roll(rgb, 8 * i, 1)) for i in range(3)]
    cases = {
        "PNG RGB 16-bit": png16(rgb16, 2),
        "PNG RGBA 16-bit": png16(np.concatenate([rgb16, g16[..., None]], 2), 6),
        "PNG LA 16-bit": png16(np.stack([g16, g16[::-1]], 2), 4),
        "PNG P + tRNS": save(Image.fromarray(rgb).quantize(16), "PNG", transparency=0),
        "PNG P, RGBA palette": save(Image.fromarray(rgba).quantize(16), "PNG"),
        "PNG LA": save(Image.fromarray(rgba).convert("LA"), "PNG"),
        "PNG L + tRNS": save(Image.fromarray(rgb).convert("L"), "PNG", transparency=7),
        "PNG 1-bit": save(Image.fromarray(g16 > 30000), "PNG"),
        "JPEG CMYK (Adobe)": save(Image.fromarray(rgb).convert("CMYK"), "JPEG", quality=95),
        "JPEG YCCK (Adobe)": ycck_jpeg(rgb),
        "JPEG progressive": save(Image.fromarray(rgb), "JPEG", progressive=True, quality=90),
        "JPEG grey": save(Image.fromarray(rgb).convert("L"), "JPEG"),
        "JPEG grey progressive": save(Image.fromarray(rgb).convert("L"), "JPEG", progressive=True),
        "TIFF 1-bit": save(Image.fromarray(g16 > 30000), "TIFF"),
        "TIFF 1-bit G4": save(Image.fromarray(g16 > 30000), "TIFF", compression="group4"),
        "TIFF RGB 16-bit": tiff(rgb16),
        "TIFF CMYK": save(Image.fromarray(rgb).convert("CMYK"), "TIFF"),
        "TIFF RGBA": save(Image.fromarray(rgba), "TIFF", compression="tiff_lzw"),
        "TIFF int16 (signed: clipped)": tiff(g16.astype(np.int32).astype(np.int16)),
        "TIFF int32 (signed: clipped)": tiff((g16.astype(np.int32) - 30000) // 100),
        "TIFF F in [0, 255]": tiff(g16.astype(np.float32) / 257),
        "TIFF F in [-20, 300]": tiff(g16.astype(np.float32) / 65535 * 320 - 20),
        "BMP RGBA (BITMAPV4)": bmp_with_alpha(rgba),
        "BMP 8-bit palette": save(Image.fromarray(rgb).quantize(64), "BMP"),
        "WebP RGBA lossless": save(Image.fromarray(rgba), "WEBP", lossless=True),
        "WebP RGBA lossy": save(Image.fromarray(rgba), "WEBP", quality=90),
        "GIF animated": save(frames[0], "GIF", save_all=True, append_images=frames[1:]),
        "WebP animated": save(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True),
        "PPM RGB 16-bit": f"P6 {rgb.shape[1]} {rgb.shape[0]} 65535\n".encode() + rgb16.astype(">u2").tobytes(),
    }
    if AVIF:
        cases["AVIF RGB"] = save(Image.fromarray(rgb), "AVIF", quality=90)
        cases["AVIF RGBA"] = save(Image.fromarray(rgba), "AVIF", quality=90)
    return cases


@pytest.mark.filterwarnings("ignore:Palette images with Transparency:UserWarning")  # the reference's convert
@pytest.mark.parametrize("color", ["rgb", "gray"])
def test_modes_decode_as_pillow_converts_them(rng, jpeg_decoder, color):
    cases = pillow_cases(rng)
    for (name, data), got in zip(cases.items(), decode_all(list(cases.values()), color)):
        want = reference(data, color)
        assert got.dtype == np.uint8 and got.shape == want.shape, (name, got.shape, want.shape)
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_colour_transforms_keep_the_colours(rng, jpeg_decoder):
    """Not only Pillow's answer: CMYK and YCCK JPEGs come out as the colours put in (not inverted),
    16-bit colour as its high byte, animations as their first frame."""
    rgb = blocks(rng)
    g16 = ramp16()
    rgb16 = np.stack([g16, g16[::-1], 65535 - g16], 2)
    frames = [np.roll(rgb, 8 * i, 1) for i in range(3)]
    datas = [
        save(Image.fromarray(rgb).convert("CMYK"), "JPEG", quality=95),
        ycck_jpeg(rgb),
        png16(rgb16, 2),
        save(Image.fromarray(frames[0]), "WEBP", save_all=True, lossless=True,
             append_images=[Image.fromarray(f) for f in frames[1:]]),
    ]
    cmyk, ycck, colour16, animated = decode_all(datas)
    for name, got in (("CMYK", cmyk), ("YCCK", ycck)):
        assert np.abs(got.astype(int) - rgb).mean() < 2, name
    np.testing.assert_array_equal(colour16, (rgb16 >> 8).astype(np.uint8))
    np.testing.assert_array_equal(animated, frames[0])


# --- deliberate differences: high bytes and the float rule ---------------------------------------


@pytest.mark.parametrize("color", ["rgb", "gray"])
def test_deep_integer_and_float_images_are_scaled_not_clipped(rng, color):
    g16 = ramp16()
    ten_bit = (g16 >> 6).astype(np.uint16)  # 0..1023
    unit = g16.astype(np.float32) / 65535
    with_nan = unit.copy()
    with_nan[3, 5:9] = np.nan
    cases = {  # name: (file, what headrace gives; Pillow's convert clips the integers, truncates the floats)
        "PNG I;16": (png16(g16, 0), g16 >> 8),
        "TIFF I;16": (save(Image.fromarray(g16), "TIFF"), g16 >> 8),
        "TIFF I;16B": (tiff(g16, endian=">"), g16 >> 8),
        "TIFF uint32": (tiff(g16.astype(np.uint32) << 16 | 0xFFFF), g16 >> 8),  # Pillow: wrapped to negative
        "PGM maxval 65535": (pgm(g16, 65535), g16 >> 8),
        # Pillow scales a PGM's values to 0..65535 (rounded) and opens it in mode I
        "PGM maxval 1023": (pgm(ten_bit, 1023), np.round(ten_bit / 1023 * 65535).astype(np.uint32) >> 8),
        "TIFF F in [0, 1]": (tiff(unit), np.floor(unit * 255 + 0.5)),
        "TIFF F in [0, 1], big-endian": (tiff(unit, endian=">"), np.floor(unit * 255 + 0.5)),
        "TIFF F in [0, 1] with NaN": (tiff(with_nan), np.floor(np.nan_to_num(with_nan) * 255 + 0.5)),
    }
    assert Image.open(io.BytesIO(cases["TIFF uint32"][0])).getextrema()[0] < 0  # what Pillow reads
    outs = decode_all([data for data, _ in cases.values()], color)
    for (name, (data, grey)), got in zip(cases.items(), outs):
        want = np.repeat(grey.astype(np.uint8)[..., None], 3 if color == "rgb" else 1, 2)
        assert got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)
        assert not np.array_equal(got, reference(data, color)), f"{name}: Pillow's own conversion agrees now?"


def test_float_rule_edges(rng):
    """[0, 1] inclusive is scaled, exact k/255 values come back as k, all-NaN is black; one value
    out of [0, 1] and the image is Pillow's (clipped, truncated), NaN black there too."""
    k = np.arange(256, dtype=np.float32).reshape(16, 16)
    cases = {
        "k/255": (k / 255, k),
        "zeros": (np.zeros((4, 5), np.float32), np.zeros((4, 5))),
        "ones": (np.ones((4, 5), np.float32), np.full((4, 5), 255)),
        "all NaN": (np.full((4, 5), np.nan, np.float32), np.zeros((4, 5))),
        "k with a NaN": (np.where(k == 7, np.nan, k), np.where(k == 7, 0, k)),
        "k + 0.75 (truncated)": (k + 0.75, k),
        "0.5 and 1.5 (not unit: clipped)": (np.array([[0.5, 1.5]], np.float32), np.array([[0, 1]])),
        "-inf, inf": (np.array([[-np.inf, np.inf, 3]], np.float32), np.array([[0, 255, 3]])),
    }
    outs = decode_all([tiff(f) for f, _ in cases.values()], "gray")
    for (name, (_, want)), got in zip(cases.items(), outs):
        np.testing.assert_array_equal(got[..., 0], want.astype(np.uint8), err_msg=name)


# --- EXIF orientation on every format that carries one -------------------------------------------

ORIENTED = ["JPEG", "PNG", "WEBP", "TIFF"] + (["AVIF"] if AVIF else [])


def oriented(a: np.ndarray, fmt: str, o: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = o
    kw = {"quality": 90} if fmt in ("JPEG", "AVIF") else {}
    return save(Image.fromarray(a), fmt, exif=exif, **kw)


@pytest.mark.parametrize("fmt", ORIENTED)
@pytest.mark.parametrize("color", ["rgb", "gray"])
def test_exif_orientation_every_format(rng, jpeg_decoder, fmt, color):
    a = blocks(rng, 24, 40)  # not square: 5..8 swap height and width
    datas = [oriented(a, fmt, o) for o in range(1, 9)]
    upright = decode_all(datas, color)
    stored = decode_all(datas, color, exif=False)
    # exif=False is the image as stored: the same pixels with no tag (Pillow's TIFF loader itself
    # turns a TIFF upright on open, so Image.open is not the stored image there)
    as_stored = reference(datas[0], color)
    for o, data, got, raw in zip(range(1, 9), datas, upright, stored):
        np.testing.assert_array_equal(got, reference(data, color), err_msg=f"{fmt} orientation {o}")
        np.testing.assert_array_equal(raw, as_stored, err_msg=f"{fmt} stored {o}")
        assert got.shape[:2] == ((40, 24) if o >= 5 else (24, 40)), (fmt, o)


@pytest.mark.skipif(not AVIF, reason="Pillow without AVIF")
def test_avif_orientation_is_in_the_container_and_known_from_the_header(rng):
    """AVIF's orientation is its irot/imir boxes (Pillow writes them from the EXIF tag and drops
    the tag); the header alone gives it, so the GPU path's planning sees the upright size."""
    a = blocks(rng, 24, 40)
    data = oriented(a, "AVIF", 6)
    assert b"irot" in data
    opened = _pillow.open_image(data, ops.Decode(), "k", "s")
    assert (opened.orientation, opened.height, opened.width) == (6, 40, 24)
    opened.img.close()


# --- the GPU path's fallback gets the same pixels --------------------------------------------------


def test_gpu_fallback_decode_equals_the_cpu_pixels(rng):
    """ops/cuda decodes non-JPEGs with ``_pillow.decode`` (a Pillow image) and, planned from the
    header, ``_pillow.pixels``: the new conversions and AVIF's orientation reach both."""
    g16 = ramp16()
    datas = [tiff(g16.astype(np.float32) / 65535), tiff(g16.astype(np.uint32) << 16), png16(g16, 0), pgm(g16, 65535)]
    if AVIF:
        datas.append(oriented(blocks(rng, 24, 40), "AVIF", 8))
    for color in ("rgb", "gray"):
        spec = ops.Decode(color=color)
        for i, data in enumerate(datas):
            img = _pillow.decode(data, spec, "k", "s")
            as_image = np.asarray(img)
            img.close()
            as_tensor = _pillow.pixels(_pillow.open_image(data, spec, "k", "s"), spec).numpy()
            np.testing.assert_array_equal(as_tensor, as_image.reshape(as_tensor.shape), err_msg=f"{i} {color}")


# --- what cannot be decoded is a typed error naming the sample -------------------------------------


def test_unreadable_formats_are_typed_errors():
    g16 = ramp16()
    heic = struct.pack(">I", 24) + b"ftypheic" + b"\0\0\0\0" + b"mif1heic" + bytes(64)
    unreadable = {
        "TIFF float64": tiff(g16.astype(np.float64) / 65535),  # Pillow reads 32-bit float TIFFs only
        "TIFF float16": tiff((g16 / 65535).astype(np.float16)),
        "HEIC without a plugin": heic,
    }
    for name, data in unreadable.items():
        err = decode_error(data)
        assert "not an image format" in str(err) or "unreadable" in str(err), (name, err)


def test_max_pixels_holds_for_the_scaled_modes():
    g16 = ramp16()  # 24 x 40 = 960 pixels
    for data in (tiff(g16.astype(np.float32) / 65535), tiff(g16.astype(np.uint32)), pgm(g16, 65535)):
        err = decode_error(data, max_pixels=959)
        assert "max_pixels=959" in str(err)


@pytest.mark.filterwarnings("ignore:Corrupt EXIF data:UserWarning")  # Pillow reading the cut TIFF's tags
def test_truncated_deep_files_are_typed_errors():
    g16 = ramp16()
    for data in (tiff(g16.astype(np.float32) / 65535), save(Image.fromarray(g16), "TIFF"), png16(g16, 0)):
        decode_error(data[: len(data) * 2 // 3])
