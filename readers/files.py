"""Samples from image files: a class-per-folder tree, or a list of paths with labels."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from headrace._errors import ConfigError, ReadError
from headrace._sample import Sample

from ._base import IndexedReader

__all__ = ["FileReader", "files"]

DEFAULT_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "gif")


class FileReader(IndexedReader):
    """Reads whole files in chunks from I/O threads; one Sample per file.

    A sample's fields are ``{ext: bytes, "cls": b"<label>"}`` (WebDataset's convention) and its key
    is the path relative to the root without extension (or the path itself for a path list).
    """

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        labels: Sequence[int] | None,
        *,
        root: Path | None = None,
        classes: Sequence[str] = (),
        shuffle: bool = False,
        seed: int | None = None,
        chunk_size: int = 64,
        io_threads: int = 2,
    ) -> None:
        super().__init__(shuffle=shuffle, seed=seed, chunk_size=chunk_size, io_threads=io_threads)
        self.paths = [os.fspath(p) for p in paths]
        if labels is not None:
            labels = [int(v) for v in labels]
            if len(labels) != len(self.paths):
                raise ConfigError(f"files: {len(self.paths)} paths but {len(labels)} labels")
        self.labels = labels
        self.root = root
        self.classes = tuple(classes)
        self._keys = [_key(p, root) for p in self.paths]
        self._exts = [_ext(p) for p in self.paths]

    def _dataset_size(self) -> int:
        return len(self.paths)

    def _fetch(self, indices: Sequence[int]) -> list[Sample]:
        out = []
        for i in indices:
            path = self.paths[i]
            fields: dict = {}
            error = None
            try:
                with open(path, "rb") as f:
                    fields[self._exts[i]] = f.read()
            except OSError as exc:
                error = ReadError(f"cannot read file: {exc.strerror or exc}", key=self._keys[i], source=path)
                error.__cause__ = exc
            if self.labels is not None:
                fields["cls"] = str(self.labels[i]).encode()
            out.append(Sample(self._keys[i], fields, path, i, error=error))
        return out

    def state_dict(self) -> dict:
        return {**super().state_dict(), "root": str(self.root) if self.root else None}

    def __repr__(self) -> str:
        where = f"root={str(self.root)!r}" if self.root else f"{len(self.paths)} paths"
        return f"FileReader({where}, samples={len(self)}, shuffle={self.shuffle}, rank={self.rank}/{self.world})"


def _key(path: str, root: Path | None) -> str:
    rel = os.path.relpath(path, root) if root is not None else path
    stem, _ = os.path.splitext(rel)
    return stem.replace(os.sep, "/")


def _ext(path: str) -> str:
    return os.path.splitext(path)[1].lstrip(".").lower() or "bin"


def files(
    source: str | os.PathLike | Sequence[str | os.PathLike],
    labels: Sequence[int] | None = None,
    *,
    extensions: Sequence[str] = DEFAULT_EXTENSIONS,
    shuffle: bool = False,
    seed: int | None = None,
    chunk_size: int = 64,
    io_threads: int = 2,
) -> FileReader:
    """A reader over image files.

    ``source`` is either a folder whose sub-folders are classes (label = the sub-folder's index in
    sorted order, files found recursively below it), or a sequence of file paths with optional
    ``labels``. ``shuffle`` gives a new seeded order each epoch (``seed`` defaults to the loader's).
    ``chunk_size`` files are read per thread call, by ``io_threads`` threads.

    Raises ReadError if the folder does not exist or holds no images, ConfigError for a wrong
    argument. A listed path that is missing raises ReadError (naming it) when it is read.
    """
    if isinstance(source, (str, os.PathLike)):
        if labels is not None:
            raise ConfigError("files: labels come from the sub-folders when source is a folder")
        root = Path(source)
        if not root.is_dir():
            raise ReadError("no such folder", source=str(root))
        exts = {e.lower().lstrip(".") for e in extensions}
        classes = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        paths, found = [], []
        for label, name in enumerate(classes):
            for p in sorted((root / name).rglob("*")):
                if p.is_file() and p.suffix.lower().lstrip(".") in exts:
                    paths.append(p)
                    found.append(label)
        if not paths:
            raise ReadError(f"no image files ({', '.join(sorted(exts))}) in class sub-folders", source=str(root))
        return FileReader(paths, found, root=root, classes=classes, shuffle=shuffle, seed=seed,
                          chunk_size=chunk_size, io_threads=io_threads)
    if isinstance(source, Sequence) and not isinstance(source, (bytes, bytearray)):
        if not source:
            raise ConfigError("files: the path list is empty")
        return FileReader(list(source), labels, shuffle=shuffle, seed=seed,
                          chunk_size=chunk_size, io_threads=io_threads)
    raise ConfigError(f"files: source must be a folder or a sequence of paths, got {type(source).__name__}")
