"""The benchmarks' folded launches (``tldsl/bench/folded.py``), on the CPU: a folded kernel's
waits count in its own epochs, on counters of its own. The kernels timed one after the other
run stream-ordered and notify nothing; a folded launch that counted its epochs from theirs
waited for an epoch nobody notifies — on the GPU a hang (``bench moe --layer ag --fold on``,
thirty-second session). Here the folded AllGather+MoE kernel, lowered as the benchmark lowers
it, gets its counters from :func:`folded_launches` as the benchmark's rows get theirs, and its
tile programs run in the simulator's rules (:class:`tldsl.runtime.sim.bound_launch.BoundLaunch`)
on them, launch after launch, every output checked after each."""
from __future__ import annotations

import numpy as np
import pytest

import tldsl as tl
from tldsl.bench import moe
from tldsl.bench.folded import SATISFIED, FoldedLaunches, comm_notified, folded_launches
from tldsl.errors import DeadlockError
from tldsl.ops.moe import moe_routing
from tldsl.runtime.sim.bound_launch import BoundLaunch

torch = pytest.importorskip("torch")

T, K, N, E, TOPK, BM = 64, 64, 64, 4, 2, 64
FOLDED_PARTS = ("gather_rows", "grouped_gemm")
BF16_NAN = 0x7FC0


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)


def _bits_f32(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)


@pytest.fixture
def staged_ag():
    """A small AllGather+MoE program with its rows staged (gather_rows, then the grouped GEMM),
    its folded kernel as the benchmark lowers it, its arrays (outputs and staged rows poisoned)
    and the reference of its output rows."""
    from tldsl.codegen import lower
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(T)]).astype(np.int32)
    rt = moe_routing(ids, E, 1, T, BM)
    k = rt.trace_allgather_moe(1, T, K, N, E, tl.bfloat16,
                               compute=tl.ComputeSchedule(tile=(BM, N, K), stages=2),
                               comm=tl.CommSchedule(tile_m=BM, mode="pull"), stage_rows=True)
    assert {p.name for p in k.parts if p.role == "compute"} == set(FOLDED_PARTS)
    lf = moe.folded_as_run_folds(k, {p: lower(k, p) for p in FOLDED_PARTS})
    x = _bits_f32(_bf16_bits(rng.standard_normal((T, K))))
    w = _bits_f32(_bf16_bits(rng.standard_normal((E, K, N)) / K ** 0.5))
    arrays = {"x_gathered": _bf16_bits(x), "w1": _bf16_bits(w),
              **{n: np.ascontiguousarray(a) for n, a in rt.allgather_tables().items()}}
    poisoned = [b.name for b in [*k.buffers, *k.workspaces] if b.name not in arrays]
    assert {"h", "x_sorted"} <= set(poisoned)
    for name in poisoned:
        b = next(b for b in [*k.buffers, *k.workspaces] if b.name == name)
        arrays[name] = np.full(tuple(b.type.shape), BF16_NAN, np.uint16)
    want = {int(rt.token_pos[j * T + t]): x[t] @ w[ids[t, j]] for t in range(T) for j in range(TOPK)}
    return k, lf, arrays, poisoned, want


def _sim_prepared(k, arrays, launched, seed=0):
    """``prepare(signals)``: each launch runs the folded parts' tile programs to the end in the
    simulator on ``arrays`` and those counters, the tasks in a seeded random order (a
    DeadlockError where every task waits: the GPU's hang)."""
    import random

    class Prepared:
        def __init__(self, signals):
            self.signals = signals

        def launch(self, stream, launch_index):
            launched.append(launch_index)
            BoundLaunch(k, FOLDED_PARTS, 0, launch_index, lambda r, n: arrays[n],
                        lambda r, n: self.signals[n].numpy(), random.Random(seed + launch_index)).run_alone()
    return Prepared


def _check_rows(arrays, want, launch):
    h = _bits_f32(arrays["h"])
    for row, ref in want.items():
        np.testing.assert_allclose(h[row], ref, rtol=2e-2, atol=2e-2, err_msg=f"launch {launch}, row {row}")


@pytest.mark.parametrize("seed", [0, 1])
def test_the_benchmarks_folded_launches_wait_for_their_own_gathers(staged_ag, seed):
    k, lf, arrays, poisoned, want = staged_ag
    comm = comm_notified(k)
    assert comm and set(lf.signal_slots) - comm, "the kernel waits on the all-gather and on its own gather"
    launched = []
    folded = folded_launches(k, lf, _sim_prepared(k, arrays, launched, seed), device="cpu")
    for n, c in folded.signals.items():
        assert c.dtype == torch.int64 and c.shape == (lf.signal_slots[n],)
        assert (c == (SATISFIED if n in comm else 0)).all(), n
    for launch in (1, 2, 3):
        for name in poisoned:           # each launch's GEMM must read rows its own gather staged
            arrays[name][...] = BF16_NAN
        folded.launch(stream=0)
        _check_rows(arrays, want, launch)
    assert launched == [1, 2, 3]
    # another row's folded kernel: its own counters, from epoch 1 again
    again = []
    other = folded_launches(k, lf, _sim_prepared(k, arrays, again, seed), device="cpu")
    assert all(other.signals[n] is not folded.signals[n] for n in lf.signal_slots)
    other.launch(0)
    assert again == [1]


def test_the_old_bookkeeping_deadlocks(staged_ag):
    """Documents what the benchmark did before (the simulator's semantics, not FoldedLaunches'):
    the folded kernel's first launch at epoch 2, the stream-ordered kernels' launch having
    counted one, on counters those kernels never advanced."""
    k, lf, arrays, _, _ = staged_ag
    comm = comm_notified(k)
    counters = {n: torch.full((s,), SATISFIED if n in comm else 0, dtype=torch.int64)
                for n, s in lf.signal_slots.items()}
    with pytest.raises(DeadlockError, match="every task waits"):
        _sim_prepared(k, arrays, [])(counters).launch(0, 2)


def test_satisfied_signals_must_be_the_kernels():
    with pytest.raises(ValueError, match=r"satisfied signals \['nope'\]"):
        FoldedLaunches(lambda sig: None, {"rows_ready": 4}, satisfied={"nope"}, device="cpu")


@pytest.mark.parametrize("layer", ["ag", "rs"])
def test_folded_kernels_wait_with_tl_runs_timeout(layer):
    """A folded kernel the benchmark times traps on a wait no launch satisfies (tl.run's default
    timeout) instead of hanging the GPU; MoE+ReduceScatter's notifies nothing the all-gather does."""
    from tldsl.codegen import lower
    row = moe._parse_row("mixtral:2048:random")
    if layer == "ag":
        _, _, ir, lowered = moe.lowered_row(row, stage_rows="on")
        lf = moe.folded_as_run_folds(ir, {p: lower(ir, p) for p in lowered})
        assert comm_notified(ir) == {"gather_x_ready"}
    else:
        *_, ir = moe.rs_program(row)
        *_, lf, _ = moe.lowered_rs_row(row, fold=True)
        assert comm_notified(ir) & set(lf.signal_slots) == set()
    assert lf.side is not None
    assert f"-DTLDSL_WAIT_TIMEOUT_NS={moe.FOLDED_WAIT_TIMEOUT_NS}ull" in lf.options
