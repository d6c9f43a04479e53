"""Real storage servers for the storage tests: moto's S3 server and an aiohttp HTTP server, each
behind a fault-injecting proxy, all on 127.0.0.1 in one child process (``storage_servers.py``)."""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from headrace import readers
from sample_data import tar_bytes
from storage_servers import ACCESS_KEY, SECRET_KEY as SECRET, TOKEN, post_faults, serving



@dataclass
class Servers:
    """Base URLs: ``s3`` and ``http`` are the proxies (faults), ``*_direct`` the servers themselves."""

    s3: str
    http: str
    s3_direct: str
    http_direct: str
    root: Path

    def faults(self, proxy: str, *rules: dict) -> None:
        """Install a fault plan on a proxy (``"s3"`` or ``"http"``); no rules: serve normally."""
        post_faults(getattr(self, proxy), *rules)

    def log(self, proxy: str) -> list[dict]:
        """The requests the proxy saw since the last plan or log read."""
        return json.loads(urllib.request.urlopen(getattr(self, proxy) + "/__log__", timeout=10).read())


@pytest.fixture(scope="session")
def storage_root(tmp_path_factory, image_folder) -> Path:
    """What the servers serve: ``wds/`` (75 JPEGs in 10 shards + index), ``images/`` (a class tree),
    ``big/big-0.tar`` (12 MiB: 48 samples of 256 KiB)."""
    root = tmp_path_factory.mktemp("storage")
    readers.pack(image_folder, root / "wds", format="webdataset", shard_count=8, shuffle=True, seed=1)
    for path in image_folder.rglob("*.jpg"):
        dest = root / "images" / path.relative_to(image_folder)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(path.read_bytes())
    rng = np.random.default_rng(0)
    (root / "big").mkdir()
    (root / "big" / "big-0.tar").write_bytes(tar_bytes(
        [(f"{i:04d}.bin", rng.integers(0, 256, 256 << 10, dtype=np.uint8).tobytes()) for i in range(48)]))
    return root


@pytest.fixture(scope="session")
def shards(storage_root) -> Path:
    """The served ``wds/`` folder read from disk: 75 JPEGs in 10 tar shards of at most 8 samples, and
    their index (read only)."""
    return storage_root / "wds"


@pytest.fixture(scope="session")
def servers(storage_root) -> Servers:
    """The child process serving ``storage_root``; stopped when the session ends."""
    with serving(storage_root) as urls:
        yield Servers(root=storage_root, **urls)


@pytest.fixture
def s3_env(servers, monkeypatch) -> Servers:
    """Standard AWS environment pointing at the S3 proxy (``AWS_ENDPOINT_URL_S3``); faults cleared.

    Credentials are always set, so no test ever asks an instance metadata service."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_SESSION_TOKEN", TOKEN)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", servers.s3)
    servers.faults("s3")
    servers.faults("http")
    yield servers
    servers.faults("s3")
    servers.faults("http")


@pytest.fixture(scope="session")
def packed_in_order(tmp_path_factory, image_folder):
    """image_folder (75 JPEGs) packed into 10 shards of at most 8 samples, in order, with the index
    (``headrace-index.json``): for the tests that cut, draw or count shards."""
    dest = tmp_path_factory.mktemp("packed-in-order") / "wds"
    readers.pack(image_folder, dest, format="webdataset", shard_count=8, seed=1)
    return dest


@pytest.fixture
def packed_copy(tmp_path, packed_in_order):
    """A fresh copy of ``packed_in_order``, index included, for a test to cut or extend."""
    dest = tmp_path / "wds"
    shutil.copytree(packed_in_order, dest)
    return dest
