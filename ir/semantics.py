"""The meaning of scalar ops and wait targets, shared by the static analysis, the simulator and the
code generator."""
from __future__ import annotations

import math
import operator

import numpy as np


def _floordiv(a, b):
    if b == 0:
        raise ZeroDivisionError("integer division by zero in index arithmetic")
    return a // b


def _mod(a, b):
    if b == 0:
        raise ZeroDivisionError("modulo by zero in index arithmetic")
    return a % b


ARITH = {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul,
    "floordiv": _floordiv, "mod": _mod, "min": min, "max": max,
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "eq": operator.eq, "ne": operator.ne,
    # Python's: logical on booleans, bitwise on integers (``pid & 1``), as the generated C++
    "and": operator.and_, "or": operator.or_, "xor": operator.xor,
}

def _float_of(x):
    """``x`` as the float array numpy math gives it: float32 stays float32, integers become float64."""
    x = np.asarray(x)
    return x if x.dtype.kind == "f" else x.astype(np.float64)


def _sigmoid(x):
    """1 / (1 + e^-x) in the operand's float type: 0 where e^-x overflows, NaN stays NaN."""
    x = _float_of(x)
    return 1.0 / (1.0 + np.exp(-x))


_ERF = np.frompyfunc(math.erf, 1, 1)


def _erf(x):
    """The error function, exact in double then rounded to the operand's float type (numpy has no erf)."""
    x = _float_of(x)
    return np.asarray(_ERF(x.astype(np.float64)), np.float64).astype(x.dtype)


def _rsqrt(x):
    """1 / sqrt(x): inf at 0, NaN below it."""
    x = _float_of(x)
    return 1.0 / np.sqrt(x)


def _in_float(fn):
    """``fn`` on its operand as :func:`_float_of` gives it: math of a bool or integer tile is in
    float64, as the generated code computes it (numpy alone takes a bool array's exp in float16
    and an integer's reciprocal in integers)."""
    return lambda x: fn(_float_of(x))


# max and min: numpy's (NaN wins), with -0 below +0 (IEEE 754-2019 maximum / minimum, which the GPU's
# max.NaN / min.NaN compute): numpy returns the second operand of a tie, so the sign of a zero result
# depended on the operands' order, and a reduction's on numpy's internal order; this way neither does.
def _maximum(a, b):
    r = np.maximum(a, b)
    if r.dtype.kind == "f":
        zeros = (np.asarray(a) == 0) & (np.asarray(b) == 0)
        if np.any(zeros):                       # +0 + -0 is +0, -0 + -0 is -0: the larger zero
            r = np.where(zeros, np.add(a, b, dtype=r.dtype), r)
    return r


def _minimum(a, b):
    r = np.minimum(a, b)
    if r.dtype.kind == "f":
        zeros = (np.asarray(a) == 0) & (np.asarray(b) == 0)
        if np.any(zeros):                       # -(-a + -b): the smaller zero
            r = np.where(zeros, np.negative(np.add(np.negative(a), np.negative(b), dtype=r.dtype)), r)
    return r


def _zero_signed(r, x, axis, negative: bool):
    """``r`` (a max or min of ``x`` along ``axis``) with its zeros signed as IEEE 754-2019 orders
    them: -0 where (``negative``: any, else every) zero of ``x`` there is -0."""
    if r.dtype.kind != "f" or not np.any(r == 0):
        return r
    zero = x == 0
    neg = np.any(zero & np.signbit(x), axis=axis) if negative else ~np.any(zero & ~np.signbit(x), axis=axis)
    return np.where(r == 0, np.where(neg, r.dtype.type(-0.0), r.dtype.type(0.0)), r)


def _max_reduce(x, axis):
    return _zero_signed(np.max(x, axis=axis), x, axis, negative=False)


def _min_reduce(x, axis):
    return _zero_signed(np.min(x, axis=axis), x, axis, negative=True)


def _sum_reduce(x, axis):
    """numpy's sum, whose reductions start from add's identity +0 (numpy 2): a sum of -0s is +0, not
    the -0 IEEE addition of the elements alone gives; pinned here (the generated code adds +0 to
    its sums), so that it depends neither on numpy's version nor on the order a reduction runs in."""
    r = np.sum(x, axis=axis)
    if r.dtype.kind == "f":
        r = np.add(r, r.dtype.type(0.0))        # -0 + +0 is +0; every other value stays as it is
    return r


EWISE = {
    "sigmoid": _sigmoid, "tanh": _in_float(np.tanh), "erf": _erf, "rsqrt": _rsqrt,
    "neg": np.negative, "exp": _in_float(np.exp), "exp2": _in_float(np.exp2), "log": _in_float(np.log),
    "abs": np.abs, "sqrt": _in_float(np.sqrt), "recip": _in_float(np.reciprocal), "not": np.logical_not,
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "max": _maximum, "min": _minimum, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal, "eq": np.equal, "ne": np.not_equal,
    # numpy's & and |: logical on bools, bitwise on integers (tracing refuses floats)
    "and": np.bitwise_and, "or": np.bitwise_or, "floordiv": np.floor_divide, "mod": np.mod,
    "where": np.where,
}

REDUCE = {"sum": _sum_reduce, "max": _max_reduce, "min": _min_reduce}


def bf16_rounded(x) -> np.ndarray:
    """``x`` rounded to bf16 (nearest even on the 16 dropped bits), still float32; NaN stays NaN."""
    f = np.array(x, np.float32)
    bits = f.view(np.uint32)
    nan = np.isnan(f)
    bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    bits &= np.uint32(0xFFFF0000)
    f[nan] = np.nan
    return f


def float_of(value, dtype_name: str) -> float:
    """The float ``value`` as a ``dtype_name`` float holds it: f16 and bf16 rounded to nearest even
    (numpy rounds a Python float to an f16 array's type before the math, NEP 50), f32 rounded."""
    with np.errstate(over="ignore"):         # past the type's range: inf, as numpy rounds it
        f = np.float32(value)
        if dtype_name == "f16":
            f = np.float32(np.float16(value))
    if dtype_name == "bf16":
        f = bf16_rounded(f)
    return float(f)


def wrap_i32(x):
    """Index arithmetic is 32-bit on the GPU: wrap like it does."""
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        x = int(x) & 0xFFFFFFFF
        return x - (1 << 32) if x >= (1 << 31) else x
    return x


def wait_target(count: int, launch: int, epoch: bool = True, per_launch: int | None = None, lag: int = 0) -> int:
    """The value a wait spins for. Signals are counters never reset: with epoch counting a
    slot notified ``per_launch`` times per launch (default ``count``: the wait needs all of
    them) holds ``per_launch * (launch - 1)`` when launch ``launch`` (1-based) begins, so the
    wait needs ``per_launch * (launch - 1) + count``; ``epoch=False`` waits for ``count`` itself.
    ``lag``: the wait is for the notifies of launch ``launch - lag`` (a buffer reused every other
    launch is free once its readers reached the launch before); none before the first launch."""
    if not epoch:
        return count
    per = count if per_launch is None else per_launch
    if launch - lag < 1:
        return 0
    return per * (launch - 1 - lag) + count
