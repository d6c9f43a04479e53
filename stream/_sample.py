"""What moves through the pipeline: encoded samples, batches of them, and the tensors that come out."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Batch", "Sample", "SampleBatch", "SampleList", "samples_nbytes", "value_nbytes"]

FieldValue = bytes | bytearray | memoryview


@dataclass(slots=True)
class Sample:
    """One encoded sample, as a reader produced it.

    ``fields`` maps an extension-like name to raw bytes, the WebDataset convention: ``"jpg"`` holds
    the encoded image, ``"cls"`` the class label as ASCII digits. Samples from a user's source
    (``readers.sequence``, ``readers.iterable``) may hold other values too: an int label, arrays,
    tensors, token ids. ``index`` is the sample's stable
    index in its data set: per-sample random parameters are keyed on it, so a sample gets the same
    augmentation in an epoch whichever rank, batch or thread handles it. ``position`` is where the
    sample stands in this rank's stream for the epoch (0, 1, 2, ...), which is what resume counts.
    A reader that cannot read a sample still sends it, with ``error`` set and no fields, so the
    failure keeps its place in the stream and meets the loader's error policy like any other.
    """

    key: str
    fields: dict[str, FieldValue]
    source: str
    index: int
    position: int = -1
    error: Exception | None = None

    @property
    def nbytes(self) -> int:
        return sum(value_nbytes(v) for v in self.fields.values())


class SampleList(list):
    """A reader's chunk that carries its ``samples_nbytes``, counted where that is cheap (the files
    reader sums the sizes it read), so that the event loop need not touch every sample's fields.
    The count holds while the list is not changed; readers hand their chunks over unchanged."""

    __slots__ = ("done_at", "nbytes")

    def __init__(self, samples: Iterable[Sample], nbytes: int) -> None:
        super().__init__(samples)
        self.nbytes = nbytes
        self.done_at = 0.0  # time.monotonic() when an I/O thread finished it (0: not stamped)


def samples_nbytes(samples: list[Sample]) -> int:
    """Bytes held by ``samples``' fields (one comprehension: this runs on the loop for every chunk).

    ``len`` is the size of a ``bytes`` field only: an array's or a tensor's is its first dimension
    (3 for a float32 image of 3 x 224 x 224, which holds 602,112), and counting that let a reader of
    arrays run past ``Loader(max_bytes=)`` by orders of magnitude."""
    if type(samples) is SampleList:
        return samples.nbytes
    return sum([len(v) if type(v) is bytes else value_nbytes(v) for s in samples for v in s.fields.values()])


def value_nbytes(value: object) -> int:
    """Bytes a field's value holds: its length for bytes, its buffer for an array or a tensor, a
    nominal 64 for anything else (an int, a list of token ids: small next to an image)."""
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, memoryview):
        return value.nbytes  # its len() counts items of its format, rows of a 2-D view
    nbytes = getattr(value, "nbytes", None)  # NumPy arrays; torch tensors since 2.1
    return nbytes if isinstance(nbytes, int) else 64


@dataclass(slots=True)
class SampleBatch:
    """Samples grouped for one trip through the ops. ``padded`` trailing samples are repeats (FILL policy)."""

    samples: list[Sample]
    epoch: int
    index: int
    padded: int = 0

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def end_position(self) -> int:
        """Stream position just after this batch's last real (not padded) sample."""
        real = self.samples[: len(self.samples) - self.padded]
        return real[-1].position + 1 if real else 0


@dataclass(eq=False)
class Batch(Mapping[str, Any]):
    """The loader's output: names mapped to tensors (``batch["image"]``, ``batch["label"]``).

    ``sample_keys`` and ``sources`` name the samples row by row. A value is a tensor whose first
    dimension is the batch, or a list of tensors when the samples' shapes differ (no crop or resize
    made them equal).
    """

    data: dict[str, Any]
    sample_keys: list[str]
    sources: list[str]
    epoch: int
    index: int
    padded: int = 0
    dropped: int = 0  # samples of this batch skipped (``on_error="skip"``)
    replaced: int = 0  # rows holding another sample of the batch (``on_error="replace"``)
    filtered: int = 0  # samples of this batch an ``ops.Filter`` dropped (not errors)
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.data[name]

    def handoff(self) -> None:
        """Order the caller's current CUDA stream after the lane that made this batch.

        The loader calls it before handing the batch out (the sync facade again, in the consumer's
        thread). The stream waits on the lane's event without blocking the host, and each tensor is
        recorded on the stream so its memory is reused only after the consumer's work on it.
        """
        hand_off(self.data.values(), self.extra.get("ready"))

    def substitute(self) -> None:
        """Fill the rows of replaced samples (``on_error="replace"``) from their substitutes.

        Called by the loader right after ``handoff()``, so on the GPU the gather runs on the
        consumer's stream, after the lane; the event recorded after it is the batch's new ``ready``
        (the sync facade's consumer thread waits on that one).
        """
        take = self.extra.pop("take", None)
        if take is None:
            return
        import torch

        index = torch.tensor(take, dtype=torch.int64)
        device = None
        for name, value in list(self.data.items()):
            if isinstance(value, torch.Tensor):
                self.data[name] = _rows(value, index.to(value.device))
                device = value.device if value.is_cuda else device
            elif isinstance(value, list):
                self.data[name] = [value[i] for i in take]
        if self.extra.get("ready") is not None and device is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self.extra["ready"] = event

    def __iter__(self) -> Iterator[str]:
        return iter(self.data)

    def __len__(self) -> int:
        return len(self.data)

    def __getstate__(self) -> dict[str, Any]:
        # A GPU batch's ``ready`` is a CUDA event, which does not pickle (torch.save, a
        # multiprocessing queue): wait for it, so the lane's work on the tensors is done whichever
        # stream then copies them, and leave it out.
        state = dict(self.__dict__)
        ready = self.extra.get("ready")
        if ready is not None:
            ready.synchronize()
            state["extra"] = {name: value for name, value in self.extra.items() if name != "ready"}
        return state

    @property
    def size(self) -> int:
        """Number of rows (samples) in the batch, padded rows included."""
        return len(self.sample_keys)

    def __repr__(self) -> str:
        shapes = {k: _describe(v) for k, v in self.data.items()}
        return f"Batch(epoch={self.epoch}, index={self.index}, size={self.size}, {shapes})"


def _describe(value: Any) -> str:
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{getattr(value, 'dtype', '')}{list(shape)}@{getattr(value, 'device', '')}"
    if isinstance(value, list):
        return f"list[{len(value)}]"
    return type(value).__name__


def hand_off(values: Iterable[Any], ready: Any) -> None:
    """Make the current CUDA stream wait on ``ready`` (a lane's event) without blocking the host,
    and record each CUDA tensor among ``values`` (or in a list among them: images of different
    sizes) on that stream, so its memory is reused only after the work queued there. Nothing to do
    when ``ready`` is None (CPU results)."""
    if ready is None:
        return
    import torch

    streams: dict[Any, Any] = {}
    recorded: set[int] = set()
    for tensor in _cuda_tensors(values):
        stream = streams.get(tensor.device)
        if stream is None:
            stream = streams[tensor.device] = torch.cuda.current_stream(tensor.device)
            stream.wait_event(ready)
        storage = tensor.untyped_storage().data_ptr()
        if storage not in recorded:  # a list's images are views of one allocation: record it once
            tensor.record_stream(stream)
            recorded.add(storage)


def _cuda_tensors(values: Iterable[Any]) -> Iterator[Any]:
    import torch

    for value in values:
        if isinstance(value, list):
            yield from _cuda_tensors(value)
        elif isinstance(value, torch.Tensor) and value.is_cuda:
            yield value


def _rows(value: Any, index: Any) -> Any:
    """The rows ``index`` (dim 0) of the tensor ``value``, in ``value``'s own memory order: a batch
    handed out as a view over another layout (``Pipeline(splits=)``'s view-major images, the CPU
    path's channels-last NCHW uint8) keeps it, so what it promises (timm's order a view away) holds
    after a replacement too."""
    if value.dim() < 2 or value.is_contiguous():
        return value.index_select(0, index)
    order = sorted(range(value.dim()), key=value.stride, reverse=True)  # outermost in memory first
    dense = value.permute(order)
    if not dense.is_contiguous():  # not a permuted dense tensor: the rows as they come
        return value.index_select(0, index)
    return dense.index_select(order.index(0), index).permute([order.index(d) for d in range(value.dim())])
