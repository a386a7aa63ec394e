"""The launch protocols of the default fused ops, executed on two simulated ranks: AllGather+GEMM's
copy-engine push (runtime/dist/ag_push.py; or the GEMM pushing its own rows, pusher="gemm") and pull
(runtime/dist/ag_pull.py) — with the staging kernel as the handshake (the default where rows are
not whole tiles) or with the GEMM staging its own rows — and GEMM+ReduceScatter on the copy engine
(runtime/dist/gemm_rs_copy.py). Both ranks' real op objects enqueue their launches into a fake
driver whose streams hold the CPU tensors themselves, and a scheduler runs the streams in random
orders, some starving streams for a while (a stream op runs only when its stream waits, event
waits and the kernels' counter waits allow).

No kernel is modelled by hand. Every GEMM is the program it was compiled from
(``lowered.program``: the compute part and the parts the schedule fused into it — the GEMM that
stages or pushes this rank's rows), run by the simulator's rules (runtime/sim/bound_launch.py) on
the device's memory, task by task, blocked on its waits (``_CompiledGemm``). The staging kernel,
hand-written CUDA, runs as the program it implements: the staging part the same AllGather+GEMM
traces with ``own_rows='compute'`` (``_Stager``). Every launch's output must be exact whatever
order the streams ran in: a buffer overwritten before it was read, a counter written before its
data, or a deadlock, fails — and each test shows the model catching a protocol with one of its
waits or its call order removed, or (``test_the_compiled_program_is_what_runs``) a
synchronisation primitive deleted from the GEMM's program.
"""
from __future__ import annotations

import random
import threading
import types
from collections import deque

import numpy as np

import pytest

torch = pytest.importorskip("torch")

import tldsl as tl  # noqa: E402


class Deadlock(AssertionError):
    pass


class _Result(tuple):
    pass


class CaptureError(AssertionError):
    """What the driver refuses while a stream captures a CUDA graph."""


class Graph:
    """The work a capture recorded: per call, its stream and how to issue it again (on a stream)."""

    def __init__(self, origin: int):
        self.origin = origin
        self.calls: list[tuple[int, object]] = []
        self.last: dict[int, int] = {}        # stream -> index of its last call
        self.joined: dict[int, int] = {}      # stream -> the last of its calls another captured stream waited for


class Device:
    """The fake driver (the calls ``PushAllGather`` makes) and the streams it runs.

    CUDA graphs: :meth:`begin_capture` makes a stream capture instead of run — every call on it,
    and on any stream that waits for an event recorded in the capture (a fork), is recorded in a
    :class:`Graph`, not queued. :meth:`end_capture` refuses work forked and never joined back;
    :meth:`replay` issues the recorded calls again, in their order, the origin's on the replay
    stream and every forked stream's on a fresh stream (a replay owes nothing to the streams the
    capture ran on). While capturing, waiting for an event recorded outside the capture, and a
    host synchronisation (:meth:`synchronize`), raise :class:`CaptureError`."""

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
        self.capture_of: dict[int, Graph] = {}                # capturing stream -> its graph
        self.event_graph: dict[int, tuple] = {}               # event whose latest record is captured -> (graph, stream, call)
        self.fresh_streams = iter(range(10 ** 7, 10 ** 8))
        self.arrivals: dict = {}                              # barrier key -> per-rank arrivals so far

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

    def queue(self, stream: int, name: str, op, again=None) -> None:
        """A kernel that runs in steps: ``op()`` answers True once done, "step" when it made
        progress, False when it cannot (its tasks all wait). ``again(stream)``: the same launch
        issued anew (what a graph replays; None: this launch cannot be captured)."""
        self._enqueue(stream, name, op, again)

    def kernel(self, stream: int, name: str, work, ready=lambda: True) -> None:
        """A stand-in kernel on ``stream``: ``work()`` once ``ready()`` (its spin-waits) holds."""
        def op():
            if not ready():
                return False
            work()
            return True
        self._enqueue(stream, name, op, lambda s: self.kernel(s, name, work, ready))

    def barrier(self, stream: int, key, rank: int, world: int) -> None:
        """torch symmetric memory's barrier kernel on ``stream``: this rank arrives, then waits
        until every rank has arrived as often (its signal pads reset themselves: replayable)."""
        arrived = self.arrivals.setdefault(key, [0] * world)
        state = {}

        def op():
            if not state:
                arrived[rank] += 1
                state["n"] = arrived[rank]
                return all(a >= state["n"] for a in arrived) or "step"
            return all(a >= state["n"] for a in arrived)
        self._enqueue(stream, "barrier", op, lambda s: self.barrier(s, key, rank, world))

    # -- CUDA graphs -------------------------------------------------------------------------------
    def begin_capture(self, stream: int) -> Graph:
        if int(stream) in self.capture_of:
            raise CaptureError(f"stream {stream} is already capturing")
        g = self.capture_of[int(stream)] = Graph(int(stream))
        return g

    def end_capture(self, g: Graph) -> Graph:
        unjoined = [s for s, last in g.last.items() if s != g.origin and g.joined.get(s, -1) < last]
        self.abort_capture(g)
        if unjoined:
            raise CaptureError(f"capture ended with work on stream(s) {unjoined} not joined back into the origin "
                               f"stream (cudaErrorStreamCaptureUnjoined)")
        return g

    def abort_capture(self, g: Graph) -> None:
        for s in [s for s, x in self.capture_of.items() if x is g]:
            del self.capture_of[s]
        for ev in [e for e, info in self.event_graph.items() if info[0] is g]:
            del self.event_graph[ev]

    def replay(self, g: Graph, stream: int) -> None:
        """One launch of the graph on ``stream``."""
        if self.capture_of:
            raise CaptureError("a graph launched while a stream captures")
        where = {g.origin: int(stream)}
        for s, again in g.calls:
            if s not in where:
                where[s] = next(self.fresh_streams)
            again(where[s])

    def synchronize(self) -> None:
        """The host waits for the device: refused while capturing (here the device runs later)."""
        if self.capture_of:
            raise CaptureError("synchronize() while a stream captures a graph (cudaErrorStreamCaptureUnsupported)")

    # -- driver calls ------------------------------------------------------------------------------
    def _enqueue(self, stream: int, name: str, op, again=None):
        g = self.capture_of.get(int(stream))
        if g is not None:
            if again is None:
                raise CaptureError(f"'{name}' on a capturing stream: this simulated work cannot be captured")
            g.calls.append((int(stream), again))
            g.last[int(stream)] = len(g.calls) - 1
            return (0,)
        self.queues.setdefault(int(stream), deque()).append((name, op))
        return (0,)

    def cuEventCreate(self, flags):
        self.next_event += 1
        self.events[self.next_event] = [0, set()]
        return (0, self.next_event)

    def cuEventDestroy(self, ev):
        return (0,)

    def cuEventRecord(self, ev, stream):
        g = self.capture_of.get(int(stream))
        if g is not None:           # a record in the capture: a wait for it forks the waiting stream into it
            res = self._enqueue(stream, "record", None, lambda s: self.cuEventRecord(ev, s))
            self.event_graph[ev] = (g, int(stream), len(g.calls) - 1)
            return res
        self.event_graph.pop(ev, None)
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
        captured = self.event_graph.get(ev)
        g = self.capture_of.get(int(stream))
        if captured is not None:
            if g is None:           # a fork: the stream joins the capture
                g = self.capture_of[int(stream)] = captured[0]
            elif g is not captured[0]:
                raise CaptureError("a capture waits for an event recorded in another capture")
            g.joined[captured[1]] = max(g.joined.get(captured[1], -1), captured[2])
            return self._enqueue(stream, "wait event", None, lambda s: self.cuStreamWaitEvent(s, ev, flags))
        rec = self.events[ev]
        target = rec[0]
        if g is not None and target:
            raise CaptureError(f"a capturing stream waits for event {ev}, recorded outside the capture "
                               f"(cudaErrorStreamCaptureIsolation)")
        return self._enqueue(stream, "wait event", lambda: target == 0 or target in rec[1],
                             lambda s: self.cuStreamWaitEvent(s, ev, flags))

    def cuStreamWaitValue64(self, stream, addr, value, flags):
        return self._enqueue(stream, "wait value", lambda: int(self.u64(addr)[0]) >= int(value),
                             lambda s: self.cuStreamWaitValue64(s, addr, value, flags))

    def tldsl_signal_add(self, stream, addr):
        def op():
            self.u64(addr)[0] += 1
            return True
        return self._enqueue(stream, "signal add", op, lambda s: self.tldsl_signal_add(s, addr))

    def cuStreamWriteValue64(self, stream, addr, value, flags):
        def op():
            self.u64(addr)[0] = int(value)
            return True
        return self._enqueue(stream, "write value", op, lambda s: self.cuStreamWriteValue64(s, addr, value, flags))

    def cuMemsetD8Async(self, addr, value, n, stream):
        def op():
            self.bytes(addr, n)[:] = value
            return True
        return self._enqueue(stream, "memset", op, lambda s: self.cuMemsetD8Async(addr, value, n, s))

    def cuMemcpyAsync(self, dst, src, n, stream):
        def op():
            self.bytes(dst, n)[:] = self.bytes(src, n)
            return True
        return self._enqueue(stream, "copy", op, lambda s: self.cuMemcpyAsync(dst, src, n, s))

    class CUDA_MEMCPY2D:
        """The fields the runtime sets (read at the call, like the driver's)."""

    CUmemorytype = types.SimpleNamespace(CU_MEMORYTYPE_DEVICE=2)

    def cuMemcpy2DAsync(self, p, stream):
        assert p.srcMemoryType == p.dstMemoryType == self.CUmemorytype.CU_MEMORYTYPE_DEVICE
        assert p.srcXInBytes == p.srcY == p.dstXInBytes == p.dstY == 0
        src, dst, sp, dp, w, h = p.srcDevice, p.dstDevice, p.srcPitch, p.dstPitch, p.WidthInBytes, p.Height

        def op():
            for row in range(h):
                self.bytes(dst + row * dp, w)[:] = self.bytes(src + row * sp, w)
            return True
        fields = types.SimpleNamespace(srcMemoryType=p.srcMemoryType, dstMemoryType=p.dstMemoryType, srcXInBytes=0,
                                       srcY=0, dstXInBytes=0, dstY=0, srcDevice=src, dstDevice=dst, srcPitch=sp,
                                       dstPitch=dp, WidthInBytes=w, Height=h)
        return self._enqueue(stream, "copy 2d", op, lambda s: self.cuMemcpy2DAsync(fields, s))

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
        from tldsl.runtime.sim.blas_threads import one_blas_thread
        with one_blas_thread():           # the compiled GEMMs' tiles: small matmuls, one BLAS thread
            self._run(rng, max_steps)

    def _run(self, rng: random.Random, max_steps: int) -> None:
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
                progress = op()            # True: done; "step": progressed (a kernel's task ran); False: blocked
                if progress:
                    if progress is True:
                        self.queues[s].popleft()
                    break
            else:
                heads = {s: self.queues[s][0][0] for s in live}
                raise Deadlock(f"no stream can progress; heads: {heads}")
        raise AssertionError("simulation did not finish")


def _small_ints(*shape):
    """bf16 integers in [-2, 2]: the compiled GEMMs' products and sums (K <= 16) are exact in any
    order, so a result equals torch's exactly unless the protocol let in wrong data."""
    return torch.randint(-2, 3, shape).to(torch.bfloat16)


def _raw(t):
    """A tensor's memory as the numpy array the simulator's rules read and write (bf16: its bits)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class _CompiledGemm:
    """The compiled GEMM itself, not a model of it: the tile program it was lowered from
    (``lowered.program``: the compute part and the parts the schedule fused into it) run by the
    simulator's rules (runtime/sim/bound_launch.py) on this device's memory — every task blocked
    on its waits until the counters it reads (in the tensors the runtime passed) reach the
    launch's targets. Names bind as the launcher binds them: this rank's buffers and signals by
    their IR names; a peer's copy of a signal through the ``<signal>_peers`` address table the
    runtime passes; a peer's gathered tensor (the GEMM pushing) through ``push_landing_<q>``, the
    slot of the launch's parity. The fused kernel reads this rank's rows from the shard, so it
    never notifies this rank's own ready slot; the program does (its own-rows part) — the one
    counter the two leave different. It stands in for ``GemmKernel``: ``prepare(buffers, signals,
    rank)`` gives a launch whose ``launch(stream, L)`` queues the program on ``stream``."""

    #: ``program -> program``: what the tests run instead of the compiled program (a mutant)
    mutate = None

    def __init__(self, ranks):
        self.ranks = ranks
        self.programs = {}

    def __call__(self, lowered, compiled=None, progress=None, reserve_sms=0):
        gemm = types.SimpleNamespace(lowered=lowered, grid=(132, 1, 1), reserve=reserve_sms)
        gemm.prepare = lambda buffers, signals=None, rank=0, hold=True: types.SimpleNamespace(
            launch=lambda stream, L: self.enqueue(stream, L, lowered, buffers, signals, rank))
        return gemm

    def enqueue(self, stream, L, lowered, buffers, signals, rank):
        from tldsl.codegen.plan.gemm import push_landing
        kernel, part = lowered.program
        if self.mutate is not None:
            kernel = self.programs.setdefault(id(kernel), self.mutate(kernel))
        W, device = kernel.world_size, self.ranks.device
        signals = signals or {}
        gathered = lowered.tma_buffer("tma_a")
        M = kernel.buffer(gathered).type.shape[0]

        def buffer(r, name):
            if r == rank:
                return _raw(buffers[name])
            assert name == gathered, f"rank {rank}'s GEMM reaches rank {r}'s '{name}'"
            q = (r - rank - 1) % W                    # the ring order of the pushes
            return _raw(buffers[push_landing(q)])[(L % 2) * M:(L % 2 + 1) * M]

        def signal(r, name):
            if r == rank:
                return signals[name].numpy()
            slots = kernel.signals[[s.name for s in kernel.signals].index(name)].type.slots
            return device.bytes(int(signals[f"{name}_peers"][r]), 8 * slots).view(np.int64)
        parts = [part.name] + [p.name for p in kernel.parts if p.fused]
        _queue_program(device, stream, f"GEMM {L}", kernel, parts, rank, L, buffer, signal)


def _queue_program(device, stream, name, kernel, parts, rank, L, buffer, signal):
    """Queue launch ``L`` of ``parts`` of ``kernel`` on ``stream``: built when it reaches the head
    of the stream, then run a task step at a time between the other streams' operations."""
    from tldsl.runtime.sim.bound_launch import BoundLaunch
    state = {}

    def run():
        launch = state.get("launch")
        if launch is None:
            launch = state["launch"] = BoundLaunch(kernel, parts, rank, L, buffer, signal,
                                                   random.Random(1000 * L + rank))
        if launch.done:
            return True
        return "step" if launch.step() else False
    device.queue(stream, f"{name} ({kernel.name}: {', '.join(parts)})", run,
                 lambda s: _queue_program(device, s, name, kernel, parts, rank, L, buffer, signal))


class _Ranks:
    """Two ranks' ops built in two threads (construction is collective), then driven from one.
    torch's streams, events and stream contexts are the simulated driver's; every tensor the ops
    allocate lives in its memory."""

    def __init__(self, monkeypatch, make, gemm, W=2):
        """``make(rank)``: the rank's op; ``gemm(ranks)``: the stand-in for ``GemmKernel``."""
        from tldsl.runtime.dist import ag_gemm as agm, gemm_rs as grs
        from tldsl.runtime.gpu import plan_exec
        from tldsl.runtime.gpu import gemm as gemm_mod
        import torch.distributed._symmetric_memory as symm_mem
        self.W = W
        self.device = dev = Device()
        self.local = threading.local()
        self.streams = iter(range(1, 10 ** 6))
        self.current = {}                                  # rank -> its stack of current (raw) streams
        barrier = threading.Barrier(W)
        rendezvous: dict = {}
        mp = monkeypatch
        mp.setattr(plan_exec, "load_driver", lambda: dev)
        mp.setattr(gemm_mod, "GemmKernel", gemm(self))
        mp.setattr(agm.AllGatherMatmul, "_check", lambda self, a, b: None)       # CPU tensors stand in
        ranks = self

        def ctx(group=None):
            return types.SimpleNamespace(rank=ranks.local.rank, world_size=W, device=0, group=None, group_name="g",
                                         backend="CUDA")
        mp.setattr(agm, "dist_context", ctx)
        mp.setattr(grs, "dist_context", ctx)
        mp.setattr(grs, "validate_operands", lambda *a, **k: None)

        class Handle:
            def __init__(self, t):
                me, key = ranks.local.rank, ranks.local.calls
                self.key = key
                ranks.local.calls += 1
                rendezvous.setdefault(key, {})[me] = t
                barrier.wait()
                self.tensors = [rendezvous[key][q] for q in range(W)]
                self.buffer_ptrs = [x.data_ptr() for x in self.tensors]

            def barrier(self, channel=0):
                if getattr(ranks.local, "building", False):     # construction: the ranks' threads meet
                    barrier.wait()
                else:                                            # a launch: the barrier kernel on the stream
                    dev.barrier(ranks.raw_stream(), (self.key, channel), ranks.local.rank, W)

            def get_buffer(self, rank, sizes, dtype, storage_offset=0):
                return self.tensors[rank].view(dtype).reshape(sizes)      # the peer's memory itself
        mp.setattr(symm_mem, "empty", lambda size, dtype=None, device=None: dev.register(torch.empty(size, dtype=dtype)))
        mp.setattr(symm_mem, "rendezvous", lambda t, group_name: Handle(t))
        mp.setattr(symm_mem, "enable_symm_mem_for_group", lambda name: None, raising=False)

        class Stream:
            def __init__(self, device=None, stream_id=None):
                self.cuda_stream = next(ranks.streams) if stream_id is None else stream_id

            def wait_event(self, ev):
                dev.cuStreamWaitEvent(self.cuda_stream, ev.id, 0)

            def wait_stream(self, other):
                ev = Event()
                ev.record(other)
                self.wait_event(ev)

        class Event:
            def __init__(self, *a, **k):
                self.id = dev.cuEventCreate(0)[1]

            def record(self, stream=None):
                dev.cuEventRecord(self.id, (stream or torch.cuda.current_stream()).cuda_stream)

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                ranks.current[ranks.local.rank].append(self.stream.cuda_stream)

            def __exit__(self, *exc):
                ranks.current[ranks.local.rank].pop()
        mp.setattr(torch.cuda, "Stream", Stream)
        mp.setattr(torch.cuda, "Event", Event)
        mp.setattr(torch.cuda, "stream", StreamContext)
        mp.setattr(torch.cuda, "current_stream", lambda device=None: Stream(stream_id=ranks.raw_stream()))
        mp.setattr(torch.cuda, "synchronize", lambda *a: dev.synchronize())
        from tldsl.runtime.dist import call_order
        mp.setattr(call_order, "capturing", lambda: ranks.raw_stream() in dev.capture_of)
        mp.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: ranks.raw_stream(), raising=False)
        mp.setattr(torch.Tensor, "record_stream", lambda t, s: None)
        for name in ("empty", "zeros", "full"):        # every tensor an op allocates is device memory
            real = getattr(torch, name)
            mp.setattr(torch, name, lambda *a, real=real, **k: dev.register(
                real(*a, **{x: v for x, v in k.items() if x != "device"})))
        self.ops = [None] * W
        errors = []

        def build(r):
            try:
                self.local.rank, self.local.calls, self.local.building = r, 0, True
                self.current[r] = [next(self.streams)]
                self.ops[r] = make(r)
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

    def raw_stream(self) -> int:
        return self.current[self.local.rank][-1]

    def call(self, r: int, *args, stream: int | None = None):
        self.local.rank = r
        if stream is not None:
            self.current[r][0] = stream
        return self.ops[r](*args)

    def capture(self, r: int, *args):
        """Rank ``r``'s call captured into a graph, as ``torch.cuda.graph`` does: on a side stream
        of its own (after everything before it has run). Returns (graph, the call's outputs)."""
        self.local.rank = r
        side = next(self.streams)
        self.current[r].append(side)
        g = self.device.begin_capture(side)
        try:
            out = self.ops[r](*args)
        except BaseException:
            self.device.abort_capture(g)
            raise
        finally:
            self.current[r].pop()
        return self.device.end_capture(g), out


def _push_ranks(monkeypatch, Ms=128, K=16, N=24, make=None, gemm=None):
    """Two ranks of AllGatherMatmul's default (the push), with the gathering GEMM's stand-in (or
    ``make(rank)``'s op with ``gemm``'s)."""
    from tldsl.runtime.dist import ag_gemm as agm, ag_push
    ranks = _Ranks(monkeypatch, make or (lambda r: agm.AllGatherMatmul(Ms, K, N, torch.bfloat16)), gemm or _CompiledGemm)
    ranks.Ms, ranks.K, ranks.N = Ms, K, N
    assert all(isinstance(op._engine, ag_push.PushAllGather) for op in ranks.ops)
    return ranks


def _run_launches(monkeypatch, seed: int, launches: int = 6, streams_per_rank: int = 1, make=None, gemm=None,
                  K=16):
    rng = random.Random(seed)
    ranks = _push_ranks(monkeypatch, K=K, make=make, gemm=gemm)
    W, Ms, K, N = ranks.W, ranks.Ms, ranks.K, ranks.N
    own_streams = {r: [next(ranks.streams) for _ in range(streams_per_rank)] for r in range(W)}
    b = ranks.device.register(_small_ints(K, N))
    expected, got = [], []
    for L in range(1, launches + 1):
        shards = [ranks.device.register(_small_ints(Ms, K)) for _ in range(W)]
        gathered = torch.cat(shards)
        expected.append((gathered, (gathered.float() @ b.float()).to(torch.bfloat16)))
        outs = []
        for r in rng.sample(range(W), W):                  # the hosts enqueue in either order
            stream = own_streams[r][(L - 1) % streams_per_rank]
            outs.append((r, ranks.call(r, shards[r], b, stream=stream)))
        got.append(dict(outs))
    ranks.device.run(rng)
    for L, ((want_a, want_c), per_rank) in enumerate(zip(expected, got), start=1):
        for r, (a_full, c) in per_rank.items():
            assert torch.equal(a_full, want_a), f"seed {seed}: rank {r}'s A_gathered of launch {L} is wrong"
            assert torch.equal(c, want_c), f"seed {seed}: rank {r}'s C of launch {L} is wrong"
    return ranks


@pytest.mark.parametrize("streams_per_rank", [1, 2])
@pytest.mark.parametrize("seed", range(10))
def test_push_protocol_on_two_simulated_ranks(monkeypatch, seed, streams_per_rank):
    """Six launches per rank, on one stream or alternating between two (the op orders a call on
    a new stream after the previous call's stream: runtime/dist/call_order.py)."""
    ranks = _run_launches(monkeypatch, seed, streams_per_rank=streams_per_rank)
    # the counters after 6 launches: every peer's flag here holds 6, its "done" 5 (written a launch
    # later); this rank's own flag 6 too, from the program's own-rows part (see _CompiledGemm)
    for r, op in enumerate(ranks.ops):
        assert op._engine.flags.tolist() == [6, 6]
        assert op._engine.consumed.tolist() == [5 if p != r else 0 for p in range(2)]


def _failing_seeds(monkeypatch, break_it, streams_per_rank=1, seeds=range(30), run=None, **kw) -> list[int]:
    """The seeds whose schedule gives a wrong result with the protocol broken by ``break_it(mp)``
    (``run``: the op's launch runner, default the AG push's)."""
    run = run or _run_launches
    failed = []
    for seed in seeds:
        with monkeypatch.context() as mp:
            break_it(mp)
            try:
                run(mp, seed, streams_per_rank=streams_per_rank, **kw)
            except AssertionError:
                failed.append(seed)
    return failed


def _run_gemm_push_launches(monkeypatch, seed: int, launches: int = 6, streams_per_rank: int = 1):
    from tldsl.runtime.dist import ag_gemm as agm
    return _run_launches(monkeypatch, seed, launches, streams_per_rank,
                         make=lambda r: agm.AllGatherMatmul(128, 16, 24, torch.bfloat16, pusher="gemm"),
                         gemm=_CompiledGemm)


@pytest.mark.parametrize("streams_per_rank", [1, 2])
@pytest.mark.parametrize("seed", range(10))
def test_gemm_push_protocol_on_two_simulated_ranks(monkeypatch, seed, streams_per_rank):
    """pusher="gemm": the GEMM pushes this rank's rows into the peers' landing slot L % 2 with no
    wait of its own — the slot is free by call order (the launch before it waited for the peer's
    previous push, made after the peer's GEMM two launches back had finished)."""
    ranks = _run_gemm_push_launches(monkeypatch, seed, streams_per_rank=streams_per_rank)
    for r, op in enumerate(ranks.ops):
        assert op.engine == "gemm-push"
        assert op._engine.flags.tolist() == [6, 6]


def test_the_gemm_push_model_can_fail(monkeypatch):
    """Without the call order (a call on a new stream overtaking the previous one), a launch's
    push overwrites the landing slot a peer's earlier launch still reads, or the peer reads a
    later launch's rows: some schedules get a wrong A_gathered."""
    assert _failing_seeds(monkeypatch, _unordered, streams_per_rank=2, run=_run_gemm_push_launches)
    assert not _failing_seeds(monkeypatch, lambda mp: None, streams_per_rank=2, seeds=range(10),
                              run=_run_gemm_push_launches)


def test_the_model_catches_broken_protocols(monkeypatch):
    """The model can fail: pushing into the landing slot the peer is reading, or letting a call
    on a new stream overtake the previous call (its counters would vouch for a launch that has
    not run), gives some schedule a wrong A_gathered."""
    from tldsl.runtime.dist import ag_push

    def other_slot(mp):
        plan = ag_push.PushAllGather._plan_addresses

        def swapped(self, *a):
            plan(self, *a)
            self._peer_plan = [(p, c, (d[1], d[0]), f) for p, c, d, f in self._peer_plan]
        mp.setattr(ag_push.PushAllGather, "_plan_addresses", swapped)
    assert _failing_seeds(monkeypatch, other_slot, seeds=range(4)) == list(range(4))
    assert _failing_seeds(monkeypatch, _unordered, streams_per_rank=2)
    assert not _failing_seeds(monkeypatch, lambda mp: None, streams_per_rank=2, seeds=range(10))


def _run_sliced_launches(monkeypatch, seed: int, launches: int = 6, streams_per_rank: int = 1, col_tile=128,
                         K=320):
    from tldsl.runtime.dist import ag_gemm as agm
    push = tl.CommSchedule(engine="copy_engine", mode="push", col_tile=col_tile)

    return _run_launches(monkeypatch, seed, launches, streams_per_rank,
                         make=lambda r: agm.AllGatherMatmul(128, K, 24, torch.bfloat16, comm=push), gemm=_CompiledGemm,
                         K=K)


@pytest.mark.parametrize("streams_per_rank", [1, 2])
@pytest.mark.parametrize("seed", range(8))
def test_column_sliced_push_protocol_on_two_simulated_ranks(monkeypatch, seed, streams_per_rank):
    """col_tile: each shard pushed in column slices (320 columns in slices of 128: 128, 128, 64), each
    followed by the flag's count of slices landed; the GEMM reads each slice once its count is
    there. After 6 launches every peer's flag here holds 3 * 6."""
    ranks = _run_sliced_launches(monkeypatch, seed, streams_per_rank=streams_per_rank)
    for r, op in enumerate(ranks.ops):
        assert op._engine.slices == 3
        assert op._engine.flags.tolist() == [18, 18]


def test_the_column_sliced_model_can_fail(monkeypatch):
    """Each flag written before its slice's copy instead of after lets the GEMM read a slice that
    has not landed: some schedules get a wrong A_gathered."""
    from tldsl.runtime.dist import ag_push

    def flag_first(mp):
        def push(self, cs, p, slot, src, flag, L):
            cu, wr = self._cu, self._consts.write_default
            for j, (offset, m) in enumerate(self._slice_plan[(p, slot)]):
                cu.cuStreamWriteValue64(cs, flag, self.slices * (L - 1) + j + 1, wr)
                m.srcDevice = src + offset
                cu.cuMemcpy2DAsync(m, cs)
            return (0,), (0,)
        mp.setattr(ag_push.PushAllGather, "_push_slices", push)
    assert _failing_seeds(monkeypatch, flag_first, seeds=range(12), run=_run_sliced_launches)
    assert not _failing_seeds(monkeypatch, lambda mp: None, seeds=range(6), run=_run_sliced_launches)


# -- GEMM + ReduceScatter on the copy engine (runtime/dist/gemm_rs_copy.py) --------------------------

def _rs_ranks(monkeypatch, Ms=512, K=16, N=24, early_sum=False, **options):
    from tldsl.runtime.dist import gemm_rs as grs
    from tldsl.runtime.dist.gemm_rs_copy import CopyEngineReduceScatter
    real_sum = CopyEngineReduceScatter._sum_rows
    holder = {}

    def deferred_sum(self, out, lo, hi):          # torch ops run on the host here: run it in stream order
        ranks = holder["ranks"]
        ranks.device.kernel(ranks.raw_stream(), f"sum {lo}:{hi}", lambda: real_sum(self, out, lo, hi))
    monkeypatch.setattr(CopyEngineReduceScatter, "_sum_rows", deferred_sum)
    ranks = _Ranks(monkeypatch, lambda r: grs.MatmulReduceScatter(2 * Ms, K, N, torch.bfloat16, ce_chunks=4,
                                                                  **options), _CompiledGemm)
    holder["ranks"] = ranks
    ranks.Ms, ranks.K, ranks.N = Ms, K, N
    for op in ranks.ops:
        assert op._engine.tpr == 4
        op._engine.early_sum = early_sum
    return ranks


def _run_rs_launches(monkeypatch, seed: int, launches: int = 5, streams_per_rank: int = 1, early_sum=False):
    rng = random.Random(seed)
    ranks = _rs_ranks(monkeypatch, early_sum=early_sum)
    W, Ms, K, N = ranks.W, ranks.Ms, ranks.K, ranks.N
    own_streams = {r: [next(ranks.streams) for _ in range(streams_per_rank)] for r in range(W)}
    expected, got = [], []
    for L in range(1, launches + 1):
        ab = [(ranks.device.register(_small_ints(W * Ms, K)), ranks.device.register(_small_ints(K, N)))
              for _ in range(W)]
        partials = [(a.float() @ b.float()).to(torch.bfloat16) for a, b in ab]
        expected.append([partials[r][r * Ms:(r + 1) * Ms] + partials[1 - r][r * Ms:(r + 1) * Ms] for r in range(W)])
        outs = {}
        for r in rng.sample(range(W), W):
            outs[r] = ranks.call(r, *ab[r], stream=own_streams[r][(L - 1) % streams_per_rank])
        got.append(outs)
    ranks.device.run(rng)
    for L, (want, per_rank) in enumerate(zip(expected, got), start=1):
        for r, out in per_rank.items():
            assert torch.equal(out, want[r]), f"seed {seed}: rank {r}'s rows of launch {L} are wrong"
    return ranks


@pytest.mark.parametrize("early_sum", [False, True])
@pytest.mark.parametrize("streams_per_rank", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_reduce_scatter_protocol_on_two_simulated_ranks(monkeypatch, seed, streams_per_rank, early_sum):
    """GEMM+RS on the copy engine: the GEMM's chunks (peers' rows first), the handshake, the
    copies of each chunk once its counter allows, the notifies, and this rank's sum (all after
    the GEMM, or its early chunks on the side stream) — every launch's rows exact."""
    _run_rs_launches(monkeypatch, seed, streams_per_rank=streams_per_rank, early_sum=early_sum)


def test_the_reduce_scatter_model_can_fail(monkeypatch):
    """Copies that do not wait for their chunk's counter, a sum that does not wait for the
    peers' copies, or calls on alternating streams without the call order, give some schedule
    wrong rows."""
    from tldsl.runtime.dist.gemm_rs_copy import CopyEngineReduceScatter

    def no_chunk_waits(mp):
        init = CopyEngineReduceScatter.__init__

        def patched(self, *a, **k):
            init(self, *a, **k)
            self.steps = [s for s in self.steps if s[0] != "wait"]
        mp.setattr(CopyEngineReduceScatter, "__init__", patched)

    def no_arrival_waits(mp):
        init = CopyEngineReduceScatter.__init__

        def patched(self, *a, **k):
            init(self, *a, **k)
            self.arrivals = []
        mp.setattr(CopyEngineReduceScatter, "__init__", patched)
    for break_it, streams in ((no_chunk_waits, 1), (no_arrival_waits, 1), (_unordered, 2)):
        assert _failing_seeds(monkeypatch, break_it, streams, range(20), _run_rs_launches, launches=3), \
            break_it.__name__


# -- AllGather+GEMM pulling (runtime/dist/ag_pull.py: staging kernel, device handshake) --------------

class _Stager:
    """The publishing staging kernel (runtime/dist/staging.py, hand-written CUDA) as the program it
    implements: the staging part AllGather+GEMM traces with ``own_rows='compute'`` (the part the
    GEMM runs fused when it stages its rows itself) — wait until every peer has staged the launch
    before, copy the shard into the symmetric slot and into this rank's rows of A_gathered,
    notify this rank's flag, publish the launch into this rank's slot of every peer's arrival
    array — run by the simulator's rules on the device's memory at the addresses the runtime
    gives the kernel."""

    def __init__(self, ranks, Ms, K, N):
        self.ranks, self.shape = ranks, (Ms, K, N)

    def __call__(self, sm_count, progress=None, publish=None):
        from tldsl.ops.allgather_gemm import allgather_gemm
        device = self.ranks.device
        stager = types.SimpleNamespace(kernel=types.SimpleNamespace(name="tldsl_stage_shard_publish"),
                                       usable=lambda *a: all(int(x) % 16 == 0 for x in a))
        arrive, table, rank, W, _, _ = publish
        Ms, K, N = self.shape
        bf, S = tl.bfloat16, tl.TensorSpec
        bm = Ms & -Ms if Ms & -Ms <= 256 else 256          # any compute tile that divides the rows: the
        program = allgather_gemm.trace(                     # staging part does not depend on it
            W, S((Ms, K), bf), S((K, N), bf), S((W * Ms, N), bf), compute=tl.ComputeSchedule(tile=(max(bm, 8), 16, 16)),
            comm=tl.CommSchedule(engine="copy_engine", mode="pull", own_rows="compute"))
        (stage,) = [p.name for p in program.parts if p.fused]
        ready, arrival = "gather_a_ready", "gather_a_arrive"

        def prepare(cu, src, dst0, dst1, nbytes, flag):
            rows = {"a": (src, Ms), "a_slot": (dst0, Ms), "a_gathered": (dst1 - rank * nbytes, W * Ms)}

            def buffer(r, name):
                assert r == rank, f"the staging kernel of rank {rank} reaches rank {r}'s '{name}'"
                addr, n = rows[name]
                return device.bytes(addr, n * K * 2).view(np.uint16).reshape(n, K)

            def signal(r, name):
                if name == ready and r == rank:
                    return device.bytes(flag - 8 * rank, 8 * W).view(np.int64)
                base = arrive if r == rank else int(device.u64(table + 8 * r)[0])
                assert name == arrival, name
                return device.bytes(base, 8 * W).view(np.int64)

            def launch(stream, L):
                _queue_program(device, stream, f"stage {L}", program, [stage], rank, L, buffer, signal)
            return types.SimpleNamespace(launch=launch)
        stager.prepare = prepare
        return stager


def _run_gathering_launches(monkeypatch, seed: int, ranks, Ms: int, K: int, N: int, launches: int,
                            streams_per_rank: int) -> None:
    """Launches of two ranks' AllGatherMatmul (any path) on fresh shards, every stream run in a
    random order; each launch's A_gathered and C must be exact."""
    rng = random.Random(seed)
    W = ranks.W
    own_streams = {r: [next(ranks.streams) for _ in range(streams_per_rank)] for r in range(W)}
    b = ranks.device.register(_small_ints(K, N))
    expected, got = [], []
    for L in range(1, launches + 1):
        shards = [ranks.device.register(_small_ints(Ms, K)) for _ in range(W)]
        gathered = torch.cat(shards)
        expected.append((gathered, (gathered.float() @ b.float()).to(torch.bfloat16)))
        got.append({r: ranks.call(r, shards[r], b, stream=own_streams[r][(L - 1) % streams_per_rank])
                    for r in rng.sample(range(W), W)})
    ranks.device.run(rng)
    for L, ((want_a, want_c), per_rank) in enumerate(zip(expected, got), start=1):
        for r, (a_full, c) in per_rank.items():
            assert torch.equal(a_full, want_a), f"seed {seed}: rank {r}'s A_gathered of launch {L} is wrong"
            assert torch.equal(c, want_c), f"seed {seed}: rank {r}'s C of launch {L} is wrong"


def _run_pull_launches(monkeypatch, seed: int, launches: int = 5, streams_per_rank: int = 1, Ms=200, K=16, N=24):
    """The pull with the publishing staging kernel (the default at rows that are not whole tiles)."""
    ranks = _pull_ranks(monkeypatch, Ms, K, N)
    _run_gathering_launches(monkeypatch, seed, ranks, Ms, K, N, launches, streams_per_rank)


def _pull_ranks(monkeypatch, Ms=200, K=16, N=24, **options):
    """Two ranks of the pull with the publishing staging kernel (``options``: the op's, besides)."""
    from tldsl.runtime.dist import ag_gemm as agm, staging
    from tldsl.runtime.gpu import device as device_mod
    holder = {}
    monkeypatch.setattr(staging, "ShardStager", lambda *a, **k: _Stager(holder["ranks"], Ms, K, N)(*a, **k))
    monkeypatch.setattr(device_mod, "sm_count", lambda: 132)

    def gemm(ranks):
        holder["ranks"] = ranks
        return _CompiledGemm(ranks)
    ranks = _Ranks(monkeypatch, lambda r: agm.AllGatherMatmul(Ms, K, N, torch.bfloat16, **options), gemm)
    assert all(op.engine == "copy_engine" and op.staging == "kernel" and op.handshake == "device" for op in ranks.ops)
    return ranks


@pytest.mark.parametrize("streams_per_rank", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_pull_protocol_on_two_simulated_ranks(monkeypatch, seed, streams_per_rank):
    """AG+GEMM's pull with the staging kernel as the handshake (the default where rows are not
    whole tiles): the staging waits for the peers' previous launch, the copy streams wait for
    each peer's published arrival, the GEMM for every flag — every launch's A_gathered and C
    exact."""
    _run_pull_launches(monkeypatch, seed, streams_per_rank=streams_per_rank)


def test_the_pull_model_can_fail(monkeypatch):
    """Copies that do not wait for the peer's published arrival (they read a slot the peer has
    not staged yet), or calls on alternating streams without the call order, give some schedule
    a wrong result. (The staging kernel's own wait for the peers' previous launch is implied by
    the call order and the handshake of the launch before; removing it is not caught, rightly.)"""
    for break_it, streams in ((_no_arrival_wait, 1), (_unordered, 2)):
        assert _failing_seeds(monkeypatch, break_it, streams, range(20), _run_pull_launches, launches=4), \
            break_it.__name__


def _no_arrival_wait(mp):
    """The pull's copies stop waiting for the peer's published arrival."""
    from tldsl.runtime.dist import ag_pull
    pulls = ag_pull.PullAllGather._enqueue_pulls
    mp.setattr(ag_pull.PullAllGather, "_enqueue_pulls",
               lambda self, cu, a_full, slot, L, wait_arrivals: pulls(self, cu, a_full, slot, L, wait_arrivals=False))


def _unordered(mp):
    """Calls on a new stream no longer wait for the previous call's stream."""
    from tldsl.runtime.dist import call_order
    mp.setattr(call_order.CallOrder, "follow", lambda self, stream: None)


def _run_gemm_staging_launches(monkeypatch, seed: int, launches: int = 5, streams_per_rank: int = 1):
    """The pull with the GEMM staging its own rows (whole tiles per rank, asked for)."""
    ranks = _gemm_staging_ranks(monkeypatch)
    _run_gathering_launches(monkeypatch, seed, ranks, 256, 16, 24, launches, streams_per_rank)


def _gemm_staging_ranks(monkeypatch):
    from tldsl.runtime.dist import ag_gemm as agm
    from tldsl.runtime.gpu import device as device_mod
    monkeypatch.setattr(device_mod, "sm_count", lambda: 132)
    pull = tl.CommSchedule(engine="copy_engine", mode="pull")
    Ms, K, N = 256, 16, 24
    ranks = _Ranks(monkeypatch, lambda r: agm.AllGatherMatmul(Ms, K, N, torch.bfloat16, comm=pull, staging="gemm"),
                   _CompiledGemm)
    assert all(op.staging == "gemm" and op.handshake == "device" for op in ranks.ops)
    return ranks


@pytest.mark.parametrize("streams_per_rank", [1, 2])
@pytest.mark.parametrize("seed", range(6))
def test_gemm_staging_protocol_on_two_simulated_ranks(monkeypatch, seed, streams_per_rank):
    """The pull whose GEMM stages this rank's rows and publishes the arrival itself: every
    launch's A_gathered and C exact; with the copies not waiting for the published arrival, or
    alternating streams without the call order, some schedule is wrong."""
    _run_gemm_staging_launches(monkeypatch, seed, streams_per_rank=streams_per_rank)


def test_the_gemm_staging_model_can_fail(monkeypatch):
    for break_it, streams in ((_no_arrival_wait, 1), (_unordered, 2)):
        assert _failing_seeds(monkeypatch, break_it, streams, range(20), _run_gemm_staging_launches, launches=4), \
            break_it.__name__


def test_the_compiled_program_is_what_runs(monkeypatch):
    """The GEMMs here are their programs: deleting a synchronisation primitive of the parts the
    schedule fused into the GEMM (own_rows='compute': the staging's ready notify and the arrival
    it publishes; the pushing GEMM's ready notifies on its peers) makes some schedule of the
    protocol wrong or deadlocked. (The staging's slot-free wait, ``lag=1``, is implied by the
    call order and the launch before's handshake — a peer copied the slot at L-2 before its GEMM
    L-2 ended, before it published L-1 — so deleting it is not caught, rightly.)"""
    from tldsl.testing.mutants import delete_site, sync_sites
    runs = ((_run_gemm_staging_launches, "gemm staging"), (_run_gemm_push_launches, "gemm push"))
    for run, what in runs:
        probe = {}

        def record(kernel):
            probe["kernel"] = kernel
            return kernel
        with monkeypatch.context() as mp:
            mp.setattr(_CompiledGemm, "mutate", staticmethod(record))
            run(mp, 0, launches=1)
        sites = [i for i, (part, op) in enumerate(sync_sites(probe["kernel"]))
                 if probe["kernel"].part(part).fused and not op.attrs.get("lag")]
        assert len(sites) >= 3, what
        for i in sites:
            def break_it(mp, i=i):
                mp.setattr(_CompiledGemm, "mutate", staticmethod(lambda k, i=i: delete_site(k, i)))
            assert _failing_seeds(monkeypatch, break_it, 2, range(12), run, launches=4), (what, i)
