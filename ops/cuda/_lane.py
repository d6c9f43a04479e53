"""A GPU lane: its thread, CUDA stream and nvImageCodec decoder, and what it does with one prepared
batch: decode the windows (fused with the kernel launch in the shim when it can), Pillow's
pixels for the rest, the batch in parts when it is over the lane's budget."""

from __future__ import annotations

import collections
import concurrent.futures
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from headrace import _nvjpeg
from headrace._errors import LoaderError

from .. import _pillow
from .._batch_stages import batch_extras, checked_batch
from .._results import Processed, field_columns, image_field
from .._stage_calls import stage_failure
from ._codecs import NativeDecoder, PythonDecoder
from ._launch import FusedLaunch, Staging
from ._output import LaneOutput
from ._prep import Prepared, lane_budget

if TYPE_CHECKING:
    from ._executor import CudaExecutor

__all__ = ["Lane", "Laps"]


class Lane:
    """One lane of the GPU executor: a thread, a CUDA stream and an nvImageCodec decoder. It decodes
    a prepared batch's windows and has its kernel launched (``LaneOutput``), batch after batch in
    order on its stream; it keeps each batch's decoded pixels alive until a host wait two batches
    later."""

    def __init__(self, owner: CudaExecutor, index: int, hw_load: float | str, threads: int) -> None:
        self.owner = owner
        self.index = index
        self.queued: set[concurrent.futures.Future[Any]] = set()  # batches given to this lane, not finished
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
                                         cuda_load=tuning.cuda_load, gpu_load=tuning.gpu_huffman_load,
                                         gpu_threads=tuning.gpu_huffman_threads or 0,
                                         options=tuning.decoder_options(), cut_frames=tuning.cut_frames)
        else:
            # One decoder: gpu_huffman_load's second one is the shim's.
            self.decoder = PythonDecoder(dev, threads=threads, channels=pipe.channels, exif=pipe.decode.exif,
                                         options=self.owner.tuning.decoder_options())
        self.out = LaneOutput(self.owner, self.cp_stream, self.stream)
        self.staging = [Staging(cupy, self.cp_stream) for _ in range(4)]
        self.turn = 0
        # (event after the batch's kernel, its decoded pixels): pixels stay alive, and their memory
        # unused, until two batches later, after a host wait on that event (docs/gpu-notes.md §3: nvJPEG's
        # hardware decoder was seen writing before earlier work on its stream had finished).
        self.recent: collections.deque[tuple[Any, Any]] = collections.deque(maxlen=2)
        self.part_done = torch.cuda.Event()  # a part's kernel has read its windows (``_in_parts``)
        self.seconds: collections.Counter[str] = collections.Counter()
        # The shim waits, decodes, copies, launches and records in one GIL-free call when it can.
        # Without a fixed output size each image gets its own size and place in one allocation
        # (``LaneOutput.views``); that launch goes from Python.
        out = self.out
        self.fused = None
        if not out.ragged and self.decoder.launch_unavailable is None and self.owner.tuning.launch == "shim":
            self.fused = FusedLaunch(out.kernel, size=pipe.output_size(), channels=pipe.channels, chw=out.chw,
                                     normalize=out.normalize, mean=out.mean, inv_std=out.inv_std)

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
        self.out.post = self.fused = None

    def finish(self, prep: Prepared) -> Processed:
        """Decode the prepared batch's windows and launch the fused kernel (in the lane's thread)."""
        try:
            with torch.cuda.stream(self.stream):
                return self._finish(prep)
        finally:
            prep.release()

    def _finish(self, prep: Prepared) -> Processed:
        lap = Laps(self.seconds)
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
        out = torch.empty(self.out.shape(n), dtype=self.out.dtype(), device=self.owner.device)
        labels = torch.empty(n, dtype=torch.int64, device=self.owner.device) if prep.label_array is not None else None
        lap("alloc")
        launch = self.fused.prepare(stage, out, prep.meta, prep.geo, prep.label_array, labels, wait,
                                    record=self.out.post is None)
        lap("tables")
        decoded = self.decoder.decode(prep.token, prep.parse_idx, prep.regions, self.cp_stream.ptr,
                                      buffers=(pointers, row_strides, workspace), launch=launch)
        lap("decode")
        if not decoded.launched:
            return None, decoded
        ok = np.arange(n)
        if self.out.post is not None:
            out = self.out.post_ops(out, prep, ok, ready=stage.ready)
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
        if self.out.ragged:
            out, images, offsets = self.out.views(prep.meta[ok])
        else:
            out = images = torch.empty(self.out.shape(len(ok)), dtype=self.out.dtype(), device=self.owner.device)
        lap("alloc")
        if len(ok):
            self.out.launch(out, tables, stage, pointers[ok], row_strides[ok], prep, ok, offsets, lap)
        return self.out.outputs(prep, stage, images, ok, lap), uploads

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
        out, views, offsets = self.out.views(prep.meta)
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
                self.out.launch(out, tables, stage, pointers[ok], row_strides[ok], prep, ok_rows, offsets[ok_rows], lap)
            done[ok_rows] = True
            self.part_done.record(self.stream)
            self.part_done.synchronize()  # the windows, the uploads and the tables are free again
            del decoded, uploads
        prep.release()
        ok = np.flatnonzero(done)
        if self.out.ragged:
            images: Any = [views[i] for i in ok.tolist()]
        else:
            images = out.view(self.out.shape(n))
            if len(ok) < n:
                images = images.index_select(0, torch.from_numpy(ok).to(self.owner.device))
        self.seconds["parts"] += len(prep.parts)
        return self.out.outputs(prep, stage, images, ok, lap)

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
            if len(decoded.status) and np.all(decoded.status == _nvjpeg.ENCODING_UNSUPPORTED):
                _nvjpeg.warn_unusable(len(decoded.status))  # bound to another package's libnvjpeg
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

    def _done(self, prep: Prepared, result: Processed, stage: Staging, keep: Any) -> Processed:
        fields = self.owner.pipeline.fields
        if fields:
            result.data.update(field_columns(prep.batch.samples, result.kept, fields))
        # The decoded pixels (and Pillow's uploads) stay alive until the host wait two batches later.
        self.recent.append((stage.ready, keep))
        if self.owner.stages and result.kept:
            self._run_stages(prep, result)
            stage.ready.record(self.stream)  # after the stages' work: what consumers wait on
        result.ready = stage.ready
        self.seconds["batches"] += 1
        return result

    def _run_stages(self, prep: Prepared, result: Processed) -> None:
        """The executor's ``MapBatch`` stages on the batch, here: this thread, this lane's stream
        current. One that raises fails every row left, named, as a ``StagedExecutor`` would."""
        started = time.perf_counter()
        owner, batch = self.owner, prep.batch
        for lane_stage in owner.stages:
            stage = lane_stage.stage
            try:
                extras = batch_extras(stage, lane_stage.position, seed=owner.seed, epoch=batch.epoch, index=batch.index,
                                      keys=lambda: [batch.samples[row].key for row in result.kept],
                                      layout=owner.pipeline.layout)
                result.data = checked_batch(stage.fn(result.data, **extras), rows=len(result.kept))
            except Exception as exc:
                result.failures.extend((row, stage_failure(stage, batch.samples[row], exc)) for row in result.kept)
                result.data, result.kept = {}, []
                break
        self.seconds["stages"] += time.perf_counter() - started

    def _cpu_decode(self, sample, region, decoded: torch.Tensor | LoaderError | None) -> torch.Tensor:
        """``region`` of the sample's pixels on the device: Pillow's window from the prep thread
        (or its error), else decoded now."""
        if isinstance(decoded, LoaderError):
            raise decoded
        if decoded is None:
            pipe = self.owner.pipeline
            img = _pillow.decode(image_field(sample, pipe.image_fields), pipe.decode, sample.key, sample.source)
            y0, x0, y1, x1 = (int(v) for v in region)
            arr = np.array(img.crop((x0, y0, x1, y1))).reshape(y1 - y0, x1 - x0, -1)  # a writable copy, for torch
            img.close()
            decoded = torch.from_numpy(arr)
        return decoded.to(self.owner.device, non_blocking=False)


class Laps:
    """Adds the time since the last lap to ``seconds["lane." + name]``: where a lane's host time goes
    after its decode (``CudaExecutor.timings``)."""

    def __init__(self, seconds: collections.Counter[str]) -> None:
        self.seconds = seconds
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[f"lane.{name}"] += now - self.last
        self.last = now
