"""``headrace inspect PATH``: what a data set holds, read through the readers it would be loaded with.

One pass over the samples, in reader order (``--limit N``: the first N): per sample its fields, its
label (the ``cls`` field), its image's format (from the bytes' magic, never the name) and size (from
the header: ``ops._limits.claimed_size``, or Pillow's lazy open for other formats), its bytes.
``--verify`` makes that pass the reader of a CPU ``Loader`` that decodes every image, skipping and
recording the samples that fail, so reading and decoding overlap as they do in training.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import io
import json
import logging
import os
import statistics
import sys
import warnings
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, Self

from headrace._errors import ConfigError, LoaderError
from headrace._sample import Sample, value_nbytes
from headrace.readers import Reader

__all__ = ["Census", "image_format", "inspect", "inspect_path", "open_reader", "render"]

_NOT_IMAGES = frozenset({"cls", "json", "txt", "__key__", "__url__", "id", "label"})
_SIDE_BINS = (0, 64, 128, 256, 512, 1024, 2048, 4096)
_MP_BINS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0)
_AVIF_BRANDS = frozenset({b"avif", b"avis"})
_HEIF_BRANDS = frozenset({b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"hevm", b"hevs", b"mif1", b"msf1"})
_SHOWN = 10  # class names, and bad samples after that many lines each, shown in the text report


def image_format(data: Any) -> str:
    """The image format the bytes' signature names (``jpeg``, ``png``, ...), or ``"unknown"``."""
    head = bytes(data[:16])
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if head.startswith(b"BM"):
        return "bmp"
    if head.startswith((b"II*\x00", b"MM\x00*")):
        return "tiff"
    if head.startswith((b"\x00\x00\x00\x0cjP  \r\n\x87\n", b"\xff\x4f\xff\x51")):
        return "jpeg2000"
    if head[4:8] == b"ftyp":  # ISO media: images only under the HEIF brands, else a video (MP4, QuickTime)
        size = int.from_bytes(head[:4], "big")
        brands = {bytes(data[i : i + 4]) for i in range(16, min(size, 64) - 3, 4)} | {head[8:12]}
        if brands & _AVIF_BRANDS:
            return "avif"
        return "heif" if brands & _HEIF_BRANDS else "unknown"
    if len(head) > 2 and head[0:1] == b"P" and head[1:2] in b"1234567" and head[2:3].isspace():
        return "pnm"
    return "unknown"


def _header_size(data: Any, fmt: str) -> tuple[int, int] | None:
    """(width, height) from the header only; None where it cannot be read."""
    from headrace.ops._limits import claimed_size

    size = claimed_size(data) if fmt in ("jpeg", "png", "webp", "gif") else None
    if size is not None or fmt == "unknown":
        return size
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:  # lazy: the header only
                return img.size
    except Exception:  # noqa: BLE001 - any plugin's complaint means the header says nothing usable
        return None


class Census:
    """Counts what the samples it is shown hold; ``report()`` gives it as a JSON-ready dict."""

    def __init__(self) -> None:
        self.samples = 0
        self.fields: Counter[str] = Counter()
        self.labels: Counter[int] = Counter()
        self.bad_labels = 0
        self.formats: Counter[str] = Counter()
        self.no_image = 0
        self.sizes: list[tuple[int, int]] = []
        self.sample_bytes: list[int] = []
        self.image_bytes: list[int] = []
        self.unreadable: list[LoaderError] = []

    def add(self, sample: Sample) -> None:
        self.samples += 1
        if sample.error is not None:
            self.unreadable.append(sample.error)
        self.fields.update(list(sample.fields))
        self.sample_bytes.append(sum(value_nbytes(v) for v in sample.fields.values()))  # ints and arrays too
        cls = sample.fields.get("cls")
        if cls is not None:
            try:
                self.labels[int(bytes(cls))] += 1
            except ValueError:
                self.bad_labels += 1
        data = _image_field(sample.fields)
        if data is None:
            self.no_image += 1
            return
        self.image_bytes.append(len(data))
        fmt = image_format(data)
        self.formats[fmt] += 1
        size = _header_size(data, fmt)
        if size is not None:
            self.sizes.append(size)

    def report(self, classes: list[str] | None = None) -> dict[str, Any]:
        per_class = [self.labels[k] for k in sorted(self.labels)]
        names = None if not classes else {str(k): classes[k] if 0 <= k < len(classes) else None for k in sorted(self.labels)}
        shorter = [min(w, h) for w, h in self.sizes]
        megapixels = [w * h / 1e6 for w, h in self.sizes]
        return {
            "samples": self.samples,
            "fields": dict(sorted(self.fields.items())),
            "classes": {"count": len(self.labels), "named": len(classes or []), "names": list(classes or []),
                        "per_class": {str(k): self.labels[k] for k in sorted(self.labels)}, "ids_to_names": names,
                        "unlabelled": self.samples - sum(per_class) - self.bad_labels,
                        "bad_labels": self.bad_labels, **_spread(per_class)},
            "image_formats": dict(self.formats.most_common()),
            "no_image_field": self.no_image,
            "image_sizes": {"read": len(self.sizes), "width": _spread([w for w, _ in self.sizes]),
                            "height": _spread([h for _, h in self.sizes]),
                            "shorter_side": {**_spread(shorter), "histogram": _histogram(shorter, _SIDE_BINS)},
                            "megapixels": {**_spread(megapixels), "histogram": _histogram(megapixels, _MP_BINS)}},
            "sample_bytes": {"total": sum(self.sample_bytes), **_spread(self.sample_bytes)},
        }


def _image_field(fields: dict[str, Any]) -> Any:
    """The encoded image: the first field named as an image (the Pipeline's rule), else the first
    other non-label field whose bytes carry an image signature."""
    from headrace.ops._pipeline import IMAGE_EXTENSIONS

    for name in IMAGE_EXTENSIONS:
        if name in fields:
            return fields[name]
    for name, value in fields.items():
        if (name not in _NOT_IMAGES and isinstance(value, (bytes, bytearray, memoryview))
                and image_format(value) != "unknown"):
            return value
    return None


def _spread(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"min": None, "median": None, "max": None}
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _histogram(values: list[float], edges: tuple[float, ...]) -> list[dict[str, Any]]:
    """Counts per bin [edges[i], edges[i+1]), the last bin open; bins outside the data left out."""
    counts = [0] * len(edges)
    for v in values:
        i = len(edges) - 1
        while i > 0 and v < edges[i]:
            i -= 1
        counts[i] += 1
    rows = [{"from": lo, "to": edges[i + 1] if i + 1 < len(edges) else None, "count": n}
            for i, (lo, n) in enumerate(zip(edges, counts))]
    used = [i for i, n in enumerate(counts) if n]
    return rows[used[0] : used[-1] + 1] if used else []


class _Tap(Reader):
    """A reader that hands on another's samples (the first ``limit``) and shows each to a census."""

    def __init__(self, reader: Reader, census: Census, limit: int | None) -> None:
        self.reader, self.census, self.limit = reader, census, limit

    def __len__(self) -> int:
        n = len(self.reader)
        return n if self.limit is None else min(n, self.limit)

    def shard(self, rank: int, world: int, *, equal: Any = None) -> Self:
        raise ConfigError("inspect reads the whole data set in one process")

    async def read(self, epoch: int, *, start: int = 0, seed: int = 0) -> AsyncIterator[list[Sample]]:
        seen, limit = 0, self.limit
        async with contextlib.aclosing(self.reader.read(epoch, start=start, seed=seed)) as chunks:
            async for chunk in chunks:
                if limit is not None:
                    chunk = chunk[: limit - seen]
                for sample in chunk:
                    self.census.add(sample)
                seen += len(chunk)
                if chunk:
                    yield chunk
                if limit is not None and seen >= limit:
                    return


def open_reader(path: str, format: str | None = None) -> tuple[Any, str]:
    """The reader for ``path`` and its kind (``files``, ``webdataset``, ``lmdb``, ``caffe``, ``tfrecord`` or
    ``recordio``; an LMDB whose first value is an encoded ``caffe.Datum`` is ``caffe``),
    guessed from the path (``_guess``; a bucket folder is tried as shards first) unless ``format``
    says. TFRecord files are read with the ImageNet layout's fields (``jpg``, ``cls``) where their
    first record has those features, else with its first feature that holds an image (by its bytes)
    as ``jpg``, else with every feature under its own name. Raises what the reader's constructor
    raises."""
    from headrace import readers

    kind = format or _guess(path)
    if format is None and kind == "files" and "://" in path:  # a bucket folder: of shards, or of classes
        try:
            return readers.webdataset(path), "webdataset"
        except LoaderError:
            pass
    if kind == "lmdb":
        reader = readers.lmdb(path)
        if format is None and _holds_caffe_datums(reader):
            return readers.caffe(path), "caffe"
        return reader, kind
    if kind == "caffe":
        return readers.caffe(path), kind
    if kind == "webdataset":
        return readers.webdataset(path), kind
    if kind == "tfrecord":
        return _tfrecord_reader(path), kind
    if kind == "recordio":
        return readers.recordio(path), kind
    if kind != "files":
        raise ConfigError(f"inspect: format must be files, webdataset, lmdb, caffe, tfrecord or recordio, got {kind!r}")
    return readers.files(path), kind


def _holds_caffe_datums(reader: Any) -> bool:
    """The LMDB's first value is an encoded ``caffe.Datum`` (Caffe's ``convert_imageset --encoded``),
    not a headrace record or a bare image: read it as Caffe's, or its images would show as ``bin``."""
    from headrace.readers.caffe import decode_datum
    from headrace.readers.lmdb import decode_default

    value = reader.first_value()
    if value is None or "bin" not in decode_default(b"", value):
        return False
    try:
        decode_datum(b"", value)
    except (ValueError, ImportError):  # not a Datum, a raw one, or no protobuf to tell
        return False
    return True


def _tfrecord_reader(path: str) -> Any:
    from headrace import readers
    from headrace.readers.tfrecord import IMAGENET_FEATURES

    everything = readers.tfrecord(path, features=None)  # the files scanned for their records once
    first = everything._fetch([0])[0]  # one record, read here (its reader fetches in threads the same way)
    if first.error is not None:
        return everything
    images = [name for name, value in first.fields.items()
              if isinstance(value, bytes) and image_format(value) != "unknown"]
    # The ImageNet layout as the loader reads it; else the image under a name the decoder takes (so
    # that --verify decodes it), its other features left out, since a feature named must be in every record.
    features = (IMAGENET_FEATURES if set(IMAGENET_FEATURES) <= set(first.fields)
                else {images[0]: "jpg"} if images else None)
    if features is None:
        return everything
    chosen = copy.copy(everything)  # the same records, read with these features
    chosen.features = dict(features)
    return chosen


def _guess(path: str) -> str:
    """A URL ending in ``/``, a local folder of class sub-folders: files; a local folder holding
    ``data.mdb``, or another local file: an LMDB; files that start as a TFRecord does (a folder of
    them, or a pattern): TFRecord; ``.rec`` files (or a folder of them): RecordIO; shard names,
    patterns, other URLs: WebDataset."""
    shard_like = path.endswith((".tar", ".tar.gz", ".tgz")) or any(ch in path for ch in "{*?[")
    if "://" in path:
        return "webdataset" if shard_like or not path.endswith("/") else "files"
    if path.endswith(".rec"):
        return "recordio"
    if os.path.isfile(path):
        return "webdataset" if shard_like else "tfrecord" if _is_tfrecord(path) else "lmdb"
    if os.path.isdir(path):
        names = os.listdir(path)
        if "data.mdb" in names:
            return "lmdb"
        if any(n.endswith((".tar", ".tar.gz", ".tgz")) for n in names):
            return "webdataset"
        if any(n.endswith(".rec") for n in names):
            return "recordio"
        files = sorted(n for n in names if not n.startswith(".") and os.path.isfile(os.path.join(path, n)))
        if files and _is_tfrecord(os.path.join(path, files[0])):
            return "tfrecord"
        return "files"
    if "{" in path and not path.endswith((".tar", ".tar.gz", ".tgz")):
        from headrace.readers._shards import expand_braces

        first = expand_braces(path)[0]
        if os.path.isfile(first) and _is_tfrecord(first):
            return "tfrecord"
    return "webdataset" if shard_like else "files"


def _is_tfrecord(path: str) -> bool:
    """The file starts as a TFRecord of Examples does: a length that fits the file, then the first
    byte of an Example (its features field)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(13)
    except OSError:
        return False
    if len(head) < 13:
        return False
    length = int.from_bytes(head[:8], "little")
    return 0 < length and 12 + length + 4 <= size and head[12] == 0x0A


def _storage(reader: Any, kind: str, census: Census) -> dict[str, Any]:
    """The sizes of what holds the data: the files (from the samples read), the shards or the LMDB."""
    if kind == "files":  # a file is a sample's image field
        return {"kind": "files", "count": len(census.image_bytes), "bytes": sum(census.image_bytes),
                **_spread(census.image_bytes)}
    if kind in ("tfrecord", "recordio"):
        sizes = [os.path.getsize(p) for p in reader.paths]
        return {"kind": kind, "count": len(sizes), "bytes": sum(sizes), **_spread(sizes)}
    if kind in ("lmdb", "caffe"):
        path = reader.path if not os.path.isdir(reader.path) else os.path.join(reader.path, "data.mdb")
        size = os.path.getsize(path)
        return {"kind": "lmdb", "count": 1, "bytes": size, "min": size, "median": size, "max": size}
    local = [p for p in reader.shards if os.path.isfile(p)]
    sizes = [os.path.getsize(p) for p in local]
    out: dict[str, Any] = {"kind": "shards", "count": len(reader.shards), "bytes": sum(sizes) if sizes else None,
                           **_spread(sizes)}
    if len(local) < len(reader.shards):
        out["note"] = "sizes of local shards only"
    return out


def _classes(reader: Any, kind: str) -> list[str]:
    """Class names the data set records: the sub-folders, the LMDB's or the shard index's list."""
    names = getattr(reader, "classes", None)
    if names:
        return list(names)
    if kind == "webdataset":
        from headrace.readers._shards import INDEX_NAME

        folder = os.path.dirname(reader.shards[0])
        with contextlib.suppress(OSError, ValueError, AttributeError):
            with open(os.path.join(folder, INDEX_NAME), encoding="utf-8") as f:
                return [str(c) for c in json.load(f).get("classes", [])]
    return []


def inspect(path: str, *, format: str | None = None, limit: int | None = None, verify: bool = False,
            threads: int | None = None, progress: bool = False) -> dict[str, Any]:
    """What the data set at ``path`` holds, as a JSON-ready dict (see the module docstring).

    ``verify`` decodes every image on the CPU; the samples that cannot be read or decoded are listed
    under ``"bad"`` (without it, only those that cannot be read). ``progress`` shows a tqdm bar.
    Raises what opening the reader raises (LoaderError, ImportError for a missing extra).
    """
    from tqdm import tqdm

    reader, kind = open_reader(path, format)
    census = Census()
    tap = _Tap(reader, census, limit)
    try:
        total: int | None = len(tap)
    except TypeError:  # shards without an index: counted as they are read
        total = None
    with tqdm(total=total, desc="verifying" if verify else "reading", unit="sample", disable=not progress) as bar:
        with event_loop() as loop:
            bad = run_to_end(loop, _verify(tap, threads, bar.update) if verify else _read(tap, bar.update))
    if not verify:
        bad = census.unreadable
    return {
        "path": path,
        "format": kind,
        "limit": limit,
        **census.report(_classes(reader, kind)),
        "storage": _storage(reader, kind, census),
        "verified": verify,
        "bad": [{"key": e.key, "source": e.source, "error": type(e).__name__, "stage": e.stage, "message": e.message}
                for e in bad],
    }


@contextlib.contextmanager
def event_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A new event loop for the commands' ``run_to_end`` calls; at the end the tasks still there are
    cancelled and awaited, and the async generators closed, before the loop closes."""
    from headrace._loop import new_event_loop

    loop = new_event_loop()
    try:
        yield loop
    finally:
        try:
            if rest := [t for t in asyncio.all_tasks(loop) if not t.done()]:
                for task in rest:
                    task.cancel()
                run_to_end(loop, asyncio.wait(rest))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


def run_to_end(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` on ``loop`` and return its result. Ctrl-C, or the command line's SIGTERM, is a
    KeyboardInterrupt raised wherever the main thread is; it is raised here only once ``coro``,
    cancelled, has unwound (its loader closed). A loop closed under the pending tasks instead printed
    "Task was destroyed but it is pending!" for each and cleaned nothing up; asyncio.Runner waits
    too, but gives up when a TaskGroup raises the interrupt again out of a task it cancels."""
    task = loop.create_task(coro)
    try:
        return loop.run_until_complete(task)
    except BaseException as stop:
        task.cancel()
        while not task.done():
            try:
                loop.run_until_complete(asyncio.wait([task]))
            except BaseException as again:
                if again is not stop:  # a second Ctrl-C: stop waiting
                    raise
        raise


async def _read(tap: _Tap, update: Callable[[int], object]) -> list[LoaderError]:
    async with contextlib.aclosing(tap.read(0)) as chunks:
        async for chunk in chunks:
            update(len(chunk))
    return []


async def _verify(tap: _Tap, threads: int | None, update: Callable[[int], object]) -> list[LoaderError]:
    """Decode every sample ``tap`` gives through a CPU loader that skips, and records, failures."""
    from headrace import Loader
    from headrace.ops import Pipeline

    bad: list[LoaderError] = []

    def on_error(error: LoaderError) -> str:
        bad.append(error)
        update(1)
        return "skip"

    loader = Loader(tap, batch_size=32, pipeline=Pipeline(label=None), device="cpu", num_threads=threads,
                    on_error=on_error, max_errors=1.0, distributed=False)
    log = logging.getLogger("headrace")
    level = log.level
    log.setLevel(logging.ERROR)  # the loader logs each skip; the report lists them all instead
    try:
        async with loader:
            async for batch in loader:
                update(len(batch.sample_keys))
    finally:
        log.setLevel(level)
    return bad


def inspect_path(path: str, *, format: str | None = None, limit: int | None = None, verify: bool = False,
                 threads: int | None = None, json_path: str | None = None, out: Any = None) -> int:
    """``headrace inspect``: print the report (and write it to ``json_path``); 1 when samples are bad, else 0."""
    report = inspect(path, format=format, limit=limit, verify=verify, threads=threads, progress=True)
    print(render(report), file=out or sys.stdout)
    if json_path is not None:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
    return 1 if report["bad"] else 0


_KINDS = {"files": "a class-per-folder tree", "webdataset": "WebDataset shards", "lmdb": "an LMDB", "caffe": "a Caffe LMDB",
          "tfrecord": "TFRecord files", "recordio": "RecordIO files"}


def render(report: dict[str, Any]) -> str:
    """The report as text: one line per subject, histograms as bars."""
    lines = [f"{report['path']}: {_KINDS[report['format']]}"]
    limited = report["limit"] is not None and report["samples"] >= report["limit"]
    lines.append(f"samples: {report['samples']:,}" + (f" (the first {report['limit']:,} only: --limit)" if limited else ""))
    lines.append("fields: " + (", ".join(f"{k} {n:,}" for k, n in report["fields"].items()) or "none"))
    lines.append(_classes_line(report["classes"]))
    formats = ", ".join(f"{k} {n:,}" for k, n in report["image_formats"].items()) or "none"
    lines.append(f"image formats (from the bytes): {formats}"
                 + (f"; {report['no_image_field']:,} sample(s) without an image field" if report["no_image_field"] else ""))
    sizes = report["image_sizes"]
    if sizes["read"]:
        w, h = sizes["width"], sizes["height"]
        lines.append(f"image sizes ({sizes['read']:,} headers read): width {w['min']}-{w['max']} (median {w['median']:g}), "
                     f"height {h['min']}-{h['max']} (median {h['median']:g})")
        lines += _bars("shorter side, px", sizes["shorter_side"]["histogram"], whole=True)
        lines += _bars("megapixels", sizes["megapixels"]["histogram"], whole=False)
    st = report["storage"]
    what = {"files": "file(s)", "shards": "shard(s)", "lmdb": "LMDB file", "tfrecord": "TFRecord file(s)",
            "recordio": ".rec file(s)"}[st["kind"]]
    if st["bytes"] is None:
        lines.append(f"storage: {st['count']:,} {what}, sizes unknown (remote)")
    else:
        lines.append(f"storage: {st['count']:,} {what}, {_size(st['bytes'])}"
                     + (f"; each min {_size(st['min'])}, median {_size(st['median'])}, max {_size(st['max'])}"
                        if st["count"] > 1 else "") + (f" ({st['note']})" if "note" in st else ""))
    bad = report["bad"]
    if bad:
        lines.append(f"bad samples: {len(bad):,}" + ("" if report["verified"] else " (unreadable; --verify also decodes)"))
        lines += [f"  {b['key']}  {b['source']}  {b['error']}: {b['message']}" for b in bad]
    else:
        lines.append("verified: every sample decodes" if report["verified"] else "not decoded (--verify decodes every image)")
    return "\n".join(lines)


def _classes_line(c: dict[str, Any]) -> str:
    if not c["count"]:
        return "classes: none (no cls field)"
    ids = list(c["per_class"])
    names = c["ids_to_names"]
    shown = [names[i] if names and names.get(i) is not None else i for i in ids[:_SHOWN]]
    more = f", ... (+{len(ids) - _SHOWN:,})" if len(ids) > _SHOWN else ""
    named = f" of {c['named']:,} named" if c["named"] and c["named"] != c["count"] else ""
    extra = "".join(f"; {c[k]:,} {k.replace('_', ' ')}" for k in ("unlabelled", "bad_labels") if c[k])
    return (f"classes: {c['count']:,}{named} ({', '.join(map(str, shown))}{more}); samples per class "
            f"min {c['min']:,}, median {c['median']:g}, max {c['max']:,}{extra}")


def _bars(title: str, rows: list[dict[str, Any]], *, whole: bool) -> list[str]:
    """A histogram's bins as bars; ``whole``: integer bins, labelled with their last value (64-127)."""
    top = max((r["count"] for r in rows), default=0) or 1
    labels = [f"{r['from']:g}" + ("+" if r["to"] is None else f"-{r['to'] - 1 if whole else r['to']:g}") for r in rows]
    width = max(map(len, labels), default=0)
    return [f"  {title}:"] + [f"    {label:>{width}} {r['count']:>8,} {'#' * max(1, round(40 * r['count'] / top))}"
                              for label, r in zip(labels, rows)]


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"
