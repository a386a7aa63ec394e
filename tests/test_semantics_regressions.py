"""Where the simulator and the generated code once meant different things (found by review):
a negative ``tl.expand_dims`` axis (numpy's: counted from the end of the result) and ``&`` /
``|`` on integer scalars and tiles (Python's and numpy's: bitwise, an integer). Each is checked in the simulator
against numpy / Python, and in the general recipe's generated code run on CPU threads."""
from __future__ import annotations

import functools
import math
import sys

import re
import shutil

import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen import lower

from test_codegen_general import emulate


@tl.kernel
def negative_axes(x, y, z, *, compute: tl.ComputeSchedule = None):
    @tl.compute_part(grid=(4,))
    def part(p):
        v = tl.load(x, (0,), (4,))
        with tl.when(p == 0):
            tl.store(y, (0, 0), tl.expand_dims(v, -1) + tl.zeros((4, 4)))      # a column, broadcast along rows
        bit = p & 2                                                             # an i32 (2 or 0), not a bool
        with tl.when(bit != 0):
            tl.store(z, (p,), tl.full((1,), 1.0) * bit)
        with tl.when((p | 4) == 5):
            tl.store(z, (p,), tl.full((1,), -1.0))
        with tl.when(((p & 2) == 0) & (p != 1)):
            tl.store(z, (p,), tl.full((1,), 0.0))


def _inputs():
    return {"x": np.arange(4, dtype=np.float32), "y": np.full((4, 4), np.nan, np.float32),
            "z": np.full(4, np.nan, np.float32)}


WANT_Y = np.repeat(np.arange(4, dtype=np.float32)[:, None], 4, axis=1)       # numpy's expand_dims(v, -1)
WANT_Z = np.array([0.0 if (p & 2) == 0 and p != 1 else -1.0 if (p | 4) == 5 else float(p & 2) for p in range(4)],
                  np.float32)


def test_the_simulator_means_numpy_and_python():
    res = tl.simulate(negative_axes, 1, [_inputs()])
    assert np.array_equal(res[0]["y"], WANT_Y) and np.array_equal(res[0]["z"], WANT_Z)
    ir = negative_axes.trace(1, tl.TensorSpec((4,), tl.float32), tl.TensorSpec((4, 4), tl.float32),
                             tl.TensorSpec((4,), tl.float32))
    ands = [op for op in ir.part("part").walk() if op.name == "arith" and op.attrs["op"] in ("and", "or")]
    assert [str(op.result.type) for op in ands][:2] == ["i32", "i32"] and str(ands[-1].result.type) == "i1"

    @tl.kernel
    def too_far(x):
        @tl.compute_part(grid=(1,))
        def part(p):
            tl.expand_dims(tl.load(x, (0,), (4,)), 3)
    with pytest.raises(tl.CompilationError, match="axis 3 is outside a 2-d result"):
        too_far.trace(1, tl.TensorSpec((4,), tl.float32))


@pytest.mark.skipif(shutil.which("g++") is None, reason="the generated code runs on CPU threads through g++")
def test_the_generated_code_means_the_same(tmp_path):
    ir = negative_axes.trace(1, tl.TensorSpec((4,), tl.float32), tl.TensorSpec((4, 4), tl.float32),
                             tl.TensorSpec((4,), tl.float32))
    got = emulate(ir, lower(ir, "part"), _inputs(), tmp_path)
    assert np.array_equal(got["y"], WANT_Y) and np.array_equal(got["z"], WANT_Z)


@tl.kernel
def mixed_sum(x, n, y, *, compute: tl.ComputeSchedule = None):
    @tl.compute_part(grid=(1,))
    def part(p):
        tl.store(y, (0,), tl.load(x, (0,), (4,)) + tl.load(n, (0,), (4,)))      # f16 + i32, stored as f16


def _mixed_inputs():
    # 2049 + 2**-14 lies just above the midpoint of f16's 2048 and 2050: one rounding gives 2050;
    # rounding to float first lands on the midpoint (2049.0) and then on the even 2048
    return {"x": np.full(4, 2.0 ** -14, np.float16), "n": np.array([2049, 2051, -2049, 7], np.int32),
            "y": np.full(4, np.nan, np.float16)}


def test_a_16_bit_result_is_rounded_once():
    want = (np.float64(2.0 ** -14) + _mixed_inputs()["n"]).astype(np.float16)
    assert list(want[:3]) == [2050, 2052, -2048]
    res = tl.simulate(mixed_sum, 1, [_mixed_inputs()])
    assert np.array_equal(res[0]["y"], want)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the generated code runs on CPU threads through g++")
def test_the_generated_code_rounds_a_16_bit_result_once(tmp_path):
    ir = mixed_sum.trace(1, tl.TensorSpec((4,), tl.float16), tl.TensorSpec((4,), tl.int32),
                         tl.TensorSpec((4,), tl.float16))
    got = emulate(ir, lower(ir, "part"), _mixed_inputs(), tmp_path)
    want = (np.float64(2.0 ** -14) + _mixed_inputs()["n"]).astype(np.float16)
    assert np.array_equal(got["y"], want), got["y"]


@tl.kernel
def tile_bits(x, y, *, compute: tl.ComputeSchedule = None):
    @tl.compute_part(grid=(1,))
    def part(p):
        v = tl.load(x, (0,), (16,))
        bits = (v & 6) + (5 | v) * 100 - (v & (v > 2)) * 10000        # int & int, int | int, int & bool
        mask = ~((v > 3) & (v < 12)) | (v == 7)                        # bool: logical
        tl.store(y, (0,), bits + mask + ((v > 4) & 6) * 1000000 + ((v < 2) | 8) * 100000)   # bool & int literal


def _bits_inputs():
    return {"x": np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, -1, -6, 255, 2 ** 30 + 5], np.int32),
            "y": np.full(16, -999, np.int32)}


def _bits_want(v):
    return ((v & 6) + (5 | v) * 100 - (v & (v > 2)) * 10000 + (~((v > 3) & (v < 12)) | (v == 7))
            + ((v > 4) & 6) * 1000000 + ((v < 2) | 8) * 100000).astype(np.int32)


def test_tile_ands_and_ors_are_numpys():
    """``&`` / ``|`` on tiles as numpy's: bitwise on integers (with a bool as 0 / 1), logical on
    bools; ``~`` on a bool mask (once ``&`` on int tiles was a truth test, unlike numpy and the
    scalars' ``&``)."""
    v = _bits_inputs()["x"]
    res = tl.simulate(tile_bits, 1, [_bits_inputs()])
    assert np.array_equal(res[0]["y"], _bits_want(v)), res[0]["y"]


@pytest.mark.skipif(shutil.which("g++") is None, reason="the generated code runs on CPU threads through g++")
def test_the_generated_code_ands_tiles_as_numpy(tmp_path):
    ir = tile_bits.trace(1, tl.TensorSpec((16,), tl.int32), tl.TensorSpec((16,), tl.int32))
    got = emulate(ir, lower(ir, "part"), _bits_inputs(), tmp_path)
    assert np.array_equal(got["y"], _bits_want(_bits_inputs()["x"])), got["y"]


@tl.kernel
def math_of_masks(x, y, *, compute: tl.ComputeSchedule = None):
    @tl.compute_part(grid=(2,))
    def part(p):
        v = tl.load(x, (0,), (8,))
        acc = tl.fragment((8,), tl.float32, fill=p * 10)                     # a run-time fill
        acc += tl.exp(v > 2) + tl.tanh(v > 4) + tl.ewise("recip", v + 1) + abs(v - 5)  # bool and int math: in float64
        acc += tl.full((8,), p + 1, tl.float32) + tl.sqrt(v)                 # a run-time tl.full
        tl.store(y, (p, 0), tl.expand_dims(acc.read(), 0))


def _masks_inputs():
    return {"x": np.array([0, 1, 2, 3, 4, 5, 6, 9], np.int32), "y": np.full((2, 8), np.nan, np.float32)}


def _masks_want():
    v = _masks_inputs()["x"].astype(np.float64)
    rows = [p * 10 + np.exp((v > 2) * 1.0) + np.tanh((v > 4) * 1.0) + 1 / (v + 1) + np.abs(v - 5) + (p + 1) + np.sqrt(v)
            for p in range(2)]
    return np.array(rows).astype(np.float32)


def test_float_math_of_bool_and_int_tiles_is_in_float64():
    """numpy takes a bool array's exp / tanh in float16 and an int array's reciprocal in ints;
    the generated code (and now the simulator) computes them in float64, as numpy on the floats
    they stand for. Also: tl.full / tl.fragment filled with a traced scalar, abs() on a tile."""
    res = tl.simulate(math_of_masks, 1, [_masks_inputs()])
    np.testing.assert_allclose(res[0]["y"], _masks_want(), rtol=1e-6)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the generated code runs on CPU threads through g++")
def test_the_generated_code_takes_the_math_of_masks_as_the_simulator(tmp_path):
    ir = math_of_masks.trace(1, tl.TensorSpec((8,), tl.int32), tl.TensorSpec((2, 8), tl.float32))
    got = emulate(ir, lower(ir, "part"), _masks_inputs(), tmp_path)
    np.testing.assert_allclose(got["y"], _masks_want(), rtol=1e-6)


@pytest.mark.parametrize("body, message", [
    ("tl.store(y, (0,), tl.load(x, (0.5,), (8,)))", "offset 0.5 into 'x' must be an int or a traced i32 scalar"),
    ("tl.store(y, (0,), tl.cast((tl.load(x, (0,), (8,)) > 0) - (tl.load(x, (0,), (8,)) > 1), tl.float32))",
     "'-' of bool tiles"),
    ("tl.store(y, (0,), tl.full((8,), tl.load(x, (0,), (8,))))", "tl.full: the value must be a Python number or a traced"),
    ("tl.store(y, (0,), tl.full((8,), np.arange(8)))", "got ndarray"),
    ("tl.store(y, (0,), tl.cast(tl.iota(p + 8), tl.float32))", "tile shapes are static"),
    ("tl.store(y, (0,), tl.load(x, (0,), (8,)) ** 2)", "'**' on tiles"),
])
def test_operands_a_tile_program_cannot_mean_are_refused_at_their_line(body, message):
    """Each once traced and then failed later (a float offset ran differently in the simulator and
    the generated code; the rest failed in the simulator or the code generator, away from the line)."""
    src = ("def prog(x, y):\n"
           "    @tl.compute_part(grid=(1,))\n"
           "    def part(p):\n"
           f"        {body}\n")
    scope = {"tl": tl, "np": np}
    exec(compile(src, "<prog>", "exec"), scope)
    kernel = tl.kernel(scope["prog"])
    with pytest.raises(tl.CompilationError, match=re.escape(message)) as info:
        kernel.trace(1, tl.TensorSpec((8,), tl.float32), tl.TensorSpec((8,), tl.float32))
    assert info.value.loc.lineno == 4


def test_matmul_operator_is_a_dot():
    @tl.kernel
    def mm(a, b, c):
        @tl.compute_part(grid=(1,))
        def part(p):
            tl.store(c, (0, 0), tl.load(a, (0, 0), (16, 16)) @ tl.load(b, (0, 0), (16, 16)))
    a = np.arange(256, dtype=np.float16).reshape(16, 16) % 7
    b = np.eye(16, dtype=np.float16) * 2
    res = tl.simulate(mm, 1, [{"a": a, "b": b, "c": np.full((16, 16), np.nan, np.float32)}])
    np.testing.assert_array_equal(res[0]["c"], a.astype(np.float32) * 2)


@pytest.mark.parametrize("decorate, message", [
    (lambda: tl.comm_part(grid=(1,), lanes=-3), "lanes is a positive int"),
    (lambda: tl.comm_part(grid=(1,), lanes=True), "lanes is a positive int"),
    (lambda: tl.comm_part(grid=(1,), lanes=2.5), "lanes is a positive int"),
    (lambda: tl.comm_part(grid=(1,), name=123), "a part's name is a Python identifier"),
    (lambda: tl.compute_part(grid=(1,), align_shift="x"), "align_shift='x'"),
])
def test_part_options_are_checked_where_written(decorate, message):
    """lanes=-3 once deadlocked the simulator while the GPU's plan ran one CTA; 0, 2.5 and True
    were taken; a name or align_shift of the wrong type reached the code generator."""
    @tl.kernel
    def k(x):
        decorate()
    with pytest.raises(tl.CompilationError, match=re.escape(message)):
        k.trace(1, tl.TensorSpec((8,), tl.float32))
    with pytest.raises(tl.CompilationError, match="a kernel's name is a Python identifier"):
        tl.kernel(name=123)(lambda x: None)


@tl.kernel
def mask_out(x, m, *, compute: tl.ComputeSchedule = None):
    @tl.compute_part(grid=(1,))
    def part(p):
        v = tl.load(x, (0,), (8,))
        tl.store(m, (0,), ((v & 1) == 1) | (v > 5))


@pytest.mark.parametrize("body, message", [
    (lambda x: [None for _ in tl.range(0, 8, 0.5)], "tl.range step must be a Python int or an i32 scalar (a program "
                                                    "id, a table entry), got float 0.5"),
    (lambda x: [None for _ in tl.range(True)], "tl.range stop must be a Python int or an i32 scalar"),
    (lambda x: [None for _ in tl.range(0, tl.load_scalar(x, (0,)))], "got a f32 scalar"),
    (lambda x: tl.fragment((8, 8), "float"), "tl.fragment: unknown dtype 'float' (tl.float16, tl.bfloat16"),
    (lambda x: tl.full((8,), 1.0, "half precision"), "tl.full: unknown dtype 'half precision'"),
    (lambda x: tl.load(x, (0,), (8,)).to("double"), "tl.cast: unknown dtype 'double'"),
    # dtype=None (a constexpr's default) was "unsupported dtype float64": np.dtype(None) is float64
    (lambda x: tl.cast(tl.load(x, (0,), (8,)), None), "tl.cast: a dtype is required, got None: pass one of tl.float16"),
    (lambda x: tl.full((8,), 1.0, None), "tl.full: a dtype is required, got None"),
    (lambda x: tl.zeros((8,), None), "tl.full: a dtype is required, got None"),
    (lambda x: tl.fragment((8, 8), None), "tl.fragment: a dtype is required, got None"),
    (lambda x: tl.local_buffer((8,), None), "buffer 'scratch': a dtype is required, got None"),
])
def test_a_bad_loop_bound_or_dtype_is_an_error_at_the_users_line(body, message):
    """tl.range(0, 8, 0.5) and tl.fragment(..., "float") once raised Python's own TypeError from
    inside the tracer, with no line of the user's."""
    @tl.kernel
    def k(x):
        @tl.compute_part(grid=(1,))
        def p(i):
            body(x)
    with pytest.raises(tl.CompilationError, match=re.escape(message)) as e:
        k.trace(1, tl.TensorSpec((8,), tl.float32))
    assert "test_semantics_regressions.py" in str(e.value)


def test_tl_kernel_takes_a_python_function_once():
    """A kernel decorated twice, or something that is no function, once failed deep inside with
    an AttributeError ('KernelFunction' object has no attribute '__code__')."""
    with pytest.raises(tl.CompilationError, match="'mask_out' is a tl.kernel already; decorate its function once"):
        tl.kernel(mask_out)
    with pytest.raises(tl.CompilationError, match=r"tl.kernel decorates a Python function \(def ...\), got int 3"):
        tl.kernel(3)
    with pytest.raises(tl.CompilationError, match="got partial"):
        tl.kernel(name="k")(functools.partial(lambda x, y: None, y=1))


def test_a_bool_output_is_the_same_from_the_simulator_and_the_generated_code(tmp_path):
    """A bool tensor written by a tile program (the host harness reads it back as numpy bools)."""
    x = np.array([0, 1, 2, 3, 6, 7, 8, 9], np.int32)
    want = ((x & 1) == 1) | (x > 5)
    inputs = {"x": x, "m": np.zeros(8, np.bool_)}
    assert np.array_equal(tl.simulate(mask_out, 1, [dict(inputs)])[0]["m"], want)
    if shutil.which("g++") is not None:
        ir = mask_out.trace(1, tl.TensorSpec((8,), tl.int32), tl.TensorSpec((8,), tl.bool_))
        assert np.array_equal(emulate(ir, lower(ir, "part"), inputs, tmp_path)["m"], want)


def test_a_float_column_offset_of_a_row_gather_is_refused_at_its_line():
    """tl.load_rows took its column offset through as_scalar, past the offsets' check: 2.5 traced
    and failed in the simulator with numpy's own TypeError (review)."""
    @tl.kernel
    def gather(x, y):
        @tl.compute_part(grid=(1,))
        def part(p):
            tl.store(y, (0, 0), tl.load_rows(x, tl.iota(8), 2.5, 4))
    with pytest.raises(tl.CompilationError, match=re.escape("tl.load_rows: offset 2.5 into 'x' must be an int")):
        gather.trace(1, tl.TensorSpec((8, 8), tl.float32), tl.TensorSpec((8, 4), tl.float32))


# -- Python float constants: numpy's value in the generated code (found by a helper's numerics programs) --

@tl.kernel
def python_float_constants(i, x, y, m, *, compute: tl.ComputeSchedule = None):
    """Python floats beside an i32 tile (numpy: float64 math with the double itself) and beside an
    f32 tile (numpy: the float nearest it), some of them outside f32's range."""
    @tl.compute_part(grid=(1,))
    def part(p):
        v = tl.load(i, (0, 0), (8, 16))
        t = tl.load(x, (0, 0), (8, 16))
        tl.store(y, (0, 0), v * 0.1)                                        # was (double)(0.1f)
        tl.store(y, (8, 0), v * (-math.log(10000.0) / 16))                  # rotary frequencies' exponents
        tl.store(y, (16, 0), v * 1e39 + tl.where(v > 0, 1e-50, 0.0))        # 1e+39f: NVRTC's "out of range"
        tl.store(y, (24, 0), tl.where(v > 2, t, -1e100) + tl.where(v > 9, -sys.float_info.max, 0.0))
        tl.store(y, (32, 0), t * (1 + 2 ** -24))      # an f32 tie: 1.0 (its decimal read as a float is not)
        tl.store(y, (40, 0), tl.where(v > 5, 1e-40, t))                     # an f32 subnormal
        tl.store(m, (0, 0), v < 16777216.5)


def _constants_inputs():
    rng = np.random.default_rng(5)
    i = rng.integers(-2 ** 30, 2 ** 30, (8, 16)).astype(np.int32)
    i[0, :8] = [16777216, 16777217, 16777215, 0, 1, -1, 7, 2 ** 31 - 1]
    i[1] = np.arange(16)
    return {"i": i, "x": rng.standard_normal((8, 16)).astype(np.float32),
            "y": np.full((48, 16), np.nan, np.float32), "m": np.zeros((8, 16), np.bool_)}


def _constants_want():
    inp = _constants_inputs()
    v, t = inp["i"], inp["x"]
    d = v.astype(np.float64)
    with np.errstate(all="ignore"):
        y = np.concatenate([d * 0.1, d * (-math.log(10000.0) / 16), d * 1e39 + np.where(v > 0, 1e-50, 0.0),
                            np.where(v > 2, t, np.float32(-np.inf)) + np.where(v > 9, np.float32(-np.inf), 0),
                            t, np.where(v > 5, np.float32(1e-40), t)]).astype(np.float32)
    return y, v < 16777216.5


def test_python_float_constants_mean_numpys_values():
    res = tl.simulate(python_float_constants, 1, [_constants_inputs()])[0]
    y, m = _constants_want()
    np.testing.assert_array_equal(res["y"], y)
    np.testing.assert_array_equal(res["m"], m)
    assert m[0, 0] and y[16, 3] == 0            # 0 * 1e39 is 0, not the NaN of 0 * inf


def _constants_ir():
    S = tl.TensorSpec
    return python_float_constants.trace(1, S((8, 16), tl.int32), S((8, 16), tl.float32), S((48, 16), tl.float32),
                                        S((8, 16), tl.bool_))


@pytest.mark.skipif(shutil.which("g++") is None, reason="the generated code runs on CPU threads through g++")
def test_the_generated_code_computes_with_the_constants_numpy_uses(tmp_path):
    """The generated code wrote every Python float as an f32 decimal: ``(double)(0.1f)`` beside an
    i32 tile (~17% of ``i * 0.1`` one ulp off, ``i < 16777216.5`` false at 16777216, ``0 * 1e+39f``
    NaN), and the decimal of an f32 tie, which the compiler rounds the other way."""
    ir = _constants_ir()
    got = emulate(ir, lower(ir, "part"), _constants_inputs(), tmp_path)
    want = tl.simulate(python_float_constants, 1, [_constants_inputs()])[0]
    np.testing.assert_array_equal(got["y"], want["y"])
    np.testing.assert_array_equal(got["m"], want["m"])


@pytest.mark.nvrtc
def test_float_constants_outside_f32s_range_compile(tmp_path):
    """``-1e+100f`` (a softmax's mask), ``1e+39f`` and ``1e-50f`` were NVRTC errors ("floating
    constant is out of range") from a program tl.simulate ran."""
    from tldsl.codegen import toolchain as tcm
    from tldsl.codegen.toolchain.cache import KernelCache
    from tldsl.codegen.toolchain.compiler import compile_many
    ok, why = tcm.toolchain_available()
    if not ok:
        pytest.skip(f"CUDA wheels missing (NVRTC compile tests): {why}")
    lk = lower(_constants_ir(), "part")
    compile_many([lk.job()], cache=KernelCache(tmp_path), progress=False)
    assert "e+100" not in lk.source and "e+39f" not in lk.source and "e-50f" not in lk.source


def _f32_nearest(d) -> np.float32:
    """The float nearest the exact rational ``d`` (ties to even), as a compiler reads a decimal."""
    from fractions import Fraction
    c = np.float32(float(d))
    with np.errstate(over="ignore"):
        cands = [c, np.nextafter(c, np.float32(-np.inf)), np.nextafter(c, np.float32(np.inf))]
    cands = [f for f in cands if np.isfinite(f)]
    return min(cands, key=lambda f: (abs(Fraction(float(f)) - d), int(f.view(np.uint32)) & 1))


def test_float_literals_are_exact():
    """c_literal: the float nearest a Python float, however a compiler reads it (directly, or through
    the nearest double); c_double_literal: the double itself."""
    from fractions import Fraction
    from tldsl.codegen.rules.scalars import c_double_literal, c_literal
    assert c_literal(-1e100) == "__int_as_float(0xff800000)" and c_literal(1e39) == "__int_as_float(0x7f800000)"
    assert (c_literal(1e-50), c_literal(-1e-50), c_literal(0.1), c_literal(1 + 2 ** -24)) == \
        ("0.0f", "-0.0f", "0.1f", "1.0f")
    assert c_literal(float(np.float32(1 / 3))) == "0.3333333432674408f"      # an f32 value: as it always was
    assert c_literal(-1e-40) == "-0x1.16c2p-133f" and c_literal(2.0 ** -149) == "0x1p-149f"
    assert (c_double_literal(0.1), c_double_literal(-1e100), c_double_literal(5e-324)) == ("0.1", "-1e+100", "0x1p-1074")
    assert c_double_literal(float("-inf")) == "(double)(__int_as_float(0xff800000))"
    rng = np.random.default_rng(0)
    vals = list(rng.standard_normal(300) * 10.0 ** rng.integers(-50, 50, 300))
    vals += [float(np.float32(v)) + s * 2.0 ** (np.frexp(np.float32(v))[1] - 25)       # f32 ties, and beside them
             for v in rng.standard_normal(200) for s in (1, 1 + 2 ** -30, 1 - 2 ** -30)]
    vals += [3.4028235677973366e38, 3.4028235e38, 1.1754942e-38, 1.1754943e-38, 7e-46, 8e-46]
    for v in vals:
        with np.errstate(over="ignore"):
            want = np.float32(v)
        lit = c_literal(v)
        if not np.isfinite(want):
            assert lit == ("__int_as_float(0x7f800000)" if want > 0 else "__int_as_float(0xff800000)"), (v, lit)
            continue
        s = lit[:-1]
        exact = Fraction(float.fromhex(s)) if "0x" in s else Fraction(s)
        assert _f32_nearest(exact) == want and np.float32(float.fromhex(s) if "0x" in s else float(s)) == want, (v, lit)
        assert lit.startswith("-") == bool(np.signbit(want)), (v, lit)                # -0.0f where it underflows
        d = c_double_literal(v)
        assert (float.fromhex(d) if "0x" in d else float(d)) == v, (v, d)


@pytest.mark.parametrize("value", [0.1, -0.0, 1e100, -1e-40, 3.0, float("nan")])
def test_a_float_constant_survives_pickle_and_copy(value):
    """Found by a helper's round: pickling a FloatConstant (a str subclass) rebuilt it from its C++
    text, which ``float`` refuses ("0.1f"): a ValueError. The value and the text now round-trip."""
    import copy
    import pickle
    from tldsl.codegen.rules.scalars import FloatConstant
    const = FloatConstant(value)
    copies = [pickle.loads(pickle.dumps(const, protocol)) for protocol in range(pickle.HIGHEST_PROTOCOL + 1)]
    for got in copies + [copy.copy(const), copy.deepcopy(const)]:
        assert type(got) is FloatConstant and got == const and str(got) == str(const)
        assert got.value == value or (math.isnan(got.value) and math.isnan(value))
        assert math.copysign(1.0, got.value) == math.copysign(1.0, value)          # -0.0 stays -0.0


# -- tl.sum of -0s (numpy's starts from +0) --------------------------------------------------------------

@tl.kernel
def signed_zero_sums(x, h, w, r, y, *, compute: tl.ComputeSchedule = None):
    """1 / tl.sum of rows and columns of -0s (and of rows with some +0, a NaN, cancelling terms): by
    lanes of a warp an output (x's rows and columns, an f16 tile's rows), by warps an output (w's long
    rows), a row held in registers (r, plus its sum: -0 + +0 is +0)."""
    @tl.compute_part(grid=(1,))
    def part(p):
        t = tl.load(x, (0, 0), (8, 16))
        tl.store(y, (0, 0), tl.expand_dims(1.0 / tl.sum(t, 1), 0))
        tl.store(y, (1, 0), tl.expand_dims(1.0 / tl.sum(t, 0), 0))
        tl.store(y, (2, 0), tl.expand_dims(1.0 / tl.cast(tl.sum(tl.load(h, (0, 0), (8, 16)), 1), tl.float32), 0))
        tl.store(y, (3, 0), tl.expand_dims(1.0 / tl.sum(tl.load(w, (0, 0), (2, 2048)), 1), 0))
        v = tl.load(r, (0, 0), (1, 1024))
        tl.store(r, (0, 0), v + tl.expand_dims(tl.sum(v, 1), 1))


def _zero_sums_inputs():
    x = np.full((8, 16), -0.0, np.float32)
    x[1, 3], x[2, :8], x[3, :2], x[4, 9] = 0.0, 1.0, (-1.0, 1.0), np.nan
    return {"x": x, "h": x.astype(np.float16), "w": np.full((2, 2048), -0.0, np.float32),
            "r": np.full((1, 1024), -0.0, np.float32), "y": np.full((4, 16), np.nan, np.float32)}


def _zero_sums_want():
    """numpy's sums (their zeros +0, as numpy 2's add.reduce gives them), reciprocated."""
    x = _zero_sums_inputs()["x"]
    y = np.full((4, 16), np.nan, np.float32)
    with np.errstate(divide="ignore"):
        y[0, :8] = y[2, :8] = 1 / (x.sum(1) + np.float32(0))
        y[1] = 1 / (x.sum(0) + np.float32(0))
    y[3, :2] = np.inf
    assert list(y[0, :4]) == [np.inf, np.inf, 1 / 8, np.inf] and y[1, 0] == np.inf and y[1, 1] == 0.5
    return y, np.zeros((1, 1024), np.float32)


def test_a_sum_of_negative_zeros_is_positive_zero_as_numpys():
    y, r = _zero_sums_want()
    res = tl.simulate(signed_zero_sums, 1, [_zero_sums_inputs()])[0]
    np.testing.assert_array_equal(res["y"], y)
    assert not np.signbit(res["r"]).any() and not res["r"].any()


@pytest.mark.skipif(shutil.which("g++") is None, reason="the generated code runs on CPU threads through g++")
def test_the_generated_code_sums_negative_zeros_to_positive_zero(tmp_path):
    """The generated sums started from the first element (or -0.0f) and gave -0 (IEEE: -0 + -0 is
    -0), so 1 / tl.sum(...) was -inf where the simulator's (numpy's) is +inf."""
    S = tl.TensorSpec
    inp = _zero_sums_inputs()
    ir = signed_zero_sums.trace(1, S((8, 16), tl.float32), S((8, 16), tl.float16), S((2, 2048), tl.float32),
                                S((1, 1024), tl.float32), S((4, 16), tl.float32))
    lk = lower(ir, "part")
    for path in ("lanes an output", "warps an output", "over the row in registers", "over the rows' chunks"):
        assert path in lk.source, path              # every way a reduction is lowered
    got = emulate(ir, lk, inp, tmp_path)
    y, r = _zero_sums_want()
    np.testing.assert_array_equal(got["y"], y)
    assert not np.signbit(got["r"]).any() and not got["r"].any()


@pytest.mark.parametrize("axis, message", [
    (1.0, "tl.sum's axis must be an int (the axis of the 2-d tile to reduce along), got float 1.0: write tl.sum(t, 1)"),
    (True, "tl.sum's axis must be an int (the axis of the 2-d tile to reduce along), got bool True"),
    (np.float64(0), "got float64 np.float64(0.0): write tl.sum(t, 0)"),
    ((0, 1), "got tuple"),
])
def test_a_reduction_axis_that_is_no_int_is_refused_at_its_line(axis, message):
    """tl.sum(t, 1.0) said 'axis 1.0 out of range' (it is in range: it is no int); tl.sum(t, True)
    reduced along axis 1."""
    @tl.kernel
    def k(x, y):
        @tl.compute_part(grid=(1,))
        def part(p):
            tl.store(y, (0,), tl.sum(tl.load(x, (0, 0), (8, 8)), axis))
    with pytest.raises(tl.CompilationError, match=re.escape(message)) as e:
        k.trace(1, tl.TensorSpec((8, 8), tl.float32), tl.TensorSpec((8,), tl.float32))
    assert "test_semantics_regressions.py" in str(e.value)
