"""Which device a loader or service runs on: the one rule both use."""

from __future__ import annotations

from typing import Any

from ._errors import ConfigError

__all__ = ["resolve_device"]


def resolve_device(pipeline: Any, device: Any, *, local_rank: int | None = None) -> str:
    """``"cpu"``, ``"cuda"`` or ``"cuda:N"`` for ``device`` (``"auto"``: the GPU when CUDA, CuPy and
    nvImageCodec are there and the GPU path can run ``pipeline``, else the CPU).

    With a ``local_rank`` (one process per GPU, as torchrun starts them), ``"auto"`` and ``"cuda"``
    become ``"cuda:<local_rank>"`` (modulo the GPUs this process sees, so a launcher that shows
    each process only its own GPU gets ``"cuda:0"``); an explicit ``"cuda:N"`` is kept.

    Raises ConfigError for an unknown device, a GPU that is not there, or a pipeline the GPU path
    cannot run when the GPU was asked for (now, not at the first batch).
    """
    from headrace.ops import cuda_available, gpu_unsupported

    why_not_gpu = gpu_unsupported(pipeline)
    # A pipeline without images (video clips, arrays) needs only torch's GPU, not CuPy and nvImageCodec.
    gpu_ready = cuda_available() if getattr(pipeline, "has_image", True) else _torch_cuda()
    if device == "auto":
        device = "cuda" if gpu_ready and why_not_gpu is None else "cpu"
    if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device.startswith("cuda"):
        if not gpu_ready:
            raise ConfigError(f"device={device!r} needs a GPU, CuPy and nvImageCodec (pip install 'headrace[cuda13]')")
        if why_not_gpu:
            raise ConfigError(why_not_gpu)
        if device == "cuda" and local_rank is not None:
            import torch

            device = f"cuda:{local_rank % max(1, torch.cuda.device_count())}"
    return device


def _torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
