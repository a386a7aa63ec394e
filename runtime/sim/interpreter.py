"""What every IR op does, for one task: the simulator's rule table.

A task's body runs as a Python generator. It yields to the scheduler before every
signal and data primitive (so other tasks interleave at tile granularity) and when a wait
cannot proceed yet. Plain loads/stores and math run without yielding: the race detector
does not depend on the interleaving, so finer steps would only cost time. For the same
reason a loop that never yields may run in bulk (:mod:`.bulk_loop`): its loads as regions,
its tile math in one numpy call, with the results and reports of running it op by op.
"""
from __future__ import annotations

import numpy as np

from ...errors import OutOfBoundsError, RaceError, SimulationError
from ...ir.opdefs import data_operands
from ...ir.semantics import ARITH, EWISE, REDUCE, wrap_i32
from ...ir.types import MemSpace
from .bulk_loop import BulkLoops
from .fast_scalars import compile_scalar
from .memory import ADD, READ, WRITE, Memory, to_storage

STEP = ("step",)
#: the rules the bulk path computes itself: where one is replaced (a test recording what a
#: task loads, say), loops run op by op through the replacement
BULK_REPLACES = ("op_load", "op_dot", "op_ewise", "op_cast", "op_trans", "op_expand_dims", "op_broadcast")
SCALAR_RULES = ("op_const", "op_program_id", "op_rank", "op_arith", "op_select")


def _runs(rows: np.ndarray):
    """``(start, end)`` of each run of consecutive values in sorted unique ``rows``."""
    if not rows.size:
        return []
    breaks = np.nonzero(np.diff(rows) != 1)[0]
    starts = np.concatenate([[rows[0]], rows[breaks + 1]])
    ends = np.concatenate([rows[breaks], [rows[-1]]]) + 1
    return list(zip(starts.tolist(), ends.tolist()))


class Interpreter:
    def __init__(self, engine):
        self.engine = engine
        self.mem: Memory = engine.memory
        self.rules = {name[3:]: getattr(self, name) for name in dir(self) if name.startswith("op_")}
        own = all(getattr(type(self), name) is _OWN_RULES[name] for name in BULK_REPLACES)
        self.bulk = BulkLoops(self) if own and engine.options.bulk_loops else None
        self.fast_scalars = all(getattr(type(self), name) is _OWN_RULES[name] for name in SCALAR_RULES)
        self.compiled: dict[int, list] = {}       # id(block) -> [(function, op)]

    def run(self, task):
        env: dict[int, object] = {}
        yield from self.block(task.part.body, env, task)

    def block(self, block, env, task):
        compiled = self.compiled.get(id(block))
        if compiled is None:
            compiled = self.compiled[id(block)] = self._compile(block)
        for rule, op in compiled:
            out = rule(op, env, task)
            if out is not None:          # a generator: the op may yield to the scheduler
                yield from out

    def _compile(self, block):
        """(function, op) per op of ``block``."""
        return [(self.compile_op(op), op) for op in block.ops]

    def compile_op(self, op):
        """What runs ``op``: its rule, or its index arithmetic compiled (:mod:`.fast_scalars`)."""
        rule = self.rules.get(op.name)
        if rule is None:
            return _no_rule
        return (compile_scalar(op, rule) if self.fast_scalars else None) or rule

    # -- scalars ----------------------------------------------------------------------------
    def op_const(self, op, env, task):
        env[op.result.id] = op.attrs["value"]

    def op_program_id(self, op, env, task):
        env[op.result.id] = task.coords[op.attrs["axis"]]

    def op_rank(self, op, env, task):
        env[op.result.id] = task.rank

    def op_arith(self, op, env, task):
        a, b = env[op.operands[0].id], env[op.operands[1].id]
        try:
            env[op.result.id] = wrap_i32(ARITH[op.attrs["op"]](a, b))
        except ZeroDivisionError as e:
            raise SimulationError(f"{task} at {op.loc.short() if op.loc else '?'}: {e}", at=(op.loc,)) from None

    def op_select(self, op, env, task):
        c, a, b = (env[v.id] for v in op.operands)
        env[op.result.id] = a if c else b

    # -- control ------------------------------------------------------------------------------
    def op_for(self, op, env, task):
        lo, hi, st = (env[v.id] for v in op.operands)
        if st <= 0:
            raise SimulationError(f"{task}: loop step {st} at {op.loc.short()} must be positive", at=(op.loc,))
        plan = self.bulk.plan(op) if self.bulk is not None else None
        if plan is not None and self.bulk.run(plan, env, task, lo, hi, st):
            return None
        return self._loop(op, env, task, lo, hi, st)

    def _loop(self, op, env, task, lo, hi, st):
        body = op.regions[0]
        iv = body.args[0].id
        for i in range(lo, hi, st):
            env[iv] = i
            yield from self.block(body, env, task)

    def op_if(self, op, env, task):
        if env[op.operands[0].id]:
            return self.block(op.regions[0], env, task)
        return None

    # -- memory ---------------------------------------------------------------------------------
    def _buf(self, rank, value, task, op):
        return self.mem.buffer(rank, value.hint, task, op)

    def _read_box(self, rank, value, offsets, shape, task, op):
        """Read a box (zero outside the tensor, as TMA does) and record the access."""
        buf = self._buf(rank, value, task, op)
        lo, hi, bsl, tsl, empty = Memory.clip(buf, offsets, shape)
        tile = np.zeros(shape, buf.data.dtype)
        if not empty:
            self.mem.access(rank, buf, lo, hi, READ, task, op)
            tile[tsl] = buf.data[bsl]
        return tile

    def _write_box(self, rank, value, offsets, tile, task, op):
        buf = self._buf(rank, value, task, op)
        lo, hi, bsl, tsl, empty = Memory.clip(buf, offsets, tile.shape)
        if not empty:
            self.mem.access(rank, buf, lo, hi, WRITE, task, op)
            buf.write(bsl, to_storage(tile[tsl], buf.dtype))

    def op_load(self, op, env, task):
        t, *offs = op.operands
        tile = self._read_box(task.rank, t, [env[o.id] for o in offs], op.attrs["shape"], task, op)
        env[op.result.id] = tile.reshape(op.result.type.shape)

    def op_store(self, op, env, task):
        t, *offs, v = op.operands
        self._write_box(task.rank, t, [env[o.id] for o in offs], env[v.id], task, op)

    def op_load_scalar(self, op, env, task):
        t, *idx = op.operands
        buf = self._buf(task.rank, t, task, op)
        index = [env[i.id] for i in idx]
        if any(not 0 <= i < d for i, d in zip(index, buf.data.shape)):
            raise OutOfBoundsError(f"{task} at {op.loc.short()}: index {tuple(index)} is outside "
                                   f"table '{buf.name}' of shape {buf.data.shape}", at=(op.loc,),
                                   rank=task.rank, tile=task.coords, buffer=buf.name, primitive=op.name)
        lo = np.array(index, np.int64)
        self.mem.access(task.rank, buf, lo, lo + 1, READ, task, op)
        env[op.result.id] = int(buf.data[tuple(index)])

    def _row_boxes(self, op, env, task, ncols_in_tile: int, kind: int, verb: str):
        """The rows ``tl.load_rows`` / ``tl.add_rows`` touch: ``(buf, rows, col, c0, c1, valid)``
        — an id past the tensor an OutOfBoundsError, each run of consecutive rows recorded as one
        access of ``kind`` (none where the columns lie outside the tensor: then ``c1 <= c0``)."""
        t, rows_v, col_v = op.operands[:3]
        buf = self._buf(task.rank, t, task, op)
        rows = np.asarray(env[rows_v.id], np.int64)
        col = env[col_v.id]
        nrows, ncols = buf.data.shape
        if (rows >= nrows).any():
            bad = int(rows[rows >= nrows][0])
            raise OutOfBoundsError(f"{task} at {op.loc.short()}: {verb} row {bad} of '{buf.name}', "
                                   f"which has {nrows} rows", at=(op.loc,), rank=task.rank, tile=task.coords,
                                   buffer=buf.name, primitive=op.name)
        c0, c1 = max(col, 0), min(col + ncols_in_tile, ncols)
        valid = np.nonzero(rows >= 0)[0]
        if c1 > c0:
            for s, e in _runs(np.unique(rows[valid])):      # contiguous runs of rows, as boxes
                self.mem.access(task.rank, buf, np.array([s, c0]), np.array([e, c1]), kind, task, op)
        return buf, rows, col, c0, c1, valid

    def op_load_rows(self, op, env, task):
        shape = op.attrs["shape"]
        buf, rows, col, c0, c1, valid = self._row_boxes(op, env, task, shape[1], READ, "gathers")
        tile = np.zeros(shape, buf.data.dtype)
        if c1 > c0:
            for i in valid:
                tile[i, c0 - col:c1 - col] = buf.data[rows[i], c0:c1]
        env[op.result.id] = tile

    def op_add_rows(self, op, env, task):
        tile = np.asarray(env[op.operands[3].id], np.float32)
        buf, rows, col, c0, c1, valid = self._row_boxes(op, env, task, tile.shape[1], ADD, "adds into")
        if c1 <= c0:
            return
        terms = np.asarray(to_storage(tile[:, c0 - col:c1 - col], buf.dtype), np.float32)
        for i in valid:            # each term rounded to the tensor's type, then added, the sum rounded (the GPU's)
            r = int(rows[i])
            cur = np.asarray(buf.data[r, c0:c1], np.float32)
            buf.write((slice(r, r + 1), slice(c0, c1)), to_storage(cur + terms[i], buf.dtype)[None])

    # -- tile math ----------------------------------------------------------------------------------
    def _out(self, op, arr):
        return to_storage(arr, op.result.type.dtype)

    def op_full(self, op, env, task):
        env[op.result.id] = to_storage(np.full(op.attrs["shape"], op.attrs["value"]), op.attrs["dtype"])

    def op_iota(self, op, env, task):
        env[op.result.id] = np.arange(op.attrs["n"], dtype=np.int32)

    def op_ewise(self, op, env, task):
        args = []
        for v in op.operands:
            x = env[v.id]
            if isinstance(x, np.ndarray) and x.dtype == np.float16:
                x = x.astype(np.float32)
            args.append(x)
        with np.errstate(all="ignore"):
            res = EWISE[op.attrs["op"]](*args)
        env[op.result.id] = self._out(op, np.broadcast_to(res, op.result.type.shape))

    def op_cast(self, op, env, task):
        x = env[op.operands[0].id]
        with np.errstate(all="ignore"):
            env[op.result.id] = to_storage(x, op.attrs["dtype"])

    def op_reduce(self, op, env, task):
        x = env[op.operands[0].id]
        if x.dtype.kind == "f":
            x = x.astype(np.float32)
        with np.errstate(all="ignore"):
            env[op.result.id] = self._out(op, REDUCE[op.attrs["op"]](x, axis=op.attrs["axis"]))

    def op_expand_dims(self, op, env, task):
        env[op.result.id] = np.expand_dims(env[op.operands[0].id], op.attrs["axis"])

    def op_broadcast(self, op, env, task):
        env[op.result.id] = np.broadcast_to(env[op.operands[0].id], op.attrs["shape"]).copy()

    def op_trans(self, op, env, task):
        env[op.result.id] = np.ascontiguousarray(env[op.operands[0].id].T)

    def op_dot(self, op, env, task):
        a, b = (env[v.id].astype(np.float32) for v in op.operands)
        with np.errstate(all="ignore"):
            env[op.result.id] = a @ b

    def op_frag_alloc(self, op, env, task):
        env[op.result.id] = to_storage(np.full(op.attrs["shape"], op.attrs["value"]), op.attrs["dtype"]).copy()

    def op_frag_read(self, op, env, task):
        env[op.result.id] = env[op.operands[0].id].copy()

    def op_frag_write(self, op, env, task):
        frag = env[op.operands[0].id]
        frag[...] = to_storage(env[op.operands[1].id], op.operands[0].type.dtype)

    # -- the nine primitives ----------------------------------------------------------------------
    def _notify(self, op, env, task):
        yield STEP
        sig, ch = op.operands[0], env[op.operands[1].id]
        target = task.rank if op.name == "producer_tile_notify" else env[op.operands[2].id]
        self.engine.notify(task, op, sig.hint, target, ch, op.attrs.get("scope", "sys"))

    op_producer_tile_notify = op_peer_tile_notify = op_rank_notify = _notify

    def _wait(self, op, env, task):
        sig, ch, count = op.operands[0], env[op.operands[1].id], env[op.operands[2].id]
        return self.engine.wait(task, op, sig.hint, ch, count, op.attrs.get("epoch", True),
                                op.attrs.get("per_launch"), op.attrs.get("lag", 0))

    op_consumer_tile_wait = op_peer_tile_wait = op_rank_wait = _wait

    def _data(self, op, env, task):
        yield STEP
        src, srank, soffs, dst, drank, doffs, tile = data_operands(op)
        shape = op.attrs["shape"]
        if src is not None:
            srank_v = env[srank.id]
            soffs_v = [env[o.id] for o in soffs]
        if dst is not None:
            drank_v = env[drank.id]
            doffs_v = [env[o.id] for o in doffs]
        if tile is not None:                       # push a register tile
            self._write_box(drank_v, dst, doffs_v, env[tile.id], task, op)
        elif dst is None:                          # pull into a tile
            env[op.result.id] = self._read_box(srank_v, src, soffs_v, shape, task, op)
        else:                                      # memory -> memory
            sbuf = self._buf(srank_v, src, task, op)
            dbuf = self._buf(drank_v, dst, task, op)
            ext = []
            for s_o, d_o, n, sd, dd in zip(soffs_v, doffs_v, shape, sbuf.data.shape, dbuf.data.shape):
                lo = max(0, -s_o, -d_o)
                hi = min(n, sd - s_o, dd - d_o)
                ext.append((lo, hi))
            if any(hi <= lo for lo, hi in ext):
                return
            s_lo = np.array([s + lo for s, (lo, _) in zip(soffs_v, ext)])
            s_hi = np.array([s + hi for s, (_, hi) in zip(soffs_v, ext)])
            d_lo = np.array([d + lo for d, (lo, _) in zip(doffs_v, ext)])
            d_hi = np.array([d + hi for d, (_, hi) in zip(doffs_v, ext)])
            if sbuf is dbuf and bool(np.all(np.maximum(s_lo, d_lo) < np.minimum(s_hi, d_hi))):
                raise _overlapping_copy(op, task, srank_v, sbuf, s_lo, s_hi, d_lo, d_hi)
            self.mem.access(srank_v, sbuf, s_lo, s_hi, READ, task, op)
            data = sbuf.data[tuple(slice(a, b) for a, b in zip(s_lo, s_hi))].copy()
            self.mem.access(drank_v, dbuf, d_lo, d_hi, WRITE, task, op)
            dbuf.write(tuple(slice(a, b) for a, b in zip(d_lo, d_hi)), to_storage(data, dbuf.dtype))

    op_tile_push_data = op_tile_pull_data = op_rank_copy_data = _data


def _overlapping_copy(op, task, rank, buf, s_lo, s_hi, d_lo, d_hi) -> RaceError:
    """A copy whose source and destination overlap in one buffer of one rank: the copy engine
    (cuMemcpy2D) and the SMs' copies move it in pieces, in no order the program can rely on, so
    what lands depends on the engine; the simulator would have moved it as one memmove."""
    box = lambda lo, hi: "[" + ", ".join(f"{a}:{b}" for a, b in zip(lo, hi)) + "]"    # noqa: E731
    return RaceError(
        f"{op.name} copies {buf.name}{box(s_lo, s_hi)} onto {buf.name}{box(d_lo, d_hi)} of rank {rank}: the "
        f"regions overlap, and a copy moves its elements in pieces in no set order (the copy engine's and "
        f"the SMs' alike), so the result would depend on the engine. Copy through another buffer (a "
        f"tl.local_buffer), or move the box so that it does not overlap its source",
        at=(op.loc,), rank=rank, buffer=buf.name, region=(tuple(d_lo), tuple(d_hi)), tile=task.coords,
        task=str(task), primitive=op.name)


def _no_rule(op, env, task):
    raise SimulationError(f"the simulator has no rule for op '{op.name}'")


_OWN_RULES = {name: getattr(Interpreter, name) for name in BULK_REPLACES + SCALAR_RULES}
_ = MemSpace
