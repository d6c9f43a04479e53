"""DecodeClip(device="cuda") without a GPU: its arguments, the lazy import of PyNvVideoCodec, the
frame numbers it asks for, and its errors through a fake decoder (the GPU runs are tests/gpu_video/)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

av = pytest.importorskip("av")

from sample_data import make_video  # noqa: E402

from headrace import ConfigError, DecodeError, Loader, ops, readers  # noqa: E402
from headrace.ops import _video_gpu  # noqa: E402
from headrace.ops._video import gpu_precheck  # noqa: E402
from headrace.ops._video_gpu import NvdecClips, clip_indices, resolve_video_device  # noqa: E402


def test_cuda_without_pynvvideocodec_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", None)  # import fails, as when it is not installed
    with pytest.raises(ConfigError, match=r"PyNvVideoCodec: pip install 'headrace\[video-gpu\]'"):
        ops.DecodeClip(device="cuda")
    with pytest.raises(ConfigError, match="PyNvVideoCodec"):
        ops.video_pipeline(size=8, device="cuda:0")
    assert ops.DecodeClip(device="auto").device == "cpu"  # auto: no PyNvVideoCodec, the CPU


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", types.ModuleType("PyNvVideoCodec"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        ops.DecodeClip(device="cuda")
    assert resolve_video_device("auto") == "cpu"


@pytest.mark.parametrize("bad", [{"device": "gpu"}, {"device": 0}, {"device": None}, {"decoders_per_thread": 0},
                                 {"decoders_per_thread": True}])
def test_wrong_arguments(bad):
    with pytest.raises(ConfigError):
        ops.DecodeClip(**bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: device='cuda' is not an error here")
def test_a_loader_on_cuda_without_a_gpu_is_a_config_error(tmp_path):
    make_video(tmp_path / "a" / "v.mp4", 8)
    with pytest.raises(ConfigError):
        Loader(readers.video(tmp_path, sequence_length=4), batch_size=2, device="cuda", pipeline=ops.video_pipeline())


async def test_frame_numbers_are_ranks_in_the_probes_sorted_timestamps(tmp_path):
    """The GPU path asks NVDEC for frames by number: the clip's start + stride * k must be where the
    sample's timestamps sit in the probe's sorted list (a variable-rate file, B-frames)."""
    stamps = [int(i * 40 + (i % 3) * 13 + (i // 10) * 7) for i in range(30)]
    make_video(tmp_path / "vfr" / "v.mkv", 30, pts=stamps)
    make_video(tmp_path / "h264" / "v.mp4", 30, gop=8)
    reader = readers.video(tmp_path, sequence_length=4, stride=3, step=2)
    infos, _ = reader.probed()
    samples = [s async for chunk in reader.read(0) for s in chunk]
    assert samples
    for s in samples:
        info = infos[0 if s.key.startswith("h264") else 1]
        indices = clip_indices(*(int(v) for v in s.fields["clip"]))
        assert np.array_equal(info.pts[indices], s.fields["pts"])
        assert np.all(np.diff(info.pts) > 0)  # sorted and distinct: a rank is a frame


class _Frame:
    """A DecodedFrame stand-in: DLPack of a CPU tensor, and a timestamp."""

    def __init__(self, tensor, pts):
        self.tensor, self.pts = tensor, pts

    def __dlpack__(self, stream=None):
        return self.tensor.__dlpack__()

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()

    def getPTS(self):
        return self.pts


def _fake_nvc(frames=10, pts=None, dtype=torch.uint8, fail=None, short=False):
    made = []

    class SimpleDecoder:
        def __init__(self, source, **kw):
            if fail:
                raise RuntimeError(fail)
            made.append(source)

        def __len__(self):
            return frames

        def seek_to_index(self, index):
            self.sought = index

        def get_batch_frames_by_index(self, indices):
            # NvdecClips seeks before each clip (a kept PyNvVideoCodec 2.2.4 decoder gave stale frames without)
            assert getattr(self, "sought", None) == indices[0], "no seek to the clip's first frame"
            self.sought = None
            out = [_Frame(torch.full((3, 4, 6), i, dtype=dtype), (pts or list(range(frames)))[i]) for i in indices]
            return out[:-1] if short else out

        def get_stream_metadata(self):
            return types.SimpleNamespace(average_fps=25.0)

        def reconfigure_decoder(self, source):
            made.append(("reconfigured", source))

    module = types.ModuleType("PyNvVideoCodec")
    module.SimpleDecoder = SimpleDecoder
    module.OutputColorType = types.SimpleNamespace(RGBP=1)
    return module, made


@pytest.fixture
def clips(monkeypatch):
    """An NvdecClips whose stream is a stand-in (no GPU here)."""
    monkeypatch.setattr(NvdecClips, "stream", lambda self: _stand_in_stream(self))
    return NvdecClips("cpu", decoders_per_thread=2)


def _stand_in_stream(self):
    local = self._local
    if getattr(local, "stream", None) is None:
        import collections

        local.stream, local.decoders = types.SimpleNamespace(cuda_stream=0), collections.OrderedDict()
    return local.stream


def _use(monkeypatch, **kw):
    module, made = _fake_nvc(**kw)
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", module)
    return made


def test_frames_come_in_order_and_decoders_are_kept_per_video(monkeypatch, clips):
    made = _use(monkeypatch)
    out, rate = clips.frames("a.mp4", "a.mp4", [2, 5, 8], np.array([2, 5, 8]), key="k")
    assert out.shape == (3, 3, 4, 6) and out[:, 0, 0, 0].tolist() == [2, 5, 8] and rate == 25.0
    clips.frames("a.mp4", "a.mp4", [0], None, key="k")
    clips.frames(b"xx", "s.tar:b.mp4", [1], None, key="k")
    clips.frames("c.mp4", "c.mp4", [1], None, key="k")  # a third video: the least recent decoder is reconfigured
    clips.frames(b"yy", "s.tar:d.mp4", [1], None, key="k")  # bytes: a new decoder, the least recent one dropped
    clips.frames("c.mp4", "c.mp4", [1], None, key="k")
    assert made == ["a.mp4", b"xx", ("reconfigured", "c.mp4"), b"yy"]


def test_timestamps_may_be_shifted_by_one_offset_per_video(monkeypatch, clips):
    """PyNvVideoCodec's timestamps come before the MP4 edit list: -1024 where PyAV says 0."""
    _use(monkeypatch, pts=[t - 1024 for t in range(0, 5120, 512)])
    clips.frames("v.mp4", "v.mp4", [2, 4], np.array([1024, 2048]), key="k")
    clips.frames("v.mp4", "v.mp4", [7], np.array([3584]), key="k")
    with pytest.raises(DecodeError, match="numbers this video's frames otherwise"):
        clips.frames("v.mp4", "v.mp4", [8], np.array([3584]), key="k")  # another shift: not the probe's frame


@pytest.mark.parametrize(("kw", "indices", "message"), [
    ({"frames": 10}, [8, 10], "finds 10 frames"),
    ({"short": True}, [1, 2], "delivered 1 of the clip's 2 frames"),
    ({"pts": [0, 7, 9, 12, 15, 18, 21, 24, 27, 30]}, [1, 3], "numbers this video's frames otherwise"),
    ({"dtype": torch.int16}, [1, 2], "8-bit"),
    ({"fail": "no decoder for this codec"}, [1], "NVDEC cannot decode the video: RuntimeError: no decoder"),
])
def test_what_nvdec_cannot_deliver_is_a_decode_error_naming_the_file(monkeypatch, clips, kw, indices, message):
    _use(monkeypatch, **kw)
    with pytest.raises(DecodeError, match=message) as info:
        clips.frames("v.mp4", "v.mp4", indices, np.array(indices), key="v.mp4@1")
    assert (info.value.key, info.value.source) == ("v.mp4@1", "v.mp4")


def test_the_gpu_precheck_reads_the_display_matrix_and_refuses_what_nvdec_gets_wrong(tmp_path):
    plain = make_video(tmp_path / "p.mp4", 8)
    assert gpu_precheck(str(plain)) == 0
    assert gpu_precheck(plain.read_bytes(), source="x") == 0
    with pytest.raises(DecodeError) as info:
        gpu_precheck(b"not a video", key="k", source="x.mp4")
    assert (info.value.key, info.value.source) == ("k", "x.mp4")
    mkv = make_video(tmp_path / "v.mkv", 8)
    with pytest.raises(DecodeError, match="Matroska"):
        gpu_precheck(str(mkv), key="k")
    sys.path.insert(0, str(Path(__file__).parents[1] / "gpu_video"))
    try:
        from video_data import hevc_10bit
    finally:
        sys.path.pop(0)
    ten = hevc_10bit(tmp_path / "ten.mp4", frames=4)
    if ten is not None:
        with pytest.raises(DecodeError, match="10-bit") as info:
            gpu_precheck(str(ten), key="k")
        assert info.value.source == str(ten)


def test_a_failed_decoder_is_not_kept_alive_by_its_error(monkeypatch, clips):
    import gc
    import weakref

    module, _ = _fake_nvc()
    alive = []

    class Failing(module.SimpleDecoder):
        def get_batch_frames_by_index(self, indices):
            alive.append(weakref.ref(self))
            raise RuntimeError("end of stream")

    module.SimpleDecoder = Failing
    monkeypatch.setitem(sys.modules, "PyNvVideoCodec", module)
    with pytest.raises(DecodeError) as info:
        clips.frames("v.mp4", "v.mp4", [1], None, key="k")
    gc.collect()
    assert info.value.__cause__ is not None and alive[0]() is None  # the file it holds is closed


def test_nvdec_clips_pickle_without_their_decoders():
    import pickle

    clips = NvdecClips("cpu", 3)
    again = pickle.loads(pickle.dumps(clips))
    assert again.decoders_per_thread == 3 and again.device == clips.device
    assert _video_gpu.DECODERS_PER_THREAD >= 1
