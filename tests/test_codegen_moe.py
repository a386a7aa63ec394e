"""The MoE compute parts lowered by the ``grouped_gemm`` and ``combine`` recipes.

* Host-side (no CUDA): recognition of AllGather+MoE's and MoE+ReduceScatter's compute parts,
  the kernel parameter contract (order, sources, TMA descriptors, tables, signals), the
  schedule reaching the C++ template, and rejections that name the op and the user's line.
* Generated code run on the host (needs ``g++``): the generated ``Prog`` members — the guard,
  the expert, the gathered row ids, the waits and notifies with their loops, and the whole
  combine body — compiled against a small host shim of the device helpers and run over every
  tile, then compared with the IR's own meaning (a Python walk of the scalar ops using the
  simulator's arithmetic and wait targets) and with numpy — over two launches where a wait
  counts ``per_launch`` notifies, the simulator and the generated code agree on its target.
* NVRTC (marker ``nvrtc``): every kernel compiled for sm_90a for three schedules and checked
  on its SASS. Spill budget: 0 bytes of spill stores/loads, no stack, no local-memory
  instructions; the grouped GEMMs stay within the 168 registers the launch bound of a
  384-thread CTA allows (consumers raise theirs with setmaxnreg), the combine under 64.
"""
from __future__ import annotations

import re

import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tldsl as tl
from tldsl.codegen import toolchain as tcm
from tldsl.codegen.toolchain.cache import KernelCache
from tldsl.codegen.toolchain.compiler import CompileJob, CudaCompileError, compile_cuda, compile_many
from tldsl.codegen import (LoweredCombine, LoweredGroupedGemm, LoweringError, lower_combine, lower_grouped_gemm,
                           match_combine, match_grouped_gemm)
from tldsl.codegen.pipeline import lower as dispatch_lower, match as pick_recipe
from tldsl.ir import core
from tldsl.ir.opdefs import NOTIFY_OPS, WAIT_OPS, DEFAULT_MEMORY_SCOPE
from tldsl.ir.semantics import ARITH, wait_target, wrap_i32
from tldsl.kernel import TensorSpec as S
from tldsl.ops.moe import (allgather_moe, make_allgather_case, moe_num_tiles, moe_reduce_scatter, moe_routing,
                           random_routing)

import host_build

INCLUDE = Path(__file__).resolve().parent.parent / "codegen" / "include"
_OK, _WHY = tcm.toolchain_available()
needs_nvrtc = pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler (g++)")

#: Spill budget of every generated MoE kernel.
SPILL_BUDGET_BYTES = 0
MAX_REGISTERS_GEMM = 168
MAX_REGISTERS_COMBINE = 64


# -- traced kernels ------------------------------------------------------------------------------

def trace_ag(tile=(128, 128, 64), stages=4, order="row_major", dt=tl.float16, W=4, Ms=256, K=512, Nr=384, E=8,
             topk=2, comm=None, group_m=8, cluster=(1, 1), stage_rows=False):
    BM = tile[0]
    T = W * Ms
    NT = moe_num_tiles(T * topk, E, BM)
    c = tl.ComputeSchedule(tile=tile, stages=stages, order=order, group_m=group_m, cluster=cluster)
    return allgather_moe.trace(W, S((Ms, K), dt), S((E, K, Nr), dt), S((NT,), tl.int32), S((NT,), tl.int32),
                               S((NT, 2), tl.int32), S((NT,), tl.int32),
                               S((NT * BM,), tl.int32), S((NT * BM, Nr), dt), compute=c,
                               comm=comm or tl.CommSchedule(tile_m=64, mode="pull"), stage_rows=stage_rows)


def trace_rs(tile=(128, 128, 64), stages=4, order="row_major", dt=tl.float16, W=4, Ms=256, K=512, Nr=384, E=8,
             topk=2, comm=None, group_m=8, cluster=(1, 1), partial_dtype="f32"):
    BM = tile[0]
    T = W * Ms
    NT = moe_num_tiles(T * topk, E, BM)
    TT = -(-T // BM)
    c = tl.ComputeSchedule(tile=tile, stages=stages, order=order, group_m=group_m, cluster=cluster)
    return moe_reduce_scatter.trace(
        W, S((NT * BM, Nr), dt), S((E, Nr, K), dt), S((T, topk), tl.float32), S((NT,), tl.int32),
        S((NT,), tl.int32), S((topk * T,), tl.int32), S((NT, min(BM, TT)), tl.int32), S((NT,), tl.int32), S((TT,), tl.int32),
        S((Ms, K), dt), compute=c, comm=comm or tl.CommSchedule(tile_m=64, order="ring", mode="push"),
        partial_dtype=partial_dtype)


# -- host side: recognition and the parameter contract ---------------------------------------------

def test_allgather_moe_lowering_contract():
    k = trace_ag()
    lw = lower_grouped_gemm(k, "grouped_gemm")
    assert isinstance(lw, LoweredGroupedGemm) and lw.kind == "grouped_gemm"
    c = lw.config
    assert (c.BM, c.BN, c.BK, c.stages, c.consumer_wgs, c.threads) == (128, 128, 64, 4, 2, 384)
    assert (c.producer_regs, c.consumer_regs) == (56, 224)          # the gathering producer keeps row ids
    assert lw.gather and lw.batched and lw.store_inactive           # h's unused tiles get zeros
    assert (lw.M, lw.N, lw.K) == (1024, 384, 512) and lw.grid_tiles == (k.part("grouped_gemm").grid)
    assert [p.name for p in lw.params] == ["tma_b", "tma_c", "ptr_x_gathered", "rank", "launch",
                                          "sig_gather_x_ready", "tbl_tile_expert", "tbl_sorted_token_ids",
                                          "tbl_tile_valid_rows", "tbl_tile_tokens"]
    assert [p.source for p in lw.params] == ["tma:tma_b", "tma:tma_c", "buffer:x_gathered", "rank", "launch",
                                            "signal:gather_x_ready", "buffer:tile_expert",
                                            "buffer:sorted_token_ids", "buffer:tile_valid_rows",
                                            "buffer:tile_tokens"]
    assert [p.kind for p in lw.params] == ["tma", "tma", "ptr", "i32", "u64", "ptr", "ptr", "ptr", "ptr", "ptr"]
    assert lw.signals == ("gather_x_ready",) and lw.signal_slots == {"gather_x_ready": 16}
    assert lw.tables == ("tile_expert", "sorted_token_ids", "tile_valid_rows", "tile_tokens")
    # rows past the tile's valid rows are stored as zeros: a tile of at most 64 runs as a half tile
    assert c.half_tiles and "int valid_rows(int pid0, int pid1)" in lw.source
    assert "kHalfTiles = true" in lw.source and "using GmmaHalf = cute::SM90::GMMA::MMA_64x64x16_F32F16F16_SS<" \
        in lw.source and "kRowLimit = true" in lw.source
    # A gathered by the producer: the two consumer warpgroups share each tile (no ping-pong)
    assert not c.pingpong and c.m_blocks == 1 and "kPingPong = false" in lw.source
    assert lw.buffers["x_gathered"] == ((1024, 512), "f16") and lw.buffers["tile_tokens"] == ((23, 2), "i32")
    b, cc = lw.tma
    # w1 [E, K, Nr] as a 3-d TMA tensor, one expert's (BK, BN) box at a time
    assert (b.buffer, b.global_dims, b.global_strides, b.box_dims, b.swizzle) == \
        ("w1", (384, 512, 8), (768, 512 * 768), (64, 64, 1), "CU_TENSOR_MAP_SWIZZLE_128B")
    assert (cc.buffer, cc.global_dims, cc.box_dims) == ("h", (384, 23 * 128), (64, 64))
    assert lw.waits == 1 and lw.notifies == 0 and lw.wait_scopes == ("gpu",)
    src = lw.source
    assert "kGather = true, kBatched = true, kStoreInactive = true" in src
    assert f"Tr::kSmemBytes == {lw.smem_bytes}" in src and "Tr::kFullArrivals == 129" in src
    assert "tldsl::wait_at_least<tldsl::kScopeGpu>(sig_gather_x_ready + " in src and "* launch" in src
    assert "tldsl::grouped::ld1(tbl_sorted_token_ids, " in src            # the gathered rows, bounds-checked
    assert "void notifies" not in src                                     # nothing to notify
    # every generated line of the Prog members points at the tile program
    prog = src.split("struct Prog {")[1].split("\n};")[0]
    code = [l for l in prog.splitlines() if l.startswith("    ") and l.strip().startswith(("const ", "tldsl::",
                                                                                        "for ", "if "))]
    assert code and all("// tldsl: " in l and "moe.py:" in l for l in code)
    assert lw.grid(132) == (69, 1, 1) and lw.block == (384, 1, 1)
    assert "grouped GEMM, A gathered rows (cp.async)" in lw.describe()


@pytest.mark.parametrize("comm,wait,scope", [
    (tl.CommSchedule(tile_m=64, mode="push", order="full_mesh"), "peer_tile_wait", "sys"),
    (tl.CommSchedule(tile_m=128, mode="pull"), "consumer_tile_wait", "gpu"),
    (tl.CommSchedule(engine="copy_engine"), "rank_wait", "sys"),
])
def test_allgather_moe_waits_follow_the_comm_schedule(comm, wait, scope):
    lw = lower_grouped_gemm(trace_ag(comm=comm), "grouped_gemm")
    assert lw.wait_scopes == (scope,) and f"// {wait}" in lw.source
    assert f"tldsl::wait_at_least<tldsl::kScope{scope.capitalize()}>" in lw.source


def test_moe_reduce_scatter_gemm_contract():
    k = trace_rs()
    lw = lower_grouped_gemm(k, "grouped_gemm")
    assert not lw.gather and lw.batched and not lw.store_inactive     # skipped tiles store nothing
    # y_sorted in the operands' dtype (rounded as torch's _grouped_mm returns its rows)
    assert lw.config.out_dtype == "f16" and (lw.config.producer_regs, lw.config.consumer_regs) == (40, 232)
    assert [p.name for p in lw.params] == ["tma_a", "tma_b", "tma_c", "rank", "launch", "sig_y_ready",
                                          "tbl_tile_expert", "tbl_tile_valid_rows", "tbl_tile_num_token_tiles",
                                          "tbl_tile_token_tiles"]
    assert lw.config.half_tiles and "kRowLimit = true" in lw.source
    # A by TMA and a 128 x 128 tile's accumulators fit one warpgroup: the two take whole tiles in turns
    # (ping-pong), a half tile one m64 block of the tile's 64 x 128 WGMMA (no half-width atom); one
    # deferred-notify ring per warpgroup
    cfg = lw.config
    assert cfg.pingpong and cfg.m_blocks == 2 and cfg.acc_per_thread == 128 and cfg.notify_slots == 4
    assert "kPingPong = true" in lw.source and "GmmaHalf" not in lw.source
    assert "using Gmma = cute::SM90::GMMA::MMA_64x128x16_F32F16F16_SS<" in lw.source
    assert "ping-pong" in lw.describe()
    # 128 x 256 tiles: each warpgroup on 64 rows of every tile (cooperative), two half-width atoms for half tiles
    wide = lower_grouped_gemm(trace_rs(tile=(128, 256, 64), stages=3), "grouped_gemm").config
    assert not wide.pingpong and wide.m_blocks == 1 and wide.notify_slots == 2 and wide.half_tiles
    a, b, c = lw.tma
    assert (a.buffer, a.global_dims, a.box_dims) == ("h", (384, 23 * 128), (64, 128))
    assert (b.buffer, b.global_dims, b.box_dims) == ("w2", (512, 384, 8), (64, 64, 1))
    assert (c.buffer, c.data_type, c.box_dims) == ("y_sorted", "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", (64, 64))
    assert lw.waits == 0 and lw.notifies == 1 and lw.signals == ("y_ready",)
    src = lw.source
    assert "kStoreInactive = false" in src and "void waits" not in src
    # only the hook the template calls: the notifier warp's, every lane fencing, then taking every 32nd
    # token tile of the loop (the one-thread copy is not emitted: NVRTC would warn it unused)
    assert "void notifies(int pid0, int pid1)" not in src and "kNotifierWarp = true" in src
    lanes = src.split("void notifies_lanes(int pid0, int pid1, int lane) const {")[1].split("\n  }\n")[0]
    assert "#pragma unroll 1" in lanes                                     # table-driven loop stays a loop
    assert lanes.index("tldsl::fence_acq_rel<tldsl::kScopeGpu>") < lanes.index("tldsl::red_relaxed_add")
    assert re.search(r"for \(int (i_\d+) = 0 \+ lane \* 1; \1 < (t_\d+); \1 = unsigned\(\2\) - unsigned\(\1\) > unsigned\(32 \* 1\) \? \1 \+ 32 \* 1 : \2\)",
                     lanes)
    assert "kNotifiesGuarded = true" in src                                # unused tiles are not handed over
    assert "if (lane == 0)" not in lanes                                   # every add is in the loop


def test_combine_contract():
    k = trace_rs(comm=tl.CommSchedule(tile_m=64, order="ring", mode="push"), order="comm_aligned")
    lw = lower_combine(k, "combine")
    assert isinstance(lw, LoweredCombine) and lw.kind == "combine"
    assert [p.name for p in lw.params] == ["ptr_y_sorted", "out_partial", "rank", "launch", "sig_y_ready",
                                          "sig_reduce_scatter_ready", "tbl_token_tile_producers", "tbl_token_pos",
                                          "ptr_topk_weights"]
    ctypes = {p.name: p.ctype for p in lw.params}
    # y_sorted is written by the grouped GEMM while the combine runs: never __restrict__ / non-coherent
    assert ctypes["ptr_y_sorted"] == "const __half*" and ctypes["out_partial"] == "float* __restrict__"
    assert ctypes["tbl_token_pos"] == "const int* __restrict__"
    assert lw.buffers == {"y_sorted": ((23 * 128, 512), "f16"), "partial": ((1024, 512), "f32"),
                          "token_tile_producers": ((8,), "i32"), "token_pos": ((2048,), "i32"),
                          "topk_weights": ((1024, 2), "f32")}
    assert lw.grid_tiles == (8, 4) and lw.tile == (128, 128) and lw.block == (1024, 1, 1) and lw.smem_bytes == 0
    assert lw.align_shift == k.part("combine").align_shift == 1 and "kOrder = 2" in lw.source
    assert lw.waits == 1 and lw.notifies == 1 and lw.wait_scopes == ("gpu",)
    assert lw.signal_slots == {"y_ready": 32, "reduce_scatter_ready": 16}
    assert lw.grid(132) == (32, 1, 1) and lw.grid(4, ctas_per_sm=2) == (8, 1, 1)


def test_combine_folded_into_the_grouped_gemm_contract():
    """``side="combine"``: one kernel whose parameters are the GEMM's then the combine's others,
    the combine's Cfg and Prog beside the GEMM's (96 threads: the producer's spare warps), more
    registers for the producer warpgroup, both parts' waits and notifies."""
    k = trace_rs(tile=(128, 256, 64), order="swizzled", group_m=1000)
    lg, lc = lower_grouped_gemm(k, "grouped_gemm"), lower_combine(k, "combine")
    lf = lower_grouped_gemm(k, "grouped_gemm", side="combine")
    assert lf.side == "combine" and lg.side is None and lf.side_tiles == lc.grid_tiles
    assert [p.name for p in lf.params] == [p.name for p in lg.params] + [
        p.name for p in lc.params if p.name not in {q.name for q in lg.params}]
    assert {p.name: p.ctype for p in lf.params}["ptr_y_sorted"] == "const __half*"      # never __restrict__
    assert {p.name: p.ctype for p in lf.params}["out_partial"] == "float*"      # stores released mid-kernel
    assert (lf.config.producer_regs, lf.config.consumer_regs) == (104, 200)
    # no half tiles with a part folded in (the GEMM alone has them): measured slower folded
    assert lg.config.half_tiles and not lf.config.half_tiles and "kHalfTiles = false" in lf.source
    assert lf.waits == 1 and lf.notifies == 2 and lf.wait_scopes == ("gpu",)
    assert lf.signal_slots == {**lg.signal_slots, **lc.signal_slots}
    assert lf.buffers == {**lg.buffers, **lc.buffers} and lf.grid(132) == lg.grid(132)
    assert lf.tables == lg.tables + tuple(t for t in lc.tables if t not in lg.tables)      # i32 tables only
    assert "topk_weights" not in lf.tables and "token_pos" in lf.tables
    src = lf.source
    assert "struct SideCfg {" in src and "struct SideProg {" in src and "kEnabled = true" in src
    assert "kThreads = 96," in src and "item0 += 96" in src
    assert "grouped_gemm_kernel<Cfg, SideCfg>(" in src and "rank, prog, side);" in src
    # the combine's own kernel is as before: the folded one only adds
    assert "kEnabled" not in lc.source and "kThreads = 1024," in lc.source


def test_register_splits_stay_within_the_ctas_registers():
    """setmaxnreg moves registers between warpgroups of one CTA: a consumer increase beyond what
    the producer's decrease frees waits forever (a hang, not an error). Every split the grouped
    GEMM plans fits the 168 x 384 registers ptxas gives a 384-thread CTA."""
    from tldsl.codegen.plan.grouped_gemm import GATHER_REGS, HELD_REGS, REGISTER_POOL, SIDE_REGS
    assert REGISTER_POOL == (65536 // 384) // 8 * 8 * 384
    for k, kw in ((trace_rs(tile=(128, 256, 64)), {}), (trace_rs(tile=(128, 256, 64)), {"side": "combine"}),
                  (trace_ag(tile=(128, 256, 64)), {})):
        c = lower_grouped_gemm(k, "grouped_gemm", **kw).config
        assert c.threads == 384 and 128 * c.producer_regs + 256 * c.consumer_regs <= REGISTER_POOL, (kw, c)
    for p, q in (GATHER_REGS, SIDE_REGS, HELD_REGS, (40, 232)):
        assert 128 * p + 256 * q <= REGISTER_POOL and p % 8 == 0 and q % 8 == 0


@pytest.mark.parametrize("side,texts", [
    ("nope", ["no part of that name", "'combine'"]),
    ("grouped_gemm", ["only another compute part"]),
    ("reduce_scatter", ["only another compute part"]),
])
def test_fold_rejections_name_the_part(side, texts):
    k = trace_rs()
    with pytest.raises(LoweringError) as e:
        lower_grouped_gemm(k, "grouped_gemm", side=side)
    for t in texts:
        assert t in str(e.value), str(e.value)


def test_fold_refused_where_the_gemm_gathers_or_the_two_wait_on_each_other(monkeypatch):
    """A gathered A keeps every producer thread busy; two parts waiting on each other could, in
    one kernel, wait forever on tiles queued behind their own (checked before anything is
    planned). One way round is folded: the GEMM notifying the combine, the gather notifying the
    GEMM."""
    from dataclasses import replace
    import tldsl.codegen.plan.grouped_gemm as pg
    from tldsl.codegen.match.grouped_gemm import match_grouped_gemm
    k = trace_rs()
    gp = k.part("grouped_gemm")
    m = match_grouped_gemm(k, gp)
    with pytest.raises(LoweringError) as e:
        pg.plan_side(k, gp, replace(m, gather=True), "combine", None)
    assert "gathers its A rows" in str(e.value) and "loaded by TMA" in str(e.value)
    assert pg.plan_side(k, gp, m, "combine", None).part.name == "combine"          # combine waits on the GEMM
    kst = trace_ag(stage_rows=True)
    gst = kst.part("grouped_gemm")
    assert pg.plan_side(kst, gst, match_grouped_gemm(kst, gst), "gather_rows", None).part.name == "gather_rows"
    # both ways round (the combine also notifying something the GEMM waits on)
    graph = {"grouped_gemm": {"combine"}, "combine": {"grouped_gemm"}}
    monkeypatch.setattr(pg, "waits_on", lambda kernel: graph)
    with pytest.raises(LoweringError) as e:
        pg.plan_side(k, gp, m, "combine", None)
    assert "'grouped_gemm' and 'combine' wait on each other" in str(e.value)
    assert "wait on each other forever" in str(e.value)


def test_fold_refused_where_the_sides_tiles_wait_on_each_other(monkeypatch):
    """Folded, a part's tiles run in a fixed order on the GEMM's CTAs' spare warps: tiles waiting
    for tiles of the same part could wait on one queued behind them (its own kernel would have had
    them all resident, or been refused)."""
    import tldsl.codegen.plan.grouped_gemm as pg
    from tldsl.codegen.match.grouped_gemm import match_grouped_gemm
    k = trace_rs()
    gp = k.part("grouped_gemm")
    m = match_grouped_gemm(k, gp)
    monkeypatch.setattr(pg, "self_signals", lambda part: ["chain"] if part.name == "combine" else [])
    with pytest.raises(LoweringError) as e:
        pg.plan_side(k, gp, m, "combine", None)
    assert "tiles of 'combine' wait on each other (signals ['chain'])" in str(e.value)
    assert "queued behind it" in str(e.value)


def test_fold_refused_where_the_two_wait_on_each_other_through_another_part(monkeypatch):
    """Only a path through a third part closes the cycle (GEMM -> relay -> combine -> GEMM):
    the refusal follows waits transitively, not just each part's own waits."""
    import tldsl.codegen.plan.grouped_gemm as pg
    from tldsl.codegen.match.grouped_gemm import match_grouped_gemm
    k = trace_rs()
    gp = k.part("grouped_gemm")
    m = match_grouped_gemm(k, gp)
    graph = {"grouped_gemm": {"relay"}, "relay": {"combine"}, "combine": {"grouped_gemm"}}
    monkeypatch.setattr(pg, "waits_on", lambda kernel: graph)
    with pytest.raises(LoweringError) as e:
        pg.plan_side(k, gp, m, "combine", None)
    assert "wait on each other" in str(e.value) and "through other parts" in str(e.value)
    graph["relay"] = set()                                  # the path cut: the fold is planned
    assert pg.plan_side(k, gp, m, "combine", None).part.name == "combine"


def test_row_gather_folded_into_the_grouped_gemm_contract():
    """``side="gather_rows"`` (AllGather+MoE with its rows staged): the row gather runs on the
    producer's spare warps ahead of the GEMM tiles that wait for its rows, which the GEMM then
    loads by TMA; the gather writes the staged rows (never read through a pointer here), reads
    the gathered tokens coherently (the all-gather writes them while the kernel runs)."""
    k = trace_ag(tile=(128, 256, 64), order="swizzled", stage_rows=True)
    lg, lr = lower_grouped_gemm(k, "grouped_gemm"), lower_combine(k, "gather_rows")
    lf = lower_grouped_gemm(k, "grouped_gemm", side="gather_rows")
    assert not lg.gather and lf.side == "gather_rows" and lf.side_tiles == lr.grid_tiles
    assert [p.name for p in lf.params] == [p.name for p in lg.params] + [
        p.name for p in lr.params if p.name not in {q.name for q in lg.params}]
    ctypes = {p.name: p.ctype for p in lf.params}
    assert ctypes["ptr_x_gathered"] == "const __half*" and ctypes["out_x_sorted"] == "__half*"   # never restrict
    assert "tma_a" in ctypes and "ptr_x_sorted" not in ctypes                 # the GEMM's A: by TMA
    assert (lf.config.producer_regs, lf.config.consumer_regs) == (104, 200)
    assert lg.config.half_tiles and not lf.config.half_tiles and "kHalfTiles = false" in lf.source
    assert lf.waits == lg.waits + lr.waits and lf.notifies == lg.notifies + lr.notifies
    assert lf.signal_slots == {**lg.signal_slots, **lr.signal_slots}
    assert lf.buffers == {**lg.buffers, **lr.buffers} and lf.grid(132) == lg.grid(132)
    assert "sorted_token_ids" in lf.tables
    assert "folded in: row-gather part 'gather_rows'" in lf.describe()
    src = lf.source
    assert "struct SideCfg {" in src and "kEnabled = true" in src and "kThreads = 96," in src
    # 4096 items a tile: 96 threads take them five at a time, the last group skipping those past the
    # tile (no table read, no store into the next tile's rows); 1024 threads divide them: no guards
    guards = ("if (item >= 4096) continue;", "if (item >= 4096) break;")
    assert "item0 < 4096; item0 += 480)" in src and all(g in src for g in guards)
    assert "item0 < 4096; item0 += 4096)" in lr.source and not any(g in lr.source for g in guards)


def test_a_scaled_combine_folded_with_a_partial_last_group():
    """A top-1 combine (one weighted row a token) folded: several items at once on 96 threads, the
    items past the tile read no weight (0, never the next tile's) and store nothing."""
    k = trace_rs(tile=(128, 256, 64), order="swizzled", topk=1)
    lf, lc = lower_grouped_gemm(k, "grouped_gemm", side="combine"), lower_combine(k, "combine")
    total = 128 * 256 // lc.vec
    for text in ("w_[g_][j_] = 0.0f;", f"if (item >= {total}) continue;", f"if (item >= {total}) break;"):
        assert text in lf.source and text not in lc.source, text


def test_dispatcher_routes_the_moe_parts():
    kag, krs = trace_ag(), trace_rs()
    assert pick_recipe(kag, kag.part("grouped_gemm")).recipe.name == "grouped_gemm"
    assert pick_recipe(krs, krs.part("grouped_gemm")).recipe.name == "grouped_gemm"
    assert pick_recipe(krs, krs.part("combine")).recipe.name == "combine"
    for k, comm in ((kag, "gather_x"), (krs, "reduce_scatter")):
        for match in (match_grouped_gemm, match_combine):
            _raises(lambda: match(k, k.part(comm)), "is a comm part")
    assert isinstance(dispatch_lower(kag, "grouped_gemm"), LoweredGroupedGemm)
    assert isinstance(dispatch_lower(krs, "grouped_gemm"), LoweredGroupedGemm)
    assert isinstance(dispatch_lower(krs, "combine"), LoweredCombine)
    with pytest.raises(LoweringError, match="combine recipe .* takes no option cluster"):
        dispatch_lower(krs, "combine", cluster=(1, 1))          # a combine has no clusters: not ignored silently


def test_schedule_drives_the_template():
    for order, code in (("row_major", 0), ("swizzled", 1), ("comm_aligned", 2)):
        for trace in (trace_ag, trace_rs):
            lw = lower_grouped_gemm(trace(order=order, group_m=4, tile=(128, 64, 32), stages=6), "grouped_gemm")
            assert f"kOrder = {code}, kGroupM = 4" in lw.source
            assert "BM = 128, BN = 64, BK = 32" in lw.source and "kStages = 6" in lw.source
            assert lw.config.SA == 64                                       # 32 halfs of K: 64-byte swizzle
    # (in pairs: 64-row tiles without clusters run paired on 128-row CTA tiles)
    lw = lower_grouped_gemm(trace_ag(tile=(64, 128, 64), cluster=(2, 1)), "grouped_gemm")
    assert lw.config.consumer_wgs == 1 and (lw.config.producer_regs, lw.config.consumer_regs) == (0, 0)
    assert "Tr::kUnitsA == 8 && Tr::kRowStep == 16" in lw.source


def _raises(fn, *texts):
    with pytest.raises(LoweringError) as ei:
        fn()
    for t in texts:
        assert t in str(ei.value), str(ei.value)
    return ei.value


def test_schedule_limits_are_reported():
    _raises(lambda: lower_grouped_gemm(trace_ag(tile=(32, 128, 64)), "grouped_gemm"), "BM=32")
    _raises(lambda: lower_grouped_gemm(trace_ag(tile=(128, 256, 128), stages=4), "grouped_gemm"), "shared memory")
    _raises(lambda: lower_grouped_gemm(trace_ag(K=516), "grouped_gemm"), "16-byte aligned rows")
    _raises(lambda: lower_grouped_gemm(trace_ag(dt=tl.float32), "grouped_gemm"), "f16 or both bf16")
    _raises(lambda: lower_grouped_gemm(trace_rs(K=514), "grouped_gemm"), "16-byte aligned rows")


# -- rejections point at the user's line -------------------------------------------------------------

@tl.kernel
def gathered(x, w, tile_expert, ids, h, *, compute: tl.ComputeSchedule = None, variant: tl.constexpr = "ok"):
    T, K = x.shape
    E, _, N = w.shape
    BM, BN, BK = compute.tile
    NT = tile_expert.shape[0]
    ready = tl.signal("ready", NT)
    done = tl.signal("done", NT)
    done2 = tl.signal("done2", NT, scope="symmetric") if variant == "peer_notify" else None

    @tl.comm_part(grid=(NT,))
    def feed(t):
        if variant == "mask_ids_cycle":      # tile t's rows come once tile t - 1 is done
            with tl.when(t > 0):
                tl.consumer_tile_wait(done, t - 1, count=tl.cdiv(N, BN))
        tl.producer_tile_notify(ready, t)

    @tl.compute_part(grid=(NT, tl.cdiv(N, BN)))
    def gg(i, pn):
        e = tl.load_scalar(tile_expert, (i,))
        acc = tl.fragment((BM, BN), tl.float32)
        if variant == "wait_outside":
            tl.consumer_tile_wait(ready, i)
        with tl.when(e >= 0):
            if variant not in ("wait_after", "wait_outside"):
                tl.consumer_tile_wait(ready, i)
            if variant == "notify_before":
                tl.producer_tile_notify(done, i)
            rows = tl.load(ids, (i * BM,), (BM,))
            for k in tl.range(0, K, BK):
                ex = tl.minimum(e, k) if variant == "expert_in_loop" else e
                bc = pn * BN + 8 if variant == "shifted_b" else pn * BN
                acc += tl.dot(tl.load_rows(x, rows, k, BK), tl.load(w, (ex, k, bc), (BK, BN)))
            if variant == "wait_after":
                tl.consumer_tile_wait(ready, i)
        def rows_in():
            return tl.iota(BM)[:, None]
        out = {"exp": lambda: tl.exp(acc),
               "mask_rows": lambda: tl.where(rows_in() < e + 1, acc, 0.0),         # e + 1 rows kept
               "mask_written": lambda: tl.where(rows_in() < e + 1, acc, 0.0),
               "mask_ids": lambda: tl.where(rows_in() < tl.load_scalar(ids, (i * BM,)) + BM, acc, 0.0),
               "mask_ids_written": lambda: tl.where(rows_in() < tl.load_scalar(ids, (i * BM,)) + BM, acc, 0.0),
               "mask_ids_cycle": lambda: tl.where(rows_in() < tl.load_scalar(ids, (i * BM,)) + BM, acc, 0.0),
               "mask_negzero": lambda: tl.where(rows_in() < e, acc, -0.0),
               "mask_one": lambda: tl.where(rows_in() < e, acc, 1.0),
               "mask_swapped": lambda: tl.where(rows_in() < e, 0.0, acc),
               "mask_cols": lambda: tl.where(tl.iota(BN)[None, :] < e, acc, 0.0),
               "mask_ge": lambda: tl.where(rows_in() >= e, acc, 0.0),
               "mask_tile": lambda: tl.where(rows_in() < tl.load(ids, (i * BM,), (BM,))[:, None], acc, 0.0)}
        tl.store(h, (i * BM, pn * BN), out[variant]() if variant in out else acc)
        if variant == "peer_notify":
            tl.peer_tile_notify(done2, i, 0)
        elif variant == "nested_notify":         # notifies in nested loops under a condition
            for a in tl.range(0, e + 2):
                for b in tl.range(0, 2):
                    with tl.when(a > b):
                        tl.producer_tile_notify(done, i)
        elif variant != "notify_before":
            tl.producer_tile_notify(done, i)

    @tl.compute_part(grid=(NT,))
    def after(i):
        if variant != "peer_notify":
            tl.consumer_tile_wait(done, i, count=tl.cdiv(N, BN))
        if variant == "writes_w":           # B written while the GEMM runs
            tl.store(w, (0, 0, 0), tl.zeros((1, BK, BN), w.dtype))
        if variant in ("writes_table", "mask_written", "mask_ids_written"):   # the guard's table written meanwhile
            tl.store(tile_expert, (0,), tl.zeros((NT,), tl.int32))


def _trace_gathered(variant, tile=(128, 128, 64)):
    specs = (S((512, 256), tl.float16), S((4, 256, 256), tl.float16), S((8,), tl.int32), S((8 * 128,), tl.int32),
             S((8 * 128, 256), tl.float16))
    return gathered.trace_checked(1, specs, dict(compute=tl.ComputeSchedule(tile=tile), variant=variant),
                                  channels=False)


def _lanes_hook(k):
    """The notifier warp's copy of part 'gg''s notify hook, rendered from its plan (these parts wait
    and gather A: the template never runs a notifier warp for them)."""
    from tldsl.codegen.match.grouped_gemm import match_grouped_gemm
    from tldsl.codegen.plan.grouped_gemm import plan_grouped_gemm
    from tldsl.codegen.recipes.prog_hooks import HookEmitter
    from tldsl.ir.opdefs import NOTIFY_OPS
    part = k.part("gg")
    plan = plan_grouped_gemm(k, part, match_grouped_gemm(k, part))
    assert plan.waits and plan.match.gather
    return HookEmitter(plan, "test", NOTIFY_OPS, lanes=32).signal_fn("notifies_lanes")


def test_gathered_gemm_lowers_with_waits_and_notifies():
    lw = lower_grouped_gemm(_trace_gathered("ok"), "gg")
    assert lw.gather and lw.store_inactive and lw.waits == 1 and lw.notifies == 1
    assert lw.signals == ("ready", "done")
    # the notify sits after the (outside-the-guard) store: it runs for inactive tiles too
    notifies = lw.source.split("void notifies")[1].split("\n  }\n")[0]
    assert "if (" not in notifies and "tldsl::red_relaxed_add<tldsl::kScopeGpu>(sig_done + pid0_0, 1ull)" in notifies
    assert "kNotifiesGuarded = false" in lw.source      # a tile the guard skips still notifies
    # spread over a notifier warp's lanes, a notify outside any loop is lane 0's alone
    lanes = "\n".join(_lanes_hook(_trace_gathered("ok")))
    assert "if (lane == 0) tldsl::red_relaxed_add<tldsl::kScopeGpu>(sig_done + pid0_0, 1ull)" in lanes


def test_notifies_spread_over_lanes_take_the_outermost_loop_only():
    """The notifier warp's copy of the hook spreads only the outermost loop's iterations over its 32
    lanes; inner loops and conditions run whole in each lane, and no add is lane 0's alone."""
    lw = lower_grouped_gemm(_trace_gathered("nested_notify"), "gg")
    # (the code without its `// tldsl: file:line` markers, whose paths may hold any digits)
    lanes = re.sub(r"//[^\n]*", "", "\n".join(_lanes_hook(_trace_gathered("nested_notify"))))
    loops = re.findall(r"for \(int (i_\d+) = ([^;]*);", lanes)
    assert [start for _, start in loops] == ["0 + lane * 1", "0"]          # outer spread, inner whole
    assert "32 * 1" in lanes.split(loops[1][0])[0] and "32" not in lanes.split(f"for (int {loops[1][0]}")[1]
    assert "if (lane == 0)" not in lanes and lanes.count("tldsl::red_relaxed_add") == 1
    assert lanes.index("tldsl::fence_acq_rel") < lanes.index("for (")
    one = lw.source.split("void notifies(int pid0, int pid1) const {")[1].split("\n  }\n")[0]
    assert "lane" not in one and len(re.findall(r"for \(int i_\d+ = 0; ", one)) == 2



@pytest.mark.parametrize("trace,tile,pingpong,ring,smem", [
    # A by TMA, 2 x 64 accumulators a thread on one warpgroup; the notifier warp's two rings of two slots
    (trace_rs, (128, 128, 64), True, 4, 164992),
    (trace_rs, (128, 64, 64), False, 2, 132192),    # would fit one warpgroup, but only 128 x 128 is measured
    (trace_rs, (128, 256, 64), False, 2, 181328),   # 2 x 128 would not fit one warpgroup: both share each tile
    (lambda **kw: trace_rs(cluster=(2, 1), **kw), (64, 256, 64), False, 2, 197728),  # 64 rows: split columns
    (trace_ag, (128, 128, 64), False, 0, 164928),   # A gathered by the producer: its cp.asyncs set the pace
    (lambda **kw: trace_ag(stage_rows=True, **kw), (128, 128, 64), True, 0, 164928),   # staged rows, by TMA
], ids=["rs-128x128", "rs-128x64", "rs-128x256", "rs-64x256", "ag-gathered-128x128", "ag-staged-128x128"])
def test_ping_pong_where_a_whole_tile_fits_one_warpgroup_and_a_comes_by_tma(trace, tile, pingpong, ring, smem):
    stages = 3 if tile[:2] == (128, 256) else 4
    lw = lower_grouped_gemm(trace(tile=tile, stages=stages), "grouped_gemm")
    c = lw.config
    assert c.pingpong == pingpong and f"kPingPong = {'true' if pingpong else 'false'}" in lw.source
    assert c.acc_per_thread <= 128 and ("ping-pong" in lw.describe()) == pingpong
    # each warpgroup's m64 blocks of a tile: all of its rows ping-pong, its share of them otherwise
    assert c.m_blocks == (tile[0] // 64 if pingpong else 1)
    # the notify ring's slots (one ring per warpgroup in ping-pong; none without the notifier warp:
    # the AG GEMMs wait) and the shared memory the kernel asks for, in numbers (e.g. 128 x 128 x 64,
    # 4 stages of 16 + 16 KiB, 2 x 2 epilogue buffers of 8 KiB, 8 stage and 8 ring barriers, 1 KiB of
    # alignment slack: 131072 + 32768 + 64 + 64 + 1024)
    assert c.notify_slots == ring and c.smem_bytes == smem


def test_64_row_tiles_pair_into_128_row_cta_tiles_where_they_can():
    """A part of 64-row tiles (experts padded to 64 rows) runs on 128-row CTA tiles: two of one
    expert as one tile, any other as a half tile (``kPairRows``); where that cannot apply, the
    64-row tiles' consumer warpgroups split the columns."""
    k = trace_rs(tile=(64, 256, 64), stages=4)
    rs = lower_grouped_gemm(k, "grouped_gemm")
    c = rs.config
    assert c.pair_rows and (c.BM, c.half_tiles, c.split_n, c.pingpong, c.consumer_wgs) == (128, True, False, False, 2)
    assert c.group_m == 8                                    # slots of two 64-row tiles: 128 rows each
    assert "kPairRows = true" in rs.source and "two of one expert" in rs.describe()
    assert rs.grid_tiles == tuple(k.part("grouped_gemm").grid)        # the program's 64-row tiles
    assert {t.param: t.box_dims for t in rs.tma}["tma_a"] == (64, 128)   # A: 128 rows a CTA tile
    # 4 stages of 16 + 32 KiB, two warpgroups' two 8 KiB epilogue buffers, 8 stage and 4 ring
    # barriers, 1 KiB of alignment slack: 196608 + 32768 + 64 + 32 + 1024
    assert (c.epi_buffers, c.notify_slots, c.smem_bytes) == (2, 2, 230496)
    ag = lower_grouped_gemm(trace_ag(tile=(64, 256, 64), stages=4), "grouped_gemm")
    assert ag.config.pair_rows and ag.gather and ag.store_inactive     # gathered rows, unused tiles' zeros
    assert "int row(int pid0, int pid1, int r)" in ag.source
    # not paired: clusters (a pair of CTAs would hold a tile and its follower), a part folded in,
    # stages that do not fit 128-row tiles (5 x 48 KiB)
    for lw in (lower_grouped_gemm(trace_rs(tile=(64, 256, 64), stages=4, cluster=(2, 1)), "grouped_gemm"),
               lower_grouped_gemm(k, "grouped_gemm", side="combine"),
               lower_grouped_gemm(trace_rs(tile=(64, 256, 64), stages=5), "grouped_gemm")):
        assert not lw.config.pair_rows and lw.config.split_n and lw.config.BM == 64 and "kPairRows = false" in lw.source

@settings(max_examples=40, deadline=None)
@given(BN=st.sampled_from([64, 128, 256]), BK=st.sampled_from([32, 64]), stages=st.integers(2, 8),
       cluster=st.sampled_from([(1, 1), (2, 1)]), dt=st.sampled_from([tl.float16, tl.bfloat16]),
       rs=st.booleans())
def test_64_row_tiles_pair_exactly_where_128_row_tiles_fit(BN, BK, stages, cluster, dt, rs):
    """Over the schedules a user may write with 64-row tiles: they pair (128-row CTA tiles, half
    tiles, the order's groups in slots of two, the program's grid) exactly where there are no
    clusters and the same schedule at 128 rows fits with half tiles; else they run as 64 rows."""
    from tldsl.codegen.plan.grouped_gemm import half_tiles_fit
    from tldsl.codegen.plan.wgmma import SMEM_LIMIT, choose_config
    k = (trace_rs if rs else trace_ag)(tile=(64, BN, BK), stages=stages, cluster=cluster, dt=dt)
    try:
        lw = lower_grouped_gemm(k, "grouped_gemm")
    except LoweringError:
        return                                   # the 64-row schedule itself does not fit (tested elsewhere)
    c = lw.config
    try:
        tall = choose_config("t", tl.ComputeSchedule(tile=(128, BN, BK), stages=stages), dt.name, dt.name, K=512,
                             split_n=True, notify_slots=c.notify_slots)
        fits = half_tiles_fit(tall)
    except LoweringError:
        fits = False
    assert c.pair_rows == (cluster == (1, 1) and fits)
    if c.pair_rows:
        assert (c.BM, c.half_tiles, c.split_n, c.group_m, c.stages) == (128, True, False, 8, stages)
        assert c.smem_bytes <= SMEM_LIMIT and lw.grid_tiles == tuple(k.part("grouped_gemm").grid)
        assert lw.grid(132)[0] <= -(-lw.grid_tiles[0] // 2) * lw.grid_tiles[1]     # no more CTAs than slots
    else:
        assert c.BM == 64 and "kPairRows = false" in lw.source


def test_64_row_tiles_do_not_pair_where_the_roles_could_disagree_or_a_pair_wait_on_itself():
    """Pairing reads the guard and expert of a tile's neighbour in every role: not where another
    part writes them while the kernel runs. A pair waits for both its tiles before computing the
    first: not where a tile's rows wait (here through the part feeding them) on the tile before."""
    tile = (64, 128, 64)
    assert lower_grouped_gemm(_trace_gathered("mask_ids", tile), "gg").config.pair_rows
    for variant in ("mask_ids_written", "mask_ids_cycle"):
        lw = lower_grouped_gemm(_trace_gathered(variant, tile), "gg")
        assert not lw.config.pair_rows and lw.config.BM == 64 and lw.config.consumer_wgs == 1, variant


@pytest.mark.parametrize("variant,texts", [
    ("wait_after", ("'consumer_tile_wait' after the K loop",)),
    ("wait_outside", ("'consumer_tile_wait' outside the `tl.when` guard",)),
    ("notify_before", ("'producer_tile_notify' before the accumulator's store",)),
    ("expert_in_loop", ("must not depend on the K loop",)),
    ("shifted_b", ("B tile offsets must be (e, k, pid1*128)",)),
    ("exp", ("`tl.store(c, (i*BM, pn*BN), acc)`", "nothing else on the accumulator")),
    ("mask_one", ("may mask whole rows only", "the rows dropped must be the constant 0")),
    ("mask_negzero", ("the rows dropped must be the constant 0 (+0.0",)),
    ("mask_written", ("the row mask's count reads 'tile_expert', which another part writes",)),
    ("mask_swapped", ("may mask whole rows only", "the accumulator must be where's second operand")),
    ("mask_cols", ("may mask whole rows only", "the row index must be `tl.iota(128)[:, None]`")),
    ("mask_ge", ("may mask whole rows only", "the condition must be `row index < n`")),
    ("mask_tile", ("may mask whole rows only", "n must be an i32 scalar")),
])
def test_grouped_gemm_rejections_name_the_op_and_line(variant, texts):
    e = _raises(lambda: lower_grouped_gemm(_trace_gathered(variant), "gg"), "grouped GEMM lowering", *texts)
    assert e.loc is not None and e.loc.filename == __file__


def test_a_row_mask_is_the_tiles_valid_rows():
    """`tl.where(tl.iota(BM)[:, None] < n, acc, 0.0)` before the store: the kernel's valid_rows() is n
    (its index code emitted like any hook's), and a 128-row tile of two warpgroups may run half tiles."""
    lw = lower_grouped_gemm(_trace_gathered("mask_rows"), "gg")
    assert lw.config.half_tiles
    hook = lw.source.split("int valid_rows(int pid0, int pid1) const {")[1].split("\n  }\n")[0]
    assert "tbl_tile_expert[" in hook and re.search(r"const int (t_\d+) = \(t_\d+ \+ 1\);.*\n    return \1;", hook)
    assert "kRowLimit = true" in lw.source and "kHalfTiles = true" in lw.source
    plain = lower_grouped_gemm(_trace_gathered("ok"), "gg")
    assert not plain.config.half_tiles and "kRowLimit = false" in plain.source and "valid_rows" not in plain.source
    # 64-row tiles in clusters (their warpgroups split columns already) mask rows but run no half tiles
    # (without clusters they pair into 128-row CTA tiles: test_64_row_tiles_pair_into_128_row_cta_tiles...)
    k = trace_rs(tile=(64, 256, 64), cluster=(2, 1))
    lw64 = lower_grouped_gemm(k, "grouped_gemm")
    assert lw64.config.split_n and not lw64.config.half_tiles and "kRowLimit = true" in lw64.source


def test_clusters_of_two_tiles_share_b():
    for trace in (trace_ag, trace_rs):
        lw = lower_grouped_gemm(trace(cluster=(2, 1)), "grouped_gemm")
        gm, gn = lw.grid_tiles
        assert lw.config.cluster == (2, 1) and lw.cluster_dims == (2, 1, 1) and "kClusterM = 2;" in lw.source
        assert "cluster (2, 1)" in lw.describe()
        # a whole number of clusters, never more than cluster tiles (pairs of tile rows), one CTA per SM
        assert lw.grid(132) == (2 * min(66, -(-gm // 2) * gn), 1, 1) and lw.grid(7) == (6, 1, 1)
    lw = lower_grouped_gemm(trace_ag(), "grouped_gemm", cluster=(2, 1))      # the option overrides the schedule
    assert lw.cluster_dims == (2, 1, 1) and lower_grouped_gemm(trace_ag(), "grouped_gemm").cluster_dims == (1, 1, 1)
    assert lower_grouped_gemm(trace_ag(), "grouped_gemm").grid(132) == (69, 1, 1)


@pytest.mark.parametrize("variant,texts", [
    ("writes_w", ("cluster (2, 1): B ('w') is written by another part",)),
    ("writes_table", ("the tile guard or the expert reads 'tile_expert', which another part writes",)),
])
def test_clusters_refused_where_the_pair_could_disagree(variant, texts):
    k = _trace_gathered(variant)
    assert lower_grouped_gemm(k, "gg").cluster_dims == (1, 1, 1)          # fine without clusters
    e = _raises(lambda: lower_grouped_gemm(k, "gg", cluster=(2, 1)), "grouped GEMM lowering", *texts)
    assert e.loc is not None and e.loc.filename == __file__


def test_peer_notify_in_a_compute_part_is_rejected():
    k = _trace_gathered("peer_notify")
    e = _raises(lambda: lower_grouped_gemm(k, "gg"), "'peer_tile_notify' notifies another rank's copy")
    assert e.loc.filename == __file__ and "peer_tile_notify" in e.loc.source


@tl.kernel
def combine_like(y, pos, wts, out, *, compute: tl.ComputeSchedule = None, variant: tl.constexpr = "ok"):
    R, Kc = y.shape
    T, topk = wts.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(T, BM), tl.cdiv(Kc, BN)))
    def comb(j, pn):
        m0, c0 = j * BM, pn * BN
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, topk):
            rows = tl.load(pos, (k * T + m0,), (BM,))
            col = pn * pn * BN if variant == "sq_col" else c0 + {"odd_col": 2, "col1": 1, "col4": 4}.get(variant, 0)
            g = tl.load_rows(y, rows, col, BN)
            if variant == "unscaled":
                acc += g
                continue
            if variant == "per_col":
                s = tl.load(wts, (k, c0), (1, BN))
            elif variant == "f16":
                s = tl.cast(tl.load(wts, (m0, k), (BM, 1)), tl.float16)
            elif variant == "dot":
                s = tl.dot(tl.load(wts, (m0, k), (BM, 1)), tl.load(wts, (k, 0), (1, 1)))
            else:
                s = tl.load(wts, (m0, k), (BM, 1))
            acc += g * s
        tl.store(out, (m0, c0), acc)


def _trace_combine(variant, ydt=tl.float32, topk=2, tile=(64, 64, 16)):
    specs = (S((512, 256), ydt), S((topk * 300,), tl.int32), S((300, topk), tl.float32), S((300, 256), tl.float32))
    return combine_like.trace_checked(1, specs, dict(compute=tl.ComputeSchedule(tile=tile), variant=variant),
                                      channels=False)


@needs_gxx
@pytest.mark.parametrize("variant,ydt,topk,in_flight,vec,tile,items", [
    ("ok", tl.float32, 2, True, 4, (64, 64, 16), 1), ("ok", tl.bfloat16, 8, True, 8, (64, 64, 16), 1),
    ("unscaled", tl.float16, 3, True, 8, (64, 64, 16), 1),
    ("ok", tl.float32, 12, False, 4, (64, 64, 16), 1),   # more rows than the gathers kept in flight: as written
    ("ok", tl.bfloat16, 12, False, 8, (64, 64, 16), 1),
    ("col4", tl.bfloat16, 2, True, 4, (64, 64, 16), 1),  # 16-bit rows from a column offset of 4: 4-wide loads
    # 128x256 tiles: 4 items a thread (8 of 4 columns), gathered together as far as 8 gathers and
    # 40 values in flight allow
    ("unscaled", tl.bfloat16, 1, True, 8, (128, 256, 16), 4), ("ok", tl.float32, 1, True, 4, (128, 256, 16), 8),
    ("ok", tl.float32, 2, True, 4, (128, 256, 16), 2), ("ok", tl.bfloat16, 2, True, 8, (128, 256, 16), 1),
    ("ok", tl.bfloat16, 12, False, 8, (128, 256, 16), 1),
    # column offsets no multiple of 4: 2 or 1 columns a thread
    ("odd_col", tl.float32, 2, True, 2, (64, 64, 16), 2), ("odd_col", tl.bfloat16, 3, True, 2, (64, 64, 16), 2),
    ("col1", tl.float16, 3, True, 1, (64, 64, 16), 2), ("col1", tl.float32, 12, False, 1, (64, 64, 16), 1),
])
def test_combine_body_sums_like_numpy(tmp_path, variant, ydt, topk, in_flight, vec, tile, items):
    """The combine's body on the host, every thread of every tile: the gathers of one item or of
    several issued before any is used (a short loop of constant bounds) or one by one, 1, 2, 4 or
    8 columns a thread (8: 16-bit rows whose column offsets are multiples of 8; 1 and 2: offsets no
    multiple of 4), against numpy; rows
    < 0 read zero, columns past the gathered tensor's read zero and the store's rows past T are
    dropped."""
    from tldsl.codegen.recipes.combine import MAX_GATHERS_IN_FLIGHT, items_at_once
    from tldsl.codegen.plan.combine import COMBINE_THREADS
    lw = lower_combine(_trace_combine(variant, ydt, topk, tile))
    assert ("x_[g_][j_]" in lw.source) == in_flight and (topk <= MAX_GATHERS_IN_FLIGHT) == in_flight
    assert f"float acc_[{items}][{vec}]" in lw.source and (items == 1 or items * topk <= MAX_GATHERS_IN_FLIGHT)
    plan = SimpleNamespace(match=SimpleNamespace(BMf=tile[0], BNf=tile[1]), vec=vec, threads=COMBINE_THREADS)
    assert items_at_once(plan,
                         topk if in_flight else None) == items
    assert lw.vec == vec and f"loadv<{vec}>" in lw.source and f"storev<{vec}>" in lw.source
    assert f"x {vec} columns" in lw.describe()
    rng = np.random.default_rng(topk)
    T, R, Kc = 300, 512, 256
    y = rng.standard_normal((R, Kc)).astype(np.float32)
    if ydt != tl.float32:
        y = (_bf16_bits(y).astype(np.uint32) << 16).view(np.float32) if ydt == tl.bfloat16 else \
            y.astype(np.float16).astype(np.float32)
    pos = rng.integers(-1, R, size=topk * T).astype(np.int32)
    wts = rng.standard_normal((T, topk)).astype(np.float32)
    out = np.full((T, Kc), np.nan, np.float32)
    _, got = _run_host(tmp_path, lw, dict(y=y, pos=pos, wts=wts, out=out), gemm=False)
    shift = {"col4": 4, "odd_col": 2, "col1": 1}.get(variant, 0)
    if shift:                             # the gather reads columns c0 + shift ..: the last ones past y's end
        y = np.concatenate([y[:, shift:], np.zeros((R, shift), np.float32)], axis=1)
    gathered = np.where(pos[:, None] >= 0, y[np.maximum(pos, 0)], 0).reshape(topk, T, Kc)
    scale = np.ones((T, topk), np.float32) if variant == "unscaled" else wts
    want = np.einsum("tk,ktn->tn", scale, gathered)
    np.testing.assert_allclose(got.reshape(T, Kc), want, rtol=1e-5, atol=1e-5)


def test_combine_like_part_lowers():
    lw = lower_combine(_trace_combine("ok"))
    assert lw.waits == 0 and lw.notifies == 0 and lw.signals == ()
    assert "void waits" not in lw.source and "void notifies" not in lw.source
    assert [p.name for p in lw.params] == ["ptr_y", "out_out", "rank", "launch", "tbl_pos", "ptr_wts"]
    assert lw.params[0].ctype == "const float*"             # gathered rows: coherent loads, never .nc


@tl.kernel
def combine_exact_rows(y, pos, fr, wa, wb, sel, out, *, compute: tl.ComputeSchedule = None):
    """A combine whose per-row index and scale are float expressions: an f32 -> i32 cast (NaN and
    3e9 give INT_MIN: the row from ``pos`` then), and per ``sel`` 1 / max, 1 / min, //, % or a
    product plus a sum of the two scales."""
    R, Kc = y.shape
    T, topk = wa.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(T, BM), tl.cdiv(Kc, BN)))
    def comb(j, pn):
        m0, c0 = j * BM, pn * BN
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, topk):
            ci = tl.cast(tl.load(fr, (k * T + m0,), (BM,)), tl.int32)
            rows = tl.where(ci == -2147483648, tl.load(pos, (k * T + m0,), (BM,)), ci)
            a, b = tl.load(wa, (m0, k), (BM, 1)), tl.load(wb, (m0, k), (BM, 1))
            c = tl.load(sel, (m0, k), (BM, 1))
            s = tl.where(c == 0, 1.0 / tl.maximum(a, b), tl.where(c == 1, 1.0 / tl.minimum(a, b), tl.where(
                c == 2, a // b, tl.where(c == 3, a % b, a * b + a * 0.75))))
            acc += tl.load_rows(y, rows, c0, BN) * s
        tl.store(out, (m0, c0), acc)


def _combine_exact_case(T=100, R=64, Kc=64):
    rng = np.random.default_rng(5)
    nan, z = np.float32(np.nan), np.float32(0.0)
    fr = rng.uniform(-2, R, T).astype(np.float32)           # (rows past y are an error; below 0 read zero)
    fr[:6] = [nan, 3e9, -3e9, np.inf, -0.5, 63.9]
    probes = [(nan, 1, 0), (1, nan, 0), (-z, z, 0), (z, -z, 0), (nan, 1, 1), (1, nan, 1), (-z, z, 1), (z, -z, 1),
              (1, 0.1, 2), (-1, 0.1, 2), (1, 0.1, 3), (-1, 0.1, 3), (-7.5, 2, 2), (-7.5, 2, 3), (5, -z, 2), (5, -z, 3),
              (nan, 2, 2), (nan, 2, 3), (1.1, 3.3, 4), (nan, 1, 4)]
    wa = rng.standard_normal((T, 1)).astype(np.float32)
    wb = rng.standard_normal((T, 1)).astype(np.float32)
    sel = rng.integers(0, 5, (T, 1)).astype(np.float32)
    for i, (x, w, c) in enumerate(probes):
        wa[i, 0], wb[i, 0], sel[i, 0] = x, w, c
    return dict(y=rng.standard_normal((R, Kc)).astype(np.float32), pos=rng.integers(0, R, T).astype(np.int32),
                fr=fr, wa=wa, wb=wb, sel=sel, out=np.full((T, Kc), np.nan, np.float32))


def _lower_combine_exact(inp):
    specs = [S.of(inp[n]) for n in ("y", "pos", "fr", "wa", "wb", "sel", "out")]
    k = combine_exact_rows.trace_checked(1, specs, dict(compute=tl.ComputeSchedule(tile=(64, 64, 16))),
                                         channels=False)
    return lower_combine(k)


def test_per_row_float_expressions_use_the_exact_element_math():
    """Per-row float math is the general lowering's (``tldsl::gen``, element_math.hpp included): NaN-
    propagating max / min ordering -0 below +0, numpy's divmod, explicitly rounded products and
    sums (never an FMA), numpy's f32 -> i32; i32 index code keeps the index rules."""
    lw = _lower_combine_exact(_combine_exact_case())
    prog = _prog_struct(lw.source)
    assert '#include "tldsl/element_math.hpp"' in lw.source
    for fn in ("max_(", "min_(", "floordiv(", "mod(", "mul(", "add(", "div(", "f2i("):
        assert f"tldsl::gen::{fn}" in prog, fn
    assert not re.search(r"fminf|fmaxf|floorf|\(int\)\(t_\d+\)\s*;", prog), prog
    rows = [l for l in prog.splitlines() if "tldsl: " in l and "const float" in l and "grouped::ld" not in l]
    assert rows and not [l for l in rows if re.search(r"\bt_\d+ [-+*/] ", l)], rows   # no infix float math
    assert re.search(r"const int t_\d+ = \(i_\d+ \* 100\);", prog)                       # index code as before
    # the MoE programs' own per-row code (i32) is unchanged, without general.hpp
    for l in (lower_combine(trace_rs(), "combine"), lower_grouped_gemm(trace_rs(), "grouped_gemm", side="combine")):
        assert "tldsl::gen::" not in l.source and "general.hpp" not in l.source


@needs_gxx
def test_per_row_float_expressions_run_like_the_simulator(tmp_path):
    """The combine's Prog on the host, on the device headers' own element math, against the
    simulator bit for bit: NaN in max / min, -0 against +0, float // and % (numpy's divmod: 1 // 0.1
    is 9, not floorf's 10), a product plus a sum, casts of NaN / +-3e9 / inf to i32 (INT_MIN)."""
    inp = _combine_exact_case()
    lw = _lower_combine_exact(inp)
    with np.errstate(all="ignore"):
        want = tl.simulate(combine_exact_rows, 1, [inp], compute=tl.ComputeSchedule(tile=(64, 64, 16)))[0]["out"]
    _, got = _run_host(tmp_path, lw, inp, gemm=False, real_math=True)
    got = got.reshape(want.shape)
    assert np.isnan(want[:8]).any() and np.isinf(want).any()             # the probes reach the output
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


@pytest.mark.nvrtc
@needs_nvrtc
def test_per_row_float_expressions_compile_for_sm90a(tmp_path):
    """With general.hpp included, the combine compiles for sm_90a within its register budget, no
    spills; the per-row max / min are PTX's NaN-propagating ones (SASS FMNMX.NAN)."""
    lw = _lower_combine_exact(_combine_exact_case())
    ck = lw.compile(cache=KernelCache(tmp_path), progress=False)
    info = ck.ptxas_info()[ck.name]
    assert info["spill_store_bytes"] == info["spill_load_bytes"] == info["stack_bytes"] == 0, info
    assert info["registers"] <= MAX_REGISTERS_COMBINE, info
    k = ck.sass()[ck.name]
    assert k.count("FMNMX.NAN") >= 2 and k.summary()["LDL/STL"] == 0, sorted(k.opcodes)   # max.NaN / min.NaN


@pytest.mark.parametrize("variant,ydt,texts", [
    ("per_col", tl.float32, ("per row",)),
    ("f16", tl.float16, ("computed in f16", "only f32 accumulation")),
    ("dot", tl.float32, ("tl.dot belongs to a GEMM",)),
    ("sq_col", tl.float32, ("column offsets must be affine",)),
])
def test_combine_rejections_name_the_op_and_line(variant, ydt, texts):
    e = _raises(lambda: lower_combine(_trace_combine(variant, ydt)), "row-gather combine lowering", *texts)
    assert e.loc is not None and e.loc.filename == __file__


def test_lowering_needs_a_compute_part():
    k = trace_ag()
    _raises(lambda: lower_grouped_gemm(k, "gather_x"), "is a comm part")
    _raises(lambda: match_combine(k, k.part("grouped_gemm")), "tl.dot belongs to a GEMM")
    _raises(lambda: match_grouped_gemm(trace_rs(), trace_rs().part("combine")), "exactly one tl.dot")


# -- the generated Prog members, run on the host --------------------------------------------------

SHIM_STD = r"""
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <vector>
#include <string>
#define __device__
#define __forceinline__ inline
#define __restrict__
"""
#: the index helpers and signal ops, printing the signal events
SHIM_SIGNALS = r"""
namespace tldsl {
enum Scope : int { kScopeGpu = 0, kScopeSys = 1 };
inline int floordiv(int a, int b) { return (a / b) - (((a % b) != 0) && ((a < 0) != (b < 0)) ? 1 : 0); }
inline int floormod(int a, int b) { return a - floordiv(a, b) * b; }
inline int imin(int a, int b) { return a < b ? a : b; }
inline int imax(int a, int b) { return a > b ? a : b; }
struct Sig { const char* name; unsigned long long* base; int n; };
static std::vector<Sig> g_sigs;
static const Sig& sig_of(const unsigned long long* p) {
  for (const Sig& s : g_sigs) if (p >= s.base && p < s.base + s.n) return s;
  fprintf(stderr, "signal slot out of range\n"); exit(3);
}
template <int S> void wait_at_least(const unsigned long long* slot, unsigned long long target) {
  const Sig& s = sig_of(slot);
  printf("wait %s %d %llu %s\n", s.name, int(slot - s.base), target, S == kScopeSys ? "sys" : "gpu");
}
inline long long checked_count(long long count, unsigned site, long long most) {
  if (count <= 0 || (most > 0 && count > most)) { fprintf(stderr, "wait count %lld at site %u\n", count, site); exit(5); }
  return count;
}
static int g_fences = 0;
template <int S> void fence_acq_rel() { ++g_fences; }
template <int S> void red_relaxed_add(unsigned long long* slot, unsigned long long v) {
  const Sig& s = sig_of(slot);
  if (g_fences == 0) { fprintf(stderr, "notify before its release fence\n"); exit(4); }
  printf("notify %s %d %s\n", s.name, int(slot - s.base), S == kScopeSys ? "sys" : "gpu");
  *slot += v;
}
}  // namespace tldsl
"""
#: the grouped templates' loads and stores
SHIM_GROUPED = r"""
// the 16-bit element types as their bits (the combine gathers y_sorted in the operands' dtype)
struct __half { unsigned short bits; };
struct __nv_bfloat16 { unsigned short bits; };
namespace tldsl {
namespace grouped {
inline float value_of(float x) { return x; }
inline int value_of(int x) { return x; }
}  // namespace grouped
}  // namespace tldsl
// CUDA's explicitly rounded float ops (the host build has no FMA contraction to avoid)
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
namespace tldsl {
namespace grouped {
inline float value_of(__half x) { _Float16 h; std::memcpy(&h, &x.bits, 2); return float(h); }
inline float value_of(__nv_bfloat16 x) {
  uint32_t u = uint32_t(x.bits) << 16; float f; std::memcpy(&f, &u, 4); return f;
}
template <class T> T ld_coherent(const T* p) { return *p; }
template <bool C = false, class T> auto ld1(const T* p, int i, int n) -> decltype(value_of(T())) {
  return (unsigned)i < (unsigned)n ? value_of(p[i]) : decltype(value_of(T()))(0);
}
template <bool C = false, class T> auto ld2(const T* p, int i, int j, int n0, int n1) -> decltype(value_of(T())) {
  return ((unsigned)i < (unsigned)n0 && (unsigned)j < (unsigned)n1) ? value_of(p[(long long)i * n1 + j])
                                                                    : decltype(value_of(T()))(0);
}
static int g_vec_loads[9] = {0};      // loads by width: the combine's 1-, 2-, 4- or 8-wide gathers
template <int N, class T> inline void loadv(const T* p, int row, int rows, int col, int cols, float (&x)[N]) {
  static_assert(N == 1 || N == 2 || N == 4 || (N == 8 && sizeof(T) == 2), "the device helper's widths");
  ++g_vec_loads[N];
  for (int q = 0; q < N; ++q)
    x[q] = ((unsigned)row < (unsigned)rows && (unsigned)col < (unsigned)cols)
               ? value_of(p[(long long)row * cols + col + q]) : 0.f;
}
inline void from_float(float v, float& y) { y = v; }
inline void from_float(float v, __half& y) { _Float16 h = _Float16(v); std::memcpy(&y.bits, &h, 2); }
inline void from_float(float v, __nv_bfloat16& y) {    // round to nearest even (finite values)
  uint32_t u; std::memcpy(&u, &v, 4); u += 0x7fffu + ((u >> 16) & 1u); y.bits = (unsigned short)(u >> 16);
}
template <int N, class T> inline void storev(T* p, int row, int rows, int col, int cols, const float (&x)[N]) {
  if ((unsigned)row < (unsigned)rows && (unsigned)col < (unsigned)cols)
    for (int q = 0; q < N; ++q) from_float(x[q], p[(long long)row * cols + col + q]);
}
}  // namespace grouped
}  // namespace tldsl
template <class T> std::vector<T> read_file(const char* path, size_t n) {
  std::vector<T> v(n);
  FILE* f = fopen(path, "rb");
  if (!f || fread(v.data(), sizeof(T), n, f) != n) { fprintf(stderr, "cannot read %s\n", path); exit(2); }
  fclose(f);
  return v;
}
"""
SHIM = SHIM_STD + SHIM_SIGNALS + SHIM_GROUPED
#: a Prog without signal ops on the device headers' own element math and index helpers (their
#: host emulation: ``tldsl::gen``, ``tldsl::floordiv``, ...), the grouped loads and stores shimmed
SHIM_REAL_MATH = "#define TLDSL_HOST_EMULATION\n#include \"tldsl/general.hpp\"\n" + SHIM_STD + SHIM_GROUPED


def _bf16_bits(a) -> np.ndarray:
    """bf16 bits of ``a`` (float32, rounded to nearest even)."""
    u = np.ascontiguousarray(a, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _rounded(a, dt) -> np.ndarray:
    """float32 ``a`` rounded to ``dt`` (f16 or bf16, nearest even), as float32."""
    if dt == tl.bfloat16:
        return (_bf16_bits(a).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)


def _prog_struct(source: str) -> str:
    return "struct Prog {" + source.split("struct Prog {")[1].split("\n};\n")[0] + "\n};\n"


def _run_host(tmp_path, lw, arrays: dict, *, launch=1, rank=0, gemm=True, bm=None, real_math=False):
    """Compile the lowered kernel's Prog on the host and run it over every tile: returns the
    printed events and (combine) the stored tensor. ``real_math``: on the device headers' element
    math (:data:`SHIM_REAL_MATH`; a Prog without waits or notifies)."""
    decls = []
    for p in lw.params:
        if p.kind == "tma" or (gemm and lw.gather and p.name.startswith("ptr_")):
            continue
        if p.name == "rank":
            decls.append(f"  int rank = {rank};")
        elif p.name == "launch":
            decls.append(f"  unsigned long long launch = {launch}ull;")
        elif p.source.startswith("signal:"):
            name = p.source[7:]
            n = lw.signal_slots[name]
            decls.append(f"  std::vector<unsigned long long> store_{p.name}({n}, 0ull);")
            decls.append(f"  unsigned long long* {p.name} = store_{p.name}.data();")
            decls.append(f"  tldsl::g_sigs.push_back({{\"{name}\", {p.name}, {n}}});")
        else:
            name = p.source[7:]
            arr = np.ascontiguousarray(arrays[name])
            path = tmp_path / f"{name}.bin"
            if "__half" in p.ctype:                          # a 16-bit tensor: its bits
                arr, ct = arr.astype(np.float16), "__half"
            elif "__nv_bfloat16" in p.ctype:
                arr, ct = _bf16_bits(arr), "__nv_bfloat16"
            else:
                ct = "int" if arr.dtype == np.int32 else "float"
                assert arr.dtype in (np.int32, np.float32), (name, arr.dtype)
            arr.tofile(path)
            decls.append(f"  std::vector<{ct}> v_{p.name} = read_file<{ct}>(\"{path.name}\", {arr.size});")
            decls.append(f"  {p.ctype.replace('__restrict__', '')} {p.name} = v_{p.name}.data();")
    init = lw.source.split("const Prog prog{")[1].split("};")[0]
    g0, g1 = lw.grid_tiles
    loop = [f"  for (int pid0 = 0; pid0 < {g0}; ++pid0) for (int pid1 = 0; pid1 < {g1}; ++pid1) {{",
            "    printf(\"tile %d %d\\n\", pid0, pid1);"]
    if gemm:
        loop.append("    const bool act = prog.active(pid0, pid1);")
        loop.append("    printf(\"active %d batch %d\\n\", int(act), act ? prog.batch(pid0, pid1) : -1);")
        if lw.gather:
            loop.append(f"    if (act) {{ printf(\"rows\"); for (int r = 0; r < {bm}; ++r) "
                        "printf(\" %d\", prog.row(pid0, pid1, r)); printf(\"\\n\"); }")
    if lw.waits:
        # one thread (the order the IR says), then a warp's 32 lanes one after another: each takes its share
        # of the waiting loops' iterations, together every wait once (checked below)
        loop.append("    prog.waits(pid0, pid1, 0, 1);")
        loop.append("    printf(\"lanes\\n\"); for (int lane = 0; lane < 32; ++lane) prog.waits(pid0, pid1, lane, 32); "
                    "printf(\"end lanes\\n\");")
    if not gemm:
        loop.append(f"    for (int tid = 0; tid < {lw.threads}; ++tid) prog.body(pid0, pid1, tid);")
    if gemm and lw.notifies and not lw.waits and not lw.gather and lw.side is None:
        # what the template runs there (kNotifierWarp): the notifier warp's 32 lanes, one after another,
        # each owing its own fence
        loop.append("    for (int lane = 0; lane < 32; ++lane) { tldsl::g_fences = 0; "
                    "prog.notifies_lanes(pid0, pid1, lane); }")
    elif lw.notifies:
        loop.append("    tldsl::g_fences = 0;")
        loop.append("    prog.notifies(pid0, pid1);")
    loop.append("  }")
    out_dump = []
    if not gemm:
        dst = next(p for p in lw.params if p.name.startswith("out_"))
        out_dump = ["  FILE* fo = fopen(\"out.bin\", \"wb\");",
                    f"  fwrite({dst.name}, sizeof(v_{dst.name}[0]), v_{dst.name}.size(), fo);", "  fclose(fo);"]
    main = ["int main() {", *decls, f"  const Prog prog{{{init}}};", *loop, *out_dump, "  return 0;", "}"]
    src = (SHIM_REAL_MATH if real_math else SHIM) + _prog_struct(lw.source) + "\n".join(main) + "\n"
    (tmp_path / "prog.cpp").write_text(src)
    exe = host_build.build(src, ["-std=c++20", "-O1", "-pthread", "-ffp-contract=off", "-w", f"-I{INCLUDE}"]
                           if real_math else ["-std=c++17", "-O1", "-Wno-unknown-pragmas"])
    run = subprocess.run([str(exe)], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = None
    if not gemm:                                      # the stored tensor, as float32
        ctype = next(p for p in lw.params if p.name.startswith("out_")).ctype
        if "__half" in ctype:
            out = np.fromfile(tmp_path / "out.bin", np.float16).astype(np.float32)
        elif "__nv_bfloat16" in ctype:
            out = (np.fromfile(tmp_path / "out.bin", np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            out = np.fromfile(tmp_path / "out.bin", np.float32)
    return _lanes_checked(run.stdout.splitlines()), out


def _lanes_checked(lines):
    """The harness's output without the waits a warp's lanes ran, after checking that they are
    the tile's waits as one thread ran them, each once (in whatever order the lanes took them)."""
    kept, tile_waits, lanes = [], [], None
    for line in lines:
        if line.startswith("tile "):
            tile_waits = []
        if line == "lanes":
            lanes = []
        elif line == "end lanes":
            assert sorted(lanes) == sorted(tile_waits), (lanes, tile_waits)
            lanes = None
        elif lanes is not None:
            lanes.append(line)
        else:
            kept.append(line)
            if line.startswith("wait "):
                tile_waits.append(line)
    return kept


def _ir_signal_events(part: core.Part, tables: dict, pid, rank: int, launch: int):
    """What the tile program's scalar code and signal ops do for one tile, by the IR's meaning
    (the simulator's arithmetic): ([waits], [notifies]) in program order."""
    env: dict[int, object] = {}
    waits, notifies = [], []

    def val(v):
        op = v.owner
        if isinstance(op, core.Op) and op.name == "const":
            return op.attrs["value"]
        return env[v.id]

    def run(ops):
        for op in ops:
            n = op.name
            if n == "program_id":
                env[op.result.id] = pid[op.attrs["axis"]]
            elif n == "rank":
                env[op.result.id] = rank
            elif n == "arith":
                env[op.result.id] = wrap_i32(ARITH[op.attrs["op"]](val(op.operands[0]), val(op.operands[1])))
            elif n == "select":
                c, a, b = (val(x) for x in op.operands)
                env[op.result.id] = a if c else b
            elif n == "load_scalar":
                t = tables[op.operands[0].owner.name]
                env[op.result.id] = int(t[tuple(val(x) for x in op.operands[1:])])
            elif n == "for":
                lo, hi, st = (val(x) for x in op.operands)
                for i in range(lo, hi, st):
                    env[op.regions[0].args[0].id] = i
                    run(op.regions[0].ops)
            elif n == "if":
                if val(op.operands[0]):
                    run(op.regions[0].ops)
            elif n in WAIT_OPS:
                target = wait_target(val(op.operands[2]), launch, op.attrs.get("epoch", True),
                                     op.attrs.get("per_launch"))
                waits.append(f"wait {op.operands[0].owner.name} {val(op.operands[1])} {target} "
                             f"{DEFAULT_MEMORY_SCOPE[n]}")
            elif n in NOTIFY_OPS:
                notifies.append(f"notify {op.operands[0].owner.name} {val(op.operands[1])} {op.attrs['scope']}")
    run(part.body.ops)
    return waits, notifies


def _split_tiles(lines):
    tiles, cur = {}, None
    for l in lines:
        if l.startswith("tile "):
            cur = tuple(int(x) for x in l.split()[1:])
            tiles[cur] = []
        else:
            tiles[cur].append(l)
    return tiles


@needs_gxx
@pytest.mark.parametrize("comm", [tl.CommSchedule(tile_m=16, mode="pull"),
                                  tl.CommSchedule(tile_m=32, mode="push", order="full_mesh"),
                                  tl.CommSchedule(engine="copy_engine")])
def test_allgather_moe_generated_prog_runs_like_the_ir(tmp_path, comm):
    W, launch = 3, 2
    compute = tl.ComputeSchedule(tile=(64, 32, 32))
    case = make_allgather_case(np.random.default_rng(1), W, rows_per_rank=40, k=40, n=48, num_experts=5, topk=2,
                               compute=compute, comm=comm, routing="random")
    inp = case.inputs[0]
    k = allgather_moe.trace(W, *[S.of(inp[n]) for n in allgather_moe.arg_names], compute=compute, comm=comm)
    lw = lower_grouped_gemm(k, "grouped_gemm")
    lines, _ = _run_host(tmp_path, lw, inp, launch=launch, rank=1, bm=64)
    tiles = _split_tiles(lines)
    part = k.part("grouped_gemm")
    te, ids = inp["tile_expert"], inp["sorted_token_ids"]
    assert len(tiles) == part.grid[0] * part.grid[1]
    for (i, pn), ev in tiles.items():
        e = int(te[i])
        assert ev[0] == f"active {int(e >= 0)} batch {e if e >= 0 else -1}"
        rest = ev[1:]
        if e >= 0:
            assert rest[0] == "rows " + " ".join(str(int(x)) for x in ids[i * 64:(i + 1) * 64])
            rest = rest[1:]
        waits, notifies = _ir_signal_events(part, inp, (i, pn), 1, launch)
        assert rest == waits + notifies, (i, pn)
        assert (len(waits) > 0) == (e >= 0)


@needs_gxx
@pytest.mark.parametrize("partial_dtype,dt", [("f32", tl.float16), ("out", tl.float16), ("out", tl.bfloat16)],
                         ids=["f32", "out-f16", "out-bf16"])
def test_moe_reduce_scatter_generated_code_runs_like_the_ir(tmp_path, partial_dtype, dt):
    """The grouped GEMM's guard, expert and notifies, and the whole combine (waits, the
    gather-weight-sum body on every thread, the store's clipping, the reduce-scatter notifies)
    run on the host against the IR and numpy; T = 120 tokens is not a multiple of BM = 64.
    ``partial_dtype='out'``: the combine sums in fp32 and stores f16 or bf16 (h's dtype), rounded once."""
    W, Ms, K, Nr, E, topk, BM, launch = 3, 40, 40, 48, 5, 2, 64, 1
    compute = tl.ComputeSchedule(tile=(BM, 32, 16), order="comm_aligned")
    comm = tl.CommSchedule(tile_m=8, order="ring", mode="push")
    rng = np.random.default_rng(7)
    ids, wts = random_routing(rng, W * Ms, E, topk, "random")
    rt = moe_routing(ids, E, W, Ms, BM)
    T, R = W * Ms, rt.num_rows
    tables = rt.reduce_scatter_tables()
    k = rt.trace_moe_reduce_scatter(W, Ms, Nr, K, E, wts, dt, compute=compute, comm=comm,
                                    partial_dtype=partial_dtype)
    # grouped GEMM: guard, expert, notifies
    lg = lower_grouped_gemm(k, "grouped_gemm")
    (tmp_path / "g").mkdir()
    lines, _ = _run_host(tmp_path / "g", lg, tables, launch=launch)
    gpart = k.part("grouped_gemm")
    for (i, pn), ev in _split_tiles(lines).items():
        e = int(rt.tile_expert[i])
        assert ev[0] == f"active {int(e >= 0)} batch {e if e >= 0 else -1}"
        waits, notifies = _ir_signal_events(gpart, tables, (i, pn), 0, launch)
        # spread over the notifier's lanes: every add exactly once, in the lanes' order
        assert waits == [] and sorted(ev[1:]) == sorted(notifies)
        assert len(notifies) == int(rt.tile_num_token_tiles[i])
    assert lg.config.notify_slots == 2
    # combine: waits, body, notifies, on every tile
    y = _rounded(rng.standard_normal((R, K)).astype(np.float32), dt)        # y_sorted is h's dtype
    partial = np.full((T, K), np.nan, np.float32)
    arrays = dict(tables, y_sorted=y, partial=partial, topk_weights=wts)
    lc = lower_combine(k, "combine")
    assert lc.buffers["partial"][1] == ("f32" if partial_dtype == "f32" else dt.name)
    (tmp_path / "c").mkdir()
    lines, out = _run_host(tmp_path / "c", lc, arrays, launch=launch, rank=2, gemm=False)
    ref = np.einsum("tk,tkn->tn", wts, y[rt.row_of])
    if partial_dtype == "out":               # the fp32 sum, rounded once to h's dtype
        ref = _rounded(ref, dt)
    tol = 1e-5 if partial_dtype == "f32" else (1e-3 if dt == tl.float16 else 8e-3)   # (an ulp of the stores)
    np.testing.assert_allclose(out.reshape(T, K), ref, rtol=tol, atol=tol)
    # the same body as the producer's spare warps run it, folded into the grouped GEMM: 96 threads
    # (a 64x32 tile of 4-wide items is not a whole number of their strides)
    from tldsl.codegen.match.combine import match_combine
    from tldsl.codegen.plan.combine import plan_combine
    from tldsl.codegen.plan.grouped_gemm import SIDE_THREADS
    from tldsl.codegen.recipes.combine import render_combine
    cp = k.part("combine")
    l96 = render_combine(plan_combine(k, cp, match_combine(k, cp), threads=SIDE_THREADS))
    assert l96.threads == 96 and "item0 += 96" in l96.source
    (tmp_path / "c96").mkdir()
    arrays["partial"] = np.full((T, K), np.nan, np.float32)
    _, out96 = _run_host(tmp_path / "c96", l96, arrays, launch=launch, rank=2, gemm=False)
    np.testing.assert_allclose(out96.reshape(T, K), ref, rtol=tol, atol=tol)
    cpart = k.part("combine")
    tiles = _split_tiles(lines)
    assert len(tiles) == cpart.grid[0] * cpart.grid[1]
    for (j, pn), ev in tiles.items():
        waits, notifies = _ir_signal_events(cpart, tables, (j, pn), 2, launch)
        assert ev == waits + notifies
        assert waits == [f"wait y_ready {j * cpart.grid[1] + pn} {int(rt.token_tile_producers[j]) * launch} gpu"]


# -- a wait for the first of several notifies per launch (per_launch) ------------------------------

@tl.kernel
def sliced_feed(xs, w, tile_expert, ids, h, *, compute: tl.ComputeSchedule = None):
    """A gathered grouped GEMM whose tiles start on the first of two slices: the feed copies a
    tile's rows of A and notifies, then notifies the same slot again (a second slice the GEMM
    does not read), so the slot gains two per launch and the wait needs ``2 * (launch - 1) + 1``."""
    T, K = xs.shape
    E, _, N = w.shape
    BM, BN, BK = compute.tile
    NT = tile_expert.shape[0]
    x = tl.symmetric_buffer((T, K), xs.dtype, "x")
    ready = tl.signal("ready", NT)

    @tl.comm_part(grid=(NT,))
    def feed(t):
        tl.tile_push_data(x.at(tl.rank()), (t * BM, 0), xs, (t * BM, 0), (BM, K))
        tl.producer_tile_notify(ready, t)           # slice 1: the tile's rows
        tl.producer_tile_notify(ready, t)           # slice 2

    @tl.compute_part(grid=(NT, tl.cdiv(N, BN)))
    def gg(i, pn):
        e = tl.load_scalar(tile_expert, (i,))
        acc = tl.fragment((BM, BN), tl.float32)
        with tl.when(e >= 0):
            tl.consumer_tile_wait(ready, i, per_launch=2)
            rows = tl.load(ids, (i * BM,), (BM,))
            for k in tl.range(0, K, BK):
                acc += tl.dot(tl.load_rows(x, rows, k, BK), tl.load(w, (e, k, pn * BN), (BK, BN)))
        tl.store(h, (i * BM, pn * BN), acc)


SLICED = dict(NT=4, BM=64, K=128, N=128, E=2)


def _sliced_case():
    NT, BM, K, N, E = (SLICED[k] for k in ("NT", "BM", "K", "N", "E"))
    rng = np.random.default_rng(3)
    te = np.array([0, -1, 1, 0], np.int32)
    ids = np.concatenate([rng.permutation(np.arange(i * BM, (i + 1) * BM)) for i in range(NT)]).astype(np.int32)
    ids[5] = -1                                      # a padding row: reads zero
    inputs = dict(xs=(rng.standard_normal((NT * BM, K)) * 0.25).astype(np.float16),
                  w=(rng.standard_normal((E, K, N)) * 0.25).astype(np.float16), tile_expert=te, ids=ids,
                  h=np.zeros((NT * BM, N), np.float16))
    xg = np.where(ids[:, None] >= 0, inputs["xs"].astype(np.float32)[np.maximum(ids, 0)], 0)
    ref = np.zeros((NT * BM, N), np.float32)
    for i, e in enumerate(te):
        if e >= 0:
            ref[i * BM:(i + 1) * BM] = xg[i * BM:(i + 1) * BM] @ inputs["w"][e].astype(np.float32)
    return inputs, ref


def _sliced_compute():
    return tl.ComputeSchedule(tile=(SLICED["BM"], 64, 64))


def test_sliced_wait_counts_the_launch_in_the_simulator(monkeypatch):
    """Over two launches the wait's target on launch 2 is ``per_launch * 1 + count`` = 3 and the
    product is right; with the target the old grouped-GEMM emitter computed (``count * launch``
    = 2), the slot's two notifies of launch 1 would satisfy the wait before launch 2's feed
    wrote the rows: the simulator reports exactly that."""
    from tldsl.runtime.sim import engine
    inputs, ref = _sliced_case()
    targets = []

    def spy(count, launch, epoch=True, per_launch=None, lag=0):
        targets.append((launch, wait_target(count, launch, epoch, per_launch, lag)))
        return targets[-1][1]
    monkeypatch.setattr(engine, "wait_target", spy)
    res = tl.simulate(sliced_feed, 1, [inputs], compute=_sliced_compute(), options=tl.SimOptions(launches=2))
    np.testing.assert_allclose(res[0]["h"].astype(np.float32), ref, rtol=1e-2, atol=1e-2)
    assert {t for launch, t in targets if launch == 1} == {1} and {t for launch, t in targets if launch == 2} == {3}

    monkeypatch.setattr(engine, "wait_target", lambda count, launch, epoch=True, per_launch=None, lag=0:
                        count * launch if epoch else count)
    with pytest.raises(tl.StaleSignalError, match=r"'ready'\[\d\] already held 2 when launch 2 began, and the "
                                                  r"wait needs 2"):
        tl.simulate(sliced_feed, 1, [inputs], compute=_sliced_compute(), options=tl.SimOptions(launches=2))


def _sliced_lowered():
    inputs, _ = _sliced_case()
    k = sliced_feed.trace(1, *[S.of(inputs[n]) for n in sliced_feed.arg_names], compute=_sliced_compute())
    return k, inputs, lower_grouped_gemm(k, "gg")


def test_sliced_wait_target_in_the_generated_code():
    _, _, lw = _sliced_lowered()
    waits = lw.source.split("void waits")[1].split("\n  }\n")[0]
    assert "tldsl::wait_at_least<tldsl::kScopeGpu>(sig_ready + pid0_0, " \
           "2ull * (launch - 1ull) + (unsigned long long)(1));" in waits


@needs_gxx
def test_sliced_wait_runs_like_the_simulator_on_launch_2(tmp_path):
    """The generated waits() run on the host at launch 2 spin for the simulator's target."""
    k, inputs, lw = _sliced_lowered()
    lines, _ = _run_host(tmp_path, lw, inputs, launch=2, bm=SLICED["BM"])
    part = k.part("gg")
    for (i, pn), ev in _split_tiles(lines).items():
        waits, _ = _ir_signal_events(part, inputs, (i, pn), 0, 2)
        assert [e for e in ev if e.startswith("wait ")] == waits
        assert waits == ([f"wait ready {i} 3 gpu"] if inputs["tile_expert"][i] >= 0 else [])


# -- NVRTC: compile for sm_90a, check the SASS -------------------------------------------------------

COMPILE_SCHEDULES = [
    dict(tile=(128, 128, 64), stages=4, order="row_major", dt=tl.float16),
    dict(tile=(128, 256, 64), stages=3, order="swizzled", dt=tl.bfloat16),
    dict(tile=(64, 128, 32), stages=6, order="comm_aligned", dt=tl.float16),
    dict(tile=(128, 256, 64), stages=4, order="swizzled", dt=tl.bfloat16, cluster=(2, 1)),
    # 64-row tiles for small experts: the two consumer warpgroups split the columns (64x128 each)
    dict(tile=(64, 256, 64), stages=5, order="swizzled", dt=tl.bfloat16, cluster=(2, 1)),
    # 128 x 128 tiles: ping-pong consumers (each warpgroup on whole tiles, in turns), in pairs
    dict(tile=(128, 128, 64), stages=6, order="swizzled", dt=tl.bfloat16, cluster=(2, 1)),
    # 64-row tiles paired into 128-row CTA tiles (the folded kernels: the columns split)
    dict(tile=(64, 256, 64), stages=4, order="swizzled", dt=tl.bfloat16),
]


def _check_common(ck, max_regs):
    info = ck.ptxas_info()[ck.name]
    assert info["spill_store_bytes"] <= SPILL_BUDGET_BYTES and info["spill_load_bytes"] <= SPILL_BUDGET_BYTES, info
    assert info["stack_bytes"] == 0 and info["registers"] <= max_regs, info
    for warning in ("C7510", "C7514", "C7515"):       # serialised WGMMA pipelines
        assert warning not in ck.log, ck.log
    k = ck.sass()[ck.name]
    s = k.summary()
    assert s["BPT.TRAP"] == 0 and s["LDL/STL"] == 0 and s["local_bytes"] == 0, s
    return k


def check_grouped_gemm_sass(ck, lw, gemm_waits=None):
    """``gemm_waits``: the waits of the GEMM's own tiles where they are not ``lw.waits`` (a folded
    part's waits come with it; only the GEMM's own acquires feed TMA)."""
    k = _check_common(ck, MAX_REGISTERS_GEMM)
    s = k.summary()
    assert s["HGMMA"] > 0 and k.count(f"HGMMA.64x{lw.config.wg_n}x16.F32") > 0, s
    assert s["UTMALDG"] > 0 and s["UTMASTG"] > 0 and s["SYNCS"] > 0, s
    assert k.count("UTMALDG.3D") > 0                                  # the expert's weights: 3-d TMA
    assert k.count("USETMAXREG") in (0, 2)
    # ping-pong: the consumer warpgroups hand each other the turn at the K loop (bar.arrive / bar.sync)
    assert (k.count("BAR.ARV") > 0) == lw.config.pingpong, sorted(k.mnemonics)
    if lw.gather:
        assert k.count("LDGSTS.E.BYPASS.128") > 0, sorted(k.mnemonics)  # cp.async gather, 16 B, L2 only
        assert k.count("ARRIVES.LDGSTSBAR.64") > 0                     # cp.async.mbarrier.arrive
        assert k.count("FENCE.VIEW.ASYNC.S") > 0                       # cp.async data -> WGMMA's proxy
        assert k.count("UTMALDG.2D") == 0                              # no TMA for A
    else:
        assert k.count("LDGSTS") == 0 and k.count("UTMALDG.2D") > 0
    if lw.config.cluster == (2, 1):
        assert k.count("UTMALDG.3D.MULTICAST") > 0                     # B shared by the pair
        assert k.count("SYNCS.ARRIVE.TRANS64.RED") > 0                 # stages released on the partner too
        assert k.count("UCGABAR_ARV") > 0 and k.count("UCGABAR_WAIT") > 0   # cluster barriers: start, end
    else:
        assert k.count("MULTICAST") == 0 and k.count("UCGABAR_ARV") == 0
    acquires = {sc: k.count(f"LDG.E.64.STRONG.{sc.upper()}") for sc in ("gpu", "sys")}
    for sc in ("gpu", "sys"):
        assert (acquires[sc] > 0) == (sc in lw.wait_scopes), (acquires, lw.wait_scopes)
    if lw.waits if gemm_waits is None else gemm_waits:
        assert k.count("FENCE.VIEW.ASYNC.G") > 0                       # acquire -> TMA's proxy
    assert (k.count("REDG.E.ADD.64.STRONG.GPU") > 0) == (lw.notifies > 0)
    if lw.notifies:
        assert k.count("MEMBAR.ALL.GPU") > 0                           # the release fence
    return k


def check_combine_sass(ck, lw):
    k = _check_common(ck, MAX_REGISTERS_COMBINE)
    assert k.count("HGMMA") == 0 and k.count("LDGSTS") == 0
    # coherent gathers of y_sorted: 4 f32 (16 bytes) or 8 f16 / bf16 (16 bytes) a thread, or 4
    # f16 / bf16 (8 bytes) where the columns do not allow 8
    wide = "LDG.E.128" if lw.buffers["y_sorted"][1] == "f32" or lw.vec == 8 else "LDG.E.64"
    assert k.count(wide) > 0, sorted(k.opcodes)
    assert k.count(wide + ".CONSTANT") == 0                            # ... never through the .nc path
    assert k.count("STG.E.128") > 0
    assert k.count("LDG.E.64.STRONG.GPU") > 0 and k.count("REDG.E.ADD.64.STRONG.GPU") > 0
    return k


@pytest.mark.parametrize("sched", COMPILE_SCHEDULES,
                         ids=lambda s: "x".join(map(str, s["tile"])) + ("-cluster2" if "cluster" in s else ""))
@pytest.mark.nvrtc
@needs_nvrtc
def test_moe_kernels_compile_for_sm90a(tmp_path, sched):
    kag, krs, kst = trace_ag(**sched), trace_rs(**sched), trace_ag(**sched, stage_rows=True)
    lws = [lower_grouped_gemm(kag, "grouped_gemm"), lower_grouped_gemm(krs, "grouped_gemm"),
           lower_combine(krs, "combine"), lower_grouped_gemm(krs, "grouped_gemm", side="combine"),
           lower_grouped_gemm(kst, "grouped_gemm", side="gather_rows"), lower_grouped_gemm(kst, "grouped_gemm")]
    # the folded parts' own kernels, the GEMMs alone (their index in lws): what each folded kernel adds
    alone = {"combine": (lws[2], "y_sorted", 1), "gather_rows": (lower_combine(kst, "gather_rows"), "x_gathered", 5)}
    t0 = time.perf_counter()
    cks = compile_many([CompileJob(l.source, l.entry, l.options) for l in lws], cache=KernelCache(tmp_path),
                       progress=False)
    wall = time.perf_counter() - t0
    sass = {}
    for i, (lw, ck) in enumerate(zip(lws, cks)):
        assert not ck.cached and ck.cubin[:4] == b"\x7fELF"
        k = sass[i] = (check_combine_sass(ck, lw) if lw.kind == "combine" else
                       check_grouped_gemm_sass(ck, lw, gemm_waits=lws[alone[lw.side][2]].waits if lw.side else None))
        print(f"{lw.entry} {sched['tile']}: {ck.compile_seconds:.1f} s {ck.timings} {k.summary()}")
    for i, lw in enumerate(lws):
        if lw.kind == "grouped_gemm" and lw.side:
            # the folded part: the gathers of its own kernel (not counting the acquires, LDG.E.64.STRONG
            # too), never through the .nc path; its stores; its acquire (more than the GEMM's alone)
            k, (lc, src, j) = sass[i], alone[lw.side]
            wide = "LDG.E.128" if lc.buffers[src][1] == "f32" or lc.vec == 8 else "LDG.E.64"
            assert k.count(wide) - k.count(wide + ".STRONG") > 0, sorted(k.opcodes)
            assert k.count(wide + ".CONSTANT") == 0 and k.count("STG.E.128") > 0

            def acquires(x):
                return x.count("LDG.E.64.STRONG.GPU") + x.count("LDG.E.64.STRONG.SYS")
            # (a GEMM alone on paired 64-row tiles has its waits inlined twice, for each of a pair's tiles;
            # a folded kernel never pairs)
            own = acquires(sass[j]) // (2 if lws[j].config.pair_rows and not lw.config.pair_rows else 1)
            assert acquires(k) > own, (acquires(k), acquires(sass[j]), lws[j].config.pair_rows)
    print(f"{len(lws)} kernels in {wall:.1f} s")


@pytest.mark.nvrtc
@needs_nvrtc
def test_gathered_row_offsets_widen_past_32_bits(tmp_path):
    """The gathering producer keeps each row's element offset in A (computed once a tile): 32 bits
    where every offset it forms fits (below M * K + BK), else 64 — the host's choice and the
    template's agree (a static_assert), and both widths compile without spills."""
    small = lower_grouped_gemm(trace_ag(tile=(128, 256, 64)), "grouped_gemm")
    big = lower_grouped_gemm(trace_ag(tile=(128, 256, 64), W=2, Ms=1 << 18, K=4096), "grouped_gemm")
    assert small.gather and small.M * small.K + small.config.BK < 1 << 31
    assert big.gather and big.M * big.K >= 1 << 31
    assert "Tr::kOffsets32 == true" in small.source and "Tr::kOffsets32 == false" in big.source
    cks = compile_many([CompileJob(l.source, l.entry, l.options) for l in (small, big)], cache=KernelCache(tmp_path),
                       progress=False)
    for lw, ck in zip((small, big), cks):
        check_grouped_gemm_sass(ck, lw)


@pytest.mark.parametrize("tile", [(128, 256, 64), (128, 128, 64), (128, 256, 32)], ids=lambda t: "x".join(map(str, t)))
@pytest.mark.nvrtc
@needs_nvrtc
def test_gathering_producer_copies_a_row_in_three_instructions(tmp_path, tile):
    """A stage whose rows all lie in A takes the producer's fast path: each 16-byte copy is a
    64-bit add of the row's offset (computed once a tile) onto the stage's base (LEA, LEA.HI.X) and an
    unpredicated cp.async at an immediate shared offset (the rows share one swizzled column) — three
    instructions a row, against five (an offset add, a widening multiply-add, a predicate, a shared
    address add, the copy) before. Rows past the tile's valid ones keep the zero-filling copy."""
    lw = lower_grouped_gemm(trace_ag(tile=tile, stages=4, order="swizzled", dt=tl.bfloat16, cluster=(2, 1)),
                            "grouped_gemm")
    ck, = compile_many([CompileJob(lw.source, lw.entry, lw.options)], cache=KernelCache(tmp_path), progress=False)
    assert lw.gather
    check_grouped_gemm_sass(ck, lw)
    body = ck.sass()[ck.name].lines
    copies = [i for i, b in enumerate(body) if b.startswith("LDGSTS")]
    # whole copies: no source-size predicate after the two addresses
    whole = [i for i in copies if not re.search(r"\]\s*,\s*!?P\d\s*$", body[i])]
    rows_per_thread = tile[0] // (128 // (tile[2] * 2 // 16))
    assert len(whole) == rows_per_thread, (len(whole), [body[i] for i in copies])
    assert len(copies) > len(whole)                                    # ... and the zero-filling path
    # shared addresses: one register + an immediate a row
    bases = {re.match(r"LDGSTS\S*\s+\[(R\d+)", body[i]).group(1) for i in whole}
    assert len(bases) == 1, [body[i] for i in whole]
    span = [b for b in body[whole[0]:whole[-1] + 1]
            if not b.startswith("@!PT LDS") and not re.match(r"(@!?U?P\d+\s+)?BRA\b", b)]
    assert len(span) <= 3 * rows_per_thread, span


@pytest.mark.nvrtc
@needs_nvrtc
def test_moe_reduce_scatter_with_partials_in_the_output_dtype_compiles(tmp_path):
    """partial_dtype='out' (MoEReduceScatter's default): the combine, alone and folded into the
    grouped GEMM, stores its bf16 sums 8 a thread (16-byte stores)."""
    k = trace_rs(tile=(128, 256, 64), stages=4, order="swizzled", dt=tl.bfloat16, cluster=(2, 1), partial_dtype="out")
    lws = [lower_combine(k, "combine"), lower_grouped_gemm(k, "grouped_gemm", side="combine")]
    assert lws[0].buffers["partial"] == ((4 * 256, 512), "bf16") and lws[0].vec == 8
    cks = compile_many([CompileJob(lw.source, lw.entry, lw.options) for lw in lws], cache=KernelCache(tmp_path),
                       progress=False)
    check_combine_sass(cks[0], lws[0])
    folded = check_grouped_gemm_sass(cks[1], lws[1], gemm_waits=lower_grouped_gemm(k, "grouped_gemm").waits)
    assert folded.count("STG.E.128") > 0 and folded.count("HGMMA") > 0


@pytest.mark.nvrtc
@needs_nvrtc
@pytest.mark.parametrize("comm", [tl.CommSchedule(tile_m=64, mode="push", order="full_mesh"),
                                  tl.CommSchedule(engine="copy_engine")], ids=["push", "copy_engine"])
def test_allgather_moe_sys_waits_compile(tmp_path, comm):
    lw = lower_grouped_gemm(trace_ag(comm=comm), "grouped_gemm")
    ck = lw.compile(cache=KernelCache(tmp_path), progress=False)
    check_grouped_gemm_sass(ck, lw)


def test_items_at_once_stay_within_their_bounds():
    """Every tile shape, vector width, loop length and thread count (a combine's own 1024, the 96
    of one folded into a grouped GEMM): the items a thread gathers together keep at most
    MAX_GATHERS_IN_FLIGHT gathers and MAX_VALUES_IN_FLIGHT values (or are one item), divide its
    share where the threads divide the tile (no partial group), cover every item of the tile once
    — a partial group (``ragged``) skipping the items past the tile — and a loop of unknown or
    long bounds takes one."""
    from tldsl.codegen.plan.combine import COMBINE_THREADS
    from tldsl.codegen.recipes.combine import (MAX_GATHERS_IN_FLIGHT, MAX_VALUES_IN_FLIGHT, items_at_once,
                                               ragged)
    for threads in (COMBINE_THREADS, 96):
        for bm in (8, 16, 32, 64, 128, 256):
            for bn in (8, 16, 32, 64, 128, 256):
                for vec in (4, 8):
                    if bn % vec:
                        continue
                    total = bm * bn // vec
                    for trips in (None, 0, 1, 2, 3, 4, 5, 8, 9, 12):
                        plan = SimpleNamespace(match=SimpleNamespace(BMf=bm, BNf=bn), vec=vec, threads=threads)
                        g = items_at_once(plan, trips)
                        assert g >= 1
                        if g > 1:
                            assert g * trips <= MAX_GATHERS_IN_FLIGHT and g <= -(-total // threads)
                            assert g * vec * (trips + (trips > 1)) <= MAX_VALUES_IN_FLIGHT
                            if total % threads == 0:
                                assert (total // threads) % g == 0 and not ragged(plan, g)
                        if trips is None or not 0 < trips <= MAX_GATHERS_IN_FLIGHT or total <= threads:
                            assert g == 1 and not ragged(plan, g)
                        # the generated loops: item0 = tid, tid + threads * g, ...; items item0 + j * threads
                        # of them, those past the tile skipped where ragged
                        seen = [item0 + j * threads for tid in range(threads)
                                for item0 in range(tid, total, threads * g) for j in range(g)]
                        kept = [i for i in seen if i < total]
                        assert sorted(kept) == list(range(total)) and (len(kept) == len(seen)) == \
                            (not ragged(plan, g)), (threads, bm, bn, vec, trips, g)


@pytest.mark.nvrtc
@needs_nvrtc
@pytest.mark.parametrize("ydt,topk,items", [(tl.float32, 1, 8), (tl.bfloat16, 1, 4), (tl.bfloat16, 2, 1),
                                            (tl.float32, 2, 2)])
def test_combine_items_in_flight_fit_the_registers(tmp_path, ydt, topk, items):
    """The most items a thread gathers together (``items_at_once``) compile without spills in the
    64 registers a thread of a 1024-thread CTA has: a register budget too generous shows here."""
    lw = lower_combine(_trace_combine("unscaled" if topk == 1 else "ok", ydt, topk, (128, 256, 16)))
    assert f"float acc_[{items}][" in lw.source
    ck = lw.compile(cache=KernelCache(tmp_path), progress=False)
    info = ck.ptxas_info()[ck.name]
    assert info["spill_store_bytes"] == info["spill_load_bytes"] == info["stack_bytes"] == 0, info
    assert info["registers"] <= 64, info


@pytest.mark.nvrtc
@needs_nvrtc
@pytest.mark.parametrize("ydt", [tl.float32, tl.float16, tl.bfloat16])
def test_a_combine_of_columns_no_multiple_of_4_takes_narrower_accesses_and_compiles(tmp_path, ydt):
    """Columns no multiple of 4 (tensors of 514 or 513 columns, or a column offset of 1 or 2) are
    gathered 2 or 1 columns a thread, not refused: every width and element type compiles without
    spills. (On the GPU: test_gpu_run's combines at column offsets of 1 and 2, and the fuzzer's
    combine family, which draws column counts no multiple of 4.)"""
    lws = [lower_combine(trace_rs(K=514, dt=ydt, partial_dtype="out"), "combine"),
           lower_combine(trace_rs(K=513, dt=ydt, partial_dtype="out"), "combine"),
           lower_combine(_trace_combine("odd_col", ydt)), lower_combine(_trace_combine("col1", ydt))]
    assert [lw.vec for lw in lws] == [2, 1, 2, 1]
    assert all(f"loadv<{lw.vec}>" in lw.source and f"storev<{lw.vec}>" in lw.source for lw in lws)
    cks = compile_many([CompileJob(lw.source, lw.entry, lw.options) for lw in lws], cache=KernelCache(tmp_path),
                       progress=False)
    for ck in cks:
        info = ck.ptxas_info()[ck.name]
        assert info["spill_store_bytes"] == info["spill_load_bytes"] == 0, info


@pytest.mark.nvrtc
@needs_nvrtc
def test_sliced_wait_compiles(tmp_path):
    _, _, lw = _sliced_lowered()
    ck = lw.compile(cache=KernelCache(tmp_path), progress=False)
    check_grouped_gemm_sass(ck, lw)


@pytest.mark.nvrtc
@needs_nvrtc
def test_moe_compile_error_points_at_the_tile_program(tmp_path):
    lw = lower_combine(trace_rs(), "combine")
    needle = "tldsl::wait_at_least<tldsl::kScopeGpu>(sig_y_ready"
    assert needle in lw.source
    bad = lw.source.replace(needle, "tldsl::wait_at_least<tldsl::kScopeGpu>(sig_not_declared")
    with pytest.raises(CudaCompileError) as ei:
        compile_cuda(bad, lw.entry, cache=KernelCache(tmp_path), progress=False)
    e = ei.value
    assert e.loc is not None and e.loc.filename.endswith("moe.py") and "consumer_tile_wait" in e.loc.source


@tl.kernel
def _dealt_waits(y, cnt, ids, wts, out, *, compute: tl.ComputeSchedule = None, written: tl.constexpr = False):
    """A combine whose waits nest loops, guards and bounds that depend on outer loops (or, with
    ``written``, read a table another part writes, after a wait): how a warp's lanes share them."""
    T, topk = wts.shape
    BM, BN, _ = compute.tile
    NTT = tl.cdiv(T, BM)
    ready, more = tl.signal("ready", NTT), tl.signal("more", 64)

    @tl.compute_part(grid=(NTT,))
    def writer(j):
        tl.store(cnt, (j * 8,), tl.full((8,), 3, tl.int32))
        tl.producer_tile_notify(ready, j)
        for s in tl.range(0, 64):
            tl.producer_tile_notify(more, s)

    @tl.compute_part(grid=(NTT, tl.cdiv(y.shape[1], BN)))
    def combine(j, pn):
        m0, c0 = j * BM, pn * BN
        tl.consumer_tile_wait(ready, j)
        if written:                        # the count another part stores, read after the wait above
            for s in tl.range(0, tl.load_scalar(cnt, (j * 8,))):
                tl.consumer_tile_wait(more, tl.load_scalar(ids, (j * 8 + s,)))
        else:
            for a in tl.range(0, 3):
                tl.consumer_tile_wait(more, a)
                with tl.when(a > 0):
                    for b in tl.range(a, a * 5 + 1, 2):
                        for c in tl.range(0, 2):
                            tl.consumer_tile_wait(more, (b * 2 + c) % 64)
                        tl.consumer_tile_wait(more, 40 + b % 8)
            tl.consumer_tile_wait(more, 63)
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, topk):
            rows = tl.load(ids, (k * T + m0,), (BM,))
            acc += tl.load_rows(y, rows, c0, BN) * tl.load(wts, (m0, k), (BM, 1))
        tl.store(out, (m0, c0), acc)


@needs_gxx
@pytest.mark.parametrize("written", [False, True])
def test_a_warps_lanes_share_a_tiles_waits_each_once(tmp_path, written):
    """The waits hook run by 32 lanes: every wait of the tile once (the host harness checks the
    lanes' waits against one thread's, which run in the IR's order), the innermost waiting loops'
    iterations shared whatever the nesting — or, where the waits' index code reads a table written
    during the launch after a wait, all on lane 0, in order."""
    specs = (S((512, 256), tl.float32), S((64,), tl.int32), S((600,), tl.int32), S((300, 2), tl.float32),
             S((300, 256), tl.float32))
    k = _dealt_waits.trace_checked(1, specs, dict(compute=tl.ComputeSchedule(tile=(64, 64, 16)), written=written),
                                   channels=False)
    lw = lower_combine(k, "combine")
    waits_fn = lw.source.split("void waits(int pid0, int pid1, int lane, int lanes) const {")[1].split("\n  }\n")[0]
    assert ("if (lane != 0) return;" in waits_fn) is written and ("+ lane * " in waits_fn) is not written
    rng = np.random.default_rng(0)
    arrays = {"y": rng.standard_normal((512, 256)).astype(np.float32), "cnt": rng.integers(1, 9, 64).astype(np.int32),
              "ids": rng.integers(0, 64, 600).astype(np.int32), "wts": rng.standard_normal((300, 2)).astype(np.float32),
              "out": np.zeros((300, 256), np.float32)}
    lines, _ = _run_host(tmp_path, lw, arrays, gemm=False, launch=2)
    part = k.part("combine")
    for (j, pn), ev in _split_tiles(lines).items():
        waits, _ = _ir_signal_events(part, arrays, (j, pn), 0, 2)
        assert [e for e in ev if e.startswith("wait ")] == waits and len(waits) > (1 if written else 20)
