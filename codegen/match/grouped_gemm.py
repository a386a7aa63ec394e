"""Recognising a grouped GEMM over run-time tile tables (the MoE expert GEMMs): one K loop of
``acc += tl.dot(A, B)`` — A dense or gathered by per-row ids, B one expert's weights — inside
an optional ``tl.when`` guard, one store of the accumulator — whole, or with its rows from a
run-time count on zeroed (``tl.where(tl.iota(BM)[:, None] < n, acc, 0.0)``: a tile with few
valid rows may skip computing the others) — waits before the loop (and, where the tile's rows are
added into C, between the loop and ``tl.add_rows``) and notifies after the store (the shape is in
:mod:`..recipes.grouped_gemm`). The matcher checks
the structure only; shapes, tile offsets and the schedule are the planner's
(:mod:`..plan.grouped_gemm`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...ir import core
from ...ir.opdefs import WAIT_OPS
from ..errors import fail, not_applicable
from ..ir_queries import SCALAR_OPS, const_value, enclosing, kernel_tensor
from .per_row import ROW_TILE_OPS, check_signal_or_control_op, is_tile, tile_producers

WHAT = "grouped GEMM lowering"


@dataclass
class GroupedGemmMatch:
    """What :func:`match_grouped_gemm` found in the part."""
    part: core.Part
    loop: core.Op                   # the K loop
    dot: core.Op
    a_load: core.Op                 # load (dense A) | load_rows (gathered A)
    b_load: core.Op
    frag: core.Op                   # the accumulator
    store: core.Op                  # the accumulator's store into C
    guard: core.Op | None           # the `tl.when` around the K loop
    store_inside: bool              # the store is inside the guard (skipped tiles store nothing)
    a: core.Buffer
    b: core.Buffer
    c: core.Buffer
    gather: bool
    batched: bool                   # B is [E, K, N]: one expert's weights per tile
    rows: core.Value | None         # the gathered row ids (a (BM,) i32 tile)
    batch: core.Value | None        # the expert
    out_dtype: str
    row_limit: core.Value | None = None     # n of a row mask: the stored tile's rows >= n are zeros
    row_mask: tuple[core.Op, ...] = ()      # its ops (where, lt, expand_dims, iota)
    b_k_major: bool = False                 # B stored [N, K] / [E, N, K], its tile transposed in the dot
    # tl.add_rows(c, targets, pn*BN, acc * scale): each row added into row targets[r] of C (a negative id
    # skipped), scaled by its per-row value first (the MoE combine in the GEMM's epilogue); `store` is that op
    targets: core.Value | None = None       # the (BM,) i32 row ids
    scale: core.Value | None = None         # the per-row (BM, 1) f32 factor, or None
    scale_op: core.Op | None = None         # acc * scale
    # waits after the K loop, before the rows are added (ids of their ops): the consumers run them
    # before a tile's rows are held, so its adds follow them (an output cleared by another part first)
    late_waits: frozenset = frozenset()

    @property
    def adds_rows(self) -> bool:
        return self.targets is not None


ROW_MASK = "tl.where(tl.iota(BM)[:, None] < n, acc, 0.0)"


def _row_mask(where: core.Op, acc: core.Value, BM: int) -> tuple[core.Value, tuple[core.Op, ...]]:
    """``(n, ops)`` of ``tl.where(tl.iota(BM)[:, None] < n, acc, 0.0)`` with ``n`` a scalar, or a
    LoweringError at the op that differs: the only mask the template applies per row."""
    def refuse(what, at):
        return fail(WHAT, f"the accumulator's store may mask whole rows only, as `{ROW_MASK}` with n an i32 scalar "
                    f"(a table entry, say): {what}", at)
    cond, a, b = where.operands
    if a is not acc:
        raise refuse("the accumulator must be where's second operand (the rows kept)", where)
    zero = const_value(b)
    if is_tile(b) or zero != 0 or math.copysign(1.0, zero) < 0:
        raise refuse("the rows dropped must be the constant 0 (+0.0: what the kernel stores)", where)
    lt = cond.owner
    if not (isinstance(lt, core.Op) and lt.name == "ewise" and lt.attrs.get("op") == "lt"):
        raise refuse("the condition must be `row index < n`", lt if isinstance(lt, core.Op) else where)
    rows, n = lt.operands
    if is_tile(n) or n.type.dtype.name != "i32":
        raise refuse(f"n must be an i32 scalar, got {n.type}", lt)
    ed = rows.owner
    iota = ed.operands[0].owner if isinstance(ed, core.Op) and ed.name == "expand_dims" else None
    if not (isinstance(iota, core.Op) and iota.name == "iota" and ed.attrs.get("axis") == 1
            and tuple(ed.result.type.shape) == (BM, 1) and iota.attrs.get("n") == BM):
        raise refuse(f"the row index must be `tl.iota({BM})[:, None]` (the tile's rows)", lt)
    return n, (where, lt, ed, iota)


def match_grouped_gemm(kernel: core.Kernel, part: core.Part) -> GroupedGemmMatch:
    """Check that ``part`` is a grouped GEMM; raise :class:`LoweringError` at the op that is not."""
    if part.role != "compute":
        raise fail(WHAT, f"part '{part.name}' is a {part.role} part; only compute parts are lowered", part)
    if len(part.grid) != 2:
        raise fail(WHAT, f"the grid must be 2-d (tiles of rows, tiles of columns), got {part.grid}", part)
    dots = [op for op in part.walk() if op.name == "dot"]
    if len(dots) != 1:
        refuse = not_applicable if not dots else fail        # no dot at all: a part of another kind
        raise refuse(WHAT, f"expected exactly one tl.dot in compute part '{part.name}', found {len(dots)}",
                     dots[1] if len(dots) > 1 else part)
    dot = dots[0]
    parent = enclosing(part.body)
    loop = parent.get(id(dot))
    if loop is None or loop.name != "for":
        raise fail(WHAT, "tl.dot must be the body of a `for k in tl.range(0, K, BK)` loop", dot)
    top = part.body.ops
    guard = None
    if loop not in top:
        g = parent.get(id(loop))
        if g is None or g.name != "if" or g not in top:
            raise fail(WHAT, "the K loop must be at the top of the part or directly inside one `with tl.when(...)`",
                       loop)
        guard = g
    tile_ops = guard.regions[0].ops if guard is not None else top

    # the K loop: acc += tl.dot(A, B), plus index arithmetic
    body = [op for op in loop.regions[0].ops if op.name not in ("const", "arith")]
    # B stored [N, K] ([E, N, K]: a stack of torch Linear weights): `tl.dot(a, tl.trans(b_tile))`
    trans = [op for op in body if op.name == "trans"]
    b_k_major = len(trans) == 1 and dot.operands[1] is trans[0].result
    if b_k_major:
        body.remove(trans[0])
    if sorted(op.name for op in body) != sorted(["load", "load", "dot", "frag_read", "ewise", "frag_write"]) and \
            sorted(op.name for op in body) != sorted(["load_rows", "load", "dot", "frag_read", "ewise", "frag_write"]):
        other = next((op for op in body if op.name not in ("load", "load_rows", "dot", "frag_read", "ewise",
                                                           "frag_write")), loop)
        raise fail(WHAT, "the K loop must be `acc += tl.dot(A, B)` with A and B loaded in the loop, got "
                   f"{[op.name for op in body]}" + (f" ('{other.name}' is not lowered there)" if other is not loop
                                                     else ""), other)
    a_load, b_load = dot.operands[0].owner, dot.operands[1].owner
    if b_k_major:
        b_load = trans[0].operands[0].owner
    if not (isinstance(a_load, core.Op) and a_load in body and isinstance(b_load, core.Op) and b_load in body):
        raise fail(WHAT, "tl.dot must multiply two tiles loaded in the K loop", dot)
    if b_load.name != "load":
        raise fail(WHAT, f"B must be a tl.load tile (TMA), got '{b_load.name}'", b_load)
    fw = next(op for op in body if op.name == "frag_write")
    fr = next(op for op in body if op.name == "frag_read")
    add = next(op for op in body if op.name == "ewise")
    if add.attrs.get("op") != "add" or {add.operands[0].id, add.operands[1].id} != {fr.result.id, dot.result.id}:
        raise fail(WHAT, "the K loop must accumulate: acc += tl.dot(...)", add)
    frag = fw.operands[0].owner
    if fr.operands[0].owner is not frag or fw.operands[1] is not add.result or not isinstance(frag, core.Op) \
            or frag.name != "frag_alloc":
        raise fail(WHAT, "the K loop must read and write one tl.fragment accumulator", fw)
    if frag not in top and frag not in tile_ops:
        raise fail(WHAT, "the accumulator must be allocated before the K loop, at the top of the part or of the guard",
                   frag)
    if frag.result.type.dtype.name != "f32" or frag.attrs.get("value", 0) != 0:
        raise fail(WHAT, "the accumulator must be an f32 fragment initialised to 0", frag)

    # the epilogue: frag_read -> [cast] -> store
    order = list(part.body.walk())
    pos = {id(op): i for i, op in enumerate(order)}
    loop_ops = {id(o) for o in loop.regions[0].walk()}
    reads = [op for op in order if op.name == "frag_read" and op.operands[0].owner is frag and id(op) not in loop_ops]
    if len(reads) != 1:
        raise fail(WHAT, f"expected the accumulator to be read once after the K loop (by tl.store), found {len(reads)}",
                   reads[1] if reads else loop)
    rd = reads[0]
    users = [op for op in order if any(x is rd.result for x in op.operands)]
    store, cast, row_limit, mask_ops, kept = None, None, None, (), rd.result
    if len(users) == 1 and users[0].name == "ewise" and users[0].attrs.get("op") == "where":
        row_limit, mask_ops = _row_mask(users[0], rd.result, frag.result.type.shape[0])
        kept = users[0].result
        users = [op for op in order if any(x is kept for x in op.operands)]
    if len(users) == 1 and users[0].name == "cast":
        cast = users[0]
        users = [op for op in order if any(x is cast.result for x in op.operands)]
    if len(users) == 1 and users[0].name == "store" and users[0].operands[-1] is (cast.result if cast else kept):
        store = users[0]
    targets, scale, scale_op = None, None, None
    if store is None and cast is None:
        store, scale, scale_op = _added_rows(users, kept, order, frag.result.type.shape[0])
        targets = store.operands[1] if store is not None else None
    if store is None:
        raise fail(WHAT, "after the K loop expected `tl.store(c, (i*BM, pn*BN), acc)` (or of `" + ROW_MASK + "`), "
                   "or `tl.add_rows(c, rows, pn*BN, acc * scale[:, None])`, and nothing else on the accumulator",
                   users[0] if users else rd)
    store_parent = parent.get(id(store))
    if guard is not None and store_parent is guard:
        store_inside = True
    elif store_parent is None:
        store_inside = guard is None
    else:
        raise fail(WHAT, "the store of the accumulator must be at the top of the part or of the guard", store)
    if pos[id(store)] < pos[id(loop)] or (cast is not None and parent.get(id(cast)) is not store_parent) or \
            (scale_op is not None and parent.get(id(scale_op)) is not store_parent) or \
            parent.get(id(rd)) is not store_parent:
        raise fail(WHAT, "the accumulator's store must follow the K loop, in the same block", store)

    a = kernel_tensor(a_load.operands[0], "A", a_load, WHAT)
    b = kernel_tensor(b_load.operands[0], "B", b_load, WHAT)
    c = kernel_tensor(store.operands[0], "C", store, WHAT)
    gather = a_load.name == "load_rows"
    rows = a_load.operands[1] if gather else None
    batched = len(b.type.shape) == 3
    batch = b_load.operands[1] if batched else None

    # every other op: scalar code, waits before the K loop, notifies after the store, and the tile
    # ops of the gathered row ids
    row_ops = {id(o) for o in tile_producers(rows)} if rows is not None else set()
    known = {id(frag), id(loop), id(rd), id(store)} | ({id(cast)} if cast is not None else set()) | loop_ops
    known |= {id(o) for o in mask_ops} | ({id(scale_op)} if scale_op is not None else set())
    # the added rows' ids and scales: per-row expressions, rendered row by row for the epilogue
    for v in (targets, scale):
        for o in (tile_producers(v) if v is not None else ()):
            if o.name not in ROW_TILE_OPS:
                raise fail(WHAT, f"'{o.name}' cannot compute the added rows' ids or scales (only per-row loads, "
                           "iota and elementwise math are lowered)", o)
            known.add(id(o))
    guarded = {id(o) for o in guard.regions[0].walk()} if guard is not None else set()
    late: set[int] = set()
    if guard is not None:
        known.add(id(guard))
    for op in order:
        if id(op) in known:
            continue
        n = op.name
        if n in SCALAR_OPS:
            continue
        if id(op) in row_ops:
            if n not in ROW_TILE_OPS:
                raise fail(WHAT, f"'{n}' cannot compute gathered row ids (only per-row loads, iota and elementwise "
                           "math are lowered)", op)
            if pos[id(op)] > pos[id(loop)]:
                raise fail(WHAT, "the gathered row ids must be computed before the K loop", op)
            continue
        if n in WAIT_OPS:
            if pos[id(op)] > pos[id(loop)]:
                if targets is None or pos[id(op)] > pos[id(store)]:
                    raise fail(WHAT, f"'{n}' after the K loop: waits must precede the tile's loads (or, where the "
                               "tile's rows are added into C, its tl.add_rows)", op)
                late.add(id(op))
            if guard is not None and id(op) not in guarded:
                # the producer runs waits only for the tiles the guard lets through; a tile it skips
                # would store (zeros) or notify without having waited
                raise fail(WHAT, f"'{n}' outside the `tl.when` guard: it would also hold up the tiles the guard "
                           "skips; move it inside the guard", op)
            continue
        check_signal_or_control_op(op, WHAT, pos, store, store_name="the accumulator's store", loop_name="the K loop",
                                   kind="a grouped-GEMM compute part", hint="only index arithmetic, table reads, "
                                   "waits, the K loop, the accumulator's store and notifies are lowered")
    return GroupedGemmMatch(part, loop, dot, a_load, b_load, frag, store, guard, store_inside, a, b, c, gather,
                            batched, rows, batch, c.type.dtype.name, row_limit, mask_ops, b_k_major, targets, scale,
                            scale_op, frozenset(late))


def _added_rows(users, kept: core.Value, order, BM: int):
    """``(add_rows op, scale, mul op)`` where the accumulator (``kept``: row-masked or not) is
    added into rows of C as ``tl.add_rows(c, rows, col, kept)`` or ``tl.add_rows(c, rows, col,
    kept * scale)`` with ``scale`` a per-row (BM, 1) f32 tile; ``(None, None, None)`` otherwise."""
    scale = mul = None
    if len(users) == 1 and users[0].name == "ewise" and users[0].attrs.get("op") == "mul":
        mul = users[0]
        others = [x for x in mul.operands if x is not kept]
        if len(others) != 1 or not is_tile(others[0]) or tuple(others[0].type.shape) != (BM, 1) \
                or others[0].type.dtype.name != "f32" or tuple(mul.result.type.shape) != tuple(kept.type.shape):
            return None, None, None
        scale = others[0]
        users = [op for op in order if any(x is mul.result for x in op.operands)]
        kept = mul.result
    if len(users) == 1 and users[0].name == "add_rows" and users[0].operands[-1] is kept:
        return users[0], scale, mul
    return None, None, None

