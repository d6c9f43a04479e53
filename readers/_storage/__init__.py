"""Storage backends behind one seam (``Store``: read, read a range, stream, list), and the machinery
that streams an object into a parser thread with retries and a byte bound (``RemoteFile``)."""

from ._base import Body, ObjectInfo, Store, StoreFault, redact_url, scrub
from ._downloads import Downloads
from ._http import HttpStore
from ._memory import LocalStore, MemoryStore
from ._remote import RemoteFile
from ._remote_fetch import Link
from ._resolve import Storage, is_url, run_sync
from ._retry import Retry, with_retries
from ._s3 import S3Store

__all__ = [
    "Body",
    "Downloads",
    "HttpStore",
    "Link",
    "LocalStore",
    "MemoryStore",
    "ObjectInfo",
    "RemoteFile",
    "Retry",
    "S3Store",
    "Storage",
    "Store",
    "StoreFault",
    "is_url",
    "redact_url",
    "run_sync",
    "scrub",
    "with_retries",
]
