"""What the grouped-GEMM and combine matchers ask of a part's IR: the per-row tile expressions
(gathered row ids, per-row scales) a value is computed from, and what a value depends on. Both
recipes wrap a template around code with run-time row indices; these questions are how their
matchers tell the template's work from the tile program's."""
from __future__ import annotations

from ...ir import core
from ...ir.opdefs import DATA_OPS, NOTIFY_OPS, WAIT_OPS
from ...ir.types import TileType
from ..errors import fail
from ..ir_queries import CONTROL_OPS, SCALAR_OPS

#: the tile ops a per-row index or scale expression may be made of (rendered element by element)
ROW_TILE_OPS = frozenset({"iota", "load", "ewise", "cast", "full", "broadcast", "expand_dims"})


def is_tile(v: core.Value) -> bool:
    return isinstance(v.type, TileType)


def tile_producers(v: core.Value) -> list[core.Op]:
    """The tile-producing ops a tile value is computed from (its own included), depth first."""
    seen: dict[int, core.Op] = {}
    work = [v]
    while work:
        x = work.pop()
        op = x.owner
        if not isinstance(op, core.Op) or not is_tile(x) or id(op) in seen:
            continue
        seen[id(op)] = op
        work.extend(o for o in op.operands if is_tile(o))
    return list(seen.values())


def depends_on(v: core.Value, var: core.Value) -> bool:
    """Whether ``v`` is computed from ``var`` (e.g. a loop variable)."""
    work, seen = [v], set()
    while work:
        x = work.pop()
        if x is var:
            return True
        if x.id in seen:
            continue
        seen.add(x.id)
        if isinstance(x.owner, core.Op):
            work.extend(x.owner.operands)
    return False


def check_this_rank_notify(op: core.Op, what: str) -> None:
    """The MoE templates' notifies add to this rank's copy of a signal only (else a
    LoweringError from recipe ``what`` at the notify)."""
    if op.name != "producer_tile_notify":
        raise fail(what, f"'{op.name}' notifies another rank's copy of a symmetric signal; this lowering emits only "
                   "this rank's signals (producer_tile_notify)", op)


def check_signal_or_control_op(op: core.Op, what: str, pos: dict, store: core.Op, *, store_name: str,
                               loop_name: str, kind: str, hint: str = "") -> None:
    """The ops both MoE templates take besides their own: notifies (this rank's, after the tile's
    store), loops and guards holding only index code and signal ops; data movement is refused,
    and so is anything else (a LoweringError from recipe ``what``, at the op). ``kind`` names
    the compute part in errors ("a grouped-GEMM compute part"); ``hint`` says what it takes."""
    n = op.name
    if n in NOTIFY_OPS:
        check_this_rank_notify(op, what)
        if pos[id(op)] < pos[id(store)]:
            raise fail(what, f"'{n}' before {store_name}: notifies must follow the tile's stores", op)
        return
    if n in CONTROL_OPS:
        bad = [o for o in op.regions[0].walk() if o.name not in SCALAR_OPS | WAIT_OPS | NOTIFY_OPS | CONTROL_OPS]
        if bad:
            raise fail(what, f"'{bad[0].name}' inside a loop or guard other than {loop_name} is not lowered (only "
                             "index arithmetic and signal ops may be there)", bad[0])
        return
    if n in DATA_OPS:
        raise fail(what, f"'{n}' moves data between ranks; {kind} may not", op)
    raise fail(what, f"'{n}' is not supported in {kind}" + (f" ({hint})" if hint else ""), op)
