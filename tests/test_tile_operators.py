"""Python's operators on tiles, fragments and traced scalars, in either order: a fragment reads as
its current value (``acc * 0.5``, ``acc /= l``, ``-acc``, ``acc > 0``), and a traced scalar on the
left of a tile broadcasts (``p * 8 + tl.iota(8)``) — each checked in the simulator against numpy,
and lowered and compiled like any tile math."""
from __future__ import annotations

import functools
import math
import re

import numpy as np
import pytest

import tldsl as tl


@tl.kernel
def mixed(x, out, hits):
    @tl.compute_part(grid=(2,))
    def v(p):
        acc = tl.fragment((8,), tl.float32, fill=2.0)
        t = tl.load(x, (0,), (8,))
        acc /= t
        y = -acc * 0.5 + (p * 8 + tl.iota(8))
        acc.write(tl.where(acc > 0, y, 1 - acc))
        acc -= abs(acc) // 4 + acc % 2
        tl.store(out, (p * 8,), acc)
        tl.store(hits, (p * 8,), tl.cast((p + tl.iota(8) == 3) | (acc >= 3), tl.int32))


def _want(x):
    out, hits = [], []
    for p in range(2):
        a = (2 / x).astype(np.float32)
        a = np.where(a > 0, -a * 0.5 + (p * 8 + np.arange(8)), 1 - a).astype(np.float32)
        a = a - (np.floor(np.abs(a) / 4) + np.mod(a, 2))
        out.append(a)
        hits.append(((p + np.arange(8)) == 3) | (a >= 3))
    return np.concatenate(out), np.concatenate(hits).astype(np.int32)


def test_fragments_and_scalars_take_operators_in_either_order():
    x = np.array([1, 2, 4, -1, -2, 8, 0.5, -4], np.float32)      # every quotient exact
    r = tl.simulate(mixed, 1, [{"x": x, "out": np.full(16, np.nan, np.float32), "hits": np.full(16, -1, np.int32)}])
    want_out, want_hits = _want(x)
    np.testing.assert_array_equal(r[0]["out"], want_out)
    np.testing.assert_array_equal(r[0]["hits"], want_hits)


def test_the_same_program_lowers_and_compiles():
    pytest.importorskip("cuda.bindings")
    from tldsl.codegen import lower
    f32 = tl.TensorSpec((16,), tl.float32)
    k = mixed.trace(1, tl.TensorSpec((8,), tl.float32), f32, tl.TensorSpec((16,), tl.int32))
    assert lower(k, "v").compile().cubin


def test_a_fragment_has_no_truth_value():
    @tl.kernel
    def branch(out):
        @tl.compute_part(grid=(1,))
        def v(p):
            acc = tl.fragment((8,), tl.float32)
            if acc:
                tl.store(out, (0,), acc)

    with pytest.raises(tl.CompilationError, match="a fragment has no Python truth value"):
        branch.trace(1, tl.TensorSpec((8,), tl.float32))


def test_traced_scalars_negate_and_take_their_absolute_value():
    @tl.kernel
    def starts(out):
        @tl.compute_part(grid=(3,))
        def v(p):
            lo = tl.maximum(-p * 8, 0) + abs(p - 1) + (+p)
            tl.store(out, (p * 8,), lo + tl.iota(8))

    got = tl.simulate(starts, 1, [{"out": np.full(24, -1, np.int32)}])[0]["out"]
    want = np.concatenate([max(-p * 8, 0) + abs(p - 1) + p + np.arange(8) for p in range(3)])
    np.testing.assert_array_equal(got, want)


def test_divmod_and_cdiv_of_traced_scalars_follow_pythons_floor_and_ceiling_for_either_sign():
    """``pm, pn = divmod(pid, n)`` works on traced scalars (it was a bare TypeError), and
    ``tl.cdiv`` of a traced value by a negative divisor is the ceiling, as for Python ints (it
    computed ``(a + b - 1) // b``: cdiv(5, -2) was -1)."""
    @tl.kernel
    def splits(tab, out):
        @tl.compute_part(grid=(4,))
        def v(p):
            a, b = tl.load_scalar(tab, (p * 2,)), tl.load_scalar(tab, (p * 2 + 1,))
            q, r = divmod(a, b)
            q2, r2 = divmod(7, b)
            vals = (q, r, q2, r2, tl.cdiv(a, b), tl.cdiv(a, 3))
            t = tl.full((6,), 0, tl.int32)
            for i, x in enumerate(vals):
                t = tl.where(tl.iota(6) == i, x, t)
            tl.store(out, (p * 6,), t)

    pairs = [(5, -2), (-5, 2), (-7, -3), (9, 4)]
    tab = np.array(pairs, np.int32).ravel()
    got = tl.simulate(splits, 1, [{"tab": tab, "out": np.full(24, -99, np.int32)}])[0]["out"].reshape(4, 6)
    want = [[a // b, a % b, 7 // b, 7 % b, -(-a // b), -(-a // 3)] for a, b in pairs]
    np.testing.assert_array_equal(got, want)


def test_schedules_take_numpy_ints_as_the_ints_they_are():
    """Sizes computed with numpy in a notebook: ``stages=np.int64(2)`` is 2, not 'need 1..8'."""
    i = np.int64
    s = tl.ComputeSchedule(tile=(i(64), i(64), i(32)), stages=i(2), group_m=i(4), cluster=(i(2), i(1)))
    assert s == tl.ComputeSchedule(tile=(64, 64, 32), stages=2, group_m=4, cluster=(2, 1))
    assert all(type(v) is int for v in s.tile + (s.stages, s.group_m) + s.cluster)
    assert tl.CommSchedule(tile_m=i(16)).tile_m == 16 and type(tl.CommSchedule(tile_m=i(16)).tile_m) is int
    with pytest.raises(tl.ScheduleError, match="stages takes an int, got True"):
        tl.ComputeSchedule(stages=True)


def test_a_number_or_scalar_divides_a_tile_from_the_left():
    @tl.kernel
    def divided(out):
        @tl.compute_part(grid=(2,))
        def v(p):
            t = tl.iota(8) + 1
            tl.store(out, (p * 8,), (p + 7) // t + (p + 5) % t + 7 // t)

    got = tl.simulate(divided, 1, [{"out": np.full(16, -1, np.int32)}])[0]["out"]
    t = np.arange(8) + 1
    np.testing.assert_array_equal(got, np.concatenate([(p + 7) // t + (p + 5) % t + 7 // t for p in range(2)]))


@pytest.mark.parametrize("expr, says", [
    ("1 << p", "'<<' and '>>' on traced scalars: multiply or floor-divide"),
    ("p ** 2", "'**' on traced scalars: write the product"),
    ("~(p > 0)", "'~' on traced scalars: for 'not x' write x == 0"),
    ("64 / (p + 1)", "'/' on traced index scalars is ambiguous: use '//'"),
    ("len(tl.iota(8))", "a tile has no len(): its shape is t.shape"),
    ("tl.iota(8) >> 1", "'<<' and '>>' on tiles"),
    ("2.0 ** tl.zeros((8,))", "'**' on tiles: write the product"),
    ("tl.fragment((8,), tl.int32) ^ 1", "'^' on tiles: for bool masks write a != b"),
    ("tl.sum(tl.zeros((2, 8)))", "tl.sum needs the axis to reduce along (tl.sum(t, 1) for each row's)"),
    ("round(tl.zeros((8,)) * 4.0)", "round() / math.floor() of a tile: floor-divide by 1"),
    ("sum(tl.zeros((2, 8)))", "a tile is not iterable (sum(t), list(t), for x in t): reduce it with tl.sum(t, axis)"),
    ("round(tl.fragment((8,)))", "round() / math.floor() of a tile: floor-divide by 1"),
    ("list(tl.fragment((2, 8)))", "a tile is not iterable"),
    ("tl.full((8,), float('nan'), tl.int32)", "tl.full: nan has no i32 value (numpy refuses it too)"),
    ("tl.fragment((8,), tl.int32, fill=float('-inf'))", "tl.fragment: -inf has no i32 value"),
    ("tl.max(tl.zeros((8,)), axis=None)", "reducing a tile to one scalar is not supported"),
])
def test_operators_tldsl_has_not_are_typed_errors_at_the_users_line(expr, says):
    ns = {"tl": tl}
    src = ("@tl.kernel\ndef k(out):\n    @tl.compute_part(grid=(1,))\n    def v(p):\n"
           f"        x = {expr}\n        tl.store(out, (0,), tl.zeros((8,)))\n")
    exec(compile(src, "<operators>", "exec"), ns)
    with pytest.raises(tl.CompilationError, match=re.escape(says)) as info:
        ns["k"].trace(1, tl.TensorSpec((8,), tl.float32))
    assert info.value.loc is not None and info.value.loc.lineno == 5


def test_a_scalar_divided_by_a_tile_is_elementwise():
    @tl.kernel
    def halves(out):
        @tl.compute_part(grid=(2,))
        def v(p):
            tl.store(out, (p * 8,), (p + 1) / tl.full((8,), 2.0))

    got = tl.simulate(halves, 1, [{"out": np.full(16, np.nan, np.float32)}])[0]["out"]
    np.testing.assert_array_equal(got, np.repeat([0.5, 1.0], 8).astype(np.float32))


def test_expand_dims_takes_a_numpy_int_axis_and_refuses_a_traced_one():
    @tl.kernel
    def rows(out):
        @tl.compute_part(grid=(1,))
        def v(p):
            tl.store(out, (0, 0), tl.broadcast_to(tl.expand_dims(tl.iota(4), np.int64(0)), (2, 4)))

    got = tl.simulate(rows, 1, [{"out": np.full((2, 4), -1, np.int32)}])[0]["out"]
    np.testing.assert_array_equal(got, np.tile(np.arange(4), (2, 1)))

    @tl.kernel
    def traced(out):
        @tl.compute_part(grid=(1,))
        def v(p):
            tl.store(out, (0, 0), tl.expand_dims(tl.iota(4), p))

    with pytest.raises(tl.CompilationError, match="tl.expand_dims: axis must be a Python int, got Scalar"):
        traced.trace(1, tl.TensorSpec((1, 4), tl.int32))


@tl.kernel
def signs(x, s, m):
    @tl.compute_part(grid=(1,))
    def v(p):
        t = tl.load(x, (0,), (8,))
        tl.store(s, (0,), tl.where(t > 0, 1, -1) + tl.where(t < -2, True, 5))
        tl.store(m, (0,), tl.cast(tl.where(t == 0, True, False), tl.int32))


def test_where_of_two_numbers_takes_numpys_type():
    """``tl.where(mask, 1, -1)`` is an i32 tile (numpy's int, in the program's integer type), and
    of two bools a mask; a float on either side makes it f32."""
    x = np.array([-4, -3, -1, 0, 0.5, 2, -2.5, 7], np.float32)
    r = tl.simulate(signs, 1, [{"x": x, "s": np.full(8, 99, np.int32), "m": np.full(8, 99, np.int32)}])[0]
    np.testing.assert_array_equal(r["s"], np.where(x > 0, 1, -1) + np.where(x < -2, True, 5))
    np.testing.assert_array_equal(r["m"], (x == 0).astype(np.int32))
    k = signs.trace(1, tl.TensorSpec((8,), tl.float32), tl.TensorSpec((8,), tl.int32), tl.TensorSpec((8,), tl.int32))
    kinds = [op.results[0].type.dtype for op in k.part("v").body.ops if op.name == "ewise" and op.attrs.get("op") == "where"]
    assert kinds == [tl.int32, tl.int32, tl.bool_], kinds
    pytest.importorskip("cuda.bindings")
    from tldsl.codegen import lower
    assert lower(k, "v").compile().cubin


@tl.kernel
def positives(x, counts, anyall):
    @tl.compute_part(grid=(1,))
    def count(p):
        t = tl.load(x, (0, 0), (4, 8))
        tl.store(counts, (0,), tl.sum(t > 0, 1) + tl.sum(t < -1, 1))
        tl.store(anyall, (0,), tl.cast(tl.max(t > 0, 1), tl.int32) * 2 + tl.cast(tl.min(t > -9, 1), tl.int32))


def test_the_sum_of_a_mask_counts_it():
    """``tl.sum`` of a bool tile counts its true elements as numpy does (an i32 tile; bool
    arithmetic would have OR'ed them); ``tl.max`` of one is 'any', ``tl.min`` 'all'."""
    x = np.array([[1, -2, 3, 0, 5, -6, 7, 8], [-1, -2, -3, -4, -5, -6, -7, -8],
                  [0, 0, 0, 0, 0, 0, 0, 1], [9, 9, 9, 9, 9, 9, 9, -10]], np.float32)
    r = tl.simulate(positives, 1, [{"x": x, "counts": np.full(4, -1, np.int32), "anyall": np.full(4, -1, np.int32)}])[0]
    np.testing.assert_array_equal(r["counts"], np.sum(x > 0, 1) + np.sum(x < -1, 1))
    np.testing.assert_array_equal(r["anyall"], np.any(x > 0, 1) * 2 + np.all(x > -9, 1))
    k = positives.trace(1, tl.TensorSpec((4, 8), tl.float32), tl.TensorSpec((4,), tl.int32), tl.TensorSpec((4,), tl.int32))
    pytest.importorskip("cuda.bindings")
    from tldsl.codegen import lower
    assert lower(k, "count").compile().cubin


@tl.kernel
def bool_index_math(x, y, flags):
    @tl.compute_part(grid=(4,))
    def part(p):
        late = p > 1
        off = (late + 1) * 4                        # a bool beside an int counts 0 / 1: 4 or 8, an i32
        either = (p == 0) + (p == 3)                # two bools: + is `or`, * is `and` (numpy's)
        both_ = (p >= 1) * (p <= 2)
        tl.store(y, (p * 4,), tl.load(x, (off,), (4,)))
        tl.store(flags, (p * 2,), tl.where(tl.iota(2) == 0, tl.full((2,), 1, tl.int32) * either,
                                           tl.full((2,), 1, tl.int32) * both_))


def test_bool_scalars_in_index_math_take_numpys_types():
    """``(p > 1) + 1`` is an i32 (it was a bool: the simulator computed 2 where the generated C++
    held ``true``, and an offset refused it); two bools add as `or` and multiply as `and`."""
    x = np.arange(16, dtype=np.float32)
    r = tl.simulate(bool_index_math, 1, [{"x": x, "y": np.full(16, np.nan, np.float32),
                                          "flags": np.full(8, -1, np.int32)}])[0]
    p = np.arange(4)
    np.testing.assert_array_equal(r["y"].reshape(4, 4), x[((p > 1) + 1)[:, None] * 4 + np.arange(4)])
    np.testing.assert_array_equal(r["flags"].reshape(4, 2), np.stack([(p == 0) | (p == 3), (p >= 1) & (p <= 2)], 1))
    k = bool_index_math.trace(1, tl.TensorSpec((16,), tl.float32), tl.TensorSpec((16,), tl.float32),
                              tl.TensorSpec((8,), tl.int32))
    assert [o.results[0].type.dtype.name for o in k.parts[0].walk() if o.name == "arith"][1:3] == ["i32", "i32"]
    pytest.importorskip("cuda.bindings")
    from tldsl.codegen import lower
    assert lower(k, "part").compile().cubin


@tl.kernel
def doubling_allreduce(x, inbox: tl.Symmetric, y, flags):
    """An allreduce by recursive doubling: at step ``s`` each rank swaps its partial sum with
    rank ``me ^ 2**s`` (``^`` of traced scalars: bitwise on i32, `!=` on bools)."""
    W = tl.world_size()
    (N,) = x.shape
    got = tl.signal("got", max(1, W.bit_length() - 1), scope="symmetric")

    @tl.comm_part(grid=(1,))
    def swap(i):
        me = tl.rank()
        acc = tl.load(x, (0,), (N,))
        for step in tl.static_range(W.bit_length() - 1):
            partner = me ^ (1 << step)
            tl.tile_push_data(inbox.at(partner), (step * N,), acc)
            tl.peer_tile_notify(got, step, partner)
            tl.peer_tile_wait(got, step)
            acc = acc + tl.load(inbox, (step * N,), (N,))
        tl.store(y, (0,), acc)
        odd_one = (me == 1) ^ (me == 2)                   # two bools: True where exactly one holds
        tl.store(flags, (0,), tl.full((2,), 1, tl.int32) * tl.where(tl.iota(2) == 0, me ^ -3, odd_one ^ 5))


def _doubling_inputs(W, N=24, seed=8):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(N).astype(np.float32), "inbox": np.full(N * max(1, W.bit_length() - 1), np.nan,
             np.float32), "y": np.full(N, np.nan, np.float32), "flags": np.full(2, -99, np.int32)} for _ in range(W)]


@pytest.mark.parametrize("W", [2, 4, 8])
def test_xor_of_traced_scalars_pairs_ranks_for_recursive_doubling(W):
    """``me ^ 2**s`` is the partner of a recursive-doubling allreduce: every rank ends with the sum
    (the same bits on every rank: each step adds the two partials, which commute); ``^`` of an i32
    and a negative number and of two bools (logical) as numpy computes them. Simulated, then on the
    fake device through the generated kernel's plan (tl.run's own path)."""
    from test_run_fake_device import agrees
    ins = _doubling_inputs(W)
    res = tl.simulate(doubling_allreduce, W, ins)
    total = np.sum([i["x"] for i in ins], 0, dtype=np.float64)
    for r in range(W):
        np.testing.assert_allclose(res[r]["y"], total, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(res[r]["y"], res[0]["y"])
        np.testing.assert_array_equal(res[r]["flags"], [r ^ -3, ((r == 1) ^ (r == 2)) ^ 5])
    agrees(doubling_allreduce, W, ins)
    pytest.importorskip("cuda.bindings")
    from tldsl.codegen import lower
    lk = lower(res.kernel, "swap")
    assert " ^ 1);" in lk.source                    # the first step's partner, C++'s xor of ints
    assert lk.compile().cubin


@tl.kernel
def signed_zeros(x, y, *, compute: tl.ComputeSchedule = None):
    """max / min of zeros of both signs, seen through 1 / result (+inf or -inf): elementwise both
    ways round, and reduced along rows."""
    M, N = x.shape

    @tl.compute_part(grid=(1,))
    def part(p):
        t = tl.load(x, (0, 0), (M, N))
        z = -tl.zeros((M, N))                                   # -0.0 everywhere
        tl.store(y, (0, 0), 1.0 / tl.maximum(t, z))
        tl.store(y, (M, 0), 1.0 / tl.maximum(z, t))
        tl.store(y, (2 * M, 0), 1.0 / tl.minimum(t, -z))
        tl.store(y, (3 * M, 0), 1.0 / tl.minimum(-z, t))
        tl.store(y, (4 * M, 0), tl.expand_dims(1.0 / tl.max(t, 1), 1) + tl.zeros((M, N)))
        tl.store(y, (5 * M, 0), tl.expand_dims(1.0 / tl.min(t, 1), 1) + tl.zeros((M, N)))


SIGNED_ZEROS_X = np.array([[0.0, -0.0, 0.0, -0.0], [-0.0, -0.0, -0.0, -0.0], [0.0, 0.0, 0.0, 0.0],
                           [-0.0, 0.0, -1.0, -2.0]], np.float32)


def _ieee_max(a: float, b: float) -> float:
    """IEEE 754-2019 maximum of two non-NaN floats: -0 below +0."""
    if a == b == 0:
        return b if math.copysign(1, a) < 0 else a
    return max(a, b)


def _ieee_min(a: float, b: float) -> float:
    if a == b == 0:
        return a if math.copysign(1, a) < 0 else b
    return min(a, b)


def signed_zeros_want():
    """``signed_zeros``' y as IEEE 754-2019 maximum / minimum give it (the GPU's max.NaN / min.NaN)."""
    x = SIGNED_ZEROS_X.tolist()
    el = lambda f, a, b: [[f(u, v) for u, v in zip(ra, rb)] for ra, rb in zip(a, b)]   # noqa: E731
    z, pz = [[-0.0] * 4] * 4, [[0.0] * 4] * 4
    rows = lambda f: [[functools.reduce(f, r)] * 4 for r in x]                         # noqa: E731
    blocks = [el(_ieee_max, x, z), el(_ieee_max, z, x), el(_ieee_min, x, pz), el(_ieee_min, pz, x),
              rows(_ieee_max), rows(_ieee_min)]
    with np.errstate(divide="ignore"):
        return (1 / np.array([r for b in blocks for r in b], np.float64)).astype(np.float32)


def test_max_and_min_order_negative_zero_below_positive_zero():
    """numpy's maximum returns the second operand of a tie, so max(0, -0) and max(-0, 0) differed
    in sign, as did a row's max with numpy's internal order; the GPU's max.NaN orders -0 below +0
    (IEEE 754-2019) and so now does the simulator: 1 / max(+0, -0) is +inf either way round."""
    got = tl.simulate(signed_zeros, 1, [{"x": SIGNED_ZEROS_X, "y": np.full((24, 4), np.nan, np.float32)}],
                      compute=tl.ComputeSchedule(tile=(8, 8, 8)))[0]["y"]
    np.testing.assert_array_equal(got, signed_zeros_want())
    assert got[0, 0] == got[4, 0] == np.inf and got[8, 1] == got[12, 1] == -np.inf   # max(+0, -0), min(-0, +0)


@pytest.mark.parametrize("expr,says", [("(p > 0) - (p > 1)", "scalar 'sub' of two bools: numpy refuses it"),
                                       ("-(p > 0)", "'-' of a bool scalar: numpy refuses it too"),
                                       ("p + 0.5", "a float beside one belongs in tile math")])
def test_scalar_arithmetic_numpy_would_refuse_or_tldsl_cannot_trace_says_what_to_write(expr, says):
    src = f"""
@tl.kernel
def k(y):
    @tl.compute_part(grid=(4,))
    def part(p):
        q = {expr}
        tl.store(y, (p,), tl.full((1,), 1.0))
"""
    ns = {"tl": tl}
    exec(compile(src, "<scalars>", "exec"), ns)        # noqa: S102 - the test's own source
    with pytest.raises(tl.CompilationError, match=re.escape(says)) as info:
        ns["k"].trace(1, tl.TensorSpec((4,), tl.float32))
    assert str(info.value).startswith("<scalars>:6:")
