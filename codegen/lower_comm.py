"""Lower communication parts: SM parts to persistent CUDA kernels, copy-engine parts to host plans.

**SM parts** (``engine='sm'``: all-gather pull / push, reduce-scatter ring / full-mesh, push /
pull) become one ``extern "C"`` kernel (``include/tldsl/comm.hpp``):

* ``lanes`` CTAs (the schedule's ``sms``); CTA ``b`` runs tasks ``b, b + gridDim.x, ...`` of the
  communication schedule's task order (``CommSchedule.task_order``: row-major for ``ring``,
  peer step fastest for ``full_mesh``). Every task a CTA starts depends only on tasks of the
  same or an earlier index on other ranks (all ranks walk the same order), so the static
  assignment cannot deadlock where the simulator's lane queue does not.
* the part's index code (``const``, ``rank``, ``arith``, ``select``, ``load_scalar``, ``for``,
  ``if``) becomes C++ statements run by every thread (:mod:`.scalars`, shared with the GEMM
  lowering), each carrying its ``// tldsl: file:line`` marker;
* tile values are **not materialised**: a tile expression (``load``, ``load_rows``,
  ``tile_pull_data`` into a tile, ``iota``, ``full``, elementwise ops with numpy broadcasting,
  ``cast``, ``expand_dims``, ``broadcast``) is evaluated element by element where a statement
  consumes it (``store``, ``tile_push_data``; ``tile_pull_data`` / ``tile_push_data`` between
  tensors are plain copies). That keeps a 64 x 8192 fp32 tile out of shared memory, and it is
  exact because the lowering proves that moving a load down to its statement changes
  nothing: no notify and no write of the loaded tensor lie in between, and no loop separates
  the two (else :class:`LoweringError` at the load's line);
* a statement streams its tile through the CTA in chunks of ``V`` elements of a row
  (``V * sizeof`` >= 16 bytes), ``U`` chunks per thread per round: loads first (16-byte vectors
  when in bounds and aligned), then the element code, then the stores. Out-of-bounds loads
  read 0, out-of-bounds stores are dropped, copies move only elements inside both tensors —
  the simulator's rules. Float math is explicitly rounded (no FMA contraction) and 16-bit
  results are rounded at every op, as in numpy, so results match the simulator bit for bit;
* waits: thread 0 spins with ``ld.acquire`` at the wait's scope, then a CTA barrier; notifies:
  a CTA barrier, then thread 0 ``fence.acq_rel`` + ``red.relaxed.add`` at the notify's scope;
  consecutive statements of a task are separated by a CTA barrier.

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

Launch: grid ``(min(lanes, tasks), 1, 1)``, block ``(threads, 1, 1)`` (512 by default; any
block size works, the code reads ``blockDim.x``), no dynamic shared memory. All pointers must be
16-byte aligned (the vector path assumes it).

**Copy-engine parts** (``engine='copy_engine'``: ``rank_copy_data`` + ``rank_notify`` /
``rank_wait``) are not kernels: :func:`plan_copy_engine` evaluates their index code for every
rank and gives a :class:`CopyEnginePlan` — per rank, the ordered actions for one
communication stream: :class:`CeCopy` (``cuMemcpy2DAsync``), :class:`CeSignalWrite`
(``cuStreamWriteValue64``, ordered after the copies before it), :class:`CeWait`
(``cuStreamWaitValue64`` GEQ). :meth:`CopyEnginePlan.run_numpy` executes a plan on numpy
arrays (the reference the runtime must match).
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from ..ir import core
from .lowered import LoweredKernel, recognises  # noqa: F401
from ..ir import types as T
from ..ir.opdefs import DEFAULT_MEMORY_SCOPE, NOTIFY_OPS, WAIT_OPS, data_operands
from ..ir.semantics import ARITH, wait_target, wrap_i32
from .lower_gemm import KernelParam
from .scalars import LoweringError, ScalarEmitter, c_literal, cident, marker, wait_target_expr

DEFAULT_THREADS = 256
MAX_UNROLL = 8
CHUNK_REGISTERS = 32      # 32-bit registers per thread for the chunks a round keeps in flight

_STORAGE = {"f16": "tldsl::comm::f16", "bf16": "tldsl::comm::bf16", "f32": "float", "i32": "int"}
_BYTES = {"f16": 2, "bf16": 2, "f32": 4, "i32": 4}
_TILE_OPS = frozenset({"load", "load_rows", "tile_pull_data", "iota", "full", "ewise", "cast", "expand_dims",
                       "broadcast"})
_MEMORY_LEAVES = frozenset({"load", "load_rows", "tile_pull_data"})


def _fail(msg: str, op_or_loc=None) -> LoweringError:
    loc = getattr(op_or_loc, "loc", op_or_loc)
    return LoweringError(f"communication lowering: {msg}", loc)


def _is_this_rank(v: core.Value | None) -> bool:
    return v is None or (isinstance(v.owner, core.Op) and v.owner.name == "rank")


def _where(op) -> str:
    return op.loc.short() if getattr(op, "loc", None) is not None else "?"


# =================================================================================================
# SM parts
# =================================================================================================

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
        if self.transport == "nvshmem":
            from .toolchain import find_toolchain
            tc = find_toolchain()
            tc.require_nvshmem()
            kw["options"] = tuple(kw.pop("options", ())) + (f"-DTLDSL_NVSHMEM_VERSION=\"{tc.nvshmem_version}\"",)
        return super().compile(**kw)

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


def task_decode(grid: tuple[int, ...], order: str) -> list[tuple[int, int, int | None]]:
    """How task index ``t`` of ``CommSchedule(order=...).task_order(grid)`` gives the program
    ids: one ``(axis, divisor, modulus)`` per axis, ``pid[axis] = t // divisor % modulus``
    (``modulus`` None: no modulo needed)."""
    n = len(grid)
    if order == "full_mesh" and n >= 2:
        axes = list(range(1, n)) + [0]        # sort key (c[1:], c[0]): c0 fastest, then row-major
    else:
        axes = list(range(n))
    out = []
    div = 1
    for pos in reversed(range(n)):
        a = axes[pos]
        out.append((a, div, grid[a] if pos > 0 else None))
        div *= grid[a]
    return sorted(out)


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
        self.reads: list = []          # (access, tile coordinates) of every memory leaf
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


def _ctype(dtype) -> str:
    name = dtype.name if hasattr(dtype, "name") else dtype
    return {"i1": "bool", "i32": "int", "f32": "float", "f16": "float", "bf16": "float"}[name]


class _CommEmitter(ScalarEmitter):
    what = "the communication lowering"

    def __init__(self, kernel: core.Kernel, part: core.Part, transport: str = "ptr"):
        super().__init__(None)
        self.kernel, self.part = kernel, part
        self.transport = transport
        self.pre: dict[int, int] = {}
        self.parent: dict[int, core.Op | None] = {}
        self.block_of: dict[int, int] = {}
        notify_idx, writes = [], {}
        counter = itertools.count()

        def index(block, owner):
            for op in block.ops:
                k = next(counter)
                self.pre[id(op)] = k
                self.parent[id(op)] = owner
                self.block_of[id(op)] = id(block)
                if op.name in NOTIFY_OPS:
                    notify_idx.append(k)
                wb = self._written_buffer(op)
                if wb is not None:
                    writes.setdefault(id(wb), []).append(k)
                for r in op.regions:
                    index(r, op)
        index(part.body, None)
        self.notify_idx = notify_idx
        self.write_idx = writes
        self.local_bufs: dict[int, tuple[core.Buffer, set]] = {}
        self.peer_bufs: dict[int, tuple[core.Buffer, set]] = {}
        self.local_sigs: dict[int, tuple[core.Signal, set]] = {}
        self.peer_sigs: dict[int, core.Signal] = {}
        self.remote_bufs: dict[int, core.Buffer] = {}     # addressed on another rank (either transport)
        self.remote_sigs: dict[int, core.Signal] = {}
        self.pending = False           # a statement ran since the last CTA barrier
        self.waits = self.notifies = self.transfers = 0
        self._has_sink: dict[int, bool] = {}

    # -- bookkeeping ---------------------------------------------------------------------------
    def fail(self, msg, op=None):
        return _fail(msg, op)

    def rank_expr(self) -> str:
        return "my_rank"

    @staticmethod
    def _written_buffer(op: core.Op):
        if op.name == "store":
            return op.operands[0].owner
        if op.name in ("tile_push_data", "tile_pull_data", "rank_copy_data"):
            _, _, _, dst, _, _, _ = data_operands(op)
            return dst.owner if dst is not None else None
        return None

    def _buf_ptr(self, v: core.Value, rank: core.Value | None, mode: str, op) -> str:
        buf = v.owner
        if not isinstance(buf, core.Buffer):
            raise _fail("a data operand must be a kernel tensor", op)
        if buf.type.dtype.name not in _STORAGE:
            raise _fail(f"tensor '{buf.name}' is {buf.type.dtype}: communication kernels move f16, bf16, f32 "
                        "and i32 data", op)
        if _is_this_rank(rank):
            self.local_bufs.setdefault(id(buf), (buf, set()))[1].add(mode)
            return f"buf_{cident(buf.name)}"
        if not buf.symmetric:
            raise _fail(f"'{buf.name}' is addressed on another rank but is not symmetric", op)
        self.remote_bufs[id(buf)] = buf
        if self.transport == "nvshmem":       # this rank's symmetric address, mapped on the device
            self.local_bufs.setdefault(id(buf), (buf, set()))[1].add(mode)
            return f"tldsl::comm::peer(buf_{cident(buf.name)}, {self.name(rank, op)})"
        self.peer_bufs.setdefault(id(buf), (buf, set()))[1].add(mode)
        return f"buf_{cident(buf.name)}_peers[{self.name(rank, op)}]"

    def _sig_ptr(self, op, rank: core.Value | None, mode: str) -> str:
        sig = op.operands[0].owner
        ch = self.name(op.operands[1], op)
        if _is_this_rank(rank):
            self.local_sigs.setdefault(id(sig), (sig, set()))[1].add(mode)
            return f"sig_{cident(sig.name)} + {ch}"
        self.peer_sigs[id(sig)] = sig
        self.remote_sigs[id(sig)] = sig
        return f"sig_{cident(sig.name)}_peers[{self.name(rank, op)}] + {ch}"

    def _region_has_sink(self, block: core.Block) -> bool:
        if id(block) not in self._has_sink:
            self._has_sink[id(block)] = any(self._is_sink(o) for o in block.walk())
        return self._has_sink[id(block)]

    @staticmethod
    def _is_sink(op) -> bool:
        return op.name == "store" or op.name == "tile_push_data" or \
            (op.name == "tile_pull_data" and op.attrs.get("form", "copy") == "copy")

    # -- ops -------------------------------------------------------------------------------------
    def emit_op(self, op, ind, lines):
        if op.name in ("for", "if"):
            before = self.pending
            body = op.regions[0]
            has = self._region_has_sink(body)
            if op.name == "for" and has:
                self.pending = True          # the loop's back edge: the last iteration's statement
            super().emit_op(op, ind, lines)
            self.pending = before or has or self.pending
            return
        super().emit_op(op, ind, lines)

    def emit_other(self, op, ind, lines):
        n = op.name
        mk = marker(op.loc)
        if n in WAIT_OPS:
            scope = "tldsl::kScopeSys" if DEFAULT_MEMORY_SCOPE[n] == "sys" else "tldsl::kScopeGpu"
            slot = self._sig_ptr(op, None, "r")
            count = self.name(op.operands[2], op)
            target = wait_target_expr(op, count)
            lines.append(f"{ind}tldsl::comm::cta_wait<{scope}>({slot}, {target});  // {n}{mk}")
            self.waits += 1
            self.pending = False
        elif n in NOTIFY_OPS:
            rank = None if n == "producer_tile_notify" else op.operands[2]
            scope = op.attrs.get("scope", DEFAULT_MEMORY_SCOPE[n])
            cscope = "tldsl::kScopeSys" if scope == "sys" else "tldsl::kScopeGpu"
            if self.transport == "nvshmem" and rank is not None and not _is_this_rank(rank):
                slot = self._sig_ptr(op, None, "w")        # the symmetric counter; NVSHMEM finds rank's copy
                sig = op.operands[0].owner
                self.remote_sigs[id(sig)] = sig
                lines.append(f"{ind}tldsl::comm::cta_notify_peer({slot}, {self.name(rank, op)});  // {n}{mk}")
            else:
                slot = self._sig_ptr(op, rank, "w")
                lines.append(f"{ind}tldsl::comm::cta_notify<{cscope}>({slot});  // {n}{mk}")
            self.notifies += 1
            self.pending = False
        elif self._is_sink(op):
            if self.pending:
                lines.append(f"{ind}__syncthreads();  // the previous statement's threads are done")
            self._sink(op, ind, lines)
            self.transfers += 1
            self.pending = True
        elif n in _TILE_OPS and op.results and isinstance(op.result.type, T.TileType):
            pass                           # evaluated where a statement consumes it
        elif n == "rank_copy_data":
            raise _fail("rank_copy_data runs on the copy engine, not in an SM communication part", op)
        else:
            raise _fail(f"'{n}' is not supported in a communication part on SMs (supported: index code, "
                        "waits, notifies, loads, elementwise tile math, casts, stores and tile_push/pull_data)", op)

    # -- moving a tile's reads down to the statement that consumes it ------------------------------
    def _check_deferral(self, node_op: core.Op, sink: core.Op):
        blk = self.block_of[id(node_op)]
        cur = sink
        while self.block_of[id(cur)] != blk:
            owner = self.parent[id(cur)]
            if owner is None:
                raise _fail(f"a tile made at {_where(node_op)} is used by the statement at {_where(sink)} outside "
                            "the region that made it; keep tile values inside their loop / condition", node_op)
            if owner.name == "for":
                raise _fail(f"the tile made at {_where(node_op)} is used inside a tl.range loop (at {_where(sink)}) "
                            "that does not make it; the lowering evaluates tiles where they are stored, so load it "
                            "inside the loop", node_op)
            cur = owner
        if node_op.name not in _MEMORY_LEAVES:
            return
        lo, hi = self.pre[id(node_op)], self.pre[id(sink)]
        k = bisect.bisect_right(self.notify_idx, lo)
        if k < len(self.notify_idx) and self.notify_idx[k] < hi:
            raise _fail(f"the tile loaded at {_where(node_op)} is stored at {_where(sink)} after a notify; the "
                        "lowering reads a tile where it is stored, which would move the read after the release: "
                        "store it before the notify", node_op)
        src = node_op.operands[0].owner
        ws = self.write_idx.get(id(src), [])
        k = bisect.bisect_right(ws, lo)
        if k < len(ws) and ws[k] < hi:
            raise _fail(f"'{src.name}' is written between the load at {_where(node_op)} and the statement at "
                        f"{_where(sink)} that consumes it; the lowering reads a tile where it is stored, which would "
                        "see that write", node_op)

    # -- tile expressions --------------------------------------------------------------------------
    @staticmethod
    def _bcast(coords: list[str], src_shape, dst_shape) -> list[str]:
        m, n = len(src_shape), len(dst_shape)
        out = []
        for j in range(m):
            a = j + n - m
            out.append("0" if src_shape[j] == 1 and dst_shape[a] != 1 else coords[a])
        return out

    def _val(self, v: core.Value, coords: list[str], ctx: _Ctx) -> str:
        """C expression of tile value ``v`` at tile coordinates ``coords`` (one per axis)."""
        if not isinstance(v.type, T.TileType):
            return self.name(v, ctx.sink)              # a scalar operand, defined by the index code
        key = (v.id, tuple(coords))
        if key in ctx.memo:
            return ctx.memo[key]
        op = v.owner
        if not isinstance(op, core.Op):
            raise _fail("internal: a tile without a defining op", ctx.sink)
        self._check_deferral(op, ctx.sink)
        n = op.name
        dt = op.result.type.dtype.name
        ct = _ctype(dt)
        shape = op.result.type.shape
        if n == "load":
            acc = _Box(op.operands[0].owner, self._buf_ptr(op.operands[0], None, "r", op),
                       [self.name(o, op) for o in op.operands[1:]], len(shape))
            out = self._leaf(acc, coords, op, ctx)
        elif n == "tile_pull_data":
            src, srank, soffs, *_ = data_operands(op)
            acc = _Box(src.owner, self._buf_ptr(src, srank, "r", op), [self.name(o, op) for o in soffs], len(shape))
            out = self._leaf(acc, coords, op, ctx)
        elif n == "load_rows":
            buf, rows, col = op.operands
            acc = _Rows(buf.owner, self._buf_ptr(buf, None, "r", op), rows, self.name(col, op))
            out = self._leaf(acc, coords, op, ctx)
        elif n == "iota":
            out = coords[0]
        elif n == "full":
            val = op.attrs["value"]
            lit = c_literal(bool(val) if dt == "i1" else int(val) if dt == "i32" else float(val))
            out = ctx.var(ct, self._round(dt, lit))
        elif n == "ewise":
            args = [self._val(a, self._bcast(coords, a.type.shape, shape) if isinstance(a.type, T.TileType) else [],
                              ctx) for a in op.operands]
            out = ctx.var(ct, self._round(dt, self._ewise(op, args)))
        elif n == "cast":
            x = self._val(op.operands[0], coords, ctx)
            out = ctx.var(ct, self._convert(op.operands[0].type.dtype.name, dt, x))
        elif n == "expand_dims":
            axis = op.attrs["axis"]
            out = self._val(op.operands[0], coords[:axis] + coords[axis + 1:], ctx)
        elif n == "broadcast":
            src = op.operands[0]
            out = self._val(src, self._bcast(coords, src.type.shape, shape), ctx)
        else:
            raise _fail(f"'{n}' cannot be streamed by the communication lowering (it handles loads, "
                        "elementwise math, casts and broadcasts; no dot, reduce, transpose or fragments)", op)
        ctx.memo[key] = out
        return out

    def _leaf(self, acc, coords: list[str], op: core.Op, ctx: _Ctx) -> str:
        st = _STORAGE[acc.dtype]
        ctx.reads.append((acc, list(coords)))
        if ctx.vector and coords and coords[-1] == "cc":
            k = len(ctx.leaves)
            ctx.leaves.append(_Leaf(acc, coords[:-1], op))
            return ctx.var(_ctype(acc.dtype), f"tldsl::comm::Elem<{st}>::get(v{k}[u].get(e))", "l")
        # an element load (broadcast along the row, or inside a row index)
        rp, col, ncols = self._row_access(acc, coords, coords[-1] if coords else "0", ctx)
        return ctx.var(_ctype(acc.dtype), f"tldsl::comm::Elem<{st}>::get(tldsl::comm::load_elem<{st}>({rp}, {col}, "
                                           f"{ncols}))", "l")

    def _row_access(self, acc, coords: list[str], col_coord: str, ctx: _Ctx, write: bool = False):
        """Emit the row pointer of an access at tile coordinates ``coords`` (the last one is
        replaced by ``col_coord``): returns (row pointer variable, column expression, ncols).
        The row pointer is null where the row lies outside the tensor."""
        dims = acc.dims
        st = _STORAGE[acc.dtype]
        nb = len(dims)
        if isinstance(acc, _Rows):
            rows_ctx = _Ctx(ctx.sink, False)
            rows_ctx.n, rows_ctx.reads = ctx.n, ctx.reads
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
        s, d = _ctype(src), _ctype(dst)
        if d == "bool":
            return f"({x} != 0)"
        if d == "int":
            return f"(int)({x})" if s != "int" else x
        val = x if s == "float" else f"(float)({x})"
        return _CommEmitter._round(dst, val)

    def _ewise(self, op: core.Op, args: list[str]) -> str:
        kind = op.attrs["op"]
        dts = [a.type.dtype.name for a in op.operands]
        rdt = op.result.type.dtype.name
        is_f = any(d in ("f16", "bf16", "f32") for d in dts) or rdt in ("f16", "bf16", "f32") and kind != "where"
        if kind == "where":
            c, a, b = args
            return f"({c} ? {a} : {b})"
        if kind in ("lt", "le", "gt", "ge", "eq", "ne"):
            sym = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}[kind]
            return f"({args[0]} {sym} {args[1]})"
        if kind in ("and", "or"):
            if all(d == "i1" for d in dts):
                return f"({args[0]} {'&&' if kind == 'and' else '||'} {args[1]})"
            return f"({args[0]} {'&' if kind == 'and' else '|'} {args[1]})"
        if kind == "not":
            return f"(!{args[0]})"
        if is_f:
            fa = [a if d in ("f16", "bf16", "f32") else f"(float)({a})" for a, d in zip(args, dts)]
            table = {"add": "tldsl::comm::fadd({0}, {1})", "sub": "tldsl::comm::fsub({0}, {1})",
                     "mul": "tldsl::comm::fmul({0}, {1})", "div": "tldsl::comm::fdiv({0}, {1})",
                     "max": "tldsl::comm::fmax_nan({0}, {1})", "min": "tldsl::comm::fmin_nan({0}, {1})",
                     "floordiv": "floorf(tldsl::comm::fdiv({0}, {1}))",
                     "mod": "tldsl::comm::fsub({0}, tldsl::comm::fmul(floorf(tldsl::comm::fdiv({0}, {1})), {1}))",
                     "neg": "(-{0})", "exp": "expf({0})", "exp2": "exp2f({0})", "log": "logf({0})",
                     "abs": "fabsf({0})", "sqrt": "sqrtf({0})", "recip": "tldsl::comm::fdiv(1.0f, {0})"}
        else:
            fa = args
            table = {"add": "tldsl::comm::iadd({0}, {1})", "sub": "tldsl::comm::isub({0}, {1})",
                     "mul": "tldsl::comm::imul({0}, {1})", "max": "tldsl::imax({0}, {1})",
                     "min": "tldsl::imin({0}, {1})", "floordiv": "tldsl::floordiv({0}, {1})",
                     "mod": "tldsl::floormod({0}, {1})", "neg": "tldsl::comm::isub(0, {0})",
                     "abs": "tldsl::imax({0}, tldsl::comm::isub(0, {0}))",
                     "div": "tldsl::comm::fdiv((float)({0}), (float)({1}))"}
        if kind not in table:
            raise _fail(f"elementwise '{kind}' on {dts} is not supported by the communication lowering", op)
        return table[kind].format(*fa)

    # -- statements --------------------------------------------------------------------------------
    def _sink(self, op: core.Op, ind: str, lines: list[str]):
        n = op.name
        copy = False
        if n == "store":
            buf, *offs, tile = op.operands
            dst = _Box(buf.owner, self._buf_ptr(buf, None, "w", op), [self.name(o, op) for o in offs],
                       len(tile.type.shape))
            shape, value = tile.type.shape, tile
            what = f"store -> {buf.owner.name}"
        else:
            src, srank, soffs, dv, drank, doffs, tile = data_operands(op)
            dst = _Box(dv.owner, self._buf_ptr(dv, drank, "w", op), [self.name(o, op) for o in doffs],
                       len(dv.type.shape))
            if tile is not None:
                shape, value = tile.type.shape, tile
                what = f"{n} -> {dv.owner.name}.at(rank {self.name(drank, op)})"
            else:
                copy = True
                shape, value = tuple(op.attrs["shape"]), None
                if len(src.type.shape) != len(dv.type.shape):
                    raise _fail(f"{n} between tensors of different ranks ({src.owner.name} is "
                                f"{len(src.type.shape)}-d, {dv.owner.name} {len(dv.type.shape)}-d)", op)
                srcbox = _Box(src.owner, self._buf_ptr(src, srank, "r", op), [self.name(o, op) for o in soffs],
                              len(shape))
                what = (f"{n} {src.owner.name}@{self.name(srank, op)} -> {dv.owner.name}@{self.name(drank, op)} "
                        "(copy)")
        nd = len(shape)
        R, C = math.prod(shape[:-1]), shape[-1]
        coords = [f"ti{k}" for k in range(nd - 1)] + ["cc"]
        ctx = _Ctx(op, True)
        if copy:
            ctx.leaves.append(_Leaf(srcbox, coords[:-1], op))
            result = None
        else:
            result = self._val(value, coords, ctx)
            self._check_self_alias(op, dst, ctx)
        dt_out = dst.dtype
        vec_accesses = [lf.access for lf in ctx.leaves] + [dst]
        V = 16 // min(_BYTES[a.dtype] for a in vec_accesses)
        NC = -(-C // V)
        # registers of one chunk per access (a copy stores the chunk it loaded)
        if copy:
            regs = V * _BYTES[ctx.leaves[0].access.dtype] // 4
        else:
            regs = sum(V * _BYTES[a.dtype] // 4 for a in vec_accesses)
        U = max(1, min(MAX_UNROLL, CHUNK_REGISTERS // max(1, regs)))
        static_ok = all(a.dims[-1] % V == 0 for a in vec_accesses)
        conds = []
        for a in vec_accesses:
            off = a.col_offset()
            try:
                if int(off) % V:
                    static_ok = False
            except ValueError:
                conds.append(f"(({off}) % kV) == 0")
        vec_ok = "false" if not static_ok else (" && ".join(conds) if conds else "true")

        i1, i2, i3, i4 = ind + "  ", ind + "    ", ind + "      ", ind + "        "
        L = lines
        L.append(f"{ind}{{  // {what}: tile {'x'.join(map(str, shape))} {dt_out}{marker(op.loc)}")
        L.append(f"{i1}constexpr int kC = {C}, kV = {V}, kNC = {NC}, kU = {U}, kTotal = {R} * kNC;")
        L.append(f"{i1}const bool vec_ok = {vec_ok};")
        L.append(f"{i1}for (int base = (int)threadIdx.x; base < kTotal; base += kU * (int)blockDim.x) {{")
        for k, lf in enumerate(ctx.leaves):
            L.append(f"{i2}tldsl::comm::Chunk<{_STORAGE[lf.access.dtype]}, kV> v{k}[kU];")
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
            st = _STORAGE[lf.access.dtype]
            L.append(f"{i4}{{")
            L.extend(f"{i4}  {ln}" for ln in lctx.lines)
            mask = "m0[u] = " if copy else ""
            L.append(f"{i4}  {mask}tldsl::comm::load_chunk<{st}, kV>(v{k}[u], {rp}, {col}, {ncols}, kC - c, vec_ok);")
            L.append(f"{i4}}}")
        L.append(f"{i3}}}")
        L.append(f"{i2}}}")
        # phase 2: element code, then the stores
        so = _STORAGE[dt_out]
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
        L.append(f"{i4}  tldsl::comm::store_chunk<{so}, kV>({rp}, {col}, {ncols}, kC - c, "
                 f"vec_ok, {mask}, {chunk});")
        L.append(f"{i4}}}")
        L.append(f"{i3}}}")
        L.append(f"{i2}}}")
        L.append(f"{i1}}}")
        L.append(f"{ind}}}")

    def _check_self_alias(self, op, dst: _Box, ctx: _Ctx):
        """A statement that reads the tensor it writes, on this rank: only the same box, element
        for element, is safe when threads store while others still load."""
        for a, coords in ctx.reads:
            if a.buf is not dst.buf or a.ptr != dst.ptr:
                continue
            if isinstance(a, _Box) and a.offs == dst.offs and a.tile_rank == dst.tile_rank and \
                    coords == [f"ti{k}" for k in range(len(coords) - 1)] + ["cc"]:
                continue
            raise _fail(f"the statement at {_where(op)} reads '{a.buf.name}' at another place than it writes it; "
                        "the lowering streams a statement through many threads, so store into another tensor", op)


def lower_comm(kernel: core.Kernel, part: str | core.Part | None = None, *, threads: int = DEFAULT_THREADS,
               wait_timeout_ns: int | None = None, entry: str | None = None) -> LoweredComm:
    """Lower an SM communication part (the only one, or the one named) to a persistent kernel."""
    if part is None:
        parts = [p for p in kernel.parts if p.role == "comm" and p.engine == "sm"]
        if len(parts) != 1:
            raise _fail(f"kernel '{kernel.name}' has {len(parts)} communication parts on SMs; name the one to lower",
                        kernel.loc)
        p = parts[0]
    else:
        p = kernel.part(part) if isinstance(part, str) else part
    if p.role != "comm":
        raise _fail(f"part '{p.name}' is a {p.role} part; lower_comm lowers communication parts", p)
    if p.engine != "sm":
        raise _fail(f"part '{p.name}' runs on the copy engine: it becomes a host plan (plan_copy_engine), not a kernel", p)
    if not (isinstance(threads, int) and 32 <= threads <= 1024 and threads % 32 == 0):
        raise _fail(f"threads={threads}: need a multiple of 32 between 32 and 1024", p)
    sched = kernel.comm_schedule
    order = sched.order if sched is not None else "ring"
    lanes = int(p.lanes or (sched.lanes if sched is not None else 1))
    transport = sched.transport if sched is not None else "ptr"
    em = _CommEmitter(kernel, p, transport)
    decode = task_decode(tuple(p.grid), order)
    body = em.emit(p.body.ops, "    ")
    entry = entry or cident(f"tldsl_{kernel.name}_{p.name}")

    params: list[KernelParam] = []
    for b in kernel.buffers:
        st = _STORAGE.get(b.type.dtype.name)
        if id(b) in em.local_bufs:
            const = "const " if em.local_bufs[id(b)][1] == {"r"} else ""
            params.append(KernelParam(f"buf_{cident(b.name)}", f"{const}{st}*", "ptr", f"buffer:{b.name}"))
        if id(b) in em.peer_bufs:
            params.append(KernelParam(f"buf_{cident(b.name)}_peers", f"{st}* const* __restrict__", "ptr",
                                      f"peers:{b.name}"))
    for s in kernel.signals:
        if id(s) in em.local_sigs:
            const = "const " if em.local_sigs[id(s)][1] == {"r"} else ""
            params.append(KernelParam(f"sig_{cident(s.name)}", f"{const}unsigned long long*", "ptr",
                                      f"signal:{s.name}"))
        if id(s) in em.peer_sigs:
            params.append(KernelParam(f"sig_{cident(s.name)}_peers", "unsigned long long* const* __restrict__", "ptr",
                                      f"peer_signals:{s.name}"))
    for t in em.tables:
        params.append(KernelParam(f"tbl_{cident(t.name)}", "const int* __restrict__", "ptr", f"buffer:{t.name}"))
    params += [KernelParam("rank", "int", "i32", "rank"),
               KernelParam("launch", "unsigned long long", "u64", "launch")]

    ntasks = math.prod(p.grid)
    digest = hashlib.sha256(repr((kernel.name, p.name, p.grid, order, lanes, threads)).encode()).hexdigest()[:12]
    L = [f"// Generated by tldsl.codegen.lower_comm — do not edit. Kernel '{kernel.name}', communication part "
         f"'{p.name}' ({p.loc}).",
         f"// tasks: grid {tuple(p.grid)} = {ntasks}, {order} order; {lanes} lane(s): CTA b runs tasks b, "
         f"b + gridDim.x, ...; world size {kernel.world_size}; config {digest}",
         '#include "tldsl/comm_nvshmem.hpp"' if transport == "nvshmem" else '#include "tldsl/comm.hpp"',
         "",
         f'extern "C" __global__ void __launch_bounds__({threads}, 1)',
         f"{entry}(",
         "    " + ",\n    ".join(f"{q.ctype} {q.name}" for q in params) + ") {",
         "  (void)rank; (void)launch;",
         f"  for (int task = (int)blockIdx.x; task < {ntasks}; task += (int)gridDim.x) {{{marker(p.loc)}",
         "    // the rank, re-read per task: index code that depends on it only is not hoisted out of the",
         "    // task loop (it would stay live in registers across every statement of the task)",
         "    const int my_rank = tldsl::comm::opaque(rank);"]
    for axis, div, mod in decode:
        e = "task" if div == 1 else f"task / {div}"
        if mod is not None:
            e = f"({e}) % {mod}"
        L.append(f"    const int pid{axis} = {e};")
    L += body
    if em.pending:
        L.append("    __syncthreads();  // this task's statements are done before the next task's begin")
    L += ["  }", "}", ""]
    options = []
    if wait_timeout_ns is not None:
        options.append(f"-DTLDSL_WAIT_TIMEOUT_NS={int(wait_timeout_ns)}ull")
    if transport == "nvshmem":
        options.append("-D__NVSHMEM_NUMBA_SUPPORT__")       # header-only NVSHMEM: no device library to link
    sigs = [s.name for s in kernel.signals if id(s) in em.local_sigs or id(s) in em.peer_sigs]
    return LoweredComm(kernel.name, p.name, entry, "\n".join(L), tuple(params), threads, lanes, tuple(p.grid), order,
                       kernel.world_size, em.waits, em.notifies, em.transfers, tuple(sigs), tuple(options),
                       transport=transport,
                       remote_buffers=tuple(b.name for b in kernel.buffers if id(b) in em.remote_bufs),
                       remote_signals=tuple(x.name for x in kernel.signals if id(x) in em.remote_sigs))


# =================================================================================================
# Copy-engine parts
# =================================================================================================

@dataclass(frozen=True)
class CeCopy:
    """``cuMemcpy2DAsync`` on the rank's communication stream: ``height`` rows of
    ``width_bytes`` from rank ``src_rank``'s ``src`` (first byte ``src_byte_offset`` from its
    base, rows ``src_pitch`` bytes apart) to rank ``dst_rank``'s ``dst``. Offsets and ``shape``
    are in elements, already clipped to both tensors (the simulator's rule)."""
    src: str
    src_rank: int
    src_offsets: tuple[int, ...]
    dst: str
    dst_rank: int
    dst_offsets: tuple[int, ...]
    shape: tuple[int, ...]
    elem_bytes: int
    src_byte_offset: int
    dst_byte_offset: int
    width_bytes: int
    height: int
    src_pitch: int
    dst_pitch: int
    task: tuple[int, ...]
    loc: str = ""

    @property
    def nbytes(self) -> int:
        return self.width_bytes * self.height


@dataclass(frozen=True)
class CeSignalWrite:
    """``cuStreamWriteValue64(stream, <rank's copy of signal> + 8 * slot, value(launch),
    CU_STREAM_WRITE_VALUE_DEFAULT)``: ordered after every earlier action of the stream (the
    default flags include the memory barrier). Counters only grow: the ``index``-th of the
    ``per_launch`` notifies of this slot in a launch writes ``(launch - 1) * per_launch + index``,
    what ``index`` atomic adds would have left (one rank owns each slot, so no add is lost)."""
    signal: str
    rank: int
    slot: int
    per_launch: int
    index: int
    task: tuple[int, ...]
    loc: str = ""

    def value(self, launch: int) -> int:
        return (launch - 1) * self.per_launch + self.index

    @property
    def byte_offset(self) -> int:
        return 8 * self.slot


@dataclass(frozen=True)
class CeWait:
    """``cuStreamWaitValue64(stream, <this rank's copy of signal> + 8 * slot, target(launch),
    CU_STREAM_WAIT_VALUE_GEQ)``."""
    signal: str
    slot: int
    count: int
    epoch: bool
    task: tuple[int, ...]
    loc: str = ""
    per_launch: int | None = None

    def target(self, launch: int) -> int:
        return wait_target(self.count, launch, self.epoch, self.per_launch)

    def target_text(self) -> str:
        """:meth:`target` as a formula of ``launch``."""
        if not self.epoch:
            return str(self.count)
        if self.per_launch is None:
            return f"{self.count} * launch"
        return f"{self.per_launch} * (launch - 1) + {self.count}"


@dataclass(frozen=True)
class CopyEnginePlan:
    """A copy-engine part as host actions: ``actions[r]`` is what rank ``r`` enqueues, in order,
    on one communication stream per launch (see the module docstring). Pointers: a symmetric
    buffer / signal on rank ``q`` is addressed through rank ``q``'s mapping as seen from the
    executing rank (``nvshmem_ptr`` / symmetric memory ``buffer_ptrs[q]``)."""
    kernel_name: str
    part: str
    world_size: int
    actions: tuple[tuple[CeCopy | CeSignalWrite | CeWait, ...], ...]
    buffers: dict = field(default_factory=dict)      # name -> (shape, dtype name, element bytes)
    signals: dict = field(default_factory=dict)      # name -> slots

    def copies(self, rank: int) -> list[CeCopy]:
        return [a for a in self.actions[rank] if isinstance(a, CeCopy)]

    def describe(self) -> str:
        out = [f"{self.kernel_name}.{self.part}: copy-engine plan, {self.world_size} rank(s)"]
        for r, acts in enumerate(self.actions):
            out.append(f"  rank {r}:")
            for a in acts:
                if isinstance(a, CeCopy):
                    out.append(f"    copy {a.src}@{a.src_rank}{list(a.src_offsets)} -> {a.dst}@{a.dst_rank}"
                               f"{list(a.dst_offsets)} {'x'.join(map(str, a.shape))}: {a.height} x {a.width_bytes} B "
                               f"(+{a.src_byte_offset} pitch {a.src_pitch} -> +{a.dst_byte_offset} pitch {a.dst_pitch})")
                elif isinstance(a, CeSignalWrite):
                    out.append(f"    write {a.signal}[{a.slot}]@{a.rank} = (launch-1)*{a.per_launch}+{a.index}")
                else:
                    out.append(f"    wait {a.signal}[{a.slot}] >= {a.target_text()}")
        return "\n".join(out)

    def run_numpy(self, memory: list[dict], signals: list[dict], launch: int = 1) -> None:
        """Execute the plan on numpy arrays in device layout (C-contiguous; 16-bit floats as
        2-byte items): ``memory[r][name]`` is rank ``r``'s tensor, ``signals[r][name]`` its u64
        counters. Copies move raw bytes with the plan's offsets and pitches — what the driver
        will do. Ranks' streams interleave; a wait blocks its stream until satisfied."""
        pos = [0] * self.world_size
        while True:
            progressed = False
            for r in range(self.world_size):
                while pos[r] < len(self.actions[r]):
                    a = self.actions[r][pos[r]]
                    if isinstance(a, CeWait):
                        if int(signals[r][a.signal][a.slot]) < a.target(launch):
                            break
                    elif isinstance(a, CeSignalWrite):
                        signals[a.rank][a.signal][a.slot] = a.value(launch)
                    else:
                        _numpy_copy(a, memory)
                    pos[r] += 1
                    progressed = True
            if all(p == len(acts) for p, acts in zip(pos, self.actions)):
                return
            if not progressed:
                stuck = {r: self.actions[r][pos[r]] for r in range(self.world_size) if pos[r] < len(self.actions[r])}
                raise RuntimeError(f"copy-engine plan deadlocked: every unfinished stream waits ({stuck})")


def _numpy_copy(a: CeCopy, memory):
    src, dst = memory[a.src_rank][a.src], memory[a.dst_rank][a.dst]
    for arr, name in ((src, a.src), (dst, a.dst)):
        if not arr.flags.c_contiguous or arr.itemsize != a.elem_bytes:
            raise ValueError(f"'{name}' must be C-contiguous with {a.elem_bytes}-byte elements (device layout)")
    sb, db = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    w = a.width_bytes
    for h in range(a.height):
        s0, d0 = a.src_byte_offset + h * a.src_pitch, a.dst_byte_offset + h * a.dst_pitch
        db[d0:d0 + w] = sb[s0:s0 + w]


def _ce_eval(block, env, rank, task, out, kernel):
    for op in block.ops:
        n = op.name
        if n == "const":
            env[op.result.id] = op.attrs["value"]
        elif n == "program_id":
            env[op.result.id] = task[op.attrs["axis"]]
        elif n == "rank":
            env[op.result.id] = rank
        elif n == "arith":
            a, b = env[op.operands[0].id], env[op.operands[1].id]
            try:
                env[op.result.id] = wrap_i32(ARITH[op.attrs["op"]](a, b))
            except ZeroDivisionError as e:
                raise _fail(f"rank {rank} task {task}: {e}", op) from None
        elif n == "select":
            c, a, b = (env[v.id] for v in op.operands)
            env[op.result.id] = a if c else b
        elif n == "for":
            lo, hi, st = (env[v.id] for v in op.operands)
            if st <= 0:
                raise _fail(f"loop step {st} must be positive", op)
            for i in range(lo, hi, st):
                env[op.regions[0].args[0].id] = i
                _ce_eval(op.regions[0], env, rank, task, out, kernel)
        elif n == "if":
            if env[op.operands[0].id]:
                _ce_eval(op.regions[0], env, rank, task, out, kernel)
        elif n == "rank_copy_data":
            src, srank, soffs, dst, drank, doffs, _ = data_operands(op)
            out.append(("copy", op, src.owner, env[srank.id], [env[o.id] for o in soffs], dst.owner,
                        env[drank.id], [env[o.id] for o in doffs], tuple(op.attrs["shape"]), task))
        elif n == "rank_notify":
            out.append(("notify", op, op.operands[0].owner, env[op.operands[1].id], env[op.operands[2].id], task))
        elif n in ("rank_wait", "consumer_tile_wait"):        # a stream wait on this rank's counters
            out.append(("wait", op, op.operands[0].owner, env[op.operands[1].id], env[op.operands[2].id],
                        bool(op.attrs.get("epoch", True)), op.attrs.get("per_launch"), task))
        else:
            raise _fail(f"'{n}' cannot run on the copy engine (a plan of copies and stream memory operations is "
                        "made on the host: index code, rank_copy_data, rank_notify, rank_wait and "
                        "consumer_tile_wait only)", op)


def _ce_copies(op, sbuf, srank, soffs, dbuf, drank, doffs, shape, task, W) -> list[CeCopy]:
    for who, r in (("source", srank), ("destination", drank)):
        if not 0 <= r < W:
            raise _fail(f"task {task}: {who} rank {r} is outside the group of {W}", op)
    sd, dd = sbuf.type.shape, dbuf.type.shape
    if len(sd) != len(dd) or len(shape) != len(sd):
        raise _fail(f"rank_copy_data between tensors of different ranks ({sbuf.name} {list(sd)}, "
                    f"{dbuf.name} {list(dd)})", op)
    ext = []
    for s_o, d_o, nn, s_d, d_d in zip(soffs, doffs, shape, sd, dd):
        ext.append((max(0, -s_o, -d_o), min(nn, s_d - s_o, d_d - d_o)))
    if any(hi <= lo for lo, hi in ext):
        return []
    eb = _BYTES[sbuf.type.dtype.name]
    nd = len(shape)
    sstr = [math.prod(sd[a + 1:]) for a in range(nd)]
    dstr = [math.prod(dd[a + 1:]) for a in range(nd)]
    s_lo = [s + lo for s, (lo, _) in zip(soffs, ext)]
    d_lo = [d + lo for d, (lo, _) in zip(doffs, ext)]
    cshape = tuple(hi - lo for lo, hi in ext)
    width = cshape[-1] * eb
    height = cshape[-2] if nd >= 2 else 1
    spitch = sd[-1] * eb
    dpitch = dd[-1] * eb
    out = []
    lead = [range(n) for n in cshape[:-2]]
    for idx in itertools.product(*lead):
        so = sum((s_lo[a] + (idx[a] if a < nd - 2 else 0)) * sstr[a] for a in range(nd)) * eb
        do = sum((d_lo[a] + (idx[a] if a < nd - 2 else 0)) * dstr[a] for a in range(nd)) * eb
        out.append(CeCopy(sbuf.name, srank, tuple(s_lo), dbuf.name, drank, tuple(d_lo), cshape, eb, so, do, width,
                          height, spitch, dpitch, tuple(task), _where(op)))
    return out


def plan_copy_engine(kernel: core.Kernel, part: str | core.Part | None = None) -> CopyEnginePlan:
    """Evaluate a copy-engine part for every rank into a :class:`CopyEnginePlan`."""
    if part is None:
        parts = [p for p in kernel.parts if p.role == "comm" and p.engine == "copy_engine"]
        if len(parts) != 1:
            raise _fail(f"kernel '{kernel.name}' has {len(parts)} copy-engine parts; name the one to plan", kernel.loc)
        p = parts[0]
    else:
        p = kernel.part(part) if isinstance(part, str) else part
    if p.engine != "copy_engine":
        raise _fail(f"part '{p.name}' runs on {p.engine}, not the copy engine", p)
    W = kernel.world_size
    sched = kernel.comm_schedule
    order = sched.task_order(tuple(p.grid)) if sched is not None else \
        list(itertools.product(*(range(g) for g in p.grid)))
    events = []
    for r in range(W):
        ev = []
        for task in order:
            _ce_eval(p.body, {}, r, tuple(task), ev, kernel)
        events.append(ev)
    # each (signal, target rank, slot) must be notified by one rank only: its stream writes absolute values
    owners: dict = {}
    for r, ev in enumerate(events):
        for e in ev:
            if e[0] == "notify":
                _, op, sig, ch, target, task = e
                if not 0 <= target < W:
                    raise _fail(f"rank {r} task {task}: rank_notify to rank {target}, outside the group of {W}", op)
                if not 0 <= ch < sig.type.slots:
                    raise _fail(f"rank {r} task {task}: channel {ch} is outside signal '{sig.name}' "
                                f"({sig.type.slots} slots)", op)
                key = (sig.name, target, ch)
                owners.setdefault(key, []).append((r, op))
    for key, lst in owners.items():
        ranks = sorted({r for r, _ in lst})
        if len(ranks) > 1:
            raise _fail(f"ranks {ranks} all notify slot {key[2]} of '{key[0]}' on rank {key[1]}; the copy engine "
                        "writes signal values (cuStreamWriteValue64) instead of adding, so one rank must own each slot",
                        lst[0][1])
    for other in kernel.parts:
        if other is p:
            continue
        for op in other.walk():
            if op.name in NOTIFY_OPS and any(op.operands[0].owner.name == k[0] for k in owners):
                raise _fail(f"signal '{op.operands[0].owner.name}' is notified by the copy engine (absolute writes) "
                            f"and by part '{other.name}' (atomic adds); give each its own signal", op)
    seen: dict = {}
    actions = []
    for r, ev in enumerate(events):
        acts = []
        for e in ev:
            if e[0] == "copy":
                _, op, sb, sr, so, db, dr, do, shape, task = e
                acts.extend(_ce_copies(op, sb, sr, so, db, dr, do, shape, task, W))
            elif e[0] == "notify":
                _, op, sig, ch, target, task = e
                key = (sig.name, target, ch)
                seen[key] = seen.get(key, 0) + 1
                acts.append(CeSignalWrite(sig.name, target, ch, len(owners[key]), seen[key], tuple(task), _where(op)))
            else:
                _, op, sig, ch, count, epoch, per_launch, task = e
                if not 0 <= ch < sig.type.slots:
                    raise _fail(f"rank {r} task {task}: channel {ch} is outside signal '{sig.name}'", op)
                acts.append(CeWait(sig.name, ch, count, epoch, tuple(task), _where(op), per_launch))
        actions.append(tuple(acts))
    bufs = {b.name: (b.type.shape, b.type.dtype.name, _BYTES.get(b.type.dtype.name)) for b in kernel.buffers}
    sigs = {s.name: s.type.slots for s in kernel.signals}
    return CopyEnginePlan(kernel.name, p.name, W, tuple(actions), bufs, sigs)


# =================================================================================================
# dispatch (codegen.lower)
# =================================================================================================

def matches(kernel: core.Kernel, part: core.Part) -> bool:
    """Communication parts: SM parts become kernels, copy-engine parts plans."""
    return part.role == "comm"


def lower(kernel: core.Kernel, part: core.Part, **options):
    """``codegen.lower`` entry: a :class:`LoweredComm` for an SM part (options: ``threads``,
    ``wait_timeout_ns``, ``entry``), a :class:`CopyEnginePlan` for a copy-engine part. Options
    meant for other parts' lowerings (``lower_all`` passes one set to every part) are ignored
    where they do not apply: ``cluster`` always, and everything for a copy-engine plan except
    unknown names."""
    options.pop("cluster", None)
    if part.engine == "copy_engine":
        unknown = set(options) - {"threads", "wait_timeout_ns", "entry"}
        if unknown:
            raise _fail(f"unknown option(s) {sorted(unknown)} for a copy-engine plan", part)
        return plan_copy_engine(kernel, part)
    return lower_comm(kernel, part, **options)

