"""The sequential baselines of ``tldsl.bench baselines`` compute the layers our fused ops compute:
two gloo ranks on the CPU run each baseline (all-gather / reduce-scatter through
torch.distributed, ``torch._grouped_mm``, SDPA) against numpy references written from the
layers' definitions, for every routing kind and both attention layouts."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.multiprocessing as mp  # noqa: E402

from tldsl.bench import baselines  # noqa: E402

W, T, K, N, E, TOPK = 2, 12, 16, 8, 5, 2
S, HQ, HKV, D = 8, 4, 2, 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, K, generator=g)
    w1 = [torch.randn(E, K, N, generator=g) for _ in range(W)]
    w2 = [torch.randn(E, N, K, generator=g) for _ in range(W)]
    q = torch.randn(W * S, HQ, D, generator=g)
    k = torch.randn(W * S, HKV, D, generator=g)
    v = torch.randn(W * S, HKV, D, generator=g)
    return x, w1, w2, q, k, v


def _rows(layout, rank):
    if layout == "contiguous":
        return np.arange(rank * S, (rank + 1) * S)
    (a, b), (c, d) = baselines.zigzag_positions(rank, W, S)
    return np.concatenate([np.arange(a, b), np.arange(c, d)])


def _rank(rank, path):
    import torch.distributed as dist
    # the ranks meet through a file, not a TCP port another pytest worker could take meanwhile
    dist.init_process_group("gloo", init_method=f"file://{path}/rendezvous", rank=rank, world_size=W)
    x, w1, w2, q, k, v = _inputs()
    out = {}
    for kind in baselines.ROUTINGS:
        ids, wts = baselines.random_topk(T, E, TOPK, kind, device="cpu", seed=3)
        h = baselines.ag_moe(x[rank * T // W:(rank + 1) * T // W], ids, w1[rank])
        out[kind] = dict(ids=ids, wts=wts, h=h, y=baselines.moe_rs(h, ids, wts, w2[rank]))
    for layout in baselines.LAYOUTS:
        rows = torch.as_tensor(_rows(layout, rank))
        for causal in (False, True):
            for heads in (HQ, HKV):            # MHA (K/V with every query head), GQA
                kk, vv = (torch.cat([t, t], 1)[rows] if heads == HQ else t[rows] for t in (k, v))
                out[layout, causal, heads] = baselines.sp_attention(q[rows], kk, vv, causal=causal, layout=layout)
    torch.save(out, f"{path}/rank{rank}.pt")
    dist.destroy_process_group()


def _attention(q, k, v, causal):
    """numpy: softmax attention of every global query over every key (GQA: a K/V head per
    ``HQ // Hkv`` query heads), the causal mask on global positions."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[2])
    if causal:
        s = np.where(np.arange(s.shape[2])[None, None, :] <= np.arange(s.shape[1])[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(axis=2, keepdims=True))
    p /= p.sum(axis=2, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every rank's baselines: one spawn of two gloo ranks for all the checks below."""
    path = tmp_path_factory.mktemp("baselines")
    mp.start_processes(_rank, args=(str(path),), nprocs=W, start_method="spawn")
    return [torch.load(path / f"rank{r}.pt", weights_only=False) for r in range(W)]


@pytest.mark.parametrize("kind", baselines.ROUTINGS)
def test_the_moe_baselines_compute_the_layers(results, kind):
    res = [r[kind] for r in results]
    x, w1, w2 = _inputs()[:3]
    x = x.numpy()
    ids, wts = res[0]["ids"].numpy(), res[0]["wts"].numpy()
    assert ids.shape == (T, TOPK) and np.allclose(wts.sum(1), 1) and ((ids >= 0) & (ids < E)).all()
    if kind == "one":
        assert (ids == ids[0]).all()
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    y_all = 0
    for r in range(W):
        # AllGather+MoE: routed row i (expert-sorted) = token order[i] // k times its expert's w1 slice
        want_h = np.stack([x[t // TOPK] @ w1[r][flat[t]].numpy() for t in order])
        np.testing.assert_allclose(res[r]["h"].numpy(), want_h, rtol=1e-4, atol=1e-4)
        y_all = y_all + np.stack([sum(wts[t, j] * want_h[np.where(order == t * TOPK + j)[0][0]] @ w2[r][ids[t, j]].numpy()
                                      for j in range(TOPK)) for t in range(T)])
    for r in range(W):          # MoE+ReduceScatter: this rank's tokens, summed over the ranks' slices
        np.testing.assert_allclose(res[r]["y"].numpy(), y_all[r * T // W:(r + 1) * T // W], rtol=1e-4, atol=1e-3)


def test_the_attention_baseline_computes_the_layer(results):
    q, k, v = (t.numpy() for t in _inputs()[3:])
    res = results
    assert len([key for key in res[0] if isinstance(key, tuple)]) == 8      # 2 layouts x causal x MHA/GQA
    for (layout, causal, heads) in (key for key in res[0] if isinstance(key, tuple)):
        kk, vv = (np.concatenate([t, t], 1) if heads == HQ else t for t in (k, v))
        want = _attention(q, kk, vv, causal)
        for r in range(W):
            np.testing.assert_allclose(res[r][layout, causal, heads].numpy(), want[_rows(layout, r)],
                                       rtol=1e-4, atol=1e-5, err_msg=f"{layout} causal={causal} heads={heads}")


def test_bad_arguments_are_refused_in_one_line():
    with pytest.raises(SystemExit):
        baselines.parse_args(["sp_attention", "--layout", "diagonal"])
    with pytest.raises(SystemExit):
        baselines.parse_args(["ag_moe", "--models", "mixtral:lots:random"])
    with pytest.raises(ValueError, match="rows per rank must be even"):
        baselines.zigzag_positions(0, 2, 7)
    with pytest.raises(ValueError, match="routing: one of"):
        baselines.random_topk(4, 4, 2, "uniform", device="cpu")
    args = baselines.parse_args(["moe_rs", "--models", "qwen3:8192:zipf"])
    assert args.rows == [baselines.MoERow("qwen3", 8192, "zipf")]
    rows = baselines.parse_args(["ag_moe"]).rows        # the rows, as the benchmark's row objects
    assert [(r.model, r.tokens, r.routing) for r in rows] == [tuple(r) for r in baselines.MOE_ROWS]
    assert all(isinstance(r, baselines.MoERow) for r in rows)


def test_the_sm_splits_to_time_are_parsed_and_checked():
    from tldsl.runtime.gpu.run_plan import CHAINS
    from tldsl.runtime.gpu.sm_split import SPLITS
    assert set(baselines.SM_SPLITS) == set(SPLITS) | {f"{s}/{c}" for s in SPLITS for c in CHAINS}
    assert baselines.parse_args(["moe_rs", "--fused"]).sm_splits == ("work",)
    assert baselines.parse_args(["moe_rs", "--fused", "--sm-split", "work,even,work"]).sm_splits == ("work", "even")
    assert baselines.parse_args(["moe_rs", "--fused", "--sm-split", "work,work/beside"]).sm_splits == \
        ("work", "work/beside")
    # each variant is the op's keyword arguments: the split, and the chain where one is asked for
    assert baselines._layout_kw("work") == {"sm_split": "work"}             # the op's own choice
    assert baselines._layout_kw("work/after") == {"sm_split": "work", "chain": "after"}
    assert baselines._layout_kw("even/beside") == {"sm_split": "even", "chain": "beside"}
    assert {baselines._layout_kw(v).get("chain") for v in baselines.SM_SPLITS} == set(CHAINS) | {None}
    for bad in ("fair", "work,", "", "work/overlap"):
        with pytest.raises(SystemExit):
            baselines.parse_args(["moe_rs", "--fused", "--sm-split", bad])


def test_the_partials_to_time_are_parsed_and_checked(capsys):
    """``--partial``: MoEReduceScatter's partial dtypes, one op each (the op's default, ``out``, alone
    unless asked); refused where the layer has no partial."""
    import inspect
    from tldsl.runtime.dist.moe_ops import MoEReduceScatter
    default = inspect.signature(MoEReduceScatter).parameters["partial_dtype"].default
    assert baselines.parse_args(["moe_rs", "--fused"]).partials == (default,) == ("out",)
    assert baselines.parse_args(["moe_rs", "--fused", "--partial", "out,f32,out"]).partials == ("out", "f32")
    assert baselines.parse_args(["ag_moe", "--fused"]).partials == ("out",)
    for argv, why in ((["moe_rs", "--partial", "bf16"], "--partial: out, f32 or both"),
                      (["moe_rs", "--partial", ""], "--partial: out, f32 or both"),
                      (["ag_moe", "--partial", "f32"], "ag_moe has none")):
        with pytest.raises(SystemExit):
            baselines.parse_args(argv)
        assert why in capsys.readouterr().err


def test_the_comm_schedules_to_time_are_parsed_and_checked(capsys):
    """``--comm`` (sp_attention): one SequenceParallelAttention per way of gathering K and V —
    ``default`` is the op's own (None: its DEFAULT_COMM), the others named schedules; refused
    in one line where malformed or where the layer is an MoE one."""
    import tldsl as tl
    assert baselines.parse_args(["sp_attention", "--fused"]).comms == ("default",)
    args = baselines.parse_args(["sp_attention", "--fused", "--comm", "default,copy_engine/pull,sm/128x8,default"])
    assert args.comms == ("default", "copy_engine/pull", "sm/128x8")
    assert baselines.comm_schedule("default") is None
    assert baselines.comm_schedule("copy_engine/push") == tl.CommSchedule(engine="copy_engine", mode="push")
    assert baselines.comm_schedule("copy_engine/pull") == tl.CommSchedule(engine="copy_engine", mode="pull")
    assert baselines.comm_schedule("sm/128x8") == tl.CommSchedule(tile_m=128, sms=8)
    assert baselines.comm_schedule("sm/shardx2/push") == tl.CommSchedule(sms=2, mode="push")
    for bad in ("sm/128", "sm/ax8", "sm/128x0", "copy_engine", "copy_engine/ring", "nccl", "sm/128x8/mesh"):
        with pytest.raises(ValueError, match="--comm"):
            baselines.comm_schedule(bad)
        with pytest.raises(SystemExit):
            baselines.parse_args(["sp_attention", "--fused", "--comm", bad])
        assert "--comm" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        baselines.parse_args(["ag_moe", "--fused", "--comm", "sm/128x8"])
    assert "not taken by ag_moe" in capsys.readouterr().err


def test_the_attention_op_is_built_with_the_comm_schedule_asked_for(monkeypatch):
    """fused_layers.sp_attention_op passes a ``--comm`` schedule to the op, and nothing (the op's
    default) for ``default``."""
    import tldsl as tl
    from tldsl.bench import fused_layers
    import tldsl.runtime.dist as dist_pkg
    built = []

    class Op:
        def __init__(self, q, k, heads, **kw):
            built.append(kw)

        def __call__(self, q, k, v):
            return q

        def close(self):
            pass

    monkeypatch.setattr(dist_pkg, "SequenceParallelAttention", Op)
    q = torch.ones(4, 2, 8)
    for spec in ("default", "sm/64x4"):
        fused_layers.sp_attention_op(q, q, q, causal=False, layout="contiguous", reference=q,
                                     comm=baselines.comm_schedule(spec))
    assert "comm" not in built[0] and built[1]["comm"] == tl.CommSchedule(tile_m=64, sms=4)


def test_the_timeline_needs_the_fused_op_and_prints_host_times(monkeypatch, capsys):
    """``--timeline`` is refused without ``--fused`` (there is no fused op to mark); with it, each
    op's one extra call is marked and every rank prints its phases with the host's enqueue times."""
    import io
    import torch.distributed as dist
    import tldsl.runtime.dist.timeline as timeline
    from tldsl.bench import dist as bench_dist
    with pytest.raises(SystemExit):
        baselines.parse_args(["ag_moe", "--timeline"])
    assert "add --fused" in capsys.readouterr().err
    assert baselines.parse_args(["sp_attention", "--fused", "--timeline"]).timeline

    class Marks:
        def __init__(self):
            self.marks = []

        def phases(self):
            return list(self.marks)

        def format(self, prefix, host=False):
            return prefix + ", ".join(f"{m} (host {host})" for m in self.marks)

    class Op:
        timeline = None

    op = Op()
    monkeypatch.setattr(timeline, "PhaseTimeline", Marks)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", lambda dst, obj: dst.__setitem__(slice(None), [obj, obj]))
    out = io.StringIO()
    every = bench_dist.mark_phases(op, lambda: op.timeline.marks.append("gemm done"), "row", out=out, host=True)
    assert out.getvalue() == "# [rank 1] row phases: gemm done (host True)\n"
    assert every == [["gemm done"], ["gemm done"]] and op.timeline is None
