"""The simulator at notebook speed, race detection on: the library's AllGather+GEMM at the sizes
people try first, and every library op at W = 64, each within a stated time.

Times are the CPU time of this process (``time.process_time``). That is not immune to a busy
machine: two cores shared with three other pytest workers, or with a neighbour on the same host,
cost the same run 1.3 s on one 2-core machine and 4.2-5.1 s on another (its BLAS products wait on
memory that the other jobs also use). So these tests are marked ``timed``: ``make test`` runs them
alone, after the rest of the suite, and a case counts its best of up to three runs (noise only
adds time; a lost speed-up is slow in every run). The bounds are what the issue asked for and
still below what the simulator takes without the loops run in bulk, the indexed race log or BLAS
kept on one thread, so a lost speed-up fails here. Where a machine is too slow for the issue's
seconds at all, the AllGather+GEMM cases hold the simulator to a multiple of the bare float32
tile products of the same case, timed on the same machine. Every run also checks its result
against numpy and that nothing was reported: fast and wrong would not pass.
"""
from __future__ import annotations

import time
import warnings

import numpy as np
import pytest

import tldsl as tl
from tldsl.bench.sim import make_inputs, tile_products_seconds
from tldsl.ops import OPS
from tldsl.testing import check_case


def _cpu_seconds(fn):
    """(result, CPU seconds, wall seconds) of ``fn()``."""
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.process_time() - c0, time.perf_counter() - t0


def _best_of(fn, bound_s, tries=3):
    """(result, CPU seconds, wall seconds) of the first of up to ``tries`` runs of ``fn()`` within
    ``bound_s`` of CPU, else of the fastest; with every run's CPU seconds, for the message."""
    runs = []
    for _ in range(tries):
        runs.append(_cpu_seconds(fn))
        if runs[-1][1] <= bound_s:
            break
    res, cpu, wall = min(runs, key=lambda r: r[1])
    return res, cpu, wall, [round(r[1], 1) for r in runs]


@pytest.mark.slow
@pytest.mark.timed
@pytest.mark.parametrize("M, tile, bound_s, ratio", [
    # the bound; an idle 2-core machine took ~1.3 s of CPU (2026-12-02), a slower one 3.7-6.4 s
    # (2026-12-04) with its bare tile products 2.5-2.7 s (1.8-2.4x); before the bulk loops, ~40 s;
    # with loops run op by op, ~10.5 s on the first machine, 15.4 s (6x its products) on the second
    (1024, 64, 4.0, 3.5),
    # ~5.5 s; before, ~140 s; op by op ~13.5 s; with threaded BLAS on a busy machine 100-160 s:
    # this bound (the target) guards the log and the BLAS threads, the case above the bulk
    # loops. The slower machine: 18.4 s, its tile products 11.9 s (1.55x)
    (4096, 128, 20.0, 3.0),
])
def test_allgather_gemm_w8_at_notebook_speed(M, tile, bound_s, ratio):
    """Within the issue's bound, or, on a machine too slow for it, within ``ratio`` times the bare
    tile products of the same case on the same machine (``tile_products_seconds``: the float32
    math no simulation can skip, timed right after the run). The same machine's speed swung by
    2-3x from minute to minute (BENCHMARKS.md, thirty-eighth session); the ratio moved far less
    (1.8-2.4x), and a lost speed-up moves it as much as it moves the seconds."""
    W, N, K = 8, 1024, 1024
    kernel, inputs = make_inputs("allgather_gemm", W, M, N, K)
    tries = []
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # no LongSimulationWarning at this size
            res, cpu, wall = _cpu_seconds(lambda: tl.simulate(
                kernel, W, inputs, compute=tl.ComputeSchedule(tile=(tile, tile, tile))))
        if cpu <= bound_s:
            break
        products = tile_products_seconds("allgather_gemm", W, M, N, K, tile)
        tries.append(f"{cpu:.1f} s of CPU ({wall:.1f} s wall), {cpu / products:.1f}x its tile products' {products:.1f} s")
        if cpu <= ratio * products:
            break
    else:
        pytest.fail(f"AllGather+GEMM W={W} M={M} N=K={K} tile {tile}: over {bound_s} s of CPU and over {ratio}x "
                    f"the bare tile products in each of three runs: {'; '.join(tries)}: the simulator lost its speed-up")
    a = np.concatenate([x["a"].astype(np.float32) for x in inputs])
    want = a @ inputs[0]["b"].astype(np.float32)
    for r in (0, W - 1):
        np.testing.assert_allclose(res[r]["c"].astype(np.float32), want, rtol=2e-2, atol=0.5)
    assert abs(res.expected_steps - res.steps) <= 0.1 * res.steps     # the up-front estimate


@pytest.mark.parametrize("op, K", [("allgather_gemm", 128), ("gemm_reduce_scatter", 256)])
def test_tile_products_are_the_simulations_own_products(op, K, monkeypatch):
    """The floor above is the math the simulation does: the same batched float32 products, as
    many, of the same shapes, as the simulator's bulk loops compute for the case (W=2,
    M=N=128, tile 64, two launches)."""
    from tldsl.runtime.sim import bulk_loop
    import tldsl.bench.sim as sim_bench
    W, M, N, tile = 2, 128, 128, 64
    simulated, floor = [], []
    real_dot, real_matmul = bulk_loop._BULK["dot"], np.matmul

    def sim_dot(op_, args, n):
        out = real_dot(op_, args, n)
        simulated.append((args[0][0].shape, args[1][0].shape, out.dtype))
        return out

    monkeypatch.setitem(bulk_loop._BULK, "dot", sim_dot)
    kernel, inputs = make_inputs(op, W, M, N, K)
    tl.simulate(kernel, W, inputs, compute=tl.ComputeSchedule(tile=(tile, tile, tile)))

    def floor_matmul(a, b, *args, **kw):
        out = real_matmul(a, b, *args, **kw)
        floor.append((a.shape, b.shape, out.dtype))
        return out

    monkeypatch.setattr(sim_bench.np, "matmul", floor_matmul)
    tile_products_seconds(op, W, M, N, K, tile)
    monkeypatch.undo()
    assert len(simulated) == 2 * W * (M // tile) * (N // tile)
    assert sorted(simulated) == sorted(floor)


# W = 64 for every op of the library: sizes per op (16x16x16 tiles), and the CPU seconds each
# may take (a quiet 2-core machine: 3-9 s each, tracing and the static checks included).
W64_CASES = {
    "allgather_gemm": (dict(rows_per_rank=16, n=16, k=32, comm=tl.CommSchedule(tile_m=16)), 40.0),
    "gemm_reduce_scatter": (dict(rows_per_rank=16, n=16, k_per_rank=32, comm=tl.CommSchedule(tile_m=16)), 40.0),
    "allgather_moe": (dict(rows_per_rank=4, k=16, n=16, num_experts=4, topk=2, comm=tl.CommSchedule(tile_m=16)), 40.0),
    "moe_reduce_scatter": (dict(rows_per_rank=4, k=16, n=16, num_experts=4, topk=2,
                                comm=tl.CommSchedule(tile_m=16)), 50.0),
    "sp_attention": (dict(seq_per_rank=16, heads=1, head_dim=16, causal=True, comm=tl.CommSchedule(tile_m=16)), 50.0),
}


def test_every_library_op_has_a_w64_case():
    assert set(W64_CASES) == set(OPS)


@pytest.mark.slow
@pytest.mark.timed
@pytest.mark.parametrize("name", sorted(W64_CASES))
def test_library_op_at_w64(name):
    W = 64
    params, bound_s = W64_CASES[name]
    spec = OPS[name]
    case = spec.make_case(np.random.default_rng(0), W, compute=tl.ComputeSchedule(tile=(16, 16, 16)), **params)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # W = 64 is below the long-run warning
        res, cpu, wall, runs = _best_of(lambda: check_case(spec, case, W, seed=0, label=f"{name} W={W}"), bound_s)
    assert cpu <= bound_s, f"{name} at W={W}: {cpu:.1f} s of CPU ({wall:.1f} s wall; runs {runs}), bound {bound_s} s"
    assert res.steps > 8 * W * W             # the run really is the W^2 one


@pytest.mark.parametrize("op", ["allgather_gemm", "gemm_reduce_scatter"])
def test_sim_benchmark_prints_its_phases(op, capsys):
    """`python -m tldsl.bench sim`: the figures above come from it."""
    from tldsl.bench import main
    assert main(["sim", "--op", op, "-W", "2", "-M", "64", "-N", "32", "-K", "64", "--tile", "16",
                 "--repeats", "2", "--profile"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"# sim {op}: W=2 M=64 N=32 K=64, tile 16x16x16, ")
    assert "load " in out.splitlines()[0]
    for phase in ("trace ", "static checks ", "simulate ", "  without detectors ", "CPU seconds ", "total ",
                  "profile (cProfile"):
        assert any(line.startswith(phase) for line in out.splitlines()), (phase, out)
    assert "median of 2:" in out and "scheduler steps (estimated" in out and "runtime/sim/" in out


@pytest.mark.parametrize("debugging", [False, True])
def test_a_benchmark_run_while_debugging_hangs_says_its_times_do_not_compare(debugging, capsys, monkeypatch):
    """TLDSL_WAIT_TIMEOUT_NS builds every timed kernel with the slot report, which slows it: any
    benchmark run with it set says so on stderr."""
    from tldsl.bench import main
    if debugging:
        monkeypatch.setenv("TLDSL_WAIT_TIMEOUT_NS", "1000000000")
    assert main(["sim", "--op", "allgather_gemm", "-W", "2", "-M", "64", "-N", "32", "-K", "64", "--tile", "16",
                 "--repeats", "1"]) == 0
    assert ("this run's times are not comparable" in capsys.readouterr().err) == debugging
