"""Sources of encoded samples."""

from ._base import IndexedReader, Reader, epoch_order
from .files import FileReader, files

__all__ = ["FileReader", "IndexedReader", "Reader", "epoch_order", "files"]
