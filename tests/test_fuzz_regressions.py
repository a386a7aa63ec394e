"""Programs the differential fuzzer found disagreeing on the GPU, kept as regression tests.

Each is the fuzzer's program as it printed it (``python -m tldsl.testing.fuzz --seed S --gpu``),
with its inputs: checked in the simulator against numpy, in the general recipe's generated code
on CPU threads against the simulator, and (marker ``gpu``) through ``tl.run`` on a GPU.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen import lower
from tldsl.runtime.gpu import gpu_available

from test_codegen_general import emulate_kernel


# seed 2026, program 149 (W = 2): a comm part squares x into a workspace tile by tile and
# notifies; the compute part waits for all six tiles, loads a 32x32 tile of the [23, 26]
# workspace (the columns past 26 read 0) and keeps the row maximum of its negation. Every row's
# answer is 0 (the zero padding beats every -x**2); the H200 once answered 64 (= max x**2).
@tl.kernel
def fuzz_2026_149(x0, y0):
    ws0 = tl.local_buffer((23, 26), tl.int32, "ws0")
    ready0 = tl.signal("ready0", 6)

    @tl.comm_part(grid=(3, 2), name="comm0")
    def comm0(pm, pn):
        r0 = pm * 8
        c0 = pn * 16
        t0 = tl.load(x0, (r0, c0), (8, 16))
        tl.store(ws0, (r0, c0), (t0 * t0))
        tl.producer_tile_notify(ready0, pm * 2 + pn)

    @tl.compute_part(grid=(1,))
    def stage0(pm):
        r0 = pm * 32
        for q in tl.range(r0 // 8, tl.cdiv(tl.minimum(r0 + 32, 23), 8), 1):
            for j in tl.static_range(0, 2, 1):
                tl.consumer_tile_wait(ready0, q * 2 + j)
        acc = tl.fragment((32,), tl.int32, fill=-1073741824)
        for k in tl.static_range(0, 26, 32):
            t1 = tl.load(ws0, (r0, k), (32, 32))
            acc[...] = tl.maximum(acc[...], tl.max(-t1, 1))
        tl.store(y0, (r0,), acc[...])


def _inputs_149():
    rng = np.random.default_rng(149)
    return [{"x0": rng.integers(-8, 9, (23, 26)).astype(np.int32),
             "y0": np.full(23, -0x5A5A5A5A, np.int32)} for _ in range(2)]


def _want_149(x):
    """The row maximum of -x**2 over the 32 loaded columns: the 6 past the tensor's edge read 0."""
    return np.maximum((-(x.astype(np.int64) ** 2)).max(axis=1), 0).astype(np.int32)


def test_149_in_the_simulator():
    ins = _inputs_149()
    assert all((np.abs(i["x0"]) == 8).any(axis=1).sum() > 10 for i in ins)   # max x**2 = 64 in most rows
    res = tl.simulate(fuzz_2026_149, 2, ins)
    for r in range(2):
        assert np.array_equal(res[r]["y0"], _want_149(ins[r]["x0"]))


@pytest.mark.skipif(shutil.which("g++") is None, reason="the generated code runs on CPU threads through g++")
def test_149_generated_code_on_cpu_threads(tmp_path):
    ins = _inputs_149()
    k = fuzz_2026_149.trace(2, tl.TensorSpec((23, 26), tl.int32), tl.TensorSpec((23,), tl.int32))
    stored = [dict(i, ws0=np.full((23, 26), -0x5A5A5A5A, np.int32)) for i in ins]
    got = emulate_kernel(k, [lower(k, p.name) for p in k.parts], stored, tmp_path)
    for r in range(2):
        assert np.array_equal(got[r]["y0"], _want_149(ins[r]["x0"])), got[r]["y0"]


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_available(), reason="needs an sm_90 GPU with torch and cuda-python")
def test_149_on_the_gpu():
    ins = _inputs_149()
    got = tl.run(fuzz_2026_149, 2, ins)
    for r in range(2):
        assert np.array_equal(got[r]["y0"], _want_149(ins[r]["x0"])), got[r]["y0"]
