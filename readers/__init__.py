"""Sources of encoded samples."""

from ._base import IndexedReader, Reader, epoch_order
from ._pack import PackResult, pack
from ._storage import HttpStore, LocalStore, MemoryStore, ObjectInfo, Retry, S3Store, Store
from .caffe import CaffeReader, caffe
from .coco import CocoReader, coco
from .files import FileReader, file_list, files
from .lmdb import LmdbReader, decode_default, decode_record, encode_record, lmdb
from .mix import MixReader, mix
from .recordio import RecordIOReader, recordio
from .sources import IterableReader, SequenceReader, iterable, sequence
from .tfrecord import TFRecordReader, parse_example, tfrecord
from .video import VideoReader, video
from .webdataset import WebDatasetReader, webdataset

__all__ = [
    "CaffeReader",
    "CocoReader",
    "FileReader",
    "HttpStore",
    "IndexedReader",
    "IterableReader",
    "LmdbReader",
    "LocalStore",
    "MemoryStore",
    "MixReader",
    "ObjectInfo",
    "PackResult",
    "Reader",
    "RecordIOReader",
    "Retry",
    "S3Store",
    "SequenceReader",
    "Store",
    "TFRecordReader",
    "VideoReader",
    "WebDatasetReader",
    "caffe",
    "coco",
    "decode_default",
    "decode_record",
    "encode_record",
    "epoch_order",
    "file_list",
    "files",
    "iterable",
    "lmdb",
    "mix",
    "pack",
    "parse_example",
    "recordio",
    "sequence",
    "tfrecord",
    "video",
    "webdataset",
]
