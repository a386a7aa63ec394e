"""Tracing: Python runs the tile program once with proxy values, and every operation
on a proxy appends an op to the IR. No AST rewriting: loops are ``tl.range`` iterators
that open an IR loop region, run the body once with a symbolic index, and close it.

This module holds the builder, the scalar proxies (with their arithmetic), the rank and
world size, and the proxies of tensors and signals; the tile proxies and their math build on
it in :mod:`.tiles`.
"""
from __future__ import annotations

import contextvars
import math
import numbers
from contextlib import contextmanager

import numpy as np

from .errors import CompilationError
from .ir import core, types as T
from .ir.location import user_location
from .ir.names import unique_c_name
from .ir.semantics import float_of

_CURRENT: contextvars.ContextVar["Builder | None"] = contextvars.ContextVar("tldsl_builder", default=None)


class Builder:
    """Collects the pieces of one kernel while its Python function runs."""

    def __init__(self, name: str, world_size: int):
        self.name = name
        self.world_size = world_size
        self.buffers: list[core.Buffer] = []
        self.signals: list[core.Signal] = []
        self.parts: list[core.Part] = []
        self.mappings: list = []
        self.blocks: list[core.Block] = []   # the innermost open block is last
        self.part_role: str | None = None
        self.part_engine: str | None = None
        self.compute_schedule = None
        self.comm_schedule = None
        self.home: dict[int, core.Block] = {}         # value id -> the block that made it
        self.opened_by: dict[int, core.Op | None] = {}  # block id -> its `for` / `if` op (None: a part's body)
        self.left_early: CompilationError | None = None  # a tl.range body left by break / return (early_exits)

    # -- op emission ---------------------------------------------------------------
    def emit(self, name: str, operands, result_types=(), attrs=None, regions=(), hints=()):
        for t in result_types:
            if isinstance(t, (T.TileType, T.FragmentType)) and math.prod(t.shape) > MAX_TILE_ELEMENTS:
                raise CompilationError(
                    f"a {'x'.join(map(str, t.shape))} {t.dtype} {'fragment' if isinstance(t, T.FragmentType) else 'tile'}"
                    f" has {math.prod(t.shape):,} elements: no kernel indexes one past 2**30 (its element indices are "
                    "32-bit ints) — use smaller tiles (the shapes the program loads and computes, or the compute "
                    "schedule's tile), or a tensor (tl.local_buffer)", user_location())
        if not self.blocks:
            raise CompilationError("tile operations (loads, stores, math, traced scalars, primitives) can "
                                   "only be used inside a compute or comm part (a function decorated with "
                                   "tl.compute_part / tl.comm_part)",
                                   user_location())
        self.raise_left_early()
        for v in operands:
            self._check_in_scope(v)
        op = core.Op(name, list(operands), [], dict(attrs or {}), list(regions), user_location())
        for i, t in enumerate(result_types):
            op.results.append(core.Value(t, hints[i] if i < len(hints) else None, owner=op))
            self.home[op.results[-1].id] = self.blocks[-1]
        self.blocks[-1].ops.append(op)
        return op

    def raise_left_early(self) -> None:
        """Raise the error of a ``tl.range`` loop left early, once anything follows it."""
        if self.left_early is not None:
            raise self.left_early

    @contextmanager
    def region(self, block: core.Block):
        parent = self.blocks[-1].ops if self.blocks else []
        self.opened_by[id(block)] = next((op for op in reversed(parent) if any(r is block for r in op.regions)), None)
        for a in block.args:
            self.home[a.id] = block
        self.blocks.append(block)
        try:
            yield block
        finally:
            self.blocks.pop()

    def _check_in_scope(self, v) -> None:
        """A value used where it exists: made in a block still open (this one or one around it).
        Python names outlive the loop or ``tl.when`` body that bound them, so an accumulator kept
        in a tile (``acc = tl.zeros(...)``; ``acc += ...`` in a ``tl.range``) would otherwise
        surface later as an IR verifier error about an op the user never wrote."""
        if isinstance(v, core.Value) and isinstance(v.owner, (core.Buffer, core.Signal)):
            if not any(v.owner is x for x in (*self.buffers, *self.signals)):
                kind = "signal" if isinstance(v.owner, core.Signal) else "tensor"
                made = f" (declared at {v.owner.loc.short()})" if getattr(v.owner, "loc", None) else ""
                fail(f"this uses the {kind} '{v.owner.name}'{made} of another trace or kernel: each trace makes "
                     f"its own {kind}s — use the kernel function's own arguments, tl.signal and workspaces, "
                     f"not ones kept from another trace")
            return                                   # a tensor's or signal's handle: kernel-wide
        if not isinstance(v, core.Value) or not isinstance(v.owner, (core.Op, core.Block)):
            return
        home = self.home.get(v.id)
        if home is not None and any(home is b for b in self.blocks):
            return
        made = f" (made at {v.owner.loc.short()})" if isinstance(v.owner, core.Op) and v.owner.loc else ""
        if home is None:
            fail(f"this uses a value{made} of another trace or kernel: keep tiles and traced scalars inside "
                 f"the kernel function that made them (pass tensors between kernels instead)")
        opener = self.opened_by.get(id(home))
        if opener is not None and opener.name == "for":
            fail(f"this uses a value{made} from inside the tl.range loop at {opener.loc.short()}, after the loop: "
                 "a value made in a loop's body exists only inside it. For an accumulator a loop updates, make "
                 "a fragment before the loop (acc = tl.fragment(shape, dtype); acc += ... in the loop; "
                 "acc.read() after it)")
        if opener is not None:
            fail(f"this uses a value{made} from inside the tl.when block at {opener.loc.short()}, after the block: "
                 "a value made under tl.when exists only inside it; store it there, write a fragment there, "
                 "or choose between tiles with tl.where")
        fail(f"this uses a value{made} of another part: parts share data only through tensors (store in one, "
             "load in the other, ordered by a notify and a wait)")

    @staticmethod
    def c_name(name: str, taken) -> str:
        """The C name generated code gives a tensor (signal) ``name`` beside the kernel's other
        tensors (signals) ``taken``: unique even where IR names differ only in characters a C
        identifier cannot hold ("x-y", "x_y": :mod:`tldsl.ir.names`)."""
        return unique_c_name(name, (x.cname for x in taken))

    def unique(self, name: str, taken) -> str:
        names = {x.name for x in taken}
        if name not in names:
            return name
        i = 1
        while f"{name}_{i}" in names:
            i += 1
        return f"{name}_{i}"


def current() -> Builder:
    b = _CURRENT.get()
    if b is None:
        raise CompilationError("tldsl language functions can only be called while a @tl.kernel "
                               "is being traced", user_location())
    return b


def in_part() -> bool:
    b = _CURRENT.get()
    return b is not None and bool(b.blocks)


@contextmanager
def tracing(builder: Builder):
    token = _CURRENT.set(builder)
    try:
        yield builder
    finally:
        _CURRENT.reset(token)


#: the most elements a tile or fragment may hold: every lowering indexes a tile's elements with
#: 32-bit ints (and steps past the last by a few threads' worth). Checked as the trace makes it, so
#: the simulator refuses what no kernel could hold.
MAX_TILE_ELEMENTS = 2 ** 30


def fail(message: str):
    raise CompilationError(message, user_location())


def dtype_arg(dtype, what: str) -> T.DType:
    """A dtype argument of the language (a tl, numpy or torch dtype, or a name) as a tl dtype; a
    CompilationError at the user's line naming ``what`` took it otherwise."""
    if dtype is None:       # np.dtype(None) is float64: say what is missing, not "unsupported dtype float64"
        fail(f"{what}: a dtype is required, got None: pass one of tl.float16, tl.bfloat16, tl.float32, tl.int32, "
             "tl.bool_ (or a numpy or torch dtype)")
    try:
        return T.dtype_of(dtype)
    except TypeError as e:
        fail(f"{what}: {e} (tl.float16, tl.bfloat16, tl.float32, tl.int32, tl.bool_, or a numpy or torch dtype)")


# ----------------------------------------------------------------------------------
# Proxies
# ----------------------------------------------------------------------------------

def scalar_dtype(x) -> T.DType:
    """The type numpy gives a Python or numpy number on its own: bool, i32 for integers, else f32."""
    if isinstance(x, (bool, np.bool_)):
        return T.bool_
    if isinstance(x, numbers.Integral):
        return T.int32
    return T.float32


def const(x, dtype: T.DType | None = None) -> "Scalar":
    dtype = dtype or scalar_dtype(x)
    if dtype == T.int32 and not (-2**31 <= int(x) < 2**31):
        fail(f"integer constant {x} does not fit in i32")
    value = bool(x) if dtype == T.bool_ else (int(x) if dtype.kind == "int" else float(x))
    if dtype.is_float and dtype.bits == 16:     # numpy's: a number beside an f16 array is an f16 (NEP 50)
        value = float_of(value, dtype.name)
    op = current().emit("const", [], [T.ScalarType(dtype)], {"value": value, "dtype": dtype})
    return Scalar(op.result)


def as_scalar(x) -> "Scalar":
    if isinstance(x, Scalar):
        return x
    if isinstance(x, np.bool_):
        x = bool(x)
    if isinstance(x, (complex, np.complexfloating)):
        fail(f"expected a real scalar (int, float, bool or traced scalar), got the complex number {x!r}")
    if isinstance(x, (numbers.Number, np.number, bool)):
        return const(x)
    fail(f"expected a scalar (int, float or traced scalar), got {type(x).__name__}")


def refusing(message: str):
    """An operator tldsl has not: a CompilationError at the user's line saying what to write instead
    (rather than Python's TypeError about unsupported operands)."""
    def refused(self, *args):
        fail(message)
    return refused


def _is_tile(x) -> bool:
    """A Tile or Fragment (known by its value's type: tiles.py builds on this module)."""
    return isinstance(getattr(getattr(x, "value", None), "type", None), (T.TileType, T.FragmentType))


#: arithmetic of two bool scalars, as numpy computes it
_BOOL_ARITH = {"add": "or", "max": "or", "mul": "and", "min": "and"}


def scalar_op(op: str, a, b) -> "Scalar":
    """The traced scalar ``a <op> b`` (arithmetic, comparison, min/max); numbers become constants.
    With a tile or fragment on either side, NotImplemented: a Scalar's operator then hands the
    expression to the tile's reflected one (``p * 8 + tl.iota(8)`` broadcasts)."""
    if _is_tile(a) or _is_tile(b):
        return NotImplemented
    a, b = as_scalar(a), as_scalar(b)
    if a.dtype != b.dtype and not {a.dtype, b.dtype} <= {T.int32, T.bool_}:
        fail(f"scalar '{op}' of {a.dtype} and {b.dtype}: traced scalars do index arithmetic, in i32 "
             + ("(a float beside one belongs in tile math: scale a tile by the index, `t * q`)"
                if T.float32 in (a.dtype, b.dtype) else "(compare or `&` / `|` the bools)"))
    if a.dtype == b.dtype == T.bool_ and op in _BOOL_ARITH:
        op = _BOOL_ARITH[op]       # numpy's arithmetic of two bools: + and max are `or`, * and min `and`
    elif a.dtype == b.dtype == T.bool_ and op in ("sub", "floordiv", "mod"):
        fail(f"scalar '{op}' of two bools: numpy refuses it; write `a != b` (xor) or `&` / `|`")
    if op in ("and", "or", "xor"):     # booleans: logical; an integer on either side: bitwise, an integer
        rdt = T.bool_ if a.dtype == b.dtype == T.bool_ else T.int32
    elif op in ("lt", "le", "gt", "ge", "eq", "ne"):
        rdt = T.bool_
    else:                          # a bool beside an integer counts 0 / 1 (numpy's: an integer)
        rdt = T.int32 if T.int32 in (a.dtype, b.dtype) else a.dtype
    res = current().emit("arith", [a.value, b.value], [T.ScalarType(rdt)], {"op": op})
    return Scalar(res.result)


class Scalar:
    """A traced scalar (index arithmetic, ranks, loop counters, table entries)."""
    __slots__ = ("value",)

    def __init__(self, value: core.Value):
        self.value = value

    @property
    def dtype(self) -> T.DType:
        return self.value.type.dtype

    def __bool__(self):
        fail("a traced scalar has no Python truth value while tracing: use tl.when(cond) for a "
             "guarded region, tl.select for a choice of values, or a constexpr for a static choice. (Python "
             "asks for one in `if`, `and` / `or` / `not`, a chained comparison `0 < p < n` and builtin min / max: "
             "combine conditions with & and | ((0 < p) & (p < n)), and write tl.minimum / tl.maximum)")

    def __index__(self):
        fail("a traced scalar cannot be used as a Python int (e.g. in range() or a shape): "
             "use tl.range for loops and constexprs for shapes")

    def __int__(self):
        self.__index__()

    def __hash__(self):
        return id(self)

    def __neg__(self):
        if self.dtype == T.bool_:
            fail("'-' of a bool scalar: numpy refuses it too; for 'not x' write x == 0 (or -1 * x for an i32)")
        return scalar_op("sub", 0 if self.dtype.kind == "int" else 0.0, self)

    def __pos__(self): return self
    def __abs__(self): return self if self.dtype == T.bool_ else scalar_op("max", self, -self)   # numpy's abs(True)
    def __add__(self, o): return scalar_op("add", self, o)
    def __radd__(self, o): return scalar_op("add", o, self)
    def __sub__(self, o): return scalar_op("sub", self, o)
    def __rsub__(self, o): return scalar_op("sub", o, self)
    def __mul__(self, o): return scalar_op("mul", self, o)
    def __rmul__(self, o): return scalar_op("mul", o, self)
    def __floordiv__(self, o): return scalar_op("floordiv", self, o)
    def __rfloordiv__(self, o): return scalar_op("floordiv", o, self)
    def __mod__(self, o): return scalar_op("mod", self, o)
    def __rmod__(self, o): return scalar_op("mod", o, self)
    # `pm, pn = divmod(pid, n)`: index arithmetic's common spelling (numpy's floor semantics, as // and %)
    def __divmod__(self, o): return self // o, self % o
    def __rdivmod__(self, o): return o // self, o % self
    def __lt__(self, o): return scalar_op("lt", self, o)
    def __le__(self, o): return scalar_op("le", self, o)
    def __gt__(self, o): return scalar_op("gt", self, o)
    def __ge__(self, o): return scalar_op("ge", self, o)
    def __eq__(self, o): return scalar_op("eq", self, o)  # noqa: PLE0302
    def __ne__(self, o): return scalar_op("ne", self, o)
    def __and__(self, o): return scalar_op("and", self, o)
    def __rand__(self, o): return scalar_op("and", o, self)
    def __or__(self, o): return scalar_op("or", self, o)
    def __ror__(self, o): return scalar_op("or", o, self)

    def __truediv__(self, o):
        if _is_tile(o):
            return NotImplemented           # the tile's reflected '/': elementwise
        fail("'/' on traced index scalars is ambiguous: use '//' for integer division")
    __rtruediv__ = __truediv__

    __pow__ = __rpow__ = refusing("'**' on traced scalars: write the product (p * p)")
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = refusing(
        "'<<' and '>>' on traced scalars: multiply or floor-divide by the power of two (p * 4, p // 4)")
    def __xor__(self, o): return scalar_op("xor", self, o)
    def __rxor__(self, o): return scalar_op("xor", o, self)
    __invert__ = refusing("'~' on traced scalars: for 'not x' write x == 0, or tl.select(x, 0, 1)")

    def __repr__(self):
        return f"Scalar({self.value.type})"


def cdiv(a, b):
    """Ceiling division; stays a Python int when both sides are Python ints."""
    if a is None or b is None:
        fail(f"cdiv({a}, {b}): a size is None — a schedule field left unset? (CommSchedule.tile_m is None "
             f"by default: pass tile_m=..., or handle None for whole chunks)")
    if isinstance(a, Scalar) or isinstance(b, Scalar):
        if isinstance(b, numbers.Integral) and b > 0:
            return (a + (b - 1)) // b            # (the form the recipes' wait patterns know)
        q = a // b                               # a divisor of either sign: the floor, up where inexact
        return select(a % b != 0, q + 1, q)
    if b == 0:
        fail(f"cdiv({a}, 0): dividing by zero (a zero-sized dimension or tile?)")
    return -(-a // b)


def select(cond, a, b) -> Scalar:
    """``cond ? a : b`` for traced scalars (offsets, ranks, counts); for tiles use ``tl.where``."""
    c, a, b = as_scalar(cond), as_scalar(a), as_scalar(b)
    if a.dtype != b.dtype:
        fail(f"select of {a.dtype} and {b.dtype}")
    return Scalar(current().emit("select", [c.value, a.value, b.value], [a.value.type]).result)


# ----------------------------------------------------------------------------------
# The group
# ----------------------------------------------------------------------------------

def rank() -> Scalar:
    """This rank's index in the process group (a traced scalar)."""
    return Scalar(current().emit("rank", [], [T.i32], hints=["rank"]).result)


def world_size() -> int:
    """The number of ranks: a Python int, because kernels are specialised per world size."""
    return current().world_size


# ----------------------------------------------------------------------------------
# Tensors and signals
# ----------------------------------------------------------------------------------

class TensorRef:
    """A tensor argument or workspace as seen by the tile program."""
    __slots__ = ("buffer",)

    def __init__(self, buffer: core.Buffer):
        self.buffer = buffer

    @property
    def value(self):
        return self.buffer.value

    @property
    def shape(self) -> tuple[int, ...]:
        return self.buffer.type.shape

    @property
    def dtype(self) -> T.DType:
        return self.buffer.type.dtype

    @property
    def name(self) -> str:
        return self.buffer.name

    @property
    def symmetric(self) -> bool:
        return self.buffer.symmetric

    def at(self, rank) -> "RemoteRef":
        """This symmetric tensor as allocated on ``rank`` (remote memory is a view, not an op)."""
        if not self.symmetric:
            fail(f"'{self.name}' is not symmetric: only symmetric tensors (tl.Symmetric arguments "
                 "or tl.symmetric_buffer workspaces) can be addressed on another rank")
        return RemoteRef(self, rank)

    def __repr__(self):
        return f"TensorRef({self.name}: {self.buffer.type})"


class RemoteRef:
    """``tensor.at(rank)``: the copy of a symmetric tensor that lives on ``rank``."""
    __slots__ = ("tensor", "rank")

    def __init__(self, tensor: TensorRef, rank):
        self.tensor = tensor
        self.rank = rank

    @property
    def shape(self):
        return self.tensor.shape

    @property
    def dtype(self):
        return self.tensor.dtype

    def at(self, rank):
        fail(f"{self.tensor.name}.at(...) is already the copy on one rank: call .at(rank) once, on the tensor "
             f"itself ({self.tensor.name}.at(rank))")

    def __repr__(self):
        return f"{self.tensor.name}.at({self.rank})"


class SignalRef:
    __slots__ = ("signal",)

    def __init__(self, signal: core.Signal):
        self.signal = signal

    @property
    def value(self):
        return self.signal.value

    @property
    def slots(self) -> int:
        return self.signal.type.slots

    @property
    def scope(self) -> str:
        return self.signal.type.scope.value

    @property
    def name(self):
        return self.signal.name

    def __repr__(self):
        return f"SignalRef({self.name}: {self.signal.type})"
