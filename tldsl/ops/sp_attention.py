"""Sequence-parallel attention: the sequence is sharded across ranks; every rank all-gathers
K and V and runs flash attention for its own queries over the whole sequence.

Layout (per rank ``r`` of ``W``; ``Sl`` rows per rank, ``H`` heads of ``D`` columns)::

    q [Sl, H*D]   local queries, global positions r*Sl .. r*Sl+Sl-1
    k [Sl, H*D]   symmetric shard of the keys   (global rows r*Sl ..)
    v [Sl, H*D]   symmetric shard of the values
    o [Sl, H*D]   output: softmax(q k_all^T * scale [+ causal mask]) v_all, per head

Communication: two ``all_gather`` collectives (K and V) into symmetric workspaces of
``[W*Sl, H*D]``; push/pull, ring/full-mesh, SMs/copy engine and the communication tile size
are all choices of the communication schedule.

Compute: one task per (query block of ``BM`` rows, head). It walks the key blocks of ``BN``
rows shard by shard, starting with its own rank's shard and then ``rank+1, rank+2, ...``
(the order in which ring communication delivers them), and waits *per key block* for just
the K/V rows that block reads, so attention over the local shard starts before any peer's
K/V has arrived. A key block never crosses a shard boundary: its rows are gathered with
``tl.load_rows`` and rows past the shard end read as zero and are masked out. The softmax is
online (running max ``m``, running sum ``l``, accumulator ``acc``, all fp32). With
``causal=True`` a shard's key blocks past the query block's last position are skipped by
the dynamic loop bound and the remaining ones are masked on global positions.

``BK`` of the compute schedule is not used: the head dim ``D`` is a static extent and every
Q/K/V tile spans all ``D`` columns of its head.
"""
from __future__ import annotations

import math

import numpy as np

import tldsl as tl
from tldsl.collectives import all_gather
from tldsl.ir.types import dtype_of
from tldsl.ops.registry import register
from tldsl.runtime.sim.memory import to_storage
from tldsl.testing import OpCase, OpSpec

# Masked scores: finite, so ``m_old - m_new`` and ``s - m`` never become ``-inf - -inf``.
NEG_BIG = -1.0e30


@tl.kernel
def sp_attention(q, k: tl.Symmetric, v: tl.Symmetric, o, *, heads: tl.constexpr,
                 causal: tl.constexpr = False, scale: tl.constexpr = None,
                 compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
    """q, o: [Sl, H*D] local; k, v: [Sl, H*D] symmetric shards; ``heads`` = H.
    ``scale`` defaults to 1/sqrt(D)."""
    W = tl.world_size()
    tl.static_assert(q.shape == k.shape == v.shape == o.shape,
                     f"sp_attention: q, k, v and o must have the same shape [Sl, H*D], got "
                     f"q={list(q.shape)} k={list(k.shape)} v={list(v.shape)} o={list(o.shape)}")
    tl.static_assert(len(q.shape) == 2, f"sp_attention: tensors must be 2-d [Sl, H*D], got {list(q.shape)}")
    tl.static_assert(q.dtype == k.dtype == v.dtype,
                     f"sp_attention: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    Sl, width = q.shape
    tl.static_assert(isinstance(heads, int) and not isinstance(heads, bool) and heads > 0,
                     f"sp_attention: heads must be a positive int, got {heads!r}")
    tl.static_assert(width % heads == 0,
                     f"sp_attention: the width {width} of q/k/v is not heads x head_dim: "
                     f"{heads} heads do not divide it")
    D = width // heads
    sm_scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    BM, BN, _ = compute.tile            # BK unused: each tile spans the whole head dim
    N = W * Sl

    k_all = tl.symmetric_buffer((N, width), k.dtype, "k_gathered")
    v_all = tl.symmetric_buffer((N, width), v.dtype, "v_gathered")
    k_gather = all_gather(k, k_all, comm, name="gather_k")
    v_gather = all_gather(v, v_all, comm, name="gather_v")

    @tl.compute_part(grid=(tl.cdiv(Sl, BM), heads))
    def attention(pm, h):
        me = tl.rank()
        q0, c0 = pm * BM, h * D
        q_pos = tl.iota(BM) + (me * Sl + q0)                       # global query positions
        last_q = me * Sl + tl.minimum(q0 + BM, Sl) - 1           # last valid query of the block
        qt = tl.load(q, (q0, c0), (BM, D))
        j = tl.iota(BN)                                          # key row within a block
        m = tl.fragment((BM,), tl.float32, fill=NEG_BIG)
        l_sum = tl.fragment((BM,), tl.float32)
        acc = tl.fragment((BM, D), tl.float32)
        for s in tl.range(0, W):
            peer = (me + s) % W                                  # own shard first
            base = peer * Sl
            if causal:                                           # keys after last_q: skipped
                hi = tl.minimum(tl.maximum(last_q + 1 - base, 0), Sl)
            else:
                hi = Sl
            for kb in tl.range(0, hi, BN):
                r0 = base + kb
                r1 = base + tl.minimum(kb + BN, Sl)
                k_gather.wait_rows(r0, r1)                        # just this block's rows
                v_gather.wait_rows(r0, r1)
                in_shard = (j + kb) < Sl
                rows = tl.where(in_shard, j + r0, -1)             # -1: reads as zero
                kt = tl.load_rows(k_all, rows, c0, D)
                vt = tl.load_rows(v_all, rows, c0, D)
                mask = in_shard[None, :]
                if causal:
                    mask = mask & ((j + r0)[None, :] <= q_pos[:, None])
                sc = tl.where(mask, tl.dot(qt, tl.trans(kt)) * sm_scale, NEG_BIG)
                m_old = m[...]
                m_new = tl.maximum(m_old, tl.max(sc, 1))
                alpha = tl.exp(m_old - m_new)
                p = tl.where(mask, tl.exp(sc - m_new[:, None]), 0.0)
                l_sum[...] = l_sum[...] * alpha + tl.sum(p, 1)
                acc[...] = acc[...] * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
                m[...] = m_new
        denom = l_sum[...]
        denom = tl.where(denom > 0.0, denom, 1.0)                 # a row with no unmasked key: 0, not NaN
        tl.store(o, (q0, c0), acc[...] / denom[:, None])


def reference(q_shards, k_shards, v_shards, heads: int, causal: bool = False, scale: float | None = None):
    """numpy (fp32): every rank's output, softmax attention per head over the gathered K/V
    with the causal mask on global positions."""
    W = len(q_shards)
    Sl, width = np.shape(q_shards[0])
    D = width // heads
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = np.concatenate([np.asarray(x, np.float32) for x in k_shards], axis=0)
    v = np.concatenate([np.asarray(x, np.float32) for x in v_shards], axis=0)
    outs = []
    for r in range(W):
        qr = np.asarray(q_shards[r], np.float32)
        out = np.empty((Sl, width), np.float32)
        qpos = r * Sl + np.arange(Sl)[:, None]
        kpos = np.arange(W * Sl)[None, :]
        for h in range(heads):
            cols = slice(h * D, (h + 1) * D)
            s = (qr[:, cols] @ k[:, cols].T) * scale
            if causal:
                s = np.where(kpos <= qpos, s, -np.inf)
            s = s - s.max(axis=1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=1, keepdims=True)
            out[:, cols] = p @ v[:, cols]
        outs.append(out)
    return outs


# -- registration for the tests ------------------------------------------------------------

def _random(rng, shape, dtype):
    dt = dtype_of(dtype)
    return to_storage(rng.standard_normal(shape).astype(np.float32), dt).copy()


def make_case(rng, world_size, *, seq_per_rank, heads, head_dim, causal, compute, comm, dtype="float16"):
    W, Sl, width = world_size, seq_per_rank, heads * head_dim
    qs = [_random(rng, (Sl, width), dtype) for _ in range(W)]
    ks = [_random(rng, (Sl, width), dtype) for _ in range(W)]
    vs = [_random(rng, (Sl, width), dtype) for _ in range(W)]
    store = dtype_of(dtype).np
    inputs = [{"q": qs[r], "k": ks[r], "v": vs[r], "o": np.full((Sl, width), np.nan, store)}
              for r in range(W)]
    ref = reference(qs, ks, vs, heads, causal)
    return OpCase(inputs, [{"o": ref[r]} for r in range(W)],
                  {"compute": compute, "comm": comm, "heads": heads, "causal": causal},
                  rtol=2e-2, atol=2e-2,
                  description=f"sp_attention W={W} Sl={Sl} H={heads} D={head_dim} causal={causal} "
                              f"{dtype} {compute} {comm}")


def _params(world_size):
    """Sl mostly not a multiple of the tiles; the whole sequence W*Sl stays <= 64 so that one
    simulation (two launches) stays well under half a second at any world size."""
    from hypothesis import strategies as st
    from tldsl.testing import strategies as tst
    max_sl = min(24, max(2, 64 // world_size))

    @st.composite
    def params(draw):
        compute = draw(tst.compute_schedules(tiles=(8, 16)))
        return dict(seq_per_rank=draw(tst.dims(1, max_sl)), heads=draw(st.integers(1, 2)),
                    head_dim=draw(st.integers(4, 16)), causal=draw(st.booleans()),
                    compute=compute, comm=draw(tst.comm_schedules(compute=compute)),
                    dtype=draw(st.sampled_from(("float16", "bfloat16", "float32"))))
    return params()


def _mutant_params():
    c = tl.ComputeSchedule(tile=(8, 8, 8))
    base = dict(world_size=3, seq_per_rank=12, heads=1, head_dim=8, compute=c)
    pull = tl.CommSchedule(tile_m=8, mode="pull")
    push = tl.CommSchedule(tile_m=8, mode="push", order="full_mesh")
    ce_pull = tl.CommSchedule(engine="copy_engine", mode="pull")
    ce_push = tl.CommSchedule(engine="copy_engine", mode="push")
    return [dict(base, causal=False, comm=pull), dict(base, causal=True, comm=pull),
            dict(base, causal=False, comm=push), dict(base, causal=True, comm=push),
            dict(base, causal=False, comm=ce_push), dict(base, causal=True, comm=ce_pull)]


SPEC = register(OpSpec("sp_attention", sp_attention, make_case, _params, _mutant_params(),
                       doc="o = softmax(q all_gather(k)^T / sqrt(D) [causal]) all_gather(v), sequence-parallel"))
