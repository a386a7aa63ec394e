import numpy as np

import tldsl as tl
from tldsl.ops.allgather_gemm import allgather_gemm, reference


def test_demo_runs():
    from tldsl.demo import main
    assert main(["--world-size", "2", "--rows-per-rank", "12"]) == 0


def test_allgather_gemm_matches_numpy():
    W, Ms, K, N = 3, 7, 20, 24
    rng = np.random.default_rng(1)
    shards = [rng.standard_normal((Ms, K)).astype(np.float16) for _ in range(W)]
    b = rng.standard_normal((K, N)).astype(np.float16)
    inputs = [{"a": s, "b": b, "c": np.full((W * Ms, N), np.nan, np.float16)} for s in shards]
    res = tl.simulate(allgather_gemm, W, inputs, seed=3, compute=tl.ComputeSchedule(tile=(8, 16, 8)),
                      comm=tl.CommSchedule(tile_m=8))
    for r in range(W):
        np.testing.assert_allclose(res[r]["c"].astype(np.float32), reference(shards, b), rtol=1e-2, atol=3e-2)
