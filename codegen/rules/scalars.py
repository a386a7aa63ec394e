"""The rule for index code: scalar IR ops → C++ statements, shared by every recipe.

A tile program's index arithmetic — ``const``, ``program_id``, ``rank``, ``arith``,
``select``, ``load_scalar`` and the structured ``for`` / ``if`` regions around them — becomes
plain C++ statements, one per op, each ending in a ``// tldsl: file:line`` marker so that a
compile error points at the tile program. :class:`ScalarEmitter` handles those ops and hands
every other op to :meth:`ScalarEmitter.emit_other`, which each recipe overrides (waits in a
GEMM prologue, notifies in its epilogue, whole communication parts), rendering the primitives
through :mod:`.primitives`.

Values are scoped like the IR's regions: a value defined inside a ``for`` / ``if`` body is
out of scope after it, and using it there raises :class:`LoweringError` (C++ would reject
the generated code anyway, at a line far from the cause). A hook that needs values where the
tile program's structure is not kept (a per-tile guard or expert, row ids inside a template's
loop) emits them with :meth:`ScalarEmitter.emit_values` instead: index code is pure, so it
may be computed outside its ``if``.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from fractions import Fraction

import numpy as np

from ...ir import core
from ..abi import cident, marker, table_param
from ..dtypes import scalar_ctype
from ..errors import LoweringError
from ..ir_queries import const_value, producers


def c_literal(val) -> str:
    """A C++ literal for a Python scalar (bool, int, float). A float is written as the ``float``
    nearest it (round to nearest even, as numpy rounds a Python float beside a float32 array),
    exactly: past f32's range an infinity, below it a subnormal (hex) or a signed zero — never a
    decimal NVRTC refuses as out of range (``1e+100f``), nor one it could round otherwise."""
    if isinstance(val, bool):
        return "true" if val else "false"
    if isinstance(val, int):
        return str(int(val))
    f = float(val)
    if math.isnan(f):
        return "__int_as_float(0x7fc00000)"
    with np.errstate(over="ignore"):
        f32 = np.float32(f)
    if math.isinf(f32):
        return "__int_as_float(0x7f800000)" if f32 > 0 else "__int_as_float(0xff800000)"
    x = float(f32)
    if x == 0:                                 # a signed zero
        return _shortest(x) + "f"
    if abs(x) < _F32_MIN_NORMAL:               # a subnormal, written exactly in hex
        return _hex(x) + "f"
    if x == f:                                 # already a float: its decimal (as it always was written)
        return _shortest(x) + "f"
    short = str(f32)                           # the shortest decimal that rounds to the float ...
    return (short if _rounds_only_to(short, f32) else _shortest(x)) + "f"   # ... else the float itself


#: the smallest normal float: below it a float constant is a subnormal, written in hex
_F32_MIN_NORMAL = 2.0 ** -126


def _shortest(x: float) -> str:
    """Python's shortest decimal of ``x`` that reads back as ``x``, with a point or an exponent."""
    r = repr(x)
    return r if ("e" in r or "." in r) else r + ".0"


def _hex(x: float) -> str:
    """``x`` as a C++17 hexadecimal floating literal, exact (``0x1.8p-140``)."""
    m, e = math.frexp(x)                       # x = m * 2**e, 0.5 <= |m| < 1 (a subnormal double too)
    mant = float.hex(2 * m).split("p")[0]
    return f"{mant.rstrip('0').rstrip('.')}p{e - 1}"


def _rounds_only_to(s: str, f32) -> bool:
    """Whether the decimal ``s`` becomes ``f32`` however a compiler rounds it to ``float``: directly,
    or first to the nearest double (lying within half a double's ulp of ``s``) — both inside the
    interval of reals that round to ``f32``."""
    with np.errstate(over="ignore"):           # FLT_MAX's neighbour: inf
        lo_n = np.nextafter(f32, np.float32(-np.inf))
        hi_n = np.nextafter(f32, np.float32(np.inf))
    if not (np.isfinite(lo_n) and np.isfinite(hi_n)):
        return False
    d, x = Fraction(s), Fraction(float(f32))
    slack = Fraction(math.ulp(float(s)))
    return (x + Fraction(float(lo_n))) / 2 < d - slack and d + slack < (x + Fraction(float(hi_n))) / 2


def c_double_literal(val: float) -> str:
    """A C++ ``double`` of exactly the Python float ``val``: the constant of math the simulator
    (numpy) does in float64 with it, beside an integer tile (``i * 0.1``, ``i < 16777216.5``)."""
    f = float(val)
    if math.isnan(f) or math.isinf(f):
        return f"(double)({c_literal(f)})"
    if f != 0 and abs(f) < 2.0 ** -1022:       # a double subnormal: hex, exact
        return _hex(f)
    return _shortest(f)


class FloatConstant(str):
    """The C++ of a float constant (:func:`c_literal`: at ``float`` precision) that keeps its value,
    so that math computing in double writes it as the exact double (:func:`c_double_literal`) —
    as numpy computes an integer tile with a Python float — not as the float widened
    (:func:`.tile_ops.convert`)."""
    value: float

    def __new__(cls, value: float):
        s = super().__new__(cls, c_literal(float(value)))
        s.value = float(value)
        return s

    def __getnewargs__(self):
        """The value, not the C++ text ``str`` gives: pickle and :mod:`copy` rebuild the
        constant through :meth:`__new__`, which takes the float (``"0.1f"`` is none)."""
        return (self.value,)


#: the elementwise ops of tile math on one element (``include/tldsl/general.hpp``), by IR op;
#: the operands are already in the op's compute type (float, double, int or bool), each
#: function exactly rounded as numpy rounds it (no FMA contraction, NaN-propagating max / min,
#: numpy's floor division and modulo, i32 wrapping)
ELEMENT_MATH = {
    "add": "tldsl::gen::add({0}, {1})", "sub": "tldsl::gen::sub({0}, {1})", "mul": "tldsl::gen::mul({0}, {1})",
    "div": "tldsl::gen::div({0}, {1})", "floordiv": "tldsl::gen::floordiv({0}, {1})",
    "mod": "tldsl::gen::mod({0}, {1})", "max": "tldsl::gen::max_({0}, {1})", "min": "tldsl::gen::min_({0}, {1})",
    "neg": "tldsl::gen::neg({0})", "abs": "tldsl::gen::abs_({0})", "recip": "tldsl::gen::recip({0})",
    "exp": "tldsl::gen::exp_({0})", "exp2": "tldsl::gen::exp2_({0})", "log": "tldsl::gen::log_({0})",
    "sqrt": "tldsl::gen::sqrt_({0})", "sigmoid": "tldsl::gen::sigmoid({0})", "tanh": "tldsl::gen::tanh_({0})",
    "erf": "tldsl::gen::erf_({0})", "rsqrt": "tldsl::gen::rsqrt({0})",
    "lt": "({0} < {1})", "le": "({0} <= {1})", "gt": "({0} > {1})", "ge": "({0} >= {1})",
    "eq": "({0} == {1})", "ne": "({0} != {1})", "not": "(!{0})", "where": "({0} ? {1} : {2})",
}
#: numpy's ``&`` and ``|`` (the simulator's ``bitwise_and`` / ``bitwise_or``): logical where the
#: op computes in bool, bitwise where in int (a bool operand already converted to 0 / 1)
_LOGICAL = {"and": "&&", "or": "||"}
_BITWISE = {"and": "&", "or": "|"}


#: the header of the element functions (``tldsl::gen``), for kernels that are not the general
#: lowering's (which includes it through ``general.hpp``)
ELEMENT_MATH_INCLUDE = '#include "tldsl/element_math.hpp"   // element math: tldsl::gen'


def element_math_includes(source_lines) -> list[str]:
    """The include a kernel's generated code needs for its element math (none where it has none:
    the library's MoE and communication kernels' sources, and their compiles, stay as they were)."""
    return [ELEMENT_MATH_INCLUDE] if any("tldsl::gen::" in line for line in source_lines) else []


def element_expr(kind: str, args: list[str], compute: str) -> str:
    """C++ of one element of the elementwise op ``kind`` (``tl.ewise``'s ops and the math
    functions) on ``args``, already converted to ``compute`` ("float", "double", "int" or
    "bool"; ``where``'s condition is a bool). numpy's meaning, which the simulator runs."""
    if kind in _LOGICAL:
        if compute == "bool":
            return f"({args[0]} {_LOGICAL[kind]} {args[1]})"
        if compute == "int":
            return f"({args[0]} {_BITWISE[kind]} {args[1]})"
        raise LoweringError(f"internal: '{kind}' computing in {compute} (tracing takes bool or integer operands only)")
    if compute == "bool" and kind in ("add", "mul", "max", "min"):
        # numpy on booleans: add / max are `or`, mul / min are `and`
        return f"({args[0]} {'||' if kind in ('add', 'max') else '&&'} {args[1]})"
    if kind not in ELEMENT_MATH:
        raise LoweringError(f"internal: no element rule for elementwise op '{kind}'")
    return ELEMENT_MATH[kind].format(*args)


def step_cannot_wrap(hi: str, st: str) -> bool:
    """Whether ``iv += st`` stays within i32 for every ``iv < hi`` (C++ expressions; literals known):
    a step of 1 always does, a literal step below a literal bound where ``hi + st - 1 <= INT_MAX``."""
    try:
        step = int(st)
    except ValueError:
        return False
    if step == 1:
        return True
    try:
        return int(hi) + step - 1 <= 2**31 - 1
    except ValueError:
        return False


class ScalarEmitter:
    """Emit the scalar ops of a list of IR ops as C++ statements.

    ``needed``: ids of the ops to emit (see :func:`..ir_queries.needed_ops`); None emits every op.
    Subclasses override :meth:`pid_expr`, :meth:`rank_expr`, :meth:`table_expr` (how the
    kernel reaches program ids, the rank and ``load_scalar`` tables) and :meth:`emit_other`
    (every op that is not scalar or control), and may override :meth:`fail`."""

    INFIX = {"add": "+", "sub": "-", "mul": "*", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
             "eq": "==", "ne": "!="}
    what = "this lowering"
    #: a line put before every emitted ``for`` (e.g. ``#pragma unroll 1``: a table-driven loop stays a loop)
    loop_pragma = ""

    def __init__(self, needed: set[int] | None = None):
        self.needed = needed
        self.names: dict[int, str] = {}
        self.n = 0
        self.tables: list[core.Buffer] = []
        self._scopes: list[list[int]] = [[]]
        self.loop_depth = 0                   # ``for`` loops around the op being emitted

    # -- hooks ---------------------------------------------------------------------------------
    def fail(self, msg: str, op=None) -> LoweringError:
        return LoweringError(msg, getattr(op, "loc", op))

    def pid_expr(self, axis: int, op: core.Op) -> str:
        return f"pid{axis}"

    def rank_expr(self) -> str:
        return "rank"

    def loop_header(self, iv: str, lo: str, hi: str, st: str) -> str:
        """The ``for (...)`` of a ``tl.range`` loop (a subclass may spread its iterations over threads). Its
        step is taken only where it stays below ``hi`` (their distance compared unsigned, exact for any
        ``iv < hi``): ``iv += st`` past INT_MAX would wrap below ``hi`` and never end (the simulator runs
        ``range(lo, hi, st)`` exactly, whatever its bounds)."""
        if step_cannot_wrap(hi, st):             # the plain form, which the compiler unrolls and counts
            return f"for (int {iv} = {lo}; {iv} < {hi}; {iv} += {st})"
        return (f"for (int {iv} = {lo}; {iv} < {hi}; "
                f"{iv} = unsigned({hi}) - unsigned({iv}) > unsigned({st}) ? {iv} + {st} : {hi})")

    def table_expr(self, buf: core.Buffer) -> str:
        return table_param(buf)

    def table_read(self, buf: core.Buffer, index: str) -> str:
        """C++ reading element ``index`` (flat) of a ``load_scalar`` table."""
        return f"{self.table_expr(buf)}[{index}]"

    def emit_other(self, op: core.Op, ind: str, lines: list[str]) -> None:
        raise self.fail(f"'{op.name}' is not supported by {self.what}", op)

    # -- names ---------------------------------------------------------------------------------
    def name(self, v: core.Value, op: core.Op | None = None) -> str:
        val = const_value(v)
        if val is not None:
            return FloatConstant(val) if isinstance(val, float) else c_literal(val)
        if v.id not in self.names:
            raise self.fail(f"a scalar value ({v.hint or 'unnamed'}) is used outside the region that defines it; "
                            f"{self.what} needs values defined where they are used", op)
        return self.names[v.id]

    def define(self, v: core.Value) -> str:
        base = cident(v.hint or "t")
        nm = f"{base}_{self.n}"
        self.n += 1
        self.names[v.id] = nm
        self._scopes[-1].append(v.id)
        return nm

    def bind(self, v: core.Value, expr: str) -> None:
        """Name ``v`` by an existing C expression (e.g. a program id computed elsewhere)."""
        self.names[v.id] = expr
        self._scopes[-1].append(v.id)

    @contextmanager
    def scope(self):
        """A C++ block the recipe opens itself (not an IR region): names defined inside it are
        out of scope after it."""
        self._scopes.append([])
        try:
            yield
        finally:
            for vid in self._scopes.pop():
                self.names.pop(vid, None)

    # -- emission ------------------------------------------------------------------------------
    def emit_values(self, values, ops, ind: str, lines: list[str]) -> None:
        """Emit what computing ``values`` takes and is not named yet: their :func:`producers`
        among ``ops``, in program order, outside the tile program's regions."""
        for op in producers(values, ops, self.names.keys()):
            if op.name != "const":
                self.emit_op(op, ind, lines)

    def emit(self, ops, indent: str = "    ") -> list[str]:
        lines: list[str] = []
        self.emit_block(ops, indent, lines)
        return lines

    def emit_block(self, ops, ind: str, lines: list[str]) -> None:
        for op in ops:
            if self.needed is not None and id(op) not in self.needed:
                continue
            if op.name == "const":
                continue
            self.emit_op(op, ind, lines)

    def _region(self, block: core.Block, ind: str, lines: list[str]) -> None:
        self._scopes.append([])
        try:
            self.enter_region(block, ind, lines)
            self.emit_block(block.ops, ind, lines)
            self.leave_region(block, ind, lines)
        finally:
            for vid in self._scopes.pop():
                self.names.pop(vid, None)

    def enter_region(self, block: core.Block, ind: str, lines: list[str]) -> None:
        """Called before a region's body is emitted (subclasses track state here)."""

    def leave_region(self, block: core.Block, ind: str, lines: list[str]) -> None:
        """Called after a region's body is emitted, inside it (a subclass may end it with lines)."""

    def emit_op(self, op: core.Op, ind: str, lines: list[str]) -> None:
        mk = marker(op.loc)
        n = op.name
        if n == "program_id":
            lines.append(f"{ind}const int {self.define(op.result)} = {self.pid_expr(op.attrs['axis'], op)};{mk}")
        elif n == "rank":
            lines.append(f"{ind}const int {self.define(op.result)} = {self.rank_expr()};{mk}")
        elif n == "arith":
            lines.append(f"{ind}const {scalar_ctype(op.result.type.dtype)} {self.define(op.result)} = "
                         f"{self.arith_expr(op)};{mk}")
        elif n == "select":
            c, a, b = (self.name(v, op) for v in op.operands)
            lines.append(f"{ind}const {scalar_ctype(op.result.type.dtype)} {self.define(op.result)} = "
                         f"{c} ? {a} : {b};{mk}")
        elif n == "load_scalar":
            buf = op.operands[0].owner
            if buf not in self.tables:
                self.tables.append(buf)
            shape = buf.type.shape
            idx = [self.name(v, op) for v in op.operands[1:]]
            terms, stride = [], 1
            for d in reversed(range(len(shape))):
                terms.append(f"{idx[d]} * {stride}" if stride != 1 else idx[d])
                stride *= shape[d]
            lines.append(f"{ind}const int {self.define(op.result)} = "
                         f"{self.table_read(buf, ' + '.join(reversed(terms)))};{mk}")
        elif n == "for":
            lo, hi, st = (self.name(v, op) for v in op.operands)
            self._scopes.append([])
            iv = self.define(op.regions[0].args[0])
            if self.loop_pragma:
                lines.append(f"{ind}{self.loop_pragma}")
            lines.append(f"{ind}{self.loop_header(iv, lo, hi, st)} {{{mk}")
            self.loop_depth += 1
            try:
                self._region(op.regions[0], ind + "  ", lines)
            finally:
                self.loop_depth -= 1
                for vid in self._scopes.pop():
                    self.names.pop(vid, None)
            lines.append(f"{ind}}}")
        elif n == "if":
            lines.append(f"{ind}if ({self.name(op.operands[0], op)}) {{{mk}")
            self._region(op.regions[0], ind + "  ", lines)
            lines.append(f"{ind}}}")
        else:
            self.emit_other(op, ind, lines)

    def arith_expr(self, op: core.Op) -> str:
        """C++ of a binary ``arith`` op — or of an ``ewise`` op of the same kind on values a recipe
        renders element by element (per-row index and scale expressions)."""
        a, b = (self.name(v, op) for v in op.operands)
        kind = op.attrs["op"]
        is_float = any(v.type.dtype.is_float for v in op.operands)   # an elementwise op may mix i32 and f32
        if kind in self.INFIX:
            return f"({a} {self.INFIX[kind]} {b})"
        if kind == "floordiv":
            return f"floorf({a} / {b})" if is_float else f"tldsl::floordiv({a}, {b})"
        if kind == "mod":
            return f"({a} - floorf({a} / {b}) * {b})" if is_float else f"tldsl::floormod({a}, {b})"
        if kind == "min":
            return f"fminf({a}, {b})" if is_float else f"tldsl::imin({a}, {b})"
        if kind == "max":
            return f"fmaxf({a}, {b})" if is_float else f"tldsl::imax({a}, {b})"
        if kind in ("and", "or", "xor"):
            both_bool = all(v.type.dtype.name == "i1" for v in op.operands)
            sym = {"and": "&&", "or": "||", "xor": "!="}[kind] if both_bool else {"and": "&", "or": "|", "xor": "^"}[kind]
            return f"({a} {sym} {b})"
        raise self.fail(f"scalar op '{kind}' is not supported by {self.what}", op)
