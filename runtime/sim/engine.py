"""Tasks, signals and the seeded scheduler: one launch of a kernel on W simulated ranks.

Happens-before is tracked with vector clocks (:mod:`.clocks`): each task's clock has an entry
per task of the launch it is ordered after. A notify (release) records the notifier's clock
in the signal slot and then advances the notifier's own entry; a wait (acquire) folds into the
waiter's clock those of the notifies that brought the slot to the count it needs. A release at ``gpu`` scope is only folded into waiters on the same
rank: a peer that acquires it gets no ordering, exactly as on the hardware.
"""
from __future__ import annotations

import itertools
import weakref

import numpy as np

from ...errors import DeadlockError, OutOfBoundsError, SimulationError, StaleSignalError
from ...ir.semantics import wait_target
from .clocks import join_into, new_clock
from .interpreter import Interpreter
from .memory import Memory


class Task:
    __slots__ = ("tid", "rank", "part", "coords", "vc", "gen", "state", "wait_info", "started", "launch",
                 "waited", "narrow", "partial")

    def __init__(self, tid, rank, part, coords, launch):
        self.tid, self.rank, self.part, self.coords, self.launch = tid, rank, part, coords, launch
        self.vc = new_clock(tid)
        self.gen = None
        self.state = "queued"
        self.wait_info = None
        self.started = None
        self.waited: list[str] = []     # the signal slots it waited on (for race reports)
        self.narrow: list[str] = []     # ... of those, released by another rank at too narrow a scope
        self.partial: list[str] = []    # ... of those, passed before notifies the slot had already received

    def __str__(self):
        c = ",".join(str(x) for x in self.coords)
        return f"rank {self.rank} {self.part.role} task {self.part.name}({c})"


class SignalSlotClocks:
    """Per signal (on one rank): slot values and the releases into each slot this launch.

    A wait that needs the slot at ``target`` is ordered after the releases that brought it there,
    the first ``target - start`` of this launch, and no later one: on the GPU its spin may read
    the slot exactly at ``target``, before any later notify. Joining every release the slot has
    received by the time the waiter runs would hide a wait count too low in every interleaving
    where the missing notify happened to land early. So each release's clock is kept
    (``releases``, in notify order), with joins of whole runs of them (``checkpoints``).

    Not modelled: a waiter already ordered after a *later* release (through another signal) must
    read at least that far, and on the GPU its read then orders it after every release before it
    (the atomic adds form one chain). So a race may be reported in an interleaving that would
    not race on the GPU, but never in a program free of races: a release between the first
    ``target - start`` and that later one is not ordered before the later one (else the waiter's
    clock would hold it), so in another interleaving it lands after, the wait passes without it,
    and the race is real."""

    def __init__(self, slots: int):
        self.values = np.zeros(slots, np.int64)
        self.start = np.zeros(slots, np.int64)
        self.releases: dict[int, list] = {}                  # slot -> [(scope, rank, tid, clock)], notify order
        # (slot, waiter's rank) -> [(clock, narrow ranks)]: entry j joins what the first (j + 1) * CHECKPOINT
        # releases order for a waiter on that rank, so a wait needing a long prefix joins one of these
        # and at most CHECKPOINT - 1 releases after it (rising counts on one slot: not quadratic)
        self.checkpoints: dict[tuple[int, int], list] = {}

    def clear(self) -> None:
        self.start[:] = self.values
        self.releases.clear()
        self.checkpoints.clear()

    def prefix_checkpoint(self, ch: int, rank: int, upto: int):
        """(clock, narrow ranks) of the first ``upto`` releases into ``ch`` (a multiple of
        CHECKPOINT) as a waiter on ``rank`` is ordered after them; built on first use."""
        marks = self.checkpoints.setdefault((ch, rank), [])
        releases = self.releases[ch]
        while len(marks) * CHECKPOINT < upto:
            clock, narrow = (dict(marks[-1][0]), set(marks[-1][1])) if marks else ({}, set())
            lo = len(marks) * CHECKPOINT
            for scope, r, _, c in releases[lo:lo + CHECKPOINT]:
                if scope == "sys" or r == rank:
                    join_into(clock, c)
                else:
                    narrow.add(r)
            marks.append((clock, frozenset(narrow)))
        return marks[upto // CHECKPOINT - 1]


#: releases a prefix checkpoint covers (:meth:`SignalSlotClocks.prefix_checkpoint`)
CHECKPOINT = 32


def compute_slots(kernel, asked: int | None, one_slot=()) -> dict[str, int | None]:
    """Slots each compute part runs on (None: every task resident at once): ``asked``
    (:attr:`.options.SimOptions.compute_slots`) for every part, else one for the parts named in
    ``one_slot`` and every task at once for the rest."""
    if asked is not None:
        return {p.name: asked for p in kernel.parts}
    return {p.name: 1 if p.name in one_slot else None for p in kernel.parts}


def task_order(kernel, part, rank: int) -> list[tuple]:
    """The order ``part``'s tasks are taken on ``rank``, as the GPU's persistent CTAs take them:
    its schedule's tile order (a compute part) or task order (a comm part), else row-major."""
    return [t for t in task_slots(kernel, part, rank) if t is not None]


def task_slots(kernel, part, rank: int) -> list:
    """:func:`task_order` as a persistent kernel numbers its tasks, with None for the holes it
    skips (:meth:`~tldsl.ir.schedule.ComputeSchedule.tile_slots`): CTA ``b`` of ``n`` takes slots
    ``b, b + n, ...``."""
    if part.role == "compute" and kernel.compute_schedule is not None:
        return kernel.compute_schedule.tile_slots(part.grid, rank, kernel.world_size, getattr(part, "align_shift", 0))
    if part.role == "comm" and kernel.comm_schedule is not None:
        return kernel.comm_schedule.task_order(part.grid)
    return list(itertools.product(*(range(g) for g in part.grid)))


#: per traced kernel: {part name: walks_forward's answer} (the run plan asks more than once)
_WALKS_FORWARD: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def walks_forward(kernel, part) -> bool:
    """Whether every wait of ``part`` on its own tasks is met by tasks before it in the order a
    persistent kernel's CTAs take them (:func:`task_slots`): then any number of CTAs runs it
    (:func:`~tldsl.ir.analysis.earlier_tasks_satisfy`). Once per kernel and part."""
    cache = _WALKS_FORWARD.setdefault(kernel, {})
    if part.name not in cache:
        from ...ir.analysis import earlier_tasks_satisfy
        cache[part.name] = earlier_tasks_satisfy(kernel, part, lambda rank: task_slots(kernel, part, rank))
    return cache[part.name]


class Engine:
    """Runs launches; owns memory, signals, the scheduler and the event log."""

    def __init__(self, kernel, memory: Memory, options, rng: np.random.Generator, one_slot=()):
        self.kernel, self.memory, self.options, self.rng = kernel, memory, options, rng
        W = kernel.world_size
        self.signals = [{s.name: SignalSlotClocks(s.type.slots) for s in kernel.signals} for _ in range(W)]
        self.interp = Interpreter(self)
        self.events: list[tuple] = []
        self.steps = 0
        self.launch = 0
        self.waiters: dict[tuple, list[Task]] = {}
        self.ready: list[Task] = []
        self.progress = None             # a ProgressReporter, asked every CHECK_EVERY steps
        self._check_at = float("inf")
        self.slots = compute_slots(kernel, options.compute_slots, one_slot)

    def report_progress(self, reporter):
        self.progress = reporter
        self._check_at = self.steps + reporter.CHECK_EVERY

    # -- signals -----------------------------------------------------------------------------------
    def _slot(self, task, op, rank, name, ch):
        if not 0 <= rank < self.kernel.world_size:
            raise OutOfBoundsError(f"{task} ({op.name} at {op.loc.short()}): rank {rank} is outside the "
                                   f"group of {self.kernel.world_size}", at=(op.loc,), rank=task.rank, tile=task.coords,
                                   primitive=op.name)
        sig = self.signals[rank][name]
        if not 0 <= ch < sig.values.shape[0]:
            raise OutOfBoundsError(f"{task} ({op.name} at {op.loc.short()}): channel {ch} is outside signal "
                                   f"'{name}' ({sig.values.shape[0]} slots)", at=(op.loc,), rank=task.rank,
                                   tile=task.coords, primitive=op.name, signal=name)
        return sig

    def notify(self, task: Task, op, name, rank, ch, scope):
        sig = self._slot(task, op, rank, name, ch)
        sig.values[ch] += 1
        sig.releases.setdefault(ch, []).append((scope, task.rank, task.tid, dict(task.vc)))
        task.vc[task.tid] += 1
        self._log(task, "notify", f"{name}[{ch}]@{rank}")
        for w in self.waiters.pop((rank, name, ch), []):
            if w.state == "blocked":
                target = w.wait_info[4]
                if sig.values[ch] >= target:
                    w.state = "ready"
                    self.ready.append(w)
                    self._log(w, "resume", f"{name}[{ch}]")
                else:
                    self.waiters.setdefault((rank, name, ch), []).append(w)

    def wait(self, task: Task, op, name, ch, count, epoch, per_launch=None, lag=0):
        sig = self._slot(task, op, task.rank, name, ch)
        if count <= 0:
            raise SimulationError(f"{task} ({op.name} at {op.loc.short()}): wait count {count} must be positive",
                                  at=(op.loc,))
        if per_launch is not None and count > per_launch:
            raise SimulationError(f"{task} ({op.name} at {op.loc.short()}): wait count {count} exceeds the slot's "
                                  f"{per_launch} notifies per launch (per_launch): it would wait into the next launch",
                                  at=(op.loc,))
        target = wait_target(count, self.launch, epoch, per_launch, lag)
        if sig.values[ch] < target:
            task.wait_info = (op, name, ch, count, target)
            yield ("wait", (task.rank, name, ch), target)
            task.wait_info = None
        if sig.start[ch] >= target and not lag:      # a lagged wait is for an earlier launch's notifies
            raise StaleSignalError(
                f"{task} ({op.name} at {op.loc.short()}) was satisfied by a stale signal: "
                f"'{name}'[{ch}] already held {int(sig.start[ch])} when launch {self.launch} began, and the "
                f"wait needs {target}; notifies of an earlier launch let it through. Count per launch "
                f"(epoch=True) and notify exactly `count` times per launch, or reset the signal",
                at=(op.loc,), rank=task.rank, tile=task.coords, signal=name, channel=ch, primitive=op.name)
        self._acquire(task, sig, name, ch, target)
        task.waited.append(f"{name}[{ch}] (lag={lag}: the notifies of {lag} launch{'es' if lag > 1 else ''} back, "
                           "none of this launch's)" if lag else f"{name}[{ch}]")

    @staticmethod
    def _acquire(task: Task, sig: SignalSlotClocks, name, ch, target) -> None:
        """Order ``task`` after the releases that brought slot ``ch`` to ``target``: this
        launch's first ``target - start`` (none for a lagged wait, which counts an earlier launch's);
        a release at ``gpu`` scope by another rank orders nothing (noted for the race report)."""
        releases = sig.releases.get(ch, ())
        needed = min(int(target - sig.start[ch]), len(releases))
        # the latest release of each notifier covers its earlier ones (a task's clock only grows), and one
        # the waiter already knows of (its entry for the notifier at least the release's) adds nothing
        narrow, seen, vc = {}, set(), task.vc
        base = max(needed, 0) // CHECKPOINT * CHECKPOINT
        if base:
            clock, far = sig.prefix_checkpoint(ch, task.rank, base)
            join_into(vc, clock)
            narrow.update(dict.fromkeys(sorted(far)))
        for scope, rank, tid, clock in reversed(releases[base:max(needed, 0)]):
            if scope != "sys" and rank != task.rank:
                narrow[rank] = None
            elif tid not in seen:
                seen.add(tid)
                if vc.get(tid, 0) < clock[tid]:
                    join_into(vc, clock)
        if 0 < needed < len(releases):
            task.partial.append(f"{name}[{ch}] (its first {needed} of the {len(releases)} notifies it had)")
        task.narrow.extend(f"{name}[{ch}] by rank {r}" for r in narrow)

    # -- scheduling -------------------------------------------------------------------------------
    def _log(self, task, what, detail=""):
        if self.options.record_timeline:
            self.events.append((self.steps, self.launch, task.rank, task.part.name, task.part.role,
                                task.coords, what, detail))

    def run_launch(self):
        """Run one launch of the kernel on every rank to completion."""
        self.launch += 1
        k, opts = self.kernel, self.options
        self.memory.new_launch(opts.repoison)
        for rank_sigs in self.signals:
            for s in rank_sigs.values():
                s.clear()
        plan = []
        for rank in range(k.world_size):
            for part in k.parts:
                plan.append((rank, part, task_order(k, part, rank)))
        ntasks = sum(len(o) for _, _, o in plan)
        queues = []
        tid = 0
        for rank, part, order in plan:
            tasks = []
            for coords in order:
                tasks.append(Task(tid, rank, part, tuple(coords), self.launch))
                tid += 1
            limit = part.lanes if part.role == "comm" else self.slots[part.name]
            if limit and limit < len(tasks):
                # as the GPU runs them: lane b (a CTA, or the copy engine's one stream) takes tasks
                # b, b + lanes, ... of the order, each after the last (not whichever a free lane
                # finds next: a task waiting on a later task of its own lane hangs there)
                queues.extend([tasks[b::limit], 0, 1, 0] for b in range(limit))
            else:
                queues.append([tasks, 0, len(tasks), 0])         # tasks, next index, limit, running
        self.waiters, self.ready = {}, []
        owner = {}
        for q in queues:
            for t in q[0]:
                owner[t.tid] = q
            self._admit(q)
        unfinished = ntasks
        rng = self.rng
        while unfinished:
            if not self.ready:
                raise self._deadlock(queues)
            i = int(rng.integers(len(self.ready)))
            task = self.ready[i]
            self.ready[i] = self.ready[-1]
            self.ready.pop()
            self.steps += 1
            if self.steps > opts.max_steps:
                raise SimulationError(f"gave up after {opts.max_steps} scheduler steps (livelock?)")
            if self.steps >= self._check_at:
                self._check_at = self.steps + self.progress.CHECK_EVERY
                self.progress.check(self.steps, self.launch)
            try:
                req = next(task.gen)
            except StopIteration:
                task.state = "done"
                unfinished -= 1
                self._log(task, "end")
                q = owner[task.tid]
                q[3] -= 1
                self._admit(q)
                continue
            if req[0] == "wait":
                _, key, target = req
                sig = self.signals[key[0]][key[1]]
                if sig.values[key[2]] >= target:
                    self.ready.append(task)
                else:
                    task.state = "blocked"
                    self._log(task, "block", f"{key[1]}[{key[2]}]")
                    self.waiters.setdefault(key, []).append(task)
            else:
                self.ready.append(task)
        self.memory.finish_launch()

    def _admit(self, q):
        tasks, nxt, limit, running = q
        while nxt < len(tasks) and running < limit:
            t = tasks[nxt]
            t.gen = self.interp.run(t)
            t.state = "ready"
            t.started = self.steps
            self.ready.append(t)
            self._log(t, "start")
            nxt += 1
            running += 1
        q[1], q[3] = nxt, running

    def _deadlock(self, queues) -> DeadlockError:
        blocked = [t for q in queues for t in q[0][: q[1]] if t.state == "blocked"]
        queued = sum(len(q[0]) - q[1] for q in queues)
        lines = []
        for t in blocked[:12]:
            op, name, ch, count, target = t.wait_info
            val = int(self.signals[t.rank][name].values[ch])
            lines.append(f"  {t}: {op.name} on '{name}'[{ch}] at {op.loc.short() if op.loc else '?'} — "
                         f"has {val}, needs {target} ({count} per launch, launch {self.launch})")
        if len(blocked) > 12:
            lines.append(f"  ... and {len(blocked) - 12} more blocked tasks")
        if queued:
            lines.append(f"  {queued} task(s) cannot start: each waits behind a blocked task of its lane (a lane "
                         f"runs its tasks one after another, as a persistent CTA does: compute_slots / "
                         f"communication lanes)")
            for name in sorted({q[0][0].part.name for q in queues if len(q[0]) > q[1] and q[0][0].part.role ==
                                "compute"}):
                slots = self.slots[name]
                why = ("compute_slots" if self.options.compute_slots is not None else
                       "by default: it waits on its own tiles through other parts, and a GPU may give it fewer "
                       "CTAs than tiles; tl.SimOptions(compute_slots=N) checks every compute part on N instead")
                lines.append(f"  compute part '{name}' ran on {slots} slot(s) ({why}), as on a GPU that "
                             f"gives it {slots} CTA(s): a tile that waits, directly or through other parts, for a "
                             f"later tile of its own slot hangs there. Wait only on earlier tiles (reorder the tiles "
                             f"or the signals), or make the part's tiles wait for each other directly (the GPU run "
                             f"plan then keeps them all resident, or refuses the launch)")
        first = blocked[0] if blocked else None
        details = {}
        if first is not None:
            op, name, ch, count, target = first.wait_info
            details = dict(rank=first.rank, tile=first.coords, signal=name, channel=ch, primitive=op.name)
        return DeadlockError(f"deadlock in launch {self.launch}: every unfinished task waits on a signal "
                             f"nothing left will notify\n" + "\n".join(lines),
                             at=[t.wait_info[0].loc for t in blocked], blocked=[str(t) for t in blocked], **details)
