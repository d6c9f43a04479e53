"""``headrace inspect`` and ``headrace bench`` on a Caffe LMDB: recognised by its first value (an
encoded ``caffe.Datum``) or named by ``--format caffe``, its images counted by format, not as ``bin``."""

from __future__ import annotations

import numpy as np
import pytest
from sample_data import jpeg_bytes

from headrace import readers
from headrace._inspect import inspect, open_reader

lmdb = pytest.importorskip("lmdb")
pytest.importorskip("google.protobuf")


def _caffe_db(path, images: list[bytes], encoded: bool = True) -> str:
    from headrace.readers.caffe import datum_class

    env = lmdb.open(str(path), map_size=64 << 20)
    with env.begin(write=True) as txn:
        for i, image in enumerate(images):
            datum = datum_class()(channels=3, height=8, width=8, data=image, label=i % 3, encoded=encoded)
            txn.put(f"{i:08d}".encode(), datum.SerializeToString())
    env.close()
    return str(path)


@pytest.fixture
def images():
    rng = np.random.default_rng(0)
    return [jpeg_bytes(rng, 24, 32) for _ in range(7)]


def test_an_lmdb_of_encoded_datums_is_inspected_as_caffe(tmp_path, images):
    path = _caffe_db(tmp_path / "db", images)
    reader, kind = open_reader(path)
    assert kind == "caffe" and type(reader).__name__ == "CaffeReader"
    report = inspect(path, verify=True)
    assert report["format"] == "caffe" and report["samples"] == 7
    assert report["image_formats"] == {"jpeg": 7}
    assert report["bad"] == []


def test_format_caffe_is_taken_as_said_and_other_lmdbs_stay_lmdb(tmp_path, images):
    caffe_db = _caffe_db(tmp_path / "caffe", images)
    assert open_reader(caffe_db, "lmdb")[1] == "lmdb"  # what the user asked for
    assert open_reader(caffe_db, "caffe")[1] == "caffe"
    raw = _caffe_db(tmp_path / "raw", images, encoded=False)  # raw Datums: the Caffe reader refuses them
    assert open_reader(raw)[1] == "lmdb"
    src = tmp_path / "src" / "c0"
    src.mkdir(parents=True)
    for i, image in enumerate(images):
        (src / f"{i}.jpg").write_bytes(image)
    readers.pack(tmp_path / "src", tmp_path / "packed", format="lmdb")  # headrace records
    assert open_reader(str(tmp_path / "packed"))[1] == "lmdb"
