"""The GPU executor: a prep thread, and lanes of (thread, CUDA stream, nvImageCodec decoder).

The prep thread reads a batch's headers and plans each sample's crop (the same geometry as the
CPU path, vectorised over the batch); other formats and the JPEGs nvImageCodec must not take
decode in Pillow threads meanwhile (``_prep.py``). A lane then decodes only the region each crop
reads of the JPEGs (nvImageCodec: hardware JPEG engine and CUDA decoder together, Pillow for what they fail on;
GIL-free through the C shim of ``_batch_decode`` when it builds), launches one fused kernel for the batch and records an
event; it never waits for the GPU. In the common case (every image to nvImageCodec, the CUDA driver
reachable) the shim does all of that in the one call that decodes, so the lane takes the GIL back
once a batch (``_launch.py``). Batch i goes to lane i mod lanes (or, with
``GpuTuning(dispatch="free")``, to the lane with the fewest batches queued), so the prep thread and
the lanes work on different batches at once, and each lane's batches stay in order on its stream.

Hand-off: the output is allocated by torch on the lane's stream; the consumer's current stream
waits on the lane's event and the tensor is recorded on that stream, so the caching allocator
reuses the memory only after the consumer's work on it. The event loop never blocks on the device.

Bounds (``Decode``): the prep thread refuses a file whose header claims more than ``max_pixels``
and an op output larger than that, before anything is allocated (``_prep.py``); a batch whose
decode windows need more than half of ``max_batch_bytes`` (a lane keeps two workspaces) is
decoded in parts, each resampled into its rows before the next part reuses the workspace.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from headrace._errors import HW_LOAD, ClosedError, ConfigError, require_hw_load, require_int, require_number
from headrace._sample import SampleBatch
from headrace._threads import join_threads

from .._geometry import check_foldable
from .._batch_stages import LaneStage
from .._limits import ByteBudget
from .._pipeline import Pipeline
from .._results import Processed
from .._stages import Filter
from . import _batch_decode as batch_decode
from ._codecs import NativeHeaders, PythonHeaders
from ._lane import Lane
from ._prep import PillowThreads, Prepared, prepare

__all__ = ["CudaExecutor", "GpuTuning", "cuda_available", "gpu_unsupported", "pick_lane"]


def gpu_unsupported(pipeline: Pipeline) -> str | None:
    """Why the GPU path cannot run ``pipeline`` (None when it can)."""
    late_filters = [stage for stage in pipeline.after if isinstance(stage, Filter)]
    if late_filters:
        return (f"{late_filters[0]!r} stands after decode: on the GPU path a row is CUDA tensors, and reading a "
                "keep-or-drop answer from them on the host would make it wait for the GPU row by row; put the Filter "
                "before Decode (on the encoded fields: nothing is decoded for a sample it drops), or use device='cpu'")
    late_async = [stage for stage in pipeline.after if stage.is_async]
    if late_async:
        return (f"{late_async[0]!r} is an async def after decode: on the GPU path torch's current stream is per "
                "thread, so a stage awaited on the event loop would put the loop's other CUDA work on its stream; "
                "make it a plain function (it runs in a thread, on a stream of its own)")
    try:
        check_foldable(pipeline.image_ops)
    except ConfigError as exc:
        return exc.message
    return None


def pick_lane(lanes: list[Lane], index: int, dispatch: str) -> Lane:
    """The lane batch ``index`` goes to. ``"free"``: the one with the fewest batches queued or
    decoding; among equals, the batch's turn (lane ``index mod lanes``). A lane held up by a slow batch
    (large images, the engine's share late) is passed over rather than waited for: in the decode
    floor on the H100 this took 4 lanes from 28.2k to 28.8k images/s and 3 lanes from 26.4k to
    28.4k, though the training pipeline showed no difference through its noise (docs/benchmarks.md,
    issue 22). ``"turn"``: always the batch's turn."""
    n = len(lanes)
    if dispatch == "turn":
        return lanes[index % n]
    return min(lanes, key=lambda lane: (len(lane.queued), (lane.index - index) % n))


def cuda_available() -> bool:
    """True when torch sees a GPU and CuPy and nvImageCodec import."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # noqa: F401
        from nvidia import nvimgcodec  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class GpuTuning:
    """How the GPU path drives nvImageCodec: expert knobs, and the ways the benchmarks measure
    against each other. The defaults are what was fastest on the H100.

    ``cuda_load``: the share of what reaches the CUDA decoder that its hybrid backend (Huffman on
    the host) takes; the rest goes to its GPU backend. Two ways to move JPEG Huffman decoding off
    the host threads onto the GPU (nvJPEG's GPU-hybrid backend), spending GPU time for host cores:
    ``gpu_huffman_above``, the CUDA decoder does it on the GPU for every image whose decoded window
    has more pixels than this (``None``: nvImageCodec's own threshold, 1,000,000 pixels, above any
    ImageNet-sized image); ``gpu_huffman_load``, a share of each batch (the windows next in size
    after the hardware engine's) goes to a second CUDA decoder that does it for all its images (0:
    none; the shim's alone, ``decode="python"`` has one decoder), with ``gpu_huffman_threads`` host
    threads (``None``: as many as the lane's decoder; they mostly wait, as each keeps one image on
    the GPU at a time). On the H200, ``gpu_huffman_above=25_000`` trained at about the default's rate with 5-18%
    fewer host cores an image, but validation (whole images) lost 1-13%; ``gpu_huffman_load=0.2``
    trained at 0.97-1.04 of the default's rate with 13-18% fewer host cores an image, validation
    lost 8-11%, and 8 GPU-Huffman threads were slower than the lane's 4: the GPU's Huffman decode
    keeps up with part of a batch, not all of it (docs/benchmarks.md, issue 22). ``nvimgcodec_options``: options for
    nvImageCodec's decoders, as its documentation spells them (for example
    ``"nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"``). ``decode``: ``"shim"`` (one GIL-free call
    a batch through nvImageCodec's C API) or ``"python"`` (its Python API, the fallback where the
    shim cannot be built). ``launch``: ``"shim"`` (the shim also launches the fused kernel) or
    ``"python"`` (launched from Python after the decode). ``dispatch``: ``"turn"`` (batch i to lane
    i mod lanes) or ``"free"`` (to the lane with the fewest batches queued: +2-8% in the decode
    floor on the H100, no difference the training pipeline's noise let us see; docs/benchmarks.md).
    ``cut_frames``: the hardware engine's share of a batch decodes from copies of its JPEGs whose
    frame height ends one MCU row below the window (the shim only): the engines decode every row of
    an image whatever its window, so they then stop where the window does. Same pixels; on the
    H200 the engines alone decoded training windows 10-13% faster (docs/benchmarks.md, issue 22).
    """

    cuda_load: float = 1.0
    gpu_huffman_above: int | None = None
    gpu_huffman_load: float = 0.0
    gpu_huffman_threads: int | None = None
    nvimgcodec_options: str = ""
    decode: Literal["shim", "python"] = "shim"
    launch: Literal["shim", "python"] = "shim"
    dispatch: Literal["turn", "free"] = "turn"
    cut_frames: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "cuda_load", require_number("cuda_load", self.cuda_load, 0.0, 1.0, wanted="in [0, 1]"))
        object.__setattr__(self, "gpu_huffman_load",
                           require_number("gpu_huffman_load", self.gpu_huffman_load, 0.0, 1.0, wanted="in [0, 1]"))
        if self.gpu_huffman_threads is not None:
            object.__setattr__(self, "gpu_huffman_threads", require_int("gpu_huffman_threads", self.gpu_huffman_threads))
        if self.gpu_huffman_above is not None:
            object.__setattr__(self, "gpu_huffman_above", require_int("gpu_huffman_above", self.gpu_huffman_above, 0))
        if not isinstance(self.nvimgcodec_options, str):
            raise ConfigError(f"nvimgcodec_options must be a str, got {self.nvimgcodec_options!r}")
        for name in ("decode", "launch"):
            if getattr(self, name) not in ("shim", "python"):
                raise ConfigError(f"{name} must be 'shim' or 'python', got {getattr(self, name)!r}")
        if self.dispatch not in ("free", "turn"):
            raise ConfigError(f"dispatch must be 'free' or 'turn', got {self.dispatch!r}")
        if not isinstance(self.cut_frames, bool):
            raise ConfigError(f"cut_frames must be a bool, got {self.cut_frames!r}")

    def decoder_options(self) -> str:
        """The options string for nvImageCodec's decoders: ``gpu_huffman_above`` as its option,
        then ``nvimgcodec_options`` (nvImageCodec reads them in order, so the user's win)."""
        ours = "" if self.gpu_huffman_above is None else f"nvjpeg_cuda_decoder:hybrid_huffman_threshold={self.gpu_huffman_above}"
        return " ".join(part for part in (ours, self.nvimgcodec_options) if part)


class CudaExecutor:
    """Runs a pipeline on one GPU with ``lanes`` lanes. Lives across epochs; ``aclose`` ends it.

    ``hw_load`` is the share of each batch given to the hardware JPEG decoder (baseline JPEGs,
    the largest windows first, until it has that share of the bytes the batch's windows need read;
    the rest, and what it fails, go to the CUDA decoder, then Pillow), or ``"adaptive"``: the share
    moves batch by batch to keep both busy. A share of bytes, not of images: both decoders are
    bound by the bytes they read, and validation's largest windows are its largest images (0.76 of
    the bytes is what 0.65 of the images, DALI's default, gives training's random crops). ``decoder_threads`` are the host threads of
    each lane's decoder (default: the cores shared among the lanes: on the H100, 4 lanes of 4
    threads decoded more than 2 lanes of 16, each lane's batch a unit that waits for its slower
    part, so more lanes keep the engines and the threads busier; docs/benchmarks.md, issue 22).

    ``run`` may be awaited for several batches at once. Cancelling it cancels its thread jobs that
    have not started (their parsed headers go back to the reader); one already running finishes
    and its output is dropped. ``drain`` waits for those, after which the executor takes new
    batches; ``aclose`` drains, then frees decoders, streams, workspaces and threads.

    ``stages`` are ``MapBatch`` stages each lane runs on its batch right after the kernel, in its
    thread with its stream current (``_batch_stages``); ``Processed.ready`` then follows them.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        device: int | str | torch.device = 0,
        lanes: int = 4,
        seed: int = 0,
        hw_load: float | str = HW_LOAD,
        decoder_threads: int | None = None,
        tuning: GpuTuning | None = None,
        stages: tuple[LaneStage, ...] = (),
    ) -> None:
        if not cuda_available():
            raise ConfigError("device='cuda' needs a GPU, CuPy and nvImageCodec (pip install 'headrace[cuda13]')")
        reason = gpu_unsupported(pipeline)
        if reason is not None:
            raise ConfigError(reason)
        hw_load = require_hw_load(hw_load)  # a share, NumPy's too; not True (1)
        if tuning is not None and not isinstance(tuning, GpuTuning):
            raise ConfigError(f"tuning must be a headrace.ops.GpuTuning, got {type(tuning).__name__}")
        self.tuning = tuning = tuning or GpuTuning()
        self.pipeline = pipeline
        self.stages = stages
        self.seed = seed
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        threads = decoder_threads or max(1, (os.cpu_count() or 2) // lanes)  # the cores, shared by the lanes
        # The C shim when it builds (GIL-free decode), else nvImageCodec's Python API.
        self.native = tuning.decode == "shim" and batch_decode.load() is not None
        exif = pipeline.decode.exif
        self._headers = NativeHeaders(exif=exif) if self.native else PythonHeaders(exif=exif)
        self._prep = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="headrace-prep")
        # Formats other than JPEG, and JPEGs nvImageCodec must not take, decode in Pillow here
        # (``_prep.py``); its threads start on first use.
        self._pillow = PillowThreads(
            concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="headrace-pillow"),
            ByteBudget(pipeline.decode.max_batch_bytes),
        )
        # Thread jobs submitted by run() and not finished (prep and lanes): what drain() cancels or awaits.
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._prep_seconds: collections.Counter[str] = collections.Counter()
        self._lanes = [Lane(self, i, hw_load, threads) for i in range(lanes)]
        self._closed = False

    def timings(self) -> dict[str, float]:
        """Seconds spent per phase (prep thread, and lanes summed): where a batch's host time goes."""
        total: collections.Counter[str] = collections.Counter(self._prep_seconds)
        for lane in self._lanes:
            total.update(lane.seconds)
            total.update({f"shim.{name}": value for name, value in lane.decoder.seconds.items()})
        return dict(total)

    async def run(self, batch: SampleBatch) -> Processed:
        """Decode and transform ``batch`` on the GPU; per-sample failures come back in
        ``Processed.failures`` (LoaderError subclasses naming the sample). Raises ClosedError after
        ``aclose()``."""
        if self._closed:
            raise ClosedError("CudaExecutor.run after aclose()")
        # Headers and plans in the prep thread, decode and kernel in a lane: the next batch is
        # parsed while lanes decode, and nothing per image waits for the GIL inside a lane.
        job = self._submit(self._prep, prepare, batch, self.pipeline, self._headers, self.seed, self._prep_seconds,
                           self._pillow)
        try:
            prepared = await asyncio.wrap_future(job)
        except asyncio.CancelledError:
            job.add_done_callback(_release_result)  # still running: its headers go back when it ends
            raise
        lane = pick_lane(self._lanes, batch.index, self.tuning.dispatch)
        future = self._submit(lane.pool, lane.finish, prepared)
        lane.queued.add(future)
        future.add_done_callback(lane.queued.discard)
        # Cancelled before it started (by run's cancellation or drain()): its parsed headers go back unused.
        future.add_done_callback(functools.partial(_release_if_cancelled, prepared))
        try:
            return await asyncio.wrap_future(future)
        except BaseException:
            # A cancelled run's batch may still finish in its lane: its output (device memory) must
            # not live on through this frame, which the CancelledError's traceback keeps.
            del future, prepared
            raise

    def _submit(self, pool: concurrent.futures.ThreadPoolExecutor, fn, *args) -> concurrent.futures.Future[Any]:
        job = pool.submit(fn, *args)
        self._pending.add(job)
        job.add_done_callback(self._pending.discard)
        return job

    async def drain(self) -> None:
        """Cancel the thread jobs ``run`` submitted that have not started, wait for the running
        ones, then let each lane's stream finish and drop what it kept for batches in flight.
        Safe when idle; when cancelled, it still waits for the running jobs, then re-raises.
        The executor takes new batches afterwards (unless closed)."""
        while self._pending:
            jobs = list(self._pending)
            for job in jobs:
                job.cancel()
            await join_threads(jobs)
        if not self._closed:
            await join_threads([lane.pool.submit(lane.settle) for lane in self._lanes])

    async def aclose(self) -> None:
        """Drain, then free decoders, streams, workspaces and threads. Final (``run`` raises
        ClosedError afterwards); safe twice; when cancelled it still finishes, then re-raises."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.drain()
        finally:
            await join_threads([lane.pool.submit(lane.close) for lane in self._lanes])
            self._prep.shutdown(wait=True)
            self._pillow.pool.shutdown(wait=True)
            self._headers.close()
            for lane in self._lanes:
                lane.pool.shutdown(wait=True)


def _release_if_cancelled(prepared: Prepared, job: concurrent.futures.Future[Any]) -> None:
    if job.cancelled():
        prepared.release()


def _release_result(job: concurrent.futures.Future[Any]) -> None:
    """Give back the headers of a prep job whose ``run`` was cancelled while it ran."""
    if not job.cancelled() and job.exception() is None:
        job.result().release()
