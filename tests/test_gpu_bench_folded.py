"""``bench moe --fold on`` on the GPU, one row of each layer: the folded kernel checked against
torch, then timed. Its AllGather+MoE row hung before the thirty-second session (its first launch
waited for an epoch the stream-ordered kernels timed beside it never notify); the folded kernels
now wait with a timeout, so such a slip fails this test instead of hanging it."""
from __future__ import annotations

import pytest

from tldsl.runtime.gpu import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs an sm_90 GPU with torch and cuda-python")]


@pytest.mark.parametrize("layer", ["ag", "rs"])
def test_bench_moe_checks_and_times_the_folded_kernel(layer):
    from tldsl.bench import fused_layers, moe
    row = moe._parse_row("mixtral:2048:random")
    if layer == "ag":
        r = moe.bench_row(row, 2, stage_rows="on", fold=True)
        assert len(r["parts_ms"]) == 4          # the pair one after the other, each kernel alone, the copy
    else:
        r = moe.bench_rs_row(row, 2, fold=True)
        assert len(r["parts_ms"]) == 5          # the pair, the GEMM, the combine, the notifying GEMM, the copy
    assert r["ms"] > 0 and all(t > 0 for t in r["parts_ms"])
    assert r["err"] <= fused_layers.REL_TOL     # (bench_row raises beyond it: checked before timing)
