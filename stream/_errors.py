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

import math
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


def is_int(value: object) -> bool:
    """An int or a NumPy integer scalar, not a bool (True would be 1): what ``require_int`` takes."""
    # numbers.Integral holds int and NumPy's integer scalars (not np.bool_), without importing NumPy.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require_int(name: str, value: object, minimum: int | None = 1, *, below: int | None = None,
                wanted: str | None = None) -> int:
    """``value`` as a Python int if it is an int or a NumPy integer (``np.int64(8)``, from a config or
    an array) of at least ``minimum`` (None: no bound) and, if given, less than ``below``; ConfigError
    naming ``name`` otherwise, saying ``f"{name} must be {wanted}"`` (by default, the bounds in
    words). A bool is refused (True would be 1), as is a float, even ``8.0``."""
    if not is_int(value) or (minimum is not None and value < minimum) or (below is not None and value >= below):
        raise ConfigError(f"{name} must be {wanted or _ints_wanted(minimum, below)}, got {value!r}")
    return int(value)


def _ints_wanted(minimum: int | None, below: int | None) -> str:
    if below is not None:
        return f"an int in [{minimum}, {below})" if minimum is not None else f"an int < {below}"
    if minimum is None:
        return "an int"
    return "a positive int" if minimum == 1 else "a non-negative int" if minimum == 0 else f"an int >= {minimum}"


def require_number(name: str, value: object, low: float | None = None, high: float | None = None, *,
                   low_open: bool = False, high_open: bool = False, wanted: str | None = None) -> float:
    """``value`` as a Python float if it is a real number (an int, a float, or a NumPy integer or
    floating scalar: ``np.float32(0.1)``, from a config or an array) within ``[low, high]`` (None: no
    bound on that side; ``low_open``/``high_open`` leave that end out); ConfigError naming ``name``
    otherwise, saying ``f"{name} must be {wanted}"`` (by default, the bounds in words). A bool
    (np.bool_ too) is refused, as is NaN: it compares false with every bound and would pass the
    checks made after this one."""
    number = math.nan
    if not isinstance(value, bool) and isinstance(value, numbers.Real):  # numbers.Real holds NumPy's, not np.bool_
        try:
            number = float(value)
        except OverflowError:  # an int past a float's range: no count of seconds or fraction is that
            pass
    if (math.isnan(number) or (low is not None and (number <= low if low_open else number < low))
            or (high is not None and (number >= high if high_open else number > high))):
        raise ConfigError(f"{name} must be {wanted or _numbers_wanted(low, high, low_open, high_open)}, got {value!r}")
    return number


# The share of each batch's bytes (those its crop windows need read) the GPU path gives the
# hardware JPEG engine: what 0.65 of the images (DALI's default) gives training's random crops, while
# validation's largest windows, its largest images, then get 0.76 of its bytes too rather than 0.79
# (docs/benchmarks.md, issue 22). Fixed, though "adaptive" ran faster where the host was the limit
# (training 1.06-1.14x, validation 1.01-1.07x, 13-16% fewer host cores per image, on one H200):
# a share that moves with timing sends an image to the engine in one run and to the CUDA decoder in
# the next, and the two do not give the same pixels, so two runs of one seed would differ.
HW_LOAD = 0.76


def require_hw_load(value: object) -> float | str:
    """``hw_load`` checked: ``"adaptive"``, or a share in [0, 1] (NumPy's too) as a Python float.
    Checked where the Loader or the service is made, on the CPU path too (which does not use it), so
    that a wrong value fails there and not when the same code first runs on a GPU."""
    if isinstance(value, str) and value == "adaptive":
        return value
    return require_number("hw_load", value, 0.0, 1.0, wanted="in [0, 1] or 'adaptive'")


def _numbers_wanted(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if low is not None and high is not None:
        return f"a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if low is not None:
        return f"a number {'>' if low_open else '>='} {low}"
    if high is not None:
        return f"a number {'<' if high_open else '<='} {high}"
    return "a number"


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
