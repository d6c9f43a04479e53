"""What the shard cache and the object cache share: a folder of copies named by their URL, ``.part``
files renamed into place, each copy's record of the size it was written with, the free space a
cache leaves on its disk, and failures counted and logged once (``_shard_cache.py``,
``_object_cache.py``)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from headrace._errors import ConfigError, require_int

__all__ = ["PART", "CacheFolder", "SharedTally", "damage", "disk_has_room", "from_arguments", "hold", "is_copy",
           "is_dead_part", "locked_folder", "nearly_full", "unlink"]

logger = logging.getLogger("headrace")

PART = ".part"
# Free space a cache leaves on its disk: checkpoints and logs must still fit.
RESERVE_BYTES = 1 << 30
RESERVE_FRACTION = 0.05
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
# A copy's file name: the hash ``CacheFolder._name`` gives it, then a dash.
_COPY = re.compile(r"[0-9a-f]{16}-")
# A ``.part`` file's name as ``CacheFolder._part`` gives it: its writer's pid.
_PART_OWNER = re.compile(r"\.(\d+)-[0-9a-f]{8}\.part$")
# How long a writer may take from making its ``.part`` file to locking it (``is_dead_part``).
_SECOND_LOOK = 0.05
# The size a copy was written with, kept on its file (an extended attribute, set on the ``.part``
# file before the rename, so a copy is never in place without it): a copy cut short or lengthened
# since (a crash before its data reached the disk, a disk error, a hand) is told apart from a whole
# one by one look at its attributes, not by reading it.
_SIZE_ATTR = "user.headrace.size"
_NO_ATTRIBUTES = frozenset({errno.ENOTSUP, errno.EOPNOTSUPP})  # a file system that keeps none
_C = TypeVar("_C")


def from_arguments(what: str, folder: str | os.PathLike | None, max_bytes: int | None,
                   make: Callable[[str | os.PathLike, int | None], _C]) -> _C | None:
    """A reader's ``cache_dir=`` and ``cache_bytes=`` checked, and its cache made (None without a
    folder); ConfigError naming the reader (``what``) for a wrong value or a folder it cannot use."""
    if max_bytes is not None:
        max_bytes = require_int(f"{what}: cache_bytes", max_bytes, 1)
        if folder is None:
            raise ConfigError(f"{what}: cache_bytes needs a cache_dir")
    if folder is None:
        return None
    if not os.fspath(folder):  # Path("") is the working directory: its files must not be taken for copies
        raise ConfigError(f"{what}: cache_dir is empty (give a folder)")
    try:
        return make(folder, max_bytes)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot use cache_dir {os.fspath(folder)!r}: {exc.strerror or exc}") from exc


def damage(file: int | str, size: int) -> str | None:
    """Why the copy ``file`` (its path, or an open descriptor), found ``size`` bytes long, is not
    whole: the size recorded when it was written is another, or it has no record (written before
    copies recorded their size, or put there by a tool that leaves extended attributes behind: a
    copy of the folder stopped partway leaves a file cut short). None where it is whole, and where
    its file system keeps no extended attributes (nothing was recorded to check it against).
    Raises OSError where its attributes cannot be read (a copy removed meanwhile)."""
    try:
        recorded = os.getxattr(file, _SIZE_ATTR)
    except AttributeError:  # a platform without extended attributes
        return None
    except OSError as exc:
        if exc.errno in _NO_ATTRIBUTES:
            return None
        if exc.errno == errno.ENODATA:
            return "has no record of the size it was written with"
        raise
    try:
        written = int(recorded)
    except ValueError:
        return "has an unreadable record of its size"
    return None if written == size else f"is {size} bytes, not the {written} written"


def disk_has_room(folder: str | os.PathLike, nbytes: int) -> bool:
    """``nbytes`` more fit on ``folder``'s disk leaving ``RESERVE_BYTES`` or ``RESERVE_FRACTION``
    of it free, whichever is larger."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    return free - nbytes >= max(RESERVE_BYTES, int(total * RESERVE_FRACTION))


def is_copy(entry: os.DirEntry) -> bool:
    """``entry`` is a whole copy a cache wrote: a file named as ``CacheFolder._name`` names them,
    not a ``.part`` file. Anything else in the folder (a user's file, a sub-folder, another tool's
    lock) is neither counted nor evicted."""
    try:
        return (_COPY.match(entry.name) is not None and not entry.name.endswith(PART)
                and entry.is_file(follow_symlinks=False))
    except OSError:  # removed meanwhile
        return False


def hold(fd: int) -> None:
    """The ``.part`` file open at ``fd`` marked as being written, until it is closed: an exclusive
    ``flock`` of it (``is_dead_part``). Where it cannot be locked, its name's pid alone tells."""
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)  # waits only for a look by ``is_dead_part``, never for a writer
    except (ImportError, OSError):
        pass


def _held(path: str | os.PathLike) -> bool | None:
    """A writer holds ``path`` (``hold``); None where that cannot be told (no ``fcntl``, a file
    system without locks, a file not ours to open)."""
    try:
        import fcntl

        fd = os.open(path, os.O_RDONLY)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # lets the look's lock go


def is_dead_part(path: str | os.PathLike) -> bool:
    """``path`` is a ``.part`` file whose writer (a process on this host) is gone: a run killed
    mid-copy left it, and nobody will rename or remove it. Its writer holds a lock of it while it
    lives (``hold``): the pid in its name alone would keep a killed run's part forever where a live
    process has that pid now (a restarted container's gets the killed one's: 1, or the same small
    number every time), and would remove a live writer's whose pid is not seen here (a rank in
    another container sharing the folder). A part not locked whose pid runs is looked at once more
    a moment later: its writer may have made it and not yet locked it."""
    owner = _PART_OWNER.search(os.fspath(path))
    if owner is None:
        return False
    held = _held(path)
    if held:
        return False
    try:
        os.kill(int(owner.group(1)), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        pass
    if held is None:
        return False
    time.sleep(_SECOND_LOOK)
    return _held(path) is False


@contextlib.contextmanager
def locked_folder(folder: Path) -> Iterator[None]:
    """``folder`` for this process (this thread) alone until the block ends: an exclusive ``flock``
    of the folder itself, so no file is added to it. Where it cannot be locked (no ``fcntl``, a file
    system without locks), the block runs unlocked."""
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # lets the lock go


def nearly_full() -> OSError:
    return OSError(errno.ENOSPC, "the disk is nearly full (a cache leaves 5% of it or 1 GiB free)")


def unlink(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class CacheFolder:
    """A folder of copies, each named by a hash of its URL (distinct URLs, distinct files) and the
    URL's file name (for people looking in the folder). ``failed``: copies given up."""

    def __init__(self, folder: str | os.PathLike, max_bytes: int | None) -> None:
        self.folder = Path(folder)
        self.max_bytes = max_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self.failed = 0
        self._lock = threading.Lock()  # counters and byte counts, from several threads
        self._unrecorded = False  # its file system keeps no extended attributes (said once)

    @staticmethod
    def _name(url: str, fallback: str, identity: str | None = None) -> tuple[str, str]:
        """(the hash of ``identity``, the file name of its copy). ``identity`` is the source as
        given, query string and all (two URLs that differ there are two objects: ``?id=0`` and
        ``?id=1``); ``url``, without credentials or query, gives the name its readable end."""
        digest = hashlib.sha256((url if identity is None else identity).encode()).hexdigest()[:16]
        return digest, f"{digest}-{_UNSAFE.sub('_', url.rstrip('/').rsplit('/', 1)[-1])[-80:] or fallback}"

    @staticmethod
    def _part(final: str | os.PathLike) -> str:
        """A ``.part`` name beside ``final`` that this process alone writes (its pid: see
        ``is_dead_part``)."""
        return f"{os.fspath(final)}.{os.getpid()}-{uuid.uuid4().hex[:8]}{PART}"

    def _record_size(self, fd: int, size: int) -> None:
        """Record on the open ``.part`` file ``fd`` the size it is written with (``damage`` checks
        it). Where the file system keeps no extended attributes the copy goes without (said once);
        OSError where it refuses this one: the copy is then not kept, since without its record it
        would be taken for damaged and read from the store every epoch."""
        try:
            os.setxattr(fd, _SIZE_ATTR, str(size).encode())
            return
        except AttributeError:  # a platform without extended attributes
            pass
        except OSError as exc:
            if exc.errno not in _NO_ATTRIBUTES:
                raise
        with self._lock:
            first, self._unrecorded = not self._unrecorded, True
        if first:
            logger.warning("headrace: %s keeps no extended attributes: its copies cannot record their size, and "
                           "one cut short there is not told apart from a whole one", self.folder)

    def _give_up(self, url: str, exc: OSError) -> None:
        with self._lock:
            self.failed += 1
            first = self.failed == 1
        if first:  # once: a full disk would say it for every copy
            logger.warning("headrace: not caching %s in %s: %s", url, self.folder, exc)


class SharedTally:
    """The bytes of copies in a folder as all the processes sharing it count them (ranks on one
    host): an integer in a hidden file of the folder, read and changed under an exclusive ``flock``
    of it. A count each process keeps alone lets N ranks fill N times ``cache_bytes``. Where the
    file cannot be made or locked (a read-only folder, no ``fcntl``), it counts for this process
    alone."""

    NAME = ".headrace-used"

    def __init__(self, folder: Path) -> None:
        self.path = folder / self.NAME
        self._alone: int | None = None  # the count, where there is no file to keep it in

    @contextlib.contextmanager
    def locked(self) -> Iterator[_TallyFile]:
        """The count, for this process alone until the block ends."""
        try:
            import fcntl

            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except (ImportError, OSError):
            yield _TallyFile(None, self)
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # a file system without locks: counted as if alone
                pass
            yield _TallyFile(fd, self)
        finally:
            os.close(fd)  # lets the lock go


class _TallyFile:
    def __init__(self, fd: int | None, tally: SharedTally) -> None:
        self._fd, self._tally = fd, tally

    def read(self) -> int | None:
        """The count, or None where there is none yet (a new folder, a file cut short)."""
        if self._fd is None:
            return self._tally._alone
        try:
            text = os.pread(self._fd, 64, 0)
            return int(text) if text.strip() else None
        except (OSError, ValueError):
            return None

    def write(self, used: int) -> None:
        if self._fd is None:
            self._tally._alone = used
            return
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, str(used).encode(), 0)
        except OSError:
            pass
