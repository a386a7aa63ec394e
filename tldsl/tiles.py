"""Tiles while tracing: the :class:`Tile` and :class:`Fragment` proxies and the math their
operators emit (elementwise ops, casts, shape changes). A tile's ``+`` and ``tl.ewise("add")``
are one thing, so they live in one module; :mod:`.language` exports them to tile programs.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .ir import core, types as T
from .ir.opdefs import BINARY_OPS, FLOAT_RESULT_OPS, UNARY_OPS
from .operands import check_tile_shape, tensor_name
from .numpy_protocol import number_operand
from .tracing import Scalar, scalar_op, scalar_dtype, const, current, dtype_arg, fail, refusing


class Tile:
    """A traced, immutable tile with a static shape (lives in shared memory or registers)."""
    __slots__ = ("value",)

    def __init__(self, value: core.Value):
        self.value = value

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.type.shape

    @property
    def dtype(self) -> T.DType:
        return self.value.type.dtype

    @property
    def space(self) -> T.MemSpace:
        return self.value.type.space

    def __bool__(self):
        fail("a tile has no Python truth value: use tl.where for elementwise choices. (Python asks for one "
             "in `if`, `and` / `or` / `not`, a chained comparison `lo < t < hi` and builtin min / max: combine masks "
             "with & and | ((lo < t) & (t < hi)), and write tl.minimum / tl.maximum)")

    def _e(self, op, other, swap=False):
        return ewise(op, other, self) if swap else ewise(op, self, other)

    def __add__(self, o): return self._e("add", o)
    def __radd__(self, o): return self._e("add", o, True)
    def __sub__(self, o): return self._e("sub", o)
    def __rsub__(self, o): return self._e("sub", o, True)
    def __mul__(self, o): return self._e("mul", o)
    def __rmul__(self, o): return self._e("mul", o, True)
    def __truediv__(self, o): return self._e("div", o)
    def __rtruediv__(self, o): return self._e("div", o, True)
    def __floordiv__(self, o): return self._e("floordiv", o)
    def __rfloordiv__(self, o): return self._e("floordiv", o, True)
    def __mod__(self, o): return self._e("mod", o)
    def __rmod__(self, o): return self._e("mod", o, True)
    def __lt__(self, o): return self._e("lt", o)
    def __le__(self, o): return self._e("le", o)
    def __gt__(self, o): return self._e("gt", o)
    def __ge__(self, o): return self._e("ge", o)
    def __eq__(self, o): return self._e("eq", o)  # noqa: PLE0302
    def __ne__(self, o): return self._e("ne", o)
    def __and__(self, o): return self._e("and", o)
    def __rand__(self, o): return self._e("and", o, True)
    def __or__(self, o): return self._e("or", o)
    def __ror__(self, o): return self._e("or", o, True)

    def __invert__(self):
        if self.dtype != T.bool_:
            fail(f"'~' of a {self.dtype} tile: tiles take '~' on bool masks only (tl.ewise('not', mask)); "
                 "for integers write -x - 1")
        return ewise("not", self)

    def __neg__(self):
        return ewise("neg", self)

    def __pos__(self):
        return self

    def __abs__(self):
        return ewise("abs", self)

    __pow__ = __rpow__ = refusing(
        "'**' on tiles: write the product (x * x), or tl.exp2(y * tl.log(x) / log(2)) for a real power")
    __lshift__ = __rlshift__ = __rshift__ = __rrshift__ = refusing(
        "'<<' and '>>' on tiles: multiply or floor-divide by the power of two (t * 4, t // 4)")
    __xor__ = __rxor__ = refusing("'^' on tiles: for bool masks write a != b")
    __len__ = refusing("a tile has no len(): its shape is t.shape")
    __iter__ = refusing("a tile is not iterable (sum(t), list(t), for x in t): reduce it with tl.sum(t, axis), "
                        "tl.max(t, axis), tl.min(t, axis)")
    __round__ = __floor__ = __ceil__ = __trunc__ = refusing(
        "round() / math.floor() of a tile: floor-divide by 1 (t // 1.0 floors, (t + 0.5) // 1.0 rounds halves up), "
        "or cast to tl.int32 (truncates toward zero)")
    __divmod__ = __rdivmod__ = refusing("divmod() of tiles: write a // b and a % b")
    __setitem__ = __delitem__ = refusing(
        "tiles are immutable: t[...] = value cannot change one. Make a new tile, tl.where(mask, value, t) with a "
        "mask from tl.iota (e.g. (tl.iota(BM) == 0)[:, None]), or keep a tl.fragment and write it whole "
        "(frag[...] = tile)")
    __hash__ = object.__hash__

    @property
    def T(self) -> "Tile":
        return trans(self)

    def __getitem__(self, idx):
        """``t[:, None]`` / ``t[None, :]`` insert unit axes (for broadcasting)."""
        if not isinstance(idx, tuple):
            idx = (idx,)
        out, axis = self, 0
        for s in idx:
            if s is None:
                out = expand_dims(out, axis)
                axis += 1
            elif isinstance(s, slice) and s == slice(None):
                axis += 1
            else:
                fail("tiles support only ':' and None in indexing; use tl.load/tl.where for the rest")
        return out

    def to(self, dtype) -> "Tile":
        return cast(self, dtype)

    def __repr__(self):
        return f"Tile({self.value.type})"


class Fragment:
    """A mutable register tile, e.g. an accumulator that a loop updates in place."""
    __slots__ = ("value",)

    def __init__(self, value: core.Value):
        self.value = value

    @property
    def shape(self):
        return self.value.type.shape

    @property
    def dtype(self):
        return self.value.type.dtype

    def read(self) -> Tile:
        return Tile(current().emit("frag_read", [self.value],
                                   [T.TileType(self.shape, self.dtype, T.MemSpace.REG)]).result)

    def write(self, tile) -> None:
        tile = as_tile(tile, like=self)
        if tile.shape != self.shape:
            try:
                fits = np.broadcast_shapes(tile.shape, self.shape) == self.shape
            except ValueError:
                fits = False
            if not fits:
                fail(f"cannot write a {tile.shape} tile into a {self.shape} fragment")
            tile = broadcast_to(tile, self.shape)
        if tile.dtype != self.dtype:
            tile = cast(tile, self.dtype)
        current().emit("frag_write", [self.value, tile.value])

    def __getitem__(self, idx):
        if idx is Ellipsis or idx == slice(None):
            return self.read()
        return self.read()[idx]

    def __setitem__(self, idx, tile):
        if idx is not Ellipsis and idx != slice(None):
            fail("fragments are written whole: use frag[...] = tile")
        self.write(tile)

    def __iadd__(self, other):
        self.write(self.read() + other)
        return self

    def __isub__(self, other):
        self.write(self.read() - other)
        return self

    def __imul__(self, other):
        self.write(self.read() * other)
        return self

    def __itruediv__(self, other):
        self.write(self.read() / other)
        return self

    def __bool__(self):
        fail("a fragment has no Python truth value: use tl.where for elementwise choices. (Python asks for one "
             "in `if`, `and` / `or` / `not`, a chained comparison `lo < t < hi` and builtin min / max: combine masks "
             "with & and | ((lo < t) & (t < hi)), and write tl.minimum / tl.maximum)")

    __hash__ = object.__hash__

    def __repr__(self):
        return f"Fragment({self.value.type})"


def _read_then(name: str):
    """A fragment's operator: the same operator on its current value (``acc * 0.5``, ``-acc``,
    ``acc > 0``), a tile; the fragment is unchanged."""
    def op(self, *args):
        return getattr(self.read(), name)(*args)
    op.__name__ = name
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
              "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__", "__and__",
              "__rand__", "__or__", "__ror__", "__invert__", "__neg__", "__abs__", "__pow__", "__rpow__", "__lshift__",
              "__rlshift__", "__rshift__", "__rrshift__", "__xor__", "__rxor__", "__divmod__", "__rdivmod__",
              "__round__", "__floor__", "__ceil__", "__trunc__", "__iter__"):
    setattr(Fragment, _name, _read_then(_name))
Fragment.T = property(lambda self: self.read().T)


# ----------------------------------------------------------------------------------
# Tile math
# ----------------------------------------------------------------------------------

def full(shape, value, dtype=T.float32) -> Tile:
    """A tile of ``shape`` holding ``value`` everywhere (``dtype`` defaults to float32); ``value``
    a Python number or a traced scalar (a program id, a table entry)."""
    shape = check_tile_shape(shape, len(shape) if isinstance(shape, (tuple, list)) else 1, "tl.full")
    dtype = dtype_arg(dtype, "tl.full")
    if isinstance(value, Scalar):              # a run-time value: zeros plus the scalar, in dtype
        return cast(ewise("add", full(shape, 0, dtype), value), dtype)
    check_fill(value, "tl.full", dtype)
    op = current().emit("full", [], [T.TileType(shape, dtype)], {"shape": shape, "value": value, "dtype": dtype})
    return Tile(op.result)


def check_fill(value, what: str, dtype: T.DType | None = None) -> None:
    """A constant fill is one Python number (not a tile, an array or a string), and an integer fill
    of an i32 tile fits in i32 (rather than wrapping around)."""
    if isinstance(value, (numbers.Number, np.number, np.bool_)) and not isinstance(value, (complex, np.complexfloating)):
        if dtype == T.int32 and isinstance(value, (numbers.Integral, np.integer)) and not -2**31 <= int(value) < 2**31:
            fail(f"{what}: {value} does not fit in i32")
        if dtype == T.int32 and not math.isfinite(float(value)):
            fail(f"{what}: {value} has no {dtype} value (numpy refuses it too); fill a float tile, or give a number")
        return
    kind = "a tile" if isinstance(value, (Tile, Fragment)) else type(value).__name__
    fail(f"{what}: the value must be a Python number or a traced scalar, got {kind} "
         f"(for a tile of varying values, build it with tile math: tl.iota, tl.where, ...)")


def zeros(shape, dtype=T.float32) -> Tile:
    """A tile of ``shape`` holding zeros; for an accumulator that ``+=`` updates, use :func:`fragment`."""
    return full(shape, 0, dtype)


def as_tile(x, like=None) -> Tile:
    if isinstance(x, Tile):
        return x
    if isinstance(x, Fragment):
        return x.read()
    if isinstance(x, (numbers.Number, Scalar)):
        shape = like.shape if like is not None else ()
        dtype = like.dtype if like is not None else T.float32
        if isinstance(x, Scalar):
            return full(shape, x, x.dtype) if shape else fail("a scalar needs a tile shape here")
        return full(shape, x, dtype)
    fail(f"expected a tile, got {type(x).__name__}")


_INFIX = {"and": "&", "or": "|"}


def _promote(dtypes):
    floats = [d for d in dtypes if d.is_float]
    if not floats:
        return T.int32 if T.int32 in dtypes else T.bool_
    if len(set(floats)) == 1:
        return floats[0]
    return T.float32


def _float_number(a) -> bool:
    """A Python or numpy float (np.float32 is no Python float)."""
    return isinstance(a, (float, np.floating))


def _wider_numpy_float(a, dtype: T.DType) -> bool:
    """A numpy float scalar that keeps its own type beside a 16-bit float tile of type ``dtype``
    (numpy 2 treats numpy scalars as typed, Python's numbers, np.float64 among them, as taking the
    array's type): an np.float32, or an np.float16 beside bf16 (the two meet in f32)."""
    return isinstance(a, np.float32) or (isinstance(a, np.float16) and dtype == T.bfloat16)


def _int_number(a) -> bool:
    """A Python or numpy integer that is not a bool."""
    return isinstance(a, (numbers.Integral, np.integer)) and not isinstance(a, (bool, np.bool_))


def ewise(op: str, *args) -> Tile:
    """Elementwise math with numpy broadcasting; Python numbers adopt the tile's type."""
    if op not in UNARY_OPS | BINARY_OPS | {"where"}:
        fail(f"unknown elementwise op '{op}'")
    args = tuple(number_operand(a.read() if isinstance(a, Fragment) else a, f"'{op}' of a tile") for a in args)  # a fragment is read once
    tiles = [a for a in args if isinstance(a, (Tile, Fragment))]
    if not tiles:
        fail(f"'{op}' needs at least one tile operand")
    tiles = [as_tile(a) for a in tiles]
    tile_dtypes = [t.dtype for t in tiles]
    scal_dtypes = [a.dtype for a in args if isinstance(a, Scalar)]
    if op == "where":
        if len(tiles) > 1 or scal_dtypes:
            dtype = _promote([t.dtype for t in tiles[1:]] + scal_dtypes)
        else:      # both branches numbers: numpy's type for them (tl.where(m, 1, -1) is i32, (m, True, False) bool)
            dtype = _promote([scalar_dtype(a) for a in args[1:]])
    else:
        dtype = _promote(tile_dtypes + scal_dtypes)
    values = args[1:] if op == "where" else args
    if any(_float_number(a) for a in values) and not dtype.is_float:
        dtype = T.float32    # numpy's: a float beside an integer or bool tile makes floats (0.5 * iota)
    if dtype.bits == 16 and any(_wider_numpy_float(a, dtype) for a in values):
        dtype = T.float32    # numpy's: np.float32 is typed (NEP 50), np.float32(0.1) * f16 tile is f32
    if dtype == T.bool_ and any(_int_number(a) for a in values):
        dtype = T.int32      # numpy's: an int beside a bool tile is an int (mask + 1 is 1 or 2, mask & 2 is 0)
    try:
        shape = np.broadcast_shapes(*[t.shape for t in tiles])
    except ValueError:
        fail(f"'{op}': tile shapes {[t.shape for t in tiles]} do not broadcast")
    vals = []
    for a in args:
        if isinstance(a, (Tile, Fragment)):
            vals.append(as_tile(a).value)
        elif isinstance(a, Scalar):
            vals.append(a.value)
        elif isinstance(a, (numbers.Number, np.number)):
            cd = T.bool_ if isinstance(a, bool) else (dtype if dtype.is_float or _int_number(a) else T.float32)
            vals.append(const(a, cd if cd.kind != "bool" else T.bool_).value)
        else:
            fail(f"'{op}': unsupported operand {type(a).__name__}")
    if op in ("sub", "neg") and dtype == T.bool_:
        fail(f"'-' of bool tiles: numpy refuses it too; for masks use ~m, m & ~n or m != n "
             f"(or tl.cast to an integer first)")
    if op in ("and", "or"):
        # numpy's & and |: logical on bool tiles, bitwise on integers (a bool operand counts as 0 / 1)
        if dtype.is_float:
            kinds = ", ".join(d.name for d in tile_dtypes + scal_dtypes) + (", a float" if len(args) > len(tiles) + len(scal_dtypes) else "")
            fail(f"'{_INFIX[op]}' of {kinds}: '&' and '|' take bool or integer tiles, as in numpy "
                 f"(logical on bool, bitwise on integers); compare floats first, e.g. (x > 0) {_INFIX[op]} (y < 1)")
        rdt = dtype
    elif op in ("lt", "le", "gt", "ge", "eq", "ne", "not"):
        rdt = T.bool_
    else:
        rdt = dtype
    if op in FLOAT_RESULT_OPS and not rdt.is_float:
        rdt = T.float32
    if op == "where":
        rdt = dtype
    res = current().emit("ewise", vals, [T.TileType(tuple(shape), rdt)], {"op": op})
    return Tile(res.result)


def cast(x, dtype) -> Tile:
    """``x`` converted elementwise to ``dtype`` (the same tile when it already has that type)."""
    x = as_tile(x)
    dtype = dtype_arg(dtype, "tl.cast")
    if x.dtype == dtype:
        return x
    return Tile(current().emit("cast", [x.value], [T.TileType(x.shape, dtype)], {"dtype": dtype}).result)


def expand_dims(x, axis: int) -> Tile:
    """``x`` with a new axis of length 1 at ``axis``, as numpy's (to broadcast a row or column;
    a negative ``axis`` counts from the end of the result, as in numpy)."""
    x = as_tile(x)
    shape = list(x.shape)
    if isinstance(axis, Scalar) or not isinstance(axis, numbers.Integral) or isinstance(axis, (bool, np.bool_)):
        fail(f"tl.expand_dims: axis must be a Python int, got {type(axis).__name__} {axis!r}")
    if not -len(shape) - 1 <= axis <= len(shape):
        fail(f"tl.expand_dims: axis {axis!r} is outside a {len(shape) + 1}-d result")
    axis = int(axis) % (len(shape) + 1)
    shape.insert(axis, 1)
    return Tile(current().emit("expand_dims", [x.value], [T.TileType(tuple(shape), x.dtype)],
                               {"axis": axis}).result)


def broadcast_to(x, shape) -> Tile:
    """``x`` repeated to ``shape`` by numpy's broadcasting rules; a shape they refuse is a CompilationError."""
    x = as_tile(x)
    shape = check_tile_shape(shape, len(shape) if isinstance(shape, (tuple, list)) else 1, "tl.broadcast_to")
    try:
        if np.broadcast_shapes(x.shape, shape) != shape:
            raise ValueError
    except ValueError:
        fail(f"cannot broadcast a {x.shape} tile to {shape}")
    if x.shape == shape:
        return x
    return Tile(current().emit("broadcast", [x.value], [T.TileType(shape, x.dtype)], {"shape": shape}).result)


def trans(x) -> Tile:
    """The transpose of a 2-d tile (e.g. ``tl.dot(q, tl.trans(k))``)."""
    x = as_tile(x)
    if len(x.shape) != 2:
        fail("tl.trans needs a 2-d tile")
    return Tile(current().emit("trans", [x.value], [T.TileType(x.shape[::-1], x.dtype, x.space)]).result)


def _check_numbers(what: str, a, b) -> None:
    """Operands of tl.minimum / tl.maximum that are neither tiles nor traced scalars must be numbers."""
    if not all(isinstance(v, numbers.Number) and not isinstance(v, complex) for v in (a, b)):
        fail(f"{what} takes tiles, fragments, traced scalars or Python numbers, got "
             f"{type(a).__name__} and {type(b).__name__}")


def minimum(a, b):
    """The smaller of two scalars (two Python numbers stay one), or the elementwise minimum
    when either is a tile."""
    if isinstance(a, (Tile, Fragment)) or isinstance(b, (Tile, Fragment)):
        return ewise("min", a, b)
    if not isinstance(a, Scalar) and not isinstance(b, Scalar):
        _check_numbers("tl.minimum", a, b)
        return min(a, b)
    return scalar_op("min", a, b)


def maximum(a, b):
    """The larger of two scalars, or the elementwise maximum when either is a tile."""
    if isinstance(a, (Tile, Fragment)) or isinstance(b, (Tile, Fragment)):
        return ewise("max", a, b)
    if not isinstance(a, Scalar) and not isinstance(b, Scalar):
        _check_numbers("tl.maximum", a, b)
        return max(a, b)
    return scalar_op("max", a, b)


#: how a program spells each dtype (for messages)
_SPELLED = {"f16": "tl.float16", "bf16": "tl.bfloat16", "f32": "tl.float32", "i32": "tl.int32", "i1": "tl.bool_"}


def tile_for_store(ref, tile, what) -> Tile:
    """``tile`` as a store into ``ref`` takes it: as many axes, floats converted to its type."""
    tile = as_tile(tile)
    if len(tile.shape) != len(ref.shape):
        fail(f"{what}: a {len(tile.shape)}-d tile into the {len(ref.shape)}-d tensor '{tensor_name(ref)}'")
    if tile.dtype != ref.dtype:
        if tile.dtype.is_float and ref.dtype.is_float:
            tile = cast(tile, ref.dtype)
        else:
            fail(f"{what}: cannot store {'a' if tile.dtype.name == 'bf16' else 'an'} {tile.dtype} tile into '{tensor_name(ref)}' of {ref.dtype} (floats convert "
                 f"on a store, integers and bools do not: convert it first, t.to({_SPELLED[ref.dtype.name]}))")
    return tile
