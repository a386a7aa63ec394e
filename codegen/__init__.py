"""IR -> CUDA C++ for Hopper (sm_90a), compiled by NVRTC from PyPI wheels (no GPU needed to build).

Stages, each usable on its own:

* :mod:`.toolchain` — finds NVRTC 13.0, the CuTe/CUTLASS headers, the CUDA 13 / CCCL / CRT
  headers and ``cuobjdump``; one :class:`ToolchainError` names what is missing.
* :mod:`.lower_gemm` — recognises a GEMM-shaped compute part and emits a warp-specialized,
  persistent TMA + WGMMA kernel (``include/tldsl/sm90_gemm.hpp``) whose producer runs the tile
  program's waits before each tile's loads; plus the host-side description (TMA descriptors,
  flat parameter list, launch shape).
* :mod:`.compiler` — NVRTC in a spawn process pool, progress lines, errors that point at the
  generated line and the tile program's line.
* :mod:`.cache` — content-addressed cubin cache (``$TLDSL_CACHE_DIR``).
* :mod:`.sass` — ``cuobjdump`` SASS / resource checks (HGMMA, UTMALDG, traps, spills).

The simulator (``tldsl.runtime.sim``) consumes the same IR; the GPU runtime that loads and
launches these cubins is the next piece.
"""
from .toolchain import Toolchain, ToolchainError, find_toolchain, toolchain_available, REQUIREMENTS
from .cache import KernelCache, cache_dir, cache_key
from .compiler import (CompileJob, CompiledKernel, CudaCompileError, ProgressEvent, compile_cuda, compile_many,
                       nvrtc_options, shutdown_pool)
from .sass import SassReport, KernelSass, analyze_cubin, parse_sass, parse_ptxas_log
from .lower_gemm import (GemmConfig, KernelParam, LoweredGemm, LoweringError, TmaDescriptorSpec, lower_gemm,
                         match_gemm)

from .lowered import LoweredKernel   # `tldsl.codegen.lower` stays the dispatcher module

__all__ = [n for n in dir() if not n.startswith("_")]
