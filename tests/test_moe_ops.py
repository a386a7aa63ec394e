"""AllGatherMoE and MoEReduceScatter (runtime/dist/moe_ops.py) — the library's MoE tile programs on
the one fused-op runtime, with the routing built per call — on W fake GPUs (the harness of
tests/test_program_op.py): a whole tensor-parallel MoE layer (layer 0 then layer 1, a new
routing every launch, routings with empty experts and with every token on the same experts)
against numpy's layer written from scratch; bad input refused before anything is enqueued."""
from __future__ import annotations

import re

import numpy as np
import pytest

import tldsl as tl

torch = pytest.importorskip("torch")

from test_program_op import Group, host  # noqa: E402

from tldsl.errors import InputError  # noqa: E402
from tldsl.ops.moe import moe_routing, random_routing, reference_moe, reference_moe_reduce_scatter  # noqa: E402
from tldsl.runtime.dist.moe_ops import AG_TABLES, RS_TABLES, AllGatherMoE, MoEReduceScatter  # noqa: E402

C32 = tl.ComputeSchedule(tile=(32, 32, 32))
MS, K, NR, E, TOPK = 24, 32, 32, 4, 2


class HostRouter:
    """The routing tables from :func:`moe_routing` (the reference the GPU builder is checked
    against), as fresh CPU tensors each call — the fake GPU runs later than the host enqueues."""

    def __init__(self, W, BM):
        self.W, self.BM, self.calls = W, BM, 0

    def __call__(self, topk_ids):
        self.calls += 1
        rt = moe_routing(topk_ids.numpy(), E, self.W, MS, self.BM)
        names = ("tile_expert", "tile_valid_rows", "tile_tokens", "tile_visit", "sorted_token_ids", "token_pos",
                 "tile_token_tiles", "tile_num_token_tiles", "token_tile_producers")
        return {n: torch.from_numpy(np.ascontiguousarray(getattr(rt, n))) for n in names}


def default_gather():
    from tldsl.runtime.dist.moe_ops import DEFAULT_AG_COMM
    return DEFAULT_AG_COMM


def _layers(monkeypatch, W, comm_ag, comm_rs, seed=0, stage_rows=None):
    g = Group(monkeypatch, W, seed)
    x = tl.TensorSpec((MS, K), tl.float16)
    ag = g.build(lambda r, dev: AllGatherMoE(x, tl.TensorSpec((E, K, NR), tl.float16), TOPK, compute=C32,
                                             comm=comm_ag, router=HostRouter(W, 32), device=dev, timeout_s=2.0,
                                             stage_rows=stage_rows))
    rs = g.build(lambda r, dev: MoEReduceScatter(tl.TensorSpec((E, NR, K), tl.float16), MS, TOPK, compute=C32,
                                                 comm=comm_rs, router=HostRouter(W, 32), device=dev, timeout_s=2.0))
    return g, ag, rs


@pytest.mark.parametrize("gather", ["sm", "copy_engine", "copy_engine/staged"])   # copy_engine: AllGatherMoE's default
@pytest.mark.parametrize("W", [1, 2, 3])
def test_a_moe_layer_on_two_fused_ops_agrees_with_numpy(monkeypatch, W, gather):
    """(``/staged``: the routed rows gathered by a compute part of their own, the grouped GEMM
    chained after it on its stream.)"""
    rng = np.random.default_rng(W)
    comm_ag = tl.CommSchedule(tile_m=16, mode="pull") if gather == "sm" else default_gather()
    staged = gather.endswith("/staged")
    g, ag, rs = _layers(monkeypatch, W, comm_ag, tl.CommSchedule(tile_m=16, mode="push"), stage_rows=staged)
    assert ag[0].stage_rows is staged and [p.name for p in ag[0].kernel.parts if p.role == "compute"] == \
        (["gather_rows", "grouped_gemm"] if staged else ["grouped_gemm"])
    if staged:
        planned = {k.part: k for k in ag[0].plan.kernels}
        assert planned["grouped_gemm"].after == "gather_rows"
        assert planned["grouped_gemm"].stream == planned["gather_rows"].stream
    xs = [rng.standard_normal((MS, K)).astype(np.float16) for _ in range(W)]
    w1 = [(rng.standard_normal((E, K, NR)) / 4).astype(np.float16) for _ in range(W)]
    w2 = [(rng.standard_normal((E, NR, K)) / 4).astype(np.float16) for _ in range(W)]
    launches, alive = [], []
    for kind in ("random", "concentrated"):           # a new routing each launch; some experts get nothing
        ids, wts = random_routing(rng, W * MS, E, TOPK, kind)
        outs = []
        for r in g.fake.rng.sample(range(W), W):
            h, tables = ag[r](torch.from_numpy(xs[r]), torch.from_numpy(ids), torch.from_numpy(w1[r]))
            out = rs[r](h, torch.from_numpy(ids), torch.from_numpy(wts), torch.from_numpy(w2[r]), tables)
            outs.append((r, out))
            alive.append((h, tables))    # the fake GPU runs at synchronize(): CPU memory freed before is reused
        launches.append((ids, wts, dict(outs)))
    for r in range(W):
        ag[r].synchronize()
        rs[r].synchronize()
    for ids, wts, outs in launches:
        want = reference_moe(xs, w1, w2, ids, wts)
        for r in range(W):
            got = host(outs[r])
            np.testing.assert_allclose(got, want[r * MS:(r + 1) * MS], rtol=2e-2, atol=3e-2)
    assert all(op.launches == 2 for op in ag + rs) and all(op._router.calls == 2 for op in ag)
    for op in ag + rs:
        op.close()


@pytest.mark.parametrize("W", [1, 2])
def test_a_moe_layer_on_the_ops_default_schedules_agrees_with_numpy(monkeypatch, W):
    """The measured defaults — 128x256x64 grouped GEMMs in the swizzled order (AllGather+MoE's
    in clusters of two), the copy engines gathering, the reduce-scatter in 128-row tiles on 32
    lanes — on sizes far from whole tiles."""
    from tldsl.runtime.dist.moe_ops import DEFAULT_AG_COMPUTE, DEFAULT_RS_COMPUTE
    g = Group(monkeypatch, W, W)
    ag = g.build(lambda r, dev: AllGatherMoE(tl.TensorSpec((MS, K), tl.float16), tl.TensorSpec((E, K, NR), tl.float16),
                                             TOPK, router=HostRouter(W, 128), device=dev, timeout_s=2.0))
    rs = g.build(lambda r, dev: MoEReduceScatter(tl.TensorSpec((E, NR, K), tl.float16), MS, TOPK,
                                                 router=HostRouter(W, 128), device=dev, timeout_s=2.0))
    assert ag[0].compute == DEFAULT_AG_COMPUTE and rs[0].compute == DEFAULT_RS_COMPUTE
    assert (rs[0].comm.tile_m, rs[0].comm.sms) == (128, 32) and ag[0].comm.engine == "copy_engine"
    assert DEFAULT_AG_COMPUTE.order == DEFAULT_RS_COMPUTE.order == "swizzled"
    assert DEFAULT_AG_COMPUTE.cluster == (2, 1) and DEFAULT_RS_COMPUTE.cluster == (1, 1)
    # the partials in h's dtype by default, as MatmulReduceScatter's (NCCL's numerics)
    assert rs[0].partial_dtype == "out" and rs[0].kernel.buffer("partial").type.dtype.name == "f16"
    rng = np.random.default_rng(10 + W)
    xs = [rng.standard_normal((MS, K)).astype(np.float16) for _ in range(W)]
    w1 = [(rng.standard_normal((E, K, NR)) / 4).astype(np.float16) for _ in range(W)]
    w2 = [(rng.standard_normal((E, NR, K)) / 4).astype(np.float16) for _ in range(W)]
    ids, wts = random_routing(rng, W * MS, E, TOPK, "random")
    outs = {}
    for r in g.fake.rng.sample(range(W), W):
        h, tables = ag[r](torch.from_numpy(xs[r]), torch.from_numpy(ids), torch.from_numpy(w1[r]))
        outs[r] = (rs[r](h, torch.from_numpy(ids), torch.from_numpy(wts), torch.from_numpy(w2[r]), tables), h, tables)
    for op in ag + rs:
        op.synchronize()
    want = reference_moe(xs, w1, w2, ids, wts)
    for r in range(W):
        np.testing.assert_allclose(host(outs[r][0]), want[r * MS:(r + 1) * MS], rtol=2e-2, atol=3e-2)
    for op in ag + rs:
        op.close()


def test_bad_input_is_refused_before_anything_is_enqueued(monkeypatch):
    g, ag, rs = _layers(monkeypatch, 2, tl.CommSchedule(tile_m=16), tl.CommSchedule(tile_m=16, mode="push"))
    op = ag[0]
    x, w1 = torch.zeros(MS, K, dtype=torch.float16), torch.zeros(E, K, NR, dtype=torch.float16)
    ids = torch.zeros(2 * MS, TOPK, dtype=torch.int32)
    cases = [
        (lambda: op(x, ids.float(), w1), "int32 or int64"),
        (lambda: op(x, ids[:-1], w1), r"topk_ids must be \[48, 2\]"),
        (lambda: op(x, ids.t().contiguous().t(), w1), "not contiguous"),
        (lambda: op(x, torch.full_like(ids, E), w1), r"topk_ids\[0, 0\] = 4 is not an expert id"),
        (lambda: op(x, ids - 1, w1), "is not an expert id"),
        (lambda: op(x.float(), ids, w1), "argument 'x'"),
        (lambda: op(x.t(), ids, w1), "argument 'x'"),
        (lambda: op([1, 2], ids, w1), "argument 'x'"),
        (lambda: op(x.to("meta"), ids, w1), "argument 'x' is on meta"),
        (lambda: op(x, ids, w1.to("meta")), "argument 'w1' is on meta"),
        (lambda: op(x, ids, w1, h=torch.zeros(3, 3)), "argument 'h'"),
        (lambda: op(x.clone().requires_grad_(), ids, w1), "argument 'x' requires grad, but the op has no backward"),
    ]
    for call, match in cases:
        with pytest.raises(InputError, match=match):
            call()
    assert op.launches == 0 and op._router.calls == 0 and not any(g.fake.queues.values())   # nothing enqueued
    with monkeypatch.context() as mp:               # while a CUDA graph captures: no host check of the ids
        from tldsl.runtime.dist import call_order
        mp.setattr(call_order, "capturing", lambda: True)
        with pytest.raises(InputError, match="validate_ids=False to capture it"):
            op(x, ids, w1)
    assert op.launches == 0 and op._router.calls == 0 and not any(g.fake.queues.values())
    with pytest.raises(InputError, match="w1 must be"):
        AllGatherMoE(tl.TensorSpec((MS, K), tl.float16), tl.TensorSpec((E, K + 1, NR), tl.float16), TOPK)
    for bad_x in (tl.TensorSpec((MS,), tl.float16), tl.TensorSpec((1, MS, K), tl.float16)):
        with pytest.raises(InputError, match=r"x must be \[Ms, K\] \(2-d\), got \["):
            AllGatherMoE(bad_x, tl.TensorSpec((E, K, NR), tl.float16), TOPK)
    with pytest.raises(InputError, match="w1: unsupported dtype float64"):          # the dtype, not the type
        AllGatherMoE(tl.TensorSpec((MS, K), tl.float16), np.zeros((E, K, NR)), TOPK)
    with pytest.raises(InputError, match=r"w2 must be \[E, Nr, K\] \(3-d\)"):
        MoEReduceScatter(tl.TensorSpec((NR, K), tl.float16), MS, TOPK)
    with pytest.raises(InputError, match="topk must be a positive int"):
        AllGatherMoE(tl.TensorSpec((MS, K), tl.float16), tl.TensorSpec((E, K, NR), tl.float16), 0)
    for bad in ("yes", 1, 0.5):
        with pytest.raises(InputError, match="stage_rows must be True, False or None"):
            AllGatherMoE(tl.TensorSpec((MS, K), tl.float16), tl.TensorSpec((E, K, NR), tl.float16), TOPK,
                         stage_rows=bad)
    for kw, match in ((dict(compute="fast"), "compute must be a tl.ComputeSchedule"),
                      (dict(comm=tl.ComputeSchedule()), "comm must be a tl.CommSchedule")):
        with pytest.raises(InputError, match="AllGatherMoE: " + match):
            AllGatherMoE(tl.TensorSpec((MS, K), tl.float16), tl.TensorSpec((E, K, NR), tl.float16), TOPK, **kw)
        with pytest.raises(InputError, match="MoEReduceScatter: " + match):
            MoEReduceScatter(tl.TensorSpec((E, NR, K), tl.float16), MS, TOPK, **kw)
    for kw, match in ((dict(validate_ids="no"), "validate_ids must be True or False, got 'no'"),
                      (dict(validate_ids=1), "validate_ids must be True or False"),
                      (dict(router=42), "router must be a callable .*got int")):
        with pytest.raises(InputError, match=match):
            AllGatherMoE(tl.TensorSpec((MS, K), tl.float16), tl.TensorSpec((E, K, NR), tl.float16), TOPK, **kw)
    with pytest.raises(InputError, match="check_routing takes the routing tables by name .*got NoneType"):
        op.check_routing(None)
    with pytest.raises(InputError, match="rows_per_rank must be a positive int"):
        MoEReduceScatter(tl.TensorSpec((E, NR, K), tl.float16), 0, TOPK)
    with pytest.raises(InputError, match="a torch tensor, numpy array or tl.TensorSpec"):
        MoEReduceScatter("w2", MS, TOPK)
    with monkeypatch.context() as mp:               # a router of the caller's that leaves a table out
        mp.setattr(op, "_router", lambda topk_ids: {"tile_expert": torch.zeros(1)})
        with pytest.raises(InputError, match=r"the router returned no \['tile_valid_rows', 'tile_tokens', "
                                             r"'tile_visit', 'sorted_token_ids'\]"):
            op(x, ids, w1)
    assert op.launches == 0
    with pytest.raises(InputError, match="tables: missing"):
        rs[0](torch.zeros(rs[0].kernel.buffer("h").type.shape, dtype=torch.float16), ids,
              torch.zeros(2 * MS, TOPK), torch.zeros(E, NR, K, dtype=torch.float16), {"tile_expert": None})
    with pytest.raises(InputError, match="argument 'h'"):
        rs[0](torch.zeros(1), ids, torch.zeros(2 * MS, TOPK), torch.zeros(1), None)
    h = torch.zeros(rs[0].kernel.buffer("h").type.shape, dtype=torch.float16)
    with pytest.raises(InputError, match="argument 'out'"):
        rs[0](h, ids, torch.zeros(2 * MS, TOPK), torch.zeros(E, NR, K, dtype=torch.float16), out=torch.zeros(1))
    assert rs[0].launches == 0 and rs[0]._router.calls == 0
    for op in ag + rs:
        op.close()
    for after_close in (lambda: ag[0].routing(ids), lambda: ag[0](x, ids, w1), ag[0].signal_counters):
        with pytest.raises(InputError, match="AllGatherMoE was closed"):
            after_close()
    assert ag[0]._router.calls == 0


def _one_notify_less(d):
    """Row tile 0 notifies one token tile less, and that tile counts one producer less: consistent
    counts, but a row the combine reads is then never waited for."""
    n = int(d["tile_num_token_tiles"][0])
    d["token_tile_producers"][int(d["tile_token_tiles"][0, n - 1])] -= 1
    d["tile_num_token_tiles"][0] = n - 1


def _set(name, index, value):
    """A mutation of one entry of one table (``value``: of the table)."""
    return name, lambda d: d[name].__setitem__(index, value(d[name]))


#: (table, a mutation of a correct routing, what the error says): each a way the kernels would hang,
#: race or store a routed row as zero, so each must be refused before anything is enqueued
BROKEN_TABLES = [
    (*_set("tile_visit", 1, lambda t: t[0]), "'tile_visit' is not a permutation"),
    (*_set("tile_expert", 0, lambda t: E), "'tile_expert' holds values outside"),
    (*_set("tile_expert", 0, lambda t: (t[0] + 1) % E), "in a tile of another expert"),
    (*_set("tile_valid_rows", 0, lambda t: 33), "'tile_valid_rows' holds values outside"),
    (*_set("tile_valid_rows", 0, lambda t: 0), "past its tile's valid rows"),
    (*_set("sorted_token_ids", 0, lambda t: 2 * MS), "'sorted_token_ids' holds values outside"),
    (*_set("sorted_token_ids", 0, lambda t: t[1]), "disagrees with 'token_pos'"),
    (*_set("tile_tokens", (0, 1), lambda t: 2 * MS + 1), "'tile_tokens' holds a range"),
    (*_set("tile_tokens", (0, 1), lambda t: t[0, 0]), "outside its 'tile_tokens' range"),
    (*_set("token_pos", 0, lambda t: -1), "'token_pos' holds values outside"),
    (*_set("token_pos", 1, lambda t: t[0]), "sends two routed rows to one row"),
    (*_set("token_tile_producers", 0, lambda t: t[0] + 1), "'token_tile_producers' is not the number"),
    (*_set("tile_num_token_tiles", 0, lambda t: 99), "'tile_num_token_tiles' holds values outside"),
    (*_set("tile_token_tiles", (0, 0), lambda t: 5), "names a token tile outside"),
    ("tile_num_token_tiles", _one_notify_less, "does not notify the token tile"),
]


@pytest.mark.parametrize("table,breaks,match", BROKEN_TABLES, ids=[f"{b[0]}:{b[2][:24]}" for b in BROKEN_TABLES])
def test_a_routing_the_library_did_not_build_is_checked_before_anything_is_enqueued(monkeypatch, table, breaks,
                                                                                     match):
    """A caller's router, or the tables handed to MoEReduceScatter: checked against the ids on the
    ids' device (one read back, as the ids' own check) before the op enqueues anything."""
    g, ag, rs = _layers(monkeypatch, 2, tl.CommSchedule(tile_m=16), tl.CommSchedule(tile_m=16, mode="push"))
    x, w1 = torch.zeros(MS, K, dtype=torch.float16), torch.zeros(E, K, NR, dtype=torch.float16)
    h, w2 = torch.zeros(rs[0].kernel.buffer("h").type.shape, dtype=torch.float16), torch.zeros(E, NR, K,
                                                                                                dtype=torch.float16)
    ids = torch.from_numpy(random_routing(np.random.default_rng(3), 2 * MS, E, TOPK)[0])
    good = HostRouter(2, 32)(ids)
    broken = {n: t.clone() for n, t in good.items()}
    breaks(broken)
    assert not torch.equal(broken[table], good[table])
    op = rs[0] if table in RS_TABLES and table not in AG_TABLES else ag[0]
    if op is ag[0]:
        monkeypatch.setattr(op, "_router", lambda topk_ids: broken)
        call = lambda: op(x, ids, w1)                                                # noqa: E731
    else:
        call = lambda: op(h, ids, torch.ones(2 * MS, TOPK), w2, broken)              # noqa: E731
    with pytest.raises(InputError, match=re.escape(match)):
        call()
    assert op.launches == 0 and not any(g.fake.queues.values())                     # nothing enqueued
    from tldsl.runtime.dist.moe_tables import check_routing_tables
    names = AG_TABLES if op is ag[0] else RS_TABLES
    check_routing_tables(good, names, ids, num_experts=E, block_m=32, num_tiles=op.num_tiles)   # the correct ones pass
    for o in ag + rs:
        o.close()


def test_a_routers_tables_are_held_to_the_ids_without_token_pos_and_tables_passed_check_the_ids(monkeypatch):
    """A router that returns AllGatherMoE's tables only (no ``token_pos``) is still held to the ids:
    every (token, expert) once among the valid rows. Tables handed to MoEReduceScatter check the ids
    they are checked against first (a CUDA graph capturing is refused, as for the ids alone)."""
    g, ag, rs = _layers(monkeypatch, 2, tl.CommSchedule(tile_m=16), tl.CommSchedule(tile_m=16, mode="push"))
    x, w1 = torch.zeros(MS, K, dtype=torch.float16), torch.zeros(E, K, NR, dtype=torch.float16)
    ids = torch.from_numpy(random_routing(np.random.default_rng(3), 2 * MS, E, TOPK)[0])
    good = HostRouter(2, 32)(ids)
    for broken in ({"tile_expert": lambda t: t.__setitem__(0, (t[0] + 1) % E)},
                   {"sorted_token_ids": lambda t: t.__setitem__(0, (t[0] + 1) % (2 * MS)),
                    "tile_tokens": lambda t: t.__setitem__((0, 1), 2 * MS)},
                   {"tile_valid_rows": lambda t: t.__setitem__(0, t[0] - 1)}):
        tables = {n: good[n].clone() for n in AG_TABLES}
        for n, fn in broken.items():
            fn(tables[n])
        monkeypatch.setattr(ag[0], "_router", lambda topk_ids, tables=tables: tables)
        with pytest.raises(InputError, match=r"do not hold each \(token, expert\) of topk_ids once"):
            ag[0](x, ids, w1)
    h, w2 = torch.zeros(rs[0].kernel.buffer("h").type.shape, dtype=torch.float16), torch.zeros(E, NR, K,
                                                                                                dtype=torch.float16)
    plain = dict(good)
    with pytest.raises(InputError, match="topk_ids: a torch tensor"):
        rs[0](h, ids.tolist(), torch.ones(2 * MS, TOPK), w2, plain)
    with pytest.raises(InputError, match=r"topk_ids must be \[48, 2\]"):
        rs[0](h, ids[:-1], torch.ones(2 * MS, TOPK), w2, plain)
    with monkeypatch.context() as mp:
        from tldsl.runtime.dist import call_order
        mp.setattr(call_order, "capturing", lambda: True)
        with pytest.raises(InputError, match="validate_ids=False to capture it"):
            rs[0](h, ids, torch.ones(2 * MS, TOPK), w2, plain)
    assert ag[0].launches == 0 and rs[0].launches == 0 and not any(g.fake.queues.values())
    for o in ag + rs:
        o.close()


def test_a_shard_written_into_the_ops_buffer_is_bound_in_place(monkeypatch):
    """``symmetric_buffer('x')``: the caller writes its shard into the op's own symmetric buffer
    and passes it — no copy into it before the launch nor back out after it — and the layer
    still agrees with numpy, launch after launch."""
    from test_run_fake_device import FakeDevice
    W = 2
    g, ag, rs = _layers(monkeypatch, W, default_gather(), tl.CommSchedule(tile_m=16, mode="push"))
    copies = []
    copy = FakeDevice.cuMemcpyAsync
    monkeypatch.setattr(FakeDevice, "cuMemcpyAsync", lambda self, dst, src, n, s: (copies.append((dst, src, n)),
                                                                                     copy(self, dst, src, n, s))[1])
    bufs = [op.symmetric_buffer("x") for op in ag]
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in bufs]
    rng = np.random.default_rng(5)
    w1 = [(rng.standard_normal((E, K, NR)) / 4).astype(np.float16) for _ in range(W)]
    w2 = [(rng.standard_normal((E, NR, K)) / 4).astype(np.float16) for _ in range(W)]
    for _ in range(2):
        xs = [rng.standard_normal((MS, K)).astype(np.float16) for _ in range(W)]
        ids, wts = random_routing(rng, W * MS, E, TOPK, "random")
        for r in range(W):          # (the fake GPU runs at synchronize: the previous launch is done)
            bufs[r].copy_(torch.from_numpy(xs[r]))
        outs = {}
        for r in g.fake.rng.sample(range(W), W):
            h, tables = ag[r](bufs[r], torch.from_numpy(ids), torch.from_numpy(w1[r]))
            outs[r] = (rs[r](h, torch.from_numpy(ids), torch.from_numpy(wts), torch.from_numpy(w2[r]), tables),
                       h, tables)
        for op in ag + rs:
            op.synchronize()
        want = reference_moe(xs, w1, w2, ids, wts)
        for r in range(W):
            np.testing.assert_allclose(host(outs[r][0]), want[r * MS:(r + 1) * MS], rtol=2e-2, atol=3e-2)
    assert copies and not any(lo <= d < hi for d, _, _ in copies for lo, hi in spans)    # nothing copied in
    with pytest.raises(InputError, match="'w1' is not a symmetric argument of allgather_moe"):
        ag[0].symmetric_buffer("w1")
    for op in ag + rs:
        op.close()
    with pytest.raises(Exception, match="closed"):
        ag[0].symmetric_buffer("x")


def test_a_tensor_overlapping_a_symmetric_buffer_without_being_it_is_found():
    from tldsl.runtime.dist.program_op import _overlaps_other
    base = torch.zeros(64)
    assert _overlaps_other(base[:32], base[16:48]) and _overlaps_other(base[16:48], base[:32])
    assert not _overlaps_other(base[:32], base[:32]) and not _overlaps_other(base[:32], base[32:])


def test_moe_reduce_scatter_with_fp32_partials_agrees_and_refuses_other_dtypes(monkeypatch):
    """``partial_dtype='f32'``: the partial (and the reduce-scatter's traffic) in fp32, the
    result within the same tolerance; any other value is an InputError before anything is built."""
    W = 2
    g = Group(monkeypatch, W, 3)
    w2s = tl.TensorSpec((E, NR, K), tl.float16)
    rs = g.build(lambda r, dev: MoEReduceScatter(w2s, MS, TOPK, compute=C32, comm=tl.CommSchedule(tile_m=16),
                                                 router=HostRouter(W, 32), device=dev, timeout_s=2.0,
                                                 partial_dtype="f32"))
    assert rs[0].partial_dtype == "f32" and rs[0].kernel.buffer("partial").type.dtype.name == "f32"
    rng = np.random.default_rng(5)
    ids, wts = random_routing(rng, W * MS, E, TOPK, "random")
    rt = moe_routing(ids, E, W, MS, 32)
    hs = [(rng.standard_normal((rt.num_rows, NR)) / 4).astype(np.float16) for _ in range(W)]
    w2 = [(rng.standard_normal((E, NR, K)) / 4).astype(np.float16) for _ in range(W)]
    tables = HostRouter(W, 32)(torch.from_numpy(ids))
    args = {r: (torch.from_numpy(hs[r]), torch.from_numpy(ids), torch.from_numpy(wts), torch.from_numpy(w2[r]), tables)
            for r in range(W)}           # alive until the fake GPU runs, at synchronize()
    outs = {r: rs[r](*args[r]) for r in g.fake.rng.sample(range(W), W)}
    for r in range(W):
        rs[r].synchronize()
    want = reference_moe_reduce_scatter(hs, w2, wts, rt)
    for r in range(W):
        np.testing.assert_allclose(host(outs[r]), want[r * MS:(r + 1) * MS], rtol=2e-2, atol=3e-2)
        rs[r].close()
    with pytest.raises(InputError, match="partial_dtype='bf16': choose 'out'"):
        g.build(lambda r, dev: MoEReduceScatter(w2s, MS, TOPK, compute=C32, device=dev, partial_dtype="bf16"))


def test_moe_reduce_scatter_runs_its_combine_after_the_grouped_gemm_unless_told_otherwise(monkeypatch):
    """By default the combine runs after the grouped GEMM, on its stream, with the SMs it leaves
    (``chain='after'``); beside it (``chain='beside'``) it runs behind the GEMM's tiles: under
    the work split it keeps a floor and the GEMM gets the rest, ``sm_split='even'`` halves them
    as before; anything else is an InputError on every rank before anything is allocated."""
    g = Group(monkeypatch, 1)
    big = dict(rows_per_rank=256, topk=TOPK, compute=C32, comm=tl.CommSchedule(tile_m=32, mode="push"))
    w2 = tl.TensorSpec((E, 1024, 256), tl.float16)
    after = g.build(lambda r, dev: MoEReduceScatter(w2, **big, device=dev))[0]
    got = {k.part: k for k in after.plan.kernels}
    assert got["combine"].after == "grouped_gemm" and got["combine"].stream == got["grouped_gemm"].stream
    assert got["grouped_gemm"].ctas + got["reduce_scatter"].ctas == after.plan.resident_ctas
    assert "after grouped_gemm" in after.describe() and f"{after.plan.streams} stream(s)" in after.describe()
    after.close()
    plans = {s: g.build(lambda r, dev: MoEReduceScatter(w2, **big, device=dev, sm_split=s, chain="beside"))[0]
             for s in ("work", "even")}
    ctas = {s: {k.part: k.ctas for k in op.plan.kernels} for s, op in plans.items()}
    assert ctas["work"]["combine"] < ctas["even"]["combine"] and ctas["work"]["grouped_gemm"] > ctas["even"]["grouped_gemm"]
    assert abs(ctas["even"]["combine"] - ctas["even"]["grouped_gemm"]) <= 1
    assert plans["work"].plan.split == "work" and "SMs shared by work" in plans["work"].describe()
    assert "SMs shared by even" in plans["even"].describe()
    for op in plans.values():
        op.close()
    with pytest.raises(InputError, match="split='half'"):
        g.build(lambda r, dev: MoEReduceScatter(w2, **big, device=dev, sm_split="half"))
    with pytest.raises(InputError, match="chain='overlap'"):
        g.build(lambda r, dev: MoEReduceScatter(w2, **big, device=dev, chain="overlap"))


def test_the_rows_are_staged_where_the_slice_is_wide():
    """AllGatherMoE's default: the routed rows gathered by a pass of their own from Nr = 4096
    columns of the rank's slice (measured: it lost at 768 and 1408, won at 8192 and 14336)."""
    from tldsl.ops.moe import STAGE_ROWS_MIN_N, stage_rows_pays
    assert STAGE_ROWS_MIN_N == 4096
    assert [stage_rows_pays(n) for n in (768, 1408, 4095, 4096, 8192, 14336)] == \
        [False, False, False, True, True, True]
    # across ranks the chained GEMM would wait for every peer's rows: not staged until measured there
    assert not any(stage_rows_pays(n, W) for n in (8192, 14336) for W in (2, 4, 8))


@pytest.mark.parametrize("W", [1, 2])
def test_the_op_stages_by_default_at_one_rank_only(monkeypatch, W):
    g = Group(monkeypatch, W, 0)
    wide = tl.TensorSpec((E, K, 4096), tl.float16)
    ag = g.build(lambda r, dev: AllGatherMoE(tl.TensorSpec((MS, K), tl.float16), wide, TOPK, compute=C32,
                                             router=HostRouter(W, 32), device=dev, timeout_s=2.0))
    assert all(op.stage_rows is (W == 1) for op in ag)
    assert ("gather_rows" in [p.name for p in ag[0].kernel.parts]) is (W == 1)
    forced = g.build(lambda r, dev: AllGatherMoE(tl.TensorSpec((MS, K), tl.float16), wide, TOPK, compute=C32,
                                                 router=HostRouter(W, 32), device=dev, timeout_s=2.0,
                                                 stage_rows=np.True_))        # asked for: staged at any W
    assert all(op.stage_rows is True for op in forced) and "gather_rows" in [p.name for p in forced[0].kernel.parts]
    for op in ag + forced:
        op.close()


@pytest.mark.parametrize("chain", ["after", "beside", "folded"])
def test_a_staged_gather_the_gemm_overlaps_visits_the_tiles_in_layout_order(monkeypatch, chain):
    """AllGatherMoE with its rows staged: run before the grouped GEMM (``chain="after"``, the
    default) the gather visits the row tiles by tokens (the routing's ``tile_visit``); where the
    GEMM overlaps it and takes tiles as they complete ("beside", "folded"), in layout order. The
    same ``h`` either way."""
    from tldsl.ops.moe import reference_allgather_moe
    from tldsl.runtime.dist import program_op
    g = Group(monkeypatch, 1, 0)
    c8 = tl.ComputeSchedule(tile=(8, 32, 32))           # 8-row tiles: two or more an expert, so the orders differ
    ag = g.build(lambda r, dev: AllGatherMoE(tl.TensorSpec((MS, K), tl.float16), tl.TensorSpec((E, K, NR), tl.float16),
                                             TOPK, compute=c8, router=HostRouter(1, 8), device=dev, timeout_s=2.0,
                                             stage_rows=True, chain=chain))
    seen = []
    real = program_op.FusedProgram.__call__

    def spy(self, *args, **kw):
        seen.append(kw["tile_visit"].clone())
        return real(self, *args, **kw)
    monkeypatch.setattr(program_op.FusedProgram, "__call__", spy)
    rng = np.random.default_rng(5)
    ids, _ = random_routing(rng, MS, E, TOPK)
    x = rng.standard_normal((MS, K)).astype(np.float16)
    w1 = (rng.standard_normal((E, K, NR)) / 4).astype(np.float16)
    h, tables = ag[0](torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w1))
    ag[0].synchronize()
    rt = moe_routing(ids, E, 1, MS, 8)
    np.testing.assert_allclose(host(h), reference_allgather_moe([x], w1, rt), rtol=2e-2, atol=3e-2)
    layout = list(range(rt.num_tiles))
    assert host(tables["tile_visit"]).tolist() == rt.tile_visit.tolist() != layout      # what the router built
    assert host(seen[0]).tolist() == (rt.tile_visit.tolist() if chain == "after" else layout)
    ag[0].close()


def test_tables_that_are_no_dict_are_refused_before_anything_is_enqueued(monkeypatch):
    """Found by an explorer's round: MoEReduceScatter(...)(..., tables=<a MoERouting>) raised an
    untyped TypeError ('argument of type MoERouting is not iterable'), and AllGatherMoE trusted its
    router's return alike. Both now say what the tables must be (a dict by name) with InputError."""
    g, ag, rs = _layers(monkeypatch, 2, tl.CommSchedule(tile_m=16), tl.CommSchedule(tile_m=16, mode="push"))
    x, w1 = torch.zeros(MS, K, dtype=torch.float16), torch.zeros(E, K, NR, dtype=torch.float16)
    h, w2 = torch.zeros(rs[0].kernel.buffer("h").type.shape, dtype=torch.float16), torch.zeros(E, NR, K,
                                                                                                dtype=torch.float16)
    ids = torch.from_numpy(random_routing(np.random.default_rng(3), 2 * MS, E, TOPK)[0])
    rt = moe_routing(ids.numpy(), E, 2, MS, 32)
    for tables in (rt, [rt.token_pos], "tables"):
        with pytest.raises(InputError, match=r"tables: pass what AllGatherMoE returned .*a dict.* got "
                                             + type(tables).__name__):
            rs[0](h, ids, torch.ones(2 * MS, TOPK), w2, tables)
    for returned in (rt, None, [1, 2]):
        monkeypatch.setattr(ag[0], "_router", lambda topk_ids, returned=returned: returned)
        with pytest.raises(InputError, match=r"router\(topk_ids\) must return the routing tables by name .*got "
                                             + type(returned).__name__):
            ag[0](x, ids, w1)
    assert ag[0].launches == 0 and rs[0].launches == 0 and not any(g.fake.queues.values())
    for o in ag + rs:
        o.close()


def test_check_routing_refuses_a_malformed_error_word(monkeypatch):
    """Found by an explorer's round: check_routing crashed with AttributeError / ValueError /
    TypeError on an 'info' entry that is not the routing's error word (3 ints)."""
    g, ag, rs = _layers(monkeypatch, 1, tl.CommSchedule(tile_m=16), tl.CommSchedule(tile_m=16, mode="push"))
    op = ag[0]
    for info in ([0, 1, 3], torch.tensor([0]), np.array([0, 1]), type(None), torch.zeros(3), np.zeros((1, 3), int)):
        with pytest.raises(InputError, match=r"check_routing: tables\['info'\] must be the routing's error word"):
            op.check_routing({"info": info})
    op.check_routing({"info": torch.zeros(3, dtype=torch.int32)})              # no error flagged: passes
    op.check_routing({"info": np.zeros(3, np.int64)})
    with pytest.raises(InputError, match=r"topk_ids\[2, 1\] was not an expert id"):
        op.check_routing({"info": torch.tensor([0, 1, 2 * TOPK + 1], dtype=torch.int32)})
    for o in ag + rs:
        o.close()


def test_a_callers_router_is_not_held_to_the_gpu_builders_limits(monkeypatch):
    """Found by an explorer's round: AllGatherMoE(..., router=<callable>) with 3000 experts was refused
    with the GPU routing kernels' limit (at most 2048 experts: their shared memory), which a caller's
    router never runs. The builder's limits hold where the builder is used (no router); the op's own
    sizes still hold either way."""
    from tldsl.runtime.dist.moe_tables import table_shapes
    from tldsl.runtime.gpu.moe_routing import RoutingSizes
    g = Group(monkeypatch, 1, 0)
    many = tl.TensorSpec((3000, 16, 16), tl.float16)
    c16 = tl.ComputeSchedule(tile=(16, 16, 16))
    ops = g.build(lambda r, dev: AllGatherMoE(tl.TensorSpec((8, 16), tl.float16), many, 2, compute=c16, device=dev,
                                              router=lambda ids: {}, timeout_s=2.0))
    assert ops[0].num_experts == 3000
    for o in ops:
        o.close()
    with pytest.raises(InputError, match="moe routing on the GPU: at most 2048 experts, got 3000"):
        g.build(lambda r, dev: AllGatherMoE(tl.TensorSpec((8, 16), tl.float16), many, 2, compute=c16, device=dev))
    with pytest.raises(InputError, match="num_experts must be a positive int"):
        g.build(lambda r, dev: AllGatherMoE(tl.TensorSpec((8, 16), tl.float16), tl.TensorSpec((0, 16, 16), tl.float16),
                                            2, compute=c16, device=dev, router=lambda ids: {}))
    for W, Ms, topk, n_e, BM in ((1, 8, 2, 3000, 16), (2, 24, 2, 4, 32), (3, 100, 8, 64, 128), (1, 1, 1, 1, 16)):
        sizes = RoutingSizes(W, Ms, topk, min(n_e, 2048), BM)
        want = {n: s for n, s in sizes.shapes().items() if n in AG_TABLES + RS_TABLES}
        got = table_shapes(W * Ms, topk, sizes.num_experts, BM, sizes.num_tiles)
        assert {n: got[n] for n in want} == want              # the specs a router's tables are held to


@pytest.mark.parametrize("W", [1, 2])
def test_a_moe_layer_of_linear_weights_agrees_with_the_same_layer_of_transposed_ones(monkeypatch, W):
    """``weights="nk"``: the experts' matrices stored as torch Linear weights ([E, N, K]); the same
    layer as numpy's on the transposed weights, and shapes of the other layout refused up front."""
    rng = np.random.default_rng(40 + W)
    g = Group(monkeypatch, W, 5)
    x = tl.TensorSpec((MS, K), tl.float16)
    ag = g.build(lambda r, dev: AllGatherMoE(x, tl.TensorSpec((E, NR, K), tl.float16), TOPK, compute=C32,
                                             comm=tl.CommSchedule(tile_m=16, mode="pull"), router=HostRouter(W, 32),
                                             device=dev, timeout_s=2.0, weights="nk"))
    rs = g.build(lambda r, dev: MoEReduceScatter(tl.TensorSpec((E, K, NR), tl.float16), MS, TOPK, compute=C32,
                                                 comm=tl.CommSchedule(tile_m=16, mode="push"),
                                                 router=HostRouter(W, 32), device=dev, timeout_s=2.0, weights="nk"))
    xs = [rng.standard_normal((MS, K)).astype(np.float16) for _ in range(W)]
    w1 = [(rng.standard_normal((E, K, NR)) / 4).astype(np.float16) for _ in range(W)]
    w2 = [(rng.standard_normal((E, NR, K)) / 4).astype(np.float16) for _ in range(W)]
    w1_nk = [np.ascontiguousarray(w.transpose(0, 2, 1)) for w in w1]      # alive until the fake GPU runs
    w2_nk = [np.ascontiguousarray(w.transpose(0, 2, 1)) for w in w2]
    ids, wts = random_routing(rng, W * MS, E, TOPK, "random")
    outs, alive = {}, []
    for r in g.fake.rng.sample(range(W), W):
        h, tables = ag[r](torch.from_numpy(xs[r]), torch.from_numpy(ids), torch.from_numpy(w1_nk[r]))
        outs[r] = rs[r](h, torch.from_numpy(ids), torch.from_numpy(wts), torch.from_numpy(w2_nk[r]), tables)
        alive.append((h, tables))
    for r in range(W):
        ag[r].synchronize()
        rs[r].synchronize()
    want = reference_moe(xs, w1, w2, ids, wts)
    for r in range(W):
        np.testing.assert_allclose(host(outs[r]), want[r * MS:(r + 1) * MS], rtol=2e-2, atol=3e-2)
    for op in ag + rs:
        op.close()
    with pytest.raises(tl.InputError, match=r"w1 must be \[E, Nr, K=32\] \(weights='nk'\)"):
        AllGatherMoE(x, tl.TensorSpec((E, NR, K + 8), tl.float16), TOPK, weights="nk")
    for bad in ("t", np.array(["nk", "kn"]), None):
        with pytest.raises(tl.InputError, match="weights must be one of"):
            MoEReduceScatter(tl.TensorSpec((E, NR, K), tl.float16), MS, TOPK, weights=bad)
