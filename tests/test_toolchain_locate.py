"""Where the toolchain's pieces are found: cuda.pathfinder first, the pinned wheels before any
other CUDA, and the same errors as before when a piece is missing. A stand-in pathfinder says
what each search finds, so these run anywhere."""
import sys
from pathlib import Path

import pytest
from cuda.pathfinder import DynamicLibNotFoundError, LocatedHeaderDir

from tldsl.codegen.toolchain import ToolchainError, locate


class FakePathfinder:
    def __init__(self, headers=None, binaries=None, nvrtc_error=None):
        self.headers, self.binaries, self.nvrtc_error = headers or {}, binaries or {}, nvrtc_error

    def locate_nvidia_header_directory(self, libname):
        return self.headers.get(libname)

    def find_nvidia_binary_utility(self, name):
        return self.binaries.get(name)

    def load_nvidia_dynamic_lib(self, name):
        if self.nvrtc_error:
            raise self.nvrtc_error


@pytest.fixture
def fresh_search(monkeypatch):
    """No wheel on sys.path, and the cached answers forgotten before and after."""
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p])
    for var in ("TLDSL_CUTLASS_INCLUDE", "TLDSL_CUDA_INCLUDE", "TLDSL_NVSHMEM_INCLUDE", "TLDSL_CUOBJDUMP"):
        monkeypatch.delenv(var, raising=False)
    locate.find_toolchain.cache_clear()
    locate.load_nvrtc.cache_clear()
    yield
    locate.find_toolchain.cache_clear()
    locate.load_nvrtc.cache_clear()


def _headers(root: Path, rel: str, probe: str) -> Path:
    d = root / rel
    (d / probe).parent.mkdir(parents=True, exist_ok=True)
    (d / probe).write_text("// stand-in")
    return d


def test_a_wheel_beats_a_system_toolkit(tmp_path, monkeypatch, fresh_search):
    wheel = _headers(tmp_path / "site", "nvidia/cu13/include", "cuda_runtime_api.h")
    toolkit = _headers(tmp_path / "usr", "cuda/include", "cuda_runtime_api.h")
    notes = []
    # pathfinder found the wheel in a site directory: taken as is
    monkeypatch.setattr(locate, "_pathfinder", lambda: FakePathfinder(
        {"cudart": LocatedHeaderDir(str(wheel), "site-packages")}))
    assert locate._header_dir("cudart", "nvidia/cu13/include", "cuda_runtime_api.h", notes) == wheel.resolve()
    # pathfinder found only $CUDA_PATH's: a wheel reached through PYTHONPATH comes first ...
    monkeypatch.setattr(locate, "_pathfinder", lambda: FakePathfinder(
        {"cudart": LocatedHeaderDir(str(toolkit), "CUDA_PATH")}))
    monkeypatch.setattr(sys, "path", sys.path + [str(tmp_path / "site")])
    assert locate._header_dir("cudart", "nvidia/cu13/include", "cuda_runtime_api.h", notes) == wheel
    assert notes == []
    # ... and without one, the toolkit's headers are used, with a note saying they are not the pins
    monkeypatch.setattr(sys, "path", sys.path[:-1])
    assert locate._header_dir("cudart", "nvidia/cu13/include", "cuda_runtime_api.h", notes) == toolkit.resolve()
    assert notes == [f"note: cudart headers from CUDA_PATH ({toolkit.resolve()}), not the pinned wheels"]


def test_a_folder_without_the_probe_is_no_answer(tmp_path, monkeypatch, fresh_search):
    empty = tmp_path / "include"
    empty.mkdir()
    monkeypatch.setattr(locate, "_pathfinder", lambda: FakePathfinder(
        {"cute": LocatedHeaderDir(str(empty), "site-packages")}))
    assert locate._header_dir("cute", "cutlass_library/source/include", "cute/tensor.hpp", []) is None


def test_missing_pieces_keep_their_messages(monkeypatch, fresh_search):
    monkeypatch.setattr(locate, "_pathfinder", lambda: FakePathfinder())
    with pytest.raises(ToolchainError, match=r"the CUTLASS/CuTe headers \(cute/tensor.hpp\) were not found"
                                             r"(.|\n)*pip install nvidia-cutlass==4.2.0.0"):
        locate.find_toolchain()


def test_nvrtc_that_cannot_be_loaded_says_what_to_install(monkeypatch, fresh_search):
    monkeypatch.setattr(locate, "_pathfinder", lambda: FakePathfinder(
        nvrtc_error=DynamicLibNotFoundError("libnvrtc.so.13 not found")))
    with pytest.raises(ToolchainError, match=r"libnvrtc could not be loaded(.|\n)*nvidia-cuda-nvrtc==13.0.88"):
        locate.load_nvrtc()


def test_cuobjdump_override_then_pathfinder_then_path(tmp_path, monkeypatch, fresh_search):
    exe = tmp_path / "bin" / "cuobjdump"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setattr(locate, "_pathfinder", lambda: FakePathfinder(binaries={"cuobjdump": "/pf/cuobjdump"}))
    monkeypatch.setenv("TLDSL_CUOBJDUMP", str(exe))
    assert locate._find_cuobjdump() == exe
    monkeypatch.delenv("TLDSL_CUOBJDUMP")
    assert locate._find_cuobjdump() == Path("/pf/cuobjdump")
    monkeypatch.setattr(locate, "_pathfinder", lambda: FakePathfinder())
    monkeypatch.setenv("PATH", str(exe.parent))
    assert locate._find_cuobjdump() == exe
