"""Run a generated MoE kernel — a grouped GEMM or a row-gather combine
(``codegen.lower_grouped_gemm``) — on torch tensors: validate every argument against the
lowered kernel's parameter contract, encode the TMA descriptors, launch persistently."""
from __future__ import annotations

from ...errors import InputError
from .device import require_gpu, sm_count
from .module import load_kernel
from .launcher import Launcher

_TORCH_DTYPE = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "i32": "int32"}


class GroupedKernel(Launcher):
    """A lowered grouped GEMM or combine, compiled and loaded, callable with tensors.

    ``kernel(buffers, signals={...}, launch_index=1, rank=0)``: ``buffers`` maps IR tensor
    names (arguments and workspaces: the gathered tokens, weights, output, tables...) to CUDA
    torch tensors of exactly the traced shape and dtype, contiguous; ``signals`` maps signal
    names to int64 CUDA tensors of counters (at least the signal's slots); ``launch_index`` is
    the 1-based epoch the waits count in. ``ctas_per_sm`` sizes a combine's persistent grid.
    """

    def __init__(self, lowered, compiled=None, progress=None, ctas_per_sm: int = 1):
        require_gpu()
        self.lowered = lowered
        self.compiled = compiled if compiled is not None else lowered.compile(progress=progress)
        self.kernel = load_kernel(self.compiled.cubin, lowered.entry, lowered.smem_bytes)
        sms = sm_count()
        self.grid = lowered.grid(sms, ctas_per_sm) if getattr(lowered, "kind", "") == "combine" else lowered.grid(sms)

    def _tensor(self, buffers: dict, name: str, shape, dtype: str, *, tma: bool = False):
        import torch
        t = buffers.get(name)
        if t is None:
            raise InputError(f"{self.lowered.entry}: missing tensor '{name}'")
        if not isinstance(t, torch.Tensor) or not t.is_cuda:
            raise InputError(f"'{name}' must be a CUDA torch tensor")
        if tuple(t.shape) != tuple(shape):
            raise InputError(f"'{name}' has shape {tuple(t.shape)}; the kernel was built for {tuple(shape)}")
        want = getattr(torch, _TORCH_DTYPE[dtype])
        if t.dtype != want:
            raise InputError(f"'{name}' is {t.dtype}; the kernel was built for {want}")
        if not t.is_contiguous():
            raise InputError(f"'{name}' must be contiguous (row-major)")
        if t.data_ptr() % 16:
            raise InputError(f"'{name}' must be 16-byte aligned" + (" for TMA" if tma else " (vector access)"))
        return t

    def tma_tensor(self, buffers, spec):
        return self._tensor(buffers, spec.buffer, tuple(reversed(spec.global_dims)), spec.dtype, tma=True)

    def table_pointer(self, buffers, name):
        shape, dtype = self.lowered.buffers[name]
        return self._tensor(buffers, name, shape, dtype).data_ptr()

    def signal_slots(self, name):
        return self.lowered.signal_slots[name]
