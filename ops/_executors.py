"""The one place an executor is chosen for a pipeline and a device."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from headrace._errors import HW_LOAD

from ._pipeline import Pipeline

if TYPE_CHECKING:
    from headrace._sample import SampleBatch

    from ._results import Processed

__all__ = ["Executor", "open_executor"]


class Executor(Protocol):
    """What the loader and the service ask of an executor (``CpuExecutor``, ``CudaExecutor``,
    ``StagedExecutor``): it lives as long as its owner, across epochs.

    ``run`` turns one batch of samples into tensors, per-sample failures in ``Processed.failures``
    (several ``run`` calls may be awaited at once); ``drain`` cancels work not started and waits for
    the rest (between epochs, after one was left early); ``aclose`` is final and frees threads,
    decoders and device memory.
    """

    async def run(self, batch: SampleBatch) -> Processed: ...

    async def drain(self) -> None: ...

    async def aclose(self) -> None: ...


def open_executor(pipeline: Pipeline, device: str, *, num_threads: int, seed: int, lanes: int = 4,
                  hw_load: float | str = HW_LOAD, name: str = "headrace-cpu", decoder_threads: int | None = None,
                  tuning: Any = None) -> Executor:
    """An executor running ``pipeline`` on ``device`` (``"cpu"`` or ``"cuda[:N]"``).

    The CPU executor (``num_threads`` threads) or the GPU one (``lanes`` lanes) for the images;
    wrapped in a ``StagedExecutor`` (``num_threads`` threads of its own) when the pipeline has user
    stages (other than the ``MapBatch`` stages the GPU lanes run themselves), ``fields`` or no
    image. Making the GPU executor blocks once (decoders, streams, kernels); ``tuning`` (an
    ``ops.GpuTuning``) goes to it.
    """
    from .cpu._executor import CpuExecutor
    from .cuda._executor import CudaExecutor
    from ._batch_stages import LaneStage, lane_stages
    from ._staged import StagedExecutor

    inner: Any = None
    on_lanes: tuple[LaneStage, ...] = ()
    if pipeline.has_image:
        core = pipeline.core() if pipeline.needs_staging else pipeline
        if device == "cpu":
            inner = CpuExecutor(core, num_threads=num_threads, seed=seed, name=name)
        else:
            # The MapBatch stages a lane can run go to the lanes: no thread hop, no second stream.
            on_lanes = lane_stages(pipeline)
            threads = {} if decoder_threads is None else {"decoder_threads": decoder_threads}
            inner = CudaExecutor(core, device=device, lanes=lanes, seed=seed, hw_load=hw_load, tuning=tuning,
                                 stages=on_lanes, **threads)
    # Lanes take stages only from a pipeline without fields: when they take all its stages, no
    # StagedExecutor is left with anything to do.
    if not pipeline.needs_staging or (on_lanes and len(on_lanes) == len(pipeline.stages)):
        return inner
    return StagedExecutor(pipeline, inner, num_threads=num_threads, seed=seed, device=device, on_lanes=len(on_lanes))
