"""Run a generated MoE kernel — a grouped GEMM or a row-gather combine (the
``codegen.recipes.grouped_gemm`` / ``.combine`` recipes) — on torch tensors: validate every
argument against the lowered kernel's parameter contract, encode the TMA descriptors, launch
persistently."""
from __future__ import annotations

from .device import require_gpu, sm_count
from .module import load_kernel
from .launcher import Launcher


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

    def tma_tensor(self, buffers, spec):
        return self.checked_tensor(buffers, spec.buffer, tuple(reversed(spec.global_dims)), spec.dtype, tma=True)

    def table_pointer(self, buffers, name):
        shape, dtype = self.lowered.buffers[name]
        return self.checked_tensor(buffers, name, shape, dtype).data_ptr()

    def signal_slots(self, name):
        return self.lowered.signal_slots[name]
