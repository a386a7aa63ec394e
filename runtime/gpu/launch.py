"""Pack a flat kernel parameter list and launch it (with a thread-block cluster if asked).

Through cuda.bindings' ``cuLaunchKernel`` on arguments packed once, not ``cuda.core.launch``:
measured no better, and it cannot pass our TMA descriptors (:mod:`.module` has the numbers)."""
from __future__ import annotations

import ctypes

from .device import check


class ArgPack:
    """Kernel arguments as the ``void*[]`` the driver takes; keeps every value alive, and (``refs``)
    the tensors whose addresses it packed: a launch prepared once must never write into memory
    the allocator has since handed to another tensor."""

    def __init__(self):
        self.holders: list = []
        self.refs: list = []
        self._arr = None

    def hold(self, tensor) -> None:
        """Keep ``tensor`` alive as long as this pack (its address is one of the arguments)."""
        self.refs.append(tensor)

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
        self._arr = None

    def set(self, index: int, value: int) -> None:
        """Change a scalar argument in place (the launch epoch of a cached pack)."""
        self.holders[index].value = int(value)

    def address(self) -> int:
        if self._arr is None:
            self._arr = (ctypes.c_void_p * len(self.holders))(*[ctypes.addressof(h) for h in self.holders])
        return ctypes.addressof(self._arr)


class PreparedLaunch:
    """A kernel with its arguments packed and validated once: :meth:`launch` sets the launch
    epoch (when the kernel takes one) and enqueues it — one driver call, no Python-side
    checks. The ops cache these per set of tensor addresses, because the host time of a
    launch is on the critical path of a fused op when the device is idle."""

    def __init__(self, kernel, grid, block, pack: ArgPack, launch_slot: int | None, cluster=(1, 1, 1),
                 enqueue=None):
        """``enqueue(stream, pack, launch_index)``: how to launch, when not :func:`launch`."""
        self.kernel, self.grid, self.block, self.pack = kernel, tuple(grid), tuple(block), pack
        self.launch_slot = launch_slot
        self.cluster = tuple(cluster)
        self.enqueue = enqueue
        self._config = None

    def launch(self, stream: int, launch_index: int | None = None) -> None:
        if self.launch_slot is not None:
            if launch_index is None or launch_index < 1:
                raise ValueError("this kernel counts launches: pass launch_index >= 1")
            self.pack.set(self.launch_slot, launch_index)
        if self.enqueue is not None:
            self.enqueue(stream, self.pack, launch_index)
        elif self.cluster == (1, 1, 1):
            launch(self.kernel, self.grid, self.block, self.pack, stream)
        else:                           # the launch configuration built once (7 µs a call in cuda-python)
            if self._config is None or self._config[0] != self.kernel.smem_bytes:
                self._config = (self.kernel.smem_bytes,
                                cluster_config(self.kernel, self.grid, self.block, self.cluster))
            launch_with(self._config[1], self.kernel, self.pack, stream)


class LaunchCache:
    """A few :class:`PreparedLaunch` objects by key (tensor addresses); least recently used out."""

    def __init__(self, size: int = 8):
        self.size, self.items = int(size), {}

    def get(self, key, build):
        hit = self.items.pop(key, None)
        if hit is None:
            hit = build()
            if len(self.items) >= self.size:
                self.items.pop(next(iter(self.items)))
        self.items[key] = hit
        return hit


_DRIVER: list = []     # (cuda.bindings.driver, CUDA_SUCCESS), looked up once: a launch is on the host's critical path


def _driver():
    if not _DRIVER:
        from cuda.bindings import driver
        _DRIVER.append((driver, driver.CUresult.CUDA_SUCCESS))
    return _DRIVER[0]


def launch(kernel, grid, block, args: ArgPack, stream: int, cluster=(1, 1, 1)):
    cu, ok = _driver()
    if cluster == (1, 1, 1):
        res = cu.cuLaunchKernel(kernel.function, *grid, *block, kernel.smem_bytes, stream, args.address(), 0)
        if res[0] != ok:
            check(res, f"cuLaunchKernel({kernel.name})")
        return
    launch_with(cluster_config(kernel, grid, block, cluster), kernel, args, stream)


def cluster_config(kernel, grid, block, cluster):
    """A ``CUlaunchConfig`` for ``kernel`` with a thread-block cluster (its stream set per launch)."""
    cu = _driver()[0]
    cfg = cu.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = block
    cfg.sharedMemBytes = kernel.smem_bytes
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
    cfg.attrs = [attr]
    cfg.numAttrs = 1
    return cfg


def launch_with(cfg, kernel, args: ArgPack, stream: int) -> None:
    """``cuLaunchKernelEx`` with a prepared configuration, on ``stream``."""
    cu, ok = _driver()
    cfg.hStream = stream
    res = cu.cuLaunchKernelEx(cfg, kernel.function, args.address(), 0)
    if res[0] != ok:
        check(res, f"cuLaunchKernelEx({kernel.name})")
