"""The op table: one entry per IR op, saying what class of op it is and what it means.

Each op is defined once here (name, category, doc); its type rule lives in the frontend
(``tldsl.language``, ``tldsl.tiles``, ``tldsl.primitives``: checked while tracing, so errors
point at the user's line) and again in :mod:`.verifier`; its meaning lives in the simulator's
rule table, the ``op_<name>`` methods of ``tldsl.runtime.sim.interpreter.Interpreter`` (scalar
arithmetic and wait targets in :mod:`.semantics`, which the code generator shares); its
lowering lives in ``tldsl.codegen`` (``tldsl.codegen.lower`` runs a part through the pipeline: match a recipe, plan, render).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpDef:
    name: str
    category: str   # scalar | tile | memory | control | sync | data
    doc: str
    touches_memory: bool = False


_DEFS = [
    # scalars: index arithmetic, evaluated by the thread block, never touch memory
    OpDef("const", "scalar", "an immediate scalar"),
    OpDef("program_id", "scalar", "this task's coordinate along a grid axis"),
    OpDef("rank", "scalar", "this process's rank in the group"),
    OpDef("arith", "scalar", "scalar arithmetic / comparison (attr op)"),
    OpDef("select", "scalar", "scalar c ? a : b"),
    OpDef("load_scalar", "memory", "read one element of an int table (dynamic mappings)", True),
    # tile math in registers
    OpDef("full", "tile", "a register tile filled with a constant"),
    OpDef("iota", "tile", "0..n-1 as an i32 tile"),
    OpDef("ewise", "tile", "elementwise op with numpy broadcasting (attr op)"),
    OpDef("cast", "tile", "element type conversion"),
    OpDef("reduce", "tile", "sum / max / min along one axis"),
    OpDef("expand_dims", "tile", "insert a unit axis"),
    OpDef("broadcast", "tile", "broadcast to a static shape"),
    OpDef("trans", "tile", "2-D transpose"),
    OpDef("dot", "tile", "matrix product with fp32 accumulation (mma / wgmma)"),
    OpDef("frag_alloc", "tile", "a mutable register fragment (accumulator)"),
    OpDef("frag_read", "tile", "read a fragment's current value"),
    OpDef("frag_write", "tile", "overwrite a fragment"),
    # local memory movement
    OpDef("load", "memory", "global -> shared tile load; out-of-bounds elements read as 0 (TMA semantics)", True),
    OpDef("load_rows", "memory", "gather rows by an index tile into shared memory; negative rows read as 0", True),
    OpDef("store", "memory", "register tile -> global store; out-of-bounds elements are dropped", True),
    OpDef("add_rows", "memory", "scatter-add a tile's rows into rows of a tensor by an index tile (negative "
          "rows skipped); adds commute: atomic on the GPU, unordered adds are no race", True),
    # control flow
    OpDef("for", "control", "a counted loop that stays a loop (attr unroll for a hint)"),
    OpDef("if", "control", "a guarded region"),
    # the nine TileLink primitives
    OpDef("producer_tile_notify", "sync",
          "release: this rank's producer finished the tile behind `channel`; adds 1 to the local signal slot"),
    OpDef("consumer_tile_wait", "sync",
          "acquire: block until the local signal slot received `count` notifies in this launch"),
    OpDef("peer_tile_notify", "sync",
          "release (system scope): add 1 to slot `channel` of `rank`'s copy of a symmetric signal"),
    OpDef("peer_tile_wait", "sync",
          "acquire (system scope): block until this rank's copy of the slot received `count` notifies from peers"),
    OpDef("rank_notify", "sync",
          "release of a whole rank's chunk (copy engine / host granularity) to `rank`'s signal slot"),
    OpDef("rank_wait", "sync", "acquire of a whole rank's chunk"),
    OpDef("tile_push_data", "data", "SMs write a tile (or a local region) into a peer's symmetric buffer", True),
    OpDef("tile_pull_data", "data", "SMs read a tile of a peer's symmetric buffer (into registers or a local buffer)", True),
    OpDef("rank_copy_data", "data", "copy engine moves a region between ranks' symmetric buffers", True),
]

OPS: dict[str, OpDef] = {d.name: d for d in _DEFS}
NOTIFY_OPS = frozenset({"producer_tile_notify", "peer_tile_notify", "rank_notify"})
WAIT_OPS = frozenset({"consumer_tile_wait", "peer_tile_wait", "rank_wait"})
SYNC_OPS = NOTIFY_OPS | WAIT_OPS
DATA_OPS = frozenset({"tile_push_data", "tile_pull_data", "rank_copy_data"})
PRIMITIVES = SYNC_OPS | DATA_OPS

# Which signal scope each signal primitive needs, and the memory scope of its release/acquire.
SIGNAL_SCOPE = {
    "producer_tile_notify": "local", "consumer_tile_wait": "local",
    "peer_tile_notify": "symmetric", "peer_tile_wait": "symmetric",
    "rank_notify": "symmetric", "rank_wait": "symmetric",
}
DEFAULT_MEMORY_SCOPE = {
    "producer_tile_notify": "gpu", "peer_tile_notify": "sys", "rank_notify": "sys",
    "consumer_tile_wait": "gpu", "peer_tile_wait": "sys", "rank_wait": "sys",
}
# Ops a copy-engine part may contain: it is a stream of DMA copies and stream memory ops
# (a consumer_tile_wait there is a stream wait on this rank's counters, e.g. the GEMM's tiles).
COPY_ENGINE_OPS = frozenset({"const", "program_id", "rank", "arith", "select", "for", "if",
                             "rank_copy_data", "rank_notify", "rank_wait", "consumer_tile_wait"})

ARITH_OPS = {"add", "sub", "mul", "floordiv", "mod", "min", "max",
             "lt", "le", "gt", "ge", "eq", "ne", "and", "or", "xor"}
UNARY_OPS = {"neg", "exp", "exp2", "log", "abs", "sqrt", "recip", "not", "sigmoid", "tanh", "erf", "rsqrt"}
#: the elementwise ops whose result is a float whatever the operands (division, transcendental math)
FLOAT_RESULT_OPS = frozenset({"exp", "exp2", "log", "sqrt", "recip", "div", "sigmoid", "tanh", "erf", "rsqrt"})
BINARY_OPS = {"add", "sub", "mul", "div", "max", "min", "lt", "le", "gt", "ge", "eq", "ne",
              "and", "or", "floordiv", "mod"}
REDUCE_OPS = {"sum", "max", "min"}


def data_operands(op):
    """Split a data-movement op's operands into (src, src_rank, src_offs, dst, dst_rank, dst_offs, tile).

    Forms: `copy` moves memory to memory; `tile` moves between a register tile and memory.
    """
    o = op.operands
    form = op.attrs.get("form", "copy")
    if op.name == "tile_pull_data" and form == "tile":
        n = len(o[0].type.shape)
        return o[0], o[1], o[2:2 + n], None, None, (), None
    if op.name == "tile_push_data" and form == "tile":
        n = len(o[1].type.shape)
        return None, None, (), o[1], o[2], o[3:3 + n], o[0]
    ns = len(o[0].type.shape)
    src, src_rank, src_offs = o[0], o[1], o[2:2 + ns]
    rest = o[2 + ns:]
    nd = len(rest[0].type.shape)
    return src, src_rank, src_offs, rest[0], rest[1], rest[2:2 + nd], None


def written_buffers(kernel) -> frozenset[str]:
    """Names of the tensors some part of ``kernel`` writes on any rank: a store's tensor, a data
    movement's destination (the verifier admits no other op that writes memory)."""
    out = set()
    for part in kernel.parts:
        for op in part.walk():
            if op.name in ("store", "add_rows"):
                out.add(op.operands[0].owner.name)
            elif op.name in DATA_OPS:
                dst = data_operands(op)[3]
                if dst is not None:
                    out.add(dst.owner.name)
    return frozenset(out)


def written_arguments(kernel) -> list:
    """The arguments of ``kernel`` some part writes, in argument order: what the runtimes put back
    between launches so that every launch runs on the caller's values."""
    written = written_buffers(kernel)
    return [b for b in kernel.args if b.name in written]

