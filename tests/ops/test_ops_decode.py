"""Decode through CpuExecutor: JPEG, PNG, WebP, TIFF, RGB and gray, alpha, odd modes, EXIF orientation
1..8 (one parser for every path), and the verdict on truncated and damaged files."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
import torch
from ops_refs import (
    ORIENTATION_TAG,
    UPRIGHT,
    batch,
    encode,
    photo,
    pil_decode,
    random_image,
    sample,
    tv_resize,
    with_orientation,
)
from PIL import Image, ImageOps, TiffImagePlugin

from headrace import DecodeError
from headrace.ops import Decode, Pipeline, RandomResizedCrop, Resize, _pillow, uniforms


def hwc(t: torch.Tensor) -> np.ndarray:
    """A CHW uint8 output row as an HWC array."""
    return t.permute(1, 2, 0).numpy()


async def run_list(make_executor, pipeline, datas, seed=0):
    out = await make_executor(pipeline, seed=seed).run(batch([sample(i, d) for i, d in enumerate(datas)]))
    assert not out.failures, out.failures
    return out.data["image"]


async def test_jpeg_rgb_equals_pillow_decode(make_executor, rng):
    datas = [encode(random_image(rng, *rng.integers(20, 120, 2))) for _ in range(12)]
    images = await run_list(make_executor, Pipeline([Decode()]), datas)
    assert isinstance(images, list) and len(images) == 12  # sizes differ, no resize: a list
    for img, data in zip(images, datas):
        assert img.dtype == torch.uint8 and img.shape[0] == 3
        np.testing.assert_array_equal(hwc(img), np.asarray(pil_decode(data)))  # same decoder: exact


async def test_png_is_lossless(make_executor, rng):
    arrays = [random_image(rng, *rng.integers(20, 120, 2)) for _ in range(8)]
    images = await run_list(make_executor, Pipeline([Decode()], layout="HWC"), [encode(a, "PNG") for a in arrays])
    for img, a in zip(images, arrays):
        np.testing.assert_array_equal(img.numpy(), a)


async def test_gray_output_from_rgb_and_gray_files(make_executor, rng):
    rgb = [random_image(rng, *rng.integers(20, 90, 2)) for _ in range(4)]
    gray = [random_image(rng, *rng.integers(20, 90, 2), channels=1) for _ in range(4)]
    datas = [encode(a, "PNG") for a in rgb] + [encode(a, "JPEG") for a in gray] + [encode(a, "PNG") for a in gray]
    images = await run_list(make_executor, Pipeline([Decode(color="gray")]), datas)
    for img, data in zip(images, datas):
        assert img.shape[0] == 1
        np.testing.assert_array_equal(img[0].numpy(), np.asarray(pil_decode(data, "L")))
    for img, a in zip(images[:4], rgb):  # ITU-R 601-2 luma, as Pillow's "L": L = (299R + 587G + 114B) / 1000
        luma = a.astype(np.float64) @ np.array([0.299, 0.587, 0.114])
        assert np.abs(img[0].numpy() - luma).max() <= 1.0
    for img, a in zip(images[8:], gray):  # gray PNG: lossless
        np.testing.assert_array_equal(img[0].numpy(), a[..., 0])


async def test_gray_jpeg_to_rgb_repeats_the_channel(make_executor, rng):
    a = random_image(rng, 40, 56, channels=1)
    (img,) = await run_list(make_executor, Pipeline([Decode()]), [encode(a, "JPEG")])
    stored = np.asarray(Image.open(io.BytesIO(encode(a, "JPEG"))))
    np.testing.assert_array_equal(hwc(img), np.repeat(stored[..., None], 3, axis=2))


async def test_alpha_and_palette_are_dropped(make_executor, rng):
    rgba = np.concatenate([random_image(rng, 30, 40), rng.integers(0, 256, (30, 40, 1), dtype=np.uint8)], axis=2)
    pal = Image.fromarray(random_image(rng, 30, 40)).quantize(16)
    pal.info["transparency"] = 0
    buf = io.BytesIO()
    pal.save(buf, "PNG", transparency=0)
    images = await run_list(make_executor, Pipeline([Decode()]), [encode(rgba, "PNG"), buf.getvalue()])
    np.testing.assert_array_equal(hwc(images[0]), rgba[..., :3])
    np.testing.assert_array_equal(hwc(images[1]), np.asarray(pal.convert("RGBA").convert("RGB")))


def test_orientation_table_matches_pillow(rng):
    """The NumPy table the tests use agrees with Pillow's exif_transpose (so neither is assumed)."""
    a = random_image(rng, 13, 21)
    for o, move in UPRIGHT.items():
        ref = ImageOps.exif_transpose(Image.open(io.BytesIO(with_orientation(a, o, "PNG"))))
        np.testing.assert_array_equal(np.asarray(ref.convert("RGB")), move(a))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
async def test_exif_orientation(make_executor, rng, fmt):
    a = random_image(rng, 24, 40)  # not square: orientations 5..8 swap height and width
    datas = [with_orientation(a, o, fmt) for o in range(1, 9)]
    upright = await run_list(make_executor, Pipeline([Decode()]), datas)
    stored = await run_list(make_executor, Pipeline([Decode(exif=False)]), datas)
    for o, data, img, raw in zip(range(1, 9), datas, upright, stored):
        ref = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")
        np.testing.assert_array_equal(hwc(img), np.asarray(ref), err_msg=f"orientation {o}")
        np.testing.assert_array_equal(hwc(img), UPRIGHT[o](hwc(raw)), err_msg=f"orientation {o}")
        assert img.shape[1:] == ((40, 24) if o >= 5 else (24, 40))


async def test_random_resized_crop_uses_the_upright_size(make_executor, rng):
    """Orientation 6 stores 28 x 120 (h x w) for a 120 x 28 upright image: the window must be drawn on
    the upright image, so that the same sample crops the same scene whatever its EXIF says."""
    rrc = RandomResizedCrop(16, scale=(0.3, 1.0))
    a = random_image(rng, 28, 120)
    datas = [with_orientation(a, 6)] * 16
    out = await make_executor(Pipeline([Decode(), rrc]), seed=5).run(batch([sample(i, d) for i, d in enumerate(datas)]))
    u = uniforms(5, 0, 1, np.arange(16), rrc.randoms)  # op position 1: the first op after Decode
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(datas[0]))).convert("RGB")
    assert upright.size == (28, 120)  # (w, h)
    differs = 0
    for i in range(16):
        top, left, ch, cw = rrc.window(120, 28, u[i])
        ref = tv_resize(np.asarray(upright)[top : top + ch, left : left + cw], 16, 16)
        np.testing.assert_array_equal(hwc(out.data["image"][i]), ref)
        differs += rrc.window(28, 120, u[i]) != (top, left, ch, cw)
    assert differs > 8  # the stored size would have given other windows: the check has teeth


# --- EXIF: one parser for every format and colour mode ------------------------------------------


def exif_block(typ: int = 3, count: int = 1, value: bytes = struct.pack(">H", 6), *, ifd: int = 8, entries: int = 1,
               cut: int | None = None) -> bytes:
    """A big-endian EXIF block (with JPEG's ``Exif\\0\\0`` prefix) whose IFD0 holds one orientation
    entry of the given type, count and value field; ``cut`` truncates the TIFF structure."""
    tiff = b"MM\x00\x2a" + struct.pack(">I", ifd) + struct.pack(">H", entries)
    tiff += struct.pack(">HHI", 0x0112, typ, count) + value.ljust(4, b"\x00") + b"\x00" * 4
    return b"Exif\x00\x00" + (tiff if cut is None else tiff[:cut])


EXIF_BLOCKS = {  # name: (block, orientation every path must read)
    "valid-6": (exif_block(), 6),
    "valid-8": (exif_block(value=struct.pack(">H", 8)), 8),
    "type-LONG": (exif_block(typ=4, value=struct.pack(">I", 6)), 1),
    "type-BYTE": (exif_block(typ=1, value=b"\x06"), 1),
    "count-2": (exif_block(count=2, value=struct.pack(">HH", 6, 6)), 1),
    "count-0": (exif_block(count=0), 1),
    "value-9": (exif_block(value=struct.pack(">H", 9)), 1),
    "value-0": (exif_block(value=struct.pack(">H", 0)), 1),
    "ifd-out-of-range": (exif_block(ifd=0xFFFF), 1),
    "table-truncated": (exif_block(entries=3, cut=16), 1),
    "entry-cut-short": (exif_block(cut=18), 1),
}


def with_exif(a: np.ndarray, block: bytes, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, fmt, exif=block, **({"quality": 90} if fmt == "JPEG" else {"lossless": True} if fmt == "WEBP" else {}))
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
async def test_malformed_exif_reads_as_1_on_every_path(make_executor, rng, jpeg_decoder, fmt):
    """One parser decides for nvImageCodec's RGB path, Pillow's RGB path and the gray path: a
    malformed orientation entry (wrong type or count, a value out of range, an offset outside the
    block, a truncated table) is orientation 1 on all of them; a valid one turns all of them."""
    from headrace.ops._exif import orientation

    a = random_image(rng, 24, 40)
    datas = {name: with_exif(a, block, fmt) for name, (block, _) in EXIF_BLOCKS.items()}
    for color in ("rgb", "gray"):
        upright = await run_list(make_executor, Pipeline([Decode(color=color)], layout="HWC"), list(datas.values()))
        stored = await run_list(make_executor, Pipeline([Decode(color=color, exif=False)], layout="HWC"), list(datas.values()))
        for (name, (_, expect)), data, img, raw in zip(EXIF_BLOCKS.items(), datas.values(), upright, stored):
            assert orientation(data) == expect, name
            np.testing.assert_array_equal(img.numpy(), UPRIGHT[expect](raw.numpy()), err_msg=f"{color} {name}")


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "TIFF"])
async def test_gray_and_rgb_turn_the_same_way(make_executor, rng, jpeg_decoder, fmt):
    a = random_image(rng, 18, 30)
    datas = [with_orientation(a, o, fmt) for o in range(1, 9)]
    rgb = await run_list(make_executor, Pipeline([Decode()], layout="HWC"), datas)
    gray = await run_list(make_executor, Pipeline([Decode(color="gray")], layout="HWC"), datas)
    for o, data, x, g in zip(range(1, 9), datas, rgb, gray):
        ref = np.asarray(Image.open(io.BytesIO(data)).convert("L"))  # stored, or upright where Pillow turned it (TIFF)
        if fmt != "TIFF":
            ref = UPRIGHT[o](ref[..., None])[..., 0]
        np.testing.assert_array_equal(g[..., 0].numpy(), ref, err_msg=f"orientation {o}")
        assert tuple(x.shape[:2]) == tuple(g.shape[:2]) == ((30, 18) if o >= 5 else (18, 30))


@pytest.mark.parametrize("compression", [None, "tiff_lzw", "tiff_deflate", "packbits"])
async def test_tiff_orientation_is_applied_once(make_executor, rng, compression):
    """Pillow's TIFF loader turns the image upright itself: headrace must not turn it again."""
    a = random_image(rng, 20, 34)
    kw = {"compression": compression} if compression else {}
    datas = []
    for o in range(1, 9):
        exif = Image.Exif()
        exif[ORIENTATION_TAG] = o
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, "TIFF", exif=exif, **kw)
        datas.append(buf.getvalue())
    upright = await run_list(make_executor, Pipeline([Decode()], layout="HWC"), datas)
    stored = await run_list(make_executor, Pipeline([Decode(exif=False)], layout="HWC"), datas)
    for o, img, raw in zip(range(1, 9), upright, stored):
        np.testing.assert_array_equal(img.numpy(), UPRIGHT[o](a), err_msg=f"orientation {o}")
        np.testing.assert_array_equal(raw.numpy(), a, err_msg=f"orientation {o}, exif=False")
    for o, data in zip(range(1, 9), datas):  # the GPU path's Pillow fallback agrees
        img = _pillow.decode(data, Decode(), "k", "s")
        np.testing.assert_array_equal(np.asarray(img), UPRIGHT[o](a), err_msg=f"decode(), orientation {o}")


async def test_tiff_orientation_of_the_wrong_type_is_undone(make_executor, rng):
    """A TIFF whose orientation tag is a LONG: Pillow's loader turns the image by it; the EXIF rule
    (SHORT only) says 1, so headrace hands out the stored image, as for JPEG and PNG."""
    a = random_image(rng, 12, 26)
    ifd = TiffImagePlugin.ImageFileDirectory_v2()
    ifd[ORIENTATION_TAG] = 6
    ifd.tagtype[ORIENTATION_TAG] = 4
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "TIFF", tiffinfo=ifd)
    assert Image.open(io.BytesIO(buf.getvalue())).size == (12, 26)  # Pillow will turn it
    (img,) = await run_list(make_executor, Pipeline([Decode()], layout="HWC"), [buf.getvalue()])
    np.testing.assert_array_equal(img.numpy(), a)


# --- the verdict on truncated and damaged files ---------------------------------------------------


def _png_chunk(png: bytes, kind: bytes) -> int:
    pos = 8
    while png[pos + 4 : pos + 8] != kind:
        pos += 12 + struct.unpack(">I", png[pos : pos + 4])[0]
    return pos


def damaged_files() -> dict[str, bytes]:
    """Real photographs in each format, cut or damaged the ways files are."""
    a = photo("coffee", 150, 220)
    files = {fmt: encode(a, fmt) for fmt in ("JPEG", "PNG", "WEBP", "GIF", "TIFF", "BMP")}
    files["WEBP-lossless"] = encode(a, "WEBP", lossless=True)
    out = {}
    for name, data in files.items():
        for f in (0.5, 0.9):
            out[f"{name}-truncated-{int(f * 100)}%"] = data[: int(len(data) * f)]
        if name not in ("TIFF", "BMP"):  # formats whose end this rule knows
            out[f"{name}-bytes-after-the-end"] = data + b"trailing garbage"
    png = files["PNG"]
    idat = _png_chunk(png, b"IDAT")
    damaged = bytearray(png)
    damaged[idat + 8 + 40 : idat + 8 + 80] = bytes(40)  # zeros in the middle of the zlib stream
    out["PNG-IDAT-bad-CRC"] = bytes(damaged)
    length = struct.unpack(">I", png[idat : idat + 4])[0]
    damaged[idat + 8 + length : idat + 12 + length] = struct.pack(">I", zlib.crc32(bytes(damaged[idat + 4 : idat + 8 + length])))
    out["PNG-IDAT-damaged-zlib"] = bytes(damaged)  # the CRC matches: the decoder must see the damage
    out["PNG-no-IEND"] = png[:-12]
    out["PNG-IEND-CRC-cut"] = png[:-1]
    out["GIF-no-trailer"] = files["GIF"][:-1]
    jpeg = files["JPEG"]
    out["JPEG-no-EOI"] = jpeg[:-2]
    return out


@pytest.mark.parametrize("exif", [True, False])
@pytest.mark.parametrize("color", ["rgb", "gray"])
async def test_truncated_and_damaged_files_are_decode_errors(make_executor, jpeg_decoder, exif, color):
    bad = damaged_files()
    good = encode(photo("chelsea", 60, 90))
    samples = [sample(0, good)] + [sample(i + 1, d) for i, d in enumerate(bad.values())] + [sample(999, good)]
    for s, name in zip(samples[1:], bad):
        s.key = name
    for pipeline in (Pipeline([Decode(color=color, exif=exif)]), Pipeline([Decode(color=color, exif=exif), RandomResizedCrop(32)])):
        out = await make_executor(pipeline).run(batch(samples))
        assert out.kept == [0, len(samples) - 1], [samples[r].key for r in out.kept]
        for row, err in out.failures:
            assert type(err) is DecodeError, (samples[row].key, err)
            assert (err.key, err.source) == (samples[row].key, samples[row].source)


async def test_padding_after_the_end_is_allowed(make_executor, jpeg_decoder):
    """Zero bytes after the end (some cameras pad files to a block size) are not damage."""
    a = photo("rocket", 40, 60)
    formats = ("JPEG", "PNG", "WEBP", "GIF")
    datas = [encode(a, fmt) for fmt in formats]
    plain = await run_list(make_executor, Pipeline([Decode()]), datas)
    padded = await run_list(make_executor, Pipeline([Decode()]), [d + bytes(13) for d in datas])
    for fmt, x, y in zip(formats, plain, padded):
        assert torch.equal(x, y), fmt


# --- odd modes: pixels or a DecodeError, nothing else ------------------------------------------


def odd_mode_files(rng) -> dict[str, bytes]:
    """Files in the modes Pillow opens that are not plain RGB or L."""
    rgb = Image.fromarray(random_image(rng, 20, 30))
    g16 = rng.integers(0, 65536, (20, 30)).astype(np.uint16)
    images = {
        "I;16 PNG": (Image.fromarray(g16), "PNG"),
        "I;16 TIFF": (Image.fromarray(g16), "TIFF"),
        "F TIFF": (Image.fromarray(g16.astype(np.float32) / 7.0), "TIFF"),
        "I TIFF": (Image.fromarray(g16.astype(np.int32) - 30000), "TIFF"),
        "1 PNG": (Image.fromarray(g16 > 30000), "PNG"),
        "1 TIFF": (Image.fromarray(g16 > 30000), "TIFF"),
        "CMYK JPEG": (rgb.convert("CMYK"), "JPEG"),
        "CMYK TIFF": (rgb.convert("CMYK"), "TIFF"),
        "LA PNG": (rgb.convert("LA"), "PNG"),
        "RGBA TIFF": (rgb.convert("RGBA"), "TIFF"),
        "YCbCr TIFF": (rgb.convert("YCbCr"), "TIFF"),
        "LAB TIFF": (rgb.convert("LAB"), "TIFF"),
    }
    pal = Image.fromarray(rng.integers(0, 256, (20, 30), dtype=np.uint8), "L").convert("P")
    pal.putpalette([255, 0, 0, 0, 255, 0])  # two colours, indices up to 255
    images["P PNG, short palette"] = (pal, "PNG")
    pa = pal.convert("PA")
    images["PA TIFF"] = (pa, "TIFF")
    out = {}
    for name, (img, fmt) in images.items():
        buf = io.BytesIO()
        img.save(buf, fmt)
        out[name] = buf.getvalue()
    return out


@pytest.mark.parametrize("color", ["rgb", "gray"])
async def test_odd_modes_decode_or_fail_typed(make_executor, rng, color):
    files = odd_mode_files(rng)
    samples = [sample(i, d) for i, d in enumerate(files.values())]
    out = await make_executor(Pipeline([Decode(color=color), Resize(16)], layout="HWC")).run(batch(samples))
    channels = 3 if color == "rgb" else 1
    for img in out.data["image"]:
        assert img.dtype == torch.uint8 and img.shape[2] == channels and min(img.shape[:2]) == 16
    for row, err in out.failures:
        assert type(err) is DecodeError and err.key == samples[row].key, (list(files)[row], err)
    failed = {list(files)[row] for row, _ in out.failures}
    # Pillow converts every other mode; LAB has no luma conversion, and some Pillow builds (the GPU
    # machine's) cannot read YCbCr TIFFs: those fail typed, which is what this test is about.
    assert failed <= {"LAB TIFF", "YCbCr TIFF"}, failed
    assert sorted(out.kept + [row for row, _ in out.failures]) == list(range(len(files)))  # each sample once


def test_jpeg_exif_behind_large_application_segments():
    """The Exif APP1 is found behind other application segments of any size (a 60 KB ICC-like APP2,
    a JFIF APP0); one placed after the tables (not where the standard puts it) is not read."""
    from headrace.ops._exif import jpeg_orientation, orientation

    a = random_image(np.random.default_rng(5), 16, 24)
    data = with_orientation(a, 6)
    app2 = b"\xff\xe2" + struct.pack(">H", 60002) + bytes(60000)
    behind = data[:2] + app2 + app2 + data[2:]
    assert jpeg_orientation(behind) == orientation(behind) == orientation(memoryview(behind)) == 6
    assert np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(behind)))).shape[:2] == (24, 16)  # Pillow agrees
    exif_at = data.index(b"\xff\xe1")
    exif_len = struct.unpack(">H", data[exif_at + 2 : exif_at + 4])[0] + 2
    segment, rest = data[exif_at : exif_at + exif_len], data[:exif_at] + data[exif_at + exif_len :]
    dqt = rest.index(b"\xff\xdb")
    late = rest[: dqt + 4 + struct.unpack(">H", rest[dqt + 2 : dqt + 4])[0] - 2] + segment
    late += rest[len(late) - len(segment) :]
    assert Image.open(io.BytesIO(late)).size == (24, 16) and jpeg_orientation(late) == 1
