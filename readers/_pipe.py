"""Shards read from a shell command's standard output: ``pipe:`` sources, WebDataset's convention.

``"pipe:gsutil cat gs://bucket/train-0001.tar"`` reaches any store a command-line tool reaches
(GCS, Azure, a cluster file system's client), where the S3 and HTTP readers do not. The output is
a stream: never seeked, passed over by reading, resumed mid-shard by running the command again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
from typing import IO

from headrace._errors import ReadError

__all__ = ["PIPE", "PipeShard", "is_pipe"]

PIPE = "pipe:"
_STDERR_SHOWN = 2000
_PIPE_BYTES = 1 << 20  # the end of the command's error output, in the error that names it


def _widen(out: IO[bytes]) -> None:
    """A 1 MiB pipe instead of Linux's 64 KiB: the command writes, and the parser reads, in larger
    steps, with fewer switches between them."""
    try:
        import fcntl

        fcntl.fcntl(out.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)
    except (ImportError, OSError):  # not Linux, or past /proc/sys/fs/pipe-max-size: the default stands
        pass


def is_pipe(path: object) -> bool:
    return isinstance(path, str) and path.startswith(PIPE)


class PipeShard:
    """A command's output read as a shard file, by one parser thread.

    The command starts on the first read (in that thread, not on the event loop), in a session of
    its own so that ``kill()`` reaches what it started too (``sh -c 'curl … | gunzip'``). Its end
    is checked where the output ends: an exit status other than 0 raises a ReadError naming the
    shard, with the end of the command's error output, before the parser sees a truncated tar.
    ``kill()`` (from the event loop, when the read is stopped) ends the command, so a thread
    waiting on its output wakes up; ``close()`` kills it if it still runs, reaps it and closes
    the pipe and the file its error output went to.
    """

    streamed = True  # the tar parser reads over what it skips: a pipe cannot seek

    def __init__(self, command: str, source: str) -> None:
        self.command = command
        self.source = source  # the shard's name in errors (its URLs' query strings left out)
        self.closed = False
        self._lock = threading.Lock()
        self._killed = False
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: IO[bytes] | None = None
        self._err: IO[bytes] | None = None
        self._head = b""  # bytes peeked at, not yet read

    def _stream(self) -> IO[bytes]:
        if self._out is None:
            with self._lock:
                if self._killed or self.closed:
                    raise ReadError("the read was stopped", source=self.source)
                # A file, not a pipe, for its errors: it never fills up and stops the command. Closed in close().
                self._err = tempfile.TemporaryFile()  # noqa: SIM115
                self._proc = subprocess.Popen(self.command, shell=True, stdin=subprocess.DEVNULL,
                                              stdout=subprocess.PIPE, stderr=self._err, bufsize=1 << 20,
                                              start_new_session=True)
                self._out = self._proc.stdout
                _widen(self._out)
        assert self._out is not None
        return self._out

    def peek(self, n: int = 1) -> bytes:
        """At least ``n`` bytes ahead unless the output ends first (a buffered pipe's own ``peek``
        gives what one read brought, which may be a single byte of a slow command's output)."""
        out = self._stream()
        while len(self._head) < n:
            more = out.read1(n - len(self._head))  # type: ignore[attr-defined]
            if not more:
                self._check_exit()
                break
            self._head += more
        return self._head

    def read(self, n: int = -1) -> bytes:
        head, self._head = self._head, b""
        if head and 0 <= n <= len(head):
            self._head = head[n:]
            return head[:n]
        want = -1 if n < 0 else n - len(head)
        data = self._stream().read(want)  # a buffered pipe returns less than asked only at its end
        if want < 0 or len(data) < want:
            self._check_exit()
        return head + data if head else data

    def finish(self) -> None:
        """After the parser's end: the rest of the output (after the archive's end marker) read and
        dropped, then the exit status checked."""
        out, self._head = self._stream(), b""
        while out.read(1 << 20):
            pass
        self._check_exit()

    def _check_exit(self) -> None:
        assert self._proc is not None
        status = self._proc.wait()
        if status != 0 and not self._killed:
            raise ReadError(f"the command exited with status {status}{self._stderr_tail()}", source=self.source)

    def _stderr_tail(self) -> str:
        if self._err is None:
            return ""
        self._err.seek(0, os.SEEK_END)
        size = self._err.tell()
        self._err.seek(max(0, size - _STDERR_SHOWN))
        text = self._err.read().decode("utf-8", "replace").strip()
        return f": {text}" if text else ""

    def kill(self) -> None:
        """End the command and whatever it started; safe from any thread, and more than once."""
        with self._lock:
            self._killed = True
            proc = self._proc
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def close(self) -> None:
        if self.closed:
            return
        self.kill()
        with self._lock:
            self.closed = True
        if self._proc is not None:
            self._proc.wait()
        for f in (self._out, self._err):
            if f is not None:
                f.close()

    def __enter__(self) -> PipeShard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
