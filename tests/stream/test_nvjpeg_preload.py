"""nvImageCodec's libnvjpeg loaded before another package's (``headrace/_nvjpeg.py``).

This machine has no nvJPEG: real shared libraries (copies of zlib) stand in for the copies, so
what is mapped is the process's own ``/proc/self/maps``. Each case runs in a
fresh interpreter, since a mapped library stays for the process's life. The GPU machine's test
with torchvision's own copy is tests/gpu/test_gpu_decoders.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from headrace import _nvjpeg

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
ZLIB = Path("/lib/x86_64-linux-gnu/libz.so.1")


@pytest.fixture
def copies(tmp_path):
    if not ZLIB.exists():
        pytest.skip("no zlib at its Debian path to copy")
    wheel = tmp_path / "nvidia" / "cu13" / "lib" / "libnvjpeg.so.13"
    other = tmp_path / "torchvision.libs" / "libnvjpeg.36e11081.so.13"
    extension = tmp_path / "ext" / "libnvjpeg_ext.so.0.9.0"
    for path in (wheel, other, extension):
        path.parent.mkdir(parents=True)
        shutil.copy(ZLIB, path)
    return SimpleNamespace(wheel=wheel, other=other, extension=extension)


def _run(body: str, copies) -> list[str]:
    # The module is loaded from its file, not through ``import headrace``, whose own preload would
    # map the real nvJPEG first where its wheel is installed (the GPU machine).
    script = textwrap.dedent(f"""
        import ctypes, importlib.util
        from pathlib import Path
        spec = importlib.util.spec_from_file_location("nvjpeg_alone", {_nvjpeg.__file__!r})
        _nvjpeg = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_nvjpeg)
        _nvjpeg._wheel_library = lambda: Path({str(copies.wheel)!r})
        wheel, other, extension = {str(copies.wheel)!r}, {str(copies.other)!r}, {str(copies.extension)!r}
    """) + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_preload_maps_the_wheels_copy_first(copies):
    out = _run("""
        print(_nvjpeg.preload())
        ctypes.CDLL(other)  # torchvision imported after headrace
        ctypes.CDLL(extension)  # nvImageCodec's extension is not a copy of libnvjpeg
        print(_nvjpeg.mapped())
        print(_nvjpeg.preload())  # once per process
    """, copies)
    assert out == [str(copies.wheel), str(sorted([str(copies.wheel), str(copies.other)])), str(copies.wheel)]


def test_preload_leaves_a_process_where_another_copy_is_mapped(copies):
    out = _run("""
        ctypes.CDLL(other)  # torchvision imported before headrace
        print(_nvjpeg.preload())
        print(_nvjpeg.mapped())
    """, copies)
    assert out == ["None", str([str(copies.other)])]


def test_preload_without_the_wheel_or_a_loadable_library(copies):
    out = _run("""
        _nvjpeg._wheel_library = lambda: None
        print(_nvjpeg.preload(), _nvjpeg.mapped())
        _nvjpeg._wheel_library = lambda: Path(wheel).with_name("libnvjpeg.so.99")  # not there
        print(_nvjpeg.preload(), _nvjpeg.mapped())
    """, copies)
    assert out == ["None []", "None []"]


@pytest.mark.parametrize("major", [13, 12])
def test_the_wheels_copy_of_nvimgcodecs_cuda_major_is_found_beside_it(major, tmp_path, monkeypatch):
    package = tmp_path / "nvidia" / "nvimgcodec"
    package.mkdir(parents=True)
    spec = SimpleNamespace(submodule_search_locations=[str(package)])
    monkeypatch.setattr(_nvjpeg.importlib.util, "find_spec", lambda name: spec)
    monkeypatch.setattr(_nvjpeg, "_cuda_major", lambda: major)
    assert _nvjpeg._wheel_library() is None
    other = 25 - major  # the other CUDA major's copy is never the one
    for folder, name in ((f"cu{other}/lib", f"libnvjpeg.so.{other}"), ("nvjpeg/lib", f"libnvjpeg.so.{other}")):
        (tmp_path / "nvidia" / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / "nvidia" / folder / name).write_bytes(b"")
    assert _nvjpeg._wheel_library() is None
    (tmp_path / "nvidia" / "nvjpeg" / "lib" / f"libnvjpeg.so.{major}").write_bytes(b"")
    assert _nvjpeg._wheel_library() == tmp_path / "nvidia" / "nvjpeg" / "lib" / f"libnvjpeg.so.{major}"
    (tmp_path / "nvidia" / f"cu{major}" / "lib").mkdir(parents=True)
    (tmp_path / "nvidia" / f"cu{major}" / "lib" / f"libnvjpeg.so.{major}").write_bytes(b"")
    assert _nvjpeg._wheel_library() == tmp_path / "nvidia" / f"cu{major}" / "lib" / f"libnvjpeg.so.{major}"  # RPATH order
    monkeypatch.setattr(_nvjpeg.importlib.util, "find_spec", lambda name: None)
    assert _nvjpeg._wheel_library() is None


def test_the_cuda_major_is_the_nvimgcodec_distributions(monkeypatch):
    installed = {"nvidia-nvimgcodec-cu12"}

    def version(name):
        if name not in installed:
            raise _nvjpeg.importlib.metadata.PackageNotFoundError(name)
        return "0.9.0"

    monkeypatch.setattr(_nvjpeg.importlib.metadata, "version", version)
    assert _nvjpeg._cuda_major() == 12
    installed = {"nvidia-nvimgcodec-cu13"}
    assert _nvjpeg._cuda_major() == 13
    installed = set()
    assert _nvjpeg._cuda_major() is None


def test_the_warning_names_the_copies_once(monkeypatch):
    monkeypatch.setattr(_nvjpeg, "_warned", False)
    monkeypatch.setattr(_nvjpeg, "mapped", lambda: ["/site/torchvision.libs/libnvjpeg.36e11081.so.13"])
    with pytest.warns(RuntimeWarning, match=r"all 256 images.*torchvision\.libs/libnvjpeg\.36e11081\.so\.13.*import headrace before"):
        _nvjpeg.warn_unusable(256)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _nvjpeg.warn_unusable(256)  # once per process
