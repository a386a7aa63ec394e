"""Recognising communication parts: what an SM part may contain so that the streamed kernel of
:mod:`..recipes.sm_comm` computes exactly what the simulator does, and what a copy-engine part
may contain so that :mod:`..plan.copy_engine` can evaluate it on the host.

An SM part's tile values are never materialised: each data statement (``store``,
``tile_push_data``, ``tile_pull_data`` between tensors) evaluates its tile expression element by
element where it runs. :func:`match_sm_comm` proves that moving every read down to its
statement changes nothing — no notify and no write of the loaded tensor lie in between, no loop
separates the two, and no statement reads the tensor it writes at another place — and collects
what the planner needs: every tensor and signal access (the kernel's ABI) and each statement's
vector reads (its chunking)."""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from ...ir import core
from ...ir import types as T
from ...ir.opdefs import NOTIFY_OPS, WAIT_OPS, data_operands
from ..abi import is_this_rank
from ..errors import fail, not_applicable
from ..ir_queries import CONTROL_OPS, SCALAR_OPS, const_value

WHAT = "communication lowering"

#: the dtypes the communication kernels' vector copies move (``dtypes.ctype(dt).comm``)
COMM_DTYPES = ("f16", "bf16", "f32", "i32")
#: ops whose tile result is evaluated where a statement consumes it
TILE_OPS = frozenset({"load", "load_rows", "tile_pull_data", "iota", "full", "ewise", "cast", "expand_dims",
                      "broadcast"})
#: tile ops that read memory
MEMORY_LEAVES = frozenset({"load", "load_rows", "tile_pull_data"})
FLOATS = ("f16", "bf16", "f32")
#: elementwise ops the streamed element code computes, besides where / comparisons / and / or / not
FLOAT_EWISE = frozenset({"add", "sub", "mul", "div", "max", "min", "floordiv", "mod", "neg", "exp", "exp2", "log",
                         "abs", "sqrt", "recip"})
INT_EWISE = frozenset({"add", "sub", "mul", "max", "min", "floordiv", "mod", "neg", "abs", "div"})
#: ops a copy-engine part may contain (its plan is evaluated on the host)
COPY_ENGINE_OPS = frozenset({"const", "program_id", "rank", "arith", "select", "for", "if", "rank_copy_data",
                             "rank_notify", "rank_wait", "consumer_tile_wait"})


def where(op) -> str:
    """An op's line as error messages name it."""
    return op.loc.short() if getattr(op, "loc", None) is not None else "?"


def is_statement(op: core.Op) -> bool:
    """A data statement: it writes a tensor (the tile it stores, or a copy between tensors)."""
    return op.name == "store" or op.name == "tile_push_data" or \
        (op.name == "tile_pull_data" and op.attrs.get("form", "copy") == "copy")


def written_buffer(op: core.Op):
    """The tensor ``op`` writes, else None."""
    if op.name == "store":
        return op.operands[0].owner
    if op.name in ("tile_push_data", "tile_pull_data", "rank_copy_data"):
        _, _, _, dst, _, _, _ = data_operands(op)
        return dst.owner if dst is not None else None
    return None


def is_float_ewise(op: core.Op) -> bool:
    """Whether an elementwise op computes in float (a float operand, or a float result)."""
    dts = [a.type.dtype.name for a in op.operands]
    return any(d in FLOATS for d in dts) or op.result.type.dtype.name in FLOATS and op.attrs["op"] != "where"


@dataclass(frozen=True, eq=False)
class Access:
    """A tensor as an op reaches it: which rank's copy, read or written, where."""
    buf: core.Buffer
    rank: core.Value | None        # None or tl.rank(): this rank's copy
    mode: str                      # "r" | "w"
    op: core.Op
    offsets: tuple = ()            # a box: its first element, one value per tensor axis
    tile_rank: int = 0             # a box: how many trailing tensor axes the tile spans
    rows: core.Value | None = None     # load_rows: the i32 tile of row indices ...
    col: core.Value | None = None      # ... and the first column

    @property
    def this_rank(self) -> bool:
        return is_this_rank(self.rank)

    @property
    def dtype(self) -> str:
        return self.buf.type.dtype.name

    @property
    def dims(self) -> tuple[int, ...]:
        return self.buf.type.shape

    @property
    def col_offset(self) -> core.Value:
        return self.col if self.rows is not None else self.offsets[-1]


@dataclass(frozen=True)
class SignalUse:
    """A wait ("r", always this rank's counters) or a notify ("w", of ``rank`` 's copy)."""
    sig: core.Signal
    rank: core.Value | None
    mode: str
    op: core.Op

    @property
    def this_rank(self) -> bool:
        return is_this_rank(self.rank)


@dataclass(frozen=True)
class Statement:
    """A data statement: where it writes, the tile shape it streams, and the memory reads it
    makes a chunk at a time (a copy's: its source), in the order the renderer loads them."""
    op: core.Op
    dst: Access
    shape: tuple[int, ...]
    value: core.Value | None       # the tile written; None: a copy between tensors
    vector_reads: tuple[Access, ...]

    @property
    def copy(self) -> bool:
        return self.value is None


@dataclass(frozen=True)
class CommMatch:
    """What :func:`match_sm_comm` found in an SM communication part."""
    part: core.Part
    statements: tuple[Statement, ...]
    accesses: tuple[Access, ...]       # every tensor access of the statements and their tiles
    signal_uses: tuple[SignalUse, ...]
    tables: tuple[core.Buffer, ...]    # i32 tables read by load_scalar, in program order
    waits: int
    notifies: int


@dataclass(frozen=True)
class CopyEngineMatch:
    """A copy-engine part: index code, copies, rank notifies and waits only."""
    part: core.Part
    copies: tuple[core.Op, ...]
    notifies: tuple[core.Op, ...]
    waits: tuple[core.Op, ...]


def _scalar_key(v: core.Value):
    """Equal for two scalar operands exactly when they are one value, or constants that generated
    code spells the same (:func:`..rules.scalars.c_literal`: ``True``, ``1`` and ``1.0`` differ)."""
    val = const_value(v)
    if val is None:
        return ("value", v.id)
    if isinstance(val, bool):
        return ("const", "bool", val)
    if isinstance(val, int):
        return ("const", "int", int(val))
    return ("const", "float", repr(float(val)))


def _address_key(a: Access):
    """Equal for two accesses of one tensor exactly when they go through the same pointer."""
    return ("this",) if a.this_rank else ("peer", _scalar_key(a.rank))


def broadcast_coords(coords: list[str], src_shape, dst_shape) -> list[str]:
    """Tile coordinates of a broadcast operand (numpy rules: size-1 axes read coordinate 0): where
    the matcher and the renderer evaluate an operand of a ``dst_shape`` tile at ``coords``."""
    m, n = len(src_shape), len(dst_shape)
    return ["0" if src_shape[j] == 1 and dst_shape[j + n - m] != 1 else coords[j + n - m] for j in range(m)]


def statement_coords(nd: int) -> list[str]:
    """The coordinates a statement evaluates its tile at: row indices ``ti<k>``, column ``cc``."""
    return [f"ti{k}" for k in range(nd - 1)] + ["cc"]


class _Expr:
    """One walk of a statement's tile expression: memo of (value, coordinates), reads, and
    the memory leaves read a chunk at a time (``vector``: the statement's own walk)."""

    def __init__(self, sink: core.Op, vector: bool, reads: list | None = None):
        self.sink, self.vector = sink, vector
        self.memo: set = set()
        self.reads: list = [] if reads is None else reads
        self.leaves: list[tuple[Access, list[str]]] = []


class _SmMatcher:
    def __init__(self, part: core.Part):
        self.pre: dict[int, int] = {}
        self.parent: dict[int, core.Op | None] = {}
        self.block_of: dict[int, int] = {}
        self.notify_idx: list[int] = []
        self.write_idx: dict[int, list[int]] = {}
        counter = itertools.count()

        def index(block, owner):
            for op in block.ops:
                k = next(counter)
                self.pre[id(op)] = k
                self.parent[id(op)] = owner
                self.block_of[id(op)] = id(block)
                if op.name in NOTIFY_OPS:
                    self.notify_idx.append(k)
                wb = written_buffer(op)
                if wb is not None:
                    self.write_idx.setdefault(id(wb), []).append(k)
                for r in op.regions:
                    index(r, op)
        index(part.body, None)
        self.statements: list[Statement] = []
        self.accesses: list[Access] = []
        self.signal_uses: list[SignalUse] = []
        self.tables: list[core.Buffer] = []
        self.waits = self.notifies = 0

    # -- the part, op by op --------------------------------------------------------------------
    def walk(self, block: core.Block) -> None:
        for op in block.ops:
            n = op.name
            if n in CONTROL_OPS:
                self.walk(op.regions[0])
            elif n in SCALAR_OPS:
                if n == "load_scalar" and op.operands[0].owner not in self.tables:
                    self.tables.append(op.operands[0].owner)
            elif n in WAIT_OPS:
                self.signal_uses.append(SignalUse(op.operands[0].owner, None, "r", op))
                self.waits += 1
            elif n in NOTIFY_OPS:
                rank = None if n == "producer_tile_notify" else op.operands[2]
                self.signal_uses.append(SignalUse(op.operands[0].owner, rank, "w", op))
                self.notifies += 1
            elif is_statement(op):
                self.statement(op)
            elif n in TILE_OPS and op.results and isinstance(op.result.type, T.TileType):
                pass                       # checked where a statement consumes it
            elif n == "rank_copy_data":           # no SM rule: the copy engine moves it (recipe copy_engine)
                raise fail(WHAT, "rank_copy_data runs on the copy engine, not in an SM communication part", op)
            else:
                raise fail(WHAT, f"'{n}' is not supported in a communication part on SMs (supported: index code, "
                           "waits, notifies, loads, elementwise tile math, casts, stores and tile_push/pull_data)",
                           op)

    def access(self, v: core.Value, rank, mode: str, op: core.Op, **at) -> Access:
        buf = v.owner
        if not isinstance(buf, core.Buffer):
            raise fail(WHAT, "a data operand must be a kernel tensor", op)
        if buf.type.dtype.name not in COMM_DTYPES:
            raise fail(WHAT, f"tensor '{buf.name}' is {buf.type.dtype}: communication kernels move f16, bf16, f32 "
                       "and i32 data", op)
        if not is_this_rank(rank) and not buf.symmetric:
            raise fail(WHAT, f"'{buf.name}' is addressed on another rank but is not symmetric", op)
        a = Access(buf, rank, mode, op, **at)
        self.accesses.append(a)
        return a

    # -- a statement -----------------------------------------------------------------------------
    def statement(self, op: core.Op) -> None:
        if op.name == "store":
            buf, *offs, tile = op.operands
            dst = self.access(buf, None, "w", op, offsets=tuple(offs), tile_rank=len(tile.type.shape))
            shape, value = tile.type.shape, tile
        else:
            src, srank, soffs, dv, drank, doffs, tile = data_operands(op)
            dst = self.access(dv, drank, "w", op, offsets=tuple(doffs), tile_rank=len(dv.type.shape))
            if tile is not None:
                shape, value = tile.type.shape, tile
            else:
                shape, value = tuple(op.attrs["shape"]), None
                if len(src.type.shape) != len(dv.type.shape):
                    raise fail(WHAT, f"{op.name} between tensors of different ranks ({src.owner.name} is "
                               f"{len(src.type.shape)}-d, {dv.owner.name} {len(dv.type.shape)}-d)", op)
                read = self.access(src, srank, "r", op, offsets=tuple(soffs), tile_rank=len(shape))
                self.statements.append(Statement(op, dst, tuple(shape), None, (read,)))
                return
        ex = _Expr(op, True)
        self.expr(value, statement_coords(len(shape)), ex)
        self.check_self_alias(op, dst, ex)
        for a, row_coords in ex.leaves:           # a vector leaf's row indices are read per chunk
            if a.rows is not None:
                self.expr(a.rows, [(row_coords + ["c"])[0]], _Expr(op, False))
        self.statements.append(Statement(op, dst, tuple(shape), value, tuple(a for a, _ in ex.leaves)))

    def expr(self, v: core.Value, coords: list[str], ex: _Expr) -> None:
        """Check the tile expression ``v`` as the renderer evaluates it at ``coords``."""
        if not isinstance(v.type, T.TileType):
            return                                 # a scalar operand, defined by the index code
        key = (v.id, tuple(coords))
        if key in ex.memo:
            return
        op = v.owner
        if not isinstance(op, core.Op):
            raise fail(WHAT, "internal: a tile without a defining op", ex.sink)
        self.check_deferral(op, ex.sink)
        n = op.name
        shape = op.result.type.shape
        if n == "load":
            self.leaf(self.access(op.operands[0], None, "r", op, offsets=tuple(op.operands[1:]),
                                  tile_rank=len(shape)), coords, ex)
        elif n == "tile_pull_data":
            src, srank, soffs, *_ = data_operands(op)
            self.leaf(self.access(src, srank, "r", op, offsets=tuple(soffs), tile_rank=len(shape)), coords, ex)
        elif n == "load_rows":
            buf, rows, col = op.operands
            self.leaf(self.access(buf, None, "r", op, rows=rows, col=col), coords, ex)
        elif n in ("iota", "full"):
            pass
        elif n == "ewise":
            for a in op.operands:
                if isinstance(a.type, T.TileType):
                    self.expr(a, broadcast_coords(coords, a.type.shape, shape), ex)
            kind = op.attrs["op"]
            if kind not in ("where", "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "not") and \
                    kind not in (FLOAT_EWISE if is_float_ewise(op) else INT_EWISE):
                raise fail(WHAT, f"elementwise '{kind}' on {[a.type.dtype.name for a in op.operands]} is not supported "
                           "by the communication lowering", op)
        elif n == "cast":
            self.expr(op.operands[0], coords, ex)
        elif n == "expand_dims":
            axis = op.attrs["axis"]
            self.expr(op.operands[0], coords[:axis] + coords[axis + 1:], ex)
        elif n == "broadcast":
            src = op.operands[0]
            self.expr(src, broadcast_coords(coords, src.type.shape, shape), ex)
        else:
            raise fail(WHAT, f"'{n}' cannot be streamed by the communication lowering (it handles loads, "
                       "elementwise math, casts and broadcasts; no dot, reduce, transpose or fragments)", op)
        ex.memo.add(key)

    def leaf(self, a: Access, coords: list[str], ex: _Expr) -> None:
        ex.reads.append((a, list(coords)))
        if ex.vector and coords and coords[-1] == "cc":
            ex.leaves.append((a, coords[:-1]))
        elif a.rows is not None:                  # an element read: its row index now
            self.expr(a.rows, [coords[0]], _Expr(ex.sink, False, ex.reads))

    # -- what makes evaluating a tile at its statement exact ---------------------------------------
    def check_deferral(self, node_op: core.Op, sink: core.Op) -> None:
        blk = self.block_of[id(node_op)]
        cur = sink
        while self.block_of[id(cur)] != blk:
            owner = self.parent[id(cur)]
            if owner is None:
                raise fail(WHAT, f"a tile made at {where(node_op)} is used by the statement at {where(sink)} outside "
                           "the region that made it; keep tile values inside their loop / condition", node_op)
            if owner.name == "for":
                raise fail(WHAT, f"the tile made at {where(node_op)} is used inside a tl.range loop (at {where(sink)}) "
                           "that does not make it; the lowering evaluates tiles where they are stored, so load it "
                           "inside the loop", node_op)
            cur = owner
        if node_op.name not in MEMORY_LEAVES:
            return
        lo, hi = self.pre[id(node_op)], self.pre[id(sink)]
        k = bisect.bisect_right(self.notify_idx, lo)
        if k < len(self.notify_idx) and self.notify_idx[k] < hi:
            raise fail(WHAT, f"the tile loaded at {where(node_op)} is stored at {where(sink)} after a notify; the "
                       "lowering reads a tile where it is stored, which would move the read after the release: "
                       "store it before the notify", node_op)
        src = node_op.operands[0].owner
        ws = self.write_idx.get(id(src), [])
        k = bisect.bisect_right(ws, lo)
        if k < len(ws) and ws[k] < hi:
            raise fail(WHAT, f"'{src.name}' is written between the load at {where(node_op)} and the statement at "
                       f"{where(sink)} that consumes it; the lowering reads a tile where it is stored, which would "
                       "see that write", node_op)

    @staticmethod
    def check_self_alias(op: core.Op, dst: Access, ex: _Expr) -> None:
        """A statement that reads the tensor it writes, on this rank: only the same box, element
        for element, is safe when threads store while others still load."""
        for a, coords in ex.reads:
            if a.buf is not dst.buf or _address_key(a) != _address_key(dst):
                continue
            if a.rows is None and [_scalar_key(o) for o in a.offsets] == [_scalar_key(o) for o in dst.offsets] \
                    and a.tile_rank == dst.tile_rank and coords == statement_coords(len(coords)):
                continue
            raise fail(WHAT, f"the statement at {where(op)} reads '{a.buf.name}' at another place than it writes it; "
                       "the lowering streams a statement through many threads, so store into another tensor", op)


def match_sm_comm(kernel: core.Kernel, part: core.Part) -> CommMatch:
    """The statements, accesses and signal uses of an SM communication part, or a LoweringError
    at the first op the streamed kernel cannot run exactly."""
    if part.role != "comm":
        raise fail(WHAT, f"part '{part.name}' is a {part.role} part; lower_comm lowers communication parts", part)
    if part.engine != "sm":
        raise not_applicable(WHAT, f"part '{part.name}' runs on the copy engine: it becomes a host plan "
                             "(plan_copy_engine), not a kernel", part)
    m = _SmMatcher(part)
    m.walk(part.body)
    return CommMatch(part, tuple(m.statements), tuple(m.accesses), tuple(m.signal_uses), tuple(m.tables),
                     m.waits, m.notifies)


def match_copy_engine(kernel: core.Kernel, part: core.Part) -> CopyEngineMatch:
    """A copy-engine part's copies, notifies and waits, or a LoweringError at the first op a
    plan of copies and stream memory operations cannot express."""
    if part.engine != "copy_engine":
        raise not_applicable(WHAT, f"part '{part.name}' runs on {part.engine}, not the copy engine", part)
    copies, notifies, waits = [], [], []
    for op in part.walk():
        if op.name not in COPY_ENGINE_OPS:
            raise fail(WHAT, f"'{op.name}' cannot run on the copy engine (a plan of copies and stream memory "
                       "operations is made on the host: index code, rank_copy_data, rank_notify, rank_wait and "
                       "consumer_tile_wait only)", op)
        if op.name == "rank_copy_data":
            src, _, _, dst, _, _, _ = data_operands(op)
            sd, dd = src.type.shape, dst.type.shape
            if len(sd) != len(dd) or len(op.attrs["shape"]) != len(sd):
                raise fail(WHAT, f"rank_copy_data between tensors of different ranks ({src.owner.name} {list(sd)}, "
                           f"{dst.owner.name} {list(dd)})", op)
            copies.append(op)
        elif op.name == "rank_notify":
            notifies.append(op)
        elif op.name in WAIT_OPS:
            waits.append(op)
    return CopyEngineMatch(part, tuple(copies), tuple(notifies), tuple(waits))
