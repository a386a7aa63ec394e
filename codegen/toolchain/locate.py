"""Find the CUDA device toolchain tldsl compiles with: NVRTC, the CUTLASS/CuTe headers, the
CUDA 13 runtime / CCCL / CRT headers, and ``cuobjdump`` for SASS checks.

Everything comes from PyPI wheels (no CUDA toolkit install, no GPU):

=====================  =======================  ==============================================
what                   wheel                    where (relative to site-packages)
=====================  =======================  ==============================================
NVRTC 13.0             nvidia-cuda-nvrtc        ``nvidia/cu13/lib/libnvrtc.so.13``
Python bindings        cuda-bindings            ``cuda.bindings.nvrtc``
CuTe / CUTLASS         nvidia-cutlass           ``cutlass_library/source/include``
runtime headers        nvidia-cuda-runtime      ``nvidia/cu13/include``
CCCL 3.0 (libcu++)     nvidia-cuda-cccl         ``nvidia/cu13/include/cccl``
CRT headers            nvidia-cuda-crt          ``nvidia/cu13/include/crt``
cuobjdump (optional)   nvidia-cuda-cuobjdump    ``nvidia/cu13/bin/cuobjdump``
=====================  =======================  ==============================================

Version pins that matter (measured, see the project's NVRTC notes): NVRTC must be 13.0.x
(the H200 hosts' driver is CUDA 13.0 and cannot load code from a newer NVRTC), and CCCL must
be 13.0.85 (CCCL 3.0.1; CUTLASS 4.2 does not compile under NVRTC with CCCL >= 3.2).

How they are found: ``cuda.pathfinder`` (NVIDIA's search, which cuda-bindings itself loads NVRTC
through) finds NVRTC, the headers of CUTLASS, the CUDA runtime and NVSHMEM, and ``cuobjdump`` — in
installed wheels first, then conda, ``$CUDA_PATH``/``$CUDA_HOME`` and the system's folders. What
stays ours, and why: wheels reached only through ``sys.path`` (``pip install --target`` +
``PYTHONPATH``, as on the GPU hosts) are looked for before pathfinder's non-wheel places, because
pathfinder searches site directories only and the pinned wheels must win over a system toolkit;
CCCL and the CRT headers are taken beside the runtime headers (``cccl/``, ``crt/``), so the three
come from one CUDA (pathfinder has no ``crt`` entry, and its ``cccl`` may come from another
install); versions are read from the wheels' metadata, which pathfinder does not report.

Environment overrides (tldsl/env.py lists them all): ``TLDSL_CUTLASS_INCLUDE`` (a dir holding
``cute/`` and ``cutlass/``), ``TLDSL_CUDA_INCLUDE`` (a dir holding ``cuda_runtime_api.h`` and
``cccl/``), ``TLDSL_NVSHMEM_INCLUDE``, ``TLDSL_CUOBJDUMP`` (the cuobjdump executable).

Discovery is lazy and cheap (no library is loaded until :meth:`Toolchain.nvrtc` is used),
so a compile-cache hit does not pay for loading NVRTC.
"""
from __future__ import annotations

import functools
import os
import shutil
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from ... import env
from ...errors import TldslError
from .nvshmem_match import NVSHMEM_PINNED, header_version as nvshmem_header_version, mismatch as nvshmem_mismatch

ARCH = "sm_90a"
NVRTC_REQUIRED = (13, 0)
CCCL_TESTED = ("13.0.85", "13.1.115")

#: One line per wheel, for error messages and the report of what to install.
REQUIREMENTS = (
    "nvidia-cuda-nvrtc==13.0.88",
    "nvidia-cuda-cccl==13.0.85",
    "nvidia-cuda-runtime",
    "nvidia-cuda-crt",
    "cuda-bindings",
    "nvidia-cutlass==4.2.0.0 (only its headers are used)",
    "nvidia-cuda-cuobjdump, nvidia-cuda-nvdisasm (optional: SASS checks)",
)

INCLUDE_DIR = Path(__file__).resolve().parent.parent / "include"   # tldsl's own C++ headers


class ToolchainError(TldslError):
    """A piece of the CUDA toolchain is missing or has the wrong version."""


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _pathfinder():
    """``cuda.pathfinder`` (cuda-bindings depends on it: present wherever NVRTC can be loaded)."""
    try:
        import cuda.pathfinder as pathfinder
    except ImportError:
        raise _missing("cuda.pathfinder is not installed", "pip install cuda-bindings (it brings cuda-pathfinder)") from None
    return pathfinder


def _find_under_site(rel: str, probe: str) -> Path | None:
    """``rel`` under a ``sys.path`` entry, holding ``probe``: wheels installed with ``pip install
    --target DIR`` and reached through ``PYTHONPATH``, which pathfinder does not search."""
    for d in dict.fromkeys(p for p in sys.path if p):
        cand = Path(d) / rel
        if (cand / probe).exists():
            return cand
    return None


def _header_dir(libname: str, rel: str, probe: str, notes: list[str]) -> Path | None:
    """The folder holding ``probe`` for pathfinder's ``libname``: an installed wheel's, else a
    wheel's on ``sys.path`` (``rel`` under it), else pathfinder's other places (conda, CUDA_PATH,
    the system), which are noted because they are not the pinned wheels."""
    found = _pathfinder().locate_nvidia_header_directory(libname)
    if found is not None and not (found.abs_path and (Path(found.abs_path) / probe).exists()):
        found = None
    if found is not None and found.found_via == "site-packages":
        return Path(found.abs_path)
    on_path = _find_under_site(rel, probe)
    if on_path is not None:
        return on_path
    if found is None:
        return None
    notes.append(f"note: {libname} headers from {found.found_via} ({found.abs_path}), not the pinned wheels")
    return Path(found.abs_path)


@dataclass(frozen=True)
class Toolchain:
    """Where the headers and tools are, and their versions. Build one with :func:`find_toolchain`."""
    cutlass_include: Path
    cuda_include: Path
    cccl_include: Path
    cutlass_version: str
    cccl_version: str
    nvrtc_version: str              # the wheel's version, e.g. "13.0.88" (or "13.0" from nvrtcVersion)
    cuobjdump: Path | None
    tldsl_include: Path = INCLUDE_DIR
    notes: tuple[str, ...] = field(default=())
    nvshmem_include: Path | None = None     # NVSHMEM's headers (optional: NVSHMEM-transport kernels only)
    nvshmem_version: str | None = None

    @property
    def include_dirs(self) -> list[Path]:
        """Include order that works for CuTe under NVRTC: ours, CUTLASS, cu13, cu13/cccl (then
        NVSHMEM's, where installed)."""
        dirs = [self.tldsl_include, self.cutlass_include, self.cuda_include, self.cccl_include]
        return dirs + ([self.nvshmem_include] if self.nvshmem_include is not None else [])

    def require_nvshmem(self) -> None:
        """NVSHMEM's headers are here, and of the NVSHMEM the installed torch links (when it links one)."""
        if self.nvshmem_include is None:
            raise _missing("NVSHMEM's headers (nvidia/nvshmem/include/nvshmem.h) were not found: a kernel with "
                           "transport='nvshmem' includes them", f"pip install nvidia-nvshmem-cu13=={NVSHMEM_PINNED} "
                           "(the version the GPU hosts' torch links; device headers must match the host library)")
        problem = nvshmem_mismatch(self.nvshmem_include)
        if problem:
            raise ToolchainError(problem)

    def versions(self) -> dict[str, str]:
        return {"nvrtc": self.nvrtc_version, "cutlass": self.cutlass_version, "cccl": self.cccl_version,
                "arch": ARCH, "cuobjdump": str(self.cuobjdump) if self.cuobjdump else "absent"}

    def nvrtc(self):
        """The ``cuda.bindings.nvrtc`` module, after checking the loaded library is NVRTC 13.0."""
        return load_nvrtc()

    def __repr__(self) -> str:
        """One line of versions (``str()``: the paths as well)."""
        return (f"Toolchain(NVRTC {self.nvrtc_version}, CUTLASS {self.cutlass_version}, CCCL {self.cccl_version}, "
                f"NVSHMEM {self.nvshmem_version or 'absent'}, cuobjdump {'found' if self.cuobjdump else 'absent'})")

    def __str__(self) -> str:
        lines = [f"NVRTC {self.nvrtc_version} (arch {ARCH})",
                 f"CUTLASS/CuTe {self.cutlass_version}: {self.cutlass_include}",
                 f"CUDA headers: {self.cuda_include}",
                 f"CCCL {self.cccl_version}: {self.cccl_include}",
                 f"cuobjdump: {self.cuobjdump or 'not found (SASS checks unavailable)'}"]
        return "\n".join(lines + list(self.notes))


def _missing(what: str, hint: str) -> ToolchainError:
    return ToolchainError(
        f"CUDA toolchain incomplete: {what}.\n  {hint}\n"
        "tldsl compiles device code with NVRTC from PyPI wheels; install them with\n"
        "  pip install nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-cccl==13.0.85 nvidia-cuda-runtime "
        "nvidia-cuda-crt cuda-bindings nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm\n"
        "  pip install nvidia-cutlass==4.2.0.0")


@functools.lru_cache(maxsize=None)
def load_nvrtc():
    """NVRTC's Python bindings, loaded once and checked to be the 13.0.x the GPU hosts' driver loads
    cubins from (a toolchain error that says what to install otherwise)."""
    try:
        _pathfinder().load_nvidia_dynamic_lib("nvrtc")   # the handle cuda.bindings itself loads (and caches)
    except ToolchainError:
        raise
    except Exception as ex:   # DynamicLibNotFoundError and its kin
        raise _missing("libnvrtc could not be loaded", f"({ex}); install nvidia-cuda-nvrtc==13.0.88") from None
    try:
        from cuda.bindings import nvrtc
    except ImportError as ex:
        raise _missing("cuda.bindings.nvrtc cannot be imported", f"({ex}); install cuda-bindings") from None
    try:
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as ex:  # the bindings import, but libnvrtc.so.13 is not loadable
        raise _missing("libnvrtc could not be loaded", f"({ex}); install nvidia-cuda-nvrtc==13.0.88") from None
    if (major, minor) != NVRTC_REQUIRED:
        raise ToolchainError(
            f"NVRTC {major}.{minor} found, tldsl needs {NVRTC_REQUIRED[0]}.{NVRTC_REQUIRED[1]}: the H200 hosts' "
            "driver (CUDA 13.0) cannot load code from a newer NVRTC. pip install nvidia-cuda-nvrtc==13.0.88")
    return nvrtc


@functools.lru_cache(maxsize=None)
def find_toolchain() -> Toolchain:
    """Locate every piece; raise one :class:`ToolchainError` naming what is missing."""
    notes = []
    # CUTLASS / CuTe headers
    override = env.get("TLDSL_CUTLASS_INCLUDE")
    if override:
        cutlass_inc = Path(override)
        if not (cutlass_inc / "cute" / "tensor.hpp").exists():
            raise _missing(f"TLDSL_CUTLASS_INCLUDE={override} holds no cute/tensor.hpp", "point it at CUTLASS's include/")
    else:
        cutlass_inc = _header_dir("cute", os.path.join("cutlass_library", "source", "include"), "cute/tensor.hpp",
                                  notes)
        if cutlass_inc is None:
            raise _missing("the CUTLASS/CuTe headers (cute/tensor.hpp) were not found",
                           "pip install nvidia-cutlass==4.2.0.0")
    cutlass_version = _dist_version("nvidia-cutlass") or _header_version(cutlass_inc / "cutlass" / "version.h")

    # CUDA runtime + CCCL + CRT headers
    override = env.get("TLDSL_CUDA_INCLUDE")
    if override:
        cuda_inc = Path(override)
        if not (cuda_inc / "cuda_runtime_api.h").exists():
            raise _missing(f"TLDSL_CUDA_INCLUDE={override} holds no cuda_runtime_api.h", "point it at a CUDA 13 include/")
    else:
        cuda_inc = _header_dir("cudart", os.path.join("nvidia", "cu13", "include"), "cuda_runtime_api.h", notes)
        if cuda_inc is None:
            raise _missing("the CUDA 13 runtime headers (nvidia/cu13/include/cuda_runtime_api.h) were not found",
                           "pip install nvidia-cuda-runtime")
    cccl_inc = cuda_inc / "cccl"     # beside the runtime headers: one CUDA's (module docstring)
    if not (cccl_inc / "cuda" / "std" / "type_traits").exists():
        raise _missing(f"CCCL headers are missing under {cccl_inc}", "pip install nvidia-cuda-cccl==13.0.85")
    if not (cuda_inc / "crt" / "mma.h").exists():
        raise _missing(f"CRT headers are missing under {cuda_inc / 'crt'}", "pip install nvidia-cuda-crt")
    cccl_version = _dist_version("nvidia-cuda-cccl") or _cccl_header_version(cccl_inc)
    if cccl_version not in CCCL_TESTED:
        notes.append(f"warning: nvidia-cuda-cccl {cccl_version} is untested; CUTLASS 4.2 is known to fail under "
                     "NVRTC with CCCL >= 3.2 (pin nvidia-cuda-cccl==13.0.85)")

    # NVRTC: the wheel's version, without loading the library (a cache hit must stay cheap).
    nvrtc_version = _dist_version("nvidia-cuda-nvrtc")
    if nvrtc_version is None:
        nvrtc = load_nvrtc()
        _, major, minor = nvrtc.nvrtcVersion()
        nvrtc_version = f"{major}.{minor}"
    elif not nvrtc_version.startswith("13.0."):
        raise ToolchainError(
            f"nvidia-cuda-nvrtc {nvrtc_version} is installed, tldsl needs 13.0.x: the H200 hosts' driver (CUDA 13.0) "
            "cannot load code from a newer NVRTC. pip install nvidia-cuda-nvrtc==13.0.88")
    else:
        try:
            import importlib.util
            if importlib.util.find_spec("cuda.bindings") is None:
                raise ImportError("cuda.bindings")
        except (ImportError, ValueError):
            raise _missing("cuda.bindings (Python bindings for NVRTC) is not installed", "pip install cuda-bindings") from None

    override = env.get("TLDSL_NVSHMEM_INCLUDE")
    nvshmem_inc = (Path(override) if override else
                   _header_dir("nvshmem", os.path.join("nvidia", "nvshmem", "include"), "nvshmem.h", notes))
    if nvshmem_inc is not None and not (nvshmem_inc / "nvshmem.h").exists():
        raise _missing(f"TLDSL_NVSHMEM_INCLUDE={override} holds no nvshmem.h", "point it at NVSHMEM's include/")
    nvshmem_version = ((_dist_version("nvidia-nvshmem-cu13") or nvshmem_header_version(nvshmem_inc))
                       if nvshmem_inc is not None else None)
    return Toolchain(cutlass_inc, cuda_inc, cccl_inc, cutlass_version, cccl_version, nvrtc_version,
                     _find_cuobjdump(), INCLUDE_DIR, tuple(notes), nvshmem_inc, nvshmem_version)


def _find_cuobjdump() -> Path | None:
    """``$TLDSL_CUOBJDUMP``, else pathfinder's (wheels, conda, CUDA_PATH), else a wheel's on
    ``sys.path``, else ``PATH`` (pathfinder does not search ``PATH``)."""
    override = env.get("TLDSL_CUOBJDUMP")
    if override:
        return Path(override) if Path(override).exists() else None
    found = _pathfinder().find_nvidia_binary_utility("cuobjdump")
    if found:
        return Path(found)
    d = _find_under_site(os.path.join("nvidia", "cu13", "bin"), "cuobjdump")
    if d is not None:
        return d / "cuobjdump"
    w = shutil.which("cuobjdump")
    return Path(w) if w else None


def _header_version(path: Path) -> str:
    import re
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    parts = [re.search(rf"#define CUTLASS_{k} (\d+)", text) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else "unknown"


def _cccl_header_version(cccl_inc: Path) -> str:
    import re
    try:
        text = (cccl_inc / "cuda" / "std" / "__cccl" / "version.h").read_text()
    except OSError:
        return "unknown"
    m = re.search(r"#define CCCL_VERSION (\d+)", text)
    return f"cccl-{m.group(1)}" if m else "unknown"


def toolchain_available() -> tuple[bool, str]:
    """(True, "") when everything needed to compile is present, else (False, the reason)."""
    try:
        find_toolchain()
        load_nvrtc()
    except ToolchainError as ex:
        return False, str(ex)
    return True, ""
