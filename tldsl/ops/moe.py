"""Tensor-parallel MoE with run-time (dynamic) mappings: AllGather+MoE and MoE+ReduceScatter.

Setting (TileLink's TP MoE). Tokens are sharded by rank: ``x`` is ``[Ms, K]`` on every rank
(symmetric), ``T = W * Ms`` tokens in all, token ``t`` on rank ``t // Ms``. Every rank holds
all ``E`` experts, but only its ``1/W`` slice of the intermediate dimension:
``w1 [E, K, Nr]`` and ``w2 [E, Nr, K]``. The routing (``topk_ids [T, topk]``, distinct
experts per token, and ``topk_weights [T, topk]``) is global and the same on every rank.

* ``allgather_moe``: all-gather the token shards (any communication schedule of
  :func:`~tldsl.collectives.all_gather`), gather each routed ``(token, k)`` row by expert and
  run a grouped GEMM with this rank's ``w1`` slice: ``h [R_pad, Nr]`` in expert-sorted order.
* ``moe_reduce_scatter``: grouped GEMM ``h @ w2[expert]`` into a workspace, the top-k
  weighted combine per token into a partial ``[T, K]``, then a reduce-scatter, so rank ``r``
  gets ``out [Ms, K]`` = the MoE output of its own tokens, summed over the ranks' slices.

**Expert-sorted order.** The routed rows ``(t, k)`` are sorted by expert (stable, so inside
an expert tokens increase), and each expert's rows are padded up to a multiple of ``BM``
(the compute tile's rows): row tile ``i`` covers sorted rows ``[i*BM, (i+1)*BM)``, all of one
expert. Tiles after the last expert's are unused. Their number is static for given sizes:
:func:`moe_num_tiles` bounds it by the worst case over all routings, so one compiled kernel
serves every routing with the same sizes. :func:`moe_routing` fills the tables (the
dynamic mapping) on the host; padding rows and unused tiles of ``h`` hold zeros.
``tldsl.runtime.gpu.moe_routing.MoERoutingBuilder`` builds the same tables, entry for entry,
on the GPU from a ``topk_ids`` tensor there, with no host synchronisation.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields

import numpy as np

import tldsl as tl
from tldsl.collectives import PARTIAL_DTYPES, all_gather, partial_buffer, reduce_scatter
from tldsl.errors import InputError
from tldsl.ir.display import html_card, one_line
from tldsl.ops.registry import register
from tldsl.ops.weights import check_weight_layout, matrix_dims, stored_form, weight_tile
from tldsl.runtime.sim.memory import host_array, host_float32, host_operand, nan_like
from tldsl.testing import OpCase, OpSpec


# -- host side: the routing tables -----------------------------------------------------------

def moe_num_tiles(num_routed_rows: int, num_experts: int, BM: int) -> int:
    """Worst-case number of ``BM``-row tiles of the expert-sorted rows, over every routing of
    ``num_routed_rows`` rows (``T * topk``) to ``num_experts`` experts. An expert with ``c``
    rows fills ``ceil(c / BM)`` tiles, so the total is at most
    ``(rows + E * (BM - 1)) // BM``, and never more than one tile per row."""
    return max(1, min(num_routed_rows, (num_routed_rows + num_experts * (BM - 1)) // BM))


@dataclass(frozen=True, eq=False, repr=False)
class MoERouting:
    """The run-time tables of one routing (all int32; ``NT`` = :attr:`num_tiles`,
    ``R_pad = NT * BM``, ``TT = ceil(T / BM)`` token tiles of ``BM`` tokens).

    ``sorted_token_ids [R_pad]``
        token of every expert-sorted row, -1 for padding (the grouped GEMM gathers these).
    ``tile_expert [NT]``
        expert of row tile ``i``, -1 for an unused tile.
    ``tile_valid_rows [NT]``
        routed (non-padding) rows in tile ``i``; they come first in the tile.
    ``tile_tokens [NT, 2]``
        ``[min token, max token + 1)`` of tile ``i`` (``[0, 0)`` when unused): the rows of the
        gathered tokens it reads, so it waits only for the communication tiles holding them.
    ``tile_ranks [NT, 2]``
        ``[first, last + 1)`` source rank of those tokens (``[0, 0)`` when unused).
    ``tile_visit [NT]``
        the row tiles in the order a pass over them visits them (:func:`visit_order`): every
        expert's tiles interleaved by their place in the expert, so tiles over the same tokens
        come together (AllGather+MoE's staged row gather then reads a token's second routed
        copy from L2), the unused tiles last, in place.
    ``token_pos [topk * T]``
        sorted row of ``(t, k)`` at ``k * T + t`` (k-major, so one ``k`` of a token tile is
        contiguous): where the combine finds token ``t``'s ``k``-th expert output.
    ``tile_token_tiles [NT, min(BM, TT)]``
        the token tiles (``token // BM``) whose tokens row tile ``i`` holds, ascending,
        -1 padded: the combine channels its GEMM tiles notify.
    ``tile_num_token_tiles [NT]``
        how many entries of ``tile_token_tiles[i]`` are used (0 for an unused tile).
    ``token_tile_producers [TT]``
        how many row tiles hold tokens of token tile ``j`` (the combine's wait count).
    """
    num_experts: int
    world_size: int
    rows_per_rank: int
    topk: int
    block_m: int
    expert_counts: np.ndarray
    sorted_token_ids: np.ndarray
    tile_expert: np.ndarray
    tile_valid_rows: np.ndarray
    tile_tokens: np.ndarray
    tile_ranks: np.ndarray
    tile_visit: np.ndarray
    token_pos: np.ndarray
    tile_token_tiles: np.ndarray
    tile_num_token_tiles: np.ndarray
    token_tile_producers: np.ndarray

    @property
    def num_tokens(self) -> int:
        return self.world_size * self.rows_per_rank

    @property
    def num_tiles(self) -> int:
        return int(self.tile_expert.shape[0])

    @property
    def num_rows(self) -> int:
        """``R_pad``: rows of ``h`` (expert-sorted, padded)."""
        return self.num_tiles * self.block_m

    def __repr__(self) -> str:
        """One line: the routing's sizes (the tables are attributes; ``_repr_html_`` lists them)."""
        used = int((self.tile_expert >= 0).sum())
        return one_line(f"<MoERouting: {self.num_tokens} tokens ({self.world_size} ranks x {self.rows_per_rank}), "
                        f"top-{self.topk} of {self.num_experts} experts; {used} of {self.num_tiles} tiles of "
                        f"{self.block_m} rows used ({self.num_tokens * self.topk} routed of {self.num_rows} rows)>")

    def _repr_html_(self) -> str:
        """A notebook's view: the sizes, the rows each expert got, and the tables' shapes folded away."""
        counts = [int(c) for c in self.expert_counts]
        facts = [("tokens", f"{self.num_tokens} ({self.world_size} ranks x {self.rows_per_rank})"),
                 ("experts", f"{self.num_experts}, top-{self.topk} per token"),
                 ("tiles", f"{int((self.tile_expert >= 0).sum())} used of {self.num_tiles}, {self.block_m} rows each"),
                 ("rows", f"{self.num_tokens * self.topk} routed of {self.num_rows} (R_pad)"),
                 ("rows per expert", one_line(", ".join(map(str, counts)))),
                 ("experts without a token", sum(c == 0 for c in counts))]
        tables = "\n".join(f"{f.name}: {list(getattr(self, f.name).shape)} {getattr(self, f.name).dtype}"
                           for f in fields(self) if isinstance(getattr(self, f.name), np.ndarray))
        return html_card("MoERouting (run-time tables of one routing)", facts, [("tables", tables)])

    @property
    def row_of(self) -> np.ndarray:
        """``[T, topk]``: the sorted row of token ``t``'s ``k``-th routed copy."""
        return self.token_pos.reshape(self.topk, self.num_tokens).T.copy()

    def allgather_tables(self) -> dict[str, np.ndarray]:
        """The table arguments of :func:`allgather_moe`."""
        return {"tile_expert": self.tile_expert, "tile_valid_rows": self.tile_valid_rows,
                "tile_tokens": self.tile_tokens, "tile_visit": self.tile_visit,
                "sorted_token_ids": self.sorted_token_ids}

    def reduce_scatter_tables(self) -> dict[str, np.ndarray]:
        """The table arguments of :func:`moe_reduce_scatter`."""
        return {"tile_expert": self.tile_expert, "tile_valid_rows": self.tile_valid_rows, "token_pos": self.token_pos,
                "tile_token_tiles": self.tile_token_tiles, "tile_num_token_tiles": self.tile_num_token_tiles,
                "token_tile_producers": self.token_tile_producers}

    def row_weights(self, topk_weights) -> np.ndarray:
        """``[R_pad]`` f32: each sorted row's top-k weight (0 at padding rows), what
        :func:`moe_combined_experts` scales its rows by; ``topk_weights [T, topk]``."""
        wts = host_float32("row_weights: topk_weights", topk_weights, 2)
        if wts.shape != (self.num_tokens, self.topk):
            raise InputError(f"row_weights: topk_weights must be [{self.num_tokens}, {self.topk}], got "
                             f"{list(wts.shape)}")
        out = np.zeros(self.num_rows, np.float32)
        out[self.token_pos] = wts.T.reshape(-1)          # token_pos[k * T + t]: the row of (t, k)
        return out

    def trace_combined_experts(self, k: int, n: int, num_experts: int, dtype, weights: str = "kn",
                               out_dtype=None, **schedules):
        """:func:`moe_combined_experts` traced for this routing: ``[num_rows, k]`` expert-sorted rows,
        ``[num_experts, k, n]`` weights (``weights="nk"``: ``[num_experts, n, k]``), the rows' weights,
        this routing's tables and the ``[num_tokens, n]`` output (``out_dtype``, else ``dtype``)."""
        S = tl.TensorSpec
        w = (num_experts, n, k) if weights == "nk" else (num_experts, k, n)
        return moe_combined_experts.trace(
            1, S((self.num_rows, k), dtype), S(w, dtype), S((self.num_rows,), tl.float32),
            S.of(self.sorted_token_ids), S.of(self.tile_expert), S.of(self.tile_valid_rows),
            S((self.num_tokens, n), out_dtype or dtype), weights=weights, **schedules)

    def trace_allgather_moe(self, world_size: int, rows_per_rank: int, k: int, n: int, num_experts: int, dtype,
                            weights: str = "kn", **schedules):
        """:func:`allgather_moe` traced for this routing: each rank's ``[rows_per_rank, k]`` tokens,
        ``[num_experts, k, n]`` expert weights (``weights="nk"``: ``[num_experts, n, k]``), this
        routing's tables and the ``[num_rows, n]`` output, all ``dtype`` (a tldsl dtype) but the
        tables; ``schedules``: ``compute=``, ``comm=`` (and ``stage_rows=``)."""
        S, tabs = tl.TensorSpec, self.allgather_tables()
        w = (num_experts, n, k) if weights == "nk" else (num_experts, k, n)
        return allgather_moe.trace(world_size, S((rows_per_rank, k), dtype), S(w, dtype),
                                   *[S.of(tabs[t]) for t in ("tile_expert", "tile_valid_rows", "tile_tokens",
                                                             "tile_visit", "sorted_token_ids")],
                                   S((self.num_rows, n), dtype), weights=weights, **schedules)

    def trace_moe_reduce_scatter(self, world_size: int, rows_per_rank: int, k: int, n: int, num_experts: int,
                                 topk_weights, dtype, weights: str = "kn", **schedules):
        """:func:`moe_reduce_scatter` traced for this routing: ``[num_rows, k]`` expert-sorted rows,
        ``[num_experts, k, n]`` weights (``weights="nk"``: ``[num_experts, n, k]``), the
        ``topk_weights`` (an array, or a spec), this routing's tables and each rank's
        ``[rows_per_rank, n]`` output, all ``dtype`` but the tables and weights; ``schedules``:
        ``compute=``, ``comm=``, ``partial_dtype=``."""
        S, tabs = tl.TensorSpec, self.reduce_scatter_tables()
        wts = topk_weights if isinstance(topk_weights, tl.TensorSpec) else S.of(topk_weights)
        w = (num_experts, n, k) if weights == "nk" else (num_experts, k, n)
        return moe_reduce_scatter.trace(
            world_size, S((self.num_rows, k), dtype), S(w, dtype), wts,
            *[S.of(tabs[t]) for t in ("tile_expert", "tile_valid_rows", "token_pos", "tile_token_tiles",
                                      "tile_num_token_tiles", "token_tile_producers")],
            S((rows_per_rank, n), dtype), weights=weights, **schedules)


def visit_order(tile_expert, tile_local, expert_tiles) -> np.ndarray:
    """``tile_visit``: the used row tiles ordered by ``(2 l + 1) / n_e`` — tile ``l`` of the ``n_e``
    tiles of expert ``e`` at the middle of its share of the expert's rows, which, tokens increasing
    inside an expert, is about where its tokens lie among all tokens — ties by expert; the
    unused tiles (expert -1) after them, in place. ``tile_local [NT]``: ``l`` of each tile;
    ``expert_tiles [E]``: ``n_e``. Sorted here (the keys as doubles: division rounds correctly, so
    equal fractions give equal keys, and two different ones with denominators this small differ
    by far more than a rounding); the GPU's routing (``moe_routing.hpp``: ``visit_from``,
    ``tiles_before``) computes the same permutation without sorting, by counting for each tile
    every other expert's tiles that sort before it."""
    te = np.asarray(tile_expert, np.int64)
    n = np.asarray(expert_tiles, np.int64)
    used = np.flatnonzero(te >= 0)
    visit = np.arange(te.shape[0], dtype=np.int32)
    if used.size:
        e = te[used]
        key = (2 * np.asarray(tile_local, np.int64)[used] + 1) / n[e]
        visit[:used.size] = used[np.lexsort((e, key))]
    return visit


def _positive_int(name, v):
    if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v <= 0:
        raise InputError(f"moe_routing: {name} must be a positive int, got {v!r}")
    return int(v)


def check_table_rows(who: str, routed_rows: int, num_experts: int, BM: int) -> None:
    """The padded rows of a routing (at most every expert's last tile short of ``BM``) index int32
    tables: refused past 2**31 with :class:`~tldsl.InputError`."""
    if routed_rows + num_experts * BM >= 2**31:
        raise InputError(f"{who}: too many routed rows for 32-bit tables")


def expert_ids(who: str, topk_ids, num_experts: int, num_tokens: int, tokens: str) -> np.ndarray:
    """``topk_ids`` as a host integer array ``[num_tokens, topk >= 1]`` (a torch tensor too, on any
    device) whose every id is one of ``num_experts`` experts, else :class:`~tldsl.InputError`
    (``who``: the function named in the message; ``tokens``: what the ``num_tokens`` rows are)."""
    E, T = num_experts, num_tokens
    try:
        ids = host_array(topk_ids)                 # (a torch tensor too, on any device)
    except ValueError as e:             # (ragged lists: numpy's "inhomogeneous shape")
        raise InputError(f"{who}: topk_ids must be [{T}, topk] ({tokens}), an array or "
                         f"equal-length rows: {e}") from None
    if ids.ndim != 2 or ids.shape[0] != T or ids.shape[1] < 1:
        raise InputError(f"{who}: topk_ids must be [{T}, topk] ({tokens}), "
                         f"got shape {list(ids.shape)}")
    if ids.dtype.kind not in "iu":
        raise InputError(f"{who}: topk_ids must be integers, got {ids.dtype}")
    bad = (ids < 0) | (ids >= E)
    if bad.any():
        t, k = (int(i) for i in np.argwhere(bad)[0])
        raise InputError(f"{who}: topk_ids[{t}, {k}] = {int(ids[t, k])} is not an expert id "
                         f"(there are {E} experts: 0..{E - 1})")
    return ids


def moe_routing(topk_ids, num_experts: int, world_size: int, rows_per_rank: int, BM: int,
                interleave: int | None = None) -> MoERouting:
    """Sort the routed rows by expert and fill the dynamic mapping's tables (see
    :class:`MoERouting`).

    ``topk_ids [W * rows_per_rank, topk]``: the experts of every token (global, identical on
    every rank); ``BM``: the compute tile's rows (``compute.tile[0]``) of the kernels that use
    the tables. ``interleave``: lay the tiles out in rounds — every expert's first
    ``interleave`` tiles, then every expert's next ones — rather than expert after expert. A
    tile still holds one expert's rows in token order, so a GEMM walking the tiles in order
    finishes the token tiles progressively, not all in its last wave, and a combine beside it or
    folded into it can follow it; a round keeps one expert's weights for ``interleave`` tiles
    (as many as the swizzled order's ``group_m``); host tables only (the fused ops' routing on the
    GPU lays the experts out one after the other). Raises :class:`~tldsl.InputError` on ids
    outside ``[0, num_experts)`` or a shape that does not fit."""
    E = _positive_int("num_experts", num_experts)
    W = _positive_int("world_size", world_size)
    Ms = _positive_int("rows_per_rank", rows_per_rank)
    BM = _positive_int("BM", BM)
    if interleave is not None:
        interleave = _positive_int("interleave", interleave)
    T = W * Ms
    ids = expert_ids("moe_routing", topk_ids, E, T, f"{W} ranks x {Ms} tokens")
    topk = ids.shape[1]
    check_table_rows("moe_routing", T * topk, E, BM)
    flat = ids.reshape(-1).astype(np.int64)                    # routed row p = t * topk + k
    order = np.argsort(flat, kind="stable")                    # expert-major, then token
    counts = np.bincount(flat, minlength=E)
    NT = moe_num_tiles(T * topk, E, BM)
    TT = -(-T // BM)
    width = min(BM, TT)
    sorted_tok = np.full(NT * BM, -1, np.int32)
    tile_expert = np.full(NT, -1, np.int32)
    tile_valid = np.zeros(NT, np.int32)
    tile_tokens = np.zeros((NT, 2), np.int32)
    tile_ranks = np.zeros((NT, 2), np.int32)
    tile_local = np.zeros(NT, np.int64)
    token_pos = np.full(topk * T, -1, np.int32)
    tile_tt = np.full((NT, width), -1, np.int32)
    tile_ntt = np.zeros(NT, np.int32)
    producers = np.zeros(TT, np.int32)
    starts = np.cumsum(counts) - counts
    chunks = [(e, c0) for e in range(E) for c0 in range(0, int(counts[e]), BM)]      # expert after expert
    if interleave is not None:             # rounds of `interleave` tiles of each expert
        chunks.sort(key=lambda ec: (ec[1] // BM // interleave, ec[0], ec[1]))
    tile = 0
    for e, c0 in chunks:
        chunk = order[starts[e] + c0:starts[e] + min(c0 + BM, int(counts[e]))]
        tok, k = chunk // topk, chunk % topk
        r0 = tile * BM
        sorted_tok[r0:r0 + chunk.size] = tok
        token_pos[k * T + tok] = r0 + np.arange(chunk.size)
        tile_expert[tile] = e
        tile_local[tile] = c0 // BM
        tile_valid[tile] = chunk.size
        tile_tokens[tile] = (tok.min(), tok.max() + 1)
        tile_ranks[tile] = (tok.min() // Ms, tok.max() // Ms + 1)
        tts = np.unique(tok // BM)
        tile_tt[tile, :tts.size] = tts
        tile_ntt[tile] = tts.size
        producers[tts] += 1
        tile += 1
    assert tile <= NT and (token_pos >= 0).all()
    visit = visit_order(tile_expert, tile_local, -(-counts // BM))
    return MoERouting(E, W, Ms, topk, BM, counts.astype(np.int32), sorted_tok, tile_expert, tile_valid,
                      tile_tokens, tile_ranks, visit, token_pos, tile_tt, tile_ntt, producers)


# -- the kernels ----------------------------------------------------------------------------------

def expert_rows_tile(h, w2, tiles, i, pn, tile, weights: str = "kn"):
    """Row tile ``i``, column tile ``pn`` of ``h @ w2[expert]`` (``tile`` = (BM, BN, BK); ``tiles``
    maps ``expert`` and ``valid_rows`` by row tile), its rows past the tile's valid ones zeros —
    whatever ``h`` holds there — so a GPU may leave them uncomputed."""
    BM, BN, BK = tile
    r0, c0, expert = i * BM, pn * BN, tiles["expert", i]
    acc = tl.fragment((BM, BN), tl.float32)
    for k in tl.range(0, h.shape[1], BK):
        acc += tl.dot(tl.load(h, (r0, k), (BM, BK)), weight_tile(w2, k, c0, BK, BN, weights, expert=expert))
    return tl.where(tl.iota(BM)[:, None] < tiles["valid_rows", i], acc, 0.0)


def _check_table(t, shape, what, hint=""):
    tl.static_assert(t.dtype == tl.int32, f"{what}: table '{t.name}' must be int32, got {t.dtype}")
    tl.static_assert(tuple(t.shape) == tuple(shape),
                     f"{what}: table '{t.name}' must be {list(shape)}, got {list(t.shape)}{hint}")


def _expert_rows_and_weights(who: str, h, w2, tile_expert, weights: str, BM: int) -> tuple:
    """``(R, Nr, E, K, NT)`` of layer 1's operands, checked at trace time: ``h [R_pad, Nr]`` of
    ``NT`` row tiles of ``BM`` rows, ``w2 [E, Nr, K]`` (``weights="nk"``: ``[E, K, Nr]``) of
    ``h``'s dtype, ``tile_expert [NT]`` an i32 table."""
    tl.static_assert(len(h.shape) == 2, f"{who}: h must be [R_pad, Nr], got {list(h.shape)}")
    form = "[E, K, Nr]" if weights == "nk" else "[E, Nr, K]"
    tl.static_assert(len(w2.shape) == 3, f"{who}: w2 must be {form}, got {list(w2.shape)}")
    R, Nr = h.shape
    E, Nw, K = matrix_dims(w2, weights, who)
    tl.static_assert(Nw == Nr, f"{who}: h is [{R}, {Nr}] but w2 is {list(w2.shape)}{stored_form(weights, form)}: "
                               f"w2's Nr must be {Nr}")
    tl.static_assert(w2.dtype == h.dtype, f"{who}: h is {h.dtype} but w2 is {w2.dtype}")
    NT = _num_tiles(who, tile_expert)
    tl.static_assert(R == NT * BM, f"{who}: h must have {NT * BM} rows ({NT} tiles of BM={BM} "
                                   f"sorted rows), got {R} (were the tables built with moe_routing(..., BM={BM})?)")
    return R, Nr, E, K, NT


def _num_tiles(who: str, tile_expert) -> int:
    """The row tiles ``NT`` of a routing, ``tile_expert [NT]`` checked as an i32 table."""
    tl.static_assert(len(tile_expert.shape) == 1,
                     f"{who}: tile_expert must be 1-d [num_tiles], got {list(tile_expert.shape)}")
    NT = tile_expert.shape[0]
    _check_table(tile_expert, (NT,), who)
    return NT


@tl.kernel
def allgather_moe(x: tl.Symmetric, w1, tile_expert, tile_valid_rows, tile_tokens, tile_visit, sorted_token_ids, h, *,
                  compute: tl.ComputeSchedule = None, comm: tl.CommSchedule = None, stage_rows: bool = False,
                  weights: str = "kn"):
    """x: [Ms, K] token shard (symmetric); w1: [E, K, Nr] (this rank's slice of every expert; with
    ``weights="nk"`` stored [E, Nr, K], a stack of torch Linear weights);
    tables from :func:`moe_routing` (``allgather_tables()``); h: [R_pad, Nr] =
    ``all_gather(x)[sorted_token_ids] @ w1[expert of the row]`` in expert-sorted order, its padding
    rows zeros: a row tile's rows past its ``tile_valid_rows`` are stored as zeros whatever the
    weights hold, so a GPU may skip computing them (a tile of at most ``BM / 2`` routed rows runs
    as a half tile, except in a kernel with another part folded in).

    ``stage_rows``: where the routed rows are gathered. False: by the grouped GEMM itself, each
    tile's rows read by row id at every K step (every column tile of a row tile gathers them
    again). True: once, by a compute part of their own (``gather_rows``, as the rows arrive) into
    the expert-sorted ``x_sorted``, which the GEMM then reads as dense tiles (TMA on GPUs) once
    the row tile's ``rows_ready`` channel is complete — one more pass over the routed rows, paid
    back where ``Nr`` is wide (:func:`stage_rows_pays`). That pass visits the row tiles in
    ``tile_visit``'s order: the tiles over the same tokens together, so a token's ``topk`` copies
    are read about at once and all but the first come from L2 (Mixtral's 32768 tokens: 0.353 ->
    0.308 ms on one H200, 0.481 -> 0.346 on one H100; BENCHMARKS.md, forty-second session). That
    suits a pass run before the GEMM; a GEMM that overlaps it and takes tiles as they complete
    wants them in layout order (``tile_visit = arange``: what AllGatherMoE passes then)."""
    W = tl.world_size()
    Ms, K = x.shape
    BM, BN, BK = compute.tile
    form = "[E, Nr, K]" if weights == "nk" else "[E, K, Nr]"
    tl.static_assert(len(w1.shape) == 3, f"allgather_moe: w1 must be {form}, got {list(w1.shape)}")
    E, Kw, Nr = matrix_dims(w1, weights, "allgather_moe")
    stored = stored_form(weights, form)
    tl.static_assert(Kw == K, f"allgather_moe: the token shard x is [{Ms}, {K}] but w1 is "
                              f"{list(w1.shape)}{stored}: w1's K must be {K}")
    tl.static_assert(w1.dtype == x.dtype, f"allgather_moe: x is {x.dtype} but w1 is {w1.dtype}")
    NT = _num_tiles("allgather_moe", tile_expert)
    _check_table(tile_valid_rows, (NT,), "allgather_moe")
    _check_table(tile_tokens, (NT, 2), "allgather_moe")
    _check_table(tile_visit, (NT,), "allgather_moe")
    _check_table(sorted_token_ids, (NT * BM,), "allgather_moe",
                 f" ({NT} tiles of BM={BM} rows: were the tables built with moe_routing(..., BM={BM})?)")
    tl.static_assert(tuple(h.shape) == (NT * BM, Nr),
                     f"allgather_moe: h must be [{NT * BM}, {Nr}] ({NT} tiles of BM={BM} sorted rows, "
                     f"Nr={Nr}), got {list(h.shape)}")
    T = W * Ms

    x_full = tl.symmetric_buffer((T, K), x.dtype, "x_gathered")
    gathered = all_gather(x, x_full, comm, name="gather_x")
    tiles = tl.DynamicMapping("expert_tiles", NT, expert=tile_expert, valid_rows=tile_valid_rows, tokens=tile_tokens,
                              visit=tile_visit)

    if stage_rows:
        GC = min(K, 4 * BK)      # columns a gather task copies: BM x 256 (64 KB of bf16) at BK = 64
        KC = tl.cdiv(K, GC)
        x_sorted = tl.local_buffer((NT * BM, K), x.dtype, "x_sorted")
        rows_ready = tl.signal("rows_ready", NT, scope="local")

        @tl.compute_part(grid=(NT, KC))
        def gather_rows(v, kc):
            i = tiles["visit", v]                         # the v-th row tile by the tokens it holds
            r0, k0 = i * BM, kc * GC
            gathered.wait_rows(tiles["tokens", i, 0], tiles["tokens", i, 1])     # an unused tile's range is empty
            acc = tl.fragment((BM, GC), tl.float32)      # (exact: x's values through f32 and back)
            for _ in tl.range(0, 1):                     # (a row gather: the combine recipe, one row summed)
                # padding rows and an unused tile's rows (ids -1): zeros, nothing read
                acc += tl.load_rows(x_full, tl.load(sorted_token_ids, (r0,), (BM,)), k0, GC)
            tl.store(x_sorted, (r0, k0), acc)
            tl.producer_tile_notify(rows_ready, i)

    @tl.compute_part(grid=(NT, tl.cdiv(Nr, BN)))
    def grouped_gemm(i, pn):
        r0, c0 = i * BM, pn * BN
        expert = tiles["expert", i]
        acc = tl.fragment((BM, BN), tl.float32)
        with tl.when(expert >= 0):
            if stage_rows:
                tl.consumer_tile_wait(rows_ready, i, count=KC)      # every column chunk of the tile's rows
            else:
                # tokens of one expert tile increase: waiting on their row range covers them all
                gathered.wait_rows(tiles["tokens", i, 0], tiles["tokens", i, 1])
                rows = tl.load(sorted_token_ids, (r0,), (BM,))
            for k in tl.range(0, K, BK):
                a = tl.load(x_sorted, (r0, k), (BM, BK)) if stage_rows else tl.load_rows(x_full, rows, k, BK)
                acc += tl.dot(a, weight_tile(w1, k, c0, BK, BN, weights, expert=expert))
        # padding rows and unused tiles (no valid rows): zeros
        tl.store(h, (r0, c0), tl.where(tl.iota(BM)[:, None] < tiles["valid_rows", i], acc, 0.0))


def stage_rows_pays(Nr: int, world_size: int = 1) -> bool:
    """Whether :func:`allgather_moe` should gather its routed rows in a pass of their own
    (``stage_rows=True``) rather than inside the grouped GEMM — at one rank only: across ranks the
    GEMM, chained after the gather on its stream, would start once every peer's rows are in,
    where gathering in the GEMM starts each tile as its rows arrive; that trade is not measured
    (one GPU this session), so ``world_size > 1`` answers False. The pass reads and writes every
    routed row once, whatever ``Nr``; the in-GEMM gather costs every column tile of a row tile
    its cp.async copies (the GEMM on rows already gathered, A by TMA, was 15% faster at Mixtral's
    shape: BENCHMARKS.md, fifteenth session). Both grow with K; the GEMM's time grows with ``Nr``
    (the rank's slice of the output columns), the pass's does not: on one H200 (twenty-third
    session) staging lost at ``Nr`` 768 and 1408 (Qwen3-30B, Qwen1.5-MoE, DeepSeek-MoE:
    0.60-0.86x ``_grouped_mm`` against 0.96-1.02x gathering in the GEMM) and won at 8192 and 14336 (the stress row, Mixtral: 0.99-1.05x against 0.90-0.93x).
    Since the gathering producer's copies became three instructions (d9e90b5) the two are level on
    the wide rows (fortieth session: Mixtral 8192 1.01x staged against 1.00x, 32768 0.99x against
    0.98x, the stress row 1.02x both): staging stays, as neither wins there."""
    return world_size == 1 and Nr >= STAGE_ROWS_MIN_N


#: the slice width from which the rows are staged: between the widest that lost (1408) and the
#: narrowest that won (8192) on one H200
STAGE_ROWS_MIN_N = 4096


@tl.kernel
def moe_reduce_scatter(h, w2, topk_weights, tile_expert, tile_valid_rows, token_pos, tile_token_tiles,
                       tile_num_token_tiles, token_tile_producers, out, *, compute: tl.ComputeSchedule = None,
                       comm: tl.CommSchedule = None, partial_dtype: str = "f32", weights: str = "kn"):
    """h: [R_pad, Nr] expert-sorted rows (this rank's slice of the intermediate activations);
    w2: [E, Nr, K] (this rank's slice; with ``weights="nk"`` stored [E, K, Nr], a stack of torch
    Linear weights); topk_weights: [T, topk] (float, global); tables from
    :func:`moe_routing` (``reduce_scatter_tables()``); out: [Ms, K] = for this rank's tokens,
    sum over ranks and k of ``topk_weights[t, k] * (h @ w2[expert])[row of (t, k)]``.

    Three stages, linked by tile-granular signals: the grouped GEMM writes ``y_sorted`` (a row
    tile's rows past its ``tile_valid_rows`` as zeros: the combine never reads them, and a GPU may
    skip computing them); the
    combine task of token tile ``j`` (``BM`` tokens) and column tile ``pn`` waits on channel
    ``(j, pn)`` for exactly the GEMM tiles holding its tokens (their number is a table
    entry, each of them notifies the channels of the token tiles it touches), gathers every
    token's ``topk`` rows, weights and sums them in fp32 into ``partial [T, K]``, and hands
    its rows to the reduce-scatter (an SM ring or a direct full mesh).

    ``partial_dtype``: ``"f32"`` (the partial stays fp32 in the workspace and on the wire: the
    sum over ranks is rounded once, at ``out``) or ``"out"`` (each rank's combined rows rounded
    to ``out``'s dtype when stored: a quarter fewer bytes for the combine to move at top-2 and
    half the reduce-scatter's traffic, the numerics of NCCL's reduce-scatter of a bf16 layer —
    as :func:`~tldsl.ops.gemm_reduce_scatter.gemm_reduce_scatter`'s)."""
    W = tl.world_size()
    BM, BN, BK = compute.tile
    R, Nr, E, K, NT = _expert_rows_and_weights("moe_reduce_scatter", h, w2, tile_expert, weights, BM)
    tl.static_assert(len(topk_weights.shape) == 2,
                     f"moe_reduce_scatter: topk_weights must be [T, topk], got {list(topk_weights.shape)}")
    tl.static_assert(len(out.shape) == 2, f"moe_reduce_scatter: out must be [Ms, K], got {list(out.shape)}")
    T, topk = topk_weights.shape
    Ms = out.shape[0]
    tl.static_assert(topk_weights.dtype.is_float,
                     f"moe_reduce_scatter: topk_weights must be floating point, got {topk_weights.dtype}")
    tl.static_assert(T == W * Ms, f"moe_reduce_scatter: topk_weights has {T} tokens but {W} ranks x "
                                  f"{Ms} rows of out make {W * Ms}")
    tl.static_assert(tuple(out.shape) == (Ms, K), f"moe_reduce_scatter: out must be [{Ms}, {K}] "
                                                  f"(K of w2), got {list(out.shape)}")
    TT = tl.cdiv(T, BM)                      # token tiles: the combine's rows
    NC = tl.cdiv(K, BN)
    _check_table(tile_valid_rows, (NT,), "moe_reduce_scatter")
    _check_table(token_pos, (topk * T,), "moe_reduce_scatter", f" (topk={topk} x {T} tokens)")
    _check_table(tile_token_tiles, (NT, min(BM, TT)), "moe_reduce_scatter",
                 f" ({NT} tiles x min(BM={BM}, {TT} token tiles))")
    _check_table(tile_num_token_tiles, (NT,), "moe_reduce_scatter")
    _check_table(token_tile_producers, (TT,), "moe_reduce_scatter", f" ({T} tokens in tiles of BM={BM})")

    # the GEMM's rows rounded to the operands' dtype, as torch's _grouped_mm returns them: half the
    # bytes of fp32 written and read back by the combine, which weights and sums them in fp32
    y = tl.local_buffer((R, K), h.dtype, "y_sorted")
    partial = partial_buffer((T, K), out, partial_dtype, "moe_reduce_scatter")
    y_ready = tl.signal("y_ready", TT * NC, scope="local")
    rs = reduce_scatter(partial, out, comm, name="reduce_scatter", producer_rows=BM, producers_per_row=NC)
    gemm_tiles = tl.DynamicMapping("expert_tiles", NT, expert=tile_expert, valid_rows=tile_valid_rows,
                                   token_tiles=tile_token_tiles, num_token_tiles=tile_num_token_tiles)
    token_tiles = tl.DynamicMapping("token_tiles", TT, producers=token_tile_producers)

    @tl.compute_part(grid=(NT, NC))
    def grouped_gemm(i, pn):
        expert = gemm_tiles["expert", i]
        with tl.when(expert >= 0):
            tl.store(y, (i * BM, pn * BN), expert_rows_tile(h, w2, gemm_tiles, i, pn, compute.tile, weights))
            for s in tl.range(0, gemm_tiles["num_token_tiles", i]):
                tl.producer_tile_notify(y_ready, gemm_tiles["token_tiles", i, s] * NC + pn)

    @tl.compute_part(grid=(TT, NC), align_shift=rs.align_shift)
    def combine(j, pn):
        m0, c0 = j * BM, pn * BN
        tl.consumer_tile_wait(y_ready, j * NC + pn, count=token_tiles["producers", j])
        in_range = tl.iota(BM) + m0 < T          # the last token tile may be short
        acc = tl.fragment((BM, BN), tl.float32)
        for k in tl.range(0, topk):
            rows = tl.where(in_range, tl.load(token_pos, (k * T + m0,), (BM,)), -1)
            acc += tl.load_rows(y, rows, c0, BN) * tl.load(topk_weights, (m0, k), (BM, 1))
        tl.store(partial, (m0, c0), acc)
        rs.notify_rows(m0, tl.minimum(m0 + BM, T))


@tl.kernel
def moe_combined_experts(h, w2, row_weights, sorted_token_ids, tile_expert, tile_valid_rows, out, *,
                         compute: tl.ComputeSchedule = None, weights: str = "kn"):
    """One GPU's MoE second layer with its top-k combine in the GEMM's epilogue: for every routed row
    ``r`` (of token ``t = sorted_token_ids[r]``), ``out[t] += row_weights[r] * (h @ w2[expert])[r]``
    by ``tl.add_rows`` — no expert-sorted ``y`` written and read back by a combine pass.

    h: [R_pad, Nr] expert-sorted rows; w2: [E, Nr, K] (``weights="nk"``: [E, K, Nr]); row_weights:
    [R_pad] f32, each routed row's top-k weight (:meth:`MoERouting.row_weights`); the tables from
    :func:`moe_routing` (``sorted_token_ids`` -1 at padding rows); out: [T, K], added to — zeros for
    the layer's output. The adds land in no fixed order (atomics), each rounded to ``out``'s type."""
    BM, BN, BK = compute.tile
    R, Nr, E, K, NT = _expert_rows_and_weights("moe_combined_experts", h, w2, tile_expert, weights, BM)
    tl.static_assert(len(out.shape) == 2, f"moe_combined_experts: out must be [T, K], got {list(out.shape)}")
    tl.static_assert(out.shape[1] == K, f"moe_combined_experts: out must have K = {K} columns, got {list(out.shape)}")
    tl.static_assert(out.dtype.is_float, f"moe_combined_experts: out must be floating point, got {out.dtype}")
    _check_table(tile_valid_rows, (NT,), "moe_combined_experts")
    _check_table(sorted_token_ids, (R,), "moe_combined_experts")
    tl.static_assert(tuple(row_weights.shape) == (R,) and row_weights.dtype == tl.float32,
                     f"moe_combined_experts: row_weights must be f32 [{R}] (one weight a sorted row), got "
                     f"{row_weights.dtype} {list(row_weights.shape)}")
    gemm_tiles = tl.DynamicMapping("expert_tiles", NT, expert=tile_expert, valid_rows=tile_valid_rows)

    @tl.compute_part(grid=(NT, tl.cdiv(K, BN)))
    def grouped_gemm(i, pn):
        with tl.when(gemm_tiles["expert", i] >= 0):
            y = expert_rows_tile(h, w2, gemm_tiles, i, pn, compute.tile, weights)
            scale = tl.load(row_weights, (i * BM,), (BM,))[:, None]
            # (the rows past the tile's valid ones add nothing: a GPU may leave them uncomputed)
            tokens = tl.load(sorted_token_ids, (i * BM,), (BM,))
            tokens = tl.where(tl.iota(BM) < gemm_tiles["valid_rows", i], tokens, -1)
            tl.add_rows(out, tokens, pn * BN, y * scale)


# -- numpy references ---------------------------------------------------------------------------------

def _ranks(name: str, arrays, ndim: int) -> list[np.ndarray]:
    if not isinstance(arrays, (list, tuple)) or not arrays:
        raise InputError(f"{name}: one array per rank (a non-empty list), got {type(arrays).__name__}")
    return [host_float32(f"{name}[{i}]", a, ndim) for i, a in enumerate(arrays)]


def _routing_of(who: str, routing) -> "MoERouting":
    if not isinstance(routing, MoERouting):
        raise InputError(f"{who}: routing must come from moe_routing, got {type(routing).__name__}")
    return routing


def _experts_held(who: str, name: str, w: np.ndarray, routing: "MoERouting") -> None:
    if w.shape[0] != routing.num_experts:
        raise InputError(f"{who}: the routing has {routing.num_experts} experts but {name} holds {w.shape[0]}")


def reference_allgather_moe(x_shards, w1, routing: MoERouting):
    """numpy: one rank's ``h [R_pad, Nr]`` (fp32) for its ``w1`` slice."""
    routing = _routing_of("reference_allgather_moe", routing)
    x = np.concatenate(_ranks("reference_allgather_moe: x_shards", x_shards, 2), axis=0)
    w1 = host_float32("reference_allgather_moe: w1", w1, 3)
    _experts_held("reference_allgather_moe", "w1", w1, routing)
    if x.shape[0] != routing.num_tokens or w1.shape[1] != x.shape[1]:
        raise InputError(f"reference_allgather_moe: x shards joined must be [{routing.num_tokens}, K] (the "
                         f"routing's tokens) and w1 [E, K, Nr], got {list(x.shape)} and {list(w1.shape)}")
    h = np.zeros((routing.num_rows, w1.shape[2]), np.float32)
    for i, e in enumerate(routing.tile_expert):
        if e < 0:
            continue
        rows = slice(i * routing.block_m, i * routing.block_m + routing.tile_valid_rows[i])
        h[rows] = x[routing.sorted_token_ids[rows]] @ w1[e]
    return h


def reference_moe_reduce_scatter(h_slices, w2_slices, topk_weights, routing: MoERouting):
    """numpy: the combined MoE output of every token, summed over the ranks' slices:
    ``[T, K]`` (fp32); rank ``r``'s ``out`` is rows ``[r*Ms, (r+1)*Ms)``."""
    who = "reference_moe_reduce_scatter"
    routing = _routing_of(who, routing)
    wts = host_float32(f"{who}: topk_weights", topk_weights, 2)
    if wts.shape != (routing.num_tokens, routing.topk):
        raise InputError(f"{who}: topk_weights must be [{routing.num_tokens}, {routing.topk}], got {list(wts.shape)}")
    hs, w2s = _ranks(f"{who}: h_slices", h_slices, 2), _ranks(f"{who}: w2_slices", w2_slices, 3)
    if len(hs) != len(w2s):
        raise InputError(f"{who}: {len(hs)} h slices but {len(w2s)} w2 slices")
    row_of = routing.row_of
    out = 0
    for h, w2 in zip(hs, w2s):
        _experts_held(who, "w2", w2, routing)
        if h.shape != (routing.num_rows, w2.shape[1]):
            raise InputError(f"{who}: h must be [{routing.num_rows}, {w2.shape[1]}], got {list(h.shape)}")
        y = np.zeros((h.shape[0], w2.shape[2]), np.float32)
        for i, e in enumerate(routing.tile_expert):
            if e >= 0:
                rows = slice(i * routing.block_m, (i + 1) * routing.block_m)
                y[rows] = h[rows] @ w2[e]
        out = out + np.einsum("tk,tkn->tn", wts, y[row_of])
    return out


def reference_moe(x_shards, w1_slices, w2_slices, topk_ids, topk_weights, activation=None):
    """numpy: the whole tensor-parallel MoE layer from scratch (no tables): for every token,
    ``sum_k weight * act(x @ W1[e]) @ W2[e]`` with ``W1``/``W2`` the ranks' slices joined
    along the intermediate dimension. ``[T, K]`` (fp32). Ids outside ``[0, E)`` are refused as
    :func:`moe_routing` refuses them."""
    who = "reference_moe"
    xs = _ranks(f"{who}: x_shards", x_shards, 2)
    w1s, w2s = _ranks(f"{who}: w1_slices", w1_slices, 3), _ranks(f"{who}: w2_slices", w2_slices, 3)
    try:
        x, w1, w2 = (np.concatenate(xs, axis=0), np.concatenate(w1s, axis=2), np.concatenate(w2s, axis=1))
    except ValueError as e:
        raise InputError(f"{who}: the shards and slices do not join (x [Ms, K], w1 [E, K, Nr], w2 [E, Nr, K] "
                         f"on every rank): {e}") from None
    E = w1.shape[0]
    if w1.shape[1] != x.shape[1] or w2.shape[:2] != (E, w1.shape[2]):
        raise InputError(f"{who}: x [T, K], w1 [E, K, Nr] and w2 [E, Nr, K] joined, got {list(x.shape)}, "
                         f"{list(w1.shape)} and {list(w2.shape)}")
    act = activation or (lambda v: v)
    ids = expert_ids(who, topk_ids, E, x.shape[0], "the tokens of x_shards")
    wts = host_float32(f"{who}: topk_weights", topk_weights, 2)
    if wts.shape != ids.shape:
        raise InputError(f"{who}: topk_weights must be {list(ids.shape)} (topk_ids' shape), got {list(wts.shape)}")
    out = np.zeros((x.shape[0], w2.shape[2]), np.float32)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = ids[t, k]
            out[t] += wts[t, k] * (act(x[t] @ w1[e]) @ w2[e])
    return out


# -- host side: run a layer on the simulator ---------------------------------------------------------

def _float_arrays(name, arrays) -> None:
    """The activations an MoE layer multiplies: float16, bfloat16 (torch tensors) or float32
    (refused before the outputs are poisoned with NaN, which another dtype cannot hold)."""
    try:
        ok = tl.TensorSpec.of(arrays[0], f"{name}[0]").dtype.is_float
    except InputError:                  # a dtype no tile program holds (float64, complex, ...)
        ok = False
    if not ok:
        raise InputError(f"{name}: float16, bfloat16 or float32 arrays, got {arrays[0].dtype}")


def _per_rank(name, arrays, W):
    if not isinstance(arrays, (list, tuple)):
        raise InputError(f"{name}: one array per rank (a list of {W}), got {type(arrays).__name__}")
    arrays = list(arrays)
    if len(arrays) != W:
        raise InputError(f"{name}: got {len(arrays)} arrays for {W} ranks")
    return [host_operand(a) for a in arrays]         # torch tensors kept: tl.simulate takes them (bf16 too)


def simulate_allgather_moe(x_shards, w1_slices, topk_ids, *, compute=None, comm=None, seed: int = 0,
                           options=None, weights: str = "kn"):
    """AllGather+MoE on the simulator: route on the host (:func:`moe_routing`), run
    :func:`allgather_moe` on ``len(x_shards)`` ranks and return ``(routing, [h of every rank])``.

    ``x_shards``: one ``[Ms, K]`` token shard per rank; ``w1_slices``: one ``[E, K, Nr]`` per
    rank (``weights="nk"``: ``[E, Nr, K]``, a stack of torch Linear weights); ``topk_ids``:
    ``[W * Ms, topk]``."""
    if not isinstance(x_shards, (list, tuple)) or not x_shards:
        raise InputError(f"simulate_allgather_moe: x_shards must be one [Ms, K] token shard per rank (a non-empty "
                         f"list), got {type(x_shards).__name__}{' (empty)' if isinstance(x_shards, (list, tuple)) else ''}")
    W = len(x_shards)
    xs = [host_operand(x) for x in x_shards]
    w1 = _per_rank("simulate_allgather_moe: w1_slices", w1_slices, W)
    check_weight_layout("simulate_allgather_moe", weights)
    form = "[E, Nr, K]" if weights == "nk" else "[E, K, Nr]"
    if xs[0].ndim != 2 or w1[0].ndim != 3:
        raise InputError(f"simulate_allgather_moe: x shards must be [Ms, K] and w1 slices {form}, got "
                         f"{list(xs[0].shape)} and {list(w1[0].shape)}")
    _float_arrays("simulate_allgather_moe: x_shards", xs)
    compute, comm = allgather_moe.default_schedules(compute=compute, comm=comm)
    rt = moe_routing(topk_ids, w1[0].shape[0], W, xs[0].shape[0], compute.BM)
    Nr = w1[0].shape[1 if weights == "nk" else 2]
    inputs = [dict(x=xs[r], w1=w1[r], h=nan_like(xs[r], (rt.num_rows, Nr)), **rt.allgather_tables())
              for r in range(W)]
    res = tl.simulate(allgather_moe, W, inputs, seed=seed, options=options, compute=compute, comm=comm,
                      weights=weights)
    return rt, [res[r]["h"] for r in range(W)]


def simulate_moe_reduce_scatter(h_slices, w2_slices, topk_weights, routing: MoERouting, *, compute=None,
                                comm=None, seed: int = 0, options=None, partial_dtype: str = "f32",
                                weights: str = "kn"):
    """MoE+ReduceScatter on the simulator: run :func:`moe_reduce_scatter` with the tables of
    ``routing`` and return every rank's ``out [Ms, K]``. ``compute.BM`` must be the block
    the routing was built for; ``partial_dtype`` and ``weights`` (w2 slices ``[E, Nr, K]``, or
    ``"nk"``: ``[E, K, Nr]``) as :func:`moe_reduce_scatter` takes them."""
    if not isinstance(routing, MoERouting):
        raise InputError(f"simulate_moe_reduce_scatter: routing must come from moe_routing, got "
                         f"{type(routing).__name__}")
    W = routing.world_size
    hs = _per_rank("simulate_moe_reduce_scatter: h_slices", h_slices, W)
    w2 = _per_rank("simulate_moe_reduce_scatter: w2_slices", w2_slices, W)
    _float_arrays("simulate_moe_reduce_scatter: h_slices", hs)
    compute, comm = moe_reduce_scatter.default_schedules(compute=compute, comm=comm)
    if compute.BM != routing.block_m:
        raise InputError(f"simulate_moe_reduce_scatter: the routing was built for BM={routing.block_m}, "
                         f"the compute tile has BM={compute.BM}")
    wts = host_operand(topk_weights)
    if tuple(wts.shape) != (routing.num_tokens, routing.topk):
        raise InputError(f"simulate_moe_reduce_scatter: topk_weights must be [{routing.num_tokens}, "
                         f"{routing.topk}] like the routing, got {list(wts.shape)}")
    check_weight_layout("simulate_moe_reduce_scatter", weights)
    if w2[0].ndim != 3:
        raise InputError(f"simulate_moe_reduce_scatter: w2 slices must be "
                         f"{'[E, K, Nr]' if weights == 'nk' else '[E, Nr, K]'}, got {list(w2[0].shape)}")
    if w2[0].shape[0] != routing.num_experts:
        raise InputError(f"simulate_moe_reduce_scatter: the routing has {routing.num_experts} experts but the "
                         f"w2 slices hold {w2[0].shape[0]}")
    K = w2[0].shape[1 if weights == "nk" else 2]
    inputs = [dict(h=hs[r], w2=w2[r], topk_weights=wts,
                   out=nan_like(hs[r], (routing.rows_per_rank, K)), **routing.reduce_scatter_tables())
              for r in range(W)]
    res = tl.simulate(moe_reduce_scatter, W, inputs, seed=seed, options=options, compute=compute, comm=comm,
                      partial_dtype=partial_dtype, weights=weights)
    return [res[r]["out"] for r in range(W)]


# -- registration for the tests ----------------------------------------------------------------------

ROUTINGS = ("random", "concentrated")


def random_routing(rng, num_tokens: int, num_experts: int, topk: int, kind: str = "random"):
    """Test routings: ``topk`` distinct experts per token and positive weights.

    ``random``: tokens choose among a random subset of at least ``topk`` experts (so some
    experts usually get no token); ``concentrated``: every token picks the same ``topk``
    experts (with ``topk=1``, all tokens go to one expert)."""
    E = num_experts
    if not 1 <= topk <= E:
        raise InputError(f"random_routing: need 1 <= topk <= num_experts, got topk={topk}, E={E}")
    if kind == "random":
        active = rng.choice(E, int(rng.integers(topk, E + 1)), replace=False)
        ids = np.stack([rng.choice(active, topk, replace=False) for _ in range(num_tokens)])
    elif kind == "concentrated":
        ids = np.tile(rng.choice(E, topk, replace=False), (num_tokens, 1))
    else:
        raise InputError(f"random_routing: unknown kind {kind!r}, choose one of {ROUTINGS}")
    weights = rng.random((num_tokens, topk)).astype(np.float32) + 0.05
    weights /= weights.sum(axis=1, keepdims=True)
    return ids.astype(np.int32), weights


def make_allgather_case(rng, world_size, *, rows_per_rank, k, n, num_experts, topk, compute, comm,
                        routing="random", dtype="float16", stage_rows=False):
    W, Ms, E = world_size, rows_per_rank, num_experts
    ids, _ = random_routing(rng, W * Ms, E, topk, routing)
    rt = moe_routing(ids, E, W, Ms, compute.BM)
    xs = [rng.standard_normal((Ms, k)).astype(dtype) for _ in range(W)]
    w1 = [rng.standard_normal((E, k, n)).astype(dtype) for _ in range(W)]
    inputs = [dict(x=xs[r], w1=w1[r], h=np.full((rt.num_rows, n), np.nan, dtype), **rt.allgather_tables())
              for r in range(W)]
    expected = [{"h": reference_allgather_moe(xs, w1[r], rt)} for r in range(W)]
    return OpCase(inputs, expected, {"compute": compute, "comm": comm, "stage_rows": stage_rows},
                  rtol=2e-2, atol=2e-2 * max(1.0, np.sqrt(k) / 4),
                  description=f"allgather_moe W={W} x=[{Ms}, {k}] w1=[{E}, {k}, {n}] topk={topk} "
                              f"{routing} routing (experts {rt.expert_counts.tolist()}) {compute} {comm}"
                              + (" rows staged" if stage_rows else ""))


def make_reduce_scatter_case(rng, world_size, *, rows_per_rank, k, n, num_experts, topk, compute, comm,
                             routing="random", dtype="float16", partial_dtype="f32"):
    W, Ms, E = world_size, rows_per_rank, num_experts
    ids, wts = random_routing(rng, W * Ms, E, topk, routing)
    rt = moe_routing(ids, E, W, Ms, compute.BM)
    hs = [rng.standard_normal((rt.num_rows, n)).astype(dtype) for _ in range(W)]
    w2 = [rng.standard_normal((E, n, k)).astype(dtype) for _ in range(W)]
    inputs = [dict(h=hs[r], w2=w2[r], topk_weights=wts, out=np.full((Ms, k), np.nan, dtype),
                   **rt.reduce_scatter_tables()) for r in range(W)]
    ref = reference_moe_reduce_scatter(hs, w2, wts, rt)
    expected = [{"out": ref[r * Ms:(r + 1) * Ms]} for r in range(W)]
    return OpCase(inputs, expected, {"compute": compute, "comm": comm, "partial_dtype": partial_dtype},
                  rtol=2e-2, atol=2e-2 * max(1.0, np.sqrt(W * n) / 4),
                  description=f"moe_reduce_scatter W={W} h=[{rt.num_rows}, {n}] w2=[{E}, {n}, {k}] "
                              f"out=[{Ms}, {k}] topk={topk} {routing} routing "
                              f"(experts {rt.expert_counts.tolist()}) {compute} {comm} partial {partial_dtype}")


def _params(engines, staged=False, partials=False):
    def params_for(world_size):
        from hypothesis import strategies as st
        from tldsl.testing import strategies as tst

        # every rank works on all W * Ms tokens, so the simulated work grows with W^2 * Ms: cap
        # Ms so that the largest draws (8x8x8 tiles, topk=3, K=N=24) simulate in ~0.2 s
        max_rows = min(12, max(1, 96 // (world_size * world_size)))

        @st.composite
        def params(draw):
            compute = draw(tst.compute_schedules())
            E = draw(st.integers(1, 6))
            return dict(rows_per_rank=draw(tst.dims(1, max_rows)), k=draw(tst.dims(1, 24)), n=draw(tst.dims(1, 24)),
                        num_experts=E, topk=draw(st.integers(1, min(3, E))),
                        routing=draw(st.sampled_from(ROUTINGS)), compute=compute,
                        comm=draw(tst.comm_schedules(engines=engines, compute=compute)),
                        **({"stage_rows": draw(st.booleans())} if staged else {}),
                        **({"partial_dtype": draw(st.sampled_from(PARTIAL_DTYPES))} if partials else {}))
        return params()
    return params_for


def _allgather_mutant_params():
    c = tl.ComputeSchedule(tile=(8, 16, 16))
    base = dict(world_size=3, rows_per_rank=7, k=20, n=24, num_experts=5, topk=2, compute=c)
    return [dict(base, comm=tl.CommSchedule(tile_m=8, mode="pull")),
            dict(base, comm=tl.CommSchedule(tile_m=8, mode="push", order="full_mesh")),
            dict(base, comm=tl.CommSchedule(engine="copy_engine", mode="pull")),
            dict(base, comm=tl.CommSchedule(engine="copy_engine", mode="push")),
            # the rows staged in two column chunks (64 + 8): a dropped chunk, count or wait shows
            dict(base, k=72, comm=tl.CommSchedule(tile_m=8, mode="pull"), stage_rows=True)]


def _reduce_scatter_mutant_params():
    # rows_per_rank is a multiple of BM: no combine tile spans two reduce-scatter segments, so
    # no wait of the reduce-scatter guards rows an earlier wait of the same task already ordered
    c = tl.ComputeSchedule(tile=(8, 16, 16), order="comm_aligned")
    base = dict(rows_per_rank=8, k=20, n=24, num_experts=5, topk=2, compute=c)
    return [dict(base, world_size=3, comm=tl.CommSchedule(tile_m=8, order="ring", mode="push")),
            dict(base, world_size=4, comm=tl.CommSchedule(tile_m=None, order="ring", mode="pull")),
            dict(base, world_size=3, comm=tl.CommSchedule(tile_m=8, order="full_mesh", mode="push")),
            dict(base, world_size=2, comm=tl.CommSchedule(tile_m=None, order="full_mesh", mode="pull"))]


AG_SPEC = register(OpSpec("allgather_moe", allgather_moe, make_allgather_case, _params(("sm", "copy_engine"), True),
                          _allgather_mutant_params(),
                          doc="h = grouped GEMM of all_gather(x) rows sorted by expert, with w1[expert]"))
RS_SPEC = register(OpSpec("moe_reduce_scatter", moe_reduce_scatter, make_reduce_scatter_case,
                          _params(("sm",), partials=True),
                          _reduce_scatter_mutant_params(),
                          doc="out = reduce_scatter(top-k combine(grouped GEMM of h with w2[expert]))"))
