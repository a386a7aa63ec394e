"""``bench moe`` on the GPU, one small row in each mode: each row checked against torch, then timed,
with the columns the table prints — our kernels one by one and, last, a copy of the bytes the
combine or the staged row gather moves (the combine's row: then one of the least bytes the grouped
GEMM and combine move through DRAM together). The folded AllGather+MoE row hung before the thirty-second
session (its first launch waited for an epoch the stream-ordered kernels timed beside it never
notify); the folded kernels now wait with a timeout, so such a slip fails here instead of hanging."""
from __future__ import annotations

import pytest

from tldsl.runtime.gpu import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs an sm_90 GPU with torch and cuda-python")]


@pytest.mark.parametrize("layer, spec, kw, parts", [
    ("ag", "mixtral:2048:random", dict(stage_rows="on"), 3),          # the gather, the GEMM, the copy
    ("ag", "qwen3:2048:random", dict(stage_rows="off"), 0),           # gathered in the GEMM: nothing apart
    ("ag", "mixtral:2048:random", dict(stage_rows="on", fold=True), 4),   # + the pair one after the other
    ("rs", "mixtral:2048:random", dict(), 5),         # the GEMM, the combine, notifying, the two copies
    ("rs", "mixtral:2048:random", dict(partial_dtype="f32"), 5),      # ... the partial in fp32 (bf16 by default)
    ("rs", "mixtral:2048:random", dict(fold=True), 6),                # + the pair one after the other
    # the GEMM storing y_sorted, the combine, the GEMM adding its rows, the zeroing, the two copies
    ("rs", "mixtral:2048:random", dict(combine="epilogue"), 6),
    ("rs", "qwen3:2048:random", dict(combine="epilogue"), 6),
    ("rs", "mixtral:2048:random", dict(combine="epilogue", group_m=4, interleave=1), 6),   # another tile order
])
def test_bench_moe_checks_and_times_each_mode(layer, spec, kw, parts):
    from tldsl.bench import fused_layers, moe
    row = moe._parse_row(spec)
    r = (moe.bench_row if layer == "ag" else moe.bench_rs_row)(row, 2, **kw)
    assert len(r["parts_ms"]) == parts
    assert r["ms"] > 0 and all(t > 0 for t in r["parts_ms"])
    assert r["err"] <= fused_layers.REL_TOL     # (the row raises beyond it: checked before timing)
    if kw.get("fold"):      # the rows the folded kernel computes (no half tiles folded), not the unfolded GEMM's
        assert r["padded"] == folded_rows(layer, row), (r["padded"], folded_rows(layer, row))


def folded_rows(layer, row) -> int:
    """Rows ``bench moe``'s folded kernel of ``layer`` computes for ``row``: every used tile whole."""
    from tldsl.bench import moe
    from tldsl.codegen import lower
    if layer == "ag":
        _, rt, ir, lowered = moe.lowered_row(row, stage_rows="on")
        lf = moe.folded_as_run_folds(ir, {p: lower(ir, p) for p in lowered})
    else:
        _, _, rt, lf, _ = moe.lowered_rs_row(row, fold=True)
    assert not lf.config.half_tiles
    return int((rt.tile_expert >= 0).sum()) * rt.block_m


def test_the_power_probe_checks_then_runs_each_kernel_back_to_back():
    """``bench probe moe_power`` on a small row: the pair checked against torch's sequence, then a
    table row for each of the four kernels, its time a launch; the power columns filled where
    nvidia-smi is there."""
    import io
    import re
    import shutil
    from tldsl.bench import moe
    from tldsl.bench.moe_power import probe_moe_power
    out = io.StringIO()
    probe_moe_power([moe._parse_row("mixtral:2048:random")], seconds=1.0, out=out)
    rows = [ln for ln in out.getvalue().splitlines() if ln.startswith("| mixtral 2048 random |")]
    assert [ln.split(" | ")[1] for ln in rows] == ["our grouped GEMM", "`_grouped_mm`", "our combine",
                                                   "our GEMM, then combine"], out.getvalue()
    for ln in rows:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert float(cells[2]) > 0, ln
        if shutil.which("nvidia-smi"):
            assert re.fullmatch(r"\d+ \(\d+\)", cells[3]) and re.fullmatch(r"\d+ / \d+", cells[5]), ln
