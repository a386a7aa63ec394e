"""``tl.run`` without a GPU: everything decided before a launch — the arguments' checks (the
simulator's, error for error), the binding of every kernel parameter by its source kind, the
plan of what each rank launches on which stream with which grid, and the refusals (a parameter
nothing can pass, kernels that cannot all be resident at once). The launches themselves are in
tests/test_gpu_run.py."""
from __future__ import annotations

import os

import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen.abi import SOURCES, KernelParam, TmaDescriptorSpec
from tldsl.codegen.toolchain import toolchain_available
from tldsl.ops.allgather_gemm import allgather_gemm
from tldsl.ops.gemm import gemm
from tldsl.ops.gemm_reduce_scatter import gemm_reduce_scatter
from tldsl.runtime.gpu.bind import BINDERS, DeviceMemory, bind, check_bindings, nominal_memory, pack
from tldsl.runtime.gpu.run_errors import ResidencyError, UnboundParameterError
from tldsl.runtime.gpu.run_plan import (RESERVED_FOR_COPIES, PlannedKernel, lower_for_run, needs_free_sms,
                                        plan_run)
from tldsl.runtime.gpu.plan_exec import DeviceArray

from programs import scale_rows     # test_gpu_run and test_run_fake_device import it from here too

S, F16, F32 = tl.TensorSpec, tl.float16, tl.float32
H200_SMS = 132


@tl.kernel
def row_softmax(x, y, *, compute: tl.ComputeSchedule = None):
    M, N = x.shape
    BM = compute.tile[0]

    @tl.compute_part(grid=(tl.cdiv(M, BM),))
    def part(pm):
        t = tl.load(x, (pm * BM, 0), (BM, N)).to(tl.float32)
        m = tl.max(t, 1)
        e = tl.exp(t - m[:, None])
        tl.store(y, (pm * BM, 0), e / tl.sum(e, 1)[:, None])


C128 = tl.ComputeSchedule(tile=(128, 128, 64))


def ag_gemm(W=2, engine="sm", own_rows="comm", mode="pull"):
    comm = tl.CommSchedule(mode=mode, sms=2, engine=engine, own_rows=own_rows) if engine == "sm" else \
        tl.CommSchedule(mode=mode, engine=engine, own_rows=own_rows)
    return allgather_gemm.trace(W, S((256, 256), F16), S((256, 256), F16), S((W * 256, 256), F16), compute=C128,
                                comm=comm)


def gemm_rs(W=2):
    return gemm_reduce_scatter.trace(W, S((512, 256), F16), S((256, 256), F16), S((512 // W, 256), F16), compute=C128,
                                     comm=tl.CommSchedule(sms=2))


def planned(k, sm_count=H200_SMS, **kw):
    lowered = lower_for_run(k, wait_timeout_ns=10 ** 9)
    check_bindings(k, lowered)
    return plan_run(k, lowered, sm_count=sm_count, **kw)


# =================================================================================================
# the binding table
# =================================================================================================

def test_the_binding_table_covers_every_source_kind():
    assert set(BINDERS) == set(SOURCES)


class _Lowered:
    """A kernel ABI with one parameter of every source kind (what a recipe could produce)."""
    entry = "every_kind"

    def __init__(self):
        self.tma = (TmaDescriptorSpec("tma_x", "x", "A", "f16", "CU_TENSOR_MAP_DATA_TYPE_FLOAT16", (8, 4), (16,),
                                      (8, 4), (1, 1), "CU_TENSOR_MAP_SWIZZLE_NONE"),)
        self.params = (KernelParam("tma_x", "T", "tma", "tma:tma_x"), KernelParam("s", "u64*", "ptr", "signal:ready"),
                       KernelParam("sp", "u64**", "ptr", "peer_signals:ready"),
                       KernelParam("xp", "half**", "ptr", "peers:x"), KernelParam("xb", "half*", "ptr", "buffer:x"),
                       KernelParam("yd", "float*", "ptr", "data:y"), KernelParam("rank", "int", "i32", "rank"),
                       KernelParam("launch", "u64", "u64", "launch"), KernelParam("M", "int", "i32", "M", 4),
                       KernelParam("N", "int", "i32", "N", 8), KernelParam("K", "int", "i32", "K", 2))


def _memory(W=3):
    addr = iter(range(0x1000, 1 << 40, 0x1000))
    buffers = [{"x": DeviceArray(next(addr), (4, 8), "f16"), "y": DeviceArray(next(addr), (4,), "f32")}
               for _ in range(W)]
    signals = [{"ready": DeviceArray(next(addr), (2,), "i64")} for _ in range(W)]
    uploads, encoded = [], []

    def upload(values):
        uploads.append(list(values))
        return DeviceArray(next(addr), (len(values),), "u64", owner=list(values))

    def encode(spec, address):
        encoded.append((spec.param, address))
        return bytes([len(encoded)]) * 128
    return DeviceMemory(W, buffers, signals, upload, encode), uploads, encoded


def test_every_source_kind_binds_to_its_value():
    mem, uploads, encoded = _memory()
    lk = _Lowered()
    got = {b.param.source: b.value for b in bind(lk, 1, mem, launch=5)}
    assert encoded == [("tma_x", mem.buffers[1]["x"].ptr)] and got["tma:tma_x"] == bytes([1]) * 128
    assert got["signal:ready"] == mem.signals[1]["ready"].ptr
    assert got["buffer:x"] == mem.buffers[1]["x"].ptr and got["data:y"] == mem.buffers[1]["y"].ptr
    assert got["peers:x"] == mem.tables[("buffer", "x")].ptr
    assert got["peer_signals:ready"] == mem.tables[("signal", "ready")].ptr
    assert uploads == [[mem.signals[q]["ready"].ptr for q in range(3)], [mem.buffers[q]["x"].ptr for q in range(3)]]
    assert (got["rank"], got["launch"], got["M"], got["N"], got["K"]) == (1, 5, 4, 8, 2)
    bind(lk, 2, mem)
    assert len(uploads) == 2            # the tables are uploaded once, whichever rank binds
    args, slot = pack(bind(lk, 0, mem, launch=1))
    assert slot == 7 and len(args.holders) == len(lk.params)


@pytest.mark.parametrize("source,error", [
    ("scalar:own_cols", "own_rows='comm'"), ("buffer:nowhere", "no tensor of the traced program"),
    ("signal:nowhere", "no signal of the traced program"), ("tma:tma_nowhere", "does not describe"),
    ("M", "no value fixed by the trace")])
def test_a_parameter_nothing_can_pass_is_refused(source, error):
    mem, _, _ = _memory()
    lk = _Lowered()
    lk.params = (KernelParam("p", "int" if ":" not in source or source.startswith("scalar") else "void*",
                             "i32" if not source.startswith(("buffer", "signal")) else "ptr", source),)
    if source.startswith("tma"):
        lk.params = (KernelParam("p", "T", "tma", source),)
    with pytest.raises(UnboundParameterError, match=error.replace("(", r"\(").replace(")", r"\)")):
        bind(lk, 0, mem)


def test_a_tma_descriptor_larger_than_its_tensor_is_refused():
    mem, _, _ = _memory()
    lk = _Lowered()
    lk.tma = (TmaDescriptorSpec("tma_x", "x", "A", "f16", "F16", (16, 4), (32,), (8, 4), (1, 1), "NONE"),)
    with pytest.raises(UnboundParameterError, match="spans 128 bytes of 'x', which holds 64"):
        bind(lk, 0, mem)


def test_a_kernels_scratch_is_sized_by_its_grid_poisoned_and_kept_per_rank():
    """A general kernel whose tiles do not fit in shared memory takes its global-memory scratch:
    poisoned memory of scratch_bytes_per_cta for every CTA the plan launches, one per rank
    (the ranks run at once), allocated once (later bindings, launches, reuse it)."""
    import dataclasses
    from programs import outer_sums
    from tldsl.runtime.gpu.bind import SCRATCH_POISON_WORD
    k = outer_sums.trace(2, S((5, 1000), F16), S((5, 520), F16), S((1000, 520), F32),
                         compute=tl.ComputeSchedule(tile=(256, 256, 16)))
    plan = planned(k, sm_count=7)
    uploads = []

    def upload(values):
        uploads.append(list(values))
        return DeviceArray(0x1000 * len(uploads), (len(values),), "u64")
    mem = dataclasses.replace(nominal_memory(k), upload=upload, allocate=None)    # scratch through upload
    binds = plan.bind(mem)
    sizes = {}
    for item in plan.kernels:
        lk = item.lowered
        assert lk.scratch_bytes_per_cta == lk.groups * 256 * 256 * 4 and 1 <= item.ctas < lk.num_tasks
        [scratch] = [b.value for b in binds[(item.rank, item.part)] if b.param.source == "scratch"]
        sizes[scratch] = item.ctas * lk.scratch_bytes_per_cta
    assert len(sizes) == 2 and sorted(len(u) * 8 for u in uploads) == sorted(sizes.values())
    assert all(set(u) == {SCRATCH_POISON_WORD} for u in uploads)
    plan.bind(mem)
    assert len(uploads) == 2
    lk = plan.kernels[0].lowered
    assert len(bind(lk, 0, nominal_memory(k))) == len(lk.params)      # unplanned: the kernel's largest grid


def test_a_scratch_budget_shrinks_the_grids_of_the_kernels_taking_scratch_alike():
    """Under a budget for the scratch, every kernel taking it gets fewer CTAs by one factor (here
    from 4 to 2 each: 5 CTAs' worth fit, not 6 for [3, 3]); no budget, or one that fits, leaves
    the plan as it was."""
    from programs import outer_sums
    k = outer_sums.trace(2, S((5, 1000), F16), S((5, 1000), F16), S((1000, 1000), F32),
                         compute=tl.ComputeSchedule(tile=(256, 256, 16)))
    free = planned(k, sm_count=8)
    per_cta = free.kernels[0].lowered.scratch_bytes_per_cta
    assert [x.ctas for x in free.kernels] == [4, 4] and per_cta > 0
    assert planned(k, sm_count=8, scratch_budget=8 * per_cta) == free
    assert [x.ctas for x in planned(k, sm_count=8, scratch_budget=5 * per_cta).kernels] == [2, 2]
    assert [x.ctas for x in planned(k, sm_count=8, scratch_budget=2 * per_cta).kernels] == [1, 1]
    with pytest.raises(ResidencyError, match="over the 0 B free on the GPU"):
        planned(k, sm_count=8, scratch_budget=-5)


# =================================================================================================
# plans: what each rank launches
# =================================================================================================

def test_plan_of_a_gemm():
    k = gemm.trace(1, S((512, 256), F16), S((256, 384), F16), S((512, 384), F16), compute=C128)
    plan = planned(k)
    [item] = plan.items
    assert isinstance(item, PlannedKernel) and type(item.lowered).__name__ == "LoweredGemm"
    assert item.grid == (4 * 3, 1, 1) and item.stream == 0 and item.smem_bytes > 0
    binds = {b.param.source: b for b in plan.bind(nominal_memory(k))[(0, "tile")]}
    assert {"tma:tma_a", "tma:tma_b", "tma:tma_c", "M", "N", "K", "rank", "launch"} <= set(binds)
    assert (binds["M"].value, binds["N"].value, binds["K"].value) == (512, 384, 256)


@pytest.mark.parametrize("fn", [scale_rows, row_softmax])
def test_plan_of_an_elementwise_program_through_the_general_recipe(fn):
    k = fn.trace(1, S((1000, 96), F16), S((1000, 96), F32), compute=tl.ComputeSchedule(tile=(16, 32, 16)))
    plan = planned(k)
    [item] = plan.items
    assert type(item.lowered).__name__ == "LoweredGeneral"
    tasks = item.lowered.num_tasks
    assert item.grid == (min(tasks, H200_SMS), 1, 1)
    mem = nominal_memory(k)
    binds = {b.param.source: b.value for b in plan.bind(mem)[(0, "part")]}
    assert binds["buffer:x"] == mem.buffers[0]["x"].ptr and binds["buffer:y"] == mem.buffers[0]["y"].ptr
    assert "-DTLDSL_WAIT_TIMEOUT_NS=1000000000ull" in item.lowered.options


def test_plan_of_allgather_gemm_on_sms_at_two_ranks():
    k = ag_gemm()
    plan = planned(k)
    assert [(x.rank, x.part, type(x.lowered).__name__) for x in plan.items] == [
        (0, "gather_a", "LoweredComm"), (0, "gemm", "LoweredGemm"), (1, "gather_a", "LoweredComm"),
        (1, "gemm", "LoweredGemm")]
    assert [x.stream for x in plan.items] == [0, 1, 2, 3] and plan.reserved_sms == 0
    comm, gemm_ = plan.items[0], plan.items[1]
    assert comm.grid == (2, 1, 1) and gemm_.grid == (8, 1, 1)        # the lanes; one CTA per 128x128 tile
    mem = nominal_memory(k)
    binds = plan.bind(mem)
    for r in range(2):
        b = {x.param.source: x.value for x in binds[(r, "gather_a")]}
        table = mem.tables[("buffer", "a")]
        assert b["peers:a"] == table.ptr and table.owner == (mem.buffers[0]["a"].ptr, mem.buffers[1]["a"].ptr)
        assert b["buffer:a_gathered"] == mem.buffers[r]["a_gathered"].ptr
        assert b["signal:gather_a_ready"] == mem.signals[r]["gather_a_ready"].ptr and b["rank"] == r
        g = {x.param.source: x.value for x in binds[(r, "gemm")]}
        assert g["signal:gather_a_ready"] == mem.signals[r]["gather_a_ready"].ptr      # waits on its own counters


def test_plan_of_allgather_gemm_on_the_copy_engine_leaves_sms_to_its_copies():
    k = ag_gemm(engine="copy_engine")
    plan = planned(k)
    kinds = [(x.rank, x.part, type(x).__name__) for x in plan.items]
    assert kinds == [(0, "gather_a", "PlannedCopies"), (0, "gemm", "PlannedKernel"), (1, "gather_a", "PlannedCopies"),
                     (1, "gemm", "PlannedKernel")]
    assert plan.reserved_sms == RESERVED_FOR_COPIES
    assert sum(x.ctas for x in plan.kernels) <= H200_SMS - RESERVED_FOR_COPIES
    assert all(c.plan.actions[c.rank] for c in plan.copies)
    assert "copy engine" in plan.describe()


def test_a_run_on_some_of_the_sms_leaves_the_copies_the_others():
    """``tl.run(sms=N)``: the persistent kernels take N SMs and the GPU's other SMs stay free, so
    the same-GPU copies need none of the N kept back (before, N <= 4 refused every copy-engine
    program and N = 6 left its kernels 2)."""
    k = ag_gemm(engine="copy_engine")
    few = planned(k, sm_count=2, spare_sms=H200_SMS - 2)
    assert few.reserved_sms == 0 and sum(x.ctas for x in few.kernels) == 2
    assert planned(k, sm_count=H200_SMS - 1, spare_sms=1).reserved_sms == RESERVED_FOR_COPIES - 1
    with pytest.raises(ResidencyError, match="it runs on 2 of the GPU's 3 SMs, 3 of them left to the copy engine"):
        planned(k, sm_count=2, spare_sms=1)


def test_plan_that_hoists_the_own_shard_copies_leaves_no_sm_free():
    """Where the launch runs the copy engine's same-GPU copies before forking any part (the
    fused-op runtime: ``hoist_local_copies``), an all-gather's copies need no free SM beside the
    persistent kernels; on one GPU (``tl.run``), where every rank's copies are same-GPU, they do."""
    k = ag_gemm(engine="copy_engine", mode="push")
    plan = planned(k, hoist_local_copies=True)
    assert plan.reserved_sms == 0 and "left to the copy engine" not in plan.describe()
    assert planned(k).reserved_sms == RESERVED_FOR_COPIES
    lowered = lower_for_run(k, wait_timeout_ns=10 ** 9)
    assert needs_free_sms(lowered.values(), 2, False) and not needs_free_sms(lowered.values(), 2, True)
    assert not needs_free_sms(lower_for_run(ag_gemm(), wait_timeout_ns=10 ** 9).values(), 2, False)   # no copy engine


def test_plan_of_gemm_reduce_scatter_at_two_ranks():
    k = gemm_rs()
    plan = planned(k)
    mem = nominal_memory(k)
    for r in range(2):
        b = {x.param.source: x.value for x in plan.bind(mem)[(r, "reduce_scatter")]}
        assert b["peer_signals:reduce_scatter_arrived"] == mem.tables[("signal", "reduce_scatter_arrived")].ptr
        assert mem.tables[("signal", "reduce_scatter_arrived")].owner == tuple(
            mem.signals[q]["reduce_scatter_arrived"].ptr for q in range(2))
        assert b["buffer:partial"] == mem.buffers[r]["partial"].ptr


def test_compute_kernels_share_the_sms_the_lanes_leave():
    k = ag_gemm()
    plan = planned(k, sm_count=12)
    comm = [x for x in plan.kernels if x.part == "gather_a"]
    gemms = [x for x in plan.kernels if x.part == "gemm"]
    assert all(x.ctas == 2 for x in comm) and all(x.ctas == 4 for x in gemms)      # (12 - 2 x 2) / 2
    assert sum(x.ctas for x in plan.kernels) <= 12


def test_kernels_that_cannot_all_be_resident_are_refused():
    k = ag_gemm()
    with pytest.raises(ResidencyError, match="at least 6 CTAs resident at once"):
        planned(k, sm_count=5)
    with pytest.raises(ResidencyError, match="cannot run even one CTA on an SM"):
        planned(k, occupancy=lambda lk: 0 if lk.part == "gemm" else 1)
    planned(k, queues=3)                        # kernels alone may share the hardware queues
    ce = ag_gemm(engine="copy_engine")
    with pytest.raises(ResidencyError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        planned(ce, queues=3)                   # a stream wait would block the streams sharing its queue
    planned(ce, queues=4)


def test_tl_run_asks_cuda_for_a_queue_per_stream_before_cuda_starts(monkeypatch):
    """AllGather+GEMM on the copy engine at W = 8 runs 16 streams: more than CUDA's default 8 hardware
    queues, which plan_run refuses. tl.run sets CUDA_DEVICE_MAX_CONNECTIONS itself where CUDA has not
    started in the process and the caller has not set it; otherwise it leaves it, and plan_run's
    error says what to set."""
    from tldsl.runtime.gpu.run_plan import MAX_CONNECTIONS, reserve_hardware_queues
    ce = ag_gemm(W=8, engine="copy_engine")
    lowered = lower_for_run(ce, wait_timeout_ns=10 ** 9)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    with pytest.raises(ResidencyError, match="CUDA_DEVICE_MAX_CONNECTIONS"):
        plan_run(ce, lowered, sm_count=H200_SMS)
    reserve_hardware_queues(ce, lowered, cuda_started=lambda: True)          # too late: CUDA read it already
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    reserve_hardware_queues(ce, lowered, cuda_started=lambda: False)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == str(MAX_CONNECTIONS)
    plan_run(ce, lowered, sm_count=H200_SMS)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")                  # the caller's choice stands
    reserve_hardware_queues(ce, lowered, cuda_started=lambda: False)
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    sm = ag_gemm(W=8)                                                        # kernels alone share queues: left alone
    reserve_hardware_queues(sm, lower_for_run(sm, wait_timeout_ns=10 ** 9), cuda_started=lambda: False)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ


@tl.kernel
def reverse_chain(x, y):
    """Task t waits for task t + 1 of the same part: fine with every task resident (as the
    simulator runs a compute part), a deadlock for a persistent CTA that holds task t while
    task t + 1 waits for a CTA."""
    n = x.shape[0] // 8
    done = tl.signal("done", n)

    @tl.compute_part(grid=(n,))
    def part(t):
        with tl.when(t < n - 1):
            tl.consumer_tile_wait(done, t + 1)
        tl.store(y, (t * 8,), tl.load(x, (t * 8,), (8,)) + 1.0)
        tl.producer_tile_notify(done, t)


def test_a_part_waiting_for_its_own_tasks_must_fit_at_once():
    """Found by review: the simulator accepts the chain, a GPU with fewer CTAs than tasks hangs
    on it; tl.run refuses it before anything is launched, and runs it where all 16 fit."""
    k = reverse_chain.trace(1, S((128,), tl.float32), S((128,), tl.float32))
    with pytest.raises(ResidencyError, match=r"part 'part' waits for its own tasks \(signal\(s\) done\) but only 8 of "
                                             r"its 16 tasks"):
        planned(k, sm_count=8)
    assert planned(k, sm_count=16).kernels[0].ctas == 16


@tl.kernel
def running_sum(x, y):
    """A running sum over tiles (a look-back scan): tile t adds its rows to tile t - 1's sum, so it
    waits only for the tile before it in the order a persistent kernel's CTAs take them."""
    n = x.shape[0] // 8
    done = tl.signal("done", n)

    @tl.compute_part(grid=(n,))
    def part(t):
        with tl.when(t > 0):
            tl.consumer_tile_wait(done, t - 1)
            tl.store(y, (t * 8,), tl.load(y, ((t - 1) * 8,), (8,)) + tl.load(x, (t * 8,), (8,)))
        with tl.when(t == 0):
            tl.store(y, (0,), tl.load(x, (0,), (8,)))
        tl.producer_tile_notify(done, t)


def test_a_part_whose_tasks_wait_only_on_earlier_ones_runs_on_any_number_of_ctas():
    """The running sum's waits are all met by tasks earlier in the walk, so its kernel needs one
    CTA, not one per task (before, 1000 tiles on 132 SMs were refused as the reverse chain is); a
    wait on a later task, on a count earlier tasks cannot reach, or on a channel read from memory
    keeps the old rule."""
    from tldsl.ir.analysis import earlier_tasks_satisfy
    from tldsl.runtime.sim.engine import task_slots
    k = running_sum.trace(1, S((8000,), tl.float32), S((8000,), tl.float32))
    plan = planned(k, sm_count=8)
    assert plan.kernels[0].ctas == 8, plan.describe()
    part = k.parts[0]
    assert earlier_tasks_satisfy(k, part, lambda r: task_slots(k, part, r))
    assert not earlier_tasks_satisfy(k, part, lambda r: list(reversed(task_slots(k, part, r))))
    rev = reverse_chain.trace(1, S((128,), tl.float32), S((128,), tl.float32))
    assert not earlier_tasks_satisfy(rev, rev.parts[0], lambda r: task_slots(rev, rev.parts[0], r))


@tl.kernel
def notify_read_from_memory(x, flags, y):
    """Task 0 notifies where flags[0] > 0, the last task where not: which one does is known only
    at run time, and every other task waits for it (found by review)."""
    n = x.shape[0] // 8
    done = tl.signal("done", 1)

    @tl.compute_part(grid=(n,))
    def part(t):
        f = tl.load_scalar(flags, 0)
        with tl.when(t == 0):
            with tl.when(f > 0):
                tl.producer_tile_notify(done, 0)
        with tl.when(t == n - 1):
            with tl.when(f <= 0):
                tl.producer_tile_notify(done, 0)
        with tl.when(t > 0):
            tl.consumer_tile_wait(done, 0)
            tl.store(y, (t * 8,), tl.load(x, (t * 8,), (8,)))


@tl.kernel
def running_sum_in_a_cycle(x, y, z):
    """A running sum whose first task also waits for part b, which waits for the last task's
    first notify: a cycle through another part (found by review)."""
    n = x.shape[0] // 8
    done, from_a, from_b = tl.signal("done", n), tl.signal("from_a", 1), tl.signal("from_b", 1)

    @tl.compute_part(grid=(n,))
    def a(t):
        with tl.when(t == n - 1):
            tl.producer_tile_notify(from_a, 0)
        with tl.when(t == 0):
            tl.consumer_tile_wait(from_b, 0)
            tl.store(y, (0,), tl.load(x, (0,), (8,)))
        with tl.when(t > 0):
            tl.consumer_tile_wait(done, t - 1)
            tl.store(y, (t * 8,), tl.load(y, ((t - 1) * 8,), (8,)) + tl.load(x, (t * 8,), (8,)))
        tl.producer_tile_notify(done, t)

    @tl.compute_part(grid=(1,))
    def b(p):
        tl.consumer_tile_wait(from_a, 0)
        tl.store(z, (0,), tl.load(x, (0,), (8,)) * 2.0)
        tl.producer_tile_notify(from_b, 0)


def test_self_waits_the_analysis_cannot_order_keep_every_task_resident():
    """A notify under a condition read from memory may not happen (the channel analysis counts it,
    as an upper bound; ordering needs a lower one), and a part waiting on itself through another
    part too may deadlock however its own waits look: both keep the old rule, every task resident
    (a launch with fewer CTAs is refused, not left to hang as the fake device showed)."""
    f32, i32 = tl.float32, tl.int32
    k = notify_read_from_memory.trace(1, S((512,), f32), S((1,), i32), S((512,), f32))
    with pytest.raises(ResidencyError, match="only 8 of its 64 tasks"):
        planned(k, sm_count=8)
    k = running_sum_in_a_cycle.trace(1, S((512,), f32), S((512,), f32), S((8,), f32))
    with pytest.raises(ResidencyError, match="part 'a' waits for its own tasks"):
        planned(k, sm_count=16)


def test_a_schedule_fusing_parts_into_the_gemm_is_refused_before_any_gpu_work():
    k = ag_gemm(engine="copy_engine", own_rows="compute")
    with pytest.raises(UnboundParameterError, match="own_rows='comm'"):
        lower_for_run(k)
    with pytest.raises(UnboundParameterError, match="own_rows='comm'"):
        tl.run(k, 2, [{b.name: np.zeros(b.type.shape, np.float16) for b in k.args}] * 2)


@tl.kernel
def user_fused_copy(x: tl.Symmetric, y: tl.Symmetric, z):
    W = tl.world_size()
    M, N = x.shape
    sig = tl.signal("f", W, scope="symmetric")

    @tl.comm_part(grid=(W,), fused=True)
    def push(s):
        me = tl.rank()
        p = (me + s) % W
        tl.rank_copy_data(y.at(p), (me * M, 0), x, (0, 0), (M, N))
        tl.rank_notify(sig, me, p)

    @tl.compute_part(grid=(W,))
    def part(q):
        tl.rank_wait(sig, q)
        tl.store(z, (q * M, 0), tl.load(y, (q * M, 0), (M, N)) + 2.0)


def test_a_part_the_program_itself_declares_fused_is_named_with_what_to_drop():
    """Without a schedule that fuses, the message blamed one (own_rows='compute') the kernel never
    had (found by a helper)."""
    f32 = tl.float32
    k = user_fused_copy.trace(2, S((16, 16), f32), S((32, 16), f32), S((32, 16), f32))
    with pytest.raises(UnboundParameterError, match=r"part\(s\) \['push'\] of 'user_fused_copy' are declared "
                                                    r"@tl.comm_part\(..., fused=True\).*Drop fused=True"):
        lower_for_run(k)


def test_the_lowering_options_are_checked():
    k = scale_rows.trace(1, S((64, 64), F16), S((64, 64), F16), compute=tl.ComputeSchedule(tile=(16, 16, 16)))
    with pytest.raises(UnboundParameterError, match="entry"):
        lower_for_run(k, entry="mine")
    with pytest.raises(tl.TldslError, match="unknown lowering option"):
        lower_for_run(k, bogus=1)


# =================================================================================================
# the call: the simulator's checks, error for error
# =================================================================================================

W, MS = 2, 16
COMPUTE, COMM = tl.ComputeSchedule(tile=(16, 16, 16)), tl.CommSchedule(tile_m=8)


def _inputs():
    rng = np.random.default_rng(0)
    b = rng.integers(-3, 4, (16, 16)).astype(np.float16)
    return [{"a": rng.integers(-3, 4, (MS, 16)).astype(np.float16), "b": b,
             "c": np.full((W * MS, 16), np.nan, np.float16)} for _ in range(W)]


BAD_CALLS = {
    "no world size": dict(world_size=None), "world size 0": dict(world_size=0), "world size 1.5": dict(world_size=1.5),
    "inputs None": dict(inputs=None), "inputs a dict": dict(inputs={"a": 1}), "one rank's inputs": dict(inputs="x"),
    "three ranks' inputs": dict(inputs=_inputs() + _inputs()[:1]), "negative seed": dict(seed=-1),
    "bool seed": dict(seed=True), "bad options": dict(options={"bogus": 1}), "options a list": dict(options=[1]),
    "unknown keyword": dict(bogus=3), "compute swapped": dict(compute=COMM),
    "missing argument": dict(inputs=[{"a": x["a"], "b": x["b"]} for x in _inputs()]),
    "non-uniform shard": dict(inputs=[dict(x, a=x["a"][: 8 * (r + 1)]) for r, x in enumerate(_inputs())]),
    "float64 input": dict(inputs=[dict(x, b=x["b"].astype(np.float64)) for x in _inputs()]),
    "not a kernel": dict(kernel=print),
    "a TensorSpec input": dict(inputs=[dict(x, b=tl.TensorSpec(x["b"].shape, tl.float16)) for x in _inputs()]),
    "a list on rank 1": dict(inputs=[dict(x, b=x["b"].tolist() if r else x["b"]) for r, x in enumerate(_inputs())]),
    "float64 on rank 1": dict(inputs=[dict(x, b=x["b"].astype(np.float64) if r else x["b"])
                                      for r, x in enumerate(_inputs())]),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_calls_get_the_simulators_errors(case):
    call = dict(kernel=allgather_gemm, world_size=W, inputs=_inputs(), compute=COMPUTE, comm=COMM)
    call.update(BAD_CALLS[case])
    kernel, world_size, inputs = call.pop("kernel"), call.pop("world_size"), call.pop("inputs")
    with pytest.raises(tl.TldslError) as want:
        tl.simulate(kernel, world_size, inputs, **call)
    with pytest.raises(type(want.value)) as got:
        tl.run(kernel, world_size, inputs, **call)
    assert type(got.value) is type(want.value), (str(got.value), str(want.value))


@pytest.mark.parametrize("kw,error", [(dict(timeout_s=0), "timeout_s"), (dict(timeout_s="1"), "timeout_s"),
                                      (dict(timeout_s=float("inf")), r"finite .*\(None: no timeout"),
                                      (dict(timeout_s=float("nan")), "timeout_s"),
                                      # below 1 ns was a LoweringError about wait_timeout_ns; 2**64 ns wrapped
                                      (dict(timeout_s=1e-10), r"timeout_s=1e-10: .*whole nanoseconds"),
                                      (dict(timeout_s=18446744073.8), r"below 18446744073.7 s \(2\*\*64 ns"),
                                      (dict(lowering=[("threads", 64)]), "lowering"),
                                      (dict(lowering={"wait_timeout_ns": 10}), "pass timeout_s instead")])
def test_the_run_options_are_checked(kw, error):
    with pytest.raises(tl.InputError, match=error):
        tl.run(allgather_gemm, W, _inputs(), compute=COMPUTE, comm=COMM, **kw)


def test_without_a_gpu_a_valid_call_says_why_it_cannot_run():
    from tldsl.runtime.gpu.device import GPUUnavailableError, gpu_available
    if gpu_available():
        pytest.skip("a GPU is here: tests/test_gpu_run.py runs the call")
    x = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    with pytest.raises(GPUUnavailableError, match="no GPU to run on"):
        tl.run(scale_rows, 1, [{"x": x, "y": np.zeros_like(x)}], compute=tl.ComputeSchedule(tile=(16, 16, 16)))


def test_importing_tldsl_imports_neither_torch_nor_the_code_generator():
    code = ("import sys, tldsl as tl; tl.run; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'cuda') "
            "or m.startswith(('tldsl.codegen', 'tldsl.runtime.gpu'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_fuzzer_finds_tl_run():
    from tldsl.testing.fuzz import gpu_unavailable
    assert gpu_unavailable() != "tl.run does not exist yet"


# =================================================================================================
# memory and the result, on torch's CPU device (the same code a GPU run uses)
# =================================================================================================

def test_every_rank_gets_its_own_memory_as_the_simulator_does():
    torch = pytest.importorskip("torch")
    from tldsl.runtime.gpu.run_program import allocate, read_back
    k = gemm_rs(W=2)
    rng = np.random.default_rng(3)
    per_rank = [[rng.standard_normal(b.type.shape).astype(np.float16) for b in k.args] for _ in range(2)]
    per_rank[1][1] = torch.from_numpy(per_rank[1][1])          # a torch tensor is copied too
    cpu = SimpleNamespace(torch_device=torch.device("cpu"), upload=None, encode_tma=None)
    tensors, mem = allocate(k, per_rank, cpu)
    sim = tl.simulate(k, 2, [dict(zip([b.name for b in k.args], [np.asarray(x) for x in arrays]))
                             for arrays in per_rank], options={"launches": 1})
    outputs, workspaces = read_back(k, tensors)
    for r in range(2):
        for b, arr in zip(k.args, per_rank[r]):
            assert np.array_equal(outputs[r][b.name], np.asarray(arr)) and outputs[r][b.name].dtype == np.float16
        for b in k.workspaces:
            assert np.isnan(workspaces[r][b.name]).all() and workspaces[r][b.name].shape == b.type.shape
            assert workspaces[r][b.name].dtype == sim.workspaces[r][b.name].dtype
        for s in k.signals:
            assert mem.signals[r][s.name].shape == (s.type.slots,) and not tensors[r][f"signal:{s.name}"].any()
    assert tensors[1]["b"].data_ptr() != per_rank[1][1].data_ptr()
    ptrs = [a.ptr for r in range(2) for a in mem.buffers[r].values()] + \
        [a.ptr for r in range(2) for a in mem.signals[r].values()]
    assert len(set(ptrs)) == len(ptrs)                                     # no two ranks share a tensor


def test_bf16_inputs_are_stored_as_the_simulator_stores_them():
    torch = pytest.importorskip("torch")
    from tldsl.runtime.gpu.run_program import read_back, to_device
    from tldsl.runtime.sim.memory import to_storage
    k = scale_rows.trace(1, S((8, 8), tl.bfloat16), S((8, 8), F32), compute=tl.ComputeSchedule(tile=(8, 8, 8)))
    x = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)
    t = to_device(x, tl.bfloat16, torch.device("cpu"))
    assert t.dtype == torch.bfloat16
    outputs, _ = read_back(k, [{"x": t, "y": torch.zeros(8, 8)}])
    assert outputs[0]["x"].dtype == np.float32 and np.array_equal(outputs[0]["x"], to_storage(x, tl.bfloat16))


def test_the_result_has_the_simulators_interface():
    from tldsl.runtime.gpu.run_result import RunResult
    k = scale_rows.trace(1, S((8, 8), F32), S((8, 8), F32), compute=tl.ComputeSchedule(tile=(8, 8, 8)))
    out = [{"x": np.ones((8, 8), np.float32), "y": np.full((8, 8), 3.0, np.float32)}]
    res = RunResult(k, out, [{}], [], 0, 2, 0, 0, device="H200", launch_ms=[0.5, 0.25])
    assert isinstance(res, tl.SimResult) and res[0]["y"][0, 0] == 3.0 and res.outputs is out
    assert "GPU run records no event log" in res.timeline()
    with pytest.raises(tl.InputError, match="no event log"):
        res.plot_timeline()
    assert repr(res).startswith("<RunResult scale_rows: 1 ranks on H200, 2 launch(es) [0.500, 0.250] ms")
    assert "RunResult of scale_rows" in res._repr_html_()


_TOOLCHAIN, _NO_TOOLCHAIN = toolchain_available()


@pytest.mark.nvrtc
@pytest.mark.skipif(not _TOOLCHAIN, reason=f"NVRTC toolchain: {_NO_TOOLCHAIN}")
@pytest.mark.parametrize("W,engine", [(8, "sm"), (2, "copy_engine")])
def test_a_plan_shows_itself_in_one_line_and_a_card(W, engine):
    """``result.plan`` in a notebook: a line naming its kernels, CTAs and streams (it was the
    dataclass dump, 4.4 KB for W = 8, every PlannedKernel's lowered kernel in it) and a card
    with the launch shape of each part and ``describe()``, which stays the long form."""
    from test_reprs import assert_notebook_native
    plan = planned(ag_gemm(W=W, engine=engine))
    html = assert_notebook_native(plan, "RunPlan allgather_gemm", f"{W} rank(s)", f"{len(plan.kernels)} kernel(s)",
                                  f"{plan.resident_ctas} CTAs of {H200_SMS} SMs", f"{plan.streams} stream(s)")
    assert "RunPlan of allgather_gemm" in html and "part gemm" in html and "tldsl_allgather_gemm_gemm" in html
    assert "describe()" in html and plan.describe().splitlines()[1].strip().replace("'", "&#x27;") in html
    for x in plan.items:
        text = repr(x)
        assert "\n" not in text and len(text) <= 100 and f"rank {x.rank} {x.part}" in text, text
    assert ("copy engine" in repr(plan.items[0])) == (engine == "copy_engine")


def test_the_kernels_tl_run_builds_compile_with_their_wait_timeouts():
    """Every recipe's kernel as tl.run lowers it (waits that trap after the timeout), compiled
    for sm_90a: a general-recipe compute part and communication part, the SM communication
    kernel, the GEMM, attention, the grouped GEMM and the combine."""
    from tldsl.codegen.toolchain.compiler import compile_many
    from test_run_fake_device import library_case
    tile = tl.ComputeSchedule(tile=(32, 32, 16))
    programs = [scale_rows.trace(1, S((100, 70), F16), S((100, 70), F16), compute=tile), ag_gemm()]
    for name in ("normed_gather", "sp_attention", "moe_reduce_scatter"):
        fn, W, inputs, kw = library_case(name)
        programs.append(fn.trace(W, *[inputs[0][a] for a in fn.arg_names], **kw))
    kernels = [lk for k in programs for lk in lower_for_run(k, wait_timeout_ns=60 * 10 ** 9).values()
               if hasattr(lk, "source")]
    assert {type(lk).__name__ for lk in kernels} == {"LoweredGeneral", "LoweredComm", "LoweredGemm",
                                                     "LoweredAttention", "LoweredGroupedGemm", "LoweredCombine"}
    assert all("-DTLDSL_WAIT_TIMEOUT_NS=60000000000ull" in lk.options for lk in kernels)
    compiled = compile_many([lk.job() for lk in kernels], progress=False)
    assert all(c.cubin for c in compiled)


def test_whether_cuda_has_started_asks_torch_then_every_primary_context_then_the_current_one():
    """reserve_hardware_queues sets CUDA_DEVICE_MAX_CONNECTIONS only where no context exists yet:
    CUDA reads it when it makes one (found by review: torch's view alone misses another library's
    context, and the setting would then be believed, not applied)."""
    from types import SimpleNamespace
    from tldsl.runtime.gpu.device import cuda_context_exists
    R = SimpleNamespace(CUDA_SUCCESS=0, CUDA_ERROR_NOT_INITIALIZED=3, CUDA_ERROR_NO_DEVICE=100)

    def driver(count_err=0, active=(0, 0), current=0):
        return SimpleNamespace(CUresult=R, cuDeviceGetCount=lambda: (count_err, len(active)),
                               cuDeviceGet=lambda i: (0, i), cuDevicePrimaryCtxGetState=lambda d: (0, 0, active[d]),
                               cuCtxGetCurrent=lambda: (0, current))
    torch = pytest.importorskip("torch")
    if torch.cuda.is_initialized():
        pytest.skip("torch's CUDA has started in this process: the answer is True before the driver is asked")
    assert cuda_context_exists(driver(count_err=R.CUDA_ERROR_NOT_INITIALIZED)) is False
    assert cuda_context_exists(driver()) is False
    assert cuda_context_exists(driver(active=(0, 1))) is True           # CuPy's or Numba's primary context
    assert cuda_context_exists(driver(current=0x7F00)) is True          # a context of its own, current
    assert cuda_context_exists(driver(count_err=R.CUDA_ERROR_NO_DEVICE)) is True   # unknown: leave it
    assert cuda_context_exists(SimpleNamespace()) is True               # a driver that cannot answer
