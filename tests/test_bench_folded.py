"""The benchmarks' folded launches (``tldsl/bench/folded.py``), on the CPU: a folded kernel's
waits count in its own epochs, on counters of its own. The kernels timed one after the other
run stream-ordered and notify nothing; a folded launch that counted its epochs from theirs
waited for an epoch nobody notifies — on the GPU a hang (``bench moe --layer ag --fold on``,
thirty-second session). Here the folded AllGather+MoE program runs in the simulator's rules
(:class:`tldsl.runtime.sim.bound_launch.BoundLaunch`) as the benchmark launches it."""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl
from tldsl.bench import moe
from tldsl.bench.folded import SATISFIED, FoldedLaunches
from tldsl.errors import DeadlockError
from tldsl.ops.moe import moe_routing
from tldsl.runtime.sim.bound_launch import BoundLaunch

torch = pytest.importorskip("torch")

T, K, N, E, TOPK, BM = 24, 32, 32, 4, 2, 16
FOLDED_PARTS = ("gather_rows", "grouped_gemm")


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def _bits_f32(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)


@pytest.fixture(scope="module")
def staged_ag():
    """A small AllGather+MoE program with its rows staged (gather_rows, then the grouped GEMM),
    its arrays, and the reference of its output rows."""
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(T)]).astype(np.int32)
    rt = moe_routing(ids, E, 1, T, BM)
    k = rt.trace_allgather_moe(1, T, K, N, E, tl.bfloat16,
                               compute=tl.ComputeSchedule(tile=(BM, N, K), stages=2),
                               comm=tl.CommSchedule(tile_m=BM, mode="pull"), stage_rows=True)
    assert {p.name for p in k.parts if p.role == "compute"} == set(FOLDED_PARTS)
    x = _bits_f32(_bf16_bits(rng.standard_normal((T, K))))
    w = _bits_f32(_bf16_bits(rng.standard_normal((E, K, N)) / K ** 0.5))
    arrays = {"x_gathered": _bf16_bits(x), "w1": _bf16_bits(w),
              **{n: np.ascontiguousarray(a) for n, a in rt.allgather_tables().items()}}
    for b in [*k.buffers, *k.workspaces]:
        if b.name not in arrays:        # outputs and staged rows poisoned (bf16 NaN bits)
            arrays[b.name] = np.full(tuple(b.type.shape), 0x7FC0, np.uint16)
    want = {}
    for t in range(T):
        for j in range(TOPK):
            want[int(rt.token_pos[j * T + t])] = x[t] @ w[ids[t, j]]
    return k, arrays, want


def _sim_prepared(k, arrays, launched):
    """``prepare(signals)`` for FoldedLaunches: each launch runs the folded parts' tile programs
    to the end in the simulator on ``arrays`` and those counters (a DeadlockError where every
    task waits: the GPU's hang)."""
    class Prepared:
        def __init__(self, signals):
            self.signals = signals

        def launch(self, stream, launch_index):
            launched.append(launch_index)
            BoundLaunch(k, FOLDED_PARTS, 0, launch_index, lambda r, n: arrays[n],
                        lambda r, n: self.signals[n].numpy()).run_alone()
    return Prepared


def _comm_signals(k):
    from tldsl.ir import NOTIFY_OPS
    return {op.operands[0].owner.name for p in k.parts if p.role == "comm" for op in p.walk()
            if op.name in NOTIFY_OPS}


def test_folded_launches_count_their_own_epochs_on_fresh_counters(staged_ag):
    k, arrays, want = staged_ag
    slots = {s.name: int(s.type.slots) for s in k.signals}
    comm = _comm_signals(k)
    assert comm and set(slots) - comm, "the program has an all-gather signal and a signal of its own"
    launched = []
    elsewhere = {n: torch.full((s,), 7, dtype=torch.int64) for n, s in slots.items()}   # another launch's
    folded = FoldedLaunches(_sim_prepared(k, arrays, launched), slots, satisfied=comm, device="cpu")
    assert all(folded.signals[n] is not elsewhere[n] for n in slots)
    for n, c in folded.signals.items():
        assert c.dtype == torch.int64 and c.shape == (slots[n],)
        assert (c == (SATISFIED if n in comm else 0)).all(), n
    for _ in range(3):
        folded.launch(stream=0)
    assert launched == [1, 2, 3]
    h = _bits_f32(arrays["h"])
    for row, ref in want.items():
        np.testing.assert_allclose(h[row], ref, rtol=2e-2, atol=2e-2)
    # a second benchmark row's folded kernel starts at epoch 1 again
    again = []
    FoldedLaunches(_sim_prepared(k, arrays, again), slots, satisfied=comm, device="cpu").launch(0)
    assert again == [1]


def test_an_epoch_nobody_notifies_deadlocks(staged_ag):
    """What the benchmark did before: the folded kernel's first launch at the epoch after the
    stream-ordered kernels' launch, on counters those kernels never advanced."""
    k, arrays, _ = staged_ag
    slots = {s.name: int(s.type.slots) for s in k.signals}
    comm = _comm_signals(k)
    counters = {n: torch.full((s,), SATISFIED if n in comm else 0, dtype=torch.int64) for n, s in slots.items()}
    with pytest.raises(DeadlockError, match="every task waits"):
        _sim_prepared(k, arrays, [])(counters).launch(0, 2)


def test_satisfied_signals_must_be_the_kernels():
    with pytest.raises(ValueError, match=r"satisfied signals \['nope'\]"):
        FoldedLaunches(lambda sig: None, {"rows_ready": 4}, satisfied={"nope"}, device="cpu")


@pytest.mark.parametrize("layer", ["ag", "rs"])
def test_folded_kernels_wait_with_tl_runs_timeout(layer):
    """A folded kernel the benchmark times traps on a wait no launch satisfies (tl.run's default
    timeout) instead of hanging the GPU."""
    from tldsl.codegen import lower
    row = moe._parse_row("mixtral:2048:random")
    if layer == "ag":
        _, _, ir, lowered = moe.lowered_row(row, stage_rows="on")
        lf = moe.folded_as_run_folds(ir, {p: lower(ir, p) for p in lowered})
    else:
        *_, lf, _ = moe.lowered_rs_row(row, fold=True)
    assert lf.side is not None
    assert f"-DTLDSL_WAIT_TIMEOUT_NS={moe.FOLDED_WAIT_TIMEOUT_NS}ull" in lf.options
