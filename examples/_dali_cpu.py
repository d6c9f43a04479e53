"""NVIDIA DALI's CPU pipeline as a peer of ``benchmark_cpu.py``, run by it in a Python of its own.

DALI's wheels carry their own nvImageCodec, which need not agree with the one headrace's CPU path
uses, so ``benchmark_cpu.py --dali PYTHON`` starts this script under a Python that has
``nvidia-dali`` and torch installed (a venv of its own) and asks it for one epoch at a time, so its
epochs take turns with the other systems' as theirs do.

The pipelines are the ones DALI's ImageNet example runs, on the CPU (``device_id=None``), over the
same (path, label) list: training, shuffled, ``decoders.image_random_crop`` (a JPEG's crop window
decoded alone, scale 0.08-1, ratio 3/4-4/3), resize to 224x224, ``crop_mirror_normalize`` with a
coin-flip mirror; validation, in order, ``decoders.image``, the shorter side resized to 256,
``crop_mirror_normalize`` cropping the centre 224x224. Both give float32 NCHW, through
``DALIGenericIterator`` as torch tensors.

DALI's pipeline goes on between its turns until its queue holds ``PREFETCH`` batches (its default
depth), so an epoch begins with that many ready that the others made on their own time: an epoch
is timed from when the last of them is taken, and counts the images after them (in a steady run
the pipeline makes a batch for each one taken).

Protocol: argv = the (path, label) list as a JSON file, batch size, threads, ``training`` or
``validation``. It prints
``ready <DALI version>``, then for each ``epoch`` line it reads, ``<images> <seconds>``.
"""

from __future__ import annotations

import json
import sys
import time

PREFETCH = 2  # DALI's default prefetch_queue_depth


def epochs(listing: str, batch: int, threads: int, pipeline: str):
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    with open(listing) as f:
        pairs = json.load(f)
    paths = [p for p, _ in pairs]
    labels = [label for _, label in pairs]

    mean, std = [0.485 * 255, 0.456 * 255, 0.406 * 255], [0.229 * 255, 0.224 * 255, 0.225 * 255]
    train = pipeline == "training"

    @pipeline_def
    def pipe_def():
        jpegs, label = fn.readers.file(files=paths, labels=labels, random_shuffle=train, name="Reader")
        if train:
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                                   random_area=[0.08, 1.0], random_aspect_ratio=[0.75, 4 / 3])
            images = fn.resize(images, resize_x=224, resize_y=224)
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=mean, std=std,
                                              mirror=fn.random.coin_flip(probability=0.5))
        else:
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            images = fn.resize(images, resize_shorter=256)
            images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", crop=(224, 224),
                                              mean=mean, std=std)
        return images, label

    pipe = pipe_def(batch_size=batch, num_threads=threads, device_id=None, seed=0, prefetch_queue_depth=PREFETCH)
    pipe.build()
    it = DALIGenericIterator(pipe, ["image", "label"], reader_name="Reader",
                             last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)

    def one() -> tuple[int, float]:
        n, start = 0, time.perf_counter()
        for i, out in enumerate(it):
            if i < PREFETCH:  # made before this turn began
                start = time.perf_counter()
            else:
                n += out[0]["image"].shape[0]
        return n, time.perf_counter() - start

    return one


def main() -> int:
    listing, batch, threads, pipeline = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    import nvidia.dali

    one = epochs(listing, batch, threads, pipeline)
    print(f"ready {nvidia.dali.__version__}", flush=True)
    for line in sys.stdin:
        if line.strip() != "epoch":
            break
        n, seconds = one()
        print(f"{n} {seconds}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
