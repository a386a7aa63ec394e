"""The NVRTC toolchain: the last stage of the pipeline, from generated CUDA C++ to a cubin.

* :mod:`.locate` — finds NVRTC 13.0, the CuTe/CUTLASS headers, the CUDA 13 / CCCL / CRT
  headers and ``cuobjdump``; one :class:`ToolchainError` names what is missing.
* :mod:`.compiler` — NVRTC in a spawn process pool, progress lines, errors that point at the
  generated line and the tile program's line.
* :mod:`.cache` — content-addressed cubin cache (``$TLDSL_CACHE_DIR``).
* :mod:`.sass` — ``cuobjdump`` SASS / resource checks (HGMMA, UTMALDG, traps, spills).
"""
from .locate import ARCH, CCCL_TESTED, REQUIREMENTS, Toolchain, ToolchainError, find_toolchain, toolchain_available
from .cache import KernelCache, cache_dir, cache_key
from .compiler import (CompileJob, CompiledKernel, CudaCompileError, ProgressEvent, compile_cuda, compile_many,
                       nvrtc_options, shutdown_pool)
from .sass import KernelSass, SassReport, analyze_cubin, parse_ptxas_log, parse_sass

__all__ = [n for n in dir() if not n.startswith("_")]
