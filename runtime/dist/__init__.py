"""The distributed runtime: ranks from torch.distributed (torchrun), symmetric memory from
torch's symmetric-memory layer (NVSHMEM backend where available), communication on the copy
engine (stream-ordered peer copies + stream memory writes for the flags) feeding generated
kernels that wait per tile.

Allocation of symmetric memory is collective: it happens only when an op object is built
(an explicit, documented point every rank reaches), never on a call or from garbage collection.
"""
from .group import DistContext, dist_context
from .ag_gemm import AllGatherMatmul

__all__ = ["DistContext", "dist_context", "AllGatherMatmul"]
