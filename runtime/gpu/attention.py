"""Run a generated flash-attention kernel (``codegen.recipes.attention``) on torch tensors:
validate, encode the TMA descriptors (2-D for Q and O, 3-D ``[shards, L, width]`` views for the
gathered K and V), launch persistent CTAs."""
from __future__ import annotations

from ...errors import InputError
from .device import require_gpu, sm_count
from .module import load_kernel
from .launcher import Launcher


class AttentionKernel(Launcher):
    """A lowered attention compute part, compiled and loaded, callable with tensors.

    ``kernel(q=..., k_gathered=..., v_gathered=..., o=..., signals={...}, launch_index=1,
    rank=r)``: buffers by their IR names (``kernel.lowered.buffers``); signals (u64 counters,
    int64 CUDA tensors) by signal name; ``launch_index`` is the 1-based epoch the waits count in;
    ``rank`` is this process's rank (the key-block order and the causal positions depend on it).
    ``reserve_sms`` leaves that many SMs free of this persistent kernel (for communication that
    must run beside it on SMs while it waits), as for :class:`GemmKernel`; ``max_ctas`` caps the
    persistent grid further (tests use it to run several tiles per CTA).
    """

    def __init__(self, lowered, compiled=None, progress=None, reserve_sms: int = 0, max_ctas: int | None = None):
        require_gpu()
        self.lowered = lowered
        self.compiled = compiled if compiled is not None else lowered.compile(progress=progress)
        self.kernel = load_kernel(self.compiled.cubin, lowered.entry, lowered.smem_bytes)
        sms = max(1, sm_count() - int(reserve_sms))
        if max_ctas is not None:
            sms = max(1, min(sms, int(max_ctas)))
        self.grid = lowered.grid(sms)

    def tma_tensor(self, buffers, spec):
        shape, dtype = self.lowered.buffers[spec.buffer]
        return self.checked_tensor(buffers, spec.buffer, shape, dtype, tma=True)

    def check_call(self, rank, launch_index):
        super().check_call(rank, launch_index)
        if not 0 <= rank < self.lowered.world_size:
            raise InputError(f"rank {rank} is outside the kernel's world of {self.lowered.world_size}")
