"""FusedProgram (runtime/dist/program_op.py) — the fused-op runtime that drives any traced kernel —
on W fake GPUs without a GPU: every rank's real FusedProgram is built in a thread of its own
(building is collective: the agreement check, the symmetric allocations), and all of them enqueue
into one fake device (tests/test_run_fake_device.py) whose memory is CPU tensors: each kernel launch
decodes the arguments the runtime packed and runs the tile program it was lowered from in the
simulator's rules on the memory those addresses name; copy-engine plans, the copy-in/out and the
handshakes are driver calls on its streams, which run interleaved at random with one starved at a
time. Every launch of every rank must agree with ``tl.simulate`` of the same launches.
"""
from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pytest

import tldsl as tl

torch = pytest.importorskip("torch")

from test_gpu_run import assert_agrees  # noqa: E402
from test_run_fake_device import FakeDevice  # noqa: E402

from tldsl.errors import InputError  # noqa: E402
from tldsl.ir.opdefs import written_buffers  # noqa: E402
from tldsl.runtime.dist import program_op  # noqa: E402
from tldsl.runtime.dist.program_check import rmsnorm_allgather  # noqa: E402  (tutorials/04's program)


class RankDevice:
    """Rank ``rank``'s view of the shared fake device: a caller's stream and streams of its own;
    every call holds the device's lock (ranks in threads may call at once)."""

    def __init__(self, fake, rank):
        self._fake, self.rank = fake, rank
        if not hasattr(fake, "lock"):
            fake.lock = threading.RLock()

    @property
    def ce_driver(self):
        return self

    alternate = False           # each call on another caller's stream than the one before

    def origin(self):
        if self.alternate:
            self.calls = getattr(self, "calls", 0) + 1
            return 1000 * (self.rank + 1) + 500 + self.calls % 2
        return 1000 * (self.rank + 1)

    def streams(self, n):
        return [1000 * (self.rank + 1) + i + 1 for i in range(n)]

    def __getattr__(self, name):
        value = getattr(self._fake, name)
        if not callable(value) or isinstance(value, type):
            return value

        def locked(*a, **k):
            with self._fake.lock:
                return value(*a, **k)
        return locked


class Group:
    """W ranks as threads: the host collectives (the exchange, symmetric memory's rendezvous) meet
    at a barrier; the ranks' FusedPrograms share one fake device."""

    def __init__(self, monkeypatch, W, seed=0):
        import torch.distributed._symmetric_memory as symm_mem
        self.W, self.fake = W, FakeDevice(seed)
        self.local = threading.local()
        barrier = self.barrier = threading.Barrier(W)
        meet: dict = {}
        group = self

        def ctx(g=None):
            return types.SimpleNamespace(rank=group.local.rank, world_size=W, device=0, group=None,
                                         group_name=f"fake{id(group)}", backend="CUDA")

        def gather(obj):
            key = group.local.calls
            group.local.calls += 1
            meet.setdefault(key, {})[group.local.rank] = obj
            barrier.wait()
            out = [meet[key][q] for q in range(W)]
            barrier.wait()
            return out

        class Handle:
            def __init__(self, t):
                self.tensors = gather(t)
                self.buffer_ptrs = [x.data_ptr() for x in self.tensors]

        monkeypatch.setattr(program_op, "dist_context", ctx)
        monkeypatch.setattr(program_op, "exchange", lambda c, obj: gather(obj))
        monkeypatch.setattr(symm_mem, "empty", lambda size, dtype=None, device=None: torch.empty(size, dtype=dtype))
        monkeypatch.setattr(symm_mem, "rendezvous", lambda t, group_name: Handle(t))
        lock = threading.Lock()                   # tracing and lowering are not thread-safe
        build = program_op.FusedProgram._build

        def serial_build(self, *a):
            with lock:
                return build(self, *a)
        monkeypatch.setattr(program_op.FusedProgram, "_build", serial_build)
        from tldsl.runtime.gpu import cuda_device             # tl.run's default device: this rank's fake GPU
        monkeypatch.setattr(cuda_device, "CudaDevice", lambda: RankDevice(group.fake, group.local.rank))

    def build(self, make):
        """``make(rank, device)`` on every rank at once; the ops, or the first rank's error (and
        every rank's errors in ``self.errors``)."""
        ops, self.errors = [None] * self.W, [None] * self.W

        def run(r):
            self.local.rank, self.local.calls = r, 0
            try:
                ops[r] = make(r, RankDevice(self.fake, r))
            except BaseException as e:   # noqa: BLE001 - re-raised in the test's thread
                self.errors[r] = e
        threads = [threading.Thread(target=run, args=(r,)) for r in range(self.W)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for e in self.errors:
            if e is not None:
                raise e
        return ops


def tensors(arrays: dict) -> dict:
    """numpy arrays as the CPU tensors the fake GPU holds (bf16 bit-exact)."""
    out = {}
    for k, v in arrays.items():
        out[k] = torch.from_numpy(np.ascontiguousarray(v).copy())
    return out


def host(t):
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def run_program(monkeypatch, fn, W, inputs, launches=2, seed=0, fresh=None, **kw):
    """FusedProgram on W fake ranks: ``launches`` calls on every rank, all enqueued before the
    fake GPU runs anything; ``fresh(L)``: new inputs for launch ``L`` (default: the same tensors,
    updated in place, as the simulator's launches leave them). Returns (ops, every launch's
    outputs by rank)."""
    g = Group(monkeypatch, W, seed)
    ops = g.build(lambda r, dev: program_op.FusedProgram(fn, None, inputs[r], device=dev, timeout_s=2.0, **kw))
    per_launch = []
    args = [tensors(inputs[r]) for r in range(W)]
    for L in range(1, launches + 1):
        if fresh is not None:
            args = [tensors(x) for x in fresh(L)]
        for r in g.fake.rng.sample(range(W), W):         # the hosts enqueue in any order
            ops[r](**args[r])
        per_launch.append(args)
    for r in range(W):
        ops[r].synchronize()
    outs = [[{n: host(t) for n, t in a.items()} for a in args] for args in per_launch]
    return ops, outs, g


def simulated(fn, W, inputs, launches, **kw):
    return tl.simulate(fn, W, inputs, options={"launches": launches}, **kw)


# =================================================================================================
# programs
# =================================================================================================

def library_case(name: str, W: int):
    """(kernel, inputs, keyword values) of a library op or a hand-written program at W ranks."""
    from tldsl.ops import allgather_gemm as agm, gemm_reduce_scatter as grs
    from tldsl.ops.moe import allgather_moe, make_allgather_case, make_reduce_scatter_case, moe_reduce_scatter
    from tldsl.ops.sp_attention import make_case as sp_case
    from tldsl.ops.sp_attention import sp_attention
    from test_codegen_general import normed_gather, ring_exchange
    rng = np.random.default_rng(W)
    c16 = tl.ComputeSchedule(tile=(16, 16, 16))
    if name == "allgather_gemm":
        c = agm.make_case(rng, W, rows_per_rank=32, n=32, k=16, compute=c16, comm=tl.CommSchedule(sms=1))
        return agm.allgather_gemm, c.inputs, c.kwargs
    if name == "allgather_gemm_ce":
        c = agm.make_case(rng, W, rows_per_rank=32, n=32, k=16, compute=c16,
                          comm=tl.CommSchedule(engine="copy_engine"))
        return agm.allgather_gemm, c.inputs, c.kwargs
    if name == "gemm_reduce_scatter":
        c = grs.make_case(rng, W, rows_per_rank=16, n=32, k_per_rank=16, compute=c16, comm=tl.CommSchedule(sms=1))
        return grs.gemm_reduce_scatter, c.inputs, c.kwargs
    if name == "sp_attention":
        c = sp_case(rng, W, seq_per_rank=64, heads=1, head_dim=16, causal=True,
                    compute=tl.ComputeSchedule(tile=(64, 32, 16)), comm=tl.CommSchedule(tile_m=32, mode="pull"))
        return sp_attention, c.inputs, c.kwargs
    c32 = tl.ComputeSchedule(tile=(32, 32, 32))
    if name == "allgather_moe":
        c = make_allgather_case(rng, W, rows_per_rank=24, k=32, n=32, num_experts=3, topk=2, compute=c32,
                                comm=tl.CommSchedule(tile_m=16, mode="pull"))
        return allgather_moe, c.inputs, c.kwargs
    if name == "moe_reduce_scatter":
        c = make_reduce_scatter_case(rng, W, rows_per_rank=24, k=32, n=32, num_experts=3, topk=2, compute=c32,
                                     comm=tl.CommSchedule(tile_m=16, mode="push"))
        return moe_reduce_scatter, c.inputs, c.kwargs
    if name == "ring_exchange":
        inputs = [{n: rng.standard_normal((16, 8)).astype(np.float32) for n in "xywz"} for _ in range(W)]
        return ring_exchange, inputs, {"compute": tl.ComputeSchedule(tile=(8, 8, 8))}
    if name == "rmsnorm_allgather":
        inputs = [{"x": rng.standard_normal((16, 32)).astype(np.float16), "w": rng.standard_normal((1, 32))
                   .astype(np.float16), "out": np.full((16 * W, 32), np.nan, np.float16)} for _ in range(W)]
        return rmsnorm_allgather, inputs, {"compute": tl.ComputeSchedule(tile=(8, 16, 16))}
    assert name == "normed_gather"
    inputs = [{"x": rng.standard_normal((8, 16)).astype(np.float32), "g": np.zeros((8 * W, 16), np.float32),
               "y": np.zeros((8 * W, 16), np.float32)} for _ in range(W)]
    return normed_gather, inputs, {"compute": tl.ComputeSchedule(tile=(8, 16, 16)), "comm": tl.CommSchedule(sms=1)}


def _agrees(monkeypatch, name, W, launches=2, seed=0):
    fn, inputs, kw = library_case(name, W)
    want = simulated(fn, W, inputs, launches, **kw)
    ops, outs, g = run_program(monkeypatch, fn, W, inputs, launches=launches, seed=seed, **kw)
    assert_agrees(outs[-1], want.outputs, want.kernel, sums=True)
    return ops, outs, g


@pytest.mark.parametrize("name", ["normed_gather", "ring_exchange", "rmsnorm_allgather"])
@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_hand_written_programs_agree_with_the_simulator(monkeypatch, name, W):
    ops, _, _ = _agrees(monkeypatch, name, W, launches=3, seed=W)
    for op in ops:
        assert op.launches == 3
        op.close()


def test_normed_gather_with_fresh_inputs_every_launch(monkeypatch):
    """Launch L's results are launch L's: each of three launches gets new shards, and every rank's
    output of each launch matches a simulation of those inputs alone."""
    fn, _, kw = library_case("normed_gather", 3)
    rng = np.random.default_rng(9)
    fresh = {L: [{"x": rng.standard_normal((8, 16)).astype(np.float32), "g": np.zeros((24, 16), np.float32),
                  "y": np.zeros((24, 16), np.float32)} for _ in range(3)] for L in (1, 2, 3)}
    ops, outs, _ = run_program(monkeypatch, fn, 3, fresh[1], launches=3, seed=5, fresh=fresh.get, **kw)
    for L in (1, 2, 3):
        want = tl.simulate(fn, 3, fresh[L], **kw)
        assert_agrees(outs[L - 1], want.outputs, want.kernel, sums=True)
    for op in ops:
        op.close()


@pytest.mark.parametrize("name,ranks", [("allgather_gemm", (1, 2, 4)), ("allgather_gemm_ce", (1, 2, 3)),
                                        ("gemm_reduce_scatter", (1, 2, 4)), ("sp_attention", (1, 2, 3)),
                                        ("allgather_moe", (1, 2, 4)), ("moe_reduce_scatter", (1, 2, 3))])
def test_library_ops_agree_with_the_simulator(monkeypatch, name, ranks):
    for W in ranks:
        ops, _, _ = _agrees(monkeypatch, name, W, launches=2, seed=W)
        for op in ops:
            op.close()


# =================================================================================================
# the protocol can fail: each handshake and the epoch is needed
# =================================================================================================

def _fresh_ring(W=3):
    rng = np.random.default_rng(11)
    return {L: [{n: rng.standard_normal((16, 8)).astype(np.float32) for n in "xywz"} for _ in range(W)]
            for L in (1, 2, 3)}


def _fresh_gather(W=2):
    rng = np.random.default_rng(12)
    return {L: [{"a": rng.standard_normal((32, 16)).astype(np.float16), "b": rng.standard_normal((16, 32))
                 .astype(np.float16), "c": np.full((32 * W, 32), np.nan, np.float16)} for _ in range(W)]
            for L in (1, 2, 3)}


def _fresh_rmsnorm(W=3):
    rng = np.random.default_rng(14)
    return {L: [{"x": rng.standard_normal((16, 32)).astype(np.float16), "w": rng.standard_normal((1, 32))
                 .astype(np.float16), "out": np.full((16 * W, 32), np.nan, np.float16)} for _ in range(W)]
            for L in (1, 2, 3)}


def _failing_seeds(monkeypatch, fn, fresh, kw, break_it, seeds):
    """The seeds whose launches give a wrong result (or never finish) with ``break_it(mp)``."""
    from tldsl.runtime.gpu.run_errors import GpuHangError
    W = len(fresh[1])
    wants = {L: tl.simulate(fn, W, fresh[L], **kw) for L in fresh}
    failed = []
    for seed in seeds:
        with monkeypatch.context() as mp:
            break_it(mp)
            mp.setattr("tldsl.runtime.gpu.run_program.HOST_SLACK_S", 0.0)
            try:
                ops, outs, _ = run_program(mp, fn, W, fresh[1], launches=len(fresh), seed=seed, fresh=fresh.get,
                                           **kw)
            except GpuHangError:
                failed.append(seed)
                continue
            try:
                for L, want in wants.items():
                    assert_agrees(outs[L - 1], want.outputs, want.kernel, sums=True)
            except AssertionError:
                failed.append(seed)
            for op in ops:
                op.close()
    return failed


def _skip_handshake(parity):
    real = program_op.stream_handshake

    def handshake(drv, stream, arrive, rank, value):
        if value % 2 != parity:
            real(drv, stream, arrive, rank, value)
    return lambda mp: mp.setattr(program_op, "stream_handshake", handshake)


def _no_epoch(mp):
    real = program_op.enqueue_launch
    mp.setattr(program_op, "enqueue_launch", lambda dev, order, launch, *a, **k: real(dev, order, 1, *a, **k))


def test_the_protocol_holds_and_each_of_its_steps_is_needed(monkeypatch):
    """Three launches with new inputs each, in random stream interleavings: all agree with the
    simulator. Without the entry handshake a rank pulls a peer's shard before the peer copied
    this launch's in (or pushes into a buffer the peer is still copying out); without the exit
    handshake a rank copies its result out before a peer's push of this launch landed; without
    the epoch a launch's waits are satisfied by the previous launch's notifies."""
    from test_codegen_general import ring_exchange
    from tldsl.ops.allgather_gemm import allgather_gemm
    ring = (ring_exchange, _fresh_ring(), {"compute": tl.ComputeSchedule(tile=(8, 8, 8))})
    gather = (allgather_gemm, _fresh_gather(), {"compute": tl.ComputeSchedule(tile=(16, 16, 16)),
                                                "comm": tl.CommSchedule(sms=1)})
    for fn, fresh, kw in (ring, gather):
        assert not _failing_seeds(monkeypatch, fn, fresh, kw, lambda mp: None, range(4))
    seeds = range(3)                # (each mutant fails at almost every seed)
    assert _failing_seeds(monkeypatch, *ring, _skip_handshake(1), seeds)         # no entry handshake
    assert _failing_seeds(monkeypatch, *ring, _skip_handshake(0), seeds)         # no exit handshake
    rms = (rmsnorm_allgather, _fresh_rmsnorm(), {"compute": tl.ComputeSchedule(tile=(8, 16, 16))})
    assert not _failing_seeds(monkeypatch, *rms, lambda mp: None, range(2))
    assert _failing_seeds(monkeypatch, *rms, _skip_handshake(0), seeds)          # (its only synchronisation)
    assert _failing_seeds(monkeypatch, *gather, _no_epoch, seeds)                # every launch is launch 1


def test_calls_on_alternating_streams_run_in_call_order(monkeypatch):
    """Each call on another stream of the caller's: a launch still follows the previous one —
    without that wait, a launch copies its inputs in while the one before still reads them."""
    from test_codegen_general import ring_exchange
    ring = (ring_exchange, _fresh_ring(), {"compute": tl.ComputeSchedule(tile=(8, 8, 8))})

    def alternate(mp):
        mp.setattr(RankDevice, "alternate", True)

    def unordered(mp):
        alternate(mp)
        mp.setattr(program_op, "_capturing", lambda: True)      # (what skips the wait)
    assert not _failing_seeds(monkeypatch, *ring, alternate, range(4))
    assert _failing_seeds(monkeypatch, *ring, unordered, range(3))


@tl.kernel
def gather_without_its_wait(x: tl.Symmetric, g, y, *, compute: tl.ComputeSchedule = None,
                            comm: tl.CommSchedule = None):
    """rmsnorm_gather (runtime/dist/program_check.py) with the compute part's wait deleted: it
    reads the gathered rows whenever it runs."""
    Ms, N = x.shape
    W = tl.world_size()
    ready = tl.signal("ready", W)

    @tl.comm_part(grid=(W,), engine="sm")
    def gather(p):
        t = tl.tile_pull_data(x.at(p), (0, 0), (Ms, N)).to(tl.float32)
        tl.store(g, (p * Ms, 0), t * tl.rsqrt(tl.sum(t * t, 1) / N + 1e-6)[:, None])
        tl.producer_tile_notify(ready, p)

    @tl.compute_part(grid=(W,))
    def part(p):
        tl.store(y, (p * Ms, 0), tl.load(g, (p * Ms, 0), (Ms, N)) * 2.0 + 1.0)


def test_a_program_without_its_wait_fails(monkeypatch):
    """The fake GPU runs what was compiled: the same program with its consumer wait deleted reads
    gathered rows before they are written (or the last launch's) in some interleavings."""
    from test_codegen_general import normed_gather
    kw = {"compute": tl.ComputeSchedule(tile=(8, 16, 16)), "comm": tl.CommSchedule(sms=1)}
    rng = np.random.default_rng(13)
    fresh = {L: [{"x": rng.standard_normal((8, 16)).astype(np.float32), "g": np.zeros((16, 16), np.float32),
                  "y": np.zeros((16, 16), np.float32)} for _ in range(2)] for L in (1, 2, 3)}
    wants = {L: tl.simulate(normed_gather, 2, fresh[L], **kw) for L in fresh}
    failed = 0
    for seed in range(2):           # (it fails at almost every seed)
        with monkeypatch.context() as mp:
            ops, outs, _ = run_program(mp, gather_without_its_wait, 2, fresh[1], launches=3, seed=seed,
                                       fresh=fresh.get, static_checks=False, **kw)
            try:
                for L, want in wants.items():
                    assert_agrees(outs[L - 1], want.outputs, want.kernel, sums=True)
            except AssertionError:
                failed += 1
            for op in ops:
                op.close()
    assert failed


def _fresh_counters_every_launch(mp):
    """What a CUDA graph's replays do (the fused-op base's device-side epoch): every launch is
    launch 1, after a group barrier on the caller's stream, this rank's counters zeroed, and a
    second barrier — here as stream operations of the fake GPU."""
    arrivals: dict = {}

    def epoch(self):
        self.launches += 1
        n, rank, W, block = self.launches, self.ctx.rank, self.ctx.world_size, self._counter_block

        def barrier(phase):
            arrived = []

            def op():
                if not arrived:
                    arrivals.setdefault((n, phase), set()).add(rank)
                    arrived.append(True)
                return len(arrivals[(n, phase)]) == W
            return op
        origin = self.device.origin()
        self.device._enqueue(origin, barrier(0))
        self.device._enqueue(origin, lambda: block.zero_() is not None)
        self.device._enqueue(origin, barrier(1))
        return 1
    mp.setattr(program_op.FusedProgram, "_launch_epoch", epoch)


def test_every_launch_as_launch_one_of_fresh_counters(monkeypatch):
    """A captured program's launches (each launch 1 of counters reset on the device) give every
    launch's results too: the protocol depends on the epoch only through _launch_epoch."""
    from test_codegen_general import ring_exchange
    from tldsl.ops.allgather_gemm import allgather_gemm
    ring = (ring_exchange, _fresh_ring(), {"compute": tl.ComputeSchedule(tile=(8, 8, 8))})
    gather = (allgather_gemm, _fresh_gather(), {"compute": tl.ComputeSchedule(tile=(16, 16, 16)),
                                                "comm": tl.CommSchedule(sms=1)})
    for case in (ring, gather):
        assert not _failing_seeds(monkeypatch, *case, _fresh_counters_every_launch, range(3))


# =================================================================================================
# refusals: before anything is allocated or enqueued
# =================================================================================================

def _built(monkeypatch, fn, W, inputs, **kw):
    g = Group(monkeypatch, W)
    ops = g.build(lambda r, dev: program_op.FusedProgram(fn, None, inputs[r], device=dev, timeout_s=2.0, **kw))
    return g, ops


def test_bad_arguments_are_refused_before_anything_is_enqueued(monkeypatch):
    fn, inputs, kw = library_case("normed_gather", 2)
    g, ops = _built(monkeypatch, fn, 2, inputs, **kw)
    good = tensors(inputs[0])
    bad = [({**good, "x": good["x"][:4]}, r"argument 'x': \(4, 16\) torch.float32, the program was traced for "
                                           r"\(8, 16\)"),
           ({**good, "x": good["x"].half()}, "argument 'x'.*float16"),
           ({**good, "y": good["y"].numpy()}, "argument 'y': a torch tensor"),
           ({**good, "g": torch.zeros(16, 16).t()}, "argument 'g' is not contiguous"),
           ({"x": good["x"], "g": good["g"]}, r"missing \['y'\]"),
           ({**good, "z": good["x"]}, r"unknown \['z'\]")]
    for args, msg in bad:
        with pytest.raises(InputError, match=msg):
            ops[0](**args)
    with pytest.raises(InputError, match="takes 3 tensors"):
        ops[0](good["x"])
    assert not any(g.fake.queues.values()) and ops[0].launches == 0       # nothing was enqueued
    for op in ops:
        op.close()
    with pytest.raises(Exception, match="closed"):
        ops[0](**good)
    assert "closed" in repr(ops[0])


def test_an_argument_the_program_writes_may_not_share_memory_with_another(monkeypatch):
    """normed_gather writes g and y and reads x: a written argument aliasing another one (the same
    tensor, or views of one) is refused before anything is enqueued — the kernels would write it
    while still reading the other."""
    fn, inputs, kw = library_case("normed_gather", 2)
    g, ops = _built(monkeypatch, fn, 2, inputs, **kw)
    good = tensors(inputs[0])
    both = torch.zeros(2, 16, 16)
    for args, msg in (({**good, "g": good["y"]}, "argument 'g' overlaps argument 'y'"),
                      ({**good, "g": both[0], "y": both[0]}, "argument 'g' overlaps argument 'y'")):
        with pytest.raises(InputError, match=msg):
            ops[0](**args)
    assert not any(g.fake.queues.values()) and ops[0].launches == 0
    # x is symmetric: copied into its buffer before the kernels run, so it may share the bytes of
    # an output (an in-place call), and the call's check lets it through; a written symmetric
    # argument (copied back after them) still may not share an output's
    assert "x" in {b.name for b in ops[0].kernel.args if b.symmetric}
    ops[0].check_arguments({**good, "x": good["y"][:8]})
    from tldsl.runtime.dist.program_op import _check_written_apart
    args, ts = ops[0].kernel.args[:2], [both[0], both[0]]
    _check_written_apart(args, ts, {args[0].name}, [True, True])                 # one written, one read: copied apart
    with pytest.raises(InputError, match="overlaps"):
        _check_written_apart(args, ts, {args[0].name, args[1].name}, [True, True])   # two copy-backs
    with pytest.raises(InputError, match="overlaps"):
        _check_written_apart(args, ts, {args[0].name}, [False, False])           # in place: written while read
    for op in ops:
        op.close()


@tl.kernel
def pull_prev(x: tl.Symmetric, z, w, *, compute: tl.ComputeSchedule = None):
    """Reads its symmetric x, stores the local output z, then pulls the previous rank's x into w."""
    M, N = x.shape
    W = tl.world_size()
    s = tl.signal("s", 1, scope="symmetric")

    @tl.compute_part(grid=(1,))
    def part(p):
        nxt, prv = (tl.rank() + 1) % W, (tl.rank() + W - 1) % W
        tl.store(z, (0, 0), tl.load(x, (0, 0), (M, N)) + 100.0)
        tl.peer_tile_notify(s, 0, nxt)
        tl.peer_tile_wait(s, 0, count=1)
        tl.store(w, (0, 0), tl.tile_pull_data(x.at(prv), (0, 0), (M, N)))


@tl.kernel
def double_and_pull(x, y: tl.Symmetric, w, *, compute: tl.ComputeSchedule = None):
    """Reads the local input x, stores 2x into its symmetric y, then pulls the previous rank's y into w."""
    M, N = x.shape
    W = tl.world_size()
    s = tl.signal("s", 1, scope="symmetric")

    @tl.compute_part(grid=(1,))
    def part(p):
        nxt, prv = (tl.rank() + 1) % W, (tl.rank() + W - 1) % W
        tl.store(y, (0, 0), tl.load(x, (0, 0), (M, N)) * 2.0)
        tl.peer_tile_notify(s, 0, nxt)
        tl.peer_tile_wait(s, 0, count=1)
        tl.store(w, (0, 0), tl.tile_pull_data(y.at(prv), (0, 0), (M, N)))


def _alias_inputs(fn, W=2, n=8):
    """x = rank + 1 everywhere, every other argument zeros."""
    return [{a: np.full((n, n), float(r + 1) if a == "x" else 0.0, np.float32) for a in fn.arg_names}
            for r in range(W)]


ALIAS_KW = {"compute": tl.ComputeSchedule(tile=(8, 8, 8))}


@pytest.mark.parametrize("fn, name, other", [(pull_prev, "z", "x"), (double_and_pull, "x", "y")])
def test_an_argument_within_another_arguments_symmetric_buffer_is_refused(monkeypatch, fn, name, other):
    """The kernels and the peers touch a symmetric argument in its symmetric buffer, which a staged
    argument is copied into before them: another argument's tensor there is refused before
    anything is enqueued. Unchecked, pull_prev given z=symmetric_buffer('x') stored z where the
    peer pulls x (w = [102, 101] where tl.simulate gives [2, 1]), and double_and_pull given its
    read-only local x in symmetric_buffer('y') read y's copied-in zeros instead of x (w and y 0)."""
    inputs = _alias_inputs(fn)
    g, ops = _built(monkeypatch, fn, 2, inputs, **ALIAS_KW)
    args = tensors(inputs[0])
    buf = ops[0].symmetric_buffer(other)
    buf.copy_(args[name])                               # (what the caller meant the argument to hold)
    with pytest.raises(InputError, match=f"argument '{name}' overlaps the symmetric buffer of argument '{other}'"):
        ops[0](**{**args, name: buf})
    assert not any(g.fake.queues.values()) and ops[0].launches == 0
    for op in ops:
        op.close()


def test_another_arguments_buffer_or_a_workspace_is_refused_for_any_argument(monkeypatch):
    """ring_exchange (x, y, w symmetric; z local, written): another argument's buffer for a local
    output or for a symmetric argument (copied in from, or back into, a buffer the other is copied
    into) is refused; the buffer passed as its own argument too is that argument's tensor, compared
    as any other. A workspace (allgather_gemm's gathered rows) is the program's own memory."""
    fn, inputs, kw = library_case("ring_exchange", 2)
    with monkeypatch.context() as mp:
        g, ops = _built(mp, fn, 2, inputs, **kw)
        good = tensors(inputs[0])
        for name, other in (("z", "y"), ("z", "x"), ("x", "w"), ("w", "y")):
            with pytest.raises(InputError, match=f"argument '{name}' overlaps the symmetric buffer of argument "
                                                 f"'{other}'"):
                ops[0](**{**good, name: ops[0].symmetric_buffer(other)})
        y = ops[0].symmetric_buffer("y")
        with pytest.raises(InputError, match="argument 'y' overlaps argument 'z'"):
            ops[0](**{**good, "y": y, "z": y})
        assert not any(g.fake.queues.values()) and ops[0].launches == 0
        for op in ops:
            op.close()
    fn, inputs, kw = library_case("allgather_gemm", 2)
    g, ops = _built(monkeypatch, fn, 2, inputs, **kw)
    ws = ops[0].workspace_tensors()["a_gathered"]
    good = tensors(inputs[0])
    with pytest.raises(InputError, match="argument 'b' overlaps the program's workspace 'a_gathered'"):
        ops[0](**{**good, "b": ws.view(-1)[:good["b"].numel()].view(good["b"].shape)})
    assert not any(g.fake.queues.values()) and ops[0].launches == 0
    for op in ops:
        op.close()


@pytest.mark.parametrize("fn", [pull_prev, double_and_pull])
def test_a_symmetric_buffer_passed_as_its_own_argument_still_agrees_with_the_simulator(monkeypatch, fn):
    """Zero-copy, the intended use of symmetric_buffer(name): the caller writes the input into the
    buffer and passes it as that argument, launch after launch, and every launch agrees with
    tl.simulate of its inputs."""
    W = 2
    sym = "x" if fn is pull_prev else "y"
    g, ops = _built(monkeypatch, fn, W, _alias_inputs(fn, W), **ALIAS_KW)
    bufs = [op.symmetric_buffer(sym) for op in ops]
    rng = np.random.default_rng(3)
    for _ in range(2):
        inputs = _alias_inputs(fn, W)
        for r in range(W):
            inputs[r]["x"] = rng.standard_normal((8, 8)).astype(np.float32)
        want = tl.simulate(fn, W, inputs, **ALIAS_KW)
        args = [tensors(x) for x in inputs]
        for r in range(W):      # (the fake GPU runs at synchronize: the previous launch is done)
            bufs[r].copy_(args[r][sym])
            args[r][sym] = bufs[r]
        for r in g.fake.rng.sample(range(W), W):
            ops[r](**args[r])
        for op in ops:
            op.synchronize()
        assert_agrees([{n: host(t) for n, t in a.items()} for a in args], want.outputs, want.kernel, sums=True)
    for op in ops:
        op.close()


def test_ranks_that_trace_different_programs_all_refuse(monkeypatch):
    """The agreement check: every rank raises an InputError naming the difference — none goes on
    to allocate and wait for the others."""
    from tldsl.runtime.dist import symmetric
    fn, inputs, kw = library_case("normed_gather", 2)
    before = len(symmetric._LEDGER)
    g = Group(monkeypatch, 2)
    tiles = {0: tl.ComputeSchedule(tile=(8, 16, 16)), 1: tl.ComputeSchedule(tile=(8, 8, 16))}
    with pytest.raises(InputError, match="the ranks traced different programs — schedules: rank 0 .*tile=\\(8, 16, 16\\).*, rank 1 .*tile=\\(8, 8, 16\\)"):
        g.build(lambda r, dev: program_op.FusedProgram(fn, None, inputs[r], device=dev,
                                                       **{**kw, "compute": tiles[r]}))
    assert all(isinstance(e, InputError) for e in g.errors)
    assert len(symmetric._LEDGER) == before and not any(g.fake.queues.values())


def test_a_rank_that_cannot_build_it_is_named_by_its_peers(monkeypatch):
    fn, inputs, kw = library_case("normed_gather", 2)
    g = Group(monkeypatch, 2)
    specs = {0: inputs[0], 1: {**inputs[1], "x": np.zeros((8,), np.float32)}}
    with pytest.raises(InputError):
        g.build(lambda r, dev: program_op.FusedProgram(fn, None, specs[r], device=dev, **kw))
    assert "rank 1 could not build it" in str(g.errors[0])
    assert "rank 1 could not build it" not in str(g.errors[1])        # its own error
    with pytest.raises(InputError, match="needs a @tl.kernel function"):
        Group(monkeypatch, 1).build(lambda r, dev: program_op.FusedProgram(object(), None, {}, device=dev))
    for bad, match in ((dict(static_checks="no"), "static_checks must be True or False, got 'no'"),
                       (dict(specs=42), r"specs: the arguments' specs \(x, g, y\) in order .*got int"),
                       (dict(progress=42), r"FusedProgram: progress=42: None, True, False or a function")):
        with pytest.raises(InputError, match=match):
            Group(monkeypatch, 1).build(lambda r, dev: program_op.FusedProgram(
                fn, None, **{"specs": inputs[0], **bad}, device=dev, **kw))
    with pytest.raises(InputError, match="timeout_s must be a finite positive number"):
        Group(monkeypatch, 1).build(lambda r, dev: program_op.FusedProgram(fn, None, inputs[0], device=dev,
                                                                           timeout_s=float("inf"), **kw))


# =================================================================================================
# tl.run across a group, and what every fused op shows
# =================================================================================================

def test_tl_run_with_a_group_runs_through_the_fused_program_runtime(monkeypatch):
    fn, inputs, kw = library_case("ring_exchange", 3)
    want = simulated(fn, 3, inputs, 2, **kw)
    g = Group(monkeypatch, 3)
    results = g.build(lambda r, dev: tl.run(fn, inputs=inputs[r], group=object(), options={"launches": 2},
                                                  timeout_s=5.0, **kw))
    got = [res[r] for r, res in enumerate(results)]
    assert_agrees(got, want.outputs, want.kernel, sums=True)
    res = results[1]
    assert isinstance(res, tl.SimResult) and res.launches == 2 and len(res.launch_ms) == 2
    assert "rank 1 of 3" in repr(res)
    with pytest.raises(InputError, match="holds only its own arrays"):
        res[0]
    assert results[2][-1] is results[2][2]              # the last rank, as on a one-process result
    with pytest.raises(InputError, match=r"indexed by rank first: result\[rank\]\['y'\]"):
        res["y"]
    assert "output " in results[1]._repr_html_()        # this rank's own outputs (rank 0's list is empty here)
    with pytest.raises(InputError, match="the process group has 3 ranks"):
        g.build(lambda r, dev: tl.run(fn, 2, inputs=inputs[r], group=object(), **kw))
    run_module = sys.modules["tldsl.run"]       # tldsl does not import the distributed runtime: it registers itself
    monkeypatch.setattr(run_module, "_ACROSS_GROUP", None)
    with pytest.raises(InputError, match="import tldsl.runtime.dist first"):
        tl.run(fn, inputs=inputs[0], group=object(), **kw)


def test_tl_run_with_a_group_runs_every_launch_on_the_callers_arguments(monkeypatch):
    """As tl.simulate and tl.run on one GPU: an in-place ``y += x`` (and a push into a peer's
    symmetric argument) returns one application of itself over three launches."""
    from test_simulator import accumulate
    rng = np.random.default_rng(4)
    inputs = [{"x": rng.standard_normal(8).astype(np.float32), "y": rng.standard_normal(8).astype(np.float32),
               "seen": rng.standard_normal(8).astype(np.float32)} for _ in range(2)]
    results = Group(monkeypatch, 2).build(lambda r, dev: tl.run(accumulate, inputs=inputs[r], group=object(),
                                                                options={"launches": 3}, timeout_s=5.0))
    for r, res in enumerate(results):
        assert res.launches == 3
        np.testing.assert_array_equal(res[r]["y"], inputs[r]["y"] + inputs[r]["x"])
        np.testing.assert_array_equal(res[r]["seen"], inputs[1 - r]["x"] * 2)


def test_describe_repr_and_counters(monkeypatch):
    fn, inputs, kw = library_case("allgather_gemm", 2)
    ops, _, _ = run_program(monkeypatch, fn, 2, inputs, launches=3, **kw)
    op = ops[1]
    assert repr(op).startswith("<FusedProgram rank 1/2: allgather_gemm(a [32, 16] f16") and "3 launches" in repr(op)
    assert op.signal_counters() == {"gather_a_ready": [3, 3]}          # the epoch: 3 launches' notifies
    text = op.describe()
    assert "rank 1's launch: 2 stream(s)" in text and "part gemm:" in text
    assert "FusedProgram" in op._repr_html_()
    for o in ops:
        o.close()
    assert op.describe().endswith("its symmetric memory is freed")


def test_the_torchrun_checks_case_runner_on_fake_ranks(monkeypatch):
    """runtime/dist/program_check.py's per-case check (what torchrun runs on GPUs) passes on the
    fake ranks for its own hand-written programs and a library op, and reports a wrong answer."""
    from tldsl.runtime.dist import program_check as pc
    rng = np.random.default_rng(3)
    x = [{"x": rng.standard_normal((8, 16)).astype(np.float32), "g": np.zeros((16, 16), np.float32),
          "y": np.zeros((16, 16), np.float32)} for _ in range(2)]
    r = [{n: rng.standard_normal((16, 8)).astype(np.float32) for n in "xyz"} for _ in range(2)]
    fn, inputs, kw = library_case("allgather_gemm_ce", 2)
    cases = [(pc.rmsnorm_gather, x, {"compute": tl.ComputeSchedule(tile=(8, 16, 16)), "comm": tl.CommSchedule(sms=1)}),
             (pc.ring, r, {"compute": tl.ComputeSchedule(tile=(8, 8, 8))}), (fn, inputs, kw)]
    for fn, inputs, kw in cases:
        expected = tl.simulate(fn, 2, inputs, **kw).outputs
        g = Group(monkeypatch, 2)
        assert g.build(lambda q, dev: pc.check_case(fn, inputs, kw, expected, 1e-3, object(), q, 2, 3)) == [[], []]
    wrong = [{k: v + 1 for k, v in e.items()} for e in expected]
    g = Group(monkeypatch, 2)
    problems = g.build(lambda q, dev: pc.check_case(fn, inputs, kw, wrong, 1e-3, object(), q, 2, 2))
    assert all(any(x.startswith("tl.run c: max error") for x in p) for p in problems)


def test_only_written_symmetric_arguments_are_copied_back():
    """A read-only symmetric argument (AllGather+GEMM's shard) is not copied back after a launch;
    what any rank stores or moves into is (pushes into a peer included)."""
    from test_codegen_general import ring_exchange
    for name, written in (("allgather_gemm", {"c", "a_gathered"}), ("allgather_gemm_ce", {"c", "a_gathered"}),
                          ("rmsnorm_allgather", {"out"}), ("normed_gather", {"g", "y"})):
        fn, inputs, kw = library_case(name, 2)
        assert written_buffers(tl.simulate(fn, 2, inputs, **kw).kernel) == written, name
    r = library_case("ring_exchange", 2)
    assert written_buffers(tl.simulate(ring_exchange, 2, r[1], **r[2]).kernel) == {"y", "w", "z"}


def _fresh_library(name: str, W: int, launches: int = 3) -> tuple:
    """``(kernel, {launch: inputs}, keyword values)`` of a library op with new activations every
    launch: each input array of finite floats redrawn (same routing tables and shapes; outputs,
    poisoned with NaN, kept)."""
    fn, inputs, kw = library_case(name, W)
    rng = np.random.default_rng(100 + W)

    def redraw(a):
        if a.dtype.kind == "f" and np.isfinite(a).all():
            return rng.standard_normal(a.shape).astype(a.dtype)
        return a
    fresh = {L: [{n: (a if L == 1 else redraw(a)) for n, a in rank.items()} for rank in inputs]
             for L in range(1, launches + 1)}
    return fn, fresh, kw


def _without_a_wait(role: str):
    """The program as traced with its first wait in a part of ``role`` deleted (a consumer's wait
    for the data it reads), as the mutation check deletes it."""
    from tldsl.ir.opdefs import WAIT_OPS
    from tldsl.kernel import KernelFunction
    from tldsl.testing.mutants import delete_site, sync_sites
    real = KernelFunction.trace_checked

    def traced(self, *args, **kwargs):
        ir = real(self, *args, **kwargs)
        site = next(i for i, (part, op) in enumerate(sync_sites(ir))
                    if ir.part(part).role == role and op.name in WAIT_OPS)
        return delete_site(ir, site)
    return lambda mp: mp.setattr(KernelFunction, "trace_checked", traced)


# the wait deleted: the grouped GEMM's for the gathered rows, the reduce-scatter's for the combined
# rows (the combine's own wait takes its count from a table nothing else reads), attention's for K/V
@pytest.mark.parametrize("name,W,role", [("allgather_moe", 2, "compute"), ("moe_reduce_scatter", 3, "comm"),
                                         ("sp_attention", 2, "compute")])
def test_the_new_ops_protocol_holds_replays_and_fails_without_its_waits(monkeypatch, name, W, role):
    """AllGather+MoE, MoE+ReduceScatter and sequence-parallel attention as the fused-op runtime runs
    them, three launches with new activations each in random stream interleavings: right as
    launched eagerly and as a CUDA graph replays them (every launch launch 1 of counters zeroed
    on the device between two barriers), and wrong — or hung — without a wait one of their parts
    makes for the data it reads."""
    case = _fresh_library(name, W)
    assert not _failing_seeds(monkeypatch, *case, lambda mp: None, range(2))
    assert not _failing_seeds(monkeypatch, *case, _fresh_counters_every_launch, range(2))
    assert _failing_seeds(monkeypatch, *case, _without_a_wait(role), range(3))


@pytest.mark.parametrize("fresh_counters", [False, True])
def test_a_gather_counting_every_ranks_arrival_on_one_slot_through_the_fused_op_runtime(monkeypatch, fresh_counters):
    """FusedProgram (one rank a GPU, fake ranks in threads): three ranks' copy engines each add 1
    to rank 0's one slot (the fakes' tldsl_signal_add), three launches, with the counters kept or
    zeroed every launch (the graph mode); rank 0's result is the simulator's."""
    from test_run_fake_device import gather_arrivals, gather_inputs
    if fresh_counters:
        _fresh_counters_every_launch(monkeypatch)
    ins = gather_inputs(3)
    kw = dict(comm=tl.CommSchedule(engine="copy_engine"))
    want = simulated(gather_arrivals, 3, ins, 3, **kw)
    ops, outs, _ = run_program(monkeypatch, gather_arrivals, 3, ins, launches=3, **kw)
    np.testing.assert_array_equal(outs[-1][0]["y"], want.outputs[0]["y"])
    for op in ops:
        op.close()


@pytest.mark.parametrize("sm_slot", [0, 1, -1])
def test_a_signal_the_copy_engine_and_an_sm_part_share_through_the_fused_op_runtime(monkeypatch, sm_slot):
    from test_codegen_comm import ce_beside_sm
    from test_run_fake_device import ce_beside_sm_inputs
    ins = ce_beside_sm_inputs(2)
    kw = dict(sm_slot=sm_slot, comm=tl.CommSchedule(engine="copy_engine"))
    want = simulated(ce_beside_sm, 2, ins, 2, **kw)
    ops, outs, _ = run_program(monkeypatch, ce_beside_sm, 2, ins, launches=2, **kw)
    for r in range(2):
        np.testing.assert_array_equal(outs[-1][r]["y"], want.outputs[r]["y"])
    for op in ops:
        op.close()



class _RecordedFailure:
    """A device's run-time check word (runtime/gpu/run_checks.py) holding ``word``."""

    def __init__(self, word: int):
        self.word = word

    def read(self) -> int:
        return self.word

    def clear(self) -> None:
        self.word = 0


def test_a_wait_count_the_kernels_found_wrong_is_raised_at_synchronize(monkeypatch):
    """The fused-op runtime reads the word the kernels record a failed wait-count check in (as
    tl.run does after each launch): synchronize raises RunCheckError at the wait's line, once."""
    from test_codegen_general import counted_wait
    from tldsl.codegen.ir_queries import wait_site
    from tldsl.runtime.gpu.run_errors import RunCheckError
    inputs = [{"x": np.ones((8, 8), np.float32), "cnt": np.array([1], np.int32), "y": np.zeros((8, 8), np.float32)}]
    ops, outs, _ = run_program(monkeypatch, counted_wait, 1, inputs, launches=1,
                               compute=tl.ComputeSchedule(tile=(8, 8, 8)))
    np.testing.assert_array_equal(outs[0][0]["y"], np.full((8, 8), 3.0, np.float32))
    op = ops[0]
    wait = next(o for _, o in op.kernel.walk() if o.name == "consumer_tile_wait")
    op.device.run_checks = _RecordedFailure(((wait_site(wait) + 1) << 32) | 0)
    with pytest.raises(RunCheckError, match="consumer_tile_wait at .*its count was 0 at run time"):
        op.synchronize()
    op.synchronize()                                    # reported once: the word is cleared
    op.close()
