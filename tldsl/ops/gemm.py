"""A plain tile-program GEMM, ``C = A @ B`` on one GPU: the compute part every fused op builds on,
and the kernel the code generator's speed is measured with."""
from __future__ import annotations

import tldsl as tl


@tl.kernel
def gemm(a, b, c, *, compute: tl.ComputeSchedule = None):
    """a: [M, K]; b: [K, N]; c: [M, N] (fp32 accumulation, converted on store)."""
    M, K = a.shape
    Kb, N = b.shape
    tl.static_assert(K == Kb, f"gemm: A is [{M}, {K}] but B is [{Kb}, {N}]")
    tl.static_assert(tuple(c.shape) == (M, N), f"gemm: C must be [{M}, {N}], got {list(c.shape)}")
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def tile(pm, pn):
        r0, c0 = pm * BM, pn * BN
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(a, (r0, k), (BM, BK)), tl.load(b, (k, c0), (BK, BN)))
        tl.store(c, (r0, c0), acc)


@tl.kernel
def linear(x, w, y, *, compute: tl.ComputeSchedule = None):
    """x: [M, K]; w: [N, K], a torch ``Linear``'s weight as it is stored; y: [M, N] = x @ w.T. The
    transposed tile is only a layout: the GEMM recipe reads B K-major, as it reads A."""
    M, K = x.shape
    N, Kw = w.shape
    tl.static_assert(K == Kw, f"linear: x is [{M}, {K}] but w is [{N}, {Kw}] (w is [N, K])")
    tl.static_assert(tuple(y.shape) == (M, N), f"linear: y must be [{M}, {N}], got {list(y.shape)}")
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def tile(pm, pn):
        r0, c0 = pm * BM, pn * BN
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            acc += tl.dot(tl.load(x, (r0, k), (BM, BK)), tl.trans(tl.load(w, (c0, k), (BN, BK))))
        tl.store(y, (r0, c0), acc)
