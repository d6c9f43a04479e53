"""The peer shard formats of ``examples/benchmark_latency.py``: Lightning's litdata and Mosaic streaming.

Each writes the benchmark's JPEGs (the bytes of ``serve/images``, no re-encoding, and the class
index) in its own format, into ``serve/litdata`` (``BinaryWriter``, the writer under
``litdata.optimize``, ``chunk_bytes=--shard-mb`` MB) and ``serve/streaming`` (``MDSWriter``,
``size_limit=--shard-mb`` MB), so the object server serves them beside the WebDataset shards. A row
reads them the library's documented way, from ``s3://BUCKET/<peer>`` with the endpoint given as the
library asks for it, iterating the dataset in the row's process (no DataLoader, as the
``webdataset`` row does), the JPEG bytes counted and dropped.

Each row's process makes its local cache in a fresh temporary folder (removed at exit), so it holds
at most the index when the clock starts and every shard is downloaded on the clock.

Neither package is a dependency of headrace: ``pip install litdata mosaicml-streaming`` (both pull
torchvision; streaming pins ``numpy<2.2``). Without one, its row is skipped and says so.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

# The row names, with the module each needs and the folder under ``serve`` it reads.
PEERS = {"litdata-shards": ("litdata", "litdata"), "streaming-shards": ("streaming", "streaming")}
PIP = {"litdata": "litdata", "streaming": "mosaicml-streaming"}


def missing(row: str) -> str | None:
    """Why ``row`` cannot run here (its package is not installed), or None."""
    module = PEERS[row][0]
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install {PIP[module]})"
    return None


def _samples(serve: Path) -> list[tuple[Path, int]]:
    """The JPEGs under ``serve/images`` in a fixed order, each with its class index."""
    classes = sorted(p.name for p in (serve / "images").iterdir() if p.is_dir())
    index = {name: i for i, name in enumerate(classes)}
    return [(p, index[p.parent.name]) for p in sorted((serve / "images").rglob("*.jpg"))]


def write(serve: Path, shard_mb: float, rows: set[str]) -> dict[str, list[Path]]:
    """The shards of each peer in ``rows``, unless already written for these images and
    ``shard_mb`` (a stamp beside the folder): ``{row: its shard files}``. A peer not installed, or
    whose writer fails, is left out and says why."""
    ready = {}
    config = {"images": len(list((serve / "images").rglob("*.jpg"))), "shard_mb": shard_mb}
    for row in sorted(rows & set(PEERS)):
        if why := missing(row):
            print(f"{row}: skipped, {why}")
            continue
        folder = PEERS[row][1]
        out, stamp = serve / folder, serve / f".{folder}.json"
        if not (stamp.exists() and json.loads(stamp.read_text()) == config):
            stamp.unlink(missing_ok=True)
            # In a process of its own: the library's imports and a chunk held while written would
            # raise the benchmark's peak RSS, and each row's process starts from its parent's.
            done = subprocess.run([sys.executable, __file__, str(serve), str(shard_mb), row])
            if done.returncode != 0:
                print(f"{row}: skipped, writing its shards failed (exit {done.returncode})")
                continue
            stamp.write_text(json.dumps(config))
        ready[row] = sorted(p for p in out.iterdir() if p.name != "index.json")
        print(f"{row}: {len(ready[row])} shards in {folder}/ (largest "
              f"{max(p.stat().st_size for p in ready[row]) / 1e6:.0f} MB)")
    return ready


def _write_litdata(out: Path, samples: list[tuple[Path, int]], chunk_bytes: int) -> None:
    from litdata.streaming.writer import BinaryWriter

    writer = BinaryWriter(str(out), chunk_bytes=chunk_bytes)
    for i, (path, cls) in enumerate(samples):
        writer[i] = {"jpg": path.read_bytes(), "cls": cls}  # bytes stay bytes: litdata's "bytes" serializer
    writer.done()
    writer.merge()


def _write_streaming(out: Path, samples: list[tuple[Path, int]], size_limit: int) -> None:
    from streaming import MDSWriter

    with MDSWriter(out=str(out), columns={"jpg": "bytes", "cls": "int"}, size_limit=size_limit) as writer:
        for path, cls in samples:
            writer.write({"jpg": path.read_bytes(), "cls": cls})


def _cache(name: str) -> str:
    """A fresh, empty cache folder for this process, removed at exit."""
    path = tempfile.mkdtemp(prefix=f"headrace-bench-{name}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def row_litdata(serve: Path, url: str, where: str, args: argparse.Namespace) -> Callable[[], tuple[int, int]]:
    """litdata's ``StreamingDataset("s3://BUCKET/litdata")``: boto3 and obstore clients, the
    endpoint passed as ``storage_options={"endpoint_url": ...}`` (litdata's documented way for
    S3-compatible stores); the index is fetched here, off the clock."""
    from litdata import StreamingDataset
    from litdata.streaming import downloader

    from storage_servers import BUCKET

    # litdata GETs the chunks through obstore, whose client refuses an http:// endpoint without
    # allow_http (reqwest "BadScheme"), and litdata builds it from these options alone.
    downloader._OBSTORE_CLIENT_OPTIONS = {**downloader._OBSTORE_CLIENT_OPTIONS, "allow_http": True}
    dataset = StreamingDataset(f"s3://{BUCKET}/litdata", cache_dir=_cache("litdata"),
                               storage_options={"endpoint_url": url})
    return lambda: _drain(dataset)


def row_streaming(serve: Path, url: str, where: str, args: argparse.Namespace) -> Callable[[], tuple[int, int]]:
    """Mosaic streaming's ``StreamingDataset(remote="s3://BUCKET/streaming", local=<temp>)``:
    boto3, the endpoint from ``S3_ENDPOINT_URL`` (streaming's documented variable); the index is
    fetched here, off the clock."""
    from streaming import StreamingDataset

    from storage_servers import BUCKET

    os.environ["S3_ENDPOINT_URL"] = url
    dataset = StreamingDataset(remote=f"s3://{BUCKET}/streaming", local=_cache("streaming"), shuffle=False,
                               batch_size=64)
    return lambda: _drain(dataset)


def _drain(dataset) -> tuple[int, int]:  # noqa: ANN001 - a peer's iterable dataset of {"jpg", "cls"}
    n = b = 0
    for sample in dataset:
        n += 1
        b += len(sample["jpg"])
    return n, b


def _write_one(serve: Path, shard_mb: float, row: str) -> None:
    out = serve / PEERS[row][1]
    shutil.rmtree(out, ignore_errors=True)
    write_format = _write_litdata if PEERS[row][0] == "litdata" else _write_streaming
    write_format(out, _samples(serve), int(shard_mb * 1e6))


if __name__ == "__main__":  # write(): python examples/_latency_peers.py SERVE SHARD_MB ROW
    _write_one(Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3])
