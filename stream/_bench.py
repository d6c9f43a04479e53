"""``headrace bench PATH``: how fast this machine reads, decodes and transforms the user's own data.

Three rows (four with ``dataloader=True``), each timed over ``epochs`` epochs of the same samples
(``limit``: the first N), the best epoch reported (the first pays for thread or worker start-up and
a cold page cache):

- ``read``: the reader alone, its samples drained as they come (samples/s, MB/s of encoded bytes);
- ``decode``: a ``Loader`` with ``Pipeline([Decode()])``: images of their own sizes;
- ``pipeline``: a ``Loader`` with ``ops.training(size)`` or ``ops.validation(size, resize=size * 256 // 224)``;
- ``dataloader`` (optional): torch's ``DataLoader`` over the same samples, Pillow decode and the same
  transforms re-made as torchvision computes them, in ``threads`` (default: all cores) persistent
  worker processes (``_bench_dataloader``). A local files tree is read by path each epoch, as
  ``ImageFolder`` does; shards and LMDBs are read once, before the timing, into memory, so that row
  leaves out the reading the others pay for, and the table says so.

The loader rows' consumer only counts the batches, so their starved share (``EpochMetrics``) is
the share of the epoch the pipeline was the limit, and their blocked share is small. Labels are
not parsed (``label=None``): any data set works, and a label costs next to nothing. Samples that
fail to read or decode are skipped and counted, not fatal. The reader is opened as ``headrace
inspect`` opens it (``_inspect.open_reader``), and each row reads it through ``_inspect._Tap``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from ._errors import ConfigError, require_int
from ._inspect import Census, _Tap, event_loop, open_reader, run_to_end
from ._sample import Sample

__all__ = ["bench", "bench_path", "plot", "render"]

ROWS = {"read": "reader alone", "decode": "decode only", "pipeline": "whole pipeline", "dataloader": "torch DataLoader"}


class _Bytes(Census):
    """Counts the samples and encoded bytes a ``_Tap`` passes, nothing else (no header parsing);
    samples that could not be read are counted apart, as ``skipped``.

    ``by_key`` (loader rows) also keeps each sample's bytes under its key until ``take`` hands them
    to the consumer: with ``run_ahead`` the next epoch's reading starts before this epoch's last
    batch, so what an epoch moved is counted where its batches arrive.
    """

    def __init__(self, *, by_key: bool = False) -> None:
        super().__init__()
        self.bytes = self.skipped = 0
        self.by_key: dict[str, int] | None = {} if by_key else None

    def add(self, sample: Sample) -> None:
        if sample.error is not None:  # unreadable: skipped by the loader rows, so counted, not timed, here
            self.skipped += 1
            return
        n = sum(len(v) for v in sample.fields.values())
        self.samples += 1
        self.bytes += n
        if self.by_key is not None:
            self.by_key[sample.key] = self.by_key.get(sample.key, 0) + n

    def take(self, keys: list[str]) -> int:
        assert self.by_key is not None
        return sum(self.by_key.pop(key, 0) for key in keys)


def bench(path: str, *, format: str | None = None, limit: int | None = None, device: str = "cpu",
          pipeline: str = "training", size: int = 224, batch_size: int = 64, threads: int | None = None,
          epochs: int = 2, dataloader: bool = False, log: Callable[[str], object] | None = None) -> dict[str, Any]:
    """Time the rows over the data set at ``path`` and return a JSON-ready report.

    ``report["rows"]``: ``read``, ``decode``, ``pipeline`` and with ``dataloader`` a ``dataloader``
    row, each its best epoch's ``samples``, ``bytes`` (encoded), ``seconds``, ``images_per_second``,
    ``mb_per_second`` (10^6 bytes), ``ratio_to_pipeline``, ``ratio_to_dataloader`` (None without that
    row), ``starved_fraction`` and ``blocked_fraction`` (None for ``read`` and ``dataloader``, which
    have no headrace loader), ``skipped``, ``threads`` (the DataLoader's: worker processes), and
    every epoch's numbers under ``epochs``; the DataLoader row also says ``reads`` (files opened by
    path, or encoded samples held in memory). ``log`` gets a line
    per epoch as it ends. Raises ConfigError for bad arguments and what opening the reader or
    making a loader raises (``LoaderError``, ``ImportError`` for a missing extra); samples that
    fail are skipped and counted, never raised.
    """
    from headrace._device import resolve_device

    if pipeline not in ("training", "validation"):
        raise ConfigError(f"bench: pipeline must be 'training' or 'validation', got {pipeline!r}")
    # Python ints (NumPy's taken): they are in the JSON report too.
    epochs = require_int("bench: epochs", epochs)
    batch_size, size = require_int("batch_size", batch_size), require_int("bench: size", size)
    limit = None if limit is None else require_int("bench: limit", limit, 0)
    threads = None if threads is None else require_int("bench: threads", threads)
    log = log or (lambda line: None)
    resolve_device(_pipeline(pipeline, size), device)  # a GPU asked for and missing: now, not after the reader row
    reader, kind = open_reader(path, format)
    with event_loop() as loop:  # Ctrl-C or SIGTERM: the row's loader is closed before the interrupt is raised
        rows = run_to_end(loop, _rows(reader, kind, limit=limit, device=device, pipeline=pipeline, size=size,
                                      batch_size=batch_size, threads=threads, epochs=epochs, log=log))
        samples = None
        if dataloader:
            from ._bench_dataloader import collect

            samples = run_to_end(loop, collect(reader, kind, limit))
    if samples is not None:  # worker processes start once the event loop and its threads are gone
        rows.append(_dataloader_row(samples, device=device, pipeline=pipeline, size=size, batch_size=batch_size,
                                    workers=threads or os.cpu_count() or 1, epochs=epochs, log=log))
    by_name = {row["name"]: row for row in rows}
    for row in rows:
        for other in ("pipeline", "dataloader"):
            top = by_name[other]["images_per_second"] if other in by_name else 0.0
            row[f"ratio_to_{other}"] = row["images_per_second"] / top if top > 0 else None
    return {"path": path, "format": kind, "device": device, "pipeline": pipeline, "size": size,
            "batch_size": batch_size, "threads": by_name["pipeline"]["threads"], "epochs": epochs, "limit": limit,
            "epoch_reported": "best", "rows": rows}


def _validation_resize(size: int) -> int:
    """The shorter side the validation pipeline resizes to before its centre crop: 256 for 224."""
    return size * 256 // 224


async def _rows(reader: Any, kind: str, limit: int | None, device: str, pipeline: str, size: int, batch_size: int,
                threads: int | None, epochs: int, log: Callable[[str], object]) -> list[dict[str, Any]]:
    from headrace import ops

    rows = [await _read_row(reader, kind, limit, epochs, log)]
    for name, pipe, what in (("decode", ops.Pipeline([ops.Decode()], label=None), "Decode"),
                             ("pipeline", _pipeline(pipeline, size), f"{pipeline} {size}")):
        rows.append(await _loader_row(name, what, reader, pipe, limit=limit, device=device,
                                      batch_size=batch_size, threads=threads, epochs=epochs, log=log))
    return rows


def _pipeline(pipeline: str, size: int) -> Any:
    from headrace import ops

    if pipeline == "training":
        return ops.training(size, label=None)
    return ops.validation(size, resize=_validation_resize(size), label=None)


async def _read_row(reader: Any, kind: str, limit: int | None, epochs: int, log: Callable[[str], object]) -> dict[str, Any]:
    counts = _Bytes()
    tap = _Tap(reader, counts, limit)
    runs = []
    for epoch in range(epochs):
        counts.samples = counts.bytes = counts.skipped = 0
        start = time.perf_counter()
        async with contextlib.aclosing(tap.read(epoch)) as chunks:
            async for _ in chunks:
                pass
        runs.append(_run(epoch, counts.samples, counts.bytes, time.perf_counter() - start, None,
                         skipped=counts.skipped))
        log(_line("read", runs[-1], epochs))
    return {**_best("read", kind, runs), "threads": None}


async def _loader_row(name: str, what: str, reader: Any, pipe: Any, *, limit: int | None, device: str,
                      batch_size: int, threads: int | None, epochs: int,
                      log: Callable[[str], object]) -> dict[str, Any]:
    from headrace import Loader

    counts = _Bytes(by_key=True)
    loader = Loader(_Tap(reader, counts, limit), batch_size=batch_size, pipeline=pipe, device=device,
                    num_threads=threads, on_error="skip", max_errors=1.0, distributed=False)
    sync = _synchronize(loader.device)
    runs = []
    async with loader:
        for epoch in range(epochs):
            done = _Bytes()  # what reached the consumer this epoch
            dropped = loader.stats().dropped
            start = time.perf_counter()
            async for batch in loader:
                done.samples += len(batch.sample_keys)
                done.bytes += counts.take(batch.sample_keys)
            sync()  # on the GPU a batch is queued work until its stream is done
            seconds = time.perf_counter() - start
            stats = loader.stats()
            runs.append(_run(epoch, done.samples, done.bytes, seconds, stats.epoch_metrics,
                             skipped=stats.dropped - dropped))
            log(_line(name, runs[-1], epochs))
    return {**_best(name, what, runs), "threads": loader.num_threads}


def _dataloader_row(samples: Any, *, device: str, pipeline: str, size: int, batch_size: int, workers: int,
                    epochs: int, log: Callable[[str], object]) -> dict[str, Any]:
    from ._bench_dataloader import epoch, make_loader

    loader = make_loader(samples, pipeline=pipeline, size=size, resize=_validation_resize(size),
                         batch_size=batch_size, workers=workers, pin_memory=device.startswith("cuda"))
    runs = []
    for n in range(epochs):
        start = time.perf_counter()
        done, moved, skipped = epoch(loader, samples, device)
        runs.append(_run(n, done, moved, time.perf_counter() - start, None, skipped=skipped))
        log(_line("dataloader", runs[-1], epochs))
    del loader  # its persistent workers exit here, not at some later collection
    what = f"{workers} workers, {'by path' if samples.by_path else 'from memory'}"
    return {**_best("dataloader", what, runs), "threads": workers, "reads": samples.where}


def _synchronize(device: str) -> Callable[[], None]:
    if not device.startswith("cuda"):
        return lambda: None
    import torch

    return lambda: torch.cuda.synchronize(device)


def _run(epoch: int, samples: int, nbytes: int, seconds: float, metrics: Any, *, skipped: int = 0) -> dict[str, Any]:
    """One epoch of a row: the samples (and their encoded bytes) that reached the end of the row."""
    return {"epoch": epoch, "samples": samples, "bytes": nbytes, "skipped": skipped, "seconds": seconds,
            "images_per_second": samples / seconds if seconds > 0 else 0.0,
            "mb_per_second": nbytes / 1e6 / seconds if seconds > 0 else 0.0,
            "starved_fraction": None if metrics is None else min(metrics.starved_fraction, 1.0),
            "blocked_fraction": None if metrics is None else min(metrics.blocked_fraction, 1.0)}


def _best(name: str, what: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    best = max(runs, key=lambda r: r["images_per_second"])
    return {"name": name, "what": f"{ROWS[name]} ({what})", **best,
            "epochs": [{k: r[k] for k in ("epoch", "samples", "seconds", "images_per_second")} for r in runs]}


def _line(name: str, run: dict[str, Any], epochs: int) -> str:
    return (f"{name} epoch {run['epoch'] + 1}/{epochs}: {run['samples']:,} samples in {run['seconds']:.2f} s, "
            f"{run['images_per_second']:,.0f} samples/s")


def render(report: dict[str, Any]) -> str:
    """The report as a text table: images/s, MB/s, ratio to the whole pipeline (and to the DataLoader
    when it ran), starved and blocked."""
    rows = report["rows"]
    dataloader = next((row for row in rows if row["name"] == "dataloader"), None)
    ratios = ["pipeline"] + (["dataloader"] if dataloader else [])
    width = max(34, *(len(row["what"]) for row in rows))
    lines = [f"headrace bench {report['path']} ({report['format']}): {report['device']}, {report['threads']} "
             f"thread(s), batch {report['batch_size']}; the best of {report['epochs']} epoch(s) per row",
             f"{'row':<{width}} {'samples':>8} {'images/s':>10} {'MB/s':>8} {'vs pipeline':>12}"
             + (f" {'vs DataLoader':>14}" if dataloader else "") + f" {'starved':>8} {'blocked':>8}"]
    for row in rows:
        shown = [_ratio(row[f"ratio_to_{other}"]).rjust(12 if other == "pipeline" else 14) for other in ratios]
        lines.append(f"{row['what']:<{width}} {row['samples']:>8,} {row['images_per_second']:>10,.0f} "
                     f"{row['mb_per_second']:>8,.1f} {' '.join(shown)} {_share(row['starved_fraction']):>8} "
                     f"{_share(row['blocked_fraction']):>8}")
    skipped = {row["name"]: row["skipped"] for row in rows if row["skipped"]}
    if skipped:
        lines.append("skipped (failed to read or decode): " + ", ".join(f"{k} {v:,}" for k, v in skipped.items()))
    lines.append("starved: the consumer waited for a batch; blocked: finished batches waited for the consumer")
    if dataloader:
        lines.append(f"torch DataLoader: Pillow decode and torchvision-style {report['pipeline']} transforms in "
                     f"{dataloader['threads']} persistent worker process(es), {dataloader['reads']}"
                     + ("" if dataloader["reads"].startswith("files") else " (read once before timing: this row "
                        "does not pay for reading)"))
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def plot(report: dict[str, Any], path: str) -> None:
    """Write a PNG: images/s per row (each bar labelled with its ratio to the DataLoader row when that
    ran), and the loader rows' starved and blocked shares stacked. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    rows = report["rows"]
    timed = [r for r in rows if r["starved_fraction"] is not None]
    fig, (speed, shares) = plt.subplots(1, 2, figsize=(11, 4))
    bars = speed.bar([r["name"] for r in rows], [r["images_per_second"] for r in rows], color="tab:blue")
    if any(r["name"] == "dataloader" for r in rows):
        speed.bar_label(bars, labels=[f"{_ratio(r['ratio_to_dataloader'])} DataLoader" for r in rows], fontsize=8)
    speed.set_ylabel("images/s")
    speed.set_title(f"{report['device']}, batch {report['batch_size']} (best of {report['epochs']} epochs)")
    names = [r["name"] for r in timed]
    starved = [r["starved_fraction"] for r in timed]
    shares.bar(names, starved, color="tab:orange", label="consumer starved")
    shares.bar(names, [r["blocked_fraction"] for r in timed], bottom=starved, color="tab:green",
               label="pipeline blocked")
    shares.set_ylim(0, 1)
    shares.set_ylabel("share of the epoch")
    shares.legend(loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    fig.suptitle(f"headrace bench {report['path']}")
    fig.tight_layout()
    fig.savefig(path, format="png")
    plt.close(fig)


def _log_line(line: str) -> None:
    # One write with its newline: print() writes the text and the newline apart (stderr writes
    # through), and a Ctrl-C between the two left "interrupted" on the end of the epoch's line.
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def bench_path(path: str, *, json_path: str | None = None, plot_path: str | None = None, out: Any = None,
               **options: Any) -> int:
    """``headrace bench``: run ``bench``, print the table, write ``json_path`` and ``plot_path``; 0."""
    report = bench(path, log=_log_line, **options)
    print(render(report), file=out or sys.stdout)
    if json_path is not None:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    if plot_path is not None:
        plot(report, plot_path)
    return 0
