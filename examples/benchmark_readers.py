"""Reader benchmark: headrace's WebDataset reader against the ``webdataset`` library, raw samples.

Not a test: it prints a table of samples/s and MB/s and writes it as JSON to ``examples/results/``.

Both read the same tar shards (written by ``headrace pack``) from the page cache (every shard is
read once before timing) and hand out undecoded samples: a dict of field → bytes from the library,
lists of ``headrace.Sample`` from headrace (its async generator, driven by an event loop). Content
does not matter to either, so the payloads are random bytes with ImageNet-like sizes (lognormal
around ``--kib`` KiB) plus a ``.cls`` label: two members per sample. Rows:

- ``sequential``: shards in order, no shuffle (the library: ``WebDataset(urls, shardshuffle=False)``);
- ``shuffled``: shard shuffle plus a 1,000-sample shuffle buffer (the library: ``shardshuffle=True``
  and ``.shuffle(1000)``), seeded;
- ``pipe:cat``: the shards in order as a command's output (``pipe:cat shard.tar``, the convention
  both readers follow for stores reached by a command-line tool), no shuffle;
- ``tfrecord``: the same samples as TFRecord files of ``tf.train.Example`` records (one file per
  shard, ImageNet's feature names), in order: headrace's ``readers.tfrecord`` against the
  ``tfrecord`` package's reader (what a torch ``DataLoader`` over TFRecords uses), when installed;
- ``lmdb``: the same samples' payloads as the values of one LMDB, in key order: headrace's
  ``readers.lmdb`` against a loop of py-lmdb ``txn.get`` (what a torch ``Dataset`` over an LMDB
  does in ``__getitem__``, here with nothing around it: each value freed before the next, so its
  memory is reused at once), when py-lmdb is installed;
- ``caffe``: the same as ``caffe.Datum`` values (``convert_imageset --encoded``'s layout):
  ``readers.caffe`` against that loop with protobuf parsing each value (what Caffe's and
  DALI's users write for a ``Dataset``), when py-lmdb and protobuf are installed;
- ``files``: the same samples as one file each in class folders, in order: ``readers.files``
  against a loop of ``open(path, "rb").read()`` in one thread (each file's bytes freed before the
  next), and a torch ``DataLoader`` whose ``Dataset`` reads a file in ``__getitem__`` (two worker
  processes, 64 files a batch, what a PyTorch user writes), when torch is installed; the peers
  are given the list of paths, headrace the folder (its row includes listing it);
- ``parser``: the tar parsing alone in one thread, members grouped into samples: headrace's
  512-byte-header parser against ``tarfile`` in stream mode ("r|*") plus WebDataset's grouping,
  which is how the library (and a tarfile-based reader) parses.

Every row runs ``--turns`` times (5), the rows taking turns, and the table gives each row's median
(the JSON keeps every turn): on a shared 2-core VM one turn of a row spread by up to 3x within
minutes. The data set is made once and cached under ``.data/bench-readers``.

    python examples/benchmark_readers.py                  # 8192 samples of ~70 KiB, 16 shards
    python examples/benchmark_readers.py --kib 4 --samples 32768
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

import headrace
from headrace import readers
from headrace._loop import new_event_loop  # uvloop when installed, as the loader uses
from headrace.readers._tar import iter_groups, open_shard

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def make_shards(root: Path, samples: int, kib: float, shards: int, seed: int = 0) -> list[str]:
    """A class-per-folder tree of random-byte ".jpg" files, packed into ``shards`` tar shards (cached)."""
    out = root / "shards"
    stamp = root / "config.json"
    config = {"samples": samples, "kib": kib, "shards": shards, "seed": seed}
    if stamp.exists() and json.loads(stamp.read_text()) == config:
        return sorted(str(p) for p in out.glob("*.tar"))
    shutil.rmtree(root, ignore_errors=True)
    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(np.log(kib * 1024), 0.5, samples), 256, None).astype(int)
    src = root / "src"
    for i, size in enumerate(sizes):
        folder = src / f"class{i % 10:02d}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{i:07d}.jpg").write_bytes(b"\xff\xd8\xff" + rng.bytes(int(size) - 3))
    per_shard = -(-samples // shards)
    readers.pack(src, out, format="webdataset", shard_size=None, shard_count=per_shard, shuffle=True, seed=seed)
    shutil.rmtree(src)
    stamp.write_text(json.dumps(config))
    return sorted(str(p) for p in out.glob("*.tar"))


def make_tfrecords(root: Path, shards: list[str]) -> list[str] | None:
    """The shards' samples as TFRecord files, one per shard (cached beside them); None without the
    ``tfrecord`` package, which writes them."""
    try:
        from tfrecord.writer import TFRecordWriter
    except ImportError:
        return None
    out = root / "tfrecord"
    paths = [str(out / (Path(p).stem + ".tfrecord")) for p in shards]
    if all(os.path.exists(p) for p in paths):
        return paths
    out.mkdir(exist_ok=True)
    for shard, path in zip(shards, paths):
        writer = TFRecordWriter(path + ".part")
        with open_shard(shard) as f:
            for _, _, fields, _ in iter_groups(f, shard):
                writer.write({"image/encoded": (bytes(fields["jpg"]), "byte"),
                              "image/class/label": (int(fields["cls"]), "int")})
        writer.close()
        os.replace(path + ".part", path)
    return paths


def make_lmdbs(root: Path, shards: list[str]) -> tuple[str, str] | None:
    """The shards' samples as an LMDB of raw payloads and one of ``caffe.Datum`` values (cached
    beside them); None without py-lmdb or protobuf."""
    try:
        import lmdb
        from headrace.readers.caffe import datum_class
    except ImportError:
        return None
    raw, datums = root / "lmdb", root / "caffe"
    if not (raw / "done").exists():
        datum = datum_class()
        for path in (raw, datums):
            shutil.rmtree(path, ignore_errors=True)
        size = sum(os.path.getsize(p) for p in shards)
        envs = [lmdb.open(str(path), map_size=2 * size + (64 << 20)) for path in (raw, datums)]
        txns = [env.begin(write=True) for env in envs]
        i = 0
        for shard in shards:
            with open_shard(shard) as f:
                for _, _, fields, _ in iter_groups(f, shard):
                    key, image = f"{i:08d}".encode(), bytes(fields["jpg"])
                    txns[0].put(key, image)
                    txns[1].put(key, datum(data=image, label=int(fields["cls"]), encoded=True).SerializeToString())
                    i += 1
        for txn, env in zip(txns, envs):
            txn.commit()
            env.close()
        (raw / "done").touch()
    return str(raw), str(datums)


def make_files(root: Path, shards: list[str]) -> list[str]:
    """The shards' samples as one ".jpg" file each under ten class folders (cached beside them):
    their paths, in order."""
    out = root / "files"
    if not (out / "done").exists():
        shutil.rmtree(out, ignore_errors=True)
        for shard in shards:
            with open_shard(shard) as f:
                for _, key, fields, _ in iter_groups(f, shard):
                    folder = out / f"class{int(fields['cls']):02d}"
                    folder.mkdir(parents=True, exist_ok=True)
                    (folder / f"{Path(key).name}.jpg").write_bytes(fields["jpg"])
        (out / "done").touch()
    return sorted(str(p) for p in out.glob("class*/*.jpg"))


def files_loop(paths: list[str]) -> tuple[int, int]:
    n = b = 0
    for path in paths:
        with open(path, "rb") as f:
            b += len(f.read())
        n += 1
    return n, b


class _FileDataset:
    """A map-style ``Dataset`` of file bytes, as a user writes one for a ``DataLoader``."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> bytes:
        with open(self.paths[i], "rb") as f:
            return f.read()


def _as_list(batch: list) -> list:
    return batch


def torch_files(paths: list[str]) -> tuple[int, int]:
    from torch.utils.data import DataLoader

    n = b = 0
    for batch in DataLoader(_FileDataset(paths), batch_size=64, num_workers=2, collate_fn=_as_list):
        n += len(batch)
        b += sum(map(len, batch))
    return n, b


def lmdb_loop(path: str, parse: bool) -> tuple[int, int]:
    import lmdb

    datum = None
    if parse:
        from headrace.readers.caffe import datum_class

        datum = datum_class()
    n = b = 0
    env = lmdb.open(path, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            for _, value in txn.cursor():
                if datum is not None:
                    parsed = datum.FromString(value)
                    b += len(parsed.data) + len(str(parsed.label))
                else:
                    b += len(value)
                n += 1
    finally:
        env.close()
    return n, b


def warm(paths: list[str]) -> int:
    total = 0
    for p in paths:
        with open(p, "rb") as f:
            while chunk := f.read(1 << 24):
                total += len(chunk)
    return total


def timed(fn: Callable[[], tuple[int, int]]) -> dict:
    start = time.perf_counter()
    samples, nbytes = fn()
    elapsed = time.perf_counter() - start
    return {"samples": samples, "payload_bytes": nbytes, "seconds": elapsed,
            "samples_per_s": samples / elapsed, "mb_per_s": nbytes / elapsed / 1e6}


# --- the two readers ---------------------------------------------------------------------------


def headrace_read(paths: list[str], shuffle: bool) -> tuple[int, int]:
    return drain(readers.webdataset(paths, shuffle=shuffle, shuffle_buffer=1000, seed=0))


def drain(reader: readers.Reader) -> tuple[int, int]:
    """One epoch of ``reader`` on headrace's event loop: (samples, payload bytes)."""

    async def run() -> tuple[int, int]:
        n = b = 0
        async for chunk in reader.read(0):
            n += len(chunk)
            for s in chunk:
                b += s.nbytes
        return n, b

    loop = new_event_loop()
    try:
        return loop.run_until_complete(run())
    finally:
        loop.close()


def library_read(paths: list[str], shuffle: bool) -> tuple[int, int]:
    import webdataset as wds

    dataset = wds.WebDataset(paths, shardshuffle=100 if shuffle else False, seed=0 if shuffle else None)
    if shuffle:
        dataset = dataset.shuffle(1000)
    n = b = 0
    for sample in dataset:
        n += 1
        b += sum(len(v) for k, v in sample.items() if not k.startswith("__"))
    return n, b


def package_tfrecord(paths: list[str]) -> tuple[int, int]:
    from tfrecord.reader import tfrecord_loader

    n = b = 0
    for path in paths:
        for record in tfrecord_loader(path, None, {"image/encoded": "byte", "image/class/label": "int"}):
            n += 1
            b += len(record["image/encoded"]) + len(str(int(record["image/class/label"][0])))
    return n, b


# --- the parsers alone -------------------------------------------------------------------------


def headrace_parse(paths: list[str]) -> tuple[int, int]:
    n = b = 0
    for path in paths:
        with open_shard(path) as f:
            for _, _, fields, _ in iter_groups(f, path):
                n += 1
                b += sum(len(v) for v in fields.values())
    return n, b


def tarfile_parse(paths: list[str]) -> tuple[int, int]:
    from webdataset.tariterators import base_plus_ext

    n = b = 0
    for path in paths:
        with open(path, "rb") as raw, tarfile.open(fileobj=raw, mode="r|*") as tar:
            key, fields = None, {}
            for info in tar:
                if not info.isreg():
                    continue
                prefix, ext = base_plus_ext(info.name)
                data = tar.extractfile(info).read()
                tar.members = []
                if prefix != key:
                    if key is not None:
                        n += 1
                        b += sum(len(v) for v in fields.values())
                    key, fields = prefix, {}
                fields[ext.lower()] = data
            if key is not None:
                n += 1
                b += sum(len(v) for v in fields.values())
    return n, b


def write_results(benchmark: str, kib: float, body: dict) -> Path:
    """``body`` (versions, config, table) as ``examples/results/<benchmark>-<host>-<date>-<kib>k.json``,
    with the time and the machine."""
    RESULTS.mkdir(exist_ok=True)
    host = "vm" if "vm" in socket.gethostname() or os.cpu_count() <= 4 else socket.gethostname()
    out = RESULTS / f"{benchmark}-{host}-{datetime.date.today().isoformat()}-{kib:g}k.json"
    out.write_text(json.dumps({
        "benchmark": benchmark, "when": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"host": socket.gethostname(), "cpus": os.cpu_count(), "platform": platform.platform()},
        **body,
    }, indent=1) + "\n")
    print(f"\nwrote {out.relative_to(ROOT)}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--kib", type=float, default=70.0, help="typical payload size (KiB)")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--data", default=str(ROOT / ".data" / "bench-readers"))
    parser.add_argument("--turns", type=int, default=5, help="runs of every row, taking turns (the median is shown)")
    parser.add_argument("--no-json", action="store_true")
    args = parser.parse_args(argv)
    import webdataset as wds

    root = Path(args.data) / f"{args.samples}x{args.kib:g}k-{args.shards}"
    print(f"data: {args.samples} samples of ~{args.kib:g} KiB in {args.shards} shards under {root}", flush=True)
    paths = make_shards(root, args.samples, args.kib, args.shards)
    size = warm(paths)
    print(f"shards: {size / 2**20:,.0f} MiB on disk, read once to warm the page cache; {os.cpu_count()} cores\n")
    piped = [f"pipe:cat {p}" for p in paths]
    records = make_tfrecords(root, paths)
    if records:
        warm(records)
    lmdbs = make_lmdbs(root, paths)
    if lmdbs:
        warm([os.path.join(folder, "data.mdb") for folder in lmdbs])
    files = make_files(root, paths)
    warm(files)
    try:
        import torch.utils.data  # noqa: F401
        has_torch = True
    except ImportError:
        has_torch = False
    rows = [
        ("sequential", "webdataset library", lambda: library_read(paths, False)),
        ("sequential", "headrace", lambda: headrace_read(paths, False)),
        ("shuffled", "webdataset library", lambda: library_read(paths, True)),
        ("shuffled", "headrace", lambda: headrace_read(paths, True)),
        ("pipe:cat", "webdataset library", lambda: library_read(piped, False)),
        ("pipe:cat", "headrace", lambda: headrace_read(piped, False)),
        *([("tfrecord", "tfrecord package", lambda: package_tfrecord(records)),
           ("tfrecord", "headrace", lambda: drain(readers.tfrecord(records)))] if records else []),
        *([("lmdb", "py-lmdb txn loop", lambda: lmdb_loop(lmdbs[0], parse=False)),
           ("lmdb", "headrace", lambda: drain(readers.lmdb(lmdbs[0]))),
           ("caffe", "py-lmdb + protobuf loop", lambda: lmdb_loop(lmdbs[1], parse=True)),
           ("caffe", "headrace", lambda: drain(readers.caffe(lmdbs[1])))] if lmdbs else []),
        ("files", "open/read loop", lambda: files_loop(files)),
        *([("files", "torch DataLoader, 2 workers", lambda: torch_files(files))] if has_torch else []),
        ("files", "headrace", lambda: drain(readers.files(Path(files[0]).parent.parent))),
        ("parser", "tarfile r|* + grouping", lambda: tarfile_parse(paths)),
        ("parser", "headrace _tar.iter_groups", lambda: headrace_parse(paths)),
    ]
    turns: list[list[dict]] = [[] for _ in rows]
    for turn in range(args.turns):
        for (row, system, fn), results in zip(rows, turns):
            result = timed(fn)
            assert result["samples"] == args.samples, (system, result["samples"])
            results.append(result)
        print(f"turn {turn + 1} of {args.turns} done", flush=True)
    table = []
    print(f"\n{'row':<11} {'system':<27} {'samples/s':>11} {'MB/s':>9} {'ratio':>7}   turns (samples/s)")
    baseline: dict[str, float] = {}
    for (row, system, _), results in zip(rows, turns):
        rate = float(np.median([r["samples_per_s"] for r in results]))
        mb = float(np.median([r["mb_per_s"] for r in results]))
        ratio = rate / baseline.setdefault(row, rate)
        table.append({"row": row, "system": system, "ratio": ratio, "samples_per_s": rate, "mb_per_s": mb,
                      "turns": results})
        spread = ", ".join(f"{r['samples_per_s']:,.0f}" for r in results)
        print(f"{row:<11} {system:<27} {rate:>11,.0f} {mb:>9,.0f} {ratio:>6.2f}x   {spread}", flush=True)
    if not args.no_json:
        write_results("readers", args.kib, {
            "versions": {"python": sys.version.split()[0], "headrace": headrace.__version__, "webdataset": wds.__version__,
                         "numpy": np.__version__},
            "config": {"samples": args.samples, "kib": args.kib, "shards": args.shards, "shard_mib": size / 2**20 / len(paths),
                       "turns": args.turns},
            "table": table,
        })
    return 0


if __name__ == "__main__":
    sys.exit(main())
