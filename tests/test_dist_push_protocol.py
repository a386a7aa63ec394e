"""The copy-engine push protocol of AllGather+GEMM (runtime/dist/ag_push.py), executed on two
simulated ranks: both ranks' real ``PushAllGather`` objects enqueue their launches into a fake
driver whose streams hold the CPU tensors themselves, and a scheduler runs the streams in a
random order (a stream op runs only when its stream waits, event waits and the GEMM's flag
waits allow). The GEMM is a stand-in with the generated kernel's contract: it waits until every
peer's flag holds the launch, then reads the peers' rows from the landing slot and its own rows
from the shard into A_gathered. Every launch's A_gathered must be exactly the launch's shards,
whatever the order the streams ran in: a landing slot overwritten before its GEMM read it, a
flag written before its data, or a deadlock, fails.
"""
from __future__ import annotations

import random
import threading
import types
from collections import deque

import pytest

torch = pytest.importorskip("torch")

import tldsl as tl  # noqa: E402


class Deadlock(AssertionError):
    pass


class _Result(tuple):
    pass


class Device:
    """The fake driver (the calls ``PushAllGather`` makes) and the streams it runs."""

    class CUresult:
        CUDA_SUCCESS = 0

    CUevent_flags = types.SimpleNamespace(CU_EVENT_DISABLE_TIMING=2)
    CUstreamWriteValue_flags = types.SimpleNamespace(CU_STREAM_WRITE_VALUE_DEFAULT=0)
    CUstreamWaitValue_flags = types.SimpleNamespace(CU_STREAM_WAIT_VALUE_GEQ=1)

    def __init__(self):
        self.queues: dict[int, deque] = {}
        self.memory: list[tuple[int, int, object]] = []      # (address, bytes, uint8 numpy view)
        self.events: dict[int, list] = {}                     # event -> [records so far, set of records completed]
        self.next_event = 100

    # -- memory ------------------------------------------------------------------------------------
    def register(self, t):
        self.memory.append((t.data_ptr(), t.numel() * t.element_size(), t.view(torch.uint8).reshape(-1).numpy()))
        return t

    def bytes(self, addr: int, n: int):
        for base, size, view in self.memory:
            if base <= addr and addr + n <= base + size:
                return view[addr - base:addr - base + n]
        raise AssertionError(f"simulated GPU: [{addr:#x}, +{n}) is outside every registered tensor")

    def u64(self, addr: int):
        return self.bytes(addr, 8).view("<u8")

    # -- driver calls ------------------------------------------------------------------------------
    def _enqueue(self, stream: int, name: str, op):
        self.queues.setdefault(int(stream), deque()).append((name, op))
        return (0,)

    def cuEventCreate(self, flags):
        self.next_event += 1
        self.events[self.next_event] = [0, set()]
        return (0, self.next_event)

    def cuEventDestroy(self, ev):
        return (0,)

    def cuEventRecord(self, ev, stream):
        rec = self.events[ev]
        rec[0] += 1
        ticket = rec[0]

        def op():
            rec[1].add(ticket)
            return True
        return self._enqueue(stream, "record", op)

    def cuStreamWaitEvent(self, stream, ev, flags):
        # the wait binds to the event's latest record at the time of the call (none: no wait),
        # whatever the event is recorded on later
        rec = self.events[ev]
        target = rec[0]
        return self._enqueue(stream, "wait event", lambda: target == 0 or target in rec[1])

    def cuStreamWaitValue64(self, stream, addr, value, flags):
        return self._enqueue(stream, "wait value", lambda: int(self.u64(addr)[0]) >= int(value))

    def cuStreamWriteValue64(self, stream, addr, value, flags):
        def op():
            self.u64(addr)[0] = int(value)
            return True
        return self._enqueue(stream, "write value", op)

    def cuMemcpyAsync(self, dst, src, n, stream):
        def op():
            self.bytes(dst, n)[:] = self.bytes(src, n)
            return True
        return self._enqueue(stream, "copy", op)

    def cuGetErrorName(self, err):
        return (0, b"simulated error")

    def cuGetErrorString(self, err):
        return (0, b"simulated error")

    # -- the device --------------------------------------------------------------------------------
    def run(self, rng: random.Random, max_steps: int = 1_000_000) -> None:
        """Run the streams' head ops until all queues are empty: in a random order, half the
        time with random priorities held for a while (the highest-priority stream that can
        progress runs — so some streams starve while others run far ahead, the schedules where
        a reused buffer is overwritten early)."""
        starve = rng.random() < 0.5
        prio: dict = {}
        for step in range(max_steps):
            live = [s for s, q in self.queues.items() if q]
            if not live:
                return
            if starve:
                if step % 64 == 0:
                    prio = {s: rng.random() for s in self.queues}
                live.sort(key=lambda s: -prio.get(s, 0.0))
            else:
                rng.shuffle(live)
            for s in live:
                name, op = self.queues[s][0]
                if op():
                    self.queues[s].popleft()
                    break
            else:
                heads = {s: self.queues[s][0][0] for s in live}
                raise Deadlock(f"no stream can progress; heads: {heads}")
        raise AssertionError("simulation did not finish")


class _Gemm:
    """The gathering GEMM's contract (``GatherRows``): wait for every peer's flag, read the peers'
    rows from the landing slot and this rank's from the shard into A_gathered."""

    def __init__(self, device, world_size):
        self.device, self.W = device, world_size

    def __call__(self, lowered, compiled=None, progress=None, reserve_sms=0):
        gemm = types.SimpleNamespace(lowered=lowered, grid=(132, 1, 1), reserve=reserve_sms)
        device, W = self.device, self.W

        def prepare(buffers, signals=None, rank=0):
            (flags,) = signals.values()
            landing, shard, copy = buffers["a_gathered"], buffers["a_shard"], buffers["a_copy"]
            Ms = shard.shape[0]

            def launch(stream, L):
                def op():
                    if any(int(flags[p]) < L for p in range(W) if p != rank):
                        return False
                    for p in range(W):
                        rows = slice(p * Ms, (p + 1) * Ms)
                        copy[rows] = shard if p == rank else landing[rows]
                    return True
                device._enqueue(stream, f"GEMM {L}", op)
            return types.SimpleNamespace(launch=launch)
        gemm.prepare = prepare
        return gemm


class _Ranks:
    """Two ranks' ops built in two threads (construction is collective), then driven from one."""

    def __init__(self, monkeypatch, Ms=128, K=16, N=24, W=2):
        from tldsl.runtime.dist import ag_gemm as agm, ag_push, plan_exec
        from tldsl.runtime.gpu import gemm as gemm_mod
        import torch.distributed._symmetric_memory as symm_mem
        self.W, self.Ms, self.K, self.N = W, Ms, K, N
        self.device = dev = Device()
        self.local = threading.local()
        self.streams = iter(range(1, 10 ** 6))
        self.current = {}                                  # rank -> its current (raw) stream
        barrier = threading.Barrier(W)
        rendezvous: dict = {}
        mp = monkeypatch
        mp.setattr(plan_exec, "load_driver", lambda: dev)
        mp.setattr(gemm_mod, "GemmKernel", _Gemm(dev, W))
        mp.setattr(agm.AllGatherMatmul, "_check", lambda self, a, b: None)       # CPU tensors stand in
        ranks = self

        def ctx(group=None):
            return types.SimpleNamespace(rank=ranks.local.rank, world_size=W, device=0, group=None, group_name="g",
                                         backend="CUDA")
        mp.setattr(agm, "dist_context", ctx)

        def empty(size, dtype=None, device=None):
            return dev.register(torch.empty(size, dtype=dtype))

        class Handle:
            def __init__(self, t):
                me, key = ranks.local.rank, ranks.local.calls
                ranks.local.calls += 1
                rendezvous.setdefault(key, {})[me] = t.data_ptr()
                barrier.wait()
                self.buffer_ptrs = [rendezvous[key][q] for q in range(W)]

            def barrier(self, channel=0):
                barrier.wait()
        mp.setattr(symm_mem, "empty", empty)
        mp.setattr(symm_mem, "rendezvous", lambda t, group_name: Handle(t))

        class Stream:
            def __init__(self, device=None, stream_id=None):
                self.cuda_stream = next(ranks.streams) if stream_id is None else stream_id
        mp.setattr(torch.cuda, "Stream", Stream)
        mp.setattr(torch.cuda, "current_stream", lambda device=None: Stream(stream_id=ranks.current[ranks.local.rank]))
        mp.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: ranks.current[ranks.local.rank],
                   raising=False)
        real_empty = torch.empty
        mp.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **{x: v for x, v in k.items() if x != "device"}))
        self.ops = [None] * W
        errors = []

        def build(r):
            try:
                self.local.rank, self.local.calls = r, 0
                self.current[r] = next(self.streams)
                self.ops[r] = agm.AllGatherMatmul(Ms, K, N, torch.bfloat16)
            except BaseException as ex:   # noqa: BLE001 - re-raised in the test's thread
                errors.append(ex)
                barrier.abort()
        threads = [threading.Thread(target=build, args=(r,)) for r in range(W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        assert all(isinstance(op._engine, ag_push.PushAllGather) for op in self.ops)

    def call(self, r: int, shard, b, stream: int | None = None):
        self.local.rank = r
        if stream is not None:
            self.current[r] = stream
        return self.ops[r](shard, b)


def _run_launches(monkeypatch, seed: int, launches: int = 6, streams_per_rank: int = 1):
    rng = random.Random(seed)
    ranks = _Ranks(monkeypatch)
    W, Ms, K, N = ranks.W, ranks.Ms, ranks.K, ranks.N
    own_streams = {r: [next(ranks.streams) for _ in range(streams_per_rank)] for r in range(W)}
    b = torch.zeros(K, N, dtype=torch.bfloat16)
    expected, got = [], []
    for L in range(1, launches + 1):
        shards = [ranks.device.register(torch.randn(Ms, K).to(torch.bfloat16)) for _ in range(W)]
        expected.append(torch.cat(shards))
        outs = []
        for r in rng.sample(range(W), W):                  # the hosts enqueue in either order
            stream = own_streams[r][(L - 1) % streams_per_rank]
            outs.append((r, ranks.call(r, shards[r], b, stream)[0]))
        got.append(dict(outs))
    ranks.device.run(rng)
    for L, (want, per_rank) in enumerate(zip(expected, got), start=1):
        for r, a_full in per_rank.items():
            assert torch.equal(a_full, want), f"seed {seed}: rank {r}'s A_gathered of launch {L} is wrong"
    return ranks


@pytest.mark.parametrize("streams_per_rank", [1, 2])
@pytest.mark.parametrize("seed", range(10))
def test_push_protocol_on_two_simulated_ranks(monkeypatch, seed, streams_per_rank):
    """Six launches per rank, on one stream or alternating between two (the op orders a call on
    a new stream after the previous call's stream: runtime/dist/call_order.py)."""
    ranks = _run_launches(monkeypatch, seed, streams_per_rank=streams_per_rank)
    # the counters after 6 launches: every peer's flag here holds 6, its "done" 5 (written a launch later)
    for r, op in enumerate(ranks.ops):
        assert op._engine.flags.tolist() == [6 if p != r else 0 for p in range(2)]
        assert op._engine.consumed.tolist() == [5 if p != r else 0 for p in range(2)]


def _failing_seeds(monkeypatch, break_it, streams_per_rank=1, seeds=range(30)) -> list[int]:
    failed = []
    for seed in seeds:
        with monkeypatch.context() as mp:
            break_it(mp)
            try:
                _run_launches(mp, seed, streams_per_rank=streams_per_rank)
            except AssertionError:
                failed.append(seed)
    return failed


def test_the_model_catches_broken_protocols(monkeypatch):
    """The model can fail: pushing into the landing slot the peer is reading, or letting a call
    on a new stream overtake the previous call (its counters would vouch for a launch that has
    not run), gives some schedule a wrong A_gathered."""
    from tldsl.runtime.dist import ag_push, call_order

    def other_slot(mp):
        plan = ag_push.PushAllGather._plan_addresses

        def swapped(self, *a):
            plan(self, *a)
            self._peer_plan = [(p, c, (d[1], d[0]), f) for p, c, d, f in self._peer_plan]
        mp.setattr(ag_push.PushAllGather, "_plan_addresses", swapped)

    def unordered(mp):
        mp.setattr(call_order.CallOrder, "follow", lambda self, cu, stream: None)
    assert _failing_seeds(monkeypatch, other_slot, seeds=range(4)) == list(range(4))
    assert _failing_seeds(monkeypatch, unordered, streams_per_rank=2)
    assert not _failing_seeds(monkeypatch, lambda mp: None, streams_per_rank=2, seeds=range(10))
