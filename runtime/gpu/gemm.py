"""Run a generated GEMM kernel on torch tensors: validate, encode TMA descriptors, launch."""
from __future__ import annotations

from ...errors import InputError
from .device import require_gpu, sm_count
from .module import load_kernel
from .launcher import Launcher

_TORCH_DTYPE = {"f16": "float16", "bf16": "bfloat16", "f32": "float32"}


class GemmKernel(Launcher):
    """A lowered GEMM (``codegen.lower_gemm``), compiled and loaded, callable with tensors.

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
        import torch
        t = buffers.get(spec.buffer)
        if t is None:
            raise InputError(f"{self.lowered.entry}: missing tensor '{spec.buffer}'")
        want_shape = tuple(reversed(spec.global_dims))
        want_dtype = getattr(torch, _TORCH_DTYPE[spec.dtype])
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise InputError(f"'{spec.buffer}' must be a CUDA torch tensor")
        if tuple(t.shape) != want_shape:
            raise InputError(f"'{spec.buffer}' has shape {tuple(t.shape)}; the kernel was built for {want_shape}")
        if t.dtype != want_dtype:
            raise InputError(f"'{spec.buffer}' is {t.dtype}; the kernel was built for {want_dtype}")
        if not t.is_contiguous():
            raise InputError(f"'{spec.buffer}' must be contiguous (row-major)")
        if t.data_ptr() % 16:
            raise InputError(f"'{spec.buffer}' must be 16-byte aligned for TMA")
        return t

    def scalar(self, param):
        return param.value if param.source in ("M", "N", "K") else None
