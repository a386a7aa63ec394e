"""The programs ``python -m tldsl.bench general`` times are what the issue asks to time: plain tile
programs that simulate to numpy's results, go through the general lowering (no recipe), and
compile to kernels with every dot on tensor cores and no spills."""
from __future__ import annotations

import re

import numpy as np
import pytest

import tldsl as tl
from tldsl.bench import general as bench_general
from tldsl.bench import general_programs as gp
from tldsl.codegen import lower
from tldsl.codegen.recipes.general import LoweredGeneral

S = tl.TensorSpec
M, N, K = 37, 300, 70             # rows and columns that are not whole tiles
C = tl.ComputeSchedule(tile=(16, 64, 16))


def _nan(*shape):
    return np.full(shape, np.nan, np.float16)


def _rms(h, w):
    return h / np.sqrt((h ** 2).mean(1, keepdims=True) + 1e-6) * w


def _cases():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, N)).astype(np.float16)
    r = rng.standard_normal((M, N)).astype(np.float16)
    w = rng.standard_normal((1, N)).astype(np.float16)
    a = (rng.standard_normal((M, K)) / 4).astype(np.float16)
    b, c = ((rng.standard_normal((K, N)) / 4).astype(np.float16) for _ in range(2))
    bias = rng.standard_normal((1, N)).astype(np.float16)
    xf, hf = x.astype(np.float64), (x + r).astype(np.float64)
    e = np.exp(xf - xf.max(1, keepdims=True))
    af = a.astype(np.float64)
    return [
        (gp.scale_shift, {"x": x, "y": _nan(M, N)}, {"y": xf * 2 + 1}),
        (gp.row_softmax, {"x": x, "y": _nan(M, N)}, {"y": e / e.sum(1, keepdims=True)}),
        (gp.rms_norm, {"x": x, "w": w, "y": _nan(M, N)}, {"y": _rms(xf, w.astype(np.float64))}),
        (gp.add_rms_norm, {"x": x, "r": r, "w": w, "h": _nan(M, N), "y": _nan(M, N)},
         {"h": (x + r).astype(np.float64), "y": _rms(hf, w.astype(np.float64))}),
        (gp.gated_gemm, {"a": a, "b": b, "bias": bias, "c": c, "out": _nan(M, N)},
         {"out": np.maximum(af @ b + bias, 0) * (af @ c)}),
    ]


@pytest.mark.parametrize("whole_row", [gp.WHOLE_ROW, 128], ids=["whole-rows", "column-tiles"])
@pytest.mark.parametrize("kernel,inputs,want", _cases(), ids=lambda v: getattr(v, "name", ""))
def test_each_program_simulates_to_numpy_and_lowers_through_the_general_recipe(kernel, inputs, want, whole_row):
    """Rows up to ``WHOLE_ROW`` elements go whole; the 300-column rows past a limit of 128 go by
    column tiles in two passes (the rows programs' other branch)."""
    kw = {"rows": 3, "whole_row": whole_row} if kernel.name in ("row_softmax", "rms_norm", "add_rms_norm") else {}
    res = tl.simulate(kernel, 1, [inputs], compute=C, **kw)
    for name, ref in want.items():
        got = res[0][name].astype(np.float64)
        assert np.allclose(got, ref, rtol=2e-2, atol=2e-2 * max(1.0, np.abs(ref).max())), (kernel.name, name)
    ir = kernel.trace(1, *(S(inputs[n].shape, tl.float16) for n in kernel.arg_names), compute=C, **kw)
    assert isinstance(lower(ir, "part"), LoweredGeneral), kernel.name          # no recipe matches it
    if kw:
        assert bool(re.search(r"for \(int \w+_\d+ = ", lower(ir, "part").source)) == (whole_row < N), kernel.name


def test_the_benchmarks_kernels_compile_with_dots_on_tensor_cores(tmp_path):
    """At the benchmark's schedules and shapes: no spills, no trap, every dot on tensor cores
    (HGMMA where it runs on WGMMA, HMMA where on mma.sync)."""
    from tldsl.codegen import toolchain as tcm
    ok, why = tcm.toolchain_available()
    if not ok:
        pytest.skip(f"CUDA wheels missing (NVRTC compile tests): {why}")
    from tldsl.codegen.toolchain.cache import KernelCache
    from tldsl.codegen.toolchain.compiler import compile_many
    from tldsl.codegen.toolchain.sass import tensor_core_problems
    big, rows = S((16384, 8192), tl.float16), S((1, 8192), tl.float16)
    flat, by_rows = tl.ComputeSchedule(tile=(32, 256, 16)), tl.ComputeSchedule(tile=(16, 256, 16))
    M_, N_, K_ = 8191, 8200, 4104
    irs = [gp.scale_shift.trace(1, big, big, compute=flat), gp.row_softmax.trace(1, big, big, compute=by_rows),
           gp.rms_norm.trace(1, big, rows, big, compute=by_rows),
           gp.add_rms_norm.trace(1, big, big, rows, big, big, compute=by_rows),
           gp.gated_gemm.trace(1, S((M_, K_), tl.float16), S((K_, N_), tl.float16), S((1, N_), tl.float16),
                               S((K_, N_), tl.float16), S((M_, N_), tl.float16),
                               compute=tl.ComputeSchedule(**bench_general.GEMM_SCHEDULE))]
    lks = [lower(ir, "part") for ir in irs]
    assert all(isinstance(lk, LoweredGeneral) for lk in lks)
    for lk, ck in zip(lks, compile_many([lk.job() for lk in lks], cache=KernelCache(tmp_path), progress=False)):
        sass = ck.sass()[ck.name]
        assert sass.count("BPT.TRAP") == 0 and sass.spill_instructions == 0, (lk.entry, sass.summary())
        assert not tensor_core_problems(sass, lk.wgmma_dots, lk.dots - lk.wgmma_dots), (lk.entry, sass.mnemonics)
    assert lks[-1].dots == lks[-1].wgmma_dots == 2          # 64-row f16 tiles: both dots on WGMMA
    assert "pipelined dot loop" in lks[-1].source and lks[-1].threads == 256   # its K loop as a mainloop
