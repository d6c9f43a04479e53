"""The GPU path's post ops: colour twist, warps, blur, tone curves and sharpness, a few kernel
launches a batch each (``PostOp.steps``: the passes of ops such as ``RandAugment``), then finish.

``PostOps`` belongs to a lane: it launches on the lane's CuPy stream and allocates its outputs with
torch on that stream (docs/gpu-notes.md §3: ``record_stream`` ignores memory torch did not allocate). Images
of a batch may differ in size: each launch reads per-sample tables (addresses, sizes, row strides,
the op's numbers). A batch's passes are laid out on the host (``_post_passes.py``), then built as
one ``Plan`` and issued by one call that holds no GIL (``_plan.py``: from Python each copy, launch
and event cost a GIL hand-off). The numbers are the CPU path's (``PostOp.tables``), so both draw
the same parameters for a sample.

Buffers: a pass launches over the samples it changes only (a sample ``p`` left alone, or one that
drew another kind of pass in a policy's round, is skipped), so each sample's pixels move between
the input and two uint8 buffers on their own (``route``): the colour twist and tone curves work in
place once a buffer is ours; a warp, a blur or sharpness writes into the other buffer; a batch
tensor's samples are gathered into one buffer at the end. The blur's horizontal pass
writes float32 scratch that its vertical pass reads, rounding once at the end, as the CPU path
does. A tone curve builds each sample's tables on the device (from the image's level counts where
the curve is read off the image), then looks every pixel up. AugMix's chains are rows of their own
(a batch of n samples, n x width chains), laid out as a batch of their own in the same
allocation, their input each sample's pixels where the mix finds them; one kernel then mixes each
sample's chains with it (``mix_chains``).

Host waits: the only one is the plan's, for the event of the plan that used the same pinned block
four batches ago (long passed, in practice). Nothing else synchronises.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._pipeline import Pipeline
from .._post_spec import Step
from ._plan import INPUT, OUTPUT, WORK, Plan, PlanSlots
from ._post_kernels import FINISH_TYPES, module
from ._post_passes import (BatchPasses, PlannedPost, blur_table, changed, color_table, finish_launch, finish_own_sizes,
                           packed_layout, post_steps, route, warp_table)

__all__ = ["PostOps", "blur_table", "changed", "color_table", "describe", "finish", "route", "warp_table"]


# --- pure NumPy (tested on the CPU) -------------------------------------------------------------


def describe(images: Any) -> np.ndarray:
    """(n, 5) int64 rows ``(address, height, width, row stride in bytes, channels)`` of ``images``:
    a uint8 [N, H, W, C] CUDA tensor, a list of uint8 [H, W, C] CUDA tensors, or a list of such
    tuples. Pixels within a row must be packed (C bytes apart). Raises ValueError otherwise."""
    if isinstance(images, torch.Tensor):
        if images.dim() != 4:
            raise ValueError(f"expected a [N, H, W, C] tensor, got shape {tuple(images.shape)}")
        _check_tensor(images[0] if len(images) else images.new_empty((1, 1, images.shape[3])))
        n, h, w, c = images.shape
        rows = np.empty((n, 5), dtype=np.int64)
        rows[:, 0] = images.data_ptr() + np.arange(n, dtype=np.int64) * images.stride(0)
        rows[:, 1:] = (h, w, images.stride(1), c)
        return rows
    rows = np.empty((len(images), 5), dtype=np.int64)
    for i, img in enumerate(images):
        if isinstance(img, torch.Tensor):
            _check_tensor(img)
            h, w, c = img.shape
            rows[i] = (img.data_ptr(), h, w, img.stride(0), c)
        else:
            rows[i] = tuple(int(v) for v in img)
    if len(rows) and (np.any(rows[:, 1:3] < 1) or np.any(rows[:, 3] < rows[:, 2] * rows[:, 4])):
        raise ValueError("images must be at least 1 x 1 with row strides of at least width x channels bytes")
    return rows


def _check_tensor(img: torch.Tensor) -> None:
    if img.dtype != torch.uint8 or img.dim() != 3 or not img.is_cuda:
        raise ValueError(f"expected uint8 HWC CUDA images, got {img.dtype} {tuple(img.shape)} on {img.device}")
    if img.stride(2) != 1 or img.stride(1) != img.shape[2]:
        raise ValueError(f"pixels of a row must be packed, got strides {img.stride()} for shape {tuple(img.shape)}")


# --- device side ---------------------------------------------------------------------------------


class PostOps:
    """A pipeline's post ops and its finish on one CUDA stream; owned by a lane, used by its thread.

    ``stream`` is the lane's ``cupy.cuda.Stream``; ``seed`` the executor's. Inputs must be ready on
    that stream (written on it, or waited for) and stay alive until the stream has passed the
    launches (buffers torch allocated on the stream itself may be dropped at once). A batch's
    launches are built as one ``Plan`` and issued by one call (``_plan.py`` says why); ``native``
    False issues them through CuPy instead of the decode shim.
    """

    def __init__(self, pipeline: Pipeline, stream, *, seed: int = 0, device: torch.device | None = None,
                 native: bool = True) -> None:
        import cupy

        self.pipeline = pipeline
        self.ops = pipeline.post_ops
        self.seed = seed
        self.channels = pipeline.channels
        self.cupy = cupy
        self.cp_stream = stream
        self.native = native
        self.device = device if device is not None else torch.device("cuda", cupy.cuda.Device().id)
        self.stream = torch.cuda.ExternalStream(stream.ptr, device=self.device)
        self._module = module(self.channels)
        self._functions: dict[str, int] = {}
        self._slots = PlanSlots(cupy, stream)

    def tables(self, rows: np.ndarray, indices: np.ndarray, epoch: int, split: int = 1) -> list[Step]:
        """The passes (``PostOp.steps`` of each post op, in order) for images ``rows`` (from
        ``describe``) of samples ``indices`` in the augmented view ``split`` (``Pipeline.splits``):
        primitive ops and their per-sample tables."""
        return post_steps(self.pipeline, self.seed, epoch, indices, rows[:, 1], rows[:, 2], split)

    def apply(self, images: Any, indices: np.ndarray, epoch: int, *, inplace: bool = False, finish: bool = False,
              ready: torch.cuda.Event | None = None, split: int = 1, out: torch.Tensor | None = None) -> Any:
        """The post ops on ``images`` (see ``describe``) of the samples ``indices`` in ``epoch``.

        Returns a uint8 [N, H, W, C] tensor for a tensor, else a list of [h, w, C] tensors: new
        memory allocated on the stream (``images`` itself without post ops). ``inplace`` lets the
        colour twist write into the input when it comes first. ``finish`` (a tensor only): the
        batch normalised and laid out as the pipeline asks (``finish``), in the same launches, into
        ``out`` when given (contiguous, of the finished shape and dtype). ``split``: the augmented
        view whose draws to take (``Pipeline.splits``). ``ready``: recorded on the stream once the
        result is written."""
        rows = describe(images)
        return self.apply_tables(images, self.tables(rows, indices, epoch, split), inplace=inplace, rows=rows,
                                 finish=finish, ready=ready, out=out)

    def apply_tables(self, images: Any, steps: list[Step], *, inplace: bool = False, rows: np.ndarray | None = None,
                     finish: bool = False, ready: torch.cuda.Event | None = None, out: torch.Tensor | None = None) -> Any:
        """``apply`` with given passes (primitive ops and their tables, n rows each; ``tables``).

        Each pass launches over the samples it changes (``changed``), each sample's pixels moving
        between the input and two buffers on their own (``route``); at the end a batch tensor's
        samples are gathered into one buffer. The buffers and temporaries are one allocation, and
        every launch goes up in one plan."""
        batch = isinstance(images, torch.Tensor)
        if finish and not batch:
            raise ValueError("finish=True takes a batch tensor; finish each image of a list on its own")
        if finish and not images.is_contiguous():  # the finish kernel reads the batch as one block
            images, rows = images.contiguous(), None
        rows = describe(images) if rows is None else rows
        if len(rows) and np.any(rows[:, 4] != self.channels):
            raise ValueError(f"images must have {self.channels} channels (the pipeline's)")
        passes = BatchPasses(rows, steps, self.channels, inplace)
        plan = Plan()
        with torch.cuda.stream(self.stream):
            memory = torch.empty(passes.size, dtype=torch.uint8, device=self.device) if passes.size else None
            target = passes.launches(plan, memory.data_ptr() if memory is not None else 0, gather=batch)
            result, address = images, (int(rows[0, 0]) if len(rows) else 0)

            def buffer(k: int, offset: int, size: int) -> torch.Tensor:
                at = passes.at(k) + int(offset)
                return memory[at : at + int(size)]

            if target is not None:
                address = memory.data_ptr() + passes.at(target)
                result = None if finish else buffer(target, 0, passes.total).view(images.shape)
            elif not batch and passes.changes:
                result = [images[i] if k < 0 else buffer(k, o, s).view(int(h), int(w), self.channels)
                          for i, (k, o, s, h, w) in enumerate(zip(passes.where, passes.offsets, passes.sizes,
                                                                  rows[:, 1], rows[:, 2]))]
            if finish and self.pipeline.normalize is not None:
                result = self._finish_into(plan, address, images.shape, out)
            elif finish:  # no Normalize: torch lays the batch out, after the plan
                if result is None:
                    result = buffer(target, 0, passes.total).view(images.shape)
                self._slots.run(plan, self._function, native=self.native)
                result = self.finish(result, out)
                if ready is not None:
                    ready.record(self.stream)
                return result
            if len(plan) or ready is not None:
                self._slots.run(plan, self._function, ready=ready, native=self.native)
        return result

    def run_planned(self, images: torch.Tensor, planned: PlannedPost, *, ready: torch.cuda.Event | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """``apply(..., finish=True)`` with the plan made ahead (``plan_post``) for ``images``, a
        contiguous uint8 [N, H, W, C] batch of its ``input_shape``: here only the workspace and the
        output (unless ``out`` is given: contiguous, of the plan's ``out_shape`` and dtype) are
        allocated and the plan issued, with its addresses relocated into them."""
        with torch.cuda.stream(self.stream):
            work = torch.empty(planned.work, dtype=torch.uint8, device=self.device) if planned.work else None
            if out is None:
                out = torch.empty(planned.out_shape, dtype=planned.dtype, device=self.device)
            bases = {INPUT: images.data_ptr(), WORK: work.data_ptr() if work is not None else 0, OUTPUT: out.data_ptr()}
            self._slots.run(planned.plan, self._function, bases=bases, ready=ready, native=self.native)
        return out

    def _function(self, name: str) -> int:
        fn = self._functions.get(name)
        if fn is None:
            kernel = self._module.get_function(name)  # a RawKernel; its CUfunction, for the plan
            fn = self._functions[name] = kernel.kernel.ptr
        return fn

    def _finish_into(self, plan: Plan, address: int, shape: tuple[int, ...], out: torch.Tensor | None = None
                     ) -> torch.Tensor:
        """The finish kernel (the pipeline has a Normalize) on the contiguous uint8 [N, H, W, C] batch at
        ``address``, added to ``plan``; returns its output: ``out`` (contiguous), or allocated on the stream."""
        norm = self.pipeline.normalize
        n, h, w, c = shape
        if out is None:
            out = torch.empty((n, c, h, w) if norm.layout == "CHW" else (n, h, w, c), dtype=norm.dtype,
                              device=self.device)
        finish_launch(plan, norm, address, out.data_ptr(), shape)
        return out

    def finish_each(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """``finish`` of each uint8 [h, w, C] image of a list (sizes may differ), in one plan: the
        results are views into one allocation, as the lane's images of their own sizes are. One
        plan rather than one an image: each is a call that lets the GIL go (``_plan.py``)."""
        norm = self.pipeline.normalize
        if norm is None or not images:  # the layout alone: torch's views and copies
            return [self.finish(image[None])[0] for image in images]
        with torch.cuda.stream(self.stream):
            images = [image if image.is_contiguous() else image.contiguous() for image in images]
            rows = describe(images)
            shapes, strides, _ = packed_layout(rows[:, 1], rows[:, 2], rows[:, 4], norm.layout == "CHW")
            out = torch.empty(int((rows[:, 1] * rows[:, 2] * rows[:, 4]).sum()), dtype=norm.dtype, device=self.device)
            plan = Plan()
            starts = finish_own_sizes(plan, norm, rows, out.data_ptr())
            self._slots.run(plan, self._function, native=self.native)
        return list(map(out.as_strided, shapes.tolist(), strides.tolist(), starts.tolist()))

    def finish(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Normalize, layout and dtype of a contiguous uint8 [N, H, W, C] batch, on the stream, as the
        pipeline asks (its Normalize, else its uint8 layout): the CPU path's ``_finish`` arithmetic.
        Into ``out`` when given (contiguous, of the finished shape and dtype)."""
        pipe = self.pipeline
        with torch.cuda.stream(self.stream):
            if pipe.normalize is None:
                laid = x.permute(0, 3, 1, 2) if pipe.layout == "CHW" else x
                if out is not None:
                    return out.copy_(laid)
                return laid.contiguous() if pipe.layout == "CHW" else x
            x = x.contiguous()
            plan = Plan()
            out = self._finish_into(plan, x.data_ptr(), tuple(x.shape), out)
            if len(plan):
                self._slots.run(plan, self._function, native=self.native)
            return out


# finish_launch names the kernel after Normalize's dtype: one kernel for each dtype it allows.
assert {str(d).removeprefix("torch.") for d in (torch.float32, torch.float16, torch.bfloat16)} == set(FINISH_TYPES)


def finish(x: torch.Tensor, pipeline: Pipeline, stream=None) -> torch.Tensor:
    """``PostOps(pipeline, stream).finish(x)``; ``stream`` defaults to CuPy's current stream."""
    import cupy

    return PostOps(pipeline, stream if stream is not None else cupy.cuda.get_current_stream()).finish(x)
