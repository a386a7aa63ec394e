"""Planning pipelined dot loops in the general lowering: a ``tl.range`` loop whose body only
loads 16-bit tiles and accumulates their ``dot`` s into fragments runs as a GEMM mainloop
(``include/tldsl/general_pipeline.hpp``, rendered by :mod:`..rules.dot_loop`) instead of
statement by statement — the loads go by cp.async into a ring of shared-memory stages several
iterations ahead, each dot reads its operands where they landed, the accumulators stay in
registers. Which loops qualify (:func:`find_dot_loops`):

* the body holds only index code (``arith``, ``select``, ``load_scalar``), loads and, per dot,
  ``frag += tl.dot(x, y)`` (a ``frag_read``, an ``add``, a ``frag_write``), each fragment
  accumulated by one dot and touched by nothing else in the loop;
* every load is a whole 2-D tile of a 2-D tensor of this rank, f16 or bf16, read only by dots of
  the loop, always as the same operand (left operands are staged K-major, right ones MN-major —
  or K-major, a right operand ``tl.trans(w_tile)`` of a ``[N, K]`` tensor such as a torch
  ``Linear``'s weight: the tile is staged as it is loaded, rows of K, and the WGMMA reads it so);
* every dot: both operands such loads of one dtype, M and K multiples of 64, N one of 64, 128,
  192, 256 (the staged layout's 128-byte chunks and the WGMMA N); all dots of the loop share M;
* a CTA of one warpgroup per 64-row block of M (M 64 or 128), each thread holding at most
  :data:`ACC_LIMIT` accumulators.

Everything else stays on the statement-by-statement path, which lowers any program.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...ir import core
from ..abi import TmaDescriptorSpec, tma_param
from ..dtypes import MMA_INPUTS, SWIZZLE, ctype, elem_bytes

#: fp32 accumulators one thread may hold across a pipelined loop (of its ~255 registers)
ACC_LIMIT = 128
#: the N a staged dot may have (WGMMA m64nNk16 with N a multiple of the 64-element chunks)
STAGED_N = (64, 128, 192, 256)
#: the fewest stages the ring runs with (one iteration's copies in flight ahead of the WGMMAs,
#: with one WGMMA group left running across an iteration's end: :attr:`DotLoop.lookahead`)
MIN_STAGES = 3
#: the most stages the plan gives a ring
MAX_STAGES = 6
#: index code that may sit in a pipelined loop's body (re-evaluated for the iterations ahead)
INDEX_OPS = frozenset({"const", "arith", "select", "load_scalar"})


@dataclass(frozen=True)
class StagedLoad:
    """A load of the loop, staged in every stage at ``offset`` bytes (``nbytes``); ``tma``: the
    descriptor its TMA copies read (None: cp.async)."""
    op: core.Op
    offset: int
    nbytes: int
    role: str                     # "a" (K-major), "b" (MN-major) or "bt" (a right operand transposed: K-major)
    tma: TmaDescriptorSpec | None = None


@dataclass(frozen=True)
class StagedDot:
    """``frag += dot(a, b)``: the dot, its operands' loads, the fragment, the ops it replaces."""
    op: core.Op
    a: core.Op
    b: core.Op
    frag: core.Value
    ops: tuple                    # frag_read, add, frag_write
    fill: float | None            # the fragment's fill where its registers start from it (no slot
                                  # read: the frag_alloc is absorbed), else None (read the slot)
    trans: core.Op | None = None  # the ``trans`` of a K-major right operand (replaced: only a layout)

    @property
    def b_k_major(self) -> bool:
        return self.trans is not None


@dataclass(frozen=True)
class DotLoop:
    """A loop run as a pipelined mainloop: its staged loads and dots, the ring's shape and the
    CTA's warpgroups (each holding ``mb`` 64-row blocks of every dot's output)."""
    loop: core.Op
    loads: tuple
    dots: tuple
    stage_bytes: int
    stages: int
    warpgroups: int
    inflight_option: int | None = None   # WGMMA groups left running across an iteration's end (0 or
                                         # 1; None: 1 from four stages on, else 0: :attr:`inflight`)

    @property
    def inflight(self) -> int:
        """WGMMA groups left running across an iteration's end: the option, or by default one
        where the ring has four stages or more (two iterations of copies ahead either way)."""
        if self.inflight_option is not None:
            return self.inflight_option
        return 1 if self.stages >= 4 else 0

    @property
    def tma(self) -> bool:
        """Whether the stages are copied by TMA (one thread, an mbarrier per stage)."""
        return all(ld.tma is not None for ld in self.loads)

    @property
    def lookahead(self) -> int:
        """Iterations whose copies are issued ahead of the one the WGMMAs read: a stage is
        rewritten only once every warpgroup's WGMMAs on it are done — ``inflight`` iterations
        later."""
        return self.stages - 1 - self.inflight

    @property
    def mb(self) -> int:
        return self.dots[0].op.operands[0].type.shape[0] // 64 // self.warpgroups

    @property
    def ring_bytes(self) -> int:
        """The ring's stages, the slack that aligns them to 1024 bytes (the swizzle's period) and,
        copied by TMA, the stages' mbarriers after them."""
        return self.stages * self.stage_bytes + 1024 + (8 * self.stages if self.tma else 0)

    @property
    def absorbed_allocs(self) -> tuple:
        return tuple(d.frag.owner for d in self.dots if d.fill is not None)

    def ops(self) -> set[int]:
        """ids of the body's tile ops the mainloop replaces."""
        out = {id(ld.op) for ld in self.loads}
        for d in self.dots:
            out |= {id(d.op)} | {id(o) for o in d.ops} | ({id(d.trans)} if d.trans is not None else set())
        return out


def _op_walk(op: core.Op):
    """``op`` and every op in its regions."""
    yield op
    for r in op.regions:
        yield from r.walk()


def _blocks(block: core.Block):
    yield block
    for op in block.ops:
        for r in op.regions:
            yield from _blocks(r)


def _users(part: core.Part) -> dict[int, list[core.Op]]:
    out: dict[int, list[core.Op]] = {}
    for op in part.walk():
        for v in op.operands:
            out.setdefault(v.id, []).append(op)
    return out


def _fill(part: core.Part, loop: core.Op, frag: core.Value) -> float | None:
    """The fragment's fill where nothing touches it between its ``frag_alloc`` and the loop, both
    in one block (the registers start from the fill, the slot lives only after the loop)."""
    alloc = frag.owner
    if not isinstance(alloc, core.Op) or alloc.name != "frag_alloc":
        return None
    for b in _blocks(part.body):
        if alloc in b.ops and loop in b.ops:
            i, j = b.ops.index(alloc), b.ops.index(loop)
            if i > j:
                return None
            for op in b.ops[i + 1:j]:
                if any(x.operands and any(v is frag for v in x.operands) for x in _op_walk(op)):
                    return None
            return float(alloc.attrs["value"])
    return None


def _staged_dot(op: core.Op, body: list, users: dict) -> tuple | None:
    """(fragment, (frag_read, add, frag_write)) of ``frag += dot``, or None."""
    us = users.get(op.result.id, [])
    if len(us) != 1 or us[0].name != "ewise" or us[0].attrs.get("op") != "add" or us[0] not in body:
        return None
    add = us[0]
    other = add.operands[1] if add.operands[0] is op.result else add.operands[0]
    read = other.owner
    if not isinstance(read, core.Op) or read.name != "frag_read" or read not in body:
        return None
    frag = read.operands[0]
    aus = users.get(add.result.id, [])
    if len(aus) != 1 or aus[0].name != "frag_write" or aus[0].operands[0] is not frag or aus[0].operands[1] is not add.result:
        return None
    if len(users.get(read.result.id, [])) != 1:
        return None
    ftype = frag.type
    if ftype.dtype.name != "f32" or tuple(ftype.shape) != tuple(op.result.type.shape):
        return None
    if add.result.type.dtype.name != "f32" or op.result.type.dtype.name != "f32":
        return None
    return frag, (read, add, aus[0])


def _structure(part: core.Part, loop: core.Op, users: dict) -> tuple | None:
    """(loads {id: (op, role)}, dots [(op, frag, ops)]) where the loop has the shape the module
    docstring describes, else None."""
    body = loop.regions[0].ops
    loads: dict[int, list] = {}
    dots = []
    transposed: list[core.Op] = []
    claimed: set[int] = set()
    for op in body:
        if op.name in INDEX_OPS:
            continue
        if op.name == "load":
            loads[id(op)] = [op, None]
        elif op.name == "trans":
            transposed.append(op)       # a K-major right operand's (checked with the dots below)
        elif op.name == "dot":
            found = _staged_dot(op, body, users)
            if found is None:
                return None
            dots.append((op, *found))
            claimed |= {id(o) for o in found[1]}
        elif id(op) not in claimed and op.name not in ("frag_read", "ewise", "frag_write"):
            return None
    for op in body:
        if op.name in ("frag_read", "ewise", "frag_write") and id(op) not in claimed:
            return None
    if not dots:
        return None
    frags = [f for _, f, _ in dots]
    if len({f.id for f in frags}) != len(frags):
        return None
    ops_in_loop = {id(o) for o in _op_walk(loop)}
    for _, frag, ops in dots:           # nothing else in the loop touches the fragment
        if any(id(u) in ops_in_loop and u not in ops for u in users.get(frag.id, [])):
            return None
    M = None
    for op, _, _ in dots:
        a, b = op.operands
        b_role = "b"
        if isinstance(b.owner, core.Op) and b.owner.name == "trans" and b.owner in body \
                and [u.name for u in users.get(b.id, [])] == ["dot"]:
            b, b_role = b.owner.operands[0], "bt"     # a right operand transposed: staged K-major, as loaded
        if not (isinstance(a.owner, core.Op) and id(a.owner) in loads and isinstance(b.owner, core.Op)
                and id(b.owner) in loads):
            return None
        (m, k), n = a.type.shape, op.operands[1].type.shape[1]
        if a.type.dtype.name not in MMA_INPUTS or a.type.dtype != b.type.dtype or m % 64 or k % 64 \
                or n not in STAGED_N:
            return None
        if M not in (None, m):
            return None
        M = m
        for v, role in ((a, "a"), (b, b_role)):
            entry = loads[id(v.owner)]
            if entry[1] not in (None, role):
                return None         # one load as two operands of different layouts
            entry[1] = role
    if any(t not in (op.operands[1].owner for op, _, _ in dots) for t in transposed):
        return None                 # a transpose that is not a dot's right operand
    for op, role in loads.values():
        buf = op.operands[0].owner
        shape = tuple(op.result.type.shape)
        if role is None or len(shape) != 2 or tuple(op.attrs["shape"]) != shape or len(buf.type.shape) != 2 \
                or elem_bytes(buf.type.dtype) != 2 or shape[1] % 64 or shape[0] % 8:
            return None
        if any(u.name != ("trans" if role == "bt" else "dot") for u in users.get(op.result.id, [])):
            return None
    return loads, dots, M


#: the warpgroups a pipelined loop's CTA may have: one 64-row block of every dot's output each
#: (the configurations run on a GPU so far; BM 64 or 128)
MAX_WARPGROUPS = 2


def warpgroups_for(M: int, dots, threads: int | None) -> int | None:
    """The warpgroups of the CTA: one per 64-row block of M (at most :data:`MAX_WARPGROUPS`;
    ``threads`` // 128 must be that where given), each thread holding at most
    :data:`ACC_LIMIT` accumulators; None where that does not hold (the loop then runs statement by
    statement)."""
    w = M // 64
    if w > MAX_WARPGROUPS or (threads is not None and threads != 128 * w):
        return None
    if sum(d.result.type.shape[1] // 2 for d in dots) > ACC_LIMIT:
        return None
    return w


def _descriptor(op: core.Op) -> TmaDescriptorSpec | None:
    """The TMA descriptor a staged load's copies read (64-column boxes of its rows, 128-byte
    swizzle), or None where TMA cannot read the tensor (rows not a multiple of 16 bytes, a zero extent)."""
    buf = op.operands[0].owner
    nrows, ncols = buf.type.shape
    R = op.result.type.shape[0]
    dt = buf.type.dtype
    if ncols % 8 or ctype(dt).tma is None or nrows == 0 or ncols == 0:   # (TMA takes no zero extent)
        return None
    return TmaDescriptorSpec(f"{tma_param(buf)}_{R}x64", buf.name, "staged", dt.name, ctype(dt).tma, (ncols, nrows),
                             (ncols * 2,), (64, R), (1, 1), SWIZZLE[128])


def _trans_of(dot: core.Op) -> core.Op | None:
    """The ``trans`` a dot's right operand goes through (staged K-major), else None."""
    b = dot.operands[1].owner
    return b if isinstance(b, core.Op) and b.name == "trans" else None


def _right_load(dot: core.Op) -> core.Value:
    """The loaded tile behind a dot's right operand (under its ``trans``, if any)."""
    t = _trans_of(dot)
    return t.operands[0] if t is not None else dot.operands[1]


def find_dot_loops(part: core.Part, threads: int | None, stages: int, inflight: int | None = None,
                   copies: str = "tma") -> list[DotLoop]:
    """Every loop of the part that runs as a pipelined mainloop (see the module docstring), with
    ``stages`` stages (the plan lowers it where shared memory is short) and ``inflight`` WGMMA
    groups left running across iterations, in walk order; ``copies``: "tma" where every loaded
    tensor allows it (else, and for "cp.async", cp.async by every thread)."""
    users = _users(part)
    out = []
    for loop in part.walk():
        if loop.name != "for":
            continue
        found = _structure(part, loop, users)
        if found is None:
            continue
        loads, dots, M = found
        w = warpgroups_for(M, [d for d, _, _ in dots], threads)
        if w is None:
            continue
        staged, off = [], 0
        for op, role in loads.values():
            n = -(-op.result.type.shape[0] * op.result.type.shape[1] * 2 // 1024) * 1024
            staged.append(StagedLoad(op, off, n, role, _descriptor(op) if copies == "tma" else None))
            off += n
        if not all(ld.tma is not None for ld in staged):
            staged = [replace(ld, tma=None) for ld in staged]
        by_load = {id(s.op): s for s in staged}
        sdots = tuple(StagedDot(d, by_load[id(d.operands[0].owner)].op, by_load[id(_right_load(d).owner)].op, f, ops,
                                _fill(part, loop, f), _trans_of(d)) for d, f, ops in dots)
        out.append(DotLoop(loop, tuple(staged), sdots, off, max(MIN_STAGES, min(MAX_STAGES, stages)), w, inflight))
    return out


def with_stages(loop: DotLoop, stages: int) -> DotLoop:
    return replace(loop, stages=stages)
