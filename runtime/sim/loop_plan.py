"""Which loops the simulator may run in bulk, and how: the plan for one ``for`` op.

A loop whose body never yields to the scheduler (no signal or data primitive, no store, no
nested region) runs within one scheduler step, so nothing else touches memory while it runs:
all its loads may be done first, their race checks done on whole regions at once, and the
tile math that does not depend on the loop-carried state (the loads' products, typically
``tl.dot(tl.load(...), tl.load(...))``) done for every iteration in one numpy call. Only the
ops that carry state from one iteration to the next (``acc += ...``) still run per iteration,
in order — so results are bit for bit those of running the loop op by op.

Math counts as bulk only where numpy computes each element or matrix product the same way
whatever the array around it (exactly rounded elementwise ops, one BLAS call per product);
the rest runs per iteration.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...ir.types import float32

SCALAR_OPS = frozenset({"const", "program_id", "rank", "arith", "select"})
BULK_MATH = frozenset({"dot", "cast", "trans", "ewise", "expand_dims", "broadcast"})
STEP_OPS = frozenset({"full", "iota", "ewise", "cast", "reduce", "expand_dims", "broadcast", "trans", "dot",
                      "frag_alloc", "frag_read", "frag_write"})
#: transcendental ops: numpy may take a different code path (and rounding) by array length
NOT_BULK_EWISE = frozenset({"exp", "exp2", "log", "sigmoid", "tanh", "erf"})


@dataclass(frozen=True)
class LoopPlan:
    iv: int                          # the induction variable's id
    scalars: tuple                   # index arithmetic, run per iteration before anything else
    loads: tuple                     # every load of the body, in body order
    bulk: tuple                      # tile math over all iterations at once, in body order
    steps: tuple                     # the ops run per iteration (loop-carried state), in body order
    step_scalars: tuple              # ids of body scalars the steps read
    step_bulk: tuple                 # ids of load / bulk results the steps read
    accumulate: tuple | None = None  # (fragment id, addend id): the steps are exactly frag += addend in f32
    dot_loads: frozenset = frozenset()  # ids of loads read only by dots (which compute in float32)
    load_offsets: tuple = ()         # per load, the ids of its offset operands
    bytes_per_iteration: int = 1     # of bulk tiles (as float32): how many iterations to hold at once
    direct: bool = False             # no index arithmetic: the loads' offsets are the induction variable
                                     # or values from outside the loop


def plan_loop(for_op) -> LoopPlan | None:
    """The bulk plan of a ``for`` op, or None where it must run op by op."""
    body = for_op.regions[0]
    iv = body.args[0].id
    scalars, loads, bulk, steps = [], [], [], []
    varying = {iv}                   # scalars that may change from one iteration to the next
    local = {iv}                     # values the body defines
    bulk_ids: set[int] = set()
    for op in body.ops:
        if op.regions:
            return None
        local.update(r.id for r in op.results)
        if op.name in SCALAR_OPS:
            scalars.append(op)
            varying.update(r.id for r in op.results)
        elif op.name == "load":
            loads.append(op)
            bulk_ids.add(op.result.id)
        elif _bulk_math(op, bulk_ids, local):
            bulk.append(op)
            bulk_ids.add(op.result.id)
        elif op.name in STEP_OPS:
            steps.append(op)
        else:
            return None              # a yield, a store, a gather: op by op
    if not loads:
        return None
    read = {v.id for op in steps for v in op.operands}
    return LoopPlan(iv, tuple(scalars), tuple(loads), tuple(bulk), tuple(steps),
                    tuple(sorted(read & varying)), tuple(sorted(read & bulk_ids)),
                    _accumulate(steps, bulk_ids), _dot_loads(body.ops, loads),
                    tuple(tuple(v.id for v in op.operands[1:]) for op in loads),
                    sum(4 * _elements(op.result.type.shape) for op in loads + bulk),
                    not scalars and not (read & varying))


def _elements(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _bulk_math(op, bulk_ids, local) -> bool:
    """Math on bulk values and values from outside the loop only."""
    if op.name not in BULK_MATH or (op.name == "ewise" and op.attrs["op"] in NOT_BULK_EWISE):
        return False
    ids = [v.id for v in op.operands]
    return any(i in bulk_ids for i in ids) and all(i in bulk_ids or i not in local for i in ids)


def _accumulate(steps, bulk_ids):
    """(fragment, addend) where the steps are ``frag_write(f, add(frag_read(f), x))`` on f32
    tiles of one shape, x computed in bulk — ``np.add(f, x[i], out=f)`` per iteration."""
    if [op.name for op in steps] != ["frag_read", "ewise", "frag_write"]:
        return None
    read, add, write = steps
    frag = read.operands[0]
    if add.attrs["op"] != "add" or write.operands[0] is not frag or write.operands[1] is not add.result:
        return None
    a, b = add.operands
    addend = b if a is read.result else a if b is read.result else None
    if addend is None or addend is read.result or addend.id not in bulk_ids:
        return None
    shape = tuple(frag.type.shape)
    if any(tuple(v.type.shape) != shape or v.type.dtype != float32 for v in (frag, addend, add.result)):
        return None
    return frag.id, addend.id


def _dot_loads(ops, loads) -> frozenset:
    """Loads whose every use is a bulk ``dot`` (loop bodies are not read after the loop)."""
    users: dict[int, set] = {op.result.id: set() for op in loads}
    for op in ops:
        for v in op.operands:
            if v.id in users:
                users[v.id].add(op.name)
    return frozenset(i for i, names in users.items() if names == {"dot"})
