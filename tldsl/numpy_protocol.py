"""numpy's functions meeting traced values: tiles, fragments and traced scalars are not arrays.

A numpy ufunc with a tile-language twin of the same elementwise meaning traces as that twin
(``np.exp(t)`` is ``tl.exp(t)``, ``np.maximum(t, 0.0)`` is ``tl.maximum(t, 0.0)``, ``np.float32(2) * t``
a tile multiply). Anything else numpy would do with one — another ufunc, a ufunc's ``reduce``, a
numpy function such as ``np.sum``, turning it into an array — is a CompilationError at the user's
line naming what to write. Without this, ``np.sum(t)`` returned ``t`` itself (numpy summed a 0-d
object array: a silently wrong program) and ``np.exp(t)`` was numpy's TypeError about loops.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from .errors import CompilationError
from .ir.location import user_location
from .tracing import Scalar, fail

#: binary ufuncs traced as Python's operators: (the operator on the left operand, on the right one)
BINARY = {
    np.add: ("__add__", "__radd__"), np.subtract: ("__sub__", "__rsub__"),
    np.multiply: ("__mul__", "__rmul__"), np.true_divide: ("__truediv__", "__rtruediv__"),
    np.floor_divide: ("__floordiv__", "__rfloordiv__"), np.remainder: ("__mod__", "__rmod__"),
    np.bitwise_and: ("__and__", "__rand__"), np.bitwise_or: ("__or__", "__ror__"),
    np.less: ("__lt__", "__gt__"), np.less_equal: ("__le__", "__ge__"),
    np.greater: ("__gt__", "__lt__"), np.greater_equal: ("__ge__", "__le__"),
    np.equal: ("__eq__", "__eq__"), np.not_equal: ("__ne__", "__ne__"),
}

#: unary ufuncs traced as Python's operators
UNARY = {np.negative: "__neg__", np.positive: "__pos__", np.absolute: "__abs__", np.invert: "__invert__"}

#: ufuncs traced as the tl function of the same name and meaning (NaN in max/min propagates in
#: both), and the traced value classes: given by :func:`install` (the language builds on this module)
TWINS: dict = {}
TRACED: tuple = (Scalar,)

#: what to write instead of a numpy function or ufunc method tldsl does not trace
INSTEAD = {
    "sum": "tl.sum(x, axis)", "max": "tl.max(x, axis)", "amax": "tl.max(x, axis)", "min": "tl.min(x, axis)",
    "amin": "tl.min(x, axis)", "where": "tl.where(mask, a, b)", "dot": "tl.dot(a, b)", "matmul": "tl.dot(a, b)",
    "transpose": "tl.trans(x) or x.T", "expand_dims": "tl.expand_dims(x, axis)",
    "broadcast_to": "tl.broadcast_to(x, shape)", "clip": "tl.minimum(tl.maximum(x, lo), hi)",
    "zeros_like": "tl.zeros(x.shape, x.dtype)", "full_like": "tl.full(x.shape, value, x.dtype)",
    "add.reduce": "tl.sum(x, axis)", "maximum.reduce": "tl.max(x, axis)", "minimum.reduce": "tl.min(x, axis)",
    "power": "the product (x * x)", "square": "x * x", "reciprocal": "1.0 / x", "rint": "tl.cast",
    "erf": "tl.erf(x)", "expit": "tl.sigmoid(x)", "sigmoid": "tl.sigmoid(x)", "rsqrt": "tl.rsqrt(x)",
    "logical_and": "a & b on bool tiles", "logical_or": "a | b on bool tiles", "logical_not": "~mask",
}

#: numpy's array methods and attributes a tile lacks, and what to write instead
METHODS = {
    "sum": "tl.sum(t, axis)", "max": "tl.max(t, axis)", "min": "tl.min(t, axis)",
    "mean": "tl.sum(t, axis) / t.shape[axis]", "astype": "tl.cast(t, dtype)", "transpose": "tl.trans(t) or t.T",
    "reshape": "tl.expand_dims(t, axis) or tl.broadcast_to(t, shape) (a tile's shape is static)",
    "dot": "tl.dot(a, b)", "clip": "tl.minimum(tl.maximum(t, lo), hi)", "ndim": "len(t.shape)",
    "size": "math.prod(t.shape)", "any": "tl.max(tl.cast(mask, tl.int32), axis) > 0",
    "all": "tl.min(tl.cast(mask, tl.int32), axis) > 0",
    "item": "tl.store it and read the result: a traced tile has no values while tracing",
    "tolist": "tl.store it and read the result: a traced tile has no values while tracing",
    "numpy": "tl.store it and read the result: a traced tile has no values while tracing",
}

ARRAYS = ("tiles, fragments and traced scalars are traced values, not arrays: a part reads arrays through "
           "its kernel's arguments (tl.load), and makes constant tiles with tl.full")


def _traced(x) -> bool:
    return isinstance(x, TRACED)


def _hint(name: str) -> str:
    instead = INSTEAD.get(name) or (f"tl.{name}(x)" if name in TWINS else None)
    return f"write {instead}" if instead else "the tile language's functions are tl.* (help(tl))"


class NotAnArrayMethod(CompilationError, AttributeError):
    """A numpy array method asked of a tile (``t.sum(axis=1)``): a CompilationError at the user's
    line saying what to write, and an AttributeError, so ``hasattr(t, "sum")`` is False and
    duck-typed code (``x.numpy() if hasattr(x, "numpy") else x``) goes on as with any object."""


def missing_attribute(self, name: str):
    """``__getattr__`` of tiles and fragments: numpy's array methods (``t.sum(axis=1)``,
    ``t.astype(...)``) say what to write; any other missing name is the usual AttributeError (numpy
    and Python probe dunders this way)."""
    if name in METHODS:
        raise NotAnArrayMethod(f"a {type(self).__name__} has no .{name} (it is no numpy array): write "
                               f"{METHODS[name]}", user_location())
    if name in ("read", "write"):           # (an AttributeError too: hasattr(t, "read") stays False)
        raise NotAnArrayMethod(
            f"a tile has no .{name}(): only a fragment (tl.fragment) is read and written; a tile is a value, used "
            "as it is. Was it a fragment once? `acc = acc + t` binds `acc` to a new tile: update a fragment in "
            "place with `acc += t` or `acc.write(t)`", user_location())
    raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")


def number_operand(x, what: str):
    """An operand beside a traced value as the tile language takes it (``what`` names the
    operation for the errors): a 0-d array as its number, a numpy bool as Python's, anything else
    as it is; an array of more dimensions, and a complex number, are refused."""
    if isinstance(x, np.ndarray):
        if x.ndim:
            fail(f"{what} and a numpy array of shape {x.shape}: {ARRAYS}")
        x = x[()]
    if isinstance(x, (complex, np.complexfloating)):
        fail(f"{what} and the complex number {x!r}: tiles hold real numbers (f16, bf16, f32, i32, bool)")
    return bool(x) if isinstance(x, np.bool_) else x


def _operand(x, ufunc):
    """A ufunc's operand: a traced value, or a number (:func:`number_operand`)."""
    x = number_operand(x, f"numpy's {ufunc.__name__} of a traced value")
    if not (_traced(x) or isinstance(x, (numbers.Number, np.generic))):
        fail(f"numpy's {ufunc.__name__} of a traced value and a {type(x).__name__}: it takes tiles, fragments, "
             f"traced scalars and numbers")
    return x


def array_ufunc(self, ufunc, method, *inputs, **kwargs):
    """``__array_ufunc__`` of the traced values (see the module's docstring)."""
    if method != "__call__":
        fail(f"numpy's {ufunc.__name__}.{method} on a traced value: {_hint(f'{ufunc.__name__}.{method}')}")
    if kwargs:
        fail(f"numpy's {ufunc.__name__}({', '.join(kwargs)}=...) on a traced value: out=, where=, dtype= and the "
             f"other ufunc keywords do not apply to tiles (tl.cast changes a tile's type)")
    args = [_operand(x, ufunc) for x in inputs]
    if ufunc in BINARY:
        left, right = BINARY[ufunc]
        a, b = args
        got = getattr(a, left)(b) if _traced(a) else NotImplemented
        if got is NotImplemented and _traced(b):
            got = getattr(b, right)(a)
        if got is NotImplemented:
            fail(f"numpy's {ufunc.__name__} of {type(a).__name__} and {type(b).__name__}: not traced")
        return got
    if ufunc in UNARY:
        return getattr(args[0], UNARY[ufunc])()
    if ufunc.__name__ in TWINS:
        return TWINS[ufunc.__name__](*args)
    fail(f"numpy's {ufunc.__name__} on a traced value is not in the tile language: {_hint(ufunc.__name__)}")


#: numpy functions that only ask a traced value's static shape: answered
SHAPE_QUERIES = {"shape": lambda x: tuple(x.shape), "ndim": lambda x: len(x.shape),
                 "size": lambda x: math.prod(x.shape)}


def _numpy_name(func) -> str:
    """``np.sum``, ``np.linalg.norm``, ``np.emath.sqrt``: a numpy function as a user writes it."""
    module = getattr(func, "__module__", "") or ""
    parts = [p for p in module.split(".")[1:] if not p.startswith("_")]
    aliases = {"scimath": "emath", "fromnumeric": None, "function_base": None, "numeric": None, "multiarray": None,
               "shape_base": None, "lib": None, "core": None, "utils": None}
    parts = [aliases.get(p, p) for p in parts]
    return ".".join(["np", *[p for p in parts if p], getattr(func, "__name__", str(func))])


def array_function(self, func, types, args, kwargs):
    """``__array_function__`` of the traced values: ``np.shape``, ``np.ndim`` and ``np.size`` of one
    are answered from its static shape; numpy's other functions (``np.sum``, ``np.where``,
    ``np.dot``, ...) are refused with what to write."""
    name = getattr(func, "__name__", str(func))
    if name in SHAPE_QUERIES and func is getattr(np, name, None) and len(args) == 1 and not kwargs \
            and not isinstance(args[0], Scalar):
        return SHAPE_QUERIES[name](args[0])
    fail(f"numpy's {_numpy_name(func)} on a traced value: {_hint(name)} (numpy's functions run on arrays, "
         f"not while tracing)")


def refuse_array(self, dtype=None, copy=None):
    """``__array__``: a traced value has no numbers yet."""
    fail(f"numpy cannot make an array or a numpy number of a {type(self).__name__}: {ARRAYS} (tl.cast changes a "
         f"tile's type)")


def refuse_number(self):
    """``__float__``, ``__complex__`` (math.exp(t), float(t)): a tile is not one number."""
    fail(f"a {type(self).__name__} is not a Python number (math's functions and float() take numbers): for "
         f"tiles use tl.exp, tl.sqrt, ... elementwise, tl.sum(x, axis) to reduce")


def install(classes: tuple, twins: dict) -> None:
    """Give the traced value classes numpy's protocols (and, but for traced scalars, which say
    so themselves, the number refusals); ``twins``: {ufunc name: the tl function it traces as}."""
    global TRACED
    TRACED = tuple(classes)
    TWINS.update(twins)
    for cls in classes:
        cls.__array_ufunc__ = array_ufunc
        cls.__array_function__ = array_function
        cls.__array__ = refuse_array
        if cls is not Scalar:
            cls.__float__ = cls.__complex__ = cls.__int__ = cls.__index__ = refuse_number
            cls.__getattr__ = missing_attribute
