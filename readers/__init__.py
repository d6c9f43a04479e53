"""Sources of encoded samples."""

from ._base import IndexedReader, Reader, epoch_order
from ._pack import PackResult, pack
from .files import FileReader, files
from .lmdb import LmdbReader, decode_default, decode_record, encode_record, lmdb
from .webdataset import WebDatasetReader, webdataset

__all__ = [
    "FileReader",
    "IndexedReader",
    "LmdbReader",
    "PackResult",
    "Reader",
    "WebDatasetReader",
    "decode_default",
    "decode_record",
    "encode_record",
    "epoch_order",
    "files",
    "lmdb",
    "pack",
    "webdataset",
]
