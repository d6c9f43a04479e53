"""The record files' scans in C (``hr_scan_tfrecords``/``hr_scan_recordio`` through
``_read_files.scan_records``) against the Python scans they stand in for: on whole files, files
cut at every kind of place, lengths rewritten, the magic lost, RecordIO records written in parts,
and files damaged at random, both give the same records (offset, length, or the cut and damaged
markers) in the same order; past a call's capacity the scan goes on where it stopped."""

from __future__ import annotations

import importlib
import os
import struct

import numpy as np
import pytest
from sample_data import write_recordio

from headrace.readers import _read_files
from headrace.readers._read_files import scan_records

pytestmark = pytest.mark.skipif(_read_files._load() is None, reason="the C helper does not build here")
tfrecord_module = importlib.import_module("headrace.readers.tfrecord")  # modules, not the functions
recordio_module = importlib.import_module("headrace.readers.recordio")
MAGIC = struct.pack("<I", 0xCED7230A)


def _tfrecord_bytes(payloads: list[bytes]) -> tuple[bytes, list[int]]:
    out, starts = bytearray(), []
    for data in payloads:
        starts.append(len(out))
        length = struct.pack("<Q", len(data))
        out += length + struct.pack("<I", tfrecord_module._masked_crc32c(length)) + data
        out += struct.pack("<I", tfrecord_module._masked_crc32c(data))
    return bytes(out), starts


def _payloads(rng: np.random.Generator, n: int, *, magic_inside: bool = False) -> list[bytes]:
    out = []
    for i in range(n):
        data = bytearray(rng.integers(0, 256, int(rng.integers(0, 300)), dtype=np.uint8).tobytes())
        if magic_inside and i % 3 < 2 and len(data) >= 16:  # at 4-byte boundaries: written in parts
            for at in rng.choice(len(data) // 4 - 1, size=i % 3 + 1, replace=False):  # 2 or 3 parts
                data[int(at) * 4:int(at) * 4 + 4] = MAGIC
        out.append(bytes(data))
    return out


def _both(module, path) -> tuple[list | Exception, list | Exception]:
    """The module's scan of ``path`` with the C helper and with Python alone (or what each raised)."""
    results = []
    for native in (True, False):
        saved = module.scan_records
        if not native:
            module.scan_records = lambda *args: None
        try:
            results.append(module._scan(str(path), 0))
        except Exception as exc:  # noqa: BLE001 - compared below, type and words
            results.append(exc)
        finally:
            module.scan_records = saved
    return results[0], results[1]


def _same(native, python) -> None:
    if isinstance(python, Exception):
        assert type(native) is type(python) and str(native) == str(python)
    else:
        assert native == python


def _damage(data: bytes, rng: np.random.Generator, starts: list[int]) -> bytes:
    out = bytearray(data)
    for _ in range(int(rng.integers(1, 4))):
        how = int(rng.integers(0, 4))
        if how == 0 and out:
            out[int(rng.integers(0, len(out)))] ^= int(rng.integers(1, 256))
        elif how == 1 and starts:  # a header's length (or magic) rewritten
            at = int(rng.choice(starts))
            out[at:at + 8] = rng.integers(0, 256, 8, dtype=np.uint8).tobytes()
        elif how == 2 and out:
            del out[int(rng.integers(0, len(out))):]
        else:
            at = int(rng.integers(0, len(out) + 1))
            out[at:at] = rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
    return bytes(out[: max(len(out), 1)])


def test_whole_files_scan_alike(tmp_path):
    rng = np.random.default_rng(0)
    tf_path, rec_path = tmp_path / "a.tfrecord", tmp_path / "a.rec"
    data, starts = _tfrecord_bytes(_payloads(rng, 200))
    tf_path.write_bytes(data)
    native, python = _both(tfrecord_module, tf_path)
    assert native == python and [r[1] - 12 for r in native] == starts
    offsets = write_recordio(rec_path, _payloads(rng, 200, magic_inside=True), idx=False)
    native, python = _both(recordio_module, rec_path)
    assert native == python and [r[1] for r in native] == offsets


def test_files_cut_at_every_place_scan_alike(tmp_path):
    rng = np.random.default_rng(1)
    data, _ = _tfrecord_bytes(_payloads(rng, 6))
    rec_path = tmp_path / "whole.rec"
    write_recordio(rec_path, _payloads(rng, 6, magic_inside=True), idx=False)
    records = rec_path.read_bytes()
    for name, module, whole in (("cut.tfrecord", tfrecord_module, data), ("cut.rec", recordio_module, records)):
        path = tmp_path / name
        for end in range(1, len(whole) + 1):
            path.write_bytes(whole[:end])
            _same(*_both(module, path))


@pytest.mark.parametrize("seed", range(4))
def test_damaged_files_scan_alike(tmp_path, seed):
    rng = np.random.default_rng(seed)
    data, tf_starts = _tfrecord_bytes(_payloads(rng, 40))
    rec_path = tmp_path / "pristine.rec"
    rec_starts = write_recordio(rec_path, _payloads(rng, 40, magic_inside=True), idx=False)
    records = rec_path.read_bytes()
    path_tf, path_rec = tmp_path / "d.tfrecord", tmp_path / "d.rec"
    for _ in range(60):
        path_tf.write_bytes(_damage(data, rng, tf_starts))
        _same(*_both(tfrecord_module, path_tf))
        path_rec.write_bytes(_damage(records, rng, rec_starts))
        _same(*_both(recordio_module, path_rec))


def test_past_a_calls_capacity_the_scan_goes_on(tmp_path, monkeypatch):
    rng = np.random.default_rng(2)
    tf_path, rec_path = tmp_path / "a.tfrecord", tmp_path / "a.rec"
    data, _ = _tfrecord_bytes(_payloads(rng, 50))
    tf_path.write_bytes(data[:-5])  # the last record cut short: left to Python
    write_recordio(rec_path, _payloads(rng, 50, magic_inside=True), idx=False)
    whole = {module: module._scan(str(path), 0) for module, path in
             ((tfrecord_module, tf_path), (recordio_module, rec_path))}
    monkeypatch.setattr(_read_files, "_SCAN_CAP", 7)
    for module, path in ((tfrecord_module, tf_path), (recordio_module, rec_path)):
        assert module._scan(str(path), 0) == whole[module]
        with open(path, "rb") as f:
            pairs, end = scan_records("tfrecord" if module is tfrecord_module else "recordio", f.fileno(),
                                      path.stat().st_size, str(path))
        assert len(pairs) == (49 if module is tfrecord_module else 50)
        assert end == (path.stat().st_size if module is recordio_module else whole[module][-1][1])


def test_a_read_error_names_the_file(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)  # a folder: its pread fails (EISDIR)
    try:
        with pytest.raises(IsADirectoryError) as caught:
            scan_records("tfrecord", fd, 100, "named.tfrecord")
    finally:
        os.close(fd)
    assert caught.value.filename == "named.tfrecord"
