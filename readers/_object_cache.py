"""Objects of a store kept on local disk as they are first fetched, so later epochs (and later runs)
read them from there: ``files(..., cache_dir=, cache_bytes=)`` over a bucket or URLs.

A chunk's objects are looked up in one call that lets the GIL go (the files reader's C helper: a
missing copy is one failed ``open``); the ones not there are fetched from the store as before and
written afterwards, each to a ``.part`` file renamed into place, so a reader sees a whole object or
none. Both run on the reader's own I/O threads, never on the event loop. The folder fans out by
the first two hex digits of the URL's hash (256 sub-folders: a million objects stay listable).

With ``cache_bytes`` the folder fills until the bound and then keeps what it has: under a shuffled
order every object is as likely to come next, so a fixed subset hits as often as any eviction
policy would, without rewriting the disk every epoch. A cached copy is used as it is (clear the
folder when the objects change); writing never fails a read (a full disk stops the copies, counted
in ``failed`` and logged once).

A copy records the size it was written with (``_cache_folder.damage``): a copy found of another
size, or with no record (copied by a tool that leaves extended attributes behind), is not served
but removed and read from the store, since its bytes would be a sample cut short. The check is
one look at the attributes of each copy read, not a read of its bytes; the copy stays byte for
byte the object.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from ._cache_folder import (PART, CacheFolder, SharedTally, damage, disk_has_room, hold, is_copy, is_dead_part,
                            logger, nearly_full, unlink)
from ._read_files import ChunkReader

__all__ = ["ObjectCache"]


class ObjectCache(CacheFolder):
    """A folder of objects, named by their URL. ``hits``: objects read from it; ``kept``: objects
    written to it; ``skipped``: objects not written because the writes were behind; ``failed``:
    writes given up; ``damaged``: copies found empty, of another size than written, or with no
    record of it, removed and read from the store instead;
    ``used``: with a ``max_bytes``, bytes in it as the processes sharing it count them
    (``SharedTally``), as this process last saw."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int | None = None, *, native: bool = True) -> None:
        super().__init__(folder, max_bytes)
        self.hits = self.kept = self.skipped = self.damaged = 0
        self.used: int | None = None
        self._tally = SharedTally(self.folder)
        self._full = False  # a scan found no room: nothing more is written
        self._queued = 0  # bytes handed to ``keep`` and not yet written
        self._files = ChunkReader(native=native)

    def __repr__(self) -> str:
        return (f"ObjectCache({str(self.folder)!r}, max_bytes={self.max_bytes}, hits={self.hits}, kept={self.kept}, "
                f"skipped={self.skipped}, failed={self.failed})")

    def path(self, url: str, identity: str | None = None) -> str:
        """Where the object is kept: named by ``identity`` (its source as given), else ``url``."""
        digest, name = self._name(url, "object", identity)
        return os.path.join(self.folder, digest[:2], name)

    def read(self, urls: Sequence[str], identities: Sequence[str] | None = None) -> list[bytes | None]:
        """I/O thread: each URL's kept copy, or None where there is none whole."""
        ids = identities if identities is not None else [None] * len(urls)
        paths = [self.path(u, i) for u, i in zip(urls, ids)]
        blobs = self._files.read([os.fsencode(p) for p in paths])
        out: list[bytes | None] = []
        damaged: list[tuple[str, str]] = []
        for path, blob in zip(paths, blobs):
            if isinstance(blob, OSError):
                out.append(None)
                continue
            try:
                # An object is never kept empty (``keep``): an empty copy was cut short, recorded or not.
                why = "is empty" if not blob else damage(path, len(blob))
            except OSError:  # removed since it was read (another rank found it damaged): not served
                out.append(None)
                continue
            if why is not None:
                damaged.append((path, why))
            out.append(None if why is not None else blob)
        if damaged:
            self._remove_damaged(damaged)
        with self._lock:
            self.hits += sum(b is not None for b in out)
        return out

    def _remove_damaged(self, found: list[tuple[str, str]]) -> None:
        """Copies not whole (``found``: their paths, and why): served, each would be a sample cut
        short every epoch. They go, and the store is read (and a new copy kept). Under a
        ``max_bytes`` their bytes are given back, so the new copies fit."""
        freed = 0
        for path, _ in found:
            try:
                size = os.stat(path).st_size
                if size == 0 or damage(path, size) is not None:  # not a whole copy another rank put there since
                    os.unlink(path)
                    freed += size
            except OSError:
                pass
        with self._lock:
            first = self.damaged == 0
            self.damaged += len(found)
        if freed and self._claim(-freed):
            self._full = False
        if first:  # once: after a crash, or over a folder copied without its attributes, there may be thousands
            path, why = found[0]
            logger.warning("headrace: %d cached objects in %s not whole (%s %s; cut short by a crash, a disk error, or "
                           "copied without their extended attributes?): removed, read from the store",
                           len(found), self.folder, os.path.basename(path), why)

    def reserve(self, nbytes: int, count: int, bound: int) -> bool:
        """Room for ``count`` objects of ``nbytes`` in all to wait to be written, within ``bound``
        (always when none waits); False counts them as skipped. ``release(nbytes)`` once written."""
        with self._lock:
            if self._queued and self._queued + nbytes > bound:
                self.skipped += count
                return False
            self._queued += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._queued -= nbytes

    def keep(self, objects: Sequence[tuple[str, bytes]], identities: Sequence[str] | None = None) -> None:
        """I/O thread: write each ``(url, bytes)`` (named by ``identities``, as ``read`` looks them
        up), while they fit within ``max_bytes``."""
        if not disk_has_room(self.folder, sum(len(data) for _, data in objects)):
            self._give_up(objects[0][0] if objects else "", nearly_full())
            return
        ids = identities if identities is not None else [None] * len(objects)
        for (url, data), identity in zip(objects, ids):
            if self._full:
                return  # full: what is there stays
            if not data:
                continue  # not kept: an empty copy is taken for one cut short (``read``)
            final = self.path(url, identity)
            part = self._part(final)
            try:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                fd = self._write_whole(part, data)
            except OSError as exc:
                unlink(part)
                self._give_up(url, exc)
                return
            try:  # held until renamed or removed: a ``.part`` file not held is a killed run's (``is_dead_part``)
                if not self._put(url, part, final, len(data)):
                    return
            finally:
                os.close(fd)
            with self._lock:
                self.kept += 1

    def _put(self, url: str, part: str, final: str, nbytes: int) -> bool:
        """The written ``part`` renamed to ``final`` if its ``nbytes`` fit; False where they do not
        (``_full``), or the rename failed (given up)."""
        # Counted once on disk (as a ``.part`` file): a scan by another process meanwhile sees it.
        if not self._claim(nbytes):
            unlink(part)
            return False
        try:
            os.replace(part, final)
        except OSError as exc:
            unlink(part)
            self._claim(-nbytes)
            self._give_up(url, exc)
            return False
        return True

    def _write_whole(self, path: str, data: bytes) -> int:
        """``data`` to a new file at ``path``, all of it, and its size recorded on it: one ``write``
        may write less (a disk filling up, or 2 GiB at most a call on Linux), and a copy cut short
        would be taken for damaged later. The file stays open, held (``hold``): its descriptor is
        returned for the caller to close once it is renamed or removed. Raises OSError if the file
        ends up shorter, or its size cannot be recorded where the file system keeps records."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            hold(fd)
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                if not written:
                    raise OSError(f"wrote {len(data) - len(view)} of {len(data)} bytes")
                view = view[written:]
            self._record_size(fd, len(data))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _claim(self, nbytes: int) -> bool:
        """With ``max_bytes``: ``nbytes`` more counted in the folder's tally, shared with the other
        processes writing to it, if they fit (two writers must not both take the last room); a
        negative ``nbytes`` gives room back. The folder is scanned where there is no tally yet, and
        where the tally says full: it may count copies gone since (a folder cleared by hand, a
        writer killed between its count and its rename). Full after a scan, this cache stops."""
        if self.max_bytes is None:
            return True
        with self._lock, self._tally.locked() as tally:
            used = tally.read()
            if used is None or used + nbytes > self.max_bytes:
                # The scan saw this writer's own ``.part`` file, and not the copies given back (removed first).
                used = max(0, self._scan() - nbytes)
                self._full = used + nbytes > self.max_bytes
            fits = used + nbytes <= self.max_bytes
            self.used = max(0, used + nbytes) if fits else used
            tally.write(self.used)
            return fits

    def _scan(self) -> int:
        """Bytes of the copies in the folder now, with the ``.part`` files of live writers (a writer
        counts its bytes once they are in one: a ``.part`` file holds bytes counted or about to be);
        those of dead writers are removed."""
        total = 0
        for sub in os.scandir(self.folder):
            if not sub.is_dir(follow_symlinks=False):
                continue
            try:
                entries = list(os.scandir(sub.path))
            except OSError:  # removed meanwhile, or not ours to read
                continue
            for entry in entries:
                if entry.name.endswith(PART) and is_dead_part(entry.path):
                    unlink(entry.path)  # a killed run's: never renamed nor removed, it would count forever
                elif is_copy(entry) or entry.name.endswith(PART):
                    try:
                        total += entry.stat().st_size
                    except OSError:  # removed meanwhile
                        pass
        return total
