"""Recognising the plain GEMM: a compute part whose accumulator is one K loop of
``acc += tl.dot(load A, load B)``, stored once, with waits before it and notifies (or a
generated epilogue of sums) after it. The matcher checks the structure only; the shapes, the
tile offsets and the schedule are the planner's (:mod:`..plan.gemm`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...ir import core
from ...ir.opdefs import NOTIFY_OPS, WAIT_OPS
from ..errors import fail, not_applicable
from ..ir_queries import CONTROL_OPS, SCALAR_OPS, kernel_tensor


WHAT = "GEMM lowering"


@dataclass
class GemmMatch:
    """What :func:`match_gemm` found in the part."""
    a: core.Buffer
    b: core.Buffer
    c: core.Buffer
    prologue: list[core.Op]         # before the accumulator: index code and waits
    loop: core.Op                   # the K loop
    dot: core.Op
    store: core.Op                  # the accumulator's store into C
    out_dtype: str
    frag: core.Op                   # the accumulator
    epilogue: list[core.Op] = field(default_factory=list)   # after the store: index code + notifies
    extras: list[core.Op] = field(default_factory=list)     # a generated epilogue's other stores (sums)
    epilogue_context: list[core.Op] = field(default_factory=list)
    """The ops the epilogue hook runs among: the prologue, the index code between the loop and
    the store (the epilogue may use any of their values), then the epilogue."""
    b_k_major: bool = False
    """B is stored [N, K] and its tile transposed in the loop: ``tl.dot(a, tl.trans(tl.load(b, (n, k),
    (BN, BK))))``, as a torch Linear's weight is kept."""

    @property
    def b_load(self) -> core.Op:
        """The load of B's tile (under the ``trans`` of a K-major B)."""
        op = self.dot.operands[1].owner
        return op.operands[0].owner if self.b_k_major else op


def is_accumulator(v: core.Value, frag: core.Op) -> bool:
    """Whether ``v`` is the accumulator itself (read, maybe cast)."""
    op = v.owner
    if isinstance(op, core.Op) and op.name == "cast":
        op = op.operands[0].owner
    return isinstance(op, core.Op) and op.name == "frag_read" and op.operands[0] is frag.result


def match_gemm(kernel: core.Kernel, part: core.Part) -> GemmMatch:
    """Check that ``part`` is the recognised GEMM; raise :class:`LoweringError` at the op that is not."""
    ops = part.body.ops
    fa = [i for i, op in enumerate(ops) if op.name == "frag_alloc"]
    if len(fa) != 1:
        raise not_applicable(WHAT, f"expected exactly one tl.fragment accumulator in compute part '{part.name}', "
                             f"found {len(fa)}", part)
    i0 = fa[0]
    prologue, rest = ops[:i0], ops[i0:]
    allowed_pro = SCALAR_OPS | CONTROL_OPS | WAIT_OPS
    for op in prologue:
        for sub in [op, *[o for r in op.regions for o in r.walk()]]:
            if sub.name not in allowed_pro:
                raise fail(WHAT, f"'{sub.name}' before the accumulator is not supported by the GEMM lowering "
                           "(only index arithmetic, loops and waits may precede it)", sub)
    frag = rest[0]
    if frag.result.type.dtype.name != "f32" or frag.attrs.get("value", 0) != 0:
        raise fail(WHAT, "the accumulator must be an f32 fragment initialised to 0", frag)
    # after the first top-level store: the epilogue (index code and notifies only)
    si = next((i for i, op in enumerate(rest) if op.name == "store"), None)
    if si is None and any(op.name == "if" for op in rest):
        m = _match_split(prologue, rest, frag)
    else:
        m = _match_plain(prologue, rest, frag, si)
    if any(len(t.type.shape) != 2 for t in (m.a, m.b, m.c)):    # e.g. experts' weights [E, K, N]: a grouped GEMM
        raise not_applicable(WHAT, "A, B and C must be 2-d", m.dot, made_for="grouped_gemm")
    between = [op for op in ops[len(m.prologue):] if op.name in SCALAR_OPS and op not in m.epilogue]
    m.epilogue_context = list(m.prologue) + between + list(m.epilogue)
    return m


def _match_plain(prologue, rest, frag, si) -> GemmMatch:
    """The K loop, then the store of the accumulator, then notifies (and their index code)."""
    epilogue = rest[si + 1:] if si is not None else []
    rest = rest[:si + 1] if si is not None else rest
    allowed_epi = SCALAR_OPS | CONTROL_OPS | NOTIFY_OPS
    for op in epilogue:
        for sub in [op, *[o for r in op.regions for o in r.walk()]]:
            if sub.name not in allowed_epi:
                raise fail(WHAT, f"'{sub.name}' after the tile's store is not supported by the GEMM lowering (only "
                           "index arithmetic, loops, conditions and notifies may follow the store)", sub)
    loop = _k_loop(rest, frag)
    tail = [op for op in rest[1:] if op is not loop and op.name not in ("const", "arith")]
    names = [op.name for op in tail]
    if names not in (["frag_read", "cast", "store"], ["frag_read", "store"]):
        raise fail(WHAT, "after the K loop expected `tl.store(c, (pm*BM, pn*BN), acc)` and nothing else, got "
                   f"{names}", tail[0] if tail else loop)
    store = tail[-1]
    if tail[0].operands[0] is not frag.result:
        raise fail(WHAT, "the store must write the accumulator", store)
    la, lb, dot, b_k_major = _k_body(loop, frag)
    a, b = kernel_tensor(la.operands[0], "A", la, WHAT), kernel_tensor(lb.operands[0], "B", lb, WHAT)
    c = kernel_tensor(store.operands[0], "C", store, WHAT)
    return GemmMatch(a, b, c, prologue, loop, dot, store, c.type.dtype.name, frag, epilogue, b_k_major=b_k_major)


def _k_loop(rest: list[core.Op], frag: core.Op) -> core.Op:
    loops = [op for op in rest if op.name == "for"]
    if len(loops) != 1:
        raise fail(WHAT, f"expected one tl.range K loop after the accumulator, found {len(loops)}", frag)
    return loops[0]


def is_stage_wait(op: core.Op) -> bool:
    """A wait in the K loop (maybe under conditions, with its index code): run by the producer
    before it loads the step's stage — e.g. a column-sliced all-gather's ``wait_cols``."""
    if op.name in WAIT_OPS:
        return True
    if op.name not in CONTROL_OPS:
        return False
    subs = [o for r in op.regions for o in r.walk()]
    return (any(o.name in WAIT_OPS for o in subs)
            and all(o.name in SCALAR_OPS | CONTROL_OPS | WAIT_OPS for o in subs))


def _k_body(loop: core.Op, frag: core.Op):
    """The K-loop body's A load, B load, dot and whether B's tile is transposed (checked:
    ``acc += tl.dot(load A, load B)`` or ``acc += tl.dot(load A, tl.trans(load B))``)."""
    # the K-loop body: load A, load B, dot, frag_read, add, frag_write (+ index arithmetic and
    # the stage waits before the loads)
    body = [op for op in loop.regions[0].ops if op.name not in ("const", "arith") and not is_stage_wait(op)]
    # B stored [N, K]: its tile transposed, `tl.dot(la, tl.trans(lb))` (the transpose is only a layout)
    trans = [op for op in body if op.name == "trans"]
    body = [op for op in body if op.name != "trans"]
    names = [op.name for op in body]
    # `acc += tl.dot(la, lb)`, `acc.write(tl.dot(la, lb, acc.read()))` and
    # `acc.write(acc.read() + tl.dot(la, lb))` trace to the same ops, the read placed differently
    if sorted(names) != sorted(["load", "load", "dot", "frag_read", "ewise", "frag_write"]) or \
            names[-2:] != ["ewise", "frag_write"] or names.index("dot") < max(i for i, n in enumerate(names)
                                                                            if n == "load"):
        raise fail(WHAT, "the K loop must be `acc += tl.dot(tl.load(a, ...), tl.load(b, ...))`, got "
                   f"{names}", loop)
    dot, fr = body[names.index("dot")], body[names.index("frag_read")]
    add, fw = body[-2], body[-1]
    la, lb = (v.owner for v in dot.operands[:2])
    if trans:
        if len(trans) > 1 or lb is not trans[0]:
            raise fail(WHAT, "tl.trans in the K loop must transpose B's loaded tile, tl.dot's second operand: "
                       "`tl.dot(tl.load(a, ...), tl.trans(tl.load(b, ...)))`", trans[-1])
        lb = lb.operands[0].owner
    loads = [op for op in body if op.name == "load"]
    if la not in loads or lb not in loads or la is lb:
        raise fail(WHAT, "tl.dot must multiply the two tiles loaded in the loop, A first", dot)

    if add.attrs.get("op") != "add" or {add.operands[0].id, add.operands[1].id} != {fr.result.id, dot.result.id}:
        raise fail(WHAT, "the loop must accumulate: acc += tl.dot(...)", add)
    if fr.operands[0] is not frag.result or fw.operands[0] is not frag.result or fw.operands[1] is not add.result:
        raise fail(WHAT, "the loop must read and write the same accumulator", fw)
    return la, lb, dot, bool(trans)


#: what a generated epilogue may contain besides index code: stores, their elementwise values
#: (the accumulator, loaded tiles, adds, casts), waits before them and notifies after them
EPILOGUE_OPS = SCALAR_OPS | CONTROL_OPS | NOTIFY_OPS | WAIT_OPS | {"store", "frag_read", "load", "ewise", "cast"}


def _match_split(prologue, rest, frag) -> GemmMatch:
    """A tile program whose code after the K loop chooses per tile what to store (e.g. GEMM +
    ReduceScatter summing in the epilogue: other ranks' rows into the partials, then notified;
    this rank's rows, after waits, plus the tiles peers sent, into the output). The first store
    of the accumulator itself is C's (at the tile's place: the GEMM's output); after it may come
    one more store, of an elementwise expression of the accumulator and loaded tiles."""
    loop = _k_loop(rest, frag)
    post = rest[rest.index(loop) + 1:]
    stores: list[core.Op] = []

    def walk(ops, in_loop):
        for op in ops:
            if op.name not in EPILOGUE_OPS:
                raise fail(WHAT, f"'{op.name}' after the K loop is not supported by the GEMM lowering (a generated "
                           "epilogue has stores of the accumulator and loaded tiles, waits, notifies and index "
                           "code)", op)
            if op.name == "store":
                if in_loop:
                    raise fail(WHAT, "a store in a loop after the K loop is not supported by the GEMM lowering", op)
                stores.append(op)
            for r in op.regions:
                walk(r.ops, in_loop or op.name == "for")
    walk(post, False)
    main = [st for st in stores if is_accumulator(st.operands[-1], frag)][:1]     # the first: C
    if not main:
        raise fail(WHAT, "a generated GEMM epilogue needs a store of the accumulator itself (the GEMM's output C)",
                   stores[0] if stores else loop)
    extras = [st for st in stores if st is not main[0]]
    if len(extras) > 1 or (extras and stores[-1] is not extras[0]):
        raise fail(WHAT, "a generated GEMM epilogue may store one elementwise sum of the accumulator, after its store "
                   "of the accumulator itself", extras[-1] if extras else main[0])
    la, lb, dot, b_k_major = _k_body(loop, frag)
    a, b = kernel_tensor(la.operands[0], "A", la, WHAT), kernel_tensor(lb.operands[0], "B", lb, WHAT)
    c = kernel_tensor(main[0].operands[0], "C", main[0], WHAT)
    return GemmMatch(a, b, c, prologue, loop, dot, main[0], c.type.dtype.name, frag, post, extras,
                     b_k_major=b_k_major)
