"""The distributed runtime's host-side pieces, tested without a GPU and without torch.

The only fake is the CUDA driver (:class:`FakeDriver`): a flat fake address space backed by
numpy bytes (each rank sees every symmetric buffer at its own virtual address, aliasing the same
bytes, as peer mappings do), per-stream queues, and real semantics for the calls the runtime
issues — ``cuMemcpyAsync`` / ``cuMemcpy2DAsync`` move bytes with the given pitches,
``cuStreamWriteValue64`` stores, ``cuStreamWaitValue64`` blocks its stream until the (cyclic)
``>=`` holds, ``cuLaunchKernel`` records the packed parameter array. Streams run interleaved by
:meth:`FakeDriver.run`, so cross-rank ordering bugs deadlock here as they would on GPUs.

What is checked: the copy-engine plan executor against the plan's own numpy reference
(``CopyEnginePlan.run_numpy``: same bytes, offsets, pitches and signal values) on every rank
and launch, the calls and streams it issues, its validation; the communication-kernel launcher's
pointer tables (built once, uploaded to device memory), parameter order and values, grid and
errors; symmetric-workspace layout and addresses; the autotuner; the GEMM+RS and AG+GEMM
input validation; the stuck-wait explainer of the distributed checks.
"""
from __future__ import annotations

import enum
import itertools
import os
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import tldsl as tl
from tldsl.codegen import lower
from tldsl.codegen import CeCopy, CeSignalWrite, CeWait, lower_comm, plan_copy_engine
from tldsl.kernel import TensorSpec as S
from tldsl.ops.allgather_gemm import allgather_gemm
from tldsl.ops.gemm_reduce_scatter import gemm_reduce_scatter
from tldsl.runtime.dist.comm_kernel import CommKernel, decode_args, explain_address, kernel_specs
from tldsl.runtime.gpu.plan_exec import (DeviceArray, PlanExecutor, PointerTable, plan_symmetric_names,
                                          symmetric_addresses)
from tldsl.runtime.dist.regions import layout_regions
from tldsl.runtime.gpu.device import CudaDriverError

from test_codegen_comm import ce_blocks      # the n-d clipped copy-engine kernel, planned here too

# many tests build an op on fakes and drop it: that warns (symmetric.py), which is not their subject
pytestmark = pytest.mark.filterwarnings("ignore::tldsl.runtime.dist.symmetric.SymmetricMemoryWarning")


@pytest.fixture(autouse=True)
def _own_symmetric_ledger(monkeypatch):
    """Each test starts with no symmetric memory held, and what it drops is not kept for the next."""
    from tldsl.runtime.dist import symmetric as sym
    monkeypatch.setattr(sym, "_LEDGER", {})


# =================================================================================================
# the fake driver
# =================================================================================================

class FakeCUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_ILLEGAL_ADDRESS = 700


class FakeMemcpy2D:
    """The fields of CUDA_MEMCPY2D the runtime may set (a typo raises, like the real struct)."""
    __slots__ = ("srcMemoryType", "srcDevice", "srcHost", "srcArray", "srcXInBytes", "srcY", "srcPitch",
                 "dstMemoryType", "dstDevice", "dstHost", "dstArray", "dstXInBytes", "dstY", "dstPitch",
                 "WidthInBytes", "Height")

    def __init__(self):
        for s in self.__slots__:
            setattr(self, s, 0)


class FakeDriver:
    CUresult = FakeCUresult
    CUmemorytype = SimpleNamespace(CU_MEMORYTYPE_HOST=1, CU_MEMORYTYPE_DEVICE=2)
    CUstreamWriteValue_flags = SimpleNamespace(CU_STREAM_WRITE_VALUE_DEFAULT=0)
    CUstreamWaitValue_flags = SimpleNamespace(CU_STREAM_WAIT_VALUE_GEQ=0)
    CUevent_flags = SimpleNamespace(CU_EVENT_DISABLE_TIMING=2)
    CUDA_MEMCPY2D = FakeMemcpy2D

    def __init__(self):
        self.maps: list[tuple[int, int, np.ndarray]] = []     # (address, nbytes, uint8 view of the backing)
        self.next = 0x7f0000000000
        self.queues: dict[int, deque] = {}
        self.calls: list[tuple] = []
        self.fail: dict[str, FakeCUresult] = {}
        self.launches: list[dict] = []

    # -- memory ----------------------------------------------------------------------------------
    def map(self, arr: np.ndarray) -> int:
        """A fresh virtual address for the bytes of ``arr`` (C-contiguous; several maps alias)."""
        assert arr.flags.c_contiguous
        addr = self.next
        self.next += -(-max(arr.nbytes, 1) // 4096) * 4096 + 4096
        self.maps.append((addr, arr.nbytes, arr.reshape(-1).view(np.uint8)))
        return addr

    def bytes(self, addr: int, n: int) -> np.ndarray:
        for base, size, view in self.maps:
            if base <= addr and addr + n <= base + size:
                return view[addr - base:addr - base + n]
        raise AssertionError(f"fake GPU: access [{addr:#x}, +{n}) is outside every mapped buffer")

    def upload_u64(self, values):
        arr = np.array([int(v) for v in values], np.uint64)
        self._keep = getattr(self, "_keep", []) + [arr]
        return DeviceArray(self.map(arr), (len(arr),), "u64", owner=arr)

    def read_u64(self, addr: int, n: int) -> list[int]:
        return [int(x) for x in self.bytes(addr, 8 * n).view(np.uint64)]

    # -- calls -----------------------------------------------------------------------------------
    def _call(self, name, stream, op, record):
        self.calls.append((name, stream) + record)
        if name in self.fail:
            return (self.fail[name],)
        if op is not None:
            self.queues.setdefault(int(stream), deque()).append((name, op))
        return (FakeCUresult.CUDA_SUCCESS,)

    def cuMemcpyAsync(self, dst, src, n, stream):
        dst, src, n = int(dst), int(src), int(n)

        def op():
            self.bytes(dst, n)[:] = self.bytes(src, n)
        return self._call("cuMemcpyAsync", stream, op, (dst, src, n))

    def cuMemcpy2DAsync(self, p, stream):
        assert int(p.srcMemoryType) == int(self.CUmemorytype.CU_MEMORYTYPE_DEVICE)
        assert int(p.dstMemoryType) == int(self.CUmemorytype.CU_MEMORYTYPE_DEVICE)
        src, dst = int(p.srcDevice) + int(p.srcXInBytes), int(p.dstDevice) + int(p.dstXInBytes)
        sp, dp, w, h = int(p.srcPitch), int(p.dstPitch), int(p.WidthInBytes), int(p.Height)
        assert int(p.srcY) == 0 and int(p.dstY) == 0
        if w > sp or w > dp:
            return self._call("cuMemcpy2DAsync", stream, None, (dst, dp, src, sp, w, h)) and \
                (FakeCUresult.CUDA_ERROR_INVALID_VALUE,)

        def op():
            for row in range(h):
                self.bytes(dst + row * dp, w)[:] = self.bytes(src + row * sp, w)
        return self._call("cuMemcpy2DAsync", stream, op, (dst, dp, src, sp, w, h))

    def cuStreamWriteValue64(self, stream, addr, value, flags):
        addr, value = int(addr), int(value)
        assert flags == self.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT

        def op():
            self.bytes(addr, 8).view(np.uint64)[0] = value
        return self._call("cuStreamWriteValue64", stream, op, (addr, value))

    def tldsl_signal_add(self, stream, addr):
        addr = int(addr)

        def op():
            self.bytes(addr, 8).view(np.uint64)[0] += np.uint64(1)
        return self._call("tldsl_signal_add", stream, op, (addr,))

    def cuStreamWaitValue64(self, stream, addr, value, flags):
        addr, value = int(addr), int(value)
        assert flags == self.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ

        def op():   # the driver's cyclic >=: (int64_t)(*addr - value) >= 0
            cur = int(self.bytes(addr, 8).view(np.uint64)[0])
            return ((cur - value) & ((1 << 64) - 1)) < (1 << 63)
        return self._call("cuStreamWaitValue64", stream, op, (addr, value))

    def cuMemsetD8Async(self, addr, value, n, stream):
        addr, n = int(addr), int(n)

        def op():
            self.bytes(addr, n)[:] = int(value)
        return self._call("cuMemsetD8Async", stream, None, (addr, int(value), n))

    # events: recorded in the call log like torch's (the streams here run their queues in any order)
    def cuEventCreate(self, flags):
        self._events = getattr(self, "_events", 5000) + 1
        return (FakeCUresult.CUDA_SUCCESS, self._events)

    def cuEventDestroy(self, ev):
        return (FakeCUresult.CUDA_SUCCESS,)

    def cuEventRecord(self, ev, stream):
        return self._call("cuEventRecord", stream, None, (int(ev),))

    def cuStreamWaitEvent(self, stream, ev, flags):
        return self._call("cuStreamWaitEvent", stream, None, (int(ev),))

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        self.launches.append(dict(function=fn, grid=(gx, gy, gz), block=(bx, by, bz), smem=smem, stream=stream,
                                  params=int(params), decoded=self._decode(fn, int(params))))
        return self._call("cuLaunchKernel", stream, None, (fn, (gx, gy, gz), (bx, by, bz)))

    def _decode(self, fn, params):
        kinds = getattr(fn, "kinds", None)
        return decode_args(params, kinds) if kinds else None

    def cuGetErrorName(self, err):
        return (FakeCUresult.CUDA_SUCCESS, FakeCUresult(err).name.encode())

    def cuGetErrorString(self, err):
        return (FakeCUresult.CUDA_SUCCESS, b"fake driver error")

    # -- the device ------------------------------------------------------------------------------
    def run(self, max_rounds=100000):
        """Run every stream's queue; a wait blocks its stream until satisfied."""
        for _ in range(max_rounds):
            progressed = False
            for s, q in self.queues.items():
                while q:
                    name, op = q[0]
                    done = op()
                    if name == "cuStreamWaitValue64" and not done:
                        break
                    q.popleft()
                    progressed = True
            if all(not q for q in self.queues.values()):
                return
            if not progressed:
                raise AssertionError("fake GPU deadlock: every non-empty stream waits: "
                                     + str({s: q[0][0] for s, q in self.queues.items() if q}))
        raise AssertionError("fake GPU did not finish")


# =================================================================================================
# copy-engine plans on the fake driver, against CopyEnginePlan.run_numpy
# =================================================================================================

def _device_memory(plan, W, rng, dtypes):
    """Per-rank numpy tensors for every buffer of the plan (device layout), random contents."""
    mem = []
    for r in range(W):
        d = {}
        for name, (shape, dt, eb) in plan.buffers.items():
            npdt = dtypes.get(dt, np.float32)
            d[name] = (rng.standard_normal(shape) * 10).astype(npdt)
        mem.append(d)
    sigs = [{name: np.zeros(slots, np.uint64) for name, slots in plan.signals.items()} for _ in range(W)]
    return mem, sigs


def _map_everything(drv, plan, mem, sigs):
    """Map the arrays: symmetric ones once per viewing rank (aliases), local ones for their owner.
    Returns one PointerTable per rank."""
    W = plan.world_size
    sym_b, sym_s = plan_symmetric_names(plan)
    tables = [PointerTable(W, r) for r in range(W)]
    for name in plan.buffers:
        for r in range(W):
            if name in sym_b:
                tables[r].add_symmetric(name, [drv.map(mem[q][name]) for q in range(W)], mem[r][name].nbytes)
            else:
                tables[r].add_local(name, drv.map(mem[r][name]), mem[r][name].nbytes)
    for name in plan.signals:
        for r in range(W):
            if name in sym_s:
                tables[r].add_symmetric(name, [drv.map(sigs[q][name]) for q in range(W)], sigs[r][name].nbytes)
            else:
                tables[r].add_local(name, drv.map(sigs[r][name]), sigs[r][name].nbytes)
    return tables


def _ag_plan(W, Ms, K, mode, dt=tl.float16):
    k = allgather_gemm.trace(W, S((Ms, K), dt), S((K, 8), dt), S((W * Ms, 8), dt),
                             compute=tl.ComputeSchedule(tile=(16, 16, 16)),
                             comm=tl.CommSchedule(engine="copy_engine", mode=mode))
    return lower(k, "gather_a")


@tl.kernel
def ce_relay(x: tl.Symmetric, y: tl.Symmetric, *, comm: tl.CommSchedule = None):
    """A chain through the ranks on the copy engine: rank r waits for rank r-1's block to arrive
    in its y, forwards it to rank r+1, then notifies r+1 (stream waits across ranks)."""
    W = tl.world_size()
    got = tl.signal("got", 1, scope="symmetric")

    @tl.comm_part(grid=(1,), engine="copy_engine", lanes=1)
    def relay(s):
        me = tl.rank()
        nxt = (me + 1) % W
        with tl.when(me == 0):
            tl.rank_copy_data(y.at(nxt), (0, 0), x, (0, 0), (2, 6))
            tl.rank_notify(got, 0, nxt)
        with tl.when(me > 0):
            tl.rank_wait(got, 0, count=1)
            with tl.when(me < W - 1):
                tl.rank_copy_data(y.at(nxt), (0, 0), y, (0, 0), (2, 6))
                tl.rank_notify(got, 0, nxt)


def _ce_blocks_plan(W):
    k = ce_blocks.trace(W, S((3, 5, 4), tl.float32), S((W * 3, 4, 5), tl.float32),
                        comm=tl.CommSchedule(engine="copy_engine"))
    return plan_copy_engine(k)


def _ce_relay_plan(W):
    k = ce_relay.trace(W, S((2, 6), tl.float32), S((2, 6), tl.float32), comm=tl.CommSchedule(engine="copy_engine"))
    return plan_copy_engine(k)


PLANS = {
    "ag-pull-f16": lambda: _ag_plan(3, 5, 6, "pull"),
    "ag-push-f16": lambda: _ag_plan(3, 5, 6, "push"),
    "ag-push-f32-W4": lambda: _ag_plan(4, 7, 5, "push", tl.float32),
    "nd-clipped": lambda: _ce_blocks_plan(3),
    "relay-waits": lambda: _ce_relay_plan(4),
}


def _run_plan_on_fake(plan, launches=(1, 2), local_split=False, seed=0):
    W = plan.world_size
    rng = np.random.default_rng(seed)
    dtypes = {"f16": np.float16, "f32": np.float32}
    mem, sigs = _device_memory(plan, W, rng, dtypes)
    want_mem = [{k: v.copy() for k, v in m.items()} for m in mem]
    want_sig = [{k: v.copy() for k, v in s.items()} for s in sigs]
    drv = FakeDriver()
    tables = _map_everything(drv, plan, mem, sigs)
    execs = [PlanExecutor(plan, r, tables[r], driver=drv) for r in range(W)]
    issued = []
    for L in launches:
        if L != launches[0]:        # fresh contents everywhere: a copy skipped at launch L shows
            for r in range(W):
                for name, arr in mem[r].items():
                    arr[...] = want_mem[r][name][...] = (rng.standard_normal(arr.shape) * 10).astype(arr.dtype)
        # ranks enqueue in reverse order: the device, not enqueue order, must sort out waits
        for r in reversed(range(W)):
            issued.append(execs[r].enqueue(100 + r, L, local_stream=(200 + r) if local_split else None))
        drv.run()
        plan.run_numpy(want_mem, want_sig, launch=L)
        for r in range(W):
            for name in plan.buffers:
                assert mem[r][name].tobytes() == want_mem[r][name].tobytes(), (L, r, name)
            for name in plan.signals:
                assert np.array_equal(sigs[r][name], want_sig[r][name]), (L, r, name, sigs[r][name])
    return drv, execs, tables, issued, mem, sigs


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_executor_matches_run_numpy(name):
    plan = PLANS[name]()
    drv, execs, tables, issued, *_ = _run_plan_on_fake(plan)
    W = plan.world_size
    # one driver call per action, in the plan's order, and nothing else
    per_rank = [[c for c in drv.calls if c[1] == 100 + r] for r in range(W)]
    for r in range(W):
        acts = plan.actions[r]
        assert len(per_rank[r]) == 2 * len(acts)        # two launches
        for (call, a) in zip(per_rank[r], list(acts) * 2):
            kind = {CeCopy: ("cuMemcpyAsync", "cuMemcpy2DAsync"), CeSignalWrite: ("cuStreamWriteValue64",),
                    CeWait: ("cuStreamWaitValue64",)}[type(a)]
            assert call[0] in kind, (call, a)


def test_plan_executor_addresses_offsets_pitches_and_epochs():
    """The exact arguments: peer addresses from rank r's own table, the plan's byte offsets and
    pitches, a 1-D copy for whole rows, absolute epoch values for the flags."""
    plan = PLANS["ag-pull-f16"]()
    drv, execs, tables, issued, mem, sigs = _run_plan_on_fake(plan, launches=(1, 2, 3))
    W, Ms, K = 3, 5, 6
    r = 1
    launch3 = issued[-W:][W - 1 - r]          # rank 1's calls of launch 3 (ranks enqueued in reverse)
    t = tables[r]
    for step in range(W):
        peer = (r + step) % W
        copy, write = launch3[2 * step], launch3[2 * step + 1]
        assert copy == ("cuMemcpyAsync", 101, t.address("a_gathered", r) + peer * Ms * K * 2,
                        t.address("a", peer), Ms * K * 2)
        assert write == ("cuStreamWriteValue64", 101, t.address("gather_a_ready", r) + 8 * peer, 3)
    # rank 1 reads rank 0's shard through rank 1's own mapping of it (not rank 0's address)
    assert t.address("a", 0) != tables[0].address("a", 0)
    # the pitched case: 2-D copies with the plan's pitches
    plan = PLANS["nd-clipped"]()
    drv, *_ = _run_plan_on_fake(plan, launches=(1,))
    c2 = [c for c in drv.calls if c[0] == "cuMemcpy2DAsync"]
    assert len(c2) == 2 * 3 * 3 and all(c[3] == 20 and c[5] == 16 and c[6] == 12 and c[7] == 3 for c in c2)  # dst pitch, src pitch


def test_plan_executor_waits_block_across_ranks():
    """Rank r > 0 waits (cuStreamWaitValue64) for rank r-1's notify: the chain completes only in
    rank order however the ranks enqueue, and the targets count in launches."""
    plan = PLANS["relay-waits"]()
    drv, execs, tables, issued, mem, sigs = _run_plan_on_fake(plan, launches=(1, 2))
    waits = [c for c in drv.calls if c[0] == "cuStreamWaitValue64"]
    assert sorted((c[1], c[3]) for c in waits) == sorted((100 + r, L) for r in (1, 2, 3) for L in (1, 2))
    for r in range(1, 4):
        assert np.array_equal(mem[r]["y"], mem[0]["x"])
    # without the notify the wait blocks: drop rank 0's enqueue and the fake GPU deadlocks
    drv2 = FakeDriver()
    mem2, sigs2 = _device_memory(plan, 4, np.random.default_rng(1), {})
    t2 = _map_everything(drv2, plan, mem2, sigs2)
    for r in (1, 2, 3):
        PlanExecutor(plan, r, t2[r], driver=drv2).enqueue(100 + r, 1)
    with pytest.raises(AssertionError, match="deadlock"):
        drv2.run()


def test_plan_executor_local_segments_go_to_the_local_stream():
    """Same-GPU copies run on SMs: with local_stream they (and their flag) go there, the rest
    stays on the communication stream; results still match the plan."""
    plan = PLANS["ag-push-f16"]()
    drv, execs, *_ = _run_plan_on_fake(plan, launches=(1, 2), local_split=True)
    for r in range(3):
        segs = execs[r].segments
        assert [local for local, _ in segs] == [True, False, False]
        local_calls = [c for c in drv.calls if c[1] == 200 + r]
        assert [c[0] for c in local_calls] == ["cuMemcpyAsync", "cuStreamWriteValue64"] * 2
        assert "local" in execs[r].describe()
    # a plan whose first segment is remote keeps everything on the communication stream
    pull = PLANS["ag-pull-f16"]()
    assert [loc for loc, _ in PlanExecutor(pull, 0, _map_everything(FakeDriver(), pull, *_device_memory(
        pull, 3, np.random.default_rng(0), {}))[0], driver=FakeDriver()).segments] == [True, False, False]


def _waited_local_plan():
    """Rank 0 waits for a flag, then copies within its GPU; rank 1 copies its own rows first: a
    local segment behind a wait must stay behind it."""
    import dataclasses
    from tldsl.codegen.plan.copy_engine import CopyEnginePlan
    ag = PLANS["ag-pull-f16"]()
    own = [ag.actions[r][0] for r in range(2)]                # rank r's copy of its own shard
    own = [dataclasses.replace(c, src_rank=r, dst_rank=r) for r, c in enumerate(own)]
    write = ag.actions[0][1]
    wait = CeWait(write.signal, 0, 1, True, (0,))
    return CopyEnginePlan("k", "p", 2, ((wait, own[0], write), (own[1], write)), ag.buffers, ag.signals)


def test_plan_executor_hoists_the_local_segments_no_wait_precedes():
    """The fused-op runtime enqueues an all-gather's own-shard copy before forking any part
    (``only="hoisted"``), the rest after (``only="rest"``): together every action once, in the
    plan's order within each; a same-GPU copy behind a wait is never hoisted, and only then are
    SMs left free for it (``local_copies_left``)."""
    from tldsl.runtime.gpu.plan_exec import local_copies_left
    for name in ("ag-pull-f16", "ag-push-f16", "ag-push-f32-W4", "nd-clipped"):
        plan = PLANS[name]()
        W = plan.world_size
        rng = np.random.default_rng(1)
        mem, sigs = _device_memory(plan, W, rng, {"f16": np.float16, "f32": np.float32})
        want_mem = [{k: v.copy() for k, v in m.items()} for m in mem]
        want_sig = [{k: v.copy() for k, v in s.items()} for s in sigs]
        drv = FakeDriver()
        tables = _map_everything(drv, plan, mem, sigs)
        execs = [PlanExecutor(plan, r, tables[r], driver=drv) for r in range(W)]
        for r in range(W):
            assert execs[r].hoisted == (True,) + (False,) * (len(execs[r].segments) - 1)
            assert not local_copies_left(plan, r)
            early = execs[r].enqueue(300 + r, 1, only="hoisted")
            rest = execs[r].enqueue(100 + r, 1, only="rest")
            assert [c[0] for c in early][-1] == "cuStreamWriteValue64" and all(c[1] == 300 + r for c in early)
            assert len(early) + len(rest) == len(plan.actions[r])
            assert not any(c[1] == 300 + r for c in rest)
        drv.run()
        plan.run_numpy(want_mem, want_sig, launch=1)
        for r in range(W):
            for b in plan.buffers:
                assert mem[r][b].tobytes() == want_mem[r][b].tobytes(), (name, r, b)
    relay = PLANS["relay-waits"]()
    assert not any(local_copies_left(relay, r) for r in range(4))      # its copies cross GPUs
    # a local segment behind a cross-GPU one stays behind it: signal writes are absolute values, so
    # run first its write could publish copies not yet made (and be overwritten by the earlier one)
    import dataclasses
    from tldsl.codegen.plan.copy_engine import CopyEnginePlan
    pull = PLANS["ag-pull-f16"]()
    own_last = tuple(tuple(a[2:] + a[:2]) for a in pull.actions)         # the peers' shards, then its own
    late = CopyEnginePlan("k", "p", 3, own_last, pull.buffers, pull.signals)
    ex = PlanExecutor(late, 0, _map_everything(FakeDriver(), late, *_device_memory(
        late, 3, np.random.default_rng(0), {}))[0], driver=FakeDriver())
    assert [loc for loc, _ in ex.segments] == [False, False, True] and ex.hoisted == (False, False, False)
    assert local_copies_left(late, 0)
    # a copy within a peer's GPU (its buffer into its own) keeps SMs free too: it runs there as a kernel
    peer_local = [list(a) for a in pull.actions]
    peer_local[0][2] = dataclasses.replace(peer_local[0][2], dst_rank=peer_local[0][2].src_rank)
    assert local_copies_left(CopyEnginePlan("k", "p", 3, tuple(map(tuple, peer_local)), pull.buffers,
                                            pull.signals), 0)
    waited = _waited_local_plan()
    assert local_copies_left(waited, 0) and not local_copies_left(waited, 1)
    drv = FakeDriver()
    mem, sigs = _device_memory(waited, 2, np.random.default_rng(2), {"f16": np.float16})
    t = _map_everything(drv, waited, mem, sigs)
    ex = [PlanExecutor(waited, r, t[r], driver=drv) for r in range(2)]
    assert ex[0].hoisted == (False, False) and ex[1].hoisted == (True,)
    assert ex[0].enqueue(300, 1, only="hoisted") == [] and len(ex[0].enqueue(100, 1, only="rest")) == 3
    with pytest.raises(tl.InputError, match="only='some'"):
        ex[1].enqueue(101, 1, only="some")


def test_plan_executor_per_call_tensor():
    """A local tensor given per call (a fresh output each launch): its address comes with enqueue."""
    plan = PLANS["ag-pull-f16"]()
    W = 3
    rng = np.random.default_rng(3)
    mem, sigs = _device_memory(plan, W, rng, {"f16": np.float16})
    drv = FakeDriver()
    tables = _map_everything(drv, plan, mem, sigs)
    ex = PlanExecutor(plan, 0, tables[0], per_call=("a_gathered",), driver=drv)
    fresh = np.zeros_like(mem[0]["a_gathered"])
    addr = drv.map(fresh)
    calls = ex.enqueue(5, 1, per_call={"a_gathered": addr})
    assert all(c[2] >= addr and c[2] < addr + fresh.nbytes for c in calls if c[0] == "cuMemcpyAsync")
    with pytest.raises(tl.InputError, match="holds 8 bytes; the plan needs"):
        ex.enqueue(5, 1, per_call={"a_gathered": DeviceArray(addr, (4,), "f16")})
    assert ex.enqueue(5, 2, per_call={"a_gathered": DeviceArray(addr, fresh.shape, "f16")})[1][3] == 2
    with pytest.raises(tl.InputError, match="missing"):
        ex.enqueue(5, 1)
    with pytest.raises(tl.InputError, match="not per-call"):
        ex.enqueue(5, 1, per_call={"a_gathered": addr, "a": 1})


def test_plan_executor_rejects_bad_tables_before_enqueueing():
    plan = PLANS["ag-pull-f16"]()
    W = 3
    mem, sigs = _device_memory(plan, W, np.random.default_rng(0), {"f16": np.float16})
    drv = FakeDriver()
    t = _map_everything(drv, plan, mem, sigs)[1]
    # a peer-read buffer given only locally
    bad = PointerTable(W, 1, dict(t.entries), dict(t.sizes))
    bad.add_local("a", t.address("a", 1), t.sizes["a"])
    with pytest.raises(tl.InputError, match="not addressable from rank 1: it must be symmetric"):
        PlanExecutor(plan, 1, bad, driver=drv)
    # a buffer smaller than the plan's copies
    small = PointerTable(W, 1, dict(t.entries), dict(t.sizes))
    small.sizes["a_gathered"] = 10
    with pytest.raises(tl.InputError, match="'a_gathered' holds 10 bytes"):
        PlanExecutor(plan, 1, small, driver=drv)
    # wrong rank / world
    with pytest.raises(tl.InputError, match="pointer table is for rank 1"):
        PlanExecutor(plan, 0, t, driver=drv)
    ex = PlanExecutor(plan, 1, t, driver=drv)
    with pytest.raises(tl.InputError, match="count from 1"):
        ex.enqueue(7, 0)
    assert drv.calls == []                                    # nothing reached the driver


def test_plan_executor_checks_every_driver_call():
    plan = PLANS["ag-push-f16"]()
    mem, sigs = _device_memory(plan, 3, np.random.default_rng(0), {"f16": np.float16})
    drv = FakeDriver()
    t = _map_everything(drv, plan, mem, sigs)
    drv.fail["cuStreamWriteValue64"] = FakeCUresult.CUDA_ERROR_ILLEGAL_ADDRESS
    with pytest.raises(CudaDriverError, match=r"cuStreamWriteValue64: rank 2: gather_a_ready\[2\]@2 = 1 "
                                              r"\(.*allgather_gemm.py:\d+\) failed: CUDA_ERROR_ILLEGAL_ADDRESS"):
        PlanExecutor(plan, 2, t[2], driver=drv).enqueue(3, 1)
    drv.fail = {"cuMemcpyAsync": FakeCUresult.CUDA_ERROR_INVALID_VALUE}
    with pytest.raises(CudaDriverError, match="cuMemcpyAsync: rank 0: copy a@0 -> a_gathered@0"):
        PlanExecutor(plan, 0, t[0], driver=drv).enqueue(3, 1)


def test_plan_executor_with_real_cuda_bindings_structs():
    """The executor's struct fields and enum names exist in cuda-python (no GPU needed: only the
    structs and enums are real, the calls go to the fake)."""
    cu = pytest.importorskip("cuda.bindings.driver")

    class Hybrid(FakeDriver):
        CUresult = cu.CUresult
        CUmemorytype = cu.CUmemorytype
        CUstreamWriteValue_flags = cu.CUstreamWriteValue_flags
        CUstreamWaitValue_flags = cu.CUstreamWaitValue_flags
        CUDA_MEMCPY2D = cu.CUDA_MEMCPY2D

        def _call(self, name, stream, op, record):
            self.calls.append((name, stream) + record)
            if op is not None:
                self.queues.setdefault(int(stream), deque()).append((name, op))
            return (cu.CUresult.CUDA_SUCCESS,)

    plan = PLANS["nd-clipped"]()
    mem, sigs = _device_memory(plan, 3, np.random.default_rng(2), {})
    want_m = [{k: v.copy() for k, v in m.items()} for m in mem]
    want_s = [{k: v.copy() for k, v in s.items()} for s in sigs]
    drv = Hybrid()
    t = _map_everything(drv, plan, mem, sigs)
    for r in range(3):
        PlanExecutor(plan, r, t[r], driver=drv).enqueue(10 + r, 1)
    drv.run()
    plan.run_numpy(want_m, want_s, 1)
    assert all(mem[r]["y"].tobytes() == want_m[r]["y"].tobytes() for r in range(3))
    for name in ("cuMemcpyAsync", "cuMemcpy2DAsync", "cuStreamWriteValue64", "cuStreamWaitValue64",
                 "cuLaunchKernel", "cuGetErrorName", "cuGetErrorString"):
        assert callable(getattr(cu, name))


def test_symmetric_addresses():
    bp = [0x1000_0000, 0x2000_0000, 0x3000_0000]
    # the tensor lies 512 bytes into its block (a pool allocation); a region 1024 bytes further in
    got = symmetric_addresses(bp, 1, 0x2000_0200, 4096, handle_offset=512, buffer_size=1 << 20, region_offset=1024)
    assert got == (0x1000_0600, 0x2000_0600, 0x3000_0600)
    assert symmetric_addresses(bp, 0, bp[0], 16) == tuple(bp)
    with pytest.raises(tl.InputError, match="handle says"):
        symmetric_addresses(bp, 1, 0x2000_0200, 16, handle_offset=0)
    with pytest.raises(tl.InputError, match="runs past"):
        symmetric_addresses(bp, 1, bp[1], 4096, buffer_size=4000)
    with pytest.raises(tl.InputError, match="null"):
        symmetric_addresses([bp[0], 0], 0, bp[0], 16)
    with pytest.raises(tl.InputError, match="before its block"):
        symmetric_addresses(bp, 2, bp[2] - 16, 16)


def test_layout_regions():
    regs, total = layout_regions([("stage", "buffer", (3, 5), "f32"), ("arrived", "signal", (7,), "u64"),
                                  ("a", "buffer", (4, 8), "bf16")], align=512)
    assert [(r.name, r.offset, r.nbytes) for r in regs] == [("stage", 0, 60), ("arrived", 512, 56), ("a", 1024, 64)]
    assert total == 1536 and all(r.offset % 512 == 0 for r in regs)
    with pytest.raises(tl.InputError, match="twice"):
        layout_regions([("x", "buffer", (1,), "f32"), ("x", "signal", (1,), "u64")])
    with pytest.raises(tl.InputError, match="u64 counters"):
        layout_regions([("s", "signal", (4,), "f32")])
    with pytest.raises(tl.InputError, match="empty shape"):
        layout_regions([("s", "buffer", (0, 4), "f32")])


# =================================================================================================
# communication kernels: pointer tables, parameter packing, launch
# =================================================================================================

class FakeKernel:
    """What load_kernel returns; ``kinds`` lets the fake driver decode the packed parameters."""

    def __init__(self, lowered):
        self.name = lowered.entry
        self.function = self
        self.smem_bytes = 0
        self.kinds = [p.kind for p in lowered.params]


def _rs_ir(W=2, Ms=20, N=24, comm=None):
    comm = comm or tl.CommSchedule(tile_m=8, mode="push", order="ring", sms=3)
    return gemm_reduce_scatter.trace(W, S((W * Ms, 16), tl.float16), S((16, N), tl.float16), S((Ms, N), tl.float16),
                                     compute=tl.ComputeSchedule(tile=(8, 16, 16), order="comm_aligned"), comm=comm)


def _fake_array(drv, shape, dtype):
    npdt = {"f16": np.float16, "bf16": np.uint16, "f32": np.float32, "u64": np.uint64, "i64": np.int64}[dtype]
    arr = np.zeros(shape, npdt)
    return DeviceArray(drv.map(arr), shape, dtype, owner=arr)


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_comm_kernel_tables_params_and_grid(mode):
    W, Ms, N = 3, 20, 24
    k = _rs_ir(W, Ms, N, tl.CommSchedule(tile_m=8, mode=mode, order="full_mesh", sms=2))
    lc = lower_comm(k, "reduce_scatter")
    bufs, slots = kernel_specs(k)
    stage = "reduce_scatter_recv" if mode == "push" else "reduce_scatter_send"
    drv = FakeDriver()
    rank = 1
    # every rank's copy of the symmetric stage buffer / arrived signal, as mapped on rank 1
    stage_copies = [_fake_array(drv, bufs[stage][0], "f32") for _ in range(W)]
    arrived_copies = [_fake_array(drv, (slots["reduce_scatter_arrived"],), "u64") for _ in range(W)]
    uploads = []

    def uploader(values):
        uploads.append(tuple(values))
        return drv.upload_u64(values)
    ck = CommKernel(lc, rank=rank, world_size=W, buffers=bufs, signal_slots=slots,
                    peers={stage: [a.ptr for a in stage_copies]},
                    peer_signals={"reduce_scatter_arrived": [a.ptr for a in arrived_copies]},
                    kernel=FakeKernel(lc), driver=drv, uploader=uploader)
    # the tables: uploaded once, W entries each, entry q = rank q's copy
    assert sorted(uploads) == sorted([tuple(a.ptr for a in stage_copies), tuple(a.ptr for a in arrived_copies)])
    assert drv.read_u64(ck.tables[f"peers:{stage}"].ptr, W) == [a.ptr for a in stage_copies]
    assert drv.read_u64(ck.tables["peer_signals:reduce_scatter_arrived"].ptr, W) == [a.ptr for a in arrived_copies]
    partial = _fake_array(drv, bufs["partial"][0], "f32")
    ready = _fake_array(drv, (slots["reduce_scatter_ready"],), "i64")
    for launch in (1, 2, 7):
        out = _fake_array(drv, bufs["out"][0], "f16")
        ck(stream=42, buffers={"partial": partial, "out": out, stage: stage_copies[rank]},
           signals={"reduce_scatter_ready": ready, "reduce_scatter_arrived": arrived_copies[rank]}, launch_index=launch)
        got = drv.launches[-1]
        assert got["grid"] == (2, 1, 1) == lc.grid() and got["block"] == lc.block and got["stream"] == 42
        assert got["smem"] == 0
        want = {"buffer:partial": partial.ptr, "buffer:out": out.ptr, f"buffer:{stage}": stage_copies[rank].ptr,
                f"peers:{stage}": ck.tables[f"peers:{stage}"].ptr,
                "signal:reduce_scatter_ready": ready.ptr, "signal:reduce_scatter_arrived": arrived_copies[rank].ptr,
                "peer_signals:reduce_scatter_arrived": ck.tables["peer_signals:reduce_scatter_arrived"].ptr,
                "rank": rank, "launch": launch}
        assert got["decoded"] == [want[p.source] for p in lc.params]      # the contract's order
    assert len(uploads) == 2                                            # not rebuilt per launch


def test_comm_kernel_rejects_wrong_arguments():
    W = 2
    k = _rs_ir(W)
    lc = lower_comm(k, "reduce_scatter")
    bufs, slots = kernel_specs(k)
    drv = FakeDriver()
    stage = [_fake_array(drv, bufs["reduce_scatter_recv"][0], "f32") for _ in range(W)]
    arrived = [_fake_array(drv, (slots["reduce_scatter_arrived"],), "u64") for _ in range(W)]
    common = dict(rank=0, world_size=W, buffers=bufs, signal_slots=slots, kernel=FakeKernel(lc), driver=drv,
                  uploader=drv.upload_u64)
    with pytest.raises(tl.InputError, match="reaches 'reduce_scatter_recv' on other ranks"):
        CommKernel(lc, peer_signals={"reduce_scatter_arrived": [a.ptr for a in arrived]}, **common)
    with pytest.raises(tl.InputError, match="3 entries for a world of 2"):
        CommKernel(lc, peers={"reduce_scatter_recv": [stage[0].ptr] * 3},
                   peer_signals={"reduce_scatter_arrived": [a.ptr for a in arrived]}, **common)
    with pytest.raises(tl.InputError, match="not 16-byte aligned"):
        CommKernel(lc, peers={"reduce_scatter_recv": [stage[0].ptr + 4, stage[1].ptr]},
                   peer_signals={"reduce_scatter_arrived": [a.ptr for a in arrived]}, **common)
    with pytest.raises(tl.InputError, match="traced for 2 ranks"):
        CommKernel(lc, **dict(common, world_size=3))
    ck = CommKernel(lc, peers={"reduce_scatter_recv": [s.ptr for s in stage]},
                    peer_signals={"reduce_scatter_arrived": [a.ptr for a in arrived]}, **common)
    partial = _fake_array(drv, bufs["partial"][0], "f32")
    out = _fake_array(drv, bufs["out"][0], "f16")
    ready = _fake_array(drv, (slots["reduce_scatter_ready"],), "i64")
    good_b = {"partial": partial, "out": out, "reduce_scatter_recv": stage[0]}
    good_s = {"reduce_scatter_ready": ready, "reduce_scatter_arrived": arrived[0]}
    cases = [
        (dict(good_b, out=_fake_array(drv, (3, 3), "f16")), good_s, 1, "'out' has shape"),
        (dict(good_b, out=_fake_array(drv, bufs["out"][0], "f32")), good_s, 1, "'out' is f32"),
        (dict(good_b, out=DeviceArray(out.ptr + 2, out.shape, "f16")), good_s, 1, "16-byte aligned"),
        ({k: v for k, v in good_b.items() if k != "partial"}, good_s, 1, "missing tensor 'partial'"),
        (dict(good_b, reduce_scatter_recv=stage[1]), good_s, 1, "pointer table gives rank 0's copy"),
        (good_b, dict(good_s, reduce_scatter_ready=_fake_array(drv, (1,), "i64")), 1, "counters"),
        (good_b, dict(good_s, reduce_scatter_arrived=arrived[1]), 1, "pointer table gives rank 0's copy"),
        (good_b, good_s, 0, "count from 1"),
        (dict(good_b, out=np.zeros(3)), good_s, 1, "must be a CUDA torch tensor"),
    ]
    for b, s, L, msg in cases:
        with pytest.raises(tl.InputError, match=msg):
            ck(stream=1, buffers=b, signals=s, launch_index=L)
    assert drv.launches == []
    drv.fail["cuLaunchKernel"] = FakeCUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaDriverError, match=r"cuLaunchKernel\(tldsl_gemm_reduce_scatter_reduce_scatter, grid"):
        ck(stream=1, buffers=good_b, signals=good_s, launch_index=3)


def test_comm_kernel_allgather_push_tables():
    """AG push: the kernel reads the local shard and writes every rank's gathered buffer and
    flags through the tables; the pull variant reads peers' shards and notifies locally."""
    W = 2
    for mode, want in (("push", {"buffer:a", "peers:a_gathered", "peer_signals:gather_a_ready", "rank", "launch"}),
                       ("pull", {"peers:a", "buffer:a_gathered", "signal:gather_a_ready", "rank", "launch"})):
        k = allgather_gemm.trace(W, S((40, 16), tl.bfloat16), S((16, 32), tl.bfloat16), S((80, 32), tl.bfloat16),
                                 compute=tl.ComputeSchedule(tile=(16, 16, 16)),
                                 comm=tl.CommSchedule(tile_m=16, mode=mode, sms=4))
        lc = lower(k, "gather_a")
        assert {p.source for p in lc.params} == want
        bufs, slots = kernel_specs(k)
        drv = FakeDriver()
        sym = "a_gathered" if mode == "push" else "a"
        copies = [_fake_array(drv, bufs[sym][0], "bf16") for _ in range(W)]
        flags = [_fake_array(drv, (slots["gather_a_ready"],), "u64") for _ in range(W)]
        ck = CommKernel(lc, rank=1, world_size=W, buffers=bufs, signal_slots=slots,
                        peers={sym: [c.ptr for c in copies]},
                        peer_signals={"gather_a_ready": [f.ptr for f in flags]} if mode == "push" else None,
                        kernel=FakeKernel(lc), driver=drv, uploader=drv.upload_u64)
        other = "a" if mode == "push" else "a_gathered"
        vals = ck(stream=9, buffers={other: _fake_array(drv, bufs[other][0], "bf16"), sym: copies[1]},
                  signals={"gather_a_ready": flags[1]}, launch_index=4)
        assert dict(vals)["launch"] == 4 and dict(vals)["rank"] == 1
        assert drv.launches[-1]["grid"] == (4, 1, 1)


def test_explain_address():
    entries = [("reduce_scatter_ready", 0x1000, 4, "local: GEMM tiles notify"), ("reduce_scatter_arrived", 0x2000, 2, "")]
    assert explain_address(0x1018, entries) == "reduce_scatter_ready[3] (local: GEMM tiles notify)"
    assert explain_address(0x2008, entries) == "reduce_scatter_arrived[1]"
    assert explain_address(0x1020, entries) is None and explain_address(0x1004, entries) is None


# =================================================================================================
# the autotuner
# =================================================================================================

from tldsl.runtime.dist.autotune import (AutotuneError, Autotuner, candidate_label, tune_key)  # noqa: E402

CANDS = [(tl.ComputeSchedule(tile=(128, 256, 64), stages=4, order=o), tl.CommSchedule(**c))
         for o in ("comm_aligned", "swizzled")
         for c in (dict(engine="copy_engine", mode="pull"), dict(engine="sm", mode="push", tile_m=128, sms=8))]
KEY = ("ag_gemm", [[8192, 28672, 8192]], "bfloat16", 2, "NVIDIA H200")


class FakeTimer:
    """Per-candidate CUDA-event times in ms (what cuda_event_timings would return)."""

    def __init__(self, times):
        self.times = times
        self.calls = []

    def __call__(self, cand):
        self.calls.append(cand)
        t = self.times[CANDS.index(cand)]
        if isinstance(t, Exception):
            raise t
        return t


def test_autotune_picks_the_fastest_median_and_caches(tmp_path):
    # candidate 2 has the lowest median (one slow outlier does not matter), candidate 0 the lowest mean-killer
    timer = FakeTimer([[1.0, 1.0, 9.0], [1.2, 1.1, 1.3], [0.9, 5.0, 0.95, 0.97, 0.96], [1.0, 0.99, 1.01]])
    tuner = Autotuner(tmp_path, version="0.1.0")
    logged = []
    res = tuner.tune(*KEY, CANDS, timer, log=logged.append)
    assert res.best is CANDS[2] and not res.cached and res.median_ms == pytest.approx(0.96)
    assert timer.calls == CANDS and [t.label for t in logged] == [candidate_label(c) for c in CANDS]
    assert res.path.exists() and res.path.parent == tmp_path / "autotune"
    assert "**best**" in res.table() and res.table().count("\n") == len(CANDS) + 1
    # a second tuner (another process) finds it: nothing is measured
    timer2 = FakeTimer([[0.1]] * 4)
    res2 = Autotuner(tmp_path, version="0.1.0").tune(*KEY, CANDS, timer2)
    assert res2.cached and res2.best is CANDS[2] and timer2.calls == []
    assert [t.median_ms for t in res2.trials][2] == pytest.approx(0.96)
    # force re-measures
    assert Autotuner(tmp_path, version="0.1.0").tune(*KEY, CANDS, timer2, force=True).best is CANDS[0]


@pytest.mark.parametrize("change", ["op", "shapes", "dtype", "world", "gpu", "version"])
def test_autotune_key_changes_miss_the_cache(tmp_path, change):
    Autotuner(tmp_path, version="0.1.0").tune(*KEY, CANDS, FakeTimer([[1.0], [2.0], [3.0], [4.0]]))
    op, shapes, dtype, world, gpu = KEY
    version = "0.1.0"
    if change == "op":
        op = "gemm_rs"
    elif change == "shapes":
        shapes = [[4096, 28672, 8192]]
    elif change == "dtype":
        dtype = "float16"
    elif change == "world":
        world = 4
    elif change == "gpu":
        gpu = "NVIDIA H100 80GB HBM3"
    else:
        version = "0.2.0"
    assert tune_key(op, shapes, dtype, world, gpu, version) != tune_key(*KEY, "0.1.0")
    timer = FakeTimer([[4.0], [3.0], [2.0], [1.0]])
    res = Autotuner(tmp_path, version=version).tune(op, shapes, dtype, world, gpu, CANDS, timer)
    assert not res.cached and res.best is CANDS[3] and len(timer.calls) == 4


def test_autotune_cache_dir_is_the_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TLDSL_CACHE_DIR", str(tmp_path / "kc"))
    res = Autotuner().tune(*KEY, CANDS, FakeTimer([[1.0]] * 4))
    assert res.path.parent == tmp_path / "kc" / "autotune" and res.best is CANDS[0]


def test_autotune_stale_or_broken_cache_entries(tmp_path):
    tuner = Autotuner(tmp_path, version="0.1.0")
    res = tuner.tune(*KEY, CANDS, FakeTimer([[1.0], [2.0], [3.0], [4.0]]))
    # the cached winner is no longer a candidate: measure again among the others
    timer = FakeTimer([None, [2.0], [3.0], [1.5]])
    res2 = tuner.tune(*KEY, CANDS[1:], timer)
    assert not res2.cached and res2.best is CANDS[3] and timer.calls == CANDS[1:]
    # a damaged file is a miss and gets rewritten
    res.path.write_text("{not json")
    res3 = tuner.tune(*KEY, CANDS, FakeTimer([[5.0], [1.0], [5.0], [5.0]]))
    assert not res3.cached and res3.best is CANDS[1]
    assert tuner.tune(*KEY, CANDS, FakeTimer([[9.0]] * 4)).cached


def test_autotune_failures_are_skipped_and_all_failing_raises(tmp_path):
    tuner = Autotuner(tmp_path, version="0.1.0")
    timer = FakeTimer([RuntimeError("lowering rejected it"), [2.0], [float("nan")], [1.5]])
    res = tuner.tune(*KEY, CANDS, timer)
    assert res.best is CANDS[3]
    errs = {t.label: t.error for t in res.trials}
    assert "lowering rejected it" in errs[candidate_label(CANDS[0])] and "no usable times" in errs[candidate_label(CANDS[2])]
    with pytest.raises(AutotuneError, match="every candidate failed"):
        Autotuner(tmp_path / "x").tune(*KEY, CANDS, FakeTimer([RuntimeError("no")] * 4))
    with pytest.raises(AutotuneError, match="duplicate"):
        tuner.tune(*KEY, [CANDS[0], CANDS[0]], timer)


class FakeCollective:
    """Rank ``rank`` of two: the other rank's medians and flags are given; rank 0's cache
    lookup result is what broadcast returns on rank 1."""

    def __init__(self, rank, other_medians, other_ok, rank0_doc=None):
        self.rank = rank
        self.other_medians = list(other_medians)
        self.other_ok = list(other_ok)
        self.rank0_doc = rank0_doc
        self.calls = []

    def broadcast(self, obj):
        self.calls.append("broadcast")
        return obj if self.rank == 0 else self.rank0_doc

    def max(self, x):
        self.calls.append("max")
        return max(x, self.other_medians.pop(0))

    def all_ok(self, ok):
        self.calls.append("all_ok")
        return ok and self.other_ok.pop(0)


def test_autotune_agrees_across_ranks(tmp_path):
    # rank 1: locally candidate 0 is fastest, but the slowest rank's medians make candidate 1 win;
    # candidate 2 failed on the other rank only; the other rank's fails do not reach max()
    coll = FakeCollective(1, [5.0, 2.0, 2.5], [True, True, False, True])
    timer = FakeTimer([[1.0], [1.5], [0.5], [1.8]])
    res = Autotuner(tmp_path, collective=coll, version="0.1.0").tune(*KEY, CANDS, timer)
    assert res.best is CANDS[1] and res.median_ms == 2.0
    assert [t.error for t in res.trials][2] == "failed on another rank"
    assert coll.calls == ["broadcast", "all_ok", "max", "all_ok", "max", "all_ok", "all_ok", "max"]
    assert not (tmp_path / "autotune").exists()                 # only rank 0 writes
    # rank 1 without a local file follows rank 0's cached choice
    doc = {"format": 1, "key": tune_key(*KEY, "0.1.0"), "best": candidate_label(CANDS[3]), "median_ms": 1.0}
    coll = FakeCollective(1, [], [], rank0_doc=doc)
    t2 = FakeTimer([[1.0]] * 4)
    res = Autotuner(tmp_path, collective=coll, version="0.1.0").tune(*KEY, CANDS, t2)
    assert res.cached and res.best is CANDS[3] and t2.calls == []


def test_autotune_refuses_a_cache_dir_it_cannot_write_before_measuring(tmp_path, monkeypatch):
    """Found by a helper's round: TLDSL_CACHE_DIR naming a file let the tuner compile and time every
    candidate, then fail writing its choice with NotADirectoryError. Now an InputError naming the
    variable and the path, before any candidate is measured, as the kernel cache refuses it."""
    not_a_folder = tmp_path / "cache.txt"
    not_a_folder.write_text("")
    monkeypatch.setenv("TLDSL_CACHE_DIR", str(not_a_folder))
    timer = FakeTimer([[1.0]] * 4)
    with pytest.raises(tl.InputError, match=rf"TLDSL_CACHE_DIR='{not_a_folder}': {not_a_folder} is not a folder"):
        Autotuner(version="0.1.0").tune(*KEY, CANDS, timer)
    assert timer.calls == []
    # a caller's folder whose autotune/ is a file: named as the caller's
    (tmp_path / "kc").mkdir()
    (tmp_path / "kc" / "autotune").write_text("")
    with pytest.raises(tl.InputError, match=f"the cache folder {tmp_path / 'kc'}: .*autotune is not a folder"):
        Autotuner(tmp_path / "kc", version="0.1.0").tune(*KEY, CANDS, timer)
    assert timer.calls == [] and not_a_folder.read_text() == ""


def test_autotune_refuses_a_read_only_cache_dir_before_measuring(tmp_path, monkeypatch):
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        if os.access(read_only, os.W_OK):          # root writes anyway: the folder as another user sees it
            access = os.access
            monkeypatch.setattr(os, "access", lambda p, mode, **kw: (not (mode & os.W_OK) or Path(p) != read_only)
                                and access(p, mode, **kw))
        monkeypatch.setenv("TLDSL_CACHE_DIR", str(read_only))
        timer = FakeTimer([[1.0]] * 4)
        with pytest.raises(tl.InputError, match=rf"TLDSL_CACHE_DIR='{read_only}': {read_only} is not writable"):
            Autotuner(version="0.1.0").tune(*KEY, CANDS, timer)
        assert timer.calls == []
    finally:
        read_only.chmod(0o700)


# =================================================================================================
# GEMM+RS and AG+GEMM: what is decided before anything touches a GPU
# =================================================================================================

from tldsl.runtime.dist.ag_gemm import resolve_comm  # noqa: E402
from tldsl.runtime.dist.gemm_rs import DEFAULT_COMPUTE, check_problem, default_comm, default_sm_comm, validate_operands  # noqa: E402


def test_allgather_dtype_is_checked_before_anything_is_built(proto, monkeypatch, fake_ag):
    """AllGather+GEMM takes bfloat16 or float16 (torch dtypes or their names); anything else is an
    InputError before any memory is allocated — not an fp16 kernel reading other bytes."""
    AllGatherMatmul, torch = fake_ag
    for bad in (torch.float32, "int8", "float64", "bogus"):
        with pytest.raises(tl.InputError, match="AllGather\\+GEMM runs on bfloat16 or float16"):
            AllGatherMatmul(1024, 1032, 3000, bad)
    assert AllGatherMatmul(1024, 1032, 3000, "float16").dtype == torch.float16
    assert AllGatherMatmul(1024, 1032, 3000, torch.bfloat16).dtype == torch.bfloat16


def test_gemm_rs_problem_checks():
    assert check_problem(4091 * 2, 1032, 3000, 2, "bfloat16") == "bf16"
    assert check_problem(64, 64, 64, 4, "torch.float16") == "f16"
    for args, msg in [((4091, 1032, 3000, 2, "bfloat16"), "M must be divisible by the world size"),
                      ((8, 1030, 64, 2, "bfloat16"), "K a multiple of 8"),
                      ((8, 1024, 60, 2, "bfloat16"), "N a multiple of 8"),
                      ((8, 64, 64, 2, "float32"), "bfloat16 or float16"),
                      ((0, 64, 64, 2, "bfloat16"), "positive int"),
                      ((8, 64, 64, 0, "bfloat16"), "world size")]:
        with pytest.raises(tl.InputError, match=msg):
            check_problem(*args)
    c = default_comm(DEFAULT_COMPUTE)
    assert (c.engine, c.mode) == ("copy_engine", "push")                   # the measured default
    c = default_sm_comm(DEFAULT_COMPUTE)
    assert (c.engine, c.mode, c.tile_m, c.sms) == ("sm", "push", 64, 16)
    assert default_comm(DEFAULT_COMPUTE, sms=8) == default_sm_comm(DEFAULT_COMPUTE, 8)


def test_gemm_rs_default_schedules_lower():
    """The default schedules of the op lower for the odd-M shape the checks use (W=2): a GEMM with
    one notify per tile and a reduce-scatter kernel on `sms` CTAs, its tables as the runtime builds."""
    W, M, K, N = 2, 4091 * 2, 1032, 3000
    comm = default_sm_comm(DEFAULT_COMPUTE)
    k = gemm_reduce_scatter.trace(W, S((M, K), tl.bfloat16), S((K, N), tl.bfloat16), S((M // W, N), tl.bfloat16),
                                  compute=DEFAULT_COMPUTE, comm=comm)
    g, c = lower(k, "gemm"), lower(k, "reduce_scatter")
    assert g.notifies == 1 and g.signals == () and g.notify_signals == ("reduce_scatter_ready",)
    assert c.grid() == (16, 1, 1) and {p.source for p in c.params} >= {"peers:reduce_scatter_recv",
                                                                        "peer_signals:reduce_scatter_arrived"}
    assert [b.name for b in k.buffers if b.symmetric] == ["reduce_scatter_recv"]


def test_gemm_rs_validate_operands_reports_every_problem():
    torch = pytest.importorskip("torch")
    a = torch.zeros(16, 8, dtype=torch.bfloat16)
    b = torch.zeros(8, 24, dtype=torch.float16).t()          # wrong dtype, transposed (not contiguous)
    with pytest.raises(tl.InputError) as e:
        validate_operands(a, b, m=16, k=8, n=32, dtype=torch.bfloat16)
    msg = str(e.value)
    assert "A must be a CUDA tensor" in msg and "B must be a CUDA tensor" in msg
    assert "B has shape (24, 8); this op was built for (8, 32)" in msg
    assert "B is torch.float16" in msg and "B must be contiguous" in msg
    with pytest.raises(tl.InputError, match="A must be a torch tensor"):
        validate_operands(np.zeros((16, 8)), a, m=16, k=8, n=8, dtype=torch.bfloat16)


def test_allgather_engine_choices():
    c = DEFAULT_COMPUTE
    assert resolve_comm(None, None, None, c) == tl.CommSchedule(engine="copy_engine", mode="pull", order="ring")
    sm = resolve_comm(None, "sm", 12, c)
    assert (sm.engine, sm.mode, sm.tile_m, sm.sms) == ("sm", "pull", 128, 12)
    assert resolve_comm(None, "sm", None, c).sms == 8
    push = tl.CommSchedule(engine="sm", mode="push", tile_m=64, sms=4)
    assert resolve_comm(push, "sm", 4, c) is push
    for args, msg in [((push, "copy_engine", None), "contradicts"), ((push, None, 8), "contradicts"),
                      ((None, None, 8), "uses no SMs"), ((None, "nvlink", None), "choose 'copy_engine' or 'sm'")]:
        with pytest.raises(tl.InputError, match=msg):
            resolve_comm(*args, c)


# =================================================================================================
# the distributed checks' host-side logic
# =================================================================================================

from tldsl.checks import dist_check as dc  # noqa: E402


def test_summarize_log_reads_a_dist_check_run():
    """The GPU test's verdict on a dist_check log (lines as a 2x H200 run printed them, some
    prefixed by torchrun): every check PASS and the closing line, or it failed."""
    from tldsl.checks import dist_check as dc
    good = ("W1130 05:10:01.123 torch/distributed/run.py: Setting OMP_NUM_THREADS\n"
            "dist_check ag_gemm/copy_engine odd_m: PASS (5 iterations, max err 0.0039)\n"
            "[rank0]: dist_check ag_gemm/copy_engine streams: PASS (24 launches)\n"
            "[tldsl] tldsl_allgather_gemm_gemm: compiled in 2.6 s\n"
            "dist_check: all passed\n")
    lines, passed = dc.summarize_log(good)
    assert passed and len(lines) == 3 and lines[1].startswith("[rank0]: dist_check ag_gemm/copy_engine streams")
    assert not dc.summarize_log(good.replace("streams: PASS", "streams: FAIL"))[1]
    assert not dc.summarize_log(good.replace("dist_check: all passed", "dist_check: 1 check(s) FAILED"))[1]
    assert not dc.summarize_log("dist_check: all passed\n")[1]              # no check ran
    assert not dc.summarize_log(good.rsplit("dist_check:", 1)[0])[1]        # cut off before the end


def test_explain_log_decodes_stuck_waits():
    log = "\n".join([
        dc.map_line(0, "reduce_scatter_ready", 0x7f0000001000, 64, "rank 0, local: the GEMM's tiles notify"),
        dc.map_line(0, "reduce_scatter_arrived", 0x7f0000200000, 32, "rank 0, symmetric: peers notify"),
        dc.map_line(1, "reduce_scatter_ready", 0x7f0000005000, 64, "rank 1, local"),
        "[rank1]: some other output",
        "tldsl: wait timed out: slot 0x7f0000200018 holds 4, needs 5 (block 3, thread 0)",
        "tldsl: wait timed out: slot 0x7f0000005010 holds 6, needs 9 (block 0, thread 0)",
        "tldsl: wait timed out: slot 0x7f00deadbeef holds 0, needs 1 (block 0, thread 0)",
    ])
    out = dc.explain_log(log)
    assert out[0].endswith("reduce_scatter_arrived[3] of rank 0 (rank 0, symmetric: peers notify) — 1 notify(s) missing")
    assert "reduce_scatter_ready[2] of rank 1 (rank 1, local) — 3 notify(s) missing" in out[1]
    assert "not in any printed signal map" in out[2]
    assert dc.explain_log("[FATAL] CUDASymmetricMemory::barrier: rank 0 failed")[-1].startswith("a torch symmetric")
    assert dc.explain_log("nothing here") == []


def test_explain_command(tmp_path, capsys):
    f = tmp_path / "log.txt"
    f.write_text(dc.map_line(2, "gather_a_ready", 0x1000, 4) + "\n"
                 "tldsl: wait timed out: slot 0x1008 holds 0, needs 2 (block 7, thread 0)\n")
    assert dc.main(["explain", str(f)]) == 0
    assert "gather_a_ready[1] of rank 2 — 2 notify(s) missing" in capsys.readouterr().out


def test_missing_notifies():
    per = {"ready": [2, 2, 1], "arrived": [1]}
    got = dc.missing_notifies({"ready": [6, 5, 3], "arrived": [2]}, per, 3)
    assert got == ["ready[1] = 5 < 6 (2 per launch)", "arrived[0] = 2 < 3 (1 per launch)"]
    assert dc.missing_notifies({"ready": [0]}, None, 1) == []


def test_compare_finds_unwritten_and_wrong_tiles():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(300, 64, generator=g)
    good = ref.to(torch.bfloat16)
    res = dc.compare(good, ref)
    assert res["ok"] and res["n_bad"] == 0 and res["max_err"] < 0.02
    bad = good.clone()
    bad[130:140] = float("nan")
    bad[290, 5] += 1.0
    res = dc.compare(bad, ref)
    assert not res["ok"] and res["n_nan"] == 640 and res["n_bad"] == 641
    assert "row blocks [128, 256), [256, 384)" in res["detail"] and "first at (130, 0)" in res["detail"]
    assert not dc.compare(good[:10], ref)["ok"]
    # an elementwise slack (rounding the op does and the reference does not) widens only where given
    off = ref.clone()
    off[3, 3] += 5.0
    assert not dc.compare(off, ref)["ok"]
    slack = torch.zeros_like(ref)
    slack[3, 3] = 5.0
    assert dc.compare(off, ref, slack=slack)["ok"]
    off[4, 4] += 5.0
    assert not dc.compare(off, ref, slack=slack)["ok"]


def test_dist_check_lists_variants_without_a_gpu(capsys):
    assert dc.main(["all", "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "ag_gemm/copy_engine-f16 (float16): defaults" in out and "gemm_rs/sm-pull (bfloat16)" in "\n".join(out)
    assert [l.split(" (")[0] for l in out] == ["ag_gemm/copy_engine", "ag_gemm/copy_engine-kernel",
                                              "ag_gemm/copy_engine-memops", "ag_gemm/copy_engine-comm_first",
                                              "ag_gemm/copy_engine-gemm_staging",
                                              "ag_gemm/copy_engine-plan", "ag_gemm/copy_engine-push",
                                              "ag_gemm/copy_engine-push-direct", "ag_gemm/copy_engine-push-sliced", "ag_gemm/copy_engine-push-sliced-plan", "ag_gemm/copy_engine-f16", "ag_gemm/copy_engine-push-sliced-f16", "ag_gemm/gemm-push",
                                              "ag_gemm/sm-pull", "ag_gemm/sm-push", "ag_gemm/sm-push-nvshmem",
                                              "ag_gemm/sm-push-f16",
                                              "gemm_rs/copy_engine", "gemm_rs/copy_engine-f16", "gemm_rs/copy_engine-f32",
                                                  "gemm_rs/copy_engine-epilogue", "gemm_rs/copy_engine-epilogue-f32",
                                                  "gemm_rs/sm-push",
                                              "gemm_rs/sm-push-f32", "gemm_rs/sm-push-f16", "gemm_rs/copy_engine-epilogue-f16",
                                              "gemm_rs/sm-push-nvshmem",
                                              "gemm_rs/sm-pull",
                                              "gemm_rs/sm-push-full_mesh"]
    assert dc.main(["gemm_rs", "--variants", "gemm_rs/sm-pull", "--list"]) == 0
    assert capsys.readouterr().out.startswith("gemm_rs/sm-pull (bfloat16):")
    with pytest.raises(SystemExit, match="unknown check"):
        dc.main(["ag_gemm", "--checks", "odd_m,nope"])
    with pytest.raises(SystemExit, match="unknown variant"):
        dc.main(["ag_gemm", "--variants", "sm-sideways", "--list"])


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
def test_dist_check_variants_lower_at_their_sizes(op):
    """Every variant the checks build traces and lowers at the checks' sizes (W=2): what can fail
    without a GPU fails here, not on the GPU host."""
    from tldsl.runtime.dist.ag_gemm import DEFAULT_COMPUTE as AG_COMPUTE
    from tldsl.runtime.dist.gemm_rs import DEFAULT_COMPUTE as RS_COMPUTE, traced_comm
    W = 2
    for v in dc.variants(op):
        kw = dict(v.kwargs)
        dt = {"bfloat16": tl.bfloat16, "float16": tl.float16}[v.dtype]
        for check in dc.CHECKS:
            rows, k, n = dc.sizes(check, W, v)
            if op == "ag_gemm":
                comm = resolve_comm(kw.get("comm"), kw.get("engine"), None, AG_COMPUTE)
                ir = allgather_gemm.trace(W, S((rows, k), dt), S((k, n), dt),
                                          S((W * rows, n), dt), compute=AG_COMPUTE, comm=comm)
                comm_part = "gather_a"
            else:
                comm = kw.get("comm") or (default_sm_comm if kw.get("engine") == "sm" else default_comm)(RS_COMPUTE)
                ir = gemm_reduce_scatter.trace(W, S((W * rows, k), dt), S((k, n), dt),
                                               S((rows, n), dt), compute=RS_COMPUTE,
                                               comm=traced_comm(comm, rows, RS_COMPUTE))
                comm_part = "reduce_scatter" if comm.engine == "sm" else None    # copy engine: the runtime's copies
            g = lower(ir, "gemm")
            if comm_part is None:
                assert g.M == (W * rows) and g.notifies > 0
                continue
            c = lower(ir, comm_part)
            assert g.M == (W * rows) and g.N == n and g.K == k
            if v.sm_comm:
                assert c.grid()[0] == min(comm.sms, c.num_tasks)      # lanes, never more than tasks
            else:
                slices = 1 if comm.col_tile is None else -(-k // comm.col_tile)      # a copy + a write each
                assert c.world_size == W and len(c.actions[0]) == 2 * W * slices


# =================================================================================================
# launch protocols of the fused ops, with the device layer faked
# =================================================================================================
# torch's stream / event calls (cuStreamWaitEvent, cuEventRecord...), its symmetric memory and the
# GEMM launcher are replaced by recorders writing into the fake driver's call log, next to the
# driver calls the real CommKernel / PlanExecutor issue; tensors are CPU tensors. The assertions
# are the protocols of the module docstrings: what each launch enqueues, on which stream, in which
# order, with which launch index.

class _Proto:
    def __init__(self, monkeypatch):
        torch = pytest.importorskip("torch")
        from tldsl.runtime.dist import ag_gemm as agm, comm_kernel as ckm, gemm_rs as grs
        from tldsl.runtime.gpu import plan_exec as pem
        from tldsl.runtime.gpu import gemm as gkm, module as modm
        from tldsl.codegen import LoweredComm
        self.torch, self.drv = torch, FakeDriver()
        log = self.drv.calls
        nums = itertools.count(1)
        proto = self
        import torch.distributed._symmetric_memory as sm     # allocations through a lease: CPU tensors here
        monkeypatch.setattr(sm, "empty", lambda size, dtype=None, device=None: torch.empty(size, dtype=dtype))
        monkeypatch.setattr(sm, "rendezvous", lambda t, group_name: None)

        class Stream:
            def __init__(self, device=None):
                self.cuda_stream = 1000 + next(nums)

            def wait_event(self, ev):
                log.append(("cuStreamWaitEvent", self.cuda_stream, ev.n))

            def wait_stream(self, other):
                log.append(("wait_stream", self.cuda_stream, other.cuda_stream))

        class Event:
            def __init__(self):
                self.n = next(nums)

            def record(self, s=None):
                log.append(("cuEventRecord", (s or proto.cur).cuda_stream, self.n))

        self.cur = Stream()
        self.current = [self.cur]

        class _StreamCtx:
            def __init__(self, s):
                self.s = s

            def __enter__(self):
                proto.current.append(self.s)

            def __exit__(self, *a):
                proto.current.pop()

        def cpu(f):
            def g(*a, **k):
                k.pop("device", None)
                return f(*a, **k)
            return g
        mp = monkeypatch
        mp.setattr(torch.cuda, "Stream", Stream)
        mp.setattr(torch.cuda, "Event", Event)
        mp.setattr(torch.cuda, "current_stream", lambda device=None: proto.current[-1])
        mp.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: proto.current[-1].cuda_stream, raising=False)
        mp.setattr(torch.cuda, "stream", _StreamCtx)
        mp.setattr(torch.cuda, "synchronize", lambda *a: log.append(("synchronize",)))
        mp.setattr(torch.Tensor, "record_stream", lambda t, s: None)
        for name in ("empty", "zeros", "full"):
            mp.setattr(torch, name, cpu(getattr(torch, name)))

        class Ctx:
            rank, world_size, device, group, group_name, backend = 1, 2, 0, None, "g", "CUDA"
        for m in (grs, agm):
            mp.setattr(m, "dist_context", lambda group=None: Ctx())

        class Gemm:
            def __init__(self, lowered, compiled=None, progress=None, reserve_sms=0):
                self.lowered, self.reserve = lowered, reserve_sms
                self.grid = (132 - reserve_sms, 1, 1)

            def __call__(self, buffers=None, *, signals=None, launch_index=1, rank=0, stream=None):
                for spec in self.lowered.tma:
                    assert tuple(buffers[spec.buffer].shape) == tuple(reversed(spec.global_dims)), spec.buffer
                assert set(signals) == set(self.lowered.signals + self.lowered.notify_signals)
                log.append(("GEMM", (stream or proto.current[-1]).cuda_stream, launch_index, self.grid[0], rank))

            def prepare(self, buffers, signals=None, rank=0, hold=True):
                assert not hold, "the op caches its prepared launches by address: they must not hold its tensors"
                for spec in self.lowered.tma:
                    assert tuple(buffers[spec.buffer].shape) == tuple(reversed(spec.global_dims)), spec.buffer
                for name, shape, _ in getattr(self.lowered, "data_buffers", ()):
                    assert tuple(buffers[name].shape) == shape, name
                own = getattr(self.lowered, "row_signals", ())       # own_rows / push_rows: by the IR's names
                assert set(signals) == set(self.lowered.signals + self.lowered.notify_signals + own)
                proto.prepared += 1
                proto.gemm_args = (buffers, signals)
                return SimpleNamespace(launch=lambda stream, L: log.append(("GEMM", stream, L, self.grid[0], rank)))
        mp.setattr(gkm, "GemmKernel", Gemm)
        self.prepared = 0

        class Handle:
            def __init__(self, raw):
                self.buffer_ptrs = [raw.data_ptr() if q == 1 else 0x7100_0000_0000 + q * 0x1_0000_0000 for q in range(2)]
                self.offset, self.buffer_size = 0, raw.numel()

            def barrier(self, channel=0, timeout_ms=0):
                log.append(("BARRIER", proto.current[-1].cuda_stream))

            def get_buffer(self, rank, sizes, dtype, storage_offset=0):
                """A peer's buffer as a tensor: a CPU tensor stands in (its contents are not checked)."""
                t = torch.empty(sizes, dtype=dtype)
                proto.peer_buffers[rank] = t
                return t

        self.Handle = Handle
        self.peer_buffers = {}

        class Workspace(ckm.SymmetricWorkspace):
            def __init__(self, ctx, specs, align=512, lease=None):
                from tldsl.runtime.dist.symmetric import Lease
                self.ctx = ctx
                self.regions, self.total_bytes = layout_regions(specs, align)
                self._own_lease = lease is None
                self.lease = lease or Lease(ctx, "workspace", self)
                raw, _ = self.lease.empty(self.total_bytes + 512, torch.uint8)
                pad = (-raw.data_ptr()) % 512
                self.raw = raw[pad:pad + self.total_bytes]
                self.handle = Handle(self.raw)
                self.addresses, self.tensors = {}, {}
                for r in self.regions:
                    self.addresses[r.name] = pem.symmetric_addresses(self.handle.buffer_ptrs, 1, self.raw.data_ptr(),
                                                                     r.nbytes, region_offset=r.offset)
                    t = self.raw[r.offset:r.offset + r.nbytes].view(getattr(torch, ckm._TORCH_DTYPES[r.dtype]))
                    self.tensors[r.name] = t.view(r.shape)
                    if r.kind == "signal":
                        t.zero_()
                log.append(("rendezvous", tuple(r.name for r in self.regions)))
        mp.setattr(ckm, "SymmetricWorkspace", Workspace)
        mp.setattr(ckm, "torch_uploader", self.drv.upload_u64)
        kinds = {}

        def compile_comm(lc, **kw):          # every communication kernel is compiled before it is loaded
            kinds[lc.entry] = [p.kind for p in lc.params]
            return SimpleNamespace(cubin=lc.entry.encode())
        mp.setattr(LoweredComm, "compile", compile_comm)

        def load_kernel(cubin, name, smem=0):
            return SimpleNamespace(name=name, function=SimpleNamespace(kinds=kinds[name]), smem_bytes=0)
        mp.setattr(modm, "load_kernel", load_kernel)

        from tldsl.codegen.toolchain import compiler as cpm
        from tldsl.runtime.dist import staging as stm
        kinds[stm.ENTRY] = ["ptr", "ptr", "ptr", "u64", "ptr", "u64"]
        kinds[stm.PUBLISH_ENTRY] = kinds[stm.ENTRY] + ["ptr", "ptr", "i32", "i32", "ptr"]
        real_compile = cpm.compile_cuda
        mp.setattr(cpm, "compile_cuda", lambda src, entry, **kw: SimpleNamespace(cubin=entry.encode())
                   if entry in (stm.ENTRY, stm.PUBLISH_ENTRY) else real_compile(src, entry, **kw))
        from tldsl.runtime.gpu import device as devm
        mp.setattr(devm, "sm_count", lambda: 132)

        def as_array(x, what="tensor"):
            if isinstance(x, DeviceArray):
                return x
            return DeviceArray(x.data_ptr(), tuple(x.shape), pem._TORCH_TO_IR[str(x.dtype)], owner=x)
        mp.setattr(ckm, "as_device_array", as_array)
        mp.setattr(ckm, "load_driver", lambda: self.drv)
        mp.setattr(pem, "load_driver", lambda: self.drv)
        mp.setattr(grs, "validate_operands", lambda *a, **k: None)        # CPU tensors: tested separately
        mp.setattr(agm.AllGatherMatmul, "_check", lambda self, a, b: None)

    def events(self):
        out = [c for c in self.drv.calls if c[0] not in ("synchronize",)]
        self.drv.calls.clear()
        return out


@pytest.fixture
def proto(monkeypatch):
    return _Proto(monkeypatch)


def test_gemm_rs_sm_schedule_choices(proto):
    """engine='sm' is the tile program on the fused-op runtime (its launches: tests/test_program_engine.py);
    a schedule that contradicts it is refused, and its default gives a short K 24 SMs."""
    from tldsl.runtime.dist.gemm_rs import DEFAULT_COMPUTE, MatmulReduceScatter, default_sm_comm
    with pytest.raises(tl.InputError, match="contradicts"):
        MatmulReduceScatter(4091 * 2, 1032, 3000, "bfloat16", engine="sm",
                            comm=tl.CommSchedule(engine="copy_engine", mode="push"))
    assert default_sm_comm(DEFAULT_COMPUTE, m=8182, k=1032).sms == 24


def test_gemm_rs_copy_engine_protocol(proto):
    """engine='copy_engine': the GEMM on every SM; the copy stream's handshake, then per chunk of
    the peer's rows a wait on the GEMM's ready counter (the count of producer tiles overlapping
    the chunk, times L) and one NVLink copy into slot `rank` of the peer's receive buffer, then
    the peer's done slot; the compute stream waits for every peer's done slot and sums."""
    from tldsl.runtime.dist.gemm_rs import MatmulReduceScatter
    torch = proto.torch
    with pytest.raises(tl.InputError, match="mode='push'"):
        MatmulReduceScatter(8182, 1032, 3000, "bfloat16", comm=tl.CommSchedule(engine="copy_engine"))
    M, K, N = 4091 * 2, 1032, 3000
    op = MatmulReduceScatter(M, K, N, "bfloat16")                   # the copy engine: the default
    eng = op._engine
    assert op.comm == tl.CommSchedule(engine="copy_engine", mode="push")
    assert op._engine.gemm.reserve == 0 and op.lanes == 0                    # the GEMM gets every SM
    assert (eng.rows, eng.tpr) == (1024, 4)                          # 4091 rows: 4 chunks of whole 128-row tiles
    assert op.ir.comm_schedule == op.comm.with_(tile_m=1024)          # the tile program the simulator checks
    # the plan's waits, recomputed from the GEMM's tile grid: tiles overlapping each chunk of rank 0's rows
    BM, BN = op.compute.BM, op.compute.BN
    tn = -(-N // BN)
    counts = []
    for j in range(eng.tpr):
        lo, hi = j * eng.rows, min((j + 1) * eng.rows, op.Ms)
        counts.append(sum(tn for pm in range(-(-M // BM)) if pm * BM < hi and min(pm * BM + BM, M) > lo))
    assert [st for st in eng.steps if st[0] == "wait"] == [("wait", j, counts[j]) for j in range(4)]
    # and for our own chunks (rows [4091, 8182): not tile-aligned, so other counts)
    own_counts = []
    for j in range(eng.tpr):
        lo, hi = op.Ms + j * eng.rows, op.Ms + min((j + 1) * eng.rows, op.Ms)
        own_counts.append(sum(tn for pm in range(-(-M // BM)) if pm * BM < hi and min(pm * BM + BM, M) > lo))
    assert [c for c, _, _ in eng.own_chunks] == own_counts
    assert not eng.early_sum                  # 24 MiB of our rows (under 32): the sum after the GEMM by default ...
    eng.early_sum = True                      # ... the early sum (the default from 32 MiB) checked here
    assert eng.arrivals == [(0, 4)]                                   # rank 0 notifies 4 chunks per launch
    proto.events()
    cs, cur = eng.copy_stream.cuda_stream, proto.cur.cuda_stream
    a, b = torch.zeros(M, K, dtype=torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16)
    arrive, done = eng.ws.peers("handshake_arrive"), eng.ws.peers("reduce_scatter_done")
    recv = eng.ws.peers("reduce_scatter_recv")
    ready, part, rb = op._engine.ready.data_ptr(), op._engine.partial.data_ptr(), N * 2
    for L in (1, 2):
        op._engine.partial.copy_(torch.randn(M, N).to(torch.bfloat16))
        eng.recv[0].copy_(torch.randn(op.Ms, N).to(torch.bfloat16))     # what rank 0 sent us
        out = op(a, b)
        ev = proto.events()
        names = [e[0] for e in ev]
        assert names == (["cuEventRecord", "GEMM", "cuStreamWaitEvent", "cuStreamWriteValue64", "cuStreamWaitValue64"]
                         + ["cuStreamWaitValue64", "cuMemcpyAsync"] * 4
                         + ["cuStreamWriteValue64"] + ["cuStreamWaitValue64"] * 4 + ["cuEventRecord"]
                         + ["cuStreamWaitValue64", "cuStreamWaitEvent", "cuEventRecord", "cuStreamWaitEvent"])
        assert ev[1] == ("GEMM", cur, L, 132, 1) and ev[2] == ("cuStreamWaitEvent", cs, ev[0][2])
        assert ev[3] == ("cuStreamWriteValue64", cs, arrive[0] + 8 * 1, L)      # our slot on rank 0
        assert ev[4][:4] == ("cuStreamWaitValue64", cs, arrive[1] + 8 * 0, L)   # rank 0's slot here
        for j in range(4):
            w, c = ev[5 + 2 * j], ev[6 + 2 * j]
            assert w[:4] == ("cuStreamWaitValue64", cs, ready + 8 * j, counts[j] * L)
            n = min(1024, op.Ms - 1024 * j)
            assert c == ("cuMemcpyAsync", cs, recv[0] + (1 * op.Ms + 1024 * j) * rb, part + 1024 * j * rb, n * rb)
        assert ev[13] == ("cuStreamWriteValue64", cs, done[0] + 8 * 1, 4 * L)  # the plan's 4 notifies, coalesced
        # our first 3 chunks, summed on the side stream once the GEMM stored them (ready slots 4..6:
        # segment 1) and rank 0's rows are here; the last chunk on the compute stream
        ss = eng.sum_stream.cuda_stream
        assert [e[:4] for e in ev[14:17]] == [("cuStreamWaitValue64", ss, ready + 8 * (4 + j), own_counts[j] * L)
                                               for j in range(3)]
        assert ev[17][:4] == ("cuStreamWaitValue64", ss, done[1] + 8 * 0, 4 * L) and ev[18][1] == ss
        assert ev[19][:4] == ("cuStreamWaitValue64", cur, done[1] + 8 * 0, 4 * L)    # the sum waits for rank 0's rows
        assert ev[20] == ("cuStreamWaitEvent", cur, ev[18][2])                          # ... and for the side stream
        assert ev[21][1] == cs and ev[22] == ("cuStreamWaitEvent", cur, ev[21][2])
        want = (op._engine.partial[op.Ms:].float() + eng.recv[0].float()).to(torch.bfloat16)
        assert torch.equal(out, want)                                   # our rows + what rank 0 sent
    assert {"partial", "reduce_scatter_recv"} == set(op.workspace_tensors())
    smap = op.signal_map()
    assert [s[0] for s in smap] == ["reduce_scatter_ready", "reduce_scatter_done", "handshake_arrive"]
    assert "copy stream waits" in smap[0][3] and "% 4) * 1024" in smap[0][3]


def test_gemm_rs_copy_chunks_never_split_a_group_of_tile_rows(proto):
    """By default up to 4 copies per peer, but no two inside one group of the compute order's
    tile rows (finished together, they would only add host calls); ce_chunks overrides."""
    from tldsl.runtime.dist.gemm_rs import DEFAULT_COMPUTE, MatmulReduceScatter
    from tldsl.runtime.dist.gemm_rs_copy import default_chunk_rows
    assert DEFAULT_COMPUTE.group_m * DEFAULT_COMPUTE.BM == 1024
    assert [default_chunk_rows(ms, DEFAULT_COMPUTE) for ms in (1024, 2048, 4096, 8192, 1500, 1000)] == \
        [1024, 1024, 1024, 2048, 1024, 256]                           # under one group: whole tiles, as before
    row_major = tl.ComputeSchedule(tile=(128, 256, 64), order="row_major")
    assert default_chunk_rows(2048, row_major) == 512                  # rows finish one by one there
    assert MatmulReduceScatter(2 * 1024, 1032, 3000, "bfloat16")._engine.tpr == 1
    assert MatmulReduceScatter(2 * 2048, 1032, 3000, "bfloat16")._engine.tpr == 2
    assert MatmulReduceScatter(2 * 2048, 1032, 3000, "bfloat16", ce_chunks=4)._engine.tpr == 4
    assert MatmulReduceScatter(2 * 2048, 1032, 3000, "bfloat16", ce_chunks=16)._engine.tpr == 16  # one a tile row
    with pytest.raises(tl.InputError, match="ce_chunks=17: at most 16 copies per peer"):   # (capped at 16 before)
        MatmulReduceScatter(2 * 2048, 1032, 3000, "bfloat16", ce_chunks=17)


def test_gemm_rs_early_sum_from_32_mib_of_rows(proto):
    from tldsl.runtime.dist.gemm_rs import MatmulReduceScatter
    assert MatmulReduceScatter(2 * 2048, 1032, 8192, "bfloat16")._engine.early_sum             # 32 MiB
    assert not MatmulReduceScatter(2 * 2040, 1032, 8192, "bfloat16")._engine.early_sum          # just under


def test_gemm_rs_copy_engine_epilogue_protocol(proto):
    """reduce_in='epilogue': the same copy stream (handshake, per chunk a wait and a copy, the
    coalesced done write), but no sum after the GEMM: the GEMM gets ``out``, the receive buffer and
    the done counters (its own-row tiles wait on them and add), and the compute stream only joins
    the copy stream."""
    from tldsl.runtime.dist.gemm_rs import MatmulReduceScatter
    torch = proto.torch
    M, K, N = 2048 * 2, 1032, 3000
    comm = tl.CommSchedule(engine="copy_engine", mode="push", reduce_in="epilogue")
    op = MatmulReduceScatter(M, K, N, "bfloat16", comm=comm, ce_chunks=4)     # 4 chunks asked for
    eng = op._engine
    assert eng.fused and op.ir.comm_schedule == comm.with_(tile_m=512)
    assert {p.name for p in op.ir.parts} == {"gemm", "reduce_scatter"}          # no sum part
    assert "summed in the GEMM epilogue" in op.describe()
    assert op.compute.group_m == 8                                  # 16 tile rows a rank: whole groups
    # 4 tile rows a rank: the default's groups of 8 would reach own rows before the last other
    # rows (refused by the tile program: a GPU could hang), so groups of 4 where none is given
    small = MatmulReduceScatter(2 * 512, K, N, "bfloat16", comm=comm)
    assert small.compute.group_m == 4 and small.ir.compute_schedule == small.compute
    with pytest.raises(tl.CompilationError, match="can hang: a tile of a rank.s own rows waits"):
        MatmulReduceScatter(2 * 512, K, N, "bfloat16", comm=comm, compute=op.compute)
    proto.events()
    cs, cur = eng.copy_stream.cuda_stream, proto.cur.cuda_stream
    a, b = torch.zeros(M, K, dtype=torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16)
    done = eng.ws.peers("reduce_scatter_done")
    for L in (1, 2):
        out = op(a, b)
        ev = proto.events()
        assert [e[0] for e in ev] == (["cuEventRecord", "GEMM", "cuStreamWaitEvent", "cuStreamWriteValue64",
                                       "cuStreamWaitValue64"] + ["cuStreamWaitValue64", "cuMemcpyAsync"] * 4
                                      + ["cuStreamWriteValue64", "cuEventRecord", "cuStreamWaitEvent"])
        assert ev[1] == ("GEMM", cur, L, 132, 1) and ev[13] == ("cuStreamWriteValue64", cs, done[0] + 8 * 1, 4 * L)
        assert ev[-1] == ("cuStreamWaitEvent", cur, ev[-2][2])          # nothing waits on done on the host side
        bufs, sigs = proto.gemm_args
        assert bufs["out"] is out and bufs["partial"] is op._engine.partial
        assert bufs["reduce_scatter_recv"].data_ptr() == eng.recv.data_ptr()
        assert sigs["reduce_scatter_done"].data_ptr() == done[1]        # this rank's counters
    # the GEMM alone: the op's buffers with scratch counters whose waits are already satisfied
    op.compute_only(a, b)
    bufs, sigs = proto.gemm_args
    assert sigs["reduce_scatter_done"].min().item() >= 1 << 62 and sigs["reduce_scatter_ready"].sum().item() == 0
    assert sigs["reduce_scatter_ready"].data_ptr() != op._engine.ready.data_ptr()
    # whole tiles per rank: 4091 rows per rank cannot sum in the epilogue, and say why before anything runs
    with pytest.raises(tl.ScheduleError, match="not a multiple of the producer tile"):
        MatmulReduceScatter(4091 * 2, K, N, "bfloat16", comm=comm)


def test_gemm_rs_copy_engine_on_one_rank(proto, monkeypatch):
    """One rank: nothing to move, no symmetric workspace; the output is this rank's partial."""
    from tldsl.runtime.dist import gemm_rs as grs
    torch = proto.torch

    class One:
        rank, world_size, device, group, group_name, backend = 0, 1, 0, None, "g", "CUDA"
    monkeypatch.setattr(grs, "dist_context", lambda group=None: One())
    op = grs.MatmulReduceScatter(1000, 1032, 3000, "bfloat16")
    assert op._engine.ws is None and op.signal_map()[0][0] == "reduce_scatter_ready"
    proto.events()
    op._engine.partial.copy_(torch.randn(1000, 3000).to(torch.bfloat16))
    out = op(torch.zeros(1000, 1032, dtype=torch.bfloat16), torch.zeros(1032, 3000, dtype=torch.bfloat16))
    assert torch.equal(out, op._engine.partial)
    assert [e[0] for e in proto.events()] == ["cuEventRecord", "GEMM", "cuStreamWaitEvent", "cuEventRecord",
                                               "cuStreamWaitEvent"]
    assert repr(op).startswith("<MatmulReduceScatter rank 0/1: A [1000, 1032] @ B [1032, 3000] -> out [1000, 3000] "
                               "torch.bfloat16, ComputeSchedule(") and repr(op).endswith("1 launches>")
    op.close()
    assert repr(op).endswith("1 launches, closed>")
    # summing in the epilogue on one rank: every tile is this rank's, the GEMM stores into out
    fused = grs.MatmulReduceScatter(1024, 1032, 3000, "bfloat16",
                                    comm=tl.CommSchedule(engine="copy_engine", mode="push", reduce_in="epilogue"))
    proto.events()
    out = fused(torch.zeros(1024, 1032, dtype=torch.bfloat16), torch.zeros(1032, 3000, dtype=torch.bfloat16))
    assert proto.gemm_args[0]["out"] is out and set(proto.gemm_args[1]) == {"reduce_scatter_ready"}
    assert [e[0] for e in proto.events()] == ["cuEventRecord", "GEMM", "cuStreamWaitEvent", "cuEventRecord",
                                               "cuStreamWaitEvent"]


@pytest.fixture
def fake_ag(proto, monkeypatch):
    """``(AllGatherMatmul, torch)`` with torch symmetric memory faked over ``proto``'s driver."""
    from tldsl.runtime.dist.ag_gemm import AllGatherMatmul
    _fake_torch_symmetric_memory(proto, monkeypatch)
    return AllGatherMatmul, proto.torch


def _fake_torch_symmetric_memory(proto, monkeypatch):
    """torch's symm_mem.empty / rendezvous as CPU tensors and the fixture's fake handle."""
    import torch.distributed._symmetric_memory as sm
    monkeypatch.setattr(sm, "empty", lambda size, dtype=None, device=None: proto.torch.empty(size, dtype=dtype))
    monkeypatch.setattr(sm, "rendezvous", lambda t, group_name: proto.Handle(t))


def test_allgather_direct_copy_engine_protocol(proto, monkeypatch, fake_ag):
    """The default AG+GEMM path: shard staged in slot L % 2 and our rows + flag on the compute
    stream, ONE barrier on the copy stream, peer copies from the peer's slot L % 2 with their
    flags, and the GEMM (on all SMs but one, never behind the barrier) on the compute stream,
    enqueued before the copy stream's work with garbage collection paused until it is all in."""
    AllGatherMatmul, torch = fake_ag
    Ms, K, N = 4091, 1032, 3000
    op = AllGatherMatmul(Ms, K, N, torch.bfloat16, handshake="kernel")
    assert ("BARRIER", proto.cur.cuda_stream) in proto.events()   # loaded at construction, not beside a GEMM
    assert repr(op).startswith(f"<AllGatherMatmul rank 1/2: A shard [{Ms}, {K}] @ B [{K}, {N}] torch.bfloat16, "
                               "ComputeSchedule(") and "mode='pull'" in repr(op) and repr(op).endswith("0 launches>")
    assert op.engine == "copy_engine" and op._engine.gemm.reserve == 1 and tuple(op._engine.shards.shape) == (2, Ms, K)
    cs, cur = op._engine.copy_stream.cuda_stream, proto.cur.cuda_stream
    nbytes = Ms * K * 2
    b = torch.zeros(K, N, dtype=torch.bfloat16)
    for L in (1, 2, 3):
        a = torch.randn(Ms, K).to(torch.bfloat16)
        ga, c = op(a, b, poison_workspace=True)
        ev = proto.events()
        assert [e[0] for e in ev] == ["cuLaunchKernel", "cuEventRecord", "cuStreamWaitEvent", "GEMM", "BARRIER",
                                      "cuMemcpyAsync", "cuStreamWriteValue64", "cuEventRecord", "cuStreamWaitEvent"]
        flags = op._engine.flags.data_ptr()
        # one staging pass: our shard into our symmetric slot L % 2 and into our own rows (rank 1),
        # and L into our flag; the copy stream starts after it
        assert ev[0][1] == cur and proto.drv.launches[-1]["decoded"] == [
            a.data_ptr(), op._engine.peer_ptrs[1] + (L % 2) * nbytes, ga.data_ptr() + nbytes, nbytes // 16, flags + 8 * 1, L]
        assert ev[1][1] == cur and ev[2] == ("cuStreamWaitEvent", cs, ev[1][2])
        assert ev[3] == ("GEMM", cur, L, 131, 1) and ev[4] == ("BARRIER", cs)    # GEMM first, never behind the barrier
        assert ev[5] == ("cuMemcpyAsync", cs, ga.data_ptr(), op._engine.peer_ptrs[0] + (L % 2) * nbytes, nbytes)
        assert ev[6] == ("cuStreamWriteValue64", cs, flags, L)
        assert ev[7][1] == cs and ev[8] == ("cuStreamWaitEvent", cur, ev[7][2])  # launch L+1 after the copies
    # the GEMM's arguments are packed once per set of tensor addresses (the caching allocator
    # hands back the same A_gathered and C): later launches only set the epoch
    assert proto.prepared <= 3
    before = proto.prepared
    monkeypatch.setattr(AllGatherMatmul, "_check_out", lambda self, out, a, b: None)     # a CPU tensor stands in
    out = torch.empty(2 * Ms, N, dtype=torch.bfloat16)
    op(torch.randn(Ms, K).to(torch.bfloat16), b, out=out)
    op(torch.randn(Ms, K).to(torch.bfloat16), b, out=out)
    assert proto.prepared - before <= 2
    # a non-contiguous shard is made contiguous before the raw copies read it
    at = torch.randn(K, Ms).to(torch.bfloat16).t()
    proto.events()
    op(at, b)
    proto.events()
    staged = proto.drv.launches[-1]["decoded"]
    assert staged[0] != at.data_ptr() and staged[3] == nbytes // 16
    assert set(op.workspace_tensors()) == {"a"}
    assert set(op.signal_tensors()) == {op._engine.signal}
    # garbage collection is paused only inside the window, and restored after it
    import gc
    seen = []
    op.hooks = {"before_comm": lambda o, L, s: seen.append(gc.isenabled())}
    op(torch.randn(Ms, K).to(torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16))
    assert seen == [False] and gc.isenabled()


# =================================================================================================
# the distributed checks themselves, against CPU stand-ins of the ops (one rank)
# =================================================================================================

class StandIn:
    """A correct (or deliberately broken) CPU op with the fused ops' interface: hooks, workspaces,
    epoch counters that grow per launch."""

    def __init__(self, kind, rows, k, n, bug=None):
        import torch
        self.torch, self.kind, self.bug = torch, kind, bug
        self.launches, self.hooks = 0, {}
        self.stage = torch.zeros(rows, k)
        self.counters = [0, 0, 0, 0]

    def workspace_tensors(self):
        return {"stage": self.stage}

    def signal_counters(self):
        return {"ready": list(self.counters)}

    def signal_map(self):
        return [("ready", 0x1000, 4, "stand-in")]

    def __call__(self, a, b, poison_workspace=False, out=None):
        torch = self.torch
        self.launches += 1
        L = self.launches
        for h in ("before_comm", "before_compute"):
            if h in self.hooks:
                self.hooks[h](self, L, f"{h}-stream")
        c = (a.float() @ b.float()).to(torch.bfloat16)
        if self.bug == "unwritten" and L == 2:
            c[8:16] = float("nan")
        if self.bug == "stale" and L == 3:
            c[:, 3] += 5.0
        if out is not None:
            out.copy_(c)
            c = out
        for i in range(4):
            if not (self.bug == "skip" and L == 7 and i == 3):
                self.counters[i] += i % 2 + 1
        gathered = a.clone()
        if self.bug == "gather":
            gathered[2] += 1
        return (gathered, c) if self.kind == "ag_gemm" else c


class CpuEnv(dc.Env):
    """One CPU rank: the checks' logic runs for real; devices, NCCL and sizes are scaled down."""

    def __init__(self, bug=None, **args):
        import torch
        self.args = SimpleNamespace(**dict(dict(iters=3, straggler_iters=4, launches=20, stream_launches=6, seed=1),
                                           **args))
        self.torch, self.dist, self.rank, self.W = torch, None, 0, 1
        self.debug, self.bug = False, bug
        self.state = dc.CheckState("cpu")
        self.sleeps = []

    def barrier(self):
        pass

    def sync(self):
        pass

    def generator(self, seed):
        return self.torch.Generator().manual_seed(seed)

    def sizes(self, check, v=None):
        return (40, 24, 16) if check != "back_to_back" else (16, 8, 8)

    def device_sleep(self, stream, cycles):
        self.sleeps.append((stream, cycles))

    def current_stream(self):
        return "first-stream"

    def new_stream(self):
        return "second-stream"

    def on_stream(self, stream):
        import contextlib
        self.sleeps.append((stream, "on"))
        return contextlib.nullcontext()

    def build(self, v, rows, k, n):
        op = StandIn(v.op, rows, k, n, self.bug)
        self.state.op, self.state.per_launch = op, None
        return op

    def inputs(self, v, rows, k, n, seed):
        g = self.generator(seed)
        return (self.torch.randn(rows, k, generator=g).to(self.torch.bfloat16),
                self.torch.randn(k, n, generator=g).to(self.torch.bfloat16))

    def reference(self, v, a, b):
        ref = a.float() @ b.float()
        return (a.clone(), ref) if v.op == "ag_gemm" else (None, ref)

    def out_like(self, v, rows, n):
        return self.torch.full((rows, n), float("nan"), dtype=self.torch.bfloat16)


@pytest.mark.parametrize("op", ["ag_gemm", "gemm_rs"])
def test_checks_pass_a_correct_op(op, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.setattr(dc.time, "sleep", lambda s: None)
    for v in dc.variants(op)[:2]:
        env = CpuEnv()
        for c in dc.CHECKS:
            ok, info, worst = dc.CHECK_FNS[c](env, v)
            assert ok, (c, info)
        # the straggler hooks ran: a device sleep before the compute on every iteration
        assert [s for s, _ in env.sleeps].count("before_compute-stream") == 4
        assert [s for s, _ in env.sleeps].count("before_comm-stream") == (4 if v.sm_comm else 0)


@pytest.mark.parametrize("bug,check,want", [
    ("unwritten", "odd_m", "iteration 1: 128 element(s) out of tolerance (128 NaN: never written), first at (8, 0)"),
    ("stale", "odd_m", "iteration 2:"),
    ("gather", "odd_m", "A_gathered differs from NCCL's all-gather in 1 row(s), first [2]"),
    ("skip", "back_to_back", "signal ready: slots [3] hold [38], want [40] after 20 launches (first launch: [2])"),
    ("stale", "streams", "launch 3 (stream 1): 40 element(s) out of tolerance"),
])
def test_checks_catch_broken_ops(bug, check, want):
    pytest.importorskip("torch")
    env = CpuEnv(bug=bug)
    ok, info, _ = dc.CHECK_FNS[check](env, dc.variants("ag_gemm")[0])
    assert not ok and want in info, info


def test_allgather_memops_handshake(proto, monkeypatch, fake_ag):
    """handshake='memops': no barrier kernel and no reserved SM; the copy stream writes the
    launch number into this rank's slot on every peer, then waits for every peer's slot here."""
    AllGatherMatmul, torch = fake_ag
    Ms, K, N = 4091, 1032, 3000
    with pytest.raises(tl.InputError, match="handshake"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, handshake="spin")
    with pytest.raises(tl.InputError, match="applies to the direct copy-engine pull path"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, engine="sm", handshake="memops")
    for bad in (dict(staging="kernel"), dict(staging="copies"), dict(enqueue="comm_first")):
        for where in (dict(engine="sm"), dict(ce_executor="plan")):     # ignored there before
            with pytest.raises(tl.InputError, match=f"{next(iter(bad))}=.* applies to the direct copy-engine paths"):
                AllGatherMatmul(Ms, K, N, torch.bfloat16, **where, **bad)
    op = AllGatherMatmul(Ms, K, N, torch.bfloat16, staging="copies")     # memops: the default
    assert op.handshake == "memops"
    proto.events()
    assert op._engine.gemm.reserve == 0 and torch.equal(op._engine.arrive, torch.zeros(2, dtype=torch.int64))
    cs, cur = op._engine.copy_stream.cuda_stream, proto.cur.cuda_stream
    for L in (1, 2):
        ga, c = op(torch.randn(Ms, K).to(torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16))
        ev = proto.events()
        assert [e[0] for e in ev] == ["cuMemcpyAsync", "cuEventRecord", "cuStreamWaitEvent", "cuMemcpyAsync",
                                      "cuStreamWriteValue64", "GEMM", "cuStreamWriteValue64", "cuStreamWaitValue64",
                                      "cuMemcpyAsync", "cuStreamWriteValue64", "cuEventRecord", "cuStreamWaitEvent"]
        assert ev[5] == ("GEMM", cur, L, 132, 1)                                  # every SM: no barrier kernel
        assert ev[6] == ("cuStreamWriteValue64", cs, op._engine.arrive_peers[0] + 8 * 1, L)   # our slot on rank 0
        assert ev[7][:4] == ("cuStreamWaitValue64", cs, op._engine.arrive.data_ptr() + 8 * 0, L)   # rank 0's slot here
        assert "BARRIER" not in [e[0] for e in ev]
    assert set(op.signal_tensors()) == {op._engine.signal, "handshake_arrive"}
    # enqueue="comm_first": the same calls, the handshake and the copies before the GEMM
    with pytest.raises(tl.InputError, match="enqueue='later'"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, enqueue="later")
    with pytest.raises(tl.InputError, match="staging='dma'"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, staging="dma")
    op = AllGatherMatmul(Ms, K, N, torch.bfloat16, enqueue="comm_first", staging="copies")
    proto.events()
    op(torch.randn(Ms, K).to(torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16))
    assert [e[0] for e in proto.events()] == ["cuMemcpyAsync", "cuEventRecord", "cuStreamWaitEvent", "cuMemcpyAsync",
                                              "cuStreamWriteValue64", "cuStreamWriteValue64", "cuStreamWaitValue64",
                                              "cuMemcpyAsync", "cuStreamWriteValue64", "GEMM", "cuEventRecord",
                                              "cuStreamWaitEvent"]


def _each_launch(proto, op, Ms, K, N, n=3):
    """Launches 1..n of an AG+GEMM op on fresh shards: ``(L, shard, A_gathered, events enqueued)``."""
    torch = proto.torch
    proto.events()
    b = torch.zeros(K, N, dtype=torch.bfloat16)
    for L in range(1, n + 1):
        a = torch.randn(Ms, K).to(torch.bfloat16)
        ga, _ = op(a, b)
        yield L, a, ga, proto.events()


def test_allgather_device_handshake(proto, monkeypatch):
    """handshake='device': the staging kernel is the handshake (it waits for every peer's
    arrival at L-1, stages, and publishes L on every peer); the copy stream follows the call's
    start and only waits for peer p's arrival at L before copying shard p — no host call between
    a peer's staging and its copy."""
    from tldsl.runtime.dist.ag_gemm import AllGatherMatmul
    from tldsl.runtime.dist import staging as stm
    torch = proto.torch
    _fake_torch_symmetric_memory(proto, monkeypatch)
    Ms, K, N = 4091, 1032, 3000
    with pytest.raises(tl.InputError, match="staging='copies' has none"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, handshake="device", staging="copies")
    op = AllGatherMatmul(Ms, K, N, torch.bfloat16)         # the default with the staging kernel
    assert op.handshake == "device" and op._engine.gemm.reserve == 0 and op._engine._stager.kernel.name == stm.PUBLISH_ENTRY
    assert op._engine._arrive_table.tolist() == op._engine.arrive_peers
    cs, cur = op._engine.copy_stream.cuda_stream, proto.cur.cuda_stream
    nbytes = Ms * K * 2
    for L, a, ga, ev in _each_launch(proto, op, Ms, K, N):
        assert [e[0] for e in ev] == ["cuEventRecord", "cuLaunchKernel", "cuStreamWaitEvent", "GEMM",
                                      "cuStreamWaitValue64", "cuMemcpyAsync", "cuStreamWriteValue64",
                                      "cuEventRecord", "cuStreamWaitEvent"]
        # the copy stream follows the call's start (recorded before the staging), not the staging
        assert ev[0][1] == cur and ev[2] == ("cuStreamWaitEvent", cs, ev[0][2])
        assert ev[1][1] == cur and proto.drv.launches[-1]["decoded"] == [
            a.data_ptr(), op._engine.peer_ptrs[1] + (L % 2) * nbytes, ga.data_ptr() + nbytes, nbytes // 16,
            op._engine.flags.data_ptr() + 8, L, op._engine.arrive.data_ptr(), op._engine._arrive_table.data_ptr(), 1, 2,
            op._engine._blocks_done.data_ptr()]
        assert ev[3] == ("GEMM", cur, L, 132, 1)
        assert ev[4][:4] == ("cuStreamWaitValue64", cs, op._engine.arrive.data_ptr() + 8 * 0, L)   # rank 0 staged L
        assert ev[5] == ("cuMemcpyAsync", cs, ga.data_ptr(), op._engine.peer_ptrs[0] + (L % 2) * nbytes, nbytes)
        assert ev[6] == ("cuStreamWriteValue64", cs, op._engine.flags.data_ptr(), L)
        assert "BARRIER" not in [e[0] for e in ev]
    assert set(op.signal_tensors()) == {op._engine.signal, "handshake_arrive"}
    # a shard at an address the kernel cannot move in 16-byte vectors is copied first: the
    # publishing kernel must run every launch
    raw = torch.randn(Ms * K + 8).to(torch.bfloat16)
    odd = raw[1:1 + Ms * K].view(Ms, K)
    assert odd.data_ptr() % 16
    op(odd, torch.zeros(K, N, dtype=torch.bfloat16))
    assert [e[0] for e in proto.events()][1] == "cuLaunchKernel"
    assert proto.drv.launches[-1]["decoded"][0] % 16 == 0
    # enqueue="comm_first": the copy stream's waits and copies between the staging and the GEMM
    op = AllGatherMatmul(Ms, K, N, torch.bfloat16, handshake="device", enqueue="comm_first")
    proto.events()
    op(torch.randn(Ms, K).to(torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16))
    assert [e[0] for e in proto.events()] == ["cuEventRecord", "cuLaunchKernel", "cuStreamWaitEvent",
                                              "cuStreamWaitValue64", "cuMemcpyAsync", "cuStreamWriteValue64",
                                              "GEMM", "cuEventRecord", "cuStreamWaitEvent"]


def test_allgather_gemm_staging(proto, monkeypatch, fake_ag):
    """staging='gemm': no staging pass before the GEMM. The GEMM (own_rows='compute': the
    schedule fuses the staging into it) reads
    this rank's rows from the shard and stages them into slot L % 2 and A_gathered itself,
    publishing the arrival; the copy stream follows the call's start and per peer waits for its
    arrival, copies, writes the flag. This rank's tile rows make one group of the order."""
    AllGatherMatmul, torch = fake_ag
    Ms, K, N = 1024, 1032, 3000
    with pytest.raises(tl.InputError, match="whole 128-row tiles"):
        AllGatherMatmul(4091, K, N, torch.bfloat16, staging="gemm")
    with pytest.raises(tl.InputError, match="publishes the launch's arrival itself"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, staging="gemm", handshake="memops")
    with pytest.raises(tl.InputError, match="the GEMM goes first"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, staging="gemm", enqueue="comm_first")
    op = AllGatherMatmul(Ms, K, N, torch.bfloat16, staging="gemm")
    assert op.handshake == "device" and op.lowered.own_rows and op.compute.group_m == Ms // 128
    assert "staged by the GEMM" in op.lowered.describe()
    assert "OwnRows<Cfg::kWorldSize>{&tma_a_own, &tma_a_slot, own_staged, own_arrive, own_arrive_peers, launch, " \
           "own_cols}" in op.lowered.source
    # the staging spread over the columns of one wave: 132 CTAs, 8 tile rows -> 16 (of 12 tile columns)
    from tldsl.runtime.dist.ag_gemm import stage_columns
    assert op._engine.stage_cols == 12 and stage_columns(8192, 4096, op.compute, 132) == 2
    assert stage_columns(8192, 14336, op.compute, 132, 2) == 4 and stage_columns(1024, 256, op.compute, 132) == 1
    # the default: the GEMM stages where the shard, staged over its first wave and then copied,
    # reaches the peers before they computed their own rows (132 SMs; the benchmark's shapes)
    from tldsl.runtime.dist.ag_gemm import default_staging, resolve_comm
    ce = resolve_comm(None, None, None, op.compute)
    plans = {(ms, n): default_staging(ms, n, 8192, 2, None, ce, None, "gemm_first", "direct")
             for ms, n in ((1024, 4096), (2048, 4096), (4096, 4096), (8192, 4096), (1024, 14336), (2048, 14336),
                           (8192, 14336), (4091, 14336))}
    assert plans == {(1024, 4096): ("kernel", None), (2048, 4096): ("kernel", None), (4096, 4096): ("gemm", 1),
                     (8192, 4096): ("gemm", 1), (1024, 14336): ("gemm", 1), (2048, 14336): ("gemm", 1),
                     (8192, 14336): ("gemm", 1), (4091, 14336): ("kernel", None)}
    assert default_staging(8192, 4096, 8192, 2, None, ce, "memops", "gemm_first", "direct") == ("kernel", None)
    assert default_staging(8192, 4096, 8192, 2, None, ce, None, "comm_first", "direct") == ("kernel", None)
    swizzled = tl.ComputeSchedule(tile=(128, 256, 64), order="swizzled")
    assert default_staging(8192, 4096, 8192, 2, swizzled, ce, None, "gemm_first", "direct") == ("kernel", None)
    grouped = tl.ComputeSchedule(tile=(128, 256, 64), order="comm_aligned")           # groups of 8 tile rows
    assert default_staging(8192, 4096, 8192, 2, grouped, ce, None, "gemm_first", "direct") == ("kernel", None)
    whole = tl.ComputeSchedule(tile=(128, 256, 64), order="comm_aligned", group_m=64)
    assert default_staging(8192, 4096, 8192, 2, whole, ce, None, "gemm_first", "direct") == ("gemm", 1)
    big = AllGatherMatmul(4096, 8192, 4096, torch.bfloat16, comm=ce)      # the pull (whole tiles: push by default)
    assert big.staging == "gemm" and big._engine.stage_cols == stage_columns(4096, 4096, big.compute, 132, 1) == 4
    assert AllGatherMatmul(8192, K, 4096, torch.bfloat16, stage_waves=2)._engine.stage_cols == 4
    with pytest.raises(tl.InputError, match="stage_waves"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, staging="kernel", stage_waves=1)
    cs, cur = op._engine.copy_stream.cuda_stream, proto.cur.cuda_stream
    nbytes = Ms * K * 2
    # every launch's GEMM arguments as prepared for it (CPU tensors reuse addresses across launches,
    # so a cached launch could show an earlier launch's tensors at the same addresses)
    monkeypatch.setattr(op._engine._gemm_launches, "get", lambda key, build: build())
    for L, a, ga, ev in _each_launch(proto, op, Ms, K, N):
        assert [e[0] for e in ev] == ["cuEventRecord", "GEMM", "cuStreamWaitEvent", "cuStreamWaitValue64",
                                      "cuMemcpyAsync", "cuStreamWriteValue64", "cuEventRecord", "cuStreamWaitEvent"]
        assert ev[1] == ("GEMM", cur, L, 132, 1) and ev[2] == ("cuStreamWaitEvent", cs, ev[0][2])
        bufs, sigs = proto.gemm_args
        assert bufs["a"] is a and bufs["a_slot"].data_ptr() == op._engine.shards[L % 2].data_ptr()
        assert bufs["a_gathered"] is ga and sigs["gather_a_arrive"] is op._engine.arrive and bufs["own_cols"] == 12
        assert sigs["gather_a_arrive_peers"].tolist() == op._engine.arrive_peers
        assert ev[3][:4] == ("cuStreamWaitValue64", cs, op._engine.arrive.data_ptr() + 8 * 0, L)   # rank 0 staged L
        assert ev[4] == ("cuMemcpyAsync", cs, ga.data_ptr(), op._engine.peer_ptrs[0] + (L % 2) * nbytes, nbytes)
        assert ev[5] == ("cuStreamWriteValue64", cs, op._engine.flags.data_ptr(), L)
    assert set(op.signal_tensors()) == {op._engine.signal, "handshake_arrive", "own_staged"}
    # the GEMM alone: scratch slot and arrival, this rank's rows read from A_gathered itself
    full = torch.randn(2 * Ms, K).to(torch.bfloat16)
    op.compute_only(full, torch.zeros(K, N, dtype=torch.bfloat16))
    bufs, sigs = proto.gemm_args
    assert bufs["a"].data_ptr() == full[Ms:].data_ptr() and bufs["a_slot"].data_ptr() != op._engine.shards.data_ptr()
    assert sigs["gather_a_arrive"] is not op._engine.arrive
    assert sigs["gather_a_arrive_peers"].data_ptr() != op._engine._arrive_table.data_ptr()


def test_allgather_copy_engine_push(proto, monkeypatch, fake_ag):
    """Copy-engine push, direct: nothing staged, no handshake kernel. Per peer in ring order the
    copy stream waits until the peer finished launch L-2 (it read landing slot L % 2 then), pushes
    the shard straight from the caller's tensor into the peer's landing slot, and writes L into
    the peer's flag; after the GEMM (gather_rows, fused by own_rows='compute': this rank's rows from the shard,
    every stage stored into A_gathered) the compute stream writes L into this rank's slot of
    every peer's consumed array."""
    AllGatherMatmul, torch = fake_ag
    Ms, K, N = 1024, 1032, 3000
    push = tl.CommSchedule(engine="copy_engine", mode="push")
    for bad, match in ((dict(staging="gemm"), "staging='gemm': the copy-engine push stages nothing"),
                       (dict(handshake="device"), "handshake='device'"),
                       (dict(stage_waves=1), "stage_waves=1")):
        with pytest.raises(tl.InputError, match=match):
            AllGatherMatmul(Ms, K, N, torch.bfloat16, comm=push, **bad)
    with pytest.raises(tl.InputError, match="whole 128-row tiles"):
        AllGatherMatmul(4091, K, N, torch.bfloat16, comm=push, ce_executor="direct")
    from tldsl.runtime.dist import ag_gemm as agm
    monkeypatch.setattr(agm, "_ProgramAllGather", lambda op, *a: SimpleNamespace(name="copy_engine-plan"))
    assert AllGatherMatmul(4091, K, N, torch.bfloat16, comm=push).engine == "copy_engine-plan"   # odd rows: the plan
    # the default where this rank's rows are whole tiles; the pull elsewhere
    assert AllGatherMatmul(Ms, K, N, torch.bfloat16).engine == "copy_engine-push"
    assert AllGatherMatmul(4091, K, N, torch.bfloat16).engine == "copy_engine"
    assert AllGatherMatmul(Ms, K, N, torch.bfloat16, staging="kernel").engine == "copy_engine"
    op = AllGatherMatmul(Ms, K, N, torch.bfloat16, comm=push)
    eng = op._engine
    # every launch's GEMM arguments as prepared for it (CPU tensors reuse addresses across launches)
    monkeypatch.setattr(eng._gemm_launches, "get", lambda key, build: build())
    assert op.engine == "copy_engine-push" and op.lowered.gather_rows and not op.lowered.own_rows
    assert "GatherRows<Cfg::kWorldSize>{&tma_a_own, &tma_a_copy, own_cols}" in op.lowered.source
    assert "pushed there" in op.lowered.describe() and "landing buffer (2, 2048, 1032)" in op.describe()
    assert tuple(eng.landing.shape) == (2, 2 * Ms, K) and eng.cols == 12 and eng.gemm.reserve == 0
    assert torch.equal(eng.counters, torch.zeros(2, 2, dtype=torch.int64))
    cs, cur = eng.copy_stream.cuda_stream, proto.cur.cuda_stream
    nbytes = Ms * K * 2
    for L, a, ga, ev in _each_launch(proto, op, Ms, K, N):
        assert [e[0] for e in ev] == ["cuEventRecord", "GEMM", "cuStreamWaitEvent", "cuStreamWaitValue64",
                                      "cuMemcpyAsync", "cuStreamWriteValue64", "cuStreamWriteValue64",
                                      "cuEventRecord", "cuStreamWaitEvent"]
        assert ev[1] == ("GEMM", cur, L, 132, 1) and ev[2] == ("cuStreamWaitEvent", cs, ev[0][2])
        bufs, sigs = proto.gemm_args
        assert bufs["a"].data_ptr() == a.data_ptr() and bufs["a_gathered_out"].data_ptr() == ga.data_ptr()
        assert bufs["own_cols"] == 12
        assert bufs["a_gathered"].data_ptr() == eng.landing[L % 2].data_ptr()
        assert list(sigs) == [eng.signal] and sigs[eng.signal] is eng.flags
        assert ev[3][:4] == ("cuStreamWaitValue64", cs, eng.consumed.data_ptr() + 8 * 0, max(L - 2, 0))
        # rank 1's shard into rows [Ms, 2 Ms) of rank 0's landing slot L % 2, then its flag 1 there
        assert ev[4] == ("cuMemcpyAsync", cs, eng.landing_peers[0] + (L % 2) * 2 * nbytes + nbytes, a.data_ptr(),
                         nbytes)
        assert ev[5] == ("cuStreamWriteValue64", cs, eng.flag_peers[0] + 8 * 1, L)
        # behind the push: this rank's GEMM of launch L-1 is done (it came before the call's start)
        assert ev[6] == ("cuStreamWriteValue64", cs, eng.consumed_peers[0] + 8 * 1, L - 1)
        assert ev[7][1] == cs and ev[8] == ("cuStreamWaitEvent", cur, ev[7][2])   # nothing after the GEMM
        assert "BARRIER" not in [e[0] for e in ev]
    assert eng.consumed_peers[1] == eng.counters[1].data_ptr() and eng.flag_peers[1] == eng.flags.data_ptr()
    assert set(op.signal_tensors()) == {eng.signal, "push_consumed"} and set(op.workspace_tensors()) == {"landing"}
    # a shard the copy engine and TMA cannot read in place is made contiguous first
    at = torch.randn(K, Ms).to(torch.bfloat16).t()
    op(at, torch.zeros(K, N, dtype=torch.bfloat16))
    assert proto.gemm_args[0]["a"].is_contiguous()
    # out= is the GEMM's C; a poisoned A_gathered starts as NaN (the GEMM writes every row of it)
    monkeypatch.setattr(AllGatherMatmul, "_check_out", lambda self, out, a, b: None)      # a CPU tensor stands in
    out = torch.empty(2 * Ms, N, dtype=torch.bfloat16)
    ga, c = op(torch.randn(Ms, K).to(torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16), out=out,
               poison_workspace=True)
    assert c is out and proto.gemm_args[0]["c"] is out and torch.isnan(ga).all()
    # comm_first: the pushes before the GEMM; the consumed writes still after it
    op = AllGatherMatmul(Ms, K, N, torch.bfloat16, comm=push, enqueue="comm_first")
    proto.events()
    op(torch.randn(Ms, K).to(torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16))
    assert [e[0] for e in proto.events()] == ["cuEventRecord", "cuStreamWaitEvent", "cuStreamWaitValue64",
                                              "cuMemcpyAsync", "cuStreamWriteValue64", "cuStreamWriteValue64", "GEMM",
                                              "cuEventRecord", "cuStreamWaitEvent"]
    # the peers told right after the GEMM instead (kept to measure against)
    op._engine.done_after_gemm = True
    op(torch.randn(Ms, K).to(torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16))
    assert [e[0] for e in proto.events()] == ["cuEventRecord", "cuStreamWaitEvent", "cuStreamWaitValue64",
                                              "cuMemcpyAsync", "cuStreamWriteValue64", "GEMM", "cuStreamWriteValue64",
                                              "cuEventRecord", "cuStreamWaitEvent"]
    # the GEMM alone: this rank's rows read from A_gathered itself, the copy into scratch
    full = torch.randn(2 * Ms, K).to(torch.bfloat16)
    op.compute_only(full, torch.zeros(K, N, dtype=torch.bfloat16))
    bufs, _ = proto.gemm_args
    assert bufs["a_gathered"] is full and bufs["a"].data_ptr() == full[Ms:].data_ptr()
    assert bufs["a_gathered_out"].data_ptr() != full.data_ptr()


def test_allgather_copy_engine_push_in_column_slices(proto, monkeypatch, fake_ag):
    """col_tile: per peer the copy stream pushes the shard in column slices — one 2-D copy per
    slice (both pitches a row of K, the last slice narrower), each followed by the flag's count
    of slices landed, slices * (L - 1) + j + 1 — and the GEMM waits per slice in its K loop
    (target slices * (launch - 1) + slice + 1). A col_tile of K or more moves whole shards; the
    direct pull and the GEMM pusher take no slices."""
    AllGatherMatmul, torch = fake_ag
    Ms, K, N = 1024, 1032, 3000
    push = tl.CommSchedule(engine="copy_engine", mode="push")
    with pytest.raises(tl.InputError, match="pusher='gemm' pushes whole tiles of rows"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, comm=push.with_(col_tile=512), pusher="gemm")
    with pytest.raises(tl.InputError, match="the direct copy-engine pull moves whole shards"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, comm=tl.CommSchedule(engine="copy_engine", mode="pull",
                                                                       col_tile=512))
    assert AllGatherMatmul(Ms, K, N, torch.bfloat16, comm=push.with_(col_tile=K))._engine.slices == 1
    op = AllGatherMatmul(Ms, K, N, torch.bfloat16, comm=push.with_(col_tile=512))
    eng = op._engine
    assert op.engine == "copy_engine-push" and eng.slices == 3 and eng.col_tile == 512
    assert "3ull * (launch - 1ull)" in op.lowered.source and "kStaged = true" in op.lowered.source
    monkeypatch.setattr(eng._gemm_launches, "get", lambda key, build: build())
    cs = eng.copy_stream.cuda_stream
    nbytes, pitch = Ms * K * 2, K * 2
    for L, a, ga, ev in _each_launch(proto, op, Ms, K, N):
        names = [e[0] for e in ev]
        assert names == ["cuEventRecord", "GEMM", "cuStreamWaitEvent", "cuStreamWaitValue64",
                         *["cuMemcpy2DAsync", "cuStreamWriteValue64"] * 3, "cuStreamWriteValue64",
                         "cuEventRecord", "cuStreamWaitEvent"]
        dst = eng.landing_peers[0] + (L % 2) * 2 * nbytes + nbytes         # rank 1's rows of rank 0's slot
        for j, (c0, width) in enumerate(((0, 512), (512, 512), (1024, 8))):
            copy, flag = ev[4 + 2 * j], ev[5 + 2 * j]
            assert copy == ("cuMemcpy2DAsync", cs, dst + 2 * c0, pitch, a.data_ptr() + 2 * c0, pitch, 2 * width, Ms)
            assert flag == ("cuStreamWriteValue64", cs, eng.flag_peers[0] + 8 * 1, 3 * (L - 1) + j + 1)
        assert ev[10] == ("cuStreamWriteValue64", cs, eng.consumed_peers[0] + 8 * 1, L - 1)


def test_default_push_slices_and_the_autotuner_sees_them(proto, monkeypatch):
    """The default push moves 1024-column slices where K is wider and the compute tile's K step
    divides 1024 (whole shards otherwise, and for the GEMM pusher); the autotuner's candidates
    hold the default push both ways, so a tuned choice can only be as fast or faster."""
    from tldsl.runtime.dist.ag_gemm import AllGatherMatmul, DEFAULT_COMPUTE, default_col_tile
    from tldsl.bench.dist import candidates
    torch = proto.torch
    _fake_torch_symmetric_memory(proto, monkeypatch)
    assert default_col_tile(8192, DEFAULT_COMPUTE) == 1024
    assert default_col_tile(1024, DEFAULT_COMPUTE) is None                        # one slice: whole
    op = AllGatherMatmul(1024, 2056, 3000, torch.bfloat16)
    assert op.comm.col_tile == 1024 and op._engine.slices == 3                   # 1024, 1024, 8
    assert AllGatherMatmul(1024, 2056, 3000, torch.bfloat16, pusher="gemm").comm.col_tile is None
    comms = [cm for _, cm in candidates("ag_gemm")]
    assert op.comm in comms and op.comm.with_(col_tile=None) in comms
    rs = candidates("gemm_rs")          # the epilogue sum with comm_aligned: own rows last on every rank
    assert {cp.order for cp, cm in rs if cm.reduce_in == "epilogue"} == {"comm_aligned"}


def test_allgather_push_by_the_gemm(proto, monkeypatch, fake_ag):
    """pusher="gemm": the launch is the GEMM alone (push_rows: engine='compute') — no copy stream, no
    event, no memop: it gets the peer's landing buffer (both slots) to push into, this rank's
    landing slot L % 2 to read from, every rank's flag address and a push counter. The GEMM alone
    (compute_only) is the same gathering GEMM without the pushes."""
    AllGatherMatmul, torch = fake_ag
    Ms, K, N = 1024, 1032, 3000
    with pytest.raises(tl.InputError, match="pusher='dma': choose 'copy_engine' or 'gemm'"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, pusher="dma")
    with pytest.raises(tl.InputError, match="only the direct copy-engine push has a pusher"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, engine="sm", pusher="gemm")
    # every CTA must push its tiles of this rank's rows before it waits for a peer's: the default
    # compute order is fitted (3 tile rows per rank: groups of 1), a schedule that is not refused
    assert AllGatherMatmul(384, K, N, torch.bfloat16, pusher="gemm").compute.group_m == 1
    from tldsl.runtime.dist import ag_gemm as agm

    class Alone:
        rank, world_size, device, group, group_name, backend = 0, 1, 0, None, "g", "CUDA"
    with monkeypatch.context() as mp:      # one rank: no peer to push to, refused before anything is built
        mp.setattr(agm, "dist_context", lambda group=None: Alone())
        with pytest.raises(tl.InputError, match="a group of one rank has none"):
            AllGatherMatmul(384, K, N, torch.bfloat16, pusher="gemm")
    from tldsl.codegen import LoweringError
    with pytest.raises(LoweringError, match="push its tiles of this rank's rows before"):
        AllGatherMatmul(384, K, N, torch.bfloat16, pusher="gemm",
                        compute=tl.ComputeSchedule(tile=(128, 256, 64), stages=4, order="comm_aligned", group_m=2))
    op = AllGatherMatmul(Ms, K, N, torch.bfloat16, pusher="gemm")
    eng = op._engine
    assert op.engine == "gemm-push" and op.lowered.push_rows and op.lowered.gather_rows
    assert op.compute.group_m == 8
    assert "GEMM (as it loads it; no copy engine)" in op.describe()
    assert eng._push_buffers["push_landing_0"] is proto.peer_buffers[0]          # rank 0's, the only peer
    assert tuple(proto.peer_buffers[0].shape) == (2 * 2 * Ms, K)
    assert eng._push_signals["gather_a_ready_peers"].tolist() == eng.flag_peers
    monkeypatch.setattr(eng._gemm_launches, "get", lambda key, build: build())
    cur = proto.cur.cuda_stream
    for L, a, ga, ev in _each_launch(proto, op, Ms, K, N):
        assert ev == [("GEMM", cur, L, 132, 1)]                                  # the launch is the GEMM
        bufs, sigs = proto.gemm_args
        assert bufs["a_gathered"].data_ptr() == eng.landing[L % 2].data_ptr()
        assert bufs["a"].data_ptr() == a.data_ptr() and bufs["a_gathered_out"].data_ptr() == ga.data_ptr()
        assert bufs["push_landing_0"] is proto.peer_buffers[0] and bufs["own_cols"] == 12
        assert sigs[eng.signal] is eng.flags and sigs["push_count"] is eng._push_signals["push_count"]
    assert set(op.signal_tensors()) == {eng.signal, "push_count"}
    assert [m[0] for m in op.signal_map()] == [eng.signal, "push_count"]
    # the GEMM alone: the plain gathering GEMM (no pushes), its waits satisfied by scratch
    full = torch.randn(2 * Ms, K).to(torch.bfloat16)
    op.compute_only(full, torch.zeros(K, N, dtype=torch.bfloat16))
    assert eng.compute_gemm is not eng.gemm and not eng.compute_gemm.lowered.push_rows
    bufs, _ = proto.gemm_args
    assert "push_landing_0" not in bufs and bufs["a_gathered"] is full


def test_allgather_push_hands_out_the_next_calls_outputs_once(proto, monkeypatch):
    """spare_outputs: a push call ends by allocating the next call's A_gathered and C on its
    stream, and the next call on that stream writes them (no allocation before its GEMM). Each
    spare is handed out once; a call on another stream, or with ``out=``, allocates (and gets
    no spare C); off, or above the size limit by default, nothing is held."""
    from tldsl.runtime.dist.ag_gemm import AllGatherMatmul
    from tldsl.runtime.dist import spare_outputs as spm
    torch = proto.torch
    _fake_torch_symmetric_memory(proto, monkeypatch)
    Ms, K, N = 128, 64, 96
    op = AllGatherMatmul(Ms, K, N, torch.bfloat16)
    eng = op._engine
    assert eng._spares.enabled and "next call's outputs allocated at the end" in op.describe()
    monkeypatch.setattr(eng._gemm_launches, "get", lambda key, build: build())
    a, b = torch.randn(Ms, K).to(torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16)
    first = op(a, b)
    held = dict(eng._spares._spares)
    assert set(held) == {"a_gathered", "c"} and eng._spares.held_bytes == (2 * Ms * K + 2 * Ms * N) * 2
    assert all(t.data_ptr() not in (first[0].data_ptr(), first[1].data_ptr()) for t in held.values())
    second = op(a, b)
    assert second[0] is held["a_gathered"] and second[1] is held["c"]          # written by this call's GEMM
    assert proto.gemm_args[0]["a_gathered_out"] is held["a_gathered"] and proto.gemm_args[0]["c"] is held["c"]
    third = op(a, b)
    ptrs = {t.data_ptr() for t in (*first, *second, *third)}
    assert len(ptrs) == 6                                                       # never one tensor twice
    # another stream: the spares allocated for the old one are dropped, fresh ones allocated
    held = dict(eng._spares._spares)
    other = torch.cuda.Stream()
    proto.current.append(other)
    try:
        got = op(a, b)
    finally:
        proto.current.pop()
    assert got[0] is not held["a_gathered"] and got[1] is not held["c"]
    # out=: the caller's C, and no spare C kept for the next call
    monkeypatch.setattr(AllGatherMatmul, "_check_out", lambda self, out, a, b: None)  # a CPU tensor stands in
    out = torch.empty(2 * Ms, N, dtype=torch.bfloat16)
    assert op(a, b, out=out)[1] is out and set(eng._spares._spares) == {"a_gathered"}
    op.close()
    assert eng._spares.held_bytes == 0
    # off, and the default by size
    assert not AllGatherMatmul(Ms, K, N, torch.bfloat16, spare_outputs=False)._engine._spares.enabled
    monkeypatch.setattr(spm, "SPARE_LIMIT_BYTES", (2 * Ms * K + 2 * Ms * N) * 2 - 1)
    assert not AllGatherMatmul(Ms, K, N, torch.bfloat16)._engine._spares.enabled
    assert AllGatherMatmul(Ms, K, N, torch.bfloat16, spare_outputs=True)._engine._spares.enabled
    with pytest.raises(tl.InputError, match="spare_outputs='yes'"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, spare_outputs="yes")
    # the environment decides for ops that were not told (the torch custom ops among them)
    monkeypatch.setenv("TLDSL_SPARE_OUTPUTS", "1")
    assert AllGatherMatmul(Ms, K, N, torch.bfloat16)._engine._spares.enabled              # above the limit
    assert not AllGatherMatmul(Ms, K, N, torch.bfloat16, spare_outputs=False)._engine._spares.enabled
    monkeypatch.setenv("TLDSL_SPARE_OUTPUTS", "0")
    monkeypatch.setattr(spm, "SPARE_LIMIT_BYTES", 1 << 40)
    assert not AllGatherMatmul(Ms, K, N, torch.bfloat16)._engine._spares.enabled
    monkeypatch.setenv("TLDSL_SPARE_OUTPUTS", "yes")
    with pytest.raises(tl.InputError, match="TLDSL_SPARE_OUTPUTS='yes'"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16)
    monkeypatch.delenv("TLDSL_SPARE_OUTPUTS")
    with pytest.raises(tl.InputError, match="the direct copy-engine push and pull keep spare outputs"):
        AllGatherMatmul(Ms, K, N, torch.bfloat16, engine="sm", spare_outputs=True)


@pytest.mark.parametrize("staging", ["kernel", "gemm"])
def test_allgather_pull_hands_out_the_next_calls_outputs_once(proto, monkeypatch, fake_ag, staging):
    """The direct pull keeps spare outputs too (both of its launch paths: a staging pass, or the
    GEMM staging its own rows): the GEMM of the next call on the same stream writes them."""
    AllGatherMatmul, torch = fake_ag
    Ms, K, N = 128, 64, 96
    op = AllGatherMatmul(Ms, K, N, torch.bfloat16, comm=tl.CommSchedule(engine="copy_engine", mode="pull"),
                         staging=staging)
    eng = op._engine
    assert eng.name == "copy_engine" and eng._spares.enabled
    monkeypatch.setattr(eng._gemm_launches, "get", lambda key, build: build())
    a, b = torch.randn(Ms, K).to(torch.bfloat16), torch.zeros(K, N, dtype=torch.bfloat16)
    first = op(a, b)
    held = dict(eng._spares._spares)
    assert set(held) == {"a_gathered", "c"}
    second = op(a, b)
    assert second[0] is held["a_gathered"] and second[1] is held["c"]
    assert proto.gemm_args[0]["a_gathered"] is held["a_gathered"] and proto.gemm_args[0]["c"] is held["c"]
    third = op(a, b)
    assert len({t.data_ptr() for t in (*first, *second, *third)}) == 6
    monkeypatch.setattr(AllGatherMatmul, "_check_out", lambda self, out, a, b: None)  # a CPU tensor stands in
    out = torch.empty(2 * Ms, N, dtype=torch.bfloat16)
    assert op(a, b, out=out)[1] is out and set(eng._spares._spares) == {"a_gathered"}
    op.close()
    assert eng._spares.held_bytes == 0
    off = AllGatherMatmul(Ms, K, N, torch.bfloat16, comm=tl.CommSchedule(engine="copy_engine", mode="pull"),
                          spare_outputs=False)
    off(a, b)
    assert not off._engine._spares.enabled and off._engine._spares.held_bytes == 0


def test_calls_on_a_new_stream_follow_the_previous_call(proto, monkeypatch):
    """Launches run in call order whatever stream each call is made on: a call on another stream
    than the previous one first makes its stream wait for the previous stream's work (one event
    record there, one wait here); calls on one stream add nothing. AG pull and push, GEMM+RS on the
    copy engine (the schedules on the fused-op runtime: tests/test_program_op.py)."""
    from tldsl.runtime.dist.ag_gemm import AllGatherMatmul
    from tldsl.runtime.dist.gemm_rs import MatmulReduceScatter
    torch = proto.torch
    _fake_torch_symmetric_memory(proto, monkeypatch)
    Ms, K, N = 1024, 1032, 3000
    pull = tl.CommSchedule(engine="copy_engine", mode="pull")
    ops = [(AllGatherMatmul(Ms, K, N, torch.bfloat16, comm=pull), (Ms, K), (K, N)),
           (AllGatherMatmul(Ms, K, N, torch.bfloat16), (Ms, K), (K, N)),
           (MatmulReduceScatter(2 * Ms, K, N, torch.bfloat16), (2 * Ms, K), (K, N))]
    for op, sa, sb in ops:
        a, b = torch.randn(*sa).to(torch.bfloat16), torch.zeros(*sb, dtype=torch.bfloat16)
        first = proto.current[-1].cuda_stream
        op(a, b)
        op(a, b)
        assert "cuStreamWaitEvent" not in [e[0] for e in proto.events()[:2]]     # one stream: nothing added
        other = torch.cuda.Stream()
        proto.current.append(other)
        try:
            op(a, b)
        finally:
            proto.current.pop()
        ev = proto.events()
        assert ev[0][:2] == ("cuEventRecord", first) and ev[1][:3] == ("cuStreamWaitEvent", other.cuda_stream,
                                                                       ev[0][2]), ev[:3]
        op(a, b)                          # back on the first stream: it waits for the other one
        ev = proto.events()
        assert ev[0][:2] == ("cuEventRecord", other.cuda_stream) and ev[1][:2] == ("cuStreamWaitEvent", first)


def test_bench_schedule_spec_parses_into_schedules():
    from tldsl.bench.dist import parse_schedule
    compute, comm = parse_schedule("gemm_rs", "sms=8,order=full_mesh,mode=pull,tile=128x128x64,stages=5")(8192, 8192, 8192)
    assert compute.tile == (128, 128, 64) and compute.stages == 5 and compute.order == "comm_aligned"
    assert (comm.engine, comm.mode, comm.order, comm.sms, comm.tile_m) == ("sm", "pull", "full_mesh", 8, 32)
    compute, comm = parse_schedule("ag_gemm", "engine=sm,mode=push")(8192, 8192, 8192)
    assert (comm.engine, comm.mode, comm.sms, comm.tile_m) == ("sm", "push", 8, 128)
    compute, _ = parse_schedule("ag_gemm", "cluster=2")(8192, 8192, 8192)
    assert compute.cluster == (2, 1)
    _, comm = parse_schedule("ag_gemm", "compute_order=swizzled,engine=copy_engine")(8192, 8192, 8192)
    assert comm.engine == "copy_engine" and comm.tile_m is None
    # unset keys are what the op itself does at the shape: the push in column slices at whole
    # tiles per rank, the pull elsewhere; a push asked for by hand gets the op's slices too
    from tldsl.runtime.dist.ag_gemm import DEFAULT_COL_TILE
    assert parse_schedule("ag_gemm", "stages=3")(8192, 8192, 8192)[1] is None     # no comm key: the op decides
    _, comm = parse_schedule("ag_gemm", "order=ring")(8192, 8192, 8192)
    assert (comm.engine, comm.mode, comm.col_tile) == ("copy_engine", "push", DEFAULT_COL_TILE)
    _, comm = parse_schedule("ag_gemm", "order=ring")(8190, 8192, 8192)          # 4095 rows per rank
    assert (comm.engine, comm.mode, comm.col_tile) == ("copy_engine", "pull", None)
    # no compute key: no compute schedule given (the op treats that apart), else the one asked for
    assert parse_schedule("ag_gemm", "mode=push")(8192, 8192, 8192)[0] is None
    assert parse_schedule("ag_gemm", "stages=3")(8192, 8192, 8192)[0].stages == 3
    # the benchmark's --ag-pusher gemm pushes whole shards; --ag-handshake makes the base the pull
    assert parse_schedule("ag_gemm", "mode=push", pusher="gemm")(8192, 8192, 8192)[1].col_tile is None
    assert parse_schedule("ag_gemm", "order=ring", handshake="memops")(8192, 8192, 8192)[1].mode == "pull"
    assert parse_schedule("ag_gemm", "mode=push")(8190, 8192, 8192)[1].col_tile == DEFAULT_COL_TILE
    assert parse_schedule("ag_gemm", "mode=push,col_tile=none")(8192, 8192, 8192)[1].col_tile is None
    assert parse_schedule("ag_gemm", "mode=pull")(8192, 8192, 8192)[1].col_tile is None
    _, comm = parse_schedule("ag_gemm", "tile_m=32")(8192, 8192, 8192)          # SM keys mean the SM engine
    assert (comm.engine, comm.mode, comm.tile_m, comm.col_tile) == ("sm", "pull", 32, None)
    _, comm = parse_schedule("ag_gemm", "engine=sm")(8192, 8192, 8192)
    assert (comm.engine, comm.mode, comm.tile_m) == ("sm", "pull", 128)
    with pytest.raises(tl.InputError, match="unknown key"):
        parse_schedule("ag_gemm", "warp_size=64")
    with pytest.raises(tl.InputError, match="not key=value"):
        parse_schedule("gemm_rs", "sms")


def test_gemm_rs_default_schedule_follows_the_shape():
    from tldsl.runtime.dist.gemm_rs import DEFAULT_COMPUTE, default_sm_comm as default_comm
    heavy = default_comm(DEFAULT_COMPUTE, m=8192, k=4096)       # short K per rank: more SMs, small tiles
    light = default_comm(DEFAULT_COMPUTE, m=8192, k=14336)
    small = default_comm(DEFAULT_COMPUTE, m=2048, k=4096)
    assert (heavy.sms, heavy.tile_m) == (24, 32) and (light.sms, light.tile_m) == (16, 64)
    assert (small.sms, small.tile_m) == (16, 64)
    assert default_comm(DEFAULT_COMPUTE, sms=8, m=8192, k=4096).sms == 8
    assert default_comm(DEFAULT_COMPUTE).tile_m == 64


def test_phase_timeline_segments_and_text():
    from tldsl.runtime.dist.timeline import format_phases, segments
    ag = [("start", "compute", 0.0), ("staged", "compute", 0.2), ("barrier", "copy", 0.4),
          ("shard 0 copied", "copy", 0.7), ("gemm done", "compute", 3.0)]
    assert segments(ag) == [("compute", "stage", 0.0, 0.2), ("copy", "barrier", 0.2, 0.4),
                            ("copy", "copy 0", 0.4, 0.7), ("compute", "GEMM", 0.2, 3.0)]
    # a stream's first phase starts at the latest earlier mark that is not later in time
    rs = [("start", "compute", 0.0), ("gemm done", "compute", 1.7), ("barrier", "comm", 0.2),
          ("reduce-scatter done", "comm", 2.1)]
    assert segments(rs) == [("compute", "GEMM", 0.0, 1.7), ("comm", "barrier", 0.0, 0.2),
                            ("comm", "reduce-scatter", 0.2, 2.1)]
    # the copy-engine reduce-scatter: a push of the peer's rows, and the sum after the GEMM
    ce = [("start", "compute", 0.0), ("gemm done", "compute", 2.0), ("barrier", "copy", 0.1),
          ("rows of 1 sent", "copy", 1.2), ("reduced", "compute", 2.2)]
    assert segments(ce) == [("compute", "GEMM", 0.0, 2.0), ("copy", "barrier", 0.0, 0.1),
                            ("copy", "copy 1", 0.1, 1.2), ("compute", "sum", 2.0, 2.2)]
    # the copy-engine AG push: this rank's shard to a peer, beside the GEMM
    push = [("start", "compute", 0.0), ("gemm done", "compute", 2.0), ("shard pushed to 1", "copy", 0.3)]
    assert segments(push) == [("compute", "GEMM", 0.0, 2.0), ("copy", "copy to 1", 0.0, 0.3)]
    assert format_phases([push], width=20).splitlines()[2] == "rank 0    copy |ccc" + "." * 17 + "|"
    ce_text = format_phases([ce], width=22).splitlines()
    assert ce_text[1] == "rank 0 compute |" + "G" * 20 + "++|"
    text = format_phases([ag, ag], width=30).splitlines()
    assert text[0].strip().startswith("0 ms") and text[0].endswith("3.000 ms")
    assert text[1] == "rank 0 compute |" + "ss" + "G" * 28 + "|"
    assert text[2].startswith("rank 0    copy |..bb") and "ccc" in text[2]
    assert len(text) == 6 and text[-1].startswith("s staging")


def test_bench_shapes_take_model_names():
    from tldsl.bench.dist import parse_shapes
    assert parse_shapes("ag_gemm", "llama8b, 4096x8192x8192") == [(8192, 14336, 4096), (4096, 8192, 8192)]
    assert parse_shapes("gemm_rs", "llama405b") == [(8192, 16384, 53248)]
    with pytest.raises(tl.InputError, match="neither"):
        parse_shapes("ag_gemm", "llama9b")


# =================================================================================================
# NVSHMEM runtime (transport='nvshmem'): the ABI, the bootstrap, the workspace — with a fake library
# =================================================================================================

ABI_MAIN = r"""
#include <stdio.h>
#include <stddef.h>
#include <device_host/nvshmem_types.h>
int main() {
  printf("%zu %zu %zu %zu ", sizeof(nvshmemx_uniqueid_t), sizeof(nvshmemx_uniqueid_args_t),
         sizeof(nvshmemx_init_args_t), sizeof(nvshmemx_init_attr_t));
  printf("%zu %zu %zu %zu %zu %zu\n", offsetof(nvshmemx_init_attr_t, mpi_comm), offsetof(nvshmemx_init_attr_t, args),
         offsetof(nvshmemx_init_attr_t, args.uid_args), offsetof(nvshmemx_init_attr_t, args.uid_args.id),
         offsetof(nvshmemx_init_attr_t, args.uid_args.myrank), offsetof(nvshmemx_init_attr_t, args.uid_args.nranks));
  return 0;
}
"""


def test_nvshmem_ctypes_structs_match_the_headers(tmp_path):
    """Our ctypes mirrors of NVSHMEM 3.4's init structs have the headers' sizes and offsets
    (compiled on the host against the installed nvidia-nvshmem-cu13 headers)."""
    import ctypes
    import shutil
    import subprocess
    from tldsl.codegen.toolchain import find_toolchain
    from tldsl.runtime.dist import nvshmem as nvm
    for name, size in nvm.ABI_SIZES.items():
        assert ctypes.sizeof(getattr(nvm, name)) == size, name
    try:
        inc = find_toolchain().nvshmem_include
    except Exception:   # noqa: BLE001 - no CUDA wheels: the sizes above are still checked
        inc = None
    if inc is None or shutil.which("g++") is None:
        pytest.skip("needs g++ and NVSHMEM's headers (the nvrtc extra installs them)")
    src = tmp_path / "abi.cpp"
    src.write_text(ABI_MAIN)
    subprocess.run(["g++", f"-I{inc}", str(src), "-o", str(tmp_path / "abi")], check=True)
    got = [int(x) for x in subprocess.run([str(tmp_path / "abi")], capture_output=True, text=True,
                                          check=True).stdout.split()]
    A, I, U = nvm.InitAttr, nvm.InitArgs, nvm.UniqueIdArgs
    uid = A.args.offset + I.uid_args.offset
    assert got == [128, 24, 128, 144, A.mpi_comm.offset, A.args.offset, uid, uid + U.id.offset,
                   uid + U.myrank.offset, uid + U.nranks.offset]


class FakeNvshmemLib:
    """nvshmem4py's ``nvshmem.bindings`` functions Nvshmem calls (addresses as ints, as there),
    recorded; PE numbers and heap addresses made up. A struct passed by address is recorded as
    a copy of what it held during the call."""

    def __init__(self, pe, n):
        self.pe, self.n, self.calls, self.heap = pe, n, [], 0x7a00_0000_0000
        for name in ("get_uniqueid", "set_attr_uniqueid_args", "hostlib_init_attr", "hostlib_finalize", "my_pe",
                     "n_pes", "malloc", "free", "ptr", "cumodule_init", "barrier_all_on_stream"):
            setattr(self, name, self._fn(name))

    def _fn(self, name):
        def call(*args):
            self.calls.append((name,) + args)
            return getattr(self, "_" + name, lambda *a: None)(*args)
        return call

    def _get_uniqueid(self, addr):
        from tldsl.runtime.dist import nvshmem as nvm
        nvm.UniqueId.from_address(addr).internal = b"rank0-secret"

    def _set_attr_uniqueid_args(self, rank, n, uid, attr):
        from tldsl.runtime.dist import nvshmem as nvm
        self.calls[-1] = ("set_attr_uniqueid_args", rank, n, nvm.UniqueId.from_buffer_copy(nvm.UniqueId.from_address(uid)),
                          nvm.InitAttr.from_buffer_copy(nvm.InitAttr.from_address(attr)))

    def _my_pe(self):
        return self.pe

    def _n_pes(self):
        return self.n

    def _malloc(self, n):
        self.heap += 1 << 20
        return self.heap

    def _ptr(self, p, pe):
        return p + (pe + 1) * 0x1_0000_0000_0000

    def _cumodule_init(self, module):
        return 0


def test_nvshmem_bootstrap_over_the_process_group(monkeypatch):
    from types import SimpleNamespace
    from tldsl.runtime.dist import nvshmem as nvm
    monkeypatch.setattr(nvm.Nvshmem, "_instance", None)
    sent = []

    def bcast(objs):                 # rank 0's id reaches rank 1
        sent.append(objs[0])
        objs[0] = bytes(nvm.new_unique_id().__class__.from_buffer_copy(sent[0]))
    lib0 = FakeNvshmemLib(0, 2)
    nv = nvm.Nvshmem.get(SimpleNamespace(rank=0, world_size=2, group=None), lib=lib0, broadcast=bcast)
    names = [c[0] for c in lib0.calls]
    assert names[:3] == ["get_uniqueid", "set_attr_uniqueid_args", "hostlib_init_attr"]
    _, myrank, nranks, uid, attr = lib0.calls[1]
    assert (myrank, nranks) == (0, 2) and uid.internal.startswith(b"rank0-secret")
    assert attr.version == (1 << 16) + 144 and attr.args.version == (1 << 16) + 128
    assert attr.args.uid_args.version == (1 << 16) + 24
    assert lib0.calls[2][1] == nvm.INIT_WITH_UNIQUEID and nv.rank == 0
    assert nvm.Nvshmem.get(SimpleNamespace(rank=0, world_size=2)) is nv           # once per process
    with pytest.raises(tl.InputError, match="already initialised"):
        nvm.Nvshmem.get(SimpleNamespace(rank=1, world_size=4))
    # a rank that is not rank 0 does not make an id; a PE numbering that disagrees is an error
    monkeypatch.setattr(nvm.Nvshmem, "_instance", None)
    lib1 = FakeNvshmemLib(0, 2)
    with pytest.raises(nvm.NvshmemError, match="PE 0 of 2, but this is rank 1"):
        nvm.Nvshmem.get(SimpleNamespace(rank=1, world_size=2), lib=lib1, broadcast=lambda objs: None)
    assert "get_uniqueid" not in [c[0] for c in lib1.calls]
    monkeypatch.setattr(nvm.Nvshmem, "_instance", None)
    bad = FakeNvshmemLib(0, 2)

    class NVSHMEMError(Exception):              # what nvshmem4py raises on a failed status
        status = 7

    def refuse(*args):
        raise NVSHMEMError()
    bad._hostlib_init_attr = refuse
    with pytest.raises(nvm.NvshmemError, match="nvshmemx_hostlib_init_attr failed with status 7"):
        nvm.Nvshmem.get(SimpleNamespace(rank=0, world_size=2), lib=bad, broadcast=lambda objs: None)


def test_nvshmem_workspace_regions_peers_and_collective_free(monkeypatch):
    from types import SimpleNamespace
    torch = pytest.importorskip("torch")
    from tldsl.runtime.dist import nvshmem as nvm
    lib = FakeNvshmemLib(1, 2)
    nv = nvm.Nvshmem(lib, 1, 2)
    made = {}

    def as_tensor(ptr, shape, dtype, device):
        t = torch.full(tuple(shape), 5, dtype=torch.int64 if dtype == "u64" else torch.float32)
        made[ptr] = t
        return t
    monkeypatch.setattr(nvm, "_synchronize", lambda: None)
    monkeypatch.setattr(nvm.NvshmemWorkspace, "barrier", lambda self, *a, **k: lib.calls.append(("barrier",)))
    ctx = SimpleNamespace(rank=1, world_size=2, device=0)
    ws = nvm.NvshmemWorkspace(ctx, [("recv", "buffer", (64, 8), "f32"), ("arrived", "signal", (4,), "u64")],
                              nvshmem=nv, as_tensor=as_tensor)
    base = ws.base
    r_recv, r_arr = ws.regions
    assert ws.peers("recv")[1] == base + r_recv.offset and ws.peers("arrived")[1] == base + r_arr.offset
    assert ws.peers("recv")[0] == base + r_recv.offset + 0x1_0000_0000_0000           # nvshmem_ptr(sym, 0)
    assert torch.equal(ws.tensor("arrived"), torch.zeros(4, dtype=torch.int64))     # counters zeroed ...
    assert [c[0] for c in lib.calls][-1] == "barrier"                               # ... before anyone notifies
    assert (r_recv.offset % 512, r_arr.offset % 512) == (0, 0)
    ws.close()
    ws.close()
    frees = [c for c in lib.calls if c[0] == "free"]
    assert len(frees) == 1 and frees[0][1] == base and ws.closed            # freed once, explicitly
    # an unreachable peer is an error at construction, not a null pointer on the device
    lib._ptr = lambda p, pe: 0
    with pytest.raises(nvm.NvshmemError, match="not reachable"):
        nvm.NvshmemWorkspace(ctx, [("recv", "buffer", (8,), "f32")], nvshmem=nv, as_tensor=as_tensor)
    nv.init_module(0x55)
    nv.init_module(0x55)
    assert [c for c in lib.calls if c[0] == "cumodule_init"] == [("cumodule_init", 0x55)]   # once per module
    lib._cumodule_init = lambda m: 3
    with pytest.raises(nvm.NvshmemError, match="nvshmemx_cumodule_init failed with status 3"):
        nv.init_module(0x66)


def test_nvshmem_single_node_defaults_respect_the_user():
    from tldsl.runtime.dist.nvshmem import single_node_defaults
    env = {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "eth0"}
    assert single_node_defaults(env) == {"NVSHMEM_REMOTE_TRANSPORT": "none", "NVSHMEM_DISABLE_NVLS": "1"}
    assert env["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == "eth0"                   # the user's choice stays
    multi = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert single_node_defaults(multi) == {} and "NVSHMEM_REMOTE_TRANSPORT" not in multi


def test_interleaved_timing_rotates_and_agrees_on_failures(capsys):
    from tldsl.bench.dist import bench_interleaved
    calls = []
    cost = {"a": 1.0, "b": 2.0, "c": 3.0}

    def make(n):
        return lambda: calls.append(n)

    def timer(fn):
        fn()
        return cost[calls[-1]] + 0.01 * len(calls)     # a slow drift: interleaving spreads it over all
    fns = {"a": make("a"), "b": make("b"), "c": make("c"), "bad": lambda: 1 / 0}
    got = bench_interleaved(fns, iters=3, warm=1, timer=timer, reduce_max=lambda v: list(v))
    assert [c for c in calls[3:]] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]     # rotated per iteration
    assert got["a"] < got["b"] < got["c"] and got["bad"] != got["bad"]              # NaN for the broken one
    assert "bad failed" in capsys.readouterr().err
    # a failure on another rank removes the candidate everywhere (collectives must match)
    rounds = []

    def peer_failed_b(values):           # the first reduction carries the failure flags; a peer's "b" failed
        rounds.append(list(values))
        return [values[0], 1.0] if len(rounds) == 1 else list(values)
    got = bench_interleaved({"a": make("a"), "b": make("b")}, iters=2, warm=1, timer=timer, reduce_max=peer_failed_b)
    assert rounds[0] == [0.0, 0.0] and len(rounds[1]) == 1                        # only "a" was timed
    assert got["b"] != got["b"] and got["a"] == got["a"]


def test_bench_row_and_table():
    import io
    from tldsl.bench.dist import _row, _table
    times = {"comm": 0.3, "gemm": 2.5, "seq": 2.9, "asynctp": 2.95, "ours": 2.75, "own": 2.6}
    out = io.StringIO()
    row = _row(8192, 8192, 8192, 2, times, [], True, 0.01, None, out, rank=0)
    assert row["ideal"] == 2.5 and row["ours"] == 2.75 and "ours 2.750 ms" in out.getvalue()
    assert _row(8192, 8192, 8192, 2, times, [], False, 9.0, None, io.StringIO(), rank=1)["correct"] is False
    _table([row], "NCCL AG ms", out, "float16")
    lines = out.getvalue().strip().splitlines()
    assert "float16, world size 2:" in lines            # the table says which dtype it timed
    last = lines[-1]
    assert last == "| 8192 | 8192 | 8192 | 2.750 | 2.900 | 2.950 | 0.300 | 2.500 | 2.600 | 2.500 | 1.100 | 0.948 | 0.932 | yes |"


def test_launchers_check_their_tensors_before_launch():
    """Every launcher (GEMM, grouped GEMM, attention) checks its tensors through one base method:
    missing, not on the GPU, wrong shape, wrong dtype — each named, before anything launches."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace
    from tldsl.runtime.gpu.launcher import Launcher

    class CudaLike(torch.Tensor):        # a CPU tensor that says it is on the GPU
        is_cuda = True

    launcher = Launcher()
    launcher.lowered = SimpleNamespace(entry="tldsl_k")
    ok = torch.zeros(4, 8, dtype=torch.bfloat16).as_subclass(CudaLike)
    assert launcher.checked_tensor({"a": ok}, "a", (4, 8), "bf16", tma=True) is ok
    for bufs, shape, dt, msg in (({}, (4, 8), "bf16", "tldsl_k: missing tensor 'a'"),
                                 ({"a": torch.zeros(4, 8, dtype=torch.bfloat16)}, (4, 8), "bf16", "CUDA torch tensor"),
                                 ({"a": ok}, (8, 4), "bf16", r"shape \(4, 8\); the kernel was built for \(8, 4\)"),
                                 ({"a": ok}, (4, 8), "f16", "is torch.bfloat16; the kernel was built for torch.float16"),
                                 ({"a": ok.t()}, (8, 4), "bf16", "contiguous")):
        with pytest.raises(tl.InputError, match=msg):
            launcher.checked_tensor(bufs, "a", shape, dt)


def test_probes_take_their_own_iteration_counts_unless_told(monkeypatch):
    """``--iters`` reaches a probe only when given; otherwise each probe keeps its own default
    (ag_skew's 80 calls, the one-GPU probes' 30)."""
    import inspect
    import tldsl.bench.probes as bp
    own = {name: inspect.signature(getattr(bp, f"probe_{name}")).parameters["iters"].default
           for name in ("ag_skew", "epilogue", "rs_order")}
    assert own == {"ag_skew": 80, "epilogue": 30, "rs_order": 20}
    for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(k, "0" if k == "NCCL_NVLS_ENABLE" else "1")
    seen = []
    for name in own:
        monkeypatch.setattr(bp, f"probe_{name}", lambda shapes, name=name, **kw: seen.append((name, kw)))
    bp.main(["ag_skew"])
    bp.main(["ag_skew", "--iters", "7"])
    bp.main(["epilogue"])
    bp.main(["rs_order", "--iters", "5"])
    assert seen == [("ag_skew", {}), ("ag_skew", {"iters": 7}), ("epilogue", {}), ("rs_order", {"iters": 5})]


def _op_blocks(op):
    """Weak references to the storages of every symmetric block ``op``'s lease holds."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from tldsl.runtime.dist import symmetric as sym
    blocks = sym._LEDGER[op._lease.key].blocks
    assert blocks and all(b.tensor is not None for b in blocks)
    return [StorageWeakRef(b.tensor.untyped_storage()) for b in blocks]


@pytest.mark.parametrize("build", ["ag pull", "ag push", "ag gemm-push", "rs copy_engine", "rs epilogue"])
def test_ops_free_their_symmetric_memory_at_close_and_never_when_dropped(proto, monkeypatch, build):
    """Every op's symmetric blocks (shard slots, landing buffers, counters, workspaces) are freed
    by close() — right there, nothing of them left in the op or its engine — and an op dropped
    without close() warns and frees nothing until release_unclosed()."""
    import gc
    import warnings
    from tldsl.runtime.dist import symmetric as sym
    from tldsl.runtime.dist.ag_gemm import AllGatherMatmul
    from tldsl.runtime.dist.gemm_rs import MatmulReduceScatter
    torch = proto.torch
    _fake_torch_symmetric_memory(proto, monkeypatch)
    push = tl.CommSchedule(engine="copy_engine", mode="push")
    make = {"ag pull": lambda: AllGatherMatmul(4091, 1032, 3000, torch.bfloat16, handshake="device"),
            "ag push": lambda: AllGatherMatmul(1024, 1032, 3000, torch.bfloat16),
            "ag gemm-push": lambda: AllGatherMatmul(1024, 1032, 3000, torch.bfloat16, pusher="gemm"),
            "rs copy_engine": lambda: MatmulReduceScatter(4096 * 2, 1032, 3000, "bfloat16"),
            "rs epilogue": lambda: MatmulReduceScatter(2048 * 2, 1032, 3000, "bfloat16",
                                                       comm=push.with_(reduce_in="epilogue")),
            }[build]
    op = make()
    engine = getattr(op, "_engine", None)
    refs = _op_blocks(op)
    rows, k, n = (op.Ms, op.K, op.N) if build.startswith("ag") else (op.M, op.K, op.N)
    for _ in range(3):                                  # calls leave prepared launches, spares, views
        op(torch.randn(rows, k).to(torch.bfloat16), torch.randn(k, n).to(torch.bfloat16))
    proto.gemm_args = None                              # (the fake GEMM's record of its last buffers)
    key = op._lease.key
    with warnings.catch_warnings():
        warnings.simplefilter("error")                  # a clean close warns of nothing
        op.close()
    assert all(r.expired() for r in refs), build        # freed at close, no view of them left behind
    assert key not in sym._LEDGER
    assert repr(op).endswith("closed>")                 # (calls after it raise: test_dist_operands)
    assert op.describe().startswith(repr(op)[1:-1]) and "3 launches, closed" in op.describe()
    assert op.describe().endswith("its symmetric memory is freed")
    for look in (op.workspace_tensors, op.signal_map, op.signal_tensors):   # its views went: a clear error
        with pytest.raises(tl.InputError, match="was closed"):
            look()
    op.close()                                          # twice: nothing more to do
    del op, engine
    # dropped without close(): nothing is freed, however the op goes
    op = make()
    refs = _op_blocks(op)
    with pytest.warns(sym.SymmetricMemoryWarning, match="dropped without close"):
        del op
        gc.collect()
    assert not any(r.expired() for r in refs)
    assert sym.release_unclosed() == 1 and all(r.expired() for r in refs)


def test_each_engine_is_named_and_a_schedule_without_one_is_refused(proto, monkeypatch, fake_ag):
    """The recipe table picks the engine (runtime/dist/recipes.py), and describe() names it for
    both fused GEMM ops; a communication schedule no engine runs (the GEMM as the communication
    engine, which only pusher='gemm' selects) is refused before anything is allocated."""
    from tldsl.runtime.dist.gemm_rs import MatmulReduceScatter
    AllGatherMatmul, torch = fake_ag
    pull = AllGatherMatmul(4091, 1032, 3000, torch.bfloat16)
    assert pull.engine == "copy_engine" and "; engine copy_engine" in pull.describe().splitlines()[0]
    assert "copy_engine (direct pull): handshake device, staging kernel" in pull.describe()
    push = AllGatherMatmul(4096, 1032, 3000, torch.bfloat16)
    assert push.engine == "copy_engine-push" and push.staging is None
    rs = MatmulReduceScatter(2 * 4091, 1032, 3000, "bfloat16")
    assert rs.engine == "copy_engine" and "; engine copy_engine" in rs.describe().splitlines()[0]
    with pytest.raises(tl.InputError, match="copy-engine and SM schedules; got .*engine='compute'"):
        AllGatherMatmul(4096, 1032, 3000, torch.bfloat16, comm=tl.CommSchedule(engine="compute", mode="push", own_rows="compute"))
    for op in (pull, push, rs):
        op.close()


def test_a_launch_runs_the_hoisted_copies_before_it_forks_any_part():
    """enqueue_launch(hoist=True): every copy-engine part's hoisted segments go on the caller's
    stream after the launch's start, then a fork event the other streams wait on (not the start),
    then each part on its own stream — a copy-engine part with only the rest of its actions; with
    nothing to hoist, the streams wait on the start as before."""
    from tldsl.runtime.gpu.run_program import enqueue_launch
    calls = []

    class Dev:
        def __init__(self):
            self.n = 0

        def event(self, timing=False):
            self.n += 1
            return f"ev{self.n}"

        def record(self, ev, s):
            calls.append(("record", ev, s))

        def wait_event(self, s, ev):
            calls.append(("wait", s, ev))

        def launch(self, fn, item, args, s):
            calls.append(("launch", item.part, s))

        def destroy(self, evs):
            calls.append(("destroy", tuple(evs)))

    class Copies:
        def __init__(self, hoisted):
            self.hoisted = hoisted

        def enqueue(self, s, launch, only="all"):
            calls.append(("copies", only, s, launch))

    kernel = SimpleNamespace(source="", entry="k")
    items = [SimpleNamespace(rank=0, part="gather", stream=0, lowered=object()),
             SimpleNamespace(rank=0, part="gemm", stream=1, lowered=kernel)]
    args = {(0, "gemm"): (SimpleNamespace(set=lambda slot, v: None), None)}
    for hoisted in ((True, False), (False, False)):
        calls.clear()
        enqueue_launch(Dev(), items, 3, {"k": "fn"}, args, {(0, "gather"): Copies(hoisted)}, 100, [10, 11],
                       hoist=True)
        fork = "ev3" if any(hoisted) else "ev1"
        head = [("record", "ev1", 100)] + ([("copies", "hoisted", 100, 3), ("record", "ev3", 100)] if any(hoisted)
                                           else [])
        assert calls[:len(head)] == head
        assert calls[len(head):len(head) + 4] == [("wait", 10, fork), ("wait", 11, fork),
                                                  ("copies", "rest", 10, 3), ("launch", "gemm", 11)]
        assert calls[-1][0] == "destroy" and (fork in calls[-1][1]) == any(hoisted)
    calls.clear()                                   # tl.run's launches: nothing hoisted, every action in place
    enqueue_launch(Dev(), items, 1, {"k": "fn"}, args, {(0, "gather"): Copies((True, False))}, 100, [10, 11])
    assert ("copies", "all", 10, 1) in calls and not any(c[0] == "copies" and c[1] != "all" for c in calls)


def test_a_notify_adding_from_a_kernel_keeps_sms_free_unless_it_is_hoisted():
    """A copy-engine notify of a slot with other writers adds from a one-thread kernel, which needs
    an SM: SMs stay free beside the persistent kernels for every rank whose add runs after the
    fork (ranks 1 and 2: their copies cross GPUs, so nothing of theirs is hoisted); rank 0's copy
    into its own g and its add are hoisted ahead of the parts."""
    from test_run_fake_device import gather_arrivals
    from tldsl.runtime.gpu.plan_exec import local_copies_left
    from tldsl.runtime.gpu.run_plan import lower_for_run, needs_free_sms
    k = gather_arrivals.trace(3, S((8,), tl.float32), S((24,), tl.float32), S((24,), tl.float32),
                              comm=tl.CommSchedule(engine="copy_engine"))
    lowered = lower_for_run(k)
    plan = lowered["send"]
    assert all(a.add for acts in plan.actions for a in acts if isinstance(a, CeSignalWrite))
    assert [local_copies_left(plan, r) for r in range(3)] == [False, True, True]
    assert needs_free_sms(lowered.values(), 3, hoist_local_copies=True)

