"""Planning a copy-engine part (``engine='copy_engine'``: ``rank_copy_data`` + ``rank_notify`` /
``rank_wait``): it is not a kernel. Its index code is evaluated on the host for every rank,
giving a :class:`CopyEnginePlan` — per rank, the ordered actions for one communication stream:
:class:`CeCopy` (``cuMemcpy2DAsync``), :class:`CeSignalWrite` (``cuStreamWriteValue64``,
ordered after the copies before it; where the slot has other writers, a one-thread kernel
adding 1), :class:`CeWait` (``cuStreamWaitValue64`` GEQ).
:meth:`CopyEnginePlan.run_numpy` executes a plan on numpy arrays (the reference the runtime,
``tldsl.runtime.gpu.plan_exec``, must match). For this recipe the plan is the output."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from ...ir import core
from ...ir.analysis import notified_slots
from ...ir.display import clipped, html_card, one_line
from ...ir.opdefs import NOTIFY_OPS, data_operands
from ...ir.semantics import ARITH, wait_target, wrap_i32
from ..dtypes import elem_bytes
from ..errors import fail
from ..match.comm import WHAT, CopyEngineMatch, where
from ..rules.primitives import wait_target_formula


@dataclass(frozen=True)
class CeCopy:
    """``cuMemcpy2DAsync`` on the rank's communication stream: ``height`` rows of
    ``width_bytes`` from rank ``src_rank``'s ``src`` (first byte ``src_byte_offset`` from its
    base, rows ``src_pitch`` bytes apart) to rank ``dst_rank``'s ``dst``. Offsets and ``shape``
    are in elements, already clipped to both tensors (the simulator's rule)."""
    src: str
    src_rank: int
    src_offsets: tuple[int, ...]
    dst: str
    dst_rank: int
    dst_offsets: tuple[int, ...]
    shape: tuple[int, ...]
    elem_bytes: int
    src_byte_offset: int
    dst_byte_offset: int
    width_bytes: int
    height: int
    src_pitch: int
    dst_pitch: int
    task: tuple[int, ...]
    loc: str = ""

    @property
    def nbytes(self) -> int:
        return self.width_bytes * self.height


@dataclass(frozen=True)
class CeSignalWrite:
    """``cuStreamWriteValue64(stream, <rank's copy of signal> + 8 * slot, value(launch),
    CU_STREAM_WRITE_VALUE_DEFAULT)``: ordered after every earlier action of the stream (the
    default flags include the memory barrier). Counters only grow: the ``index``-th of the
    ``per_launch`` notifies of this slot in a launch writes ``(launch - 1) * per_launch + index``,
    what ``index`` atomic adds would have left (one rank owns each slot, so no add is lost).

    ``add``: the slot has other writers (several ranks' copy engines, or a kernel's atomic adds
    too), so an absolute value would lose their counts: the notify adds 1 instead, by a one-thread
    kernel on the stream (``runtime/gpu/signal_add.py``: ordered after the stream's copies, like a
    write, and needing an SM free to run)."""
    signal: str
    rank: int
    slot: int
    per_launch: int
    index: int
    task: tuple[int, ...]
    loc: str = ""
    add: bool = False

    def value(self, launch: int) -> int:
        return (launch - 1) * self.per_launch + self.index

    @property
    def byte_offset(self) -> int:
        return 8 * self.slot


@dataclass(frozen=True)
class CeWait:
    """``cuStreamWaitValue64(stream, <this rank's copy of signal> + 8 * slot, target(launch),
    CU_STREAM_WAIT_VALUE_GEQ)``."""
    signal: str
    slot: int
    count: int
    epoch: bool
    task: tuple[int, ...]
    loc: str = ""
    per_launch: int | None = None
    lag: int = 0

    def target(self, launch: int) -> int:
        return wait_target(self.count, launch, self.epoch, self.per_launch, self.lag)

    def target_text(self) -> str:
        """:meth:`target` as a formula of ``launch``."""
        return wait_target_formula(self.count, self.epoch, self.per_launch, cpp=False, lag=self.lag)


@dataclass(frozen=True)
class CopyEnginePlan:
    """A copy-engine part as host actions: ``actions[r]`` is what rank ``r`` enqueues, in order,
    on one communication stream per launch (see the module docstring). Pointers: a symmetric
    buffer / signal on rank ``q`` is addressed through rank ``q``'s mapping as seen from the
    executing rank (``nvshmem_ptr`` / symmetric memory ``buffer_ptrs[q]``)."""
    kernel_name: str
    part: str
    world_size: int
    actions: tuple[tuple[CeCopy | CeSignalWrite | CeWait, ...], ...]
    buffers: dict = field(default_factory=dict)      # name -> (shape, dtype name, element bytes)
    signals: dict = field(default_factory=dict)      # name -> slots

    def copies(self, rank: int) -> list[CeCopy]:
        return [a for a in self.actions[rank] if isinstance(a, CeCopy)]

    def __repr__(self) -> str:
        """One line: what each rank enqueues, counted (``describe()``: every action)."""
        acts = [a for per_rank in self.actions for a in per_rank]
        kinds = [(CeCopy, "copies"), (CeSignalWrite, "signal writes"), (CeWait, "waits")]
        counts = ", ".join(f"{sum(isinstance(a, k) for a in acts)} {what}" for k, what in kinds)
        return one_line(f"<CopyEnginePlan {self.kernel_name}.{self.part}: W={self.world_size}, {counts} "
                        f"over all ranks>")

    def _repr_html_(self) -> str:
        facts = [("part", f"{self.kernel_name}.{self.part}"), ("world size", self.world_size),
                 *((f"rank {r}", f"{len(a)} actions") for r, a in enumerate(self.actions))]
        return html_card("CopyEnginePlan (host actions on the copy engines)", facts,
                         [("describe()", clipped(self.describe(), where="the whole plan: describe()"))])

    def describe(self) -> str:
        out = [f"{self.kernel_name}.{self.part}: copy-engine plan, {self.world_size} rank(s)"]
        for r, acts in enumerate(self.actions):
            out.append(f"  rank {r}:")
            for a in acts:
                if isinstance(a, CeCopy):
                    out.append(f"    copy {a.src}@{a.src_rank}{list(a.src_offsets)} -> {a.dst}@{a.dst_rank}"
                               f"{list(a.dst_offsets)} {'x'.join(map(str, a.shape))}: {a.height} x {a.width_bytes} B "
                               f"(+{a.src_byte_offset} pitch {a.src_pitch} -> +{a.dst_byte_offset} pitch {a.dst_pitch})")
                elif isinstance(a, CeSignalWrite) and a.add:
                    out.append(f"    add {a.signal}[{a.slot}]@{a.rank} += 1 (a one-thread kernel: other writers)")
                elif isinstance(a, CeSignalWrite):
                    out.append(f"    write {a.signal}[{a.slot}]@{a.rank} = (launch-1)*{a.per_launch}+{a.index}")
                else:
                    out.append(f"    wait {a.signal}[{a.slot}] >= {a.target_text()}")
        return "\n".join(out)

    def run_numpy(self, memory: list[dict], signals: list[dict], launch: int = 1) -> None:
        """Execute the plan on numpy arrays in device layout (C-contiguous; 16-bit floats as
        2-byte items): ``memory[r][name]`` is rank ``r``'s tensor, ``signals[r][name]`` its u64
        counters. Copies move raw bytes with the plan's offsets and pitches — what the driver
        will do. Ranks' streams interleave; a wait blocks its stream until satisfied."""
        pos = [0] * self.world_size
        while True:
            progressed = False
            for r in range(self.world_size):
                while pos[r] < len(self.actions[r]):
                    a = self.actions[r][pos[r]]
                    if isinstance(a, CeWait):
                        if int(signals[r][a.signal][a.slot]) < a.target(launch):
                            break
                    elif isinstance(a, CeSignalWrite) and a.add:
                        signals[a.rank][a.signal][a.slot] += 1
                    elif isinstance(a, CeSignalWrite):
                        signals[a.rank][a.signal][a.slot] = a.value(launch)
                    else:
                        _numpy_copy(a, memory)
                    pos[r] += 1
                    progressed = True
            if all(p == len(acts) for p, acts in zip(pos, self.actions)):
                return
            if not progressed:
                stuck = {r: self.actions[r][pos[r]] for r in range(self.world_size) if pos[r] < len(self.actions[r])}
                raise RuntimeError(f"copy-engine plan deadlocked: every unfinished stream waits ({stuck})")


def _numpy_copy(a: CeCopy, memory):
    src, dst = memory[a.src_rank][a.src], memory[a.dst_rank][a.dst]
    for arr, name in ((src, a.src), (dst, a.dst)):
        if not arr.flags.c_contiguous or arr.itemsize != a.elem_bytes:
            raise ValueError(f"'{name}' must be C-contiguous with {a.elem_bytes}-byte elements (device layout)")
    sb, db = src.reshape(-1).view(np.uint8), dst.reshape(-1).view(np.uint8)
    w = a.width_bytes
    for h in range(a.height):
        s0, d0 = a.src_byte_offset + h * a.src_pitch, a.dst_byte_offset + h * a.dst_pitch
        db[d0:d0 + w] = sb[s0:s0 + w]


def part_events(kernel: core.Kernel, part: core.Part, rank: int) -> list[tuple]:
    """What ``part`` does on ``rank``, task by task in grid order, as the copy engine would run
    it: ``("copy", op, src, src_rank, src_offsets, dst, dst_rank, dst_offsets, shape, task)``,
    ``("notify", op, signal, slot, target_rank, task)`` and ``("wait", op, signal, slot, count,
    epoch, per_launch, task, lag)``. Parts of only those primitives and index code (the copy
    engine's, and those fused into a compute part) evaluate to this list."""
    out: list[tuple] = []
    for task in itertools.product(*(range(g) for g in part.grid)):
        _ce_eval(part.body, {}, rank, tuple(task), out, kernel)
    return out


def _ce_eval(block, env, rank, task, out, kernel):
    for op in block.ops:
        n = op.name
        if n == "const":
            env[op.result.id] = op.attrs["value"]
        elif n == "program_id":
            env[op.result.id] = task[op.attrs["axis"]]
        elif n == "rank":
            env[op.result.id] = rank
        elif n == "arith":
            a, b = env[op.operands[0].id], env[op.operands[1].id]
            try:
                env[op.result.id] = wrap_i32(ARITH[op.attrs["op"]](a, b))
            except ZeroDivisionError as e:
                raise fail(WHAT, f"rank {rank} task {task}: {e}", op) from None
        elif n == "select":
            c, a, b = (env[v.id] for v in op.operands)
            env[op.result.id] = a if c else b
        elif n == "for":
            lo, hi, st = (env[v.id] for v in op.operands)
            if st <= 0:
                raise fail(WHAT, f"loop step {st} must be positive", op)
            for i in range(lo, hi, st):
                env[op.regions[0].args[0].id] = i
                _ce_eval(op.regions[0], env, rank, task, out, kernel)
        elif n == "if":
            if env[op.operands[0].id]:
                _ce_eval(op.regions[0], env, rank, task, out, kernel)
        elif n == "rank_copy_data":
            src, srank, soffs, dst, drank, doffs, _ = data_operands(op)
            out.append(("copy", op, src.owner, env[srank.id], [env[o.id] for o in soffs], dst.owner,
                        env[drank.id], [env[o.id] for o in doffs], tuple(op.attrs["shape"]), task))
        elif n == "rank_notify":
            out.append(("notify", op, op.operands[0].owner, env[op.operands[1].id], env[op.operands[2].id], task))
        elif n in ("rank_wait", "consumer_tile_wait"):        # a stream wait on this rank's counters
            out.append(("wait", op, op.operands[0].owner, env[op.operands[1].id], env[op.operands[2].id],
                        bool(op.attrs.get("epoch", True)), op.attrs.get("per_launch"), task,
                        int(op.attrs.get("lag", 0))))
        else:
            raise fail(WHAT, f"internal: '{n}' reached the copy-engine evaluator unmatched", op)


def _ce_copies(op, sbuf, srank, soffs, dbuf, drank, doffs, shape, task, W) -> list[CeCopy]:
    for who, r in (("source", srank), ("destination", drank)):
        if not 0 <= r < W:
            raise fail(WHAT, f"task {task}: {who} rank {r} is outside the group of {W}", op)
    sd, dd = sbuf.type.shape, dbuf.type.shape
    ext = []
    for s_o, d_o, nn, s_d, d_d in zip(soffs, doffs, shape, sd, dd):
        ext.append((max(0, -s_o, -d_o), min(nn, s_d - s_o, d_d - d_o)))
    if any(hi <= lo for lo, hi in ext):
        return []
    eb = elem_bytes(sbuf.type.dtype)
    nd = len(shape)
    sstr = [math.prod(sd[a + 1:]) for a in range(nd)]
    dstr = [math.prod(dd[a + 1:]) for a in range(nd)]
    s_lo = [s + lo for s, (lo, _) in zip(soffs, ext)]
    d_lo = [d + lo for d, (lo, _) in zip(doffs, ext)]
    cshape = tuple(hi - lo for lo, hi in ext)
    width = cshape[-1] * eb
    height = cshape[-2] if nd >= 2 else 1
    spitch = sd[-1] * eb
    dpitch = dd[-1] * eb
    out = []
    lead = [range(n) for n in cshape[:-2]]
    for idx in itertools.product(*lead):
        so = sum((s_lo[a] + (idx[a] if a < nd - 2 else 0)) * sstr[a] for a in range(nd)) * eb
        do = sum((d_lo[a] + (idx[a] if a < nd - 2 else 0)) * dstr[a] for a in range(nd)) * eb
        out.append(CeCopy(sbuf.name, srank, tuple(s_lo), dbuf.name, drank, tuple(d_lo), cshape, eb, so, do, width,
                          height, spitch, dpitch, tuple(task), where(op)))
    return out


def plan_copy_engine_part(kernel: core.Kernel, p: core.Part, match: CopyEngineMatch) -> CopyEnginePlan:
    """Evaluate a matched copy-engine part for every rank into a :class:`CopyEnginePlan` (the
    pipeline's planning stage; :func:`..recipes.copy_engine.plan_copy_engine` is the entry that
    finds the part and runs the recipe)."""
    W = kernel.world_size
    sched = kernel.comm_schedule
    order = sched.task_order(tuple(p.grid)) if sched is not None else \
        list(itertools.product(*(range(g) for g in p.grid)))
    events = []
    for r in range(W):
        ev = []
        for task in order:
            _ce_eval(p.body, {}, r, tuple(task), ev, kernel)
        events.append(ev)
    # a (signal, target rank, slot) written by one rank's copy engine alone gets absolute values; one
    # with other writers (other ranks, other parts' atomic adds) gets adds
    owners: dict = {}
    for r, ev in enumerate(events):
        for e in ev:
            if e[0] == "notify":
                _, op, sig, ch, target, task = e
                if not 0 <= target < W:
                    raise fail(WHAT, f"rank {r} task {task}: rank_notify to rank {target}, outside the group of {W}",
                               op)
                if not 0 <= ch < sig.type.slots:
                    raise fail(WHAT, f"rank {r} task {task}: channel {ch} is outside signal '{sig.name}' "
                               f"({sig.type.slots} slots)", op)
                key = (sig.name, target, ch)
                owners.setdefault(key, []).append((r, op))
    shared = {key for key, lst in owners.items() if len({r for r, _ in lst}) > 1}
    for other in kernel.parts:
        theirs = {op.operands[0].owner.name for op in other.walk() if op.name in NOTIFY_OPS}
        if other is p or not theirs & {k[0] for k in owners}:
            continue
        slots = notified_slots(kernel, other)     # where its index code says; None: any slot of its signals
        shared |= {k for k in owners if (k in slots if slots is not None else k[0] in theirs)}
    seen: dict = {}
    actions = []
    for r, ev in enumerate(events):
        acts = []
        for e in ev:
            if e[0] == "copy":
                _, op, sb, sr, so, db, dr, do, shape, task = e
                acts.extend(_ce_copies(op, sb, sr, so, db, dr, do, shape, task, W))
            elif e[0] == "notify":
                _, op, sig, ch, target, task = e
                key = (sig.name, target, ch)
                seen[key] = seen.get(key, 0) + 1
                acts.append(CeSignalWrite(sig.name, target, ch, len(owners[key]), seen[key], tuple(task), where(op),
                                          add=key in shared))
            else:
                _, op, sig, ch, count, epoch, per_launch, task, lag = e
                if not 0 <= ch < sig.type.slots:
                    raise fail(WHAT, f"rank {r} task {task}: channel {ch} is outside signal '{sig.name}'", op)
                acts.append(CeWait(sig.name, ch, count, epoch, tuple(task), where(op), per_launch, lag))
        actions.append(tuple(acts))
    bufs = {b.name: (b.type.shape, b.type.dtype.name, elem_bytes(b.type.dtype)) for b in kernel.buffers}
    sigs = {s.name: s.type.slots for s in kernel.signals}
    return CopyEnginePlan(kernel.name, p.name, W, tuple(actions), bufs, sigs)
