"""What parsing a shard costs when it comes from a download rather than a file: the parser thread's
work alone, no network (CPU only).

A WebDataset shard's bytes are pushed into a ``RemoteFile`` as downloaded blocks (8 MiB, as
``buffer_bytes=64 MiB`` makes them), then parsed as the webdataset reader's thread parses a
download: members taken as spans of the blocks, a chunk's copied out in one GIL-free call. The same
shard parsed from its file is the row beside it. Microseconds a sample, the best of ``--runs``.

    python examples/benchmark_remote_parse.py                  # the first shard benchmark_latency.py made
    python examples/benchmark_remote_parse.py path/to/shard.tar --runs 9
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from headrace._sample import Sample
from headrace.readers._shard_files import _own_bytes
from headrace.readers._storage import RemoteFile
from headrace.readers._tar import iter_groups, open_shard

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 8 << 20
CHUNK = 64


def parse_download(data: bytes) -> float:
    """µs a sample to parse ``data`` from a download whose blocks are all here."""
    remote = RemoteFile.arrived(data, BLOCK)
    began, n, chunk = time.perf_counter(), 0, []
    with open_shard(remote) as f:
        for j, key, fields, _ in iter_groups(f, "shard", spans=True):
            chunk.append(Sample(key, fields, "shard", j))
            if len(chunk) == CHUNK:
                _own_bytes(chunk)
                n, chunk = n + len(chunk), []
    _own_bytes(chunk)
    n += len(chunk)
    return (time.perf_counter() - began) / n * 1e6


def parse_file(path: Path) -> float:
    began, n = time.perf_counter(), 0
    with open_shard(str(path)) as f:
        for _ in iter_groups(f, str(path)):
            n += 1
    return (time.perf_counter() - began) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shard", nargs="?", type=Path, help="a tar shard (default: benchmark_latency.py's first)")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    shard = args.shard or next(iter(sorted((ROOT / ".data" / "bench-latency" / "serve" / "shards").glob("*.tar"))), None)
    if shard is None:
        parser.error("no shard given, and none made yet: run python examples/benchmark_latency.py --rows headrace-shards first")
    data = shard.read_bytes()
    remote = [parse_download(data) for _ in range(args.runs)]
    local = [parse_file(shard) for _ in range(args.runs)]
    print(f"{shard.name}: {len(data) / 1e6:.0f} MB")
    print("| parsed from | µs a sample (best) | runs |\n| --- | ---: | --- |")
    for name, runs in (("a download's blocks", remote), ("its file", local)):
        print(f"| {name} | {min(runs):.1f} | {', '.join(f'{x:.1f}' for x in runs)} |")


if __name__ == "__main__":
    main()
