"""``Reader.connections()`` is overridden by each reader that reads through a store, to return its
storage's ``session()``; the base class holds nothing. It used to find the storage by attribute name
(``getattr(self, "storage")``), which a reader keeping it under another name would have gone
without, unnoticed: the Loader would then open new connections every epoch.

Checked here, for every public reader that takes a remote URL, against a real object server on
127.0.0.1 (``object_server.py``, counting connections): a read inside ``connections()`` leaves its
connections open when it ends, and leaving the block closes them. Readers of local data, and the
base class whatever attributes a subclass has, return a no-op ``nullcontext``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.util
import inspect
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from object_server import object_server, server_stats
from sample_data import jpeg_bytes, make_video, tar_bytes
from storage_servers import ACCESS_KEY, BUCKET, SECRET_KEY

from headrace import readers
from headrace.readers import Reader

RETRY = {"attempts": 6, "backoff": 0.01, "max_backoff": 0.05, "timeout": 5}
IMAGES = ["a/0.jpg", "a/1.jpg", "b/2.jpg"]
VIDEOS = ["v/0.mp4", "v/1.mp4"]


def _public_readers() -> list[type[Reader]]:
    found = (getattr(readers, name) for name in readers.__all__)
    return [cls for cls in found if isinstance(cls, type) and issubclass(cls, Reader) and cls is not Reader]


def _takes_storage(cls: type[Reader]) -> bool:
    return "storage" in inspect.signature(cls.__init__).parameters


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """What the server serves (and the local readers read): images, a shard of them, a COCO
    annotation file over them, and two short videos."""
    root = tmp_path_factory.mktemp("connections")
    rng = np.random.default_rng(0)
    blobs = {name: jpeg_bytes(rng, 24, 32) for name in IMAGES}
    for name, blob in blobs.items():
        (root / "images" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "images" / name).write_bytes(blob)
    (root / "wds").mkdir()
    members = [(f"{i:04d}.{ext}", field) for i, blob in enumerate(blobs.values())
               for ext, field in (("jpg", blob), ("cls", b"0"))]
    (root / "wds" / "shard-0.tar").write_bytes(tar_bytes(members))
    (root / "instances.json").write_text(json.dumps({
        "images": [{"id": i, "file_name": name, "width": 32, "height": 24} for i, name in enumerate(IMAGES)],
        "annotations": [{"id": i, "image_id": i, "category_id": 1, "bbox": [2, 2, 10, 8], "area": 80, "iscrowd": 0}
                        for i in range(len(IMAGES))],
        "categories": [{"id": 1, "name": "thing"}],
    }))
    if importlib.util.find_spec("av") is not None:  # the video tests skip without PyAV
        for name in VIDEOS:
            make_video(root / "videos" / name, 12)
    return root


@pytest.fixture(scope="module")
def server(data) -> str:
    with object_server(data, BUCKET) as url:
        yield url


def _s3_options(url: str) -> dict:
    return {"endpoint": url, "access_key_id": ACCESS_KEY, "secret_access_key": SECRET_KEY,
            "region": "us-east-1", "retry": RETRY}


def _remote_readers(url: str, kind: str) -> dict[type[Reader], Callable[[], Reader]]:
    """Each public reader that takes a URL, built over the server's objects (``kind``: s3 or http)."""
    base = f"s3://{BUCKET}" if kind == "s3" else f"{url}/{BUCKET}"
    options = _s3_options(url) if kind == "s3" else {"retry": RETRY}
    return {
        readers.FileReader: lambda: readers.files([f"{base}/images/{name}" for name in IMAGES], [0, 0, 1],
                                                  storage_options=options),
        readers.CocoReader: lambda: readers.coco(f"{base}/images/", f"{base}/instances.json", storage_options=options),
        readers.WebDatasetReader: lambda: readers.webdataset(f"{base}/wds/shard-0.tar", storage_options=options),
        readers.VideoReader: lambda: readers.video([(f"{base}/videos/{name}", 0) for name in VIDEOS],
                                                   sequence_length=4, storage_options=options),
    }


def _local_readers(root: Path) -> dict[type[Reader], Callable[[], Reader]]:
    """Each public reader that takes a URL, built over local files instead, and two that take none."""
    return {
        readers.FileReader: lambda: readers.files(root / "images"),
        readers.CocoReader: lambda: readers.coco(root / "images", root / "instances.json"),
        readers.WebDatasetReader: lambda: readers.webdataset(str(root / "wds" / "shard-0.tar")),
        readers.VideoReader: lambda: readers.video([(root / "videos" / name, 0) for name in VIDEOS], sequence_length=4),
        readers.SequenceReader: lambda: readers.sequence([{"jpg": b"x"}]),
        readers.IterableReader: lambda: readers.iterable([{"jpg": b"x"}]),
    }


def _open_connections(url: str) -> int:
    return server_stats(url)["open"]


async def _until_closed(url: str) -> int:
    """Connections still open once the server saw them all closed, or after 5 s. The server is
    asked from the loop's thread: ``to_thread`` would start an executor thread the leak check sees."""
    for _ in range(500):
        gc.collect()  # a dropped client's pool closes its sockets as it is collected
        if (open_now := _open_connections(url)) == 0:
            break
        await asyncio.sleep(0.01)
    return open_now


def test_every_public_reader_that_takes_storage_overrides_connections():
    """A reader given storage that kept the base class's no-op would reconnect every epoch."""
    remote = {cls for cls in _public_readers() if _takes_storage(cls)}
    assert remote == set(_remote_readers("http://unused", "s3"))  # the readers the server test covers
    for cls in remote:
        assert cls.connections is not Reader.connections, cls.__name__


def test_the_base_class_holds_nothing_whatever_a_reader_names_its_attributes():
    """No duck typing: a ``storage`` attribute with a ``session()`` is not taken for the reader's
    storage unless the reader says so by overriding ``connections()``."""

    class Named(Reader):
        def __init__(self) -> None:
            self.storage = readers.MemoryStore()  # a store, with a real session()

        def __len__(self) -> int:
            return 0

        def shard(self, rank, world, *, equal=None):
            return self

        async def read(self, epoch, *, start=0, seed=0):
            yield []

    assert isinstance(Named().connections(), contextlib.nullcontext)


@pytest.mark.parametrize("kind", ["s3", "http"])
@pytest.mark.parametrize("cls", [readers.FileReader, readers.CocoReader, readers.WebDatasetReader,
                                 readers.VideoReader], ids=lambda cls: cls.__name__)
async def test_a_remote_reader_keeps_its_connections_open_for_the_block(server, kind, cls, leaks):
    if cls is readers.VideoReader:
        pytest.importorskip("av")
    reader = _remote_readers(server, kind)[cls]()
    assert await _until_closed(server) == 0  # what building the reader opened (listing, probing) is gone
    async with reader.connections():
        async with contextlib.aclosing(reader.read(0)) as chunks:
            samples = [sample async for chunk in chunks for sample in chunk]
        assert samples and all(sample.error is None for sample in samples), samples
        # The read's own session ended with the read; the block's kept its connections.
        assert _open_connections(server) > 0
    assert await _until_closed(server) == 0
    await leaks.check()


@pytest.mark.parametrize("cls", list(_local_readers(Path())), ids=lambda cls: cls.__name__)
def test_a_reader_of_local_data_holds_nothing(data, cls):
    if cls is readers.VideoReader:
        pytest.importorskip("av")
    reader = _local_readers(data)[cls]()
    assert isinstance(reader.connections(), contextlib.nullcontext)


def test_readers_that_take_no_storage_keep_the_no_op():
    for cls in _public_readers():
        if not _takes_storage(cls) and cls is not readers.MixReader:  # a mix holds its sources' connections
            assert cls.connections is Reader.connections, cls.__name__
