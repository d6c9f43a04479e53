"""The Preprocessor's batches once gathered: the executor, then the finishing thread, then each
caller's row or its own error."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._errors import ClosedError, LoaderError, TransformError
from ._sample import Sample, SampleBatch, hand_off
from ._threads import join_threads

if TYPE_CHECKING:
    from headrace.ops._executors import Executor

    from ._request_batcher import Request, RequestBatcher

__all__ = ["BatchProcessor"]


class BatchProcessor:
    """Runs a batch of ``requests`` through ``executor`` (set by ``start``) and answers each request.

    With ``postprocess`` or ``wait_ready``, a thread of its own finishes each batch: its current
    stream waits for the lane, then ``postprocess(images)`` runs and, for ``wait_ready``, the thread
    waits for the device. Without them the images are handed to the event loop thread's stream.
    """

    def __init__(self, requests: RequestBatcher, *, postprocess: Callable[[Any], Any] | None, wait_ready: bool) -> None:
        self._requests = requests
        self.postprocess = postprocess
        self.wait_ready = wait_ready
        self.executor: Executor | None = None
        self._finisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._finishing: set[concurrent.futures.Future[Any]] = set()

    def start(self, executor: Executor) -> None:
        self.executor = executor
        if self.postprocess is not None or self.wait_ready:
            self._finisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="headrace-serve")

    async def process(self, reqs: list[Request], index: int) -> None:
        answer = self._requests.answer
        try:
            batch = SampleBatch([r.sample for r in reqs], epoch=0, index=index)
            try:
                processed = await self.executor.run(batch)
                # Every request failed (an unreadable image, a stage that raised): no images to finish.
                outputs = await self._finish(processed) if processed.kept else []
            except asyncio.CancelledError:
                for r in reqs:
                    answer(r, error=ClosedError("the service closed while the request was processed",
                                                key=r.sample.key, source="request"))
                raise
            except Exception as exc:  # noqa: BLE001 - the whole batch failed: each caller gets its own typed copy
                for r in reqs:
                    answer(r, error=_for_request(exc, r.sample))
                return
            failures = dict(processed.failures)
            row_of = {row: j for j, row in enumerate(processed.kept)}
            for row, r in enumerate(reqs):  # ``_finish`` checked a row per kept request: indexing cannot fail
                if row in row_of:
                    answer(r, result=outputs[row_of[row]])
                else:
                    answer(r, error=failures.get(row) or TransformError(
                        "the executor returned no output for this request", key=r.sample.key, source="request"))
        finally:
            self._requests.batch_done(reqs)

    async def _finish(self, processed: Any) -> Any:
        images = processed.data.get("image")
        if images is None:  # a MapBatch returned a dict without it: every request fails, saying why
            raise TransformError(f"the pipeline's batch has no 'image' to answer with (it has "
                                 f"{', '.join(map(repr, processed.data)) or 'nothing'}); a MapBatch must keep it",
                                 stage="postprocess")
        if len(images) != len(processed.kept):  # a MapBatch changed the rows: no row is known to be whose
            raise TransformError(f"the pipeline's batch has {len(images)} image rows for {len(processed.kept)} "
                                 "requests; a MapBatch must keep a row per request", stage="postprocess")
        ready = processed.ready
        if self._finisher is None:
            hand_off([images], ready)  # the loop thread's current stream: the callers'
            return images
        fut = self._finisher.submit(self._finish_in_thread, images, ready)
        self._finishing.add(fut)
        fut.add_done_callback(self._finishing.discard)
        return await asyncio.wrap_future(fut)

    def _finish_in_thread(self, images: Any, ready: Any) -> Any:
        hand_off([images], ready)  # this thread's current stream waits for the lane
        outputs = images
        if self.postprocess is not None:
            try:
                outputs = self.postprocess(images)
            except Exception as exc:
                raise TransformError(f"postprocess failed: {type(exc).__name__}: {exc}", stage="postprocess") from exc
            _check_rows(outputs, len(images))
        if self.wait_ready and ready is not None:
            import torch

            first = images[0] if isinstance(images, list) and images else images  # a list: sizes differ
            if isinstance(first, torch.Tensor):
                torch.cuda.current_stream(first.device).synchronize()
        return outputs

    async def release(self) -> None:
        """Join the finisher thread, then close the executor. Idempotent; runs to the end if cancelled."""
        try:
            if self._finisher is not None:
                await join_threads(list(self._finishing))
                self._finisher.shutdown(wait=True)
        finally:
            if self.executor is not None:
                await self.executor.aclose()


def _for_request(exc: Exception, sample: Sample) -> LoaderError:
    """A batch-wide failure as this request's own error: same type and stage, the request's key."""
    if isinstance(exc, LoaderError):
        err = type(exc)(exc.message, key=sample.key, source=sample.source, stage=exc.stage)
    else:
        err = TransformError(f"{type(exc).__name__}: {exc}", key=sample.key, source=sample.source)
    err.__cause__ = exc
    return err


def _check_rows(outputs: Any, rows: int) -> None:
    """``postprocess``'s result must be rows, one a request: a tensor or an array whose first
    dimension is the batch, or a list of that length. A tuple or a dict has a length too, which
    matched a batch of that size by chance: ``(logits, features)`` for two requests gave each
    caller the other's rows."""
    import numpy as np
    import torch

    if isinstance(outputs, (torch.Tensor, np.ndarray)):
        count = outputs.shape[0] if outputs.ndim else None
    elif isinstance(outputs, list):
        count = len(outputs)
    else:
        raise TransformError(f"postprocess must return a tensor, an array or a list with a row per image, got "
                             f"{type(outputs).__name__}", stage="postprocess")
    if count != rows:
        raise TransformError(f"postprocess returned {count} rows for {rows} images", stage="postprocess")
