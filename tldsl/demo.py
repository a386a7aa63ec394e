"""The main demo: AllGather+GEMM on 4 simulated ranks — the IR, the check against numpy,
and a per-rank timeline. Run with ``python -m tldsl.demo``.

Its sizes are bounded (a usage error past them): at most 64 ranks, 1024 rows per rank, N and K,
and 2**24 elements of gathered A and of C on all ranks together (each rank holds W * rows of each),
so that a mistyped number is refused at once rather than spinning or running out of memory."""
from __future__ import annotations

import argparse

import numpy as np

import tldsl as tl
from tldsl.ops.allgather_gemm import allgather_gemm, reference
from .cli.arg_types import nonnegative_int, positive_int_at_most

MAX_WORLD_SIZE = 64
MAX_SIZE = 1024             # rows per rank, N, K
MAX_ELEMENTS = 2 ** 24      # W * W * rows * max(N, K): gathered A and C on all ranks together


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = positive_int_at_most(MAX_SIZE)
    ap.add_argument("--world-size", type=positive_int_at_most(MAX_WORLD_SIZE), default=4,
                    help=f"simulated ranks, 1 to {MAX_WORLD_SIZE}")
    ap.add_argument("--rows-per-rank", type=size, default=40,
                    help=f"M per rank, 1 to {MAX_SIZE} (need not divide the tile)")
    ap.add_argument("-n", type=size, default=48, help=f"1 to {MAX_SIZE}")
    ap.add_argument("-k", type=size, default=64, help=f"1 to {MAX_SIZE}")
    ap.add_argument("--seed", type=nonnegative_int, default=0)
    ap.add_argument("--mode", choices=("pull", "push"), default="pull")
    ap.add_argument("--engine", choices=("sm", "copy_engine"), default="sm")
    args = ap.parse_args(argv)

    W, Ms, N, K = args.world_size, args.rows_per_rank, args.n, args.k
    _check_total(ap, W, Ms, N, K)
    rng = np.random.default_rng(args.seed)
    shards = [rng.standard_normal((Ms, K)).astype(np.float16) for _ in range(W)]
    b = rng.standard_normal((K, N)).astype(np.float16)
    compute = tl.ComputeSchedule(tile=(32, 32, 32), order="comm_aligned")
    comm = tl.CommSchedule(tile_m=None if args.engine == "copy_engine" else 16,
                           mode=args.mode, engine=args.engine)
    inputs = [{"a": shards[r], "b": b, "c": np.full((W * Ms, N), np.nan, np.float16)} for r in range(W)]

    result = tl.simulate(allgather_gemm, W, inputs, seed=args.seed, compute=compute, comm=comm)
    print(result.kernel)
    print()
    ref = reference(shards, b)
    worst = 0.0
    for r in range(W):
        err = float(np.max(np.abs(result[r]["c"].astype(np.float32) - ref)))
        worst = max(worst, err)
        ok = np.allclose(result[r]["c"].astype(np.float32), ref, rtol=1e-2, atol=5e-2)
        print(f"rank {r}: C [{W * Ms}x{N}] vs numpy all_gather(A) @ B: max |err| = {err:.2e}  "
              f"{'OK' if ok else 'MISMATCH'}")
    print()
    print(result.timeline())
    good = worst <= 5e-2 + 1e-2 * float(np.max(np.abs(ref)))
    print(f"\n{'PASS' if good else 'FAIL'}: {result.launches} launches, {result.steps} scheduler steps, "
          "no races, no deadlocks, no stale signals")
    return 0 if good else 1


def _check_total(ap: argparse.ArgumentParser, W: int, Ms: int, N: int, K: int) -> None:
    """Each of the W ranks holds the gathered A (W*Ms x K) and C (W*Ms x N): sizes each within its
    bound can still make W**2 times too much for a demo; a usage error says which numbers to lower."""
    total = W * W * Ms * max(N, K)
    if total > MAX_ELEMENTS:
        ap.error(f"--world-size {W}, --rows-per-rank {Ms}, -n {N} and -k {K} make {total} elements of "
                 f"gathered A or C on all ranks together (W * W * rows * max(N, K)); the demo allows at "
                 f"most 2**24 = {MAX_ELEMENTS}: make one of them smaller")


if __name__ == "__main__":
    raise SystemExit(main())
