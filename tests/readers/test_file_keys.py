"""A files reader's keys name one sample each: two files of one stem keep their extensions."""

from __future__ import annotations

import asyncio

import numpy as np

from headrace import readers
from sample_data import jpeg_bytes


def _keys(reader) -> list[str]:
    async def read() -> list[str]:
        return [s.key async for chunk in reader.read(0) for s in chunk]

    return asyncio.run(read())


def test_two_files_of_one_stem_keep_their_extensions(tmp_path):
    rng = np.random.default_rng(0)
    (tmp_path / "c0").mkdir()
    for name in ("a.jpg", "a.png", "b.jpg"):
        (tmp_path / "c0" / name).write_bytes(jpeg_bytes(rng, 8, 8))
    assert sorted(_keys(readers.files(tmp_path))) == ["c0/a.jpg", "c0/a.png", "c0/b"]
    paths = [str(tmp_path / "c0" / n) for n in ("a.jpg", "b.jpg")]
    assert sorted(_keys(readers.files(paths))) == sorted(p[: -len(".jpg")] for p in paths)  # no clash: as before
