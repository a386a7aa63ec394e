"""The distributed runtime: ranks from torch.distributed (torchrun), symmetric memory from
torch's symmetric-memory layer, communication on the copy engine (stream-ordered peer copies +
stream memory writes for the flags; :mod:`.plan_exec` runs any codegen copy-engine plan) or on
a few SMs (generated communication kernels, :mod:`.comm_kernel`) feeding generated kernels that
wait per tile: :class:`AllGatherMatmul` (AllGather+GEMM), :class:`MatmulReduceScatter`
(GEMM+ReduceScatter); :mod:`.autotune` picks their schedules.

Allocation of symmetric memory is collective: it happens only when an op object is built
(an explicit, documented point every rank reaches), never on a call or from garbage collection.
"""
from .group import DistContext, dist_context
from .ag_gemm import AllGatherMatmul
from .gemm_rs import MatmulReduceScatter
from .plan_exec import DeviceArray, PlanExecutor, PointerTable, symmetric_addresses
from .comm_kernel import CommKernel, SymmetricWorkspace
from .autotune import Autotuner, AutotuneError

__all__ = ["DistContext", "dist_context", "AllGatherMatmul", "MatmulReduceScatter", "DeviceArray", "PlanExecutor",
           "PointerTable", "symmetric_addresses", "CommKernel", "SymmetricWorkspace", "Autotuner", "AutotuneError"]
