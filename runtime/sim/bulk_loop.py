"""Runs a ``for`` loop in bulk (see :mod:`.loop_plan`): index arithmetic per iteration, then
each load once for all iterations (a region read, race-checked as one region), the tile math
that allows it in one numpy call over all iterations, and only the loop-carried ops per
iteration — with the same results, to the bit, and the same reports as op by op.

Reports: a loop's loads are checked region by region; only if a region could report anything
(an unwritten element, an unordered write) are its accesses replayed one by one, in the order
the loop would have made them, so the report is the one the loop would have raised.
"""
from __future__ import annotations

import numpy as np

from ...ir.semantics import EWISE
from .access_log import READ, BoxList, BoxRun
from .loop_plan import LoopPlan, plan_loop
from .memory import Memory, to_storage

#: bytes of bulk tiles held at once; a longer loop runs in chunks of iterations
CHUNK_BYTES = 32 << 20


class BulkLoops:
    """The interpreter's bulk path for loops; ``run`` returns False where the loop must run
    op by op instead."""

    def __init__(self, interp):
        self.interp = interp
        self.mem: Memory = interp.mem
        self.plans: dict[int, LoopPlan | None] = {}

    def plan(self, for_op) -> LoopPlan | None:
        key = id(for_op)
        if key not in self.plans:
            self.plans[key] = plan_loop(for_op)
        return self.plans[key]

    def run(self, plan: LoopPlan, env, task, lo: int, hi: int, st: int) -> bool:
        ivs = range(lo, hi, st)
        if not ivs:
            return True
        if plan.direct:
            places = [_direct_place(ids, plan.iv, env, lo, st, len(ivs)) for ids in plan.load_offsets]
            snapshots = []
        else:
            index = self._index_pass(plan, env, task, ivs)
            if index is None:
                return False
            offsets, snapshots = index
            places = [_place(offs) for offs in offsets]
        chunk = max(1, CHUNK_BYTES // plan.bytes_per_iteration)
        for c0 in range(0, len(ivs), chunk):
            c1 = min(c0 + chunk, len(ivs))
            values = self._loads(plan, task, [_part_of(p, c0, c1) for p in places], c1 - c0)
            _math(plan, env, values, c1 - c0)
            self._steps(plan, env, task, values, snapshots[c0:c1], c1 - c0)
        return True           # (what the body defines is not visible after the loop: the verifier's scoping)

    # -- index arithmetic ----------------------------------------------------------------------------
    def _index_pass(self, plan, env, task, ivs):
        """Every iteration's load offsets and the scalars the steps read; None if an op
        raises (op by op, the error then comes where the loop would have raised it)."""
        calls = [(self.interp.compile_op(op), op) for op in plan.scalars]
        offsets = [[] for _ in plan.loads]
        snapshots = []
        iv, step_scalars = plan.iv, plan.step_scalars
        try:
            for i in ivs:
                env[iv] = i
                for rule, op in calls:
                    rule(op, env, task)
                for offs, ids in zip(offsets, plan.load_offsets):
                    offs.append(tuple([int(env[k]) for k in ids]))
                if step_scalars:
                    snapshots.append([env[v] for v in step_scalars])
        except Exception:       # noqa: BLE001 - replayed op by op, which raises it in its place
            return None
        return offsets, snapshots

    # -- loads ------------------------------------------------------------------------------------------
    def _loads(self, plan, task, places, n) -> dict:
        """The loads' tiles stacked over the iterations, their accesses checked and logged."""
        mem = self.mem
        values, reads = {}, []
        for op, place in zip(plan.loads, places):
            buf = mem.buffer(task.rank, op.operands[0].hint, task, op)
            tiles, read = _gather(buf, place, tuple(op.attrs["shape"]), op.result.id in plan.dot_loads)
            values[op.result.id] = tiles.reshape((n,) + tuple(op.result.type.shape))
            reads.append((op, buf, read))
        if all(read is None or mem.bulk_read_is_clean(buf, read[0], read[1], task) for _, buf, read in reads):
            first = mem.reserve_seq(n * len(reads))
            for j, (op, buf, read) in enumerate(reads):
                if read is not None:
                    mem.record_bulk_read(buf, read[0], read[1], task, op, read[2], first + j, len(reads))
        else:
            self._replay(task, reads, n)
        return values

    def _replay(self, task, reads, n):
        """Check and log the accesses one by one, in the loop's order (raises its report)."""
        by_iter = [{} for _ in reads]
        for j, (_, _, read) in enumerate(reads):
            if read is not None:
                for i, lo, hi in read[2].parts():
                    by_iter[j][i] = (lo, hi)
        for i in range(n):
            for j, (op, buf, _) in enumerate(reads):
                box = by_iter[j].get(i)
                if box is not None:
                    self.mem.access(task.rank, buf, box[0], box[1], READ, task, op)

    def _steps(self, plan, env, task, values, snapshots, n):
        """The loop-carried ops, iteration by iteration, on each iteration's slice of the bulk values."""
        if plan.accumulate is not None:
            frag_id, addend_id = plan.accumulate
            frag, addend = env[frag_id], values[addend_id]
            for i in range(n):
                np.add(frag, addend[i], out=frag)
            return
        rules = self.interp.rules
        for i in range(n):
            if snapshots:
                for vid, val in zip(plan.step_scalars, snapshots[i]):
                    env[vid] = val
            for vid in plan.step_bulk:
                env[vid] = values[vid][i]
            for op in plan.steps:
                rules[op.name](op, env, task)


# -- where a load's boxes lie over the iterations: a run (first box, axis, step, count) or a list --------

def _direct_place(ids, iv, env, lo, st, n):
    """A load whose offsets are the induction variable or values from outside the loop."""
    first = tuple([lo if k == iv else int(env[k]) for k in ids])
    moved = [d for d, k in enumerate(ids) if k == iv]
    if not moved:
        return first, 0, 0, n
    if len(moved) == 1:
        return first, moved[0], st, n
    return [tuple([lo + i * st if k == iv else first[d] for d, k in enumerate(ids)]) for i in range(n)]


def _place(offs):
    """A run where the offsets move by one step along one axis, else the list."""
    first, n = offs[0], len(offs)
    if offs.count(first) == n:
        return first, 0, 0, n
    moved = [d for d in range(len(first)) if offs[1][d] != first[d]]
    if len(moved) != 1:
        return offs
    axis = moved[0]
    step = offs[1][axis] - first[axis]
    head, start, tail = first[:axis], first[axis], first[axis + 1:]
    if offs != [head + (start + i * step,) + tail for i in range(n)]:
        return offs
    return first, axis, step, n


def _part_of(place, c0, c1):
    """Iterations [c0, c1) of a place."""
    if isinstance(place, list):
        return place[c0:c1]
    first, axis, step, _ = place
    if c0:
        first = first[:axis] + (first[axis] + c0 * step,) + first[axis + 1:]
    return first, axis, step, c1 - c0


def _gather(buf, place, shape, as_f32):
    """A load's boxes over the iterations as one array [n, *shape] (zero outside the buffer,
    as a load reads; float32 if ``as_f32``), and what was accessed: (bounding lo, bounding hi,
    boxes) or None if nothing was. Boxes that follow each other along one axis, or are all the
    same, are read as one region; for a dot (``as_f32``) through the buffer's stacks."""
    if isinstance(place, list):
        return _gather_list(buf, place, shape, as_f32)
    first, axis, step, n = place
    if step not in (0, shape[axis]):
        tiles, read = _gather_list(buf, [first[:axis] + (first[axis] + i * step,) + first[axis + 1:]
                                         for i in range(n)], shape, as_f32)
        if read is None:
            return tiles, None
        return tiles, (read[0], read[1], BoxRun(first, shape, axis, step, n, buf.data.shape))
    region = list(shape)
    region[axis] = shape[axis] + step * (n - 1)
    lo, hi, bsl, tsl, empty = Memory.clip(buf, first, region)
    dtype = np.float32 if as_f32 else buf.data.dtype
    if empty:
        return np.zeros((n,) + shape, dtype), None
    read = (lo, hi, BoxRun(first, shape, axis, step, n, buf.data.shape))

    def stack(data):
        tile = np.zeros(region, dtype)
        tile[tsl] = data[bsl]
        if not step:
            return np.broadcast_to(tile, (n,) + shape)
        tiles = np.moveaxis(tile.reshape(shape[:axis] + (n, shape[axis]) + shape[axis + 1:]), axis, 0)
        return np.ascontiguousarray(tiles) if as_f32 else tiles

    if as_f32:
        return buf.dot_stacks.get(buf.data, (first, axis, step, n, shape), (lo[0], hi[0]), stack), read
    return stack(buf.data), read


def _gather_list(buf, offs, shape, as_f32):
    """:func:`_gather` box by box, for boxes that do not follow each other."""
    tiles, boxes = [], []
    for i, o in enumerate(offs):
        lo, hi, bsl, tsl, empty = Memory.clip(buf, o, shape)
        tile = np.zeros(shape, buf.data.dtype)
        if not empty:
            tile[tsl] = buf.data[bsl]
            boxes.append((i, lo, hi))
        tiles.append(tile.astype(np.float32) if as_f32 else tile)
    if not boxes:
        return np.stack(tiles), None
    lo = tuple(min(b[1][d] for b in boxes) for d in range(len(shape)))
    hi = tuple(max(b[2][d] for b in boxes) for d in range(len(shape)))
    return np.stack(tiles), (lo, hi, BoxList(boxes))


# -- tile math over a leading axis of iterations: each item as the op-by-op rule computes it --------------

def _math(plan, env, values, n):
    """The plan's bulk ops, each over all ``n`` iterations at once, into ``values``."""
    for op in plan.bulk:
        args = [(values[v.id], True) if v.id in values else (env[v.id], False) for v in op.operands]
        with np.errstate(all="ignore"):
            values[op.result.id] = _BULK[op.name](op, args, n)


def _aligned(x, ndim):
    """A bulk value [n, *s] shaped to broadcast, item by item, against ``ndim``-d tiles."""
    return x.reshape((x.shape[0],) + (1,) * (ndim - x.ndim + 1) + x.shape[1:])


def _bulk_dot(op, args, n):
    """One BLAS product per iteration, each on a C-contiguous float32 tile as op by op."""
    (a, _), (b, _) = args
    return np.matmul(_f32_tiles(a), _f32_tiles(b))


def _f32_tiles(x):
    """``x`` (float32 and C-contiguous tile by tile) or a float32 C-contiguous copy."""
    if x.dtype == np.float32 and x.strides[-1] == 4 and x.strides[-2] == 4 * x.shape[-1]:
        return x
    return np.ascontiguousarray(x, np.float32)


def _bulk_ewise(op, args, n):
    shape = tuple(op.result.type.shape)
    xs = []
    for x, bulk in args:
        if isinstance(x, np.ndarray) and x.dtype == np.float16:
            x = x.astype(np.float32)
        xs.append(_aligned(x, len(shape)) if bulk else x)
    res = EWISE[op.attrs["op"]](*xs)
    return to_storage(np.broadcast_to(res, (n,) + shape), op.result.type.dtype)


def _bulk_cast(op, args, n):
    return to_storage(args[0][0], op.attrs["dtype"])


def _bulk_trans(op, args, n):
    return np.ascontiguousarray(np.swapaxes(args[0][0], -1, -2))


def _bulk_expand_dims(op, args, n):
    axis = op.attrs["axis"]
    return np.expand_dims(args[0][0], axis if axis < 0 else axis + 1)


def _bulk_broadcast(op, args, n):
    shape = tuple(op.attrs["shape"])
    return np.broadcast_to(_aligned(args[0][0], len(shape)), (n,) + shape).copy()


_BULK = {"dot": _bulk_dot, "ewise": _bulk_ewise, "cast": _bulk_cast, "trans": _bulk_trans,
         "expand_dims": _bulk_expand_dims, "broadcast": _bulk_broadcast}
