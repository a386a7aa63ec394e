"""Planning a row-gather combine: the width of its vector accesses, which
values the generated body computes where (once per tile, or per gathered row in the loop),
and the kernel's parameters — the gathered and stored tensors, then what the hooks read
(:mod:`.prog_params`)."""
from __future__ import annotations

from dataclasses import dataclass

from ...ir import core
from ...ir.opdefs import NOTIFY_OPS, WAIT_OPS
from ...ir.schedule import ComputeSchedule
from ..abi import (LAUNCH_PARAM, RANK_PARAM, KernelParam, entry_name, output_param, pointer_param,
                   wait_timeout_options)
from ..dtypes import c_type
from ..errors import fail
from ..ir_queries import scope_of
from ..match import affine as aff
from ..match.combine import WHAT, CombineMatch
from ..match.per_row import depends_on
from ...ir.opdefs import written_buffers
from .tile_order import order_align_shift
from .prog_params import signal_hook, signal_params, signals_used, tensor_param, tensors_read, value_hook
from .wgmma import check_cluster_waits

#: threads per CTA; each owns VEC (1, 2, 4 or 8, :func:`vector_width`) consecutive columns of a tile row
#: at a time. A gather is bound by
#: its loads' latency: the more threads a CTA has, the more loads are in flight on its SM (in a
#: fused launch the combine gets few CTAs beside its GEMM and finishes the last tiles after it)
COMBINE_THREADS = 1024      # (256 -> 512 -> 1024: BENCHMARKS.md, twenty-first session)


@dataclass(frozen=True)
class CombinePlan:
    """Everything the renderer needs: the match, the schedule, the body's values and the ABI."""
    kernel: core.Kernel
    part: core.Part
    match: CombineMatch
    schedule: ComputeSchedule
    entry: str
    align_shift: int
    grid_tiles: tuple[int, int]
    params: tuple[KernelParam, ...]
    buffers: dict                           # IR name -> (shape, dtype name) of every tensor passed by pointer
    signals: tuple[core.Signal, ...]        # waited on / notified: params sig_<name>
    tensors: tuple[core.Buffer, ...]        # read by the hooks (not the gathered or stored tensor)
    written: frozenset[str]                 # tensors another part writes: read coherently
    per_tile: tuple[core.Value, ...]        # the store's offsets, the loop's bounds [, the gather's column]
    per_row: tuple[core.Value, ...]         # in the loop: the row ids [, the gather's column]
    scale: tuple[core.Value, ...]           # in the loop, after the gather: the per-row scale
    waits: int
    notifies: int
    wait_scopes: tuple[str, ...]
    options: tuple[str, ...]                # NVRTC options
    vec: int = 4                            # consecutive columns per thread (vector_width)
    threads: int = COMBINE_THREADS          # threads that share a tile (96 folded into a grouped GEMM)

    @property
    def src_param(self) -> str:
        return pointer_param(self.match.src)

    @property
    def dst_param(self) -> str:
        return output_param(self.match.dst)


def plan_combine(kernel: core.Kernel, part: core.Part, m: CombineMatch, *, wait_timeout_ns: int | None = None,
                 entry: str | None = None, threads: int = COMBINE_THREADS) -> CombinePlan:
    """The plan of a matched combine under the kernel's compute schedule; ``threads`` share a
    tile (a CTA of its own, or the spare warps of the grouped GEMM it is folded into)."""
    sched = kernel.compute_schedule or ComputeSchedule()
    _check(m)
    if len(part.grid) == 2:     # its walk: the schedule's order without the clusters (one axis: no clusters)
        check_cluster_waits(WHAT, kernel, part, (1, 1), sched.cluster)
    iv = m.loop.regions[0].args[0]
    col = m.gather.operands[2]
    col_per_row = depends_on(col, iv)
    per_tile = (m.store.operands[1], m.store.operands[2], *m.loop.operands) + (() if col_per_row else (col,))
    per_row = (m.rows,) + ((col,) if col_per_row else ())
    scale = (m.scale,) if m.scale is not None else ()

    ops = part.body.ops
    written = written_buffers(kernel)
    signals = signals_used(ops)
    # the hooks in the order the renderer emits them: waits, body (per tile, per row, scale), notifies
    tensors = tensors_read(ops, [signal_hook(ops, WAIT_OPS), value_hook(ops, per_tile), value_hook(ops, per_row),
                                 value_hook(ops, scale), signal_hook(ops, NOTIFY_OPS)])
    if m.src in tensors or m.dst in tensors:
        raise fail(WHAT, "the gathered or stored tensor is also read by an index expression; not lowered", m.gather)
    sdt, ddt = m.src.type.dtype.name, m.dst.type.dtype.name
    # the gathered tensor may be written by another part while this one runs: never __restrict__
    params = [KernelParam(pointer_param(m.src), f"const {c_type(sdt)}*", "ptr", f"buffer:{m.src.name}"),
              KernelParam(output_param(m.dst), f"{c_type(ddt)}* __restrict__", "ptr", f"buffer:{m.dst.name}"),
              RANK_PARAM, LAUNCH_PARAM]
    params += signal_params(signals)
    buffers = {m.src.name: (tuple(m.src.type.shape), sdt), m.dst.name: (tuple(m.dst.type.shape), ddt)}
    for b in tensors:
        params.append(tensor_param(b, written))
        buffers[b.name] = (tuple(b.type.shape), b.type.dtype.name)
    walk = list(part.walk())
    waits = [op for op in walk if op.name in WAIT_OPS]
    grid = (part.grid[0], part.grid[1] if len(part.grid) == 2 else 1)
    return CombinePlan(kernel, part, m, sched, entry_name(kernel, part, entry),
                       order_align_shift(getattr(part, "align_shift", 0), kernel.world_size), grid, tuple(params),
                       buffers, signals, tensors, written,
                       per_tile, per_row, scale, len(waits), sum(op.name in NOTIFY_OPS for op in walk),
                       tuple(sorted({scope_of(op) for op in waits})), wait_timeout_options(wait_timeout_ns),
                       vector_width(m), threads)


def vector_width(m: CombineMatch) -> int:
    """Columns per thread: the widest of 8, 4, 2 and 1 that divides both tensors' column counts,
    the tile's columns and every column offset (whole vectors are in bounds or out). 8 only where
    the gathered rows are 16-bit (one 16-byte load per gathered row, half the load instructions of
    4-wide 8-byte ones); 1 and 2 are for columns no multiple of 4."""
    widths = [m.src.type.shape[1], m.dst.type.shape[1], m.BNf]
    for off in (m.gather.operands[2], m.store.operands[2]):
        widths += list(aff.affine(off).values())
    for n in (8, 4, 2):
        if all(w % n == 0 for w in widths) and (n != 8 or m.src.type.dtype.name in ("f16", "bf16")):
            return n
    return 1


def _check(m: CombineMatch) -> None:
    """The tensors are 2-d f32/f16/bf16, the stored tile is the accumulator and the column
    offsets are affine (known at compile time up to the parameters' multiples)."""
    st, dt = m.src.type, m.dst.type
    if len(st.shape) != 2 or len(dt.shape) != 2:
        raise fail(WHAT, f"the gathered and stored tensors must be 2-d, got {list(st.shape)} and {list(dt.shape)}",
                   m.store)
    for b, at in ((m.src, m.gather), (m.dst, m.store)):
        if b.type.dtype.name not in ("f32", "f16", "bf16"):
            raise fail(WHAT, f"'{b.name}' is {b.type.dtype}; f32, f16 and bf16 are lowered", at)
    if tuple(m.rows.type.shape) != (m.BMf,) or m.rows.type.dtype.name != "i32":
        raise fail(WHAT, f"the row ids must be a ({m.BMf},) i32 tile, got {m.rows.type}", m.gather)
    if tuple(m.store.operands[-1].type.shape) != (m.BMf, m.BNf):
        raise fail(WHAT, "the stored tile must be the accumulator", m.store)
    for off, at in ((m.gather.operands[2], m.gather), (m.store.operands[2], m.store)):
        f = aff.affine(off)
        if f is None:
            raise fail(WHAT, "column offsets must be affine in the parameters, known at compile time (e.g. "
                       "pid1*BN)", at)
