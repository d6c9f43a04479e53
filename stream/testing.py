"""Fakes for tests of code that uses headrace: an in-memory object store with injectable faults."""

from headrace.readers._storage import MemoryStore

__all__ = ["MemoryStore"]
