"""Image-caption pairs from WebDataset shards, with a tokenizer of your own as a pipeline stage.

    python examples/captions.py --device cpu                     # the tokenizer as a plain function (in threads)
    python examples/captions.py --device cpu --async-tokenizer   # as an async def (on the event loop)
    python examples/captions.py --device cuda --images 4096 --batch-size 256

The example writes its own shards first (``--data``, default ``.data/captions``): each sample is a
small JPEG of a coloured shape (``.jpg``), a caption that says what it shows (``.txt``: "a red
circle on a grey background") and the shape's class (``.cls``), the layout of most caption data
sets (LAION, CC3M, COYO as webdataset shards).

The tokenizer is an ``ops.Map`` before ``Decode``: it gets each sample's fields (the caption as
UTF-8 bytes) and returns them with ``tokens`` (byte-level ids, padded to ``--max-len``) and
``length``. ``Pipeline(fields=["tokens", "length"])`` hands both out beside the image: a batch
has ``image`` [B, 3, S, S], ``label`` [B], ``tokens`` int64 [B, max_len] and ``length`` int64 [B],
on the GPU with ``--device cuda``. With ``--async-tokenizer`` it is an ``async def`` that first
awaits a simulated remote call (``--latency`` seconds, as a tokenizer service or a caption
database would take), at most ``--concurrency`` at once.

At the end the example decodes every batch's tokens back to text and checks each against the
caption it wrote for that sample's key, then prints one ``done:`` line with the counts.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import io
import tarfile
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

import headrace
from headrace import ops, readers

SHAPES = ("square", "circle", "triangle", "stripe")
COLOURS = {"red": (200, 40, 40), "green": (40, 170, 60), "blue": (40, 70, 200), "yellow": (230, 210, 50),
           "grey": (128, 128, 128), "white": (245, 245, 245), "black": (15, 15, 15), "purple": (130, 50, 160)}

# The byte-level tokenizer: three special ids, then one id per UTF-8 byte (no vocabulary file).
PAD, BOS, EOS = 0, 1, 2
OFFSET = 3


def tokenize_text(text: bytes, max_len: int) -> tuple[np.ndarray, int]:
    """``text`` as ``[BOS, bytes..., EOS]`` ids, cut to ``max_len`` and padded with PAD; and the length."""
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.int64) + OFFSET
    ids = np.concatenate([[BOS], ids[: max_len - 2], [EOS]])
    out = np.full(max_len, PAD, dtype=np.int64)
    out[: len(ids)] = ids
    return out, len(ids)


def detokenize(ids: list[int]) -> str:
    return bytes(i - OFFSET for i in ids if i >= OFFSET).decode("utf-8")


def make_tokenizer(max_len: int):
    """The sync stage: fields in, fields out. It runs in the loader's threads, a batch's samples
    spread over them; NumPy releases the GIL for little here, which is fine for a tokenizer this cheap."""

    def tokenize(fields: dict) -> dict:
        fields["tokens"], fields["length"] = tokenize_text(bytes(fields["txt"]), max_len)
        return fields

    return tokenize


def make_remote_tokenizer(max_len: int, latency: float):
    """The async stage: the same result after awaiting a (simulated) service. It runs on the event
    loop, at most ``concurrency`` calls at once across the batches in flight."""

    async def tokenize_remote(fields: dict) -> dict:
        await asyncio.sleep(latency)  # a round trip to a tokenizer service or a caption store
        fields["tokens"], fields["length"] = tokenize_text(bytes(fields["txt"]), max_len)
        return fields

    return tokenize_remote


# -- the data set ----------------------------------------------------------------------------------------


def draw_sample(rng: np.random.Generator) -> tuple[bytes, str, int]:
    """A JPEG of one coloured shape on a background, the caption saying so, and the shape's class."""
    names = list(COLOURS)
    back, front = rng.choice(len(names), size=2, replace=False)
    shape = int(rng.integers(len(SHAPES)))
    w, h = int(rng.integers(80, 160)), int(rng.integers(80, 160))
    img = Image.new("RGB", (w, h), COLOURS[names[back]])
    draw = ImageDraw.Draw(img)
    box = (w // 5, h // 5, w - w // 5, h - h // 5)
    fill = COLOURS[names[front]]
    if SHAPES[shape] == "square":
        draw.rectangle(box, fill=fill)
    elif SHAPES[shape] == "circle":
        draw.ellipse(box, fill=fill)
    elif SHAPES[shape] == "triangle":
        draw.polygon([(w // 2, box[1]), (box[0], box[3]), (box[2], box[3])], fill=fill)
    else:
        draw.rectangle((0, h // 3, w, 2 * h // 3), fill=fill)
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    caption = f"a {names[front]} {SHAPES[shape]} on a {names[back]} background"
    return buf.getvalue(), caption, shape


def write_shards(folder: Path, images: int, per_shard: int, seed: int) -> tuple[list[str], list[int], dict[str, str]]:
    """WebDataset shards ``folder/captions-NNNNNN.tar`` of ``KEY.jpg``, ``KEY.txt``, ``KEY.cls``;
    returns the shard paths, their sample counts and every key's caption."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("captions-*.tar"):  # only files this example writes
        old.unlink()
    rng = np.random.default_rng(seed)
    paths, counts, captions = [], [], {}
    for first in range(0, images, per_shard):
        path = folder / f"captions-{first // per_shard:06d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(first, min(images, first + per_shard)):
                key = f"{i:06d}"
                jpeg, caption, shape = draw_sample(rng)
                captions[key] = caption
                for ext, data in (("jpg", jpeg), ("txt", caption.encode()), ("cls", str(shape).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(str(path))
        counts.append(min(images, first + per_shard) - first)
    return paths, counts, captions


# -- the run ---------------------------------------------------------------------------------------------


def make_loader(args: argparse.Namespace, shards: list[str], counts: list[int]) -> headrace.Loader:
    if args.async_tokenizer:
        stage = ops.Map(make_remote_tokenizer(args.max_len, args.latency), concurrency=args.concurrency)
    else:
        stage = ops.Map(make_tokenizer(args.max_len))
    pipeline = ops.Pipeline(
        [stage, ops.Decode(), ops.RandomResizedCrop(args.size, scale=(0.5, 1.0)), ops.Flip(), ops.Normalize()],
        fields=["tokens", "length"],  # the stage's fields, handed out beside image and label
    )
    reader = readers.webdataset(shards, counts=counts, shuffle=True, shuffle_buffer=64)
    return headrace.Loader(reader, batch_size=args.batch_size, pipeline=pipeline, device=args.device,
                           num_threads=args.threads, seed=args.seed)


async def run(args: argparse.Namespace) -> None:
    shards, counts, captions = write_shards(Path(args.data), args.images, args.per_shard, args.seed)
    print(f"wrote {len(shards)} shards of jpg + txt + cls ({args.images} samples) in {args.data}")
    loader = make_loader(args, shards, counts)
    checked = samples = batches = 0
    shapes: dict[str, tuple] = {}
    async with loader:
        for epoch in range(args.epochs):
            start, seen = time.perf_counter(), 0
            async for batch in loader:
                tokens, lengths = batch["tokens"].cpu(), batch["length"].cpu()
                for key, ids, n, label in zip(batch.sample_keys, tokens.tolist(), lengths.tolist(), batch["label"].tolist()):
                    text = detokenize(ids[:n])
                    if text != captions[key][: args.max_len - 2] or SHAPES[label] not in captions[key]:
                        raise SystemExit(f"sample {key}: tokens say {text!r}, label {label}; wrote {captions[key]!r}")
                    checked += 1
                shapes = {name: tuple(batch[name].shape) for name in ("image", "label", "tokens", "length")}
                seen += len(batch.sample_keys)
                batches += 1
            samples += seen
            rate = seen / (time.perf_counter() - start)
            print(f"epoch {epoch}: {seen} samples, {rate:,.0f} samples/s; batch {shapes}")
        device = batch["image"].device
    first = next(iter(captions))
    ids, n = tokenize_text(captions[first].encode(), args.max_len)
    print(f"sample {first}: {captions[first]!r} -> {ids[:8].tolist()}... ({n} tokens)")
    stage = "async" if args.async_tokenizer else "sync"
    print(f"done: epochs={args.epochs} samples={samples} batches={batches} captions_checked={checked} "
          f"stage={stage} device={device.type} tokens={shapes['tokens']} image={shapes['image']}")



def refuse_cuda_without_gpu(device: str) -> None:
    """Say in one line that a GPU run cannot start here, rather than a traceback from inside the loader."""
    if device.startswith("cuda") and not ops.cuda_available():
        sys.exit(f"--device {device} needs a CUDA GPU with CuPy and nvImageCodec (pip install '.[cuda12]' or "
                 "'.[cuda13]'); none here: run with --device cpu")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Caption shards with a tokenizer stage (sync or async).")
    p.add_argument("--data", default=".data/captions", help="where the shards are written (default: %(default)s)")
    p.add_argument("--images", type=int, default=512)
    p.add_argument("--per-shard", type=int, default=128, help="samples per shard")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--size", type=int, default=64, help="crop side in pixels")
    p.add_argument("--max-len", type=int, default=64, help="token ids per caption, padded or cut")
    p.add_argument("--async-tokenizer", action="store_true", help="the tokenizer as an async def stage")
    p.add_argument("--latency", type=float, default=0.002, help="seconds the async stage awaits per sample")
    p.add_argument("--concurrency", type=int, default=64, help="async calls at once")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="loader threads (default: all cores)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    refuse_cuda_without_gpu(args.device)
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
