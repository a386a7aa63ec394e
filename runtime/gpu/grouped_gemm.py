"""Run a generated MoE kernel — a grouped GEMM or a row-gather combine
(``codegen.lower_grouped_gemm``) — on torch tensors: validate every argument against the
lowered kernel's parameter contract, encode the TMA descriptors, launch persistently."""
from __future__ import annotations

from ...errors import InputError
from .device import require_gpu, sm_count
from .launch import ArgPack
from .module import load_kernel
from .launcher import Launcher, signal_pointer

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
        self._tma_cache: dict = {}

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

    def args(self, buffers: dict, signals: dict | None = None, launch_index: int = 1, rank: int = 0) -> ArgPack:
        import torch
        lw = self.lowered
        specs = {s.param: s for s in lw.tma}
        pack = ArgPack()
        for p in lw.params:
            src = p.source
            if src.startswith("tma:"):
                spec = specs[src[4:]]
                t = self._tensor(buffers, spec.buffer, tuple(reversed(spec.global_dims)), spec.dtype, tma=True)
                key = (spec.param, t.data_ptr())
                desc = self._tma_cache.get(key)
                if desc is None:
                    desc = self._tma_cache[key] = spec.encode(t.data_ptr())
                pack.add("tma", desc)
            elif src == "rank":
                pack.add("i32", rank)
            elif src == "launch":
                if launch_index < 1:
                    raise InputError("launch_index counts launches from 1")
                pack.add("u64", launch_index)
            elif src.startswith("signal:"):
                name = src[7:]
                pack.add("ptr", signal_pointer(lw.entry, name, signals, lw.signal_slots[name]))
            elif src.startswith("buffer:"):
                name = src[7:]
                shape, dtype = lw.buffers[name]
                pack.add("ptr", self._tensor(buffers, name, shape, dtype).data_ptr())
            else:
                raise InputError(f"unknown kernel parameter source {src!r}")
        return pack
