"""Training epochs streamed from object storage, with a local copy that later epochs read.

    python examples/stream_s3.py "s3://my-bucket/train-{0000..0127}.tar" --cache-dir /scratch/headrace
    python examples/stream_s3.py "https://host/data/train-{0..9}.tar" --epochs 3
    python examples/stream_s3.py                   # a store 50 ms away, on 127.0.0.1, serving demo shards

With a source, the standard AWS environment (``AWS_ENDPOINT_URL_S3`` for an S3-compatible store)
or ``--endpoint`` applies. Without one, the example makes the demo JPEGs (``.data/stream-s3``),
packs them into WebDataset shards and serves them as an S3 bucket from a child process on
127.0.0.1 that answers every GET 50 ms late and caps each connection at 100 MB/s (the test
suite's object server, as a real store behaves), so the first epoch streams at a store's pace and
the later ones read the copies ``cache_dir=`` kept. Each epoch prints its rate and what the cache
did; a last ``done:`` line sums it up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import headrace
from headrace import datasets, ops, readers

HERE = Path(__file__).resolve().parent
BUCKET = "headrace-demo"


@contextlib.contextmanager
def demo_store(folder: Path, images: int, per_shard: int, latency_ms: float) -> Iterator[str]:
    """Demo shards served as ``s3://headrace-demo/shards/...`` by a local store ``latency_ms`` away;
    yields the shards' pattern, the AWS environment set to reach it."""
    sys.path.insert(0, str(HERE.parent / "tests" / "readers"))
    from object_server import object_server

    serve = folder / f"serve-{images}-{per_shard}"
    shards = serve / "shards"
    if not shards.is_dir():
        images_folder = folder / "images"
        datasets.ensure_image_folder(images_folder, count=images, workers=os.cpu_count())
        readers.pack(images_folder, shards, format="webdataset", shard_count=per_shard, shuffle=True)
    names = sorted(p.name for p in shards.glob("*.tar"))
    with object_server(serve, BUCKET, latency_ms=latency_ms, mbps=100, max_connections=256) as url:
        os.environ.update(AWS_ACCESS_KEY_ID="demo", AWS_SECRET_ACCESS_KEY="demo", AWS_REGION="us-east-1",
                          AWS_ENDPOINT_URL_S3=url)
        yield f"s3://{BUCKET}/shards/{names[0][:-10]}{{{names[0][-10:-4]}..{names[-1][-10:-4]}}}.tar"


async def train(source: str, args: argparse.Namespace, cache_dir: str) -> None:
    options = {"endpoint": args.endpoint} if args.endpoint else None
    reader = readers.webdataset(source, shuffle=True, cache_dir=cache_dir, storage_options=options,
                                buffer_bytes=args.buffer_mb << 20)
    loader = headrace.Loader(reader, batch_size=args.batch_size, pipeline=ops.training(args.size),
                             device=args.device, num_threads=args.threads)
    samples = 0
    async with loader:
        for epoch in range(args.epochs):
            hits, kept, began, seen = reader.cache.hits, reader.cache.kept, time.perf_counter(), 0
            async for batch in loader:
                seen += batch.size  # a training step goes here
            seconds = time.perf_counter() - began
            samples += seen
            print(f"epoch {epoch}: {seen:,} images in {seconds:.2f} s, {seen / seconds:,.0f} images/s; "
                  f"shards read from the cache {reader.cache.hits - hits}, kept {reader.cache.kept - kept}")
    print(f"done: epochs={args.epochs} samples={samples} shards={len(reader.shards)} hits={reader.cache.hits} "
          f"kept={reader.cache.kept} failed={reader.cache.failed} device={loader.device}")



def refuse_cuda_without_gpu(device: str) -> None:
    """Say in one line that a GPU run cannot start here, rather than a traceback from inside the loader."""
    if device.startswith("cuda") and not ops.cuda_available():
        sys.exit(f"--device {device} needs a CUDA GPU with CuPy and nvImageCodec (pip install '.[cuda12]' or "
                 "'.[cuda13]'); none here: run with --device cpu")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?", help="shards: a pattern, folder or glob URL (default: a local demo store)")
    p.add_argument("--cache-dir", help="where shards are kept (default: a temporary folder, removed at the end)")
    p.add_argument("--endpoint", help="an S3-compatible endpoint (else AWS_ENDPOINT_URL_S3 or AWS's)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--size", type=int, default=224, help="crop side in pixels")
    p.add_argument("--buffer-mb", type=int, default=64, help="webdataset(buffer_bytes=) per download, MiB")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="loader threads (default: all cores)")
    p.add_argument("--data", default=".data/stream-s3", help="the demo's images and shards (default: %(default)s)")
    p.add_argument("--images", type=int, default=1024, help="demo images")
    p.add_argument("--per-shard", type=int, default=128, help="demo images per shard")
    p.add_argument("--latency-ms", type=float, default=50, help="the demo store's first-byte latency")
    args = p.parse_args(argv)
    refuse_cuda_without_gpu(args.device)
    with contextlib.ExitStack() as stack:
        cache_dir = args.cache_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="headrace-cache-"))
        source = args.source or stack.enter_context(demo_store(Path(args.data), args.images, args.per_shard,
                                                                args.latency_ms))
        print(f"streaming {source}, keeping shards in {cache_dir}")
        asyncio.run(train(source, args, cache_dir))


if __name__ == "__main__":
    main()
