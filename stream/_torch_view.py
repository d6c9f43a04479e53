"""A ``torch.utils.data.IterableDataset`` view of a loader, for code that insists on one.

Code that only iterates a ``DataLoader`` (``for batch in X``, ``len(X)``) takes ``loader.sync()``
as it is. This view is for code that builds its own ``DataLoader`` from a dataset:
``DataLoader(torch_dataset(loader), batch_size=None)``. headrace batches already, and runs its own
threads and event loop in this process, so the ``DataLoader`` must neither batch again nor start
workers; a worker process refuses to iterate it (``ConfigError``).

torch is imported at the first ``torch_dataset()``, not with ``headrace``: the view's class is
made then, from the torch-free ``_View`` and torch's ``IterableDataset``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ._errors import ConfigError

if TYPE_CHECKING:
    from ._loader import Loader

__all__ = ["torch_dataset"]

_NO_WORKERS = (
    "torch_dataset: use DataLoader(view, batch_size=None, num_workers=0); headrace runs its own "
    "threads and event loop in this process, and a DataLoader worker process would get a copy "
    "that cannot run them"
)


class _View:
    """One epoch of ``loader`` per ``iter()``, through its ``sync()`` facade; ``len()`` when known.

    The methods of the view that ``torch_dataset(loader)`` makes; see there.
    """

    def __init__(self, loader: Loader, *, keys: str | None = None) -> None:
        self.loader = loader
        self.keys = keys
        self._sync = loader.sync()

    def __len__(self) -> int:
        return len(self._sync)  # TypeError when the reader does not know its length, as DataLoader expects

    def __iter__(self) -> Iterator[Any]:
        import torch.utils.data

        if torch.utils.data.get_worker_info() is not None:
            raise ConfigError(_NO_WORKERS)
        for batch in self._sync:
            if self.keys is None:
                yield batch
            elif self.keys in batch.data:
                # The keys would replace that field's tensor in every item, silently.
                raise ConfigError(f"torch_dataset: keys={self.keys!r} names a field of the batches "
                                  f"({sorted(batch.data)}); give the sample keys another name")
            else:
                yield {**batch.data, self.keys: list(batch.sample_keys)}

    def close(self) -> None:
        """Close the epoch in progress, if any, and the loader (threads, GPU lanes). Safe to call twice."""
        self._sync.close()

    def __enter__(self) -> _View:
        self._sync.__enter__()  # one loop thread for every epoch of the block: the loader runs ahead
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce_ex__(self, protocol: object) -> Any:
        # A worker started by spawn or forkserver gets the dataset pickled: refuse it here, clearly.
        raise ConfigError(_NO_WORKERS)


@functools.cache
def _view_class() -> type[_View]:
    import torch.utils.data

    view = type("TorchDatasetView", (_View, torch.utils.data.IterableDataset), {})
    view.__module__ = __name__
    return view


def torch_dataset(loader: Loader, *, keys: str | None = None) -> Any:
    """``loader`` as a ``torch.utils.data.IterableDataset`` whose items are headrace's batches.

    The view also has ``close()`` and works as a context manager (``with torch_dataset(loader) as view``),
    inside which one loop thread serves every epoch, so the loader runs ahead between them.

    ::

        view = headrace.torch_dataset(loader)
        data = torch.utils.data.DataLoader(view, batch_size=None)   # num_workers=0, the default
        for epoch in range(90):
            for batch in data:                  # one epoch of the loader per pass
                train_step(batch["image"], batch["label"])
        view.close()

    Arguments:
        loader: the ``Loader``; the view drives it through ``loader.sync()`` (its event loop in a
            thread per epoch), so an epoch is the same batches as ``async for`` would give.
        keys: a name under which each item also carries the batch's sample keys (a list of str);
            the item is then a plain ``dict``. None (default): the item is the ``Batch`` itself,
            which a ``DataLoader`` with its default ``collate_fn`` turns into a plain ``dict`` of
            the same tensors (``sample_keys`` and the other attributes are lost on the way).

    ``len()`` is the loader's batches per epoch, and raises TypeError when the reader does not know
    its length (the ``DataLoader``'s ``len()`` then raises too). Each ``iter()`` is the next epoch; a
    pass left early (``break``, an exception, a trainer's step limit) stops that epoch's pipeline,
    and the next ``iter()`` starts the next epoch whole. Backpressure is the loader's: it holds at
    most ``prefetch + 2`` batches ahead of the consumer (``prefetch`` decoding, two done).

    Raises:
        ConfigError: when iterated in a ``DataLoader`` worker process (``num_workers > 0``), or
            pickled for one: headrace runs its own threads and event loop in this process. Use
            ``num_workers=0`` and the loader's ``num_threads`` for parallelism. When made: when
            ``loader`` is not a ``Loader`` (``loader.sync()`` included: pass the loader itself), or
            ``keys`` is neither None nor a str. At the first batch: when ``keys`` names one of the
            batch's fields (the sample keys would take that field's place).
    """
    from ._loader import Loader

    if not isinstance(loader, Loader):
        raise ConfigError(f"torch_dataset: loader must be a headrace Loader, got {type(loader).__name__}"
                          + (" (pass the loader, not loader.sync())" if hasattr(loader, "loader") else ""))
    if keys is not None and not isinstance(keys, str):
        raise ConfigError(f"torch_dataset: keys must be a str or None, got {keys!r}")
    return _view_class()(loader, keys=keys)
