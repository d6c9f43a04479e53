"""Real test data made in memory: photograph-like JPEGs and tar archives (shared by the test folders).

A plain module, not a conftest: tests import it by name (pytest puts ``tests/`` on ``sys.path``
when it loads ``tests/conftest.py``).
"""

from __future__ import annotations

import io
import struct
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image

__all__ = ["INSTANCE_COLOURS", "frame_index", "instance_scenes", "jpeg_bytes", "make_folder", "make_video",
           "recordio_record", "tar_bytes", "video_batches", "white_rectangles", "write_recordio"]


def white_rectangles(folder: Path, sizes: list[tuple[int, int]], fmt: str = "png") -> tuple[list[str], list[dict]]:
    """One image per (height, width), black with one white rectangle at a random place, written to
    ``folder/<i>.<fmt>``; and each one's fields: its box (x0, y0, x1, y1) and a label, ``i``."""
    rng = np.random.default_rng(1)
    paths, extra = [], []
    for i, (h, w) in enumerate(sizes):
        x0, y0 = int(rng.integers(0, w // 2)), int(rng.integers(0, h // 2))
        x1, y1 = int(rng.integers(x0 + 12, w + 1)), int(rng.integers(y0 + 12, h + 1))
        pixels = np.zeros((h, w, 3), np.uint8)
        pixels[y0:y1, x0:x1] = 255
        Image.fromarray(pixels).save(folder / f"{i}.{fmt}", quality=95)
        paths.append(str(folder / f"{i}.{fmt}"))
        extra.append({"boxes": np.array([[x0, y0, x1, y1]], np.float32), "labels": np.array([i])})
    return paths, extra


INSTANCE_COLOURS = np.array([[0, 0, 0], [250, 30, 30], [30, 250, 30], [30, 30, 250]], np.uint8)  # by label 0..3


def instance_scenes(folder: Path, sizes: list[tuple[int, int]], fmt: str = "png", seed: int = 4
                    ) -> tuple[list[str], list[dict]]:
    """One image per (height, width), ``folder/<i>.<fmt>``, with ``i % 5`` instances (so some have
    none): rectangles and ellipses, some overlapping, each drawn in its label's colour
    (``INSTANCE_COLOURS``), later over earlier. And each one's fields: ``masks`` uint8 ``[N, H, W]``
    (0 and 1), ``boxes`` (each mask's bounds, x0, y0, x1, y1), ``labels`` (1..3) and ``ids`` (0..N-1,
    to follow the rows through a pipeline that drops some)."""
    rng = np.random.default_rng(seed)
    paths, extra = [], []
    for i, (h, w) in enumerate(sizes):
        masks = np.zeros((i % 5, h, w), np.uint8)
        yy, xx = np.mgrid[:h, :w]
        for k in range(len(masks)):
            y0, x0 = int(rng.integers(0, h - 10)), int(rng.integers(0, w - 10))
            y1, x1 = int(rng.integers(y0 + 8, h + 1)), int(rng.integers(x0 + 8, w + 1))
            if k % 2:
                cy, cx, ry, rx = (y0 + y1) / 2, (x0 + x1) / 2, (y1 - y0) / 2, (x1 - x0) / 2
                masks[k] = ((yy + 0.5 - cy) / ry) ** 2 + ((xx + 0.5 - cx) / rx) ** 2 <= 1
            else:
                masks[k, y0:y1, x0:x1] = 1
        labels = rng.integers(1, 4, size=len(masks))
        classes = np.zeros((h, w), np.uint8)
        for m, label in zip(masks, labels):
            classes[m == 1] = label
        Image.fromarray(INSTANCE_COLOURS[classes]).save(folder / f"{i}.{fmt}", quality=95)
        paths.append(str(folder / f"{i}.{fmt}"))
        bounds = [[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1] for ys, xs in (np.nonzero(m) for m in masks)]
        extra.append({"boxes": np.array(bounds, np.float32).reshape(-1, 4), "labels": labels,
                      "ids": np.arange(len(masks)), "masks": masks})
    return paths, extra


def jpeg_bytes(rng: np.random.Generator, h: int, w: int, quality: int = 90) -> bytes:
    # Smooth colour field plus grain: compresses like a photograph, decodes deterministically.
    small = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.Resampling.BICUBIC)
    arr = np.clip(np.asarray(img).astype(np.int16) + rng.integers(-8, 9, size=(h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def jpeg_items(n: int, seed: int, height: int, width: int) -> list[dict]:
    """n samples of real JPEGs (``__key__`` s000..., ``jpg``, ``cls`` = i % 3), of sizes
    ``height + i % 7`` by ``width + i % 5``."""
    rng = np.random.default_rng(seed)
    return [{"__key__": f"s{i:03d}", "jpg": jpeg_bytes(rng, height + i % 7, width + i % 5), "cls": i % 3} for i in range(n)]


async def cropped_images(items: list[dict], *post, size: int, seed: int = 5, channels: int = 3,
                         shuffle: bool = True) -> dict:
    """Each sample's uint8 HWC image (by key, in the order the loader gave them) after Decode,
    ``RandomResizedCrop(size)`` and the ops ``post``, through a CPU Loader with 2 threads."""
    from headrace import Loader, ops, readers

    pipe = ops.Pipeline([ops.Decode("gray" if channels == 1 else "rgb"), ops.RandomResizedCrop(size), *post], layout="HWC")
    reader = readers.sequence(items, shuffle=True, seed=1) if shuffle else readers.sequence(items)
    async with Loader(reader, batch_size=16, pipeline=pipe, device="cpu", num_threads=2, seed=seed) as loader:
        return {key: image for b in [b async for b in loader] for key, image in zip(b.sample_keys, b["image"])}


async def check_seeded_post_op(make, *, changed: int) -> None:
    """A post op (``make()`` a fresh one) through ``cropped_images`` of 40 JPEGs: the same images
    for the same seed, uint8 HWC at 32 x 32, more than ``changed`` of them other for another seed
    and other than without it."""
    import torch

    items = jpeg_items(40, 53, 40, 44)
    plain = await cropped_images(items, size=32, seed=5)
    first = await cropped_images(items, make(), size=32, seed=5)
    second = await cropped_images(items, make(), size=32, seed=5)
    other = await cropped_images(items, make(), size=32, seed=6)
    assert first.keys() == plain.keys() and len(first) == 40
    assert all(image.shape == (32, 32, 3) and image.dtype == torch.uint8 for image in first.values())
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert sum(not torch.equal(first[k], other[k]) for k in first) > changed
    assert sum(not torch.equal(first[k], plain[k]) for k in first) > changed


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    """An uncompressed tar archive of ``(name, data)`` members, in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def make_folder(root: Path, classes: int, per_class: int, seed: int = 0) -> Path:
    """A class-per-folder tree ``root/c{class}/{i:04d}.jpg`` of JPEGs 40-120 px a side."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        d = root / f"c{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            h, w = int(rng.integers(40, 120)), int(rng.integers(40, 120))
            (d / f"{i:04d}.jpg").write_bytes(jpeg_bytes(rng, h, w))
    return root


def make_video(path, frames, *, codec="libx264", width=64, height=48, gop=8, rate=25, pts=None, faststart=False):
    """A video whose frame i has its top half's left side grey 8 + 16 * (i // 16) and right side
    8 + 16 * (i % 16) (``frame_index`` reads them back), and a fixed texture in its bottom half (so
    a crop's position can be found). ``pts``: each frame's timestamp in 1/1000 s (variable rate)."""
    from fractions import Fraction

    import av  # video is an optional extra: only the video tests need it

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    texture = np.random.default_rng(0).integers(0, 256, (height // 2 // 4, width // 4, 3), dtype=np.uint8)
    texture = texture.repeat(4, 0).repeat(4, 1)
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), "w", options=options) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.codec_context.gop_size = gop
        if pts is not None:
            stream.time_base = stream.codec_context.time_base = Fraction(1, 1000)
        for i in range(frames):
            image = np.empty((height, width, 3), np.uint8)
            image[: height // 2, : width // 2] = 8 + 16 * (i // 16)
            image[: height // 2, width // 2 :] = 8 + 16 * (i % 16)
            image[height // 2 :] = texture
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            if pts is not None:
                frame.pts = pts[i]
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path


def rotated_video(path, degrees: int, *, hflip: bool = False, width: int = 64, height: int = 48):
    """The frames of ``make_video(..., 16)`` stored with a display matrix: rotate by ``degrees``
    counter-clockwise (``hflip``: then mirror) to show them."""
    import av

    path = Path(path)
    with av.open(str(make_video(path.with_suffix(".plain.mp4"), 16, width=width, height=height))) as plain, \
            av.open(str(path), "w") as out:
        source = plain.streams.video[0]
        stream = out.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = source.width, source.height, "yuv420p"
        stream.codec_context.gop_size = 8
        stream.set_display_rotation(degrees, hflip=hflip)
        for frame in plain.decode(source):
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame.to_ndarray(format="rgb24"), format="rgb24")))
        out.mux(stream.encode())
    return path


def frame_index(frame: np.ndarray) -> int:
    """The index ``make_video`` wrote into an ``[H, W, C]`` (or ``[C, H, W]``) frame's top half."""
    if frame.shape[0] == 3:
        frame = frame.transpose(1, 2, 0)
    h, w = frame.shape[:2]
    top = np.asarray(frame[2 : h // 2 - 2], np.float64)
    hi, lo = top[:, 2 : w // 2 - 3].mean(), top[:, w // 2 + 3 : w - 2].mean()
    return int(round((hi - 8) / 16)) * 16 + int(round((lo - 8) / 16))


async def video_batches(reader) -> list:
    """Every batch of one epoch of ``reader`` through a small seeded video pipeline (batches of 3
    clips, 24x32 frames cropped to 16x16, random flips): what two readers of the same videos must
    agree on."""
    from headrace import Loader, ops

    loader = Loader(reader, batch_size=3, device="cpu", num_threads=2, seed=7,
                    pipeline=ops.video_pipeline(size=(24, 32), crop=(16, 16), flip=0.5))
    batches = [b async for b in loader]
    await loader.aclose()
    return batches


_RECORDIO_MAGIC = 0xCED7230A


def recordio_record(label, image: bytes, id_: int = 0) -> bytes:
    """An image record as ``mx.recordio.pack`` makes it (MXNet itself is not installable here):
    IRHeader (flag, label, id, id2), the extra labels where ``label`` is several, the image."""
    if np.ndim(label) == 0:
        return struct.pack("<IfQQ", 0, float(label), id_, 0) + image
    labels = np.asarray(label, np.float32)
    return struct.pack("<IfQQ", len(labels), 0.0, id_, 0) + labels.tobytes() + image


def write_recordio(path: Path, records: list[bytes], idx: bool = True) -> list[int]:
    """``records`` to a ``.rec`` file (and its ``.idx``) as dmlc-core's RecordIOWriter writes them:
    data holding the magic at a 4-byte boundary is written in parts (flags 1, 2..., 3) with the
    magic left out; each part padded to 4 bytes. Returns the records' offsets."""
    out, offsets = bytearray(), []
    magic = struct.pack("<I", _RECORDIO_MAGIC)
    for data in records:
        offsets.append(len(out))
        cuts = [i for i in range(0, len(data) - 3, 4) if data[i:i + 4] == magic]
        pieces, last = [], 0
        for cut in cuts:
            pieces.append(data[last:cut])
            last = cut + 4
        pieces.append(data[last:])
        for k, piece in enumerate(pieces):
            flag = 0 if len(pieces) == 1 else 1 if k == 0 else 3 if k == len(pieces) - 1 else 2
            out += struct.pack("<II", _RECORDIO_MAGIC, (flag << 29) | len(piece)) + piece + b"\0" * (-len(piece) % 4)
    path.write_bytes(bytes(out))
    if idx:
        path.with_suffix(".idx").write_text("".join(f"{k}\t{o}\n" for k, o in enumerate(offsets)))
    return offsets
