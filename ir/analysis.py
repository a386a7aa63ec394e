"""Static channel analysis: which (rank, signal, channel) every notify and wait touches.

It evaluates only index arithmetic, for every rank and task, skipping regions without
signals. Waits whose channel can be computed must be reachable by enough notifies,
otherwise the kernel would hang: that is reported at the wait's line before anything runs.
Values read from run-time tables are unknown; waits and notifies that depend on them are
left to the simulator's dynamic deadlock detection.
"""
from __future__ import annotations

import math
from collections import Counter

from ..errors import VerificationError
from .core import Block, Kernel
from .opdefs import NOTIFY_OPS, WAIT_OPS
from .semantics import ARITH, wrap_i32


class _Unknown:
    def __repr__(self):
        return "?"


UNKNOWN = _Unknown()


def _has_sync(block: Block, memo: dict) -> bool:
    if id(block) not in memo:
        memo[id(block)] = any(op.name in NOTIFY_OPS or op.name in WAIT_OPS or
                              any(_has_sync(r, memo) for r in op.regions) for op in block.ops)
    return memo[id(block)]


#: the most blocks the static channel analysis evaluates while a kernel is traced (about 14 µs each
#: on a 2-core machine: a trace spends at most ~7 s on it); larger kernels are left to the
#: simulator's dynamic detectors
MAX_ITERATIONS = 500_000
#: gives up early when the work seen so far says the whole would take this many times the budget
GIVE_UP_FACTOR = 1.5


class SyncSites:
    def __init__(self):
        self.complete = True                     # False when the iteration budget ran out
        self.notifies: Counter = Counter()       # (sig id, target rank, channel) -> possible count
        self.dynamic_signals: set[int] = set()   # signals with a notify at an unknown channel/rank
        self.waits: list = []                    # (op, rank, task, channel, count)
        self.stray: list = []                    # (op, rank, task, channel): notifies outside their signal
        self.estimate: int = 0                   # blocks a whole enumeration takes (extrapolated where it gave up early)
        self.evaluated: int = 0                  # blocks it evaluated
        self.weight: int = 1                     # tasks the one being evaluated stands for (_task_extents)
        self.extents: tuple = ()                 # the grid extents enumerated for the part being evaluated
        self.extents_of: dict[int, tuple] = {}   # id(wait op) -> its part's enumerated extents
        self.notified_at: dict | None = None     # (sig id, target rank, channel) -> the `position`s notifying
        self.position: int = 0                   # of the task being evaluated (earlier_tasks_satisfy)
        self.guessing: int = 0                   # depth of regions entered on an unknown condition / bounds
        self.guessed_notify: bool = False        # a notify reached only so: it may not happen

    def waits_at(self, rank: int, task: tuple) -> list:
        """The waits task ``task`` of ``rank`` makes, in program order (``waits`` lists one task
        per run of tasks that differ only along grid axes no synchronisation index reads)."""
        return [w for w in self.waits if w[1] == rank and
                w[2] == tuple(t if e > 1 else 0 for t, e in zip(task, self.extents_of[id(w[0])]))]


def collect(kernel: Kernel, max_iterations: int = MAX_ITERATIONS) -> SyncSites:
    """Every notify and wait each (rank, task) of ``kernel`` reaches, with the channels, ranks and
    counts the index arithmetic gives them (``waits`` and ``stray`` in (rank, task) order, each
    task's in program order). Gives up (``complete`` False) after ``max_iterations`` block
    evaluations, or sooner where the work seen so far already says the whole would take
    :data:`GIVE_UP_FACTOR` times that: each part's (rank, task) pairs are visited in an order
    spread over the grid (:func:`_spread`), so a fraction of them stands for all — tracing a large
    kernel (a flash-attention part over 128k keys, say) does not spend seconds on an enumeration
    that would be cut off anyway, while uneven work (one heavy task among light ones) is seen
    whole wherever the budget allows it."""
    sites = SyncSites()
    memo: dict = {}
    ops_of = _sync_slice(kernel, memo)
    budget = [max_iterations]
    for part in kernel.parts:
        if not _has_sync(part.body, memo):
            continue
        extents, sites.weight = _task_extents(part, ops_of)
        sites.extents = extents
        shape = (kernel.world_size,) + extents
        pairs = math.prod(shape)
        before = max_iterations - budget[0]
        checkpoints = {max(8, pairs // d) for d in (64, 16, 4)}
        for done, i in enumerate(_spread(pairs), 1):
            rank, *task = _unravel(i, shape)
            _eval_block(part.body, {}, rank, tuple(task), sites, ops_of, budget)
            used = max_iterations - budget[0]
            sites.evaluated = sites.estimate = used
            if budget[0] <= 0:
                sites.complete = False
                return sites
            if done in checkpoints and done < pairs:
                estimate = before + (used - before) * pairs // done
                if estimate > GIVE_UP_FACTOR * max_iterations:
                    sites.complete, sites.estimate = False, estimate
                    return sites
    sites.weight = 1
    sites.waits.sort(key=lambda w: (w[1], w[2]))          # stable: each task's in program order
    sites.stray.sort(key=lambda w: (w[1], w[2]))
    return sites


def _spread(n: int):
    """0 .. n-1 in an order spread evenly over the range (a step near n / golden ratio, coprime
    with n): any prefix samples the whole grid, not its first rows."""
    step = max(1, round(n * 0.6180339887))
    while math.gcd(step, n) != 1:
        step += 1
    return ((k * step) % n for k in range(n))


def _unravel(i: int, shape: tuple) -> list[int]:
    out = []
    for extent in reversed(shape):
        i, r = divmod(i, extent)
        out.append(r)
    return out[::-1]


def _task_extents(part, ops_of: dict) -> tuple[tuple[int, ...], int]:
    """The grid extents to enumerate, and how many tasks each evaluated one stands for: a grid axis
    no index of the synchronisation reads (the heads of an attention part, say) gives every task
    along it the same notifies and waits, so only its first task is evaluated and its notifies
    count that axis's extent times."""
    read: set[int] = set()
    blocks = [part.body]
    while blocks:
        b = blocks.pop()
        for op in ops_of.get(id(b), ()):
            if op.name == "program_id":
                read.add(op.attrs["axis"])
            blocks += op.regions
    extents = tuple(g if axis in read else 1 for axis, g in enumerate(part.grid))
    return extents, math.prod(part.grid) // math.prod(extents)


#: the index arithmetic the evaluation computes; every other op's results are unknown
_EVAL_OPS = frozenset({"const", "program_id", "rank", "arith", "select"})


def _sync_slice(kernel: Kernel, memo: dict) -> dict[int, list]:
    """Per block holding a notify or wait (by ``id``), the ops its evaluation must run, in order:
    the sync ops, the ``for`` / ``if`` ops around them, and the index arithmetic their channels,
    ranks, counts, bounds and conditions are computed from. Everything else (tile math, loads)
    could only produce unknowns, and the analysis runs once per rank and task: a kernel's tile
    ops would otherwise be walked W x tasks times for nothing."""
    defs: dict = {}
    blocks: list = []

    def walk(block):
        blocks.append(block)
        for op in block.ops:
            for r in op.results:
                defs[r.id] = op
            for region in op.regions:
                walk(region)
    for part in kernel.parts:
        walk(part.body)
    keep: set[int] = set()
    wanted: list = []
    for block in blocks:
        if not _has_sync(block, memo):
            continue
        for op in block.ops:
            if op.name in NOTIFY_OPS or op.name in WAIT_OPS:
                keep.add(id(op))
                wanted += op.operands[1:]
            elif op.name in ("for", "if") and _has_sync(op.regions[0], memo):
                keep.add(id(op))
                wanted += op.operands
    seen: set[int] = set()
    while wanted:
        v = wanted.pop()
        if v.id in seen:
            continue
        seen.add(v.id)
        op = defs.get(v.id)
        if op is not None and op.name in _EVAL_OPS:
            keep.add(id(op))
            wanted += op.operands
    return {id(b): [op for op in b.ops if id(op) in keep] for b in blocks if _has_sync(b, memo)}


def _val(env, v):
    return env.get(v.id, UNKNOWN)


def _eval_block(block, env, rank, task, sites, ops_of, budget):
    budget[0] -= 1
    for op in ops_of[id(block)]:
        name = op.name
        if name == "const":
            env[op.result.id] = op.attrs["value"]
        elif name == "program_id":
            env[op.result.id] = task[op.attrs["axis"]]
        elif name == "rank":
            env[op.result.id] = rank
        elif name == "arith":
            a, b = (_val(env, v) for v in op.operands)
            try:
                env[op.result.id] = UNKNOWN if UNKNOWN in (a, b) else wrap_i32(ARITH[op.attrs["op"]](a, b))
            except ZeroDivisionError:
                env[op.result.id] = UNKNOWN
        elif name == "select":
            c, a, b = (_val(env, v) for v in op.operands)
            env[op.result.id] = UNKNOWN if c is UNKNOWN else (a if c else b)
        elif name == "for":                 # (only those holding a sync op are in the slice)
            lo, hi, st = (_val(env, v) for v in op.operands)
            body = op.regions[0]
            if UNKNOWN in (lo, hi, st) or st <= 0:
                env[body.args[0].id] = UNKNOWN
                sites.guessing += 1
                _eval_block(body, env, rank, task, sites, ops_of, budget)   # sites inside become dynamic
                sites.guessing -= 1
                continue
            for i in range(lo, hi, st):
                env[body.args[0].id] = i
                _eval_block(body, env, rank, task, sites, ops_of, budget)
                if budget[0] <= 0:
                    return
        elif name == "if":
            c = _val(env, op.operands[0])
            if c is UNKNOWN or c:
                sites.guessing += c is UNKNOWN
                _eval_block(op.regions[0], env, rank, task, sites, ops_of, budget)
                sites.guessing -= c is UNKNOWN
        elif name in NOTIFY_OPS:
            sig = op.operands[0].id
            ch = _val(env, op.operands[1])
            target = rank if name == "producer_tile_notify" else _val(env, op.operands[2])
            if UNKNOWN in (ch, target):
                sites.dynamic_signals.add(sig)
            else:
                sites.notifies[(sig, target, ch)] += sites.weight
                sites.guessed_notify = sites.guessed_notify or sites.guessing > 0
                if sites.notified_at is not None:
                    sites.notified_at.setdefault((sig, target, ch), []).append(sites.position)
                if not 0 <= ch < op.operands[0].type.slots:
                    sites.stray.append((op, rank, task, ch))
        elif name in WAIT_OPS:
            ch = _val(env, op.operands[1])
            cnt = _val(env, op.operands[2])
            sites.waits.append((op, rank, task, ch, cnt))
            sites.extents_of[id(op)] = sites.extents


def notified_slots(kernel: Kernel, part, max_iterations: int = MAX_ITERATIONS) -> set | None:
    """Every (signal name, target rank, channel) ``part`` may notify, on any rank and task (those
    under a condition the index code cannot decide included); None where some notify's channel or
    rank is read from memory, or the evaluation would take more than ``max_iterations`` blocks."""
    memo: dict = {}
    ops_of = _sync_slice(kernel, memo)
    if not _has_sync(part.body, memo):
        return set()
    sites, budget = SyncSites(), [max_iterations]
    extents, _ = _task_extents(part, ops_of)
    shape = (kernel.world_size,) + extents
    for i in range(math.prod(shape)):
        rank, *task = _unravel(i, shape)
        _eval_block(part.body, {}, rank, tuple(task), sites, ops_of, budget)
        if budget[0] <= 0:
            return None
    if sites.dynamic_signals:
        return None
    names = {op.operands[0].id: op.operands[0].owner.name for op in part.walk() if op.name in NOTIFY_OPS}
    return {(names[sig], target, ch) for sig, target, ch in sites.notifies}


def earlier_tasks_satisfy(kernel: Kernel, part, walk, max_iterations: int = MAX_ITERATIONS) -> bool:
    """Whether every task of ``part`` that waits on a signal only ``part`` notifies (its tasks waiting
    for each other: a running prefix, a look-back scan) gets every notify it needs from tasks before
    it in ``walk(rank)`` (the order a persistent kernel's CTAs take the tasks, None for a hole). Then
    any number of CTAs runs the part: the earliest unfinished task waits only on finished ones, and
    its CTA has finished all it took before, so it runs. False where that is not so, or not known
    here (a channel or count read from memory, a notify under a condition or loop bound read from
    memory — counted by :func:`check_channels` as if it happened, here it may not —, a rank-level or
    symmetric signal, another part notifying the same signal, the part waiting on itself through
    other parts too, a wait counted over earlier launches, or too large to enumerate)."""
    from .part_graph import reaches, waits_on
    deps = {p: others - {p} for p, others in waits_on(kernel).items()}
    if reaches(deps, part.name, part.name):
        return False
    own = {op.operands[0].owner.name for op in part.walk() if op.name in WAIT_OPS} & \
          {op.operands[0].owner.name for op in part.walk() if op.name in NOTIFY_OPS}
    for other in kernel.parts:
        if other is not part and any(op.name in NOTIFY_OPS and op.operands[0].owner.name in own for op in other.walk()):
            return False
    for op in part.walk():
        if op.name in WAIT_OPS and op.operands[0].owner.name in own and \
                (op.name != "consumer_tile_wait" or op.attrs.get("lag", 0)):
            return False
    memo: dict = {}
    ops_of = _sync_slice(kernel, memo)
    budget = [max_iterations]
    for rank in range(kernel.world_size):
        sites = SyncSites()
        sites.notified_at = {}
        position = {}
        for pos, task in enumerate(walk(rank)):
            if task is None:
                continue
            position[tuple(task)] = sites.position = pos
            _eval_block(part.body, {}, rank, tuple(task), sites, ops_of, budget)
            if budget[0] <= 0:
                return False
        if sites.guessed_notify:
            return False
        for op, r, task, ch, cnt in sites.waits:
            sig = op.operands[0]
            if sig.owner.name not in own:
                continue
            if sig.id in sites.dynamic_signals or UNKNOWN in (ch, cnt):
                return False
            before = sum(1 for p in sites.notified_at.get((sig.id, r, ch), ()) if p < position[task])
            if before < cnt:
                return False
    return True


def check_channels(kernel: Kernel) -> None:
    """Raise at the first notify outside its signal's channels, then at the first wait that
    cannot receive enough notifies in a launch."""
    sites = collect(kernel)
    if not sites.complete:
        return   # too large to enumerate here: the simulator's dynamic detector still applies
    for op, rank, task, ch in sites.stray[:1]:          # at the notify's line, before any wait it misleads
        sig = op.operands[0]
        raise VerificationError(
            f"{op.name} on rank {rank}, task {task}: channel {ch} is outside signal '{sig.hint}' "
            f"({sig.type.slots} slots)", op.loc)
    for op, rank, task, ch, cnt in sites.waits:
        sig = op.operands[0]
        if sig.id in sites.dynamic_signals or UNKNOWN in (ch, cnt):
            continue
        if not 0 <= ch < sig.type.slots:
            raise VerificationError(
                f"{op.name} on rank {rank}, task {task}: channel {ch} is outside signal "
                f"'{sig.hint}' ({sig.type.slots} slots)", op.loc)
        have = sites.notifies.get((sig.id, rank, ch), 0)
        if have < cnt:
            reached = sorted(c for (s, r, c) in sites.notifies if s == sig.id and r == rank)
            span = f"channels {_ranges(reached)}" if reached else "no channel"
            raise VerificationError(
                f"{op.name} on rank {rank}, task {task} waits for {cnt} notif{'y' if cnt == 1 else 'ies'} "
                f"on channel {ch} of signal '{sig.hint}', but only {have} can arrive in a launch "
                f"(notifies reach {span} of rank {rank}): this wait would hang", op.loc)


def _ranges(xs):
    xs = sorted(set(xs))
    out, start, prev = [], None, None
    for x in xs:
        if start is None:
            start = prev = x
        elif x == prev + 1:
            prev = x
        else:
            out.append(f"{start}..{prev}" if start != prev else str(start))
            start = prev = x
    if start is not None:
        out.append(f"{start}..{prev}" if start != prev else str(start))
    return ", ".join(out)
