"""The GPU comparison's tolerances (``tldsl.testing.program_tolerance``; issue 18 item 4): per
output element, from the magnitudes that flow into it, tight enough that any single wrong element
fails, loose enough for the GPU's legitimate differences (modelled here, without a GPU, by
``simulate_like_gpu``: TF32 dot operands, random summation orders, unrounded fp16/bf16
intermediates, math functions off by their ulps).

The programs: a sample of the fuzzer's and test_codegen_general's. With the tolerances these
replaced (one per dtype, times the output's largest magnitude), about one in ten zeroed elements
of the same sample passed the comparison.
"""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl
from tldsl.testing.program_case import FuzzCase
from tldsl.testing.program_families import generate_distinct
from tldsl.testing.program_tolerance import (ACCUMULATE_ULPS, SAFETY, TOLERANCES, compare, mismatches,
                                             reference_with_tolerances, round_tf32, simulate_like_gpu, worst_ratio)

import test_codegen_general as general

S = tl.TensorSpec
#: the fuzzer's programs sampled (a seed of their own) and test_codegen_general's cases
FUZZ_SEED, FUZZ_PROGRAMS = 4242, 16
GENERAL_CASES = [p.id for p in general.CASES]


def _fuzz_sample():
    for i, program in generate_distinct(FUZZ_PROGRAMS, FUZZ_SEED):
        case = FuzzCase(program, f"fuzz seed {FUZZ_SEED} program {i}")
        yield case.label, case.trace(), case.world_size, case.inputs, case.outputs, {}


def _general_sample():
    for p in general.CASES:
        fn, shapes, tile, kw = p.values
        k = general.trace(fn, shapes, tile, kw)
        yield p.id, k, 1, [general.inputs_for(k, np.random.default_rng(7))], [b.name for b in k.args], {}


@pytest.fixture(scope="module")
def sample():
    """(label, kernel, W, inputs, outputs, reference, tolerances) of every program sampled."""
    out = []
    for label, kernel, W, inputs, outputs, kw in [*_fuzz_sample(), *_general_sample()]:
        ref, tols = reference_with_tolerances(kernel, W, inputs, **kw)
        out.append((label, kernel, W, inputs, outputs, ref, tols))
    return out


def _dtype_of(kernel, name):
    return next(b.type.dtype.name for b in [*kernel.args, *kernel.workspaces] if b.name == name)


def _beyond(want, tol, dtype, sign):
    """``want`` moved by ``tol`` and then a few ulps of ``dtype`` further, as stored in ``dtype``."""
    w = float(want)
    if dtype == "i32":
        v = w + sign * (np.floor(tol) + 1)
        return np.int32(v if -2 ** 31 <= v < 2 ** 31 else w - sign * (np.floor(tol) + 1))
    from tldsl.runtime.sim.memory import to_storage
    from tldsl.ir.types import bfloat16, float16, float32
    dt = {"f16": float16, "bf16": bfloat16, "f32": float32}[dtype]
    step = 3 * TOLERANCES[dtype].ulp * abs(w) + TOLERANCES[dtype].floor
    v = to_storage(np.array([w + sign * (tol + step)]), dt)
    while abs(float(v[0]) - w) <= tol:             # rounding to the dtype came back inside: one more step
        step *= 2
        v = to_storage(np.array([w + sign * (tol + step)]), dt)
    return v[0]


def test_any_single_wrong_output_element_fails(sample):
    """Zero one element, or move it a few ulps beyond its tolerance: the comparison fails, for
    every element tried (up to 16 of every output of every rank, never one that is 0 already).
    The only zeroed elements that pass are ones whose correct value is itself within its
    tolerance of 0: a value that cancelled to almost nothing next to what flowed into it (a
    product of two TF32 dots' results, say); at most one in 200, each listed on failure."""
    rng = np.random.default_rng(0)
    tried, near_zero = 0, []
    for label, kernel, W, _, outputs, ref, tols in sample:
        for r in range(W):
            for name in outputs:
                want, tol = ref.outputs[r][name], tols[r][name]
                dtype = _dtype_of(ref.kernel, name)
                flat = np.flatnonzero(np.isfinite(want.astype(np.float64)) & (want != 0))
                for i in rng.choice(flat, min(16, flat.size), replace=False):
                    tried += 1
                    w, t = want.reshape(-1)[i], tol.reshape(-1)[i]
                    got = want.copy()
                    got.reshape(-1)[i] = 0
                    if compare(got, want, tol) is None:
                        assert abs(float(w)) <= t
                        near_zero.append(f"{label} rank {r} '{name}'[{i}]: {float(w):.4g} (tolerance {t:.3g})")
                    for sign in (1, -1):
                        got = want.copy()
                        got.reshape(-1)[i] = _beyond(w, t, dtype, sign)
                        assert compare(got, want, tol) is not None, (label, name, i, float(w), t)
    assert tried > 1200
    assert len(near_zero) <= tried / 200, "\n".join(near_zero)


def test_the_gpus_legitimate_differences_pass_with_room(sample):
    """The simulator with the GPU's legitimate differences (two random draws each) stays within
    half of every element's tolerance; and those differences are there to be accepted (the
    model is not the simulator itself)."""
    moved = 0
    for label, kernel, W, inputs, outputs, ref, tols in sample:
        for seed in (0, 1):
            got = simulate_like_gpu(kernel, W, inputs, seed=seed)
            for r in range(W):
                for name in outputs:
                    ratio = worst_ratio(got.outputs[r][name], ref.outputs[r][name], tols[r][name])
                    assert ratio <= 1 / SAFETY, f"{label} (seed {seed}) rank {r} '{name}': {ratio:.3g} x tolerance"
                    moved += not np.array_equal(got.outputs[r][name], ref.outputs[r][name], equal_nan=True)
    assert moved >= len(sample) // 2


@tl.kernel
def _dot(a, b, c, *, compute: tl.ComputeSchedule = None):
    M, K = a.shape

    @tl.compute_part(grid=(1,))
    def part(p):
        tl.store(c, (0, 0), tl.dot(tl.load(a, (0, 0), (M, K)), tl.load(b, (0, 0), (K, c.shape[1]))))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_a_dots_tolerance_comes_from_its_row_its_column_and_k(dtype):
    """Element (i, j) of ``A @ B`` may differ by SAFETY x (TF32's rounding of both operands,
    for f32 only, plus ACCUMULATE_ULPS per addition) x (|A| @ |B|)[i, j]: its own row and column,
    not the output's largest value. A row scaled by 1000 leaves the others' tolerances alone."""
    rng = np.random.default_rng(3)
    M, K, N = 16, 32, 8
    a = rng.standard_normal((M, K)).astype(np.float32)
    a[0] *= 1000
    b = rng.standard_normal((K, N)).astype(np.float32)
    npd = np.float16 if dtype == "f16" else np.float32
    a, b = a.astype(npd), b.astype(npd)
    dt = getattr(tl, {"f16": "float16", "f32": "float32"}[dtype])
    k = _dot.trace(1, S((M, K), dt), S((K, N), dt), S((M, N), tl.float32), compute=tl.ComputeSchedule(tile=(16, 16, 16)))
    ref, tols = reference_with_tolerances(k, 1, [{"a": a, "b": b, "c": np.zeros((M, N), np.float32)}])
    rel = 2 * TOLERANCES[dtype].dot_operand + ACCUMULATE_ULPS * K * TOLERANCES["f32"].ulp
    magnitude = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    assert np.allclose(tols[0]["c"], SAFETY * rel * magnitude + TOLERANCES["f32"].floor, rtol=1e-6)
    assert (TOLERANCES["f32"].dot_operand == 2.0 ** -11) and TOLERANCES["f16"].dot_operand == 0
    assert tols[0]["c"][0].min() > 100 * tols[0]["c"][1:].max()
    floor = TOLERANCES[dtype].floor                                   # inputs: exact (to the subnormal)
    assert (tols[0]["a"] == floor).all() and (tols[0]["b"] == floor).all()
    if dtype == "f32":                                                 # TF32 products are what it allows
        tf32 = round_tf32(a).astype(np.float64) @ round_tf32(b).astype(np.float64)
        assert compare(tf32, ref.outputs[0]["c"], tols[0]["c"]) is None
        assert compare(tf32, ref.outputs[0]["c"], tols[0]["c"] / 20) is not None


@tl.kernel
def _triple(x, y, *, compute: tl.ComputeSchedule = None):
    M, N = x.shape

    @tl.compute_part(grid=(1,))
    def part(p):
        tl.store(y, (0, 0), tl.load(x, (0, 0), (M, N)) * 3.0)


def test_a_small_element_next_to_a_large_one_is_checked():
    """Elementwise f32 math is exact here on both sides: each element within a few ulps of its
    own value. Zeroing the 3e-3 next to a 3e4 fails (it passed when the tolerance was a fraction
    of the output's largest magnitude)."""
    x = np.array([[1e4, 1e-3, -2.0, 0.5]], np.float32)
    k = _triple.trace(1, S((1, 4), tl.float32), S((1, 4), tl.float32), compute=tl.ComputeSchedule(tile=(8, 8, 8)))
    ref, tols = reference_with_tolerances(k, 1, [{"x": x, "y": np.zeros_like(x)}])
    want = ref.outputs[0]["y"]
    assert (tols[0]["y"] <= 4 * TOLERANCES["f32"].ulp * np.abs(want)).all()
    got = want.copy()
    got[0, 1] = 0
    assert "1 of 4 elements differ; first at (0, 1)" in compare(got, want, tols[0]["y"])


def test_nan_and_infinities_must_be_at_the_same_places():
    want = np.array([1.0, np.nan, np.inf, -np.inf], np.float32)
    tol = np.full(4, 10.0)
    assert compare(want.copy(), want, tol) is None
    for i, v in [(1, 0.0), (2, -np.inf), (3, np.nan), (0, np.nan), (0, np.inf)]:
        got = want.copy()
        got[i] = v
        assert compare(got, want, tol) is not None, (i, v)
    assert "shape" in compare(want[:2], want, tol)


def test_an_i32_output_is_exact_where_no_float_error_reaches_it(sample):
    ints = [(label, tols[r][name]) for label, _, W, _, outputs, ref, tols in sample for r in range(W)
            for name in outputs if _dtype_of(ref.kernel, name) == "i32"]
    assert ints and all(not tol.any() for _, tol in ints), [label for label, tol in ints if tol.any()]
    want = np.array([3, 5], np.int32)
    assert compare(np.array([3, 4], np.int32), want, np.zeros(2)) is not None
    assert mismatches([{"y": want}], [{"y": want}], [{"y": np.zeros(2)}], ["y"]) == []
