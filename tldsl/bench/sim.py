"""The CPU simulator's speed on a library op, race detection on (no GPU needed).

    python -m tldsl.bench sim [--op allgather_gemm] [-W 8] [-M 1024] [-N 1024] [-K 1024] [--tile 64]
                              [--repeats 3] [--profile]

M, N, K are the global sizes: AllGather+GEMM gathers [M/W, K] shards and multiplies by a
[K, N] B on every rank; GEMM+ReduceScatter multiplies [M, K/W] by [K/W, N] on every rank and
reduce-scatters the [M, N] sum. Inputs are float16. Printed, with the load average beside the
figures (the machine is often shared): the phases — tracing, the static channel analysis,
the simulation (median of ``--repeats``, every repeat listed) with its scheduler steps — and
what the simulation costs without the race and uninitialised-read detectors, so their share
shows, and beside them the bare tile products (:func:`tile_products_seconds`): the numpy math
no simulation of the case can skip, so the simulator's own cost is the rest, a ratio that
holds on a slow machine as on a fast one. ``--profile`` adds where the simulation's time went,
by module (cProfile, one run).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import time

import numpy as np

from ..cli.arg_types import positive_int

OPS = ("allgather_gemm", "gemm_reduce_scatter")


def make_inputs(op: str, W: int, M: int, N: int, K: int, seed: int = 0):
    """(kernel, per-rank inputs) for the op at global sizes M, N, K."""
    rng = np.random.default_rng(seed)
    f16 = np.float16
    if op == "allgather_gemm":
        from tldsl.ops.allgather_gemm import allgather_gemm as kernel
        b = rng.standard_normal((K, N)).astype(f16)
        inputs = [{"a": rng.standard_normal((M // W, K)).astype(f16), "b": b,
                   "c": np.full((M, N), np.nan, f16)} for _ in range(W)]
    else:
        from tldsl.ops.gemm_reduce_scatter import gemm_reduce_scatter as kernel
        inputs = [{"a": rng.standard_normal((M, K // W)).astype(f16), "b": rng.standard_normal((K // W, N)).astype(f16),
                   "out": np.full((M // W, N), np.nan, f16)} for _ in range(W)]
    return kernel, inputs


def tile_products_seconds(op: str, W: int, M: int, N: int, K: int, tile: int, launches: int = 2,
                          seed: int = 0, clock=time.process_time) -> float:
    """Seconds (of ``clock``: CPU by default) of the float32 tile products that simulating the op
    at these sizes computes, done straight in numpy: each rank's operands as float32 stacks of
    ``tile``-square tiles (made again every launch), then for every C tile, rank by rank, one
    batched product over the K tiles summed in float32 — what the simulator's bulk loops compute,
    on one BLAS thread, without the scheduler, the memory model or the detectors around it."""
    from tldsl.runtime.sim.blas_threads import one_blas_thread
    rng = np.random.default_rng(seed)
    k_rank = K if op == "allgather_gemm" else K // W
    kt = -(-k_rank // tile)
    a = [rng.standard_normal((M, kt * tile)).astype(np.float16) for _ in range(W)]
    b = [rng.standard_normal((kt * tile, N)).astype(np.float16) for _ in range(W)]
    mt, nt = -(-M // tile), -(-N // tile)
    c0 = clock()
    with one_blas_thread():
        for _ in range(launches):
            a_stacks = [[np.ascontiguousarray(x[i * tile:(i + 1) * tile].reshape(-1, kt, tile).swapaxes(0, 1),
                                              np.float32) for i in range(mt)] for x in a]
            b_stacks = [[np.ascontiguousarray(x[:, j * tile:(j + 1) * tile].reshape(kt, tile, -1), np.float32)
                         for j in range(nt)] for x in b]
            for i in range(mt):
                for j in range(nt):
                    for r in range(W):
                        products = np.matmul(a_stacks[r][i], b_stacks[r][j])
                        acc = np.zeros(products.shape[1:], np.float32)
                        for q in range(kt):
                            np.add(acc, products[q], out=acc)
    return clock() - c0


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} (5 min {five:.2f}), {os.cpu_count()} CPUs"


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_sim(op, W, M, N, K, tile, comm, repeats, launches, profile=False, out=None) -> dict:
    """Time the phases; print them to ``out`` (stdout) and return them."""
    import tldsl as tl
    if M % W or (op == "gemm_reduce_scatter" and K % W):
        raise SystemExit(f"W={W} must divide M={M}" + (f" and K={K}" if op == "gemm_reduce_scatter" else ""))
    kernel, inputs = make_inputs(op, W, M, N, K)
    kwargs = {"compute": tl.ComputeSchedule(tile=(tile, tile, tile)), "comm": comm}
    specs = [inputs[0][a] for a in kernel.arg_names]
    print(f"# sim {op}: W={W} M={M} N={N} K={K}, tile {tile}x{tile}x{tile}, {comm}, {launches} launches; {_load()}",
          file=out, flush=True)
    t_trace = _seconds(lambda: kernel.trace_checked(W, specs, kwargs, channels=False))
    t_checks = _seconds(lambda: kernel.trace_checked(W, specs, kwargs, channels=True))
    ir = kernel.trace_checked(W, specs, kwargs, channels=True)
    full = tl.SimOptions(launches=launches, static_checks=False, warn_steps=None)
    bare = tl.SimOptions(launches=launches, static_checks=False, warn_steps=None,
                         check_races=False, check_uninitialized=False)
    runs, cpu_runs, bare_runs, result = [], [], [], None
    for _ in range(repeats):                  # interleaved, so load changes fall on both alike
        t0, c0 = time.perf_counter(), time.process_time()
        result = tl.simulate(ir, W, inputs, options=full)
        runs.append(time.perf_counter() - t0)
        cpu_runs.append(time.process_time() - c0)
        bare_runs.append(_seconds(lambda: tl.simulate(ir, W, inputs, options=bare)))
    sim, sim_bare, sim_cpu = statistics.median(runs), statistics.median(bare_runs), statistics.median(cpu_runs)
    products = tile_products_seconds(op, W, M, N, K, tile, launches, clock=time.perf_counter)
    products_cpu = tile_products_seconds(op, W, M, N, K, tile, launches)
    tasks = sum(p.num_tasks for p in ir.parts) * W
    print(f"trace              {t_trace:7.3f} s", file=out)
    print(f"static checks      {t_checks:7.3f} s   (channel analysis, once per traced kernel)", file=out)
    print(f"simulate           {sim:7.2f} s   median of {repeats}: {' '.join(f'{t:.2f}' for t in runs)}; "
          f"{result.steps:,} scheduler steps (estimated {result.expected_steps:,}), {tasks:,} tasks per launch",
          file=out)
    print(f"  without detectors {sim_bare:6.2f} s   median of {repeats}: {' '.join(f'{t:.2f}' for t in bare_runs)} "
          f"-> races + uninitialised reads cost {sim - sim_bare:.2f} s", file=out)
    print(f"  tile products     {products:6.2f} s   (the float32 tile math alone, in numpy) "
          f"-> the simulation takes {sim / products:.1f}x that", file=out)
    print(f"CPU seconds        {sim_cpu:7.2f} s   simulate, median of {repeats}: "
          f"{' '.join(f'{t:.2f}' for t in cpu_runs)}; tile products {products_cpu:.2f} s -> "
          f"{sim_cpu / max(products_cpu, 1e-9):.1f}x (what the timed tests bound; wall seconds above)", file=out)
    print(f"total              {t_trace + t_checks + sim:7.2f} s   (trace + checks + simulate); {_load()}",
          file=out, flush=True)
    row = {"op": op, "W": W, "M": M, "N": N, "K": K, "tile": tile, "trace_s": t_trace, "checks_s": t_checks,
           "simulate_s": sim, "simulate_runs_s": runs, "simulate_cpu_s": sim_cpu,
           "tile_products_cpu_s": products_cpu, "without_detectors_s": sim_bare, "steps": result.steps,
           "expected_steps": result.expected_steps, "tile_products_s": products}
    if profile:
        _profile(ir, W, inputs, full, out)
    return row


def _profile(ir, W, inputs, options, out, top: int = 12):
    """One simulation under cProfile: own time by module, then the costliest functions."""
    import tldsl as tl
    prof = cProfile.Profile()
    prof.enable()
    tl.simulate(ir, W, inputs, options=options)
    prof.disable()
    stats = pstats.Stats(prof)
    by_module: dict[str, float] = {}
    rows = []
    for (path, line, name), (_, _, tottime, _, _) in stats.stats.items():
        module = _module(path)
        by_module[module] = by_module.get(module, 0.0) + tottime
        rows.append((tottime, f"{module}:{line}({name})"))
    total = sum(by_module.values()) or 1.0
    print(f"profile (cProfile, one run, {total:.2f} s with its overhead): own time by module", file=out)
    for module, t in sorted(by_module.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {100 * t / total:5.1f}%  {module}", file=out)
    print("  costliest functions (own time):", file=out)
    for t, where in sorted(rows, reverse=True)[:top]:
        print(f"  {100 * t / total:5.1f}%  {where}", file=out)


def _module(path: str) -> str:
    for marker in ("runtime/sim/", "ir/", "tldsl/"):
        if marker in path:
            return marker + path.split(marker, 1)[1]
    if "numpy" in path:
        return "numpy"
    return "builtins" if path == "~" else os.path.basename(path)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m tldsl.bench sim", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--op", choices=OPS, default="allgather_gemm")
    ap.add_argument("-W", "--world-size", type=positive_int, default=8)
    ap.add_argument("-M", type=positive_int, default=1024, help="global rows")
    ap.add_argument("-N", type=positive_int, default=1024)
    ap.add_argument("-K", type=positive_int, default=1024)
    ap.add_argument("--tile", type=positive_int, default=64, help="the compute tile, BM = BN = BK")
    ap.add_argument("--mode", choices=("pull", "push"), default="pull", help="communication mode")
    ap.add_argument("--engine", choices=("sm", "copy_engine"), default="sm", help="communication engine")
    ap.add_argument("--comm-tile-m", type=positive_int, default=None, help="rows per communication tile (default: whole shards)")
    ap.add_argument("--launches", type=positive_int, default=2)
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--profile", action="store_true", help="also profile one simulation (cProfile)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    import tldsl as tl
    args = parse_args(argv)
    comm = tl.CommSchedule(tile_m=args.comm_tile_m, mode=args.mode, engine=args.engine)
    bench_sim(args.op, args.world_size, args.M, args.N, args.K, args.tile, comm, args.repeats, args.launches,
              profile=args.profile)
    return 0
