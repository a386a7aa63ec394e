"""Signals dropped where the stream's order keeps their waits (``ir/drop_signals.py``,
``runtime/gpu/chains.py::stream_ordered_signals``, ``run_plan.stream_ordered``), without a GPU:
what is removed, what stays, which signals qualify, and that a plan never runs such kernels side by
side."""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl
from tldsl.ir import NOTIFY_OPS, WAIT_OPS, verify
from tldsl.ir.drop_signals import without_signals
from tldsl.ops.moe import moe_routing, random_routing
from tldsl.runtime.gpu.chains import chained_parts, stream_ordered_signals
from tldsl.runtime.gpu.run_errors import UnboundParameterError
from tldsl.runtime.gpu.run_plan import lower_for_run, plan_run, stream_ordered

from test_run_plan_split import chain_program, moe_rs_program

H200_SMS = 132


def _ops(part, names):
    return [op for op in part.walk() if op.name in names]


def _compute(k):
    return {p.name for p in k.parts if p.role == "compute"}


def test_the_moe_combines_signal_goes_with_the_code_that_only_fed_it():
    k = moe_rs_program()
    e = without_signals(k, {"y_ready"})
    verify(e)
    gemm, combine = e.part("grouped_gemm"), e.part("combine")
    assert not _ops(gemm, NOTIFY_OPS) and not _ops(combine, WAIT_OPS)
    # the notify loop and the table reads that fed it are gone; the K loop, the store and the guard stay
    loops = [op for op in gemm.walk() if op.name == "for"]
    assert len(loops) == 1 and _ops(gemm, {"dot"}) and _ops(gemm, {"store"}) and _ops(gemm, {"if"})
    read = {op.operands[0].owner.name for op in gemm.walk() if op.name == "load_scalar"}
    assert read == {"tile_expert", "tile_valid_rows"}
    # the reduce-scatter's signal and its notifies in the combine are untouched, its part shared
    assert [s.name for s in e.signals] == [s.name for s in k.signals if s.name != "y_ready"]
    assert len(_ops(combine, NOTIFY_OPS)) == len(_ops(k.part("combine"), NOTIFY_OPS)) > 0
    assert e.part("reduce_scatter") is k.part("reduce_scatter")
    assert e.stream_ordered == {"y_ready"} and k.stream_ordered == frozenset()
    # the original is not modified
    assert _ops(k.part("grouped_gemm"), NOTIFY_OPS) and _ops(k.part("combine"), WAIT_OPS)


def test_dropping_nothing_is_the_kernel_itself_and_an_unknown_signal_is_refused():
    k = moe_rs_program()
    assert without_signals(k, ()) is k
    with pytest.raises(KeyError, match="no signal.*y_ready_typo"):
        without_signals(k, {"y_ready_typo"})


def test_which_signals_the_stream_order_keeps():
    k = moe_rs_program()
    assert stream_ordered_signals(k, chained_parts(k, _compute(k))) == {"y_ready"}
    assert stream_ordered_signals(k, {}) == frozenset()               # beside: every signal stays
    # AllGather+MoE with its rows staged: the GEMM waits on the row gather's signal only
    rng = np.random.default_rng(0)
    ids, _ = random_routing(rng, 128, 8, 2)
    rt = moe_routing(ids, 8, 1, 128, 128)
    ag = rt.trace_allgather_moe(1, 128, 256, 512, 8, tl.bfloat16, stage_rows=True,
                                compute=tl.ComputeSchedule(tile=(128, 128, 64)),
                                comm=tl.CommSchedule(tile_m=128, mode="pull"))
    chained = chained_parts(ag, _compute(ag))
    assert chained == {"grouped_gemm": "gather_rows"}
    dropped = stream_ordered_signals(ag, chained)
    assert len(dropped) == 1 and all(s in {x.name for x in ag.signals} for s in dropped)
    # the all-gather's own signal, which a communication part notifies, stays
    e = stream_ordered(ag)
    assert _ops(e.part("gather_rows"), WAIT_OPS) and not _ops(e.part("grouped_gemm"), WAIT_OPS)
    # a part that waits on its own tasks is not chained: nothing dropped
    c = chain_program()
    assert stream_ordered(c) is c


@tl.kernel
def two_waiters(x, y, z, w):
    ready = tl.signal("ready", 4)

    @tl.compute_part(grid=(4,))
    def produce(t):
        tl.store(y, (t * 8,), tl.load(x, (t * 8,), (8,)))
        tl.producer_tile_notify(ready, t)

    @tl.compute_part(grid=(4,))
    def consume(t):
        tl.consumer_tile_wait(ready, t)
        tl.store(z, (t * 8,), tl.load(y, (t * 8,), (8,)))

    @tl.comm_part(grid=(4,))
    def send(t):
        tl.consumer_tile_wait(ready, t)
        tl.store(w, (t * 8,), tl.load(y, (t * 8,), (8,)))


def test_a_signal_another_part_also_waits_on_stays():
    S = tl.TensorSpec
    k = two_waiters.trace(1, *(S((32,), tl.float32) for _ in range(4)))
    chained = chained_parts(k, _compute(k))
    assert chained == {"consume": "produce"}
    assert stream_ordered_signals(k, chained) == frozenset()     # 'send' runs beside and needs the notifies


def test_kernels_lowered_for_after_are_never_planned_side_by_side():
    k = moe_rs_program()
    lowered = lower_for_run(k)
    assert (lowered["grouped_gemm"].notifies, lowered["combine"].waits) == (0, 0)
    plan_run(k, lowered, sm_count=H200_SMS)                      # after: as lowered
    with pytest.raises(UnboundParameterError, match="without the signals \\['y_ready'\\].*side by side"):
        plan_run(k, lowered, sm_count=H200_SMS, chain="beside")
    kept = lower_for_run(k, chain="beside")
    assert (kept["grouped_gemm"].notifies, kept["combine"].waits) == (1, 1)
    plan_run(k, kept, sm_count=H200_SMS)                         # signals kept: either way is safe
