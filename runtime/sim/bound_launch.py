"""One launch of a compiled kernel's tile program on memory the caller owns.

A host protocol (the streams, copies and counters ``runtime/dist`` enqueues around a kernel)
is only as trustworthy as its model of the kernel. Here there is no model: the simulator's own
rules (:class:`.interpreter.Interpreter`) run the part the kernel was lowered from, one
program instance per task, reading and writing the caller's arrays and signal counters.
A driver advances it a step at a time beside its other streams: a task blocked on a wait
stays blocked until the counter it reads reaches the wait's target for this launch — the
target the generated code computes (:func:`tldsl.ir.semantics.wait_target`).

No race or uninitialised-read bookkeeping is done: the caller checks the results, as a test
on a GPU would.
"""
from __future__ import annotations

import itertools
import random
from typing import Callable

import numpy as np

from ...errors import DeadlockError, SimulationError
from ...ir import core
from ...ir.semantics import wait_target
from ...ir.types import bfloat16
from .interpreter import Interpreter
from .memory import to_storage

#: (rank, buffer name) -> the caller's array: the IR dtype's numpy type, raw uint16 bits for bf16
BufferResolver = Callable[[int, str], np.ndarray]
#: (rank, signal name) -> that rank's counters of the signal (an int64 / uint64 array)
SignalResolver = Callable[[int, str], np.ndarray]

_BLOCKED = ("blocked",)


class _BoundBuffer:
    """A caller's array seen as a simulator buffer: bf16 is decoded on read and rounded on write."""

    def __init__(self, name: str, dtype, raw: np.ndarray):
        self.name, self.dtype, self.raw = name, dtype, raw
        self.bf16 = dtype.name == bfloat16.name

    @property
    def data(self) -> np.ndarray:
        if self.bf16:
            return (self.raw.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return self.raw

    def write(self, sl, values):
        values = to_storage(values, self.dtype)
        if self.bf16:
            self.raw[sl] = (np.asarray(values, np.float32).view(np.uint32) >> np.uint32(16)).astype(np.uint16)
        else:
            self.raw[sl] = values


class _BoundMemory:
    """The simulator's memory interface over the caller's arrays."""

    def __init__(self, kernel: core.Kernel, buffers: BufferResolver):
        self.dtypes = {b.name: b.type.dtype for b in kernel.buffers}
        self.resolve = buffers
        self.world_size = kernel.world_size
        self.bound: dict[tuple[int, str], _BoundBuffer] = {}    # resolved once per launch

    def buffer(self, rank: int, name: str, task=None, op=None) -> _BoundBuffer:
        if not 0 <= rank < self.world_size:
            raise SimulationError(f"{task}: rank {rank} is outside the group of {self.world_size}")
        buf = self.bound.get((rank, name))
        if buf is None:
            buf = self.bound[(rank, name)] = _BoundBuffer(name, self.dtypes[name], self.resolve(rank, name))
        return buf

    def access(self, *args) -> None:       # no race bookkeeping: the caller checks results
        return None


class _Options:
    bulk_loops = False                     # op by op: the interleaving is the point here


class _Task:
    __slots__ = ("rank", "part", "coords", "gen", "blocked_on")

    def __init__(self, rank, part, coords):
        self.rank, self.part, self.coords = rank, part, coords
        self.gen = None
        self.blocked_on = None             # (signal name, slot, target) while a wait cannot proceed

    def __str__(self):
        return f"rank {self.rank} {self.part.name}({','.join(map(str, self.coords))})"


class BoundLaunch:
    """Launch ``launch`` (1-based, the epoch its waits count in) of ``parts`` of ``kernel`` on
    ``rank``: every program instance a task, all of them resident at once (a persistent kernel's
    CTAs take tiles in some order; any order must be correct). :meth:`step` runs one task up to
    its next signal or data primitive."""

    def __init__(self, kernel: core.Kernel, parts, rank: int, launch: int, buffers: BufferResolver,
                 signals: SignalResolver, rng: random.Random | None = None):
        self.kernel, self.rank, self.launch = kernel, rank, launch
        self.memory = _BoundMemory(kernel, buffers)
        self.options = _Options()
        self._resolve_signal = signals
        self._signals: dict[tuple[int, str], np.ndarray] = {}    # resolved once per launch
        self.interp = Interpreter(self)
        self.rng = rng or random.Random(0)
        self.tasks = []
        for name in parts:
            part = kernel.part(name) if isinstance(name, str) else name
            for coords in itertools.product(*(range(g) for g in part.grid)):
                self.tasks.append(_Task(rank, part, coords))
        self.live = list(self.tasks)

    def signal_slots(self, rank: int, name: str) -> np.ndarray:
        slots = self._signals.get((rank, name))
        if slots is None:
            slots = self._signals[(rank, name)] = self._resolve_signal(rank, name)
        return slots

    # -- what the interpreter calls -------------------------------------------------------------
    def notify(self, task, op, name, rank, ch, scope):
        self._slots(task, op, rank, name, ch)[ch] += 1

    def wait(self, task, op, name, ch, count, epoch, per_launch=None, lag=0):
        if count <= 0:
            raise SimulationError(f"{task} ({op.name}): wait count {count} must be positive")
        target = wait_target(count, self.launch, epoch, per_launch, lag)
        slots = self._slots(task, op, task.rank, name, ch)
        while int(slots[ch]) < target:
            task.blocked_on = (name, ch, target)
            yield _BLOCKED
        task.blocked_on = None

    def _slots(self, task, op, rank, name, ch):
        slots = self.signal_slots(rank, name)
        if not 0 <= ch < slots.shape[0]:
            raise SimulationError(f"{task} ({op.name}): slot {ch} is outside signal '{name}' ({slots.shape[0]})")
        return slots

    # -- driving it --------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return not self.live

    def _can_run(self, task) -> bool:
        if task.blocked_on is None:
            return True
        name, ch, target = task.blocked_on
        return int(self.signal_slots(task.rank, name)[ch]) >= target

    def step(self) -> bool:
        """Advance one task that can run (chosen at random); False when every live task is
        blocked on a wait (another stream must progress first)."""
        runnable = [t for t in self.live if self._can_run(t)]
        if not runnable:
            return False
        task = self.rng.choice(runnable)
        if task.gen is None:
            task.gen = self.interp.run(task)
        while True:
            try:
                req = next(task.gen)
            except StopIteration:
                self.live.remove(task)
                return True
            if req is _BLOCKED and not self._can_run(task):
                return True
            if req is not _BLOCKED:
                return True

    def run_alone(self, max_steps: int = 10_000_000) -> None:
        """Run to the end with nothing else running (every wait must already be satisfiable)."""
        for _ in range(max_steps):
            if self.done:
                return
            if not self.step():
                blocked = [f"{t} on {t.blocked_on[0]}[{t.blocked_on[1]}] (needs {t.blocked_on[2]})"
                           for t in self.live][:8]
                raise DeadlockError(f"launch {self.launch} on rank {self.rank}: every task waits: " + "; ".join(blocked),
                                    blocked=blocked)
        raise SimulationError(f"launch {self.launch} did not finish in {max_steps} steps")
