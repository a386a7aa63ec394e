"""The fused ops captured in CUDA graphs and replayed, on two simulated ranks.

The two-rank model of tests/test_dist_protocols.py (the real ops, a fake driver whose streams run
in random orders, every GEMM the program it was compiled from) with CUDA graph capture added to
the driver (``Device.begin_capture`` / ``end_capture`` / ``replay``: a capturing stream records its
calls instead of running them, an event recorded in the capture forks the streams that wait for it
into the capture, work not joined back is refused, as are a host synchronisation and a wait for an
event recorded outside the capture).

Each variant: a few eager launches first (the counters are past 1 when the capture starts), each
rank's call captured once (``torch.cuda.graph``'s way: a side stream of its own), then 100 replays,
each after fresh inputs are written into the captured input tensors on the replay stream, and each
followed by a snapshot of the captured outputs on that stream — replays enqueued ten at a time, so
the ranks' replays overlap under the random schedules. Every replay's A_gathered and C (AG+GEMM) or
rows of the sum (GEMM+RS) must be exact. An eager call after the replays must be right too (the op
stays in graph mode: runtime/dist/fused_op.py).

The protocol that makes a replay correct (runtime/dist/fused_op.py): a captured call is launch 1 of
fresh counters, and each replay starts with barrier, counters zeroed, barrier on the device. Its
mutants fail here: the counters not reset (the epoch never advances: replay 2's waits are satisfied
by replay 1's flags), or the launch number passed from the host as before (the captured number
baked into the graph).
"""
from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

import tldsl as tl  # noqa: E402
from test_dist_protocols import (CaptureError, _CompiledGemm, _gemm_staging_ranks, _pull_ranks,  # noqa: E402
                                 _push_ranks, _Ranks, _rs_ranks, _small_ints)

REPLAYS = 100


def _ag(variant: str):
    """``(build(monkeypatch) -> ranks, (Ms, K, N))`` for an AllGather+GEMM variant."""
    from tldsl.runtime.dist import ag_gemm as agm
    bf = torch.bfloat16
    if variant == "push":
        return lambda mp: _push_ranks(mp), (128, 16, 24)
    if variant == "push-sliced":
        comm = tl.CommSchedule(engine="copy_engine", mode="push", col_tile=64)
        return (lambda mp: _push_ranks(mp, K=160, make=lambda r: agm.AllGatherMatmul(128, 160, 24, bf, comm=comm),
                                       gemm=_CompiledGemm), (128, 160, 24))
    if variant == "gemm-push":
        return (lambda mp: _push_ranks(mp, make=lambda r: agm.AllGatherMatmul(128, 16, 24, bf, pusher="gemm"),
                                       gemm=_CompiledGemm), (128, 16, 24))
    if variant == "pull-staging-kernel":
        return lambda mp: _pull_ranks(mp, 200, 16, 24), (200, 16, 24)
    if variant == "pull-staging-kernel-comm-first":
        return lambda mp: _pull_ranks(mp, 200, 16, 24, enqueue="comm_first"), (200, 16, 24)
    if variant == "push-comm-first":
        return (lambda mp: _push_ranks(mp, make=lambda r: agm.AllGatherMatmul(128, 16, 24, bf, enqueue="comm_first"),
                                       gemm=_CompiledGemm), (128, 16, 24))
    if variant == "pull-gemm-staging":
        return lambda mp: _gemm_staging_ranks(mp), (256, 16, 24)
    if variant in ("pull-copies-memops", "pull-copies-kernel-handshake"):
        handshake = "memops" if variant.endswith("memops") else "kernel"

        def build(mp):
            from tldsl.runtime.gpu import device as device_mod
            mp.setattr(device_mod, "sm_count", lambda: 132)
            ranks = _Ranks(mp, lambda r: agm.AllGatherMatmul(200, 16, 24, bf, staging="copies", handshake=handshake),
                           _CompiledGemm)
            assert all(op.staging == "copies" and op.handshake == handshake for op in ranks.ops)
            return ranks
        return build, (200, 16, 24)
    raise KeyError(variant)


AG_VARIANTS = ["push", "push-sliced", "gemm-push", "push-comm-first", "pull-staging-kernel",
               "pull-staging-kernel-comm-first", "pull-gemm-staging", "pull-copies-memops", "pull-copies-kernel-handshake"]
RS_VARIANTS = ["rs-copy", "rs-copy-early-sum", "rs-copy-epilogue"]


def _replay_ag(monkeypatch, variant: str, seed: int, replays: int = REPLAYS, eager: int = 2, batch: int = 10):
    build, (Ms, K, N) = _ag(variant)
    ranks = build(monkeypatch)
    rng = random.Random(seed)
    dev, W = ranks.device, ranks.W
    b = dev.register(_small_ints(K, N))
    stream = {r: next(ranks.streams) for r in range(W)}

    def expect(shards):
        gathered = torch.cat(shards)
        return gathered, (gathered.float() @ b.float()).to(torch.bfloat16)

    checks = []
    for _ in range(eager):                          # eager launches before the capture
        shards = [dev.register(_small_ints(Ms, K)) for _ in range(W)]
        checks.append(("eager", expect(shards), {r: ranks.call(r, shards[r], b, stream=stream[r])
                                                 for r in rng.sample(range(W), W)}))
    dev.run(rng)
    static = [dev.register(_small_ints(Ms, K)) for _ in range(W)]
    graphs, outs = {}, {}
    for r in rng.sample(range(W), W):
        graphs[r], outs[r] = ranks.capture(r, static[r], b)
    assert not any(dev.queues.values()), "a capture ran work"
    for i in range(replays):
        shards = [_small_ints(Ms, K) for _ in range(W)]
        got = {}
        for r in rng.sample(range(W), W):
            dev.kernel(stream[r], f"inputs {i}", lambda r=r, x=shards[r]: static[r].copy_(x))
            dev.replay(graphs[r], stream[r])
            snap = got.setdefault(r, {})
            dev.kernel(stream[r], f"outputs {i}", lambda r=r, snap=snap: snap.update(
                a=outs[r][0].clone(), c=outs[r][1].clone()))
        checks.append((f"replay {i + 1}", expect(shards), got))
        if (i + 1) % batch == 0:
            dev.run(rng)
    dev.run(rng)
    shards = [dev.register(_small_ints(Ms, K)) for _ in range(W)]      # eager again, after the replays
    checks.append(("eager after", expect(shards), {r: ranks.call(r, shards[r], b, stream=stream[r])
                                                   for r in rng.sample(range(W), W)}))
    dev.run(rng)
    for what, (want_a, want_c), per_rank in checks:
        for r, res in per_rank.items():
            a_full, c = (res["a"], res["c"]) if isinstance(res, dict) else res
            assert torch.equal(a_full, want_a), f"{variant}, seed {seed}: rank {r}'s A_gathered of {what} is wrong"
            assert torch.equal(c, want_c), f"{variant}, seed {seed}: rank {r}'s C of {what} is wrong"
    return ranks


def _replay_rs(monkeypatch, variant: str, seed: int, replays: int = REPLAYS, eager: int = 2, batch: int = 10):
    options = {"comm": tl.CommSchedule(engine="copy_engine", mode="push", reduce_in="epilogue")} \
        if variant == "rs-copy-epilogue" else {}
    ranks = _rs_ranks(monkeypatch, early_sum=variant == "rs-copy-early-sum", **options)
    rng = random.Random(seed)
    dev, W, Ms, K, N = ranks.device, ranks.W, ranks.Ms, ranks.K, ranks.N
    stream = {r: next(ranks.streams) for r in range(W)}

    def fresh():
        ab = [(_small_ints(W * Ms, K), _small_ints(K, N)) for _ in range(W)]
        partials = [(a.float() @ b.float()).to(torch.bfloat16) for a, b in ab]
        return ab, [partials[r][r * Ms:(r + 1) * Ms] + partials[1 - r][r * Ms:(r + 1) * Ms] for r in range(W)]

    checks = []
    for _ in range(eager):
        ab, want = fresh()
        ab = [(dev.register(a), dev.register(b)) for a, b in ab]
        checks.append(("eager", want, {r: ranks.call(r, *ab[r], stream=stream[r]) for r in rng.sample(range(W), W)}))
    dev.run(rng)
    static = [(dev.register(_small_ints(W * Ms, K)), dev.register(_small_ints(K, N))) for _ in range(W)]
    graphs, outs = {}, {}
    for r in rng.sample(range(W), W):
        graphs[r], outs[r] = ranks.capture(r, *static[r])
    assert not any(dev.queues.values()), "a capture ran work"
    for i in range(replays):
        ab, want = fresh()
        got = {}
        for r in rng.sample(range(W), W):
            def inputs(r=r, x=ab[r]):
                static[r][0].copy_(x[0])
                static[r][1].copy_(x[1])
            dev.kernel(stream[r], f"inputs {i}", inputs)
            dev.replay(graphs[r], stream[r])
            dev.kernel(stream[r], f"outputs {i}", lambda r=r: got.__setitem__(r, outs[r].clone()))
        checks.append((f"replay {i + 1}", want, got))
        if (i + 1) % batch == 0:
            dev.run(rng)
    dev.run(rng)
    ab, want = fresh()
    ab = [(dev.register(a), dev.register(b)) for a, b in ab]
    checks.append(("eager after", want, {r: ranks.call(r, *ab[r], stream=stream[r]) for r in rng.sample(range(W), W)}))
    dev.run(rng)
    for what, want, per_rank in checks:
        for r, out in per_rank.items():
            assert torch.equal(out, want[r]), f"{variant}, seed {seed}: rank {r}'s rows of {what} are wrong"
    return ranks


def _replay(monkeypatch, variant, seed, **kw):
    run = _replay_rs if variant.startswith("rs-") else _replay_ag
    return run(monkeypatch, variant, seed, **kw)


@pytest.mark.parametrize("variant", AG_VARIANTS + RS_VARIANTS)
def test_captured_op_replays_100_times(monkeypatch, variant):
    """Capture once, replay 100 times with fresh inputs: every replay's output exact."""
    ranks = _replay(monkeypatch, variant, seed=1)
    for op in ranks.ops:
        assert op._graph and op.launches == 2 + 1 + 1      # eager, the capture, eager after (replays are not calls)


@pytest.mark.parametrize("variant", AG_VARIANTS + RS_VARIANTS)
@pytest.mark.parametrize("seed", range(2, 5))
def test_captured_op_replays_under_other_schedules(monkeypatch, variant, seed):
    _replay(monkeypatch, variant, seed, replays=12, batch=4)


def _failing_seeds(monkeypatch, variant, break_it, seeds, replays=12, first=True) -> list[int]:
    """The seeds whose run fails with ``break_it`` (``first``: stop at the first)."""
    failed = []
    for seed in seeds:
        with monkeypatch.context() as mp:
            break_it(mp)
            try:
                _replay(mp, variant, seed, replays=replays, batch=4)
            except AssertionError:
                failed.append(seed)
                if first:
                    break
    return failed


def _epoch_not_advanced(mp):
    """The replays keep the captured launch number and nothing resets the counters."""
    from tldsl.runtime.dist.fused_op import FusedOp
    mp.setattr(FusedOp, "_fresh_epoch", lambda self: None)


def _epoch_from_the_host(mp):
    """The launch number passed from the host as before graphs: the captured call's baked in."""
    from tldsl.runtime.dist.fused_op import FusedOp

    def host_count(self):
        self.launches += 1
        from tldsl.runtime.dist import call_order
        self._capture = call_order.capturing()
        return self.launches
    mp.setattr(FusedOp, "_next_launch", host_count)


def _barriers_left_out(mp):
    """The counters are reset, but without the barriers around the reset."""
    from tldsl.runtime.dist.symmetric import Lease
    mp.setattr(Lease, "barrier", lambda self, stream, channel=0: None)


@pytest.mark.parametrize("variant", AG_VARIANTS + RS_VARIANTS)
@pytest.mark.parametrize("mutant", [_epoch_not_advanced, _epoch_from_the_host])
def test_replays_fail_without_the_device_epoch(monkeypatch, variant, mutant):
    """The epoch not advanced on the device, or passed from the host: some replay is wrong (or the
    simulated GPU deadlocks) under some schedule."""
    assert _failing_seeds(monkeypatch, variant, mutant, range(3)), (variant, mutant.__name__)


def test_replays_fail_without_the_barriers(monkeypatch):
    """Resetting the counters without the barriers around it lets a peer's write of the previous
    replay (or of this one) land on the wrong side of the reset."""
    assert _failing_seeds(monkeypatch, "push", _barriers_left_out, range(6))


def test_capture_refuses_host_synchronisation_and_outside_events(monkeypatch):
    """The simulated driver refuses, while capturing, a host synchronisation (the ops' debug report,
    here forced on during the capture) and a wait for an event recorded outside the capture; and
    refuses work forked and not joined back."""
    build, (Ms, K, N) = _ag("push")
    ranks = build(monkeypatch)
    dev = ranks.device
    with pytest.raises(CaptureError, match="synchronize"):
        side = next(ranks.streams)
        g = dev.begin_capture(side)
        try:
            torch.cuda.synchronize()
        finally:
            dev.abort_capture(g)
    ev = dev.cuEventCreate(0)[1]
    dev.cuEventRecord(ev, 1)
    g = dev.begin_capture(2)
    with pytest.raises(CaptureError, match="outside the capture"):
        dev.cuStreamWaitEvent(2, ev, 0)
    dev.abort_capture(g)
    g = dev.begin_capture(3)
    fork = dev.cuEventCreate(0)[1]
    dev.cuEventRecord(fork, 3)
    dev.cuStreamWaitEvent(4, fork, 0)
    dev.cuStreamWriteValue64(4, 0, 0, 0)
    with pytest.raises(CaptureError, match="not joined"):
        dev.end_capture(g)
    # the op's debug report synchronises: skipped while capturing, so a captured call never does
    for op in ranks.ops:
        op.debug = True
    b = dev.register(_small_ints(K, N))
    for r in range(2):
        ranks.capture(r, dev.register(_small_ints(Ms, K)), b)


def test_eager_calls_are_unchanged_until_a_capture(monkeypatch):
    """Never captured, an op counts its launches on the host as before (no barrier, no reset)."""
    build, (Ms, K, N) = _ag("push")
    ranks = build(monkeypatch)
    dev = ranks.device
    b = dev.register(_small_ints(K, N))
    for L in (1, 2, 3):
        for r in range(2):
            ranks.call(r, dev.register(_small_ints(Ms, K)), b)
        assert not any(name in ("barrier", "memset") for q in dev.queues.values() for name, _ in q)
        dev.run(random.Random(L))
    for op in ranks.ops:
        assert not op._graph and op._engine.flags.tolist() == [3, 3]
