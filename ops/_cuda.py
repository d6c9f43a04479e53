"""The GPU executor: a prep thread, and lanes of (thread, CUDA stream, nvImageCodec decoder).

The prep thread reads a batch's headers and plans each sample's crop (the same geometry as the
CPU path, vectorised over the batch); other formats and the JPEGs nvImageCodec must not take
decode in Pillow threads meanwhile (``_cuda_prep``). A lane then decodes only the region each crop
reads of the JPEGs (nvImageCodec: hardware JPEG engine and CUDA decoder together, Pillow for what they fail on;
GIL-free through the C shim of ``_batch_decode`` when it builds), launches one fused kernel for the batch and records an
event; it never waits for the GPU. In the common case (every image to nvImageCodec, the CUDA driver
reachable) the shim does all of that in the one call that decodes, so the lane takes the GIL back
once a batch (``_cuda_launch``). Batch i goes to lane i mod lanes, so the prep thread and the
lanes work on different batches at once, and each lane's batches stay in order on its stream.

Hand-off: the output is allocated by torch on the lane's stream; the consumer's current stream
waits on the lane's event and the tensor is recorded on that stream, so the caching allocator
reuses the memory only after the consumer's work on it. The event loop never blocks on the device.

Bounds (``Decode``): the prep thread refuses a file whose header claims more than ``max_pixels``
and an op output larger than that, before anything is allocated (``_cuda_prep``); a batch whose
decode windows need more than half of ``max_batch_bytes`` (a lane keeps two workspaces) is
decoded in parts, each resampled into its rows before the next part reuses the workspace.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from headrace._errors import ClosedError, ConfigError, LoaderError
from headrace._sample import SampleBatch
from headrace._threads import join_threads

from . import _batch_decode as batch_decode
from . import _pillow
from ._cpu import Processed, _image_field, field_columns
from ._cuda_codecs import NativeDecoder, NativeHeaders, PythonDecoder, PythonHeaders
from ._cuda_kernels import BLOCK, grid, resample_kernel
from ._cuda_launch import FusedLaunch, Staging
from ._cuda_prep import PillowThreads, Prepared, lane_budget, prepare
from ._geometry import check_foldable
from ._limits import ByteBudget
from ._pipeline import Pipeline

__all__ = ["CudaExecutor", "GpuTuning", "cuda_available", "gpu_unsupported"]

_OUT_NAMES = {torch.uint8: "uint8", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def gpu_unsupported(pipeline: Pipeline) -> str | None:
    """Why the GPU path cannot run ``pipeline`` (None when it can)."""
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
    the host) takes; the rest goes to its GPU backend. ``nvimgcodec_options``: options for
    nvImageCodec's decoders, as its documentation spells them (for example
    ``"nvjpeg_cuda_decoder:hybrid_huffman_threshold=0"``). ``decode``: ``"shim"`` (one GIL-free call
    a batch through nvImageCodec's C API) or ``"python"`` (its Python API, the fallback where the
    shim cannot be built). ``launch``: ``"shim"`` (the shim also launches the fused kernel) or
    ``"python"`` (launched from Python after the decode).
    """

    cuda_load: float = 1.0
    nvimgcodec_options: str = ""
    decode: Literal["shim", "python"] = "shim"
    launch: Literal["shim", "python"] = "shim"

    def __post_init__(self) -> None:
        if not isinstance(self.cuda_load, (int, float)) or not 0.0 <= self.cuda_load <= 1.0:
            raise ConfigError(f"cuda_load must be in [0, 1], got {self.cuda_load!r}")
        if not isinstance(self.nvimgcodec_options, str):
            raise ConfigError(f"nvimgcodec_options must be a str, got {self.nvimgcodec_options!r}")
        for name in ("decode", "launch"):
            if getattr(self, name) not in ("shim", "python"):
                raise ConfigError(f"{name} must be 'shim' or 'python', got {getattr(self, name)!r}")


class CudaExecutor:
    """Runs a pipeline on one GPU with ``lanes`` lanes. Lives across epochs; ``aclose`` ends it.

    ``hw_load`` is the share of each batch given to the hardware JPEG decoder (baseline JPEGs,
    the largest first; the rest, and what it fails, go to the CUDA decoder, then Pillow), or
    ``"adaptive"``: the share moves batch by batch to keep both busy. ``decoder_threads`` are the host threads of
    each lane's decoder (default: the cores; sharing them among the lanes was slower on the H100,
    ops/README.md).

    ``run`` may be awaited for several batches at once. Cancelling it cancels its thread jobs that
    have not started (their parsed headers go back to the reader); one already running finishes
    and its output is dropped. ``drain`` waits for those, after which the executor takes new
    batches; ``aclose`` drains, then frees decoders, streams, workspaces and threads.
    """

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        device: int | str | torch.device = 0,
        lanes: int = 2,
        seed: int = 0,
        hw_load: float | str = 0.65,
        decoder_threads: int | None = None,
        tuning: GpuTuning | None = None,
    ) -> None:
        if not cuda_available():
            raise ConfigError("device='cuda' needs a GPU, CuPy and nvImageCodec (pip install 'headrace[cuda13]')")
        reason = gpu_unsupported(pipeline)
        if reason is not None:
            raise ConfigError(reason)
        if hw_load != "adaptive" and not (isinstance(hw_load, (int, float)) and 0.0 <= hw_load <= 1.0):
            raise ConfigError(f"hw_load must be in [0, 1] or 'adaptive', got {hw_load!r}")
        if tuning is not None and not isinstance(tuning, GpuTuning):
            raise ConfigError(f"tuning must be a headrace.ops.GpuTuning, got {type(tuning).__name__}")
        self.tuning = tuning = tuning or GpuTuning()
        self.pipeline = pipeline
        self.seed = seed
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        threads = decoder_threads or (os.cpu_count() or 2)
        # The C shim when it builds (GIL-free decode), else nvImageCodec's Python API.
        self.native = tuning.decode == "shim" and batch_decode.load() is not None
        exif = pipeline.decode.exif
        self._headers = NativeHeaders(exif=exif) if self.native else PythonHeaders(exif=exif)
        self._prep = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="headrace-prep")
        # Formats other than JPEG, and JPEGs nvImageCodec must not take, decode in Pillow here
        # (``_cuda_prep``); its threads start on first use.
        self._pillow = PillowThreads(
            concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="headrace-pillow"),
            ByteBudget(pipeline.decode.max_batch_bytes),
        )
        # Thread jobs submitted by run() and not finished (prep and lanes): what drain() cancels or awaits.
        self._pending: set[concurrent.futures.Future[Any]] = set()
        self._prep_seconds: collections.Counter[str] = collections.Counter()
        self._lanes = [_Lane(self, i, hw_load, threads) for i in range(lanes)]
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
        lane = self._lanes[batch.index % len(self._lanes)]
        future = self._submit(lane.pool, lane.finish, prepared)
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


class _Lane:
    def __init__(self, owner: CudaExecutor, index: int, hw_load: float | str, threads: int) -> None:
        self.owner = owner
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"headrace-lane{index}")
        self.pool.submit(self._init, hw_load, threads).result()

    def _init(self, hw_load: float | str, threads: int) -> None:
        import cupy

        dev = self.owner.device
        torch.cuda.set_device(dev)
        cupy.cuda.Device(dev.index).use()
        self.cp_stream = cupy.cuda.Stream(non_blocking=True)
        self.stream = torch.cuda.ExternalStream(self.cp_stream.ptr, device=dev)
        pipe = self.owner.pipeline
        if self.owner.native:
            tuning = self.owner.tuning
            self.decoder = NativeDecoder(dev, threads=threads, hw_load=hw_load, channels=pipe.channels,
                                         exif=pipe.decode.exif, budget=lane_budget(pipe.decode.max_batch_bytes),
                                         cuda_load=tuning.cuda_load, options=tuning.nvimgcodec_options)
        else:
            self.decoder = PythonDecoder(dev, threads=threads, channels=pipe.channels, exif=pipe.decode.exif)
        # With post ops the fused kernel writes uint8 HWC; PostOps runs them, then normalises and
        # lays out the batch, all on this lane's stream.
        self.post = None
        if pipe.post_ops:
            from ._cuda_post import PostOps

            self.post = PostOps(pipe, self.cp_stream, seed=self.owner.seed, device=dev)
        self.kernel = resample_kernel("uint8" if self.post is not None else _OUT_NAMES[pipe.dtype])
        # What the kernel writes: the pipeline's layout and normalization, or uint8 HWC for PostOps.
        self.chw = pipe.layout == "CHW" and self.post is None
        self.normalize = pipe.normalize is not None and self.post is None
        norm = pipe.normalize
        c = pipe.channels
        mean = np.array(norm.mean if norm else (0.0,) * c, dtype=np.float32) * 255.0
        inv = 1.0 / (np.array(norm.std if norm else (1.0,) * c, dtype=np.float32) * 255.0)
        with self.cp_stream:
            self.mean = cupy.asarray(np.resize(mean, c))
            self.inv_std = cupy.asarray(np.resize(inv, c))
        self.staging = [Staging(cupy, self.cp_stream) for _ in range(4)]
        self.turn = 0
        # (event after the batch's kernel, its decoded pixels): pixels stay alive, and their memory
        # unused, until two batches later, after a host wait on that event (docs/gpu-notes.md §3: nvJPEG's
        # hardware decoder was seen writing before earlier work on its stream had finished).
        self.recent: collections.deque[tuple[Any, Any]] = collections.deque(maxlen=2)
        self.part_done = torch.cuda.Event()  # a part's kernel has read its windows (``_in_parts``)
        self.seconds: collections.Counter[str] = collections.Counter()
        # The shim waits, decodes, copies, launches and records in one GIL-free call when it can.
        self.fused = None
        # Without a fixed output size each image gets its own size and place in one allocation
        # (``_views``); that launch goes from Python.
        self.ragged = pipe.output_size() is None
        if not self.ragged and self.decoder.launch_unavailable is None and self.owner.tuning.launch == "shim":
            self.fused = FusedLaunch(self.kernel, size=pipe.output_size(), channels=c, chw=self.chw,
                                     normalize=self.normalize, mean=self.mean, inv_std=self.inv_std)

    def settle(self) -> None:
        """After a drain: the stream's work done, nothing kept for batches in flight."""
        self.cp_stream.synchronize()
        self.recent.clear()

    def close(self) -> None:
        # The stream must outlive every image decoded on it and the decoder (docs/gpu-notes.md §6).
        self.cp_stream.synchronize()
        self.recent.clear()
        self.decoder.close()
        self.staging = []
        self.post = self.fused = None

    def finish(self, prep: Prepared) -> Processed:
        """Decode the prepared batch's windows and launch the fused kernel (in the lane's thread)."""
        try:
            with torch.cuda.stream(self.stream):
                return self._finish(prep)
        finally:
            prep.release()

    def _finish(self, prep: Prepared) -> Processed:
        lap = _Laps(self.seconds)
        stage = self.staging[self.turn % len(self.staging)]
        self.turn += 1
        if prep.parts is not None:
            return self._done(prep, self._in_parts(prep, stage, lap), stage, None)
        wait = self.recent[0][0] if len(self.recent) == self.recent.maxlen else None
        decoded = None
        if self.fused is not None and len(prep.rows) and prep.on_gpu.all():
            result, decoded = self._decode_and_launch(prep, stage, wait, lap)
            prep.release()
            if result is not None:
                return self._done(prep, result, stage, decoded)
            # An image failed: nothing was launched; the batch goes on as any other.
        else:
            if wait is not None:
                wait.synchronize()
            lap("wait")
            on_gpu = prep.on_gpu
            if on_gpu.any():
                decoded = self.decoder.decode(prep.token, prep.parse_idx[on_gpu], prep.regions[on_gpu], self.cp_stream.ptr)
            prep.release()
            lap("decode")
        result, uploads = self._finish_decoded(prep, stage, decoded, lap)
        return self._done(prep, result, stage, (decoded, uploads))

    def _decode_and_launch(self, prep: Prepared, stage: Staging, wait, lap) -> tuple[Processed | None, Any]:
        """The common case (every sample went to nvImageCodec): buffers and outputs are chosen
        first, then one shim call waits, decodes, fills the kernel's tables from the prep thread's
        arrays, copies them, launches and records. Returns (None, decoded) when an image failed:
        nothing was launched, and the lane goes on as for any batch (``_finish_decoded``)."""
        n = len(prep.rows)
        pointers, row_strides, workspace = self.decoder.buffers(prep.regions, lambda: wait and wait.synchronize())
        out = torch.empty(self._out_shape(n), dtype=self._out_dtype(), device=self.owner.device)
        labels = torch.empty(n, dtype=torch.int64, device=self.owner.device) if prep.label_array is not None else None
        lap("alloc")
        launch = self.fused.prepare(stage, out, prep.meta, prep.geo, prep.label_array, labels, wait,
                                    record=self.post is None)
        lap("tables")
        decoded = self.decoder.decode(prep.token, prep.parse_idx, prep.regions, self.cp_stream.ptr,
                                      buffers=(pointers, row_strides, workspace), launch=launch)
        lap("decode")
        if not decoded.launched:
            return None, decoded
        ok = np.arange(n)
        if self.post is not None:
            out = self._post(out, prep, ok)
            stage.ready.record(self.stream)
        data: dict[str, Any] = {"image": out}
        if labels is not None:
            data["label"] = labels
        lap("event")
        return Processed(data, list(prep.rows), sorted(prep.failures, key=lambda f: f[0])), decoded

    def _finish_decoded(self, prep: Prepared, stage: Staging, decoded, lap) -> tuple[Processed, list]:
        """After the decode: Pillow for what nvImageCodec did not decode (its pixels uploaded, returned
        to be kept alive), then the kernel from Python."""
        pointers, row_strides, done, uploads = self._pixels(prep, np.arange(len(prep.rows)), decoded)
        ok = np.flatnonzero(done)
        # One pinned block per batch carries the kernel's tables and the labels: two copies.
        tables = stage.host(len(ok))
        offsets = None
        if self.ragged:
            out, images, offsets = self._views(prep.meta[ok])
        else:
            out = images = torch.empty(self._out_shape(len(ok)), dtype=self._out_dtype(), device=self.owner.device)
        lap("alloc")
        if len(ok):
            self._launch(out, tables, stage, pointers[ok], row_strides[ok], prep, ok, offsets, lap)
        return self._outputs(prep, stage, images, ok, lap), uploads

    def _in_parts(self, prep: Prepared, stage: Staging, lap) -> Processed:
        """A batch over the lane's budget, decoded part after part (``Prepared.parts``): each part's
        windows into the lane's workspaces, then resampled into its rows of one output, and the
        part's kernel waited for before the next part reuses them. Rows are placed by offsets, so a
        failed row leaves a gap, closed at the end (rare: a decode failure in a batch this large)."""
        n = len(prep.rows)
        if self.recent:  # all earlier work of this lane's stream: both workspaces are free
            self.recent[-1][0].synchronize()
            self.recent.clear()  # and an outgrown workspace is freed when replaced
        stage.reserve(n)  # no growth (which would drop the pinned block under a copy) between parts
        lap("wait")
        out, views, offsets = self._views(prep.meta)
        done = np.zeros(n, dtype=bool)
        for lo, hi in prep.parts:
            rows = np.arange(lo, hi)
            gpu = rows[prep.on_gpu[rows]]
            decoded = None
            if len(gpu):
                decoded = self.decoder.decode(prep.token, prep.parse_idx[gpu], prep.regions[gpu], self.cp_stream.ptr)
            lap("decode")
            pointers, row_strides, ok, uploads = self._pixels(prep, rows, decoded)
            ok_rows = rows[ok]
            if len(ok_rows):
                tables = stage.host(len(ok_rows))
                self._launch(out, tables, stage, pointers[ok], row_strides[ok], prep, ok_rows, offsets[ok_rows], lap)
            done[ok_rows] = True
            self.part_done.record(self.stream)
            self.part_done.synchronize()  # the windows, the uploads and the tables are free again
            del decoded, uploads
        prep.release()
        ok = np.flatnonzero(done)
        if self.ragged:
            images: Any = [views[i] for i in ok.tolist()]
        else:
            images = out.view(self._out_shape(n))
            if len(ok) < n:
                images = images.index_select(0, torch.from_numpy(ok).to(self.owner.device))
        self.seconds["parts"] += len(prep.parts)
        return self._outputs(prep, stage, images, ok, lap)

    def _pixels(self, prep: Prepared, rows: np.ndarray, decoded) -> tuple[np.ndarray, np.ndarray, np.ndarray, list]:
        """Where the windows of ``rows`` (positions in ``prep``) lie: nvImageCodec's (``decoded``, for
        those of them on the GPU), else Pillow's, uploaded. Returns addresses, row strides, which
        have pixels, and the uploads (to keep alive until the kernel has read them); Pillow's
        errors join ``prep.failures``."""
        samples = prep.batch.samples
        on_gpu = prep.on_gpu[rows]
        m = len(rows)
        pointers = np.zeros(m, dtype=np.uint64)
        row_strides = np.zeros(m, dtype=np.int64)
        done = np.zeros(m, dtype=bool)
        if decoded is not None:
            pointers[on_gpu], row_strides[on_gpu] = decoded.pointers, decoded.row_strides
            done[on_gpu] = decoded.status == 1
        uploads = []
        for k in np.flatnonzero(~done).tolist():  # Pillow's pixels, uploaded
            i = int(rows[k])
            sample = samples[prep.rows[i]]
            self.seconds["cpu_fallback"] += bool(on_gpu[k])
            try:
                pixels = self._cpu_decode(sample, prep.regions[i], prep.pillow.get(i))
            except LoaderError as exc:
                prep.failures.append((prep.rows[i], exc))
                continue
            uploads.append(pixels)
            pointers[k], row_strides[k], done[k] = pixels.data_ptr(), pixels.stride(0), True
        return pointers, row_strides, done, uploads

    def _outputs(self, prep: Prepared, stage: Staging, images: Any, ok: np.ndarray, lap) -> Processed:
        """The batch's rows ``ok`` (their images resampled): post ops, labels, the lane's event."""
        if self.post is not None:
            images = self._post(images, prep, ok)
        data: dict[str, Any] = {"image": images}
        if prep.label_array is not None:
            # From pinned memory: a copy from pageable memory may wait for the lane's stream
            # (its decode and kernel) before it starts.
            tables = stage.host(len(ok))
            tables["labels"][:] = prep.label_array[ok]
            labels = torch.empty(len(ok), dtype=torch.int64, device=self.owner.device)
            if len(ok):
                stage.upload("labels", labels.data_ptr(), len(ok))
            data["label"] = labels
        lap("labels")
        stage.ready.record(self.stream)
        lap("event")
        return Processed(data, [prep.rows[i] for i in ok.tolist()], sorted(prep.failures, key=lambda f: f[0]))

    def _done(self, prep: Prepared, result: Processed, stage: Staging, keep: Any) -> Processed:
        fields = self.owner.pipeline.fields
        if fields:
            result.data.update(field_columns(prep.batch.samples, result.kept, fields))
        # The decoded pixels (and Pillow's uploads) stay alive until the host wait two batches later.
        self.recent.append((stage.ready, keep))
        result.ready = stage.ready
        self.seconds["batches"] += 1
        return result

    def _out_shape(self, n: int) -> tuple[int, ...]:
        pipe = self.owner.pipeline
        (oh, ow), c = pipe.output_size(), pipe.channels
        return (n, c, oh, ow) if self.chw else (n, oh, ow, c)

    def _out_dtype(self) -> torch.dtype:
        return torch.uint8 if self.post is not None else self.owner.pipeline.dtype

    def _views(self, meta: np.ndarray) -> tuple[torch.Tensor, list[torch.Tensor], np.ndarray]:
        """One flat output for images of the sizes in ``meta``'s columns 5 and 6, each image's start
        in it (elements; the kernel's offsets table), and the images as views into it: one
        allocation and one launch a batch, as for a fixed size."""
        c = self.owner.pipeline.channels
        h, w = meta[:, 5].astype(np.int64), meta[:, 6].astype(np.int64)
        sizes = h * w * c
        offsets = np.cumsum(sizes) - sizes
        out = torch.empty(int(sizes.sum()), dtype=self._out_dtype(), device=self.owner.device)
        ones = np.ones_like(h)
        shapes, strides = (np.stack([c * ones, h, w], 1), np.stack([h * w, w, ones], 1)) if self.chw else (
            np.stack([h, w, c * ones], 1), np.stack([w * c, c * ones, ones], 1))
        # The views made by map() over C functions: no Python bytecode per image, so no GIL hand-off
        # to the other threads mid-way (a Python loop here cost 7-8 ms a batch of 256, two lanes).
        images = list(map(out.as_strided, shapes.tolist(), strides.tolist(), offsets.tolist()))
        return out, images, offsets

    def _post(self, images: Any, prep: Prepared, ok: np.ndarray) -> Any:
        if len(ok) == 0:  # nothing survived: the output's final form, empty
            return [] if isinstance(images, list) else self.post.finish(images)
        indices = prep.indices if len(ok) == len(prep.rows) else prep.indices[ok]
        images = self.post.apply(images, indices, prep.batch.epoch, inplace=True)
        if isinstance(images, list):  # sizes differ: each image finished on its own
            return [self.post.finish(image[None])[0] for image in images]
        return self.post.finish(images)

    def _cpu_decode(self, sample, region, decoded: torch.Tensor | LoaderError | None) -> torch.Tensor:
        """``region`` of the sample's pixels on the device: Pillow's window from the prep thread
        (or its error), else decoded now."""
        if isinstance(decoded, LoaderError):
            raise decoded
        if decoded is None:
            pipe = self.owner.pipeline
            img = _pillow.decode(_image_field(sample, pipe.image_fields), pipe.decode, sample.key, sample.source)
            y0, x0, y1, x1 = (int(v) for v in region)
            arr = np.array(img.crop((x0, y0, x1, y1))).reshape(y1 - y0, x1 - x0, -1)  # a writable copy, for torch
            img.close()
            decoded = torch.from_numpy(arr)
        return decoded.to(self.owner.device, non_blocking=False)

    def _launch(self, out: torch.Tensor, tables, stage: Staging, pointers: np.ndarray, row_strides: np.ndarray,
                prep: Prepared, ok: np.ndarray, offsets: np.ndarray | None, lap) -> None:
        """The kernel for rows ``ok`` of ``prep``, into ``out``: row j of the launch at ``offsets[j]``
        elements (images of their own sizes, or a batch in parts), else at j times the fixed size."""
        # The tables were computed in the prep thread: here only what the decode decided (the
        # pixels' addresses and row strides, which samples made it) joins them, in few NumPy calls.
        n = len(ok)
        c = self.owner.pipeline.channels
        every = n == len(prep.meta)
        tables["ptrs"][:] = pointers
        tables["meta"][:] = prep.meta if every else prep.meta[ok]
        tables["meta"][:, 2] = row_strides
        tables["geo"][:] = prep.geo if every else prep.geo[ok]
        if offsets is not None:
            tables["offsets"][:] = offsets
        lap("tables")
        d_ptrs, d_meta, d_geo, d_offsets = stage.upload_tables()
        lap("upload")
        if offsets is not None:  # the grid covers the largest image; each sample's size is in its meta row
            oh, ow = int(tables["meta"][:, 5].max()), int(tables["meta"][:, 6].max())
        else:
            (oh, ow), d_offsets = self.owner.pipeline.output_size(), np.uint64(0)
        with self.cp_stream:
            self.kernel(
                grid(oh, ow, n),
                BLOCK,
                (d_ptrs, d_meta, d_geo, np.uint64(out.data_ptr()), np.int32(oh), np.int32(ow), np.int32(c),
                 np.int32(self.chw), np.int32(self.normalize), self.mean, self.inv_std, d_offsets),
            )
        lap("kernel")


class _Laps:
    """Adds the time since the last lap to ``seconds["lane." + name]``: where a lane's host time goes
    after its decode (``CudaExecutor.timings``)."""

    def __init__(self, seconds: collections.Counter[str]) -> None:
        self.seconds = seconds
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[f"lane.{name}"] += now - self.last
        self.last = now
