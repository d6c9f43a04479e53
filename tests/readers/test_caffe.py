"""readers.caffe over real Caffe LMDBs: py-lmdb databases whose values are ``caffe.Datum`` messages
serialized by protobuf from a Datum class built here, in the test, from Caffe's schema (its own
descriptor pool and package, so nothing is shared with the reader's). As ``convert_imageset
--encoded`` writes them: JPEG and PNG bytes with their labels, keys ``{index:08d}_{file name}``.
The loader end to end on the CPU (every sample once, labels, pixels as Pillow decodes the same
bytes), shuffle and exact resume, shards, and values that are not usable Datums as ReadErrors
naming their key, under ``on_error``.
"""

from __future__ import annotations

import importlib
import io
import sys

import numpy as np
import pytest
from PIL import Image

import headrace
from headrace import ConfigError, ReadError, ops, readers
from record_checks import read_all
from sample_data import jpeg_bytes

lmdb_lib = pytest.importorskip("lmdb")
pytest.importorskip("google.protobuf")

COUNT = 30  # samples in the database: even ones JPEG, odd ones PNG


def datum_class():
    """Caffe's ``Datum`` (caffe.proto, proto2) as a protobuf message class, in a pool of its own."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    field = descriptor_pb2.FieldDescriptorProto
    schema = descriptor_pb2.FileDescriptorProto(name="test/caffe.proto", package="caffe", syntax="proto2")
    datum = schema.message_type.add(name="Datum")
    for number, (name, kind) in enumerate((("channels", field.TYPE_INT32), ("height", field.TYPE_INT32),
                                           ("width", field.TYPE_INT32), ("data", field.TYPE_BYTES),
                                           ("label", field.TYPE_INT32), ("float_data", field.TYPE_FLOAT),
                                           ("encoded", field.TYPE_BOOL)), 1):
        label = field.LABEL_REPEATED if name == "float_data" else field.LABEL_OPTIONAL
        datum.field.add(name=name, number=number, type=kind, label=label)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(schema)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("caffe.Datum"))


Datum = datum_class()


def encoded_datum(image: bytes, label: int | None) -> bytes:
    """What Caffe's ReadFileToDatum stores for an encoded image: the file's bytes, encoded, a label."""
    datum = Datum(data=image, encoded=True)
    if label is not None:
        datum.label = label
    return datum.SerializeToString()


def png_bytes(rng: np.random.Generator, h: int, w: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def write_lmdb(path, items) -> str:
    env = lmdb_lib.open(str(path), map_size=1 << 26, subdir=True, lock=False)
    with env.begin(write=True) as txn:
        for key, value in items:
            txn.put(key.encode() if isinstance(key, str) else key, value)
    env.close()
    return str(path)


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    """A Caffe LMDB of COUNT encoded Datums (JPEG and PNG, 24-90 px a side, labels 0-4), and
    key → (image bytes, label)."""
    rng = np.random.default_rng(7)
    expected = {}
    for i in range(COUNT):
        h, w = int(rng.integers(24, 90)), int(rng.integers(24, 90))
        image = jpeg_bytes(rng, h, w) if i % 2 == 0 else png_bytes(rng, h, w)
        name = f"n{i % 5:08d}/img_{i}.{'JPEG' if i % 2 == 0 else 'png'}"
        expected[f"{i:08d}_{name}"] = (image, (i * 3) % 5)
    path = write_lmdb(tmp_path_factory.mktemp("caffe") / "train_lmdb",
                      [(key, encoded_datum(image, label)) for key, (image, label) in expected.items()])
    return path, expected


def pillow_pixels(image: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(image)).convert("RGB"))


def _loader(reader, **kwargs):
    pipeline = ops.Pipeline([ops.Decode()], layout="HWC")  # whole images, as decoded: comparable with Pillow
    return headrace.Loader(reader, batch_size=8, pipeline=pipeline, device="cpu", num_threads=2, **kwargs)


def _rows(batch):
    """(key, label, HWC pixels) of each row of a batch."""
    images = batch["image"] if isinstance(batch["image"], list) else list(batch["image"])
    return [(key, int(label), image.numpy()) for key, label, image in zip(batch.sample_keys, batch["label"], images)]


async def _epoch_rows(loader):
    return [row async for batch in loader for row in _rows(batch)]


async def test_the_loader_gives_every_sample_once_with_its_label_and_pillows_pixels(imagenet, leaks):
    path, expected = imagenet
    loader = _loader(readers.caffe(path))
    async with loader:
        rows = await _epoch_rows(loader)
    assert sorted(key for key, _, _ in rows) == sorted(expected)  # every sample, once
    for key, label, pixels in rows:
        image, want = expected[key]
        assert label == want, key
        reference = pillow_pixels(image)
        assert pixels.shape == reference.shape, key
        assert np.abs(pixels.astype(np.int16) - reference).max() <= 1, key
    await leaks.check()


async def test_fields_are_the_image_under_its_format_and_the_label_as_digits(imagenet):
    path, expected = imagenet
    reader = readers.caffe(path)
    assert len(reader) == COUNT and isinstance(reader, readers.LmdbReader)
    samples = await read_all(reader)
    assert [s.key for s in samples] == sorted(expected)  # the database's sorted order
    for s in samples:
        image, label = expected[s.key]
        kind = "jpg" if s.key.endswith(".JPEG") else "png"
        assert set(s.fields) == {kind, "cls"} and bytes(s.fields[kind]) == image
        assert s.fields["cls"] == str(label).encode()  # ASCII digits, as readers.lmdb and tfrecord give it
        assert s.error is None and s.source == str(path)
    assert "caffe" in repr(reader).lower() and reader.state_dict()["type"] == "CaffeReader"


async def test_a_datum_without_a_label_has_no_cls_field(tmp_path):
    jpg = jpeg_bytes(np.random.default_rng(0), 20, 30)
    path = write_lmdb(tmp_path / "db", [("a", encoded_datum(jpg, None)), ("b", encoded_datum(jpg, 0))])
    samples = await read_all(readers.caffe(path))
    assert [sorted(s.fields) for s in samples] == [["jpg"], ["cls", "jpg"]]
    assert samples[1].fields["cls"] == b"0"  # label 0 is a label (proto2 knows it was set)


@pytest.mark.parametrize("stop_after", [0, 1, 2])
async def test_shuffle_and_exact_resume_from_a_state_dict(imagenet, stop_after):
    path, _ = imagenet
    whole = _loader(readers.caffe(path, shuffle=True, chunk_size=5), seed=11)
    async with whole:
        await _epoch_rows(whole)
        expected = [(key, label) for key, label, _ in await _epoch_rows(whole)]  # epoch 1
    assert expected != sorted(expected)  # shuffled
    first = _loader(readers.caffe(path, shuffle=True, chunk_size=5), seed=11)
    async with first:
        await _epoch_rows(first)
        seen = []
        async for batch in first:
            seen += [(key, label) for key, label, _ in _rows(batch)]
            if batch.index == stop_after:
                break
        state = first.state_dict()
    second = _loader(readers.caffe(path, shuffle=True, chunk_size=5), seed=11)
    second.load_state_dict(state)
    async with second:
        rest = [(key, label) for key, label, _ in await _epoch_rows(second)]
    assert seen + rest == expected


async def test_a_state_of_readers_lmdb_on_the_same_database_is_refused(imagenet):
    path, _ = imagenet
    plain = _loader(readers.lmdb(path))
    state = plain.state_dict()
    await plain.aclose()
    caffe = _loader(readers.caffe(path))
    with pytest.raises(ConfigError):
        caffe.load_state_dict(state)
    await caffe.aclose()


async def test_shards_are_disjoint_and_make_up_the_whole(imagenet):
    path, expected = imagenet
    reader = readers.caffe(path, shuffle=True, seed=3)
    parts = [[s.key for s in await read_all(reader.shard(rank, 4), epoch=2)] for rank in range(4)]
    assert sorted(key for part in parts for key in part) == sorted(expected)
    assert [len(reader.shard(rank, 4)) for rank in range(4)] == list(map(len, parts))
    loader = _loader(readers.caffe(path).shard(1, 3))
    async with loader:
        rows = await _epoch_rows(loader)
    assert len(rows) == COUNT // 3 and all(label == expected[key][1] for key, label, _ in rows)


@pytest.fixture
def damaged(tmp_path):
    """Good Datums around five bad values: a Datum cut in its data, a headrace record, JSON, a
    message with a Datum's fields and one a Datum has not (field 1 holding bytes, where Datum's is
    an int: protobuf parses it, keeping that field aside as unknown), an empty value."""
    rng = np.random.default_rng(1)
    good = [encoded_datum(jpeg_bytes(rng, 32, 32), label) for label in range(3)]
    items = [("0_good", good[0]), ("1_cut", good[1][: len(good[1]) // 2]),
             ("2_record", readers.encode_record({"jpg": b"\xff\xd8\xff", "cls": b"1"})),
             ("3_json", b'{"label": 3}'), ("4_other_message", b"\x0a\x05hello" + good[0]), ("5_empty", b""),
             ("6_good", good[2])]
    return write_lmdb(tmp_path / "damaged", items)


async def test_values_that_are_not_datums_are_read_errors_naming_their_key(damaged):
    samples = await read_all(readers.caffe(damaged))
    errors = {s.key: s.error for s in samples if s.error is not None}
    assert set(errors) == {"1_cut", "2_record", "3_json", "4_other_message", "5_empty"}
    for key, error in errors.items():
        assert isinstance(error, ReadError) and error.key == key and error.source == damaged
        assert "caffe.Datum" in str(error), str(error)
    assert [s.fields["cls"] for s in samples if s.error is None] == [b"0", b"2"]


async def test_on_error_raise_names_the_key_and_skip_counts_them(damaged):
    loader = _loader(readers.caffe(damaged))
    with pytest.raises(ReadError) as info:
        async with loader:
            await _epoch_rows(loader)
    assert info.value.key == "1_cut" and info.value.source == damaged
    skipping = _loader(readers.caffe(damaged), on_error="skip", max_errors=5)
    async with skipping:
        rows = await _epoch_rows(skipping)
        stats = skipping.stats()
    assert [(key, label) for key, label, _ in rows] == [("0_good", 0), ("6_good", 2)]
    assert stats.dropped == 5 and stats.errors == {"ReadError": 5}


async def test_a_raw_datum_is_a_read_error_that_says_encoded_is_needed(tmp_path):
    pixels = np.arange(3 * 4 * 5, dtype=np.uint8).reshape(3, 4, 5)  # Caffe's raw layout: CHW, BGR
    raw = Datum(channels=3, height=4, width=5, data=pixels.tobytes(), label=2).SerializeToString()
    floats = Datum(channels=1, height=2, width=2, float_data=[0.5, 1, 2, 3], label=1).SerializeToString()
    path = write_lmdb(tmp_path / "raw", [("raw", raw), ("floats", floats)])
    samples = await read_all(readers.caffe(path))
    for s in samples:
        assert isinstance(s.error, ReadError) and s.error.key == s.key and s.error.source == path
        assert "encoded=True" in str(s.error) and "raw" in str(s.error), str(s.error)
    assert "3x4x5" in str(samples[1].error)  # keys sorted: floats, raw


def test_bad_arguments_are_config_errors_and_a_missing_database_a_read_error(imagenet, tmp_path):
    path, _ = imagenet
    for kwargs in ({"shuffle": "yes"}, {"seed": -1}, {"chunk_size": 0}, {"io_threads": 0}, {"keys": "abc"},
                   {"keys": [1, 2]}):
        with pytest.raises(ConfigError):
            readers.caffe(path, **kwargs)
    with pytest.raises(TypeError):
        readers.caffe(path, decode=lambda key, value: {})  # the Datum is the format: no decode to give
    with pytest.raises(ReadError) as info:
        readers.caffe(tmp_path / "none")
    assert info.value.source == str(tmp_path / "none")


async def test_keys_pick_and_order_the_samples(imagenet):
    path, expected = imagenet
    chosen = sorted(expected)[::-7]
    samples = await read_all(readers.caffe(path, keys=chosen))
    assert [s.key for s in samples] == chosen and all(s.error is None for s in samples)


def test_without_protobuf_or_lmdb_construction_raises_an_import_error_with_the_install_hint(imagenet, monkeypatch):
    caffe_module = importlib.import_module("headrace.readers.caffe")  # the package's `caffe` is the function
    path, _ = imagenet
    monkeypatch.setattr(caffe_module, "_DATUM", None)  # the class is made on first use: make it again
    monkeypatch.setitem(sys.modules, "google.protobuf", None)
    with pytest.raises(ImportError, match=r"headrace\[caffe\]"):
        readers.caffe(path)
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "lmdb", None)
    with pytest.raises(ImportError, match=r"headrace\[caffe\]"):
        readers.caffe(path)
