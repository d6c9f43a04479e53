"""NumPy scalars (``np.int64(3)``, ``np.float32(0.1)``: from a config loaded into NumPy, an
``np.arange``, array math) are taken by the rest of the API as ``test_numpy_arguments.py`` shows for
the Loader's counts and the readers: the failure budget, the ranks, the service, channels, the GPU
shares, the record readers, storage options and retries, ``iterable``, ``pack``, the ops' sizes and
probabilities, ``DecodeClip``, ``bench``. Each is kept as a Python number (repr, equality, state
dicts and JSON reports stay NumPy-free), and a bool (``np.bool_`` too) is still a ConfigError naming
the argument, as is NaN where a number is wanted.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import shutil

import numpy as np
import pytest
import torch

from headrace import (
    ConfigError,
    ErrorBudgetExceeded,
    Loader,
    Preprocessor,
    StorageError,
    ops,
    readers,
)
from headrace._channel import open_channel
from headrace._errors import require_int, require_number
from headrace.readers._cache_folder import from_arguments
from headrace.readers._object_cache import ObjectCache
from headrace.readers._storage import HttpStore, Retry, S3Store
from headrace.readers._storage._s3 import _duration
from headrace.testing import MemoryStore
from sample_data import jpeg_bytes, recordio_record, tar_bytes, write_recordio

BOOLS = [True, np.bool_(True)]


async def _collect(loader):
    async with loader:
        return [b async for b in loader]


async def _samples(reader, epoch=0, start=0, seed=0):
    async with contextlib.aclosing(reader.read(epoch, start=start, seed=seed)) as stream:
        return [s async for chunk in stream for s in chunk]


def _python_numbers(*values) -> bool:
    return all(type(v) in (int, float) for v in values)


# -- the shared check -----------------------------------------------------------------------------


@pytest.mark.parametrize("value", [np.float32(0.25), np.float64(0.25), np.float16(0.25), 0.25])
def test_require_number_takes_numpy_floats_and_gives_a_python_float(value):
    got = require_number("p", value, 0, 1)
    assert got == 0.25 and type(got) is float


@pytest.mark.parametrize("value", [np.int64(3), np.uint8(3), 3])
def test_require_number_takes_integers_as_floats(value):
    got = require_number("seconds", value, 0, low_open=True)
    assert got == 3.0 and type(got) is float


@pytest.mark.parametrize("value", [*BOOLS, np.bool_(False), math.nan, np.float32("nan"), "0.5", None, 10**400, 1j])
def test_require_number_refuses_bools_nan_and_non_numbers_naming_the_argument(value):
    with pytest.raises(ConfigError, match=r"^p must be a number in \[0, 1\], got "):
        require_number("p", value, 0, 1)


def test_require_number_bounds_open_closed_and_in_words():
    assert require_number("x", np.float32(0.0), 0) == 0.0
    with pytest.raises(ConfigError, match=r"^x must be a number > 0, got np.float32\(0.0\)"):
        require_number("x", np.float32(0.0), 0, low_open=True)
    with pytest.raises(ConfigError, match=r"^x must be a number in \[0, inf\), got inf"):
        require_number("x", math.inf, 0, math.inf, high_open=True)
    assert require_number("x", math.inf, 0) == math.inf  # no upper bound: inf is taken
    with pytest.raises(ConfigError, match=r"^x must be a number <= 1, got np.float64\(1.5\)"):
        require_number("x", np.float64(1.5), high=1)
    with pytest.raises(ConfigError, match=r"^x must be seconds, got -1"):
        require_number("x", -1, 0, wanted="seconds")
    assert require_number("x", np.float64(-7.5)) == -7.5


def test_require_int_says_what_it_was_told_to():
    with pytest.raises(ConfigError, match=r"^n must be a count or None, got np.True_"):
        require_int("n", np.bool_(True), wanted="a count or None")


# -- the failure budget ---------------------------------------------------------------------------

BAD = ["c0/0001", "c1/0004", "c2/0007", "c2/0010"]


@pytest.fixture
def bad_folder(tmp_path, image_folder):
    """image_folder with 4 of its 75 JPEGs corrupt."""
    folder = tmp_path / "data"
    shutil.copytree(image_folder, folder)
    for key in BAD:
        (folder / f"{key}.jpg").write_bytes(b"not a jpeg at all")
    return folder


def _loader(folder, **kw):
    pipe = ops.Pipeline([ops.Decode(), ops.Resize(16), ops.CenterCrop(16)])
    return Loader(readers.files(folder), batch_size=8, pipeline=pipe, device="cpu", num_threads=2, on_error="skip", **kw)


async def test_a_numpy_error_count_stops_the_loader_at_the_error_past_it(bad_folder):
    loader = _loader(bad_folder, max_errors=np.int64(3))
    with pytest.raises(ErrorBudgetExceeded, match=r"^4 of \d+ samples failed, over the budget of 3 samples") as info:
        await _collect(loader)
    assert info.value.key == BAD[3]
    assert json.dumps(loader.state_dict())
    loader = _loader(bad_folder, max_errors=np.int32(4))  # all four within the budget
    batches = await _collect(loader)
    assert sum(b.size for b in batches) == 71 and loader.stats().dropped == 4


async def test_a_numpy_error_fraction_is_a_fraction(bad_folder):
    paths = [str(p) for _ in range(4) for p in sorted(bad_folder.rglob("*.jpg"))]  # 300 samples, 16 bad: 5.3%
    pipe = ops.Pipeline([ops.Decode(), ops.Resize(16), ops.CenterCrop(16)])

    def make(max_errors):
        return Loader(readers.files(paths, labels=[0] * len(paths)), batch_size=50, pipeline=pipe, device="cpu",
                      num_threads=2, on_error="skip", max_errors=max_errors)

    batches = await _collect(make(np.float32(0.1)))
    assert sum(b.size for b in batches) == 284
    with pytest.raises(ErrorBudgetExceeded, match=r"over the budget of 5.00% of samples"):
        await _collect(make(np.float64(0.05)))


@pytest.mark.parametrize("value", [*BOOLS, np.float32("nan"), np.float64(1.5), np.int64(-1), "3"])
def test_a_wrong_error_budget_is_refused_naming_it(image_folder, value):
    with pytest.raises(ConfigError, match=r"^max_errors (as a fraction )?must be"):
        Loader(readers.files(image_folder), batch_size=8, device="cpu", on_error="skip", max_errors=value)


# -- ranks ----------------------------------------------------------------------------------------


async def test_a_loader_takes_numpy_rank_and_world(image_folder):
    def make(rank, world):
        return Loader(readers.files(image_folder, shuffle=True), batch_size=8, device="cpu", num_threads=1, seed=2,
                      pipeline=ops.Pipeline([ops.Decode(), ops.Resize(16), ops.CenterCrop(16)]), rank=rank,
                      world=world, equal="pad")

    given, plain = make(np.int64(1), np.int64(2)), make(1, 2)
    assert (given.rank, given.world) == (1, 2) and _python_numbers(given.rank, given.world)
    keys = [b.sample_keys for b in await _collect(given)]
    assert keys == [b.sample_keys for b in await _collect(plain)] and sum(map(len, keys)) == 38
    state = given.state_dict()
    assert json.loads(json.dumps(state)) == plain.state_dict()


@pytest.mark.parametrize(("rank", "world", "wrong"), [(0, np.bool_(True), "world"), (np.bool_(False), 2, "rank"),
                                                      (np.float64(0.0), 2, "rank"), (np.int64(2), np.int64(2), "rank")])
def test_a_loader_refuses_a_bool_float_or_out_of_range_rank(image_folder, rank, world, wrong):
    with pytest.raises(ConfigError, match=rf"^{wrong} must be "):
        Loader(readers.files(image_folder), batch_size=8, device="cpu", rank=rank, world=world)


# -- the service and channels ---------------------------------------------------------------------

PIPE = ops.validation(32, resize=40, label=None)


async def test_the_service_takes_numpy_delay_pending_and_seed():
    rng = np.random.default_rng(0)
    images = [jpeg_bytes(rng, 48 + 8 * i, 64) for i in range(6)]
    outs = {}
    for kind, number in ((int, float), (np.int64, np.float32)):
        pre = Preprocessor(PIPE, device="cpu", num_threads=2, max_batch=kind(4), max_delay=number(0.01),
                           max_pending=kind(16), seed=kind(3))
        assert _python_numbers(pre.max_delay, pre.seed, pre.max_batch) and pre.seed == 3
        async with pre:
            outs[kind] = await asyncio.gather(*(pre(img) for img in images))
    assert all(torch.equal(a, b) for a, b in zip(outs[int], outs[np.int64], strict=True))
    assert outs[int][0].shape == (3, 32, 32)


@pytest.mark.parametrize(("name", "value"), [("max_delay", np.bool_(True)), ("max_delay", np.float64("nan")),
                                             ("max_delay", np.float32("inf")), ("max_pending", np.bool_(True)),
                                             ("max_pending", np.float64(8.0)), ("seed", np.bool_(True)),
                                             ("seed", np.float32(3.0))])
def test_the_service_refuses_bools_and_wrong_numbers_naming_them(name, value):
    with pytest.raises(ConfigError, match=rf"^{name} must be "):
        Preprocessor(PIPE, device="cpu", num_threads=1, **{name: value})


async def test_a_channel_bounded_by_numpy_counts():
    tx, rx = open_channel(np.int64(2), np.int64(100), name="np")
    stats = tx.statistics()
    assert (stats.max_items, stats.max_bytes) == (2, 100) and _python_numbers(stats.max_items, stats.max_bytes)
    await tx.send("a", 40)
    await tx.send("b", 40)
    with pytest.raises(TimeoutError):  # full by count: a third waits
        await asyncio.wait_for(tx.send("c", 1), 0.05)
    assert await rx.receive() == "a"
    for wrong in (*BOOLS, np.float64(2.0), np.int64(0)):
        with pytest.raises(ConfigError, match="max_items must be a positive int"):
            open_channel(wrong)
        with pytest.raises(ConfigError, match="max_bytes must be a positive int"):
            open_channel(2, wrong)


# -- the GPU's shares -----------------------------------------------------------------------------


def test_gpu_tuning_keeps_a_python_cuda_load():
    tuning = ops.GpuTuning(cuda_load=np.float32(0.5))
    assert tuning.cuda_load == 0.5 and type(tuning.cuda_load) is float and tuning == ops.GpuTuning(cuda_load=0.5)
    for wrong in (*BOOLS, np.float64(1.5), np.float32("nan"), "1"):
        with pytest.raises(ConfigError, match=r"^cuda_load must be in \[0, 1\], got "):
            ops.GpuTuning(cuda_load=wrong)


@pytest.mark.skipif(not ops.cuda_available(), reason="needs CUDA, CuPy and nvImageCodec")
async def test_a_numpy_hw_load_decodes_on_the_gpu_as_a_python_one(image_folder):
    pipe = ops.Pipeline([ops.Decode(), ops.Resize(32), ops.CenterCrop(32), ops.Normalize()])
    got = {}
    for hw_load in (0.5, np.float32(0.5), np.int64(1), 1.0):
        loader = Loader(readers.files(image_folder), batch_size=16, pipeline=pipe, device="cuda", lanes=1,
                        hw_load=hw_load, num_threads=2)
        got[repr(hw_load)] = [b["image"].cpu() for b in await _collect(loader)]
    assert all(torch.equal(a, b) for a, b in zip(got["0.5"], got["np.float32(0.5)"], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got["1.0"], got["np.int64(1)"], strict=True))
    for wrong in (*BOOLS, np.float64(1.5), np.float32("nan")):
        with pytest.raises(ConfigError, match=r"^hw_load must be in \[0, 1\] or 'adaptive', got "):
            ops.CudaExecutor(pipe, hw_load=wrong)


# -- readers --------------------------------------------------------------------------------------


async def test_recordio_takes_a_numpy_label_offset(tmp_path):
    path = tmp_path / "a.rec"
    write_recordio(path, [recordio_record(i % 3, b"\xff\xd8\xff image %d" % i) for i in range(9)])
    given, plain = readers.recordio(path, label_offset=np.int64(-1)), readers.recordio(path, label_offset=-1)
    assert type(given.label_offset) is int and json.dumps(given.state_dict())
    assert given.state_dict() == plain.state_dict()
    assert [s.fields["cls"] for s in await _samples(given)] == [str(i % 3 - 1).encode() for i in range(9)]
    for wrong in (*BOOLS, np.float64(1.0), "1"):
        with pytest.raises(ConfigError, match="^recordio: label_offset must be an int, got "):
            readers.recordio(path, label_offset=wrong)


async def test_tfrecord_takes_a_numpy_label_offset(tmp_path, image_folder):
    writer_module = pytest.importorskip("tfrecord.writer")
    reference = readers.files(image_folder)
    writer = writer_module.TFRecordWriter(str(tmp_path / "train-0"))
    for path, label in list(zip(reference.paths, reference.labels))[:6]:
        writer.write({"image/encoded": (open(path, "rb").read(), "byte"), "image/class/label": (label + 1, "int")})
    writer.close()
    given = readers.tfrecord(tmp_path / "train-0", label_offset=np.int32(-1))
    assert type(given.label_offset) is int and json.dumps(given.state_dict())
    assert [s.fields["cls"] for s in await _samples(given)] == [str(lb).encode() for lb in reference.labels[:6]]
    with pytest.raises(ConfigError, match="^tfrecord: label_offset must be an int, got "):
        readers.tfrecord(tmp_path / "train-0", label_offset=np.bool_(False))


async def test_iterable_keeps_numpy_length_chunk_size_rank_world_and_start():
    def items():
        return iter([{"__key__": f"k{i}", "bin": bytes([i])} for i in range(10)])

    given = readers.iterable(items, length=np.int64(10), chunk_size=np.int64(3)).shard(np.int64(1), np.int64(2),
                                                                                       equal="pad")
    plain = readers.iterable(items, length=10, chunk_size=3).shard(1, 2, equal="pad")
    assert _python_numbers(given.length, given.chunk_size, given.rank, given.world)
    state = given.state_dict()
    assert json.loads(json.dumps(state)) == plain.state_dict()
    keys = [s.key for s in await _samples(given, start=np.int64(2))]
    assert keys == [s.key for s in await _samples(plain, start=2)] == ["k5", "k7", "k9"]
    for name in ("length", "chunk_size"):
        with pytest.raises(ConfigError, match=f"iterable: {name} must be a positive int"):
            readers.iterable(items, **{name: np.bool_(True)})


def _shard_store(failures: int) -> MemoryStore:
    shard = tar_bytes([(f"{i:03d}.bin", bytes([i]) * 500) for i in range(20)])
    return MemoryStore({"m/s-0.tar": shard}, block=1000, fail={"m/s-0.tar": [("status", 503)] * failures})


async def test_retries_of_numpy_attempts_and_seconds():
    retry = {"attempts": np.int64(3), "backoff": np.float32(0.001), "max_backoff": np.float64(0.01),
             "timeout": np.int64(5)}
    kept = Retry.of(retry)
    assert kept == Retry(attempts=3, backoff=float(np.float32(0.001)), max_backoff=0.01, timeout=5.0)
    assert _python_numbers(kept.attempts, kept.backoff, kept.max_backoff, kept.timeout) and type(kept.attempts) is int
    # Three 503s: the third try fails with attempts=3; a fourth try, allowed by 4, reads the shard.
    (bad,) = [s for s in await _samples(readers.webdataset("m/s-0.tar", store=_shard_store(3),
                                                           storage_options={"retry": retry})) if s.error]
    assert isinstance(bad.error, StorageError)
    reader = readers.webdataset("m/s-0.tar", store=_shard_store(3),
                                storage_options={"retry": {**retry, "attempts": np.int32(4)}})
    samples = await _samples(reader)
    assert [s.key for s in samples] == [f"{i:03d}" for i in range(20)] and reader.retries == 3


@pytest.mark.parametrize(("field", "value"), [("attempts", np.bool_(True)), ("attempts", np.float64(3.0)),
                                              ("backoff", np.bool_(False)), ("timeout", np.float32("nan")),
                                              ("timeout", np.int64(0)), ("max_backoff", np.float32(-1))])
def test_a_wrong_retry_field_is_refused_naming_it(field, value):
    with pytest.raises(ConfigError, match=rf"^retry {field} must be "):
        Retry(**{field: value})


def test_storage_timeouts_of_numpy_seconds_reach_the_clients_as_python_numbers(monkeypatch):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    pytest.importorskip("obstore")
    store = S3Store("b", connect_timeout=np.float32(2.5), endpoint="http://127.0.0.1:1", access_key_id="AKIAEXAMPLE",
                    secret_access_key="not-a-secret-at-all")
    assert _duration(store._options["connect_timeout"]) == datetime.timedelta(seconds=2.5)
    store._store()  # obstore refuses a NumPy float ("'float32' object is not an instance of 'str'")
    pytest.importorskip("aiohttp")
    http = HttpStore(connect_timeout=np.int64(3))
    assert http._connect_timeout == 3.0 and type(http._connect_timeout) is float
    for wrong in (*BOOLS, np.float64("nan"), np.float32(0), np.float64("inf")):
        with pytest.raises(ConfigError, match="^storage option connect_timeout must be a positive number of seconds"):
            HttpStore(connect_timeout=wrong)
        with pytest.raises(ConfigError, match="^storage option connect_timeout must be a positive number of seconds"):
            S3Store("b", connect_timeout=wrong)


def test_pack_takes_numpy_shard_limits_and_verify_threads(image_folder, tmp_path):
    result = readers.pack(image_folder, tmp_path / "wds", format="webdataset", shard_size=np.float32(64),
                          shard_count=np.int64(10), verify="raise", verify_threads=np.int64(2))
    assert result.samples == 75 and len(result.outputs) == 8
    assert len(readers.webdataset(tmp_path / "wds")) == 75
    for name, wrong in (("shard_count", np.bool_(True)), ("verify_threads", np.bool_(True)),
                        ("shard_count", np.float64(10.0)), ("shard_size", np.bool_(True)),
                        ("shard_size", np.float64("nan")), ("shard_size", np.float32("inf"))):
        with pytest.raises(ConfigError, match=f"^pack: {name} must be "):
            readers.pack(image_folder, tmp_path / "other", format="webdataset", **{name: wrong})


# -- ops ------------------------------------------------------------------------------------------


def test_op_specs_keep_python_numbers():
    pairs = [
        (ops.Resize(np.int64(32)), ops.Resize(32)),
        (ops.Resize(np.int64(800), max_size=np.int64(1333)), ops.Resize(800, max_size=1333)),
        (ops.Resize(None, max_size=np.int32(64)), ops.Resize(None, max_size=64)),
        (ops.Resize((np.int64(24), np.uint16(32))), ops.Resize((24, 32))),
        (ops.CenterCrop(np.int64(24)), ops.CenterCrop(24)),
        (ops.RandomCrop((np.int8(8), np.int64(12))), ops.RandomCrop((8, 12))),
        (ops.RandomResizedCrop(np.int64(16)), ops.RandomResizedCrop(16)),
        (ops.RandomResize(np.int64(20), np.int64(30), max_side=np.int64(50)), ops.RandomResize(20, 30, max_side=50)),
        (ops.RandomIoUCrop(trials=np.int64(5), draws=np.int32(3)), ops.RandomIoUCrop(trials=5, draws=3)),
        (ops.Flip(np.float32(0.25)), ops.Flip(0.25)),
        (ops.Decode(max_pixels=np.int64(1 << 20), max_batch_bytes=np.int64(1 << 24)),
         ops.Decode(max_pixels=1 << 20, max_batch_bytes=1 << 24)),
        (ops.GaussianBlur((np.int64(3), np.int64(5))), ops.GaussianBlur((3, 5))),
    ]
    for given, plain in pairs:
        assert given == plain and repr(given) == repr(plain)
        assert "np." not in repr(given)
    assert type(ops.Flip(np.float64(1)).p) is float and type(ops.Resize(np.int64(32)).size) is int


REFUSALS = [
    (lambda v: ops.Resize(v), "Resize: size must be an int or"),
    (lambda v: ops.Resize(800, max_size=v), "Resize: max_size must be a positive int or None"),
    (lambda v: ops.CenterCrop((v, 8)), "CenterCrop: size must be an int or"),
    (lambda v: ops.RandomResizedCrop(v), "RandomResizedCrop: size must be an int or"),
    (lambda v: ops.RandomResize(v, 30), "RandomResize: min_size must be a positive int"),
    (lambda v: ops.RandomResize(20, v), "RandomResize: max_size must be a positive int"),
    (lambda v: ops.RandomIoUCrop(trials=v), "RandomIoUCrop: trials must be a positive int"),
    (lambda v: ops.RandomIoUCrop(draws=v), "RandomIoUCrop: draws must be a positive int"),
    (lambda v: ops.Flip(v), r"Flip: p must be a number in \[0, 1\]"),
    (lambda v: ops.Decode(max_pixels=v), "Decode: max_pixels must be a positive int or None"),
    (lambda v: ops.Decode(max_batch_bytes=v), "Decode: max_batch_bytes must be a positive int or None"),
    (lambda v: ops.GaussianBlur(v), "GaussianBlur: kernel_size must be an odd int"),
    (lambda v: ops.DecodeClip(v), "DecodeClip: size must be None, a positive int or"),
    (lambda v: ops.DecodeClip(crop=(8, v)), "DecodeClip: crop must be None, a positive int or"),
    (lambda v: ops.DecodeClip(flip=v), r"DecodeClip: flip must be a probability in \[0, 1\]"),
    (lambda v: ops.DecodeClip(decoders_per_thread=v), "DecodeClip: decoders_per_thread must be a positive int"),
]


@pytest.mark.parametrize(("make", "message"), REFUSALS, ids=[m.split(" must")[0] for _, m in REFUSALS])
@pytest.mark.parametrize("value", [*BOOLS, np.float64(16.0)], ids=["True", "np.True_", "np.float64"])
def test_ops_refuse_bools_and_floats_naming_the_argument(make, message, value):
    with pytest.raises(ConfigError, match=f"^{message}"):
        make(value)


def _images(loader_batches):
    return [img for b in loader_batches for img in (b["image"] if isinstance(b["image"], list) else list(b["image"]))]


async def test_a_numpy_resize_gives_the_images_of_a_python_one_on_the_cpu(image_folder):
    def run(*stages):
        return _collect(Loader(readers.files(image_folder), batch_size=16, pipeline=ops.Pipeline([ops.Decode(), *stages]),
                               device="cpu", num_threads=2))

    given = _images(await run(ops.Resize(np.int64(32))))
    assert len(given) == 75 and all(min(img.shape[-2:]) == 32 for img in given)
    assert all(torch.equal(a, b) for a, b in zip(given, _images(await run(ops.Resize(32))), strict=True))
    square = await run(ops.Resize(np.int64(32)), ops.CenterCrop(np.int32(32)))
    assert all(b["image"].shape[-2:] == (32, 32) for b in square)
    sized = await run(ops.RandomResize(np.int64(20), np.int64(30), max_side=np.int64(40)))
    sides = [sorted(img.shape[-2:]) for img in _images(sized)]  # the longer side capped at 40 may cut the shorter
    assert all(short < 30 and long_ <= 40 and (short >= 20 or long_ == 40) for short, long_ in sides)
    assert sides == [sorted(img.shape[-2:]) for img in _images(await run(ops.RandomResize(20, 30, max_side=40)))]


async def test_a_numpy_flip_probability_flips_as_a_python_one(image_folder):
    def run(p):
        pipe = ops.Pipeline([ops.Decode(), ops.Resize((24, 24)), ops.Flip(p), ops.Normalize()])
        return _collect(Loader(readers.files(image_folder), batch_size=25, pipeline=pipe, device="cpu", seed=1,
                               num_threads=2))

    kept, flipped = await run(np.float32(0.0)), await run(np.float32(1.0))
    assert all(torch.equal(a["image"].flip(-1), b["image"]) for a, b in zip(kept, flipped, strict=True))
    half = await run(np.float64(0.5))
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(half, await run(0.5), strict=True))


async def test_a_numpy_pixel_limit_is_still_a_limit(image_folder):
    pipe = ops.Pipeline([ops.Decode(max_pixels=np.int64(60 * 60)), ops.Resize((16, 16))])
    loader = Loader(readers.files(image_folder), batch_size=25, pipeline=pipe, device="cpu", num_threads=2,
                    on_error="skip", max_errors=np.int64(75))
    batches = await _collect(loader)
    dropped = loader.stats().dropped
    assert 0 < dropped < 75 and sum(b.size for b in batches) == 75 - dropped
    assert loader.stats().errors == {"DecodeError": dropped}


async def test_a_numpy_blur_kernel_blurs_as_a_python_one(image_folder):
    def run(kernel):
        pipe = ops.Pipeline([ops.Decode(), ops.Resize((24, 24)), ops.GaussianBlur(kernel, sigma=np.float32(1.5))])
        return _collect(Loader(readers.files(image_folder), batch_size=25, pipeline=pipe, device="cpu", num_threads=1))

    given, plain = await run(np.int64(5)), await run(5)
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(given, plain, strict=True))


async def test_the_cpu_executor_and_async_stages_keep_python_counts():
    executor = ops.CpuExecutor(ops.Pipeline([ops.Decode()]), num_threads=np.int64(2), seed=0)
    try:
        assert executor.num_threads == 2 and type(executor.num_threads) is int
    finally:
        await executor.aclose()

    async def lookup(fields):
        return fields

    stage = ops.Map(lookup, concurrency=np.int64(4))
    assert stage.concurrency == 4 and type(stage.concurrency) is int
    with pytest.raises(ConfigError, match=r"concurrency must be a positive int"):
        ops.Map(lookup, concurrency=np.bool_(True))
    with pytest.raises(ConfigError, match="CpuExecutor: num_threads must be a positive int"):
        ops.CpuExecutor(ops.Pipeline([ops.Decode()]), num_threads=np.bool_(True), seed=0)


async def test_decode_clip_of_numpy_sizes_gives_the_clips_of_python_ones(tmp_path):
    pytest.importorskip("av")
    from sample_data import make_video

    make_video(tmp_path / "a" / "v.mp4", 24, width=64, height=48)
    reader = readers.video(tmp_path, sequence_length=4, stride=2, step=8)

    def run(size, crop, flip):
        return _collect(Loader(reader, batch_size=2, pipeline=ops.video_pipeline(size, crop=crop, flip=flip),
                               device="cpu", num_threads=1, seed=3))

    given = await run(np.int64(32), (np.int64(16), np.int32(24)), np.float32(0.5))
    plain = await run(32, (16, 24), 0.5)
    assert [b["video"].shape for b in given] == [(2, 4, 3, 16, 24), (1, 4, 3, 16, 24)]  # clips at 0, 8, 16
    assert all(torch.equal(a["video"], b["video"]) for a, b in zip(given, plain, strict=True))
    clip = ops.DecodeClip(np.int64(32), flip=np.float32(0.25), decoders_per_thread=np.int64(1))
    assert clip.size == (32, 32) and _python_numbers(*clip.size, clip.flip)


# -- bench ----------------------------------------------------------------------------------------


def test_bench_takes_numpy_counts_and_reports_json(image_folder):
    from headrace._bench import bench

    report = bench(str(image_folder), limit=np.int64(16), size=np.int64(32), batch_size=np.int64(8),
                   threads=np.int64(1), epochs=np.int64(1))
    assert json.loads(json.dumps(report))["epochs"] == 1
    assert _python_numbers(report["limit"], report["size"], report["batch_size"], report["epochs"])
    assert report["rows"][0]["samples"] == 16
    for name in ("epochs", "batch_size", "size", "limit", "threads"):
        with pytest.raises(ConfigError, match=rf"^(bench: )?{name} must be "):
            bench(str(image_folder), **{name: np.bool_(True)})


# -- the last few: COCO, the mask fill, the cache bound, hw_load where it is stored ---------------


@pytest.fixture
def tiny_coco(tmp_path):
    """Two real JPEGs and a COCO file: one box of 2x2 pixels, one of 10x10."""
    rng = np.random.default_rng(0)
    images = tmp_path / "images"
    images.mkdir()
    for name in ("a.jpg", "b.jpg"):
        (images / name).write_bytes(jpeg_bytes(rng, 32, 48))
    doc = {"images": [{"id": 1, "file_name": "a.jpg", "height": 32, "width": 48},
                      {"id": 2, "file_name": "b.jpg", "height": 32, "width": 48}],
           "categories": [{"id": 7, "name": "thing"}],
           "annotations": [{"id": 1, "image_id": 1, "category_id": 7, "bbox": [1, 1, 2, 2], "area": 4, "iscrowd": 0},
                           {"id": 2, "image_id": 2, "category_id": 7, "bbox": [1, 1, 10, 10], "area": 100,
                            "iscrowd": 0}]}
    annotations = tmp_path / "instances.json"
    annotations.write_text(json.dumps(doc))
    return images, annotations


async def test_coco_takes_a_numpy_min_box_size_and_requests(tiny_coco):
    numpy_reader = readers.coco(*tiny_coco, min_box_size=np.float32(5), requests=np.int64(8))
    python_reader = readers.coco(*tiny_coco, min_box_size=5.0, requests=8)
    got = [(s.key, s.fields["boxes"].tolist()) for s in await _samples(numpy_reader)]
    assert got == [(s.key, s.fields["boxes"].tolist()) for s in await _samples(python_reader)]
    assert [len(boxes) for _, boxes in got] == [0, 1]  # the 2x2 box is left out, the 10x10 kept


@pytest.mark.parametrize("value", [*BOOLS, -1.0, math.nan, math.inf, "5"])
def test_coco_refuses_a_wrong_min_box_size_naming_it(tiny_coco, value):
    with pytest.raises(ConfigError, match="min_box_size must be a number >= 0"):
        readers.coco(*tiny_coco, min_box_size=value)


def test_a_numpy_mask_fill_is_kept_as_a_python_int():
    pipe = ops.Pipeline([ops.Decode(), ops.Resize(16)], label=None, mask="mask", mask_fill=np.uint8(255))
    assert type(pipe.mask_fill) is int and pipe.mask_fill == 255
    for wrong in (*BOOLS, 255.0, -1):
        with pytest.raises(ConfigError, match="mask_fill must be an int >= 0"):
            ops.Pipeline([ops.Decode()], label=None, mask="mask", mask_fill=wrong)


def test_a_numpy_cache_bound_is_kept_as_a_python_int(tmp_path):
    # The readers make their cache through this one function (a local folder is read in place, so
    # no reader of a local path holds one to look at).
    cache = from_arguments("files", tmp_path / "copies", np.int64(1 << 20), ObjectCache)
    assert type(cache.max_bytes) is int and cache.max_bytes == 1 << 20


@pytest.mark.parametrize("value", [np.float32(0.5), np.float64(0.5), np.int64(1), 0.5, "adaptive"])
def test_loader_and_service_keep_hw_load_as_python(image_folder, value):
    want = value if isinstance(value, str) else float(value)
    loader = Loader(readers.files(image_folder), batch_size=8, device="cpu", hw_load=value)
    service = Preprocessor(device="cpu", hw_load=value)
    for held in (loader.hw_load, service.hw_load):
        assert held == want and type(held) is type(want)


@pytest.mark.parametrize("value", [*BOOLS, 1.5, -0.1, math.nan, "fast"])
def test_a_wrong_hw_load_is_refused_on_the_cpu_path_too(image_folder, value):
    with pytest.raises(ConfigError, match=r"hw_load must be in \[0, 1\] or 'adaptive'"):
        Loader(readers.files(image_folder), batch_size=8, device="cpu", hw_load=value)
    with pytest.raises(ConfigError, match=r"hw_load must be in \[0, 1\] or 'adaptive'"):
        Preprocessor(device="cpu", hw_load=value)
