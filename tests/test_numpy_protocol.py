"""numpy's functions on traced values: a ufunc with a tile-language twin traces as the twin (the
same IR as the tl spelling, so it simulates, lowers and runs as that does); everything else numpy
would do with a tile is a CompilationError at the user's line that says what to write — never the
silently wrong ``np.sum(t) is t`` or numpy's TypeError about loops."""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

import tldsl as tl

F8 = tl.TensorSpec((8,), tl.float32)


def _kernel(body):
    @tl.kernel
    def k(x, y):
        @tl.compute_part(grid=(1,))
        def p(t):
            acc = tl.fragment((8,), tl.float32, fill=0.5)
            tl.store(y, (0,), body(tl.load(x, (0,), (8,)), acc, t))
    return k


def _ir(body) -> str:
    """The traced kernel's text without its source locations and name."""
    text = str(_kernel(body).trace(1, F8, F8))
    return re.sub(r"\s*//.*", "", text).replace("@k", "@_")


@pytest.mark.parametrize("with_numpy,with_tl", [
    (lambda a, f, t: np.exp(a), lambda a, f, t: tl.exp(a)),
    (lambda a, f, t: np.exp2(np.sqrt(a)), lambda a, f, t: tl.exp2(tl.sqrt(a))),
    (lambda a, f, t: np.log(np.abs(a) + 1), lambda a, f, t: tl.log(abs(a) + 1)),
    (lambda a, f, t: np.tanh(-a), lambda a, f, t: tl.tanh(-a)),
    (lambda a, f, t: np.maximum(a, 0.0) + np.minimum(f, a), lambda a, f, t: tl.maximum(a, 0.0) + tl.minimum(f, a)),
    (lambda a, f, t: np.float32(2) * a - np.float32(1), lambda a, f, t: 2.0 * a - 1.0),
    (lambda a, f, t: np.multiply(t, a) / np.add(a, 3), lambda a, f, t: t * a / (a + 3)),
    (lambda a, f, t: tl.where(np.less(np.float32(1), a) | np.equal(a, f), a, f),
     lambda a, f, t: tl.where((a > 1) | (a == f), a, f)),
    (lambda a, f, t: np.remainder(a, 3) + np.floor_divide(a, 2) + np.exp(f), lambda a, f, t: a % 3 + a // 2 + tl.exp(f)),
    (lambda a, f, t: np.array(2.0) * a + a * np.array(3.0), lambda a, f, t: 2.0 * a + a * 3.0),
])
def test_a_ufunc_with_a_twin_traces_as_the_twin(with_numpy, with_tl):
    assert _ir(with_numpy) == _ir(with_tl)


def test_numpy_ufuncs_simulate_to_numpys_values():
    x = np.array([0.5, 1, 2, 3, -1, 4, 0.25, 8], np.float32)
    r = tl.simulate(_kernel(lambda a, f, t: np.maximum(np.exp(a) - np.float32(2), f)), 1,
                    [{"x": x, "y": np.full(8, np.nan, np.float32)}])
    np.testing.assert_allclose(r[0]["y"], np.maximum(np.exp(x) - 2, 0.5), rtol=1e-6)


def test_the_same_program_lowers_and_compiles():
    pytest.importorskip("cuda.bindings")
    from tldsl.codegen import lower
    k = _kernel(lambda a, f, t: np.maximum(np.exp(a), f) * np.float32(0.5)).trace(1, F8, F8)
    assert lower(k, "p").compile().cubin


def _refused(body, match):
    with pytest.raises(tl.CompilationError, match=match) as e:
        _kernel(body).trace(1, F8, F8)
    return e.value


@pytest.mark.parametrize("body,match", [
    (lambda a, f, t: np.sum(a), r"np\.sum on a traced value: write tl\.sum\(x, axis\)"),
    (lambda a, f, t: np.where(a > 0, a, f), r"np\.where on a traced value: write tl\.where\(mask, a, b\)"),
    (lambda a, f, t: np.dot(a, a), r"np\.dot .*tl\.dot\(a, b\)"),
    (lambda a, f, t: np.add.reduce(a), r"add\.reduce on a traced value: write tl\.sum"),
    (lambda a, f, t: np.power(a, 2), r"numpy's power on a traced value is not in the tile language: write the product"),
    (lambda a, f, t: np.sin(a), r"numpy's sin on a traced value is not in the tile language: the tile language's"),
    (lambda a, f, t: np.exp(a, dtype=np.float32), r"numpy's exp\(dtype=\.\.\.\) on a traced value"),
    (lambda a, f, t: np.ones(8, np.float32) * a, r"numpy's multiply of a traced value and a numpy array of shape \(8,\)"),
    (lambda a, f, t: np.asarray(a), r"numpy cannot make an array or a numpy number of a Tile"),
    (lambda a, f, t: a * np.float32(t), r"numpy cannot make an array or a numpy number of a Scalar"),
    (lambda a, f, t: np.array([1.0]) + f, r"numpy array of shape \(1,\)"),
    (lambda a, f, t: a + np.ones(8, np.float32), r"'add' of a tile and a numpy array of shape \(8,\)"),
    (lambda a, f, t: a * math.exp(a), r"a Tile is not a Python number"),
    (lambda a, f, t: a * float(f), r"a Fragment is not a Python number"),
    (lambda a, f, t: [1, 2][a], r"a Tile is not a Python number"),
    (lambda a, f, t: np.add(a, "x"), r"numpy's add of a traced value and a str"),
    (lambda a, f, t: a.sum(axis=0), r"a Tile has no \.sum \(it is no numpy array\): write tl\.sum\(t, axis\)"),
    (lambda a, f, t: f.astype(np.float16), r"a Fragment has no \.astype .*: write tl\.cast\(t, dtype\)"),
    (lambda a, f, t: a.item(), r"a Tile has no \.item .*a traced tile has no values while tracing"),
    (lambda a, f, t: divmod(a, 2)[0], r"divmod\(\) of tiles: write a // b and a % b"),
    (lambda a, f, t: divmod(f, 2)[0], r"divmod\(\) of tiles"),
])
def test_what_numpy_cannot_trace_is_refused_at_the_users_line(body, match):
    err = _refused(body, match)
    assert err.loc is not None and err.loc.filename == __file__, err.loc


def test_numpy_bools_and_numbers_are_operands():
    a = _ir(lambda a, f, t: tl.cast((a > 0) & np.bool_(True), tl.float32) * np.int64(2))
    b = _ir(lambda a, f, t: tl.cast((a > 0) & True, tl.float32) * 2)
    assert a == b


def test_other_missing_attributes_stay_attribute_errors():
    """Only numpy's array methods are CompilationErrors: other names (and the dunders numpy and
    Python probe with getattr) are the usual AttributeError."""
    seen = {}

    def probe(a, f, t):
        seen["interface"] = hasattr(a, "__array_interface__") or hasattr(f, "__array_struct__")
        with pytest.raises(AttributeError, match="'Tile' object has no attribute 'colour'"):
            a.colour
        return a

    _kernel(probe).trace(1, F8, F8)
    assert seen == {"interface": False}


@tl.kernel
def promoted(x, f, i):
    @tl.compute_part(grid=(1,))
    def p(t):
        a = tl.load(x, (0,), (8,))
        ia = tl.iota(8)
        m = a > 0
        tl.store(f, (0,), np.float32(0.5) * ia + ia * np.float16(0.25) + m * np.float32(2.5)
                 + np.maximum(ia, np.float32(0.5)) + tl.where(m, ia, np.float32(0.5)) + np.array(0.5, np.float32) + ia)
        tl.store(f, (8,), tl.where(m, t, np.float32(0.5)) + a)
        tl.store(i, (0,), (m + 1) * 10 + tl.cast(m == 2, tl.int32) + np.maximum(m, 2) + tl.where(m, True, False) * 3
                 + tl.full((8,), np.bool_(True) & (t >= 0), tl.int32))


def test_numbers_take_numpys_types_beside_integer_and_bool_tiles():
    """A float number (numpy's float32 or float16 too) beside an integer or bool tile makes floats,
    an int beside a bool tile makes ints — as numpy computes; before, ``np.float32(0.5) * iota``
    truncated to integers and ``mask + 1`` stayed a mask."""
    x = np.array([-1, 2, 0, 3, -4, 5, 6, -7], np.float32)
    r = tl.simulate(promoted, 1, [{"x": x, "f": np.full(16, np.nan, np.float32), "i": np.full(8, -99, np.int32)}])[0]
    ia, m = np.arange(8), x > 0
    want_f = (np.float32(0.5) * ia + ia * np.float16(0.25) + m * np.float32(2.5) + np.maximum(ia, np.float32(0.5))
              + np.where(m, ia, np.float32(0.5)) + np.float32(0.5) + ia)
    np.testing.assert_allclose(r["f"][:8], want_f, rtol=1e-6)
    np.testing.assert_allclose(r["f"][8:], np.where(m, 0, 0.5) + x, rtol=1e-6)
    want_i = (m + 1) * 10 + (m == 2) + np.maximum(m, 2) + np.where(m, True, False) * 3 + (True & (0 >= 0))
    np.testing.assert_array_equal(r["i"], want_i)
    pytest.importorskip("cuda.bindings")
    from tldsl.codegen import lower
    k = promoted.trace(1, F8, tl.TensorSpec((16,), tl.float32), tl.TensorSpec((8,), tl.int32))
    assert lower(k, "p").compile().cubin


def test_shape_queries_are_answered_and_probing_is_no_error():
    seen = {}

    def body(a, f, t):
        seen.update(shape=np.shape(a), ndim=np.ndim(f), size=np.size(a), has_sum=hasattr(a, "sum"),
                    has_numpy=hasattr(f, "numpy"))
        return a

    _kernel(body).trace(1, F8, F8)
    assert seen == {"shape": (8,), "ndim": 1, "size": 8, "has_sum": False, "has_numpy": False}


@pytest.mark.parametrize("body,match", [
    (lambda a, f, t: np.testing.assert_allclose(a, a), r"numpy cannot make an array"),
    (lambda a, f, t: np.vectorize(lambda v: v)(a), r"numpy cannot make an array"),
    (lambda a, f, t: np.emath.sqrt(a), r"np\.emath\.sqrt on a traced value: write tl\.sqrt\(x\)"),
    (lambda a, f, t: np.linalg.norm(a), r"np\.linalg\.norm on a traced value"),
    (lambda a, f, t: a + 1j, r"tiles hold real numbers"),
    (lambda a, f, t: np.complex64(1 + 2j) * a, r"tiles hold real numbers"),
    (lambda a, f, t: a * (t + 1j), r"got the complex number"),
])
def test_refusals_from_inside_numpy_point_at_the_users_line(body, match):
    err = _refused(body, match)
    assert err.loc is not None and err.loc.filename == __file__, err.loc


@tl.kernel
def typed_scalars(h, b, y):
    @tl.compute_part(grid=(1,))
    def p(t):
        th, tb = tl.load(h, (0,), (8,)), tl.load(b, (0,), (8,))
        s = np.float32(1.0009765625) * th               # f32 (numpy 2: numpy scalars keep their type)
        u = th * np.float64(1.0009765625)               # f16 (np.float64 is a Python float: it takes the tile's)
        v = tb * np.float16(1.5)                        # f32 (f16 and bf16 meet in f32)
        assert (s.dtype, u.dtype, v.dtype) == (tl.float32, tl.float16, tl.float32)
        tl.store(y, (0,), s)
        tl.store(y, (8,), u)
        tl.store(y, (16,), v)


def test_numpy_float_scalars_keep_their_type_beside_16_bit_tiles():
    """``np.float32(c) * f16 tile`` is f32, as numpy 2 computes it (it was f16: c rounded to f16 and
    the product too); an np.float64, like a Python float, takes the tile's type."""
    torch = pytest.importorskip("torch")
    h = np.array([0.3, -1.7, 2.5, 100.1, -0.01, 7, 0, 1], np.float16)
    b = torch.tensor([0.3, -1.7, 2.5, 100.1, -0.01, 7, 0, 1], dtype=torch.bfloat16)
    r = tl.simulate(typed_scalars, 1, [{"h": h, "b": b, "y": np.full(24, np.nan, np.float32)}])[0]
    np.testing.assert_array_equal(r["y"][:8], np.float32(1.0009765625) * h)
    np.testing.assert_array_equal(r["y"][8:16], (h * np.float16(1.0009765625)).astype(np.float32))
    np.testing.assert_array_equal(r["y"][16:], b.float().numpy() * np.float32(1.5))
    pytest.importorskip("cuda.bindings")
    from tldsl.codegen import lower
    k = typed_scalars.trace(1, tl.TensorSpec((8,), tl.float16), tl.TensorSpec((8,), tl.bfloat16), tl.TensorSpec((24,), tl.float32))
    assert lower(k, "p").compile().cubin


@tl.kernel
def python_floats(h, b, y):
    @tl.compute_part(grid=(1,))
    def p(t):
        th, tb = tl.load(h, (0,), (64,)), tl.load(b, (0,), (64,))
        tl.store(y, (0,), (th * 0.1).to(tl.float32))           # 0.1 rounded to f16 first, as numpy does
        tl.store(y, (64,), (tb * 0.1).to(tl.float32))          # ... to bf16 (ml_dtypes' numpy arrays do)
        tl.store(y, (128,), (th + 1e-4).to(tl.float32))        # 1e-4 is an f16 subnormal neighbour away
        tl.store(y, (192,), tl.where(th > 1.5, th, 70000.0).to(tl.float32))     # past f16's range: inf


def _bf16(a):
    """``a`` rounded to bf16 (nearest even), as float32."""
    from tldsl.runtime.sim.memory import to_storage
    return to_storage(np.asarray(a, np.float32), tl.bfloat16)


def test_python_floats_beside_16_bit_tiles_are_rounded_to_the_tiles_type_first():
    """numpy rounds a Python float to an f16 array's type before the math (NEP 50): ``f16 * 0.1`` is
    ``f16 * f16(0.1)``, not ``f16(f16 * f32(0.1))`` (23 of these 64 elements differed by an ulp).
    The trace rounds the constant, so the simulator and every lowering compute with it."""
    torch = pytest.importorskip("torch")
    h = (1.0 + np.arange(64) / 64).astype(np.float16)
    b = torch.tensor(_bf16(1.0 + np.arange(64) / 37), dtype=torch.bfloat16)
    r = tl.simulate(python_floats, 1, [{"h": h, "b": b, "y": np.full(256, np.nan, np.float32)}])[0]["y"]
    np.testing.assert_array_equal(r[:64], (h * 0.1).astype(np.float32))
    np.testing.assert_array_equal(r[64:128], _bf16(b.float().numpy() * _bf16(0.1)))
    np.testing.assert_array_equal(r[128:192], (h + 1e-4).astype(np.float32))
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(r[192:], np.where(h > 1.5, h, np.float16(70000.0)).astype(np.float32))
    k = python_floats.trace(1, tl.TensorSpec((64,), tl.float16), tl.TensorSpec((64,), tl.bfloat16),
                            tl.TensorSpec((256,), tl.float32))
    consts = sorted(o.attrs["value"] for o in k.parts[0].walk() if o.name == "const" and o.attrs["dtype"].bits == 16)
    assert float(np.float16(0.1)) in consts and float(_bf16(0.1)) in consts and np.inf in consts

