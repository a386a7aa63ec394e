"""Plain tile programs the general lowering runs (no recipe matches them): the memory-bound
operations and the gated GEMM that ``python -m tldsl.bench general`` times beside torch. Written
as a user would write them in a notebook; each is checked against numpy in the tests."""
from __future__ import annotations

import tldsl as tl


@tl.kernel
def scale_shift(x, y, *, compute: tl.ComputeSchedule = None):
    """y = 2 x + 1, tile by tile."""
    M, N = x.shape
    BM, BN, _ = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        t = tl.load(x, (pm * BM, pn * BN), (BM, BN))
        tl.store(y, (pm * BM, pn * BN), t * 2.0 + 1.0)


#: the row programs' default ``whole_row``: rows of at most this many elements are loaded whole
#: (one read of ``x`` from memory, held in registers for every reduction and the output), longer
#: rows go by column tiles, reading ``x`` twice
WHOLE_ROW = 16384


@tl.kernel
def row_softmax(x, y, *, compute: tl.ComputeSchedule = None, rows: int = 1,
                whole_row: int = WHOLE_ROW):
    """softmax over each row. ``rows`` rows a task; a row up to ``whole_row`` elements in one
    tile, longer ones as an online max and sum over column tiles, then a second pass that writes
    the normalised tiles. Normalised by the reciprocal of the row's sum: one division a row and
    a multiplication an element (as torch's kernels do), not a division an element."""
    M, N = x.shape
    BM, BN, _ = compute.tile
    R = rows if N <= whole_row else BM

    @tl.compute_part(grid=(tl.cdiv(M, R),))
    def part(pm):
        r0 = pm * R
        if N <= whole_row:
            t = tl.cast(tl.load(x, (r0, 0), (R, N)), tl.float32)
            e = tl.exp(t - tl.expand_dims(tl.max(t, 1), 1))
            tl.store(y, (r0, 0), tl.cast(e * tl.expand_dims(1.0 / tl.sum(e, 1), 1), y.dtype))
            return
        m = tl.fragment((R,), tl.float32, fill=-1e30)
        s = tl.fragment((R,), tl.float32, fill=0.0)
        for c in tl.range(0, N, BN):
            cols = tl.iota(BN) + c
            t = tl.cast(tl.load(x, (r0, c), (R, BN)), tl.float32)
            t = tl.where(tl.broadcast_to(tl.expand_dims(cols < N, 0), (R, BN)), t, -1e30)
            m_old = m.read()
            m_new = tl.maximum(m_old, tl.max(t, 1))
            s.write(s.read() * tl.exp(m_old - m_new) + tl.sum(tl.exp(t - tl.expand_dims(m_new, 1)), 1))
            m.write(m_new)
        inv = tl.expand_dims(1.0 / s.read(), 1)
        for c in tl.range(0, N, BN):
            t = tl.cast(tl.load(x, (r0, c), (R, BN)), tl.float32)
            p = tl.exp(t - tl.expand_dims(m.read(), 1)) * inv
            tl.store(y, (r0, c), tl.cast(p, y.dtype))


@tl.kernel
def rms_norm(x, w, y, *, compute: tl.ComputeSchedule = None, rows: int = 1,
             whole_row: int = WHOLE_ROW):
    """y = x / sqrt(mean(x^2) + 1e-6) * w per row. ``rows`` rows a task; a row up to
    ``whole_row`` elements in one tile, longer ones in two passes over column tiles (the sum
    of squares, then the output)."""
    M, N = x.shape
    BM, BN, _ = compute.tile
    R = rows if N <= whole_row else BM

    @tl.compute_part(grid=(tl.cdiv(M, R),))
    def part(pm):
        r0 = pm * R
        if N <= whole_row:
            t = tl.cast(tl.load(x, (r0, 0), (R, N)), tl.float32)
            inv = tl.expand_dims(tl.rsqrt(tl.sum(t * t, 1) / N + 1e-6), 1)
            g = tl.cast(tl.load(w, (0, 0), (1, N)), tl.float32)
            tl.store(y, (r0, 0), tl.cast(t * inv * g, y.dtype))
            return
        ss = tl.fragment((R,), tl.float32, fill=0.0)
        for c in tl.range(0, N, BN):
            t = tl.cast(tl.load(x, (r0, c), (R, BN)), tl.float32)
            ss.write(ss.read() + tl.sum(t * t, 1))
        inv = tl.expand_dims(tl.rsqrt(ss.read() / N + 1e-6), 1)
        for c in tl.range(0, N, BN):
            t = tl.cast(tl.load(x, (r0, c), (R, BN)), tl.float32)
            g = tl.cast(tl.load(w, (0, c), (1, BN)), tl.float32)
            tl.store(y, (r0, c), tl.cast(t * inv * g, y.dtype))


@tl.kernel
def add_rms_norm(x, r, w, h, y, *, compute: tl.ComputeSchedule = None, rows: int = 1,
                 whole_row: int = WHOLE_ROW):
    """h = x + r (the residual stream), y = rms_norm(h) * w; ``rows`` rows a task, whole rows up
    to ``whole_row`` elements (else two passes, the second reading ``h`` back)."""
    M, N = x.shape
    BM, BN, _ = compute.tile
    R = rows if N <= whole_row else BM

    @tl.compute_part(grid=(tl.cdiv(M, R),))
    def part(pm):
        r0 = pm * R
        if N <= whole_row:
            t = tl.load(x, (r0, 0), (R, N)) + tl.load(r, (r0, 0), (R, N))
            tl.store(h, (r0, 0), t)
            f = tl.cast(t, tl.float32)
            inv = tl.expand_dims(tl.rsqrt(tl.sum(f * f, 1) / N + 1e-6), 1)
            g = tl.cast(tl.load(w, (0, 0), (1, N)), tl.float32)
            tl.store(y, (r0, 0), tl.cast(f * inv * g, y.dtype))
            return
        ss = tl.fragment((R,), tl.float32, fill=0.0)
        for c in tl.range(0, N, BN):
            t = tl.load(x, (r0, c), (R, BN)) + tl.load(r, (r0, c), (R, BN))
            tl.store(h, (r0, c), t)
            f = tl.cast(t, tl.float32)
            ss.write(ss.read() + tl.sum(f * f, 1))
        inv = tl.expand_dims(tl.rsqrt(ss.read() / N + 1e-6), 1)
        for c in tl.range(0, N, BN):
            f = tl.cast(tl.load(h, (r0, c), (R, BN)), tl.float32)
            g = tl.cast(tl.load(w, (0, c), (1, BN)), tl.float32)
            tl.store(y, (r0, c), tl.cast(f * inv * g, y.dtype))


@tl.kernel
def gated_gemm(a, b, bias, c, out, *, compute: tl.ComputeSchedule = None):
    """out = relu(a @ b + bias) * (a @ c): two dots in one K loop and an epilogue no recipe takes."""
    M, K = a.shape
    N = b.shape[1]
    BM, BN, BK = compute.tile

    @tl.compute_part(grid=(tl.cdiv(M, BM), tl.cdiv(N, BN)))
    def part(pm, pn):
        r0, c0 = pm * BM, pn * BN
        acc1 = tl.fragment((BM, BN), tl.float32)
        acc2 = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, K, BK):
            ta = tl.load(a, (r0, k), (BM, BK))
            acc1 += tl.dot(ta, tl.load(b, (k, c0), (BK, BN)))
            acc2 += tl.dot(ta, tl.load(c, (k, c0), (BK, BN)))
        g = tl.cast(tl.load(bias, (0, c0), (1, BN)), tl.float32)
        v = tl.maximum(acc1.read() + g, 0.0) * acc2.read()
        tl.store(out, (r0, c0), tl.cast(v, out.dtype))
