"""Recognising a row-gather combine (the MoE top-k combine): a loop at the top of the part
accumulating ``tl.load_rows(y, rows, col, BN) [* per-row scale]`` into one f32 fragment,
stored once, with waits before the loop and notifies after the store (the shape is in
:mod:`..recipes.combine`). Shapes and offsets are the planner's (:mod:`..plan.combine`)."""
from __future__ import annotations

from dataclasses import dataclass

from ...ir import core
from ...ir.opdefs import WAIT_OPS
from ..errors import fail, not_applicable
from ..ir_queries import CONTROL_OPS, SCALAR_OPS, enclosing, kernel_tensor
from .per_row import ROW_TILE_OPS, check_signal_or_control_op, is_tile, tile_producers

WHAT = "row-gather combine lowering"


@dataclass
class CombineMatch:
    """What :func:`match_combine` found in the part."""
    part: core.Part
    loop: core.Op                # the loop over the rows to combine
    gather: core.Op              # load_rows
    scale: core.Value | None     # per-row multiplier of the gathered tile
    mul: core.Op | None
    frag: core.Op
    store: core.Op
    src: core.Buffer             # the gathered tensor
    dst: core.Buffer             # the stored tensor
    rows: core.Value
    BMf: int                     # the accumulator's shape
    BNf: int


def match_combine(kernel: core.Kernel, part: core.Part) -> CombineMatch:
    """Check that ``part`` is a row-gather combine; raise :class:`LoweringError` at the op that is not."""
    if part.role != "compute":
        raise fail(WHAT, f"part '{part.name}' is a {part.role} part; only compute parts are lowered", part)
    if len(part.grid) not in (1, 2):
        raise fail(WHAT, f"the grid must be 1-d or 2-d, got {part.grid}", part)
    order = list(part.body.walk())
    dots = [op for op in order if op.name == "dot"]
    if dots:
        raise not_applicable(WHAT, "tl.dot belongs to a GEMM, not to a row-gather combine", dots[0])
    gathers = [op for op in order if op.name == "load_rows"]
    if len(gathers) != 1:
        raise (fail if gathers else not_applicable)(WHAT, f"expected exactly one tl.load_rows, found {len(gathers)}",
                                                    gathers[1] if gathers else part)
    g = gathers[0]
    parent = enclosing(part.body)
    loop = parent.get(id(g))
    if loop is None or loop.name != "for" or loop not in part.body.ops:
        raise fail(WHAT, "tl.load_rows must be in a `for` loop at the top of the part (the loop over the rows to "
                   "combine)", g)
    fws = [op for op in loop.regions[0].ops if op.name == "frag_write"]
    if len(fws) != 1:
        raise fail(WHAT, "the loop must accumulate once: acc += tl.load_rows(...) [* scale]", loop)
    fw = fws[0]
    frag = fw.operands[0].owner
    add = fw.operands[1].owner
    if not (isinstance(add, core.Op) and add.name == "ewise" and add.attrs["op"] == "add"):
        raise fail(WHAT, "the loop must accumulate: acc += ...", fw)
    fr = next((x.owner for x in add.operands if isinstance(x.owner, core.Op) and x.owner.name == "frag_read"
               and x.owner.operands[0].owner is frag), None)
    if fr is None:
        raise fail(WHAT, "the loop must accumulate into the fragment it writes", add)
    term = next(x for x in add.operands if x is not fr.result)
    mul, scale = None, None
    if term is g.result:
        pass
    elif isinstance(term.owner, core.Op) and term.owner.name == "ewise" and term.owner.attrs["op"] == "mul" and \
            any(x is g.result for x in term.owner.operands):
        mul = term.owner
        scale = next(x for x in mul.operands if x is not g.result)
    else:
        raise fail(WHAT, "the loop must add tl.load_rows(...) or tl.load_rows(...) * <per-row scale> to the "
                   "accumulator", add)
    if not isinstance(frag, core.Op) or frag.name != "frag_alloc" or frag not in part.body.ops:
        raise fail(WHAT, "the accumulator must be a tl.fragment allocated at the top of the part", fw)
    BMf, BNf = frag.attrs["shape"] if len(frag.attrs["shape"]) == 2 else (None, None)
    if BMf is None or frag.result.type.dtype.name != "f32":
        raise fail(WHAT, "the accumulator must be a 2-d f32 fragment", frag)
    if tuple(g.result.type.shape) != (BMf, BNf):
        raise fail(WHAT, f"the gathered tile {list(g.result.type.shape)} must have the accumulator's shape "
                   f"{[BMf, BNf]}", g)
    for v, what in ((add.result, "the sum"), ) + (((mul.result, "the product"),) if mul is not None else ()):
        if v.type.dtype.name != "f32":
            raise fail(WHAT, f"{what} is computed in {v.type.dtype}; only f32 accumulation is lowered", v.owner)
    if scale is not None and is_tile(scale):
        sh = tuple(scale.type.shape)
        if not (all(s == 1 for s in sh) or (len(sh) == 2 and sh == (BMf, 1))):
            raise fail(WHAT, f"the scale of the gathered rows must be per row ({BMf}, 1) or one value, got {list(sh)}",
                       mul)
    pos = {id(op): i for i, op in enumerate(order)}
    reads = [op for op in order if op.name == "frag_read" and op.operands[0].owner is frag and op is not fr]
    if len(reads) != 1 or reads[0] not in part.body.ops:
        raise fail(WHAT, "the accumulator must be read once after the loop, by its tl.store",
                   reads[1] if len(reads) > 1 else loop)
    rd = reads[0]
    users = [op for op in order if any(x is rd.result for x in op.operands)]
    cast = None
    if len(users) == 1 and users[0].name == "cast":
        cast = users[0]
        users = [op for op in order if any(x is cast.result for x in op.operands)]
    if not (len(users) == 1 and users[0].name == "store" and users[0] in part.body.ops):
        raise fail(WHAT, "after the loop expected `tl.store(out, (row0, col0), acc)`", users[0] if users else rd)
    store = users[0]
    if pos[id(store)] < pos[id(loop)]:
        raise fail(WHAT, "the store must follow the loop", store)
    src = kernel_tensor(g.operands[0], "the gathered tensor", g, WHAT)
    dst = kernel_tensor(store.operands[0], "the stored tensor", store, WHAT)

    rows = g.operands[1]
    expr_ops = {id(o) for o in tile_producers(rows)}
    if scale is not None and is_tile(scale):
        expr_ops |= {id(o) for o in tile_producers(scale)}
    known = {id(frag), id(loop), id(g), id(fw), id(add), id(fr), id(rd), id(store)}
    known |= {id(mul)} if mul is not None else set()
    known |= {id(cast)} if cast is not None else set()
    loop_ops = {id(o) for o in loop.regions[0].walk()}
    for op in order:
        if id(op) in known:
            continue
        n = op.name
        if n in SCALAR_OPS:
            continue
        if id(op) in expr_ops:
            if n not in ROW_TILE_OPS:
                raise fail(WHAT, f"'{n}' is not lowered in a per-row index/scale expression", op)
            continue
        if n in WAIT_OPS:
            if pos[id(op)] > pos[id(loop)]:
                raise fail(WHAT, f"'{n}' after the gather loop: waits must precede the tile's loads", op)
            continue
        if n in CONTROL_OPS and id(op) in loop_ops:
            raise fail(WHAT, f"'{n}' inside the gather loop is not supported in a row-gather combine", op)
        check_signal_or_control_op(op, WHAT, pos, store, store_name="the store", loop_name="the gather loop",
                                   kind="a row-gather combine compute part")
    return CombineMatch(part, loop, g, scale, mul, frag, store, src, dst, rows, BMf, BNf)
