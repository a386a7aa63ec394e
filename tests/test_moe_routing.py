"""The MoE routing tables built on the GPU (``runtime/gpu/moe_routing.py``,
``codegen/include/tldsl/moe_routing.hpp``), without a GPU: the numpy model of the device
algorithm against the host's :func:`tldsl.ops.moe.moe_routing` over generated routings, the
sizes and checks the host makes before a launch, and the kernels compiled by NVRTC."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tldsl.errors import InputError
from tldsl.ops.moe import moe_num_tiles, moe_routing
from tldsl.runtime.gpu.moe_routing import CHUNK, TABLES, RoutingSizes, model_tables, routing_source

SKEWS = ("uniform", "zipf", "one", "few", "duplicates")


def routing_ids(rng, T, E, topk, skew):
    """``[T, topk]`` ids: distinct experts per token (uniform or Zipf-weighted), every routed row
    on one expert, tokens among a few experts (most experts get nothing), or any ids with repeats."""
    if skew == "one":
        return np.full((T, topk), rng.integers(E), np.int64)
    if skew == "duplicates":
        return rng.integers(0, E, (T, topk))
    if skew == "few":
        active = rng.choice(E, topk, replace=False)
        return np.stack([rng.permutation(active) for _ in range(T)]).reshape(T, topk)
    w = np.ones(E) if skew == "uniform" else 1.0 / np.arange(1, E + 1) ** 1.3
    g = np.log(rng.random((T, E))) / w                 # weighted sampling without replacement
    return np.argsort(-g, axis=1)[:, :topk]


def check_model(ids, E, W, Ms, BM):
    got = model_tables(ids, E, W, Ms, BM)
    assert all((a != -7).all() for a in got.values()), "an entry the kernels never write"
    host = moe_routing(ids, E, W, Ms, BM)
    for name in TABLES:
        assert np.array_equal(got[name], getattr(host, name)), name
    assert got["info"].tolist() == [int((host.tile_expert >= 0).sum()), 0, -1]
    return got


@st.composite
def routings(draw):
    E = draw(st.integers(1, 40))
    topk = draw(st.integers(1, min(8, E)))
    W = draw(st.integers(1, 4))
    Ms = draw(st.integers(1, 60))
    BM = draw(st.sampled_from((1, 2, 3, 8, 16, 64, 128)))
    skew = draw(st.sampled_from(SKEWS))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    return E, topk, W, Ms, BM, skew, seed


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routings())
def test_the_device_algorithm_gives_the_host_tables(case):
    E, topk, W, Ms, BM, skew, seed = case
    rng = np.random.default_rng(seed)
    ids = routing_ids(rng, W * Ms, E, topk, skew)
    check_model(ids.astype(rng.choice([np.int32, np.int64])), E, W, Ms, BM)


@pytest.mark.parametrize("skew", SKEWS)
def test_several_blocks_of_rows(skew):
    """More than two blocks of the count / scatter kernels, the last one partial."""
    rng = np.random.default_rng(len(skew))
    T, topk, E = 2600, 8, 48
    assert T * topk > 4 * CHUNK and T * topk % CHUNK
    check_model(routing_ids(rng, T, E, topk, skew), E, 2, T // 2, 64)


@pytest.mark.parametrize("items", [1, 2, 4, 16])
def test_other_rows_per_thread(items):
    rng = np.random.default_rng(items)
    T, topk, E = 700, 6, 20
    ids = routing_ids(rng, T, E, topk, "zipf")
    host = moe_routing(ids, E, 1, T, 16)
    got = model_tables(ids, E, 1, T, 16, items=items)
    assert all(np.array_equal(got[n], getattr(host, n)) for n in TABLES)


def test_no_tokens_and_one_token():
    got = model_tables(np.zeros((0, 3), np.int32), 5, 2, 0, 16)
    assert got["info"].tolist() == [0, 0, -1]
    assert got["tile_expert"].tolist() == [-1] and (got["sorted_token_ids"] == -1).all()
    assert got["token_pos"].size == 0 and got["token_tile_producers"].size == 0
    assert got["tile_token_tiles"].shape == (1, 0) and got["tile_tokens"].tolist() == [[0, 0]]
    got = check_model(np.array([[3]]), 4, 1, 1, 128)
    assert got["sorted_token_ids"][:2].tolist() == [0, -1] and got["tile_expert"].tolist() == [3]


def test_bad_ids_are_flagged_and_join_no_expert():
    rng = np.random.default_rng(3)
    T, topk, E = 3000, 3, 10
    ids = routing_ids(rng, T, E, topk, "uniform")
    ids[2500, 1], ids[100, 2], ids[2999, 0] = E, -5, 1 << 40
    got = model_tables(ids, E, 1, T, 32)
    assert got["info"].tolist()[1:] == [1, 100 * topk + 2]
    for t, k in ((2500, 1), (100, 2), (2999, 0)):
        assert got["token_pos"][k * T + t] == -1
    assert got["expert_counts"].sum() == T * topk - 3
    assert (got["sorted_token_ids"] >= 0).sum() == T * topk - 3


def test_sizes_are_worst_case_bounds_and_checked():
    s = RoutingSizes(8, 4096, 8, 128, 128)
    assert s.num_tiles == moe_num_tiles(32768 * 8, 128, 128) <= -(-32768 * 8 // 128) + 128
    assert s.shapes()["sorted_token_ids"] == (s.num_tiles * 128,) and s.blocks == -(-32768 * 8 // CHUNK)
    for bad in [dict(num_experts=0), dict(num_experts=5000), dict(topk=0), dict(BM=0), dict(world_size=0),
                dict(rows_per_rank=-1), dict(topk=True), dict(rows_per_rank=2 ** 29)]:
        kw = {**dict(world_size=2, rows_per_rank=8, topk=2, num_experts=4, BM=16), **bad}
        with pytest.raises(InputError):
            RoutingSizes(kw["world_size"], kw["rows_per_rank"], kw["topk"], kw["num_experts"], kw["BM"])
    with pytest.raises(InputError, match="shared memory"):    # the chunk's layout and 2048 experts' counts
        RoutingSizes(1, 8, 2, 2048, 16, items=32)
    assert RoutingSizes(1, 8, 2, 2048, 16).smem_bytes("fused") <= 227 * 1024


@pytest.mark.nvrtc
def test_the_routing_kernels_compile(tmp_path):
    from tldsl.codegen.toolchain import KernelCache, compile_cuda, toolchain_available
    ok, why = toolchain_available()
    if not ok:
        pytest.skip(f"NVRTC toolchain: {why}")
    from tldsl.runtime.gpu.moe_routing import NAME, entry
    ck = compile_cuda(routing_source(), NAME, cache=KernelCache(tmp_path), progress=False)
    assert ck.cubin[:4] == b"\x7fELF"
    info = ck.ptxas_info()
    names = {entry(k, d) for k in ("fused", "count", "scatter") for d in ("int32", "int64")} | {entry("tiles")}
    assert names <= set(info), sorted(info)
    for name in names:                          # no local memory: every table index stays in registers
        assert info[name]["spill_store_bytes"] == 0 and info[name]["stack_bytes"] == 0, (name, info[name])


@pytest.mark.parametrize("skew", ["uniform", "zipf", "one"])
@pytest.mark.parametrize("interleave", [1, 2, 3])
def test_interleaved_tiles_are_the_same_tiles_in_rounds_of_each_expert(skew, interleave):
    """``moe_routing(..., interleave=G)``: the same tiles as expert after expert (each one expert's
    rows in token order), laid out in rounds of G tiles per expert; every table follows its tile."""
    rng = np.random.default_rng(3)
    T, E, topk, BM = 300, 6, 2, 16
    ids = routing_ids(rng, T, E, topk, skew)
    flat, inter = moe_routing(ids, E, 1, T, BM), moe_routing(ids, E, 1, T, BM, interleave=interleave)
    used = int((flat.tile_expert >= 0).sum())
    assert int((inter.tile_expert >= 0).sum()) == used and (inter.tile_expert[used:] == -1).all()

    def tiles(rt):
        return {(int(rt.tile_expert[i]), tuple(rt.sorted_token_ids[i * BM:(i + 1) * BM])): i for i in range(used)}
    a, b = tiles(flat), tiles(inter)
    assert set(a) == set(b)
    for key, i in a.items():                  # every per-tile table moves with its tile
        j = b[key]
        for name in ("tile_valid_rows", "tile_tokens", "tile_ranks", "tile_token_tiles", "tile_num_token_tiles"):
            assert np.array_equal(getattr(flat, name)[i], getattr(inter, name)[j]), name
    assert np.array_equal(flat.token_tile_producers, inter.token_tile_producers)
    # token_pos points at the same routed row wherever its tile went
    for p in range(topk * T):
        i, j = flat.token_pos[p] // BM, inter.token_pos[p] // BM
        assert flat.token_pos[p] % BM == inter.token_pos[p] % BM
        assert b[(int(flat.tile_expert[i]), tuple(flat.sorted_token_ids[i * BM:(i + 1) * BM]))] == j
    # the rounds: (the tile's index within its expert // G, expert) never decreases along the layout
    nth = {}
    keys = []
    for i in range(used):
        e = int(inter.tile_expert[i])
        keys.append((nth.get(e, 0) // interleave, e))
        nth[e] = nth.get(e, 0) + 1
    assert keys == sorted(keys)
    with pytest.raises(InputError, match="interleave"):
        moe_routing(ids, E, 1, T, BM, interleave=0)


def test_an_interleaved_layout_computes_the_same_layer_in_the_simulator():
    """MoE+ReduceScatter on two ranks with tiles interleaved across experts: the simulator (races,
    waits) against the numpy reference, which reads the same tables."""
    import tldsl as tl
    from tldsl.ops.moe import reference_moe_reduce_scatter, simulate_moe_reduce_scatter
    rng = np.random.default_rng(5)
    W, Ms, E, topk, Nr, K, BM = 2, 24, 4, 2, 32, 24, 16
    ids = routing_ids(rng, W * Ms, E, topk, "uniform")
    rt = moe_routing(ids, E, W, Ms, BM, interleave=1)
    assert not (np.diff(rt.tile_expert[rt.tile_expert >= 0]) >= 0).all()     # really out of expert order
    hs = [rng.standard_normal((rt.num_rows, Nr)).astype(np.float32) for _ in range(W)]
    w2 = [rng.standard_normal((E, Nr, K)).astype(np.float32) for _ in range(W)]
    wts = rng.random((W * Ms, topk)).astype(np.float32)
    got = simulate_moe_reduce_scatter(hs, w2, wts, rt, compute=tl.ComputeSchedule(tile=(BM, 16, 16)),
                                      comm=tl.CommSchedule(tile_m=8, mode="push"))
    want = reference_moe_reduce_scatter(hs, w2, wts, rt)
    np.testing.assert_allclose(np.concatenate(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("counts", [[5, 3, 0, 2], [1], [4, 4, 4, 4], [7, 1, 3], [30000, 17000, 1]])
def test_the_devices_visit_sums_are_the_sort_by_place_in_the_expert(counts):
    """``model_visit`` (the tiles kernel's per-tile sums, uint32 below ``NARROW_TILES`` tiles and
    64-bit past them, as the device takes them) against a sort of the used tiles by
    ``((2l + 1) / n_e, e)`` in exact fractions; unused tiles keep their place."""
    from fractions import Fraction
    from tldsl.runtime.gpu.moe_routing import NARROW_TILES, model_visit
    n = np.array(counts)
    te = np.concatenate([np.full(c, e) for e, c in enumerate(counts)] + [np.full(3, -1)]).astype(np.int32)
    first = np.cumsum(n) - n
    key = {i: (Fraction(2 * (i - first[e]) + 1, n[e]), e) for i, e in enumerate(te.tolist()) if e >= 0}
    want = sorted(key, key=key.get) + list(range(len(key), te.size))
    got = model_visit(te, first, n)
    assert got.dtype == np.int32 and got.tolist() == want
    assert (te.size >= NARROW_TILES) == (sum(counts) > 46000)        # the last case takes the 64-bit sums


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routings())
def test_every_routing_the_library_builds_passes_the_check_a_callers_tables_get(case):
    """The check of tables the library did not build (:mod:`tldsl.runtime.dist.moe_tables`)
    rejects no routing the library builds: the host's and the GPU kernels' (their numpy mirror),
    over expert counts, world sizes, tile heights and skews — duplicates within a token's top-k,
    every row on one expert, most experts empty — all of its tables at once."""
    torch = pytest.importorskip("torch")
    from tldsl.runtime.dist.moe_ops import AG_TABLES, RS_TABLES
    from tldsl.runtime.dist.moe_tables import check_routing_tables
    E, topk, W, Ms, BM, skew, seed = case
    ids = routing_ids(np.random.default_rng(seed), W * Ms, E, topk, skew)
    host = moe_routing(ids, E, W, Ms, BM)
    for tables in ({n: getattr(host, n) for n in AG_TABLES + RS_TABLES}, model_tables(ids, E, W, Ms, BM)):
        check_routing_tables({n: torch.from_numpy(np.ascontiguousarray(tables[n])) for n in AG_TABLES + RS_TABLES},
                             AG_TABLES + RS_TABLES, torch.from_numpy(np.ascontiguousarray(ids)), num_experts=E,
                             block_m=BM, num_tiles=host.num_tiles)
