"""AllGather + GEMM: ``C = all_gather(A_shard, dim=0) @ B`` on every rank (tensor-parallel
MLP input). The compute part waits per tile for exactly the rows it needs, so the GEMM
starts on the local shard while peers' shards are still arriving."""
from __future__ import annotations

import numpy as np

import tldsl as tl
from tldsl.collectives import all_gather


@tl.kernel
def allgather_gemm(a: tl.Symmetric, b, c, *, compute: tl.ComputeSchedule = None,
                   comm: tl.CommSchedule = None):
    """a: [Ms, K] shard (symmetric); b: [K, N]; c: [W*Ms, N] = all_gather(a) @ b."""
    W = tl.world_size()
    Ms, K = a.shape
    Kb, N = b.shape
    tl.static_assert(K == Kb, f"allgather_gemm: A shard is [{Ms}, {K}] but B is [{Kb}, {N}]")
    tl.static_assert(tuple(c.shape) == (W * Ms, N), f"allgather_gemm: C must be [{W * Ms}, {N}], got {list(c.shape)}")
    M = W * Ms
    BM, BN, BK = compute.tile

    a_full = tl.symmetric_buffer((M, K), a.dtype, "a_gathered")
    gathered = all_gather(a, a_full, comm, name="gather_a")

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)), align_shift=0)
    def gemm(pm, pn):
        r0, c0 = pm * BM, pn * BN
        gathered.wait_rows(r0, tl.minimum(r0 + BM, M))
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a_full, (r0, k), (BM, BK)), tl.load(b, (k, c0), (BK, BN)))
        tl.store(c, (r0, c0), acc)


def reference(a_shards, b):
    """numpy: every rank's output of all_gather(A) @ B (fp32 accumulation)."""
    a = np.concatenate([np.asarray(x, np.float32) for x in a_shards], axis=0)
    return a @ np.asarray(b, np.float32)
