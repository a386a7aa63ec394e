"""How many scheduler steps a simulation will take, estimated before it runs.

A task takes one step to start and one more for each signal or data primitive it reaches
(it yields to the scheduler before each) — a wait only if it has to block, counted here as
if it always did, so the estimate is a little high. Counting walks a task's control flow
with its index arithmetic only: no tile math, no memory but the int tables a dynamic
mapping reads (as the inputs hold them). Every task of a small launch is counted; of a large
one, an evenly spread sample (the count grows with W^2, the time to estimate it does not).

A ``tl.range`` loop that reaches no primitive runs inside one step, however many times it turns:
its iterations are counted apart (their trip counts, where the bounds are known before the loop),
so that a loop of a billion turns is warned about like a run of a billion steps.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from ...ir.opdefs import PRIMITIVES
from .fast_scalars import compile_scalar

#: tasks counted per part at most; beyond, an evenly spread sample stands for the rest
SAMPLE = 256


@dataclass(frozen=True)
class StepEstimate:
    steps: int           # all launches
    tasks: int           # per launch (every rank)
    sampled: bool        # False: every task was counted
    loop_iterations: int = 0     # all launches: turns of loops (those inside a single step too)


def estimate_steps(kernel, memory, launches: int, limit: int) -> StepEstimate:
    """Expected scheduler steps of ``launches`` launches; counting stops past ``limit``."""
    W = kernel.world_size
    counter = _Counter(memory)
    per_launch, turns, tasks, sampled = 0, 0, 0, False
    for part in kernel.parts:
        per_rank = part.num_tasks
        total = W * per_rank
        tasks += total
        picks = range(total) if total <= SAMPLE else [k * total // SAMPLE for k in range(SAMPLE)]
        sampled |= total > SAMPLE
        budget = max(1, limit // max(1, launches))
        counted = looped = 0
        for k in picks:
            steps, iterations = counter.task_steps(part, k // per_rank, _coords(k % per_rank, part.grid), budget)
            counted, looped = counted + steps, looped + iterations
        per_launch += counted * total // len(picks) if picks else 0
        turns += looped * total // len(picks) if picks else 0
    return StepEstimate(per_launch * launches, tasks, sampled, turns * launches)


def _coords(index: int, grid) -> tuple:
    out = []
    for g in reversed(grid):
        out.append(index % g)
        index //= g
    return tuple(reversed(out))


class _Task:
    """What index arithmetic reads of a task."""
    __slots__ = ("rank", "coords")

    def __init__(self, rank, coords):
        self.rank, self.coords = rank, coords


class _Counter:
    def __init__(self, memory):
        self.memory = memory
        self.scalars: dict[int, object] = {}
        self.yields: dict[int, bool] = {}        # id(block) -> whether it can reach a primitive

    def task_steps(self, part, rank, coords, budget) -> tuple[int, int]:
        """(scheduler steps, loop turns) of one task."""
        env: dict[int, object] = {}
        count = [1, 0]
        try:
            self._block(part.body, env, _Task(rank, coords), count, budget)
        except _Enough:
            pass
        except Exception:   # noqa: BLE001 - the run itself reports it; count what came before
            pass
        return count[0], count[1]

    def _block(self, block, env, task, count, budget):
        for op in block.ops:
            name = op.name
            if name in PRIMITIVES:
                count[0] += 1
                if count[0] >= budget:
                    raise _Enough
            elif name == "for":
                body = op.regions[0]
                if self._can_yield(body):
                    lo, hi, st = (env[v.id] for v in op.operands)
                    iv = body.args[0].id
                    for i in range(lo, hi, max(st, 1)):
                        env[iv] = i
                        count[1] += 1
                        self._block(body, env, task, count, budget)
                else:
                    count[1] += self._quiet_turns(op, env, task)
            elif name == "if":
                if env[op.operands[0].id] and self._can_yield(op.regions[0]):
                    self._block(op.regions[0], env, task, count, budget)
            elif name == "load_scalar":
                t, *idx = op.operands
                data = self.memory.ranks[task.rank][t.hint].data
                env[op.results[0].id] = int(data[tuple(env[i.id] for i in idx)])
            else:
                run = self._scalar(op)
                if run is not None:
                    run(op, env, task)

    def _quiet_turns(self, loop, env, task) -> int:
        """Turns of a loop that reaches no primitive, its nested loops' included, their trip counts
        as its first turn computes them (a bound that cannot be computed counts as one turn)."""
        trip = _trip(loop, env)
        if not trip:
            return 0
        body = loop.regions[0]
        first = dict(env)
        if loop.operands[0].id in env:
            first[body.args[0].id] = env[loop.operands[0].id]
        inner = 0
        for op in body.ops:
            if op.name == "for":
                inner += self._quiet_turns(op, first, task)
            elif not op.regions and op.name != "load_scalar":
                run = self._scalar(op)
                if run is not None:
                    try:
                        run(op, first, task)
                    except Exception:   # noqa: BLE001 - a bound it cannot compute counts as one turn
                        pass
        return trip * (1 + inner)

    def _scalar(self, op):
        key = id(op)
        if key not in self.scalars:
            self.scalars[key] = compile_scalar(op, _fails)
        return self.scalars[key]

    def _can_yield(self, block) -> bool:
        key = id(block)
        if key not in self.yields:
            self.yields[key] = any(op.name in PRIMITIVES or any(self._can_yield(r) for r in op.regions)
                                   for op in block.ops)
        return self.yields[key]


def _trip(loop, env) -> int:
    bounds = [env.get(v.id) for v in loop.operands]
    if not all(isinstance(b, numbers.Integral) for b in bounds):
        return 1
    lo, hi, st = bounds
    return len(range(lo, hi, max(st, 1)))


class _Enough(Exception):
    """The task alone exceeds the budget: counting it further would only cost time."""


def _fails(op, env, task):
    raise ArithmeticError(op.name)
