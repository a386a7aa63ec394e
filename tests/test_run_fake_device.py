"""``tl.run`` end to end without a GPU: the real ``run_program`` — allocation, binding, streams,
events, epochs, copy-engine plans, the wait and its timeout, the read-back — on a fake device.

The fake's memory is torch's CPU tensors, so an address the runtime binds *is* the memory: a
kernel launch decodes its packed arguments (pointers, tables of peer pointers, TMA descriptors
whose first word is the address) and runs the tile program the kernel was lowered from in the
simulator's rules (``runtime/sim/bound_launch.py``) on the memory those addresses name — a
tensor reached through no bound parameter fails the test. Streams are queues run in random
interleavings; an event wait, a counter wait (``cuStreamWaitValue64``) or a kernel's signal wait
blocks its stream. Results must match ``tl.simulate`` exactly as the GPU tests require.
"""
from __future__ import annotations

import ctypes
import random
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest

import tldsl as tl
from tldsl.runtime.gpu import run_program as rp
from tldsl.runtime.gpu.run_errors import GpuHangError
from tldsl.runtime.sim.bound_launch import BoundLaunch
from tldsl.runtime.sim.engine import task_slots

from test_gpu_run import assert_agrees
from test_run_plan import ag_gemm, gemm_rs, row_softmax, scale_rows

torch = pytest.importorskip("torch")

_NP = {"f16": np.float16, "bf16": np.uint16, "f32": np.float32, "i32": np.int32, "i1": np.bool_}


def _view(address: int, shape, dtype) -> np.ndarray:
    """The host memory at ``address`` as an array (the fake's device memory is host memory)."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = (ctypes.c_uint8 * max(n, 1)).from_address(address)
    return np.frombuffer(raw, dtype=dtype, count=int(np.prod(shape))).reshape(shape)


class PersistentLaunch(BoundLaunch):
    """A general-recipe kernel's task groups (``lanes``: its CTAs times the task groups a CTA
    runs): lane ``b`` runs task slots ``b, b + lanes, ...`` of the schedule's walk one after the
    other, as the generated task loop does — holes included (the rows past the grid in a short
    last cluster row, which the kernel skips); so a grid too small for tasks that wait for one
    another deadlocks here as on the GPU."""
    lanes = 1 << 30

    def __init__(self, kernel, parts, rank, *args, **kwargs):
        super().__init__(kernel, parts, rank, *args, **kwargs)
        at = {(t.part.name, tuple(t.coords)): t for t in self.tasks}
        walk = [None if c is None else at.pop((p.name, tuple(c))) for p in dict.fromkeys(t.part for t in self.tasks)
                for c in task_slots(kernel, p, rank)]
        assert not at, f"tasks the walk never reaches: {sorted(at)}"
        self.slots = walk
        self.tasks = [t for t in walk if t is not None]
        self.live = list(self.tasks)

    def _can_run(self, task) -> bool:
        i = self.slots.index(task)
        if any(self.slots[j] in self.live for j in range(i % self.lanes, i, self.lanes)
               if self.slots[j] is not None):
            return False
        return super()._can_run(task)


class FakeDevice:
    """The methods run_program asks of a device, and the driver calls PlanExecutor makes."""
    CUresult = SimpleNamespace(CUDA_SUCCESS=0)
    CUstreamWriteValue_flags = SimpleNamespace(CU_STREAM_WRITE_VALUE_DEFAULT=0)
    CUstreamWaitValue_flags = SimpleNamespace(CU_STREAM_WAIT_VALUE_GEQ=1)
    CUmemorytype = SimpleNamespace(CU_MEMORYTYPE_DEVICE=2)

    class CUDA_MEMCPY2D:
        pass

    name, sm_count = "fake GPU", 24
    torch_device = torch.device("cpu")

    def __init__(self, seed=0):
        self.ce_driver = self
        self.queues: dict[int, deque] = {}
        self.events: dict[int, list[int]] = {}          # event -> [records enqueued, records done]
        self.rng = random.Random(seed)
        self.kept = []
        self.launched = []                               # (rank, part, launch, stream)
        self.heaps = []                                  # NVSHMEM's heap: (rank, base, bytes, every rank's base)
        self.signal_adds = 0                             # notifies added by a kernel (runtime/gpu/signal_add.py)

    # -- run_program's device interface ---------------------------------------------------------
    def load(self, kernels, progress=None):
        return {entry: SimpleNamespace(entry=entry, module=f"module of {entry}") for entry in kernels}

    def peer_address(self, rank, addr, peer):
        """``nvshmem_ptr``: ``peer``'s address of rank ``rank``'s symmetric heap address ``addr``."""
        for r, base, n, bases in self.heaps:
            if r == rank and base <= addr < base + n:
                return bases[peer] + addr - base
        return None

    def occupancy(self, kernel, lowered):
        return 1

    def upload(self, values):
        from tldsl.runtime.gpu.plan_exec import DeviceArray
        t = torch.tensor([int(v) for v in values], dtype=torch.int64)
        self.kept.append(t)
        return DeviceArray(t.data_ptr(), (len(values),), "u64", owner=t)

    def encode_tma(self, spec, address):
        return int(address).to_bytes(8, "little") + bytes(120)

    def origin(self):
        return 0

    def streams(self, n):
        return list(range(1, n + 1))

    def event(self, timing=False):
        ev = 1000 + len(self.events)
        self.events[ev] = [0, 0]
        return ev

    def record(self, ev, stream):
        self.events[ev][0] += 1

        def op():
            self.events[ev][1] += 1
            return True
        self._enqueue(stream, op)

    def wait_event(self, stream, ev):
        target = self.events[ev][0]
        self._enqueue(stream, lambda: self.events[ev][1] >= target)

    def destroy(self, events):
        pass

    def query(self, ev):
        self.run(until=lambda: self.events[ev][1] >= self.events[ev][0])
        n, done = self.events[ev]
        return None if done >= n else "not ready"

    def elapsed_ms(self, start, end):
        return 1.0

    def read_counters(self, signals):
        return "; ".join(f"rank {r} {n}={_view(a.ptr, a.shape, np.int64).tolist()}"
                         for r, sigs in enumerate(signals) for n, a in sigs.items())

    def launch(self, kernel, item, args, stream):
        lk = item.lowered
        values = [h.value if not isinstance(h, ctypes.Array) else int.from_bytes(bytes(h)[:8], "little")
                  for h in args.holders]
        by_source = {p.source: v for p, v in zip(lk.params, values)}
        kernel_ir, part = lk.program
        parts = [part] + ([kernel_ir.part(lk.side)] if getattr(lk, "side", None) else [])   # a folded part too
        own, tables = {}, {}
        for p, v in zip(lk.params, values):
            kind, name = p.origin
            if kind in ("buffer", "data", "signal"):
                own[name] = v
            elif kind == "tma":
                own[next(t.buffer for t in lk.tma if t.param == name)] = v
            elif kind in ("peers", "peer_signals"):
                tables[name] = _view(v, (kernel_ir.world_size,), np.uint64)
        assert by_source["rank"] == item.rank
        launch = by_source["launch"]
        self.launched.append((item.rank, item.part, launch, stream))

        def address(rank, name):
            if rank == item.rank and name in own:
                return own[name]
            if name in tables:
                return int(tables[name][rank])
            if getattr(lk, "transport", "ptr") == "nvshmem" and name in own:
                peer = self.peer_address(item.rank, own[name], rank)     # the device's nvshmem_ptr
                if peer is not None:
                    return peer
            raise AssertionError(f"{lk.entry} on rank {item.rank} reached '{name}' of rank {rank}, which no "
                                 f"parameter binds")
        shapes = {b.name: (tuple(b.type.shape), _NP[b.type.dtype.name]) for b in kernel_ir.buffers}
        slots = {s.name: int(s.type.slots) for s in kernel_ir.signals}
        persistent = type(lk).__name__ == "LoweredGeneral" and lk.lanes is None     # tasks in the schedule's order
        bl = (PersistentLaunch if persistent else BoundLaunch)(kernel_ir, parts, item.rank, launch,
                         lambda r, n: _view(address(r, n), *shapes[n]),
                         lambda r, n: _view(address(r, n), (slots[n],), np.int64), rng=random.Random(self.rng.random()))

        if persistent:
            bl.lanes = item.grid[0] * lk.groups

        def op():
            for _ in range(self.rng.randint(1, 8)):
                if bl.done or not bl.step():
                    break
            return bl.done
        self._enqueue(stream, op)

    # -- the driver calls of PlanExecutor --------------------------------------------------------
    def cuMemcpyAsync(self, dst, src, n, stream):
        self._enqueue(stream, lambda: ctypes.memmove(dst, src, n) and True)
        return (0,)

    def cuMemsetD8Async(self, dst, value, n, stream):
        self._enqueue(stream, lambda: ctypes.memset(dst, value, n) and True)
        return (0,)

    def cuMemcpy2DAsync(self, p, stream):
        def op():
            for row in range(p.Height):
                ctypes.memmove(p.dstDevice + row * p.dstPitch, p.srcDevice + row * p.srcPitch, p.WidthInBytes)
            return True
        self._enqueue(stream, op)
        return (0,)

    def cuStreamWriteValue64(self, stream, addr, value, flags):
        def op():
            _view(addr, (1,), np.uint64)[0] = value
            return True
        self._enqueue(stream, op)
        return (0,)

    def cuStreamWaitValue64(self, stream, addr, value, flags):
        self._enqueue(stream, lambda: int(_view(addr, (1,), np.uint64)[0]) >= value)
        return (0,)

    def tldsl_signal_add(self, stream, addr):
        """The one-thread kernel of runtime/gpu/signal_add.py: +1 once the stream gets there."""
        self.signal_adds += 1

        def op():
            _view(addr, (1,), np.uint64)[0] += np.uint64(1)
            return True
        self._enqueue(stream, op)

    def cuGetErrorName(self, err):
        return (0, b"fake error")

    def cuGetErrorString(self, err):
        return (0, b"fake error")

    # -- the fake GPU ------------------------------------------------------------------------------
    def _enqueue(self, stream, op):
        self.queues.setdefault(int(stream), deque()).append(op)

    def run(self, until):
        """Run the streams, interleaved at random, until ``until()`` holds (work the caller's
        stream does not wait for may still be pending then) or every stream is blocked (a hang:
        the launch never completes). One stream at a time is starved for a while, so work that
        is not waited for properly runs late, as it may on a GPU."""
        starved, rounds = None, 0
        while any(self.queues.values()) and not until():
            progressed = False
            streams = [s for s, q in self.queues.items() if q]
            if rounds <= 0:
                starved, rounds = self.rng.choice(streams + [None]), self.rng.randint(5, 400)
            rounds -= 1
            self.rng.shuffle(streams)
            for s in streams:
                if s == starved:
                    continue
                q = self.queues[s]
                while q and q[0]():
                    q.popleft()
                    progressed = True
                    if self.rng.random() < 0.5:
                        break
            if not progressed:
                if starved is None:
                    return
                starved, rounds = None, 0        # only the starved stream can move: let it


def run_fake(fn, W, inputs, seed=0, lowering=None, sms=None, **kw):
    """tl.run's own path (its checks and trace, then run_program) on the fake device."""
    from tldsl.run import check_sms, trace_for_run
    options = kw.pop("options", None)
    check_sms(sms, None)
    ir, per_rank, opts = trace_for_run(fn, W, inputs, seed, options, kw)
    device = FakeDevice(seed)
    res = rp.run_program(ir, per_rank, launches=opts.launches, seed=seed, timeout_s=2.0, device=device,
                         lowering=lowering, sms=sms)
    return res, device


def agrees(fn, W, inputs, sums=True, seed=0, lowering=None, **kw):
    want = tl.simulate(fn, W, inputs, **kw)
    got, device = run_fake(fn, W, inputs, seed=seed, lowering=lowering, **kw)
    assert_agrees(got.outputs, want.outputs, want.kernel, sums)
    return got, device


def test_scale_rows_and_softmax_on_the_fake_device():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 70)).astype(np.float16)
    res, dev = agrees(scale_rows, 1, [{"x": x, "y": np.zeros_like(x)}], sums=False,
                      compute=tl.ComputeSchedule(tile=(32, 32, 16)))
    assert dev.launched == [(0, "part", 1, 0), (0, "part", 2, 0)]      # two launches (the simulator's default): one
    # kernel each, on the caller's stream
    assert np.array_equal(res[0]["y"], (x.astype(np.float32) * 2 + 1).astype(np.float16))
    agrees(row_softmax, 1, [{"x": x, "y": np.zeros(x.shape, np.float32)}],
           compute=tl.ComputeSchedule(tile=(16, 16, 16)))


def test_a_program_over_shared_memory_runs_with_its_scratch_on_the_fake_device():
    """256 x 256 f32 fragments are more than a CTA's shared memory: the kernel takes a scratch,
    which run_program allocates (on the fake, in host memory) and binds; results as simulated."""
    from programs import outer_sums
    rng = np.random.default_rng(5)
    u, v = rng.standard_normal((3, 300)).astype(np.float16), rng.standard_normal((3, 270)).astype(np.float16)
    res, dev = agrees(outer_sums, 1, [{"u": u, "v": v, "y": np.full((300, 270), np.nan, np.float32)}],
                      compute=tl.ComputeSchedule(tile=(256, 256, 16)))
    [item] = res.plan.kernels
    assert "scratch" in [p.source for p in item.lowered.params] and item.lowered.scratch_bytes_per_cta > 0


def test_kernels_whose_scratch_would_not_fit_run_on_fewer_ctas_on_the_fake_device(monkeypatch):
    """Where every CTA's scratch would not fit the device's free memory (beside the program's
    tensors and the headroom), the kernels taking it run on fewer CTAs, walking their tasks in a
    loop: the same results. Where even one CTA a kernel does not fit, it is refused before
    anything is allocated. The headroom left beside the scratch is an eighth of what is free beside
    the tensors where that is less than HEADROOM_BYTES: here 7/8 of 3.5 CTAs' scratch fits 3."""
    from programs import outer_sums
    from tldsl.runtime.gpu.run_errors import ResidencyError
    rng = np.random.default_rng(6)
    u, v = rng.standard_normal((3, 300)).astype(np.float16), rng.standard_normal((3, 270)).astype(np.float16)
    inputs = [{"u": u, "v": v, "y": np.full((300, 270), np.nan, np.float32)} for _ in range(2)]
    sched = tl.ComputeSchedule(tile=(256, 256, 16))
    per_cta = 4 * 256 * 256 * 4             # four task groups a CTA, a 256 x 256 f32 fragment each
    tensors = 2 * (u.nbytes + v.nbytes + 300 * 270 * 4)
    monkeypatch.setattr(FakeDevice, "free_memory", lambda self: tensors + 7 * per_cta // 2, raising=False)
    res, _ = agrees(outer_sums, 2, inputs, compute=sched)
    assert [k.ctas for k in res.plan.kernels] == [1, 1] and res.plan.kernels[0].lowered.num_tasks == 4
    assert res.plan.kernels[0].lowered.scratch_bytes_per_cta == per_cta
    monkeypatch.setattr(FakeDevice, "free_memory", lambda self: tensors + 2 * per_cta, raising=False)
    with pytest.raises(ResidencyError, match=r"global-memory scratch .* takes 2,097,152 B even at their fewest CTAs "
                                             r"\(rank 0 part: 1 CTA\(s\) x 1,048,576 B; rank 1 part.* over the "
                                             r"1,835,008 B free on the GPU beside the program's tensors"):
        run_fake(outer_sums, 2, inputs, compute=sched)


def ce_beside_sm_inputs(W, N=16, seed=10):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(N).astype(np.float32), "a": np.full(N, np.nan, np.float32),
             "c": np.full(N, np.nan, np.float32), "y": np.full(N, np.nan, np.float32),
             "table": np.zeros(1, np.int32)} for _ in range(W)]


@pytest.mark.parametrize("sm_slot", [0, 1, -1])
def test_a_signal_the_copy_engine_and_an_sm_part_share_on_the_fake_device(sm_slot):
    """One signal notified by an SM part's kernel (atomic adds) and by the copy engine's stream:
    at another slot (0: the stream writes its values), at the same slot (1) or at a slot read
    from memory (-1: table holds 0), where the stream adds. Each rank gets the other's x twice."""
    from test_codegen_comm import ce_beside_sm
    ins = ce_beside_sm_inputs(2)
    res, _ = agrees(ce_beside_sm, 2, ins, sm_slot=sm_slot, comm=tl.CommSchedule(engine="copy_engine"))
    for r in range(2):
        np.testing.assert_array_equal(res.outputs[r]["y"], 2 * ins[1 - r]["x"])


@tl.kernel
def gather_arrivals(x, g: tl.Symmetric, y, *, comm: tl.CommSchedule = None):
    """Every rank's copy engine copies its x into rank 0's g and counts its arrival on rank 0's
    one slot; rank 0 waits for all W, then doubles the gathered rows."""
    W = tl.world_size()
    (N,) = x.shape
    s = tl.signal("arrived", 1, scope="symmetric")

    @tl.comm_part(grid=(1,), engine="copy_engine")
    def send(i):
        tl.rank_copy_data(g.at(0), (tl.rank() * N,), x, (0,), (N,))
        tl.rank_notify(s, 0, 0)

    @tl.compute_part(grid=(1,))
    def fin(i):
        with tl.when(tl.rank() == 0):
            tl.rank_wait(s, 0, count=W)
            tl.store(y, (0,), tl.load(g, (0,), (W * N,)) * 2.0)


def gather_inputs(W, N=8, seed=12):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal(N).astype(np.float32), "g": np.full(W * N, np.nan, np.float32),
             "y": np.full(W * N, np.nan, np.float32)} for _ in range(W)]


@pytest.mark.parametrize("launches", [1, 3])
def test_a_gather_counting_every_ranks_arrival_on_one_slot_on_the_fake_device(launches):
    """Three ranks' copy engines notify one slot of rank 0 (it was refused: the stream writes
    values); each now adds 1, so rank 0's wait for 3 (6, 9 in later launches) is met only when
    every copy has landed."""
    ins = gather_inputs(3)
    res, dev = agrees(gather_arrivals, 3, ins, comm=tl.CommSchedule(engine="copy_engine"),
                      options=tl.SimOptions(launches=launches))
    np.testing.assert_array_equal(res.outputs[0]["y"], 2 * np.concatenate([i["x"] for i in ins]))
    assert dev.signal_adds == 3 * launches


def _ag_inputs(k, seed):
    rng = np.random.default_rng(seed)
    b = rng.standard_normal(k.args[1].type.shape).astype(np.float16)
    return [{"a": rng.standard_normal(k.args[0].type.shape).astype(np.float16), "b": b,
             "c": np.full(k.args[2].type.shape, np.nan, np.float16)} for _ in range(k.world_size)]


@pytest.mark.parametrize("engine", ["sm", "copy_engine"])
@pytest.mark.parametrize("launches", [1, 2])
def test_allgather_gemm_at_two_ranks_on_the_fake_device(engine, launches):
    k = ag_gemm(engine=engine)
    for seed in range(3):
        res, dev = agrees(k, 2, _ag_inputs(k, seed), seed=seed, options={"launches": launches})
        kernels = [x for x in dev.launched]
        assert sorted({(r, p) for r, p, _, _ in kernels}) == ([(0, "gather_a"), (0, "gemm"), (1, "gather_a"),
                                                                (1, "gemm")] if engine == "sm" else
                                                               [(0, "gemm"), (1, "gemm")])
        assert sorted({launch for _, _, launch, _ in kernels}) == list(range(1, launches + 1))   # each launch's epoch
        assert len({s for _, _, _, s in kernels}) == len(kernels) // launches    # a stream per rank and part


def test_gemm_reduce_scatter_at_two_ranks_on_the_fake_device():
    k = gemm_rs()
    rng = np.random.default_rng(4)
    b = rng.standard_normal((256, 256)).astype(np.float16)
    inputs = [{"a": rng.standard_normal((512, 256)).astype(np.float16), "b": b,
               "out": np.full((256, 256), np.nan, np.float16)} for _ in range(2)]
    for seed in range(2):
        agrees(k, 2, inputs, seed=seed)


def test_tensors_and_signals_named_alike_in_c_run_on_the_fake_device():
    """Names that are one C identifier ("x-y", "x_y"; "s-1", "s_1"; "g_peers" beside symmetric g)
    get parameters of their own, each bound to its own tensor or signal: results as simulated."""
    from programs import c_name_clashes
    rng = np.random.default_rng(3)
    ins = [{"x": rng.standard_normal(8).astype(np.float32), "y": np.full(16, np.nan, np.float32)} for _ in range(2)]
    res, _ = agrees(c_name_clashes, 2, ins)
    for r in range(2):
        want = np.concatenate([2 * i["x"] for i in ins]) + np.tile(3 * ins[r]["x"], 2)
        np.testing.assert_allclose(res.outputs[r]["y"], want, rtol=1e-6)
    for item in res.plan.kernels:
        names = [p.name for p in item.lowered.params]
        assert len(names) == len(set(names)), (item.part, names)


@tl.kernel
def short_of_notifies(x, y):
    ready = tl.signal("ready", 4)

    @tl.compute_part(grid=(4,))
    def produce(t):
        tl.store(y, (t * 8,), tl.load(x, (t * 8,), (8,)))
        tl.producer_tile_notify(ready, t)

    @tl.compute_part(grid=(4,))
    def consume(t):
        tl.consumer_tile_wait(ready, t, count=2)          # one notify arrives, never two
        tl.store(x, (t * 8,), tl.load(y, (t * 8,), (8,)) * 2.0)


@pytest.mark.parametrize("debugging", [False, True])
def test_a_launch_that_never_finishes_is_reported_with_the_counters(debugging, monkeypatch):
    """Past the host's deadline (the kernel did not trap in time: it may not have started, another
    process holding the GPU) the error still says where a trapped wait's report goes."""
    monkeypatch.setattr(rp, "HOST_SLACK_S", 0.0)
    if debugging:
        monkeypatch.setenv("TLDSL_WAIT_TIMEOUT_NS", "5000000000")
    else:
        monkeypatch.delenv("TLDSL_WAIT_TIMEOUT_NS", raising=False)
    inputs = [{"x": np.ones(32, np.float32), "y": np.zeros(32, np.float32)}]
    # lowered with its signal kept ("beside"): lowered for "after", 'consume' runs after 'produce' with the
    # signal between them dropped, and nothing is left to wait for
    with pytest.raises(GpuHangError, match=r"launch 1 did not finish(.|\n)*rank 0 ready=\[1, 1, 1, 1\]") as e:
        run_fake(short_of_notifies, 1, inputs, lowering={"chain": "beside"}, options={"static_checks": False})
    said = str(e.value)
    assert "the kernel printed the slot" not in said, said              # it has not trapped (yet)
    assert ("traps (and prints the slot, the value it held" in said) == debugging, said
    assert ("set to have the kernel print the slot" in said) == (not debugging), said


def test_parts_waiting_on_each_other_on_fewer_ctas_than_tiles_on_the_fake_device(monkeypatch):
    """``sms=2``: each of the two parts waiting on each other gets one CTA, walking its 12 tiles
    in order. In order (as the simulator accepts by default) they agree with the simulator;
    crossed (which it refuses: a deadlock on one slot a part) the launch never finishes. With 5
    tiles a part, every tile resident on the 24 SMs, the crossed order runs, as in the simulator
    with ``compute_slots=5``."""
    from test_simulator import two_parts_each_way, two_parts_expected, two_parts_inputs
    monkeypatch.setattr(rp, "HOST_SLACK_S", 0.0)
    n = 12
    inputs = two_parts_inputs(2, n)
    res, _ = run_fake(two_parts_each_way, 2, inputs, sms=4)
    assert sorted(k.ctas for k in res.plan.kernels) == [1, 1, 1, 1], res.plan.describe()
    for r in range(2):
        np.testing.assert_array_equal(res[r]["c"], two_parts_expected(inputs[r]["a"], n, False))
    with pytest.raises(GpuHangError, match="launch 1 did not finish"):
        run_fake(two_parts_each_way, 2, inputs, sms=4, crossed=True)
    n = 5                       # 4 kernels of 5 tiles: every tile resident on the 24 SMs
    inputs = two_parts_inputs(2, n)
    res, _ = run_fake(two_parts_each_way, 2, inputs, crossed=True)
    assert all(k.ctas == n for k in res.plan.kernels), res.plan.describe()
    for r in range(2):
        np.testing.assert_array_equal(res[r]["c"], two_parts_expected(inputs[r]["a"], n, True))


@tl.kernel
def _rows_then_columns(a, c, c2, *, compute: tl.ComputeSchedule = None):
    """'first' (one tile per row block) stages its rows, then waits for column 1 of that row block
    of 'second' (a grid of row blocks x 2 columns), which waits for the staged rows: whether one
    CTA each finishes depends on the order 'second' walks its grid in."""
    n = a.shape[0] // 8
    staged, copied = tl.signal("staged", n), tl.signal("copied", 2 * n)
    mid = tl.local_buffer(a.shape, a.dtype, "mid")

    @tl.compute_part(grid=(n,), name="first")
    def first(t):
        tl.store(mid, (t * 8,), tl.load(a, (t * 8,), (8,)) * 2.0)
        tl.producer_tile_notify(staged, t)
        tl.consumer_tile_wait(copied, t * 2 + 1)
        tl.store(c, (t * 8,), tl.load(c2, (8 * n + t * 8,), (8,)) + 1.0)

    @tl.compute_part(grid=(n, 2), name="second")
    def second(t, j):
        tl.consumer_tile_wait(staged, t)
        tl.store(c2, (j * 8 * n + t * 8,), tl.load(mid, (t * 8,), (8,)))
        tl.producer_tile_notify(copied, t * 2 + j)


def test_persistent_ctas_take_tiles_in_the_schedules_order_on_the_fake_device(monkeypatch):
    """On one CTA a part, 'second' walking its grid row by row lets 'first' go on; swizzled (eight
    row blocks of column 0 before any of column 1) 'first' waits for a tile 'second' reaches only
    after a tile that waits for 'first': the simulator reports the deadlock and the fake device,
    walking tiles in the schedule's order as the GPU does (not row-major), hangs."""
    from tldsl.errors import DeadlockError
    monkeypatch.setattr(rp, "HOST_SLACK_S", 0.0)
    n = 12
    inputs = [{"a": np.arange(8 * n, dtype=np.float32) + 100 * r, "c": np.full(8 * n, np.nan, np.float32),
               "c2": np.full(16 * n, np.nan, np.float32)} for r in range(2)]
    row_major = tl.ComputeSchedule(order="row_major")
    want = tl.simulate(_rows_then_columns, 2, inputs, compute=row_major)
    res, _ = run_fake(_rows_then_columns, 2, inputs, sms=4, compute=row_major)
    assert sorted(k.ctas for k in res.plan.kernels) == [1, 1, 1, 1], res.plan.describe()
    for r in range(2):
        np.testing.assert_array_equal(res[r]["c"], 2 * inputs[r]["a"] + 1)
        np.testing.assert_array_equal(res[r]["c"], want[r]["c"])
    swizzled = tl.ComputeSchedule(order="swizzled", group_m=8)
    with pytest.raises(DeadlockError):
        tl.simulate(_rows_then_columns, 2, inputs, compute=swizzled)
    with pytest.raises(GpuHangError, match="launch 1 did not finish"):
        run_fake(_rows_then_columns, 2, inputs, sms=4, compute=swizzled)


@pytest.mark.parametrize("order,group", [("row_major", 8), ("swizzled", 2)])
def test_the_epilogue_sum_at_two_ranks_walking_a_ranks_rows_at_a_time_on_one_cta(order, group):
    """GEMM + ReduceScatter summing in the epilogue at two ranks, row by row (or swizzled within a
    rank's rows), each rank's GEMM on one CTA: rank 0 takes its own rows first and waits, rank 1
    computes rank 0's rows first — the launch finishes and agrees with the simulator."""
    from tldsl.ops.gemm_reduce_scatter import SPEC, gemm_reduce_scatter
    W, Ms = 2, 32
    comm = tl.CommSchedule(engine="copy_engine", mode="push", tile_m=8, reduce_in="epilogue")
    compute = tl.ComputeSchedule(tile=(16, 16, 16), order=order, group_m=group)
    case = SPEC.make_case(np.random.default_rng(2), W, rows_per_rank=Ms, n=40, k_per_rank=24, compute=compute,
                          comm=comm)
    want = tl.simulate(gemm_reduce_scatter, W, case.inputs, **case.kwargs)
    res, _ = run_fake(gemm_reduce_scatter, W, case.inputs, sms=2, **case.kwargs)
    assert [k.ctas for k in res.plan.kernels if k.part == "gemm"] == [1, 1], res.plan.describe()
    assert_agrees(res.outputs, want.outputs, want.kernel, True)


def test_sms_is_checked_before_anything_runs():
    """``sms``: a positive int, at most the GPU's SMs, and only for a run on this GPU; too few for
    the kernels to be resident at once is the run plan's ResidencyError, before any launch."""
    from tldsl.errors import InputError
    from tldsl.runtime.gpu.run_errors import ResidencyError
    inputs = [{"x": np.ones((64, 64), np.float32), "y": np.full((64, 64), np.nan, np.float32)}]
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(InputError, match="sms must be None"):
            tl.run(scale_rows, 1, inputs, sms=bad)
    with pytest.raises(InputError, match="sms=: a run across a process group"):
        tl.run(scale_rows, 1, inputs, sms=4, group=object())
    with pytest.raises(InputError, match=r"sms=25: the GPU \(fake GPU\) has 24 SMs"):
        run_fake(scale_rows, 1, inputs, sms=25)
    from test_simulator import two_parts_each_way, two_parts_inputs
    with pytest.raises(ResidencyError, match="need at least 4 CTAs resident at once"):
        run_fake(two_parts_each_way, 2, two_parts_inputs(2, 4), sms=3)


def test_progress_is_checked_before_the_gpu_is_looked_for():
    """``tl.run(progress=42)``: NVRTC's rule for ``progress`` (None, True, False or a function),
    applied before anything else — before the GPU check, which on this machine would answer first."""
    from tldsl.errors import InputError
    inputs = [{"x": np.ones((64, 64), np.float32), "y": np.full((64, 64), np.nan, np.float32)}]
    for bad in (42, "yes", [print]):
        with pytest.raises(InputError, match="progress=.*None, True, False or a function"):
            tl.run(scale_rows, 1, inputs, progress=bad)


def test_ranks_that_wait_for_nothing_run_on_fewer_sms_than_kernels():
    """Where nothing in the program waits, no kernel has to be resident beside another: two ranks'
    kernels on one SM run one after the other (they were refused: "a kernel waiting for another
    could wait forever", found by a helper); a program that waits is still refused."""
    x = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    inputs = [{"x": x, "y": np.full((64, 64), np.nan, np.float32)} for _ in range(2)]
    want = tl.simulate(scale_rows, 2, inputs)
    res, _ = run_fake(scale_rows, 2, inputs, sms=1)
    assert [k.ctas for k in res.plan.kernels] == [1, 1]
    for r in range(2):
        np.testing.assert_array_equal(res.outputs[r]["y"], want[r]["y"])


@tl.kernel
def doubled_after(x, y, z):
    ready = tl.signal("ready", 4)

    @tl.compute_part(grid=(4,))
    def produce(t):
        tl.store(y, (t * 8,), tl.load(x, (t * 8,), (8,)) + 1.0)
        tl.producer_tile_notify(ready, t)

    @tl.compute_part(grid=(4,))
    def consume(t):
        tl.consumer_tile_wait(ready, (t + 1) % 4)           # another task's tile: the wait matters beside
        tl.store(z, (t * 8,), tl.load(y, (((t + 1) % 4) * 8,), (8,)) * 2.0)


def test_a_part_chained_after_its_producer_drops_the_signal_between_them():
    """chain="after" (tl.run's default): 'consume' waits only on what 'produce' alone notifies, so it
    runs after it on its stream, and the signal between them is dropped before lowering: no notify
    in 'produce', no wait in 'consume', the same result as the simulator's."""
    rng = np.random.default_rng(3)
    inputs = [{"x": rng.standard_normal(32).astype(np.float32), "y": np.full(32, np.nan, np.float32),
               "z": np.full(32, np.nan, np.float32)}]
    res, _ = agrees(doubled_after, 1, inputs)
    got = {k.part: k for k in res.plan.kernels}
    assert got["consume"].after == "produce"
    assert (got["produce"].lowered.notifies, got["consume"].lowered.waits) == (0, 0)
    assert "ready" not in got["produce"].lowered.source and "ready" not in got["consume"].lowered.source
    beside, _ = agrees(doubled_after, 1, inputs, lowering={"chain": "beside"})
    kept = {k.part: k for k in beside.plan.kernels}
    assert (kept["produce"].lowered.notifies, kept["consume"].lowered.waits) == (1, 1)
    # planned as lowered: beside, on a stream of its own
    assert kept["consume"].after is None and kept["consume"].stream != kept["produce"].stream


class _FaultingDevice(FakeDevice):
    """A device whose launch ends in a driver error, as a trapped or faulting kernel's does."""
    def __init__(self, error):
        super().__init__()
        self.error = error

    def query(self, ev):
        return self.error


@pytest.mark.parametrize("error,raised", [("CUDA_ERROR_LAUNCH_FAILED", GpuHangError),
                                          ("CUDA_ERROR_ILLEGAL_ADDRESS", rp.GpuRunError)])
def test_a_kernel_that_traps_or_faults_is_a_typed_error(error, raised):
    from tldsl.run import trace_for_run
    x = np.ones((32, 32), np.float32)
    ir, per_rank, _ = trace_for_run(scale_rows, 1, [{"x": x, "y": x}], 0, None,
                                    {"compute": tl.ComputeSchedule(tile=(16, 16, 16))})
    with pytest.raises(raised, match=f"launch 1 failed .*{error}") as e:
        rp.run_program(ir, per_rank, timeout_s=1.0, device=_FaultingDevice(error))
    assert type(e.value) is raised and "unusable now" in str(e.value)


@pytest.mark.parametrize("debugging", [False, True])
def test_a_trapped_wait_says_where_its_report_is(debugging, monkeypatch):
    """The kernels print a timed-out wait's slot only where they were built while
    TLDSL_WAIT_TIMEOUT_NS was set; otherwise the error says how to have them print it (a value no
    shorter than the run's timeout: the variable is also the fused ops' wait timeout)."""
    from tldsl.run import trace_for_run
    if debugging:
        monkeypatch.setenv("TLDSL_WAIT_TIMEOUT_NS", "5000000000")
    else:
        monkeypatch.delenv("TLDSL_WAIT_TIMEOUT_NS", raising=False)
    x = np.ones((32, 32), np.float32)
    ir, per_rank, _ = trace_for_run(scale_rows, 1, [{"x": x, "y": x}], 0, None,
                                    {"compute": tl.ComputeSchedule(tile=(16, 16, 16))})
    with pytest.raises(GpuHangError) as e:
        rp.run_program(ir, per_rank, timeout_s=1.5, device=_FaultingDevice("CUDA_ERROR_LAUNCH_FAILED"))
    said = str(e.value)
    assert ("the kernel printed the slot" in said) == debugging, said
    assert ("run again with TLDSL_WAIT_TIMEOUT_NS=1500000000 set" in said) == (not debugging), said


def library_case(name: str):
    """(kernel, W, inputs, keyword values) of a library op or a general-recipe program at W >= 2:
    attention, MoE grouped GEMM and combine, compute parts moving data (peer tables in the
    general recipe), a communication part lowered by the general recipe. A name ending ``_nk``:
    the MoE case with its experts' weights stored as torch Linear weights (``weights="nk"``)."""
    if name.endswith("_nk"):
        fn, W, inputs, kw = library_case(name[:-3])
        w = "w1" if "w1" in inputs[0] else "w2"
        return fn, W, [dict(i, **{w: np.ascontiguousarray(i[w].transpose(0, 2, 1))}) for i in inputs], \
            dict(kw, weights="nk")
    from tldsl.ops.moe import allgather_moe, make_allgather_case, make_reduce_scatter_case, moe_reduce_scatter
    from tldsl.ops.sp_attention import make_case as sp_case
    from tldsl.ops.sp_attention import sp_attention
    from test_codegen_general import normed_gather, ring_exchange
    rng = np.random.default_rng(1)
    c64 = tl.ComputeSchedule(tile=(64, 32, 32))
    if name == "sp_attention":
        c = sp_case(rng, 2, seq_per_rank=130, heads=1, head_dim=16, causal=True,
                    compute=tl.ComputeSchedule(tile=(128, 64, 16)), comm=tl.CommSchedule(tile_m=64, mode="pull"))
        return sp_attention, 2, c.inputs, c.kwargs
    if name == "allgather_moe":
        c = make_allgather_case(rng, 2, rows_per_rank=40, k=40, n=48, num_experts=5, topk=2, compute=c64,
                                comm=tl.CommSchedule(tile_m=16, mode="pull"))
        return allgather_moe, 2, c.inputs, c.kwargs
    if name == "allgather_moe_staged":        # the rows gathered in two column chunks (128 + 72)
        c = make_allgather_case(rng, 2, rows_per_rank=40, k=200, n=48, num_experts=5, topk=2, compute=c64,
                                comm=tl.CommSchedule(tile_m=16, mode="pull"), stage_rows=True)
        return allgather_moe, 2, c.inputs, c.kwargs
    if name in ("moe_reduce_scatter", "moe_reduce_scatter_out"):     # (_out: the partial in fp16, as the op's)
        c = make_reduce_scatter_case(rng, 2, rows_per_rank=40, k=40, n=48, num_experts=5, topk=2, compute=c64,
                                     comm=tl.CommSchedule(tile_m=16, mode="push"),
                                     partial_dtype="out" if name.endswith("_out") else "f32")
        return moe_reduce_scatter, 2, c.inputs, c.kwargs
    if name.startswith("moe_reduce_scatter_pingpong"):
        # 128 x 128 tiles: the GEMM's consumer warpgroups take tiles in turns. Small: fewer tiles than a
        # GPU has SMs (one a CTA: the turn handed over and taken back at the end); "_many": 36 x 9 tiles,
        # so each CTA's warpgroups alternate (a partial last column tile and K step in both)
        rows, k, n = (1024, 1032, 264) if name.endswith("_many") else (100, 136, 72)
        c = make_reduce_scatter_case(rng, 2, rows_per_rank=rows, k=k, n=n, num_experts=5, topk=2,
                                     compute=tl.ComputeSchedule(tile=(128, 128, 64), stages=4, order="swizzled"),
                                     comm=tl.CommSchedule(tile_m=64, mode="push"))
        return moe_reduce_scatter, 2, c.inputs, c.kwargs
    if name == "ring_exchange":
        inputs = [{n: rng.standard_normal((20, 24)).astype(np.float32) for n in "xywz"} for _ in range(3)]
        return ring_exchange, 3, inputs, {"compute": tl.ComputeSchedule(tile=(8, 8, 8))}
    assert name == "normed_gather"
    inputs = [{"x": rng.standard_normal((12, 40)).astype(np.float32), "g": np.zeros((24, 40), np.float32),
               "y": np.zeros((24, 40), np.float32)} for _ in range(2)]
    return normed_gather, 2, inputs, {"compute": tl.ComputeSchedule(tile=(16, 16, 16)), "comm": tl.CommSchedule(sms=2)}


LIBRARY = {"sp_attention": ["LoweredComm", "LoweredAttention"], "allgather_moe": ["LoweredComm", "LoweredGroupedGemm"],
           "allgather_moe_staged": ["LoweredComm", "LoweredCombine", "LoweredGroupedGemm"],
           "moe_reduce_scatter": ["LoweredComm", "LoweredGroupedGemm", "LoweredCombine"],
           "moe_reduce_scatter_out": ["LoweredComm", "LoweredGroupedGemm", "LoweredCombine"],
           "moe_reduce_scatter_pingpong": ["LoweredComm", "LoweredGroupedGemm", "LoweredCombine"],
           "ring_exchange": ["LoweredGeneral"], "normed_gather": ["LoweredGeneral"],
           "allgather_moe_nk": ["LoweredComm", "LoweredGroupedGemm"],
           "moe_reduce_scatter_pingpong_nk": ["LoweredComm", "LoweredGroupedGemm", "LoweredCombine"]}


@pytest.mark.parametrize("name", sorted(LIBRARY))
def test_library_ops_and_general_programs_at_several_ranks_on_the_fake_device(name):
    fn, W, inputs, kw = library_case(name)
    res, dev = agrees(fn, W, inputs, **kw)
    assert sorted({type(x.lowered).__name__ for x in res.plan.kernels}) == sorted(LIBRARY[name])
    assert {r for r, _, _, _ in dev.launched} == set(range(W))
    gemms = [x.lowered for x in res.plan.kernels if type(x.lowered).__name__ == "LoweredGroupedGemm"]
    assert all(g.config.pingpong == name.removesuffix("_nk").endswith("_pingpong") for g in gemms)
    assert all(g.config.b_k_major == name.endswith("_nk") for g in gemms)


@pytest.mark.parametrize("name,side", [("moe_reduce_scatter", "combine"), ("moe_reduce_scatter_pingpong", "combine"),
                                       ("allgather_moe_staged", "gather_rows")])
def test_a_row_gather_part_folded_into_its_grouped_gemms_kernel_on_the_fake_device(name, side):
    """``chain="folded"`` at two ranks: MoE+ReduceScatter with each rank's combine run inside its
    grouped GEMM's kernel, AllGather+MoE with each rank's row gather run inside the GEMM it feeds —
    no launch of the folded part, the GEMM's kernel binding its parameters, the outputs the
    simulator's."""
    from tldsl.run import trace_for_run
    fn, W, inputs, kw = library_case(name)
    want = tl.simulate(fn, W, inputs, **kw)
    ir, per_rank, opts = trace_for_run(fn, W, inputs, 0, None, kw)
    got = rp.run_program(ir, per_rank, launches=2, timeout_s=2.0, device=FakeDevice(3), lowering={"chain": "folded"})
    kinds = sorted((x.rank, type(x.lowered).__name__) for x in got.plan.kernels)
    assert kinds == [(r, k) for r in range(W) for k in ("LoweredComm", "LoweredGroupedGemm")]
    assert all(x.lowered.side == side for x in got.plan.kernels if x.part == "grouped_gemm")
    assert all(x.lowered.config.pingpong == name.endswith("_pingpong") for x in got.plan.kernels
               if x.part == "grouped_gemm")
    assert_agrees(got.outputs, want.outputs, want.kernel, True)


@pytest.mark.parametrize("seed,sms", [(7, 132), (5, 6)])
def test_the_fuzzers_programs_agree_on_the_fake_device(seed, sms):
    """The differential fuzzer's --gpu comparison with the fake device in the GPU's place: every
    generated program that lowers agrees with the simulator, or is refused with a typed error
    before anything is launched (more streams or CTAs at once than the device has). ``sms=6``:
    persistent general-recipe kernels run several tasks per CTA, in the generated loop's order."""
    from tldsl.codegen import LoweringError
    from tldsl.run import trace_for_run
    from tldsl.runtime.gpu.run_errors import ResidencyError
    from tldsl.testing.program_case import FuzzCase
    from tldsl.testing.program_families import generate_distinct
    agreed = 0
    for i, program in generate_distinct(40, seed):
        case = FuzzCase(program, f"seed {seed} program {i}")
        reference = case.simulate()
        ir, per_rank, opts = trace_for_run(case.trace(), case.world_size, case.inputs, 0, None, {})
        device = FakeDevice(i)
        device.sm_count = sms
        try:
            result = rp.run_program(ir, per_rank, launches=opts.launches, timeout_s=2.0, device=device)
        except (LoweringError, ResidencyError):
            continue
        bad = case.mismatches(reference.outputs, result.outputs)
        assert not bad, f"{case.label}: {bad[:3]}\n{case.source}"
        agreed += 1
    assert agreed >= 25


def test_torch_tensors_in_are_traced_copied_and_left_alone():
    x = torch.randn(40, 24).to(torch.bfloat16)
    y = torch.zeros(40, 24)
    before = x.clone()
    res, _ = run_fake(scale_rows, 1, [{"x": x, "y": y}], compute=tl.ComputeSchedule(tile=(16, 16, 16)))
    assert res.kernel.args[0].type.dtype == tl.bfloat16           # traced from the tensor's dtype
    assert torch.equal(x, before) and not y.any()                 # the caller's tensors are not the run's
    assert res.tensors[0]["x"].data_ptr() != x.data_ptr()
    assert np.array_equal(res[0]["y"], ((x * 2) + 1).float().numpy())          # bf16 math rounds each op


@tl.kernel
def peer_row_max(x0: tl.Symmetric, y0):
    """The fuzzer's program 68 of seed 2026 (a CUDA_ERROR_ILLEGAL_ADDRESS on an H200, open): a
    compute part loads a 32x32 tile of the next rank's [20, 2] f16 tensor (mostly outside it)."""
    @tl.compute_part(grid=(1, 1))
    def stage0(pm, pn):
        r0, c0 = pm * 32, pn * 32
        t0 = tl.load(x0.at((tl.rank() + 1) % 3), (r0, c0), (32, 32))
        tl.store(y0, (r0, c0), ((t0 - tl.max(t0, 1)[:, None]) * 3.0))


def peer_row_max_inputs():
    rng = np.random.default_rng(68)
    return [{"x0": rng.uniform(-1, 1, (20, 2)).astype(np.float16), "y0": np.zeros((20, 2), np.float32)}
            for _ in range(3)]


def test_a_peer_load_in_a_compute_part_binds_the_peer_table():
    res, dev = agrees(peer_row_max, 3, peer_row_max_inputs())
    assert len(res.plan.kernels) == 3 and len({x.lowered.entry for x in res.plan.kernels}) == 1
    assert [p.source for p in res.plan.kernels[0].lowered.params][:2] == ["peers:x0", "buffer:y0"]


def test_a_push_between_two_other_ranks_binds_both_peer_tables():
    """``tile_push_data`` from ``x.at(rank)`` into ``y.at(other rank)``: both tensors through peer tables."""
    from test_codegen_comm import relay
    rng = np.random.default_rng(11)
    inputs = [{"x": rng.standard_normal((10, 7)).astype(np.float32), "y": np.full((10, 7), np.nan, np.float32)}
              for _ in range(3)]
    res, dev = agrees(relay, 3, inputs, sums=False)
    assert {p.source for p in res.plan.kernels[0].lowered.params} >= {"peers:x", "peers:y"}
    for r in range(3):
        assert np.isnan(res[r]["y"][:, 0]).all() and np.array_equal(res[r]["y"][:, 1:], inputs[(r - 1) % 3]["x"][:, :6])


@pytest.mark.parametrize("launches", [2, 3])
def test_every_launch_runs_on_the_callers_arguments_on_the_fake_device(launches):
    """``tl.run`` puts back what the program writes into its arguments between launches, as the
    simulator does: an in-place ``y += x`` returns one application of itself."""
    from test_simulator import accumulate
    rng = np.random.default_rng(4)
    inputs = [{"x": rng.standard_normal(8).astype(np.float32), "y": rng.standard_normal(8).astype(np.float32),
               "seen": rng.standard_normal(8).astype(np.float32)} for _ in range(2)]
    res, dev = agrees(accumulate, 2, inputs, sums=False, options=tl.SimOptions(launches=launches))
    assert res.launches == launches
    for r in range(2):
        np.testing.assert_array_equal(res[r]["y"], inputs[r]["y"] + inputs[r]["x"])


def test_a_running_sum_over_tiles_runs_on_fewer_ctas_than_tiles_on_the_fake_device():
    """Each tile waits only for the one before it in the walk: on 3 CTAs (each taking every third
    tile, one after another) its 40 tiles finish and agree with the simulator."""
    from test_run_plan import running_sum
    x = np.random.default_rng(8).integers(-4, 5, 320).astype(np.float32)
    inputs = [{"x": x, "y": np.full(320, np.nan, np.float32)}]
    want = tl.simulate(running_sum, 1, inputs)
    res, dev = run_fake(running_sum, 1, inputs, sms=3)
    assert [k.ctas for k in res.plan.kernels] == [3], res.plan.describe()
    np.testing.assert_array_equal(res[0]["y"], want[0]["y"])
    np.testing.assert_array_equal(res[0]["y"], np.cumsum(x.reshape(40, 8), 0).reshape(-1))
