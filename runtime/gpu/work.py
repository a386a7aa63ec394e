"""How much work one launch of a part gives the SMs, estimated from its tile program.

Why: the run plan (:mod:`.run_plan`) splits the SMs left after every kernel's least among the
kernels that can use more. Split evenly, a light kernel that waits on another's tiles (an MoE
combine behind its grouped GEMM) took half the GPU from the GEMM it waits for. Split by work,
each kernel gets SMs in proportion to the time its tasks keep an SM busy, so the kernels of a
launch finish together.

The estimate is a roofline of one task, in floating-point operations: every ``dot`` counts
``2 * M * N * K``; every other tile the task moves through global memory counts its bytes times
:data:`FLOPS_PER_BYTE` (one SM's tensor-core rate over its share of memory bandwidth). Loads
that feed a dot are the dot's operands: a tiled product reads each of them from L2 many times
over, so they are counted in the dot's time, not as memory traffic. A loop whose bounds are
constants multiplies its body by its trip count; one with bounds known only at run time counts
once; a guarded region counts as taken. Nothing here needs a GPU or a recipe: any traced part
has an estimate.
"""
from __future__ import annotations

import math

from ...ir import core
from ...ir.opdefs import DATA_OPS, data_operands

#: one SM's dense tensor-core rate over its share of the memory bandwidth (H100 / H200: about
#: 990 TFLOP/s of bf16 over 3.35-4.8 TB/s): a byte moved costs about as long as this many flops
FLOPS_PER_BYTE = 200
#: what a tile op's value passes through on its way into a dot (still the dot's operand)
_TO_DOT = ("cast", "trans")


def part_work(part: core.Part) -> float:
    """The estimated cost of one launch of ``part``: its tasks times :func:`task_cost`."""
    return part.num_tasks * task_cost(part)


def task_cost(part: core.Part) -> float:
    """One task of ``part`` in flop-equivalents (see the module docstring)."""
    operands = _dot_operands(part)
    return _block_cost(part.body, operands)


def _dot_operands(part: core.Part) -> set[int]:
    """ids of the ops whose results a dot reads (through casts and transposes)."""
    defs = {id(r): op for op in part.walk() for r in op.results}
    out: set[int] = set()
    for op in part.walk():
        if op.name != "dot":
            continue
        for v in op.operands:
            d = defs.get(id(v))
            while d is not None:
                out.add(id(d))
                d = defs.get(id(d.operands[0])) if d.name in _TO_DOT and d.operands else None
    return out


def _block_cost(block: core.Block, operands: set[int]) -> float:
    total = 0.0
    for op in block.ops:
        if op.name == "for":
            body = sum(_block_cost(r, operands) for r in op.regions)
            total += body * _trip_count(op)
        elif op.regions:
            total += sum(_block_cost(r, operands) for r in op.regions)
        else:
            total += _op_cost(op, operands)
    return total


def _op_cost(op: core.Op, operands: set[int]) -> float:
    if op.name == "dot":
        a, b = op.operands[0].type.shape, op.operands[1].type.shape
        return 2.0 * a[0] * a[1] * b[-1]
    if op.name in ("load", "load_rows"):
        return 0.0 if id(op) in operands else _bytes(op.results[0].type) * FLOPS_PER_BYTE
    if op.name == "store":         # the value's elements, as the tensor holds them
        return math.prod(op.operands[-1].type.shape) * op.operands[0].type.dtype.bits / 8 * FLOPS_PER_BYTE
    if op.name == "add_rows":      # read and written back (at L2, by the atomics)
        return 2 * math.prod(op.operands[-1].type.shape) * op.operands[0].type.dtype.bits / 8 * FLOPS_PER_BYTE
    if op.name in DATA_OPS:
        src, _, _, dst, _, _, tile = data_operands(op)
        buf = src if src is not None else dst
        n = math.prod(op.attrs.get("shape", ())) * buf.type.dtype.bits / 8
        return n * (1 if tile is not None or op.attrs.get("form") == "tile" else 2) * FLOPS_PER_BYTE
    return 0.0


def _bytes(t) -> float:
    return math.prod(t.shape) * t.dtype.bits / 8


def _trip_count(op: core.Op) -> int:
    """A ``for`` loop's iterations where its bounds are constants; 1 where the data decide."""
    lo, hi, step = (_const(v) for v in op.operands[:3])
    if lo is None or hi is None or step is None or step == 0:
        return 1
    return max(0, -(-(hi - lo) // step))


def _const(v: core.Value):
    d = v.owner
    if isinstance(d, core.Op) and d.name == "const" and isinstance(d.attrs.get("value"), int):
        return d.attrs["value"]
    return None
