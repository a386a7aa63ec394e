"""Batched device copies (``cuMemcpyBatchAsync``) for the probes that time copies beside kernels:
one place for the attributes every copy of a batch carries."""
from __future__ import annotations


def batch_copies(cu, dsts, srcs, sizes, stream, flags):
    """One ``cuMemcpyBatchAsync`` of ``len(sizes)`` copies (plain device addresses), every copy
    with the same attributes: stream-ordered source, ``flags``, location hints on device 0 (the
    driver ignores them for device memory). ``stream`` must not be the legacy default stream."""
    attr = cu.CUmemcpyAttributes()
    attr.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
    attr.flags = flags
    loc = cu.CUmemLocation()
    loc.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    loc.id = 0
    attr.srcLocHint = attr.dstLocHint = loc
    res = cu.cuMemcpyBatchAsync([cu.CUdeviceptr(p) for p in dsts], [cu.CUdeviceptr(p) for p in srcs], list(sizes),
                                len(sizes), [attr], [0], 1, stream)
    err = res[0] if isinstance(res, tuple) else res
    if err != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyBatchAsync: {err}")
