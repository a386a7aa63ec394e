"""The generated MoE kernels (the ``grouped_gemm`` and ``combine`` recipes) on a GPU, against
numpy references of the ops' meaning (skipped where there is no GPU).

Run on a GPU host with: ``python -m pytest -q -m gpu tests/test_gpu_moe.py``.

* AllGather+MoE's grouped GEMM: ``h`` from the all-gathered tokens (``x_gathered``, filled
  directly: this runs the compute part alone, its waits satisfied by pre-set flags), every
  tile checked — routed rows, padding rows and unused tiles (zeros) — after poisoning ``h``
  with NaN.
* MoE+ReduceScatter's grouped GEMM then its combine (two kernels, or the combine folded into
  the GEMM's kernel): ``y_sorted`` (used tiles), ``partial``,
  and the signal counters both leave (``y_ready``, ``reduce_scatter_ready``) against the
  counts the tile program's scalar code gives; a second launch (epoch 2) gives the same
  results and doubles the counters.
* Waits really wait: with their flags short, the AllGather+MoE GEMM and the combine write
  nothing while they spin on a side stream; raising the flags lets the same launch finish
  correctly.
"""
from __future__ import annotations

import numpy as np
import pytest

from tldsl.runtime.gpu import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs an sm_90 GPU with torch and cuda-python")]


def _dt(name):
    import tldsl as tl
    return {"float16": tl.float16, "bfloat16": tl.bfloat16}[name]


def _routing(W, Ms, E, topk, BM, kind, seed):
    """``kind="edges"`` (top-1): experts of BM + 1 and 1 rows in turn, every tile of the worst case
    used — a full tile then one of one row, a tile of one row alone, and the last tile, whose A rows
    run past A's end."""
    from tldsl.ops.moe import moe_routing, random_routing
    rng = np.random.default_rng(seed)
    if kind == "edges":
        counts = [BM + 1 if e % 2 == 0 else 1 for e in range(E)]
        assert topk == 1 and sum(counts) == W * Ms, (counts, W * Ms)
        ids = rng.permutation(np.repeat(np.arange(E), counts))[:, None]
        rt = moe_routing(ids, E, W, Ms, BM)
        assert (rt.tile_expert >= 0).all()
        return rt, rng.random((W * Ms, 1)).astype(np.float32)
    ids, wts = random_routing(rng, W * Ms, E, topk, kind)
    return moe_routing(ids, E, W, Ms, BM), wts


def _case_id(case):
    """A readable test id of an AG_CASES / RS_CASES row (``-k cluster2`` picks the clustered ones)."""
    W, _, _, _, _, _, kind, tile, stages, order, dtype, cluster = case
    return f"W{W}-{kind}-{'x'.join(map(str, tile))}-s{stages}-{order}-{dtype}-cluster{cluster[0]}"


def _cuda(a):
    import torch
    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def _randn(shape, dtype, gen, scale=1.0):
    import torch
    return (torch.randn(*shape, device="cuda", dtype=torch.float32, generator=gen) * scale).to(getattr(torch, dtype))


def _np(t):
    return t.float().cpu().numpy()


def _close(got, ref, what, rel):
    tol = rel * float(np.abs(ref).max()) + 1e-2
    err = float(np.abs(got - ref).max()) if got.size else 0.0
    assert err <= tol, f"{what}: max |err| {err:.3g} > {tol:.3g}"


def _pairing(rt):
    """(pairs, lone tiles) of 64-row tiles as the template pairs them (``pair_tile``): an even
    used tile leads when the next is used on the same expert and it is full."""
    te, tv = rt.tile_expert, rt.tile_valid_rows
    pairs = lone = 0
    m = 0
    while m < len(te):
        if te[m] < 0:
            m += 1
        elif m % 2 == 0 and m + 1 < len(te) and te[m + 1] == te[m] and tv[m] >= 64:
            pairs, m = pairs + 1, m + 2
        else:
            lone, m = lone + 1, m + 1
    return pairs, lone


# -- AllGather+MoE ------------------------------------------------------------------------------------

def _lower_ag(rt, W, Ms, K, Nr, E, tile, stages, order, dtype, comm=None, cluster=(1, 1)):
    import tldsl as tl
    from tldsl.codegen import lower_grouped_gemm
    k = rt.trace_allgather_moe(W, Ms, K, Nr, E, _dt(dtype),
                               compute=tl.ComputeSchedule(tile=tile, stages=stages, order=order, cluster=cluster),
                               comm=comm or tl.CommSchedule(tile_m=64, mode="pull"))
    return lower_grouped_gemm(k, "grouped_gemm")


def _ag_inputs(rt, W, Ms, K, Nr, E, dtype, seed):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = _randn((W * Ms, K), dtype, g)
    w1 = _randn((E, K, Nr), dtype, g, 1.0 / np.sqrt(K))
    h = torch.full((rt.num_rows, Nr), float("nan"), device="cuda", dtype=x.dtype)
    bufs = {"x_gathered": x, "w1": w1, "h": h, **{n: _cuda(a) for n, a in rt.allgather_tables().items()}}
    return bufs


def _ag_reference(rt, bufs):
    from tldsl.ops.moe import reference_allgather_moe
    return reference_allgather_moe([_np(bufs["x_gathered"])], _np(bufs["w1"]), rt)


AG_CASES = [  # W, Ms, K, Nr, E, topk, routing, tile, stages, order, dtype, cluster
    (4, 256, 512, 384, 8, 2, "random", (128, 128, 64), 4, "row_major", "float16", (1, 1)),
    (2, 1000, 1032, 1400, 16, 4, "random", (128, 256, 64), 3, "swizzled", "bfloat16", (1, 1)),
    (8, 128, 520, 200, 4, 1, "concentrated", (64, 128, 32), 6, "comm_aligned", "float16", (1, 1)),
    (3, 333, 1024, 2048, 64, 6, "random", (128, 128, 64), 5, "swizzled", "bfloat16", (1, 1)),
    # clusters of two tiles: an odd number of tile rows (the last CTA's partner is past the grid),
    # unused tiles beside used ones, pairs on two experts (B per CTA) and on one (B multicast)
    (4, 256, 512, 384, 8, 2, "random", (128, 128, 64), 4, "row_major", "float16", (2, 1)),
    (2, 1000, 1032, 1400, 16, 4, "random", (128, 256, 64), 4, "swizzled", "bfloat16", (2, 1)),
    (8, 128, 520, 200, 4, 1, "concentrated", (64, 128, 32), 6, "comm_aligned", "float16", (2, 1)),
    # 64-row tiles: in pairs of CTAs, the two consumer warpgroups split the columns (a partial last column
    # tile, odd K); without clusters, two tiles of one expert to a 128-row CTA tile
    (2, 1000, 1032, 1400, 16, 4, "random", (64, 256, 64), 5, "swizzled", "bfloat16", (2, 1)),
    (8, 128, 520, 200, 4, 1, "concentrated", (64, 256, 64), 4, "comm_aligned", "float16", (1, 1)),
    # 128 x 128 tiles in pairs, a deep pipeline (A gathered: the cooperative schedule, never ping-pong)
    (2, 1000, 1032, 1400, 16, 4, "random", (128, 128, 64), 6, "swizzled", "bfloat16", (2, 1)),
    # 64-row tiles (experts padded to 64 rows) paired into 128-row CTA tiles: many small experts; every
    # tile used, lone tiles of one row, the last one's rows past A's end
    (2, 1000, 1032, 768, 64, 6, "random", (64, 256, 64), 4, "swizzled", "bfloat16", (1, 1)),
    (2, 66, 256, 384, 4, 1, "edges", (64, 128, 64), 4, "row_major", "float16", (1, 1)),
]


@pytest.mark.parametrize("W,Ms,K,Nr,E,topk,kind,tile,stages,order,dtype,cluster", AG_CASES,
                         ids=[_case_id(c) for c in AG_CASES])
def test_allgather_moe_grouped_gemm_matches_reference(W, Ms, K, Nr, E, topk, kind, tile, stages, order, dtype,
                                                      cluster):
    import torch
    from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
    rt, _ = _routing(W, Ms, E, topk, tile[0], kind, seed=W * 1000 + Ms)
    lw = _lower_ag(rt, W, Ms, K, Nr, E, tile, stages, order, dtype, cluster=cluster)
    assert lw.cluster_dims == (cluster[0], 1, 1)
    assert lw.gather and not lw.config.pingpong     # a gathered A: both warpgroups on every tile
    # 64-row tiles without clusters: two of one expert to a 128-row CTA tile, the rest alone
    assert lw.config.pair_rows == (tile[0] == 64 and cluster == (1, 1))
    if lw.config.pair_rows:
        assert _pairing(rt)[0] > 0, _pairing(rt)
    elif lw.config.half_tiles:          # some tiles run as half tiles (<= 64 valid rows)
        assert ((rt.tile_valid_rows <= 64) & (rt.tile_expert >= 0)).any()
    kern = GroupedKernel(lw)
    bufs = _ag_inputs(rt, W, Ms, K, Nr, E, dtype, seed=Ms + K)
    slots = lw.signal_slots["gather_x_ready"]
    for launch in (1, 2):                 # epoch counting: the flags say "launch n arrived"
        bufs["h"].fill_(float("nan"))
        sig = {"gather_x_ready": torch.full((slots,), launch, device="cuda", dtype=torch.int64)}
        kern(bufs, signals=sig, launch_index=launch, rank=W - 1)
        torch.cuda.synchronize()
        h = _np(bufs["h"])
        assert not np.isnan(h).any(), f"launch {launch}: rows never written: {np.argwhere(np.isnan(h))[:4]}"
        ref = _ag_reference(rt, bufs)
        _close(h, ref, f"{lw.describe().splitlines()[0]} launch {launch}", 2e-2)
        unused = np.repeat(rt.tile_expert < 0, rt.block_m)
        assert (h[unused] == 0).all()                                   # unused tiles: zeros
        padding = rt.sorted_token_ids < 0
        assert (h[padding] == 0).all()                                  # padding rows: zeros


def test_allgather_moe_waits_block_until_flags_are_set():
    """The grouped GEMM waits per tile on the all-gather's flags: with them at 0 no routed row
    is written; once raised the same launch completes and is correct."""
    import torch
    from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
    W, Ms, K, Nr, E, topk = 2, 128, 256, 256, 4, 2       # 14 tiles: most SMs stay free for the flag writes
    rt, _ = _routing(W, Ms, E, topk, 128, "random", seed=5)
    lw = _lower_ag(rt, W, Ms, K, Nr, E, (128, 128, 64), 4, "row_major", "float16")
    assert lw.num_tiles < 100
    kern = GroupedKernel(lw)
    bufs = _ag_inputs(rt, W, Ms, K, Nr, E, "float16", seed=3)
    used = torch.from_numpy(np.repeat(rt.tile_expert >= 0, rt.block_m)).cuda()
    sig = {"gather_x_ready": torch.zeros(lw.signal_slots["gather_x_ready"], device="cuda", dtype=torch.int64)}
    # Everything that runs while the kernel spins must already be loaded (lazy module loading).
    torch.cuda._sleep(1000)
    torch.isnan(bufs["h"][used]).all().item()     # loads the kernels of the check made while it spins
    sig["gather_x_ready"].fill_(0)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        kern(bufs, signals=sig, launch_index=1)
    torch.cuda._sleep(50_000_000)
    assert torch.isnan(bufs["h"][used]).all().item(), "routed rows were computed before their tokens arrived"
    sig["gather_x_ready"].fill_(1)
    torch.cuda.synchronize()
    _close(_np(bufs["h"]), _ag_reference(rt, bufs), "after the flags", 2e-2)


STAGED_FOLD_CASES = [  # W, Ms, K, Nr, E, topk, routing, tile, stages, order, dtype, cluster
    (2, 1000, 1032, 1400, 16, 4, "random", (128, 256, 64), 4, "swizzled", "bfloat16", (2, 1)),
    (4, 256, 520, 384, 8, 2, "random", (128, 128, 64), 4, "row_major", "float16", (1, 1)),
    (8, 128, 520, 200, 4, 1, "concentrated", (64, 256, 64), 4, "comm_aligned", "float16", (1, 1)),
    # 128 x 128 tiles of the staged rows (by TMA) run ping-pong beside the folded gather: pairs, 6 stages
    (2, 1000, 1032, 1400, 16, 4, "random", (128, 128, 64), 6, "swizzled", "bfloat16", (2, 1)),
]


@pytest.mark.parametrize("W,Ms,K,Nr,E,topk,kind,tile,stages,order,dtype,cluster", STAGED_FOLD_CASES,
                         ids=[_case_id(c) for c in STAGED_FOLD_CASES])
def test_allgather_moe_row_gather_folded_into_the_grouped_gemm(W, Ms, K, Nr, E, topk, kind, tile, stages, order,
                                                               dtype, cluster):
    """The row gather that stages A folded into the grouped GEMM (``side="gather_rows"``): its
    tiles on the spare producer warps, each GEMM tile waiting (really: counters from 0) for its
    rows' gather before loading them by TMA. ``h`` against the reference after poisoning ``h``
    and the staged rows, ``rows_ready`` at launch x its count, two launches."""
    import torch
    import tldsl as tl
    from tldsl.codegen import lower_grouped_gemm
    from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
    rt, _ = _routing(W, Ms, E, topk, tile[0], kind, seed=W * 1000 + Ms + 1)
    k = rt.trace_allgather_moe(W, Ms, K, Nr, E, _dt(dtype), stage_rows=True,
                               compute=tl.ComputeSchedule(tile=tile, stages=stages, order=order, cluster=cluster),
                               comm=tl.CommSchedule(tile_m=64, mode="pull"))
    lw = lower_grouped_gemm(k, "grouped_gemm", cluster=cluster, side="gather_rows")
    assert lw.side == "gather_rows" and not lw.gather
    assert lw.config.pingpong == (tile[:2] == (128, 128))     # the staged rows come by TMA
    kern = GroupedKernel(lw)
    bufs = _ag_inputs(rt, W, Ms, K, Nr, E, dtype, seed=Ms + K + 1)
    bufs["x_sorted"] = torch.empty((rt.num_rows, K), device="cuda", dtype=bufs["x_gathered"].dtype)
    chunks = lw.side_tiles[1]
    rows_ready = torch.zeros(lw.signal_slots["rows_ready"], device="cuda", dtype=torch.int64)
    for launch in (1, 2):
        bufs["h"].fill_(float("nan"))
        bufs["x_sorted"].fill_(float("nan"))
        sig = {"gather_x_ready": torch.full((lw.signal_slots["gather_x_ready"],), launch, device="cuda",
                                            dtype=torch.int64), "rows_ready": rows_ready}
        kern(bufs, signals=sig, launch_index=launch, rank=W - 1)
        torch.cuda.synchronize()
        h = _np(bufs["h"])
        assert not np.isnan(h).any(), f"launch {launch}: rows never written: {np.argwhere(np.isnan(h))[:4]}"
        _close(h, _ag_reference(rt, bufs), f"{lw.describe().splitlines()[0]} launch {launch}", 2e-2)
        assert (h[rt.sorted_token_ids < 0] == 0).all()                  # padding rows: zeros
        assert (rows_ready.cpu().numpy() == launch * chunks).all()      # every tile's every column chunk


# -- MoE+ReduceScatter ---------------------------------------------------------------------------------

def _lower_rs(rt, wts, W, Ms, K, Nr, E, tile, stages, order, dtype, comm=None, cluster=(1, 1), fold=False,
              partial_dtype="f32"):
    """(program, grouped GEMM, combine); ``fold``: the combine folded into the grouped GEMM's
    kernel (the same lowered kernel twice)."""
    import tldsl as tl
    from tldsl.codegen import lower_combine, lower_grouped_gemm
    k = rt.trace_moe_reduce_scatter(W, Ms, Nr, K, E, wts, _dt(dtype),
                                    compute=tl.ComputeSchedule(tile=tile, stages=stages, order=order),
                                    comm=comm or tl.CommSchedule(tile_m=64, order="ring", mode="push"),
                                    partial_dtype=partial_dtype)
    if fold:
        lf = lower_grouped_gemm(k, "grouped_gemm", cluster=cluster, side="combine")
        return k, lf, lf
    return k, lower_grouped_gemm(k, "grouped_gemm", cluster=cluster), lower_combine(k, "combine")


def _expected_counts(k, part_name, tables, W, rank, slots):
    """Signal counters after one launch: every notify the part's tiles make (by the IR)."""
    from test_codegen_moe import _ir_signal_events
    part = k.part(part_name)
    counts = {name: np.zeros(n, np.int64) for name, n in slots.items()}
    g1 = part.grid[1] if len(part.grid) > 1 else 1
    for p0 in range(part.grid[0]):
        for p1 in range(g1):
            _, notifies = _ir_signal_events(part, tables, (p0, p1), rank, 1)
            for ev in notifies:
                _, name, ch, _ = ev.split()
                counts[name][int(ch)] += 1
    return counts


RS_CASES = [  # W, Ms, K, Nr, E, topk, routing, tile, stages, order, dtype, cluster
    (4, 256, 512, 384, 8, 2, "random", (128, 128, 64), 4, "row_major", "float16", (1, 1)),
    (2, 1000, 1400, 1032, 16, 4, "random", (128, 256, 64), 3, "swizzled", "bfloat16", (1, 1)),
    (8, 100, 200, 520, 4, 1, "concentrated", (64, 128, 32), 6, "comm_aligned", "float16", (1, 1)),
    # clusters of two tiles (unused tiles store nothing and still notify nothing)
    (4, 256, 512, 384, 8, 2, "random", (128, 128, 64), 4, "row_major", "float16", (2, 1)),
    (2, 1000, 1400, 1032, 16, 4, "random", (128, 256, 64), 4, "swizzled", "bfloat16", (2, 1)),
    # 64-row tiles: in pairs of CTAs (and folded), the columns split between the two consumer warpgroups;
    # without clusters, two tiles of one expert to a 128-row CTA tile
    (2, 1000, 1400, 1032, 16, 4, "random", (64, 256, 64), 5, "swizzled", "bfloat16", (2, 1)),
    (4, 256, 512, 384, 8, 2, "random", (64, 256, 64), 4, "row_major", "float16", (1, 1)),
    # ping-pong 128 x 128 tiles (each consumer warpgroup on whole tiles, in turns), alone and in pairs
    (2, 1000, 1400, 1032, 16, 4, "random", (128, 128, 64), 6, "swizzled", "bfloat16", (1, 1)),
    (3, 333, 704, 2048, 64, 6, "random", (128, 128, 64), 5, "swizzled", "bfloat16", (2, 1)),
    # ... an odd number of tile rows (the last pair's partner past the grid) and several tiles per CTA
    (3, 1000, 1400, 1032, 16, 4, "random", (128, 128, 64), 5, "swizzled", "bfloat16", (2, 1)),
    # 64-row tiles paired into 128-row CTA tiles (folded: the columns split instead), small experts
    (3, 1000, 704, 2048, 64, 6, "random", (64, 256, 64), 4, "swizzled", "bfloat16", (1, 1)),
    (2, 1000, 384, 2048, 128, 8, "random", (64, 128, 64), 6, "row_major", "float16", (1, 1)),
    (2, 66, 256, 384, 4, 1, "edges", (64, 128, 64), 4, "row_major", "float16", (1, 1)),
]


@pytest.mark.parametrize("partial_dtype", ["f32", "out"])
@pytest.mark.parametrize("fold", [False, True], ids=["two_kernels", "folded"])
@pytest.mark.parametrize("W,Ms,K,Nr,E,topk,kind,tile,stages,order,dtype,cluster", RS_CASES,
                         ids=[_case_id(c) for c in RS_CASES])
def test_moe_reduce_scatter_gemm_and_combine_match_reference(W, Ms, K, Nr, E, topk, kind, tile, stages, order,
                                                             dtype, cluster, fold, partial_dtype):
    """The grouped GEMM then the combine, or (``fold``) one kernel whose spare producer warps
    run the combine's tiles as their waits hold: the same results and counters; the partial in
    fp32 or (``partial_dtype='out'``, MoEReduceScatter's default) in the operands' dtype."""
    import torch
    from tldsl.ops.moe import reference_moe_reduce_scatter
    from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
    rt, wts = _routing(W, Ms, E, topk, tile[0], kind, seed=W * 7 + Ms)
    rank = 1
    k, lg, lc = _lower_rs(rt, wts, W, Ms, K, Nr, E, tile, stages, order, dtype, cluster=cluster, fold=fold,
                          partial_dtype=partial_dtype)
    assert lg.cluster_dims == (cluster[0], 1, 1)
    assert (lg.side == "combine") == fold
    assert lg.config.pingpong == (tile[:2] == (128, 128))     # A by TMA: 128 x 128 tiles run ping-pong
    assert lg.config.pair_rows == (tile[0] == 64 and cluster == (1, 1) and not fold)
    gk = GroupedKernel(lg)
    ck = gk if fold else GroupedKernel(lc)
    g = torch.Generator(device="cuda").manual_seed(K + Nr)
    T, R = W * Ms, rt.num_rows
    tabs = rt.reduce_scatter_tables()
    bufs = {"h": _randn((R, Nr), dtype, g), "w2": _randn((E, Nr, K), dtype, g, 1.0 / np.sqrt(Nr)),
            "topk_weights": _cuda(wts), **{n: _cuda(a) for n, a in tabs.items()},
            "y_sorted": torch.empty((R, K), device="cuda", dtype=getattr(torch, dtype)),
            "partial": torch.empty((T, K), device="cuda",
                                   dtype=torch.float32 if partial_dtype == "f32" else getattr(torch, dtype))}
    slots = {**lg.signal_slots, **lc.signal_slots}
    sigs = {n: torch.zeros(s, device="cuda", dtype=torch.int64) for n, s in slots.items()}
    exp_y = _expected_counts(k, "grouped_gemm", tabs, W, rank, {"y_ready": slots["y_ready"]})["y_ready"]
    exp_rs = _expected_counts(k, "combine", tabs, W, rank, {"reduce_scatter_ready": slots["reduce_scatter_ready"]})
    assert (exp_y.reshape(-1, (lc.side_tiles if fold else lc.grid_tiles)[1]) == rt.token_tile_producers[:, None]).all()

    h, w2 = _np(bufs["h"]), _np(bufs["w2"])
    used = np.repeat(rt.tile_expert >= 0, rt.block_m)
    y_ref = np.zeros((R, K), np.float32)
    for i, e in enumerate(rt.tile_expert):
        if e >= 0:       # the program stores a tile's rows past its valid ones as zeros (h's are not)
            rows = slice(i * rt.block_m, i * rt.block_m + rt.tile_valid_rows[i])
            y_ref[rows] = h[rows] @ w2[e]
    if lg.config.pair_rows:             # pairs of 64-row tiles, tiles alone, partial tiles
        v = rt.tile_valid_rows[rt.tile_expert >= 0]
        assert min(_pairing(rt)) > 0 and (v < 64).any(), _pairing(rt)
    elif lg.config.half_tiles:          # tiles run as half tiles (<= 64 valid rows) and whole ones masked
        v = rt.tile_valid_rows[rt.tile_expert >= 0]
        assert (v <= 64).any() and ((v > 64) & (v < 128)).any()
    p_ref = reference_moe_reduce_scatter([h], [w2], wts, rt)
    for launch in (1, 2):
        bufs["y_sorted"].fill_(float("nan"))
        bufs["partial"].fill_(float("nan"))
        gk(bufs, signals=sigs, launch_index=launch, rank=rank)
        if not fold:
            ck(bufs, signals=sigs, launch_index=launch, rank=rank)
        torch.cuda.synchronize()
        y = bufs["y_sorted"].float().cpu().numpy()
        assert not np.isnan(y[used]).any() and np.isnan(y[~used]).all()    # unused tiles: not stored
        _close(y[used], y_ref[used], f"y_sorted launch {launch}", 1e-2)
        p = bufs["partial"].float().cpu().numpy()
        assert not np.isnan(p).any()
        _close(p, p_ref, f"partial launch {launch}", 1e-2)
        assert (sigs["y_ready"].cpu().numpy() == launch * exp_y).all()
        assert (sigs["reduce_scatter_ready"].cpu().numpy() == launch * exp_rs["reduce_scatter_ready"]).all()


def test_combine_waits_block_until_flags_are_set():
    """The combine waits for every grouped-GEMM tile holding its tokens: short by one launch's
    notifies it writes nothing; once they are added it completes the same launch."""
    import torch
    from tldsl.ops.moe import reference_moe_reduce_scatter
    from tldsl.runtime.gpu.grouped_gemm import GroupedKernel
    W, Ms, K, Nr, E, topk = 4, 128, 512, 256, 8, 2
    rt, wts = _routing(W, Ms, E, topk, 128, "random", seed=11)
    k, lg, lc = _lower_rs(rt, wts, W, Ms, K, Nr, E, (128, 128, 64), 4, "row_major", "float16")
    gk, ck = GroupedKernel(lg), GroupedKernel(lc)
    g = torch.Generator(device="cuda").manual_seed(1)
    tabs = rt.reduce_scatter_tables()
    bufs = {"h": _randn((rt.num_rows, Nr), "float16", g), "w2": _randn((E, Nr, K), "float16", g, 1 / 16),
            "topk_weights": _cuda(wts), **{n: _cuda(a) for n, a in tabs.items()},
            "y_sorted": torch.full((rt.num_rows, K), float("nan"), device="cuda", dtype=torch.float16),
            "partial": torch.full((W * Ms, K), float("nan"), device="cuda", dtype=torch.float32)}
    sigs = {n: torch.zeros(s, device="cuda", dtype=torch.int64)
            for n, s in {**lg.signal_slots, **lc.signal_slots}.items()}
    ref = reference_moe_reduce_scatter([_np(bufs["h"])], [_np(bufs["w2"])], wts, rt)
    gk(bufs, signals=sigs, launch_index=1)
    ck(bufs, signals=sigs, launch_index=1)
    torch.cuda.synchronize()
    _close(bufs["partial"].cpu().numpy(), ref, "launch 1", 1e-2)      # every element written, and right
    once = sigs["y_ready"].clone()            # one launch's notifies per channel
    exp_y = _expected_counts(k, "grouped_gemm", tabs, W, 0,
                             {"y_ready": {**lg.signal_slots, **lc.signal_slots}["y_ready"]})["y_ready"]
    assert (once.cpu().numpy() == exp_y).all() and exp_y.any()
    # Everything that runs while the combine spins must already be loaded (lazy module loading).
    torch.cuda._sleep(1000)
    bufs["partial"].fill_(float("nan"))
    torch.isnan(bufs["partial"]).all().item()     # loads the kernels of the check made while it spins
    sigs["y_ready"].add_(torch.zeros_like(once))  # ... and of the add that releases it (adds nothing)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ck(bufs, signals=sigs, launch_index=2)          # needs 2 launches' notifies, has 1
    torch.cuda._sleep(50_000_000)
    try:
        assert torch.isnan(bufs["partial"]).all().item(), "the combine ran before its GEMM tiles were notified"
    finally:
        sigs["y_ready"].add_(once)            # released even where the check failed: a failure, not a hang
        torch.cuda.synchronize()
    _close(bufs["partial"].cpu().numpy(), ref, "after the notifies", 1e-2)
