"""Tile programs several test files run (one definition, imported where needed)."""
from __future__ import annotations

import tldsl as tl


@tl.kernel
def scale_rows(x, y, *, compute: tl.ComputeSchedule = None):
    """``y = 2 x + 1`` tile by tile: elementwise, no loop, tiles that need not divide the tensor."""
    M, N = x.shape
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        t = tl.load(x, (pm * BM, pn * BN), (BM, BN))
        tl.store(y, (pm * BM, pn * BN), t * 2.0 + 1.0)


@tl.kernel
def outer_sums(u, v, y, *, compute: tl.ComputeSchedule = None):
    """``y = u.T @ v`` as a sum of outer products of rows, accumulated element by element in a
    fragment over a ``tl.range`` loop: at tile (256, 256, *) the f32 fragment alone (256 KB) is
    more than a CTA's shared memory."""
    K, M = u.shape
    N = v.shape[1]
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, 1):
            a = tl.load(u, (k, pm * BM), (1, BM)).to(tl.float32)
            b = tl.load(v, (k, pn * BN), (1, BN)).to(tl.float32)
            acc += tl.trans(a) * b
        tl.store(y, (pm * BM, pn * BN), acc.read())


@tl.kernel
def whole_row_softmax(x, y, *, compute: tl.ComputeSchedule = None):
    """A softmax over whole rows in one task holding the whole tensor: over a CTA's shared memory
    at any useful size (a 1024 x 5000 f32 tile is 20 MB), so its tiles live in the global scratch
    (the schedule's tile is not used)."""
    M, N = x.shape

    @tl.compute_part(grid=(1,))
    def part(p):
        t = tl.load(x, (0, 0), (M, N))
        e = tl.exp(t - tl.expand_dims(tl.max(t, 1), 1))
        tl.store(y, (0, 0), e / tl.expand_dims(tl.sum(e, 1), 1))


@tl.kernel
def one_task_outer_product(a, b, y):
    """``y += a @ b`` for the whole of y in one task: a 4096 x 4096 accumulator (64 MB, in the
    global scratch) and a dot whose WGMMA staging would not fit shared memory even 16 deep in K."""
    M, K = a.shape
    N = b.shape[1]

    @tl.compute_part(grid=(1,))
    def part(p):
        acc = tl.fragment((M, N), tl.float32)
        acc += tl.dot(tl.load(a, (0, 0), (M, K)), tl.load(b, (0, 0), (K, N)))
        tl.store(y, (0, 0), acc)

