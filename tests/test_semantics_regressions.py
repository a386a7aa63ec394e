"""Where the simulator and the generated code once meant different things (found by review):
a negative ``tl.expand_dims`` axis (numpy's: counted from the end of the result) and ``&`` /
``|`` on integer scalars and tiles (Python's and numpy's: bitwise, an integer). Each is checked in the simulator
against numpy / Python, and in the general recipe's generated code run on CPU threads."""
from __future__ import annotations

import functools

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
