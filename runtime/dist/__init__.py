"""The distributed runtime: ranks from torch.distributed (torchrun), symmetric memory from
torch's symmetric-memory layer (or NVSHMEM's heap), communication on the copy engine
(stream-ordered peer copies + stream memory writes for the flags; :mod:`..gpu.plan_exec` runs any
codegen copy-engine plan) or on a few SMs (generated communication kernels) feeding generated
kernels that wait per tile.

:class:`FusedProgram` is the one fused-op runtime: it runs any traced kernel's parts across the
group (what ``tl.run(..., group=...)`` uses), and the ops are built on it — :class:`AllGatherMoE`,
:class:`MoEReduceScatter`, :class:`SequenceParallelAttention`, and :class:`AllGatherMatmul`
(AllGather+GEMM) and :class:`MatmulReduceScatter` (GEMM+ReduceScatter), whose launches their
engine makes (:mod:`.engine`): the tile program on FusedProgram (:mod:`.program_engine`), or for
the schedules measured faster by hand a recipe (:mod:`.recipes`: :mod:`.ag_push`, :mod:`.ag_pull`,
:mod:`.gemm_rs_copy`); :mod:`.autotune` picks their schedules.
:class:`CommKernel` / :class:`SymmetricWorkspace` (:mod:`.comm_kernel`) launch one generated
communication kernel on its own, outside any op.

Symmetric memory is allocated and freed only at explicit collective points every rank reaches
in the same order (:mod:`.symmetric`): allocated when an op object is built, freed by its
``close()`` — never on a call or from garbage collection. An op dropped without ``close()``
keeps its memory (with a :class:`SymmetricMemoryWarning`) until :func:`release_unclosed`.
"""
from .group import DistContext, dist_context
from .ag_gemm import AllGatherMatmul
from .gemm_rs import MatmulReduceScatter
from ..gpu.plan_exec import DeviceArray, PlanExecutor, PointerTable, symmetric_addresses
from .comm_kernel import CommKernel, SymmetricWorkspace
from .autotune import Autotuner, AutotuneError
from .symmetric import SymmetricMemoryWarning, outstanding, release_unclosed
from .program_op import FusedProgram
from .moe_ops import AllGatherMoE, MoEReduceScatter
from .attention_op import SequenceParallelAttention

__all__ = ["DistContext", "dist_context", "AllGatherMatmul", "MatmulReduceScatter", "DeviceArray", "PlanExecutor",
           "PointerTable", "symmetric_addresses", "CommKernel", "SymmetricWorkspace", "Autotuner", "AutotuneError",
           "SymmetricMemoryWarning", "outstanding", "release_unclosed", "FusedProgram", "AllGatherMoE",
           "MoEReduceScatter", "SequenceParallelAttention"]
