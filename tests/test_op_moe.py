"""AllGather+MoE and MoE+ReduceScatter (tensor-parallel MoE with run-time mappings):
the routing tables, both kernels against numpy for fixed cases, the whole layer end to end,
and bad inputs rejected before anything is simulated."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import tldsl as tl
from tldsl.ops.moe import (allgather_moe, moe_num_tiles, moe_reduce_scatter, moe_routing, random_routing,
                           reference_allgather_moe, reference_moe, reference_moe_reduce_scatter,
                           simulate_allgather_moe, simulate_moe_reduce_scatter)

F16 = np.float16


def _compute(BM=8, BN=8, BK=8, order="row_major"):
    return tl.ComputeSchedule(tile=(BM, BN, BK), order=order)


# -- the routing tables ----------------------------------------------------------------------------

def _check_tables(rt, ids):
    """Every invariant the kernels rely on, checked from scratch."""
    T, topk = ids.shape
    BM, E = rt.block_m, rt.num_experts
    assert rt.num_tiles == moe_num_tiles(T * topk, E, BM)
    for name in ("sorted_token_ids", "tile_expert", "tile_valid_rows", "tile_tokens", "tile_ranks", "tile_visit",
                 "token_pos", "tile_token_tiles", "tile_num_token_tiles", "token_tile_producers"):
        assert getattr(rt, name).dtype == np.int32, name
    assert rt.tile_visit.tolist() == _visit_from_scratch(rt)
    # every routed (t, k) has one sorted row, in a tile of its expert
    row_of = rt.row_of
    assert sorted(row_of.ravel().tolist()) == sorted(set(row_of.ravel().tolist()))
    for t in range(T):
        for k in range(topk):
            r = row_of[t, k]
            assert rt.sorted_token_ids[r] == t
            assert rt.tile_expert[r // BM] == ids[t, k]
    assert (rt.sorted_token_ids >= 0).sum() == T * topk
    assert np.array_equal(rt.expert_counts, np.bincount(ids.ravel(), minlength=E))
    producers = np.zeros_like(rt.token_tile_producers)
    used = rt.tile_expert >= 0
    # used tiles first, experts ascending; unused tiles are all padding
    assert not np.any(used[1:] & ~used[:-1])
    assert np.all(np.diff(rt.tile_expert[used]) >= 0)
    for i in range(rt.num_tiles):
        toks = rt.sorted_token_ids[i * BM:(i + 1) * BM]
        n = rt.tile_valid_rows[i]
        assert np.all(toks[n:] == -1) and np.all(toks[:n] >= 0)
        if not used[i]:
            assert n == 0 and list(rt.tile_tokens[i]) == [0, 0] and rt.tile_num_token_tiles[i] == 0
            assert np.all(rt.tile_token_tiles[i] == -1)
            continue
        real = toks[:n]
        assert np.all(np.diff(real) > 0), "tokens of an expert tile must increase"
        assert list(rt.tile_tokens[i]) == [real.min(), real.max() + 1]
        assert list(rt.tile_ranks[i]) == [real.min() // rt.rows_per_rank, real.max() // rt.rows_per_rank + 1]
        tts = np.unique(real // BM)
        m = rt.tile_num_token_tiles[i]
        assert m == tts.size and np.array_equal(rt.tile_token_tiles[i, :m], tts)
        assert np.all(rt.tile_token_tiles[i, m:] == -1)
        producers[tts] += 1
    # each expert's rows start on a tile boundary and fill ceil(count / BM) tiles
    for e in range(E):
        assert (rt.tile_expert == e).sum() == -(-rt.expert_counts[e] // BM)
    assert np.array_equal(producers, rt.token_tile_producers)
    assert np.all(rt.token_tile_producers >= 1)


def _visit_from_scratch(rt):
    """tile_visit by its definition: the used tiles sorted by ((2l + 1) / n_e, e) — tile l of the n_e
    tiles of expert e, in layout order — then the unused ones in place."""
    te = rt.tile_expert.tolist()
    n = {e: te.count(e) for e in set(te) if e >= 0}
    local, key = {}, {}
    for i, e in enumerate(te):
        if e >= 0:
            key[i] = (Fraction(2 * local.get(e, 0) + 1, n[e]), e)
            local[e] = local.get(e, 0) + 1
    return sorted(key, key=key.get) + [i for i, e in enumerate(te) if e < 0]


@pytest.mark.parametrize("interleave", [None, 1, 2, 3])
@pytest.mark.parametrize("E,topk,BM,kind", [(8, 2, 8, "random"), (5, 3, 4, "random"), (6, 2, 8, "concentrated"),
                                            (1, 1, 8, "random"), (64, 6, 4, "random")])
def test_tile_visit_orders_the_tiles_by_where_their_tokens_lie(E, topk, BM, kind, interleave):
    """``tile_visit`` is a permutation of the row tiles: the used ones by their place in their expert
    (tiles over the same tokens together, whatever the layout), the unused ones last."""
    rng = np.random.default_rng(E * 10 + topk)
    T = 96
    ids, _ = random_routing(rng, T, E, topk, kind)
    rt = moe_routing(ids, E, 1, T, BM, interleave=interleave)
    assert rt.tile_visit.dtype == np.int32
    assert rt.tile_visit.tolist() == _visit_from_scratch(rt)
    used = int((rt.tile_expert >= 0).sum())
    first = rt.tile_tokens[rt.tile_visit[:used], 0]
    if kind == "random" and E > 1 and interleave is None:
        # the first tokens of the tiles visited in turn rise with the visit, all but locally
        assert np.corrcoef(np.arange(used), first)[0, 1] > 0.9


@pytest.mark.parametrize("W,Ms,E,topk,BM,kind", [
    (1, 5, 3, 1, 8, "random"), (3, 7, 5, 2, 8, "random"), (4, 12, 6, 3, 16, "random"),
    (8, 12, 6, 3, 8, "random"), (2, 9, 4, 1, 8, "concentrated"), (5, 3, 6, 3, 32, "concentrated"),
    (2, 12, 1, 1, 8, "random")])
def test_routing_tables(W, Ms, E, topk, BM, kind):
    rng = np.random.default_rng(W * 100 + Ms)
    ids, wts = random_routing(rng, W * Ms, E, topk, kind)
    assert np.allclose(wts.sum(axis=1), 1) and np.all(wts > 0)
    assert all(len(set(row)) == topk for row in ids.tolist())
    _check_tables(moe_routing(ids, E, W, Ms, BM), ids)


def test_routing_tables_by_hand():
    # 2 ranks x 3 tokens, topk 2, 4 experts (expert 2 gets no token), BM = 2
    ids = np.array([[0, 1], [3, 0], [1, 0], [0, 3], [1, 3], [0, 1]], np.int32)
    rt = moe_routing(ids, 4, 2, 3, 2)
    assert rt.expert_counts.tolist() == [5, 4, 0, 3]
    assert rt.num_tiles == min(12, (12 + 4 * 1) // 2) == 8
    # expert 0: tokens 0 1 2 3 5 -> 3 tiles; expert 1: 0 2 4 5 -> 2 tiles; expert 3: 1 3 4 -> 2 tiles
    assert rt.tile_expert.tolist() == [0, 0, 0, 1, 1, 3, 3, -1]
    assert rt.sorted_token_ids.tolist() == [0, 1, 2, 3, 5, -1, 0, 2, 4, 5, 1, 3, 4, -1, -1, -1]
    assert rt.tile_valid_rows.tolist() == [2, 2, 1, 2, 2, 2, 1, 0]
    assert rt.tile_tokens.tolist() == [[0, 2], [2, 4], [5, 6], [0, 3], [4, 6], [1, 4], [4, 5], [0, 0]]
    assert rt.tile_ranks.tolist() == [[0, 1], [0, 2], [1, 2], [0, 1], [1, 2], [0, 2], [1, 2], [0, 0]]
    assert rt.row_of.tolist() == [[0, 6], [10, 1], [7, 2], [3, 11], [8, 12], [4, 9]]
    # token tiles of 2 tokens: {0,1}, {2,3}, {4,5}
    assert rt.tile_token_tiles.tolist() == [[0, -1], [1, -1], [2, -1], [0, 1], [2, -1], [0, 1], [2, -1],
                                            [-1, -1]]
    assert rt.token_tile_producers.tolist() == [3, 3, 3]      # e.g. tokens {4, 5}: tiles 2, 4 and 6
    # by (2l + 1) / n_e, ties by expert: 1/6 (tile 0), 1/4 (tiles 3, 5), 3/6 (1), 3/4 (4, 6), 5/6 (2); unused 7
    assert rt.tile_visit.tolist() == [0, 3, 5, 1, 4, 6, 2, 7]
    assert rt.tile_tokens[rt.tile_visit[:7], 0].tolist() == [0, 0, 1, 2, 4, 4, 5]
    assert rt.num_rows == 16
    _check_tables(rt, ids)


def test_num_tiles_bound_is_the_worst_case():
    # every expert one row past a tile boundary: the bound is reached exactly
    BM, E = 8, 3
    counts = [BM + 1, 1, 2 * BM + 1]
    ids = np.concatenate([np.full(c, e) for e, c in enumerate(counts)]).astype(np.int32)[:, None]
    rt = moe_routing(ids, E, 1, ids.shape[0], BM)
    assert (rt.tile_expert >= 0).sum() == rt.num_tiles == 2 + 1 + 3
    # and no routing of the same sizes needs more tiles
    rng = np.random.default_rng(0)
    for _ in range(200):
        T, E, BM = int(rng.integers(1, 30)), int(rng.integers(1, 7)), int(rng.choice([8, 16]))
        topk = int(rng.integers(1, E + 1))
        ids = np.stack([rng.choice(E, topk, replace=False) for _ in range(T)])
        rt = moe_routing(ids, E, 1, T, BM)
        assert (rt.tile_expert >= 0).sum() == sum(-(-c // BM) for c in rt.expert_counts) <= rt.num_tiles


# -- AllGather + MoE -------------------------------------------------------------------------------

def _allgather_inputs(rng, W, Ms, K, Nr, E, ids, BM):
    rt = moe_routing(ids, E, W, Ms, BM)
    xs = [rng.standard_normal((Ms, K)).astype(F16) for _ in range(W)]
    w1 = [rng.standard_normal((E, K, Nr)).astype(F16) for _ in range(W)]
    inputs = [dict(x=xs[r], w1=w1[r], h=np.full((rt.num_rows, Nr), np.nan, F16), **rt.allgather_tables())
              for r in range(W)]
    return rt, xs, w1, inputs


def _check_h(res, rt, xs, w1, W):
    for r in range(W):
        want = reference_allgather_moe(xs, w1[r], rt)
        got = res[r]["h"].astype(np.float32)
        np.testing.assert_allclose(got, want, rtol=2e-2, atol=3e-2)
        pad = rt.sorted_token_ids < 0
        assert np.all(got[pad] == 0), "padding rows and unused tiles of h must be zero"


AG_COMMS = [tl.CommSchedule(tile_m=8, mode="pull"), tl.CommSchedule(tile_m=8, mode="push", order="full_mesh"),
            tl.CommSchedule(tile_m=None, mode="pull", order="full_mesh", sms=1),
            tl.CommSchedule(tile_m=16, mode="push", sms=3),
            tl.CommSchedule(engine="copy_engine", mode="pull"), tl.CommSchedule(engine="copy_engine", mode="push")]


@pytest.mark.parametrize("comm", AG_COMMS, ids=str)
@pytest.mark.parametrize("W,Ms,K,Nr,E,topk,kind", [
    (1, 11, 20, 13, 4, 2, "random"), (3, 7, 20, 13, 5, 2, "random"), (8, 2, 24, 10, 6, 3, "random"),
    (4, 5, 9, 24, 6, 1, "concentrated")])
def test_allgather_moe_matches_numpy(W, Ms, K, Nr, E, topk, kind, comm):
    rng = np.random.default_rng(W * 7 + K)
    ids, _ = random_routing(rng, W * Ms, E, topk, kind)
    compute = _compute(BM=8, BN=8 if Nr < 16 else 16, BK=8)
    rt, xs, w1, inputs = _allgather_inputs(rng, W, Ms, K, Nr, E, ids, compute.BM)
    res = tl.simulate(allgather_moe, W, inputs, seed=W, compute=compute, comm=comm)
    _check_h(res, rt, xs, w1, W)


@pytest.mark.parametrize("comm", AG_COMMS[:2] + AG_COMMS[4:], ids=str)
@pytest.mark.parametrize("W,Ms,K,Nr,E,topk,kind,BK", [
    (1, 11, 72, 13, 4, 2, "random", 16),      # K = 72: chunks of 64 + 8
    (3, 7, 100, 16, 5, 2, "random", 8),        # chunks of 32: 3 whole + 4
    (2, 5, 40, 24, 3, 1, "concentrated", 8)])
def test_allgather_moe_with_staged_rows_matches_numpy(W, Ms, K, Nr, E, topk, kind, BK, comm):
    """``stage_rows=True``: the routed rows gathered by a part of their own in column chunks of
    4 * BK (the last one partial), the grouped GEMM waiting for every chunk of its row tile."""
    rng = np.random.default_rng(W * 5 + K)
    ids, _ = random_routing(rng, W * Ms, E, topk, kind)
    compute = _compute(BM=8, BN=8 if Nr < 16 else 16, BK=BK)
    rt, xs, w1, inputs = _allgather_inputs(rng, W, Ms, K, Nr, E, ids, compute.BM)
    k = allgather_moe.trace(W, *[tl.TensorSpec.of(inputs[0][a]) for a in allgather_moe.arg_names], compute=compute,
                            comm=comm, stage_rows=True)
    gather = k.part("gather_rows")
    assert gather.grid == (rt.num_tiles, -(-K // (4 * BK))) and gather.grid[1] >= 2
    res = tl.simulate(allgather_moe, W, inputs, seed=W, compute=compute, comm=comm, stage_rows=True)
    _check_h(res, rt, xs, w1, W)


def test_allgather_moe_empty_experts_and_one_expert():
    W, Ms, K, Nr, E = 3, 6, 12, 16, 6
    rng = np.random.default_rng(5)
    compute = _compute(16, 16, 16)
    for ids in (np.full((W * Ms, 1), 4, np.int32),                                  # all tokens -> expert 4
                np.stack([[1, 3] if t % 2 else [3, 1] for t in range(W * Ms)]).astype(np.int32)):
        rt, xs, w1, inputs = _allgather_inputs(rng, W, Ms, K, Nr, E, ids, compute.BM)
        assert (rt.expert_counts == 0).sum() >= 4
        res = tl.simulate(allgather_moe, W, inputs, seed=1, compute=compute,
                          comm=tl.CommSchedule(tile_m=8, mode="push"))
        _check_h(res, rt, xs, w1, W)


def test_padding_rows_are_zeros_whatever_the_weights_hold():
    """Both programs store a tile's rows past its valid ones as zeros (what lets a GPU leave them
    uncomputed): with an infinite weight, 0 * inf would be NaN in those rows of a plain product."""
    W, Ms, K, Nr, E = 2, 5, 16, 16, 3
    rng = np.random.default_rng(11)
    compute = _compute(8, 8, 8)
    ids = rng.integers(0, E, (W * Ms, 2)).astype(np.int32)
    ids[:, 1] = (ids[:, 0] + 1) % E
    rt, xs, w1, inputs = _allgather_inputs(rng, W, Ms, K, Nr, E, ids, compute.BM)
    for inp in inputs:
        inp["w1"] = inp["w1"].copy()
        inp["w1"][:, 0, 0] = np.inf                  # every expert's first column meets an inf
    res = tl.simulate(allgather_moe, W, inputs, seed=2, compute=compute, comm=tl.CommSchedule(tile_m=8, mode="pull"))
    pad = rt.sorted_token_ids < 0
    assert pad.any() and ((rt.tile_valid_rows < compute.BM) & (rt.tile_expert >= 0)).any()
    for r in range(W):
        h = res[r]["h"]
        assert np.all(h[pad] == 0) and not np.signbit(h[pad]).any()   # +0.0, as the kernel stores
        assert np.isinf(h[~pad][:, 0]).any() or np.isnan(h[~pad][:, 0]).any()   # the routed rows did meet it
    # MoE+ReduceScatter: h's padding rows hold NaN, y_sorted's padding rows are zeros all the same, and
    # the combine reads routed rows only
    wts = rng.random((W * Ms, 2)).astype(np.float32)
    hs = [np.where(pad[:, None], np.float16(np.nan), rng.standard_normal((rt.num_rows, Nr))).astype(F16)
          for _ in range(W)]
    w2 = [rng.standard_normal((E, Nr, K)).astype(F16) for _ in range(W)]
    k = rt.trace_moe_reduce_scatter(W, Ms, Nr, K, E, wts, tl.float16, compute=compute,
                                    comm=tl.CommSchedule(tile_m=8, order="ring", mode="push"))
    ins = [dict(h=hs[r], w2=w2[r], topk_weights=wts, out=np.full((Ms, K), np.nan, F16),
                **rt.reduce_scatter_tables()) for r in range(W)]
    out = tl.simulate(k, W, ins, seed=3)
    for r in range(W):
        y = out.workspaces[r]["y_sorted"]
        used = np.repeat(rt.tile_expert >= 0, rt.block_m)
        assert np.all(y[pad & used] == 0) and np.isfinite(y[used]).all()
        assert np.isfinite(out[r]["out"]).all()


def test_allgather_moe_one_kernel_serves_every_routing():
    W, Ms, K, Nr, E, topk = 2, 6, 16, 8, 4, 2
    compute, comm = _compute(8, 8, 8), tl.CommSchedule(tile_m=8)
    rng = np.random.default_rng(11)
    traced = set()
    for kind in ("random", "concentrated", "random"):
        ids, _ = random_routing(rng, W * Ms, E, topk, kind)
        rt, xs, w1, inputs = _allgather_inputs(rng, W, Ms, K, Nr, E, ids, compute.BM)
        traced.add(id(allgather_moe.trace(W, *[inputs[0][a] for a in allgather_moe.arg_names],
                                          compute=compute, comm=comm)))
        _check_h(tl.simulate(allgather_moe, W, inputs, seed=2, compute=compute, comm=comm), rt, xs, w1, W)
    assert len(traced) == 1, "the routing lives in table arguments: one compiled kernel for all of them"


def test_allgather_moe_persistent_kernel_with_few_slots():
    # two resident compute tiles per rank: waits on tokens that arrive late must not starve others
    W, Ms, K, Nr, E = 4, 3, 8, 8, 3
    rng = np.random.default_rng(3)
    ids, _ = random_routing(rng, W * Ms, E, 2, "random")
    rt, xs, w1, inputs = _allgather_inputs(rng, W, Ms, K, Nr, E, ids, 8)
    res = tl.simulate(allgather_moe, W, inputs, seed=4, options=tl.SimOptions(compute_slots=2),
                      compute=_compute(8, 8, 8), comm=tl.CommSchedule(tile_m=8, mode="pull", sms=1))
    _check_h(res, rt, xs, w1, W)


def test_allgather_moe_waits_only_for_the_rows_in_the_tables():
    # a tile whose token range is cut short reads rows it never waited for: a race
    W, Ms, K, Nr, E = 3, 4, 8, 8, 2
    ids = np.zeros((W * Ms, 1), np.int32)                 # one expert, tokens 0..11, BM=16: one tile
    rng = np.random.default_rng(0)
    rt, xs, w1, inputs = _allgather_inputs(rng, W, Ms, K, Nr, E, ids, 16)
    assert rt.tile_tokens[0].tolist() == [0, 12]
    compute = _compute(16, 8, 8)
    for comm in (tl.CommSchedule(tile_m=8, mode="pull"), tl.CommSchedule(engine="copy_engine", mode="push")):
        tl.simulate(allgather_moe, W, inputs, compute=compute, comm=comm)    # the right tables: clean
        for r in range(W):
            inputs[r]["tile_tokens"] = np.array([[0, 5]] + [[0, 0]] * (rt.num_tiles - 1), np.int32)
        with pytest.raises(tl.RaceError, match="x_gathered"):
            tl.simulate(allgather_moe, W, inputs, compute=compute, comm=comm)
        for r in range(W):
            inputs[r]["tile_tokens"] = rt.tile_tokens


def test_a_visit_order_that_is_no_permutation_is_a_race_the_simulator_names():
    """The staged row gather finds its row tile in ``tile_visit``: a table visiting one tile twice
    (and another never) has two tasks write the same rows of ``x_sorted`` unordered."""
    W, Ms, K, Nr, E = 2, 8, 16, 8, 4
    rng = np.random.default_rng(3)
    ids, _ = random_routing(rng, W * Ms, E, 2)
    rt, xs, w1, inputs = _allgather_inputs(rng, W, Ms, K, Nr, E, ids, 8)
    compute, comm = _compute(8, 8, 8), tl.CommSchedule(tile_m=8, mode="pull")
    _check_h(tl.simulate(allgather_moe, W, inputs, compute=compute, comm=comm, stage_rows=True), rt, xs, w1, W)
    bad = rt.tile_visit.copy()
    bad[1] = bad[0]
    for r in range(W):
        inputs[r]["tile_visit"] = bad
    with pytest.raises(tl.RaceError, match=r"x_sorted.*gather_rows\(0,0\)"):
        tl.simulate(allgather_moe, W, inputs, compute=compute, comm=comm, stage_rows=True)


# -- MoE + ReduceScatter ---------------------------------------------------------------------------

def _rs_inputs(rng, W, Ms, K, Nr, E, ids, wts, BM):
    rt = moe_routing(ids, E, W, Ms, BM)
    hs = [rng.standard_normal((rt.num_rows, Nr)).astype(F16) for _ in range(W)]
    w2 = [rng.standard_normal((E, Nr, K)).astype(F16) for _ in range(W)]
    inputs = [dict(h=hs[r], w2=w2[r], topk_weights=wts, out=np.full((Ms, K), np.nan, F16),
                   **rt.reduce_scatter_tables()) for r in range(W)]
    return rt, hs, w2, inputs


def _check_out(res, rt, hs, w2, wts, W, Ms):
    want = reference_moe_reduce_scatter(hs, w2, wts, rt)
    tol = 2e-2 * max(1.0, np.sqrt(W * hs[0].shape[1]) / 4)
    for r in range(W):
        np.testing.assert_allclose(res[r]["out"].astype(np.float32), want[r * Ms:(r + 1) * Ms], rtol=2e-2, atol=tol)


RS_COMMS = [tl.CommSchedule(tile_m=8, order="ring", mode="push"), tl.CommSchedule(order="ring", mode="pull"),
            tl.CommSchedule(tile_m=8, order="full_mesh", mode="pull", sms=1),
            tl.CommSchedule(order="full_mesh", mode="push", sms=3)]


@pytest.mark.parametrize("comm", RS_COMMS, ids=str)
@pytest.mark.parametrize("W,Ms,K,Nr,E,topk,kind", [
    (1, 9, 20, 13, 4, 2, "random"), (3, 7, 20, 13, 5, 2, "random"), (8, 2, 10, 24, 6, 3, "random"),
    (4, 5, 24, 9, 6, 1, "concentrated")])
def test_moe_reduce_scatter_matches_numpy(W, Ms, K, Nr, E, topk, kind, comm):
    rng = np.random.default_rng(W * 13 + K)
    ids, wts = random_routing(rng, W * Ms, E, topk, kind)
    compute = _compute(BM=8, BN=8 if K < 16 else 16, BK=8, order="comm_aligned")
    rt, hs, w2, inputs = _rs_inputs(rng, W, Ms, K, Nr, E, ids, wts, compute.BM)
    res = tl.simulate(moe_reduce_scatter, W, inputs, seed=W, compute=compute, comm=comm)
    _check_out(res, rt, hs, w2, wts, W, Ms)


def test_moe_reduce_scatter_partials_in_the_output_dtype():
    """partial_dtype='out': each rank's combined rows are rounded to out's dtype when stored (the
    workspace and the reduce-scatter's traffic in fp16) and the owner adds them in fp16, so the
    result differs from fp32 partials (summed in fp32, rounded once) by those roundings only: half
    an fp16 ulp of each of the W partials, of each of the W - 2 sums in between and of both outputs."""
    W, Ms, K, Nr, E = 3, 8, 24, 16, 5
    rng = np.random.default_rng(11)
    ids, wts = random_routing(rng, W * Ms, E, 2, "random")
    compute = _compute(8, 8, 8, order="comm_aligned")
    rt, hs, w2, inputs = _rs_inputs(rng, W, Ms, K, Nr, E, ids, wts, compute.BM)
    comm = tl.CommSchedule(tile_m=8, order="full_mesh", mode="push")
    outs = {}
    for pd, dt in (("f32", "f32"), ("out", "f16")):
        k = rt.trace_moe_reduce_scatter(W, Ms, Nr, K, E, wts, tl.float16, compute=compute, comm=comm, partial_dtype=pd)
        assert k.buffer("partial").type.dtype.name == dt
        res = tl.simulate(moe_reduce_scatter, W, inputs, seed=1, compute=compute, comm=comm, partial_dtype=pd)
        _check_out(res, rt, hs, w2, wts, W, Ms)
        outs[pd] = np.concatenate([res[r]["out"].astype(np.float32) for r in range(W)])
    diff = np.abs(outs["out"] - outs["f32"])
    assert diff.max() > 0                                       # the partials were rounded ...

    def ulp(x):       # (magnitudes from numpy's partials, 1 % over: the simulator's may cross a power of 2)
        return np.spacing((np.abs(x) * 1.01).astype(F16)).astype(np.float32)
    rank_partials = [reference_moe_reduce_scatter([hs[r]], [w2[r]], wts, rt) for r in range(W)]
    largest_sum = sum(np.abs(p) for p in rank_partials)
    bound = (sum(ulp(p) / 2 for p in rank_partials) + (W - 2) * ulp(largest_sum) / 2
             + ulp(np.maximum(np.abs(outs["out"]), np.abs(outs["f32"]))))
    assert (diff <= bound).all()                                # ... by those roundings, no more


def test_moe_reduce_scatter_refuses_an_unknown_partial_dtype():
    rt, hs, w2, inputs = _rs_case()
    with pytest.raises(tl.CompilationError, match="partial_dtype='bf16': choose 'f32' or 'out'"):
        tl.simulate(moe_reduce_scatter, 2, inputs, compute=_compute(), comm=tl.CommSchedule(tile_m=8),
                    partial_dtype="bf16")


def test_moe_reduce_scatter_all_tokens_to_one_expert():
    W, Ms, K, Nr, E = 3, 5, 12, 10, 5
    rng = np.random.default_rng(8)
    ids = np.full((W * Ms, 1), 2, np.int32)
    wts = np.ones((W * Ms, 1), np.float32)
    rt, hs, w2, inputs = _rs_inputs(rng, W, Ms, K, Nr, E, ids, wts, 8)
    assert (rt.expert_counts > 0).sum() == 1
    res = tl.simulate(moe_reduce_scatter, W, inputs, seed=0, compute=_compute(8, 16, 8),
                      comm=tl.CommSchedule(tile_m=8, mode="pull"))
    _check_out(res, rt, hs, w2, wts, W, Ms)


def test_moe_reduce_scatter_combine_waits_for_its_producers():
    # the producer counts are the combine's wait counts: one too many hangs, one too few races
    W, Ms, K, Nr, E = 2, 8, 8, 8, 3
    rng = np.random.default_rng(2)
    ids, wts = random_routing(rng, W * Ms, E, 2, "random")
    rt, hs, w2, inputs = _rs_inputs(rng, W, Ms, K, Nr, E, ids, wts, 8)
    kw = dict(compute=_compute(8, 8, 8), comm=tl.CommSchedule(tile_m=8))
    tl.simulate(moe_reduce_scatter, W, inputs, **kw)
    j = int(np.argmax(rt.token_tile_producers))
    assert rt.token_tile_producers[j] >= 2
    for delta, error in ((1, tl.DeadlockError), (-1, tl.RaceError)):
        bad = rt.token_tile_producers.copy()
        bad[j] += delta
        with pytest.raises(error):
            tl.simulate(moe_reduce_scatter, W, [dict(i, token_tile_producers=bad) for i in inputs], **kw)


# -- the whole layer --------------------------------------------------------------------------------

@pytest.mark.parametrize("W,Ms,K,N,E,topk", [(1, 6, 16, 12, 3, 2), (2, 5, 12, 8, 4, 2), (4, 3, 8, 16, 5, 3),
                                            (8, 1, 16, 8, 6, 2)])
def test_tensor_parallel_moe_layer_end_to_end(W, Ms, K, N, E, topk):
    """x -> AllGather+MoE -> activation (elementwise, so it commutes with the N split) ->
    MoE+ReduceScatter equals the unsplit MoE layer computed from scratch."""
    rng = np.random.default_rng(W + K)
    Nr = N // W if N % W == 0 else N
    xs = [(rng.standard_normal((Ms, K)) / 2).astype(F16) for _ in range(W)]
    w1 = [(rng.standard_normal((E, K, Nr)) / np.sqrt(K)).astype(F16) for _ in range(W)]
    w2 = [(rng.standard_normal((E, Nr, K)) / np.sqrt(Nr)).astype(F16) for _ in range(W)]
    ids, wts = random_routing(rng, W * Ms, E, topk, "random")
    compute = _compute(8, 8, 8)
    rt, h = simulate_allgather_moe(xs, w1, ids, compute=compute, comm=tl.CommSchedule(tile_m=8, mode="push"))

    def act(v):
        return np.maximum(v, 0)

    h_act = [act(x.astype(np.float32)).astype(F16) for x in h]
    out = simulate_moe_reduce_scatter(h_act, w2, wts, rt, compute=compute,
                                      comm=tl.CommSchedule(tile_m=8, order="ring", mode="pull"))
    want = reference_moe(xs, w1, w2, ids, wts, activation=act)
    for r in range(W):
        np.testing.assert_allclose(out[r].astype(np.float32), want[r * Ms:(r + 1) * Ms], rtol=3e-2, atol=3e-2)


def test_the_simulate_helpers_take_the_torch_tensors_tl_simulate_takes():
    """Found by an explorer's round: simulate_allgather_moe and simulate_moe_reduce_scatter called
    np.asarray on their operands and crashed on bf16 tensors (TypeError) and on tensors that
    require grad (RuntimeError), which tl.simulate takes. Now they hand them on as they are: the
    layer's result is that of the same values as numpy float32 (small integers: exact in bf16)."""
    torch = pytest.importorskip("torch")
    W, Ms, K, Nr, E, topk = 2, 5, 16, 8, 4, 2
    rng = np.random.default_rng(4)
    xs = [rng.integers(-2, 3, (Ms, K)).astype(np.float32) for _ in range(W)]
    w1 = [rng.integers(-1, 2, (E, K, Nr)).astype(np.float32) for _ in range(W)]
    w2 = [rng.integers(-1, 2, (E, Nr, K)).astype(np.float32) for _ in range(W)]
    ids, _ = random_routing(rng, W * Ms, E, topk, "random")
    wts = np.ones((W * Ms, topk), np.float32)
    kw = dict(compute=_compute(8, 8, 8), comm=tl.CommSchedule(tile_m=8, mode="push"))
    rt, want_h = simulate_allgather_moe(xs, w1, ids, **kw)
    want = simulate_moe_reduce_scatter(want_h, w2, wts, rt, **kw)
    for dtype in (torch.bfloat16, torch.float32):
        grad = dtype == torch.float32            # float32 tensors that require grad
        t = [[torch.tensor(a, dtype=dtype).requires_grad_(grad) for a in arrays] for arrays in (xs, w1, w2)]
        rt2, h = simulate_allgather_moe(t[0], t[1], torch.tensor(ids), **kw)
        assert all(np.array_equal(np.asarray(a, np.float32), b) for a, b in zip(h, want_h)), dtype
        h_t = [torch.tensor(np.asarray(x, np.float32), dtype=dtype).requires_grad_(grad) for x in h]
        out = simulate_moe_reduce_scatter(h_t, t[2], torch.tensor(wts, dtype=dtype), rt2, **kw)
        assert all(np.array_equal(np.asarray(a, np.float32), b) for a, b in zip(out, want)), dtype


# -- bad inputs ---------------------------------------------------------------------------------------

def test_routing_rejects_bad_ids_and_shapes():
    ids = np.array([[0, 1], [2, 3]], np.int32)
    with pytest.raises(tl.InputError, match=r"topk_ids\[1, 1\] = 3 is not an expert id \(there are 3 experts"):
        moe_routing(ids, 3, 1, 2, 8)
    with pytest.raises(tl.InputError, match=r"topk_ids\[0, 0\] = -1 is not an expert id"):
        moe_routing(np.array([[-1]]), 3, 1, 1, 8)
    with pytest.raises(tl.InputError, match=r"topk_ids must be \[4, topk\] \(2 ranks x 2 tokens\)"):
        moe_routing(ids, 4, 2, 2, 8)
    with pytest.raises(tl.InputError, match="must be integers"):
        moe_routing(ids.astype(np.float32), 4, 1, 2, 8)
    with pytest.raises(tl.InputError, match="num_experts must be a positive int"):
        moe_routing(ids, 0, 1, 2, 8)
    with pytest.raises(tl.InputError, match="BM must be a positive int"):
        moe_routing(ids, 4, 1, 2, 0)
    with pytest.raises(tl.InputError, match=r"topk_ids must be \[2, topk\]"):
        moe_routing(np.zeros((2, 0), np.int32), 4, 1, 2, 8)
    with pytest.raises(tl.InputError, match=r"topk_ids must be \[2, topk\] .*equal-length rows"):
        moe_routing([[0, 1], [2]], 4, 1, 2, 8)


def test_simulate_helpers_reject_out_of_range_routing_before_running():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((3, 8)).astype(F16) for _ in range(2)]
    w1 = [rng.standard_normal((4, 8, 8)).astype(F16) for _ in range(2)]
    with pytest.raises(tl.InputError, match="= 4 is not an expert id"):
        simulate_allgather_moe(xs, w1, np.full((6, 1), 4), compute=_compute())
    rt = moe_routing(np.zeros((6, 1), np.int32), 4, 2, 3, 8)
    h = [np.zeros((rt.num_rows, 8), F16)] * 2
    with pytest.raises(tl.InputError, match="routing was built for BM=8"):
        simulate_moe_reduce_scatter(h, [np.zeros((4, 8, 8), F16)] * 2, np.ones((6, 1), np.float32), rt,
                                    compute=_compute(16, 8, 8))
    with pytest.raises(tl.InputError, match="routing has 4 experts but the w2 slices hold 3"):
        simulate_moe_reduce_scatter(h, [np.zeros((3, 8, 8), F16)] * 2, np.ones((6, 1), np.float32), rt,
                                    compute=_compute())
    with pytest.raises(tl.InputError, match=r"topk_weights must be \[6, 1\]"):
        simulate_moe_reduce_scatter(h, [np.zeros((4, 8, 8), F16)] * 2, np.ones((6, 2), np.float32), rt,
                                    compute=_compute())


def _ag_case(W=2, Ms=3, K=8, Nr=8, E=3, BM=8):
    rng = np.random.default_rng(1)
    ids, _ = random_routing(rng, W * Ms, E, 2, "random")
    return _allgather_inputs(rng, W, Ms, K, Nr, E, ids, BM)


@pytest.mark.parametrize("change,message", [
    (lambda i, rt: dict(i, w1=np.zeros((3, 9, 8), F16)), r"w1 is \[3, 9, 8\]: w1's K must be 8"),
    (lambda i, rt: dict(i, w1=np.zeros((8, 8), F16)), r"w1 must be \[E, K, Nr\]"),
    (lambda i, rt: dict(i, w1=i["w1"].astype(np.float32)), "x is f16 but w1 is f32"),
    (lambda i, rt: dict(i, h=np.zeros((rt.num_rows, 9), F16)), r"h must be \[\d+, 8\]"),
    (lambda i, rt: dict(i, sorted_token_ids=i["sorted_token_ids"][:-8]), r"moe_routing\(\.\.\., BM=8\)"),
    (lambda i, rt: dict(i, tile_tokens=i["tile_tokens"][:, :1].copy()), r"tile_tokens' must be \[\d+, 2\]"),
    (lambda i, rt: dict(i, tile_expert=i["tile_expert"].astype(np.float32)), "'tile_expert' must be int32"),
])
def test_allgather_moe_rejects_bad_shapes_at_compile_time(change, message):
    rt, xs, w1, inputs = _ag_case()
    bad = [change(i, rt) for i in inputs]
    with pytest.raises(tl.CompilationError, match=message):
        tl.simulate(allgather_moe, 2, bad, compute=_compute(), comm=tl.CommSchedule(tile_m=8))


def test_tables_must_be_int32_arrays():
    rt, xs, w1, inputs = _ag_case()
    bad = [dict(i, tile_tokens=i["tile_tokens"].astype(np.int64)) for i in inputs]
    with pytest.raises(tl.InputError, match="argument 'tile_tokens': unsupported dtype"):
        tl.simulate(allgather_moe, 2, bad, compute=_compute(), comm=tl.CommSchedule(tile_m=8))


def test_allgather_moe_rejects_tables_for_another_block_size():
    rt, xs, w1, inputs = _ag_case(BM=16)
    with pytest.raises(tl.CompilationError, match=r"were the tables built with moe_routing\(\.\.\., BM=8\)"):
        tl.simulate(allgather_moe, 2, inputs, compute=_compute(8, 8, 8), comm=tl.CommSchedule(tile_m=8))


def _rs_case(W=2, Ms=3, K=8, Nr=8, E=3, BM=8):
    rng = np.random.default_rng(1)
    ids, wts = random_routing(rng, W * Ms, E, 2, "random")
    return _rs_inputs(rng, W, Ms, K, Nr, E, ids, wts, BM)


@pytest.mark.parametrize("change,message", [
    (lambda i: dict(i, w2=np.zeros((3, 9, 8), F16)), r"w2 is \[3, 9, 8\]: w2's Nr must be 8"),
    (lambda i: dict(i, out=np.zeros((3, 9), F16)), r"out must be \[3, 8\] \(K of w2\)"),
    (lambda i: dict(i, out=np.zeros((4, 8), F16)), "topk_weights has 6 tokens but 2 ranks x 4 rows"),
    (lambda i: dict(i, topk_weights=i["topk_weights"].astype(np.int32)), "topk_weights must be floating"),
    (lambda i: dict(i, token_pos=i["token_pos"][:-1]), r"token_pos' must be \[12\].*topk=2 x 6 tokens"),
    (lambda i: dict(i, h=i["h"][:-8]), r"h must have \d+ rows"),
    (lambda i: dict(i, tile_token_tiles=i["tile_token_tiles"].T.copy()), "tile_token_tiles' must be"),
    (lambda i: dict(i, token_tile_producers=np.ones(2, np.int32)), r"token_tile_producers' must be \[1\]"),
])
def test_moe_reduce_scatter_rejects_bad_shapes_at_compile_time(change, message):
    rt, hs, w2, inputs = _rs_case()
    with pytest.raises(tl.CompilationError, match=message):
        tl.simulate(moe_reduce_scatter, 2, [change(i) for i in inputs], compute=_compute(),
                    comm=tl.CommSchedule(tile_m=8))


def test_moe_reduce_scatter_rejects_the_copy_engine_pull_and_the_epilogue_sum():
    """The copy engine only pushes; and the combine stores its tiles itself (tl.store +
    notify_rows), so the epilogue sum — which needs every tile handed over by store_tile —
    is refused when traced instead of leaving ``out`` unwritten."""
    rt, hs, w2, inputs = _rs_case()
    with pytest.raises(tl.ScheduleError, match="copy engine"):
        tl.simulate(moe_reduce_scatter, 2, inputs, compute=_compute(), comm=tl.CommSchedule(engine="copy_engine"))
    whole = tl.ComputeSchedule(tile=(8, 8, 8), order="comm_aligned")
    rt, hs, w2, inputs = _rs_case(Ms=8)        # whole tiles per rank: where the epilogue sum is otherwise allowed
    with pytest.raises(tl.ScheduleError, match="store_tile"):
        tl.simulate(moe_reduce_scatter, 2, inputs, compute=whole,
                    comm=tl.CommSchedule(engine="copy_engine", mode="push", reduce_in="epilogue"))


def test_the_references_refuse_ids_outside_the_experts_and_take_bf16_tensors():
    """Found by an explorer's round: reference_moe took a negative expert id as an index from the
    end (the last expert: a silent wrong answer) and raised IndexError on an id >= E; the three
    references crashed on bf16 torch tensors (np.asarray), which the simulate helpers take. Ids are
    now checked as moe_routing checks them, operands converted as the simulator converts them."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    W, Ms, K, Nr, E = 2, 3, 4, 4, 3
    xs = [rng.integers(-2, 3, (Ms, K)).astype(np.float32) for _ in range(W)]
    w1 = [rng.integers(-1, 2, (E, K, Nr)).astype(np.float32) for _ in range(W)]
    w2 = [rng.integers(-1, 2, (E, Nr, K)).astype(np.float32) for _ in range(W)]
    wts = np.ones((W * Ms, 1), np.float32)
    for bad in (-1, E):
        with pytest.raises(tl.InputError, match=rf"reference_moe: topk_ids\[0, 0\] = {bad} is not an expert id "
                                                rf"\(there are {E} experts"):
            reference_moe(xs, w1, w2, np.full((W * Ms, 1), bad), wts)
    with pytest.raises(tl.InputError, match=r"reference_moe: topk_ids must be \[6, topk\]"):
        reference_moe(xs, w1, w2, np.zeros((W * Ms - 1, 1), np.int32), wts)
    with pytest.raises(tl.InputError, match=r"reference_moe: topk_weights must be \[6, 1\]"):
        reference_moe(xs, w1, w2, np.zeros((W * Ms, 1), np.int32), wts[:-1])
    ids = rng.integers(0, E, (W * Ms, 2)).astype(np.int32)
    wts = rng.integers(1, 3, (W * Ms, 2)).astype(np.float32)
    rt = moe_routing(ids, E, W, Ms, 8)
    want = reference_moe(xs, w1, w2, ids, wts)
    want_h = [reference_allgather_moe(xs, w1[r], rt) for r in range(W)]
    want_out = reference_moe_reduce_scatter(want_h, w2, wts, rt)
    bf = lambda arrays: [torch.tensor(a).bfloat16() for a in arrays]              # noqa: E731  (exact in bf16)
    np.testing.assert_array_equal(reference_moe(bf(xs), bf(w1), bf(w2), torch.tensor(ids), torch.tensor(wts)), want)
    h = [reference_allgather_moe(bf(xs), bf(w1)[r], rt) for r in range(W)]
    assert all(np.array_equal(a, b) for a, b in zip(h, want_h))
    np.testing.assert_array_equal(reference_moe_reduce_scatter(bf(h), bf(w2), torch.tensor(wts).bfloat16(), rt),
                                  want_out)
    with pytest.raises(tl.InputError, match="routing has 3 experts but w1 holds 2"):
        reference_allgather_moe(xs, w1[0][:2], rt)
    with pytest.raises(tl.InputError, match="routing must come from moe_routing"):
        reference_moe_reduce_scatter(want_h, w2, wts, rt.reduce_scatter_tables())


@pytest.mark.parametrize("W,topk", [(1, 2), (2, 3)])
def test_experts_stored_as_linear_weights_give_the_same_layers(W, topk):
    """``weights="nk"``: each expert's matrix stored transposed ([E, N, K], a stack of torch Linear
    weights) and read as ``tl.trans`` of its tile — the same numbers as the [E, K, N] layout, exactly
    (the same products, summed in the same order), for both layers."""
    from tldsl.ops.moe import simulate_allgather_moe, simulate_moe_reduce_scatter
    rng = np.random.default_rng(W * 10 + topk)
    Ms, K, Nr, E = 40, 48, 32, 4
    xs = [rng.standard_normal((Ms, K)).astype(np.float32) for _ in range(W)]
    w1 = [rng.standard_normal((E, K, Nr)).astype(np.float32) for _ in range(W)]
    ids = np.stack([rng.choice(E, topk, replace=False) for _ in range(W * Ms)]).astype(np.int32)
    compute = tl.ComputeSchedule(tile=(16, 16, 16), stages=2)
    rt, h_kn = simulate_allgather_moe(xs, w1, ids, compute=compute)
    _, h_nk = simulate_allgather_moe(xs, [w.transpose(0, 2, 1).copy() for w in w1], ids, compute=compute,
                                     weights="nk")
    for a, b in zip(h_kn, h_nk):
        np.testing.assert_array_equal(a, b)
    w2 = [rng.standard_normal((E, Nr, K)).astype(np.float32) for _ in range(W)]
    wts = rng.random((W * Ms, topk)).astype(np.float32)
    out_kn = simulate_moe_reduce_scatter(h_kn, w2, wts, rt, compute=compute)
    out_nk = simulate_moe_reduce_scatter(h_kn, [w.transpose(0, 2, 1).copy() for w in w2], wts, rt, compute=compute,
                                         weights="nk")
    for a, b in zip(out_kn, out_nk):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(tl.InputError, match="weights must be one of"):
        simulate_allgather_moe(xs, w1, ids, compute=compute, weights="kk")


def test_the_grouped_gemms_of_linear_weights_lower_k_major():
    """The MoE kernels with ``weights="nk"``: each grouped GEMM goes to its recipe, B read K-major."""
    from tldsl.codegen.pipeline import lower
    from tldsl.ops.moe import allgather_moe, moe_reduce_scatter, moe_routing
    bf = tl.bfloat16
    S = tl.TensorSpec
    W, Ms, K, Nr, E, topk, BM = 1, 512, 256, 384, 4, 2, 128
    rng = np.random.default_rng(0)
    rt = moe_routing(np.stack([rng.choice(E, topk, replace=False) for _ in range(W * Ms)]).astype(np.int32),
                     E, W, Ms, BM)
    sched = tl.ComputeSchedule(tile=(BM, 128, 64), stages=4)
    ag = allgather_moe.trace(W, S((Ms, K), bf), S((E, Nr, K), bf),
                             *[S(t.shape, tl.int32) for t in rt.allgather_tables().values()],
                             S((rt.num_rows, Nr), bf), compute=sched, weights="nk")
    lg = lower(ag, "grouped_gemm")
    assert type(lg).__name__ == "LoweredGroupedGemm" and lg.config.b_k_major
