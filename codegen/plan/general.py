"""Planning the general lowering of a compute part (:mod:`..recipes.general`): which tile values
live in shared memory and where, which are computed element by element where they are
consumed, and the kernel's ABI.

* **Materialised** (a slot of the shared-memory arena): the results of ``load``, ``load_rows``,
  ``reduce`` and ``dot``, every fragment, an elementwise value (``ewise``, ``cast``) that more
  than one op uses, that a loop it is not in uses or that takes costly math and is broadcast to
  more elements than it has (:func:`_expanded`), and a ``frag_read`` whose fragment is written
  while the value is still needed (a copy).
* **Computed where consumed** (no storage): ``full``, ``iota``, ``expand_dims``, ``broadcast``,
  ``trans`` (coordinates only), the other elementwise values, and a ``frag_read`` read in place.
* **Held in registers** (:mod:`.held`): a loaded float tile or stored element value outside the
  part's loops whose every reader takes it element for element (stores, element values and
  fragment writes of its shape, reductions along its rows) — 16-byte chunks spread over the
  task's threads, its readers run in the same chunk order; no slot.
* **Slots** are reused by liveness: a slot is live from the statement that writes it to the last
  statement that reads it (to the end of the outermost loop that reads it without defining it).
  Offsets are first-fit in order of definition; the shared-memory arena holds at most 227 KB.
* **Many tasks in flight over fewer stores**: where a part runs several tasks per CTA (task
  groups, below), element values read twice are computed again wherever that lets more tasks
  share an SM (a memory-bound part is bound by the loads it keeps in flight, not by a cast) —
  except those taking costly math (an ``exp``) where they fit in registers: those are held
  there, and the group's threads are chosen to hold them (:func:`_group_threads`).
* **Spilled slots** (:func:`_spills`): where the tiles do not fit in 227 KB even when element
  values read twice are computed again (the simulator takes tiles up to 256 x 256, a single f32
  one 256 KB), some move to a global-memory scratch private to each task group of each CTA
  (:data:`..abi.SCRATCH_PARAM`, allocated by the runtime, slots reused by liveness there too):
  those live where the arena overflows that the task touches least (a statement in a loop weighs
  :data:`LOOP_WEIGHT` times one outside it), dot operands last (every warp tile of a dot reads its
  operand fragments again: cheapest from shared memory); then any spilled slot that fits again
  comes back. Element loops
  read and write a slot through a pointer into either space. The scratch has no bound here (a
  tile's elements do, at trace: ``tldsl.tracing.MAX_TILE_ELEMENTS``, for 32-bit element indices);
  the runtime gives a kernel fewer CTAs where every CTA's would not fit the GPU's free memory
  (``runtime/gpu/scratch_fit.py``).
* **Dots on WGMMA** (:func:`wgmma_dot`): a dot of f16 / bf16 tiles with a multiple of 64 rows,
  in a CTA of whole warpgroups, runs on WGMMA (``include/tldsl/general_wgmma.hpp``): its
  operands are staged, K-major, in a staging slot of the arena live at the dot only (never
  spilled: WGMMA reads shared memory), at most :data:`STAGING_LIMIT` bytes (longer K is staged
  in chunks). Every other dot runs on ``mma.sync`` and reads its operands where they are.
* **Pipelined dot loops** (:mod:`.dot_loop`): a loop that only loads 16-bit tiles and
  accumulates their dots into fragments runs as a GEMM mainloop — a ring of stages filled by
  TMA or cp.async (a staging slot live for the loop, never spilled), accumulators in registers, each
  fragment's slot written once after the loop (and live only from there where the fragment is
  filled just before the loop). The ring gets the compute schedule's ``stages`` (at least
  three), fewer where shared memory is short; a loop that does not fit with three runs
  statement by statement. The CTA then has the warpgroups the loop's dots need.
* **Task groups** (:func:`task_groups`): a part whose tasks never wait for each other and have
  no dot runs several tasks per CTA, each on its own group of threads with its own copy of the
  arena — the runtime launches one CTA per SM, and one task's tile at a time leaves an SM's
  memory pipeline mostly idle.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ...ir import core
from ...ir import types as T
from ...ir.opdefs import DATA_OPS, NOTIFY_OPS, WAIT_OPS, data_operands
from ..abi import (LAUNCH_PARAM, RANK_PARAM, SCRATCH_PARAM, KernelParam, buffer_param, entry_name, is_this_rank,
                   peer_buffer_param, peer_signal_param, signal_param, table_param, wait_timeout_options)
from ..dtypes import MMA_INPUTS, ctype, elem_bytes
from ..errors import fail
from ..ir_queries import producers
from ..match.general import ELEMENT_OPS, WHAT, GeneralMatch
from .comm import task_decode
from .dot_loop import MIN_STAGES as MIN_RING_STAGES, DotLoop, find_dot_loops, with_stages
from .held import ChunkOrder, plan_held, prefetchable
from .tile_order import order_align_shift, order_group_m

DEFAULT_THREADS = 128
#: threads of a task group where a CTA runs several tasks at once (unless ``threads`` is given):
#: small groups, many tasks in flight on an SM
GROUP_THREADS = 64
#: the most threads one CTA runs (its groups together): 128 registers a thread
MAX_CTA_THREADS = 512
#: the most task groups one CTA holds (named barriers 1..8)
MAX_GROUPS = 8
#: the shared memory a CTA may use on sm_90 (227 KB of the SM's 228)
SMEM_LIMIT = 227 * 1024
#: how much more often a statement inside a loop runs than one outside it, when choosing the slots
#: to spill (trip counts may be known only at run time)
LOOP_WEIGHT = 8
ALIGN = 16
#: element ops that only move coordinates or make constants: never stored, recomputed freely
COORDINATE_OPS = frozenset({"full", "iota", "expand_dims", "broadcast", "trans"})
#: ops whose tile result always gets a slot
STORED_RESULTS = frozenset({"load", "load_rows", "reduce", "dot", "frag_alloc", "tile_pull_data"})
#: the N of the WGMMA ops a dot's warpgroup tiles use (m64nNk16; ``general_wgmma.hpp`` GmmaSS):
#: at most 128 columns, 64 fp32 accumulators a thread, registers left for the dot's epilogue
WGMMA_N = (8, 16, 32, 64, 96, 128)
#: the most shared memory one WGMMA dot stages its operands in (beyond it, K goes in chunks)
STAGING_LIMIT = 64 * 1024
#: 32-bit registers of a CTA (sm_90): what a thread's share of them is, at a CTA's size
REGISTERS = 65536


def reduce_partials(op: core.Op, threads: int, n: int | None = None) -> int:
    """How many warps reduce each output of ``reduce`` op together (1: a warp an output, as a row
    reduction with many rows has it): where the outputs leave warps of the ``threads`` idle — a
    whole row of a memory-bound part reduced by one of its warps — the reduced axis is split
    between the idle warps (at least 32 elements each), whose partial results meet in shared
    memory (4 bytes each after the output's slot). ``n``: the reduced length where it is not the
    operand's (a reduction of held registers reduces its chunks' partial results)."""
    x = op.operands[0]
    n = x.type.shape[op.attrs["axis"]] if n is None else n
    nout = math.prod(op.result.type.shape)
    if op.result.type.dtype.kind == "bool" or n < 64 or nout * 32 >= threads:
        return 1
    return max(1, min(threads // (32 * nout), n // 32))


@dataclass(frozen=True)
class ReduceSlot:
    """The shared memory of a ``reduce`` op's slot: its outputs, then the warps' partial results
    an output (:func:`reduce_partials`) at ``warp_offset``, then (a reduction of held registers)
    one partial result a chunk at ``chunk_offset``. ``one_row``: a held tile of one row, reduced
    by each thread over its chunks, then its warp by shuffles, then one partial result a warp at
    ``warp_offset`` (one a thread where threads are not warps: the CPU emulation)."""
    warp_offset: int
    chunk_offset: int
    nbytes: int
    one_row: bool = False


def one_row_held(order: ChunkOrder | None) -> bool:
    """Whether a reduction of a held tile in ``order`` reduces one row (every chunk of every
    thread in it: no partial result a chunk needs to go through shared memory)."""
    return order is not None and math.prod(order.shape[:-1]) == 1


def reduce_slot(op: core.Op, threads: int, order: ChunkOrder | None = None) -> ReduceSlot:
    """The layout of ``reduce`` op's slot in a CTA of ``threads`` (``order``: its operand's held
    chunk order, where the reduction reads registers)."""
    nout = math.prod(op.result.type.shape)
    out = (nout * elem_bytes(op.result.type.dtype) + ALIGN - 1) // ALIGN * ALIGN
    if one_row_held(order):
        return ReduceSlot(out, out + threads * 4, out + threads * 4, True)
    P = reduce_partials(op, threads, None if order is None else order.K)
    end = out + P * nout * 4
    if order is None:
        return ReduceSlot(out, end, end)
    chunk = (end + ALIGN - 1) // ALIGN * ALIGN
    return ReduceSlot(out, chunk, chunk + nout * order.K * 4)


@dataclass(frozen=True)
class WgmmaDot:
    """How a dot runs on WGMMA: ``nt`` columns of a warpgroup's output tile, ``kc`` columns of K
    staged at once (a multiple of 16), ``nbytes`` of staging (``wgmma_staging_bytes`` in C++)."""
    nt: int
    kc: int
    nbytes: int


def wgmma_dot(op: core.Op, threads: int) -> WgmmaDot | None:
    """The WGMMA shape of dot ``op`` in a CTA of ``threads`` threads, or None where it runs on
    ``mma.sync``: operands not f16 / bf16 (f32 runs as TF32 there), rows not a multiple of 64
    (WGMMA's M), or threads not whole warpgroups. Output tiles: the fewest that cover N, each of
    the narrowest :data:`WGMMA_N` that does, whose accumulators take at most a quarter of the
    registers a thread has (128 columns up to 256 threads, fewer in larger CTAs); K staged whole
    where the operands fit :data:`STAGING_LIMIT`, else in equal chunks — but on ``mma.sync`` where
    even a chunk of 16 would not fit a CTA's shared memory (the staging is never spilled)."""
    a, b = op.operands
    (M, K), N = a.type.shape, b.type.shape[1]
    if a.type.dtype.name not in MMA_INPUTS or M % 64 or threads % 128:
        return None
    widths = [w for w in WGMMA_N if w // 2 <= REGISTERS // threads // 4] or [WGMMA_N[0]]
    tiles_n = -(-N // widths[-1])
    nt = next(w for w in widths if w * tiles_n >= N)
    rows = M + tiles_n * nt                  # A's rows and B's columns, staged as rows of K
    if rows * 16 * 2 > SMEM_LIMIT:
        return None
    kp = -(-K // 16) * 16
    chunks = -(-kp // max(16, STAGING_LIMIT // (rows * 2) // 16 * 16))
    kc = (-(-kp // chunks) + 15) // 16 * 16
    return WgmmaDot(nt, kc, rows * kc * 2)


@dataclass(frozen=True)
class Slot:
    """A materialised tile (or fragment): in the shared-memory arena, or (``spilled``) in the task
    group's global-memory scratch, ``offset`` bytes into either; or (``staging``) the shared
    memory a WGMMA dot stages its operands in (``value``: the dot's result)."""
    value: core.Value
    op: core.Op              # the op whose statement writes it
    offset: int
    nbytes: int
    start: int               # live range, in statement positions
    end: int
    spilled: bool = False
    staging: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.type.shape)

    @property
    def dtype(self) -> T.DType:
        return self.value.type.dtype


@dataclass(frozen=True)
class GeneralPlan:
    """Everything :func:`..recipes.general.render_general` needs."""
    kernel: core.Kernel
    part: core.Part
    match: GeneralMatch
    entry: str
    threads: int
    slots: dict                   # value id -> Slot
    views: dict                   # frag_read result id -> the fragment's value id (read in place)
    epilogues: dict               # dot result id -> the statement op the dot performs per element
    absorbed: frozenset           # ids of those statement ops (not rendered where they stand)
    smem_bytes: int
    decode: tuple                 # (axis, divisor, modulus | None) per program-id axis
    lanes: int | None             # a communication part: how many tasks may run at once (its CTAs)
    params: tuple[KernelParam, ...]
    signals: tuple[str, ...]
    options: tuple[str, ...]      # NVRTC options
    groups: int = 1               # task groups per CTA (each ``threads`` threads, its own arena and barrier)
    arena_bytes: int = 0          # one group's shared memory (smem_bytes = groups * arena_bytes)
    notes: tuple[str, ...] = field(default=())
    scratch_bytes: int = 0        # one group's global-memory scratch (its spilled slots; 0: none)
    wgmma: dict = field(default_factory=dict)      # dot result id -> WgmmaDot (the dots on WGMMA)
    stagings: dict = field(default_factory=dict)   # dot result id -> its staging Slot (shared memory)
    order: "TileOrder | None" = None   # the compute schedule's tile order, else row-major per ``decode``
    dot_loops: dict = field(default_factory=dict)  # id(for op) -> DotLoop (the pipelined loops)
    tma: tuple = ()               # TmaDescriptorSpec per "tma" parameter (the loops' TMA copies)
    rings: dict = field(default_factory=dict)      # id(for op) -> the Slot of its ring of stages
    held: dict = field(default_factory=dict)       # value id -> Held (:mod:`.held`: in registers)
    canon: dict = field(default_factory=dict)      # id(statement op) -> the ChunkOrder it runs in
    prefetch: frozenset = frozenset()              # held loads the next task's chunks are fetched for early
    written: frozenset = frozenset()               # id() of the tensors the part writes on this rank
    invariant: frozenset = frozenset()             # held loads of the same tile every task: loaded once
    replicated: frozenset = frozenset()            # one-element values every thread holds in a register

    def materialised(self, v: core.Value) -> bool:
        return v.id in self.slots


class _Program:
    """The part's ops in walk order, with where each sits: position, block, enclosing loops,
    users of each value."""

    def __init__(self, part: core.Part):
        self.order: list[core.Op] = []
        self.pos: dict[int, int] = {}
        self.end: dict[int, int] = {}          # id(op) -> last position inside it (itself if no region)
        self.loops: dict[int, tuple] = {}      # id(op) -> enclosing for ops, outermost first
        self.users: dict[int, list[core.Op]] = {}
        self._walk(part.body, ())

    def _walk(self, block: core.Block, loops: tuple):
        for op in block.ops:
            self.pos[id(op)] = len(self.order)
            self.order.append(op)
            self.loops[id(op)] = loops
            for v in op.operands:
                users = self.users.setdefault(v.id, [])
                if not users or users[-1] is not op:
                    users.append(op)
            for r in op.regions:
                self._walk(r, loops + ((op,) if op.name == "for" else ()))
            self.end[id(op)] = len(self.order) - 1

    def reach(self, def_op: core.Op, use: core.Op) -> int:
        """The last position at which ``use`` may read a value ``def_op`` defined: its own, or
        the end of the outermost loop around it that does not hold ``def_op``."""
        outer = [lp for lp in self.loops[id(use)] if lp not in self.loops[id(def_op)] and lp is not def_op]
        return self.end[id(outer[0])] if outer else self.pos[id(use)]


#: how element values read by several statements of one iteration are kept (:func:`_fuse_decisions`):
#: each stored once; each computed again by every reader; only those without costly math
#: computed again (the costly ones — an ``exp`` — stored, in registers where they fit)
STORE_SHARED, RECOMPUTE, RECOMPUTE_CHEAP = False, True, "cheap"


#: the deepest expression of fused element values: a chain of 500 (``t = t * a + b`` unrolled by
#: tl.static_range) would be one C++ expression 500 deep, rendered by recursion; every so many ops
#: a value is stored instead (programs of ordinary depth are unaffected)
MAX_FUSED_DEPTH = 64


def _fuse_decisions(prog: _Program, recompute) -> tuple[set[int], dict[int, int]]:
    """(ids of values computed where consumed, frag_read views) — every other tile value of an
    op in :data:`STORED_RESULTS` or an element op gets a slot. ``recompute``
    (:data:`STORE_SHARED`, :data:`RECOMPUTE` or :data:`RECOMPUTE_CHEAP`): whether an element
    value read by several ops of the same iteration is computed again by each (no slot) — the
    fallback when storing it does not fit —, or only one that takes no costly math."""
    fused: set[int] = set()
    views: dict[int, int] = {}
    depth: dict[int, int] = {}          # of the expression a fused value renders as
    for op in prog.order:
        if not op.results or not isinstance(op.result.type, (T.TileType, T.FragmentType)):
            continue
        v = op.result
        users = prog.users.get(v.id, [])
        d = 1 + max((depth.get(x.id, 0) for x in op.operands), default=0)
        if op.name in COORDINATE_OPS:
            fused.add(v.id)
            depth[v.id] = d
        elif op.name in ELEMENT_OPS and d > MAX_FUSED_DEPTH:
            pass                        # a long chain (an unrolled loop of updates) is stored every so often
        elif op.name in ELEMENT_OPS:
            # read (through coordinate ops, which are recomputed wherever they are read) only in
            # the iteration that computes it: a value read in a loop it is not in is stored once
            # rather than computed again for every element of every iteration (unless storing
            # does not fit: ``recompute``)
            again = recompute is RECOMPUTE or (recompute == RECOMPUTE_CHEAP
                                               and not _costly(v, math.prod(v.type.shape)))
            readers = users if again else _through_coordinates(prog, users)
            same_iteration = all(prog.reach(op, u) == prog.pos[id(u)] for u in readers)
            if not users or (same_iteration and (len(users) == 1 or again) and not _expanded(prog, v)):
                fused.add(v.id)         # read in the same iteration: computed there (unused: never)
                depth[v.id] = d
    # a fragment read in place while no write of the fragment can change what it reads
    for op in prog.order:
        if op.name == "frag_read" and _read_in_place(prog, op, fused):
            views[op.result.id] = op.operands[0].id
            fused.add(op.result.id)
    return fused, views


#: element math that costs a slow-path routine or a multi-function-unit sequence per element
COSTLY_MATH = frozenset({"div", "floordiv", "mod", "recip", "exp", "exp2", "log", "sqrt", "rsqrt", "sigmoid",
                         "tanh", "erf"})


def _costly(v: core.Value, n: int, seen: dict | None = None) -> bool:
    """Whether computing ``v`` takes :data:`COSTLY_MATH` (through the element ops of ``n``
    elements it is computed from; each value looked at once)."""
    seen = {} if seen is None else seen
    todo = [(v, False)]             # an explicit stack: a chain of 500 element ops is no Python recursion
    while todo:
        x, operands_done = todo.pop()
        op = x.owner
        if operands_done:
            seen[x.id] = any(seen[y.id] for y in op.operands if isinstance(y.type, T.TileType))
            continue
        if x.id in seen:
            continue
        if not (isinstance(op, core.Op) and op.name in ("ewise", "cast") and math.prod(x.type.shape) == n):
            seen[x.id] = False
        elif op.name == "ewise" and op.attrs["op"] in COSTLY_MATH:
            seen[x.id] = True
        else:
            seen[x.id] = False      # (until its operands are known)
            todo.append((x, True))
            todo.extend((y, False) for y in op.operands if isinstance(y.type, T.TileType) and y.id not in seen)
    return seen[v.id]


def _expanded(prog: _Program, v: core.Value) -> bool:
    """Whether ``v`` takes costly math and is broadcast — read, directly or through coordinate
    ops, by an element op with more elements: a per-row value broadcast over its rows (an
    RMSNorm's ``rsqrt(mean + eps)``) is stored once rather than computed again for every element
    it scales — two divisions and a square root per element of the row otherwise."""
    n = math.prod(v.type.shape)
    return _broadcast_read(prog, v, n) and _costly(v, n)


def _broadcast_read(prog: _Program, v: core.Value, n: int) -> bool:
    for u in prog.users.get(v.id, []):
        if u.name not in ELEMENT_OPS or not u.results:
            continue
        if math.prod(u.result.type.shape) > n or (u.name in COORDINATE_OPS and _broadcast_read(prog, u.result, n)):
            return True
    return False


def _through_coordinates(prog: _Program, users: list) -> list:
    """``users``, each coordinate op among them replaced by the ops that read its value."""
    out = []
    for u in users:
        if u.name in COORDINATE_OPS and u.results:
            out += _through_coordinates(prog, prog.users.get(u.result.id, []))
        else:
            out.append(u)
    return out


def _consumers(prog: _Program, v: core.Value, fused: set[int], pointwise: bool = True):
    """The statements that read ``v`` (through element ops computed in place), each with
    whether the path reads element i of ``v`` for element i of the statement's output."""
    out = []
    for u in prog.users.get(v.id, []):
        if u.results and u.result.id in fused and u.name != "frag_read":
            same = (pointwise and u.name in ("ewise", "cast") and tuple(u.result.type.shape) == tuple(v.type.shape))
            out += _consumers(prog, u.result, fused, same)
        else:
            out.append((u, pointwise))
    return out


def _read_in_place(prog: _Program, read: core.Op, fused: set[int]) -> bool:
    frag = read.operands[0]
    users = prog.users.get(read.result.id, [])
    if len(users) != 1 or prog.reach(read, users[0]) != prog.pos[id(users[0])]:
        return False
    start = prog.pos[id(read)]
    for stmt, pointwise in _consumers(prog, read.result, fused):
        stop = prog.reach(read, stmt)
        for q in prog.order[start + 1:stop + 1]:
            if q.name == "frag_write" and q.operands[0] is frag:
                if q is stmt and pointwise and tuple(q.operands[1].type.shape) == tuple(frag.type.shape):
                    continue        # element i read, then element i written: in place is exact
                return False
    return True


def _epilogues(prog: _Program, fused: set[int], views: dict) -> tuple[dict, dict]:
    """Dots whose result goes, element for element, into one statement right after them —
    ``frag += tl.dot(a, b)``, ``acc = acc * alpha + tl.dot(p, v)`` (a ``frag_write``) or a
    stored element value such as ``tl.where(mask, tl.dot(q, k) * scale, -inf)`` — compute that
    statement's element as each dot result comes out of the tensor cores: the dot's result
    needs no slot. Returns ({dot result id: the statement's op}, {target value id: the dot's
    position}: where the stored value's slot becomes live)."""
    out: dict[int, core.Op] = {}
    starts: dict[int, int] = {}
    for op in prog.order:
        if op.name != "dot":
            continue
        shape = tuple(op.result.type.shape)
        cur, target = op.result, None
        while True:                 # follow the dot's one reader through elementwise ops
            users = prog.users.get(cur.id, [])
            if len(users) != 1:
                break
            u = users[0]
            if u.name == "frag_write":
                if u.operands[1] is cur and tuple(u.operands[0].type.shape) == shape:
                    target = u
                break
            if u.name not in ("ewise", "cast") or tuple(u.result.type.shape) != shape:
                break
            if u.result.id not in fused:
                target = u          # a stored element value
                break
            cur = u.result
        if target is None:
            continue
        between = prog.order[prog.pos[id(op)] + 1:prog.pos[id(target)]]
        if any(b.regions or (b.name != "const" and not (b.results and all(r.id in fused for r in b.results)))
               for b in between):
            continue                # a statement or index code in between: it must run first
        if target.name == "frag_write":
            frag = target.operands[0]
            if not _pointwise_only(target.operands[1], frag, views, fused, shape) or \
                    any(_reads(x, frag, views, fused) for x in op.operands):
                continue            # the fragment read elsewhere than the element being written
        else:
            starts[target.result.id] = prog.pos[id(op)]
        out[op.result.id] = target
    return out, starts


def _pointwise_only(v: core.Value, frag: core.Value, views: dict, fused: set[int], shape) -> bool:
    """Whether computing ``v`` (of ``shape``) in place reads ``frag`` at most at the element
    being computed."""
    if views.get(v.id) == frag.id:
        return tuple(v.type.shape) == shape
    op = v.owner
    if not isinstance(op, core.Op) or v.id not in fused:
        return True                 # a stored value or a scalar: not the fragment
    same = op.name in ("ewise", "cast") and tuple(op.result.type.shape) == shape
    for x in op.operands:
        if not isinstance(x.type, T.TileType):
            continue
        if same and tuple(x.type.shape) == shape:
            if not _pointwise_only(x, frag, views, fused, shape):
                return False
        elif _reads(x, frag, views, fused):
            return False
    return True


def _reads(v: core.Value, frag: core.Value, views: dict, fused: set[int]) -> bool:
    """Whether computing ``v`` in place reads ``frag`` (through a read in place)."""
    if views.get(v.id) == frag.id:
        return True
    op = v.owner
    if not isinstance(op, core.Op) or v.id not in fused:
        return False
    return any(_reads(x, frag, views, fused) for x in op.operands if isinstance(x.type, T.TileType))


def _statements(prog: _Program, op: core.Op, v: core.Value, fused: set[int], views: dict) -> list[core.Op]:
    """``op`` and every op that reads or writes ``v`` — directly, through values computed in
    place, or (a fragment) through its reads in place."""
    reads = [v]
    if isinstance(v.type, T.FragmentType):
        reads += [u.result for u in prog.users.get(v.id, []) if u.name == "frag_read" and u.result.id in views]
    users = list(prog.users.get(v.id, []))
    for x in reads:
        users += [stmt for stmt, _ in _consumers(prog, x, fused)]
    return [op] + users


def _live_range(prog: _Program, op: core.Op, statements: list[core.Op]) -> tuple[int, int]:
    """From ``op`` to the last of the ``statements`` that touch its value, each stretched to the
    end of the outermost loop around it that ``op`` is not in."""
    start = prog.pos[id(op)]
    return start, max([start] + [prog.reach(op, u) for u in statements])


@dataclass(frozen=True)
class _Tile:
    """A value that needs a slot, before it has one: its size, live range, how much the task
    touches it (each statement that does, :data:`LOOP_WEIGHT` times more per loop around it) and
    whether a dot reads it (dot operands stay in shared memory where they can: each warp tile
    reads them again)."""
    value: core.Value
    op: core.Op
    nbytes: int
    start: int
    end: int
    touches: int
    dot_operand: bool
    staging: bool = False         # a WGMMA dot's staging: shared memory, never spilled

    @property
    def key(self) -> tuple[int, bool]:
        return (self.value.id, self.staging)

    def overlaps(self, start: int, end: int) -> bool:
        return not (self.end < start or end < self.start)


def _first_fit(tiles: list[_Tile], *, spilled: bool = False) -> tuple[dict, int]:
    """First-fit offsets for ``tiles``, in order of start: ({tile key: Slot}, bytes used)."""
    placed: list[Slot] = []
    top = 0
    for t in sorted(tiles, key=lambda t: (t.start, t.end)):
        busy = sorted((s.offset, s.offset + s.nbytes) for s in placed if not (s.end < t.start or t.end < s.start))
        off = 0
        for lo, hi in busy:
            if off + t.nbytes <= lo:
                break
            off = max(off, (hi + ALIGN - 1) // ALIGN * ALIGN)
        placed.append(Slot(t.value, t.op, off, t.nbytes, t.start, t.end, spilled, t.staging))
        top = max(top, off + t.nbytes)
    return {(s.value.id, s.staging): s for s in placed}, top


def _crowded(tiles: list[_Tile]) -> list[_Tile]:
    """The tiles live at a statement where the live tiles together exceed :data:`SMEM_LIMIT`."""
    over = [p for p in sorted({t.start for t in tiles})
            if sum(t.nbytes for t in tiles if t.overlaps(p, p)) > SMEM_LIMIT]
    return [t for t in tiles if any(t.overlaps(p, p) for p in over)]


def _spills(tiles: list[_Tile]) -> set[tuple[int, bool]]:
    """The keys of the tiles whose slots go to the global-memory scratch so that the rest fit in
    :data:`SMEM_LIMIT` (none where all fit): one at a time, of the tiles live where shared memory
    overflows, the one the task touches least (dot operands last, the largest first among equals;
    a WGMMA staging never); then each spilled one that fits again comes back (dot operands, then
    the most touched, first)."""
    shared, out = list(tiles), []
    while _first_fit(shared)[1] > SMEM_LIMIT:
        movable = [t for t in _crowded(shared) or shared if not t.staging] or [t for t in shared if not t.staging]
        if not movable:             # at most one staging is live at a statement, within STAGING_LIMIT
            raise fail(WHAT, "internal: the WGMMA stagings alone exceed shared memory", tiles[0].op)
        victim = min(movable, key=lambda t: (t.dot_operand, t.touches, -t.nbytes))
        shared.remove(victim)
        out.append(victim)
    for t in sorted(out, key=lambda t: (not t.dot_operand, -t.touches, t.nbytes)):
        if _first_fit(shared + [t])[1] <= SMEM_LIMIT:
            shared.append(t)
            out.remove(t)
    return {t.key for t in out}


def _place(tiles: list[_Tile]) -> tuple[dict, dict, dict, int, int]:
    """Every tile's slot: ({value id: Slot}, {dot result id: staging Slot}, {id(for op): its
    ring's Slot}, shared-memory arena bytes, scratch bytes)."""
    spilled = _spills(tiles)
    shared, top = _first_fit([t for t in tiles if t.key not in spilled])
    scratch, scratch_top = _first_fit([t for t in tiles if t.key in spilled], spilled=True)
    placed = {**shared, **scratch}
    slots = {vid: s for (vid, staging), s in placed.items() if not staging}
    stagings = {vid: s for (vid, staging), s in placed.items() if staging and s.op.name != "for"}
    rings = {id(s.op): s for (vid, staging), s in placed.items() if staging and s.op.name == "for"}
    return slots, stagings, rings, top, scratch_top


def _abi(kernel: core.Kernel, part: core.Part, *,
         scratch: bool = False) -> tuple[tuple[KernelParam, ...], tuple[str, ...]]:
    """Parameters in order: per tensor (kernel order) this rank's pointer (const when only
    read) and the table of every rank's pointers (when a data primitive reaches another rank);
    per signal this rank's counters and the table of every rank's copies (when notified
    on another rank); the ``load_scalar`` tables; the global-memory scratch (``scratch``: some
    slots are spilled); ``rank``; ``launch``."""
    modes: dict[int, set] = {}
    peer_modes: dict[int, set] = {}
    tables: list[core.Buffer] = []
    local_s: set[int] = set()
    peer_s: set[int] = set()
    for op in part.walk():
        if op.name in ("load", "load_rows"):
            modes.setdefault(id(op.operands[0].owner), set()).add("r")
        elif op.name == "store":
            modes.setdefault(id(op.operands[0].owner), set()).add("w")
        elif op.name == "add_rows":
            modes.setdefault(id(op.operands[0].owner), set()).update("rw")
        elif op.name in DATA_OPS:
            src, srank, _, dst, drank, _, _ = data_operands(op)
            for v, rank, mode in ((src, srank, "r"), (dst, drank, "w")):
                if v is not None:
                    (modes if is_this_rank(rank) else peer_modes).setdefault(id(v.owner), set()).add(mode)
        elif op.name == "load_scalar" and op.operands[0].owner not in tables:
            tables.append(op.operands[0].owner)
        elif op.name in WAIT_OPS:
            local_s.add(id(op.operands[0].owner))
        elif op.name in NOTIFY_OPS:
            if op.name == "producer_tile_notify" or is_this_rank(op.operands[2]):
                local_s.add(id(op.operands[0].owner))
            else:
                peer_s.add(id(op.operands[0].owner))
    params: list[KernelParam] = []
    for b in kernel.buffers:
        if id(b) in modes:
            const = "const " if modes[id(b)] == {"r"} else ""
            params.append(KernelParam(buffer_param(b), f"{const}{ctype(b.type.dtype).comm}*", "ptr",
                                      f"buffer:{b.name}"))
        if id(b) in peer_modes:
            params.append(KernelParam(peer_buffer_param(b), f"{ctype(b.type.dtype).comm}* const* __restrict__", "ptr",
                                      f"peers:{b.name}"))
    for s in kernel.signals:
        if id(s) in local_s:
            params.append(KernelParam(signal_param(s), "unsigned long long*", "ptr", f"signal:{s.name}"))
        if id(s) in peer_s:
            params.append(KernelParam(peer_signal_param(s), "unsigned long long* const* __restrict__", "ptr",
                                      f"peer_signals:{s.name}"))
    for t in tables:
        # no __restrict__: the part may write the table it reads (the read-only path could go stale)
        params.append(KernelParam(table_param(t), "const int*", "ptr", f"buffer:{t.name}"))
    params += [SCRATCH_PARAM] if scratch else []
    params += [RANK_PARAM, LAUNCH_PARAM]
    used = tuple(s.name for s in kernel.signals if id(s) in local_s or id(s) in peer_s)
    return tuple(params), used


def _decode(grid: tuple[int, ...]) -> tuple:
    """Row-major task order (a compute part's): ``pid[axis] = task // divisor % modulus``."""
    out, div = [], 1
    for axis in reversed(range(len(grid))):
        out.append((axis, div, grid[axis] if axis > 0 else None))
        div *= grid[axis]
    return tuple(sorted(out))


@dataclass(frozen=True)
class _Layout:
    """What the plan decides before slots get offsets: reads in place, dot epilogues, the
    statements they absorb, the dots on WGMMA, and the tiles that need a slot (their stagings
    too)."""
    views: dict
    epilogues: dict
    absorbed: frozenset
    tiles: list
    wgmma: dict
    loops: dict = field(default_factory=dict)     # id(for op) -> DotLoop, the pipelined ones
    held: dict = field(default_factory=dict)      # value id -> Held (in registers: no tile)
    canon: dict = field(default_factory=dict)     # id(statement op) -> ChunkOrder (runs in chunk order)
    costly_not_held: int = 0                      # values with costly math read twice, not in registers
    replicated: frozenset = frozenset()           # one-element values every thread holds (:func:`_replicated`)

    @property
    def shared_bytes(self) -> int:
        """The arena if every tile stays in shared memory."""
        return _first_fit(self.tiles)[1]


def _layout(prog: _Program, recompute, threads: int, loops: list[DotLoop] = ()) -> _Layout:
    fused, views = _fuse_decisions(prog, recompute)
    epilogues, starts = _epilogues(prog, fused, views)
    tiles, wgmma = [], {}
    replaced: set[int] = set().union(*(lp.ops() for lp in loops)) if loops else set()
    after_loop: dict[int, int] = {}           # fragment id -> where its slot starts (filled registers)
    written_back: dict[int, int] = {}         # fragment id -> where the loop writes its registers back
    for lp in loops:
        p, end = prog.pos[id(lp.loop)], prog.end[id(lp.loop)]
        tiles.append(_Tile(lp.loop.regions[0].args[0], lp.loop, lp.ring_bytes, p, end, 0, False, True))
        after_loop.update({d.frag.id: end + 1 for d in lp.dots if d.fill is not None})
        # every fragment of the loop is written at its end, read after it or not: the slots of
        # all of them are live there together (a dead one must not share a live one's memory)
        written_back.update({d.frag.id: end + 1 for d in lp.dots})
    stored: list[core.Op] = []
    for op in prog.order:
        if id(op) in replaced:
            continue
        shape = wgmma_dot(op, threads) if op.name == "dot" else None
        if shape is not None:       # its staging: live at the dot only
            wgmma[op.result.id] = shape
            p = prog.pos[id(op)]
            tiles.append(_Tile(op.result, op, shape.nbytes, p, p, LOOP_WEIGHT ** len(prog.loops[id(op)]), True, True))
        if not op.results or not isinstance(op.result.type, (T.TileType, T.FragmentType)):
            continue
        if op.result.id in fused or op.result.id in epilogues:
            continue
        if op.name not in STORED_RESULTS | ELEMENT_OPS | {"frag_read"}:
            raise fail(WHAT, f"internal: no storage rule for the result of '{op.name}'", op)
        stored.append(op)
    absorbed = {id(t) for t in epilogues.values()} | {id(a) for lp in loops for a in lp.absorbed_allocs}
    held, canon = plan_held(prog, [op for op in stored if op.result.id not in starts],
                            lambda v: _consumers(prog, v, fused),
                            lambda op, s: prog.reach(op, s) == prog.pos[id(s)], threads, frozenset(absorbed),
                            lambda v: v.owner.name in ("ewise", "cast") and _costly(v, math.prod(v.type.shape)))
    replicated = frozenset() if loops else _replicated(prog, stored, held, canon, fused)
    for op in stored:
        v = op.result
        if v.id in held or (v.id in replicated and op.name != "reduce"):
            continue
        nbytes = (math.prod(v.type.shape) * elem_bytes(v.type.dtype) + ALIGN - 1) // ALIGN * ALIGN
        if op.name == "reduce":     # its warps' partial results, where several warps share an output
            nbytes = reduce_slot(op, threads, canon.get(id(op))).nbytes
        stmts = _statements(prog, op, v, fused, views)
        start, end = _live_range(prog, op, stmts)
        if v.id in after_loop:
            start = after_loop[v.id]
        if v.id in written_back:
            end = max(end, written_back[v.id])
        if v.id in replicated:      # the warps' partial results, apart from every other slot: no
            end = len(prog.order)   # later statement overwrites them while a thread still reads
        touching = {id(u) for u in stmts if not (u.results and u.result.id in fused)}   # statements only
        touches = sum(LOOP_WEIGHT ** len(prog.loops[k]) for k in touching)
        dot_operand = any(u.name == "dot" for u in stmts if u is not op)
        tiles.append(_Tile(v, op, nbytes, starts.get(v.id, start), end, touches, dot_operand))
    return _Layout(views, epilogues, frozenset(absorbed), tiles, wgmma, {id(lp.loop): lp for lp in loops},
                   held, canon, _costly_not_held(prog, fused, held), replicated)


#: ops that read a value only through its element rule (:meth:`..rules.tile_ops.TileEmitter.value`)
_ELEMENT_READERS = ELEMENT_OPS | {"store", "add_rows", "reduce"}


def _replicated(prog: _Program, stored: list[core.Op], held: dict, canon: dict, fused: set[int]) -> frozenset:
    """The one-element tiles every thread of the group holds in a register instead of a slot:
    a one-row reduction of held registers (each thread combines the warps' partial results itself,
    in the same order — no thread writes the result for the others to read after a barrier), and
    element ops of one element computed only from such values (a softmax's ``1 / sum``: each
    thread divides, no slot, no barrier). Only where every reader reads it element by element."""
    out: set[int] = set()

    def from_replicated(v: core.Value) -> bool:
        if not isinstance(v.type, (T.TileType, T.FragmentType)):
            return True             # a scalar: index code every thread has
        if v.id in out:
            return True
        op = v.owner
        return v.id in fused and op.name in ELEMENT_OPS and all(from_replicated(o) for o in op.operands)

    for op in stored:
        v = op.result
        if v.id in held or not isinstance(v.type, T.TileType) or math.prod(v.type.shape) != 1:
            continue
        if any(u.name not in _ELEMENT_READERS for u in prog.users.get(v.id, [])):
            continue
        if (op.name == "reduce" and one_row_held(canon.get(id(op)))) or \
                (op.name in ("ewise", "cast") and all(from_replicated(o) for o in op.operands)):
            out.add(v.id)
    return frozenset(out)


def _costly_not_held(prog: _Program, fused: set[int], held: dict) -> int:
    """How many element values taking :data:`COSTLY_MATH` and read by more than one statement
    are not in registers: computed again by each (an ``exp`` for a row's sum and again for its
    output) or stored in shared memory (a pass over the arena each; 0.402 ms against 0.292 for
    computing a softmax's exp twice on an H200). A per-row value broadcast over its row
    (:func:`_expanded`) is meant to be stored, and does not count."""
    n = 0
    for op in prog.order:
        v = op.result if op.results else None
        if op.name not in ("ewise", "cast") or v is None or v.id in held or not _costly(v, math.prod(v.type.shape)):
            continue
        if v.id in fused:
            n += len({id(s) for s, _ in _consumers(prog, v, fused)}) > 1
        else:
            n += not _expanded(prog, v) and len(prog.users.get(v.id, [])) > 1
    return n


def plan_general(kernel: core.Kernel, part: core.Part, m: GeneralMatch, *, threads: int | None = None,
                 wait_timeout_ns: int | None = None, entry: str | None = None,
                 wgmma_inflight: int | None = None, dot_loop_copies: str = "tma") -> GeneralPlan:
    """Options: ``threads`` per task (a multiple of 32 from 32 to 1024: every warp runs tensor-core
    tiles of a dot, on WGMMA only where they are whole warpgroups, a multiple of 128, as the default
    is; default :data:`DEFAULT_THREADS`, or — where a CTA runs several tasks at once,
    :func:`task_groups` — one of :data:`GROUP_THREAD_CHOICES`, :func:`_group_threads`),
    ``wait_timeout_ns`` (a debug build whose waits trap after that long), ``entry`` (the kernel's
    name), ``wgmma_inflight`` (a pipelined dot loop's WGMMA groups left running across an
    iteration's end, 0 or 1; by default 1 from four stages on, else 0:
    :attr:`.dot_loop.DotLoop.inflight`), ``dot_loop_copies`` ("tma", where every tensor a pipelined
    loop loads allows it, or "cp.async")."""
    if dot_loop_copies not in ("tma", "cp.async"):
        raise fail(WHAT, f"dot_loop_copies={dot_loop_copies!r}: choose 'tma' or 'cp.async'", part)
    if wgmma_inflight not in (None, 0, 1) or isinstance(wgmma_inflight, bool):
        raise fail(WHAT, f"wgmma_inflight={wgmma_inflight!r}: need 0 (a pipelined dot loop's WGMMAs done at each "
                         "iteration's end, one stage more of copies ahead) or 1 (one group left running)", part)
    if threads is not None and not (isinstance(threads, int) and not isinstance(threads, bool)
                                    and 32 <= threads <= 1024 and threads % 32 == 0):
        raise fail(WHAT, f"threads={threads!r}: need a multiple of 32 between 32 and 1024", part)
    stages = getattr(kernel.compute_schedule, "stages", None) or 3
    loops = find_dot_loops(part, threads, stages, wgmma_inflight, dot_loop_copies) if part.role == "compute" else []
    prog = _Program(part)
    if threads is None:             # the warpgroups the pipelined loops need, else the usual CTA
        if loops:
            threads = 128 * max(lp.warpgroups for lp in loops)
            loops = [lp for lp in loops if 128 * lp.warpgroups == threads]
        elif task_groups(part, m, GROUP_THREADS, 0) > 1:
            threads = _group_threads(prog, part, m)
        else:
            threads = DEFAULT_THREADS
    layout = _chosen_layout(prog, part, m, threads, loops)
    slots, stagings, rings, top, scratch = _place(layout.tiles)    # still over: spill slots to the scratch
    params, signals = _abi(kernel, part, scratch=scratch > 0)
    order, written = _tile_order(kernel, part), written_tensors(part)
    tma = _tma_descriptors(layout_loops(layout))
    tail = [q for q in params if q in (SCRATCH_PARAM, RANK_PARAM, LAUNCH_PARAM)]
    params = tuple([q for q in params if q not in tail]
                   + [KernelParam(t.param, TMA_PARAM_CTYPE, "tma", f"tma:{t.param}") for t in tma] + tail)
    decode, lanes = _decode(tuple(part.grid)), None
    if part.role == "comm":         # the communication schedule's task order, on its lanes
        sched = kernel.comm_schedule
        decode = tuple(task_decode(tuple(part.grid), sched.order if sched is not None else "ring"))
        lanes = int(part.lanes or (sched.lanes if sched is not None else 1))
    groups = task_groups(part, m, threads, top)
    arena = (top + 127) // 128 * 128 if groups > 1 else top
    return GeneralPlan(kernel, part, m, entry_name(kernel, part, entry), threads, slots, layout.views,
                       layout.epilogues, layout.absorbed, groups * arena, decode, lanes, params, signals,
                       tuple(wait_timeout_options(wait_timeout_ns)), groups, arena,
                       scratch_bytes=(scratch + 127) // 128 * 128, wgmma=layout.wgmma, stagings=stagings,
                       order=order, tma=tma,
                       dot_loops={id(lp.loop): lp for lp in layout_loops(layout)}, rings=rings,
                       held=layout.held, canon=layout.canon, replicated=layout.replicated,
                       written=written, **_prefetch(part, m, layout, written, order))


def _chosen_layout(prog: _Program, part: core.Part, m: GeneralMatch, threads: int, loops: list[DotLoop]) -> _Layout:
    """The layout of the part at ``threads``: element values read twice stored once, unless
    computing them again is what fits shared memory, or — a part whose CTAs run several tasks
    at once — lets more tasks share an SM, or keeps the same tasks in flight with the tiles in
    registers and less shared memory."""
    layout = _fitting_layout(prog, threads, loops)
    if layout.shared_bytes > SMEM_LIMIT:
        again = _layout(prog, RECOMPUTE, threads, layout_loops(layout))   # recompute shared values
        if again.shared_bytes <= SMEM_LIMIT:
            layout = again
    elif task_groups(part, m, GROUP_THREADS, 0) > 1:
        # a part whose CTAs can run several tasks at once: recomputing element values read twice
        # (a cast, an exp) costs less than the tasks in flight a larger arena leaves out, or than
        # another pass over shared memory where the loads stay in registers — and where the
        # costly ones among them fit in registers, storing those there costs less again (a row
        # softmax's exp held: 0.292 -> 0.249 ms on an H200, BENCHMARKS.md, nineteenth session;
        # stored in shared memory instead: 0.402)
        again = _layout(prog, RECOMPUTE, threads, layout_loops(layout))
        cheap = _layout(prog, RECOMPUTE_CHEAP, threads, layout_loops(layout))
        if cheap.costly_not_held < again.costly_not_held and cheap.shared_bytes <= again.shared_bytes:
            again = cheap
        g_again = task_groups(part, m, threads, again.shared_bytes)
        g_layout = task_groups(part, m, threads, layout.shared_bytes)
        if g_again > g_layout or (g_again == g_layout and again.held and again.shared_bytes <= layout.shared_bytes):
            layout = again
    return layout


#: the group sizes tried where a CTA runs several tasks at once and no ``threads`` is given
GROUP_THREAD_CHOICES = (GROUP_THREADS, 128, 256, 512)


def _held_load_bytes(layout: _Layout) -> int:
    return sum(math.prod(h.value.type.shape) * elem_bytes(h.value.type.dtype) for h in layout.held.values()
               if h.value.owner.name == "load")


def _group_threads(prog: _Program, part: core.Part, m: GeneralMatch) -> int:
    """The threads of a task group where a CTA runs several tasks at once: the fewest that keep
    the most loaded bytes in registers across the CTA's groups (:mod:`.held`: read from memory
    once, no pass over shared memory, and as many tasks' loads in flight as fit) — among
    equals, the most of a task's — else :data:`GROUP_THREADS`; first of all, the fewest costly
    element values computed twice (a group large enough to hold a softmax's ``exp`` in
    registers beats more groups computing it for the sum and again for the output)."""
    best, most = GROUP_THREADS, (-math.inf, 0, 0)
    for t in GROUP_THREAD_CHOICES:
        layout = _chosen_layout(prog, part, m, t, [])
        task = _held_load_bytes(layout)
        held = (-layout.costly_not_held, task * task_groups(part, m, t, layout.shared_bytes), task)
        if held > most:
            best, most = t, held
    return best


def written_tensors(part: core.Part) -> frozenset:
    """id() of the tensors the part writes on this rank: by ``store`` or ``add_rows``, or as a data primitive's
    destination on this rank."""
    out = {id(op.operands[0].owner) for op in part.walk() if op.name in ("store", "add_rows")}
    for op in part.walk():
        if op.name in DATA_OPS:
            _, _, _, dst, drank, _, _ = data_operands(op)
            if dst is not None and is_this_rank(drank):
                out.add(id(dst.owner))
    return frozenset(out)


def _prefetch(part: core.Part, m: GeneralMatch, layout: _Layout, written: frozenset, order) -> dict:
    """The held loads prefetched a task ahead and those loaded once (:func:`.held.prefetchable`):
    only in compute parts whose tasks neither wait nor notify nor move data between ranks (a load
    issued a task early must not overtake a wait), and every task a tile of the grid (no holes)."""
    if part.role != "compute" or m.dots or m.waits or m.notifies or not layout.held or (order and order.holes):
        return {}
    if any(op.name in DATA_OPS for op in part.walk()):
        return {}
    ops = list(part.body.ops)
    ahead, once = prefetchable(part, layout.held, lambda op: producers(op.operands[1:], ops), written)
    return {"prefetch": ahead, "invariant": once}


@dataclass(frozen=True)
class TileOrder:
    """The compute schedule's tile order (:meth:`~tldsl.ir.schedule.ComputeSchedule.tile_order`)
    over the first two axes of a compute part's grid, as the kernel walks it: cluster rows of
    ``cluster_m`` tile rows (rows past the grid are holes the kernel skips), in groups of
    ``group_m`` of them down each column (0: row by row), rotated to start on the rows of rank
    ``rank + align_shift`` of ``world_size`` (``rotated``). The simulator runs a part's tasks in
    this order, so a persistent kernel walking them another way could wait where it did not."""
    group_m: int            # 0: row-major
    cluster_m: int
    rotated: bool
    world_size: int
    align_shift: int
    holes: bool             # the last cluster row is short: the kernel skips the rows past the grid


def _tile_order(kernel: core.Kernel, part: core.Part) -> TileOrder | None:
    """The order a compute part's tasks run in where it is not row-major: the schedule's
    "swizzled" or "comm_aligned" order, or clusters of tile rows, on a grid of two or more axes;
    a one-axis grid rotated by "comm_aligned" (as the GEMM and attention recipes walk them, and
    as the simulator runs them); None: row-major."""
    sched = kernel.compute_schedule
    if part.role != "compute" or sched is None:
        return None
    cm = int(sched.cluster[0])
    order = getattr(sched, "order", "row_major")
    if len(part.grid) == 1:         # a column of tiles: rotated by comm_aligned only
        if order != "comm_aligned":
            return None
        cm = 1
    if order == "row_major" and cm == 1:
        return None
    return TileOrder(0 if order == "row_major" else order_group_m(sched.group_m), cm, order == "comm_aligned",
                     int(kernel.world_size), order_align_shift(getattr(part, "align_shift", 0), kernel.world_size),
                     part.grid[0] % cm != 0)


#: the C++ type of a TMA descriptor parameter (general_pipeline.hpp's TmaDesc)
TMA_PARAM_CTYPE = "const __grid_constant__ tldsl::gen::TmaDesc"


def _tma_descriptors(loops: list[DotLoop]) -> tuple:
    """The TMA descriptors the pipelined loops' copies read, one per tensor and box."""
    out: dict[str, object] = {}
    for lp in loops:
        for ld in lp.loads:
            if ld.tma is not None:
                out.setdefault(ld.tma.param, ld.tma)
    return tuple(out.values())


def layout_loops(layout: _Layout) -> list[DotLoop]:
    """The pipelined loops a layout was made with (their stages as it gave them)."""
    return list(layout.loops.values())


def _fitting_layout(prog: _Program, threads: int, loops: list[DotLoop]) -> _Layout:
    """The layout with every pipelined loop's ring at the most stages (down to the fewest) that
    keep the arena in shared memory; loops that do not fit even then run statement by statement."""
    loops = list(loops)
    while loops:
        for stages in range(max(lp.stages for lp in loops), MIN_RING_STAGES - 1, -1):
            trial = [with_stages(lp, min(lp.stages, stages)) for lp in loops]
            layout = _layout(prog, STORE_SHARED, threads, trial)
            if layout.shared_bytes <= SMEM_LIMIT:
                return layout
        loops.pop()                 # the last loop back to the statement path, then try again
    return _layout(prog, STORE_SHARED, threads)


def task_groups(part: core.Part, m: GeneralMatch, threads: int, arena: int) -> int:
    """How many tasks one CTA runs at once, each on its own group of ``threads`` threads with its
    own shared-memory arena and named barrier: the SM's latency hiding for memory-bound parts
    (a CTA per SM, as the runtime launches them, keeps only one tile in flight otherwise). Only
    parts whose tasks are independent of each other's timing and of the CTA's shape take it: no
    waits, notifies, data primitives (their protocols run per CTA) or dots (warp tiles over the
    CTA, and the registers a thread of a 1024-thread CTA lacks)."""
    if part.role != "compute" or m.dots or m.waits or m.notifies:
        return 1
    if any(op.name in DATA_OPS for op in part.walk()):
        return 1
    g = min(MAX_GROUPS, MAX_CTA_THREADS // threads, math.prod(part.grid))
    if arena:
        g = min(g, SMEM_LIMIT // ((arena + 127) // 128 * 128))
    return max(1, g)
