"""Fuzz the loader and the preprocessor with mutated real photographs; count what comes out.

A seeded corpus of damaged images (scikit-image's photographs, cropped and scaled, encoded as
JPEG, PNG and WebP, then mutated: bit flips, truncations, inserted and deleted bytes, header
fields, huge and thin claimed sizes, empty and text files, plus untouched controls) goes through
``headrace.Loader`` (``on_error="skip", max_errors=1.0``) and ``headrace.Preprocessor`` (one
``await pre(bytes)`` per input, all at once). Each slice of the corpus runs in a subprocess with
a timeout, so a crash (signal, nonzero exit), a hang (timeout) or a runaway allocation (over
``--rss-limit``, killed before the kernel's OOM killer takes the machine) is seen and counted,
and the next slice still runs.

Every input must come out exactly once: delivered as an image, or skipped with a typed
``headrace.LoaderError``. The run fails (exit status 1) on any untyped error, crash, hang, memory
kill, lost, duplicated, mislabelled or malformed sample.

    python examples/fuzz.py --count 3000                       # CPU, loader and preprocessor
    python examples/fuzz.py --count 20000 --device cuda --slice 1000 --json fuzz-gpu.json
    python examples/fuzz.py --seed 0 --dump 1234 --dump-dir /tmp/repro     # one input's bytes
    python examples/fuzz.py --diff cpu.json gpu.json      # same bytes, same verdict on both paths?

The same ``--seed`` gives the same bytes for every input index, whatever ``--count``: input
``i`` is made from ``numpy.random.default_rng([seed, i])`` alone, so a failure found in a large
run is reproduced by ``--dump i`` (its mutation kind and detail are in the table and the JSON).
Bytes are the same where Pillow's codecs (libjpeg, zlib, libwebp) are the same versions; between
machines a few percent differ, and ``--diff`` compares only the inputs whose bytes match.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import io
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

# --- the corpus ---------------------------------------------------------------------------------

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "camera", "cat", "immunohistochemistry",
          "hubble_deep_field", "colorwheel", "moon", "coins", "logo", "brick", "grass")

# Mutation kinds and their weights. The header edits and claimed sizes are what took the whole
# run down before (an 87 GiB decode workspace, a 12 GiB resize); the byte-level ones are classic.
KINDS: dict[str, int] = {
    "control": 6,          # untouched: must be delivered
    "bitflip": 14,         # 1-20 random bits flipped
    "overwrite": 8,        # 1-4 runs of random bytes written over the file
    "truncate": 8,         # cut at a random point
    "truncate_half": 4,    # cut at 50%
    "truncate_90": 4,      # cut at 90%
    "insert": 6,           # 1-64 random bytes inserted
    "delete": 6,           # 1-64 bytes deleted
    "header_only": 4,      # JPEG up to its scan data, PNG up to IHDR, WebP up to its frame header
    "magic_garbage": 3,    # the format's first bytes, then random bytes
    "jpeg_sof": 8,         # JPEG SOF height/width: 0, 1, 65535 or random
    "png_ihdr": 6,         # PNG IHDR width/height (CRC recomputed, so the header still parses)
    "png_idat": 3,         # PNG IDAT data damaged, CRC recomputed (only the zlib stream is wrong)
    "webp_size": 6,        # WebP VP8/VP8L/VP8X size fields
    "claim_huge": 4,       # the header claims 60000x60000 (WebP: 16383x16383, its largest)
    "claim_thin": 4,       # the header claims 32768x2, 2x32768, 1x65500 or 65500x1 (WebP: 16383 at most)
    "claim_large": 3,      # claims just under the default pixel limit (8192x8192, 16384x4096, ...): decoded
    "empty": 2,            # zero bytes
    "text": 2,             # a text file with an image extension
}
FORMAT_OF = {"jpeg_sof": "jpg", "png_ihdr": "png", "png_idat": "png", "webp_size": "webp"}
HUGE = (60000, 60000)
THIN = ((32768, 2), (2, 32768), (1, 65500), (65500, 1))
LARGE = ((8192, 8192), (16384, 4096), (4096, 16384), (6000, 6000))  # at most 2**26 pixels


@dataclass(frozen=True)
class FuzzInput:
    index: int
    kind: str
    ext: str  # jpg, png or webp: the file's extension, which the pipeline reads it by
    detail: str  # how it was made and mutated, enough to recognise it in a report
    data: bytes


_photo_cache: dict[str, np.ndarray] = {}


def _photo(name: str) -> np.ndarray:
    if name not in _photo_cache:
        import skimage.data

        _photo_cache[name] = np.ascontiguousarray(getattr(skimage.data, name)())
    return _photo_cache[name]


def _source_image(rng: np.random.Generator, sides: tuple[int, int]) -> tuple[Any, str]:
    """A random crop of a photograph, scaled so its shorter side is within ``sides``."""
    from PIL import Image

    name = PHOTOS[rng.integers(len(PHOTOS))]
    pixels = _photo(name)
    h, w = pixels.shape[:2]
    ch = int(rng.integers(min(h, 48), h + 1))
    cw = int(rng.integers(max(1, min(w, ch // 3)), min(w, 3 * ch) + 1))  # aspect within 1:3, sizes modest
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    image = Image.fromarray(pixels[y : y + ch, x : x + cw])
    short = int(rng.integers(sides[0], sides[1] + 1))
    scale = short / min(ch, cw)
    size = (max(1, round(cw * scale)), max(1, round(ch * scale)))
    return image.resize(size, Image.Resampling.BILINEAR), f"{name}[{y}:{y + ch},{x}:{x + cw}]->{size[0]}x{size[1]}"


def _encode(image: Any, ext: str, rng: np.random.Generator) -> tuple[bytes, str]:
    out = io.BytesIO()
    if ext == "jpg":
        image = image.convert("L" if image.mode == "L" else "RGB")
        quality, subsampling = int(rng.choice([30, 50, 75, 90, 95])), int(rng.choice([0, 2]))  # 4:4:4, 4:2:0
        progressive = bool(rng.random() < 0.3)
        image.save(out, "JPEG", quality=quality, subsampling=subsampling, progressive=progressive)
        how = f"jpeg q{quality} {'444' if subsampling == 0 else '420'}{' progressive' if progressive else ''}"
    elif ext == "png":
        image.save(out, "PNG", compress_level=int(rng.integers(1, 7)))
        how = f"png {image.mode}"
    else:
        image = image.convert("RGBA" if image.mode == "RGBA" else "RGB")
        lossless = bool(rng.random() < 0.3)
        quality = int(rng.choice([50, 80, 95]))
        image.save(out, "WEBP", lossless=lossless, quality=quality, method=0)
        how = f"webp {'lossless' if lossless else f'q{quality}'} {image.mode}"
    return out.getvalue(), how


def make_input(seed: int, index: int, sides: tuple[int, int] = (32, 256),
               kinds: tuple[str, ...] | None = None) -> FuzzInput:
    """Input ``index`` of the corpus for ``seed``: the same bytes every time, whatever else is made.

    ``kinds`` draws from those mutation kinds only (a batch full of large claims, say).
    """
    rng = np.random.default_rng([seed, index])
    names = list(kinds or KINDS)
    weights = np.array([KINDS[k] for k in names], dtype=float)
    kind = names[rng.choice(len(names), p=weights / weights.sum())]
    ext = FORMAT_OF.get(kind) or str(rng.choice(["jpg", "jpg", "png", "webp"]))
    if kind == "empty":
        return FuzzInput(index, kind, ext, "0 bytes", b"")
    if kind == "text":
        words = ["image", "decode", "header", "pixel", "batch", "lorem", "ipsum", "\n"]
        text = " ".join(str(rng.choice(words)) for _ in range(int(rng.integers(1, 400)))).encode()
        return FuzzInput(index, kind, ext, f"{len(text)} bytes of text", text)
    image, made = _source_image(rng, sides)
    data, how = _encode(image, ext, rng)
    data, what = MUTATIONS[kind](bytearray(data), ext, rng)
    return FuzzInput(index, kind, ext, f"{made}, {how}, {what}", bytes(data))


# --- mutations: each takes the encoded bytes, the format and the input's rng ---------------------


def _control(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
    return data, "untouched"


def _bitflip(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
    n = int(rng.integers(1, 21))
    for pos in rng.integers(0, len(data), n):
        data[pos] ^= 1 << int(rng.integers(8))
    return data, f"{n} bits flipped"


def _overwrite(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
    runs = []
    for _ in range(int(rng.integers(1, 5))):
        pos, n = int(rng.integers(0, len(data))), int(rng.integers(1, 33))
        data[pos : pos + n] = rng.bytes(len(data[pos : pos + n]))
        runs.append(f"{n}@{pos}")
    return data, "overwritten " + ",".join(runs)


def _truncate_at(fraction: float | None):
    def truncate(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
        cut = int(rng.integers(0, len(data))) if fraction is None else int(len(data) * fraction)
        return data[:cut], f"cut at {cut} of {len(data)}"

    return truncate


def _insert(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
    pos, n = int(rng.integers(0, len(data) + 1)), int(rng.integers(1, 65))
    data[pos:pos] = rng.bytes(n)
    return data, f"{n} bytes inserted at {pos}"


def _delete(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
    pos, n = int(rng.integers(0, len(data))), int(rng.integers(1, 65))
    del data[pos : pos + n]
    return data, f"{n} bytes deleted at {pos}"


def _magic_garbage(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
    keep = {"jpg": 4, "png": 16, "webp": 16}[ext]
    n = int(rng.integers(0, 4096))
    return data[:keep] + bytearray(rng.bytes(n)), f"first {keep} bytes, then {n} random"


def _header_only(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
    if ext == "jpg":
        sos = _jpeg_segment(data, {0xDA})
        end = sos + 2 + struct.unpack(">H", data[sos + 2 : sos + 4])[0] if sos else len(data) // 2
        return data[:end], f"cut after the SOS header at {end}"
    if ext == "png":
        return data[:33], "signature and IHDR only"
    return data[:30], "RIFF and the frame header only"


def _random_size(rng: np.random.Generator, limit: int) -> int:
    return int(rng.choice([0, 1, limit, int(rng.integers(2, limit)), int(rng.integers(2, 512))]))


def _jpeg_segment(data: bytearray, markers: set[int]) -> int | None:
    """Offset of the first segment whose marker is in ``markers`` (walks the segment lengths)."""
    pos = 2
    while pos + 4 <= len(data) and data[pos] == 0xFF:
        marker = data[pos + 1]
        if marker in markers:
            return pos
        if marker == 0xDA:  # scan data follows; nothing of interest after it
            return None
        pos += 2 + struct.unpack(">H", data[pos + 2 : pos + 4])[0]
    return None


SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


def _set_jpeg_size(data: bytearray, width: int, height: int) -> bool:
    sof = _jpeg_segment(data, SOF_MARKERS)
    if sof is None:
        return False
    struct.pack_into(">HH", data, sof + 5, height, width)
    return True


def _set_png_size(data: bytearray, width: int, height: int) -> bool:
    struct.pack_into(">II", data, 16, width, height)
    struct.pack_into(">I", data, 29, zlib.crc32(data[12:29]))
    return True


WEBP_MAX = (1 << 14) - 1  # a lossy frame's width and height are 14-bit fields


def _webp_chunks(data: bytearray) -> list[tuple[bytes, int]]:
    """(fourcc, offset of its data) of each chunk of a RIFF WebP file."""
    chunks, pos = [], 12
    while pos + 8 <= len(data):
        fourcc, size = bytes(data[pos : pos + 4]), struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        chunks.append((fourcc, pos + 8))
        pos += 8 + size + (size & 1)
    return chunks


def _set_webp_size(data: bytearray, width: int, height: int) -> bool:
    """The frame's size fields (and the VP8X canvas, when there is one), to the bits they hold."""
    done = False
    for fourcc, at in _webp_chunks(data):
        if fourcc == b"VP8X" and at + 10 <= len(data):
            data[at + 4 : at + 7] = (max(width - 1, 0) & 0xFFFFFF).to_bytes(3, "little")
            data[at + 7 : at + 10] = (max(height - 1, 0) & 0xFFFFFF).to_bytes(3, "little")
            done = True
        elif fourcc == b"VP8 " and at + 10 <= len(data):
            struct.pack_into("<HH", data, at + 6, width & WEBP_MAX, height & WEBP_MAX)
            done = True
        elif fourcc == b"VP8L" and at + 5 <= len(data):
            bits = struct.unpack("<I", data[at + 1 : at + 5])[0]
            bits = (bits & ~0xFFFFFFF) | ((width - 1) & 0x3FFF) | (((height - 1) & 0x3FFF) << 14)
            struct.pack_into("<I", data, at + 1, bits)
            done = True
    return done


SET_SIZE = {"jpg": _set_jpeg_size, "png": _set_png_size, "webp": _set_webp_size}


def _jpeg_sof(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
    width, height = _random_size(rng, 65535), _random_size(rng, 65535)
    ok = _set_jpeg_size(data, width, height)
    return data, f"SOF {width}x{height}" if ok else "no SOF found (untouched)"


def _png_ihdr(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
    width, height = _random_size(rng, 2**31 - 1), _random_size(rng, 2**31 - 1)
    _set_png_size(data, width, height)
    return data, f"IHDR {width}x{height}"


def _png_idat(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
    pos = 8
    while pos + 8 <= len(data):
        length, ctype = struct.unpack(">I4s", data[pos : pos + 8])
        if ctype == b"IDAT" and length > 2:
            start = pos + 8 + int(rng.integers(2, length))  # past the zlib header: the stream, not its flags
            n = min(int(rng.integers(1, 9)), pos + 8 + length - start)
            data[start : start + n] = rng.bytes(n)
            struct.pack_into(">I", data, pos + 8 + length, zlib.crc32(data[pos + 4 : pos + 8 + length]))
            return data, f"{n} IDAT bytes at {start} (CRC fixed)"
        pos += 12 + length
    return data, "no IDAT found (untouched)"


def _webp_size(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
    width, height = _random_size(rng, WEBP_MAX), _random_size(rng, WEBP_MAX)
    if any(fourcc == b"VP8X" for fourcc, _ in _webp_chunks(data)) and rng.random() < 0.5:
        width, height = _random_size(rng, 1 << 24), _random_size(rng, 1 << 24)  # the canvas holds 24 bits
    ok = _set_webp_size(data, width, height)
    return data, f"WebP size {width}x{height}" if ok else "no size field found (untouched)"


def _claim(sizes: tuple[tuple[int, int], ...]):
    def claim(data: bytearray, ext: str, rng: np.random.Generator) -> tuple[bytearray, str]:
        width, height = sizes[int(rng.integers(len(sizes)))]
        if ext == "webp":  # as large as a WebP frame can claim
            width, height = min(width, WEBP_MAX), min(height, WEBP_MAX)
        ok = SET_SIZE[ext](data, width, height)
        return data, f"claims {width}x{height}" if ok else "no size field found (untouched)"

    return claim


MUTATIONS = {
    "control": _control,
    "bitflip": _bitflip,
    "overwrite": _overwrite,
    "truncate": _truncate_at(None),
    "truncate_half": _truncate_at(0.5),
    "truncate_90": _truncate_at(0.9),
    "insert": _insert,
    "delete": _delete,
    "header_only": _header_only,
    "magic_garbage": _magic_garbage,
    "jpeg_sof": _jpeg_sof,
    "png_ihdr": _png_ihdr,
    "png_idat": _png_idat,
    "webp_size": _webp_size,
    "claim_huge": _claim((HUGE,)),
    "claim_thin": _claim(THIN),
    "claim_large": _claim(LARGE),
}
assert set(MUTATIONS) | {"empty", "text"} == set(KINDS)


def pillow_verdict(data: bytes, max_pixels: int = 2**22) -> str:
    """A reference: does Pillow decode these bytes whole, strictly (no truncated images)?

    Not the rule headrace must follow (that is stated in the README), but a second opinion: an
    input headrace delivers and Pillow refuses is worth a look (a damaged PNG decoded with zeroed
    rows was one). Claims over ``max_pixels`` are not decoded: "too large".
    """
    import warnings

    from PIL import Image, ImageFile

    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as image:
                if image.width * image.height > max_pixels:
                    return "too large"
                image.load()
        return "decodes"
    except Exception:  # noqa: BLE001 - any refusal is the answer
        return "refuses"


def file_name(index: int, ext: str) -> str:
    return f"{index:07d}.{ext}"


def write_corpus(folder: Path, seed: int, count: int, sides: tuple[int, int],
                 kinds: tuple[str, ...] | None = None, jobs: int = 1) -> list[dict[str, Any]]:
    """Write inputs 0..count-1 to ``folder``; returns the manifest (everything but the bytes).
    ``jobs`` processes make them (input i depends only on the seed and i, so the corpus is the same)."""
    if jobs > 1:
        step = max(1, -(-count // (jobs * 4)))
        spans = [(lo, min(lo + step, count)) for lo in range(0, count, step)]
        with concurrent.futures.ProcessPoolExecutor(jobs) as pool:
            parts = pool.map(_write_span, [(folder, seed, lo, hi, sides, kinds) for lo, hi in spans])
            manifest = [entry for part in parts for entry in part]
    else:
        manifest = _write_span((folder, seed, 0, count, sides, kinds))
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return manifest


def _write_span(job: tuple) -> list[dict[str, Any]]:
    folder, seed, lo, hi, sides, kinds = job
    manifest = []
    for i in range(lo, hi):
        item = make_input(seed, i, sides, kinds)
        (folder / file_name(i, item.ext)).write_bytes(item.data)
        manifest.append({"index": i, "kind": item.kind, "ext": item.ext, "bytes": len(item.data),
                         "detail": item.detail, "sha1": hashlib.sha1(item.data).hexdigest()[:16],
                         "pillow": pillow_verdict(item.data, 2**22)})
    return manifest


# --- the worker: one slice in a subprocess -------------------------------------------------------


def _pipeline(name: str, label: str | None) -> Any:
    from headrace import ops

    return (ops.training if name == "training" else ops.validation)(224, label=label)


def _label_of(index: int) -> int:
    return index % 1000


def _index_of(key: str) -> int:
    return int(os.path.basename(key))


class Progress:
    """What the worker is doing, in a file the parent reads when the worker dies or hangs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.state: dict[str, Any] = {}

    def set(self, **fields: Any) -> None:
        self.state.update(fields)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state))
        tmp.replace(self.path)


class GpuMemory:
    """Peak device memory in use (``mem_get_info``, every process's), sampled by a thread."""

    def __init__(self, device: str) -> None:
        import torch

        self.torch, self.device = torch, torch.device(device)
        torch.cuda.init()
        self.peak_used = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="fuzz:gpu-memory", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            free, total = self.torch.cuda.mem_get_info(self.device)
            self.peak_used = max(self.peak_used, total - free)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return {"gpu_peak_used": self.peak_used,
                "gpu_peak_allocated": self.torch.cuda.max_memory_allocated(self.device)}


def _untyped(exc: BaseException, phase: str, indices: list[int]) -> dict[str, Any]:
    frames = traceback.extract_tb(exc.__traceback__)
    leaves = list(exc.exceptions) if isinstance(exc, BaseExceptionGroup) else [exc]
    return {
        "phase": phase,
        "type": type(exc).__qualname__,
        "leaf_types": sorted({f"{type(e).__module__}.{type(e).__qualname__}" for e in leaves}),
        "message": str(exc)[:400],
        "notes": getattr(exc, "__notes__", [])[:4],
        "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-4:]],
        "indices": indices,
    }


def _typed_end(exc: BaseException, indices: list[int]) -> dict[str, Any]:
    cause = exc.__cause__
    return {"type": type(exc).__qualname__, "message": str(exc)[:400], "indices": indices,
            "cause": f"{type(cause).__qualname__}: {str(cause)[:300]}" if cause is not None else None}


def _check_batch(batch: Any, expected: list[int]) -> list[str]:
    """What is wrong with a delivered batch: its keys, labels, image shapes or pixels."""
    import torch

    problems = []
    got = [_index_of(k) for k in batch.sample_keys]
    if not set(got) <= set(expected):
        problems.append(f"batch {batch.index} holds inputs {sorted(set(got) - set(expected))} of other batches")
    if len(expected) - len(got) != batch.dropped:
        problems.append(f"batch {batch.index}: {len(expected)} inputs, {len(got)} delivered, dropped says {batch.dropped}")
    images = batch.data.get("image")
    if not isinstance(images, torch.Tensor) or tuple(images.shape) != (len(got), 3, 224, 224):
        shape = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        problems.append(f"batch {batch.index}: images {shape} for {len(got)} samples")
    elif not bool(torch.isfinite(images).all()):
        problems.append(f"batch {batch.index}: non-finite pixels")
    labels = batch.data.get("label")
    if labels is None or [int(v) for v in labels] != [_label_of(i) for i in got]:
        problems.append(f"batch {batch.index}: labels {None if labels is None else [int(v) for v in labels][:8]} "
                        f"for inputs {got[:8]}")
    return problems


def _blank_part(indices: list[int]) -> dict[str, Any]:
    return {"inputs": len(indices), "delivered": 0, "skipped": 0, "errors": {}, "untyped": [], "aborted": [],
            "duplicated": [], "problems": [], "verdicts": {}}


async def _run_loader(paths: list[str], indices: list[int], args: argparse.Namespace, progress: Progress) -> dict:
    """One epoch of a Loader over the files; every input is delivered once or skipped once."""
    import headrace
    from headrace import readers

    part = _blank_part(indices)
    size = args.batch_size

    def in_flight(first: int) -> list[int]:  # the batches a failure may come from: a prefetch ahead and more
        return indices[first * size : (first + 6) * size]

    progress.set(suspects=in_flight(0))
    delivered: list[int] = []
    loader = None
    batch_index = 0
    try:
        reader = readers.files(paths, [_label_of(i) for i in indices])
        loader = headrace.Loader(reader, batch_size=size, pipeline=_pipeline(args.pipeline, "cls"),
                                 device=args.device, on_error="skip", max_errors=1.0, seed=args.seed)
        async for batch in loader:
            delivered.extend(_index_of(k) for k in batch.sample_keys)
            part["problems"] += _check_batch(batch, indices[batch.index * size : (batch.index + 1) * size])
            batch_index = batch.index + 1
            progress.set(suspects=in_flight(batch_index))
    except headrace.LoaderError as exc:  # typed, but it ended the epoch: the rest of the slice is lost
        part["aborted"].append(_typed_end(exc, indices[batch_index * size : (batch_index + 1) * size]))
    except Exception as exc:  # noqa: BLE001 - exactly what the harness is here to count
        part["untyped"].append(_untyped(exc, "loader", indices[batch_index * size : (batch_index + 1) * size]))
    if loader is not None:
        try:
            await loader.aclose()
        except Exception as exc:  # noqa: BLE001
            part["untyped"].append(_untyped(exc, "loader.aclose", []))
        stats = loader.stats()
        part["skipped"] = stats.dropped
        errors = getattr(stats, "errors", None)  # counted by class once the loader keeps them
        part["errors"] = dict(errors) if errors is not None else {"(not counted by class)": stats.dropped}
    part["delivered"] = len(delivered)
    part["duplicated"] = sorted(i for i, n in Counter(delivered).items() if n > 1)
    part["verdicts"] = {i: "delivered" for i in delivered}
    return part


async def _run_preprocessor(paths: list[str], indices: list[int], args: argparse.Namespace,
                            progress: Progress) -> dict:
    """Every input as its own request, all at once; each answered with its image or a typed error."""
    import headrace
    import torch

    part = _blank_part(indices)
    errors: Counter[str] = Counter()
    verdicts: dict[int, str] = {}
    pending = set(indices)

    async def report_pending() -> None:  # if the worker dies or hangs, the suspects are the unanswered
        while True:
            progress.set(suspects=sorted(pending))
            await asyncio.sleep(0.2)

    async def one(pre: Any, i: int, data: bytes) -> None:
        try:
            await _answered(pre, i, data)
        finally:
            pending.discard(i)

    async def _answered(pre: Any, i: int, data: bytes) -> None:
        try:
            out = await pre(data, key=str(i))
        except headrace.LoaderError as exc:
            errors[type(exc).__qualname__] += 1
            verdicts[i] = type(exc).__qualname__
            return
        except Exception as exc:  # noqa: BLE001
            part["untyped"].append(_untyped(exc, "preprocessor", [i]))
            verdicts[i] = "untyped"
            return
        verdicts[i] = "delivered"
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (3, 224, 224):
            part["problems"].append(f"input {i}: output {type(out).__name__} {getattr(out, 'shape', None)}")
        elif not bool(torch.isfinite(out).all()):
            part["problems"].append(f"input {i}: non-finite pixels")

    datas = [Path(p).read_bytes() for p in paths]
    try:
        pre = headrace.Preprocessor(_pipeline(args.pipeline, None), device=args.device, max_batch=args.batch_size,
                                    seed=args.seed)
        ticker = asyncio.create_task(report_pending())
        try:
            async with pre:
                await asyncio.gather(*(one(pre, i, d) for i, d in zip(indices, datas)))
        finally:
            ticker.cancel()
    except Exception as exc:  # noqa: BLE001 - setup or close failed
        part["untyped"].append(_untyped(exc, "preprocessor (setup or close)", []))
    part["delivered"] = sum(v == "delivered" for v in verdicts.values())
    part["skipped"] = sum(errors.values())
    part["errors"] = dict(errors)
    part["verdicts"] = verdicts
    return part


RUNNERS = {"loader": _run_loader, "preprocessor": _run_preprocessor}


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    """One path over the worker's inputs: together, or (``--singles``) one at a time."""
    folder = Path(args.corpus)
    manifest = json.loads((folder / "manifest.json").read_text())
    indices = [int(v) for v in args.only.split(",")] if args.only else list(range(args.start, args.stop))
    progress = Progress(Path(args.progress))
    gpu = GpuMemory(args.device) if args.device.startswith("cuda") else None
    runner = RUNNERS[args.path]
    paths = {i: str(folder / file_name(i, manifest[i]["ext"])) for i in indices}
    t0 = time.perf_counter()
    if args.singles:
        report: dict[str, Any] = {"singles": {}}
        for i in indices:
            progress.set(current=i)
            part = asyncio.run(runner([paths[i]], [i], args, progress))
            report["singles"][i] = _single_verdict(part)
    else:
        report = asyncio.run(runner([paths[i] for i in indices], indices, args, progress))
    report["seconds"] = time.perf_counter() - t0
    report["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if gpu is not None:
        report.update(gpu.stop())
    return report


def _single_verdict(part: dict[str, Any]) -> str:
    if part["untyped"]:
        u = part["untyped"][0]
        return f"untyped {u['type']} {u['leaf_types']}: {u['message'][:160]} at {' <- '.join(reversed(u['where']))}"
    if part["aborted"]:
        a = part["aborted"][0]
        return f"epoch ended by {a['type']}: {a['message'][:160]} (cause {a['cause']})"
    if part["problems"]:
        return "wrong output: " + part["problems"][0]
    if part["delivered"]:
        return "delivered"
    return "skipped " + ",".join(part["errors"]) if part["skipped"] else "lost"


# --- the parent: slices, subprocesses, checks, the table ---------------------------------------


@dataclass
class WorkerRun:
    path: str
    start: int
    stop: int
    outcome: str  # "ok", "crash", "hang" or "memory"
    returncode: int | None
    seconds: float
    peak_rss: int
    report: dict[str, Any] | None
    progress: dict[str, Any]
    stderr_tail: str
    culprits: dict[int, str] = field(default_factory=dict)  # suspects run alone after a failure


def _read_hwm(pid: int) -> int:
    """The process's peak resident set (VmHWM), in bytes; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def run_worker_process(args: argparse.Namespace, corpus: Path, path: str, start: int, stop: int,
                       only: list[int] | None = None) -> WorkerRun:
    """A worker subprocess, watched: killed past ``--timeout`` (a hang) or ``--rss-limit`` (memory)."""
    progress_path = corpus / f"progress-{path}-{start}.json"
    progress_path.unlink(missing_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--path", path, "--corpus", str(corpus),
           "--start", str(start), "--stop", str(stop), "--progress", str(progress_path), "--seed", str(args.seed),
           "--device", args.device, "--pipeline", args.pipeline, "--batch-size", str(args.batch_size)]
    if only is not None:
        cmd += ["--singles", "--only", ",".join(map(str, only))]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        # Its own session, so a hang or a runaway allocation is ended with every thread and child.
        env = None
        if args.native_stacks:  # a crash prints the faulting thread's native stack (examples/native_stack.c)
            env = dict(os.environ, LD_PRELOAD=" ".join(filter(None, [os.environ.get("LD_PRELOAD"), args.native_stacks])))
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True, env=env)
        outcome, peak = "ok", 0
        while proc.poll() is None:
            peak = max(peak, _read_hwm(proc.pid))
            if peak > args.rss_limit:
                outcome = "memory"
            elif time.perf_counter() - t0 > args.timeout:
                outcome = "hang"
            if outcome == "hang":  # where its threads are: Python's stacks of every thread, to stderr
                os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(1.0)
            if outcome != "ok":
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.01)
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    report = None
    for line in reversed(stdout.splitlines()):
        if line.startswith("FUZZ-REPORT "):
            report = json.loads(line[len("FUZZ-REPORT ") :])
            break
    if outcome == "ok" and (proc.returncode != 0 or report is None):
        outcome = "crash"
    try:
        progress = json.loads(progress_path.read_text())
    except (OSError, ValueError):
        progress = {}
    if report is not None:
        peak = max(peak, report.get("peak_rss", 0))
    keep = 6000 if outcome == "ok" else 24000  # a hang's or a crash's thread stacks
    return WorkerRun(path, start, stop, outcome, proc.returncode, seconds, peak, report, progress, stderr[-keep:])


def isolate(args: argparse.Namespace, corpus: Path, path: str, suspects: list[int]) -> dict[int, str]:
    """Each suspect alone, in order; a worker that dies names the input it was on, the next goes on."""
    verdicts: dict[int, str] = {}
    todo = list(suspects)
    while todo:
        run = run_worker_process(args, corpus, path, todo[0], todo[-1] + 1, only=todo)
        if run.report is not None:
            verdicts.update({int(k): v for k, v in run.report["singles"].items()})
            break
        culprit = run.progress.get("current", todo[0])
        last = run.stderr_tail.strip().splitlines()[-1:] if run.outcome == "crash" else []
        verdicts[culprit] = (f"{run.outcome} (exit {run.returncode}, peak RSS {_gib(run.peak_rss)}, "
                             f"{run.seconds:.1f} s){': ' + last[0][:200] if last else ''}")
        todo = todo[todo.index(culprit) + 1 :] if culprit in todo else todo[1:]
    return verdicts


def _blank(paths: list[str]) -> dict[str, dict[str, Any]]:
    return {p: {"inputs": 0, "delivered": 0, "skipped": 0, "errors": Counter(), "untyped": [], "aborted": [],
                "duplicated": [], "problems": [], "crashes": [], "hangs": [], "memory": [], "lost": 0,
                "seconds": 0.0, "verdicts": {}, "completed": []} for p in paths}


def tally(runs: list[WorkerRun], paths: list[str], manifest: list[dict[str, Any]]) -> dict[str, Any]:
    """Per path: the sums over its workers, and every failure with the inputs it names."""
    totals = _blank(paths)
    for run in runs:
        t, n = totals[run.path], run.stop - run.start
        t["inputs"] += n
        t["seconds"] += run.seconds
        part = run.report
        if run.outcome != "ok":
            # Before its report, none of the slice is accounted for; after it (a thread that kept the
            # interpreter from exiting, a crash in teardown), the report stands and the failure too.
            key = {"hang": "hangs", "memory": "memory"}.get(run.outcome, "crashes")
            t[key].append({"slice": [run.start, run.stop], "returncode": run.returncode,
                           "seconds": round(run.seconds, 1), "peak_rss": run.peak_rss,
                           "after_report": part is not None,
                           "suspects": run.progress.get("suspects", []),
                           "stderr": run.stderr_tail[-24000:],
                           "culprits": run.culprits})
        if part is None:
            t["lost"] += n
            continue
        t["delivered"] += part["delivered"]
        t["skipped"] += part["skipped"]
        t["errors"].update(part["errors"])
        for name in ("untyped", "aborted"):
            for item in part[name]:
                item["kinds"] = sorted({manifest[i]["kind"] for i in item["indices"]})
                item["culprits"] = run.culprits
                t[name].append(item)
        t["duplicated"] += part["duplicated"]
        t["problems"] += part["problems"]
        t["verdicts"].update({int(k): v for k, v in part["verdicts"].items()})
        if not (part["aborted"] or any(u["phase"] == "loader" for u in part["untyped"])):
            t["completed"].append([run.start, run.stop])  # every input has its verdict
        # A request answered with an untyped error is accounted for (and counted as untyped); an
        # untyped error out of the loader ends its epoch, and what it had not delivered is lost.
        answered = sum(u["phase"] == "preprocessor" for u in part["untyped"])
        accounted = part["delivered"] + part["skipped"] + answered
        if accounted < n:
            t["lost"] += n - accounted
        elif part["delivered"] + part["skipped"] > n:
            t["problems"].append(f"slice {run.start}-{run.stop}: {accounted} delivered + skipped of {n} inputs")
    for t in totals.values():
        t["errors"] = dict(t["errors"])
        # Untouched photographs must come out: a refused control is a good sample lost.
        t["controls_refused"] = sorted(i for i in _completed(t) - _delivered(t) if manifest[i]["kind"] == "control")
    return totals


def failed(total: dict[str, Any]) -> bool:
    return bool(total["untyped"] or total["aborted"] or total["crashes"] or total["hangs"] or total["memory"]
                or total["lost"] or total["duplicated"] or total["problems"] or total["controls_refused"])


def _completed(total: dict[str, Any]) -> set[int]:
    return {i for start, stop in total["completed"] for i in range(start, stop)}


def _delivered(total: dict[str, Any]) -> set[int]:
    return {i for i, v in total["verdicts"].items() if v == "delivered"}


def disagreements(a: dict[str, Any], b: dict[str, Any]) -> list[int]:
    """Inputs one run of a path delivered and the other refused, among those both ran to the end."""
    both = _completed(a) & _completed(b)
    return sorted(i for i in both if (i in _delivered(a)) != (i in _delivered(b)))


def versus_pillow(total: dict[str, Any], manifest: list[dict[str, Any]]) -> dict[str, list[int]]:
    done, delivered = _completed(total), _delivered(total)
    return {
        "delivered, Pillow refuses": sorted(i for i in done & delivered if manifest[i]["pillow"] == "refuses"),
        "refused, Pillow decodes": sorted(i for i in done - delivered if manifest[i]["pillow"] == "decodes"),
    }


def compare(mine: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Per path, the inputs one run delivered and the other refused (the CPU's against the GPU's, say).

    Only inputs with the same bytes in both runs count: the same seed gives the same bytes where
    Pillow and its codecs (libjpeg, zlib, libwebp) are the same versions, and a few percent differ
    between machines where they are not.
    """
    same = ("seed", "sides", "kinds_drawn")
    if [theirs.get(k) for k in same] != [mine.get(k) for k in same]:
        raise SystemExit("compare: the runs were made with another --seed, --sides or --kinds")
    def same_bytes(a: dict[str, Any], b: dict[str, Any]) -> bool:
        key = ("kind", "bytes", "detail", *(("sha1",) if "sha1" in a and "sha1" in b else ()))
        return [a[k] for k in key] == [b[k] for k in key]

    equal = {a["index"] for a, b in zip(mine["manifest"], theirs["manifest"]) if same_bytes(a, b)}
    out: dict[str, Any] = {"comparable": len(equal), "paths": {}}
    for path, total in mine["paths"].items():
        other = theirs["paths"].get(path)
        if other is None:
            continue
        both = _completed(total) & _completed(other) & equal
        a, b = _delivered(total) & both, _delivered(other) & both
        out["paths"][path] = {"only_first": sorted(a - b), "only_second": sorted(b - a), "compared": len(both)}
    return out


def print_comparison(found: dict[str, Any], names: tuple[str, str], manifest: list[dict[str, Any]]) -> None:
    print(f"{found['comparable']} inputs with the same bytes in {names[0]} and {names[1]}")
    for path, diff in found["paths"].items():
        for side, name in (("only_first", names[0]), ("only_second", names[1])):
            indices = diff[side]
            kinds = dict(Counter(manifest[i]["kind"] for i in indices).most_common(6))
            print(f"{path}: delivered only by {name}: {len(indices)} of {diff['compared']} {kinds} e.g. {indices[:10]}")


def diff_runs(first: str, second: str) -> int:
    """``--diff A.json B.json``: the verdicts of two runs, compared; exit 1 when any differ."""
    a, b = (_load_result(p) for p in (first, second))
    found = compare(a, b)
    print_comparison(found, (first, second), a["manifest"])
    return 1 if any(d["only_first"] or d["only_second"] for d in found["paths"].values()) else 0


def _load_result(path: str) -> dict[str, Any]:
    result = json.loads(Path(path).read_text())
    for total in result["paths"].values():
        total["verdicts"] = {int(k): v for k, v in total["verdicts"].items()}
    return result


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _print_rows(rows: list[tuple[str, ...]]) -> None:
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(width[0]) if i == 0 else c.rjust(width[i]) for i, c in enumerate(r)))


def print_table(result: dict[str, Any]) -> None:
    paths = list(result["paths"])
    rows: list[tuple[str, ...]] = [("", *paths)]
    classes = sorted({c for p in paths for c in result["paths"][p]["errors"]})

    def row(name: str, fn: Any) -> None:
        rows.append((name, *(str(fn(result["paths"][p])) for p in paths)))

    row("inputs", lambda t: t["inputs"])
    row("delivered", lambda t: t["delivered"])
    row("skipped", lambda t: t["skipped"])
    for c in classes:
        row(f"  {c}", lambda t, c=c: t["errors"].get(c, 0))
    row("untyped errors", lambda t: len(t["untyped"]))
    row("epochs ended by a typed error", lambda t: len(t["aborted"]))
    row("crashes", lambda t: len(t["crashes"]))
    row("hangs", lambda t: len(t["hangs"]))
    row("killed over the RSS limit", lambda t: len(t["memory"]))
    row("lost", lambda t: t["lost"])
    row("duplicated", lambda t: len(t["duplicated"]))
    row("wrong batches/outputs", lambda t: len(t["problems"]))
    row("untouched controls refused", lambda t: len(t["controls_refused"]))
    row("seconds (workers)", lambda t: f"{t['seconds']:.1f}")
    _print_rows(rows)
    print(f"peak RSS of a worker: {_gib(result['peak_rss'])} (limit {_gib(result['rss_limit'])})")
    if result.get("gpu_peak_used") is not None:
        print(f"peak GPU memory: {_gib(result['gpu_peak_allocated'])} allocated by torch, "
              f"{_gib(result['gpu_peak_used'])} in use on the device")
    if result["disagree"]:
        print(f"delivered by one path and refused by the other: {len(result['disagree'])} inputs "
              f"{result['disagree'][:12]}")
    for path, found in result["versus_pillow"].items():
        for what, indices in found.items():
            if indices:
                kinds = Counter(result["manifest"][i]["kind"] for i in indices)
                print(f"{path}: {what}: {len(indices)} inputs {dict(kinds.most_common(6))}, e.g. {indices[:8]}")
    print(f"seconds: {result['seconds']:.1f} for {result['count']} inputs, {result['slices']} slices a path "
          f"(corpus {result['corpus_seconds']:.1f})")


def print_kinds(result: dict[str, Any], manifest: list[dict[str, Any]]) -> None:
    """Delivered of each mutation kind, per path, among the inputs its workers ran to the end."""
    paths = list(result["paths"])
    rows: list[tuple[str, ...]] = [("delivered / ran", *paths, "Pillow decodes (of all)")]
    for kind in KINDS:
        mine = [m["index"] for m in manifest if m["kind"] == kind]
        cells = []
        for p in paths:
            total = result["paths"][p]
            ran, delivered = _completed(total), _delivered(total)
            cells.append(f"{sum(i in delivered for i in mine)} / {sum(i in ran for i in mine)}")
        rows.append((f"  {kind}", *cells, str(sum(manifest[i]["pillow"] == "decodes" for i in mine))))
    _print_rows(rows)


def print_failures(result: dict[str, Any], manifest: list[dict[str, Any]]) -> None:
    seed = result["seed"]

    def culprits(item: dict[str, Any]) -> None:
        found = item.get("culprits", {})
        bad = {i: v for i, v in found.items() if v != "delivered" and not v.startswith("skipped")}
        if found and not bad:
            print(f"    its {len(found)} suspects, each alone, all came through: only together (or not among them)")
        for i, verdict in sorted(bad.items(), key=lambda kv: int(kv[0])):
            m = manifest[int(i)]
            print(f"    input {i} alone: {verdict}")
            print(f"      {m['kind']} ({m['detail']}); reproduce: --seed {seed} --dump {i}")

    for path, t in result["paths"].items():
        for label, items in (("untyped", t["untyped"]), ("epoch ended by", t["aborted"])):
            for u in items:
                leaves = f" of {', '.join(u['leaf_types'])}" if u.get("leaf_types") and "Group" in u["type"] else ""
                print(f"[{path}] {label} {u['type']}{leaves}: {u['message'][:200]}")
                if u.get("where"):
                    print(f"    at {' <- '.join(reversed(u['where']))}")
                print(f"    batch inputs {u['indices'][:12]}{'...' if len(u['indices']) > 12 else ''} kinds {u['kinds']}")
                culprits(u)
        for name in ("crashes", "hangs", "memory"):
            for c in t[name]:
                what = {"crashes": "crash", "hangs": "hang", "memory": "killed over the RSS limit"}[name]
                when = " after its report (at exit)" if c["after_report"] else ""
                print(f"[{path}] {what}{when} in slice {c['slice']} (exit {c['returncode']}, {c['seconds']} s, "
                      f"peak RSS {_gib(c['peak_rss'])})")
                if name == "hangs" or "Fatal Python error" in c["stderr"]:
                    for line in _stuck_in(c["stderr"]):
                        print("    " + line)
                if name == "hangs":
                    pass
                elif "=== native stack" in c["stderr"]:
                    for line in c["stderr"].split("=== native stack of the faulting thread ===")[-1].strip().splitlines()[:16]:
                        print("    " + line[:200])
                elif c["stderr"].strip():
                    print("    stderr: " + c["stderr"].strip().splitlines()[-1][:300])
                culprits(c)
        for p in t["problems"][:20]:
            print(f"[{path}] {p}")
        if t["duplicated"]:
            print(f"[{path}] duplicated inputs {t['duplicated'][:20]}")
        if t["controls_refused"]:
            print(f"[{path}] untouched controls refused: {t['controls_refused'][:20]}")


def _stuck_in(stderr: str) -> list[str]:
    """From a hung worker's thread dump (faulthandler): each thread and the innermost frame it was in."""
    out, thread = [], None
    for line in stderr.splitlines():
        line = line.strip()
        if line.startswith(("Thread 0x", "Current thread 0x")):
            thread = line.rstrip(" (most recent call first):")
        elif thread and line.startswith("File "):
            out.append(f"{thread}: {line}")
            thread = None
    return out or ["(no thread dump)"]


def _suspects(run: WorkerRun, limit: int) -> list[int]:
    if run.report is None:
        return run.progress.get("suspects", list(range(run.start, run.stop)))[:limit]
    named = sorted({i for item in run.report["untyped"] + run.report["aborted"] for i in item["indices"]})
    return named[:limit]


def _build_native_stack(where: Path) -> str:
    """examples/native_stack.c compiled into ``where``; the path of the library."""
    source = Path(__file__).with_name("native_stack.c")
    library = where / "native_stack.so"
    subprocess.run([os.environ.get("CC", "cc"), "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return str(library)


def run(args: argparse.Namespace) -> int:
    sides = tuple(int(v) for v in args.sides.split(","))
    with tempfile.TemporaryDirectory(prefix="headrace-fuzz-") as tmp:
        corpus = Path(args.corpus or tmp)
        corpus.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        if args.native_stacks:
            args.native_stacks = _build_native_stack(corpus)
        manifest = write_corpus(corpus, args.seed, args.count, sides, args.kinds, args.jobs)
        corpus_seconds = time.perf_counter() - t0
        runs = []
        slices = [(path, start) for start in range(0, args.count, args.slice) for path in args.paths]
        # ``--jobs`` workers at a time (each its own process, loader and, on the GPU, lanes).
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            done = list(pool.map(lambda job: run_worker_process(args, corpus, job[0], job[1],
                                                                min(job[1] + args.slice, args.count)), slices))
        for (path, start), w in zip(slices, done):
            bad = (w.outcome != "ok" and w.report is None) or (w.report and (w.report["untyped"] or w.report["aborted"]))
            suspects = _suspects(w, args.isolate) if bad else []
            if suspects:
                w.culprits = isolate(args, corpus, path, suspects)
            runs.append(w)
            if not args.quiet:
                print(f"{path} {w.start}-{w.stop}: {w.outcome} in {w.seconds:.1f} s, "
                      f"peak RSS {_gib(w.peak_rss)}{f', {len(suspects)} isolated' if suspects else ''}",
                      file=sys.stderr)
        totals = tally(runs, args.paths, manifest)
        reports = [r.report for r in runs if r.report]
        on_gpu = args.device.startswith("cuda")
        result = {
            "seed": args.seed, "count": args.count, "slice": args.slice, "slices": -(-args.count // args.slice),
            "sides": list(sides), "kinds_drawn": list(args.kinds or KINDS), "device": args.device, "pipeline": args.pipeline, "batch_size": args.batch_size,
            "paths": totals, "kinds": dict(Counter(m["kind"] for m in manifest)),
            "disagree": disagreements(*totals.values()) if len(totals) == 2 else [],
            "versus_pillow": {p: versus_pillow(t, manifest) for p, t in totals.items()},
            "peak_rss": max((r.peak_rss for r in runs), default=0), "rss_limit": args.rss_limit,
            "gpu_peak_used": max((r.get("gpu_peak_used", 0) for r in reports), default=0) if on_gpu else None,
            "gpu_peak_allocated": max((r.get("gpu_peak_allocated", 0) for r in reports), default=0) if on_gpu else None,
            "seconds": time.perf_counter() - t0, "corpus_seconds": corpus_seconds,
            "failed": any(failed(t) for t in totals.values()),
        }
        result["manifest"] = manifest
        print_table(result)
        if args.compare:
            result["compare"] = compare(result, _load_result(args.compare))
            print_comparison(result["compare"], ("this run", args.compare), manifest)
        if not args.quiet:
            print_kinds(result, manifest)
        print_failures(result, manifest)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 1 if result["failed"] else 0


def dump(args: argparse.Namespace) -> int:
    sides = tuple(int(v) for v in args.sides.split(","))
    out = Path(args.dump_dir)
    out.mkdir(parents=True, exist_ok=True)
    for i in args.dump:
        item = make_input(args.seed, i, sides, args.kinds)
        path = out / file_name(i, item.ext)
        path.write_bytes(item.data)
        print(f"{path}: {item.kind}: {item.detail} ({len(item.data)} bytes)")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=3000, help="inputs in the corpus")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slice", type=int, default=500, help="inputs per worker subprocess")
    p.add_argument("--jobs", type=int, default=1, help="worker subprocesses at a time (and corpus makers)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--pipeline", choices=["training", "validation"], default="training")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds a worker may take before it counts as hung")
    p.add_argument("--rss-limit", type=float, default=8.0, help="GiB a worker may hold before it is killed")
    p.add_argument("--paths", dest="paths_arg", choices=["loader", "preprocessor", "both"], default="both")
    p.add_argument("--sides", default="32,256", help="range of an image's shorter side, in pixels: MIN,MAX")
    p.add_argument("--kinds", help="comma-separated mutation kinds to draw from (default: all): "
                                   + ", ".join(KINDS))
    p.add_argument("--isolate", type=int, default=256,
                   help="after a failure, run up to this many suspect inputs one at a time to name the culprits (0: off)")
    p.add_argument("--json", help="write the full result here")
    p.add_argument("--compare", help="a --json file of another run (same --seed, --sides, --kinds): list the "
                                     "inputs one run delivered and the other refused (the CPU's against the GPU's)")
    p.add_argument("--corpus", help="folder for the corpus (kept); default a temporary one")
    p.add_argument("--diff", nargs=2, metavar=("A", "B"), help="compare the verdicts of two --json files and exit")
    p.add_argument("--dump", type=int, nargs="+", help="write these inputs to --dump-dir and exit")
    p.add_argument("--dump-dir", default="fuzz-inputs")
    p.add_argument("--quiet", action="store_true", help="no line per worker, no table by mutation kind")
    p.add_argument("--native-stacks", action="store_true",
                   help="preload examples/native_stack.c (compiled with cc) into the workers: a crash prints the "
                        "faulting thread's native stack, kept in the report")
    # The worker's own arguments (the parent passes them).
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", choices=list(RUNNERS), help=argparse.SUPPRESS)
    p.add_argument("--start", type=int, help=argparse.SUPPRESS)
    p.add_argument("--stop", type=int, help=argparse.SUPPRESS)
    p.add_argument("--progress", help=argparse.SUPPRESS)
    p.add_argument("--singles", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--only", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.paths = list(RUNNERS) if args.paths_arg == "both" else [args.paths_arg]
    args.rss_limit = int(args.rss_limit * 2**30)
    if args.kinds:
        args.kinds = tuple(k.strip() for k in args.kinds.split(","))
        unknown = set(args.kinds) - set(KINDS)
        if unknown:
            p.error(f"unknown --kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    return args


def refuse_cuda_without_gpu(device: str) -> None:
    """Say in one line that a GPU run cannot start here, rather than a traceback from inside the loader."""
    from headrace.ops import cuda_available

    if device.startswith("cuda") and not cuda_available():
        sys.exit(f"--device {device} needs a CUDA GPU with CuPy and nvImageCodec (pip install '.[cuda12]' or "
                 "'.[cuda13]'); none here")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for it when we hang
        # A crash dumps every Python thread (which lane, prep or reader thread was in native code),
        # then the previous handler runs (--native-stacks: the faulting thread's native stack).
        faulthandler.enable(all_threads=True)
        report = run_worker(args)
        print("FUZZ-REPORT " + json.dumps(report), flush=True)
        return 0
    if args.dump:
        return dump(args)
    if args.diff:
        return diff_runs(*args.diff)
    # Checked here, once: without it every worker would crash and be isolated input by input.
    refuse_cuda_without_gpu(args.device)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
