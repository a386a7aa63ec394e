"""Sequence-parallel attention as a fused op across a process group: the library's tile program
(:func:`tldsl.ops.sp_attention.sp_attention`: K and V all-gathered while flash attention runs
per key block) run by the one fused-op runtime (:class:`~.program_op.FusedProgram`). What is
specific to attention is only its arguments: heads (MHA or GQA), the causal mask and the
sequence layout (``"zigzag"`` balances causal work across the ranks; see
:func:`~tldsl.ops.sp_attention.shard_sequence`), checked here with errors that name the
argument, before anything is built or enqueued.
"""
from __future__ import annotations

import numbers

import tldsl as tl

from ...errors import InputError
from ...ops.sp_attention import argument_problem, check_scale, sp_attention
from .operands import shape_and_dtype
from .program_op import FusedProgram

#: The communication schedule where none is given: the copy engines gather K and V (whole shards,
#: no SM taken from attention). Measured on two H200s (BENCHMARKS.md, thirty-sixth session; 32/32
#: heads, d 128, 8192 rows a rank, full mask): 3.89 ms a layer, against 8.43 with the general default
#: (each shard moved as one tile by one CTA of two lanes: 5 ms for 128 MB), 4.91 with 128-row tiles
#: on 8 lanes and 6.05 with 512-row tiles on 4 (torch's all-gather + SDPA: 3.98)
DEFAULT_COMM = tl.CommSchedule(engine="copy_engine", mode="push")


def _positive(name, v) -> int:
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
        raise InputError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def _spec(name, x):
    """(rows, columns, tl dtype) of ``[S, H*D]`` or ``[S, H, D]`` (a tensor, array or TensorSpec)."""
    shape, dt = shape_and_dtype(name, x)
    if len(shape) not in (2, 3) or 0 in shape:
        raise InputError(f"{name} must be [S, heads*D] or [S, heads, D] (no dimension 0), got {list(shape)}")
    if dt.name not in ("f16", "bf16"):
        raise InputError(f"{name} must be fp16 or bf16, got {dt.name}")
    return shape[0], shape[1] * (shape[2] if len(shape) == 3 else 1), dt


class SequenceParallelAttention(FusedProgram):
    """Attention over a sequence sharded across the ranks: this rank's queries against every
    rank's keys and values, K/V gathered tile by tile while attention runs.

    ``q``: ``[S, H, D]`` or ``[S, H*D]`` (this rank's rows; ``S`` per rank), ``k``: the same
    with ``kv_heads`` heads (GQA where fewer than ``heads``); tensors or ``tl.TensorSpec`` s.
    ``layout``: the global positions of a rank's rows (``"contiguous"``: rank ``r`` holds
    ``[r*S, (r+1)*S)``; ``"zigzag"``: chunks ``r`` and ``2W-1-r`` of ``S/2`` rows). ``comm``:
    how K and V are gathered, :data:`DEFAULT_COMM` (the copy engines) where not given. Calling
    ``op(q, k, v)`` returns ``o`` shaped like ``q``."""

    def __init__(self, q, k, heads: int, group=None, *, kv_heads: int | None = None, causal: bool = False,
                 layout: str = "contiguous", scale: float | None = None, compute=None, comm=None, **program_kw):
        S, width, dt = _spec("q", q)
        Sk, kv_width, kdt = _spec("k", k)
        heads = _positive("heads", heads)
        kv_heads = heads if kv_heads is None else _positive("kv_heads", kv_heads)
        problem = argument_problem(S, width, heads, kv_heads, causal, layout, scale)   # as the tile program checks
        if problem is not None:
            raise InputError(problem)
        scale = check_scale(scale)
        D = width // heads
        if Sk != S or kv_width != kv_heads * D or kdt != dt:
            raise InputError(f"k must be [{S}, {kv_heads}*{D}] {dt.name} (q's rows, kv_heads heads of q's head dim), "
                             f"got [{Sk}, {kv_width}] {kdt.name}")
        self.q_shape = tuple(q.shape)
        self.heads, self.kv_heads, self.causal, self.layout = heads, kv_heads, causal, layout
        specs = {"q": tl.TensorSpec((S, width), dt), "k": tl.TensorSpec((S, kv_width), dt),
                 "v": tl.TensorSpec((S, kv_width), dt), "o": tl.TensorSpec((S, width), dt)}
        kw = dict(heads=heads, causal=causal, layout=layout)
        if kv_heads != heads:
            kw["kv_heads"] = kv_heads
        if scale is not None:
            kw["scale"] = scale
        kw["comm"] = DEFAULT_COMM if comm is None else comm
        if compute is not None:
            kw["compute"] = compute
        FusedProgram.__init__(self, sp_attention, group, specs, **kw, **program_kw)

    def __call__(self, q, k, v, o=None):
        import torch
        named = {"q": q, "k": k, "v": v, **({} if o is None else {"o": o})}
        for name, t in named.items():
            if not isinstance(t, torch.Tensor):
                raise InputError(f"argument '{name}': a torch tensor, got {type(t).__name__}")
            if t.dim() not in (2, 3):
                raise InputError(f"argument '{name}' must be [S, heads*D] or [S, heads, D], got {list(t.shape)}")
            if not t.is_contiguous():         # (flattened to [S, heads*D] below: a view only where contiguous)
                raise InputError(f"argument '{name}' is not contiguous (pass .contiguous())")
        if tuple(q.shape) != self.q_shape:
            raise InputError(f"argument 'q': {tuple(q.shape)}, the op was built for {self.q_shape}")
        if o is None:
            o = torch.empty(self.q_shape, dtype=q.dtype, device=q.device)
        flat = [t.reshape(t.shape[0], -1) for t in (q, k, v, o)]
        FusedProgram.__call__(self, q=flat[0], k=flat[1], v=flat[2], o=flat[3])
        return o

    def _problem(self) -> str:
        b = self.kernel.buffer("q").type
        return (f"sequence-parallel attention: {self.ctx.world_size} x {b.shape[0]} rows, {self.heads}/"
                f"{self.kv_heads} heads, {'causal ' + self.layout if self.causal else 'full'}")
