"""The math functions of the language — ``tl.sigmoid``, ``tl.tanh``, ``tl.erf``, ``tl.rsqrt`` —
in the simulator against a float64 reference, for every float dtype (and i32 tiles, which
they turn into f32), plus what they build (SiLU, GELU, RMSNorm's scale)."""
from __future__ import annotations

import math

import numpy as np
import pytest

import tldsl as tl

S = tl.TensorSpec
FNS = {"sigmoid": tl.sigmoid, "tanh": tl.tanh, "erf": tl.erf, "rsqrt": tl.rsqrt}
REF = {"sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)), "tanh": np.tanh,
       "erf": np.vectorize(math.erf, otypes=[np.float64]), "rsqrt": lambda x: 1.0 / np.sqrt(x)}
#: relative tolerance of one rounding to the tile's type (f32: a few ulp of numpy's float32 math)
RTOL = {"f16": 2e-3, "bf16": 1.6e-2, "f32": 2e-6}


@tl.kernel
def apply(x, y, *, compute: tl.ComputeSchedule = None, fn: str = "sigmoid"):
    M, N = x.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        t = tl.load(x, (pm * BM, pn * BN), (BM, BN))
        tl.store(y, (pm * BM, pn * BN), FNS[fn](t))


def _inputs(fn, dtype, shape, rng):
    x = rng.standard_normal(shape) * 3
    if fn == "rsqrt":
        x = np.abs(x) + 1e-2
    x = x.astype(np.float32)
    return x.astype(np.float16) if dtype == tl.float16 else x


@pytest.mark.parametrize("fn", sorted(FNS))
@pytest.mark.parametrize("dtype", [tl.float16, tl.bfloat16, tl.float32], ids=lambda d: d.name)
def test_math_function_matches_numpy(fn, dtype):
    rng = np.random.default_rng(1)
    shape = (20, 36)                                 # not a multiple of the tile
    x = _inputs(fn, dtype, shape, rng)
    k = apply.trace(1, S(shape, dtype), S(shape, dtype), compute=tl.ComputeSchedule(tile=(16, 16, 16)), fn=fn)
    out = np.zeros(shape, np.float16 if dtype == tl.float16 else np.float32)
    got = tl.simulate(k, 1, [[x, out]])[0]["y"].astype(np.float64)
    x64 = x.astype(np.float64)
    if dtype == tl.bfloat16:       # the simulator stores bf16 inputs rounded (to nearest even)
        bits = x.astype(np.float32).view(np.uint32)
        x64 = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32).astype(np.float64)
    want = REF[fn](x64)
    np.testing.assert_allclose(got, want, rtol=RTOL[dtype.name], atol=RTOL[dtype.name] * 1e-3)


def test_math_functions_edges():
    """NaN stays NaN; sigmoid saturates to 0 and 1 without overflow errors; rsqrt is inf at 0 and
    NaN below; erf and tanh reach +-1."""
    x = np.array([[np.nan, -200.0, 200.0, 0.0, -1.0, 1e-3, 30.0, -30.0]], np.float32)
    got = {}
    for fn in FNS:
        res = tl.simulate(apply, 1, [[x, np.zeros_like(x)]], compute=tl.ComputeSchedule(tile=(8, 8, 8)), fn=fn)
        got[fn] = res[0]["y"][0]
    assert all(np.isnan(v[0]) for v in got.values())
    assert got["sigmoid"][1] == 0.0 and got["sigmoid"][2] == 1.0 and got["sigmoid"][3] == 0.5
    assert got["tanh"][6] == 1.0 and got["tanh"][7] == -1.0 and got["erf"][6] == 1.0 and got["erf"][7] == -1.0
    assert got["rsqrt"][3] == np.inf and np.isnan(got["rsqrt"][4])
    assert got["rsqrt"][5] == np.float32(1.0) / np.sqrt(np.float32(1e-3))


def test_math_of_an_int_tile_is_f32():
    @tl.kernel
    def int_math(x, y, *, compute: tl.ComputeSchedule = None):
        @tl.compute_part(grid=(1,))
        def part(p):
            t = tl.load(x, (0,), (8,))
            tl.store(y, (0,), tl.sigmoid(t) + tl.rsqrt(t) + tl.tanh(t) + tl.erf(t))
    x = np.arange(1, 9, dtype=np.int32)
    k = int_math.trace(1, S((8,), tl.int32), S((8,), tl.float32), compute=tl.ComputeSchedule(tile=(8, 8, 8)))
    op_types = {str(op.result.type) for op in k.parts[0].walk() if op.name == "ewise"}
    assert op_types == {"tile<8xf32, reg>"}
    res = tl.simulate(k, 1, [[x, np.zeros(8, np.float32)]])
    x64 = x.astype(np.float64)
    want = sum(REF[f](x64) for f in ("sigmoid", "rsqrt", "tanh", "erf"))
    np.testing.assert_allclose(res[0]["y"], want, rtol=1e-6)


def test_silu_gelu_and_rmsnorm_scale_in_the_simulator():
    """What the functions are for: a SiLU-gated product, exact GELU, and RMSNorm's row scale."""
    @tl.kernel
    def blocks(x, silu, gelu, norm, *, compute: tl.ComputeSchedule = None):
        M, N = x.shape

        @tl.compute_part(grid=(1,))
        def part(p):
            t = tl.load(x, (0, 0), (M, N))
            tl.store(silu, (0, 0), t * tl.sigmoid(t))
            tl.store(gelu, (0, 0), 0.5 * t * (1.0 + tl.erf(t * 0.7071067811865476)))
            ms = tl.sum(t * t, 1) / N
            tl.store(norm, (0, 0), t * tl.rsqrt(ms + 1e-6)[:, None])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    z = np.zeros_like(x)
    res = tl.simulate(blocks, 1, [[x, z, z, z]], compute=tl.ComputeSchedule(tile=(8, 32, 32)))
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(res[0]["silu"], x64 / (1 + np.exp(-x64)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res[0]["gelu"], 0.5 * x64 * (1 + REF["erf"](x64 / math.sqrt(2))), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(res[0]["norm"], x64 / np.sqrt((x64 ** 2).mean(1, keepdims=True) + 1e-6), rtol=1e-5)
