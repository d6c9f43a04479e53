"""A GPU lane's outputs: the batch tensor (or views of their own sizes), the kernel launch from
Python, the post ops and the labels, and the event that says the batch is ready."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .._results import Processed
from ._kernels import BLOCK, grid, resample_kernel
from ._launch import Staging
from ._post_passes import packed_layout
from ._prep import Prepared

__all__ = ["LaneOutput"]

_OUT_NAMES = {torch.uint8: "uint8", torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class LaneOutput:
    """What a lane's batches come out as, and the launches that write them: the fused resample
    kernel (crop, resize, flip, normalize, layout, dtype) or, with post ops, uint8 HWC then
    ``PostOps`` on the lane's stream; images of one size in one tensor, or of their own sizes as
    views into one allocation. Made in the lane's thread (CuPy's current device is the lane's)."""

    def __init__(self, owner: Any, cp_stream: Any, stream: Any) -> None:
        import cupy

        self.owner = owner
        self.cp_stream = cp_stream
        self.stream = stream
        pipe = owner.pipeline
        dev = owner.device
        # With post ops the fused kernel writes uint8 HWC; PostOps runs them, then normalises and
        # lays out the batch, all on this lane's stream.
        self.post = None
        if pipe.post_ops:
            from ._post import PostOps

            self.post = PostOps(pipe, self.cp_stream, seed=owner.seed, device=dev)
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
        self.ragged = pipe.output_size() is None

    def outputs(self, prep: Prepared, stage: Staging, images: Any, ok: np.ndarray, lap) -> Processed:
        """The batch's rows ``ok`` (their images resampled): post ops, labels, the lane's event."""
        if self.post is not None:
            images = self.post_ops(images, prep, ok)
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

    def shape(self, n: int) -> tuple[int, ...]:
        pipe = self.owner.pipeline
        (oh, ow), c = pipe.output_size(), pipe.channels
        return (n, c, oh, ow) if self.chw else (n, oh, ow, c)

    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.post is not None else self.owner.pipeline.dtype

    def views(self, meta: np.ndarray) -> tuple[torch.Tensor, list[torch.Tensor], np.ndarray]:
        """One flat output for images of the sizes in ``meta``'s columns 5 and 6, each image's start
        in it (elements; the kernel's offsets table), and the images as views into it: one
        allocation and one launch a batch, as for a fixed size."""
        h, w = meta[:, 5].astype(np.int64), meta[:, 6].astype(np.int64)
        c = np.full_like(h, self.owner.pipeline.channels)
        shapes, strides, offsets = packed_layout(h, w, c, self.chw)
        out = torch.empty(int((h * w * c).sum()), dtype=self.dtype(), device=self.owner.device)
        # The views made by map() over C functions: no Python bytecode per image, so no GIL hand-off
        # to the other threads mid-way (a Python loop here cost 7-8 ms a batch of 256, two lanes).
        images = list(map(out.as_strided, shapes.tolist(), strides.tolist(), offsets.tolist()))
        return out, images, offsets

    def post_ops(self, images: Any, prep: Prepared, ok: np.ndarray, ready: torch.cuda.Event | None = None) -> Any:
        """The post ops and the finish on the rows ``ok``; ``ready`` recorded after them (if given)."""
        if self.owner.pipeline.splits > 1:
            return self._views(images, prep, ok, ready)
        every = len(ok) == len(prep.rows)
        planned = prep.post[0] if prep.post is not None else None
        if every and planned is not None and isinstance(images, torch.Tensor) and tuple(images.shape) == planned.input_shape \
                and images.is_contiguous():  # planned in the prep thread: allocate, relocate, issue
            return self.post.run_planned(images, planned, ready=ready)
        indices = prep.indices if every else prep.indices[ok]
        if len(ok) and not isinstance(images, list):  # the passes and the finish in one plan, with the event
            return self.post.apply(images, indices, prep.batch.epoch, inplace=True, finish=True, ready=ready)
        if len(ok) == 0:  # nothing survived: the output's final form, empty
            images = [] if isinstance(images, list) else self.post.finish(images)
        else:  # sizes differ: each image finished on its own, all in one plan
            images = self.post.finish_each(self.post.apply(images, indices, prep.batch.epoch, inplace=True))
        if ready is not None:
            ready.record(self.stream)
        return images

    def _views(self, images: torch.Tensor, prep: Prepared, ok: np.ndarray, ready: torch.cuda.Event | None) -> torch.Tensor:
        """``Pipeline.splits``' views of the rows ``ok`` (``images``: their uint8 [n, H, W, C] batch,
        the pipeline ending in one size): the clean view finished as it is, then each augmented view's
        post ops and finish from the same pixels (its own draws), each into its block of one
        view-major output, handed out as ``[n, splits, ...]``. The plans made in the prep thread
        run where every row made it; else each view's passes are laid out here."""
        pipe, post = self.owner.pipeline, self.post
        splits = pipe.splits
        images = images.contiguous()
        n, h, w, c = images.shape
        planned = prep.post if len(ok) == len(prep.rows) and prep.post is not None else None
        with torch.cuda.stream(self.stream):
            shape = (n, c, h, w) if pipe.layout == "CHW" else (n, h, w, c)
            out = torch.empty((splits, *shape), dtype=pipe.dtype, device=self.owner.device)
            post.finish(images, out[0])
            indices = prep.indices[ok]
            for split in range(1, splits if n else 1):  # no rows: the clean view's empty block is all
                if planned is not None and tuple(images.shape) == planned[split - 1].input_shape:
                    post.run_planned(images, planned[split - 1], out=out[split])
                else:
                    post.apply(images, indices, prep.batch.epoch, finish=True, split=split, out=out[split])
        if ready is not None:
            ready.record(self.stream)
        return out.transpose(0, 1)

    def launch(self, out: torch.Tensor, tables, stage: Staging, pointers: np.ndarray, row_strides: np.ndarray,
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
