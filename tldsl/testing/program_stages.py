"""The parts a generated program is made of: one function per kind of compute stage (elementwise,
GEMM, row reduction, softmax, gather, scatter-add). Each adds one part to a :class:`.program_gen.ProgramGenerator`,
reading 2-d tensors it is given and writing an output it is given or makes. A stage that reads
another part's output is given ``waits`` (emits the waits for rows ``[r0, r0 + rows)``); one that
feeds another part is given ``notify`` (emits the notifies after its stores)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from .program_gen import ProgramGenerator, broadcast_shape, pow2_at_least, promote, cdiv, chance, weighted
from .program_tree import (AddRows, Assign, Binary, Broadcast, Call, Cast, Dot, DynamicMappingDecl, Expr, ExpandDims,
                           FragRead, Fragment, Iota, Load, LoadRows, Loop, Reduce, SignalDecl, Trans, Unary, Update,
                           When, Where)

Waits = Callable[..., None]   # (stmts, r0, rows[, cols]): cols, the end of the columns a task reads (None: all)
Notify = Callable[[list, "Tiling"], None]         # (stmts, how the producer cut its output)


@dataclass(frozen=True)
class Tensor:
    """A 2-d tensor a stage reads: an argument or a workspace. ``exact``: its contents are the
    same bits on every backend (inputs and copies of them, integer results), so comparisons on
    them take the same branch everywhere."""
    name: str
    shape: tuple[int, int]
    dtype: str
    exact: bool = True


@dataclass(frozen=True)
class Tiling:
    """How a stage cut its output: ``BM`` x ``BN`` tiles, a ``gm`` x ``gn`` grid (program ids ``pm``,
    ``pn``), and whether each task loops over the columns (one task, no ``pn``, per row block)."""
    BM: int
    BN: int
    gm: int
    gn: int
    col_loop: bool
    each_column: bool = False     # a looping task notifies after each column tile, in column order

    @property
    def notifies_per_row_block(self) -> int:
        return 1 if self.col_loop and not self.each_column else self.gn


def fit(value: Expr, shape, dtype: str | None) -> Expr:
    """``value`` as a store into a ``dtype`` tensor takes it: the tile's full shape, ints made float."""
    if value.shape != tuple(shape):
        value = Broadcast(shape=tuple(shape), dtype=value.dtype, bound=value.bound, exact=value.exact, x=value)
    if dtype is not None and dtype != "i32" and value.dtype == "i32":
        value = Cast(shape=value.shape, dtype="f32", bound=value.bound, exact=True, x=value)
    return value


def using(value: Expr, leaf: Expr) -> Expr:
    """``value``, plus ``leaf`` where the random tree left out the tile the stage is about."""
    if re.search(rf"(?<!\w){re.escape(leaf.src())}(?!\w)", value.src()):
        return value
    return Binary(shape=broadcast_shape(value.shape, leaf.shape), dtype=promote(value.dtype, leaf.dtype),
                  bound=value.bound + leaf.bound, exact=False, op="add", a=value, b=leaf)


def normalised(value: Expr) -> Expr:
    """``value`` scaled by a power of two into [-1, 1] (what a workspace feeding a GEMM holds)."""
    if value.bound <= 1 or value.dtype == "i32":
        return value
    scale = 1.0 / pow2_at_least(int(value.bound + 0.999))
    return Binary(shape=value.shape, dtype=value.dtype, bound=1.0, exact=value.exact, op="mul", a=value, b=scale)


def output(g: ProgramGenerator, shape, value: Expr, out: Tensor | None) -> Tensor:
    """Where a stage stores: ``out`` when given, else a new output argument typed like ``value``."""
    if out is not None:
        return out
    dtype = "i32" if value.dtype == "i32" else g.float_dtype()
    return Tensor(g.arg(shape, dtype, "output"), tuple(shape), dtype)


def ewise(g: ProgramGenerator, reads: list[Tensor], out: Tensor | None = None, *, role="compute",
          tile=None, waits: Waits | None = None, notify: Notify | None = None) -> tuple[Tensor, Tiling]:
    """``out = f(reads...)`` elementwise, tile by tile (a 2-d grid, or a grid of rows whose tasks
    loop over the columns with ``tl.range``)."""
    ch = g.ch
    R, C = reads[0].shape
    BM, BN = tile or (g.tile(), g.tile())
    col_loop = chance(ch, 35)
    stmts: list = [Assign("r0", f"pm * {BM}")]
    if waits:
        waits(stmts, "r0", BM, None if col_loop else f"pn * {BN} + {BN}")
    body: list = [] if col_loop else [Assign("c0", f"pn * {BN}")]
    leaves = g.tile_leaves(body, {t.name: (t.shape, t.dtype, t.exact) for t in reads}, "r0", "c0", BM, BN,
                           reads[0].dtype)
    value = using(g.tree(leaves, ch.integer(1, 3)), leaves[0])
    if notify:
        value = normalised(value)
    out = output(g, (R, C), value, out)
    value = fit(value, (BM, BN), out.dtype)
    guards = None
    if chance(ch, 25):          # tl.when: two kinds of tasks, each element still stored once
        guards = ch.choice(((f"c0 + {BN} <= {C}", f"c0 + {BN} > {C}"), ("r0 % 32 == 0", "r0 % 32 != 0")))
        keep, g.keep_int = g.keep_int, out.dtype == "i32"        # an i32 tensor takes integer tiles only
        alternative = fit(g.tree(leaves, 1), (BM, BN), out.dtype)
        g.keep_int = keep
        if notify:
            alternative = normalised(alternative)
        g.store(body, out.name, ("r0", "c0"), value, guards, alternative)
    else:
        g.store(body, out.name, ("r0", "c0"), value)
    # a looping task that notifies after each column tile: a consumer of its first columns waits for
    # fewer notifies than the row block gets (ordered after those only: the column order keeps it right)
    each_column = bool(notify) and col_loop and chance(ch, 50)
    tiling = Tiling(BM, BN, cdiv(R, BM), cdiv(C, BN), col_loop, each_column)
    if each_column:
        notify(body, tiling)
    if col_loop:
        stmts.append(Loop("c0", "0", str(C), str(BN), tuple(body)))
    else:
        stmts += body
    if notify and not each_column:
        notify(stmts, tiling)
    g.part(role, (tiling.gm,) if col_loop else (tiling.gm, tiling.gn), ("pm",) if col_loop else ("pm", "pn"), stmts,
           row_tile=BM)
    return out, tiling


def gemm(g: ProgramGenerator, a: Tensor, out: Tensor | None = None, *, role="compute", tile=None,
         waits: Waits | None = None, notify: Notify | None = None, mainloop: bool = False) -> tuple[Tensor, Tiling]:
    """``out = epilogue(a @ b)``: a K loop of ``tl.dot`` into a fragment (``tl.range``, unrolled with
    ``tl.static_range``, or one dot), ``b`` loaded as is or transposed, operands in fp16, bf16 or
    fp32 (a TF32 dot on the GPU); ``mainloop``: shaped for the general path's pipelined K loop
    (:mod:`tldsl.codegen.plan.dot_loop`) where ``a`` is 16-bit."""
    ch = g.ch
    R, K = a.shape
    # ``mainloop``: shaped for the general path's pipelined K loop — 64-multiple tiles, 16-bit
    # operands loaded as they are (no cast, no transpose)
    mainloop = mainloop and tile is None and a.dtype in ("f16", "bf16")
    BM, BN = tile or ((64, ch.choice((64, 128))) if mainloop else (ch.choice((16, 32, 64)), ch.choice((16, 32))))
    BK = 64 if mainloop else ch.choice((16, 32))
    g.dot_tiles.append((BM, BN, BK))
    N = out.shape[1] if out is not None else g.extent(BN)
    if mainloop and out is None and chance(ch, 60):
        N = -(-N // 8) * 8                  # rows of 16-byte multiples: TMA stages (else cp.async)
    op_dtype = a.dtype if mainloop else ("bf16" if a.dtype == "bf16" or chance(ch, 30) else a.dtype)
    b_dtype = a.dtype if a.dtype != "bf16" or mainloop else g.float_dtype()
    transposed = not mainloop and chance(ch, 35)
    b = g.arg((N, K) if transposed else (K, N), b_dtype)
    kind = "range" if mainloop else weighted(ch, {"range": 60, "static": 20, "single": 20})
    if kind == "static" and cdiv(K, BK) > 3:
        kind = "range"
    if kind == "single" and K > BK:
        kind = "range" if chance(ch, 70) else "static"

    def operand(stmts, name, dtype, offsets, box, trans):
        t: Expr = Load(shape=box, dtype=dtype, exact=True, tensor=name, offsets=offsets, box=box)
        if trans:
            t = Trans(shape=box[::-1], dtype=dtype, exact=True, x=t)
        if dtype != op_dtype:
            t = Cast(shape=t.shape, dtype=op_dtype, exact=True, x=t, method=chance(ch, 50))
        return g.bind(stmts, t, "op")

    stmts: list = [Assign("r0", f"pm * {BM}"), Assign("c0", f"pn * {BN}")]
    if waits:
        waits(stmts, "r0", BM)

    def dot_step(stmts, k):
        ta = operand(stmts, a.name, a.dtype, ("r0", k), (BM, BK), False)
        tb = operand(stmts, b, b_dtype, ("c0", k) if transposed else (k, "c0"),
                     (BN, BK) if transposed else (BK, BN), transposed)
        return Dot(shape=(BM, BN), dtype="f32", bound=float(K), a=ta, b=tb)

    if kind == "single":
        acc: Expr = g.bind(stmts, dot_step(stmts, "0"), "acc")
    else:
        stmts.append(Fragment("acc", (BM, BN), "f32"))
        body: list = []
        body.append(Update("acc", dot_step(body, "k")))
        if kind == "static":
            stmts.append(Loop("k", "0", str(K), str(BK), tuple(body), static=True))
        else:
            stmts.append(Loop("k", "0", str(K), str(BK), tuple(body)))
        acc = FragRead(shape=(BM, BN), dtype="f32", bound=float(K), name="acc")
    leaves = [acc]
    if chance(ch, 40):
        bias = g.arg((N,), g.float_dtype())
        t = Load(shape=(BN,), dtype=g.args[-1].dtype, exact=True, tensor=bias, offsets=("c0",), box=(BN,))
        leaves.append(g.bind(stmts, ExpandDims(shape=(1, BN), dtype=t.dtype, exact=True, x=t, axis=0,
                                               indexing=True), "bias"))
    value = using(g.tree(leaves, ch.integer(0, 2)), acc) if chance(ch, 70) else acc
    if notify:
        value = normalised(value)
    out = output(g, (R, N), value, out)
    g.store(stmts, out.name, ("r0", "c0"), fit(value, (BM, BN), out.dtype))
    tiling = Tiling(BM, BN, cdiv(R, BM), cdiv(N, BN), False)
    if notify:
        notify(stmts, tiling)
    g.part(role, (tiling.gm, tiling.gn), ("pm", "pn"), stmts, row_tile=BM)
    return out, tiling


REDUCE_FILL = {("sum", "f32"): 0.0, ("max", "f32"): -1.0e30, ("min", "f32"): 1.0e30,
               ("sum", "i32"): 0, ("max", "i32"): -(2 ** 30), ("min", "i32"): 2 ** 30}


def row_reduce(g: ProgramGenerator, src: Tensor, *, waits: Waits | None = None) -> Tensor:
    """``out[r] = reduce_k f(src[r, k])`` over column tiles: a fragment updated in a ``tl.range``
    loop, unrolled, or running to a per-row-block count read with ``tl.load_scalar``."""
    ch = g.ch
    R, K = src.shape
    BM, BK = g.tile(), g.tile()
    fn = ch.choice(("sum", "max", "min"))
    kind = weighted(ch, {"range": 50, "static": 20, "counted": 30})
    if kind == "static" and cdiv(K, BK) > 3:
        kind = "range"
    stmts: list = [Assign("r0", f"pm * {BM}")]
    if waits:
        waits(stmts, "r0", BM)
    body: list = []
    if kind == "counted":
        body.append(Assign("k", f"kb * {BK}"))
    t = g.bind(body, Load(shape=(BM, BK), dtype=src.dtype, exact=src.exact, tensor=src.name, offsets=("r0", "k"),
                          box=(BM, BK)))
    f = g.tree([t], ch.integer(0, 1))
    red = Reduce(shape=(BM,), dtype=f.dtype, bound=f.bound * (K if fn == "sum" else 1), fn=fn, x=f, axis=1)
    acc_dtype = "i32" if f.dtype == "i32" else "f32"
    acc = FragRead(shape=(BM,), dtype=acc_dtype, bound=red.bound, name="acc")
    if fn == "sum":
        body.append(Update("acc", red))
    else:
        body.append(Update("acc", Binary(shape=(BM,), dtype=acc_dtype, bound=red.bound, op=fn, a=acc, b=red),
                           add=False))
    stmts.append(Fragment("acc", (BM,), acc_dtype, REDUCE_FILL[fn, acc_dtype]))
    if kind == "counted":
        tab = g.arg((cdiv(R, BM),), "i32", "table", low=1, high=cdiv(K, BK) + 1)
        stmts.append(Assign("nk", table_read(g, tab, cdiv(R, BM), "count")))
        stmts.append(Loop("kb", "0", "nk", "1", tuple(body)))
    else:
        stmts.append(Loop("k", "0", str(K), str(BK), tuple(body), static=kind == "static"))
    value = g.tree([acc], 1) if acc_dtype == "f32" and chance(ch, 40) else acc
    out = output(g, (R,), value, None)
    g.store(stmts, out.name, ("r0",), fit(value, (BM,), out.dtype))
    g.part("compute", (cdiv(R, BM),), ("pm",), stmts, row_tile=BM)
    return out


def softmax(g: ProgramGenerator, src: Tensor, out: Tensor | None = None, *, role="compute",
            waits: Waits | None = None, notify: Notify | None = None) -> tuple[Tensor, Tiling]:
    """A row softmax of ``f(src)`` with the whole row in one tile (padding columns read as zero and
    take part, on every backend alike)."""
    ch = g.ch
    R, C = src.shape
    # one row a task at times: the general lowering's held rows, whose max and sum every thread holds
    BM, BC = (1 if chance(ch, 30) else g.tile()), pow2_at_least(C)
    stmts: list = [Assign("r0", f"pm * {BM}")]
    if waits:
        waits(stmts, "r0", BM)
    t = g.bind(stmts, Load(shape=(BM, BC), dtype=src.dtype, exact=src.exact, tensor=src.name, offsets=("r0", "0"),
                           box=(BM, BC)))
    x = g.bind(stmts, normalised(g.tree([t], ch.integer(0, 1))), "x") if chance(ch, 50) else t
    if x.dtype == "i32":
        x = g.bind(stmts, Cast(shape=x.shape, dtype="f32", bound=x.bound, exact=True, x=x), "x")
    m = g.bind(stmts, Reduce(shape=(BM,), dtype=x.dtype, bound=x.bound, fn="max", x=x, axis=1), "m")
    shifted = Binary(shape=(BM, BC), dtype=x.dtype, bound=2 * x.bound, op="sub", a=x,
                     b=ExpandDims(shape=(BM, 1), dtype=x.dtype, x=m, axis=1, indexing=True))
    e = g.bind(stmts, Unary(shape=(BM, BC), dtype=x.dtype, fn="exp", x=shifted), "e")
    s = g.bind(stmts, Reduce(shape=(BM,), dtype=x.dtype, bound=float(BC), fn="sum", x=e, axis=1), "s")
    value = Binary(shape=(BM, BC), dtype=x.dtype, op="div", a=e,
                   b=ExpandDims(shape=(BM, 1), dtype=x.dtype, x=s, axis=1, indexing=False))
    out = output(g, (R, C), value, out)
    g.store(stmts, out.name, ("r0", "0"), value)
    tiling = Tiling(BM, BC, cdiv(R, BM), 1, True)
    if notify:
        notify(stmts, tiling)
    g.part(role, (tiling.gm,), ("pm",), stmts, row_tile=BM)
    return out, tiling


def table_read(g: ProgramGenerator, table: str, tiles: int, key: str) -> str:
    """This task's entry of an i32 table: ``tl.load_scalar``, or a ``tl.DynamicMapping`` over it."""
    if chance(g.ch, 60):
        return f"tl.load_scalar({table}, (pm,))"
    name = g.fresh("tiles")
    g.decls.append(DynamicMappingDecl(name, tiles, key, table))
    return f'{name}["{key}", pm]'


def attention(g: ProgramGenerator, staged: bool = False) -> Tensor:
    """A flash-attention part, the shape the attention recipe lowers
    (:mod:`tldsl.codegen.match.attention`): per head and query block, an online softmax over key
    blocks of ``NS`` pieces of ``L`` key rows each (``tl.load_rows``, rows past a piece's end -1),
    optionally causal (query positions offset into the keys; key blocks past the last query
    skipped, or only masked), scaled or not, MHA or grouped-query heads; fp16 or bf16, head dim and
    blocks the recipe's (D 16-128, BM 64 or 128, BN 16-128). Written as a user would write it,
    statement by statement. ``staged``: the keys and values come from workspaces a producer part
    fills row tile by row tile, each key block waiting for the tiles over its rows (the waits of
    sequence-parallel attention, whose keys arrive from the other ranks)."""
    ch = g.ch
    D = ch.choice((16, 32, 64, 128))
    BM, BN = ch.choice((64, 128)), ch.choice((16, 32, 64, 128))
    H = ch.integer(1, 4)
    G = ch.choice([d for d in range(1, H + 1) if H % d == 0])     # query heads per key/value head
    Sq, L, NS = ch.integer(1, 2 * BM), ch.integer(1, 2 * BN), ch.integer(1, 2)
    causal = chance(ch, 50)
    skip = causal and chance(ch, 60)                     # key blocks after the block's last query skipped
    off = ch.integer(0, NS * L) if causal else 0          # position of query row 0 among the keys
    scale = ch.choice((None, 1.0 / D ** 0.5, 0.125))
    dt = g.half_dtype()
    q = g.arg((Sq, H * D), dt)
    k = g.arg((NS * L, H // G * D), dt)
    v = g.arg((NS * L, H // G * D), dt)
    o = g.arg((Sq, H * D), dt, "output")
    A = Assign
    waits: tuple = ()
    if staged:
        BP, cols, sig = ch.choice((8, 16, 32)), H // G * D, g.fresh("ready")
        kw, vw = g.workspace((NS * L, cols), dt), g.workspace((NS * L, cols), dt)
        g.decls.append(SignalDecl(sig, cdiv(NS * L, BP)))
        g.part(weighted(ch, {"compute": 60, "comm": 40}), (cdiv(NS * L, BP),), ("pm",),
               (A("r0", f"pm * {BP}"), Call("store", (kw, "(r0, 0)", f"tl.load({k}, (r0, 0), ({BP}, {cols}))")),
                Call("store", (vw, "(r0, 0)", f"tl.load({v}, (r0, 0), ({BP}, {cols}))")),
                Call("producer_tile_notify", (sig, "pm"))), row_tile=BP)
        k, v = kw, vw
        waits = (Loop("w", f"r0 // {BP}", f"tl.cdiv(tl.minimum(r0 + {BN}, base + {L}), {BP})", "1",
                      (Call("consumer_tile_wait", (sig, "w")),)),)
    stmts: list = [A("q0", f"pm * {BM}"), A("c0", f"h * {D}"), A("kc0", f"h // {G} * {D}" if G > 1 else "c0")]
    if causal:
        stmts += [A("q_pos", f"tl.iota({BM}) + ({off} + q0)"), A("last_q", f"{off} + tl.minimum(q0 + {BM}, {Sq}) - 1")]
    stmts += [A("qt", f"tl.load({q}, (q0, c0), ({BM}, {D}))"), A("j", f"tl.iota({BN})"),
              Fragment("m", (BM,), "f32", fill=-1.0e30), Fragment("l_sum", (BM,), "f32"),
              Fragment("acc", (BM, D), "f32")]
    mask = "in_shard[None, :]" + (" & ((j + r0)[None, :] <= q_pos[:, None])" if causal else "")
    scaled = "tl.dot(qt, tl.trans(kt))" + (f" * {scale!r}" if scale is not None else "")
    block = (A("r0", f"base + kb"), *waits, A("in_shard", f"(j + kb) < {L}"),
             A("rows", "tl.where(in_shard, j + r0, -1)"),
             A("kt", f"tl.load_rows({k}, rows, kc0, {D})"), A("vt", f"tl.load_rows({v}, rows, kc0, {D})"),
             A("mask", mask), A("sc", f"tl.where(mask, {scaled}, -1.0e30)"), A("m_old", "m[...]"),
             A("m_new", "tl.maximum(m_old, tl.max(sc, 1))"), A("alpha", "tl.exp(m_old - m_new)"),
             A("p", "tl.where(mask, tl.exp(sc - m_new[:, None]), 0.0)"),
             A("l_sum[...]", "l_sum[...] * alpha + tl.sum(p, 1)"),
             A("acc[...]", "acc[...] * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)"), A("m[...]", "m_new"))
    hi = f"tl.minimum(tl.maximum(last_q + 1 - base, 0), {L})" if skip else str(L)
    stmts.append(Loop("s", "0", str(NS), "1", (A("base", f"s * {L}"), A("hi", hi),
                                                Loop("kb", "0", "hi", str(BN), block))))
    stmts += [A("denom", "l_sum[...]"), A("denom", "tl.where(denom > 0.0, denom, 1.0)"),
              Call("store", (o, "(q0, c0)", "acc[...] / denom[:, None]"))]
    g.part("compute", (H, cdiv(Sq, BM)), ("h", "pm"), stmts)
    return Tensor(o, (Sq, H * D), dt, exact=False)


def grouped_gemm(g: ProgramGenerator, src: Tensor | None = None, *, waits: Waits | None = None,
                 adds: bool = False) -> Tensor:
    """A grouped GEMM over run-time tile tables, the MoE expert GEMMs' shape (what the grouped GEMM
    recipe lowers): row tile ``pm`` of A — dense, or gathered by per-row ids (``tl.load_rows``,
    negative ids read zero rows) — times the weights ``w[e]`` of the expert a table names (-1: an
    unused tile, its K loop skipped under ``tl.when``), in fp16 or bf16 on an f32 fragment, stored whole or
    with its rows past a table's valid count as zeros, inside or after the guard. WGMMA tiles
    (BM 64 or 128); K and N mostly multiples of 8 (TMA's 16-byte rows; else the general recipe
    takes it). ``src``: another part's f16 or bf16 output as A (``waits``, inside the guard, then wait for
    the task's rows), else a new input. ``adds``: each row, times a per-row f32 factor or not, added into
    the row a table names of a 16-bit tensor holding values of its own (``tl.add_rows``: the MoE combine
    in the epilogue), A dense and 16-byte rows (what the recipe adds rows for)."""
    ch = g.ch
    BM, BN, BK = ch.choice((64, 128)), ch.choice((64, 128, 256)), ch.choice((32, 64))
    g.recipe_tile = (BM, BN, BK)        # the grouped GEMM recipe takes a part at its schedule's tile only
    E = ch.integer(1, 4)
    aligned = adds or chance(ch, 85)

    def multiple_of_8(n: int) -> int:
        return -(-n // 8) * 8 if aligned else n
    if src is None:
        R, K = ch.integer(1, 3 * BM), multiple_of_8(ch.integer(1, 3 * BK))
    else:
        R, K = src.shape
    N = multiple_of_8(ch.integer(1, 2 * BN))
    NT = cdiv(R, BM)
    dt = src.dtype if src is not None else g.half_dtype()
    w = g.arg((E, K, N), dt)
    experts = g.arg((NT,), "i32", "table", low=-1, high=E)
    gather = src is None and not adds and chance(ch, 40)
    if gather:
        Rx = ch.integer(1, 2 * BM)
        a = g.arg((Rx, K), dt)
        ids_table = g.arg((NT * BM,), "i32", "rows", low=-1, high=Rx)
    else:
        a = src.name if src is not None else g.arg((R, K), dt)
    masked = chance(ch, 60)
    valid = g.arg((NT,), "i32", "table", low=0, high=BM + 1) if masked else None
    store_guarded = chance(ch, 30)
    out_dtype = g.half_dtype() if adds else g.float_dtype()
    if adds:
        Ro = ch.integer(1, 2 * BM)
        out = Tensor(g.arg((Ro, N), out_dtype), (Ro, N), out_dtype)
        targets = g.arg((NT * BM,), "i32", "rows", low=-1, high=Ro)
        factors = g.arg((NT * BM,), "f32") if chance(ch, 70) else None
    else:
        out = Tensor(g.arg((R, N), out_dtype, "output"), (R, N), out_dtype)
    stmts: list = [Assign("r0", f"pm * {BM}"), Assign("c0", f"pn * {BN}"),
                   Assign("e", table_read(g, experts, NT, "expert"))]
    guarded: list = []
    if waits:
        waits(guarded, "r0", BM)
    (guarded if store_guarded else stmts).append(Fragment("acc", (BM, BN), "f32"))
    if gather:
        ids = g.bind(guarded, Load(shape=(BM,), dtype="i32", exact=True, tensor=ids_table, offsets=("r0",),
                                   box=(BM,)), "ids")
        ta: Expr = LoadRows(shape=(BM, BK), dtype=dt, exact=True, tensor=a, rows=ids, col="k", ncols=BK)
    else:
        ta = Load(shape=(BM, BK), dtype=dt, exact=src is None or src.exact, tensor=a, offsets=("r0", "k"),
                  box=(BM, BK))
    tb = Load(shape=(BK, BN), dtype=dt, exact=True, tensor=w, offsets=("e", "k", "c0"), box=(BK, BN))
    guarded.append(Loop("k", "0", str(K), str(BK), (Update("acc", Dot(shape=(BM, BN), dtype="f32", bound=float(K),
                                                                      a=ta, b=tb)),)))
    value: Expr = FragRead(shape=(BM, BN), dtype="f32", bound=float(K), name="acc")
    epilogue: list = []
    if masked:
        epilogue.append(Assign("n", table_read(g, valid, NT, "valid")))
        rows = ExpandDims(shape=(BM, 1), dtype="i32", exact=True, x=Iota(shape=(BM,), dtype="i32", exact=True),
                          axis=1, indexing=True)
        value = Where(shape=(BM, BN), dtype="f32", bound=value.bound,
                      cond=Binary(shape=(BM, 1), dtype="i1", exact=True, op="lt", a=rows, b="n"), a=value, b=0.0)
    if adds:
        ids = g.bind(epilogue, Load(shape=(BM,), dtype="i32", exact=True, tensor=targets, offsets=("r0",),
                                    box=(BM,)), "targets")
        if factors is not None:
            value = Binary(shape=(BM, BN), dtype="f32", bound=value.bound, op="mul", a=value,
                           b=ExpandDims(shape=(BM, 1), dtype="f32", exact=True, axis=1,
                                        x=Load(shape=(BM,), dtype="f32", exact=True, tensor=factors,
                                               offsets=("r0",), box=(BM,))))
        epilogue.append(AddRows(out.name, ids, "c0", value))
    else:
        g.store(epilogue, out.name, ("r0", "c0"), value)
    if store_guarded:                  # a skipped tile stores nothing: its rows keep what the output held
        stmts.append(When("e >= 0", tuple(guarded + epilogue)))
    else:                              # a skipped tile stores zeros
        stmts += [When("e >= 0", tuple(guarded))] + epilogue
    g.part("compute", (NT, cdiv(N, BN)), ("pm", "pn"), stmts, row_tile=BM)
    return out


def combine(g: ProgramGenerator, dtype: str, src: Tensor | None = None, *, waits: Waits | None = None) -> Tensor:
    """A row-gather combine, the MoE top-k combine's shape (what the combine recipe lowers): for
    each of ``S`` slots a ``tl.range`` loop gathers ``BM`` rows of a ``dtype`` tensor by an id table
    (``tl.load_rows``; negative ids read zero rows), scales them by a per-row f32 weight, a constant
    (f32 rows only: 16-bit rows times a Python number stay 16-bit, and the recipe sums f32 products)
    or nothing, and adds them into an f32 fragment, stored once. Columns mostly a multiple of 4
    (the recipe's 4- and 8-wide accesses; else its 1- and 2-wide ones). ``src``: another part's
    output to gather from (``waits`` then waits for all of its rows before the loop: any row may
    be gathered), else a new input."""
    ch = g.ch
    BM, BN = ch.choice((8, 16, 32, 64)), ch.choice((8, 16, 32, 64))
    if src is None:
        Rx, C = g.extent(24), g.extent(BN)
        if chance(ch, 80):
            C = -(-C // 4) * 4
        src = Tensor(g.arg((Rx, C), dtype), (Rx, C), dtype)
    Rx, C = src.shape
    dtype = src.dtype
    R, S = g.extent(BM), ch.integer(1, 4)
    ids_table = g.arg((S * R,), "i32", "rows", low=-1, high=Rx)
    scale = weighted(ch, {"row": 50, "none": 30, "constant": 20 if dtype == "f32" else 0})
    weights = g.arg((R, S), "f32") if scale == "row" else None
    stmts: list = [Assign("r0", f"pm * {BM}"), Assign("c0", f"pn * {BN}")]
    if waits:
        waits(stmts, "0", Rx)
    stmts.append(Fragment("acc", (BM, BN), "f32"))
    body: list = []
    ids = g.bind(body, Load(shape=(BM,), dtype="i32", exact=True, tensor=ids_table, offsets=(f"s * {R} + r0",),
                            box=(BM,)), "ids")
    rows = LoadRows(shape=(BM, BN), dtype=dtype, exact=src.exact, tensor=src.name, rows=ids, col="c0", ncols=BN)
    term: Expr = rows
    if scale == "row":
        w = Load(shape=(BM, 1), dtype="f32", exact=True, tensor=weights, offsets=("r0", "s"), box=(BM, 1))
        term = Binary(shape=(BM, BN), dtype="f32", bound=1.0, op="mul", a=rows, b=w)
    elif scale == "constant":
        term = Binary(shape=(BM, BN), dtype="f32", bound=0.5, exact=True, op="mul", a=rows, b=0.5)
    body.append(Update("acc", term))
    stmts.append(Loop("s", "0", str(S), "1", tuple(body)))
    acc = FragRead(shape=(BM, BN), dtype="f32", bound=float(S), name="acc")
    out = output(g, (R, C), acc, None)
    g.store(stmts, out.name, ("r0", "c0"), acc)
    g.part("compute", (cdiv(R, BM), cdiv(C, BN)), ("pm", "pn"), stmts, row_tile=BM)
    return out


def gather(g: ProgramGenerator, src: Tensor) -> Tensor:
    """Rows of ``src`` chosen at run time: by an index tile (``tl.load_rows``, negative ids read
    zero rows) or a row block per task from a table (``tl.load_scalar``)."""
    ch = g.ch
    Rx, C = src.shape
    BM, BN = g.tile(), g.tile()
    R = g.extent(BM)
    stmts: list = [Assign("r0", f"pm * {BM}"), Assign("c0", f"pn * {BN}")]
    if chance(ch, 60):
        rows = g.arg((R,), "i32", "rows", low=-1, high=Rx)
        ids = g.bind(stmts, Load(shape=(BM,), dtype="i32", exact=True, tensor=rows, offsets=("r0",), box=(BM,)),
                     "ids")
        t = g.bind(stmts, LoadRows(shape=(BM, BN), dtype=src.dtype, exact=True, tensor=src.name, rows=ids,
                                   col="c0", ncols=BN))
    else:
        tab = g.arg((cdiv(R, BM),), "i32", "table", low=0, high=cdiv(Rx, BM))
        stmts.append(Assign("blk", table_read(g, tab, cdiv(R, BM), "block")))
        t = g.bind(stmts, Load(shape=(BM, BN), dtype=src.dtype, exact=True, tensor=src.name,
                               offsets=(f"blk * {BM}", "c0"), box=(BM, BN)))
    leaves: list[Expr] = [t]
    if src.dtype != "i32" and chance(ch, 40):
        i = Cast(shape=(BM,), dtype="f32", bound=BM, exact=True, x=Iota(shape=(BM,), dtype="i32", exact=True))
        leaves.append(g.bind(stmts, ExpandDims(shape=(BM, 1), dtype="f32", exact=True, x=Binary(
            shape=(BM,), dtype="f32", bound=1.0, exact=True, op="mul", a=i, b=1.0 / pow2_at_least(BM)), axis=1),
            "ramp"))
    value = using(g.tree(leaves, ch.integer(0, 2)), t)
    out = output(g, (R, C), value, None)
    g.store(stmts, out.name, ("r0", "c0"), fit(value, (BM, BN), out.dtype))
    g.part("compute", (cdiv(R, BM), cdiv(C, BN)), ("pm", "pn"), stmts)
    return out



def scatter(g: ProgramGenerator, src: Tensor) -> Tensor:
    """Rows of ``src`` (or math on them) added into rows of a tensor chosen at run time
    (``tl.add_rows``: ids from an index tile, negative ids skipped; rows repeat within a task and
    across tasks, so adds from different tasks land on the same elements in no fixed order). The
    tensor added into holds values of its own (an input the program also writes)."""
    ch = g.ch
    Rx, C = src.shape
    BM, BN = g.tile(), g.tile()
    Ro = g.extent(8)
    dst_dt = g.float_dtype()
    dst = g.arg((Ro, C), dst_dt)
    rows = g.arg((Rx,), "i32", "rows", low=-1, high=Ro)
    stmts: list = [Assign("r0", f"pm * {BM}"), Assign("c0", f"pn * {BN}")]
    ids = g.bind(stmts, Load(shape=(BM,), dtype="i32", exact=True, tensor=rows, offsets=("r0",), box=(BM,)), "ids")
    if chance(ch, 50):      # the last task's rows past src: no row (else id 0 of the zeros loaded there)
        inside = Binary(shape=(BM,), dtype="i1", exact=True, op="lt",
                        a=Binary(shape=(BM,), dtype="i32", exact=True, op="add",
                                 a=Iota(shape=(BM,), dtype="i32", exact=True), b="r0"), b=Rx)
        ids = g.bind(stmts, Where(shape=(BM,), dtype="i32", exact=True, cond=inside, a=ids, b=-1), "ids")
    t = g.bind(stmts, Load(shape=(BM, BN), dtype=src.dtype, exact=True, tensor=src.name, offsets=("r0", "c0"),
                           box=(BM, BN)))
    value = using(g.tree([t], ch.integer(0, 2)), t)
    if value.dtype not in ("f32", "f16", "bf16"):      # (a comparison or integer math: added as f32)
        value = Cast(shape=value.shape, dtype="f32", bound=value.bound, x=value)
    stmts.append(AddRows(dst, ids, "c0", value))
    g.part("compute", (cdiv(Rx, BM), cdiv(C, BN)), ("pm", "pn"), stmts)
    return Tensor(dst, (Ro, C), dst_dt)
