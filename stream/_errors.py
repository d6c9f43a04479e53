"""The exception tree. Every failure a user can see while loading data is one of these.

    LoaderError                 the root: catch this to catch everything headrace raises
    ├── ConfigError             a wrong argument (also a ValueError)
    ├── ReadError               bytes could not be read: missing file, permission, truncated container
    │   └── StorageError        a storage backend failed after its retries (S3, HTTP, ...)
    ├── DecodeError             bytes were read but are not a decodable image
    ├── TransformError          an op failed on a decoded sample or batch
    ├── ErrorBudgetExceeded     on_error="skip" dropped more samples than max_errors allows
    ├── OverloadedError         a Preprocessor refused a request: too many in flight (when_full="reject")
    └── ClosedError             the loader or channel was used after aclose()

Each carries ``key`` (the sample key, when one is known), ``source`` (path or URL) and ``stage``
(the pipeline stage that failed) as attributes; they are not folded into ``args``.
"""

from __future__ import annotations

import numbers

__all__ = [
    "ClosedError",
    "ConfigError",
    "DecodeError",
    "ErrorBudgetExceeded",
    "LoaderError",
    "OverloadedError",
    "ReadError",
    "StorageError",
    "TransformError",
]


class LoaderError(Exception):
    """Root of every error headrace raises about data, configuration or lifetime."""

    stage: str = "loader"

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        source: str | None = None,
        stage: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.key = key
        self.source = source
        if stage is not None:
            self.stage = stage

    def __str__(self) -> str:
        where = []
        if self.key is not None:
            where.append(f"key={self.key!r}")
        if self.source is not None:
            where.append(f"source={self.source!r}")
        suffix = f" [{self.stage}{': ' if where else ''}{', '.join(where)}]"
        return self.message + suffix

    def __reduce__(self):  # keep attributes across pickling (multiprocessing, torch.distributed)
        return (_rebuild, (type(self), self.message, self.key, self.source, self.stage))


def _rebuild(cls, message, key, source, stage):
    return cls(message, key=key, source=source, stage=stage)


class ConfigError(LoaderError, ValueError):
    """An argument is wrong: raised when the object is built, before any data moves."""

    stage = "config"


def require_int(name: str, value: object, minimum: int | None = 1, *, below: int | None = None) -> int:
    """``value`` as a Python int if it is an int or a NumPy integer (``np.int64(8)``, from a config or
    an array) of at least ``minimum`` (None: no bound) and, if given, less than ``below``; ConfigError
    naming ``name`` otherwise. A bool is refused (True would be 1), as is a float, even ``8.0``."""
    # numbers.Integral holds int and NumPy's integer scalars (not np.bool_), without importing NumPy.
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or (minimum is not None and value < minimum) or (below is not None and value >= below)):
        if below is not None:
            wanted = f"an int in [{minimum}, {below})" if minimum is not None else f"an int < {below}"
        elif minimum is None:
            wanted = "an int"
        else:
            wanted = "a positive int" if minimum == 1 else "a non-negative int" if minimum == 0 else f"an int >= {minimum}"
        raise ConfigError(f"{name} must be {wanted}, got {value!r}")
    return int(value)


class ReadError(LoaderError):
    """A sample's bytes could not be read from its source."""

    stage = "read"


class StorageError(ReadError):
    """A storage backend kept failing after its retry budget."""

    stage = "storage"


class DecodeError(LoaderError):
    """A sample's bytes are not an image the decoder can read (corrupt, truncated, unknown format)."""

    stage = "decode"


class TransformError(LoaderError):
    """An op could not be applied to a decoded sample."""

    stage = "transform"


class ErrorBudgetExceeded(LoaderError):
    """More samples failed than ``max_errors`` allows; ``__cause__`` is the last failure."""

    stage = "budget"


class OverloadedError(LoaderError):
    """A service refused a request because its bound on requests in flight was reached.

    Raised at once, before any work, only with ``when_full="reject"``; the caller may retry later
    or shed the load (an HTTP server answers 503).
    """

    stage = "overload"


class ClosedError(LoaderError):
    """The object was used after it was closed."""

    stage = "closed"
