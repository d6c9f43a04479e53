"""Review 3 of the record and source readers, each test a user's case that went wrong: TFRecord files
written by the ``tfrecord`` package then compressed as TensorFlow's GZIP/ZLIB options write them,
a damaged length header, a multi-label int64 feature taken as ``cls``; an MXNet ``.idx`` with a line
past the end or a line twice; a generator (sync or async) that fails midway, and sources whose
``iter()`` or factory fails.
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from headrace import ReadError, readers
from record_checks import write_tfrecord
from sample_data import jpeg_bytes, recordio_record, write_recordio

pytest.importorskip("tfrecord.writer")


def _images(n: int) -> list[bytes]:
    rng = np.random.default_rng(3)
    return [jpeg_bytes(rng, 16 + i, 20) for i in range(n)]


def _imagenet(path: Path, n: int = 4) -> list[tuple[int, int]]:
    return write_tfrecord(path, [{"image/encoded": (jpg, "byte"), "image/class/label": (i + 1, "int")}
                                  for i, jpg in enumerate(_images(n))])


async def _read(reader, epoch=0, start=0):
    return [s async for chunk in reader.read(epoch, start=start, seed=1) for s in chunk]


@pytest.mark.parametrize("compress", [gzip.compress, zlib.compress], ids=["gzip", "zlib"])
def test_a_compressed_tfrecord_file_is_refused_naming_it(tmp_path, compress):
    # TensorFlow's TFRecordWriter(options="GZIP"/"ZLIB") writes the same records through gzip or zlib;
    # the reader took such a file as one record 'cut short' (len() one a file, every sample lost).
    plain = tmp_path / "train-0"
    _imagenet(plain)
    packed = tmp_path / "train-0.gz"
    packed.write_bytes(compress(plain.read_bytes()))
    with pytest.raises(ReadError, match="compressed .*decompress it first") as caught:
        readers.tfrecord([plain, packed])
    assert caught.value.source == str(packed)
    assert len(readers.tfrecord(plain)) == 4


async def test_a_damaged_length_header_is_not_called_a_file_cut_short(tmp_path):
    path = tmp_path / "damaged"
    spans = _imagenet(path)
    raw = bytearray(path.read_bytes())
    length = struct.unpack_from("<Q", raw, spans[1][0])[0]
    struct.pack_into("<Q", raw, spans[1][0], length + (1 << 20))  # its CRC no longer matches
    path.write_bytes(bytes(raw))
    samples = await _read(readers.tfrecord(path))
    assert [s.key for s in samples] == ["damaged/0", "damaged/1"] and samples[0].error is None
    error = samples[1].error
    assert isinstance(error, ReadError) and error.key == "damaged/1" and error.source == str(path)
    assert f"at byte {spans[1][0]}" in str(error) and "length header is damaged" in str(error)
    assert "cut short" not in str(error)
    _imagenet(path)  # control: a file really cut short still says so
    path.write_bytes(path.read_bytes()[:-30])
    assert "cut short" in str((await _read(readers.tfrecord(path)))[-1].error)


async def test_several_int64_values_taken_as_cls_are_an_error_not_the_first(tmp_path):
    # A detection set's per-object classes mapped to cls gave every image its first object's class.
    path = tmp_path / "objects"
    jpg = _images(1)[0]
    write_tfrecord(path, [{"image/encoded": (jpg, "byte"), "image/object/class/label": ([3, 5, 5], "int")},
                           {"image/encoded": (jpg, "byte"), "image/object/class/label": ([7], "int")}])
    samples = await _read(readers.tfrecord(path, features={"image/encoded": "jpg", "image/object/class/label": "cls"}))
    assert isinstance(samples[0].error, ReadError) and samples[0].error.key == "objects/0"
    assert "holds 3 labels" in str(samples[0].error)
    assert samples[1].error is None and samples[1].fields["cls"] == b"7"
    kept = await _read(readers.tfrecord(path, features={"image/object/class/label": "classes"}))
    assert kept[0].fields["classes"].tolist() == [3, 5, 5]


async def test_a_recordio_index_line_past_the_end_or_twice_costs_no_good_record(tmp_path):
    images = _images(3)
    path = tmp_path / "train.rec"
    offsets = write_recordio(path, [recordio_record(i, jpg, i) for i, jpg in enumerate(images)])
    size = path.stat().st_size
    lines = "".join(f"{k}\t{o}\n" for k, o in enumerate(offsets))
    past = tmp_path / "past.idx"
    past.write_text(lines + f"3\t{size + 4096}\n")  # the last real record took the bytes up to this line's offset
    samples = await _read(readers.recordio(path, index=past))
    assert [s.fields.get("jpg") for s in samples[:3]] == images and [s.error for s in samples[:3]] == [None] * 3
    assert len(samples) == 4 and "cut short" in str(samples[3].error)
    twice = tmp_path / "twice.idx"
    twice.write_text(lines + f"1\t{offsets[1]}\n")  # one record named by two lines: was a 'cut short' error too
    reader = readers.recordio(path, index=twice)
    samples = await _read(reader)
    assert len(reader) == 3 and [s.error for s in samples] == [None] * 3
    assert [s.fields["jpg"] for s in samples] == images


def _failing(n: int, fail_at: int):
    for i in range(n):
        if i == fail_at:
            raise RuntimeError("the queue closed")
        yield {"x": np.int64(i), "__key__": f"item-{i}"}


async def _failing_async(n: int, fail_at: int):
    for item in _failing(n, fail_at):
        yield item


@pytest.mark.parametrize("make", [_failing, _failing_async], ids=["sync", "async"])
async def test_a_source_failing_midway_yields_the_items_before_it_then_a_read_error_naming_the_item(make):
    reader = readers.iterable(lambda: make(10, 6))  # chunk_size 32: the six items were in the chunk being filled
    got = []
    with pytest.raises(ReadError) as caught:
        async for chunk in reader.read(0):
            got += chunk
    assert [s.key for s in got] == [f"item-{i}" for i in range(6)] and [s.position for s in got] == list(range(6))
    assert caught.value.key == "6" and "RuntimeError after 6 items: the queue closed" in str(caught.value)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert caught.value.source == reader._name
    got = []  # from a resume point past some of them
    with pytest.raises(ReadError):
        async for chunk in reader.read(0, start=4):
            got += chunk
    assert [(s.key, s.position) for s in got] == [("item-4", 4), ("item-5", 5)]


class _NoIter:
    def __iter__(self):
        raise OSError("the spool folder is gone")


class _NoAsyncIter:
    def __aiter__(self):
        raise OSError("the stream is gone")


def _cannot_open():
    raise ValueError("no such topic")


@pytest.mark.parametrize("source", [_NoIter(), _NoAsyncIter(), _cannot_open], ids=["iter", "aiter", "factory"])
async def test_a_source_that_cannot_start_is_a_read_error_not_its_own_exception(source, leaks):
    with pytest.raises(ReadError, match="after 0 items") as caught:
        await _read(readers.iterable(source))
    assert isinstance(caught.value.__cause__, (OSError, ValueError)) and caught.value.key == "0"
    await leaks.check()
