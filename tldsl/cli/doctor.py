"""``python -m tldsl doctor``: what is installed, one line each, and what its absence prevents.

Absent pieces are reported, not failed: a laptop without a GPU is a normal place to simulate
and compile. Installed pieces that cannot work together — an NVRTC or CUTLASS of the wrong
version, a torch whose NVSHMEM differs from the headers NVSHMEM kernels compile against — are
problems, and make the exit status 1. The versions are those of pyproject.toml's PINS.
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

CUTLASS_SERIES = "4.2."      # the CuTe/CUTLASS the kernels are written against (PINS)


@dataclass
class Finding:
    what: str
    says: str
    problem: bool = False


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def tldsl_itself() -> Finding:
    from .. import __version__
    return Finding("tldsl", f"{__version__} at {Path(__file__).resolve().parent.parent}")


def python() -> Finding:
    return Finding("python", f"{sys.version.split()[0]} ({sys.executable})")


def numpy() -> Finding:
    version = _version("numpy")
    return Finding("numpy", version or "missing: nothing runs without it (pip install -e .)", problem=version is None)


def torch() -> Finding:
    version = _version("torch")
    if version is None:
        return Finding("torch", "not installed: no GPU runtime, no distributed ops nor their host-side tests "
                                "(GPU host: pip install -e '.[gpu]'; tests: pip install torch, a CPU build)")
    try:
        import torch as t
    except Exception as ex:          # a broken install: say how, in one line
        return Finding("torch", f"{version} fails to import ({type(ex).__name__}: {ex})", problem=True)
    if t.version.cuda is None:
        return Finding("torch", f"{version}, a CPU build: the distributed runtime's host-side tests run; "
                                "nothing launches on a GPU")
    return Finding("torch", f"{version}, built for CUDA {t.version.cuda}")


def cuda_python() -> Finding:
    version = _version("cuda-bindings")
    if version is None:
        return Finding("cuda-python", "cuda-bindings not installed: neither NVRTC nor the CUDA driver can be called "
                                      "(pip install -e '.[cpu]', or '.[gpu]' on a GPU host)")
    return Finding("cuda-python", f"cuda-bindings {version}: NVRTC and the CUDA driver API can be called")


def nvrtc() -> tuple[Finding, Finding]:
    """The compile toolchain, and cuobjdump for the SASS checks."""
    from ..codegen.toolchain import find_toolchain, toolchain_available
    ok, why = toolchain_available()
    if not ok:
        first = why.strip().splitlines()[0]
        missing = first.startswith("CUDA toolchain incomplete")
        return (Finding("NVRTC", f"{first} — kernels cannot be compiled (simulating and lowering still work): "
                                 "pip install -e '.[cpu]'", problem=not missing),
                Finding("SASS", "no toolchain, no SASS checks"))
    tc = find_toolchain()
    says = f"{tc.nvrtc_version} with CUTLASS {tc.cutlass_version}, CCCL {tc.cccl_version}: kernels compile for sm_90a"
    problem = not tc.cutlass_version.startswith(CUTLASS_SERIES)
    if problem:
        says = (f"{tc.nvrtc_version} with CUTLASS {tc.cutlass_version}: the kernels are written against CUTLASS "
                f"{CUTLASS_SERIES}x (pip install nvidia-cutlass==4.2.0.0)")
    elif tc.notes:
        says += "; " + "; ".join(tc.notes)
    sass = (Finding("SASS", f"cuobjdump at {tc.cuobjdump}: the SASS checks run") if tc.cuobjdump else
            Finding("SASS", "cuobjdump not found: the SASS checks skip (pip install nvidia-cuda-cuobjdump)"))
    return Finding("NVRTC", says, problem), sass


def nvshmem() -> Finding:
    """The headers transport='nvshmem' kernels compile against, beside the NVSHMEM torch links."""
    from ..codegen.toolchain import ToolchainError, find_toolchain
    from ..codegen.toolchain.nvshmem_match import NVSHMEM_PINNED, header_version, mismatch, torch_nvshmem
    try:
        include = find_toolchain().nvshmem_include
    except ToolchainError:
        include = None
    linked = torch_nvshmem()
    torch_says = f"torch links {linked[2]} ({linked[1]})" if linked else "torch links none"
    if include is None:
        return Finding("NVSHMEM", f"no headers ({torch_says}): transport='nvshmem' kernels cannot compile "
                                  f"(pip install -e '.[cpu]' pins {NVSHMEM_PINNED}; on a GPU host they come with "
                                  "torch's nvidia-nvshmem wheel)")
    problem = mismatch(include)
    if problem:
        return Finding("NVSHMEM", "MISMATCH: " + problem, problem=True)
    headers = header_version(include) or "of unknown version"
    pinned = "the pinned version" if headers == NVSHMEM_PINNED else (
        f"not the pinned {NVSHMEM_PINNED} of the GPU hosts' torch: transport='nvshmem' is measured on that only")
    return Finding("NVSHMEM", f"headers {headers} ({pinned}); {torch_says}: transport='nvshmem' kernels compile")


def gpu() -> Finding:
    from ..runtime.gpu.device import require_gpu
    from .gates import gpu_missing
    why = gpu_missing()
    if why:
        return Finding("GPU", f"none usable: {why} — the GPU tests skip; bench (but compile and sim) and check "
                              "cannot run here")
    import torch as t
    return Finding("GPU", f"{t.cuda.device_count()} visible, device 0 {require_gpu()}: the GPU tests and "
                          "benchmarks run (ag_gemm, gemm_rs and the checks need 2, under torchrun)")


def torchrun() -> Finding:
    beside = Path(sys.executable).with_name("torchrun")        # this environment's, before any on PATH
    path = str(beside) if beside.exists() else shutil.which("torchrun")
    return Finding("torchrun", path or "not found: the two-GPU benchmarks and the checks need it (it comes with torch)")


def findings() -> list[Finding]:
    return [tldsl_itself(), python(), numpy(), torch(), cuda_python(), *nvrtc(), nvshmem(), gpu(), torchrun()]


def main() -> int:
    found = findings()
    width = max(len(f.what) for f in found) + 2
    for f in found:
        print(f"{f.what:<{width}}{f.says}")
    problems = [f.what for f in found if f.problem]
    if problems:
        print(f"doctor: {len(problems)} problem{'s' * (len(problems) != 1)} ({', '.join(problems)}): "
              "see pyproject.toml's PINS for the versions that work together", file=sys.stderr)
    return 1 if problems else 0
