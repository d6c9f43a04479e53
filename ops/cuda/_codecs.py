"""The two ways the GPU path drives nvImageCodec, each as a header reader and a decoder.

Headers (one reader per executor, used by its prep thread): ``parse(data)`` returns a token for
the batch and an (n, 4) int32 array of height, width (upright when EXIF is applied), channels, and
1 where nvImageCodec parses the image; ``recycle(token)`` once the batch is decoded.

Decoders (one per lane, used by the lane's thread): ``decode(token, pick, regions, stream)``
decodes the parsed images ``pick``, each only its window ``regions[j]`` = (y0, x0, y1, x1), on the
lane's stream, and returns ``Decoded``: a status per image (1 decoded), the address and row stride
of its HWC uint8 pixels, and what must stay alive until the kernel reading them has run.

The native pair makes one GIL-free call per phase (``_batch_decode``) and decodes into a lane's
buffers, so parsing batch i+1 overlaps decoding batch i and lanes overlap each other. The Python
pair uses nvImageCodec's Python API, whose per-image GIL traffic keeps lanes from overlapping; it
is the fallback where the shim cannot be built.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._exif import jpeg_orientation
from .._limits import jpeg_sof

__all__ = ["Decoded", "NativeDecoder", "NativeHeaders", "PythonDecoder", "PythonHeaders"]

_SEQUENTIAL_DCT = (0xC0, 0xC1)  # baseline and extended JPEG: what nvImageCodec is given (batch_decode.c)


@dataclass
class Decoded:
    status: np.ndarray  # int32, 1 = decoded
    pointers: np.ndarray  # uint64 device addresses
    row_strides: np.ndarray  # int64 bytes
    keep: Any  # owner(s) of the pixels
    launched: bool = False  # the shim also launched the kernel (``NativeDecoder.decode``'s launch)


class NativeHeaders:
    def __init__(self, *, exif: bool) -> None:
        self.exif = exif
        self._free: list[Any] = []  # parsed-batch objects not in use (their handles are reused)
        self._made = 0
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        """Parsed batches handed out and not recycled yet (0 once the executor is drained)."""
        with self._lock:
            return self._made - len(self._free)

    def parse(self, data: list) -> tuple[Any, np.ndarray]:
        from ._batch_decode import ParsedBatch

        with self._lock:
            if self._free:
                parsed = self._free.pop()
            else:
                parsed = ParsedBatch()
                self._made += 1
        try:
            return parsed, parsed.parse(data, exif=self.exif)
        except BaseException:
            self.recycle(parsed)
            raise

    def recycle(self, parsed: Any) -> None:
        parsed.release()
        with self._lock:
            self._free.append(parsed)

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
            self._made -= len(free)
        for parsed in free:
            parsed.close()


class NativeDecoder:
    def __init__(self, device: torch.device, *, threads: int, hw_load: float | str, channels: int, exif: bool,
                 budget: int | None = None, cuda_load: float = 1.0, gpu_load: float = 0.0, gpu_threads: int = 0,
                 options: str = "", cut_frames: bool = True) -> None:
        from ._batch_decode import BatchDecoder

        self.device = device
        self.channels = channels
        # A workspace grows to at most this many bytes, or to one batch's need where that is more
        # (the executor hands a lane no batch over it but a single window: ``_prep.parts``).
        self.budget = budget
        self.decoder = BatchDecoder(
            device.index, threads=threads, hw_load=hw_load, cuda_load=cuda_load, gpu_load=gpu_load, gpu_threads=gpu_threads, channels=channels,
            exif=exif, options=options, cut_frames=cut_frames,
        )
        # Two buffers, used in turn and grown when a batch needs more (up to ``budget``): memory stays
        # flat over epochs.
        # The lane waits for its batch i-2's kernel before decoding batch i, so batch i's buffer is free.
        self.workspaces = [torch.empty(0, dtype=torch.uint8, device=device) for _ in range(2)]
        self.turn = 0
        from ._batch_decode import Launch, driver_reason

        self._plain = Launch()  # decode only
        # None when the shim can also launch the lane's kernel (the CUDA driver resolved).
        self.launch_unavailable = driver_reason()
        self.seconds: collections.Counter[str] = collections.Counter()  # inside the shim

    def buffers(self, regions: np.ndarray, before_growth) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        """Where each window ``regions[j]`` decodes to: (addresses, row strides, the buffer owning
        them). Buffers are used in turn; ``before_growth()`` runs before one is replaced by a
        larger one (the lane waits there for the batch that used it last)."""
        heights, widths = regions[:, 2] - regions[:, 0], regions[:, 3] - regions[:, 1]
        row_strides = (widths * self.channels).astype(np.int64)
        sizes = heights.astype(np.int64) * row_strides
        # 256-byte aligned slices of the lane's buffer.
        aligned = (sizes + 255) // 256 * 256
        offsets = np.concatenate(([0], np.cumsum(aligned)[:-1])).astype(np.uint64)
        need = int(aligned.sum())
        slot = self.turn % len(self.workspaces)
        self.turn += 1
        workspace = self.workspaces[slot]
        if need > workspace.numel():
            before_growth()
            del workspace
            self.workspaces[slot] = torch.empty(0, dtype=torch.uint8, device=self.device)  # free the old one first
            size = _grown(need) if self.budget is None else max(need, min(_grown(need), self.budget))
            workspace = self.workspaces[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return offsets + np.uint64(workspace.data_ptr()), row_strides, workspace

    def decode(self, parsed: Any, pick: np.ndarray, regions: np.ndarray, stream: int, *,
               buffers: tuple | None = None, launch: Any = None) -> Decoded:
        """Decode into ``buffers`` (from ``buffers()``; made here when None). With ``launch``
        (``_batch_decode.Launch``) the shim also waits and launches around the decode; ``seconds``
        gets its timings."""
        pointers, row_strides, workspace = buffers if buffers is not None else self.buffers(regions, lambda: None)
        launch = launch if launch is not None else self._plain
        status, launched = self.decoder.decode_launch(parsed, pick, regions, pointers, stream, launch)
        for name, value in zip(("wait", "decode", "launch"), launch.seconds):
            self.seconds[name] += value
        return Decoded(status, pointers, row_strides, workspace, launched)

    def close(self) -> None:
        self.decoder.close()
        self.workspaces = []


def _grown(need: int) -> int:
    """Room for ``need`` bytes and a quarter more, in whole MiB: later, larger batches rarely regrow it."""
    mib = 1 << 20
    return (need + need // 4 + mib - 1) // mib * mib


class PythonHeaders:
    def __init__(self, *, exif: bool) -> None:
        from nvidia import nvimgcodec as nvc

        self.nvc = nvc
        self.exif = exif

    def parse(self, data: list) -> tuple[Any, np.ndarray]:
        info = np.zeros((len(data), 4), dtype=np.int32)
        streams: list[Any] = []
        for i, blob in enumerate(data):
            try:
                # A NumPy view, not the bytes: nvImageCodec decoded fresh bytes-backed streams at
                # 9.7k images/s and array-backed ones at 17.6k on the H100 (probe, 1,024 JPEGs).
                cs = self.nvc.CodeStream(np.frombuffer(blob, dtype=np.uint8))
                h, w = cs.height, cs.width
            except RuntimeError:  # not a format nvImageCodec parses
                streams.append(None)
                continue
            if self.exif and cs.codec_name == "jpeg" and jpeg_orientation(blob) >= 5:
                h, w = w, h
            # Sequential Huffman-coded DCT only, as the shim (batch_decode.c, decodable_jpeg says why):
            # progressive, lossless and arithmetic-coded JPEGs go to Pillow.
            usable = cs.codec_name != "jpeg" or jpeg_sof(blob) in _SEQUENTIAL_DCT
            info[i] = (h, w, cs.num_channels, int(usable))
            streams.append(cs if usable else None)
        return (streams, info), info

    def recycle(self, token: Any) -> None:
        pass

    def close(self) -> None:
        pass


class PythonDecoder:
    def __init__(self, device: torch.device, *, threads: int, channels: int, exif: bool, options: str = "") -> None:
        from nvidia import nvimgcodec as nvc

        self.nvc = nvc
        self.channels = channels
        kinds = nvc.BackendKind
        # The CUDA decoder only. No CPU backend: what it fails on, the lane decodes with Pillow.
        # No hardware engine (the shim's ``hw_load``): in one decoder's chain, a sample the
        # engine fails during the decode can be decoded by two of nvImageCodec's threads at once,
        # which crashed fuzzed runs (batch_decode.c, hr_decoder).
        backends = [nvc.Backend(kinds.HYBRID_CPU_GPU), nvc.Backend(kinds.GPU_ONLY)]
        self.decoder = nvc.Decoder(device_id=device.index, max_num_cpu_threads=threads, backends=backends, options=options)
        self.launch_unavailable = "decoding through nvImageCodec's Python API"
        self.seconds: collections.Counter[str] = collections.Counter()
        gray = channels == 1
        self.params = nvc.DecodeParams(
            apply_exif_orientation=exif,
            color_spec=nvc.ColorSpec.GRAY if gray else nvc.ColorSpec.SRGB,
            sample_format=nvc.SampleFormat.I_Y if gray else nvc.SampleFormat.I_RGB,
        )

    def decode(self, token: Any, pick: np.ndarray, regions: np.ndarray, stream: int) -> Decoded:
        streams, info = token
        Region = self.nvc.Region
        sources = []
        for i, (y0, x0, y1, x1) in zip(pick.tolist(), regions.tolist()):
            cs = streams[i]
            full = (y0, x0, y1, x1) == (0, 0, int(info[i, 0]), int(info[i, 1]))
            sources.append(cs if full else cs.get_sub_code_stream(region=Region(y0, x0, y1, x1)))
        images = self.decoder.decode(sources, params=self.params, cuda_stream=stream)
        m = len(pick)
        status = np.zeros(m, dtype=np.int32)
        pointers = np.zeros(m, dtype=np.uint64)
        row_strides = np.zeros(m, dtype=np.int64)
        for j, img in enumerate(images):
            if img is None:
                continue
            iface = img.__cuda_array_interface__
            h, w, c = iface["shape"]
            y0, x0, y1, x1 = regions[j]
            if (h, w, c) != (y1 - y0, x1 - x0, self.channels):  # not what was asked: decode it another way
                continue
            strides = iface.get("strides")
            status[j], pointers[j], row_strides[j] = 1, iface["data"][0], strides[0] if strides else w * c
        return Decoded(status, pointers, row_strides, images)

    def close(self) -> None:
        self.decoder = None
