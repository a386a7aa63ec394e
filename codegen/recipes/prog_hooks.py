"""The ``Prog`` struct both MoE templates take (``include/tldsl/sm90_grouped_gemm.hpp``):
what the tile program adds around the template's work, as member functions the template
calls per tile — the guard, the expert, the gathered row ids, the waits, the notifies, the
combine's body.

Index code comes from the shared rules (:mod:`..rules.scalars`), waits and notifies from
:mod:`..rules.primitives` through :class:`..rules.sync.SignalEmitter`. What only these
templates have is rendered here: per-row tile expressions (a ``(BM,)`` or ``(BM, 1)`` tile
such as ``tl.where(in_range, tl.load(pos, ...), -1)``), computed element by element for the
template's row ``r`` (float math by the general lowering's element rules, ``tldsl::gen`` of
``include/tldsl/general.hpp``, which such a kernel then includes; i32 math by the index rules),
and coherent reads of tensors another part writes during the launch."""
from __future__ import annotations

from ...ir import core
from ...ir.opdefs import NOTIFY_OPS, WAIT_OPS
from ..abi import marker, signal_param
from ..dtypes import SCALARS, c_type, scalar_ctype
from ..ir_queries import widest_scope
from ..match.per_row import ROW_TILE_OPS
from ..plan.prog_params import tensor_name
from ..rules.primitives import release_fence
from ..rules.scalars import c_literal, element_expr
from ..rules.sync import SignalEmitter
from ..rules.tile_ops import compute_type, convert, round_to, value_ctype

#: where a generated MoE kernel's per-row expressions compute in float: the general lowering's
#: element math (``tldsl::gen``: exactly rounded, never contracted into an FMA, NaN-propagating
#: max / min, numpy's divmod, numpy's f32 -> i32)


def hook_fn(signature: str, body: list[str]) -> list[str]:
    """A ``Prog`` member function of the tile ``(pid0, pid1)``."""
    return [f"  __device__ __forceinline__ {signature} const {{", "    (void)pid0; (void)pid1;", *body, "  }"]


def prog_members(plan, first: list[tuple[str, str]] = ()) -> tuple[list[str], list[str]]:
    """(member declarations, initialiser names) of the ``Prog`` struct: ``rank``, ``launch``,
    ``first`` ((C type, name) pairs the template adds), the signals, then the tensors the
    hooks read — the kernel parameters of the same names."""
    members = [("int", "rank"), ("unsigned long long", "launch"), *first]
    members += [("unsigned long long*", signal_param(s)) for s in plan.signals]
    members += [(f"const {c_type(b.type.dtype)}*", tensor_name(b)) for b in plan.tensors]
    return [f"  {t} {n};" for t, n in members], [n for _, n in members]


def _holds_wait(op: core.Op) -> bool:
    return op.name in WAIT_OPS or any(_holds_wait(o) for r in op.regions for o in r.ops)


def _innermost_wait_loop(loop: core.Op) -> bool:
    """Whether ``loop`` waits and no loop inside it does: the loop whose iterations lanes share."""
    def inner_wait_loop(op):
        return any((o.name == "for" and _holds_wait(o)) or inner_wait_loop(o) for r in op.regions for o in r.ops)
    return _holds_wait(loop) and not inner_wait_loop(loop)


def _small_literals(lo: str, st: str) -> bool:
    """Whether ``lo + lane * st`` is known to stay within i32 for any lane (both literals, small)."""
    try:
        return abs(int(lo)) + 1024 * abs(int(st)) < 2**31
    except ValueError:
        return False


class HookEmitter(SignalEmitter):
    """Renders one ``Prog`` hook of a plan: the ops of ``roots`` (waits or notifies) with the
    index code, loops and guards around them (:meth:`emit`), or values the tile program
    computes (:meth:`value`), per-row tile expressions included."""

    loop_pragma = "#pragma unroll 1"          # table-driven loops stay loops

    def __init__(self, plan, what: str, roots=frozenset(), rows: int = 0, lanes: int = 0, pick=None):
        self.roots = frozenset(roots)
        self.pick = pick                      # which of the roots' ops this hook runs (None: all of them)
        super().__init__(plan.kernel, list(plan.part.body.ops), what)
        self.plan = plan
        self.rows = rows                      # tile rows of a per-row value
        self.row: str | None = None           # the C++ row index while rendering per-row values
        self.lanes = lanes                    # > 0: lanes of a warp run the hook (:meth:`signal_fn`)
        self.notifies = 0
        self.notify_scopes: list[str] = []
        self.reads_written = False            # a table another part writes during the launch is read
        self._spread_next = False             # waits over lanes: the loop being opened is spread
        self._spread_depth = 0                # waits over lanes: spread loops around the op being emitted

    def is_root(self, op: core.Op) -> bool:
        return op.name in self.roots and (self.pick is None or self.pick(op))

    # -- the plan's parameters -----------------------------------------------------------------
    def table_expr(self, buf: core.Buffer) -> str:
        if buf not in self.plan.tensors:
            raise self.fail(f"internal: the plan has no parameter for tensor '{buf.name}'")
        return tensor_name(buf)

    def table_read(self, buf: core.Buffer, index: str) -> str:
        p = self.table_expr(buf)
        if buf.name in self.plan.written:
            self.reads_written = True
            return f"tldsl::grouped::ld_coherent({p} + {index})"
        return f"{p}[{index}]"

    def use(self, sig: core.Signal, peers: bool = False) -> None:
        if peers or sig not in self.plan.signals:
            raise self.fail(f"internal: the plan has no parameter for signal '{sig.name}'")
        super().use(sig, peers)

    # -- hooks ---------------------------------------------------------------------------------
    def value(self, v: core.Value, ind: str, lines: list[str]) -> str:
        """The C++ name of ``v``, emitting what computes it first (outside the tile program's
        loops and guards: index code is pure)."""
        self.emit_values([v], self.ops, ind, lines)
        return self.name(v)

    def signal_fn(self, name: str) -> list[str]:
        """The ``waits`` / ``notifies`` member (nothing when the part has none): the roots with
        their loops and guards; notifies after one release fence at their widest scope.

        With ``lanes``, the member is run by several lanes of a warp at once, each with its
        ``lane`` number. Notifies, ``name(pid0, pid1, lane)`` by ``lanes`` lanes: each fences
        for itself, then takes every ``lanes``-th iteration of the outermost loops, and lane 0
        the notifies outside any loop — the same adds, all of them relaxed and commutative, in a
        fraction of one thread's dependent table reads. Waits, ``name(pid0, pid1, lane, lanes)``
        by the ``lanes`` lanes the caller runs it on (1: one thread): each takes every ``lanes``-th
        iteration of the innermost loops that wait, and lane 0 the waits outside them — a warp's
        acquires issued together, one instruction, rather than one after another (the caller's
        barrier after them orders every lane's acquire before the tile's reads). Waits dealt round
        the lanes one at a time, each lane walking the whole nest, were measured no faster than one
        thread (a divergent spin runs one lane at a time: BENCHMARKS.md, forty-third session).
        Where the waits' own index code reads a table another part writes during the launch, a
        read after a wait must follow that wait, which another lane does not: lane 0 then runs
        them all, in order."""
        body = self.emit()
        if not body:
            return []
        if self.notifies:
            body.insert(0, "    " + release_fence(widest_scope(self.notify_scopes),
                                                  "the tile's stores before its notifies"))
        if self.lanes and self._waits_over_lanes:
            if self.reads_written:      # one thread, in order: the hook as a single thread's
                body = ["    if (lane != 0) return;  // (a table written during the launch is read after a wait)",
                        *HookEmitter(self.plan, self.what, self.roots, self.rows, pick=self.pick).emit()]
            return hook_fn(f"void {name}(int pid0, int pid1, int lane, int lanes)", body)
        if self.lanes:
            return hook_fn(f"void {name}(int pid0, int pid1, int lane)", body)
        return hook_fn(f"void {name}(int pid0, int pid1)", body)

    @property
    def _waits_over_lanes(self) -> bool:
        return bool(self.roots & WAIT_OPS)

    def emit_op(self, op: core.Op, ind: str, lines: list[str]) -> None:
        if not (self.lanes and self._waits_over_lanes and op.name == "for"):
            return super().emit_op(op, ind, lines)
        spread = self._spread_depth == 0 and _innermost_wait_loop(op)
        self._spread_next = spread
        self._spread_depth += spread
        try:
            super().emit_op(op, ind, lines)
        finally:
            self._spread_depth -= spread

    def loop_header(self, iv: str, lo: str, hi: str, st: str) -> str:
        # (the start compared in 64 bits, each step by the unsigned distance to hi: the index never wraps
        # past INT_MAX)
        lanes = None
        if self.lanes and self._waits_over_lanes:
            spread, self._spread_next = self._spread_next, False
            lanes = "lanes" if spread else None
        elif self.lanes and self.loop_depth == 0:
            lanes = str(self.lanes)
        if lanes is None:
            return super().loop_header(iv, lo, hi, st)
        start = (f"{lo} + lane * {st}" if _small_literals(lo, st) else
                 f"(long long){lo} + (long long)lane * {st} < {hi} ? {lo} + lane * {st} : {hi}")
        return (f"for (int {iv} = {start}; {iv} < {hi}; "
                f"{iv} = unsigned({hi}) - unsigned({iv}) > unsigned({lanes} * {st}) ? {iv} + {lanes} * {st} : {hi})")

    def emit_other(self, op: core.Op, ind: str, lines: list[str]) -> None:
        if op.name in WAIT_OPS:
            stmt = self.wait_statement(op)
            lines.append(ind + (f"if (lane == 0) {stmt}" if self.lanes and not self._spread_depth else stmt))
        elif op.name in NOTIFY_OPS:
            scope, stmt = self.notify_statement(op, note=", released by the fence above")
            self.notify_scopes.append(scope)
            lines.append(ind + (f"if (lane == 0) {stmt}" if self.lanes and self.loop_depth == 0 else stmt))
            self.notifies += 1
        elif op.name in ROW_TILE_OPS and self.row is not None:
            ctype, expr = self._row_op(op)
            lines.append(f"{ind}const {ctype} {self.define(op.result)} = {expr};{marker(op.loc)}")
        else:
            raise self.fail(f"'{op.name}' is not scalar code: only index arithmetic, table reads (load_scalar), "
                            "loops, guards and signal ops are lowered around the tile's work", op)

    # -- per-row tile expressions -------------------------------------------------------------
    @staticmethod
    def _ctype(v: core.Value) -> str:
        """C type of a per-row value's element (16-bit floats are read as float)."""
        dt = v.type.dtype
        return "float" if dt.is_float else scalar_ctype(dt)

    def _row_op(self, op: core.Op) -> tuple[str, str]:
        """(C type, C++ expression) of element ``self.row`` of a per-row tile op: a tile of shape
        ``(rows,)``, ``(rows, 1)`` or all ones (the same value for every row)."""
        v = op.result
        shape = tuple(v.type.shape)
        if not (all(s == 1 for s in shape) or (shape[0] == self.rows and all(s == 1 for s in shape[1:]))):
            raise self.fail(f"'{op.name}' makes a {list(shape)} tile; only per-row values ({self.rows} rows, one "
                            "column) are lowered here", op)
        r = self.row if shape[0] == self.rows else None
        dt = v.type.dtype.name
        n = op.name
        a = [self.name(x, op) for x in op.operands] if n != "load" else []
        if n == "iota":
            return "int", r or "0"
        if n == "full":
            if dt not in SCALARS:
                raise self.fail(f"a {dt} tl.full is not lowered here", op)
            val = op.attrs["value"]
            return scalar_ctype(dt), c_literal(bool(val) if dt == "i1" else int(val) if dt == "i32" else float(val))
        if n == "load":
            return self._load(op, r)
        if n in ("broadcast", "expand_dims"):
            return self._ctype(op.operands[0]), a[0]
        if n == "cast":
            if dt not in SCALARS:
                raise self.fail(f"a cast to {dt} is not lowered in a per-row expression (its rounding would be "
                                "lost)", op)
            if dt == "i32" and op.operands[0].type.dtype.is_float:   # numpy's: INT_MIN for NaN and out of range
                return "int", f"tldsl::gen::f2i({a[0]})"
            return scalar_ctype(dt), {"f32": f"(float)({a[0]})", "i32": f"(int)({a[0]})", "i1": f"(({a[0]}) != 0)"}[dt]
        # ewise
        kind = op.attrs["op"]
        if dt not in SCALARS:
            raise self.fail(f"'{kind}' computes in {dt} here; only i32, bool and f32 arithmetic is lowered "
                            "exactly (cast to tl.float32 first)", op)
        ct = scalar_ctype(dt)
        compute = compute_type(op)
        if compute in ("float", "double"):
            # float math as the general lowering computes it (the simulator's numpy rules)
            args = [convert(x, value_ctype(w.type.dtype), "bool" if (kind == "where" and i == 0) else compute)
                    for i, (x, w) in enumerate(zip(a, op.operands))]
            return ct, round_to(v.type.dtype, element_expr(kind, args, compute), compute)
        # i32 and bool: the index rules (tldsl::floordiv, imin, ...)
        if kind == "where":
            return ct, f"({a[0]} ? ({ct})({a[1]}) : ({ct})({a[2]}))"
        if kind == "neg":
            return ct, f"(-{a[0]})"
        if kind == "not":
            return ct, f"(!{a[0]})"
        if kind == "abs":
            return ct, f"abs({a[0]})"
        return ct, self.arith_expr(op)

    def _load(self, op: core.Op, r: str | None) -> tuple[str, str]:
        """A per-row ``tl.load``: one element per tile row, out-of-bounds reads zero."""
        buf = op.operands[0].owner
        if not isinstance(buf, core.Buffer):
            raise self.fail("tl.load must read a kernel tensor", op)
        dt = buf.type.dtype.name
        if dt not in ("i32", "f32", "f16", "bf16"):
            raise self.fail(f"a load of {dt} is not lowered in a per-row expression", op)
        box = tuple(op.attrs["shape"])
        row_axis = len(box) - len(op.result.type.shape)
        for d, ext in enumerate(box):
            if d != row_axis and ext != 1:
                raise self.fail(f"tl.load of a {list(box)} box: only one row per tile row is lowered here", op)
        offs = [self.name(x, op) for x in op.operands[1:]]
        idx = [f"({o} + {r})" if (d == row_axis and r is not None) else o for d, o in enumerate(offs)]
        dims = buf.type.shape
        p = self.table_expr(buf)
        coherent = buf.name in self.plan.written
        self.reads_written |= coherent
        coh = "<true>" if coherent else ""
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
            elem = (f"tldsl::grouped::ld_coherent({p} + {' + '.join(flat)})" if coherent
                    else f"{p}[{' + '.join(flat)}]")
            expr = f"(({conds}) ? tldsl::grouped::value_of({elem}) : {zero})"
        return ("int" if dt == "i32" else "float"), expr

