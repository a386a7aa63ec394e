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



@tl.kernel
def c_name_clashes(x, y):
    """Tensors and signals whose names differ only in characters a C identifier cannot hold
    ("x-y", "x_y"; "s-1", "s_1"), or that read as another's table of peers' pointers ("g_peers"
    beside symmetric g, "r_peers" beside symmetric r): each needs a kernel parameter of its own.
    ``y[p] = g[p] + g_peers[p] + 3 x`` (rank p's x, pushed twice) plus this rank's 3 x."""
    W = tl.world_size()
    (N,) = x.shape
    w1 = tl.local_buffer((N,), tl.float32, "x-y")
    w2 = tl.local_buffer((N,), tl.float32, "x_y")
    g = tl.symmetric_buffer((W * N,), tl.float32, "g")
    gp = tl.symmetric_buffer((W * N,), tl.float32, "g_peers")
    s1, s2 = tl.signal("s-1", 1), tl.signal("s_1", 1)
    r = tl.signal("r", W, scope="symmetric")
    rp = tl.signal("r_peers", W, scope="symmetric")

    @tl.comm_part(grid=(W,))
    def send(p):
        tl.tile_push_data(g.at(p), (tl.rank() * N,), x, (0,), (N,))
        tl.peer_tile_notify(r, tl.rank(), p)
        tl.tile_push_data(gp.at(p), (tl.rank() * N,), x, (0,), (N,))
        tl.peer_tile_notify(rp, tl.rank(), p)

    @tl.compute_part(grid=(1,))
    def produce(i):
        t = tl.load(x, (0,), (N,))
        tl.store(w1, (0,), t)
        tl.producer_tile_notify(s1, 0)
        tl.store(w2, (0,), t * 2.0)
        tl.producer_tile_notify(s2, 0)

    @tl.compute_part(grid=(W,))
    def consume(p):
        tl.consumer_tile_wait(s1, 0)
        tl.consumer_tile_wait(s2, 0)
        tl.peer_tile_wait(r, p)
        tl.peer_tile_wait(rp, p)
        got = tl.load(g, (p * N,), (N,)) + tl.load(gp, (p * N,), (N,))
        tl.store(y, (p * N,), got + tl.load(w1, (0,), (N,)) + tl.load(w2, (0,), (N,)))


@tl.kernel
def weighted_scatter(x, idx, w, y, *, compute: tl.ComputeSchedule = None):
    """``y[idx[r]] += w[r] * x[r]`` for every row r of x, tile by tile (``tl.add_rows``: ids below 0
    skipped; rows repeat within a tile and across tiles, so adds land in no fixed order)."""
    M, N = x.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        rows = tl.where(tl.iota(BM) + pm * BM < M, tl.load(idx, (pm * BM,), (BM,)), -1)
        t = tl.load(x, (pm * BM, pn * BN), (BM, BN)).to(tl.float32) * tl.load(w, (pm * BM,), (BM,))[:, None]
        tl.add_rows(y, rows, pn * BN, t)
