"""Recipe ``sm_comm``: an SM communication part (``engine='sm'``: all-gather pull / push,
reduce-scatter ring / full-mesh, push / pull) as one persistent ``extern "C"`` kernel
(``include/tldsl/comm.hpp``). Matching: :mod:`..match.comm`; planning: :mod:`..plan.comm`.

* ``lanes`` CTAs (the schedule's ``sms``); CTA ``b`` runs tasks ``b, b + gridDim.x, ...`` of the
  communication schedule's task order (``CommSchedule.task_order``: row-major for ``ring``,
  peer step fastest for ``full_mesh``). Every task a CTA starts depends only on tasks of the
  same or an earlier index on other ranks (all ranks walk the same order), so the static
  assignment cannot deadlock where the simulator's lane queue does not.
* the part's index code (``const``, ``rank``, ``arith``, ``select``, ``load_scalar``, ``for``,
  ``if``) becomes C++ statements run by every thread (:mod:`..rules.scalars`, shared with the
  other recipes), each carrying its ``// tldsl: file:line`` marker;
* tile values are **not materialised**: a tile expression (``load``, ``load_rows``,
  ``tile_pull_data`` into a tile, ``iota``, ``full``, elementwise ops with numpy broadcasting,
  ``cast``, ``expand_dims``, ``broadcast``) is evaluated element by element where a statement
  consumes it (``store``, ``tile_push_data``; ``tile_pull_data`` / ``tile_push_data`` between
  tensors are plain copies). That keeps a 64 x 8192 fp32 tile out of shared memory, and it is
  exact because the matcher proves that moving a load down to its statement changes
  nothing: no notify and no write of the loaded tensor lie in between, and no loop separates
  the two (else :class:`LoweringError` at the load's line);
* a statement streams its tile through the CTA in chunks of ``V`` elements of a row
  (``V * sizeof`` >= 16 bytes), ``U`` chunks per thread per round: loads first (16-byte vectors
  when in bounds and aligned), then the element code, then the stores. Out-of-bounds loads
  read 0, out-of-bounds stores are dropped, copies move only elements inside both tensors —
  the simulator's rules. Float math is explicitly rounded (no FMA contraction) and 16-bit
  results are rounded at every op, as in numpy, so results match the simulator bit for bit;
* waits: thread 0 spins with ``ld.acquire`` at the wait's scope, then a CTA barrier; notifies:
  a CTA barrier, then thread 0 ``fence.acq_rel`` + ``red.relaxed.add`` at the notify's scope
  (:mod:`..rules.primitives`); consecutive statements of a task are separated by a CTA barrier.

Kernel parameters (:attr:`LoweredComm.params`, in order; ``KernelParam.source`` says what the
runtime passes):

* ``buf_<name>`` ``T*`` — ``buffer:<name>``: this rank's tensor (for a symmetric buffer, this
  rank's own mapping);
* ``buf_<name>_peers`` ``T* const*`` — ``peers:<name>``: a device array of ``world_size``
  pointers, entry ``r`` = rank ``r``'s copy of the symmetric buffer as mapped on this rank
  (``nvshmem_ptr(buf, r)``, torch symmetric memory's ``buffer_ptrs``); entry ``rank`` must be
  this rank's own pointer;
* ``sig_<name>`` ``unsigned long long*`` — ``signal:<name>``: this rank's counters;
* ``sig_<name>_peers`` ``unsigned long long* const*`` — ``peer_signals:<name>``: the same
  table for a symmetric signal notified on other ranks;
* ``tbl_<name>`` ``const int*`` — ``buffer:<name>``: an i32 table read by ``load_scalar``;
* ``rank`` ``int`` — ``rank``; ``launch`` ``unsigned long long`` — ``launch`` (1-based epoch).

**Transport** (``CommSchedule.transport``): ``ptr`` (above: peer-pointer tables) or ``nvshmem``
— NVSHMEM device calls, header-only (``include/tldsl/comm_nvshmem.hpp``,
``-D__NVSHMEM_NUMBA_SUPPORT__``): peer data through ``nvshmem_ptr(buf_<name>, pe)`` on the
device and peer notifies through ``nvshmemx_signal_op`` (after a system-scope fence and
``nvshmem_fence``), so the kernel takes no ``_peers`` tables, only this rank's symmetric
addresses, which must come from ``nvshmem_malloc``; the host must call
``nvshmemx_cumodule_init`` on the loaded module. Waits are the same acquire spins.

Launch: grid ``(min(lanes, tasks), 1, 1)``, block ``(threads, 1, 1)`` (256 by default; any
block size works, the code reads ``blockDim.x``), no dynamic shared memory. All pointers must be
16-byte aligned (the vector path assumes it).

Copy-engine parts are not kernels: recipe ``copy_engine`` (:mod:`..plan.copy_engine`).
"""
from __future__ import annotations

import dataclasses

import hashlib
import math
from dataclasses import dataclass, field

from ...ir import core
from ...ir import types as T
from ...ir.opdefs import NOTIFY_OPS, WAIT_OPS, data_operands
from ..abi import (KernelParam, LoweredKernel, buffer_param, is_this_rank, marker, peer_buffer_param,
                   signal_slot)
from ..dtypes import ctype
from ..errors import fail
from ..ir_queries import only_part, wait_site
from ..match.comm import (FLOAT_EWISE, INT_EWISE, TILE_OPS, WHAT, broadcast_coords,
                          is_statement, match_sm_comm, statement_coords)
from ..plan.comm import DEFAULT_THREADS, CommPlan, plan_sm_comm
from ..rules import primitives
from ..rules.scalars import ELEMENT_MATH, ScalarEmitter, c_literal, element_expr, element_math_includes
from ..rules.tile_ops import compute_type, convert, round_to, value_ctype
from .. import toolchain
from .recipe import Recipe


@dataclass(frozen=True)
class LoweredComm(LoweredKernel):
    """A communication part lowered to a persistent CUDA kernel (see the module docstring for
    the parameter contract)."""
    kernel_name: str
    part: str
    entry: str
    source: str
    params: tuple[KernelParam, ...]
    threads: int
    lanes: int
    grid_shape: tuple[int, ...]       # the part's task grid
    order: str                        # ring | full_mesh: the task order walked
    world_size: int
    waits: int                        # wait ops in the part's body (static count)
    notifies: int
    transfers: int                    # data statements (store / push / pull / copy)
    signals: tuple[str, ...]
    options: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    transport: str = "ptr"            # ptr: peer-pointer tables; nvshmem: NVSHMEM device calls
    remote_buffers: tuple[str, ...] = ()   # tensors addressed on other ranks: they must be symmetric
    remote_signals: tuple[str, ...] = ()   # signals notified on other ranks (either transport)

    @property
    def num_tasks(self) -> int:
        return math.prod(self.grid_shape)

    def compile(self, **kw):
        """As :meth:`LoweredKernel.compile`; an NVSHMEM-transport kernel needs NVSHMEM's headers,
        and their version joins the cache key."""
        kw["options"] = tuple(kw.pop("options", ())) + self._nvshmem_options()
        return super().compile(**kw)

    def job(self):
        """As :meth:`LoweredKernel.job`, with the NVSHMEM options of :meth:`compile`."""
        job = super().job()
        extra = self._nvshmem_options()
        return dataclasses.replace(job, options=tuple(job.options) + extra) if extra else job

    def _nvshmem_options(self) -> tuple[str, ...]:
        if self.transport != "nvshmem":
            return ()
        tc = toolchain.find_toolchain()
        tc.require_nvshmem()
        return (f"-DTLDSL_NVSHMEM_VERSION=\"{tc.nvshmem_version}\"",)

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @property
    def smem_bytes(self) -> int:
        return 0

    def grid(self, sm_count: int | None = None) -> tuple[int, int, int]:
        """``lanes`` persistent CTAs, never more than tasks (``sm_count`` is accepted for the
        runtime's uniform call and does not change the answer)."""
        return (max(1, min(self.lanes, self.num_tasks)), 1, 1)

    def describe(self) -> str:
        lines = [f"{self.entry}: {self.kernel_name}.{self.part}  communication part on SMs",
                 f"  tasks {'x'.join(map(str, self.grid_shape))} = {self.num_tasks} in {self.order} order, "
                 f"{self.lanes} lane(s) = CTAs of {self.threads} threads; {self.transfers} data statement(s), "
                 f"{self.waits} wait(s), {self.notifies} notify(s) on {list(self.signals)}",
                 "  params: " + ", ".join(f"{p.ctype} {p.name} <- {p.source}" for p in self.params)]
        return "\n".join(lines)


# -- rendering: a statement's tile expression, element by element -----------------------------------

class _Access:
    """An access of a tensor through a base pointer expression."""
    buf: core.Buffer

    @property
    def dims(self):
        return self.buf.type.shape

    @property
    def dtype(self) -> str:
        return self.buf.type.dtype.name


class _Box(_Access):
    """A box access of a tensor: base pointer expression, offsets, and how many trailing
    tensor axes the tile spans."""

    def __init__(self, buf: core.Buffer, ptr: str, offs: list[str], tile_rank: int):
        self.buf, self.ptr, self.offs, self.tile_rank = buf, ptr, offs, tile_rank

    def col_offset(self) -> str:
        return self.offs[-1]


class _Rows(_Access):
    """A ``load_rows`` access: rows from an i32 tile, a column offset."""

    def __init__(self, buf: core.Buffer, ptr: str, rows: core.Value, col: str):
        self.buf, self.ptr, self.rows, self.col = buf, ptr, rows, col

    def col_offset(self) -> str:
        return self.col


class _Leaf:
    """A memory leaf read a chunk at a time (phase 1 of a statement)."""

    def __init__(self, access, row_coords: list[str], op: core.Op):
        self.access, self.row_coords, self.op = access, row_coords, op


class _Ctx:
    """Element code of one statement: lines, memo of (value, coordinates), vector leaves."""

    def __init__(self, sink: core.Op, vector: bool):
        self.sink = sink
        self.vector = vector
        self.lines: list[str] = []
        self.memo: dict = {}
        self.leaves: list[_Leaf] = []
        self.n = 0

    def var(self, ctype: str, expr: str, hint: str = "x") -> str:
        nm = f"{hint}{self.n}"
        self.n += 1
        self.lines.append(f"const {ctype} {nm} = {expr};")
        return nm

    def ptr(self, ptype: str, expr: str, hint: str = "p") -> str:
        nm = f"{hint}{self.n}"
        self.n += 1
        self.lines.append(f"{ptype} const {nm} = {expr};")
        return nm


def _add(a: str, b: str) -> str:
    if a == "0":
        return b
    if b == "0":
        return a
    try:
        return str(int(a) + int(b))
    except ValueError:
        return f"({a} + {b})"


def _compute(dtype: str) -> str:
    return ctype(dtype).compute


def _storage(dtype: str) -> str:
    return ctype(dtype).comm


assert FLOAT_EWISE | INT_EWISE <= set(ELEMENT_MATH), "the matcher admits what the element rules render"


class _CommEmitter(ScalarEmitter):
    """The part's body as the task loop's C++: index code by the scalar rule, waits and
    notifies by the primitive rules, each data statement as a streamed block."""
    what = "the communication lowering"

    def __init__(self, plan: CommPlan):
        super().__init__(None)
        self.plan = plan
        self.transport = plan.transport
        self.pending = False           # a statement ran since the last CTA barrier
        self._has_sink: dict[int, bool] = {}

    def fail(self, msg, op=None):
        return fail(WHAT, msg, op)

    def rank_expr(self) -> str:
        return "my_rank"

    def _buf_ptr(self, v: core.Value, rank: core.Value | None, op) -> str:
        buf = v.owner
        if is_this_rank(rank):
            return buffer_param(buf)
        if self.transport == "nvshmem":       # this rank's symmetric address, mapped on the device
            return f"tldsl::comm::peer({buffer_param(buf)}, {self.name(rank, op)})"
        return f"{peer_buffer_param(buf)}[{self.name(rank, op)}]"

    def _region_has_sink(self, block: core.Block) -> bool:
        if id(block) not in self._has_sink:
            self._has_sink[id(block)] = any(is_statement(o) for o in block.walk())
        return self._has_sink[id(block)]

    # -- ops -------------------------------------------------------------------------------------
    def emit_op(self, op, ind, lines):
        if op.name in ("for", "if"):
            before = self.pending
            has = self._region_has_sink(op.regions[0])
            if op.name == "for" and has:
                self.pending = True          # the loop's back edge: the last iteration's statement
            super().emit_op(op, ind, lines)
            self.pending = before or has or self.pending
            return
        super().emit_op(op, ind, lines)

    def emit_other(self, op, ind, lines):
        n = op.name
        if n in WAIT_OPS:
            sig = op.operands[0].owner
            slot = signal_slot(sig, self.name(op.operands[1], op))
            lines.append(ind + primitives.wait(op, slot, self.name(op.operands[2], op), cta=True,
                                               site=wait_site(op)))
            self.pending = False
        elif n in NOTIFY_OPS:
            sig = op.operands[0].owner
            rank = None if n == "producer_tile_notify" else op.operands[2]
            ch = self.name(op.operands[1], op)
            if self.transport == "nvshmem" and not is_this_rank(rank):
                # the symmetric counter; NVSHMEM finds rank's copy
                lines.append(ind + primitives.notify(op, signal_slot(sig, ch), cta=True,
                                                     nvshmem_rank=self.name(rank, op)))
            else:
                peer = None if is_this_rank(rank) else self.name(rank, op)
                lines.append(ind + primitives.notify(op, signal_slot(sig, ch, peer), cta=True))
            self.pending = False
        elif is_statement(op):
            if self.pending:
                lines.append(f"{ind}__syncthreads();  // the previous statement's threads are done")
            self._statement(op, ind, lines)
            self.pending = True
        elif n in TILE_OPS and op.results and isinstance(op.result.type, T.TileType):
            pass                           # evaluated where a statement consumes it
        else:
            raise self.fail(f"internal: '{n}' reached the renderer unmatched", op)

    # -- tile expressions --------------------------------------------------------------------------
    def _val(self, v: core.Value, coords: list[str], ctx: _Ctx) -> str:
        """C expression of tile value ``v`` at tile coordinates ``coords`` (one per axis)."""
        if not isinstance(v.type, T.TileType):
            return self.name(v, ctx.sink)              # a scalar operand, defined by the index code
        key = (v.id, tuple(coords))
        if key in ctx.memo:
            return ctx.memo[key]
        op = v.owner
        n = op.name
        dt = op.result.type.dtype.name
        ct = _compute(dt)
        shape = op.result.type.shape
        if n == "load":
            acc = _Box(op.operands[0].owner, self._buf_ptr(op.operands[0], None, op),
                       [self.name(o, op) for o in op.operands[1:]], len(shape))
            out = self._leaf(acc, coords, op, ctx)
        elif n == "tile_pull_data":
            src, srank, soffs, *_ = data_operands(op)
            acc = _Box(src.owner, self._buf_ptr(src, srank, op), [self.name(o, op) for o in soffs], len(shape))
            out = self._leaf(acc, coords, op, ctx)
        elif n == "load_rows":
            buf, rows, col = op.operands
            acc = _Rows(buf.owner, self._buf_ptr(buf, None, op), rows, self.name(col, op))
            out = self._leaf(acc, coords, op, ctx)
        elif n == "iota":
            out = coords[0]
        elif n == "full":
            val = op.attrs["value"]
            lit = c_literal(bool(val) if dt == "i1" else int(val) if dt == "i32" else float(val))
            out = ctx.var(ct, self._round(dt, lit))
        elif n == "ewise":
            args = [self._val(a, broadcast_coords(coords, a.type.shape, shape) if isinstance(a.type, T.TileType)
                              else [], ctx) for a in op.operands]
            out = ctx.var(ct, self._ewise(op, args))
        elif n == "cast":
            x = self._val(op.operands[0], coords, ctx)
            out = ctx.var(ct, self._convert(op.operands[0].type.dtype.name, dt, x))
        elif n == "expand_dims":
            axis = op.attrs["axis"]
            out = self._val(op.operands[0], coords[:axis] + coords[axis + 1:], ctx)
        else:                                          # broadcast (the matcher admits no other)
            src = op.operands[0]
            out = self._val(src, broadcast_coords(coords, src.type.shape, shape), ctx)
        ctx.memo[key] = out
        return out

    def _leaf(self, acc, coords: list[str], op: core.Op, ctx: _Ctx) -> str:
        st = _storage(acc.dtype)
        if ctx.vector and coords and coords[-1] == "cc":
            k = len(ctx.leaves)
            ctx.leaves.append(_Leaf(acc, coords[:-1], op))
            return ctx.var(_compute(acc.dtype), f"tldsl::comm::Elem<{st}>::get(v{k}[u].get(e))", "l")
        # an element load (broadcast along the row, or inside a row index)
        rp, col, ncols = self._row_access(acc, coords, coords[-1] if coords else "0", ctx)
        return ctx.var(_compute(acc.dtype), f"tldsl::comm::Elem<{st}>::get("
                                            f"{primitives.tile_pull_data(st, rp, col, ncols)})", "l")

    def _row_access(self, acc, coords: list[str], col_coord: str, ctx: _Ctx, write: bool = False):
        """Emit the row pointer of an access at tile coordinates ``coords`` (the last one is
        replaced by ``col_coord``): returns (row pointer variable, column expression, ncols).
        The row pointer is null where the row lies outside the tensor."""
        dims = acc.dims
        st = _storage(acc.dtype)
        nb = len(dims)
        if isinstance(acc, _Rows):
            rows_ctx = _Ctx(ctx.sink, False)
            rows_ctx.n = ctx.n
            r = self._val(acc.rows, [coords[0]], rows_ctx)
            ctx.lines.extend(rows_ctx.lines)
            ctx.n = rows_ctx.n
            conds = [f"(unsigned)({r}) < {dims[0]}u"]
            rowlin = r
            col = _add(acc.col, col_coord)
        else:
            m = acc.tile_rank
            tc = (list(coords[:-1]) + [col_coord])[-m:] if coords else [col_coord]
            bc = [acc.offs[a] if a < nb - m else _add(acc.offs[a], tc[a - (nb - m)]) for a in range(nb)]
            conds, terms = [], []
            stride = 1
            for a in reversed(range(nb - 1)):
                conds.append(f"(unsigned)({bc[a]}) < {dims[a]}u")
                terms.append(bc[a] if stride == 1 else f"{bc[a]} * {stride}")
                stride *= dims[a]
            conds.reverse()
            rowlin = " + ".join(reversed(terms)) if terms else "0"
            col = bc[-1]
        ok = " && ".join(conds) if conds else "true"
        okv = ctx.var("bool", ok, "ok")
        ptype = f"{st}*" if write else f"const {st}*"
        rp = ctx.ptr(ptype, f"{okv} ? {acc.ptr} + (long long)({rowlin}) * {dims[-1]} : nullptr", "rp")
        return rp, col, dims[-1]

    @staticmethod
    def _round(dt: str, expr: str) -> str:
        if dt == "f16":
            return f"tldsl::comm::round_f16({expr})"
        if dt == "bf16":
            return f"tldsl::comm::round_bf16({expr})"
        return expr

    @staticmethod
    def _convert(src: str, dst: str, x: str) -> str:
        """A cast, as the general lowering's (a float to i32 by ``tldsl::gen::f2i``: NaN, inf and
        values out of range as the simulator's numpy gives them, not as the GPU's conversion)."""
        s, d = _compute(src), _compute(dst)
        if d == "bool":
            return f"({x} != 0)"
        if d == "int":
            return x if s == "int" else (f"tldsl::gen::f2i({x})" if s == "float" else f"(int)({x})")
        val = x if s == "float" else f"(float)({x})"
        return _CommEmitter._round(dst, val)

    @staticmethod
    def _ewise(op: core.Op, args: list[str]) -> str:
        """One element of an elementwise op by the general lowering's element rules: numpy's
        compute type (f32 with i32, or an integer tile with a Python float, in double with the
        exact constant), numpy's floor division and modulo, no contraction; rounded to the
        result's dtype."""
        kind = op.attrs["op"]
        ct = compute_type(op)
        conv = [convert(x, value_ctype(a.type.dtype), "bool" if (kind == "where" and i == 0) else ct)
                for i, (x, a) in enumerate(zip(args, op.operands))]
        return round_to(op.result.type.dtype, element_expr(kind, conv, ct), ct)

    # -- statements --------------------------------------------------------------------------------
    def _statement(self, op: core.Op, ind: str, lines: list[str]):
        n = op.name
        copy = False
        if n == "store":
            buf, *offs, tile = op.operands
            dst = _Box(buf.owner, self._buf_ptr(buf, None, op), [self.name(o, op) for o in offs],
                       len(tile.type.shape))
            shape, value = tile.type.shape, tile
            what = f"store -> {buf.owner.name}"
        else:
            src, srank, soffs, dv, drank, doffs, tile = data_operands(op)
            dst = _Box(dv.owner, self._buf_ptr(dv, drank, op), [self.name(o, op) for o in doffs],
                       len(dv.type.shape))
            if tile is not None:
                shape, value = tile.type.shape, tile
                what = f"{n} -> {dv.owner.name}.at(rank {self.name(drank, op)})"
            else:
                copy = True
                shape, value = tuple(op.attrs["shape"]), None
                srcbox = _Box(src.owner, self._buf_ptr(src, srank, op), [self.name(o, op) for o in soffs],
                              len(shape))
                what = (f"{n} {src.owner.name}@{self.name(srank, op)} -> {dv.owner.name}@{self.name(drank, op)} "
                        "(copy)")
        nd = len(shape)
        coords = statement_coords(nd)
        ctx = _Ctx(op, True)
        if copy:
            ctx.leaves.append(_Leaf(srcbox, coords[:-1], op))
            result = None
        else:
            result = self._val(value, coords, ctx)
        dt_out = dst.dtype
        ch = self.plan.chunking[id(op)]
        conds = []
        for a in [lf.access for lf in ctx.leaves] + [dst]:
            off = a.col_offset()
            try:
                int(off)                     # a constant: checked by the plan
            except ValueError:
                conds.append(f"(({off}) % kV) == 0")
        vec_ok = "false" if not ch.aligned else (" && ".join(conds) if conds else "true")
        chunk_args = dict(vec="kV", left="kC - c", vec_ok="vec_ok")

        i1, i2, i3, i4 = ind + "  ", ind + "    ", ind + "      ", ind + "        "
        L = lines
        L.append(f"{ind}{{  // {what}: tile {'x'.join(map(str, shape))} {dt_out}{marker(op.loc)}")
        L.append(f"{i1}constexpr int kC = {ch.cols}, kV = {ch.vec}, kNC = {ch.chunks}, kU = {ch.unroll}, "
                 f"kTotal = {ch.rows} * kNC;")
        L.append(f"{i1}const bool vec_ok = {vec_ok};")
        L.append(f"{i1}for (int base = (int)threadIdx.x; base < kTotal; base += kU * (int)blockDim.x) {{")
        for k, lf in enumerate(ctx.leaves):
            L.append(f"{i2}tldsl::comm::Chunk<{_storage(lf.access.dtype)}, kV> v{k}[kU];")
        if copy:
            L.append(f"{i2}unsigned m0[kU];")

        def chunk_head(out_ind):
            L.append(f"{out_ind}const int i = idx / kNC, c = (idx % kNC) * kV;")
            for k in range(nd - 1):
                stride = math.prod(shape[k + 1:-1])
                e = "i" if stride == 1 else f"i / {stride}"
                if k > 0:
                    e = f"({e}) % {shape[k]}"
                L.append(f"{out_ind}const int ti{k} = {e};")
            L.append(f"{out_ind}(void)i;")

        # phase 1: every leaf's chunks of this round
        L.append(f"{i2}#pragma unroll")
        L.append(f"{i2}for (int u = 0; u < kU; ++u) {{")
        L.append(f"{i3}const int idx = base + u * (int)blockDim.x;")
        L.append(f"{i3}if (idx < kTotal) {{")
        chunk_head(i4)
        for k, lf in enumerate(ctx.leaves):
            lctx = _Ctx(op, False)
            rp, col, ncols = self._row_access(lf.access, lf.row_coords + ["c"], "c", lctx)
            L.append(f"{i4}{{")
            L.extend(f"{i4}  {ln}" for ln in lctx.lines)
            L.append(f"{i4}  " + primitives.tile_pull_data(_storage(lf.access.dtype), rp, col, ncols,
                                                            chunk=f"v{k}[u]", mask="m0[u]" if copy else None,
                                                            **chunk_args))
            L.append(f"{i4}}}")
        L.append(f"{i3}}}")
        L.append(f"{i2}}}")
        # phase 2: element code, then the stores
        so = _storage(dt_out)
        L.append(f"{i2}#pragma unroll")
        L.append(f"{i2}for (int u = 0; u < kU; ++u) {{")
        L.append(f"{i3}const int idx = base + u * (int)blockDim.x;")
        L.append(f"{i3}if (idx < kTotal) {{")
        chunk_head(i4)
        if copy:
            chunk = "v0[u]"
            mask = "m0[u]"
        else:
            L.append(f"{i4}tldsl::comm::Chunk<{so}, kV> o{{}};")
            L.append(f"{i4}#pragma unroll")
            L.append(f"{i4}for (int e = 0; e < kV; ++e) {{")
            L.append(f"{i4}  const int cc = c + e;")
            L.append(f"{i4}  (void)cc;")
            L.extend(f"{i4}  {ln}" for ln in ctx.lines)
            L.append(f"{i4}  o.set(e, tldsl::comm::Elem<{so}>::put({result}));")
            L.append(f"{i4}}}")
            chunk = "o"
            mask = "~0u"
        dctx = _Ctx(op, False)
        dctx.n = 10000
        rp, col, ncols = self._row_access(dst, coords[:-1] + ["c"], "c", dctx, write=True)
        L.append(f"{i4}{{")
        L.extend(f"{i4}  {ln}" for ln in dctx.lines)
        L.append(f"{i4}  " + primitives.tile_push_data(so, rp, col, ncols, chunk, mask, **chunk_args))
        L.append(f"{i4}}}")
        L.append(f"{i3}}}")
        L.append(f"{i2}}}")
        L.append(f"{i1}}}")
        L.append(f"{ind}}}")


def render_sm_comm(plan: CommPlan) -> LoweredComm:
    """The kernel's source: the task loop over the part's body (see the module docstring)."""
    kernel, p, m = plan.kernel, plan.part, plan.match
    em = _CommEmitter(plan)
    body = em.emit(p.body.ops, "    ")
    params = plan.abi.params
    ntasks = math.prod(p.grid)
    digest = hashlib.sha256(repr((kernel.name, p.name, p.grid, plan.order, plan.lanes,
                                  plan.threads)).encode()).hexdigest()[:12]
    L = [f"// Generated by tldsl.codegen, recipe sm_comm — do not edit. Kernel '{kernel.name}', communication part "
         f"'{p.name}' ({p.loc}).",
         f"// tasks: grid {tuple(p.grid)} = {ntasks}, {plan.order} order; {plan.lanes} lane(s): CTA b runs tasks b, "
         f"b + gridDim.x, ...; world size {kernel.world_size}; config {digest}",
         '#include "tldsl/comm_nvshmem.hpp"' if plan.transport == "nvshmem" else '#include "tldsl/comm.hpp"',
         *element_math_includes(body),
         "",
         f'extern "C" __global__ void __launch_bounds__({plan.threads}, 1)',
         f"{plan.entry}(",
         "    " + ",\n    ".join(f"{q.ctype} {q.name}" for q in params) + ") {",
         "  (void)rank; (void)launch;",
         f"  for (int task = (int)blockIdx.x; task < {ntasks}; task += (int)gridDim.x) {{{marker(p.loc)}",
         "    // the rank, re-read per task: index code that depends on it only is not hoisted out of the",
         "    // task loop (it would stay live in registers across every statement of the task)",
         "    const int my_rank = tldsl::comm::opaque(rank);"]
    for axis, div, mod in plan.decode:
        e = "task" if div == 1 else f"task / {div}"
        if mod is not None:
            e = f"({e}) % {mod}"
        L.append(f"    const int pid{axis} = {e};")
    L += body
    if em.pending:
        L.append("    __syncthreads();  // this task's statements are done before the next task's begin")
    L += ["  }", "}", ""]
    return LoweredComm(kernel.name, p.name, plan.entry, "\n".join(L), params, plan.threads, plan.lanes,
                       tuple(p.grid), plan.order, kernel.world_size, m.waits, m.notifies, len(m.statements),
                       plan.abi.signals, plan.options, transport=plan.transport,
                       remote_buffers=plan.abi.remote_buffers, remote_signals=plan.abi.remote_signals)


RECIPE = Recipe("sm_comm", "comm", 20, match_sm_comm, plan_sm_comm, render_sm_comm,
                options=frozenset({"threads", "wait_timeout_ns", "entry"}),
                summary="persistent communication kernel on SMs")


def lower_comm(kernel: core.Kernel, part: str | core.Part | None = None, *, threads: int = DEFAULT_THREADS,
               wait_timeout_ns: int | None = None, entry: str | None = None) -> LoweredComm:
    """Lower an SM communication part (the only one, or the one named) to a persistent kernel:
    this recipe's match → plan → render, with the matcher's error (at the user's line) when the
    part does not fit. Options: :func:`..plan.comm.plan_sm_comm`."""
    p = only_part(kernel, part, WHAT, "communication parts on SMs", lambda q: q.role == "comm" and q.engine == "sm")
    return RECIPE.run(kernel, p, threads=threads, wait_timeout_ns=wait_timeout_ns, entry=entry)
