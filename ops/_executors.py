"""The one place an executor is chosen for a pipeline and a device."""

from __future__ import annotations

from typing import Any

from ._pipeline import Pipeline

__all__ = ["open_executor"]


def open_executor(pipeline: Pipeline, device: str, *, num_threads: int, seed: int, lanes: int = 2,
                  hw_load: float | str = 0.65, name: str = "headrace-cpu", decoder_threads: int | None = None) -> Any:
    """An executor running ``pipeline`` on ``device`` (``"cpu"`` or ``"cuda[:N]"``).

    The CPU executor (``num_threads`` threads) or the GPU one (``lanes`` lanes) for the images;
    wrapped in a ``StagedExecutor`` (``num_threads`` threads of its own) when the pipeline has user
    stages, ``fields`` or no image. Making the GPU executor blocks once (decoders, streams, kernels).
    """
    from ._cpu import CpuExecutor
    from ._cuda import CudaExecutor
    from ._staged import StagedExecutor

    inner: Any = None
    if pipeline.has_image:
        core = pipeline.core() if pipeline.needs_staging else pipeline
        if device == "cpu":
            inner = CpuExecutor(core, num_threads=num_threads, seed=seed, name=name)
        else:
            threads = {} if decoder_threads is None else {"decoder_threads": decoder_threads}
            inner = CudaExecutor(core, device=device, lanes=lanes, seed=seed, hw_load=hw_load, **threads)
    if not pipeline.needs_staging:
        return inner
    return StagedExecutor(pipeline, inner, num_threads=num_threads, seed=seed, device=device)
