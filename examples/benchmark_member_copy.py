"""What copying a sample out of a downloaded block costs, with the copies dropped at once or kept alive.

A remote shard's parser copies each member out of the blocks the download delivered into a fresh
``bytes`` (``RemoteFile.read``), holding the GIL. Kept alive, as a shuffle buffer and the batches in
flight keep samples, the copies land on fresh pages: the page faults come inside the copy. This
script times ``bytes(view[a:a + size])`` over 128 MiB of 8 MiB blocks, three passes each way, in a
thread of its own (as the parser runs):

    python examples/benchmark_member_copy.py [--size 68000] [--keep 1000]

``--keep``: copies kept alive (the oldest half dropped each time the window doubles). Run it with
``MALLOC_TOP_PAD_=268435456`` to see how much of the cost is glibc giving trimmed heap back.
"""

from __future__ import annotations

import argparse
import os
import threading
import time


def copy_all(blocks: list[bytes], size: int, keep: int) -> float:
    """Microseconds a copy, over every ``size`` slice of ``blocks``."""
    began, copies, alive = time.perf_counter(), 0, []
    for block in blocks:
        view = memoryview(block)
        for start in range(0, len(block) - size, size):
            copy = bytes(view[start : start + size])
            copies += 1
            if keep:
                alive.append(copy)
                if len(alive) > 2 * keep:
                    del alive[:keep]
    return (time.perf_counter() - began) / copies * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=68_000, help="bytes a sample (the benchmark set's mean JPEG)")
    parser.add_argument("--keep", type=int, default=1000, help="copies kept alive (a shuffle buffer's worth)")
    args = parser.parse_args()
    blocks = [os.urandom(8 << 20) for _ in range(16)]  # 128 MiB: past the caches
    for keep in (0, args.keep):
        passes: list[float] = []
        worker = threading.Thread(target=lambda: passes.extend(copy_all(blocks, args.size, keep) for _ in range(3)))
        worker.start()
        worker.join()
        label = "dropped at once" if keep == 0 else f"{keep:,}-{2 * keep:,} kept alive"
        print(f"copies of {args.size:,} bytes, {label}: {', '.join(f'{p:.1f}' for p in passes)} µs a copy")


if __name__ == "__main__":
    main()
