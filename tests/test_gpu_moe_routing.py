"""The MoE routing tables built on the GPU (``runtime/gpu/moe_routing.py``) against the host's
:func:`tldsl.ops.moe.moe_routing`, entry for entry, and their time at 32768 tokens, top-8,
128 experts (skipped where there is no GPU).

Run on a GPU host with: ``python -m pytest -q -s -m gpu tests/test_gpu_moe_routing.py``.
"""
from __future__ import annotations

import os
import statistics

import numpy as np
import pytest

from tldsl.runtime.gpu import gpu_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs an sm_90 GPU with torch and cuda-python")]

#: the target (issue 19 item 3), at every routing, and what a change must not make worse (the three
#: kernels measured 22.8 µs uniform, 21.7 Zipf, 17.0 all-to-one: BENCHMARKS.md)
BOUND_US, REGRESSION_US = 20.0, 25.0


@pytest.fixture(scope="module")
def compiled():
    from tldsl.runtime.gpu.moe_routing import compile_routing
    return compile_routing()


def _ids(rng, T, E, topk, kind):
    if kind == "uniform":                                    # distinct experts, uniformly
        return np.argsort(rng.random((T, E)), axis=1)[:, :topk]
    if kind == "zipf":                                       # distinct experts, expert e weighted 1/(e+1)^1.2
        w = 1.0 / np.arange(1, E + 1) ** 1.2
        g = np.log(rng.random((T, E))) / w                   # weighted sampling without replacement
        return np.argsort(-g, axis=1)[:, :topk]
    if kind == "one":                                        # every routed row on one expert
        return np.full((T, topk), E // 2)
    if kind == "half_empty":                                 # experts 0, 2, 4 ... get nothing
        return 2 * np.argsort(rng.random((T, E // 2)), axis=1)[:, :topk] + 1
    raise ValueError(kind)


def _build(compiled, ids_np, E, W, Ms, BM, dtype="int32", **kw):
    import torch
    from tldsl.runtime.gpu.moe_routing import MoERoutingBuilder
    b = MoERoutingBuilder(W, Ms, ids_np.shape[1], E, BM, compiled=compiled, **kw)
    ids = torch.from_numpy(np.ascontiguousarray(ids_np.astype(dtype))).cuda()
    return b, ids


def _host(tables):
    return {n: t.cpu().numpy() for n, t in tables.items()}


CASES = [  # W, Ms, topk, E, BM, kind, dtype
    (8, 4096, 8, 128, 128, "uniform", "int32"),
    (8, 4096, 8, 128, 128, "zipf", "int64"),
    (4, 1000, 2, 8, 64, "one", "int32"),
    (2, 777, 6, 64, 128, "half_empty", "int64"),
    (1, 1, 1, 1, 128, "one", "int32"),
    (3, 5, 4, 16, 64, "uniform", "int32"),
    (1, 5000, 1, 3, 1, "zipf", "int32"),
    (1, 50000, 1, 4, 1, "zipf", "int32"),    # 50000 row tiles: tile_visit's 64-bit sums (NARROW_TILES)
]

#: the ways one call can run: the fused kernel (its grid as chosen, or capped so that every
#: block takes several chunks), or the three kernels with and without programmatic dependent launch
WAYS = {"fused": dict(fused=True), "fused, 3 blocks": dict(fused=True, fused_blocks=3),
        "fused, 1 block": dict(fused=True, fused_blocks=1),
        "split, PDL": dict(fused=False, pdl=True), "split, plain": dict(fused=False, pdl=False)}


@pytest.mark.parametrize("W,Ms,topk,E,BM,kind,dtype", CASES)
def test_device_tables_equal_the_host_tables(compiled, W, Ms, topk, E, BM, kind, dtype):
    import torch
    from tldsl.ops.moe import moe_routing
    from tldsl.runtime.gpu.moe_routing import TABLES
    rng = np.random.default_rng(W * 1000 + Ms + E)
    ids_np = _ids(rng, W * Ms, E, topk, kind)
    host = moe_routing(ids_np, E, W, Ms, BM)
    tables = None
    for way, kw in WAYS.items():
        b, ids = _build(compiled, ids_np, E, W, Ms, BM, dtype, **kw)
        tables = b.empty_tables() if tables is None else tables   # later ways refill the same buffers
        for t in tables.values():               # garbage everywhere: every entry must be written (a new
            t.fill_(-7)                         # builder zeroes the barrier word before its first launch)
        b(ids, tables)
        torch.cuda.synchronize()
        assert b.fused == kw["fused"], f"{way}: the cooperative launch was refused"
        got = _host(tables)
        for n in TABLES:
            assert np.array_equal(got[n], getattr(host, n)), f"{kind} {dtype} {way}: table {n} differs"
        assert got["info"].tolist() == [int((host.tile_expert >= 0).sum()), 0, -1], way


def test_the_fused_kernel_in_a_cuda_graph(compiled):
    """Captured once, replayed on new ids copied into the captured input: the host's tables."""
    import torch
    from tldsl.ops.moe import moe_routing
    from tldsl.runtime.gpu.moe_routing import TABLES
    W, Ms, topk, E, BM = 2, 3000, 4, 32, 64
    rng = np.random.default_rng(11)
    b, ids = _build(compiled, _ids(rng, W * Ms, E, topk, "uniform"), E, W, Ms, BM, fused=True)
    tables = b.empty_tables()
    b(ids, tables)                              # prepared (and the kernels loaded) before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b(ids, tables)
    assert b.fused
    for kind in ("zipf", "one", "uniform"):
        ids_np = _ids(rng, W * Ms, E, topk, kind)
        ids.copy_(torch.from_numpy(ids_np.astype(np.int32)).cuda())
        for n, t in tables.items():             # not the barrier word: every call leaves it at zero
            if n != "barrier":
                t.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        got, host = _host(tables), moe_routing(ids_np, E, W, Ms, BM)
        for n in TABLES:
            assert np.array_equal(got[n], getattr(host, n)), f"graph replay, {kind}: table {n} differs"


@pytest.mark.parametrize("way", ["fused", "fused, 1 block", "split, PDL"])
def test_empty_routing_and_bad_ids(compiled, way):
    """T = 0 writes the one unused tile; ids outside [0, E) are flagged (the first one's routed
    row in info[2]), their rows join no expert and nothing outside the tables is touched."""
    import torch
    from tldsl.ops.moe import moe_routing
    from tldsl.runtime.gpu.moe_routing import MoERoutingBuilder
    b = MoERoutingBuilder(2, 0, 4, 8, 64, compiled=compiled, **WAYS[way])
    got = _host(b(torch.zeros((0, 4), dtype=torch.int32, device="cuda")))
    assert got["info"].tolist() == [0, 0, -1] and got["tile_expert"].tolist() == [-1]
    assert (got["sorted_token_ids"] == -1).all() and got["tile_valid_rows"].tolist() == [0]

    rng = np.random.default_rng(1)
    T, topk, E = 9000, 4, 32
    ids_np = _ids(rng, T, E, topk, "uniform").astype(np.int64)
    bad = [(5000, 2, E), (7000, 0, -1), (8999, 3, 1 << 40)]
    for t, k, v in bad:
        ids_np[t, k] = v
    b, ids = _build(compiled, ids_np, E, 1, T, 128, "int64", **WAYS[way])
    guard = torch.full((1 << 20,), 123, dtype=torch.int32, device="cuda")
    tables = b(ids)
    torch.cuda.synchronize()
    got = _host(tables)
    assert got["info"].tolist()[1:] == [1, 5000 * topk + 2]
    assert (guard == 123).all().item()
    for t, k, _ in bad:
        assert got["token_pos"][k * T + t] == -1
    clean = ids_np.copy()
    for t, k, _ in bad:                         # the good rows: as the host sorts them
        clean[t, k] = 0
    host = moe_routing(clean, E, 1, T, 128)
    expected = host.expert_counts.copy()
    expected[0] -= len(bad)
    assert np.array_equal(got["expert_counts"], expected)


def _median_us(fn, reps=100, warmup=10):
    """Median GPU time of ``fn`` between CUDA events, the stream kept busy ahead of it (a sleep
    kernel) so that the host's launch time is not counted."""
    import torch
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)
        a.record()
        fn()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z) * 1000.0)
    return statistics.median(times), min(times)


def _peer(ids, E):
    """torch's share of the job, as the peer: a stable sort of the ids and per-expert counts
    (no host synchronisation)."""
    import torch
    flat = ids.view(-1).long()
    ones = torch.ones_like(flat)

    def run():
        torch.sort(flat, stable=True)
        torch.zeros(E, dtype=torch.long, device="cuda").index_add_(0, flat, ones)
    return run


def _check_tables(b, ids, tables, ids_np, what):
    """The tables after timed calls: still the host's."""
    import torch
    from tldsl.ops.moe import moe_routing
    from tldsl.runtime.gpu.moe_routing import TABLES
    torch.cuda.synchronize()
    s = b.sizes
    host = moe_routing(ids_np, s.num_experts, s.world_size, s.rows_per_rank, s.block_m)
    got = _host(tables)
    assert all(np.array_equal(got[n], getattr(host, n)) for n in TABLES), what


def _time_routing(compiled, kind, W, Ms, topk, E, BM):
    """One routing's row: a call (what the ops do: the three kernels with PDL), timed twice; the
    fused kernel, at its grid and with one block per chunk; the three kernels with and without
    PDL, each alone; the host's time per call; torch's sort + counts."""
    import time
    import torch
    ids_np = _ids(np.random.default_rng(7), W * Ms, E, topk, kind)
    b, ids = _build(compiled, ids_np, E, W, Ms, BM)
    tables = b.empty_tables()
    stream = torch.cuda.current_stream().cuda_stream
    call, _ = _median_us(lambda: b(ids, tables))
    used = "fused" if b.fused else ("split, PDL" if b.pdl else "split, plain")
    _check_tables(b, ids, tables, ids_np, f"{kind}: a call")
    fused = _build(compiled, ids_np, E, W, Ms, BM, fused=True)[0]
    fused_us, _ = _median_us(lambda: fused(ids, tables))
    _check_tables(fused, ids, tables, ids_np, f"{kind}: fused")
    per_chunk = _build(compiled, ids_np, E, W, Ms, BM, fused=True, fused_blocks=b.sizes.blocks)[0]
    chunk_grid = per_chunk.fused_grid()
    per_chunk_us, _ = _median_us(lambda: per_chunk(ids, tables))
    _check_tables(per_chunk, ids, tables, ids_np, f"{kind}: fused, one block per chunk")
    split = b.launches(ids, tables, fused=False)
    pdl, _ = _median_us(lambda: b.enqueue(split, stream, pdl=True))
    plain, _ = _median_us(lambda: b.enqueue(split, stream, pdl=False))
    _check_tables(b, ids, tables, ids_np, f"{kind}: three kernels")
    alone = [_median_us(lambda: b.enqueue([ln], stream, pdl=False))[0] for ln in split]
    t0 = time.perf_counter()
    for _ in range(100):
        b(ids, tables)
    host_us = (time.perf_counter() - t0) * 1e4
    torch.cuda.synchronize()
    again, _ = _median_us(lambda: b(ids, tables))
    peer_us, _ = _median_us(_peer(ids, E))
    return dict(kind=kind, call=call, again=again, used=used, fused=fused_us, grid=fused.fused_grid(),
                per_chunk=per_chunk_us, chunk_grid=chunk_grid, pdl=pdl, plain=plain, alone=alone, host=host_us,
                peer=peer_us)


def _by_items(compiled, W, Ms, topk, E, BM):
    """A call, the fused kernel and the three plain kernels at 2, 4, 8 and 16 routed rows per
    thread (uniform ids)."""
    import torch
    from tldsl.runtime.gpu.moe_routing import ITEMS, MoERoutingBuilder, compile_routing
    ids_np = _ids(np.random.default_rng(7), W * Ms, E, topk, "uniform")
    ids = torch.from_numpy(ids_np.astype(np.int32)).cuda()
    stream = torch.cuda.current_stream().cuda_stream
    out = []
    for items in (2, 4, 8, 16):
        v = MoERoutingBuilder(W, Ms, topk, E, BM, items=items,
                              compiled=compiled if items == ITEMS else compile_routing(items))
        vt = v.empty_tables()
        us, _ = _median_us(lambda: v(ids, vt))
        vl = v.launches(ids, vt, fused=False)
        plain_us, _ = _median_us(lambda: v.enqueue(vl, stream, pdl=False))
        _check_tables(v, ids, vt, ids_np, f"items={items}")
        vf = MoERoutingBuilder(W, Ms, topk, E, BM, items=items, compiled=v.compiled, fused=True)
        fused_us, _ = _median_us(lambda: vf(ids, vt))
        _check_tables(vf, ids, vt, ids_np, f"items={items}, fused")
        out.append(f"items={items} ({v.sizes.blocks} chunks): a call {us:.2f} µs, fused ({vf.fused_grid()} blocks) "
                   f"{fused_us:.2f} µs, three plain kernels {plain_us:.2f} µs")
    return out


def _tiny_kernel_us():
    """One tiny kernel between the events: what any single launch costs in this measure."""
    import torch
    x = torch.empty(1, device="cuda")
    return _median_us(lambda: x.zero_())[0]


def test_routing_time_at_32k_tokens_top8_128_experts(compiled):
    """A call (the three kernels with PDL) at uniform, Zipf and all-to-one routings, against the
    fused kernel, the plain launches and torch's stable sort + per-expert counts of the same ids;
    the target is 20 µs at every routing."""
    import torch
    from tldsl.runtime.gpu.moe_routing import RoutingSizes
    W, Ms, topk, E, BM = 8, 4096, 8, 128, 128
    rows = [_time_routing(compiled, kind, W, Ms, topk, E, BM) for kind in ("uniform", "zipf", "one")]
    variants = _by_items(compiled, W, Ms, topk, E, BM)
    s = RoutingSizes(W, Ms, topk, E, BM)
    lines = [f"moe routing tables on {torch.cuda.get_device_name()}: T={W * Ms} top-{topk} E={E} BM={BM} "
             f"(NT={s.num_tiles} tiles, {s.blocks} chunks), GPU µs between CUDA events, median of 100 after "
             f"10 warm-up; one tiny kernel: {_tiny_kernel_us():.2f} µs",
             "| routing | a call | again | way | fused (blocks) | fused, one block per chunk | three kernels PDL "
             "| three plain | count alone | scatter alone | tiles alone | host µs/call | torch sort+counts |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kind']} | {r['call']:.2f} | {r['again']:.2f} | {r['used']} | {r['fused']:.2f} ({r['grid']}) | "
              f"{r['per_chunk']:.2f} ({r['chunk_grid']}) | {r['pdl']:.2f} | {r['plain']:.2f} | "
              + " | ".join(f"{a:.2f}" for a in r["alone"]) + f" | {r['host']:.1f} | {r['peer']:.2f} |"
              for r in rows]
    lines.append("uniform ids, by routed rows per thread: " + "; ".join(variants))
    text = "\n".join(lines)
    print("\n" + text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "moe_routing_bench.md"), "w") as f:
            f.write(text + "\n")
    for r in rows:
        best = min(r["call"], r["again"])
        assert best <= REGRESSION_US, f"{r['kind']} routing: median {best:.2f} µs > {REGRESSION_US} µs"
    slow = [f"{r['kind']} {r['call']:.2f} µs" for r in rows if r["call"] > BOUND_US]
    if slow:
        pytest.xfail(f"above the {BOUND_US} µs target: {', '.join(slow)}")


@pytest.mark.parametrize("kind", ["uniform", "one", "half_empty"])
def test_the_builders_tables_are_its_own_and_pass_the_check_a_foreign_routing_gets(compiled, kind):
    """What the builder writes is a RoutingTables (the MoE ops trust it); the same tables in a plain
    dict, as a caller's router would return them, pass :func:`check_routing_tables` on the GPU, and
    one entry changed fails it with an InputError."""
    import torch

    from tldsl.errors import InputError
    from tldsl.runtime.dist.moe_ops import AG_TABLES, RS_TABLES
    from tldsl.runtime.dist.moe_tables import check_routing_tables
    from tldsl.runtime.gpu.moe_routing import RoutingTables
    W, Ms, topk, E, BM = 2, 3000, 4, 16, 128
    b, ids = _build(compiled, _ids(np.random.default_rng(5), W * Ms, E, topk, kind), E, W, Ms, BM)
    tables = b(ids)
    torch.cuda.synchronize()
    assert isinstance(tables, RoutingTables)
    plain = {n: t.clone() for n, t in tables.items()}
    kw = dict(num_experts=E, block_m=BM, num_tiles=b.sizes.num_tiles)
    check_routing_tables(plain, AG_TABLES + RS_TABLES, ids, **kw)
    plain["token_tile_producers"][0] += 1
    with pytest.raises(InputError, match="'token_tile_producers' is not the number"):
        check_routing_tables(plain, RS_TABLES, ids, **kw)
