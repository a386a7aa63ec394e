"""Where a compute part that waits only on another compute part of its rank runs
(runtime/gpu/run_plan.py, ``chain``), without a GPU: after its producer on the producer's
stream with the SMs it leaves (the default: an MoE combine can start a token tile only once
every GEMM tile holding its tokens is done, which with a dynamic mapping is where the GEMM's
last wave may be), or beside it with a share of the SMs (``chain="beside"``, the layout
before), or folded into the producer's kernel (``chain="folded"``: a combine behind its grouped
GEMM). Parts that cannot wait behind their producer stay beside it: one its producer waits on
(directly or through another part), one waiting on a communication part or on two producers,
one whose tasks wait for each other."""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl
from tldsl.errors import InputError
from tldsl.ops.moe import moe_routing, random_routing
from tldsl.runtime.gpu.run_errors import UnboundParameterError
from tldsl.runtime.gpu.run_plan import CHAINS, chained_parts, lower_for_run, plan_run

from test_run_plan import H200_SMS, ag_gemm
from test_run_plan_split import chain_program, moe_rs_program

S, F32 = tl.TensorSpec, tl.float32


def _kernels(k):
    return {p.name for p in k.parts}


def test_the_moe_combine_runs_after_its_grouped_gemm_with_the_sms_it_leaves():
    k = moe_rs_program()
    assert chained_parts(k, _kernels(k)) == {"combine": "grouped_gemm"}
    plan = plan_run(k, lower_for_run(k), sm_count=H200_SMS)
    got = {x.part: x for x in plan.kernels}
    rs, gemm, combine = got["reduce_scatter"], got["grouped_gemm"], got["combine"]
    # the GEMM no longer shares with the combine: every SM but the reduce-scatter's lane
    assert (rs.ctas, gemm.ctas) == (1, 131) and gemm.after is None
    assert combine.after == "grouped_gemm" and combine.stream == gemm.stream != rs.stream
    assert combine.ctas == min(131, combine.lowered.grid(1 << 30)[0])
    assert [x.part for x in plan.items] == ["reduce_scatter", "grouped_gemm", "combine"]   # enqueued after it
    assert plan.streams == 2 and plan.resident_ctas == 132
    assert "combine: kernel" in plan.describe() and "after grouped_gemm" in plan.describe()


def test_a_chained_part_gets_its_producers_grant_not_its_producers_grid():
    """AllGather+MoE with its rows staged: a short row gather (few tasks: few CTAs) before a wide
    grouped GEMM (many tiles). The GEMM runs after the gather with the SMs the gather was granted,
    not only as many as the gather had tasks for."""
    rng = np.random.default_rng(0)
    W, Ms, K, Nr, E, topk = 1, 128, 2048, 8192, 8, 2
    ids, _ = random_routing(rng, W * Ms, E, topk)
    rt = moe_routing(ids, E, W, Ms, 128)
    k = rt.trace_allgather_moe(W, Ms, K, Nr, E, tl.bfloat16, stage_rows=True,
                               compute=tl.ComputeSchedule(tile=(128, 256, 64), stages=4, cluster=(2, 1)),
                               comm=tl.CommSchedule(tile_m=128, mode="pull"))
    assert chained_parts(k, _kernels(k)) == {"grouped_gemm": "gather_rows"}
    plan = plan_run(k, lower_for_run(k), sm_count=H200_SMS)
    got = {x.part: x for x in plan.kernels}
    gather, gemm = got["gather_rows"], got["grouped_gemm"]
    tiles = gemm.lowered.grid(1 << 30)[0]
    assert gather.ctas < 100 < tiles                   # the gather has fewer tasks than the GEMM has tiles
    assert gemm.after == "gather_rows" and gemm.stream == gather.stream
    assert gemm.ctas == min(tiles, (H200_SMS - got["gather_x"].ctas) // 2 * 2)   # clusters of two
    assert plan.resident_ctas <= H200_SMS


def test_beside_keeps_the_shared_layout():
    k = moe_rs_program()
    plan = plan_run(k, lower_for_run(k, chain="beside"), sm_count=H200_SMS, chain="beside")
    assert {x.part: (x.ctas, x.after) for x in plan.kernels} == {
        "reduce_scatter": (1, None), "grouped_gemm": (123, None), "combine": (8, None)}
    assert plan.streams == 3 and plan.resident_ctas == 132


def test_every_rank_on_one_gpu_chains_its_own_parts():
    rng = np.random.default_rng(1)
    ids, wts = random_routing(rng, 4 * 64, 8, 2)
    rt = moe_routing(ids, 8, 4, 64, 64)
    k = rt.trace_moe_reduce_scatter(4, 64, 128, 256, 8, wts, tl.bfloat16, compute=tl.ComputeSchedule(tile=(64, 128, 64)),
                                    comm=tl.CommSchedule(tile_m=64, order="ring", mode="push"))
    plan = plan_run(k, lower_for_run(k), sm_count=H200_SMS)
    for r in range(4):
        mine = {x.part: x for x in plan.kernels if x.rank == r}
        assert mine["combine"].after == "grouped_gemm" and mine["combine"].stream == mine["grouped_gemm"].stream
    assert plan.streams == 8 and len({x.stream for x in plan.kernels if x.part == "grouped_gemm"}) == 4
    assert plan.resident_ctas <= H200_SMS


@tl.kernel
def ping_pong(x, y, z, *, compute: tl.ComputeSchedule = None):
    """Two compute parts in a pipeline both ways: ``second`` waits on ``first``'s tile t, and
    ``first``'s tile t on ``second``'s tile t - 1 — ``second`` cannot wait until ``first`` is done."""
    a_done = tl.signal("a_done", 4)
    b_done = tl.signal("b_done", 4)

    @tl.compute_part(grid=(4,))
    def first(t):
        with tl.when(t > 0):
            tl.consumer_tile_wait(b_done, t - 1)
        tl.store(y, (t * 8,), tl.load(x, (t * 8,), (8,)) + 1.0)
        tl.producer_tile_notify(a_done, t)

    @tl.compute_part(grid=(4,))
    def second(t):
        tl.consumer_tile_wait(a_done, t)
        tl.store(z, (t * 8,), tl.load(y, (t * 8,), (8,)) * 2.0)
        tl.producer_tile_notify(b_done, t)


def test_a_part_its_producer_waits_on_stays_beside_it():
    k = ping_pong.trace(1, S((32,), F32), S((32,), F32), S((32,), F32), compute=tl.ComputeSchedule(tile=(8, 8, 8)))
    res = tl.simulate(k, 1, [dict(x=np.arange(32, dtype=np.float32), y=np.zeros(32, np.float32),
                                  z=np.zeros(32, np.float32))])
    np.testing.assert_array_equal(res[0]["z"], (np.arange(32) + 1.0) * 2.0)      # a valid program
    assert chained_parts(k, _kernels(k)) == {}
    plan = plan_run(k, lower_for_run(k), sm_count=H200_SMS)
    assert all(x.after is None for x in plan.kernels) and plan.streams == 2


def test_parts_waiting_on_communication_or_on_their_own_tasks_stay_beside():
    k = ag_gemm()                          # the GEMM waits on the all-gather (a communication part)
    assert chained_parts(k, _kernels(k)) == {}
    k = chain_program()                    # 'chain' waits on its own tasks, not on the GEMM
    assert chained_parts(k, _kernels(k)) == {}


def test_folded_the_combine_runs_inside_its_grouped_gemms_kernel():
    """``chain="folded"``: the combine lowered into the grouped GEMM's kernel (its producer's
    spare warps), no launch of its own; the GEMM keeps every SM the reduce-scatter leaves, and
    binds the combine's parameters too."""
    from tldsl.runtime.gpu.bind import check_bindings
    from tldsl.runtime.gpu.fold import FoldedPart
    k = moe_rs_program()
    lowered = lower_for_run(k, chain="folded")
    assert lowered["combine"] == FoldedPart("combine", "grouped_gemm")
    assert lowered["grouped_gemm"].side == "combine"
    assert lower_for_run(k)["grouped_gemm"].side is None               # after: two kernels, as before
    check_bindings(k, lowered)
    plan = plan_run(k, lowered, sm_count=H200_SMS, chain="folded")
    got = {x.part: x for x in plan.kernels}
    assert set(got) == {"reduce_scatter", "grouped_gemm"} and got["grouped_gemm"].ctas == 131
    assert plan.streams == 2 and plan.resident_ctas == 132
    names = {p.name for p in got["grouped_gemm"].lowered.params}
    assert {"out_partial", "ptr_y_sorted", "tbl_token_pos", "sig_reduce_scatter_ready"} <= names


def _staged_ag(W=1, Ms=128):
    rng = np.random.default_rng(0)
    ids, _ = random_routing(rng, W * Ms, 8, 2)
    rt = moe_routing(ids, 8, W, Ms, 128)
    return rt.trace_allgather_moe(W, Ms, 2048, 8192, 8, tl.bfloat16, stage_rows=True,
                                  compute=tl.ComputeSchedule(tile=(128, 256, 64), stages=4, cluster=(2, 1)),
                                  comm=tl.CommSchedule(tile_m=128, mode="pull"))


def test_folded_the_row_gather_runs_inside_the_grouped_gemm_it_feeds():
    """A staged AllGather+MoE: the GEMM is chained after the row gather that stages its A; folded,
    the gather runs on the GEMM kernel's spare producer warps (the GEMM hosts it though it is the
    one chained), no launch of its own, and the GEMM waits on nothing but its signals."""
    from tldsl.runtime.gpu.bind import check_bindings
    from tldsl.runtime.gpu.fold import FoldedPart
    k = _staged_ag()
    assert chained_parts(k, _kernels(k)) == {"grouped_gemm": "gather_rows"}
    lowered = lower_for_run(k, chain="folded")
    assert lowered["gather_rows"] == FoldedPart("gather_rows", "grouped_gemm")
    assert lowered["grouped_gemm"].side == "gather_rows"
    check_bindings(k, lowered)
    plan = plan_run(k, lowered, sm_count=H200_SMS, chain="folded")
    got = {x.part: x for x in plan.kernels}
    assert "gather_rows" not in got and got["grouped_gemm"].after is None
    assert plan.resident_ctas <= H200_SMS
    # the schedule's clusters of two dropped: the folded grid must all be resident, single CTAs
    assert lowered["grouped_gemm"].cluster_dims == (1, 1, 1)
    assert lower_for_run(k)["grouped_gemm"].cluster_dims == (2, 1, 1)
    assert lower_for_run(k, chain="folded", cluster=(2, 1))["grouped_gemm"].cluster_dims == (1, 1, 1)
    assert "folded in: row-gather part 'gather_rows'" in got["grouped_gemm"].lowered.describe()


def test_folded_leaves_a_pair_the_recipe_refuses_chained(monkeypatch):
    """Where the grouped GEMM's recipe refuses the fold, the pair stays two kernels, the chained
    one after the other, as with ``chain="after"``."""
    import tldsl.codegen as codegen
    from tldsl.codegen.errors import LoweringError
    real = codegen.lower

    def refusing(kernel, part, side=None, **opts):
        if side is not None:
            raise LoweringError(f"side={side!r}: refused (test)")
        return real(kernel, part, **opts)
    monkeypatch.setattr(codegen, "lower", refusing)
    for k, (part, producer) in ((_staged_ag(), ("grouped_gemm", "gather_rows")),
                                (moe_rs_program(), ("combine", "grouped_gemm"))):
        lowered = lower_for_run(k, chain="folded")
        assert all(getattr(lk, "side", None) is None for lk in lowered.values())
        plan = plan_run(k, lowered, sm_count=H200_SMS, chain="folded")
        assert {x.part: x.after for x in plan.kernels}[part] == producer


def test_an_unknown_chain_is_refused_before_anything_is_planned():
    assert CHAINS == ("after", "beside", "folded")
    k = moe_rs_program()
    with pytest.raises(InputError, match="chain='overlap'"):
        plan_run(k, lower_for_run(k), sm_count=H200_SMS, chain="overlap")


def test_lowering_option_side_is_refused_tl_run_folds_itself():
    """``side=`` by hand would run the combine in the GEMM's kernel and in its own as well."""
    with pytest.raises(UnboundParameterError, match="chain='folded'"):
        lower_for_run(moe_rs_program(), side="combine")


def test_a_producer_hosts_at_most_one_folded_part(monkeypatch):
    """Two parts chained behind one grouped GEMM: the first folds into its kernel, the second
    stays a kernel of its own (chained after it), never a second ``side=`` lowering that would
    replace the first."""
    from types import SimpleNamespace

    import tldsl.codegen
    from tldsl.runtime.gpu import fold
    from tldsl.runtime.gpu.fold import FoldedPart
    k = moe_rs_program()
    lowered = lower_for_run(k)
    lowered = dict(lowered, combine_again=lowered["combine"])
    monkeypatch.setattr(fold, "chained_parts", lambda kernel, kernels: {"combine": "grouped_gemm",
                                                                        "combine_again": "grouped_gemm"})
    calls = []

    def lower(kernel, part, side=None, **opts):
        calls.append((part, side))
        return SimpleNamespace(kind="grouped_gemm", side=side, gather=False)

    monkeypatch.setattr(tldsl.codegen, "lower", lower)
    out = fold.fold_chained(k, lowered, {}, set(lowered))
    assert calls == [("grouped_gemm", "combine")]
    assert out["combine"] == FoldedPart("combine", "grouped_gemm") and out["grouped_gemm"].side == "combine"
    assert out["combine_again"] is lowered["combine"]
