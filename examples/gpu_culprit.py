"""Find the input and decode window that crash or hang nvImageCodec on the GPU path.

A crash inside nvImageCodec kills the process in one of its own threads, so Python's fault handler
names no frame of ours. This runs the Loader over a folder (as ``examples/fuzz.py --dump`` writes
one) with each lane batch's JPEG windows logged to a file, synced, before the lane decodes it;
after a crash or a hang the last batches logged hold the culprit. ``find`` then decodes those
windows one by one through nvImageCodec's Python API in fresh processes and names the ones that
kill it (each process restarts after the last window it reached).

    python examples/fuzz.py --count 40000 --seed 300 --dump $(seq 3000 3999) --dump-dir /tmp/s
    python examples/gpu_culprit.py run /tmp/s --seed 300     # the fuzz run's seed: the same windows
    python examples/gpu_culprit.py find

For the native stack of the thread that faults, preload ``examples/native_stack.c`` (its
comment says how).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import subprocess
import sys

LOG = "/tmp/headrace-lane-batches.jsonl"
WINDOWS = "/tmp/headrace-windows.json"


def run(folder: str, seed: int, epochs: int) -> None:
    import headrace
    from headrace import ops, readers
    from headrace.ops.cuda._lane import Lane

    original = Lane.finish
    fd = os.open(LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND)

    def finish(lane, prep):
        windows = [[prep.batch.samples[row].source, *map(int, prep.regions[j])]
                   for j, row in enumerate(prep.rows) if prep.on_gpu[j]]
        os.write(fd, (json.dumps({"lane": id(lane), "windows": windows}) + "\n").encode())
        os.fsync(fd)  # on disk before nvImageCodec may take the process down
        return original(lane, prep)

    Lane.finish = finish
    files = sorted(glob.glob(os.path.join(folder, "*")))

    async def main() -> None:
        loader = headrace.Loader(readers.files(files, [i % 1000 for i in range(len(files))]), batch_size=32,
                                 pipeline=ops.training(224), device="cuda", on_error="skip", max_errors=1.0, seed=seed)
        for _ in range(epochs):
            async for _ in loader:
                pass
        await loader.aclose()

    asyncio.run(main())
    print("no crash")


def decode_from(start: int, hw_load: float) -> None:
    """Decode the saved windows from ``start`` on, printing each index first (the last printed one
    is the culprit when the process dies)."""
    import numpy as np
    from nvidia import nvimgcodec as nvc

    windows = json.load(open(WINDOWS))
    kinds = nvc.BackendKind
    decoder = nvc.Decoder(device_id=0, max_num_cpu_threads=4, backends=[
        nvc.Backend(kinds.HW_GPU_ONLY, load_hint=hw_load), nvc.Backend(kinds.HYBRID_CPU_GPU), nvc.Backend(kinds.GPU_ONLY)])
    params = nvc.DecodeParams(apply_exif_orientation=True, color_spec=nvc.ColorSpec.SRGB, sample_format=nvc.SampleFormat.I_RGB)
    for i in range(start, len(windows)):
        path, y0, x0, y1, x1 = windows[i]
        print("TRY", i, flush=True)
        stream = nvc.CodeStream(np.fromfile(path, dtype=np.uint8))
        whole = (y0, x0, y1, x1) == (0, 0, stream.height, stream.width)
        source = stream if whole else stream.get_sub_code_stream(region=nvc.Region(y0, x0, y1, x1))
        for _ in range(2):
            decoder.decode([source], params=params)


def find(batches: int) -> None:
    logged = [json.loads(line) for line in open(LOG)]
    windows: list[list] = []
    for batch in logged[-batches:]:
        windows += [w for w in batch["windows"] if w not in windows]
    json.dump(windows, open(WINDOWS, "w"))
    print(f"{len(logged)} lane batches logged; trying the {len(windows)} windows of the last {batches}")
    for hw_load in (0.0, 1.0):  # the CUDA decoder first, then the hardware engine
        start = 0
        while start < len(windows):
            try:
                done = subprocess.run([sys.executable, __file__, "decode-from", str(start), str(hw_load)],
                                      capture_output=True, text=True, timeout=120)
            except subprocess.TimeoutExpired as exc:
                done, tried = None, str(exc.stdout or "")
            tried = done.stdout if done is not None else tried
            reached = [int(line.split()[1]) for line in tried.splitlines() if line.startswith("TRY")]
            if done is not None and done.returncode == 0:
                break
            culprit = reached[-1] if reached else start
            how = "hang" if done is None else f"exit {done.returncode}"
            print(f"{how} with hw_load={hw_load}: {windows[culprit]}", flush=True)
            start = culprit + 1


def refuse_without_gpu() -> None:
    """Say in one line that this harness needs the GPU path, rather than a traceback from a worker."""
    from headrace.ops import cuda_available

    if not cuda_available():
        sys.exit("this harness needs a CUDA GPU with CuPy and nvImageCodec (pip install '.[cuda12]' or "
                 "'.[cuda13]'); none here")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="the loader over FOLDER, each lane batch logged")
    r.add_argument("folder")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--epochs", type=int, default=3)
    f = sub.add_parser("find", help="decode the last logged batches' windows one by one")
    f.add_argument("--batches", type=int, default=4)
    d = sub.add_parser("decode-from")
    d.add_argument("start", type=int)
    d.add_argument("hw_load", type=float)
    args = p.parse_args()
    refuse_without_gpu()
    if args.command == "run":
        run(args.folder, args.seed, args.epochs)
    elif args.command == "find":
        find(args.batches)
    else:
        decode_from(args.start, args.hw_load)


if __name__ == "__main__":
    main()
