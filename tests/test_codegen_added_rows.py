"""The MoE combine in the grouped GEMM's epilogue: ``moe_combined_experts`` (``tl.add_rows`` of each
weighted row into its token's row of the output) in the simulator against the numpy reference, lowered
by the grouped-GEMM recipe (held tiles whose chunks are added by vector reductions, not stored), what
that recipe refuses (to the general lowering, with a FallbackWarning), and its NVRTC build. On the GPU:
``test_gpu_moe.py`` and ``test_gpu_bench_moe.py``."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import tldsl as tl
from tldsl.codegen import LoweringError, lower, lower_grouped_gemm
from tldsl.codegen import toolchain as tcm
from tldsl.codegen.toolchain.cache import KernelCache
from tldsl.ops.moe import moe_routing, reference_moe_reduce_scatter

_OK, _WHY = tcm.toolchain_available()


def _routing(T, E, topk, BM, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.choice(E, topk, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (T, topk)).astype(np.float32)
    return moe_routing(ids, E, 1, T, BM), wts


def _inputs(rt, wts, K, N, E, seed=1, weights="kn"):
    rng = np.random.default_rng(seed)
    w2 = (rng.standard_normal((E, N, K) if weights == "nk" else (E, K, N)) * 0.1).astype(np.float16)
    return dict(h=rng.standard_normal((rt.num_rows, K)).astype(np.float16), w2=w2,
                row_weights=rt.row_weights(wts), sorted_token_ids=rt.sorted_token_ids, tile_expert=rt.tile_expert,
                tile_valid_rows=rt.tile_valid_rows, out=rng.standard_normal((rt.num_tokens, N)).astype(np.float16))


@settings(max_examples=12, deadline=None)
@given(T=st.integers(1, 90), E=st.integers(1, 7), topk=st.integers(1, 3), K=st.sampled_from([16, 48]),
       N=st.sampled_from([16, 40]), BM=st.sampled_from([16, 32]), weights=st.sampled_from(["kn", "nk"]),
       seed=st.integers(0, 1000))
def test_the_simulator_adds_each_tokens_weighted_rows_as_the_reference(T, E, topk, K, N, BM, weights, seed):
    topk = min(topk, E)
    rt, wts = _routing(T, E, topk, BM, seed)
    k = rt.trace_combined_experts(K, N, E, tl.float16, weights=weights,
                                  compute=tl.ComputeSchedule(tile=(BM, 16, 16)))
    ins = _inputs(rt, wts, K, N, E, seed, weights)
    got = tl.simulate(k, 1, [ins])[0]["out"].astype(np.float64)
    w2 = np.swapaxes(ins["w2"], 1, 2) if weights == "nk" else ins["w2"]
    want = ins["out"].astype(np.float64) + reference_moe_reduce_scatter([ins["h"]], [w2], wts, rt)
    # each add rounds to f16 (topk adds a row, in no fixed order): a few f16 ulps of the row's magnitude
    scale = np.abs(ins["out"]).astype(np.float64) + reference_moe_reduce_scatter(
        [np.abs(ins["h"])], [np.abs(w2)], wts, rt)
    assert np.all(np.abs(got - want) <= (topk + 2) * 2.0**-10 * scale + 1e-3)


def test_row_weights_put_each_tokens_weight_at_its_sorted_row():
    rt, wts = _routing(50, 5, 2, 16)
    rw = rt.row_weights(wts)
    assert rw.shape == (rt.num_rows,) and rw.dtype == np.float32
    for t in range(50):
        for j in range(2):
            row = rt.token_pos[j * 50 + t]
            assert rt.sorted_token_ids[row] == t and rw[row] == wts[t, j]
    assert np.all(rw[rt.sorted_token_ids < 0] == 0)
    with pytest.raises(tl.InputError, match=r"topk_weights must be \[50, 2\], got \[50, 3\]"):
        rt.row_weights(np.ones((50, 3), np.float32))


def _program(dtype=tl.bfloat16, out_dtype=None, T=1000, E=8, topk=2, K=128, N=512, tile=(128, 256, 64)):
    rt, _ = _routing(T, E, topk, tile[0])
    return rt.trace_combined_experts(K, N, E, dtype, out_dtype=out_dtype,
                                     compute=tl.ComputeSchedule(tile=tile, order="swizzled"))


def test_the_grouped_gemm_recipe_adds_the_rows_from_held_tiles():
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # no fallback
        lw = lower(_program(), "grouped_gemm")
    assert type(lw).__name__ == "LoweredGroupedGemm"
    assert lw.config.overlap_store and not lw.config.pair_rows and not lw.config.pingpong
    # the tokens are -1 past a tile's valid rows: half tiles add what the program does
    assert lw.config.half_tiles
    assert "kAddRows = true, kRowScale = true" in lw.source
    assert "int row_target(int pid0, int pid1, int r)" in lw.source and "float row_scale(" in lw.source
    names = [p.name for p in lw.params]
    assert names[-1] == "ptr_out" and "ptr_row_weights" in names and "tbl_sorted_token_ids" in names
    assert not any(p.ctype.startswith("const") for p in lw.params if p.name == "ptr_out")


def test_64_row_tiles_add_their_rows_with_the_columns_split_between_the_consumers():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lw = lower(_program(tile=(64, 256, 64)), "grouped_gemm")
    assert lw.config.overlap_store and lw.config.split_n and not lw.config.pair_rows and "kAddRows = true" in lw.source


@tl.kernel
def _expert_gemm_adding(h, w2, sorted_token_ids, tile_expert, tile_valid_rows, out, *,
                        compute: tl.ComputeSchedule = None, variant: tl.constexpr = "unmasked ids"):
    """An expert GEMM adding its rows into ``out``, written two ways the recipe must not take as the
    MoE program: ``"unmasked ids"``, rows past a tile's valid count zeroed but their ids left as the
    table has them; ``"scaled by out"``, rows scaled by what ``out`` holds (a hook reading the tensor
    the part adds into)."""
    BM, BN, BK = compute.tile
    NT = tile_expert.shape[0]

    @tl.compute_part(grid=(NT, out.shape[1] // BN))
    def grouped_gemm(i, pn):
        e = tl.load_scalar(tile_expert, (i,))
        with tl.when(e >= 0):
            acc = tl.fragment((BM, BN), tl.float32)
            for k in tl.range(0, h.shape[1], BK):
                acc += tl.dot(tl.load(h, (i * BM, k), (BM, BK)), tl.load(w2, (e, k, pn * BN), (BK, BN)))
            ids = tl.load(sorted_token_ids, (i * BM,), (BM,))
            if variant == "unmasked ids":
                y = tl.where(tl.iota(BM)[:, None] < tl.load_scalar(tile_valid_rows, (i,)), acc, 0.0)
                tl.add_rows(out, ids, pn * BN, y)
            else:
                tl.add_rows(out, ids, pn * BN, acc * tl.load(out, (i * BM, 0), (BM, 1)).to(tl.float32))


def _expert_gemm_kernel(variant: str):
    rt, _ = _routing(1000, 8, 2, 128)
    S = tl.TensorSpec
    return _expert_gemm_adding.trace(1, S((rt.num_rows, 128), tl.bfloat16), S((8, 128, 512), tl.bfloat16),
                                     S.of(rt.sorted_token_ids), S.of(rt.tile_expert), S.of(rt.tile_valid_rows),
                                     S((rt.num_rows, 512), tl.bfloat16),
                                     compute=tl.ComputeSchedule(tile=(128, 256, 64)), variant=variant)


def test_half_tiles_only_where_the_ids_past_the_valid_rows_add_nothing():
    """A half tile computes and adds only its first 64 rows; the program adds the others too (zeros,
    or NaN for an infinite factor, to whatever row their ids name). So half tiles only where those ids
    are -1 by the program itself, masked by the same count (the MoE program's); else every row is held
    and added."""
    lw = lower_grouped_gemm(_expert_gemm_kernel("unmasked ids"), "grouped_gemm")
    assert "kAddRows = true" in lw.source and lw.config.overlap_store and not lw.config.half_tiles
    assert lower_grouped_gemm(_program(), "grouped_gemm").config.half_tiles


def test_ids_or_scales_read_from_the_tensor_being_added_into_fall_back():
    with pytest.raises(LoweringError, match="row ids or scales read 'out', which the part adds rows into"):
        lower_grouped_gemm(_expert_gemm_kernel("scaled by out"), "grouped_gemm")


def test_an_f32_output_falls_back_to_the_general_lowering():
    k = _program(out_dtype=tl.float32)
    with pytest.raises(LoweringError, match="C must be bf16 or f16, got f32"):
        lower_grouped_gemm(k, "grouped_gemm")
    with pytest.warns(tl.FallbackWarning, match="C must be bf16 or f16, got f32"):
        lw = lower(k, "grouped_gemm")
    assert "tldsl::gen::add_to" in lw.source


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
@pytest.mark.parametrize("dtype,red,tile,cluster,K", [
    (tl.bfloat16, "REDG.E.ADD.BF16x8", (128, 256, 64), 1, 128),
    (tl.float16, "REDG.E.ADD.F16x8", (128, 256, 64), 1, 128),
    (tl.bfloat16, "REDG.E.ADD.BF16x8", (64, 256, 64), 1, 128),
    # the bench's: clusters of two, the small experts' K (32-bit targets spilled 16-32 bytes here)
    (tl.bfloat16, "REDG.E.ADD.BF16x8", (128, 256, 64), 2, 384),
    (tl.bfloat16, "REDG.E.ADD.BF16x8", (128, 256, 64), 2, 1536),
])
def test_the_added_rows_kernel_compiles_without_spills_to_vector_reductions(tmp_path, dtype, red, tile, cluster, K):
    lw = lower_grouped_gemm(_program(dtype, tile=tile, K=K), "grouped_gemm", cluster=(cluster, 1))
    ck = lw.compile(cache=KernelCache(tmp_path), progress=False)
    info = ck.ptxas_info()[ck.name]
    assert info["spill_store_bytes"] == info["spill_load_bytes"] == info["stack_bytes"] == 0, info
    sass = ck.sass()[ck.name]
    assert any(red in ln for ln in sass.lines), sorted(sass.opcodes)
    assert not any("UTMASTG" in ln or "UBLKCP.G.S" in ln for ln in sass.lines)    # nothing stored by TMA


# -- the output cleared by another part, the adds waiting for it after the K loop ---------------------------

@tl.kernel
def clearing_combine(h, w2, row_weights, sorted_token_ids, tile_expert, tile_valid_rows, out, *,
                     compute: tl.ComputeSchedule = None, wait: bool = True):
    """``moe_combined_experts`` writing ``out`` rather than adding to it: a part clears ``out`` (16-row
    tiles of zeros, each notifying ``out_cleared``), and each GEMM tile waits for every clear tile after
    its K loop, before its ``tl.add_rows`` (``wait=False``: the bug, the adds racing the clear)."""
    from tldsl.ops.moe import _expert_rows_and_weights, expert_rows_tile
    BM, BN, BK = compute.tile
    R, Nr, E, K, NT = _expert_rows_and_weights("clearing_combine", h, w2, tile_expert, "kn", BM)
    ZR = 16
    ZT = tl.cdiv(out.shape[0], ZR)
    cleared = tl.signal("out_cleared", 1, scope="local")
    tiles = tl.DynamicMapping("expert_tiles", NT, expert=tile_expert, valid_rows=tile_valid_rows)

    @tl.compute_part(grid=(ZT,))
    def clear(z):
        tl.store(out, (z * ZR, 0), tl.zeros((ZR, K), tl.float32))
        tl.producer_tile_notify(cleared, 0)

    @tl.compute_part(grid=(NT, tl.cdiv(K, BN)))
    def grouped_gemm(i, pn):
        with tl.when(tiles["expert", i] >= 0):
            y = expert_rows_tile(h, w2, tiles, i, pn, compute.tile)
            scale = tl.load(row_weights, (i * BM,), (BM,))[:, None]
            tokens = tl.load(sorted_token_ids, (i * BM,), (BM,))
            tokens = tl.where(tl.iota(BM) < tiles["valid_rows", i], tokens, -1)
            if wait:
                tl.consumer_tile_wait(cleared, 0, count=ZT)
            tl.add_rows(out, tokens, pn * BN, y * scale)


def clearing_program(rt, K, N, E, dtype=tl.float16, tile=(64, 128, 64), cluster=1, wait=True):
    S = tl.TensorSpec
    return clearing_combine.trace(
        1, S((rt.num_rows, K), dtype), S((E, K, N), dtype), S((rt.num_rows,), tl.float32), S.of(rt.sorted_token_ids),
        S.of(rt.tile_expert), S.of(rt.tile_valid_rows), S((rt.num_tokens, N), dtype),
        compute=tl.ComputeSchedule(tile=tile, order="swizzled", cluster=(cluster, 1)), wait=wait)


@pytest.mark.parametrize("T,E,topk", [(70, 5, 2), (200, 7, 3)])
def test_an_output_cleared_by_another_part_holds_only_the_weighted_rows(T, E, topk):
    rt, wts = _routing(T, E, topk, 64, seed=T)
    ins = _inputs(rt, wts, 64, 128, E, seed=T)
    ins["out"] = np.full_like(ins["out"], np.nan)          # poisoned: every element is cleared, then added to
    got = tl.simulate(clearing_program(rt, 64, 128, E), 1, [ins])[0]["out"].astype(np.float64)
    want = reference_moe_reduce_scatter([ins["h"]], [ins["w2"]], wts, rt)
    scale = reference_moe_reduce_scatter([np.abs(ins["h"])], [np.abs(ins["w2"])], wts, rt)
    assert np.all(np.abs(got - want) <= (topk + 2) * 2.0**-10 * scale + 1e-3)


def test_without_its_wait_the_clear_races_the_adds():
    rt, wts = _routing(70, 5, 2, 64)
    k = clearing_program(rt, 64, 128, 5, wait=False)
    assert not [op for op in k.part("grouped_gemm").walk() if op.name == "consumer_tile_wait"]
    with pytest.raises(tl.RaceError, match="race on out"):
        tl.simulate(k, 1, [_inputs(rt, wts, 64, 128, 5)])


def test_a_wait_after_the_k_loop_runs_on_the_consumers_before_the_rows_are_held():
    rt, _ = _routing(300, 6, 2, 128)
    k = clearing_program(rt, 128, 512, 6, tl.bfloat16, tile=(128, 256, 64), cluster=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                     # no fallback to the general lowering
        lw = lower(k, "grouped_gemm")
    assert type(lw).__name__ == "LoweredGroupedGemm" and lw.waits == 1
    src = lw.source
    assert "kHasWaits = false;" in src and "kHasLateWaits = true;" in src
    late = src[src.index("void late_waits("):]
    assert "wait_at_least" in late[:late.index("\n  }")]
    # tl.run: by default the GEMM runs after the clear on its stream, the wait dropped as the stream orders
    # them; beside it (chain="beside"), on a stream of its own, the consumers run the wait
    from tldsl.runtime.gpu.run_plan import lower_for_run, plan_run
    after = lower_for_run(k)
    assert "kHasLateWaits = false;" in after["grouped_gemm"].source
    assert "stream 0 after clear" in plan_run(k, after, sm_count=132, occupancy=lambda lk: 1).describe()
    beside = lower_for_run(k, chain="beside")
    assert "kHasLateWaits = true;" in beside["grouped_gemm"].source
    assert "after clear" not in plan_run(k, beside, sm_count=132, occupancy=lambda lk: 1, chain="beside").describe()


def test_a_wait_after_the_rows_are_added_or_in_a_storing_gemm_is_refused():
    from tldsl.ops.moe import _expert_rows_and_weights, expert_rows_tile

    @tl.kernel
    def late(h, w2, tile_expert, tile_valid_rows, out, *, compute: tl.ComputeSchedule = None, order=""):
        BM, BN, BK = compute.tile
        R, Nr, E, K, NT = _expert_rows_and_weights("late", h, w2, tile_expert, "kn", BM)
        done = tl.signal("done", 1, scope="local")
        tiles = tl.DynamicMapping("expert_tiles", NT, expert=tile_expert, valid_rows=tile_valid_rows)

        @tl.compute_part(grid=(1,))
        def other(z):
            tl.producer_tile_notify(done, 0)

        @tl.compute_part(grid=(NT, tl.cdiv(K, BN)))
        def grouped_gemm(i, pn):
            with tl.when(tiles["expert", i] >= 0):
                y = expert_rows_tile(h, w2, tiles, i, pn, compute.tile)
                if order == "wait, store":
                    tl.consumer_tile_wait(done, 0, count=1)
                if order == "add, wait":
                    tl.add_rows(out, tl.iota(BM), pn * BN, y)
                else:
                    tl.store(out, (i * BM, pn * BN), y)
                if order != "wait, store":
                    tl.consumer_tile_wait(done, 0, count=1)

    rt, _ = _routing(100, 4, 2, 64)
    S = tl.TensorSpec
    # after the adds; after a store; between the K loop and a store (only added rows take a late wait)
    for order in ("add, wait", "store, wait", "wait, store"):
        k = late.trace(1, S((rt.num_rows, 64), tl.float16), S((4, 64, 128), tl.float16), S.of(rt.tile_expert),
                       S.of(rt.tile_valid_rows), S((rt.num_rows, 128), tl.float16),
                       compute=tl.ComputeSchedule(tile=(64, 128, 64)), order=order)
        with pytest.raises(LoweringError, match="after the K loop: waits must precede the tile's loads"):
            lower_grouped_gemm(k, "grouped_gemm")


@pytest.mark.nvrtc
@pytest.mark.skipif(not _OK, reason=f"CUDA wheels missing (NVRTC compile tests): {_WHY}")
def test_the_late_waiting_kernel_compiles_without_spills(tmp_path):
    rt, _ = _routing(1000, 8, 2, 128)
    lw = lower_grouped_gemm(clearing_program(rt, 384, 512, 8, tl.bfloat16, tile=(128, 256, 64), cluster=2),
                            "grouped_gemm")
    ck = lw.compile(cache=KernelCache(tmp_path), progress=False)
    info = ck.ptxas_info()[ck.name]
    assert info["spill_store_bytes"] == info["spill_load_bytes"] == info["stack_bytes"] == 0, info
