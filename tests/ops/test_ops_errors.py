"""Bad input fails one sample, typed and named, and leaves the rest of the batch right."""

from __future__ import annotations

import pytest
import torch
from ops_refs import batch, encode, random_image, sample

from headrace import ClosedError, DecodeError, LoaderError, ReadError, TransformError
from headrace.ops import CpuExecutor, Decode, Pipeline, RandomResizedCrop, Resize, training


def bad_inputs(rng) -> dict[str, bytes | None]:
    good = encode(random_image(rng, 60, 80))
    scan = bytearray(good)
    sos = scan.index(b"\xff\xda")
    scan[sos + 20 : -2 : 7] = b"\xff" * len(scan[sos + 20 : -2 : 7])  # markers all over the entropy data
    return {
        "corrupt": bytes(scan),
        "garbled-header": good[:20] + bytes(200) + good[220:],
        "truncated": good[: len(good) // 2],
        "header-only": good[:100],
        "empty": b"",
        "text": b"label,path\n3,cat.jpg\n" * 20,
        "no-image-field": None,
    }


@pytest.mark.parametrize("pipeline", [training(20), Pipeline([Decode()]), Pipeline([Resize(16)])])
async def test_bad_samples_fail_alone(make_executor, rng, pipeline, jpeg_decoder):
    bad = bad_inputs(rng)
    goods = [encode(random_image(rng, *rng.integers(30, 90, 2))) for _ in range(6)]
    samples, expect_bad = [], {}
    for i, data in enumerate(goods):
        samples.append(sample(2 * i, data, label=i))
    for j, (name, data) in enumerate(bad.items()):
        s = sample(100 + j, data, label=50 + j)
        s.key = name
        samples.insert(2 * j % len(samples), s)  # spread through the batch and its chunks
    # Damaged scan data in a file that still ends in EOI: libjpeg-turbo (under Pillow or
    # nvImageCodec) warns and decodes what it can, or stops at a marker it does not know, depending
    # on the bytes the damage hits; Pillow raises on more of these than nvImageCodec (which, like
    # the GPU path, keeps what it decoded). Either way: a DecodeError or pixels, never a crash.
    maybe_bad = {"corrupt"}
    expect_bad = {s.key: row for row, s in enumerate(samples) if s.key in bad and s.key not in maybe_bad}

    out = await make_executor(pipeline, seed=3).run(batch(samples))
    alone = await make_executor(pipeline, seed=3).run(batch([s for s in samples if s.key not in bad]))

    failed = [row for row, _ in out.failures if samples[row].key not in maybe_bad]
    assert failed == sorted(expect_bad.values())
    for row, err in out.failures:
        assert type(err) is DecodeError and err.stage == "decode"
        assert err.key == samples[row].key and err.source == samples[row].source
        assert isinstance(err, LoaderError)
        assert str(err).endswith(f"[decode: key={err.key!r}, source={err.source!r}]")
    rows_out = [row for row in range(len(samples)) if row not in {r for r, _ in out.failures}]
    assert out.kept == rows_out
    # The good samples come out as they do in a batch without the bad ones (same indices, same randoms).
    good_out = [k for k, row in enumerate(out.kept) if samples[row].key not in bad]
    labels = out.data["label"].tolist()
    assert [labels[k] for k in good_out] == alone.data["label"].tolist() == list(range(6))
    for k, ref in zip(good_out, alone.data["image"], strict=True):
        assert torch.equal(out.data["image"][k], ref)


async def test_read_errors_are_failures_without_decoding(make_executor, rng):
    good = encode(random_image(rng, 40, 40))
    read = ReadError("cannot read file: gone", key="r1", source="/data/r1.jpg")
    samples = [
        sample(0, good),
        sample(1, None, error=read),  # as the file reader sends it: label but no image
        sample(2, good, error=ReadError("range request failed")),  # bytes present but not to be trusted
        sample(3, None, label=None, error=TimeoutError("slow disk")),
        sample(4, good),
    ]
    out = await make_executor(training(16)).run(batch(samples))
    assert out.kept == [0, 4] and out.data["image"].shape == (2, 3, 16, 16)
    assert out.data["label"].tolist() == [3, 3]
    (r1, e1), (r2, e2), (r3, e3) = out.failures
    assert (r1, r2, r3) == (1, 2, 3)
    assert e1 is read and (e1.key, e1.source) == ("r1", "/data/r1.jpg")
    assert type(e2) is ReadError and (e2.key, e2.source) == (samples[2].key, samples[2].source)
    assert type(e3) is ReadError and e3.key == samples[3].key and isinstance(e3.__cause__, TimeoutError)


async def test_label_errors_are_transform_errors(make_executor, rng):
    good = encode(random_image(rng, 30, 30))
    samples = [sample(0, good), sample(1, good, label=None), sample(2, good)]
    samples[2].fields["cls"] = b"cat"
    out = await make_executor(Pipeline([Resize((8, 8))])).run(batch(samples))
    assert out.kept == [0] and out.data["label"].tolist() == [3]
    assert [type(e) for _, e in out.failures] == [TransformError, TransformError]
    assert [e.key for _, e in out.failures] == [samples[1].key, samples[2].key]


async def test_all_fail(make_executor):
    out = await make_executor(training(8)).run(batch([sample(i, b"") for i in range(3)]))
    assert out.kept == [] and len(out.failures) == 3
    assert out.data["image"].shape == (0, 3, 8, 8) and out.data["label"].shape == (0,)


async def test_empty_batch(make_executor):
    out = await make_executor(training(8)).run(batch([]))
    assert out.kept == [] and out.failures == [] and out.data["image"].shape == (0, 3, 8, 8)


async def test_tiny_images(make_executor, rng):
    """1 x 1 and 1 x N images through every geometric op: no crash, right shape."""
    arrays = [random_image(rng, h, w) for h, w in ((1, 1), (1, 7), (9, 1), (2, 3))]
    samples = [sample(i, encode(a, "PNG")) for i, a in enumerate(arrays)]
    for pipe in (training(5), Pipeline([Resize(4), RandomResizedCrop(3)]), Pipeline([Resize((2, 2))])):
        out = await make_executor(pipe).run(batch(samples))
        assert not out.failures and len(out.kept) == 4


async def test_closed_executor(rng):
    executor = CpuExecutor(training(8), num_threads=1, seed=0)
    out = await executor.run(batch([sample(0, encode(random_image(rng, 20, 20)))]))
    assert out.kept == [0]
    await executor.aclose()
    await executor.aclose()  # twice is fine
    with pytest.raises(ClosedError):
        await executor.run(batch([sample(0, b"")]))


async def test_cancelled_run_leaves_threads_idle(rng):
    """Cancelling run() does not stop a chunk mid-image; aclose() waits for it, then joins."""
    import asyncio
    import threading

    data = encode(random_image(rng, 200, 200))
    executor = CpuExecutor(training(32), num_threads=2, seed=0, name="ops-test-cancel")
    task = asyncio.create_task(executor.run(batch([sample(i, data) for i in range(64)])))
    await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await executor.aclose()
    assert not [t for t in threading.enumerate() if t.name.startswith("ops-test-cancel")]


async def test_label_rule_every_sample_needs_the_field(make_executor, rng):
    """Pipeline(label="cls") (the default): a sample without the field fails alone, whether or not
    others in its batch have it; label=None hands out no labels and needs none."""
    good = encode(random_image(rng, 30, 30))
    mixed = [sample(0, good), sample(1, good, label=None), sample(2, good)]
    none = [sample(i, good, label=None) for i in range(3)]
    for samples, kept in ((mixed, [0, 2]), (none, [])):
        out = await make_executor(Pipeline([Resize((8, 8))])).run(batch(samples))
        assert out.kept == kept and out.data["label"].tolist() == [3] * len(kept)
        for row, err in out.failures:
            assert type(err) is TransformError and (err.key, err.source) == (samples[row].key, samples[row].source)
            assert str(err).startswith("sample has no 'cls' field (the pipeline reads labels from it; "
                                       "Pipeline(label=None) for data without labels)")
    out = await make_executor(Pipeline([Resize((8, 8))], label=None)).run(batch(mixed))
    assert out.kept == [0, 1, 2] and "label" not in out.data


async def test_labels_out_of_int64_range_fail_alone(make_executor, rng):
    good = encode(random_image(rng, 30, 30))
    samples = [sample(0, good), sample(1, good)]
    samples[1].fields["cls"] = b"99999999999999999999999"
    out = await make_executor(Pipeline([Resize((8, 8))])).run(batch(samples))
    assert out.kept == [0] and type(out.failures[0][1]) is TransformError


async def test_drain_waits_for_running_chunks_and_cancels_queued_ones(rng):
    """A cancelled run leaves chunks running in the threads; drain() cancels the queued ones, waits
    for the running ones, and the executor then serves the next run (the next epoch) as before."""
    import asyncio

    data = encode(random_image(rng, 300, 300))
    executor = CpuExecutor(training(32), num_threads=2, seed=0, name="ops-test-drain")
    try:
        await executor.drain()  # idle: returns at once
        expected = await executor.run(batch([sample(i, data) for i in range(8)]))
        for _ in range(3):
            task = asyncio.create_task(executor.run(batch([sample(i, data) for i in range(256)])))
            await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await executor.drain()
            assert not executor._running
            again = await executor.run(batch([sample(i, data) for i in range(8)]))
            assert torch.equal(again.data["image"], expected.data["image"])
    finally:
        await executor.aclose()


async def test_drain_still_waits_when_cancelled(rng):
    import asyncio

    data = encode(random_image(rng, 300, 300))
    executor = CpuExecutor(training(32), num_threads=2, seed=0)
    try:
        run = asyncio.create_task(executor.run(batch([sample(i, data) for i in range(128)])))
        await asyncio.sleep(0.02)
        run.cancel()
        drain = asyncio.create_task(executor.drain())
        await asyncio.sleep(0)
        drain.cancel()  # cancelled at once: it waits for the running chunks all the same
        with pytest.raises(asyncio.CancelledError):
            await drain
        assert not [f for f in executor._running if f.running()]
        with pytest.raises(asyncio.CancelledError):
            await run
    finally:
        await executor.aclose()


_MEMORY_CHILD = r"""
import asyncio, json, resource, sys
sys.path[:0] = sys.argv[1:2]
from ops_refs import batch, encode, photo, sample, with_sof_size
from headrace.ops import CpuExecutor, Decode, Pipeline

size = int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmSize:"))) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (1536 << 20), resource.RLIM_INFINITY))
good = encode(photo("chelsea"))
huge = with_sof_size(encode(photo("astronaut")), 30000, 30000)  # 2.5 GiB of RGB pixels claimed

async def main():
    executor = CpuExecutor(Pipeline([Decode(max_pixels=None)]), num_threads=1, seed=0)
    out = await executor.run(batch([sample(0, good), sample(1, huge), sample(2, good)]))
    await executor.aclose()
    (row, err), = out.failures
    print(json.dumps([out.kept, row, type(err).__name__, err.key, type(err.__cause__).__name__, str(err)]))

asyncio.run(main())
"""


def test_out_of_memory_is_the_samples_decode_error():
    """With no pixel limit, a header claiming 30000 x 30000 makes the decoder ask for 2.5 GiB; in a
    process allowed 1.5 GiB more than it has, that MemoryError is the sample's DecodeError."""
    import json
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, os.path.dirname(__file__)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept, row, kind, key, cause, message = json.loads(proc.stdout.strip().splitlines()[-1])
    print("\n" + message)
    assert (kept, row, kind, key, cause) == ([0, 2], 1, "DecodeError", "s0001", "MemoryError")


def test_gpu_tuning_is_checked():
    from headrace import ConfigError
    from headrace.ops import GpuTuning

    assert GpuTuning() == GpuTuning(cuda_load=1.0, gpu_huffman_above=None, gpu_huffman_load=0.0, gpu_huffman_threads=None,
                                    nvimgcodec_options="", decode="shim", launch="shim", dispatch="turn", cut_frames=True)
    for bad in ({"cuda_load": 1.5}, {"decode": "c"}, {"launch": None}, {"nvimgcodec_options": 3}, {"dispatch": "any"},
                {"gpu_huffman_above": -1}, {"gpu_huffman_above": 2.5}, {"gpu_huffman_above": True},
                {"gpu_huffman_load": -0.1}, {"gpu_huffman_load": 1.5}, {"gpu_huffman_load": "half"},
                {"gpu_huffman_threads": 0}, {"gpu_huffman_threads": 2.0}, {"cut_frames": 1}, {"cut_frames": None}):
        with pytest.raises(ConfigError):
            GpuTuning(**bad)


def test_a_batch_goes_to_the_lane_with_the_fewest_queued():
    from types import SimpleNamespace

    from headrace.ops.cuda._executor import pick_lane

    lanes = [SimpleNamespace(index=i, queued=set()) for i in range(4)]
    # All idle: each batch's turn, as batch i to lane i mod 4.
    assert [pick_lane(lanes, i, "free").index for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    lanes[1].queued.update({"a", "b"})  # lane 1 held up by a slow batch
    lanes[2].queued.add("c")
    assert pick_lane(lanes, 1, "free").index == 3  # the next idle lane after its turn, not lane 0
    assert pick_lane(lanes, 2, "free").index == 3
    assert pick_lane(lanes, 4, "free").index == 0
    lanes[0].queued.add("d")
    lanes[3].queued.add("e")
    assert pick_lane(lanes, 1, "free").index == 2  # all busy: the least queued lane from its turn on
    assert [pick_lane(lanes, i, "turn").index for i in range(5)] == [0, 1, 2, 3, 0]


async def test_aclose_cancelled_while_it_waits_still_joins_and_closes(rng):
    """aclose() cancelled while it waits for the running chunks still shuts the threads down and
    closes the JPEG decoders (a second call returns at once, so nothing else would)."""
    import asyncio
    import threading

    data = encode(random_image(rng, 300, 300))
    executor = CpuExecutor(training(32), num_threads=2, seed=0, name="ops-test-close-cancel")
    task = asyncio.create_task(executor.run(batch([sample(i, data) for i in range(64)])))
    await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    closing = asyncio.create_task(executor.aclose())
    await asyncio.sleep(0)  # into its wait for the running chunks
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert not [t for t in threading.enumerate() if t.name.startswith("ops-test-close-cancel")]
    if executor._jpeg is not None:  # nvImageCodec's CPU decoders, where it is installed
        assert executor._jpeg._closed
    await executor.aclose()  # and a second call is still fine
