"""How far a GPU result may legitimately be from the simulator's, per output element.

A GPU run and ``tl.simulate`` compute the same program in different floating-point ways: the
GPU multiplies fp32 ``dot`` operands as TF32 on its tensor cores, adds the K products of a dot
and the N elements of a ``sum`` in another order (and the tensor cores truncate where numpy
rounds), may keep an f16/bf16 intermediate in fp32 registers where the simulator rounds it, and
its ``expf``/``tanhf``/``erff`` are not numpy's. None of that is a bug; anything beyond it is.

So the tolerance is not one number per dtype times the output's largest value (which let a
zeroed element of a GEMM pass whenever its value was small next to the largest one). It is a
bound on each element's error, carried through the program alongside the simulation
(:func:`reference_with_tolerances`): every tile value gets, element by element, a bound on how
far the GPU's value may be from the simulator's, from the bounds of its operands and the
magnitudes that actually flow into it:

* inputs are exact (bound 0); loads, stores and data movement carry bounds with the values;
* ``a + b``: ``e_a + e_b``; ``a * b``: ``|a| e_b + |b| e_a + e_a e_b``; ``a / b``: the same to
  first order, divided by ``|b| - e_b``; ``max``/``min``/``abs``/``neg``: the largest operand bound;
* a math function ``f``: ``max |f(x +- e_x) - f(x)|`` (each is monotone) plus its own
  approximation error (``FUNCTION_ULPS`` f32 ulps of the result);
* ``dot(A, B)``: ``|A| @ e_B + e_A @ |B| + e_A @ e_B + (tf32 + K * accumulate) * (|A| @ |B|)``
  per element: the reduction length and the magnitudes of that row and column, not the
  output's largest value;
* ``sum`` over N: ``sum e + (N - 1) * accumulate * sum |x|``; ``max``/``min``: the largest bound;
* a comparison whose operands are closer than their bounds may come out either way: its flag
  is uncertain, and a ``where`` on an uncertain flag may take either side (``|a - b|`` more);
  a float truncated to an integer may move by one more;
* every result rounded to its dtype adds one ulp of that dtype (both sides round, to nearest):
  always for f16/bf16 (the GPU may keep the value in fp32), for f32 only where the operands
  already differ (both sides round the same exact value the same way, IEEE add/mul/div/sqrt
  without contraction).

An element agrees when ``|got - want| <= SAFETY * bound + subnormal spacing of its dtype``;
NaN and infinities must be at the same places (with the same signs). An i32 output is exact
wherever no float error reaches it. The numbers, and why each is what it is, are in
:data:`TOLERANCES` (per dtype) and the constants below it.
"""
from __future__ import annotations

import contextlib
import math
import threading
from dataclasses import dataclass

import numpy as np

#: whether the GPU runs an fp32 ``tl.dot`` as TF32 on tensor cores (it does: mma.sync / WGMMA
#: with operands rounded by ``cvt.rna.tf32.f32``); the simulator multiplies in full fp32
FP32_DOT_RUNS_AS_TF32 = True


@dataclass(frozen=True)
class DtypeTolerance:
    """What one dtype contributes to an element's bound."""
    ulp: float            # relative spacing of the dtype (2^-mantissa bits): one rounding on each
                          # side (to nearest) differs by at most ulp * |value|
    rounds_freely: bool   # whether the GPU may skip (or add) a rounding to this dtype between ops
    dot_operand: float    # relative rounding of a dot's operand on the tensor cores
    floor: float          # the spacing of the dtype's subnormals: what rounding near 0 may differ by


#: Per dtype (the dtype of the value being rounded or stored, or of a dot's operands):
#:
#: * ``f32``: ulp 2^-23 (24-bit significand). Not rounded freely: every f32 op is IEEE on both
#:   sides. As a ``dot`` operand it is rounded to TF32 (10 explicit bits, to nearest with ties
#:   away: at most 2^-11 relative per operand, so 2^-10 per product) when
#:   :data:`FP32_DOT_RUNS_AS_TF32`; the simulator does not round it.
#: * ``f16``: ulp 2^-10 (11-bit significand); rounded freely (an f16 intermediate may stay fp32
#:   on the GPU); exact as a dot operand (the tensor cores multiply f16 exactly, into fp32).
#: * ``bf16``: ulp 2^-7 (8-bit significand); as f16 otherwise.
#: * ``i32``: exact: 0 everywhere (an i32 element may differ only where float error reaches it,
#:   through a float cast to an integer or a comparison of floats closer than their bounds).
TOLERANCES = {
    "f32": DtypeTolerance(2.0 ** -23, False, 2.0 ** -11 if FP32_DOT_RUNS_AS_TF32 else 0.0, 2.0 ** -149),
    "f16": DtypeTolerance(2.0 ** -10, True, 0.0, 2.0 ** -24),
    "bf16": DtypeTolerance(2.0 ** -7, True, 0.0, 2.0 ** -133),
    "i32": DtypeTolerance(0.0, False, 0.0, 0.0),
    "i1": DtypeTolerance(0.0, False, 0.0, 0.0),
}
#: fp32 ulps per addition of a dot's K products or a sum's N elements, times sum |term|: numpy
#: adds pairwise or blocked (rounding to nearest, half an ulp), the GPU in its own order, its
#: tensor cores truncating the aligned products (up to one ulp); 2 covers both with room
ACCUMULATE_ULPS = 2.0
#: fp32 ulps of a math function's result by which the GPU's and numpy's may differ: CUDA's
#: documented maximum (expf 2, exp2f 2, logf 1, tanhf 2, erff 2; sigmoid is expf, an add and a
#: division) plus numpy's (its SIMD float32 exp/log/tanh stay within 1-2 ulps; erf is computed
#: in double and rounded once)
FUNCTION_ULPS = {"exp": 4.0, "exp2": 4.0, "log": 3.0, "tanh": 4.0, "erf": 3.0, "sigmoid": 6.0}
#: the bound is first order (products of two errors are kept only in mul and dot) and each term
#: is a worst case only up to rounding of the bound itself: twice the bound leaves room for both,
#: and the fuzzer's modelled GPU errors stay below half of it (tests/test_tolerances.py)
SAFETY = 2.0

_F32 = TOLERANCES["f32"].ulp
_MONOTONE = {
    "exp": np.exp, "exp2": np.exp2, "log": np.log, "sqrt": np.sqrt, "tanh": np.tanh,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "recip": lambda x: 1.0 / x, "erf": np.vectorize(math.erf, otypes=[np.float64]),
}
_POLE_AT_ZERO = ("log", "rsqrt", "recip")
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
_SELECTS = ("neg", "abs", "not", "max", "min", "where", "and", "or") + _COMPARE


# =================================================================================================
# The bound, carried through a simulation
# =================================================================================================

def _tol(dtype) -> DtypeTolerance:
    return TOLERANCES.get(dtype.name, TOLERANCES["f32"])


def _f64(x) -> np.ndarray:
    return np.asarray(x, np.float64) if not isinstance(x, np.ndarray) or x.dtype != np.float64 else x


def _times(mag, err):
    """``mag * err``, 0 where ``err`` is 0 (an infinite magnitude times no error is no error)."""
    with np.errstate(all="ignore"):
        return np.where(err == 0, 0.0, mag * err)


def _clean(err, value) -> np.ndarray:
    """A bound: NaN (an undefined propagation) is unbounded; a non-finite value must match
    exactly, so it carries no bound."""
    err = np.array(np.broadcast_to(_f64(err), np.shape(value)), np.float64)
    err[np.isnan(err)] = np.inf
    v = np.asarray(value)
    if v.dtype.kind == "f":
        err[~np.isfinite(v)] = 0.0
    return err


def _rounding(err, value, dtype, always=None) -> np.ndarray:
    """``err`` plus one ulp of ``dtype`` where the value is (or may be) rounded to it."""
    t = _tol(dtype)
    if t.ulp == 0.0:
        return err
    always = t.rounds_freely if always is None else always
    with np.errstate(all="ignore"):
        extra = t.ulp * np.abs(_f64(value))
    return err + (extra if always else np.where(err > 0, extra, 0.0))


def _ewise_bound(name, vals, errs, result) -> np.ndarray:
    x = [_f64(v) for v in vals]
    e = errs
    with np.errstate(all="ignore"):
        if name in ("neg", "abs", "not"):
            return e[0]
        if name in ("add", "sub"):
            return e[0] + e[1]
        if name == "mul":
            return _times(np.abs(x[0]), e[1]) + _times(np.abs(x[1]), e[0]) + e[0] * e[1]
        if name in ("div", "floordiv", "mod"):
            num = e[0] + _times(np.abs(x[0] / x[1]), e[1])
            q = np.where(num == 0, 0.0, num / np.maximum(np.abs(x[1]) - e[1], 0.0))
            if name == "div":
                return q
            # the quotient rounded down may move by one more; the remainder by the divisor more
            jump = q > 0
            if name == "floordiv":
                return np.where(jump, q + 1.0, 0.0)
            return np.where(jump, e[0] + _times(np.abs(np.floor(x[0] / x[1])), e[1]) + np.abs(x[1]) + e[1], 0.0)
        if name in ("max", "min"):
            return np.maximum(e[0], e[1])
        if name in _COMPARE:
            near = e[0] + e[1]
            return np.where((near > 0) & ~(np.abs(x[0] - x[1]) > near), 1.0, 0.0)
        if name in ("and", "or"):
            if np.asarray(result).dtype == np.bool_:
                return np.minimum(np.maximum(e[0], e[1]), 1.0)
            return np.where(e[0] + e[1] > 0, np.inf, 0.0)           # bitwise on uncertain integers
        if name == "where":
            taken = np.where(np.asarray(vals[0], bool), e[1], e[2])
            either = np.abs(x[1] - x[2]) + np.maximum(e[1], e[2])
            return np.where(e[0] > 0, either, taken)
        if name in _MONOTONE:
            f, r = _MONOTONE[name], _f64(result)
            up, down = np.abs(f(x[0] + e[0]) - r), np.abs(f(x[0] - e[0]) - r)
            moved = np.where(e[0] == 0, 0.0, np.maximum(up, down))
            if name in _POLE_AT_ZERO:                 # an interval reaching 0 reaches the pole (or the edge)
                moved = np.where((e[0] > 0) & (e[0] >= np.abs(x[0])), np.inf, moved)
            return moved + FUNCTION_ULPS.get(name, 0.0) * _F32 * np.abs(r)
    raise KeyError(f"no error bound for elementwise op '{name}'")


def _sum_bound(x, e, axis):
    n = np.shape(x)[axis]
    with np.errstate(all="ignore"):
        acc = ACCUMULATE_ULPS * max(n - 1, 0) * _F32 * np.sum(np.abs(_f64(x)), axis=axis)
    return np.sum(e, axis=axis) + acc


def _make_interpreter():
    from ..runtime.sim.interpreter import Interpreter
    from ..runtime.sim.memory import Memory

    class BoundInterpreter(Interpreter):
        """The simulator's rules, each also computing its result's error bound (kept in the
        task's environment under ``("e", value id)``; memory's in :attr:`shadow`)."""

        def __init__(self, engine):
            super().__init__(engine)
            self.shadow: dict[tuple[int, str], np.ndarray] = {}
            _BOUNDS.interpreters.append(self)

        # -- helpers -----------------------------------------------------------------------------
        @staticmethod
        def _e(env, v):
            return env.get(("e", v.id), 0.0)

        def _set(self, env, v, err):
            env[("e", v.id)] = _clean(err, env[v.id])

        def _mem(self, rank, buf):
            key = (rank, buf.name)
            s = self.shadow.get(key)
            if s is None:
                s = self.shadow[key] = np.zeros(buf.data.shape, np.float64)
            return s

        def _read_err(self, rank, value, offsets, shape, task, op, values=False):
            """The bounds of a box (0 outside the tensor); with ``values``, its values."""
            buf = self._buf(rank, value, task, op)
            _, _, bsl, tsl, empty = Memory.clip(buf, offsets, shape)
            out = np.zeros(shape, np.float64)
            if not empty:
                out[tsl] = buf.data[bsl] if values else self._mem(rank, buf)[bsl]
            return out

        def _write_err(self, rank, value, offsets, tile, err, dtype, task, op):
            buf = self._buf(rank, value, task, op)
            _, _, bsl, tsl, empty = Memory.clip(buf, offsets, np.shape(tile))
            if empty:
                return
            err = np.broadcast_to(err, np.shape(tile))
            if dtype.name != buf.dtype.name:
                err = _rounding(err, tile, buf.dtype, always=False)
            self._mem(rank, buf)[bsl] = _clean(err, tile)[tsl]

        # -- memory --------------------------------------------------------------------------------
        def op_load(self, op, env, task):
            super().op_load(op, env, task)
            t, *offs = op.operands
            err = self._read_err(task.rank, t, [env[o.id] for o in offs], op.attrs["shape"], task, op)
            self._set(env, op.result, err.reshape(op.result.type.shape))

        def op_store(self, op, env, task):
            super().op_store(op, env, task)
            t, *offs, v = op.operands
            self._write_err(task.rank, t, [env[o.id] for o in offs], env[v.id], self._e(env, v), v.type.dtype,
                            task, op)

        def op_load_rows(self, op, env, task):
            super().op_load_rows(op, env, task)
            t, rows_v, col_v = op.operands
            buf = self._buf(task.rank, t, task, op)
            rows, col = np.asarray(env[rows_v.id], np.int64), env[col_v.id]
            shape = op.attrs["shape"]
            err = np.zeros(shape, np.float64)
            c0, c1 = max(col, 0), min(col + shape[1], buf.data.shape[1])
            if c1 > c0:
                for i in np.nonzero(rows >= 0)[0]:
                    err[i, c0 - col:c1 - col] = self._mem(task.rank, buf)[rows[i], c0:c1]
            self._set(env, op.result, err)

        def op_add_rows(self, op, env, task):
            super().op_add_rows(op, env, task)
            t, rows_v, col_v, v = op.operands
            buf = self._buf(task.rank, t, task, op)
            rows, col = np.asarray(env[rows_v.id], np.int64), env[col_v.id]
            tile = np.asarray(env[v.id])
            err = np.broadcast_to(self._e(env, v), tile.shape)
            c0, c1 = max(col, 0), min(col + tile.shape[1], buf.data.shape[1])
            if c1 <= c0:
                return
            mem = self._mem(task.rank, buf)
            for i in np.nonzero(rows >= 0)[0]:
                # each add rounds its sum to the tensor's type, in the GPU's order (any): one ulp of
                # the sum's magnitude, bounded by what it had and what was added
                after, term = buf.data[rows[i], c0:c1], tile[i, c0 - col:c1 - col]
                mem[rows[i], c0:c1] = _clean(_rounding(mem[rows[i], c0:c1] + err[i, c0 - col:c1 - col],
                                                       np.abs(_f64(after)) + 2 * np.abs(_f64(term)), buf.dtype,
                                                       always=True), after)

        def _data(self, op, env, task):
            yield from super()._data(op, env, task)
            from ..ir.opdefs import data_operands
            src, srank, soffs, dst, drank, doffs, tile = data_operands(op)
            shape = op.attrs["shape"]
            if tile is not None:
                self._write_err(env[drank.id], dst, [env[o.id] for o in doffs], env[tile.id], self._e(env, tile),
                                tile.type.dtype, task, op)
            elif dst is None:
                self._set(env, op.result, self._read_err(env[srank.id], src, [env[o.id] for o in soffs], shape,
                                                         task, op))
            else:
                box = (env[srank.id], src, [env[o.id] for o in soffs], shape, task, op)
                self._write_err(env[drank.id], dst, [env[o.id] for o in doffs], self._read_err(*box, values=True),
                                self._read_err(*box), self._buf(env[srank.id], src, task, op).dtype, task, op)

        op_tile_push_data = op_tile_pull_data = op_rank_copy_data = _data

        # -- tile math ---------------------------------------------------------------------------------
        def op_full(self, op, env, task):
            super().op_full(op, env, task)
            self._set(env, op.result, 0.0)

        def op_iota(self, op, env, task):
            super().op_iota(op, env, task)
            self._set(env, op.result, 0.0)

        def op_ewise(self, op, env, task):
            super().op_ewise(op, env, task)
            vals = [env[v.id] for v in op.operands]
            errs = [_f64(self._e(env, v)) for v in op.operands]
            r = env[op.result.id]
            err = _ewise_bound(op.attrs["op"], vals, errs, r)
            if op.attrs["op"] not in _SELECTS:         # a selection is exact: its result is an operand
                err = _rounding(err, r, op.result.type.dtype)
            self._set(env, op.result, err)

        def op_cast(self, op, env, task):
            super().op_cast(op, env, task)
            v = op.operands[0]
            err, r = _f64(self._e(env, v)), env[op.result.id]
            src, dst = v.type.dtype, op.attrs["dtype"]
            if dst.name in ("i32", "i1") and src.name not in ("i32", "i1"):
                err = np.where(err > 0, err + 1.0, 0.0)                 # truncation may move by one
            elif dst.name != src.name:
                err = _rounding(err, r, dst, always=False)     # both sides round the same value alike
            self._set(env, op.result, err)

        def op_reduce(self, op, env, task):
            super().op_reduce(op, env, task)
            v = op.operands[0]
            x, err, axis = env[v.id], _f64(self._e(env, v)), op.attrs["axis"]
            err = np.broadcast_to(err, np.shape(x))
            if op.attrs["op"] != "sum":
                out = np.max(err, axis=axis)
            elif np.asarray(x).dtype.kind == "f":
                out = _sum_bound(x, err, axis)
            else:
                out = np.sum(err, axis=axis)
            self._set(env, op.result, _rounding(out, env[op.result.id], op.result.type.dtype))

        def op_expand_dims(self, op, env, task):
            super().op_expand_dims(op, env, task)
            v = op.operands[0]
            self._set(env, op.result, np.expand_dims(np.broadcast_to(self._e(env, v), np.shape(env[v.id])),
                                                     op.attrs["axis"]))

        def op_broadcast(self, op, env, task):
            super().op_broadcast(op, env, task)
            v = op.operands[0]
            self._set(env, op.result, np.broadcast_to(np.broadcast_to(self._e(env, v), np.shape(env[v.id])),
                                                      op.attrs["shape"]))

        def op_trans(self, op, env, task):
            super().op_trans(op, env, task)
            v = op.operands[0]
            self._set(env, op.result, np.broadcast_to(self._e(env, v), np.shape(env[v.id])).T)

        def op_dot(self, op, env, task):
            super().op_dot(op, env, task)
            a, b = op.operands[:2]
            A, B = np.abs(_f64(env[a.id])), np.abs(_f64(env[b.id]))
            eA = np.broadcast_to(_f64(self._e(env, a)), A.shape)
            eB = np.broadcast_to(_f64(self._e(env, b)), B.shape)
            K = A.shape[1]
            rel = 2.0 * _tol(a.type.dtype).dot_operand + ACCUMULATE_ULPS * K * _F32
            with np.errstate(all="ignore"):
                err = A @ eB + eA @ B + eA @ eB + rel * (A @ B)
            for extra in op.operands[2:]:
                err = err + self._e(env, extra)
            self._set(env, op.result, err)

        def op_frag_alloc(self, op, env, task):
            super().op_frag_alloc(op, env, task)
            self._set(env, op.result, 0.0)

        def op_frag_read(self, op, env, task):
            super().op_frag_read(op, env, task)
            self._set(env, op.result, np.array(self._e(env, op.operands[0]), np.float64, copy=True))

        def op_frag_write(self, op, env, task):
            super().op_frag_write(op, env, task)
            frag, v = op.operands
            err = np.broadcast_to(_f64(self._e(env, v)), np.shape(env[frag.id]))
            if frag.type.dtype.name != v.type.dtype.name:
                err = _rounding(err, env[frag.id], frag.type.dtype, always=False)
            self._set(env, frag, err)

    return BoundInterpreter


class _State(threading.local):
    interpreters: list = []


_BOUNDS = _State()
_LOCK = threading.Lock()


@contextlib.contextmanager
def _interpreter(cls):
    """Every simulation started inside runs ``cls`` instead of the simulator's own rules (one
    at a time); yields the list of the interpreters made."""
    from ..runtime.sim import engine
    with _LOCK:
        original = engine.Interpreter
        engine.Interpreter = cls
        _BOUNDS.interpreters = []
        try:
            yield _BOUNDS.interpreters
        finally:
            engine.Interpreter = original


def _make_gpu_like(rng: np.random.Generator):
    from ..ir.semantics import EWISE
    from ..runtime.sim.interpreter import Interpreter

    class GpuLikeInterpreter(Interpreter):
        """The simulator's rules with the differences a GPU may legitimately make."""

        def op_ewise(self, op, env, task):
            name, dt = op.attrs["op"], op.result.type.dtype.name
            super().op_ewise(op, env, task)
            if name in FUNCTION_ULPS:             # CUDA's math functions: within their ulps, either way
                r = env[op.result.id]
                if r.dtype == np.float32:
                    wiggle = rng.uniform(-0.5, 0.5, r.shape) * FUNCTION_ULPS[name] * _F32
                    env[op.result.id] = (r * (1.0 + wiggle)).astype(np.float32)
            elif dt in ("f16", "bf16") and name not in _SELECTS:      # kept in fp32, not rounded
                args = [np.asarray(env[v.id]).astype(np.float32) if np.asarray(env[v.id]).dtype.kind == "f"
                        else env[v.id] for v in op.operands]
                with np.errstate(all="ignore"):
                    r = np.asarray(EWISE[name](*args), np.float32)
                env[op.result.id] = np.broadcast_to(r, op.result.type.shape).copy()

        def op_dot(self, op, env, task):
            a, b = (np.asarray(env[v.id], np.float32) for v in op.operands[:2])
            if op.operands[0].type.dtype.name == "f32" and FP32_DOT_RUNS_AS_TF32:
                a, b = round_tf32(a), round_tf32(b)
            acc = np.zeros((a.shape[0], b.shape[1]), np.float32)
            with np.errstate(all="ignore"):
                for k in rng.permutation(a.shape[1]):
                    acc = acc + a[:, k, None] * b[None, k, :]
            env[op.result.id] = acc

        def op_reduce(self, op, env, task):
            x = env[op.operands[0].id]
            if op.attrs["op"] != "sum" or np.asarray(x).dtype.kind != "f":
                return super().op_reduce(op, env, task)
            x = np.moveaxis(np.asarray(x, np.float32), op.attrs["axis"], 0)
            acc = np.zeros(x.shape[1:], np.float32)
            with np.errstate(all="ignore"):
                for i in rng.permutation(x.shape[0]):
                    acc = acc + x[i]
            env[op.result.id] = self._out(op, acc)

    return GpuLikeInterpreter


def round_tf32(x) -> np.ndarray:
    """fp32 values rounded to TF32 as the tensor cores' operands are (to nearest, ties away)."""
    f = np.array(x, np.float32, copy=True)
    bits = f.view(np.uint32)
    finite = (bits & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
    bits[finite] = (bits[finite] + np.uint32(0x1000)) & np.uint32(0xFFFFE000)
    return f


def simulate_like_gpu(kernel, world_size: int, inputs, seed: int = 0, **simulate_kw):
    """``tl.simulate`` with the differences a GPU may legitimately make, at random (``seed``):
    fp32 dot operands rounded to TF32, every dot's K and every sum's N added in a random order in
    fp32, f16/bf16 arithmetic kept in fp32 (unrounded) until stored or cast, math functions off
    by up to half their ``FUNCTION_ULPS`` either way. A model of the GPU's error, for checking
    that the tolerances accept it (not a model of its speed or scheduling)."""
    import tldsl as tl
    with _interpreter(_make_gpu_like(np.random.default_rng(seed))):
        return tl.simulate(kernel, world_size, inputs, seed=seed, **simulate_kw)


# =================================================================================================
# The public part: reference + tolerances, and the comparison
# =================================================================================================

def reference_with_tolerances(kernel, world_size: int, inputs, **simulate_kw):
    """``tl.simulate``'s result, and per rank and argument the tolerance of each element
    (``SAFETY`` times its error bound plus its dtype's subnormal spacing; 0 for an exact one).
    The values are the simulator's own: the bounds only ride along."""
    import tldsl as tl
    with _interpreter(_make_interpreter()) as interps:
        result = tl.simulate(kernel, world_size, inputs, **simulate_kw)
    shadow = interps[-1].shadow if interps else {}
    tolerances = []
    for r in range(world_size):
        per = {}
        for b in result.kernel.args:
            want = result.outputs[r][b.name]
            bound = shadow.get((r, b.name))
            bound = np.zeros(want.shape, np.float64) if bound is None else bound
            per[b.name] = SAFETY * bound + _tol(b.type.dtype).floor
        tolerances.append(per)
    return result, tolerances


def compare(got, want, tolerance) -> str | None:
    """None where ``got`` agrees with ``want`` element by element (``|got - want| <= tolerance``,
    NaN and infinities at the same places), else what differs."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    g, w = got.astype(np.float64), want.astype(np.float64)
    tol = np.broadcast_to(np.asarray(tolerance, np.float64), w.shape)
    finite = np.isfinite(w)
    with np.errstate(invalid="ignore"):
        diff = np.abs(g - w)
        bad = np.where(finite, ~(diff <= tol), ~((g == w) | (np.isnan(g) & np.isnan(w))))
    if not bad.any():
        return None
    i = tuple(int(v) for v in np.argwhere(bad)[0])
    rel = f"{diff[i] / tol[i]:.3g} x its tolerance" if finite[i] and tol[i] > 0 else "exact expected"
    return (f"{int(bad.sum())} of {bad.size} elements differ; first at {i}: {g[i]!r}, expected {w[i]!r} "
            f"(tolerance {tol[i]:.3g}; off by {diff[i]:.3g}, {rel})")


def worst_ratio(got, want, tolerance) -> float:
    """The largest ``|got - want| / tolerance`` over the finite elements (inf where a mismatch
    is not within any tolerance: an exact element that differs, NaN/inf at other places)."""
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = np.broadcast_to(np.asarray(tolerance, np.float64), w.shape)
    finite = np.isfinite(w)
    with np.errstate(invalid="ignore", divide="ignore"):
        special_bad = (~finite & ~((g == w) | (np.isnan(g) & np.isnan(w)))).any()
        if special_bad:
            return math.inf
        diff = np.abs(g - w)[finite]
        t = tol[finite]
        ratio = np.where(diff == 0, 0.0, diff / t)
    ratio = ratio[~np.isnan(ratio)] if ratio.size else ratio
    return float(ratio.max(initial=0.0))


def mismatches(got, want, tolerances, names) -> list[str]:
    """Every rank and argument (of ``names``) where ``got`` differs from ``want`` (both one dict
    of arrays per rank), each element within ``tolerances`` (the same shape); one line each."""
    out = []
    for r in range(len(want)):
        for name in names:
            why = compare(got[r][name], want[r][name], tolerances[r][name])
            if why:
                out.append(f"rank {r} '{name}': {why}")
    return out


def assert_agrees(got, reference, tolerances, names=None) -> None:
    """For tests: ``got`` (``tl.run``'s outputs per rank, or a SimResult) agrees with the
    simulated ``reference`` (a SimResult) within ``tolerances`` (from
    :func:`reference_with_tolerances`), and has the same dtypes."""
    got_outputs = got.outputs if hasattr(got, "outputs") else got
    kernel = reference.kernel
    names = names if names is not None else [b.name for b in kernel.args]
    for r in range(kernel.world_size):
        for name in names:
            g, w = np.asarray(got_outputs[r][name]), reference.outputs[r][name]
            assert g.dtype == w.dtype, f"rank {r} '{name}': dtype {g.dtype}, expected {w.dtype}"
    bad = mismatches(got_outputs, reference.outputs, tolerances, names)
    assert not bad, "\n".join(bad)
