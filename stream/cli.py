"""The ``headrace`` command line.

``headrace demo`` makes a small JPEG data set (once; cached under ``--data``) and runs a few
training-style epochs over it, printing images/s per epoch. ``python -m headrace demo`` is the same.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

__all__ = ["main"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace", description="An asyncio streaming data loader for deep learning.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="make a small JPEG data set and time a few training epochs over it")
    demo.add_argument("--data", default=os.path.join(".data", "demo"), help="data set folder (default: %(default)s)")
    demo.add_argument("--images", type=_positive, default=1024, help="images in the data set (default: %(default)s)")
    demo.add_argument("--classes", type=_positive, default=10, help=argparse.SUPPRESS)
    demo.add_argument("--epochs", type=_positive, default=2, help="epochs to run (default: %(default)s)")
    demo.add_argument("--batch-size", type=_positive, default=64, help="batch size (default: %(default)s)")
    demo.add_argument("--threads", type=_positive, default=None, help="decode/transform threads (default: all cores)")
    demo.add_argument("--size", type=_positive, default=224, help="output side in pixels (default: %(default)s)")
    return parser


def _version() -> str:
    from headrace import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:
            return _demo(args)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
    parser.print_help()
    return 2


def _demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from headrace import datasets

    root = os.path.abspath(args.data)
    if datasets.count_images(root) != args.images:
        with tqdm(total=args.images, desc=f"making {args.images} JPEGs", unit="img") as bar:
            datasets.ensure_image_folder(root, count=args.images, classes=args.classes, progress=bar.update)
    else:
        print(f"data: {args.images} JPEGs in {root} (cached)")
    from headrace import new_event_loop

    loop = new_event_loop()
    try:
        rates = loop.run_until_complete(_epochs(root, args))
    finally:
        loop.close()
    total = sum(n for n, _ in rates) / sum(t for _, t in rates)
    print(f"throughput: {total:,.0f} images/s over {args.epochs} epoch(s)"
          f"{'' if len(rates) < 2 else f'; after the first epoch {_rate(rates[1:]):,.0f} images/s'}")
    return 0


def _rate(rates: list[tuple[int, float]]) -> float:
    return sum(n for n, _ in rates) / sum(t for _, t in rates)


async def _epochs(root: str, args: argparse.Namespace) -> list[tuple[int, float]]:
    from tqdm import tqdm

    import headrace
    from headrace import ops, readers

    loader = headrace.Loader(
        readers.files(root, shuffle=True),
        batch_size=args.batch_size,
        pipeline=ops.training(args.size),
        num_threads=args.threads,
    )
    print(f"loader: {len(loader.reader)} images, batch {args.batch_size}, {loader.num_threads} threads, "
          f"decode → random resized crop {args.size} → flip → normalize (float32 NCHW)")
    rates = []
    async with loader:
        for epoch in range(args.epochs):
            images = 0
            with tqdm(total=len(loader.reader), desc=f"epoch {epoch}", unit="img", leave=False) as bar:
                start = time.perf_counter()
                async for batch in loader:
                    n = batch["image"].shape[0]
                    images += n
                    bar.update(n)
                elapsed = time.perf_counter() - start
            rates.append((images, elapsed))
            print(f"epoch {epoch}: {images} images in {elapsed:.2f} s, {images / elapsed:,.0f} images/s")
    return rates


if __name__ == "__main__":
    sys.exit(main())
