"""``python -m tldsl.bench moe`` (the MoE grouped GEMMs beside ``torch._grouped_mm``): each row's
kernels lowered by the grouped GEMM recipe itself and compiled, the table, its repeats and fresh
processes, the JSON, the schedule refusals and the routing's row layout — on the CPU, the GPU's
timings faked."""
from __future__ import annotations

import dataclasses
import inspect

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tldsl as tl
# imported once here, not in the property test's first example (whose deadline it would spend)
from tldsl.bench.timing import launch_order


def plain_rs_gemm(rt, T: int, K: int, N: int, E: int, tile, stages: int, dtype: str, cluster: int,
                  group_m: int = 8):
    """MoE+ReduceScatter's grouped GEMM part written without notifies, lowered as the program's is."""
    from tldsl.codegen import lower_grouped_gemm
    from tldsl.ops.moe import expert_rows_tile

    @tl.kernel
    def grouped_gemm_only(h, w2, tile_expert, tile_valid_rows, y, *, compute: tl.ComputeSchedule = None):
        BM, BN, _ = compute.tile
        tiles = tl.DynamicMapping("expert_tiles", tile_expert.shape[0], expert=tile_expert,
                                  valid_rows=tile_valid_rows)

        @tl.compute_part(grid=(tile_expert.shape[0], tl.cdiv(w2.shape[2], BN)))
        def grouped_gemm(i, pn):
            with tl.when(tiles["expert", i] >= 0):
                tl.store(y, (i * BM, pn * BN), expert_rows_tile(h, w2, tiles, i, pn, compute.tile))
    S, dt = tl.TensorSpec, getattr(tl, dtype)
    k = grouped_gemm_only.trace(1, S((rt.num_rows, K), dt), S((E, K, N), dt), S.of(rt.tile_expert),
                                S.of(rt.tile_valid_rows), S((rt.num_rows, N), dt),
                                compute=tl.ComputeSchedule(tile=tile, stages=stages, order="swizzled",
                                                           group_m=group_m))
    return lower_grouped_gemm(k, "grouped_gemm", cluster=(cluster, 1))


def test_the_moe_benchmark_lowers_each_of_its_rows_grouped_gemm(tmp_path):
    """``python -m tldsl.bench moe``'s rows lower (no GPU needed to lower): one rank's slice of
    layer 0 on every token, the routing's padded rows as the kernel's output rows; a wide slice
    (Mixtral's) stages its routed rows by default — a row gather (the combine recipe), then the grouped
    GEMM reading them by TMA — a narrow one (Qwen3's) gathers them in the GEMM; ``--stage-rows``
    forces either, and the staged pair compiles for sm_90a."""
    from tldsl.bench import moe
    from tldsl.codegen import toolchain as tcm
    from tldsl.codegen.toolchain.cache import KernelCache
    from tldsl.codegen.toolchain.compiler import compile_many
    args = moe.parse_args(["--rows", "qwen3:2048:zipf,mixtral:2048:one"])
    assert args.stage_rows == "auto"
    staged = {}
    for row in args.row_list:
        ids, rt, ir, lowered = moe.lowered_row(row, args.tile_t, args.stages, cluster=args.cluster)
        staged[row.model] = list(lowered)
        gemm = lowered["grouped_gemm"]
        assert type(gemm).__name__ == "LoweredGroupedGemm" and rt.num_rows % args.tile_t[0] == 0
        assert ids.shape == (row.tokens, moe.MOE_MODELS[row.model][3])
        assert gemm.cluster_dims == (args.cluster, 1, 1)
        tma = {t.buffer for t in gemm.tma}
        assert ("x_sorted" in tma) == ("gather_rows" in lowered)       # staged rows: A by TMA
    assert staged == {"qwen3": ["grouped_gemm"], "mixtral": ["gather_rows", "grouped_gemm"]}
    row = args.row_list[0]
    assert list(moe.lowered_row(row, args.tile_t, args.stages, stage_rows="on")[3]) == ["gather_rows", "grouped_gemm"]
    assert list(moe.lowered_row(args.row_list[1], args.tile_t, args.stages, stage_rows="off")[3]) == ["grouped_gemm"]
    jobs = [lk.job() for lk in moe.lowered_row(row, args.tile_t, args.stages, stage_rows="on")[3].values()]
    assert moe.parse_args(["--cluster", "1"]).cluster == 1
    with pytest.raises(SystemExit):
        moe.parse_args(["--stage-rows", "maybe"])
    # rs: the combine folded into the grouped GEMM's kernel, its tiles column by column (every
    # tile row a group) unless --group-m says otherwise
    assert moe.parse_args(["--layer", "rs", "--fold", "on"]).fold == "on"
    for bad in (["--fold", "maybe"], ["--group-m", "0"]):
        with pytest.raises(SystemExit):
            moe.parse_args(bad)
    # ag: the row gather folded into the grouped GEMM: the rows staged (not with --stage-rows off)
    assert moe.parse_args(["--fold", "on"]).stage_rows == "on"
    assert moe.parse_args(["--fold", "on", "--stage-rows", "auto"]).stage_rows == "on"
    with pytest.raises(SystemExit):
        moe.parse_args(["--fold", "on", "--stage-rows", "off"])
    assert moe.parse_args(["--stage-rows", "off"]).stage_rows == "off"          # unfolded: as asked
    rs_row = moe._parse_row("qwen3:2048:random")
    *_, lf, none = moe.lowered_rs_row(rs_row, fold=True)
    assert none is None and lf.side == "combine" and lf.config.group_m >= lf.grid_tiles[0]
    assert lf.cluster_dims == (1, 1, 1)                                # folded as tl.run folds: no clusters
    assert moe.lowered_rs_row(rs_row, fold=True, group_m=16)[3].config.group_m == 16
    # rs: the grouped GEMM as tl.run lowers it (after its signal to the combine is dropped) is the kernel
    # of the part traced without notifies; the one as written, timed beside it, is that kernel but them
    _, _, rt, lg, _ = moe.lowered_rs_row(rs_row, notifies=True)
    _, _, _, as_run, combine = moe.lowered_rs_row(rs_row)
    hidden, ffn, E, _ = moe.MOE_MODELS["qwen3"]
    plain = plain_rs_gemm(rt, 2048, ffn // moe.TP, hidden, E, (128, 256, 64), 4, "bfloat16", 2)
    assert (lg.notifies, plain.notifies, plain.waits, as_run.notifies, combine.waits) == (1, 0, 0, 0, 0)
    assert (as_run.config, as_run.grid_tiles, as_run.cluster_dims, as_run.source.count("\n")) == (
        plain.config, plain.grid_tiles, plain.cluster_dims, plain.source.count("\n"))
    # the same configuration but for the notify ring's barriers, which a GEMM that never notifies has none of,
    # and the register split: holding a tile besides the deferred notifies' state takes HELD_REGS
    from tldsl.codegen.plan.grouped_gemm import HELD_REGS
    assert plain.config.notify_slots == 0 and lg.config.notify_slots > 0
    assert plain.config.overlap_store and lg.config.overlap_store
    assert (lg.config.producer_regs, lg.config.consumer_regs) == HELD_REGS
    assert (dataclasses.replace(plain.config, notify_slots=lg.config.notify_slots, producer_regs=HELD_REGS[0],
                                consumer_regs=HELD_REGS[1]), plain.grid_tiles,
            plain.cluster_dims) == (lg.config, lg.grid_tiles, lg.cluster_dims)
    jobs.append(plain.job())
    # probe moe_notifies: the notifier's hook with its fence, its adds or both cut out, nothing else
    from tldsl.bench.moe_probes import notify_ablations
    cuts = notify_ablations(lg.source)
    hook = {n: src.split("void notifies_lanes(")[1].split("\n  }\n")[0] for n, src in cuts.items()}
    assert cuts["as generated"] == lg.source
    assert [("fence_acq_rel" in b, "red_relaxed_add" in b) for b in hook.values()] == \
        [(True, True), (False, True), (True, False), (False, False)]
    assert all(src.split("void notifies_lanes(")[0] == lg.source.split("void notifies_lanes(")[0] for src in cuts.values())
    jobs.append(dataclasses.replace(lg, source=cuts["hand-over only"], entry=lg.entry).job())
    with pytest.raises(ValueError, match="no notifies_lanes"):
        notify_ablations(plain.source)
    ok, why = tcm.toolchain_available()
    if not ok:
        pytest.skip(f"CUDA wheels missing (NVRTC compile tests): {why}")
    compiled = compile_many(jobs, cache=KernelCache(tmp_path), progress=False)
    assert len(compiled) == 4
    for ck in compiled:                     # (the row gather: four items a thread in flight, in 64 registers)
        info = ck.ptxas_info()[ck.name]
        assert info["spill_store_bytes"] == info["spill_load_bytes"] == 0, (ck.name, info)
    rows = moe.parse_args([]).row_list                                   # the rows by default
    assert [(r.model, r.tokens, r.routing) for r in rows] == [tuple(r) for r in moe.MOE_ROWS]
    for bad in (["--tile", "128,128"], ["--cluster", "3"]):
        with pytest.raises(SystemExit):
            moe.parse_args(bad)


def test_the_moe_benchmarks_layer_1_rows_lower_and_compile(tmp_path):
    """``python -m tldsl.bench moe --layer rs``: each row's grouped GEMM (the routed rows of
    layer 1 into ``y_sorted``) and top-k combine (the partial of every token: bf16 as
    MoEReduceScatter keeps it by default, fp32 with ``--partial f32``) lower at the row's shapes —
    one rank's slice of ``ffn`` as K, ``hidden`` as N — and compile for sm_90a."""
    from tldsl.bench import moe
    from tldsl.codegen import toolchain as tcm
    from tldsl.codegen.toolchain.cache import KernelCache
    from tldsl.codegen.toolchain.compiler import compile_many
    from tldsl.runtime.dist.moe_ops import MoEReduceScatter
    args = moe.parse_args(["--layer", "rs", "--rows", "qwen3:2048:zipf,mixtral:2048:one"])
    assert args.layer == "rs" and moe.parse_args([]).layer == "ag"
    default = inspect.signature(MoEReduceScatter).parameters["partial_dtype"].default
    assert args.partial == default == "out" and moe.parse_args(["--layer", "rs", "--partial", "f32"]).partial == "f32"
    assert moe.parse_args([]).partial == "out"            # (unused by the ag layer, which refuses the option)
    with pytest.raises(SystemExit):
        moe.parse_args(["--partial", "f32"])
    jobs = []
    for row, partial in zip(args.row_list, ("out", "f32")):
        hidden, ffn, E, topk = moe.MOE_MODELS[row.model]
        ids, wts, rt, lg, lc = moe.lowered_rs_row(row, args.tile_t, args.stages, cluster=args.cluster,
                                                  partial_dtype=partial)
        assert type(lg).__name__ == "LoweredGroupedGemm" and lg.cluster_dims == (args.cluster, 1, 1)
        assert ids.shape == wts.shape == (row.tokens, topk) and rt.num_rows % args.tile_t[0] == 0
        dims = {t.buffer: t.global_dims for t in lg.tma}          # TMA's dims: innermost first
        assert dims["h"] == (ffn // moe.TP, rt.num_rows) and dims["w2"] == (hidden, ffn // moe.TP, E)
        assert lc.buffers["y_sorted"] == ((rt.num_rows, hidden), "bf16")      # rounded as _grouped_mm's
        assert lc.buffers["partial"] == ((row.tokens, hidden), "bf16" if partial == "out" else "f32")
        jobs += [lg.job(), lc.job()]
    ok, why = tcm.toolchain_available()
    if not ok:
        pytest.skip(f"CUDA wheels missing (NVRTC compile tests): {why}")
    assert len(compile_many(jobs, cache=KernelCache(tmp_path), progress=False)) == 4
    with pytest.raises(SystemExit):
        moe.parse_args(["--layer", "ffn"])


def test_the_moe_benchmarks_repeats_take_medians_and_keep_each_speed():
    """``bench moe --repeat R``: each time the median over the repeats, TFLOP/s from the medians,
    the worst error, and every repeat's own speed ratio (what the table's range shows)."""
    from tldsl.bench import moe
    assert moe.parse_args([]).repeat == 1 and moe.parse_args(["--repeat", "4"]).repeat == 4
    for bad in (["--repeat", "0"], ["--iters", "0"], ["--repeat", "x"]):
        with pytest.raises(SystemExit):
            moe.parse_args(bad)

    def run(ms, gmm, seq, parts, err):
        return dict(ms=ms, gmm_ms=gmm, seq_ms=seq, flops=3e9, tflops=3e9 / ms / 1e9, gmm_tflops=3e9 / gmm / 1e9,
                    err=err, padded=640, routed=600, parts_ms=parts)
    runs = [run(1.0, 1.2, 2.0, [0.5, 0.2], 1e-3), run(1.4, 1.1, 2.4, [0.7, 0.1], 4e-3), run(1.2, 0.9, 2.2, [0.6, 0.3], 2e-3)]
    r = moe.summarize_repeats(runs)
    assert (r["ms"], r["gmm_ms"], r["seq_ms"]) == (1.2, 1.1, 2.2)
    assert r["parts_ms"] == [0.6, 0.2]                          # column by column, not one repeat's
    assert r["tflops"] == pytest.approx(3e9 / 1.2 / 1e9) and r["gmm_tflops"] == pytest.approx(3e9 / 1.1 / 1e9)
    assert r["err"] == 4e-3 and (r["padded"], r["routed"]) == (640, 600)
    assert r["speeds"] == pytest.approx([1.2, 1.1 / 1.4, 0.75])
    one = moe.summarize_repeats(runs[:1])
    assert one["ms"] == 1.0 and one["speeds"] == pytest.approx([1.2])
    with pytest.raises(ValueError, match="no repeats"):
        moe.summarize_repeats([])


@given(n=st.integers(0, 12), run=st.integers(0, 1000))
def test_interleaved_launch_order_is_a_permutation_fixed_by_the_run(n, run):
    """Each round launches every function once: run 0 in the given order, later runs in a
    permutation their number fixes (the same on every call)."""
    order = launch_order(n, run)
    assert sorted(order) == list(range(n)) and order == launch_order(n, run)
    if run == 0:
        assert order == list(range(n))


def test_repeats_put_other_kernels_before_ours():
    """``bench moe --repeat 4``'s runs (six functions a round, layer rs): our pair is launched after
    at least three different functions (the rounds repeat back to back, so the one before it in the
    cycle)."""
    before = set()
    for run in range(4):
        order = launch_order(6, run)
        before.add(order[order.index(0) - 1])
    assert len(before) >= 3, before


def test_the_moe_benchmarks_table_with_repeats(monkeypatch):
    """``bench moe --layer rs --repeat 3``'s table, its row benchmark replaced by a recorder (no GPU):
    each row timed three times, run numbers 0, 1, 2, each inside its own fresh placement; the medians
    printed, the speed range in a last column; a row that fails is reported and the rest still run."""
    import contextlib
    import io
    from tldsl.bench import moe
    calls, placements = [], []
    times = iter([1.0, 1.3, 0.8, 0.9, 1.4, 1.0])      # medians 1.0 (means 1.03, 1.1)

    def fake_rs_row(row, iters, *args, run=0, **kw):
        assert kw["partial_dtype"] == "f32"                       # --partial reaches each row
        calls.append((row.model, run, placements[-1]))
        if row.model == "mixtral":
            raise RuntimeError("no such luck\nsecond line")
        ms = next(times)
        return dict(ms=ms, gmm_ms=1.0, seq_ms=4.0, flops=2e9, tflops=2e9 / ms / 1e9, gmm_tflops=2.0, err=1e-3,
                    padded=640, routed=600, parts_ms=[0.7, 0.2, 0.75, 0.18, 0.65])

    @contextlib.contextmanager
    def fake_placement(run):
        placements.append(run)
        yield
    monkeypatch.setattr(moe, "bench_rs_row", fake_rs_row)
    monkeypatch.setattr(moe, "fresh_placement", fake_placement)
    out = io.StringIO()
    rc = moe.main(["--layer", "rs", "--repeat", "3", "--partial", "f32",
                   "--rows", "qwen3:2048:random,mixtral:2048:one,deepseek:2048:zipf"], out=out)
    assert rc == 1                                                # the failed row counts
    assert calls == [("qwen3", 0, 0), ("qwen3", 1, 1), ("qwen3", 2, 2), ("mixtral", 0, 0),
                     ("deepseek", 0, 0), ("deepseek", 1, 1), ("deepseek", 2, 2)]
    lines = out.getvalue().splitlines()
    assert "the median of 3 such timings" in lines[0] and "the partial in fp32 (--partial f32)" in lines[0]
    assert lines[1].endswith("| speed per repeat (min-max) |") and lines[1].count("|") == lines[2].count("|")
    qwen = next(line for line in lines if line.startswith("| qwen3 2048 random |"))
    cells = [c.strip() for c in qwen.strip("|").split("|")]
    assert cells[1] == "1.000" and cells[5] == "1.00" and cells[-1] == "0.77-1.25"   # medians; 1/1.3 .. 1/0.8
    failed = next(line for line in lines if line.startswith("| mixtral 2048 one |"))
    assert "failed: RuntimeError: no such luck |" in failed and failed.count("|") == lines[1].count("|")
    deep = next(line for line in lines if line.startswith("| deepseek 2048 zipf |"))
    assert deep.count("|") == lines[1].count("|") and deep.startswith("| deepseek 2048 zipf | 1.000 |")
    assert deep.rstrip().endswith("| 0.750 | 0.180 | 0.650 | 0.71-1.11 |")     # ... notifying GEMM, the copies
    assert lines[1].endswith("| GEMM with notifies ms | copy of the combine's bytes ms "
                             "| copy of the pair's least DRAM bytes ms | speed per repeat (min-max) |")


def test_the_moe_benchmark_writes_its_rows_as_json(monkeypatch, tmp_path):
    """``bench moe --json PATH``: the options and, per row, the printed medians with every repeat's
    speed, or the row's error."""
    import contextlib
    import io
    import json
    from tldsl.bench import moe
    times = iter([2.0, 1.0])

    def fake_row(row, iters, *args, run=0, **kw):
        if row.routing == "one":
            raise ValueError("bad routing")
        ms = next(times)
        return dict(ms=ms, gmm_ms=1.5, seq_ms=3.0, flops=3e9, tflops=3e9 / ms / 1e9, gmm_tflops=2.0, err=2e-3,
                    padded=4352, routed=4096, parts_ms=[])
    monkeypatch.setattr(moe, "bench_row", fake_row)
    monkeypatch.setattr(moe, "fresh_placement", lambda run: contextlib.nullcontext())
    path = tmp_path / "moe.json"
    assert moe.main(["--repeat", "2", "--rows", "mixtral:2048:random,mixtral:2048:one", "--json", str(path)],
                    out=io.StringIO()) == 1
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "moe" and doc["options"]["layer"] == "ag" and doc["options"]["repeat"] == 2
    good, bad = doc["rows"]
    assert good["row"] == "mixtral:2048:random" and good["ms"] == 1.5 and good["speeds"] == [0.75, 1.5]
    assert good["tflops"] == 2.0 and (good["padded"], good["routed"]) == (4352, 4096)
    assert bad == {"row": "mixtral:2048:one", "error": "ValueError: bad routing"}


def test_the_moe_benchmarks_ag_table_gives_the_staged_gather_and_its_copy(monkeypatch):
    """``bench moe`` (ag): a staged row prints its row gather, its GEMM and a copy of the gather's
    bytes (the gather's bound) one by one; a row gathered in the GEMM leaves those cells empty.
    Every row has the header's cells."""
    import contextlib
    import io
    from tldsl.bench import moe

    def fake_row(row, iters, *args, run=0, **kw):
        parts = [0.1, 0.9, 0.08] if row.model == "mixtral" else []
        return dict(ms=1.0, gmm_ms=1.0, seq_ms=1.2, flops=1e9, tflops=1.0, gmm_tflops=1.0, err=1e-3,
                    padded=4352, routed=4096, parts_ms=parts)
    monkeypatch.setattr(moe, "bench_row", fake_row)
    monkeypatch.setattr(moe, "fresh_placement", lambda run: contextlib.nullcontext())
    out = io.StringIO()
    assert moe.main(["--rows", "mixtral:2048:random,qwen3:2048:random"], out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[1].endswith("| rows gathered | row gather alone ms | GEMM alone ms | copy of the gather's bytes ms |")
    staged = next(x for x in lines if x.startswith("| mixtral 2048 random |"))
    inside = next(x for x in lines if x.startswith("| qwen3 2048 random |"))
    assert staged.endswith("| staged | 0.100 | 0.900 | 0.080 |") and inside.endswith("| in the GEMM | | | |")
    assert staged.count("|") == inside.count("|") == lines[1].count("|") == lines[2].count("|")


def test_the_moe_benchmark_across_fresh_processes(monkeypatch, tmp_path):
    """``bench moe --processes 3``: the whole benchmark run in three child processes (each
    ``python -m tldsl.bench moe`` with the same options but ``--processes`` and ``--json``, writing its
    rows as JSON), the table giving the medians over them and the range of their speeds; a row that
    failed in one process, or a process that wrote nothing, is reported, the other rows still shown."""
    import io
    import json
    from tldsl.bench import moe, processes
    ms = iter([1.0, 2.0, 1.2])                    # qwen3's time in processes 1..3: median 1.2 (mean 1.4)
    cmds = []

    def fake_run(cmd, capture_output, text):
        cmds.append(cmd)
        path = cmd[cmd.index("--json") + 1]
        i = len(cmds)
        t = next(ms)
        rows = [dict(row="qwen3:2048:random", ms=t, gmm_ms=1.2, seq_ms=5.0, flops=2e9, tflops=2e9 / t / 1e9,
                     gmm_tflops=1.67, err=1e-3 * i, padded=640, routed=600,
                     parts_ms=[0.9 * t, 0.1 * t, t, 0.08 * t],
                     speeds=[1.2 / t]),
                dict(row="deepseek:2048:zipf", error="RuntimeError: relative L2 0.5") if i == 2 else
                dict(row="deepseek:2048:zipf", ms=1.0, gmm_ms=1.0, seq_ms=2.0, flops=1e9, tflops=1.0, gmm_tflops=1.0,
                     err=0.0, padded=64, routed=64, parts_ms=[0.5, 0.5, 0.5, 0.5], speeds=[1.0])]
        with open(path, "w") as f:
            json.dump({"benchmark": "moe", "rows": rows}, f)
        return type("Done", (), dict(returncode=1 if i == 2 else 0, stdout="| a child's table |\n", stderr=""))()
    monkeypatch.setattr(processes.subprocess, "run", fake_run)
    out, log = io.StringIO(), io.StringIO()
    monkeypatch.setattr(processes.sys, "stderr", log)
    path = tmp_path / "moe.json"
    argv = ["--layer", "rs", "--processes", "3", "--iters", "7", "--rows", "qwen3:2048:random,deepseek:2048:zipf",
            "--json", str(path)]
    assert moe.main(argv, out=out) == 1           # deepseek failed in process 2
    assert len(cmds) == 3 and all(c[1:4] == ["-m", "tldsl.bench", "moe"] for c in cmds)
    assert [c[4:-2] for c in cmds] == [["--layer", "rs", "--iters", "7", "--rows",
                                        "qwen3:2048:random,deepseek:2048:zipf", "--processes", "1"]] * 3   # own --json
    assert log.getvalue().count("| a child's table |") == 3 and "# process 2 of 3" in log.getvalue()
    lines = out.getvalue().splitlines()
    assert "the median over 3 processes" in lines[0]
    assert lines[1].endswith("| speed per process (min-max) |") and lines[1].count("|") == lines[2].count("|")
    qwen = [c.strip() for c in next(x for x in lines if x.startswith("| qwen3 2048 random |")).strip("|").split("|")]
    assert qwen[1] == "1.200" and qwen[5] == "1.00" and qwen[-1] == "0.60-1.20"      # median; 1.2/2.0 .. 1.2/1.0
    assert qwen[-5:-1] == ["1.080", "0.120", "1.200", "0.096"]                        # each part's median
    deep = next(x for x in lines if x.startswith("| deepseek 2048 zipf |"))
    assert "| failed: in process 2: RuntimeError: relative L2 0.5" in deep         # the child's error, as named there
    assert deep.count("|") == lines[1].count("|")
    doc = json.loads(path.read_text())
    assert doc["options"]["processes"] == 3
    good, bad = doc["rows"]
    assert good["row"] == "qwen3:2048:random" and good["ms"] == 1.2 and good["err"] == 3e-3
    assert good["speeds"] == [1.2, 0.6, 1.0] and bad["row"] == "deepseek:2048:zipf" and "process 2" in bad["error"]
    assert good["speeds_per_process"] == [[1.2], [0.6], [1.0]]          # each process's own repeats


def test_a_process_that_writes_no_rows_fails_every_row(monkeypatch):
    import io
    from tldsl.bench import moe, processes

    def crashed(cmd, capture_output, text):
        return type("Done", (), dict(returncode=-11, stdout="", stderr="warming up\nSegmentation fault"))()
    monkeypatch.setattr(processes.subprocess, "run", crashed)
    monkeypatch.setattr(processes.sys, "stderr", io.StringIO())
    out = io.StringIO()
    assert moe.main(["--processes", "2", "--rows", "qwen3:2048:random,mixtral:2048:one"], out=out) == 1
    for name in ("| qwen3 2048 random |", "| mixtral 2048 one |"):
        row = next(x for x in out.getvalue().splitlines() if x.startswith(name))
        assert "process 1 wrote no rows (exit -11): Segmentation fault" in row


def test_a_process_missing_a_row_fails_that_row_only(monkeypatch):
    """A child whose rows are not the parent's (another order, one short) is reported row by row."""
    import io
    import json
    from tldsl.bench import moe, processes

    def short(cmd, capture_output, text):
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump({"rows": [dict(row="qwen3:2048:random", ms=1.0, gmm_ms=1.0, seq_ms=2.0, flops=1e9, tflops=1.0,
                                     gmm_tflops=1.0, err=0.0, padded=64, routed=64, parts_ms=[], speeds=[1.0])]}, f)
        return type("Done", (), dict(returncode=0, stdout="", stderr=""))()
    monkeypatch.setattr(processes.subprocess, "run", short)
    monkeypatch.setattr(processes.sys, "stderr", io.StringIO())
    out = io.StringIO()
    assert moe.main(["--processes", "2", "--rows", "qwen3:2048:random,mixtral:2048:one"], out=out) == 1
    lines = out.getvalue().splitlines()
    assert next(x for x in lines if x.startswith("| qwen3 2048 random |")).startswith("| qwen3 2048 random | 1.000 |")
    assert "process 1 has no row mixtral:2048:one" in next(x for x in lines if x.startswith("| mixtral 2048 one |"))


def test_an_abbreviated_processes_option_does_not_reach_the_children(monkeypatch):
    """argparse takes ``--proc 3`` for ``--processes 3``; the children must still run once each."""
    import io
    from tldsl.bench import moe, processes
    cmds = []

    def record(cmd, capture_output, text):
        cmds.append(cmd)
        return type("Done", (), dict(returncode=1, stdout="", stderr="x"))()
    monkeypatch.setattr(processes.subprocess, "run", record)
    monkeypatch.setattr(processes.sys, "stderr", io.StringIO())
    moe.main(["--proc", "3", "--rows", "qwen3:2048:random"], out=io.StringIO())
    assert len(cmds) == 3
    for cmd in cmds:
        child = moe.parse_args(cmd[4:])
        assert child.processes == 1 and child.json == cmd[-1]


@pytest.mark.parametrize("argv, want", [
    (["--processes", "3", "--rows", "a"], ["--rows", "a"]),
    (["--processes=3", "--json=x.json", "--iters", "5"], ["--iters", "5"]),
    (["--json", "x.json", "--layer", "rs", "--processes", "2"], ["--layer", "rs"]),
])
def test_the_children_get_every_option_but_processes_and_json(argv, want):
    from tldsl.bench.processes import child_argv
    assert child_argv(argv) == want


def test_processes_below_one_are_refused(capsys):
    from tldsl.bench import moe
    with pytest.raises(SystemExit):
        moe.parse_args(["--processes", "0"])
    assert "--processes: a positive number of processes, got 0" in capsys.readouterr().err


def test_a_schedule_the_grouped_gemm_refuses_fails_the_row_naming_why():
    """``bench moe --stages 1`` (ag): the grouped GEMM recipe's refusal, not a quiet fallback to the general
    lowering (whose kernel the row would then time under the grouped GEMM's name)."""
    from tldsl.bench import moe
    from tldsl.bench.baselines import _parse_row
    from tldsl.codegen.errors import LoweringError
    with pytest.raises(LoweringError, match="needs a second stage"):
        moe.lowered_row(_parse_row("qwen15:2048:random"), stages=1, stage_rows="off")
    _, _, _, lowered = moe.lowered_row(_parse_row("mixtral:2048:random"))        # staged rows: two kernels
    assert {p: lk.kind for p, lk in lowered.items()} == {"gather_rows": "combine", "grouped_gemm": "grouped_gemm"}


def test_sorted_rows_land_where_the_routing_lays_them_out():
    """``rows_laid_out``: torch's expert-sorted rows in the routing's padded layout, padding rows zero."""
    import torch
    from tldsl.bench import moe
    from tldsl.bench.baselines import random_topk, route
    from tldsl.ops.moe import moe_routing
    T, E, topk = 300, 6, 2
    ids, _ = random_topk(T, E, topk, "random", device="cpu", seed=3)
    rt = moe_routing(ids.numpy(), E, 1, T, 64)
    order, _ = route(ids, E)
    rows = torch.arange(1, T * topk + 1, dtype=torch.float32)[:, None].repeat(1, 3)    # no zero among them
    out = moe.rows_laid_out(rows, order, rt)
    assert out.shape == (rt.num_rows, 3)
    pos = moe.laid_out(order, rt)
    assert torch.equal(out[pos], rows)
    padding = torch.ones(rt.num_rows, dtype=torch.bool)
    padding[pos] = False
    assert int(padding.sum()) == rt.num_rows - T * topk and not out[padding].any()


def test_group_m_reaches_the_ag_layers_kernels_and_rows(monkeypatch):
    """``bench moe --layer ag --group-m N``: the tile order's group of both kernels of a staged row
    (it used to be the rs layer's only, and silently ignored for ag)."""
    import contextlib
    import io
    from tldsl.bench import moe
    from tldsl.bench.baselines import _parse_row
    _, _, _, lowered = moe.lowered_row(_parse_row("mixtral:2048:random"), stage_rows="on", group_m=4)
    assert lowered["grouped_gemm"].config.group_m == 4
    assert "kGroupM = 4" in lowered["gather_rows"].source
    _, _, _, default = moe.lowered_row(_parse_row("mixtral:2048:random"), stage_rows="on")
    assert default["grouped_gemm"].config.group_m == 8
    seen = []

    def fake_row(row, iters, *args, run=0, group_m=None, **kw):
        seen.append(group_m)
        return dict(ms=1.0, gmm_ms=1.0, seq_ms=1.2, flops=1e9, tflops=1.0, gmm_tflops=1.0, err=1e-3,
                    padded=4352, routed=4096, parts_ms=[])
    monkeypatch.setattr(moe, "bench_row", fake_row)
    monkeypatch.setattr(moe, "fresh_placement", lambda run: contextlib.nullcontext())
    assert moe.main(["--rows", "mixtral:2048:random", "--group-m", "4"], out=io.StringIO()) == 0
    assert moe.main(["--rows", "mixtral:2048:random"], out=io.StringIO()) == 0
    assert seen == [4, None]


def test_group_m_reaches_the_grouped_gemm_that_adds_its_rows():
    """``bench moe --layer rs --combine epilogue --group-m N``: the tile order's group of the GEMM
    adding its rows (it reached only the pass pair's kernels, and the epilogue's GEMM silently kept 8)."""
    from tldsl.bench import moe
    from tldsl.bench.baselines import _parse_row
    row = _parse_row("mixtral:2048:random")
    _, _, rt, k = moe.rs_program(row, group_m=4)
    assert moe.lowered_added_rows(row, rt, k.compute_schedule).config.group_m == 4
    _, _, rt, k = moe.rs_program(row)
    added = moe.lowered_added_rows(row, rt, k.compute_schedule)
    assert added.config.group_m == 8 and "kAddRows = true" in added.source


def test_the_moe_benchmarks_header_names_the_clusters_the_folded_kernel_runs_with(monkeypatch):
    """``bench moe --fold on``: the header gives the folded kernel's clusters as the runtime folds
    (``runtime/gpu/fold.py``'s ``FOLDED_CLUSTER``), not a copy of them that could drift."""
    import contextlib
    import io
    from tldsl.bench import moe
    from tldsl.runtime.gpu import fold

    def fake_row(row, iters, *args, run=0, **kw):
        return dict(ms=1.0, gmm_ms=1.0, seq_ms=1.2, flops=1e9, tflops=1.0, gmm_tflops=1.0, err=1e-3,
                    padded=4608, routed=4096, parts_ms=[0.95, 0.1, 0.9, 0.08])
    monkeypatch.setattr(moe, "bench_row", fake_row)
    monkeypatch.setattr(moe, "fresh_placement", lambda run: contextlib.nullcontext())
    for clusters in [(1, 1), (2, 1)]:
        monkeypatch.setattr(fold, "FOLDED_CLUSTER", clusters)
        out = io.StringIO()
        assert moe.main(["--fold", "on", "--rows", "mixtral:2048:random"], out=out) == 0
        assert f"(the folded kernel: {clusters}, as tl.run folds)" in out.getvalue().splitlines()[0]
    out = io.StringIO()
    assert moe.main(["--rows", "mixtral:2048:random"], out=out) == 0
    assert "the folded kernel" not in out.getvalue().splitlines()[0]


def test_gather_order_reaches_the_ag_layers_routing_and_rows(monkeypatch):
    """``bench moe --gather-order layout``: the staged row gather visits the row tiles in their
    layout order (the routing's ``tile_visit`` replaced), for the same-run comparison with the
    op's order by tokens (the default); the header says which; the rs layer refuses it."""
    import contextlib
    import io

    import numpy as np
    from tldsl.bench import moe
    from tldsl.bench.baselines import _parse_row
    row = _parse_row("mixtral:2048:random")
    _, rt, _ = moe.ag_program(row, stage_rows="on")
    _, layout, _ = moe.ag_program(row, stage_rows="on", gather_order="layout")
    assert layout.tile_visit.tolist() == list(range(rt.num_tiles)) != rt.tile_visit.tolist()
    assert np.array_equal(layout.sorted_token_ids, rt.sorted_token_ids)      # the same layout: only the visit
    with pytest.raises(ValueError, match="gather_order must be one of"):
        moe.ag_program(row, gather_order="experts")
    assert moe.parse_args([]).gather_order == "tokens"
    # folded into the GEMM, which takes its tiles as they complete: layout order, as AllGatherMoE chooses
    assert moe.parse_args(["--fold", "on"]).gather_order == "layout"
    assert moe.parse_args(["--fold", "on", "--gather-order", "tokens"]).gather_order == "tokens"
    assert moe.parse_args(["--layer", "rs"]).gather_order == "tokens"        # (unused there)
    with pytest.raises(SystemExit):
        moe.parse_args(["--gather-order", "random"])
    with pytest.raises(SystemExit):
        moe.parse_args(["--layer", "rs", "--gather-order", "layout"])
    with pytest.raises(SystemExit):                 # no staged gather to order
        moe.parse_args(["--stage-rows", "off", "--gather-order", "layout"])
    assert moe.parse_args(["--stage-rows", "off"]).gather_order == "tokens"
    seen = []

    def fake_row(row, iters, *args, run=0, gather_order="tokens", **kw):
        seen.append(gather_order)
        return dict(ms=1.0, gmm_ms=1.0, seq_ms=1.2, flops=1e9, tflops=1.0, gmm_tflops=1.0, err=1e-3,
                    padded=4352, routed=4096, parts_ms=[])
    monkeypatch.setattr(moe, "bench_row", fake_row)
    monkeypatch.setattr(moe, "fresh_placement", lambda run: contextlib.nullcontext())
    out = io.StringIO()
    assert moe.main(["--rows", "mixtral:2048:random", "--gather-order", "layout"], out=out) == 0
    assert "staged rows gathered in layout order" in out.getvalue().splitlines()[0]
    assert moe.main(["--rows", "mixtral:2048:random"], out=io.StringIO()) == 0
    out = io.StringIO()
    assert moe.main(["--rows", "mixtral:2048:random", "--stage-rows", "off"], out=out) == 0
    assert "gathered in" not in out.getvalue().splitlines()[0]
    assert seen == ["layout", "tokens", "tokens"]


def test_the_moe_and_attention_benchmarks_headers_name_the_card(monkeypatch):
    """A table's figures compare only with figures from the same kind of card: the header says
    which one ran them (nothing where torch sees no GPU)."""
    import io

    from tldsl.bench import attention, moe, timing
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(moe, "bench_row", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no GPU here")))
    monkeypatch.setattr(attention, "rows", lambda *a: [])
    for main, argv in ((moe.main, ["--rows", "mixtral:2048:random"]), (attention.main, [])):
        out = io.StringIO()
        main(argv, out=out)
        assert " on NVIDIA H100 80GB HBM3" in out.getvalue().splitlines()[0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert timing.on_device() == ""


def test_the_pairs_least_dram_bytes_count_each_tensor_once_and_the_routed_rows_twice():
    """``pair_dram_bytes``: the weights read, the routed rows of ``h`` read and of ``y_sorted``
    written and read back (not the layout's padding rows), the partial written — in each tensor's
    own dtype. DeepSeek-MoE's layer 1 at 8192 tokens (E 64, K 704, N 2048, top 6; 49,152 routed
    rows in a layout of 51,136) comes to 690 MB, against 455 MB for ``_grouped_mm`` alone."""
    import torch
    from tldsl.bench import moe
    meta = dict(device="meta", dtype=torch.bfloat16)
    bufs = {"w2": torch.empty(64, 704, 2048, **meta), "h": torch.empty(51136, 704, **meta),
            "y_sorted": torch.empty(51136, 2048, **meta), "partial": torch.empty(8192, 2048, **meta)}
    routed = 8192 * 6
    least = moe.pair_dram_bytes(bufs, routed)
    assert least == 2 * (64 * 704 * 2048 + routed * 704 + 2 * routed * 2048 + 8192 * 2048)
    assert round(least / 1e6) == 690
    bufs["partial"] = torch.empty(8192, 2048, device="meta", dtype=torch.float32)    # --partial f32: 4 bytes
    assert moe.pair_dram_bytes(bufs, routed) - least == 2 * 8192 * 2048
    assert moe.pair_dram_bytes(bufs, routed - 1) == moe.pair_dram_bytes(bufs, routed) - 2 * (704 + 2 * 2048)
    # a skewed routing leaving experts without rows: only the used experts' weights are read
    assert moe.pair_dram_bytes(bufs, routed, experts_used=40) == moe.pair_dram_bytes(bufs, routed) - 2 * 24 * 704 * 2048
    assert moe.pair_dram_bytes(bufs, routed, experts_used=64) == moe.pair_dram_bytes(bufs, routed)
    for bad in (0, 65, -1):
        with pytest.raises(ValueError, match="experts_used must be in 1..64"):
            moe.pair_dram_bytes(bufs, routed, experts_used=bad)
