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

#: the target (issue 19 item 3) and what a change must not make worse (measured: 23.3 µs, BENCHMARKS.md)
BOUND_US, REGRESSION_US = 20.0, 30.0


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


def _build(compiled, ids_np, E, W, Ms, BM, dtype="int32"):
    import torch
    from tldsl.runtime.gpu.moe_routing import MoERoutingBuilder
    b = MoERoutingBuilder(W, Ms, ids_np.shape[1], E, BM, compiled=compiled)
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
]


@pytest.mark.parametrize("W,Ms,topk,E,BM,kind,dtype", CASES)
def test_device_tables_equal_the_host_tables(compiled, W, Ms, topk, E, BM, kind, dtype):
    import torch
    from tldsl.ops.moe import moe_routing
    from tldsl.runtime.gpu.moe_routing import TABLES
    rng = np.random.default_rng(W * 1000 + Ms + E)
    ids_np = _ids(rng, W * Ms, E, topk, kind)
    host = moe_routing(ids_np, E, W, Ms, BM)
    b, ids = _build(compiled, ids_np, E, W, Ms, BM, dtype)
    tables = b.empty_tables()
    for t in tables.values():                   # garbage everywhere: every entry must be written
        t.fill_(-7)
    for call in range(2):                       # the second call reuses the buffers, without PDL
        b.pdl = call == 0
        b(ids, tables)
        torch.cuda.synchronize()
        got = _host(tables)
        for n in TABLES:
            assert np.array_equal(got[n], getattr(host, n)), f"{kind} {dtype} call {call}: table {n} differs"
        assert got["info"].tolist() == [int((host.tile_expert >= 0).sum()), 0, -1]


def test_empty_routing_and_bad_ids(compiled):
    """T = 0 writes the one unused tile; ids outside [0, E) are flagged (the first one's routed
    row in info[2]), their rows join no expert and nothing outside the tables is touched."""
    import torch
    from tldsl.ops.moe import moe_routing
    from tldsl.runtime.gpu.moe_routing import MoERoutingBuilder
    b = MoERoutingBuilder(2, 0, 4, 8, 64, compiled=compiled)
    got = _host(b(torch.zeros((0, 4), dtype=torch.int32, device="cuda")))
    assert got["info"].tolist() == [0, 0, -1] and got["tile_expert"].tolist() == [-1]
    assert (got["sorted_token_ids"] == -1).all() and got["tile_valid_rows"].tolist() == [0]

    rng = np.random.default_rng(1)
    T, topk, E = 9000, 4, 32
    ids_np = _ids(rng, T, E, topk, "uniform").astype(np.int64)
    bad = [(5000, 2, E), (7000, 0, -1), (8999, 3, 1 << 40)]
    for t, k, v in bad:
        ids_np[t, k] = v
    b, ids = _build(compiled, ids_np, E, 1, T, 128, "int64")
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


def test_routing_time_at_32k_tokens_top8_128_experts(compiled):
    """The three kernels with programmatic dependent launch (what a call does), with plain
    launches, each kernel alone, and torch's stable sort + per-expert counts of the same ids."""
    import time
    import torch
    W, Ms, topk, E, BM = 8, 4096, 8, 128, 128
    T = W * Ms
    rows = []
    for kind in ("uniform", "zipf", "one"):
        ids_np = _ids(np.random.default_rng(7), T, E, topk, kind)
        b, ids = _build(compiled, ids_np, E, W, Ms, BM)
        tables = b.empty_tables()
        stream = torch.cuda.current_stream().cuda_stream
        launches = b.launches(ids, tables)
        pdl, _ = _median_us(lambda: b(ids, tables))
        used_pdl = b.pdl
        plain, _ = _median_us(lambda: b.enqueue(launches, stream, pdl=False))
        alone = [_median_us(lambda: b.enqueue([l], stream, pdl=False))[0] for l in launches]
        t0 = time.perf_counter()
        for _ in range(100):
            b(ids, tables)
        host_us = (time.perf_counter() - t0) * 1e4
        torch.cuda.synchronize()
        flat = ids.view(-1).long()
        ones = torch.ones_like(flat)

        def peer():   # the sort-by-expert part only: stable sort + per-expert counts (no host sync)
            torch.sort(flat, stable=True)
            torch.zeros(E, dtype=torch.long, device="cuda").index_add_(0, flat, ones)
        peer_us, _ = _median_us(peer)
        rows.append((kind, pdl, used_pdl, plain, alone, host_us, peer_us))
        if kind == "uniform":                   # the tables after all those calls: still the host's
            from tldsl.ops.moe import moe_routing
            from tldsl.runtime.gpu.moe_routing import TABLES
            b(ids, tables)
            host = moe_routing(ids_np, E, W, Ms, BM)
            got = _host(tables)
            assert all(np.array_equal(got[n], getattr(host, n)) for n in TABLES)
    # rows per thread of the count and scatter kernels: the default against its neighbours (uniform ids)
    from tldsl.ops.moe import moe_routing
    from tldsl.runtime.gpu.moe_routing import ITEMS, TABLES, MoERoutingBuilder, compile_routing
    ids_np = _ids(np.random.default_rng(7), T, E, topk, "uniform")
    host = moe_routing(ids_np, E, W, Ms, BM)
    ids = torch.from_numpy(ids_np.astype(np.int32)).cuda()
    variants = []
    for items in (2, 4, 8, 16):
        v = MoERoutingBuilder(W, Ms, topk, E, BM, items=items,
                              compiled=compiled if items == ITEMS else compile_routing(items))
        vt = v.empty_tables()
        us, _ = _median_us(lambda: v(ids, vt))
        vl = v.launches(ids, vt)
        stream = torch.cuda.current_stream().cuda_stream
        plain_us, _ = _median_us(lambda: v.enqueue(vl, stream, pdl=False))
        got = _host(vt)
        assert all(np.array_equal(got[n], getattr(host, n)) for n in TABLES), f"items={items}"
        variants.append(f"items={items} ({v.sizes.blocks} blocks): PDL {us:.2f} µs, plain {plain_us:.2f} µs")
    lines = [f"moe routing tables on {torch.cuda.get_device_name()}: T={T} top-{topk} E={E} BM={BM} "
             f"(NT={b.sizes.num_tiles} tiles, {b.sizes.blocks} blocks), GPU µs between CUDA events, "
             f"median of 100 after 10 warm-up",
             "| routing | tldsl (PDL) | PDL used | tldsl plain launches | count alone | scatter alone "
             "| tiles alone | host enqueue µs/call | torch sort+counts |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {k} | {p:.2f} | {u} | {pl:.2f} | {a[0]:.2f} | {a[1]:.2f} | {a[2]:.2f} | {h:.1f} | {pe:.2f} |"
              for k, p, u, pl, a, h, pe in rows]
    lines.append("uniform ids, by routed rows per thread: " + "; ".join(variants))
    text = "\n".join(lines)
    print("\n" + text)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "moe_routing_bench.md"), "w") as f:
            f.write(text + "\n")
    best = min(rows[0][1], rows[0][3])
    assert best <= REGRESSION_US, f"uniform routing: median {best:.2f} µs > {REGRESSION_US} µs (was 23.3)"
    if best > BOUND_US:
        pytest.xfail(f"uniform routing: median {best:.2f} µs, above the {BOUND_US} µs target")
