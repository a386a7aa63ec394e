"""What every stage of the code generator asks of a kernel's IR: which part to lower, which ops
are index code, which op encloses which, what a set of root ops needs, a constant's value, the
kernel tensor an operand names, and the memory scope of a signal op.

These are questions about the IR, not C++: matching and planning ask them without depending
on the rules that render C++ (:mod:`.rules`), and the rules ask the same ones."""
from __future__ import annotations

from typing import Callable, Iterable

from ..ir import core
from ..ir.opdefs import DEFAULT_MEMORY_SCOPE, WAIT_OPS
from .errors import fail

#: the scalar ops of index code, which the scalar rule (:mod:`.rules.scalars`) renders itself
SCALAR_OPS = frozenset({"const", "program_id", "rank", "arith", "select", "load_scalar"})
#: the structured control ops around index code
CONTROL_OPS = frozenset({"for", "if"})


def only_part(kernel: core.Kernel, part: str | core.Part | None, what: str, kinds: str,
              fits: Callable[[core.Part], bool], verb: str = "lower") -> core.Part:
    """``part`` (a name or a Part) or, when None, the kernel's one part that ``fits``: what a
    recipe's own entry point (``lower_gemm(kernel)``, ...) lowers. When the kernel has none or
    several, a LoweringError from recipe ``what`` says how many ``kinds`` it has."""
    if part is not None:
        return kernel.part(part) if isinstance(part, str) else part
    parts = [q for q in kernel.parts if fits(q)]
    if len(parts) != 1:
        raise fail(what, f"kernel '{kernel.name}' has {len(parts)} {kinds}; name the one to {verb}", kernel.loc)
    return parts[0]


def const_value(v: core.Value):
    """The Python value of a ``const`` op's result, else None."""
    op = v.owner
    if isinstance(op, core.Op) and op.name == "const":
        return op.attrs["value"]
    return None


def wait_site(op: core.Op) -> int:
    """How a run-time check of a wait's count in the generated code names the wait: its count
    value's id (32 bits). Values survive the rewrites lowering makes (signals dropped for stream
    order, parts folded), where op positions shift; :func:`wait_at_site` finds the wait again in
    the kernel as traced."""
    return op.operands[2].id & 0xFFFFFFFF


def wait_at_site(kernel: core.Kernel, site: int) -> core.Op | None:
    """The (first) wait of ``kernel`` whose count :func:`wait_site` names ``site`` (None if none)."""
    for _, o in kernel.walk():
        if o.name in WAIT_OPS and wait_site(o) == site:
            return o
    return None


def enclosing(block: core.Block) -> dict[int, core.Op]:
    """id(op) -> the op whose region holds it (top-level ops are absent)."""
    out: dict[int, core.Op] = {}

    def walk(b, owner):
        for op in b.ops:
            if owner is not None:
                out[id(op)] = owner
            for r in op.regions:
                walk(r, op)
    walk(block, None)
    return out


def needed_ops(ops: Iterable[core.Op], is_root: Callable[[core.Op], bool]) -> set[int]:
    """ids of the ops to emit for the roots: the roots, the producers of their operands
    (transitively) and the control ops enclosing any of them."""
    need: set[int] = set()
    blk = core.Block(list(ops))
    parent = enclosing(blk)
    work = [op for op in blk.walk() if is_root(op)]
    while work:
        op = work.pop()
        if id(op) in need:
            continue
        need.add(id(op))
        if id(op) in parent:
            work.append(parent[id(op)])
        work.extend(v.owner for v in op.operands if isinstance(v.owner, core.Op))
    return need


def producers(values: Iterable[core.Value], ops: Iterable[core.Op], named=frozenset()) -> list[core.Op]:
    """The ops among ``ops`` (walked in program order, into regions) that compute ``values``,
    directly or through their operands, without the loops and conditions around them and
    stopping at values in ``named`` (ids): what a hook emits when it needs values where the
    tile program's structure is not kept (a guard, an expert, row ids, per tile). Index code is
    pure, so computing it outside its ``if`` or before its point in the program changes nothing."""
    want: set[int] = set()
    work = list(values)
    while work:
        v = work.pop()
        op = v.owner
        if v.id in named or not isinstance(op, core.Op) or id(op) in want:
            continue
        want.add(id(op))
        work.extend(op.operands)
    return [op for op in core.Block(list(ops)).walk() if id(op) in want]


def kernel_tensor(v: core.Value, role: str, at, what: str) -> core.Buffer:
    """The kernel tensor (argument or workspace) ``v`` names, or a LoweringError from recipe
    ``what`` at ``at`` saying that ``role`` must be one."""
    if not isinstance(v.owner, core.Buffer):
        raise fail(what, f"{role} must be a kernel tensor (argument or workspace)", at)
    return v.owner


def scope_of(op: core.Op) -> str:
    """The memory scope a signal op acquires or releases at ("gpu" | "sys")."""
    if op.name in WAIT_OPS:
        return DEFAULT_MEMORY_SCOPE[op.name]
    return op.attrs.get("scope", DEFAULT_MEMORY_SCOPE[op.name])


def widest_scope(scopes) -> str:
    """"sys" if any of ``scopes`` is, else "gpu"."""
    return "sys" if "sys" in set(scopes) else "gpu"
