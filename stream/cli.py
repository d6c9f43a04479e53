"""The ``headrace`` command line.

``headrace demo`` makes a small JPEG data set (once; cached under ``--data``) and runs a few
training-style epochs over it, printing images/s per epoch. ``python -m headrace demo`` is the same.

``headrace pack SRC DEST --format webdataset|lmdb`` packs a class-per-folder image tree into tar
shards (split by ``--shard-size`` MB and/or ``--shard-count`` samples) or an LMDB; ``--verify``
decodes each file first and refuses (``--verify=skip``: leaves out) those that do not decode.
``--video`` packs a tree of videos instead (their own bytes, into tar shards ``readers.video`` reads).

``headrace inspect PATH`` says what a data set holds (samples, classes, fields, image formats and
sizes, file or shard sizes); ``--verify`` decodes every image and lists the bad ones (``_inspect``).

``headrace bench PATH`` times, on any data set ``inspect`` takes, the reader alone, decode alone and
the whole pipeline (``--dataloader``: and torch's DataLoader on the same samples), and prints images/s
with the consumer's starved and the pipeline's blocked shares; ``--json`` and ``--plot`` write them
(``_bench``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence

__all__ = ["main"]


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _path(text: str) -> str:
    if not text:  # "" is the current folder to os and the readers: a "$DATA" left unset in a script
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="headrace", description="An asyncio streaming data loader for deep learning.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = sub.add_parser("demo", help="make a small JPEG data set and time a few training epochs over it")
    demo.add_argument("--data", type=_path, default=os.path.join(".data", "demo"), help="data set folder (default: %(default)s)")
    demo.add_argument("--images", type=_positive, default=1024, help="images in the data set (default: %(default)s)")
    demo.add_argument("--classes", type=_positive, default=10, help=argparse.SUPPRESS)
    demo.add_argument("--epochs", type=_positive, default=2, help="epochs to run (default: %(default)s)")
    demo.add_argument("--batch-size", type=_positive, default=64, help="batch size (default: %(default)s)")
    demo.add_argument("--threads", type=_positive, default=None, help="decode/transform threads (default: all cores)")
    demo.add_argument("--size", type=_positive, default=224, help="output side in pixels (default: %(default)s)")
    pack = sub.add_parser("pack", help="pack a class-per-folder image tree into WebDataset shards or an LMDB",
                          description="Pack SRC (class sub-folders of images; label = index of the sorted "
                                      "sub-folder) into DEST, a new or empty folder.")
    pack.add_argument("src", type=_path, metavar="SRC", help="folder of class sub-folders")
    pack.add_argument("dest", type=_path, metavar="DEST", help="output folder (must not exist, or be empty)")
    pack.add_argument("--format", required=True, choices=("webdataset", "lmdb"), help="output format")
    # None by default, so that one given with --format lmdb (where it means nothing) can be refused.
    pack.add_argument("--shard-size", type=_megabytes, default=None, metavar="MB",
                      help="webdataset: most megabytes per shard (default: 256; 0: no limit)")
    pack.add_argument("--shard-count", type=_positive, default=None, metavar="N",
                      help="webdataset: most samples per shard (default: no limit)")
    pack.add_argument("--prefix", default=None, help="webdataset: shard file name prefix (default: shard)")
    pack.add_argument("--shuffle", action="store_true", help="write the samples in a seeded random order")
    pack.add_argument("--seed", type=int, default=0, help="seed for --shuffle (default: %(default)s)")
    pack.add_argument("--verify", nargs="?", const="raise", default=None, choices=("raise", "skip"),
                      help="decode every file before writing it (headrace's CPU decode rules; slower). "
                           "--verify or --verify=raise: stop at the first file that does not decode, naming "
                           "it, and write nothing; --verify=skip: leave such files out and list them. "
                           "Without it the files' bytes are packed unread, images or not")
    pack.add_argument("--threads", type=_positive, default=None, help="--verify: decode threads (default: all cores)")
    pack.add_argument("--video", action="store_true",
                      help="SRC holds videos (mp4, mkv, avi, mov, webm): pack each file's bytes, not re-encoded, "
                           "as <key>.mp4 (its own extension) + <key>.cls into WebDataset shards for readers.video; "
                           "--verify probes each video (demuxes every frame) instead of decoding images")
    inspect = sub.add_parser("inspect", help="say what a data set holds: samples, classes, fields, image formats "
                                             "and sizes; --verify decodes every image",
                             description="Inspect PATH: a class-per-folder image tree, a folder or pattern of "
                                         "WebDataset tar shards, an LMDB, TFRecord or RecordIO files (a "
                                         "file, folder or pattern), or an s3:// or http(s):// URL of shards (or an s3:// folder "
                                         "of class sub-folders).")
    inspect.add_argument("path", type=_path, metavar="PATH", help="data set: folder, shards (folder, glob, brace pattern), "
                                                      "LMDB or URL")
    inspect.add_argument("--format", choices=("files", "webdataset", "lmdb", "caffe", "tfrecord", "recordio"), default=None,
                         help="what PATH is (default: guessed from it)")
    inspect.add_argument("--limit", type=_positive, default=None, metavar="N", help="look at the first N samples only")
    inspect.add_argument("--verify", action="store_true",
                         help="decode every image (headrace's CPU decode) with a progress bar; list the samples "
                              "that fail (key, source, error) and exit with status 1 if there are any")
    inspect.add_argument("--threads", type=_positive, default=None, help="--verify: decode threads (default: all cores)")
    inspect.add_argument("--json", metavar="FILE", default=None, help="also write everything found to FILE as JSON")
    _bench_parser(sub)
    return parser


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="time the reader alone, decode alone and the whole pipeline on a data set",
                           description="Time, on this machine, three rows over PATH (anything headrace inspect "
                                       "takes): the reader alone, decode alone (Pipeline([Decode()])) and the whole "
                                       "pipeline, each through its own epochs; the best epoch of each is reported "
                                       "(--dataloader adds torch's DataLoader on the same samples). Samples that "
                                       "fail to read or decode are skipped and counted.")
    bench.add_argument("path", type=_path, metavar="PATH", help="data set: folder, shards (folder, glob, brace pattern), LMDB or URL")
    bench.add_argument("--format", choices=("files", "webdataset", "lmdb", "caffe", "tfrecord", "recordio"), default=None,
                       help="what PATH is (default: guessed from it)")
    bench.add_argument("--pipeline", choices=("training", "validation"), default="training",
                       help="the whole pipeline's ops: ops.training or ops.validation (default: %(default)s)")
    bench.add_argument("--size", type=_positive, default=224, help="output side in pixels (default: %(default)s)")
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                       help="where decode and transforms run (default: %(default)s; cuda needs a GPU)")
    bench.add_argument("--batch-size", type=_positive, default=64, help="batch size (default: %(default)s)")
    bench.add_argument("--threads", type=_positive, default=None,
                       help="decode/transform threads, and --dataloader's worker processes (default: all cores)")
    bench.add_argument("--dataloader", action="store_true",
                       help="add a row: torch's DataLoader on the same samples, Pillow decode and the same transforms "
                            "(torchvision's, re-made without it) in persistent worker processes; a local files tree "
                            "is read by path, shards and LMDBs from memory (read once before timing); with --device "
                            "cuda each batch is pinned and moved with .cuda(non_blocking=True)")
    bench.add_argument("--epochs", type=_positive, default=2,
                       help="epochs per row; the best is reported (default: %(default)s)")
    bench.add_argument("--limit", type=_positive, default=None, metavar="N", help="time the first N samples only")
    bench.add_argument("--json", metavar="FILE", default=None, help="also write the rows and every epoch to FILE")
    bench.add_argument("--plot", metavar="FILE.png", default=None,
                       help="also draw images/s and starved/blocked shares per row into a PNG (needs matplotlib)")


def _megabytes(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):  # inf would overflow where the shards are sized
        raise argparse.ArgumentTypeError(f"must be a non-negative number of megabytes, got {text}")
    return value


def _version() -> str:
    from headrace import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = _parser()
    args = parser.parse_args(_bare_verify(list(sys.argv[1:] if argv is None else argv)))
    command = {"demo": _demo, "pack": _pack, "inspect": _inspect, "bench": _bench}.get(args.command)
    if command is None:
        parser.print_help()
        return 2
    try:
        with _terminate_as_interrupt():
            return command(args)
    except _Terminated:
        print("terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so that it unwinds as Ctrl-C does."""


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """Make SIGTERM (``kill``, a job scheduler's stop) unwind the command as Ctrl-C does: by default
    it ends the process on the spot, which left ``pack``'s finished shards (no index) or a partial
    LMDB that a reader takes as the whole data set, and a DEST that a second run refuses. A second
    SIGTERM ends the process at once, in case the clean-up itself hangs."""

    def terminate(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise _Terminated

    try:
        previous = signal.signal(signal.SIGTERM, terminate)
    except ValueError:  # main() called from a thread other than the main one: signals go elsewhere
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _bare_verify(argv: list[str]) -> list[str]:
    """``pack ... --verify SRC`` would read SRC as the value of ``--verify``: a bare one means
    ``--verify=raise``."""
    if next((a for a in argv if not a.startswith("-")), None) != "pack":
        return argv
    end = argv.index("--") if "--" in argv else len(argv)
    # "--verify skip" and "--verify raise" keep their value; only a bare one becomes "=raise".
    return [("--verify=raise" if i < end and a == "--verify" and (argv[i + 1:i + 2] not in (["raise"], ["skip"]))
             else a) for i, a in enumerate(argv)]


def _demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from headrace import LoaderError, datasets

    root = os.path.abspath(args.data)
    try:
        if datasets.count_images(root) != args.images or not os.path.isfile(os.path.join(root, datasets.MARKER)):
            with tqdm(total=args.images, desc=f"making {args.images} JPEGs in {root}", unit="img") as bar:
                _, made = datasets.ensure_image_folder(root, count=args.images, classes=args.classes, progress=bar.update)
            print(f"data: {args.images} JPEGs in {root} ({'made now' if made else 'cached'}; remove the folder to free it)")
        else:
            print(f"data: {args.images} JPEGs in {root} (cached; remove the folder to free it)")
    except (LoaderError, OSError) as exc:  # OSError: the folder cannot be made or written
        print(f"headrace demo: error: {exc}", file=sys.stderr)
        return 1
    from ._inspect import event_loop, run_to_end

    with event_loop() as loop:  # Ctrl-C or SIGTERM: the loader is closed before the interrupt is raised
        rates = run_to_end(loop, _epochs(root, args))
    total = sum(n for n, _ in rates) / sum(t for _, t in rates)
    print(f"throughput: {total:,.0f} images/s over {args.epochs} epoch(s)"
          f"{'' if len(rates) < 2 else f'; after the first epoch {_rate(rates[1:]):,.0f} images/s'}")
    return 0


def _pack(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from headrace import DecodeError, LoaderError
    from headrace.readers import pack

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:  # made at the first sample, once the arguments and SRC have been checked
            bar = tqdm(total=total, desc=f"packing {args.format}", unit="video" if args.video else "img")
        bar.update(done - bar.n)

    shard_options = {"--shard-size": args.shard_size, "--shard-count": args.shard_count, "--prefix": args.prefix}
    given = [name for name, value in shard_options.items() if value is not None]
    if args.format == "lmdb" and given:  # an LMDB is one database: it would be ignored, silently
        print(f"headrace pack: error: {', '.join(given)} only apply to --format webdataset", file=sys.stderr)
        return 2
    shard_size = 256.0 if args.shard_size is None else args.shard_size
    try:
        result = pack(args.src, args.dest, format=args.format, shard_size=shard_size or None,
                      shard_count=args.shard_count, shuffle=args.shuffle, seed=args.seed,
                      prefix="shard" if args.prefix is None else args.prefix,
                      progress=progress, verify=args.verify, verify_threads=args.threads, video=args.video)
    except (LoaderError, ImportError, OSError) as exc:  # OSError: DEST cannot be made or written (a full disk)
        if bar is not None:
            bar.close()
        print(f"headrace pack: error: {exc}", file=sys.stderr)
        if isinstance(exc, DecodeError) and args.verify == "raise":
            print("headrace pack: nothing was written; --verify=skip leaves out the files that do not decode",
                  file=sys.stderr)
        return 1
    finally:
        if bar is not None:
            bar.close()
    what = f"{len(result.outputs)} shard(s)" if result.format == "webdataset" else "an LMDB"
    print(f"packed {result.samples} samples ({len(result.classes)} classes) into {what} in {result.dest}: "
          f"{result.bytes / 2**20:,.1f} MiB")
    if result.skipped:
        print(f"skipped {len(result.skipped)} file(s) that do not decode:")
        for path, reason in result.skipped:
            print(f"  {path}: {reason}")
    elif args.verify:
        print("verified: every file decodes")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from headrace import LoaderError

    from ._inspect import inspect_path

    if (problem := _unwritable(("--json", args.json))) is not None:
        print(f"headrace inspect: error: {problem}", file=sys.stderr)
        return 1
    try:
        return inspect_path(args.path, format=args.format, limit=args.limit, verify=args.verify,
                            threads=args.threads, json_path=args.json)
    except (LoaderError, ImportError, OSError) as exc:
        print(f"headrace inspect: error: {exc}", file=sys.stderr)
        return 1


def _bench(args: argparse.Namespace) -> int:
    from headrace import LoaderError

    from ._bench import bench_path

    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401 - checked before the timing, not after it
        except ImportError:
            print("headrace bench: error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    if (problem := _unwritable(("--json", args.json), ("--plot", args.plot))) is not None:
        print(f"headrace bench: error: {problem}", file=sys.stderr)
        return 1
    try:
        return bench_path(args.path, json_path=args.json, plot_path=args.plot, format=args.format, limit=args.limit,
                          device=args.device, pipeline=args.pipeline, size=args.size, batch_size=args.batch_size,
                          threads=args.threads, epochs=args.epochs, dataloader=args.dataloader)
    except (LoaderError, ImportError, OSError) as exc:
        print(f"headrace bench: error: {exc}", file=sys.stderr)
        return 1


def _unwritable(*outputs: tuple[str, str | None]) -> str | None:
    """Why one of the (option, file) outputs cannot be written, or None: checked before the run, as
    the files are written after it, and a bench of many minutes was lost to a mistyped folder."""
    for option, path in outputs:
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if os.path.isdir(path):
            return f"{option} {path}: is a folder, not a file"
        if not os.path.isdir(folder):
            return f"{option} {path}: no such folder {folder}"
    return None


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
