"""Tiles held in registers (the general lowering's third place for a tile value, beside a
shared-memory slot and computing it where it is consumed).

A memory-bound part — a row softmax, an RMSNorm — reads each element of a loaded tile a few
times in one iteration (a reduction, then the output). Staged in shared memory, every read is
another pass over the arena behind a barrier, and the arena's size caps the tasks an SM keeps
in flight. Held in registers, the tile is read from global memory once, straight into the
threads that use it, and the arena shrinks to the reductions' few floats.

A value outside the part's loops is **held** when every statement that reads it does so element
for element (through element ops of the same shape, :func:`.general._consumers`), outside loops
too: stores of a tile of its shape, stored element values of its shape, fragment writes of its
shape, and reductions of a tile of its shape along the last axis. Those statements then run in **chunk
order**: the tile's rows cut into chunks of ``V`` consecutive elements, chunk ``c`` on thread
``c % threads`` of the group as its ``c // threads`` th register chunk, so each thread finds in
its own registers every element it needs. Only loads (16-byte chunks of a tensor's rows) and
element values (``ewise``, ``cast``) are held, of 2- or 4-byte float types; ``V`` is one per tile
shape (8 where a 16-bit type takes part, else 4) and must divide the rows. The registers a
thread holds at once are capped at :data:`HELD_BYTES` (:data:`COSTLY_HELD_BYTES` while a value
taking costly math — an ``exp`` — is among them); over it, the largest values live there
go back to shared memory first. A held load at the top of the task body is **prefetched**
(:func:`prefetchable`): while a task computes, its group already loads the chunks of the task it
runs next into a second set of registers, so a memory-bound part keeps a load in flight the
whole time rather than only between its tasks' computations; one at offsets without a program
id (the same tile every task) is loaded once, before the first task. (Inside a ``tl.range`` loop, the
chunks' index code, hoisted out of the loop by the compiler for every statement, spilled
registers: 8 chunks a thread of a 16 x 256 tile went from 0.32 to 0.43 ms on an H200,
BENCHMARKS.md, eighteenth session.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ...ir import core
from ...ir import types as T
from ..dtypes import elem_bytes

#: the bytes of held tiles one thread keeps at once (32 registers: a 512-thread CTA has 128 a
#: thread, and the element code, addresses and a store's chunk need the rest)
HELD_BYTES = 128
#: the same while a value taking costly math is among them (48 registers: a 256-thread task holds
#: an 8192-wide f16 row and its f32 ``exp``, which would otherwise be computed twice) — loads
#: alone stay within :data:`HELD_BYTES` (an RMSNorm over rows of 16384 holding its loads, the
#: residual and the f32 cast in 48 registers spilled 208 bytes)
COSTLY_HELD_BYTES = 192


@dataclass(frozen=True)
class ChunkOrder:
    """How the group's threads walk a tile of ``shape`` in chunk order: ``chunks`` chunks of
    ``V`` elements (``K`` a row), thread ``t`` taking chunks ``t``, ``t + threads``, ... — at
    most ``per_thread`` of them."""
    shape: tuple
    V: int
    threads: int

    @property
    def K(self) -> int:
        return self.shape[-1] // self.V

    @property
    def chunks(self) -> int:
        return math.prod(self.shape[:-1]) * self.K

    @property
    def per_thread(self) -> int:
        return -(-self.chunks // self.threads)


@dataclass(frozen=True)
class Held:
    """A tile value in registers: its chunk order and the bytes a thread holds of it."""
    value: core.Value
    order: ChunkOrder

    @property
    def thread_bytes(self) -> int:
        return self.order.per_thread * self.order.V * elem_bytes(self.value.type.dtype)


def _chunk_width(dtypes) -> int:
    return 8 if any(elem_bytes(d) == 2 for d in dtypes) else 4


def _holdable(op: core.Op) -> bool:
    """A load of 16-byte chunks of a tensor's rows, or an element value; of a 2- or 4-byte float
    type. (i32 tiles stay in shared memory: NVRTC 13.0's ptxas folded a held chunk's
    ``max(-a, -b, -c, -d)`` into a three-input VIMNMX3 that dropped one operand's negation, and
    the H200 answered a row's max of ``-x`` with its max of ``x``.)"""
    v = op.result
    if not isinstance(v.type, T.TileType) or not v.type.shape or not v.type.dtype.is_float:
        return False
    if elem_bytes(v.type.dtype) not in (2, 4):
        return False
    if op.name == "load":
        return len(op.attrs["shape"]) == len(op.operands[0].type.shape) == len(v.type.shape)
    return op.name in ("ewise", "cast")


def _reads_in_chunk_order(stmt: core.Op, shape: tuple, absorbed: frozenset) -> bool:
    """Whether statement ``stmt`` can run in chunk order over a tile of ``shape`` (it reads a
    held value of that shape element for element)."""
    if id(stmt) in absorbed:
        return False
    if stmt.name == "store":
        buf, *offs, tile = stmt.operands
        return (tuple(tile.type.shape) == shape and len(offs) == len(buf.type.shape) == len(shape)
                and elem_bytes(buf.type.dtype) in (2, 4))
    if stmt.name in ("ewise", "cast"):
        return tuple(stmt.result.type.shape) == shape
    if stmt.name == "frag_write":
        return tuple(stmt.operands[0].type.shape) == shape
    if stmt.name == "reduce":         # float only: see _holdable (an i32 max of a cast is the same fold)
        x = stmt.operands[0]
        return (tuple(x.type.shape) == shape and stmt.attrs["axis"] == len(shape) - 1
                and x.type.dtype.is_float and stmt.result.type.dtype.is_float)
    return False


def _chunk_dtypes(stmt: core.Op) -> list:
    """The element types a statement moves through memory in chunks (loads' and stores' tensors)."""
    if stmt.name in ("load", "store"):
        return [stmt.operands[0].type.dtype]
    return []


def plan_held(prog, candidates: list[core.Op], consumers, reach_ok, threads: int,
              absorbed: frozenset, costly=lambda v: False) -> tuple[dict, dict]:
    """({value id: Held}, {id(statement op): ChunkOrder}) for the ``candidates`` (ops whose value
    would otherwise get a slot), given ``consumers(value) -> [(statement, pointwise)]`` and
    ``reach_ok(def op, statement)`` (the statement reads it in the defining iteration)."""
    readers: dict[int, list[core.Op]] = {}
    for op in candidates:
        if not _holdable(op) or prog.loops[id(op)]:
            continue
        shape = tuple(op.result.type.shape)
        stmts = consumers(op.result)
        if stmts and all(pw and reach_ok(op, s) and _reads_in_chunk_order(s, shape, absorbed) for s, pw in stmts):
            readers[op.result.id] = [op] + [s for s, _ in stmts]
    by_shape: dict[tuple, list[int]] = {}
    ops = {op.result.id: op for op in candidates}
    for vid in readers:
        by_shape.setdefault(tuple(ops[vid].result.type.shape), []).append(vid)
    held: dict[int, Held] = {}
    for shape, vids in by_shape.items():
        dtypes = [ops[v].result.type.dtype for v in vids]
        dtypes += [d for v in vids for s in readers[v] for d in _chunk_dtypes(s)]
        V = _chunk_width(dtypes)
        if shape[-1] % V:
            continue
        order = ChunkOrder(shape, V, threads)
        for v in vids:
            held[v] = Held(ops[v].result, order)
    held = _within_budget(prog, held, readers, costly)
    canon: dict[int, ChunkOrder] = {}
    for vid, h in held.items():
        for s in readers[vid]:
            canon[id(s)] = h.order
    return held, canon


def _within_budget(prog, held: dict, readers: dict, costly) -> dict:
    """``held`` less the values that would take a thread over :data:`HELD_BYTES` — or
    :data:`COSTLY_HELD_BYTES` where a value ``costly(value)`` says takes costly math is live —
    at some statement (the largest live there first)."""
    held = dict(held)
    live = {vid: (prog.pos[id(rs[0])], max(prog.pos[id(s)] for s in rs)) for vid, rs in readers.items()}
    while True:
        over = None
        for p in sorted({live[v][0] for v in held}):
            here = [v for v in held if live[v][0] <= p <= live[v][1]]
            limit = COSTLY_HELD_BYTES if any(costly(held[v].value) for v in here) else HELD_BYTES
            if sum(held[v].thread_bytes for v in here) > limit:
                over = here
                break
        if over is None:
            return held
        del held[max(over, key=lambda v: (held[v].thread_bytes, live[v][0]))]


#: the bytes a thread holds at once with the next task's prefetched loads (:func:`prefetchable`):
#: 64 registers
PREFETCH_BYTES = 256
#: the index code a prefetched load's offsets may be computed from (pure, per task)
PREFETCH_INDEX_OPS = frozenset({"const", "program_id", "rank", "arith", "select"})


def prefetchable(part: core.Part, held: dict, ops_before, written: frozenset) -> tuple[frozenset, frozenset]:
    """(the held loads whose next task's chunks are loaded while this task computes, those loaded
    once for every task — the ids of their values): loads at the top of the task body (no loop
    or condition around them), of a tensor the part never writes (``written``: their ids), at
    offsets computed from the program ids alone (``ops_before(op)``: the ops their offsets come
    from) — or from no program id at all: the same tile every task (an RMSNorm's weights),
    loaded before the first task and kept —; within :data:`PREFETCH_BYTES` with the held tiles,
    largest first. (The caller, :func:`.general._prefetch`, offers only parts whose tasks
    neither wait nor notify.)"""
    top = {id(op) for op in part.body.ops}
    ahead, once, total = [], [], sum(h.thread_bytes for h in held.values())
    for vid, h in sorted(held.items(), key=lambda kv: -kv[1].thread_bytes):
        op = h.value.owner
        if op.name != "load" or id(op) not in top or id(op.operands[0].owner) in written:
            continue
        index = ops_before(op)
        if any(q.name not in PREFETCH_INDEX_OPS for q in index):
            continue
        if not any(q.name == "program_id" for q in index):
            once.append(vid)
            continue
        if total + h.thread_bytes > PREFETCH_BYTES:
            continue
        total += h.thread_bytes
        ahead.append(vid)
    return frozenset(ahead), frozenset(once)
