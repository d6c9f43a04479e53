"""Video clips decoded on the GPU's video engines (NVDEC) through PyNvVideoCodec: ``DecodeClip(device="cuda")``.

Each of the loader's threads keeps its own CUDA stream and a few ``SimpleDecoder``s (one per
recent video: a thread often decodes several clips of one video in a row); a clip of another
video (a file) reconfigures the least recently used one, far cheaper than a new decoder. A clip's
frames are fetched by number (``seek_to_index`` to the first, then ``get_batch_frames_by_index``:
the decoder seeks to the keyframe before them and decodes forward), as planar RGB uint8 on the GPU, copied out
of the decoder's buffers, turned upright if the file says so, then resized, cropped and flipped by
``DecodeClip``'s torch ops on the same stream.

Ordering, in one place:

- the decoder is made with this thread's stream, so its colour conversion runs there, and
  ``torch.from_dlpack`` passes the same stream to the frames' ``__dlpack__`` (the DLPack rule: the
  producer orders its writes before that stream). Everything after (the copy out, the resize, crop
  and flip) is queued on that stream too;
- before returning, the thread waits for its stream (``synchronize``): the copy out of the
  decoder's frame buffers is done before the next call reuses them, and the clip is complete
  before any other stream reads it;
- the clip's memory was allocated on this thread's stream; it is recorded on the caller's current
  stream (``record_stream``), so the allocator reuses it only after the work the caller queues on
  it (the batching stacks clips there).
"""

from __future__ import annotations

import collections
import threading
import traceback
from typing import Any

import numpy as np
import torch

from headrace._errors import ConfigError, DecodeError, LoaderError

__all__ = ["NvdecClips", "clip_indices", "import_nvc", "resolve_video_device"]

# Decoders kept per thread (LRU). A thread that reads a video's clips in order meets the same video
# again and again; shuffled, rarely, and a kept decoder then only holds GPU memory.
DECODERS_PER_THREAD = 2


def import_nvc() -> Any:
    """PyNvVideoCodec, imported on first use: the GPU video path is an optional extra."""
    try:
        import PyNvVideoCodec as nvc
    except (ImportError, OSError) as exc:  # OSError: the wheel is there, a CUDA library it needs is not
        raise ConfigError("DecodeClip(device='cuda') needs PyNvVideoCodec: pip install 'headrace[video-gpu]' "
                          f"(or pip install pynvvideocodec); importing it failed: {exc}") from exc
    return nvc


def resolve_video_device(device: Any) -> str:
    """``"cpu"`` or ``"cuda:N"`` for ``DecodeClip``'s ``device``: ``"auto"`` is the GPU when torch sees
    one and PyNvVideoCodec imports. Raises ConfigError for another value, or for ``"cuda"`` without
    PyNvVideoCodec or a GPU."""
    if device == "cpu":
        return "cpu"
    if device == "auto":
        if not torch.cuda.is_available():
            return "cpu"
        try:
            import_nvc()
        except ConfigError:
            return "cpu"
        device = "cuda"
    if not isinstance(device, str) or not (device == "cuda" or device.startswith("cuda:")):
        raise ConfigError(f"DecodeClip: device must be 'cpu', 'cuda', 'cuda:N' or 'auto', got {device!r}")
    import_nvc()
    if not torch.cuda.is_available():
        raise ConfigError(f"DecodeClip: device={device!r} needs a CUDA GPU; torch sees none")
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    if not 0 <= index < torch.cuda.device_count():
        raise ConfigError(f"DecodeClip: device={device!r}, but torch sees {torch.cuda.device_count()} GPUs")
    return f"cuda:{index}"


def clip_indices(start: int, stride: int, length: int) -> list[int]:
    """The clip's frame numbers. A frame's number is its rank in presentation order (the probe's
    timestamps, sorted): the reader's ``clip`` start and stride are already such ranks."""
    return list(range(start, start + stride * length, stride))


class NvdecClips:
    """Decodes clips on one GPU, with per-thread decoders and streams (see the module docstring)."""

    def __init__(self, device: str, decoders_per_thread: int = DECODERS_PER_THREAD) -> None:
        self.device = torch.device(device)
        self.decoders_per_thread = decoders_per_thread
        self._local = threading.local()
        self._shifts: dict[str, int] = {}  # each video's NVDEC timestamp minus the probe's (_check_timestamps)

    def __getstate__(self) -> dict[str, Any]:  # decoders and streams are per process and thread
        return {"device": str(self.device), "decoders_per_thread": self.decoders_per_thread}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["device"], state["decoders_per_thread"])  # type: ignore[misc]

    def stream(self) -> torch.cuda.Stream:
        """This thread's stream, on which its decoders and the clip's ops run."""
        local = self._local
        if getattr(local, "stream", None) is None:
            local.stream = torch.cuda.Stream(self.device)
            local.decoders = collections.OrderedDict()
        return local.stream

    def frames(self, video: str | bytes, name: str, indices: list[int], pts: np.ndarray | None, *,
               key: str | None) -> tuple[torch.Tensor, float]:
        """Frames ``indices`` of ``video`` (a path or the video's bytes; ``name`` says which in errors
        and keys the cache) as uint8 ``[F, 3, H, W]`` on this thread's stream (current on the
        caller's side: call it inside ``torch.cuda.stream(self.stream())``), and the stream's average
        frame rate. ``pts``: the probe's timestamps of those frames, checked against the decoder's.

        Raises DecodeError naming ``key`` and ``name`` if NVDEC cannot open the video, finds fewer
        frames than the clip needs, gives frames that are not the probe's, or gives 16-bit frames.
        """
        try:
            decoder = self._decoder(video, name)
            count = len(decoder)
            if indices[-1] >= count:  # the decoder skips (with a warning) indices past its end: refuse here
                raise DecodeError(f"NVDEC finds {count} frames in the video; the clip needs frame {indices[-1]} "
                                  "(truncated or corrupt?)", key=key, source=name)
            # Seek first, always. PyNvVideoCodec 2.2.4, a decoder kept on the same video: without it,
            # the clip's first frame came back at times with the pixels of the frame one GOP later
            # (its timestamp right), 8 of 1,920 clips on the H100; with it, none
            # (tests/gpu_video/test_gpu_video.py::test_kept_decoders_give_each_clips_own_frames).
            decoder.seek_to_index(indices[0])
            decoded = decoder.get_batch_frames_by_index(indices)
            rate = float(decoder.get_stream_metadata().average_fps or 0.0)
        except LoaderError:
            raise
        except Exception as exc:  # PyNvVideoCodec raises RuntimeError, ValueError or bare Exception
            self._forget(name)
            # The error outlives this call (the loader counts it): its traceback must not keep the
            # decoder, and with it the file, open.
            decoder = None
            traceback.clear_frames(exc.__traceback__)
            raise DecodeError(f"NVDEC cannot decode the video: {type(exc).__name__}: {exc}", key=key,
                              source=name) from exc
        if len(decoded) != len(indices):
            raise DecodeError(f"NVDEC delivered {len(decoded)} of the clip's {len(indices)} frames "
                              "(truncated or corrupt?)", key=key, source=name)
        if pts is not None:
            self._check_timestamps(decoded, pts, indices, key, name)
        tensors = [torch.from_dlpack(frame) for frame in decoded]
        if tensors[0].dtype != torch.uint8:
            raise DecodeError(f"NVDEC gives {tensors[0].dtype} frames (a video of more than 8 bits per sample); "
                              "DecodeClip(device='cuda') takes 8-bit video: decode it with device='cpu', which "
                              "converts to 8 bits", key=key, source=name)
        return torch.stack(tensors), rate  # the copy out of the decoder's buffers

    def _check_timestamps(self, decoded: list[Any], pts: np.ndarray, indices: list[int], key: str | None,
                          name: str) -> None:
        """NVDEC's frames must be the probe's: their timestamps the probe's plus one shift per video.
        The shift is there because PyNvVideoCodec reports timestamps before the container's edit list
        (H.264 with B-frames in MP4 starts two frames early: -1024 where PyAV says 0); it is learned
        from the video's first clip here and must hold for every frame of every clip after. A
        variable-rate file that NVDEC numbers otherwise, or a seek that lands elsewhere, breaks it."""
        got = np.asarray([int(frame.getPTS()) for frame in decoded], np.int64)
        shift = got - np.asarray(pts, np.int64)
        known = self._shifts.setdefault(name, int(shift[0]))  # one dict operation: safe across threads
        if np.any(shift != known):
            raise DecodeError(f"NVDEC's frames {indices[:3]}... have timestamps {got[:3].tolist()}..., the probe's "
                              f"are {np.asarray(pts[:3]).tolist()}... (shift {known}): the decoder numbers this "
                              "video's frames otherwise (variable frame rate? decode it with device='cpu')",
                              key=key, source=name)

    def _decoder(self, video: str | bytes, name: str) -> Any:
        """This thread's decoder for ``name``: kept from an earlier clip; else, past
        ``decoders_per_thread``, the least recently used one reconfigured for a file (or dropped for
        bytes: a new one is made for them); else a new one."""
        self.stream()
        cache: collections.OrderedDict[tuple[str, int], Any] = self._local.decoders
        ident = (name, len(video) if isinstance(video, bytes) else -1)
        decoder = cache.get(ident)
        if decoder is not None:
            cache.move_to_end(ident)
            return decoder
        nvc = import_nvc()
        if isinstance(video, str) and len(cache) >= self.decoders_per_thread:
            # Another video for a kept decoder: reconfigure_decoder takes a path (not bytes) and cost
            # 3 ms against 222 ms for a new SimpleDecoder on the H100 (examples/benchmark_video.py).
            # Popped first: if it fails, the decoder (its state unknown) is dropped.
            _, decoder = cache.popitem(last=False)
            decoder.reconfigure_decoder(video)
        else:
            while len(cache) >= self.decoders_per_thread:
                cache.popitem(last=False)
            decoder = nvc.SimpleDecoder(video, gpu_id=self.device.index, cuda_stream=self._local.stream.cuda_stream,
                                        use_device_memory=True, output_color_type=nvc.OutputColorType.RGBP)
        cache[ident] = decoder
        return decoder

    def _forget(self, name: str) -> None:
        """Drop the decoders of a video that failed (their state is unknown)."""
        cache = getattr(self._local, "decoders", None)
        for ident in [i for i in cache or () if i[0] == name]:
            del cache[ident]

    def close_thread(self) -> None:
        """Drop this thread's decoders (they also go when the thread ends)."""
        cache = getattr(self._local, "decoders", None)
        if cache:
            cache.clear()
