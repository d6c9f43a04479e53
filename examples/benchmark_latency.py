"""Reading from object storage at real-world latency: headrace against its peers, the reader alone.

The ImageNet-like set (``headrace.datasets``: real photographs, resized and re-encoded) is served by
``tests/readers/object_server.py`` (a child process on 127.0.0.1) over plain HTTP and as an S3
bucket, twice: as WebDataset shards of ``--shard-mb`` MB and as individual JPEG objects. The server
answers every GET after ``--latency-ms``, caps each connection at ``--mbps`` MB/s and serves at most
``--max-connections`` connections at once (503 SlowDown past it), as a real store does.

Rows (raw samples, no decode; each runs in a process of its own, so its peak RSS is its own;
imports, clients and readers are made, and an S3 prefix listed, before the clock starts:
``setup_seconds``):

- ``headrace``: ``readers.webdataset`` over the shards (``buffer_bytes=--buffer-mb``), ``readers.files``
  over the objects (its defaults: ``requests=224``), S3 through obstore, HTTP through aiohttp;
- ``webdataset``: the library's documented way: ``wds.WebDataset(urls)``, ``http://`` through its
  gopen (a ``curl`` subprocess per shard), ``s3://`` through a gopen handler streaming boto3's
  ``get_object`` body (``pipe:aws s3 cp`` needs the AWS CLI, not installed here);
- ``litdata`` (``litdata-shards``): Lightning's ``litdata.StreamingDataset("s3://BUCKET/litdata")`` over the
  same JPEGs written by its ``BinaryWriter`` (the writer under ``litdata.optimize``) as raw bytes in
  chunks of ``--shard-mb`` MB, the endpoint in ``storage_options``; ``streaming`` (``streaming-shards``):
  Mosaic's ``streaming.StreamingDataset(remote="s3://BUCKET/streaming")`` over MDS shards of
  ``--shard-mb`` MB (``MDSWriter``, a ``bytes`` column), the endpoint from ``S3_ENDPOINT_URL``. Both
  over S3 only, iterated in the row's process, their local cache in a fresh temporary folder (every
  shard downloaded on the clock); see ``examples/_latency_peers.py``. Neither package is a headrace
  dependency (``pip install litdata mosaicml-streaming``: both pull torchvision, streaming pins
  ``numpy<2.2``); without one, its row is skipped and says so;
- ``DataLoader``: a torch ``DataLoader`` over the objects, boto3 (S3) or requests-free urllib (HTTP)
  in ``--workers`` worker processes, one client per worker, ``batch_size=64``;
- ``cached-shards`` / ``cachehit-shards`` and ``cached-objects`` / ``cachehit-objects``: headrace's
  rows with ``cache_dir=`` (a fresh folder in the system temp folder): the epoch that fills the folder, and a
  later epoch that reads it (one epoch fills it off the clock); with ``--pipeline``, the ``cached``
  and ``cachedobjects`` rows' warm-up epochs fill it;
- ``local disk``: the same readers over the same files on disk (page cache warm);
- ``client``: obstore GETs of the objects, 256 at once, bytes counted and dropped: the ceiling of
  the client alone. With ``--latency-ms 0`` and ``--mbps 0`` (the ``zero`` rows) it shows the
  server is not the bottleneck: the raw client goes faster through it than any reader.
- ``download`` (``headrace-download``): the shards through the webdataset reader's storage path
  (``Downloads``: ``read_ahead + 1`` at once, ``buffer_bytes=--buffer-mb`` each, the ranged GETs
  they gain), each drained by a thread in 1 MiB reads and the bytes dropped, no tar parsing: the
  download limit apart from the parser. MB/s counts the shards' bytes; ``peak_load_mb`` is the most
  one download counted against its bound (``buffer_bytes``), next to the process's peak RSS.

    python examples/benchmark_latency.py                      # 50 ms, 100 MB/s, 256 connections
    python examples/benchmark_latency.py --images 2048 --rows headrace   # a quick look
    python examples/benchmark_latency.py --rows headrace-download --rounds 5   # downloads alone, no parse

With ``--pipeline cuda`` (or ``cpu``) the rows are the training pipeline instead of the reader alone
(``none``: the same Loader with nothing decoded, its batches the sample keys):
``headrace.Loader(reader, pipeline=ops.training(224, dtype="float16"))`` (the Loader's defaults: on
cuda 4 lanes sharing the cores, the default ``hw_load``) fed by the same headrace readers, shuffled,
from local disk and over S3 at the same server settings: shards (``buffer_bytes=--buffer-mb``) and
objects (and, with ``--rows shards,download``, the download-only row at the same settings). Each row: one warm-up epoch off the clock, then ``--epochs`` timed epochs; images/s against the
local-disk row of the same data (shards against local shards, objects against the local folder) and
the peak RSS, also as what the remote row holds beyond the local one, next to what its reader is
configured to buffer. MB/s counts the JPEG bytes of the images delivered.

    python examples/benchmark_latency.py --pipeline cuda      # 16384 images, 2 timed epochs a row
    python examples/benchmark_latency.py --pipeline cpu --images 512 --batch 64   # tried without a GPU
    python examples/benchmark_latency.py --pipeline none --rows shards --images 4096 --shard-mb 25   # the loader's reading alone

It prints a table and writes JSON to ``examples/results/``.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "tests" / "readers"))
sys.path.insert(0, str(HERE))
import _latency_peers as peers  # noqa: E402
from _thread_cpu import LoopLag, ThreadCpu  # noqa: E402
from object_server import configure, object_server, server_stats  # noqa: E402
from storage_servers import ACCESS_KEY, BUCKET, SECRET_KEY  # noqa: E402

REGION = "us-east-1"


# --- data --------------------------------------------------------------------------------------


def make_data(data: Path, images: int, shard_mb: float) -> Path:
    """``data/serve/images/class_XX/*.jpg`` and ``data/serve/shards/*.tar`` (cached by a stamp)."""
    from headrace import readers
    from headrace.datasets import ensure_image_folder

    serve = data / "serve"
    stamp = data / "config.json"
    config = {"images": images, "shard_mb": shard_mb}
    if stamp.exists() and json.loads(stamp.read_text()) == config:
        return serve
    import shutil

    shutil.rmtree(serve, ignore_errors=True)
    ensure_image_folder(data / "folder", count=images, workers=os.cpu_count())  # the same images, whatever workers
    shutil.copytree(data / "folder", serve / "images", ignore=shutil.ignore_patterns(".*"))
    readers.pack(serve / "images", serve / "shards", format="webdataset", shard_size=shard_mb, shuffle=True)
    stamp.write_text(json.dumps(config))
    return serve


# --- rows (each in its own process) ------------------------------------------------------------


def _aws_env(url: str) -> None:
    os.environ.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_REGION=REGION,
                      AWS_ENDPOINT_URL_S3=url)


def _count(stream) -> tuple[int, int]:  # noqa: ANN001 - an async iterator of sample lists
    """Samples and payload bytes of one read; the seconds from its start to its first sample go into
    ``_extra`` (a shuffle buffer holds the first one back until it has ``shuffle_initial`` samples)."""
    async def run() -> tuple[int, int]:
        n = b = 0
        start = time.perf_counter()
        async for chunk in stream:
            if n == 0 and chunk:
                _extra["first_sample_seconds"] = time.perf_counter() - start
            for s in chunk:
                if s.error is not None:
                    raise s.error
                n += 1
                b += sum(len(v) for k, v in s.fields.items() if k != "cls")
        return n, b

    return _on_new_loop(run)


def _on_new_loop(run: Callable[[], Any]) -> Any:
    """``run()`` (a coroutine function) to the end on an event loop of its own, closed after."""
    import asyncio

    from headrace._loop import new_event_loop

    loop = new_event_loop()
    try:
        return loop.run_until_complete(run())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def _shard_names(serve: Path) -> list[str]:
    return sorted(p.name for p in (serve / "shards").glob("*.tar"))


def _object_keys(serve: Path) -> list[str]:
    return sorted(p.relative_to(serve).as_posix() for p in (serve / "images").rglob("*.jpg"))


def _read_ahead(args: argparse.Namespace) -> int:
    """The shards read ahead of the current one: ``--read-ahead``, or the reader's default."""
    from headrace import readers

    if args.read_ahead is not None:
        return args.read_ahead
    return inspect.signature(readers.webdataset).parameters["read_ahead"].default


def _shards_reader(serve: Path, url: str, where: str, args: argparse.Namespace, **options):  # noqa: ANN202
    """headrace's webdataset reader over the shards, from ``where``; ``options`` go to the reader."""
    from headrace import readers

    names = _shard_names(serve)
    if where == "local":
        sources = [str(serve / "shards" / n) for n in names]
    elif where == "s3":
        sources = [f"s3://{BUCKET}/shards/{n}" for n in names]
    else:
        sources = [f"{url}/{BUCKET}/shards/{n}" for n in names]
    kw = {} if where == "local" else {"buffer_bytes": args.buffer_mb << 20}
    if args.read_ahead is not None:
        kw["read_ahead"] = args.read_ahead
    if args.shuffle_buffer is not None:  # every shard row shuffles, through a buffer of this size
        kw.update(shuffle=True, shuffle_buffer=args.shuffle_buffer)
        options.pop("shuffle", None)
    if args.shuffle_initial is not None:  # where the rows shuffle: the samples held before the first one comes out
        kw["shuffle_initial"] = args.shuffle_initial
    return readers.webdataset(sources, **kw, **options)


def _objects_reader(serve: Path, url: str, where: str, args: argparse.Namespace, **options):  # noqa: ANN202
    """headrace's files reader over the JPEGs, from ``where``; ``options`` go to the reader."""
    from headrace import readers

    if where == "local":
        return readers.files(serve / "images", **options)
    if where == "s3":
        return readers.files(f"s3://{BUCKET}/images/", **options)
    keys = _object_keys(serve)
    return readers.files([f"{url}/{BUCKET}/{k}" for k in keys], labels=[0] * len(keys), **options)


def row_headrace_shards(serve: Path, url: str, where: str, args: argparse.Namespace) -> Callable[[], tuple[int, int]]:
    reader = _shards_reader(serve, url, where, args)
    return lambda: _count(reader.read(0))


def _cache_dir() -> str:
    """A fresh cache folder for this row's process, removed when it exits."""
    import atexit
    import shutil
    import tempfile

    # The system temp folder, as a scratch disk: on the 2-core VM, creating a file under the
    # checkout cost ~1.4 ms against ~80 µs in /tmp (same disk), which the objects rows would measure.
    folder = tempfile.mkdtemp(prefix="headrace-bench-cache-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _cache_row(make_reader: Callable[..., Any], later: bool) -> Callable[..., Callable[[], tuple[int, int]]]:
    """A row of headrace's reader with ``cache_dir=``: the epoch that fills the folder (every shard or
    object fetched and written to disk), or (``later``) an epoch after one that filled it off the clock."""

    def row(serve: Path, url: str, where: str, args: argparse.Namespace) -> Callable[[], tuple[int, int]]:
        reader = make_reader(serve, url, where, args, cache_dir=_cache_dir())
        if not later:
            return lambda: _count(reader.read(0))
        _count(reader.read(0))
        assert reader.cache.kept > 0 and reader.cache.failed == 0, reader.cache
        return lambda: _count(reader.read(1))

    return row


def row_headrace_download(serve: Path, url: str, where: str, args: argparse.Namespace) -> Callable[[], tuple[int, int]]:
    """The shards downloaded as ``readers.webdataset`` downloads them, the bytes dropped (no parse):
    returns (0 samples, the shards' bytes); ``peak_load_mb`` goes into ``_extra``."""
    import asyncio
    from collections import deque

    from headrace import readers
    from headrace.readers._storage import Downloads, Storage

    names = _shard_names(serve)
    if where == "s3":
        sources = [f"s3://{BUCKET}/shards/{n}" for n in names]
    else:
        sources = [f"{url}/{BUCKET}/shards/{n}" for n in names]
    storage = Storage()
    for source in sources:
        storage.locate(source)  # the stores (and their clients) made off the clock
    at_once = _read_ahead(args) + 1

    def drain(f) -> int:  # noqa: ANN001 - a RemoteFile, read by a thread as the parser reads it
        n = 0
        with f:
            while block := f.read(1 << 20):
                n += len(block)
        return n

    async def run() -> tuple[int, int]:
        downloads = Downloads(storage, args.buffer_mb << 20)
        total = 0
        async with storage.session():
            try:
                ahead = deque(downloads.open(s, i) for i, s in enumerate(sources[:at_once]))
                for i in range(at_once, len(sources) + at_once):
                    total += await asyncio.to_thread(drain, ahead.popleft())
                    if i < len(sources):
                        ahead.append(downloads.open(sources[i], i))
            finally:
                await downloads.aclose()
        _extra["peak_load_mb"] = max(_extra.get("peak_load_mb", 0), downloads.peak / 2**20)
        return 0, total

    return lambda: _on_new_loop(run)


_extra: dict[str, float] = {}  # what a row reports beyond rate and memory (the child's result line)


def row_headrace_objects(serve: Path, url: str, where: str, args: argparse.Namespace) -> Callable[[], tuple[int, int]]:
    reader = _objects_reader(serve, url, where, args)
    return lambda: _count(reader.read(0))


def row_webdataset(serve: Path, url: str, where: str, args: argparse.Namespace) -> Callable[[], tuple[int, int]]:
    import importlib

    import webdataset as wds

    names = _shard_names(serve)
    if where == "local":
        urls = [str(serve / "shards" / n) for n in names]
    elif where == "http":
        urls = [f"{url}/{BUCKET}/shards/{n}" for n in names]  # gopen: curl -s -L <url>
    else:
        import boto3
        from botocore.config import Config

        gopen = importlib.import_module("webdataset.gopen")  # the package re-exports a function of that name
        client = boto3.client("s3", endpoint_url=url, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
                              region_name=REGION, config=Config(s3={"addressing_style": "path"}))

        def gopen_s3(u, mode="rb", bufsize=8192):  # noqa: ANN001, ANN202
            bucket, _, key = u[len("s3://") :].partition("/")
            return client.get_object(Bucket=bucket, Key=key)["Body"]

        gopen.gopen_schemes["s3"] = gopen_s3
        urls = [f"s3://{BUCKET}/shards/{n}" for n in names]

    def read() -> tuple[int, int]:
        n = b = 0
        for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
            n += 1
            b += sum(len(v) for k, v in sample.items() if not k.startswith("__") and k != "cls")
        return n, b

    return read


class _Objects:
    """A map-style dataset of object keys, one client per DataLoader worker (made on first use)."""

    def __init__(self, keys: list[str], url: str, where: str) -> None:
        self.keys, self.url, self.where, self.client = keys, url, where, None

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> bytes:
        if self.where == "s3":
            if self.client is None:
                import boto3
                from botocore.config import Config

                self.client = boto3.client("s3", endpoint_url=self.url, aws_access_key_id=ACCESS_KEY,
                                           aws_secret_access_key=SECRET_KEY, region_name=REGION,
                                           config=Config(s3={"addressing_style": "path"},
                                                         retries={"max_attempts": 10, "mode": "standard"}))
            return self.client.get_object(Bucket=BUCKET, Key=self.keys[i])["Body"].read()
        if self.where == "http":
            import urllib.request

            with urllib.request.urlopen(f"{self.url}/{BUCKET}/{self.keys[i]}") as response:
                return response.read()
        with open(self.keys[i], "rb") as f:
            return f.read()


def _collate(items: list[bytes]) -> list[bytes]:
    return items


def row_dataloader(serve: Path, url: str, where: str, args: argparse.Namespace) -> Callable[[], tuple[int, int]]:
    from torch.utils.data import DataLoader

    keys = _object_keys(serve)
    if where == "local":
        keys = [str(serve / k) for k in keys]
    loader = DataLoader(_Objects(keys, url, where), batch_size=64, num_workers=args.workers, collate_fn=_collate,
                        prefetch_factor=2, persistent_workers=False)

    def read() -> tuple[int, int]:  # the workers start (and import boto3) on the clock, as every epoch
        n = b = 0
        for batch in loader:
            n += len(batch)
            b += sum(map(len, batch))
        return n, b

    return read


def row_client(serve: Path, url: str, where: str, args: argparse.Namespace) -> Callable[[], tuple[int, int]]:
    import asyncio

    from obstore.store import S3Store

    keys = _object_keys(serve)
    store = S3Store(BUCKET, endpoint=url, access_key_id=ACCESS_KEY, secret_access_key=SECRET_KEY, region=REGION,
                    client_options={"allow_http": True})
    return lambda: asyncio.run(_client_gets(store, keys))


async def _client_gets(store, keys: list[str]) -> tuple[int, int]:  # noqa: ANN001 - an obstore store
    """GET every key, 256 at once, each as a task; the bytes counted and dropped."""
    import asyncio

    import obstore

    limit, total = asyncio.Semaphore(256), 0

    async def one(key: str) -> None:
        nonlocal total
        async with limit:
            data = await (await obstore.get_async(store, key)).bytes_async()
        total += len(memoryview(data))  # after the await: `total += await ...` would read total before it

    async with asyncio.TaskGroup() as group:
        for key in keys:
            group.create_task(one(key))
    return len(keys), total


class TrainingEpochs:
    """headrace's training pipeline fed by ``reader`` through a Loader: a call runs one epoch and
    returns (images, their JPEG bytes); ``close()`` releases the loader's threads, lanes and loop."""

    def __init__(self, reader, serve: Path, args: argparse.Namespace) -> None:  # noqa: ANN001 - a headrace reader
        import headrace
        from headrace import ops
        from headrace._loop import new_event_loop  # uvloop when installed, as the loader uses

        self.cuda = args.pipeline == "cuda"
        self.reader = reader
        if args.pipeline == "none":  # the loader's reading alone: batches of sample keys, nothing decoded,
            # running ahead between epochs as the GPU path does by default
            self.loader = headrace.Loader(reader, batch_size=args.batch, device="cpu", run_ahead=True,
                                          pipeline=ops.Pipeline(image=None, label=None, fields=[]))
        else:
            self.loader = headrace.Loader(reader, batch_size=args.batch, pipeline=ops.training(224, dtype="float16"),
                                          device=args.pipeline)  # the defaults, as a user's loader
        # Every epoch delivers every image once, so its JPEG bytes are the images' sizes summed.
        sizes = [p.stat().st_size for p in (serve / "images").rglob("*.jpg")]
        self.mean_bytes = sum(sizes) / len(sizes)
        self.loop = new_event_loop()
        self.lag = LoopLag()
        self.lags: list[dict[str, float]] = []  # the loop's lag in each epoch
        # Each epoch's ``EpochMetrics`` line: whether the reader or decode held the consumer up.
        self.metrics: list[str] = []
        # Each epoch's rate between its 10% and 90% marks: without the epoch's start (first GETs,
        # 50 ms each at the latency rows) and its tail, which weigh on short epochs.
        self.steady: list[float] = []
        # Each epoch's first and last 10% of images: seconds taken, and seconds beyond what the
        # steady rate would take (where the S3 rows lose to local disk: the start, or the tail).
        self.edges: list[dict[str, float]] = []

    async def _epoch(self) -> int:
        images = 0
        began = time.perf_counter()
        marks: list[tuple[float, int]] = []
        self.lag.start()
        async for batch in self.loader:
            images += batch.size
            marks.append((time.perf_counter(), images))
        self.lags.append(await self.lag.stop())
        self.steady.append(_steady_rate(marks))
        self.edges.append(_edges(began, marks, self.steady[-1]))
        metrics = self.loader.stats().epoch_metrics
        self.metrics.append(metrics.summary() if metrics is not None else "")
        return images

    def __call__(self) -> tuple[int, int]:
        images = self.loop.run_until_complete(self._epoch())
        if self.cuda:
            import torch

            torch.cuda.synchronize()  # the last batch is ready on the consumer's stream, not yet computed
        return images, round(images * self.mean_bytes)

    def close(self) -> None:
        self.loop.run_until_complete(self.loader.aclose())
        self.loop.close()


def _edges(began: float, marks: list[tuple[float, int]], steady: float) -> dict[str, float]:
    """Seconds to the batch passing 10% of the epoch's images (from the epoch's start) and from the
    one passing 90% to the end, and each less what the steady rate would take for those images."""
    if not marks or steady <= 0:
        return {}
    total = marks[-1][1]
    first = next(m for m in marks if m[1] >= total * 0.1)
    last = next(m for m in marks if m[1] >= total * 0.9)
    head, tail = first[0] - began, marks[-1][0] - last[0]
    return {"first_batch_s": round(marks[0][0] - began, 4), "head_s": round(head, 4), "tail_s": round(tail, 4),
            "head_extra_s": round(head - first[1] / steady, 4), "tail_extra_s": round(tail - (total - last[1]) / steady, 4)}


def _steady_rate(marks: list[tuple[float, int]]) -> float:
    """Images a second between the batches that pass 10% and 90% of the epoch's images."""
    if not marks:
        return 0.0
    total = marks[-1][1]
    first = next(m for m in marks if m[1] >= total * 0.1)
    last = next(m for m in marks if m[1] >= total * 0.9)
    return (last[1] - first[1]) / (last[0] - first[0]) if last[0] > first[0] else 0.0


def row_pipeline_shards(serve: Path, url: str, where: str, args: argparse.Namespace) -> TrainingEpochs:
    return TrainingEpochs(_shards_reader(serve, url, where, args, shuffle=True), serve, args)


def row_pipeline_cached(serve: Path, url: str, where: str, args: argparse.Namespace) -> TrainingEpochs:
    """The shards row with ``cache_dir=``: the warm-up epoch fills the folder, the timed ones read it."""
    return TrainingEpochs(_shards_reader(serve, url, where, args, shuffle=True, cache_dir=_cache_dir()), serve, args)


def row_pipeline_cachedobjects(serve: Path, url: str, where: str, args: argparse.Namespace) -> TrainingEpochs:
    """The objects row with ``cache_dir=``: the warm-up epoch fills the folder, the timed ones read it."""
    return TrainingEpochs(_objects_reader(serve, url, where, args, shuffle=True, cache_dir=_cache_dir()), serve, args)


def row_pipeline_objects(serve: Path, url: str, where: str, args: argparse.Namespace) -> TrainingEpochs:
    return TrainingEpochs(_objects_reader(serve, url, where, args, shuffle=True), serve, args)


ROWS = {
    "headrace-shards": row_headrace_shards,
    "headrace-objects": row_headrace_objects,
    "headrace-download": row_headrace_download,
    "cached-shards": _cache_row(_shards_reader, later=False),
    "cachehit-shards": _cache_row(_shards_reader, later=True),
    "cached-objects": _cache_row(_objects_reader, later=False),
    "cachehit-objects": _cache_row(_objects_reader, later=True),
    "webdataset-shards": row_webdataset,
    "litdata-shards": peers.row_litdata,
    "streaming-shards": peers.row_streaming,
    "dataloader-objects": row_dataloader,
    "client-objects": row_client,
    "pipeline-shards": row_pipeline_shards,
    "pipeline-objects": row_pipeline_objects,
    "pipeline-cached": row_pipeline_cached,
    "pipeline-cachedobjects": row_pipeline_cachedobjects,
}
SYSTEMS = {"headrace-shards": "headrace webdataset()", "headrace-objects": "headrace files()",
           "headrace-download": "headrace downloads, no parse",
           "cached-shards": "headrace, cache_dir: filling it", "cachehit-shards": "headrace, cache_dir: read",
           "cached-objects": "headrace, cache_dir: filling it", "cachehit-objects": "headrace, cache_dir: read",
           "webdataset-shards": "webdataset library", "litdata-shards": "litdata StreamingDataset",
           "streaming-shards": "streaming StreamingDataset", "dataloader-objects": "DataLoader + boto3/urllib",
           "client-objects": "obstore GETs, 256 at once", "pipeline-shards": "Loader + training(), webdataset()",
           "pipeline-objects": "Loader + training(), files()",
           "pipeline-cached": "Loader + training(), webdataset(cache_dir=)",
           "pipeline-cachedobjects": "Loader + training(), files(cache_dir=)"}


def _peak_rss_mb() -> float:
    """This process's peak resident set, in MB: ``VmHWM`` where Linux gives it. ``ru_maxrss`` of a
    process that ``subprocess`` started counts its parent's peak too (it survives the exec), which
    hid every row below the parent's ~156 MB on the 2-core VM."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_row(args: argparse.Namespace) -> None:
    """In the child: one row, then one JSON line (rate, bytes, peak RSS of this process and its children)."""
    serve = Path(args.serve)
    if args.where == "s3":
        _aws_env(args.url)
    def cpu() -> float:  # this process and its finished children (DataLoader workers, curl)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.process_time() + kids.ru_utime + kids.ru_stime

    pipeline_row = args.row.startswith("pipeline")
    if args.keep_connections and args.where == "s3":
        # Measurement only: the S3 store keeps its client (its pooled connections) when a read's
        # session ends, so a row's later reads reuse warm connections instead of opening new ones.
        from headrace.readers._storage import S3Store

        async def keep(self) -> None:  # noqa: ANN001
            pass

        S3Store._disconnect = keep
    if args.scan_releasing_gil:  # measurement only: the scan through ctypes.CDLL, the GIL let go around it
        from headrace.readers import _read_files

        lib = _read_files._load()
        if lib is not None:
            scan = lib.hr_tar_scan
            scan.argtypes, scan.restype = lib.tar_scan.argtypes, lib.tar_scan.restype
            lib.tar_scan = scan
    # Measurement only: no next-epoch shard started early (before 978544d), or its first only (978544d).
    if args.no_next_epoch_start or args.next_epoch_first_only:
        from headrace.readers._shard_files import ShardFiles

        start_next = ShardFiles._start_next
        room = 0 if args.no_next_epoch_start else 1
        ShardFiles._start_next = lambda self, jobs, free: start_next(self, jobs, min(free, room))
    start = time.perf_counter()
    read = ROWS[args.row](serve, args.url, args.where, args)  # imports, clients, a bucket listed: off the clock
    setup = time.perf_counter() - start
    warmup = 0.0
    if pipeline_row:  # decoders, kernels and connections made, and the page cache read once, off the clock
        start = time.perf_counter()
        read()
        warmup = time.perf_counter() - start
    threads = ThreadCpu()
    threads.start()
    began, start = cpu(), time.perf_counter()
    samples = nbytes = 0
    epoch_rates = []
    for _ in range(args.epochs if pipeline_row else args.reader_epochs):
        epoch_start = time.perf_counter()
        n, b = read()
        epoch_rates.append(n / (time.perf_counter() - epoch_start))
        samples, nbytes = samples + n, nbytes + b
    seconds = time.perf_counter() - start
    cores_by_thread = threads.stop()
    own = _peak_rss_mb()
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    result = {"samples": samples, "payload_bytes": nbytes, "seconds": seconds, "cpu_seconds": cpu() - began,
              "samples_per_s": samples / seconds, "mb_per_s": nbytes / seconds / 1e6, "peak_rss_mb": own,
              "peak_rss_children_mb": children, "setup_seconds": setup, "config_buffer_mb": args.buffer_mb,
              "config_read_ahead": _read_ahead(args), "config_shuffle_buffer": args.shuffle_buffer,
              "config_shuffle_initial": args.shuffle_initial, **_extra}
    # The cores each kind of thread kept busy (MainThread: the event loop), and CPU per sample by thread.
    result["cores_by_thread"] = cores_by_thread
    result["epoch_samples_per_s"] = [round(r) for r in epoch_rates]
    if samples:
        result["cpu_us_per_sample_by_thread"] = {name: round(1e6 * cores * seconds / samples, 1)
                                                 for name, cores in cores_by_thread.items()}
    if pipeline_row:
        # The cores each kind of thread kept busy over the timed epochs, and the loop's lag in each.
        result.update(warmup_seconds=warmup, epoch_samples_per_s=epoch_rates, cores_by_thread=cores_by_thread,
                      loop_lag=read.lags[1:], epoch_metrics=read.metrics[1:], epoch_steady_samples_per_s=read.steady[1:],
                      epoch_edges=read.edges[1:])
        if getattr(read.reader, "peak_buffered", 0):  # shards over a store: one download's peak load
            result["peak_load_mb"] = read.reader.peak_buffered / 2**20
            # Shards whose download began before their epoch's read did (the epoch before started them).
            result["shards_started_early"] = getattr(read.reader.files, "warmed", 0)
        if args.pipeline == "cuda":
            import torch

            result["peak_gpu_mib_torch"] = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps(result), flush=True)
    if pipeline_row:
        read.close()  # after the result line: a slow release must not cost the measurement


# --- tables ------------------------------------------------------------------------------------


def print_reader_table(results: list[dict], label: dict[str, str], args: argparse.Namespace) -> None:
    print(f"| {'source':30s} | {'data':8s} | {'system':28s} | {'samples/s':>9s} | {'MB/s':>6s} | {'peak RSS MB':>11s} "
          f"| {'conns':>5s} | {'503s':>5s} | {'CPU s: reader, server':>21s} |")
    print(f"| {'-' * 30} | {'-' * 8} | {'-' * 28} | {'-' * 8}:| {'-' * 5}:| {'-' * 10}:| {'-' * 4}:| {'-' * 4}:| "
          f"{'-' * 20}:|")
    # Peak RSS: the process's own; a DataLoader's adds its largest worker process x the workers
    # (an upper bound: workers share pages with the parent).
    for r in results:
        where = {"local": "local disk", "s3": "S3", "http": "HTTP"}[r["where"]]
        src = where if r["where"] == "local" else f"{where}, {label[r['setting']]}"
        rss = r["peak_rss_mb"] + (r["peak_rss_children_mb"] * args.workers if r["row"].startswith("dataloader") else 0)
        rate = f"{r['samples_per_s']:9,.0f}" if r["samples"] else f"{'-':>9s}"
        print(f"| {src:30s} | {r['row'].split('-')[1]:8s} | {r['system']:28s} | {rate} | "
              f"{r['mb_per_s']:6.0f} | {rss:11.0f} | {r.get('server_peak_connections', '-'):>5} | "
              f"{r.get('server_refused', '-'):>5} | {r['cpu_seconds']:11.1f}, {r.get('server_cpu_seconds', 0):7.1f} |")


# The goals for the training pipeline fed over S3, as a share of the same pipeline fed from
# local disk: shards stream in large sequential reads, objects pay the first-byte latency per image.
GOALS = {"pipeline-shards": 0.90, "pipeline-objects": 0.70, "pipeline-cached": 0.90, "pipeline-cachedobjects": 0.70}
LOCAL_ROW = {"pipeline-cached": "pipeline-shards", "pipeline-cachedobjects": "pipeline-objects"}  # the local row a remote row is measured against


def reader_bounds(args: argparse.Namespace) -> dict[str, int]:
    """Bytes each remote pipeline row's reader is configured to buffer, as its docstring bounds it.

    The Loader's own buffers (``max_bytes`` between reader and batcher, ``prefetch`` batches) are
    the same from local disk, so a remote row's peak RSS beyond its local row's should stay within
    this. Shards: ``(read_ahead + 1)`` downloads of ``buffer_bytes`` (counting what the client holds
    for their GETs), twice that with the freed blocks the allocator keeps; objects: the chunks
    fetched ahead fit in ``buffer_bytes``, and the client keeps a connection for each of
    ``requests`` GETs at once, ~128 KiB each (``files()`` says so). Read from the signatures, so
    the bounds follow the readers' defaults.
    """
    from headrace import readers

    read_ahead = _read_ahead(args)
    files = inspect.signature(readers.files).parameters
    objects = files["buffer_bytes"].default + files["requests"].default * (128 << 10)
    shards = 2 * (read_ahead + 1) * (args.buffer_mb << 20)
    return {"pipeline-shards": shards, "pipeline-objects": objects, "pipeline-cached": shards,
            "pipeline-cachedobjects": objects}


def print_pipeline_table(results: list[dict], label: dict[str, str], bounds: dict[str, int]) -> None:
    local = {r["row"]: r for r in results if r["where"] == "local"}
    print(f"| {'data':8s} | {'source':30s} | {'images/s':>8s} | {'MB/s':>5s} | {'vs local disk':>13s} | "
          f"{'goal':>13s} | {'peak RSS MB':>11s} | {'beyond local / reader bound MB':>30s} | {'conns':>5s} | "
          f"{'503s':>5s} |")
    print(f"| {'-' * 8} | {'-' * 30} | {'-' * 7}:| {'-' * 4}:| {'-' * 12}:| {'-' * 12}:| {'-' * 10}:| {'-' * 29}:| "
          f"{'-' * 4}:| {'-' * 4}:|")
    for r in results:
        base = local.get(LOCAL_ROW.get(r["row"], r["row"]))
        remote = r["where"] != "local"
        vs = goal = beyond = "-"
        if remote and base:
            share = r["samples_per_s"] / base["samples_per_s"]
            vs = f"{share:.0%}"
            goal = f">= {GOALS[r['row']]:.0%} " + ("met" if share >= GOALS[r["row"]] else "MISSED")
            beyond = f"{r['peak_rss_mb'] - base['peak_rss_mb']:+.0f} / {bounds[r['row']] / 2**20:.0f}"
        src = "local disk" if not remote else f"S3, {label[r['setting']]}"
        rate = f"{r['samples_per_s']:8,.0f}" if r["samples"] else f"{'-':>8s}"
        print(f"| {r['row'].split('-')[1]:8s} | {src:30s} | {rate} | {r['mb_per_s']:5.0f} | "
              f"{vs:>13s} | {goal:>13s} | {r['peak_rss_mb']:11.0f} | {beyond:>30s} | "
              f"{r.get('server_peak_connections', '-'):>5} | {r.get('server_refused', '-'):>5} |")
    for r in results:
        if "epoch_samples_per_s" not in r:  # the download-only row
            print(f"{r['row']} {r['where']}: {r['mb_per_s']:,.0f} MB/s, peak RSS {r['peak_rss_mb']:.0f} MB, "
                  f"one download's peak load {r.get('peak_load_mb', 0):.0f} MiB (bound {r['config_buffer_mb']} MiB)")
            continue
        gpu = f", peak torch GPU memory {r['peak_gpu_mib_torch']:.0f} MiB" if "peak_gpu_mib_torch" in r else ""
        if "peak_load_mb" in r:
            gpu += f", one download's peak load {r['peak_load_mb']:.0f} MiB (bound {r['config_buffer_mb']} MiB)"
        if "shards_started_early" in r:
            gpu += f", shards the epoch before started: {r['shards_started_early']}"
        steady = r.get("epoch_steady_samples_per_s")
        if steady:
            gpu += f"; between 10% and 90% of each epoch {', '.join(f'{x:,.0f}' for x in steady)} images/s"
        edges = [e for e in r.get("epoch_edges") or [] if e]
        if edges:
            gpu += "; each epoch's first batch, first 10% and last 10% in ms (beyond the steady rate): " + ", ".join(
                f"{1e3 * e['first_batch_s']:.0f}, {1e3 * e['head_s']:.0f} (+{1e3 * e['head_extra_s']:.0f}), "
                f"{1e3 * e['tail_s']:.0f} (+{1e3 * e['tail_extra_s']:.0f})" for e in edges)
        print(f"{r['row']} {r['where']}: epochs {', '.join(f'{x:,.0f}' for x in r['epoch_samples_per_s'])} images/s "
              f"(rounds {', '.join(f'{x:,}' for x in r['all_samples_per_s'])}); setup {r['setup_seconds']:.1f} s, "
              f"warm-up epoch {r['warmup_seconds']:.1f} s, process {r['process_seconds']:.0f} s{gpu}")


# --- main --------------------------------------------------------------------------------------


def plan(rows: str, pipeline: str | None) -> list[tuple[str, str, str]]:
    """(row, where, server setting) in the order they run."""
    if pipeline:
        out = [("pipeline-shards", "local", "-"), ("pipeline-objects", "local", "-"),
               ("pipeline-shards", "s3", "slow"), ("pipeline-objects", "s3", "slow"),
               ("pipeline-cached", "s3", "slow"), ("pipeline-cachedobjects", "s3", "slow"),  # kept by the warm-up epoch
               ("headrace-download", "s3", "slow")]  # the shards' download limit, apart from the parser
        return out if rows == "all" else [r for r in out if r[0].split("-")[1] in rows.split(",")]
    out = [("headrace-shards", "local", "-"), ("webdataset-shards", "local", "-"),
           ("headrace-objects", "local", "-"), ("dataloader-objects", "local", "-")]
    for where in ("s3", "http"):
        out += [("headrace-shards", where, "slow"), ("webdataset-shards", where, "slow")]
        if where == "s3":  # the peers' own shard formats, over S3 alone
            out += [(row, where, "slow") for row in peers.PEERS]
            out += [("cached-shards", where, "slow"), ("cachehit-shards", where, "slow")]
        out += [("headrace-objects", where, "slow"), ("dataloader-objects", where, "slow")]
        if where == "s3":
            out += [("cached-objects", where, "slow"), ("cachehit-objects", where, "slow")]
    out += [("client-objects", "s3", "slow"), ("client-objects", "s3", "zero"),
            ("headrace-objects", "s3", "zero"), ("headrace-shards", "s3", "zero"),
            ("headrace-download", "s3", "slow"), ("headrace-download", "s3", "zero")]
    if rows != "all":
        out = [r for r in out if r[0].split("-")[0] in rows.split(",") or r[0] in rows.split(",")]
    return out


def measure(key: tuple[str, str, str], url: str, serve: Path, args: argparse.Namespace, slow: dict,
            zero: dict) -> dict | None:
    """One row in a child process, with what the server counted meanwhile."""
    row, where, setting = key
    server_cpu = 0.0
    if where != "local":
        configure(url, **(slow if setting == "slow" else zero))
        server_cpu = server_stats(url, reset=True)["cpu_seconds"]
    cmd = [sys.executable, __file__, "--row", row, "--where", where, "--url", url, "--serve", str(serve),
           "--buffer-mb", str(args.buffer_mb), "--workers", str(args.workers)]
    if args.read_ahead is not None:
        cmd += ["--read-ahead", str(args.read_ahead)]
    if args.shuffle_buffer is not None:
        cmd += ["--shuffle-buffer", str(args.shuffle_buffer)]
    if args.shuffle_initial is not None:
        cmd += ["--shuffle-initial", str(args.shuffle_initial)]
    if args.reader_epochs != 1:
        cmd += ["--reader-epochs", str(args.reader_epochs)]
    if args.keep_connections:
        cmd += ["--keep-connections"]
    if args.no_next_epoch_start:
        cmd += ["--no-next-epoch-start"]
    if args.next_epoch_first_only:
        cmd += ["--next-epoch-first-only"]
    if args.scan_releasing_gil:
        cmd += ["--scan-releasing-gil"]
    if args.pipeline:
        cmd += ["--pipeline", args.pipeline, "--epochs", str(args.epochs), "--batch", str(args.batch)]
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.row_timeout)
    except subprocess.TimeoutExpired as timed_out:  # one stuck row must not cost the rows after it
        tail = timed_out.stderr or b""  # bytes even in text mode: what was read before the kill
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        print(f"  {row} {where}: no result in {args.row_timeout:g} s\n{tail[-2000:]}", flush=True)
        return None
    if done.returncode != 0:
        print(f"  {row} {where}: failed (exit {done.returncode})\n{done.stdout[-1000:]}{done.stderr[-2000:]}", flush=True)
        return None
    res = json.loads(done.stdout.strip().splitlines()[-1])
    if where != "local":
        stats = server_stats(url)
        res.update(server_peak_connections=stats["peak_open"], server_refused=stats["refused"],
                   server_cpu_seconds=stats["cpu_seconds"] - server_cpu)
    res.update(row=row, where=where, setting=setting, system=SYSTEMS[row],
               process_seconds=time.perf_counter() - started)
    print(f"  {row:20s} {where:5s} {setting:4s} {res['samples_per_s']:8,.0f} samples/s "
          f"{res['mb_per_s']:7.1f} MB/s  RSS {res['peak_rss_mb']:5.0f} MB"
          + (f"  one download's peak load {res['peak_load_mb']:.0f} MiB" if "peak_load_mb" in res else "")
          + (f"  first sample {res['first_sample_seconds']:.2f} s, epoch {res['seconds']:.2f} s"
             if "first_sample_seconds" in res else ""), flush=True)
    if "cores_by_thread" in res and "loop_lag" not in res:  # a reader row
        print("    cores: " + ", ".join(f"{name} {cores:.2f}" for name, cores in list(res["cores_by_thread"].items())[:6])
              + (f"; CPU us/sample: {res['cpu_seconds'] * 1e6 / res['samples']:.1f}" if res["samples"] else ""),
              flush=True)
    if "loop_lag" in res:
        busiest = ", ".join(f"{name} {cores:.2f}" for name, cores in list(res["cores_by_thread"].items())[:8])
        lag = "; ".join(f"{x['mean_ms']:.1f}/{x['p90_ms']:.1f}" for x in res["loop_lag"] if x)
        print(f"    cores: {busiest}\n    loop lag, mean/p90 ms, by epoch: {lag}", flush=True)
        for line in res.get("epoch_metrics", [])[-1:]:  # the last epoch: who held the consumer up
            print(f"    {line}", flush=True)
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=None, help="default 8192; 16384 with --pipeline")
    parser.add_argument("--shard-mb", type=float, default=100)
    parser.add_argument("--latency-ms", type=float, default=50)
    parser.add_argument("--mbps", type=float, default=100, help="per connection")
    parser.add_argument("--max-connections", type=int, default=256)
    parser.add_argument("--buffer-mb", type=int, default=64, help="headrace webdataset(buffer_bytes=) for remote shards")
    parser.add_argument("--read-ahead", type=int, default=None, help="headrace webdataset(read_ahead=), every shard row "
                        "(default: the reader's)")
    parser.add_argument("--shuffle-buffer", type=int, default=None, help="headrace webdataset(shuffle=True, "
                        "shuffle_buffer=), every shard row (default: the reader rows do not shuffle, the pipeline "
                        "rows shuffle with the reader's default buffer)")
    parser.add_argument("--shuffle-initial", type=int, default=None, help="headrace webdataset(shuffle_initial=), "
                        "every shard row that shuffles: the buffer emits once it holds this many (default: the "
                        "reader's, 100; --shuffle-initial equal to --shuffle-buffer waits for the whole buffer). "
                        "The reader rows report the seconds from an epoch's start to its first sample")
    parser.add_argument("--workers", type=int, default=16, help="DataLoader worker processes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reader-epochs", type=int, default=1, help="reader rows: epochs timed a row, read one "
                        "after another by the same reader (each its own read: a new storage session, so new "
                        "connections, but the link's memory of the store kept)")
    parser.add_argument("--keep-connections", action="store_true", help="measurement only, S3 rows: the store keeps "
                        "its client (and its pooled connections) when a read ends, so a row's later reads (with "
                        "--reader-epochs or --pipeline) reuse warm connections; headrace itself closes them")
    parser.add_argument("--rows", default="all", help="all, or a comma list of: headrace,webdataset,litdata,streaming,"
                        "dataloader,client or of whole row names (headrace-shards: the shard rows alone) "
                        "(with --pipeline: shards,objects)")
    parser.add_argument("--pipeline", choices=("cuda", "cpu", "none"), default=None,
                        help="the rows run headrace's training pipeline on this device, not the reader alone "
                        "(none: the Loader's batches of sample keys, nothing decoded: its reading alone)")
    parser.add_argument("--no-next-epoch-start", action="store_true", help="measurement only, --pipeline shard "
                        "rows: the next epoch's first shard does not start downloading during this epoch's read "
                        "(before 978544d), for an A/B")
    parser.add_argument("--next-epoch-first-only", action="store_true", help="measurement only, --pipeline shard "
                        "rows: only the next epoch's first shard starts downloading during this epoch's read, not its "
                        "first read_ahead + 1 (978544d), for an A/B")
    parser.add_argument("--scan-releasing-gil", action="store_true", help="measurement only: the tar header scan "
                        "lets the GIL go around each call, as before it was called with the GIL held, for an A/B")
    parser.add_argument("--epochs", type=int, default=2, help="--pipeline: timed epochs a row, after one warm-up")
    parser.add_argument("--batch", type=int, default=256, help="--pipeline: batch size")
    parser.add_argument("--row-timeout", type=float, default=None, help="seconds a row's process may run (default: no limit)")
    parser.add_argument("--out", default=None, help="default examples/results/latency-vm-DATE.json "
                        "(with --pipeline: latency-pipeline-DEVICE-DATE.json)")
    parser.add_argument("--no-json", action="store_true")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    parser.add_argument("--where", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.row:
        return run_row(args)
    today = datetime.date.today().isoformat()
    args.images = args.images or (16384 if args.pipeline else 8192)
    args.out = args.out or str(HERE / "results" / (f"latency-pipeline-{args.pipeline}-{today}.json" if args.pipeline
                                                   else f"latency-vm-{today}.json"))

    t0 = time.perf_counter()
    # Its own folder for the pipeline rows: their image count differs, and either mode would remake the other's.
    data = ROOT / ".data" / ("bench-latency-pipeline" if args.pipeline else "bench-latency")
    serve = make_data(data, args.images, args.shard_mb)
    keys = plan(args.rows, args.pipeline)
    # litdata's and streaming's own shards, before the server starts (it lists the folder once);
    # a peer not installed, or whose shards could not be written, is left out.
    peer_shards = peers.write(serve, args.shard_mb, {k[0] for k in keys})
    keys = [k for k in keys if k[0] not in peers.PEERS or k[0] in peer_shards]
    shards = sorted((serve / "shards").glob("*.tar"))
    objects = list((serve / "images").rglob("*.jpg"))
    size = sum(p.stat().st_size for p in objects)
    print(f"data ready in {time.perf_counter() - t0:.0f} s: {len(objects)} JPEGs ({size / 1e6:.0f} MB, "
          f"mean {size / len(objects) / 1e3:.0f} KB), {len(shards)} shards "
          f"(largest {max(p.stat().st_size for p in shards) / 1e6:.0f} MB)")
    # Warm the page cache: local rows read from memory, as the server does.
    for p in shards + objects + [p for files in peer_shards.values() for p in files]:
        p.read_bytes()
    slow = {"latency_ms": args.latency_ms, "mbps": args.mbps, "max_connections": args.max_connections}
    zero = {"latency_ms": 0, "mbps": 0, "max_connections": args.max_connections}
    runs: dict[tuple[str, str, str], list[dict]] = {key: [] for key in keys}
    with object_server(serve, BUCKET, **slow) as url:
        for r in range(args.rounds):
            for key in list(runs) if r % 2 == 0 else list(reversed(runs)):
                res = measure(key, url, serve, args, slow, zero)
                if res is not None:
                    runs[key].append(res)
    # The median round of each row, by time; every round's rate kept.
    results = []
    for key, done in runs.items():
        if done:
            med = sorted(done, key=lambda x: x["seconds"])[len(done) // 2]
            results.append({**med, "all_samples_per_s": [round(x["samples_per_s"]) for x in done]})
    payload = {r["payload_bytes"] for r in results if r["row"] not in ("client-objects", "headrace-download")}
    if len(payload) > 2:  # shards and objects hold the same images; every row must agree
        print(f"WARNING: the rows disagree on the bytes read: {sorted(payload)}")

    cap = f"{args.mbps:g} MB/s/conn" if args.mbps else "no cap"  # --mbps 0: the server paces nothing
    label = {"-": "local disk", "slow": f"{args.latency_ms:g} ms, {cap}",
             "zero": "no latency, no cap"}
    print(f"\n{len(objects)} JPEGs of mean {size / len(objects) / 1e3:.0f} KB; {len(shards)} shards; server "
          f"{args.latency_ms:g} ms first byte, {args.mbps:g} MB/s per connection, <= {args.max_connections} "
          "connections\n")
    bounds = reader_bounds(args) if args.pipeline else {}
    if args.pipeline:
        print_pipeline_table(results, label, bounds)
    else:
        print_reader_table(results, label, args)

    if not args.no_json:
        doc = {"benchmark": "latency-pipeline" if args.pipeline else "latency", "date": today,
               "host": socket.gethostname(),
               "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "python": platform.python_version()},
               "config": {**vars(args), "objects": len(objects), "object_bytes": size, "shards": len(shards),
                          "server": "tests/readers/object_server.py, child process, 127.0.0.1",
                          **({"reader_bound_bytes": bounds, "pipeline": "ops.training(224, dtype='float16')"}
                             if args.pipeline else {})},
               "results": results}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
