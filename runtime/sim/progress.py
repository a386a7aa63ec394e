"""What a long simulation says while it runs: a warning up front with the expected number of
scheduler steps, then progress at intervals — to stderr by default (a line at a time, which
terminals and notebooks both show), or to a callback of the caller's.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass


class LongSimulationWarning(UserWarning):
    """A simulation expected to take many scheduler steps (the count grows with W^2)."""


@dataclass(frozen=True)
class SimProgress:
    """Where a running simulation stands."""
    launch: int              # 1-based
    launches: int
    steps: int               # so far, every launch
    expected_steps: int      # estimated before the run (:mod:`.step_estimate`)
    elapsed_s: float
    done: bool = False

    @property
    def fraction(self) -> float:
        return min(1.0, self.steps / self.expected_steps) if self.expected_steps else 0.0

    def __str__(self) -> str:
        if self.done:
            return f"tl.simulate: done, {self.steps:,} scheduler steps in {_duration(self.elapsed_s)}"
        left = ""
        if 0 < self.fraction < 1:
            left = f", about {_duration(self.elapsed_s * (1 - self.fraction) / self.fraction)} left"
        return (f"tl.simulate: launch {self.launch}/{self.launches}, step {self.steps:,} of about "
                f"{self.expected_steps:,} ({100 * self.fraction:.0f}%), {_duration(self.elapsed_s)}{left}")


def print_progress(p: SimProgress) -> None:
    print(p, file=sys.stderr, flush=True)


class ProgressReporter:
    """Calls ``callback`` with a :class:`SimProgress` every ``interval_s`` seconds of a run
    (the scheduler asks every ``CHECK_EVERY`` steps), and once at the end (``done``). A
    simulation of several runs (a kernel whose parts wait on themselves through others runs
    twice: :func:`~.simulate.simulate`) reports them as one, its launches and steps counted
    on: :meth:`next_run` after each run but the last."""
    CHECK_EVERY = 512

    def __init__(self, callback, interval_s: float, expected_steps: int, launches: int):
        self.callback, self.interval_s = callback, interval_s
        self.expected_steps, self.launches = expected_steps, launches
        self.start = time.perf_counter()
        self.last = self.start
        self.steps_before = self.launches_before = 0      # of the runs already finished

    def next_run(self, steps: int, launches: int) -> None:
        """A run of ``launches`` launches and ``steps`` steps has finished; the next starts at 0."""
        self.steps_before += steps
        self.launches_before += launches

    def check(self, steps: int, launch: int) -> None:
        now = time.perf_counter()
        if now - self.last >= self.interval_s:
            self.last = now
            self.callback(SimProgress(self.launches_before + launch, self.launches, self.steps_before + steps,
                                      self.expected_steps, now - self.start))

    def finish(self, steps: int) -> None:
        self.callback(SimProgress(self.launches, self.launches, self.steps_before + steps, self.expected_steps,
                                  time.perf_counter() - self.start, done=True))


def long_run_message(world_size: int, expected_steps: int, tasks: int, launches: int, max_steps: int,
                     static_checks: bool, loop_turns: int = 0) -> str:
    msg = (f"simulating W={world_size} ranks: about {expected_steps:,} scheduler steps expected "
           f"({tasks:,} tasks per launch, {launches} launch{'es' if launches != 1 else ''}; the count grows "
           f"with W^2), which may take minutes. ")
    if loop_turns:
        msg += (f"Its tl.range loops turn about {loop_turns:,} times in all, each turn's tile math simulated "
                f"(a loop that reaches no primitive runs within one step, so progress may not show while it "
                f"turns): this may take much longer; shrink the loops' trip counts to simulate it. ")
    if static_checks:
        msg += "The static channel analysis runs first (SimOptions(static_checks=False) skips it). "
    msg += ("Progress is reported while the launches run (to stderr unless SimOptions(progress=...) says "
            "otherwise); SimOptions(warn_steps=None) silences this warning")
    if expected_steps > max_steps:
        msg += (f". That is more than max_steps={max_steps:,}: the run will stop there "
                f"(raise SimOptions(max_steps=...) to let it finish)")
    return msg


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, s = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {s} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"
