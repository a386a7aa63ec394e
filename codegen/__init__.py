"""The code generator: a part of a traced kernel → CUDA C++ for Hopper (sm_90a) → a cubin.

One pipeline (:mod:`.pipeline`, ``lower(kernel, part)``), its stages visible in the folders:

* :mod:`.match` — each recipe's recogniser: a part's IR → a match, or a LoweringError at the
  user's line (:mod:`.match.affine`: affine forms of index expressions, shared);
* :mod:`.plan` — from a match and the schedules to a configuration and the kernel's ABI
  (tiles, stages, shared memory, parameters, TMA boxes; :mod:`.plan.wgmma` is the WGMMA
  mainloop both GEMM recipes plan);
* :mod:`.rules` — the C++ of one IR op each: index code (:mod:`.rules.scalars`), the TileLink
  primitives (:mod:`.rules.primitives`, each primitive in exactly one function), the hooks'
  signal emitter (:mod:`.rules.sync`);
* :mod:`.recipes` — the kernels the pipeline can build, in one table with priorities: the
  warp-specialised GEMM, the MoE grouped GEMM and combine, flash attention, the SM
  communication kernel and the copy-engine plan; each renders its template
  (``include/tldsl/*.hpp``) with its hooks through the rules;
* :mod:`.toolchain` — NVRTC (spawn pool, errors at the tile program's line), the
  content-addressed cubin cache, SASS checks.

Shared by all stages: :mod:`.abi` (parameters, TMA descriptors, names — what the GPU launcher
reads), :mod:`.dtypes` (the one dtype table), :mod:`.errors`, :mod:`.ir_queries` (what every
stage asks of the IR: index-code ops, enclosing ops, what a root needs, signal scopes). They
and the toolchain import no stage; a stage imports no stage after it (one exception: the
copy-engine plan describes its waits with the wait rule's own formula,
:func:`.rules.primitives.wait_target_formula`). The simulator (``tldsl.runtime.sim``) executes
the same IR; ``tldsl.runtime.gpu`` launches the cubins.
"""
from .toolchain import (REQUIREMENTS, CompileJob, CompiledKernel, CudaCompileError, KernelCache, KernelSass,
                        ProgressEvent, SassReport, Toolchain, ToolchainError, analyze_cubin, cache_dir, cache_key,
                        compile_cuda, compile_many, find_toolchain, nvrtc_options, parse_ptxas_log, parse_sass,
                        shutdown_pool, toolchain_available)
from .abi import KernelParam, LoweredKernel, TmaDescriptorSpec
from .errors import LoweringError
from .pipeline import lower, lower_all
from .recipes import RECIPES, Recipe
from .match.gemm import match_gemm
from .plan.wgmma import GemmConfig
from .recipes.gemm import LoweredGemm, lower_gemm
from .match.attention import match_attention
from .plan.attention import AttentionConfig
from .recipes.attention import LoweredAttention, lower_attention
from .match.grouped_gemm import match_grouped_gemm
from .recipes.grouped_gemm import LoweredGroupedGemm, lower_grouped_gemm
from .match.combine import match_combine
from .recipes.combine import LoweredCombine, lower_combine
from .match.comm import match_copy_engine, match_sm_comm
from .plan.copy_engine import CeCopy, CeSignalWrite, CeWait, CopyEnginePlan
from .recipes.copy_engine import plan_copy_engine
from .recipes.sm_comm import LoweredComm, lower_comm

__all__ = [n for n in dir() if not n.startswith("_")]
