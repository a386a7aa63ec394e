"""Sequence-parallel attention: the sequence is sharded across ranks; every rank all-gathers
K and V and runs flash attention for its own queries over the whole sequence.

Layout (per rank ``r`` of ``W``; ``Sl`` rows per rank, ``H`` query heads and ``H_kv`` key/value
heads of ``D`` columns; the whole sequence has ``N = W*Sl`` positions)::

    q [Sl, H*D]      local queries (their global positions: see ``layout``)
    k [Sl, H_kv*D]   symmetric shard of the keys   (the same positions as q's rows)
    v [Sl, H_kv*D]   symmetric shard of the values
    o [Sl, H*D]      output: softmax(q k_all^T * scale [+ causal mask]) v_all, per head

Arguments (compile-time): ``heads`` = H; ``kv_heads`` = H_kv (default H: multi-head
attention; fewer, dividing H: grouped-query attention, query head ``h`` reads key/value head
``h // (H / H_kv)``; only the H_kv heads are gathered); ``causal`` masks on global positions
(query ``p`` sees keys ``<= p``); ``scale`` (default ``1/sqrt(D)``); ``layout``, which global
positions a rank's rows hold:

* ``"contiguous"`` (default): rank ``r`` holds positions ``r*Sl .. r*Sl+Sl-1``. With
  ``causal=True`` the last rank does ``W`` times the work of the first.
* ``"zigzag"``: the sequence is cut into ``2W`` chunks of ``C = Sl/2`` positions (``Sl`` even,
  ``C`` any length); rank ``r`` holds chunks ``r`` and ``2W-1-r``, in that order (rows
  ``0..C-1`` then ``C..Sl-1``), so that every rank does the same causal work.
  :func:`shard_sequence` / :func:`unshard_sequence` cut a whole sequence ``[N, ...]`` (numpy or
  torch) into these shards and back. Without ``causal`` the layout changes nothing.

Communication: two ``all_gather`` collectives (K and V) into symmetric workspaces of
``[W*Sl, H_kv*D]``; push/pull, ring/full-mesh, SMs/copy engine and the communication tile
size are all choices of the communication schedule.

Compute: one task per (head, query block of ``BM`` rows). It walks the key blocks of ``BN``
rows piece by piece — the shards (contiguous layout) or the two chunks of each shard (zig-zag)
— starting with its own rank's and then ``rank+1, rank+2, ...`` (the order in which ring
communication delivers them), and waits *per key block* for just the K/V rows that block reads,
so attention over the local shard starts before any peer's K/V has arrived. A key block never
crosses a piece: its rows are gathered with ``tl.load_rows``, rows past the piece's end read
as zero and are masked out (so ``Sl`` and ``C`` need not be multiples of ``BN``; query rows past
``Sl`` are computed and never stored). The softmax is online (running max ``m``, running sum
``l``, accumulator ``acc``, all fp32). With ``causal=True`` a piece's key blocks past the query
block's last position are skipped by the dynamic loop bound and the remaining ones are masked
on global positions; in the zig-zag layout a query block may straddle the rank's two chunks,
and its rows' positions are ``tl.where(row < split, row + first, row + second)``.

``BK`` of the compute schedule is not used: the head dim ``D`` is a static extent and every
Q/K/V tile spans all ``D`` columns of its head.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

import tldsl as tl
from tldsl.collectives import all_gather
from tldsl.errors import InputError
from tldsl.ir.types import dtype_of
from tldsl.ops.registry import register
from tldsl.runtime.sim.memory import host_float32, to_storage
from tldsl.testing import OpCase, OpSpec

# Masked scores: finite, so ``m_old - m_new`` and ``s - m`` never become ``-inf - -inf``.
NEG_BIG = -1.0e30
#: The sequence layouts (``layout=``): which global positions a rank's rows hold.
LAYOUTS = ("contiguous", "zigzag")


def _finite_scale(scale) -> bool:
    return scale is None or (isinstance(scale, numbers.Real) and not isinstance(scale, bool) and math.isfinite(scale))


def check_scale(scale, what: str = "") -> float | None:
    """``scale`` as a float (None: ``1/sqrt(D)``): a finite real number — NaN or an infinity would
    make every output NaN (and a NaN, never equal to itself, a new op in every cache it keys).
    Negative and zero scales are allowed (meaningful, if unusual)."""
    if not _finite_scale(scale):
        raise InputError(f"{what}scale must be a finite number (None: 1/sqrt(head dim)), got {scale!r}")
    return None if scale is None else float(scale)


def _positive_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0


def argument_problem(seq_per_rank: int, width: int, heads, kv_heads=None, causal=False, layout="contiguous",
                     scale=None) -> str | None:
    """What is wrong with sequence-parallel attention's arguments for a rank's ``seq_per_rank``
    rows of q of ``width`` columns (``heads`` x head dim), in words — or None. The one check
    behind every surface of the op: the tile program (:func:`sp_attention`, a CompilationError at
    its ``tl.static_assert``), :class:`~tldsl.runtime.dist.attention_op.SequenceParallelAttention`,
    ``torch.ops.tldsl.sp_attention`` and its fake kernel, and :func:`reference` (InputError), so
    none of them accepts what another refuses. The operands' shapes and dtypes each surface checks
    in its own terms (torch tensors, specs, arrays)."""
    if not _positive_int(heads):
        return f"heads must be a positive int, got {heads!r}"
    if kv_heads is not None and not _positive_int(kv_heads):
        return f"kv_heads must be a positive int, got {kv_heads!r}"
    n_kv = heads if kv_heads is None else kv_heads
    if width % heads:
        return f"the width {width} of q/o is not heads x head_dim: {heads} heads do not divide it"
    if width // heads <= 0:
        return f"the head dim must be positive, got a width of {width} for {heads} heads"
    if heads % n_kv:
        return (f"kv_heads={n_kv} must divide heads={heads} (each key/value head serves heads/kv_heads query "
                f"heads)")
    if not isinstance(causal, bool):
        return f"causal must be a bool, got {causal!r}"
    if not isinstance(layout, str) or layout not in LAYOUTS:
        return f"layout must be one of {LAYOUTS}, got {layout!r}"
    if layout == "zigzag" and seq_per_rank % 2:
        return f"the zigzag layout holds two chunks of Sl/2 rows per rank: Sl={seq_per_rank} must be even"
    if not _finite_scale(scale):
        return f"scale must be a finite number (None: 1/sqrt(head dim)), got {scale!r}"
    return None


def check_arguments(seq_per_rank: int, width: int, heads, kv_heads=None, causal=False, layout="contiguous",
                    scale=None, what: str = "sp_attention") -> None:
    """:func:`argument_problem` as an InputError that starts with ``what``."""
    problem = argument_problem(seq_per_rank, width, heads, kv_heads, causal, layout, scale)
    if problem is not None:
        raise InputError(f"{what}: {problem}")


@tl.kernel
def sp_attention(q, k: tl.Symmetric, v: tl.Symmetric, o, *, heads: tl.constexpr, kv_heads: tl.constexpr = None,
                 causal: tl.constexpr = False, scale: tl.constexpr = None, layout: tl.constexpr = "contiguous",
                 compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None):
    """q, o: [Sl, H*D] local; k, v: [Sl, H_kv*D] symmetric shards; ``heads`` = H, ``kv_heads`` =
    H_kv (default H); ``scale`` defaults to 1/sqrt(D); ``layout`` "contiguous" or "zigzag"."""
    W = tl.world_size()
    tl.static_assert(len(q.shape) == 2 and len(k.shape) == 2 and len(v.shape) == 2 and len(o.shape) == 2,
                     f"sp_attention: tensors must be 2-d [Sl, heads*D], got q={list(q.shape)} k={list(k.shape)} "
                     f"v={list(v.shape)} o={list(o.shape)}")
    tl.static_assert(q.shape == o.shape and k.shape == v.shape and q.shape[0] == k.shape[0],
                     f"sp_attention: q and o must be [Sl, H*D], k and v [Sl, H_kv*D] (the same Sl rows), got "
                     f"q={list(q.shape)} k={list(k.shape)} v={list(v.shape)} o={list(o.shape)}")
    tl.static_assert(q.dtype == k.dtype == v.dtype,
                     f"sp_attention: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    Sl, width = q.shape
    problem = argument_problem(Sl, width, heads, kv_heads, causal, layout, scale)
    tl.static_assert(problem is None, f"sp_attention: {problem}")
    heads = int(heads)
    D = width // heads
    n_kv = heads if kv_heads is None else int(kv_heads)
    tl.static_assert(k.shape[1] == n_kv * D,
                     f"sp_attention: k and v must be [Sl, kv_heads*D] = [{Sl}, {n_kv}*{D}], got "
                     f"k={list(k.shape)} ({n_kv} key/value heads of the head dim {D} of q)")
    group = heads // n_kv
    zigzag = causal and layout == "zigzag"        # without a mask the positions change nothing
    sm_scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    BM, BN, _ = compute.tile            # BK unused: each tile spans the whole head dim
    N = W * Sl

    k_all = tl.symmetric_buffer((N, n_kv * D), k.dtype, "k_gathered")
    v_all = tl.symmetric_buffer((N, n_kv * D), v.dtype, "v_gathered")
    k_gather = all_gather(k, k_all, comm, name="gather_k")
    v_gather = all_gather(v, v_all, comm, name="gather_v")

    def key_block(qt, q_pos, m, l_sum, acc, j, kb, L, base, pos_base, kc0):
        """One key block: rows ``kb .. kb+BN-1`` of the piece of ``L`` gathered rows that starts at
        row ``base``; ``pos_base``: the global position of the piece's row 0 (None: ``base``)."""
        r0 = base + kb
        r1 = base + tl.minimum(kb + BN, L)
        k_gather.wait_rows(r0, r1)                               # just this block's rows
        v_gather.wait_rows(r0, r1)
        in_shard = (j + kb) < L
        rows = tl.where(in_shard, j + r0, -1)                    # -1: reads as zero
        kt = tl.load_rows(k_all, rows, kc0, D)
        vt = tl.load_rows(v_all, rows, kc0, D)
        mask = in_shard[None, :]
        if causal:
            key0 = r0 if pos_base is None else pos_base + kb     # global position of key row 0
            mask = mask & ((j + key0)[None, :] <= q_pos[:, None])
        sc = tl.where(mask, tl.dot(qt, tl.trans(kt)) * sm_scale, NEG_BIG)
        m_old = m[...]
        m_new = tl.maximum(m_old, tl.max(sc, 1))
        alpha = tl.exp(m_old - m_new)
        p = tl.where(mask, tl.exp(sc - m_new[:, None]), 0.0)
        l_sum[...] = l_sum[...] * alpha + tl.sum(p, 1)
        acc[...] = acc[...] * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        m[...] = m_new

    # heads outermost: the default (row-major) tile order then walks one head's query blocks before
    # the next head's, so the CTAs running at once share a head's keys in L2 instead of each head's
    # keys streaming from HBM once every few tiles (at 131072 keys, 64 MB a head, query block by
    # query block with every head ran at 0.81-0.82x cuDNN, head by head 1.02-1.03x)
    @tl.compute_part(grid=(heads, tl.cdiv(Sl, BM)))
    def attention(h, pm):
        me = tl.rank()
        q0, c0 = pm * BM, h * D
        kc0 = c0 if group == 1 else (h // group) * D               # the key/value head's columns
        if zigzag:
            C = Sl // 2
            first = me * C                                        # local row i < C: position first + i
            second = (2 * W - 1 - me) * C - C                     # local row i >= C: position second + i
            qi = tl.iota(BM)
            q_pos = tl.where(qi < C - q0, qi + (first + q0), qi + (second + q0))
            last_row = tl.minimum(q0 + BM, Sl) - 1
            last_q = tl.select(last_row < C, first + last_row, second + last_row)   # positions grow with rows
        else:
            q_pos = tl.iota(BM) + (me * Sl + q0)                  # global query positions
            last_q = me * Sl + tl.minimum(q0 + BM, Sl) - 1       # last valid query of the block
        qt = tl.load(q, (q0, c0), (BM, D))
        j = tl.iota(BN)                                          # key row within a block
        m = tl.fragment((BM,), tl.float32, fill=NEG_BIG)
        l_sum = tl.fragment((BM,), tl.float32)
        acc = tl.fragment((BM, D), tl.float32)
        for s in tl.range(0, W):
            peer = (me + s) % W                                  # own shard first
            if zigzag:
                for half in tl.range(0, 2):                      # the shard's two chunks, in row order
                    base = (2 * peer + half) * C                 # first gathered row of the chunk
                    pos0 = (peer + half * (2 * W - 1 - 2 * peer)) * C    # its first position
                    hi = tl.minimum(tl.maximum(last_q + 1 - pos0, 0), C)
                    for kb in tl.range(0, hi, BN):
                        key_block(qt, q_pos, m, l_sum, acc, j, kb, C, base, pos0, kc0)
            else:
                base = peer * Sl
                if causal:                                       # keys after last_q: skipped
                    hi = tl.minimum(tl.maximum(last_q + 1 - base, 0), Sl)
                else:
                    hi = Sl
                for kb in tl.range(0, hi, BN):
                    key_block(qt, q_pos, m, l_sum, acc, j, kb, Sl, base, None, kc0)
        denom = l_sum[...]
        denom = tl.where(denom > 0.0, denom, 1.0)                 # a row with no unmasked key: 0, not NaN
        tl.store(o, (q0, c0), acc[...] / denom[:, None])


# -- host side: the layouts and the numpy reference ------------------------------------------

def _layout_pieces(world_size: int, seq_per_rank: int, layout: str):
    """Per rank, its rows as (first position, length) pieces of the whole sequence, in row order."""
    W, Sl = world_size, seq_per_rank
    if layout == "contiguous":
        return [[(r * Sl, Sl)] for r in range(W)]
    C = Sl // 2
    return [[(r * C, C), ((2 * W - 1 - r) * C, C)] for r in range(W)]


def _check_layout(world_size, seq_per_rank, layout, what):
    if layout not in LAYOUTS:
        raise InputError(f"{what}: layout must be one of {LAYOUTS}, got {layout!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0:
        raise InputError(f"{what}: world_size must be a positive int, got {world_size!r}")
    if layout == "zigzag" and seq_per_rank % 2:
        raise InputError(f"{what}: the zigzag layout holds two chunks of Sl/2 rows per rank, but a rank holds "
                         f"Sl={seq_per_rank} rows (the whole sequence must be a multiple of 2*world_size)")


def positions(world_size: int, seq_per_rank: int, layout: str = "contiguous") -> np.ndarray:
    """``[W, Sl]`` int64: the global position of every row of every rank in ``layout``."""
    if not _positive_int(seq_per_rank):      # (a negative count made an empty array without a word)
        raise InputError(f"sp_attention.positions: seq_per_rank must be a positive int (rows per rank), got "
                         f"{seq_per_rank!r}")
    seq_per_rank = int(seq_per_rank)
    _check_layout(world_size, seq_per_rank, layout, "sp_attention.positions")
    return np.array([np.concatenate([np.arange(p, p + n) for p, n in pieces])
                     for pieces in _layout_pieces(world_size, seq_per_rank, layout)], np.int64).reshape(
                         world_size, seq_per_rank)


def _cat(parts):
    if type(parts[0]).__module__.split(".")[0] == "torch":
        import torch
        return torch.cat(list(parts), 0)
    return np.concatenate([np.asarray(p) for p in parts], 0)


def shard_sequence(x, world_size: int, layout: str = "contiguous") -> list:
    """Cut a whole sequence ``x`` ``[N, ...]`` (a numpy array or a torch tensor) into the
    ``world_size`` shards of ``layout`` (new arrays / tensors of ``N / world_size`` rows each):
    rank ``r``'s ``q``, ``k`` or ``v``. For ``"zigzag"``, ``N`` must be a multiple of
    ``2 * world_size``."""
    if not hasattr(x, "shape") or len(x.shape) < 1:
        got = f"a 0-d {type(x).__name__}" if hasattr(x, "shape") else type(x).__name__
        raise InputError(f"sp_attention.shard_sequence: x must be a numpy array or torch tensor [N, ...] (rows "
                         f"first), got {got}")
    n = int(x.shape[0])
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size <= 0 or n % world_size:
        raise InputError(f"sp_attention.shard_sequence: a sequence of {n} rows does not split into "
                         f"world_size={world_size!r} equal shards")
    _check_layout(world_size, n // world_size, layout, "sp_attention.shard_sequence")
    return [_cat([x[p:p + c] for p, c in pieces])
            for pieces in _layout_pieces(world_size, n // world_size, layout)]


def unshard_sequence(shards, layout: str = "contiguous"):
    """The inverse of :func:`shard_sequence`: the whole sequence ``[N, ...]`` from every rank's
    shard (each rank's ``o``, say), rows in position order."""
    if not isinstance(shards, (list, tuple)):
        raise InputError(f"sp_attention.unshard_sequence: takes a list with one shard per rank, got "
                         f"{type(shards).__name__} (a single tensor's rows would be taken for shards)")
    shards = list(shards)
    if any(not hasattr(s, "shape") or len(s.shape) < 1 for s in shards):
        got = [f"0-d {type(s).__name__}" if hasattr(s, "shape") else type(s).__name__ for s in shards]
        raise InputError("sp_attention.unshard_sequence: each shard must be a numpy array or torch tensor "
                         f"[Sl, ...] (rows first), got {got}")
    if not shards or any(tuple(s.shape) != tuple(shards[0].shape) for s in shards):
        raise InputError("sp_attention.unshard_sequence: needs one shard per rank, all of the same shape, got "
                         f"{[tuple(s.shape) for s in shards]}")
    W, Sl = len(shards), int(shards[0].shape[0])
    _check_layout(W, Sl, layout, "sp_attention.unshard_sequence")
    parts = []
    for r, pieces in enumerate(_layout_pieces(W, Sl, layout)):
        row = 0
        for p, c in pieces:
            parts.append((p, shards[r][row:row + c]))
            row += c
    return _cat([x for _, x in sorted(parts, key=lambda t: t[0])])


def reference(q_shards, k_shards, v_shards, heads: int, causal: bool = False, scale: float | None = None, *,
              kv_heads: int | None = None, layout: str = "contiguous"):
    """numpy (fp32): every rank's output, softmax attention per head over the gathered K/V
    (query head ``h`` on key/value head ``h // (heads / kv_heads)``) with the causal mask on the
    global positions of ``layout``. The shards: numpy arrays or torch tensors (bf16 too)."""
    what = "sp_attention.reference"
    shards = {}
    for name, xs in (("q_shards", q_shards), ("k_shards", k_shards), ("v_shards", v_shards)):
        if not isinstance(xs, (list, tuple)) or not xs:
            raise InputError(f"{what}: {name} must be a list with one [Sl, heads*D] shard per rank, got "
                             f"{type(xs).__name__}{' (empty)' if isinstance(xs, (list, tuple)) else ''}")
        shapes = [tuple(np.shape(x)) for x in xs]
        if len(shapes[0]) != 2 or any(sh != shapes[0] for sh in shapes):
            raise InputError(f"{what}: {name} must be 2-d [Sl, heads*D] shards, all of one shape, got {shapes}")
        shards[name] = shapes[0]
    W = len(q_shards)
    (Sl, width), kv_shape = shards["q_shards"], shards["k_shards"]
    if len(k_shards) != W or len(v_shards) != W:
        raise InputError(f"{what}: one q, k and v shard per rank, got {W}, {len(k_shards)} and {len(v_shards)}")
    check_arguments(Sl, width, heads, kv_heads, causal, layout, scale, what)
    D = width // heads
    n_kv = heads if kv_heads is None else kv_heads
    if shards["v_shards"] != kv_shape or kv_shape != (Sl, n_kv * D):
        raise InputError(f"{what}: k and v shards must be [Sl, kv_heads*D] = [{Sl}, {n_kv}*{D}] (q's rows, "
                         f"{n_kv} key/value heads of q's head dim {D}), got k {list(kv_shape)} and v "
                         f"{list(shards['v_shards'])}")
    group = heads // n_kv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    pos = positions(W, Sl, layout)
    k = np.concatenate([host_float32(f"{what}: k_shards[{i}]", x) for i, x in enumerate(k_shards)], axis=0)
    v = np.concatenate([host_float32(f"{what}: v_shards[{i}]", x) for i, x in enumerate(v_shards)], axis=0)
    kpos = pos.reshape(-1)[None, :]                 # the gathered rows' positions
    outs = []
    for r in range(W):
        qr = host_float32(f"{what}: q_shards[{r}]", q_shards[r])
        out = np.empty((Sl, width), np.float32)
        qpos = pos[r][:, None]
        for h in range(heads):
            cols = slice(h * D, (h + 1) * D)
            kv = slice((h // group) * D, (h // group + 1) * D)
            s = (qr[:, cols] @ k[:, kv].T) * scale
            if causal:
                s = np.where(kpos <= qpos, s, -np.inf)
            s = s - s.max(axis=1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=1, keepdims=True)
            out[:, cols] = p @ v[:, kv]
        outs.append(out)
    return outs


# -- registration for the tests ------------------------------------------------------------

def _random(rng, shape, dtype):
    dt = dtype_of(dtype)
    return to_storage(rng.standard_normal(shape).astype(np.float32), dt).copy()


def make_case(rng, world_size, *, seq_per_rank, heads, head_dim, causal, compute, comm, dtype="float16",
              kv_heads=None, layout="contiguous"):
    W, Sl, width = world_size, seq_per_rank, heads * head_dim
    kv_width = (kv_heads or heads) * head_dim
    qs = [_random(rng, (Sl, width), dtype) for _ in range(W)]
    ks = [_random(rng, (Sl, kv_width), dtype) for _ in range(W)]
    vs = [_random(rng, (Sl, kv_width), dtype) for _ in range(W)]
    store = dtype_of(dtype).np
    inputs = [{"q": qs[r], "k": ks[r], "v": vs[r], "o": np.full((Sl, width), np.nan, store)}
              for r in range(W)]
    ref = reference(qs, ks, vs, heads, causal, kv_heads=kv_heads, layout=layout)
    kwargs = {"compute": compute, "comm": comm, "heads": heads, "causal": causal}
    if kv_heads is not None:
        kwargs["kv_heads"] = kv_heads
    if layout != "contiguous":
        kwargs["layout"] = layout
    return OpCase(inputs, [{"o": ref[r]} for r in range(W)], kwargs, rtol=2e-2, atol=2e-2,
                  description=f"sp_attention W={W} Sl={Sl} H={heads} H_kv={kv_heads or heads} D={head_dim} "
                              f"causal={causal} layout={layout} {dtype} {compute} {comm}")


def _params(world_size):
    """Sl mostly not a multiple of the tiles (in the zig-zag layout its chunks Sl/2 too); MHA
    and GQA; the whole sequence times the heads stays <= 128 rows so that one simulation (two
    launches) stays well under half a second at any world size."""
    from hypothesis import strategies as st
    from tldsl.testing import strategies as tst

    @st.composite
    def params(draw):
        compute = draw(tst.compute_schedules(tiles=(8, 16)))
        heads = draw(st.sampled_from((1, 2, 4)))
        kv_heads = draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0]))
        layout = draw(st.sampled_from(LAYOUTS))
        max_sl = min(24, max(2, 128 // (world_size * heads)))
        if layout == "zigzag":
            sl = 2 * draw(tst.dims(1, max(1, max_sl // 2)))
        else:
            sl = draw(tst.dims(1, max_sl))
        return dict(seq_per_rank=sl, heads=heads, kv_heads=None if kv_heads == heads else kv_heads,
                    layout=layout, head_dim=draw(st.integers(4, 16)), causal=draw(st.booleans()),
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
    # zig-zag GQA: chunks of 7 rows (a key block of a rank's second chunk reads rows 7-13 of its
    # shard, across communication tiles of 8 rows), two query heads on one key/value head
    zz = dict(base, seq_per_rank=14, heads=2, kv_heads=1, causal=True, layout="zigzag")
    return [dict(base, causal=False, comm=pull), dict(base, causal=True, comm=pull),
            dict(base, causal=False, comm=push), dict(base, causal=True, comm=push),
            dict(base, causal=False, comm=ce_push), dict(base, causal=True, comm=ce_pull),
            dict(zz, comm=pull), dict(zz, comm=ce_push)]


SPEC = register(OpSpec("sp_attention", sp_attention, make_case, _params, _mutant_params(),
                       doc="o = softmax(q all_gather(k)^T / sqrt(D) [causal]) all_gather(v), sequence-parallel, MHA/GQA, "
                           "contiguous or zig-zag layout"))
