"""Pack a flat kernel parameter list and launch it (with a thread-block cluster if asked)."""
from __future__ import annotations

import ctypes

from .device import check


class ArgPack:
    """Kernel arguments as the ``void*[]`` the driver takes; keeps every value alive."""

    def __init__(self):
        self.holders: list = []

    def add(self, kind: str, value):
        if kind == "ptr":
            h = ctypes.c_void_p(int(value))
        elif kind == "i32":
            h = ctypes.c_int32(int(value))
        elif kind == "u64":
            h = ctypes.c_uint64(int(value))
        elif kind == "tma":
            if len(value) != 128:
                raise ValueError("a TMA descriptor is 128 bytes")
            h = (ctypes.c_uint64 * 16).from_buffer_copy(value)
        else:
            raise ValueError(f"unknown kernel parameter kind {kind!r}")
        self.holders.append(h)

    def address(self) -> int:
        self._arr = (ctypes.c_void_p * len(self.holders))(*[ctypes.addressof(h) for h in self.holders])
        return ctypes.addressof(self._arr)


def launch(kernel, grid, block, args: ArgPack, stream: int, cluster=(1, 1, 1)):
    from cuda.bindings import driver as cu
    if tuple(cluster) == (1, 1, 1):
        check(cu.cuLaunchKernel(kernel.function, *grid, *block, kernel.smem_bytes, stream, args.address(), 0),
              f"cuLaunchKernel({kernel.name})")
        return
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = kernel.smem_bytes
    cfg.hStream = stream
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    check(cu.cuLaunchKernelEx(cfg, kernel.function, args.address(), 0), f"cuLaunchKernelEx({kernel.name})")
