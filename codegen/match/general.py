"""Recognising what the general lowering takes: any compute part built from the language's tile
ops, index code, loops, guards and the nine primitives (:mod:`..recipes.general`). It is the
pipeline's last resort for compute parts, so its matcher only names what it cannot lower yet."""
from __future__ import annotations

from dataclasses import dataclass

from ...ir import core
from ...ir import types as T
from ...ir.opdefs import DATA_OPS, NOTIFY_OPS, WAIT_OPS
from ..errors import fail, not_applicable
from ..ir_queries import CONTROL_OPS, SCALAR_OPS

WHAT = "general lowering"

#: tile ops whose value can be computed element by element where it is consumed
ELEMENT_OPS = frozenset({"full", "iota", "ewise", "cast", "expand_dims", "broadcast", "trans"})
#: ops that run as a statement of the CTA (a loop over their output elements, or a dot)
STATEMENT_OPS = frozenset({"load", "load_rows", "store", "add_rows", "reduce", "dot", "frag_alloc", "frag_write"})
#: every op the general lowering renders (the data primitives as SM copies, element by element)
LOWERED_OPS = (SCALAR_OPS | CONTROL_OPS | ELEMENT_OPS | STATEMENT_OPS | {"frag_read"} | NOTIFY_OPS | WAIT_OPS
               | DATA_OPS)


@dataclass(frozen=True)
class GeneralMatch:
    """What the planner needs to know up front: the part and its op counts."""
    part: core.Part
    dots: int
    waits: int
    notifies: int


def match_general(kernel: core.Kernel, part: core.Part) -> GeneralMatch:
    """Accept a compute part whose every op the general lowering renders; otherwise a
    LoweringError at the first op it does not."""
    if part.role != "compute":
        raise not_applicable(WHAT, f"part '{part.name}' is a {part.role} part; the general lowering takes compute "
                                   "parts (and communication parts on SMs as recipe general_comm)", part)
    fused = [q.name for q in kernel.parts if q.fused]
    if fused:
        raise fail(WHAT, f"the communication schedule fused parts {fused} into this compute part (own_rows="
                         "'compute' or engine='compute'), and the general lowering does not run fused parts yet: "
                         "use a schedule without them", part)
    return _match_ops(part)


def match_general_comm(kernel: core.Kernel, part: core.Part) -> GeneralMatch:
    """Accept a communication part on SMs whose every op the general lowering renders (the
    copy engine's parts are host plans, not kernels)."""
    if part.role != "comm" or part.engine != "sm":
        raise not_applicable(WHAT, f"part '{part.name}' is not a communication part on SMs", part)
    return _match_ops(part)


def _match_ops(part: core.Part) -> GeneralMatch:
    counts = {"dot": 0, "wait": 0, "notify": 0}
    for op in part.walk():
        if op.name in DATA_OPS and any(v.type.dtype.kind == "bool" for v in op.operands
                                       if isinstance(v.type, T.TensorType)):
            raise fail(WHAT, f"'{op.name}' of a boolean tensor is not lowered (cast to tl.int32 first)", op)
        if op.name not in LOWERED_OPS:
            raise fail(WHAT, f"'{op.name}' is not lowered", op)
        if op.name == "dot":
            counts["dot"] += 1
        elif op.name in WAIT_OPS:
            counts["wait"] += 1
        elif op.name in NOTIFY_OPS:
            counts["notify"] += 1
    return GeneralMatch(part, counts["dot"], counts["wait"], counts["notify"])
