"""Run a generated GEMM kernel on torch tensors: validate, encode TMA descriptors, launch."""
from __future__ import annotations

from .device import require_gpu, sm_count
from .module import load_kernel
from .launcher import Launcher


class GemmKernel(Launcher):
    """A lowered GEMM (``codegen.recipes.gemm``), compiled and loaded, callable with tensors.

    ``kernel(a=..., b=..., c=..., signals={...}, launch=1)``: buffers by their IR names;
    signals (u64 counters, int64 tensors) by signal name; ``launch`` is the 1-based epoch
    the waits count in.
    """

    def __init__(self, lowered, compiled=None, progress=None, reserve_sms: int = 0):
        """``reserve_sms`` leaves that many SMs free of this persistent kernel (for work that
        must run beside it on SMs while it waits, e.g. copies the driver runs as kernels)."""
        require_gpu()
        self.lowered = lowered
        self.compiled = compiled if compiled is not None else lowered.compile(progress=progress)
        self.kernel = load_kernel(self.compiled.cubin, lowered.entry, lowered.smem_bytes)
        self.grid = lowered.grid(max(1, sm_count() - int(reserve_sms)))

    def tma_tensor(self, buffers, spec):
        return self.checked_tensor(buffers, spec.buffer, tuple(reversed(spec.global_dims)), spec.dtype, tma=True)

    def scalar(self, param):
        return param.value if param.source in ("M", "N", "K") else None
