"""Lower the MoE compute parts — grouped GEMMs over run-time tile tables and the top-k
combine — to Hopper (sm_90a) kernels (``codegen/include/tldsl/sm90_grouped_gemm.hpp``).

Two recognised shapes (those of :mod:`tldsl.ops.moe`, and any tile program of the same form).

**Grouped GEMM** (``allgather_moe.grouped_gemm``, ``moe_reduce_scatter.grouped_gemm``)::

    @tl.compute_part(grid=(G, cdiv(N, BN)))
    def part(i, pn):
        <scalar code: index arithmetic, table reads (load_scalar), waits>
        [acc = tl.fragment((BM, BN), tl.float32)]
        with tl.when(<guard>):                         # optional: the tile runs only where it holds
            <scalar code, loops and waits>             # the tile's prologue
            [rows = <per-row i32 expression, e.g. tl.load(ids, (i*BM,), (BM,))>]
            [acc = tl.fragment((BM, BN), tl.float32)]
            for k in tl.range(0, K, BK):
                acc += tl.dot(A, B)
            [tl.store(c, (i*BM, pn*BN), acc)]          # here: tiles outside the guard store nothing
            [<scalar code, loops and notifies>]        # after the store
        [tl.store(c, (i*BM, pn*BN), acc)]              # here: tiles outside the guard store zeros

    A = tl.load_rows(a, rows, k, BK)       (gathered rows, by index; negative rows read 0)
      | tl.load(a, (i*BM, k), (BM, BK))    (dense)
    B = tl.load(w, (e, k, pn*BN), (BK, BN))   on w [E, K, N], e any scalar (the expert)
      | tl.load(w, (k, pn*BN), (BK, BN))      on w [K, N]

The kernel is the persistent warp-specialized TMA + WGMMA design of ``sm90_gemm.hpp``
(whose traits, swizzle, WGMMA call and epilogue it reuses by ``#include``): one producer
warpgroup, one or two consumer warpgroups, a ``stages``-deep mbarrier ring, tiles visited in
the compute schedule's order (``tile_at``), a TMA-store epilogue. What the tile program
adds is generated into a ``Prog`` struct: ``active`` (the guard, e.g. ``tile_expert[i] >=
0``, read from the run-time table by producer and consumers alike, so skipped tiles cost one
load), ``batch`` (the expert: B's TMA is 3-D over ``[E, K, N]`` with a box of 1 along E),
``row`` (the gathered row ids), ``waits`` (acquire spins, before the tile's loads; the guard
and loops around them kept) and ``notifies`` (after the tile's TMA stores completed: one
``fence.acq_rel``, then relaxed ``red.add`` operations — a release pattern). Gathered A rows
are copied by the producer warpgroup's 128 threads with 16-byte
``cp.async`` (zero-fill for padding rows and columns past K) straight into the swizzled
layout TMA would produce, completing the stage's full barrier with
``cp.async.mbarrier.arrive.noinc``; consumers fence the async proxy before their WGMMAs.

**Row-gather combine** (``moe_reduce_scatter.combine``)::

    @tl.compute_part(grid=(G0, G1))
    def part(j, pn):
        <scalar code and waits>
        acc = tl.fragment((BM, BN), tl.float32, fill)
        for k in tl.range(lo, hi, step):
            rows = <per-row i32 expression>            # e.g. tl.where(in_range, tl.load(pos, ...), -1)
            acc += tl.load_rows(y, rows, col, BN) [* <per-row scale, e.g. tl.load(w, (m0, k), (BM, 1))>]
        tl.store(out, (row0, col0), acc)
        <scalar code, loops and notifies>

lowered to a plain kernel (no tensor cores: it is a bandwidth-bound gather): each thread owns
4 consecutive columns of a tile row (vector loads and stores, fp32 math), tiles visited
persistently in the schedule's order (with the part's ``align_shift``).

**Semantics kept from the simulator**: out-of-bounds tile loads (tables, weights, TMA boxes)
read zero, out-of-bounds stores are dropped, rows < 0 of a gather read zero, tiles outside
the guard store zeros where the program stores them outside the guard. Where the simulator
raises (a gathered row past the end of its tensor, a table index out of range), the kernel
reads zero (gathers) or is undefined (``load_scalar``): the simulator is the place to find
those bugs.

**Kernel parameters** (``LoweredGroupedGemm.params`` / ``LoweredCombine.params``, in order):

* grouped GEMM: ``tma_a`` (dense A only), ``tma_b`` (2-D or 3-D), ``tma_c``; ``ptr_<a>``
  (gathered A only: its base pointer); ``rank`` (i32); ``launch`` (u64, the 1-based epoch
  the waits count in); ``sig_<name>`` (u64 counters: this rank's copy of every signal waited
  on or notified, first use first); ``tbl_<name>`` (``const int*``: every i32 table the
  program reads, first use first).
* combine: ``ptr_<y>`` (the gathered tensor), ``out_<out>`` (the stored tensor), ``rank``,
  ``launch``, ``sig_<name>``..., then every other tensor it reads (``tbl_<name>`` for i32
  tables, ``ptr_<name>`` for the rest), first use first.

Shapes are compile-time constants of the generated ``Cfg`` (the trace fixes them); the host
and the C++ side agree on shared memory, TMA boxes, thread counts and the gather's thread
mapping through ``static_assert``\\ s, as in :mod:`.lower_gemm`.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

from ..ir import core
from .lowered import LoweredKernel, kernel_entry, recognises  # noqa: F401
from ..ir.opdefs import DEFAULT_MEMORY_SCOPE, NOTIFY_OPS, WAIT_OPS, DATA_OPS
from ..ir.schedule import ComputeSchedule
from ..ir.types import TileType
from .lower_gemm import (ORDERS, GemmConfig, KernelParam, LoweringError, TmaDescriptorSpec, _Affine, _DTYPE_BYTES,
                         _DTYPE_C, _DTYPE_GMMA, _SWIZZLE, _TMA_DATA_TYPE, _cident, _const_value, _fmt_aff, _marker,
                         choose_config, gemm_cfg_fields)

COMBINE_THREADS = 256
#: producer / consumer registers after ``setmaxnreg`` when A is gathered (the producer warpgroup
#: keeps the tile's row ids and cp.async addresses in registers): 128 * 56 + 256 * 224 <= 65536;
#: 224 still holds the 128 accumulators of a 128x256 tile without spills (checked in the tests).
GATHER_REGS = (56, 224)

_SCALAR_OPS = frozenset({"const", "program_id", "rank", "arith", "select", "load_scalar"})
_ROW_TILE_OPS = frozenset({"iota", "load", "ewise", "cast", "full", "broadcast", "expand_dims"})
_CTYPE = {"i32": "int", "i1": "bool", "f32": "float"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_UNARY_F = {"exp": "expf", "exp2": "exp2f", "log": "logf", "sqrt": "sqrtf"}


def _fail(msg: str, op_or_loc=None, what: str = "grouped GEMM") -> LoweringError:
    loc = getattr(op_or_loc, "loc", op_or_loc)
    return LoweringError(f"{what} lowering: {msg}", loc)


# -- IR helpers ------------------------------------------------------------------------------------

def _parents(block: core.Block) -> dict[int, core.Op]:
    """id(op) -> the op whose region holds it (top-level ops are absent)."""
    out: dict[int, core.Op] = {}

    def walk(b, owner):
        for op in b.ops:
            if owner is not None:
                out[id(op)] = owner
            for r in op.regions:
                walk(r, op)
    walk(block, None)
    return out


def _preorder(block: core.Block) -> list[core.Op]:
    return list(block.walk())


def _contains(op: core.Op, names) -> bool:
    return any(o.name in names for r in op.regions for o in r.walk())


def _is_tile(v: core.Value) -> bool:
    return isinstance(v.type, TileType)


def _tile_deps(v: core.Value) -> list[core.Op]:
    """The tile-producing ops a tile value is computed from (itself included), depth first."""
    seen: dict[int, core.Op] = {}
    work = [v]
    while work:
        x = work.pop()
        op = x.owner
        if not isinstance(op, core.Op) or not _is_tile(x) or id(op) in seen:
            continue
        seen[id(op)] = op
        work.extend(o for o in op.operands if _is_tile(o))
    return list(seen.values())


def _depends_on(v: core.Value, var: core.Value) -> bool:
    work, seen = [v], set()
    while work:
        x = work.pop()
        if x is var:
            return True
        if x.id in seen:
            continue
        seen.add(x.id)
        if isinstance(x.owner, core.Op):
            work.extend(x.owner.operands)
    return False


# -- C++ emission of scalar code, waits, notifies and per-row tile expressions ---------------------

class _Ctx:
    """Where generated lines go: a line list, an indent and a chain of name scopes."""

    def __init__(self, lines: list[str], indent: str, scopes: list[dict[int, str]]):
        self.lines, self.indent, self.scopes = lines, indent, scopes

    def line(self, text: str):
        self.lines.append(self.indent + text)

    def lookup(self, vid: int):
        for s in reversed(self.scopes):
            if vid in s:
                return s[vid]
        return None

    def bind(self, v: core.Value, name: str):
        self.scopes[-1][v.id] = name

    def child(self) -> "_Ctx":
        return _Ctx(self.lines, self.indent + "  ", self.scopes + [{}])


class _Emitter:
    """Generates the ``Prog`` struct's members for one part: scalar values (materialised on
    first use, in the scope where they are needed), the waits / notifies of the tile program
    with their enclosing loops and guards, and per-row tile expressions."""

    def __init__(self, what: str, written: frozenset[str] = frozenset()):
        self.what = what
        self.written = written                   # tensors some part writes: read them coherently
        self.n = 0
        self.signals: list[core.Signal] = []
        self.buffers: list[core.Buffer] = []     # read-only tensors (tables, per-row operands)
        self.waits = 0
        self.notifies = 0
        self.wait_scopes: set[str] = set()
        self.notify_scopes: set[str] = set()

    def fail(self, msg, at=None):
        return _fail(msg, at, self.what)

    def fresh(self, hint: str | None) -> str:
        nm = f"{_cident(hint or 't')}_{self.n}"
        self.n += 1
        return nm

    # parameters -------------------------------------------------------------------------------
    def sig(self, s: core.Signal) -> str:
        if s not in self.signals:
            self.signals.append(s)
        return f"sig_{_cident(s.name)}"

    def buf(self, b: core.Buffer) -> str:
        if b not in self.buffers:
            self.buffers.append(b)
        return self.buf_param(b)

    @staticmethod
    def buf_param(b: core.Buffer) -> str:
        return f"{'tbl' if b.type.dtype.name == 'i32' else 'ptr'}_{_cident(b.name)}"

    # scalars ----------------------------------------------------------------------------------
    def scalar(self, v: core.Value, ctx: _Ctx, at) -> str:
        op = v.owner
        if isinstance(op, core.Op) and op.name == "const":
            val = op.attrs["value"]
            if isinstance(val, bool):
                return "true" if val else "false"
            if isinstance(val, int):
                return str(val) if val >= 0 else f"({val})"
            if not math.isfinite(val):
                raise self.fail(f"the constant {val} has no exact C++ spelling here", op)
            return f"{float(val)!r}f"
        name = ctx.lookup(v.id)
        if name is not None:
            return name
        if not isinstance(op, core.Op):
            if isinstance(op, core.Block):
                raise self.fail("this value depends on a loop variable of a loop it is not inside of here "
                                "(e.g. an expert or row id computed inside the K loop)", at)
            raise self.fail(f"'{getattr(op, 'name', v)}' is not a scalar", at)
        mk = _marker(op.loc)
        n = op.name
        ctype = _CTYPE.get(v.type.dtype.name)
        if ctype is None:
            raise self.fail(f"'{n}' yields a {v.type.dtype} scalar, which is not lowered", op)
        if n == "program_id":
            axis = op.attrs["axis"]
            if axis > 1:
                raise self.fail("program_id(axis > 1): the lowered grids are at most 2-d", op)
            return f"pid{axis}"
        if n == "rank":
            return "rank"
        if n == "arith":
            a, b = (self.scalar(x, ctx, op) for x in op.operands)
            expr = self._binary(op.attrs["op"], a, b, op.operands[0].type.dtype.name,
                                op.operands[1].type.dtype.name, op)
        elif n == "select":
            c, a, b = (self.scalar(x, ctx, op) for x in op.operands)
            expr = f"({c} ? {a} : {b})"
        elif n == "load_scalar":
            buf = op.operands[0].owner
            shape = buf.type.shape
            idx = [self.scalar(x, ctx, op) for x in op.operands[1:]]
            terms, stride = [], 1
            for d in reversed(range(len(shape))):
                terms.append(f"{idx[d]} * {stride}" if stride != 1 else idx[d])
                stride *= shape[d]
            flat = " + ".join(reversed(terms))
            expr = (f"tldsl::grouped::ld_coherent({self.buf(buf)} + {flat})" if buf.name in self.written
                    else f"{self.buf(buf)}[{flat}]")
        else:
            raise self.fail(f"'{n}' is not scalar code: only index arithmetic, table reads (load_scalar), "
                            "loops, guards and signal ops are lowered around the tile's work", op)
        nm = self.fresh(v.hint)
        ctx.line(f"const {ctype} {nm} = {expr};{mk}")
        ctx.bind(v, nm)
        return nm

    def _binary(self, kind, a, b, ta, tb, op) -> str:
        floats = "f32" in (ta, tb)
        if kind in _INFIX:
            return f"({a} {_INFIX[kind]} {b})"
        if kind == "floordiv" and not floats:
            return f"tldsl::floordiv({a}, {b})"
        if kind == "mod" and not floats:
            return f"tldsl::floormod({a}, {b})"
        if kind in ("min", "max"):
            if floats:
                return f"{'fminf' if kind == 'min' else 'fmaxf'}({a}, {b})"
            return f"tldsl::i{kind}({a}, {b})"
        if kind in ("and", "or"):
            if ta == tb == "i1":
                return f"({a} {'&&' if kind == 'and' else '||'} {b})"
            return f"({a} {'&' if kind == 'and' else '|'} {b})"
        if kind == "div":
            return f"((float)({a}) / (float)({b}))"
        raise self.fail(f"'{kind}' on {ta}/{tb} is not lowered", op)

    # waits and notifies, with their enclosing control flow -------------------------------------
    def structured(self, ops, ctx: _Ctx, kinds) -> None:
        for op in ops:
            if op.name in kinds:
                self._signal_op(op, ctx)
            elif op.name in ("for", "if") and _contains(op, kinds):
                mk = _marker(op.loc)
                if op.name == "for":
                    lo, hi, st = (self.scalar(v, ctx, op) for v in op.operands)
                    iv = self.fresh(op.regions[0].args[0].hint or "i")
                    ctx.line("#pragma unroll 1")
                    ctx.line(f"for (int {iv} = {lo}; {iv} < {hi}; {iv} += {st}) {{{mk}")
                    inner = ctx.child()
                    inner.bind(op.regions[0].args[0], iv)
                else:
                    ctx.line(f"if ({self.scalar(op.operands[0], ctx, op)}) {{{mk}")
                    inner = ctx.child()
                self.structured(op.regions[0].ops, inner, kinds)
                ctx.line("}")

    def _signal_op(self, op: core.Op, ctx: _Ctx):
        n = op.name
        mk = _marker(op.loc)
        sig = op.operands[0].owner
        ch = self.scalar(op.operands[1], ctx, op)
        if n in WAIT_OPS:
            count = self.scalar(op.operands[2], ctx, op)
            scope = "tldsl::kScopeSys" if DEFAULT_MEMORY_SCOPE[n] == "sys" else "tldsl::kScopeGpu"
            self.wait_scopes.add(DEFAULT_MEMORY_SCOPE[n])
            target = (f"(unsigned long long)({count}) * launch" if op.attrs.get("epoch", True)
                      else f"(unsigned long long)({count})")
            ctx.line(f"tldsl::wait_at_least<{scope}>({self.sig(sig)} + {ch}, {target});  // {n}{mk}")
            self.waits += 1
        elif n == "producer_tile_notify":
            sc = op.attrs.get("scope", "gpu")
            self.notify_scopes.add(sc)
            scope = "tldsl::kScopeSys" if sc == "sys" else "tldsl::kScopeGpu"
            ctx.line(f"tldsl::grouped::signal_add_relaxed<{scope}>({self.sig(sig)} + {ch}, 1ull);  // {n}, "
                     f"released by the fence above{mk}")
            self.notifies += 1
        else:
            raise self.fail(f"'{n}' notifies another rank's copy of a symmetric signal; this lowering emits "
                            "only this rank's signals (producer_tile_notify)", op)

    def signal_fn(self, ops, kinds, name: str) -> list[str]:
        """The ``waits`` / ``notifies`` member: the part's signal ops of ``kinds`` with their
        enclosing loops and guards (nothing when there are none). Notifies come after one
        release fence at the widest scope they use."""
        L: list[str] = []
        before = self.notifies
        self.structured(ops, _Ctx(L, "    ", [{}]), kinds)
        if not L:
            return []
        if kinds is NOTIFY_OPS and self.notifies > before:
            scope = "tldsl::kScopeSys" if "sys" in self.notify_scopes else "tldsl::kScopeGpu"
            L.insert(0, f"    tldsl::grouped::release_fence<{scope}>();   // the tile's stores before its notifies")
        return _fn(f"void {name}(int pid0, int pid1)", L)

    # per-row tile expressions -------------------------------------------------------------------
    def row_expr(self, v: core.Value, ctx: _Ctx, r: str, rows: int, at) -> tuple[str, str]:
        """C++ expression (and its C type) for element ``r`` of a per-row tile ``v``: a tile
        whose shape is ``(rows,)``, ``(rows, 1)`` or all ones (the same value for every row)."""
        if not _is_tile(v):
            return self.scalar(v, ctx, at), _CTYPE.get(v.type.dtype.name, "?")
        name = ctx.lookup(v.id)
        dt = v.type.dtype.name
        ctype = _CTYPE.get(dt, "float")
        if name is not None:
            return name, ctype
        op = v.owner
        shape = tuple(v.type.shape)
        if not (all(s == 1 for s in shape) or (shape[0] == rows and all(s == 1 for s in shape[1:]))):
            raise self.fail(f"'{op.name}' makes a {list(shape)} tile; only per-row values ({rows} rows, one "
                            "column) are lowered here", op)
        per_row = shape[0] == rows            # else one value for every row (all extents 1)
        mk = _marker(op.loc)
        n = op.name
        if n == "iota":
            expr, ctype = (r if per_row else "0"), "int"
        elif n == "full":
            val = op.attrs["value"]
            ctype = _CTYPE.get(op.attrs["dtype"].name)
            if ctype is None:
                raise self.fail(f"a {op.attrs['dtype']} tl.full is not lowered here", op)
            expr = ("true" if val else "false") if ctype == "bool" else (
                str(int(val)) if ctype == "int" else f"{float(val)!r}f")
        elif n == "load":
            expr, ctype = self._load_expr(op, ctx, r if per_row else None, at)
        elif n == "ewise":
            kind = op.attrs["op"]
            if dt not in _CTYPE:
                raise self.fail(f"'{kind}' computes in {dt} here; only i32, bool and f32 arithmetic is lowered "
                                "exactly (cast to tl.float32 first)", op)
            args = [self.row_expr(x, ctx, r, rows, op) for x in op.operands]
            a = [x[0] for x in args]
            ts = ["f32" if x[1] == "float" else ("i1" if x[1] == "bool" else "i32") for x in args]
            if kind == "where":
                expr = f"({a[0]} ? ({ctype})({a[1]}) : ({ctype})({a[2]}))"
            elif kind == "neg":
                expr = f"(-{a[0]})"
            elif kind == "not":
                expr = f"(!{a[0]})"
            elif kind == "abs":
                expr = f"fabsf({a[0]})" if ctype == "float" else f"abs({a[0]})"
            elif kind == "recip":
                expr = f"(1.0f / (float)({a[0]}))"
            elif kind in _UNARY_F:
                expr = f"{_UNARY_F[kind]}((float)({a[0]}))"
            else:
                expr = self._binary(kind, a[0], a[1], ts[0], ts[1], op)
                if ctype == "float" and kind in _INFIX and kind in ("add", "sub", "mul"):
                    expr = f"((float)({a[0]}) {_INFIX[kind]} (float)({a[1]}))"
        elif n == "cast":
            to = op.attrs["dtype"].name
            src, _ = self.row_expr(op.operands[0], ctx, r, rows, op)
            if to == "f32":
                expr = f"(float)({src})"
            elif to == "i32":
                expr = f"(int)({src})"
            elif to == "i1":
                expr = f"(({src}) != 0)"
            else:
                raise self.fail(f"a cast to {to} is not lowered in a per-row expression (its rounding would be "
                                "lost)", op)
            ctype = _CTYPE[to]
        elif n in ("broadcast", "expand_dims"):
            expr, ctype = self.row_expr(op.operands[0], ctx, r, rows, op)
        else:
            raise self.fail(f"'{n}' is not lowered in a per-row index/scale expression", op)
        nm = self.fresh(v.hint or n)
        ctx.line(f"const {ctype} {nm} = {expr};{mk}")
        ctx.bind(v, nm)
        return nm, ctype

    def _load_expr(self, op: core.Op, ctx: _Ctx, r: str | None, at) -> tuple[str, str]:
        buf = op.operands[0].owner
        if not isinstance(buf, core.Buffer):
            raise self.fail("tl.load must read a kernel tensor", op)
        dt = buf.type.dtype.name
        if dt not in ("i32", "f32", "f16", "bf16"):
            raise self.fail(f"a load of {dt} is not lowered in a per-row expression", op)
        box = tuple(op.attrs["shape"])
        tile_shape = tuple(op.result.type.shape)
        row_axis = len(box) - len(tile_shape)
        for d, ext in enumerate(box):
            if d != row_axis and ext != 1:
                raise self.fail(f"tl.load of a {list(box)} box: only one row per tile row is lowered here", op)
        offs = [self.scalar(x, ctx, op) for x in op.operands[1:]]
        idx = [f"({o} + {r})" if (d == row_axis and r is not None) else o for d, o in enumerate(offs)]
        dims = buf.type.shape
        p = self.buf(buf)
        coh = "<true>" if buf.name in self.written else ""
        if len(dims) == 1:
            expr = f"tldsl::grouped::ld1{coh}({p}, {idx[0]}, {dims[0]})"
        elif len(dims) == 2:
            expr = f"tldsl::grouped::ld2{coh}({p}, {idx[0]}, {idx[1]}, {dims[0]}, {dims[1]})"
        else:
            conds = " && ".join(f"(unsigned)({i}) < {d}u" for i, d in zip(idx, dims))
            flat, stride = [], 1
            for d in reversed(range(len(dims))):
                flat.append(f"(long long)({idx[d]}) * {stride}")
                stride *= dims[d]
            zero = "0" if dt == "i32" else "0.0f"
            elem = (f"tldsl::grouped::ld_coherent({p} + {' + '.join(flat)})" if buf.name in self.written
                    else f"{p}[{' + '.join(flat)}]")
            expr = f"(({conds}) ? tldsl::grouped::value_of({elem}) : {zero})"
        return expr, ("int" if dt == "i32" else "float")


def _fn(sig: str, body: list[str]) -> list[str]:
    return [f"  __device__ __forceinline__ {sig} const {{", "    (void)pid0; (void)pid1;", *body, "  }"]


# -- the grouped GEMM --------------------------------------------------------------------------------

@dataclass
class _GGMatch:
    part: core.Part
    loop: core.Op
    dot: core.Op
    a_load: core.Op
    b_load: core.Op
    frag: core.Op
    store: core.Op
    guard: core.Op | None
    store_inside: bool
    a: core.Buffer
    b: core.Buffer
    c: core.Buffer
    gather: bool
    batched: bool
    rows: core.Value | None
    batch: core.Value | None
    out_dtype: str


_GG_WHAT = "grouped GEMM"


def match_grouped_gemm(kernel: core.Kernel, part: core.Part) -> _GGMatch:
    """Check that ``part`` is a grouped GEMM (module docstring); raise :class:`LoweringError`
    at the op that is not."""
    def fail(msg, at):
        return _fail(msg, at, _GG_WHAT)

    if part.role != "compute":
        raise fail(f"part '{part.name}' is a {part.role} part; only compute parts are lowered", part)
    if len(part.grid) != 2:
        raise fail(f"the grid must be 2-d (tiles of rows, tiles of columns), got {part.grid}", part)
    dots = [op for op in part.walk() if op.name == "dot"]
    if len(dots) != 1:
        raise fail(f"expected exactly one tl.dot in compute part '{part.name}', found {len(dots)}",
                   dots[1] if len(dots) > 1 else part)
    dot = dots[0]
    parent = _parents(part.body)
    loop = parent.get(id(dot))
    if loop is None or loop.name != "for":
        raise fail("tl.dot must be the body of a `for k in tl.range(0, K, BK)` loop", dot)
    top = part.body.ops
    guard = None
    if loop not in top:
        g = parent.get(id(loop))
        if g is None or g.name != "if" or g not in top:
            raise fail("the K loop must be at the top of the part or directly inside one `with tl.when(...)`", loop)
        guard = g
    tile_ops = guard.regions[0].ops if guard is not None else top

    # the K loop: acc += tl.dot(A, B), plus index arithmetic
    body = [op for op in loop.regions[0].ops if op.name not in ("const", "arith")]
    if sorted(op.name for op in body) != sorted(["load", "load", "dot", "frag_read", "ewise", "frag_write"]) and \
            sorted(op.name for op in body) != sorted(["load_rows", "load", "dot", "frag_read", "ewise", "frag_write"]):
        other = next((op for op in body if op.name not in ("load", "load_rows", "dot", "frag_read", "ewise",
                                                           "frag_write")), loop)
        raise fail("the K loop must be `acc += tl.dot(A, B)` with A and B loaded in the loop, got "
                   f"{[op.name for op in body]}" + (f" ('{other.name}' is not lowered there)" if other is not loop
                                                    else ""), other)
    a_load, b_load = dot.operands[0].owner, dot.operands[1].owner
    if not (isinstance(a_load, core.Op) and a_load in body and isinstance(b_load, core.Op) and b_load in body):
        raise fail("tl.dot must multiply two tiles loaded in the K loop", dot)
    if b_load.name != "load":
        raise fail(f"B must be a tl.load tile (TMA), got '{b_load.name}'", b_load)
    fw = next(op for op in body if op.name == "frag_write")
    fr = next(op for op in body if op.name == "frag_read")
    add = next(op for op in body if op.name == "ewise")
    if add.attrs.get("op") != "add" or {add.operands[0].id, add.operands[1].id} != {fr.result.id, dot.result.id}:
        raise fail("the K loop must accumulate: acc += tl.dot(...)", add)
    frag = fw.operands[0].owner
    if fr.operands[0].owner is not frag or fw.operands[1] is not add.result or not isinstance(frag, core.Op) \
            or frag.name != "frag_alloc":
        raise fail("the K loop must read and write one tl.fragment accumulator", fw)
    if frag not in top and frag not in tile_ops:
        raise fail("the accumulator must be allocated before the K loop, at the top of the part or of the guard",
                   frag)
    if frag.result.type.dtype.name != "f32" or frag.attrs.get("value", 0) != 0:
        raise fail("the accumulator must be an f32 fragment initialised to 0", frag)

    # the epilogue: frag_read -> [cast] -> store
    order = _preorder(part.body)
    pos = {id(op): i for i, op in enumerate(order)}
    loop_ops = {id(o) for o in loop.regions[0].walk()}
    reads = [op for op in order if op.name == "frag_read" and op.operands[0].owner is frag and id(op) not in loop_ops]
    if len(reads) != 1:
        raise fail(f"expected the accumulator to be read once after the K loop (by tl.store), found {len(reads)}",
                   reads[1] if reads else loop)
    rd = reads[0]
    users = [op for op in order if any(x is rd.result for x in op.operands)]
    store, cast = None, None
    if len(users) == 1 and users[0].name == "cast":
        cast = users[0]
        users = [op for op in order if any(x is cast.result for x in op.operands)]
    if len(users) == 1 and users[0].name == "store" and users[0].operands[-1] is (cast or rd).result:
        store = users[0]
    if store is None:
        raise fail("after the K loop expected `tl.store(c, (i*BM, pn*BN), acc)` and nothing else on the "
                   "accumulator", users[0] if users else rd)
    store_parent = parent.get(id(store))
    if guard is not None and store_parent is guard:
        store_inside = True
    elif store_parent is None:
        store_inside = guard is None
    else:
        raise fail("the store of the accumulator must be at the top of the part or of the guard", store)
    if pos[id(store)] < pos[id(loop)] or (cast is not None and parent.get(id(cast)) is not store_parent) or \
            parent.get(id(rd)) is not store_parent:
        raise fail("the accumulator's store must follow the K loop, in the same block", store)

    a = _buffer(a_load.operands[0], "A", a_load)
    b = _buffer(b_load.operands[0], "B", b_load)
    c = _buffer(store.operands[0], "C", store)
    gather = a_load.name == "load_rows"
    rows = a_load.operands[1] if gather else None
    batched = len(b.type.shape) == 3
    batch = b_load.operands[1] if batched else None

    # every other op: scalar code, waits before the K loop, notifies after the store, and the tile
    # ops of the gathered row ids
    row_ops = {id(o) for o in _tile_deps(rows)} if rows is not None else set()
    known = {id(frag), id(loop), id(rd), id(store)} | ({id(cast)} if cast is not None else set()) | loop_ops
    guarded = {id(o) for o in guard.regions[0].walk()} if guard is not None else set()
    if guard is not None:
        known.add(id(guard))
    for op in order:
        if id(op) in known:
            continue
        n = op.name
        if n in _SCALAR_OPS:
            continue
        if id(op) in row_ops:
            if n not in _ROW_TILE_OPS:
                raise fail(f"'{n}' cannot compute gathered row ids (only per-row loads, iota and elementwise "
                           "math are lowered)", op)
            if pos[id(op)] > pos[id(loop)]:
                raise fail("the gathered row ids must be computed before the K loop", op)
            continue
        if n in WAIT_OPS:
            if pos[id(op)] > pos[id(loop)]:
                raise fail(f"'{n}' after the K loop: waits must precede the tile's loads", op)
            if guard is not None and id(op) not in guarded:
                # the producer runs waits only for the tiles the guard lets through; a tile it skips
                # would store (zeros) or notify without having waited
                raise fail(f"'{n}' outside the `tl.when` guard: it would also hold up the tiles the guard "
                           "skips; move it inside the guard", op)
            continue
        if n in NOTIFY_OPS:
            if pos[id(op)] < pos[id(store)]:
                raise fail(f"'{n}' before the accumulator's store: notifies must follow the tile's stores", op)
            continue
        if n in ("for", "if"):
            bad = [o for o in op.regions[0].walk() if o.name not in _SCALAR_OPS | WAIT_OPS | NOTIFY_OPS
                   | {"for", "if"}]
            if bad:
                raise fail(f"'{bad[0].name}' inside a loop or guard other than the K loop is not lowered "
                           "(only index arithmetic and signal ops may be there)", bad[0])
            continue
        if n in DATA_OPS:
            raise fail(f"'{n}' moves data between ranks; a grouped-GEMM compute part may not", op)
        raise fail(f"'{n}' is not supported in a grouped-GEMM compute part (only index arithmetic, table reads, "
                   "waits, the K loop, the accumulator's store and notifies are lowered)", op)
    return _GGMatch(part, loop, dot, a_load, b_load, frag, store, guard, store_inside, a, b, c, gather, batched,
                    rows, batch, c.type.dtype.name)


def _buffer(v: core.Value, what: str, op) -> core.Buffer:
    if not isinstance(v.owner, core.Buffer):
        raise _fail(f"{what} must be a kernel tensor (argument or workspace)", op)
    return v.owner


def _check_gg_shapes(m: _GGMatch, sched: ComputeSchedule):
    BM, BN, BK = sched.tile

    def fail(msg, at):
        return _fail(msg, at, _GG_WHAT)

    at, bt, ct = m.a.type, m.b.type, m.c.type
    if len(at.shape) != 2 or len(ct.shape) != 2 or len(bt.shape) not in (2, 3):
        raise fail(f"A and C must be 2-d and B 2-d or 3-d ([E, K, N]); got A {list(at.shape)}, B {list(bt.shape)}, "
                   f"C {list(ct.shape)}", m.dot)
    Ma, K = at.shape
    Kb, N = bt.shape[-2:]
    if Kb != K or ct.shape[1] != N:
        raise fail(f"shapes do not form a GEMM: A {list(at.shape)}, B {list(bt.shape)}, C {list(ct.shape)}", m.dot)
    frag_shape = tuple(m.frag.attrs["shape"])
    a_shape = tuple(m.a_load.attrs["shape"])
    b_tile = tuple(m.b_load.result.type.shape)
    if a_shape != (BM, BK) or b_tile != (BK, BN) or frag_shape != (BM, BN):
        raise fail(f"tile shapes A {a_shape}, B {b_tile}, acc {frag_shape} do not match the compute schedule's "
                   f"tile {(BM, BN, BK)}", m.dot)
    lo, hi, st = (_const_value(v) for v in m.loop.operands)
    if (lo, hi, st) != (0, K, BK):
        raise fail(f"the K loop must be tl.range(0, {K}, {BK}) (K of A/B, step BK), got ({lo}, {hi}, {st})", m.loop)
    iv = m.loop.regions[0].args[0]
    aff = _Affine({iv.id: "k"})
    if m.gather:
        if tuple(m.rows.type.shape) != (BM,) or m.rows.type.dtype.name != "i32":
            raise fail(f"the gathered row ids must be a ({BM},) i32 tile, got {m.rows.type}", m.a_load)
        if aff(m.a_load.operands[2]) != {"k": 1}:
            raise fail(f"the gather must read columns (k, k + BK): its column offset must be k, got "
                       f"{_fmt_aff((aff(m.a_load.operands[2]),))}", m.a_load)
        if _depends_on(m.rows, iv):
            raise fail("the gathered row ids must not depend on the K loop", m.a_load)
    else:
        got = tuple(aff(v) for v in m.a_load.operands[1:])
        if got != ({"pid0": BM}, {"k": 1}):
            raise fail(f"A tile offsets must be (pid0*{BM}, k), got {_fmt_aff(got)}", m.a_load)
    b_offs = m.b_load.operands[1:]
    if m.batched:
        if tuple(m.b_load.attrs["shape"]) != (1, BK, BN):
            raise fail(f"B must be loaded as one expert's (BK, BN) tile: box (1, {BK}, {BN}), got "
                       f"{m.b_load.attrs['shape']}", m.b_load)
        if _depends_on(m.batch, iv):
            raise fail("B's expert coordinate must not depend on the K loop", m.b_load)
        b_offs = b_offs[1:]
    got = tuple(aff(v) for v in b_offs)
    if got != ({"k": 1}, {"pid1": BN}):
        raise fail(f"B tile offsets must be ({'e, ' if m.batched else ''}k, pid1*{BN}), got {_fmt_aff(got)}", m.b_load)
    got = tuple(aff(v) for v in m.store.operands[1:3])
    if got != ({"pid0": BM}, {"pid1": BN}):
        raise fail(f"C tile offsets must be (pid0*{BM}, pid1*{BN}), got {_fmt_aff(got)}", m.store)
    if tuple(m.store.operands[-1].type.shape) != (BM, BN):
        raise fail(f"the stored tile must be the ({BM}, {BN}) accumulator", m.store)
    in_dt = at.dtype.name
    if in_dt != bt.dtype.name or in_dt not in _DTYPE_GMMA:
        raise fail(f"A and B must both be f16 or both bf16 for WGMMA, got {at.dtype} and {bt.dtype}", m.dot)
    if m.out_dtype not in _DTYPE_C:
        raise fail(f"C must be f16, bf16 or f32, got {ct.dtype}", m.store)
    eb, ob = _DTYPE_BYTES[in_dt], _DTYPE_BYTES[m.out_dtype]
    for name, pitch in (("A", K * eb), ("B", N * eb), ("C", N * ob)):
        if pitch % 16:
            raise fail(f"TMA and cp.async need 16-byte aligned rows: {name}'s row pitch is {pitch} bytes "
                       f"(pad K and N to multiples of {16 // eb})", m.dot)
    return Ma, N, K


@dataclass(frozen=True)
class LoweredGroupedGemm(LoweredKernel):
    """A generated grouped-GEMM kernel, and what the host needs to launch it."""
    kernel_name: str
    part: str
    entry: str
    source: str
    config: GemmConfig
    params: tuple[KernelParam, ...]
    tma: tuple[TmaDescriptorSpec, ...]
    buffers: dict                    # IR name -> (shape, dtype name) of every tensor passed by pointer
    signals: tuple[str, ...]         # signals waited on / notified (kernel params "sig_<name>")
    signal_slots: dict               # signal name -> slots
    tables: tuple[str, ...]          # i32 tables read (kernel params "tbl_<name>")
    M: int                           # rows of A (gathered: rows that may be gathered)
    N: int
    K: int
    grid_tiles: tuple[int, int]
    world_size: int
    align_shift: int
    gather: bool
    batched: bool
    store_inactive: bool
    waits: int
    notifies: int
    wait_scopes: tuple[str, ...]     # memory scopes of the waits' acquires ("gpu", "sys")
    options: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    kind = "grouped_gemm"

    @property
    def num_tiles(self) -> int:
        return self.grid_tiles[0] * self.grid_tiles[1]


    def describe(self) -> str:
        c = self.config
        a = "gathered rows (cp.async)" if self.gather else "dense (TMA)"
        lines = [f"{self.entry}: {self.kernel_name}.{self.part}  grouped GEMM, A {a} [{self.M}x{self.K}], "
                 f"B {'[E, K, N] per expert' if self.batched else '[K, N]'} (TMA), C {c.out_dtype}",
                 f"  tile {c.BM}x{c.BN}x{c.BK}, {c.stages} stages, order {c.order}, {c.consumer_wgs} consumer "
                 f"warpgroups + 1 producer ({c.threads} threads), smem {c.smem_bytes} B",
                 f"  tiles {self.grid_tiles[0]}x{self.grid_tiles[1]} = {self.num_tiles}, persistent; "
                 f"inactive tiles {'store zeros' if self.store_inactive else 'are skipped'}; {self.waits} wait(s), "
                 f"{self.notifies} notify(s) on {list(self.signals) or 'no signals'}",
                 "  params: " + ", ".join(f"{p.ctype} {p.name}" for p in self.params)]
        for t in self.tma:
            lines.append(f"  {t.param}: {t.buffer} dims={list(t.global_dims)} strides={list(t.global_strides)} "
                         f"box={list(t.box_dims)} {t.swizzle}")
        return "\n".join(lines)


def _pick_part(kernel: core.Kernel, part, fn):
    if part is None:
        parts = [p for p in kernel.parts if p.role == "compute"]
        if len(parts) != 1:
            raise _fail(f"kernel '{kernel.name}' has {len(parts)} compute parts; name the one to lower",
                        kernel.loc, fn)
        return parts[0]
    return kernel.part(part) if isinstance(part, str) else part


def lower_grouped_gemm(kernel: core.Kernel, part: str | core.Part | None = None, *, cluster=None,
                       wait_timeout_ns: int | None = None, entry: str | None = None) -> LoweredGroupedGemm:
    """Lower a grouped-GEMM compute part (module docstring) to a Hopper kernel."""
    p = _pick_part(kernel, part, _GG_WHAT)
    sched = kernel.compute_schedule or ComputeSchedule()
    m = match_grouped_gemm(kernel, p)
    M, N, K = _check_gg_shapes(m, sched)
    in_dt = m.a.type.dtype.name
    cfg = choose_config(sched, in_dt, m.out_dtype, cluster=cluster, loc=p.loc, clusters_lowered=((1, 1),))
    if m.gather and cfg.consumer_wgs == 2:
        from dataclasses import replace
        cfg = replace(cfg, producer_regs=GATHER_REGS[0], consumer_regs=GATHER_REGS[1])
    em = _Emitter(_GG_WHAT, written_buffers(kernel))
    fns: list[str] = []
    # active(): the guard
    L: list[str] = []
    ctx = _Ctx(L, "    ", [{}])
    cond = em.scalar(m.guard.operands[0], ctx, m.guard) if m.guard is not None else "true"
    fns += _fn("bool active(int pid0, int pid1)", L + [f"    return {cond};"])
    # batch(): the expert
    L = []
    ctx = _Ctx(L, "    ", [{}])
    e = em.scalar(m.batch, ctx, m.b_load) if m.batched else "0"
    fns += _fn("int batch(int pid0, int pid1)", L + [f"    return {e};"])
    # row(): the gathered row ids
    if m.gather:
        L = []
        ctx = _Ctx(L, "    ", [{}])
        rexpr, rtype = em.row_expr(m.rows, ctx, "r", sched.BM, m.a_load)
        if rtype != "int":
            raise _fail("the gathered row ids must be i32", m.a_load, _GG_WHAT)
        fns += ["  __device__ __forceinline__ int row(int pid0, int pid1, int r) const {",
                "    (void)pid0; (void)pid1;", *L, f"    return {rexpr};", "  }"]
    # waits() and notifies(), with their guards and loops
    fns += em.signal_fn(p.body.ops, WAIT_OPS, "waits")
    fns += em.signal_fn(p.body.ops, NOTIFY_OPS, "notifies")

    entry = entry or _cident(f"tldsl_{kernel.name}_{p.name}")
    align_shift = int(getattr(p, "align_shift", 0))
    tma_t = "const __grid_constant__ cute::TmaDescriptor"
    params = []
    if not m.gather:
        params.append(KernelParam("tma_a", tma_t, "tma", "tma:tma_a"))
    params += [KernelParam("tma_b", tma_t, "tma", "tma:tma_b"), KernelParam("tma_c", tma_t, "tma", "tma:tma_c")]
    buffers = {}
    if m.gather:
        a_param = f"ptr_{_cident(m.a.name)}"
        params.append(KernelParam(a_param, f"const {_DTYPE_C[in_dt]}* __restrict__", "ptr", f"buffer:{m.a.name}"))
        buffers[m.a.name] = (tuple(m.a.type.shape), in_dt)
    params += [KernelParam("rank", "int", "i32", "rank"), KernelParam("launch", "unsigned long long", "u64", "launch")]
    for s in em.signals:
        params.append(KernelParam(f"sig_{_cident(s.name)}", "unsigned long long*", "ptr", f"signal:{s.name}"))
    for b in em.buffers:
        params.append(KernelParam(em.buf_param(b), _ptr_ctype(b, em), "ptr", f"buffer:{b.name}"))
        buffers[b.name] = (tuple(b.type.shape), b.type.dtype.name)

    tma = _gg_tma_specs(cfg, m, M, N, K)
    source = _gg_source(kernel, p, m, cfg, entry, params, em, fns, align_shift, M, N, K)
    options = []
    if wait_timeout_ns is not None:
        options.append(f"-DTLDSL_WAIT_TIMEOUT_NS={int(wait_timeout_ns)}ull")
    return LoweredGroupedGemm(kernel.name, p.name, entry, source, cfg, tuple(params), tma, buffers,
                              tuple(s.name for s in em.signals), {s.name: s.type.slots for s in em.signals},
                              tuple(b.name for b in em.buffers), M, N, K, tuple(p.grid), kernel.world_size,
                              align_shift, m.gather, m.batched, not m.store_inside, em.waits, em.notifies,
                              tuple(sorted(em.wait_scopes)), tuple(options))


def written_buffers(kernel: core.Kernel) -> frozenset[str]:
    """Names of the tensors some part of ``kernel`` writes (stores, data primitives' targets):
    a generated kernel reads them with coherent loads, never through the non-coherent cache."""
    from ..ir.opdefs import data_operands
    out = set()
    for _, op in kernel.walk():
        if op.name == "store":
            out.add(op.operands[0].owner.name)
        elif op.name in DATA_OPS:
            dst = data_operands(op)[3]
            if dst is not None:
                out.add(dst.owner.name)
    return frozenset(out)


def _ptr_ctype(b: core.Buffer, em: _Emitter) -> str:
    """A read-only tensor's parameter type: ``__restrict__`` (the compiler may read it through the
    non-coherent cache) unless another part writes it during the launch."""
    return f"const {_ctype_of(b)}*" + ("" if b.name in em.written else " __restrict__")


def _ctype_of(b: core.Buffer) -> str:
    dt = b.type.dtype.name
    if dt == "i32":
        return "int"
    if dt in _DTYPE_C:
        return _DTYPE_C[dt]
    raise _fail(f"tensor '{b.name}' of {dt} cannot be passed to a generated kernel", b.loc)


def _gg_tma_specs(cfg: GemmConfig, m: _GGMatch, M: int, N: int, K: int) -> tuple[TmaDescriptorSpec, ...]:
    eb, ob = cfg.elem_bytes, cfg.out_bytes
    dt = _TMA_DATA_TYPE[cfg.in_dtype]
    out = []
    if not m.gather:
        out.append(TmaDescriptorSpec("tma_a", m.a.name, "A", cfg.in_dtype, dt, (K, M), (K * eb,), (cfg.EA, cfg.BM),
                                     (1, 1), _SWIZZLE[cfg.SA]))
    if m.batched:
        E = m.b.type.shape[0]
        out.append(TmaDescriptorSpec("tma_b", m.b.name, "B", cfg.in_dtype, dt, (N, K, E), (N * eb, K * N * eb),
                                     (cfg.EB, cfg.BK, 1), (1, 1, 1), _SWIZZLE[cfg.SB]))
    else:
        out.append(TmaDescriptorSpec("tma_b", m.b.name, "B", cfg.in_dtype, dt, (N, K), (N * eb,), (cfg.EB, cfg.BK),
                                     (1, 1), _SWIZZLE[cfg.SB]))
    Mc = m.c.type.shape[0]
    out.append(TmaDescriptorSpec("tma_c", m.c.name, "C", cfg.out_dtype, _TMA_DATA_TYPE[cfg.out_dtype], (N, Mc),
                                 (N * ob,), (cfg.EC, 64), (1, 1), _SWIZZLE[cfg.SC],
                                 l2_promotion="CU_TENSOR_MAP_L2_PROMOTION_NONE"))
    return tuple(out)


def _prog_members(em: _Emitter) -> tuple[list[str], list[str]]:
    """(member declarations, initialiser names) of the generated Prog struct."""
    members = ["  int rank;", "  unsigned long long launch;"]
    init = ["rank", "launch"]
    for s in em.signals:
        members.append(f"  unsigned long long* sig_{_cident(s.name)};")
        init.append(f"sig_{_cident(s.name)}")
    for b in em.buffers:
        members.append(f"  const {_ctype_of(b)}* {em.buf_param(b)};")
        init.append(em.buf_param(b))
    return members, init


def _gg_source(kernel, part, m: _GGMatch, cfg: GemmConfig, entry, params, em: _Emitter, fns, align_shift,
               M, N, K) -> str:
    gmma = (f"cute::SM90::GMMA::MMA_64x{cfg.BN}x16_{_DTYPE_GMMA[cfg.in_dtype]}_SS<"
            "cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>")
    part_mk, dot_mk, store_mk = _marker(part.loc), _marker(m.dot.loc), _marker(m.store.loc)
    digest = hashlib.sha256(repr((kernel.name, part.name, cfg, m.gather, m.batched)).encode()).hexdigest()[:12]
    units = cfg.BK * cfg.elem_bytes // 16
    row_step = 128 // units
    members, init = _prog_members(em)
    E = m.b.type.shape[0] if m.batched else 1
    L = [
        f"// Generated by tldsl.codegen.lower_grouped_gemm — do not edit. Kernel '{kernel.name}', compute part "
        f"'{part.name}' ({part.loc}).",
        f"// C[{part.grid[0]}x{cfg.BM} rows, {N}] {cfg.out_dtype} ('{m.c.name}') = "
        f"{'gather_rows' if m.gather else 'tile'}(A[{M}x{K}] {cfg.in_dtype} '{m.a.name}') @ "
        f"{'B[e]' if m.batched else 'B'} ('{m.b.name}' {list(m.b.type.shape)})",
        f"// tile {cfg.BM}x{cfg.BN}x{cfg.BK}, {cfg.stages} stages, order {cfg.order}; config {digest}",
        '#include "tldsl/sm90_grouped_gemm.hpp"',
        "",
        "namespace {",
        "",
        *gemm_cfg_fields(cfg, gmma, kernel.world_size, align_shift, dot_mk, part_mk),
        f"  static constexpr bool kGather = {'true' if m.gather else 'false'}, "
        f"kBatched = {'true' if m.batched else 'false'}, "
        f"kStoreInactive = {'false' if m.store_inside else 'true'};",
        f"  static constexpr int kM = {M}, kK = {K}, kGridM = {part.grid[0]}, kGridN = {part.grid[1]};"
        f"  // N = {N}, E = {E}",
        "};",
        "using Tr = tldsl::grouped::GroupedTraits<Cfg>;",
        "// The host computed these (TMA boxes, dynamic shared memory, the gather's thread map); the template",
        "// must agree.",
        f"static_assert(Tr::kSmemBytes == {cfg.smem_bytes}, \"host/device shared-memory size mismatch\");",
        f"static_assert(Tr::EA == {cfg.EA} && Tr::EB == {cfg.EB} && Tr::EC == {cfg.EC}, "
        "\"host/device TMA box mismatch\");",
        f"static_assert(Tr::kThreads == {cfg.threads}, \"host/device block size mismatch\");",
        f"static_assert(Tr::kUnitsA == {units} && Tr::kRowStep == {row_step} && Tr::kFullArrivals == "
        f"{129 if m.gather else 1}, \"host/device gather mapping mismatch\");",
        "",
        "// What the tile program adds around the GEMM: guard, expert, gathered rows, waits, notifies.",
        "struct Prog {",
        f"  static constexpr bool kHasWaits = {'true' if em.waits else 'false'};",
        f"  static constexpr bool kHasNotifies = {'true' if em.notifies else 'false'};",
        *members,
        *fns,
        "};",
        "",
        "}  // namespace",
        "",
    ]
    a_tma = "nullptr" if m.gather else "&tma_a"
    a_ptr = f"ptr_{_cident(m.a.name)}" if m.gather else "nullptr"
    L += kernel_entry(entry, cfg.threads, params, [
        f"  const Prog prog{{{', '.join(init)}}};",
        f"  tldsl::grouped::grouped_gemm_kernel<Cfg>({a_tma}, &tma_b, &tma_c, {a_ptr}, rank, prog);{dot_mk}",
        f"  // stores: {m.c.name}{store_mk}"])
    return "\n".join(L)


# -- the row-gather combine ---------------------------------------------------------------------------

_CB_WHAT = "row-gather combine"


@dataclass
class _CBMatch:
    part: core.Part
    loop: core.Op
    gather: core.Op              # load_rows
    scale: core.Value | None     # per-row multiplier of the gathered tile
    mul: core.Op | None
    frag: core.Op
    store: core.Op
    src: core.Buffer
    dst: core.Buffer
    rows: core.Value
    BMf: int
    BNf: int


def match_combine(kernel: core.Kernel, part: core.Part) -> _CBMatch:
    """Check that ``part`` is a row-gather combine (module docstring)."""
    def fail(msg, at):
        return _fail(msg, at, _CB_WHAT)

    if part.role != "compute":
        raise fail(f"part '{part.name}' is a {part.role} part; only compute parts are lowered", part)
    if len(part.grid) not in (1, 2):
        raise fail(f"the grid must be 1-d or 2-d, got {part.grid}", part)
    order = _preorder(part.body)
    dots = [op for op in order if op.name == "dot"]
    if dots:
        raise fail("tl.dot belongs to a GEMM, not to a row-gather combine", dots[0])
    gathers = [op for op in order if op.name == "load_rows"]
    if len(gathers) != 1:
        raise fail(f"expected exactly one tl.load_rows, found {len(gathers)}", gathers[1] if gathers else part)
    g = gathers[0]
    parent = _parents(part.body)
    loop = parent.get(id(g))
    if loop is None or loop.name != "for" or loop not in part.body.ops:
        raise fail("tl.load_rows must be in a `for` loop at the top of the part (the loop over the rows to "
                   "combine)", g)
    fws = [op for op in loop.regions[0].ops if op.name == "frag_write"]
    if len(fws) != 1:
        raise fail("the loop must accumulate once: acc += tl.load_rows(...) [* scale]", loop)
    fw = fws[0]
    frag = fw.operands[0].owner
    add = fw.operands[1].owner
    if not (isinstance(add, core.Op) and add.name == "ewise" and add.attrs["op"] == "add"):
        raise fail("the loop must accumulate: acc += ...", fw)
    fr = next((x.owner for x in add.operands if isinstance(x.owner, core.Op) and x.owner.name == "frag_read"
               and x.owner.operands[0].owner is frag), None)
    if fr is None:
        raise fail("the loop must accumulate into the fragment it writes", add)
    term = next(x for x in add.operands if x is not fr.result)
    mul, scale = None, None
    if term is g.result:
        pass
    elif isinstance(term.owner, core.Op) and term.owner.name == "ewise" and term.owner.attrs["op"] == "mul" and \
            any(x is g.result for x in term.owner.operands):
        mul = term.owner
        scale = next(x for x in mul.operands if x is not g.result)
    else:
        raise fail("the loop must add tl.load_rows(...) or tl.load_rows(...) * <per-row scale> to the accumulator",
                   add)
    if not isinstance(frag, core.Op) or frag.name != "frag_alloc" or frag not in part.body.ops:
        raise fail("the accumulator must be a tl.fragment allocated at the top of the part", fw)
    BMf, BNf = frag.attrs["shape"] if len(frag.attrs["shape"]) == 2 else (None, None)
    if BMf is None or frag.result.type.dtype.name != "f32":
        raise fail("the accumulator must be a 2-d f32 fragment", frag)
    if tuple(g.result.type.shape) != (BMf, BNf):
        raise fail(f"the gathered tile {list(g.result.type.shape)} must have the accumulator's shape "
                   f"{[BMf, BNf]}", g)
    for v, what in ((add.result, "the sum"), ) + (((mul.result, "the product"),) if mul is not None else ()):
        if v.type.dtype.name != "f32":
            raise fail(f"{what} is computed in {v.type.dtype}; only f32 accumulation is lowered", v.owner)
    if scale is not None and _is_tile(scale):
        sh = tuple(scale.type.shape)
        if not (all(s == 1 for s in sh) or (len(sh) == 2 and sh == (BMf, 1))):
            raise fail(f"the scale of the gathered rows must be per row ({BMf}, 1) or one value, got {list(sh)}", mul)
    pos = {id(op): i for i, op in enumerate(order)}
    reads = [op for op in order if op.name == "frag_read" and op.operands[0].owner is frag and op is not fr]
    if len(reads) != 1 or reads[0] not in part.body.ops:
        raise fail("the accumulator must be read once after the loop, by its tl.store", reads[1] if len(reads) > 1
                   else loop)
    rd = reads[0]
    users = [op for op in order if any(x is rd.result for x in op.operands)]
    cast = None
    if len(users) == 1 and users[0].name == "cast":
        cast = users[0]
        users = [op for op in order if any(x is cast.result for x in op.operands)]
    if not (len(users) == 1 and users[0].name == "store" and users[0] in part.body.ops):
        raise fail("after the loop expected `tl.store(out, (row0, col0), acc)`", users[0] if users else rd)
    store = users[0]
    if pos[id(store)] < pos[id(loop)]:
        raise fail("the store must follow the loop", store)
    src = _buffer(g.operands[0], "the gathered tensor", g)
    dst = _buffer(store.operands[0], "the stored tensor", store)

    rows = g.operands[1]
    expr_ops = {id(o) for o in _tile_deps(rows)}
    if scale is not None and _is_tile(scale):
        expr_ops |= {id(o) for o in _tile_deps(scale)}
    known = {id(frag), id(loop), id(g), id(fw), id(add), id(fr), id(rd), id(store)}
    known |= {id(mul)} if mul is not None else set()
    known |= {id(cast)} if cast is not None else set()
    loop_ops = {id(o) for o in loop.regions[0].walk()}
    for op in order:
        if id(op) in known:
            continue
        n = op.name
        if n in _SCALAR_OPS:
            continue
        if id(op) in expr_ops:
            if n not in _ROW_TILE_OPS:
                raise fail(f"'{n}' is not lowered in a per-row index/scale expression", op)
            continue
        if n in WAIT_OPS:
            if pos[id(op)] > pos[id(loop)]:
                raise fail(f"'{n}' after the gather loop: waits must precede the tile's loads", op)
            continue
        if n in NOTIFY_OPS:
            if pos[id(op)] < pos[id(store)]:
                raise fail(f"'{n}' before the store: notifies must follow the tile's stores", op)
            continue
        if n in ("for", "if") and id(op) not in loop_ops:
            bad = [o for o in op.regions[0].walk() if o.name not in _SCALAR_OPS | WAIT_OPS | NOTIFY_OPS
                   | {"for", "if"}]
            if bad:
                raise fail(f"'{bad[0].name}' inside a loop or guard other than the gather loop is not lowered", bad[0])
            continue
        if n in DATA_OPS:
            raise fail(f"'{n}' moves data between ranks; a combine compute part may not", op)
        raise fail(f"'{n}' is not supported in a row-gather combine", op)
    return _CBMatch(part, loop, g, scale, mul, frag, store, src, dst, rows, BMf, BNf)


def _check_cb(m: _CBMatch):
    def fail(msg, at):
        return _fail(msg, at, _CB_WHAT)

    st, dt = m.src.type, m.dst.type
    if len(st.shape) != 2 or len(dt.shape) != 2:
        raise fail(f"the gathered and stored tensors must be 2-d, got {list(st.shape)} and {list(dt.shape)}", m.store)
    for b, at in ((m.src, m.gather), (m.dst, m.store)):
        if b.type.dtype.name not in ("f32", "f16", "bf16"):
            raise fail(f"'{b.name}' is {b.type.dtype}; f32, f16 and bf16 are lowered", at)
        if b.type.shape[1] % 4:
            raise fail(f"'{b.name}' has {b.type.shape[1]} columns; vector access needs a multiple of 4", at)
    if m.BNf % 4:
        raise fail(f"the tile has {m.BNf} columns; vector access needs a multiple of 4", m.frag)
    if tuple(m.rows.type.shape) != (m.BMf,) or m.rows.type.dtype.name != "i32":
        raise fail(f"the row ids must be a ({m.BMf},) i32 tile, got {m.rows.type}", m.gather)
    if tuple(m.store.operands[-1].type.shape) != (m.BMf, m.BNf):
        raise fail("the stored tile must be the accumulator", m.store)
    aff = _Affine({})
    for off, at in ((m.gather.operands[2], m.gather), (m.store.operands[2], m.store)):
        f = aff(off)
        if f is None or any(c % 4 for c in f.values()):
            raise fail(f"column offsets must be multiples of 4 known at compile time (e.g. pid1*BN), got "
                       f"{_fmt_aff((f,))}", at)


@dataclass(frozen=True)
class LoweredCombine(LoweredKernel):
    """A generated row-gather combine kernel, and what the host needs to launch it."""
    kernel_name: str
    part: str
    entry: str
    source: str
    threads: int
    tile: tuple[int, int]
    params: tuple[KernelParam, ...]
    buffers: dict                   # IR name -> (shape, dtype name) of every tensor passed by pointer
    signals: tuple[str, ...]
    signal_slots: dict
    tables: tuple[str, ...]
    grid_tiles: tuple[int, int]
    world_size: int
    align_shift: int
    order: str
    waits: int
    notifies: int
    wait_scopes: tuple[str, ...]
    options: tuple[str, ...] = ()
    tma: tuple = ()

    kind = "combine"

    @property
    def num_tiles(self) -> int:
        return self.grid_tiles[0] * self.grid_tiles[1]

    @property
    def block(self) -> tuple[int, int, int]:
        return (self.threads, 1, 1)

    @property
    def smem_bytes(self) -> int:
        return 0

    def grid(self, sm_count: int, ctas_per_sm: int = 1) -> tuple[int, int, int]:
        """Persistent launch: ``ctas_per_sm`` CTAs per SM, never more CTAs than tiles."""
        return (max(1, min(self.num_tiles, sm_count * ctas_per_sm)), 1, 1)

    def describe(self) -> str:
        return "\n".join([
            f"{self.entry}: {self.kernel_name}.{self.part}  row-gather combine, tile {self.tile[0]}x{self.tile[1]}, "
            f"{self.threads} threads, order {self.order}",
            f"  tiles {self.grid_tiles[0]}x{self.grid_tiles[1]} = {self.num_tiles}, persistent; {self.waits} wait(s), "
            f"{self.notifies} notify(s) on {list(self.signals) or 'no signals'}",
            "  params: " + ", ".join(f"{p.ctype} {p.name}" for p in self.params)])


def lower_combine(kernel: core.Kernel, part: str | core.Part | None = None, *, wait_timeout_ns: int | None = None,
                  entry: str | None = None) -> LoweredCombine:
    """Lower a row-gather combine compute part (module docstring) to a plain CUDA kernel."""
    p = _pick_part(kernel, part, _CB_WHAT)
    sched = kernel.compute_schedule or ComputeSchedule()
    m = match_combine(kernel, p)
    _check_cb(m)
    em = _Emitter(_CB_WHAT, written_buffers(kernel))
    src_param, dst_param = f"ptr_{_cident(m.src.name)}", f"out_{_cident(m.dst.name)}"
    fns: list[str] = em.signal_fn(p.body.ops, WAIT_OPS, "waits")

    # body(): every thread owns 4 consecutive columns of one tile row at a time
    L = []
    ctx = _Ctx(L, "    ", [{}])
    iv = m.loop.regions[0].args[0]
    o0 = em.scalar(m.store.operands[1], ctx, m.store)
    o1 = em.scalar(m.store.operands[2], ctx, m.store)
    lo, hi, st = (em.scalar(v, ctx, m.loop) for v in m.loop.operands)
    gcol_v = m.gather.operands[2]
    gcol = None if _depends_on(gcol_v, iv) else em.scalar(gcol_v, ctx, m.gather)
    fill = float(m.frag.attrs.get("value", 0.0))
    if not math.isfinite(fill):
        raise _fail(f"a fragment filled with {fill} is not lowered", m.frag, _CB_WHAT)
    V = m.BNf // 4
    sdt, ddt = m.src.type.dtype.name, m.dst.type.dtype.name
    gmk, smk, lmk = _marker(m.gather.loc), _marker(m.store.loc), _marker(m.loop.loc)
    ctx.line(f"for (int item = tid; item < {m.BMf * V}; item += {COMBINE_THREADS}) {{")
    it = ctx.child()
    it.line(f"const int r = item / {V};")
    it.line(f"const int cv = (item - r * {V}) * 4;")
    it.line(f"float acc[4] = {{{fill!r}f, {fill!r}f, {fill!r}f, {fill!r}f}};")
    kname = em.fresh(iv.hint or "k")
    it.line(f"for (int {kname} = {lo}; {kname} < {hi}; {kname} += {st}) {{{lmk}")
    kc = it.child()
    kc.bind(iv, kname)
    row, rtype = em.row_expr(m.rows, kc, "r", m.BMf, m.gather)
    if rtype != "int":
        raise _fail("the row ids must be i32", m.gather, _CB_WHAT)
    col = gcol if gcol is not None else em.scalar(gcol_v, kc, m.gather)
    kc.line("float x[4];")
    kc.line(f"tldsl::grouped::load4({src_param}, {row}, {m.src.type.shape[0]}, {col} + cv, "
            f"{m.src.type.shape[1]}, x);{gmk}")
    if m.scale is not None:
        sc, _ = em.row_expr(m.scale, kc, "r", m.BMf, m.mul)
        kc.line(f"const float w = (float)({sc});{_marker(m.mul.loc)}")
        kc.line("#pragma unroll")
        kc.line("for (int q = 0; q < 4; ++q) acc[q] += x[q] * w;")
    else:
        kc.line("#pragma unroll")
        kc.line("for (int q = 0; q < 4; ++q) acc[q] += x[q];")
    it.line("}")
    it.line(f"tldsl::grouped::store4({dst_param}, {o0} + r, {m.dst.type.shape[0]}, {o1} + cv, "
            f"{m.dst.type.shape[1]}, acc);{smk}")
    ctx.line("}")
    fns += ["  __device__ __forceinline__ void body(int pid0, int pid1, int tid) const {",
            "    (void)pid0; (void)pid1;", *L, "  }"]

    fns += em.signal_fn(p.body.ops, NOTIFY_OPS, "notifies")

    entry = entry or _cident(f"tldsl_{kernel.name}_{p.name}")
    align_shift = int(getattr(p, "align_shift", 0))
    gm = p.grid[0]
    gn = p.grid[1] if len(p.grid) == 2 else 1
    src_ct, dst_ct = _DTYPE_C[sdt], _DTYPE_C[ddt]
    params = [KernelParam(src_param, f"const {src_ct}*", "ptr", f"buffer:{m.src.name}"),
              KernelParam(dst_param, f"{dst_ct}* __restrict__", "ptr", f"buffer:{m.dst.name}"),
              KernelParam("rank", "int", "i32", "rank"),
              KernelParam("launch", "unsigned long long", "u64", "launch")]
    buffers = {m.src.name: (tuple(m.src.type.shape), sdt), m.dst.name: (tuple(m.dst.type.shape), ddt)}
    for s in em.signals:
        params.append(KernelParam(f"sig_{_cident(s.name)}", "unsigned long long*", "ptr", f"signal:{s.name}"))
    extra = [b for b in em.buffers if b is not m.src and b is not m.dst]
    for b in extra:
        params.append(KernelParam(em.buf_param(b), _ptr_ctype(b, em), "ptr", f"buffer:{b.name}"))
        buffers[b.name] = (tuple(b.type.shape), b.type.dtype.name)
    if any(b is m.src or b is m.dst for b in em.buffers):
        raise _fail("the gathered or stored tensor is also read by an index expression; not lowered", m.gather,
                    _CB_WHAT)

    members = ["  int rank;", "  unsigned long long launch;",
               f"  const {src_ct}* {src_param};", f"  {dst_ct}* {dst_param};"]
    init = ["rank", "launch", src_param, dst_param]
    for s in em.signals:
        members.append(f"  unsigned long long* sig_{_cident(s.name)};")
        init.append(f"sig_{_cident(s.name)}")
    for b in extra:
        members.append(f"  const {_ctype_of(b)}* {em.buf_param(b)};")
        init.append(em.buf_param(b))
    digest = hashlib.sha256(repr((kernel.name, p.name, sched, m.BMf, m.BNf)).encode()).hexdigest()[:12]
    plist = ",\n    ".join(f"{q.ctype} {q.name}" for q in params)
    src = [
        f"// Generated by tldsl.codegen.lower_grouped_gemm — do not edit. Kernel '{kernel.name}', compute part "
        f"'{p.name}' ({p.loc}).",
        f"// {m.dst.name}[{m.BMf}x{m.BNf} tiles] = sum over the loop of gather_rows({m.src.name})"
        f"{' * scale' if m.scale is not None else ''}; order {sched.order}; config {digest}",
        '#include "tldsl/sm90_grouped_gemm.hpp"',
        "",
        "namespace {",
        "",
        "struct Cfg {",
        f"  static constexpr int kThreads = {COMBINE_THREADS}, BM = {m.BMf}, BN = {m.BNf};{_marker(p.loc)}",
        f"  static constexpr int kGridM = {gm}, kGridN = {gn};",
        f"  static constexpr int kOrder = {ORDERS[sched.order]}, kGroupM = {sched.group_m}, "
        f"kWorldSize = {kernel.world_size}, kAlignShift = {align_shift};",
        "};",
        "// The host launches kThreads threads per CTA; the generated body strides over BM x BN/4 items by it.",
        f"static_assert(Cfg::kThreads == {COMBINE_THREADS} && Cfg::BN % 4 == 0 && Cfg::BM * (Cfg::BN / 4) == "
        f"{m.BMf * (m.BNf // 4)}, \"host/device combine mapping mismatch\");",
        "",
        "struct Prog {",
        f"  static constexpr bool kHasWaits = {'true' if em.waits else 'false'};",
        f"  static constexpr bool kHasNotifies = {'true' if em.notifies else 'false'};",
        *members,
        *fns,
        "};",
        "",
        "}  // namespace",
        "",
        f'extern "C" __global__ void __launch_bounds__({COMBINE_THREADS})',
        f"{entry}(",
        f"    {plist}) {{",
        f"  const Prog prog{{{', '.join(init)}}};",
        "  tldsl::grouped::combine_kernel<Cfg>(rank, prog);",
        "}",
        ""]
    options = []
    if wait_timeout_ns is not None:
        options.append(f"-DTLDSL_WAIT_TIMEOUT_NS={int(wait_timeout_ns)}ull")
    return LoweredCombine(kernel.name, p.name, entry, "\n".join(src), COMBINE_THREADS, (m.BMf, m.BNf), tuple(params),
                          buffers, tuple(s.name for s in em.signals), {s.name: s.type.slots for s in em.signals},
                          tuple(b.name for b in extra if b.type.dtype.name == "i32"), (gm, gn), kernel.world_size,
                          align_shift, sched.order, em.waits, em.notifies, tuple(sorted(em.wait_scopes)),
                          tuple(options))


# -- the dispatcher's interface (codegen.lower) ------------------------------------------------------

def _which(kernel: core.Kernel, part: core.Part) -> str | None:
    if part.role != "compute":
        return None
    has_dot = any(op.name == "dot" for op in part.walk())
    try:
        if has_dot:
            match_grouped_gemm(kernel, part)
            return "grouped_gemm"
        match_combine(kernel, part)
        return "combine"
    except LoweringError:
        return None


def matches(kernel: core.Kernel, part: core.Part) -> bool:
    """Whether this module recognises ``part`` (a grouped GEMM or a row-gather combine)."""
    return _which(kernel, part) is not None


_OPTIONS = ("cluster", "wait_timeout_ns", "entry")


def lower(kernel: core.Kernel, part: core.Part, **options):
    """Lower ``part``: a grouped GEMM, else a row-gather combine (the error of the closer
    shape otherwise: a part with a ``tl.dot`` is judged as a grouped GEMM). Options other
    lowerings take (``lower_all`` passes one set to every part) are ignored."""
    opts = {k: v for k, v in options.items() if k in _OPTIONS}
    if part.role == "compute" and not any(op.name == "dot" for op in part.walk()):
        opts.pop("cluster", None)
        return lower_combine(kernel, part, **opts)
    return lower_grouped_gemm(kernel, part, **opts)
