"""JPEG decode on the CPU with nvImageCodec's CPU backend (libjpeg-turbo), of only the window the ops read.

Why: on the 2-core benchmark machine, decoding was half of the CPU path's time. nvImageCodec's CPU
backend decodes a region of interest: it still reads the whole entropy-coded stream, but runs the
IDCT, upsampling and colour conversion only for the rows and columns of the crop. For
RandomResizedCrop windows that is 1.8x Pillow's whole-image decode (see ops/README.md). Its pixels
are libjpeg-turbo's with the same settings as Pillow's (accurate integer IDCT, fancy upsampling):
on every JPEG the tests make (4:2:0, 4:2:2, 4:4:4, gray, progressive, restart markers) the region
equals Pillow's decode then crop, bit for bit.

Which samples take this path: JPEGs with 1 or 3 components, 8 bits, whose last two bytes are the
EOI marker, when RGB output is asked for. Everything else, and any sample nvImageCodec fails on,
goes to Pillow, which also produces the typed error. The EOI rule keeps truncated files failing
whatever their crop: a region decode stops reading after the crop's last row, so a file cut below
it would decode. Damage inside a file that still ends in EOI (a corrupted scan) is different:
libjpeg-turbo decodes what it can, where Pillow may raise; the GPU path does the same.

The pixel limit (``Decode.max_pixels``) is checked on the header nvImageCodec parsed, before any
decode: a JPEG over it is the sample's DecodeError here, never handed to Pillow.

EXIF orientation is applied here, not by nvImageCodec: the window is drawn on the upright image,
mapped to the stored image (``stored_region``), decoded, then turned upright with tensor moves.
The orientation comes from ``_exif.jpeg_orientation``, as on the GPU path.

A ``Decoder`` must not be used by two threads at once (docs/gpu-notes.md §2), so each worker thread makes
its own, single-threaded, on first use; ``close()`` drops them all once the threads are joined.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._exif import jpeg_orientation, stored_region, upright
from .._limits import check_pixels, too_few_bits

__all__ = ["JpegDecoders"]

@dataclass(slots=True)
class Header:
    """A JPEG this module decodes: its code stream, upright size and EXIF orientation (1 when ignored)."""

    stream: Any
    height: int
    width: int
    orientation: int


class JpegDecoders:
    """nvImageCodec CPU decoders, one per calling thread, made on first use.

    ``header(data)`` says whether a sample is for this path; ``decode(jobs)`` returns each job's
    upright region as an HWC uint8 tensor, or None where nvImageCodec fails (the caller then uses Pillow).
    """

    def __init__(self, nvc: Any, *, exif: bool, max_pixels: int | None = None) -> None:
        self.nvc = nvc
        self.exif = exif
        self.max_pixels = max_pixels
        self.params = nvc.DecodeParams(
            apply_exif_orientation=False, color_spec=nvc.ColorSpec.SRGB, sample_format=nvc.SampleFormat.I_RGB
        )
        self._local = threading.local()
        self._lock = threading.Lock()
        self._made: list[Any] = []
        self._closed = False

    def header(self, data: Any, key: str | None = None, source: str | None = None) -> Header | None:
        """The header of a JPEG this path decodes; None for the others (not a JPEG, no EOI at the end,
        CMYK, 12-bit, unreadable header, too few bytes for its size). Raises DecodeError naming the
        sample when the header claims more than ``max_pixels``."""
        n = len(data)
        if n < 4 or data[0] != 0xFF or data[1] != 0xD8 or data[n - 2] != 0xFF or data[n - 1] != 0xD9:
            return None
        try:
            stream = self.nvc.CodeStream(np.frombuffer(data, dtype=np.uint8))
            if stream.codec_name != "jpeg" or stream.num_channels not in (1, 3) or stream.precision != 8:
                return None
            h, w = stream.height, stream.width
        except Exception:  # noqa: BLE001 - "Failed to get image info" and the like: Pillow says what is wrong
            return None
        check_pixels(w, h, self.max_pixels, key, source)
        if too_few_bits(n, h, w):  # as on the GPU path: Pillow decodes it, or says why not
            return None
        orientation = jpeg_orientation(data) if self.exif else 1
        if orientation >= 5:
            h, w = w, h
        return Header(stream, h, w, orientation)

    def decode(self, jobs: list[tuple[Header, tuple[int, int, int, int] | None]]) -> list[torch.Tensor | None]:
        """For each (header, region): the upright region (top, left, height, width; None: the whole
        image) as an HWC uint8 tensor, or None where nvImageCodec failed. One decode call for all."""
        dec = self._decoder()
        if dec is None:
            return [None] * len(jobs)
        streams, shapes = [], []
        try:
            for header, region in jobs:
                h, w = header.height, header.width
                top, left, ch, cw = region if region is not None else (0, 0, h, w)
                stream = header.stream
                if (top, left, ch, cw) != (0, 0, h, w):
                    sh, sw = (w, h) if header.orientation >= 5 else (h, w)
                    y0, x0, y1, x1 = stored_region(header.orientation, sh, sw, top, left, top + ch, left + cw)
                    stream = stream.get_sub_code_stream(region=self.nvc.Region(y0, x0, y1, x1))
                streams.append(stream)
                shapes.append((ch, cw, 3))
            images = dec.decode(streams, params=self.params)
        except Exception:  # noqa: BLE001 - the call raises only for bad arguments; Pillow takes over
            return [None] * len(jobs)
        return [self._upright(image, job[0].orientation, shape) for job, shape, image in zip(jobs, shapes, images)]

    @staticmethod
    def _upright(image: Any, orientation: int, shape: tuple[int, int, int]) -> torch.Tensor | None:
        if image is None:
            return None
        try:
            pixels = np.asarray(image)  # a view of the decoded buffer; the array keeps ``image`` alive
            if pixels.ndim != 3 or pixels.dtype != np.uint8:
                return None
            x = upright(torch.from_numpy(pixels), orientation)
        except Exception:  # noqa: BLE001 - an unexpected buffer: Pillow takes over
            return None
        return x if tuple(x.shape) == shape else None

    def _decoder(self) -> Any:
        dec = getattr(self._local, "decoder", None)
        if dec is None:
            nvc = self.nvc
            with self._lock:
                if self._closed:
                    return None
                try:
                    dec = nvc.Decoder(
                        device_id=nvc.NVIMGCODEC_DEVICE_CPU_ONLY,
                        max_num_cpu_threads=1,
                        backends=[nvc.Backend(nvc.BackendKind.CPU_ONLY)],
                    )
                except Exception:  # noqa: BLE001 - remember the failure: this thread uses Pillow
                    dec = False
                self._made.append(dec)
            self._local.decoder = dec
        return dec or None

    def close(self) -> None:
        """Drop every thread's decoder. Call after the threads that used them are joined."""
        with self._lock:
            self._closed = True
            self._made.clear()
        self._local = threading.local()
