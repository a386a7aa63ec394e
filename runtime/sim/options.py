"""The simulator's one options object."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ...errors import InputError
from ...ir.display import compact, one_line
from ...ir.field_types import check_field_names, check_field_types


class SimOptionsError(InputError, ValueError):
    """A SimOptions field that cannot be (an InputError; a ValueError too, as it always was)."""


@dataclass(frozen=True)
class SimOptions:
    """How the simulator runs a kernel.

    launches: how many times the kernel is launched back to back, each on the caller's
        arguments: what the program writes into them is put back between launches, so an
        in-place kernel (``y += x``) returns one application of itself. Signals and workspaces
        persist, so stale signals of an earlier launch are caught; a group barrier separates
        launches, as the host-side stream order of the GPU runtime does (``tl.run`` launches and
        restores the same way).
    compute_slots: how many tasks of each compute part of a rank may be resident at once: slot
        b runs tasks b, b + slots, ... of the compute schedule's tile order, one after another,
        as a persistent kernel's CTA does, so a wait on a tile that can only start later in its
        slot is a deadlock, as on the GPU. A communication part's lanes run its tasks the same
        way. None (the default): every task at once (as the GPU run plan keeps a compute part
        that waits on itself, unless every such wait is on a task before it in that order: a
        running sum over tiles runs on any number of CTAs); a kernel with a part that waits on its own tiles only through
        other parts is first run with that part on one slot — the GPU may give it fewer CTAs
        than tiles, and a program that finishes on one slot finishes on any number
        (:func:`tldsl.ir.part_graph.parts_waiting_through_others`) — then with every task at once, whose
        interleavings the race detector needs and whose results are returned. A number: every
        compute part on that many slots, in one run.
    check_races / check_uninitialized: the detectors (vector-clock races; reads of workspace
        memory nothing wrote).
    static_checks: run the static channel analysis before simulating (a wait nothing can
        satisfy is reported at its line without running).
    repoison: refill workspaces with NaN before every launch (kernels may not rely on
        workspace contents from an earlier launch).
    max_steps: scheduler steps before giving up (a livelock guard).
    warn_steps: simulate estimates the scheduler steps before it runs; above this many it warns
        (``LongSimulationWarning``, with the estimate) and shows progress. None: never.
    progress: None (progress lines on stderr when the run was warned about, unless the
        environment sets ``TLDSL_QUIET``), True (always),
        False (never), or a function called with a ``SimProgress`` at each interval — in a
        notebook, to drive a progress bar. A kernel run twice (on one slot first, above) reports
        both runs as one: twice the launches and steps of the result's.
    progress_interval_s: seconds between progress reports.
    bulk_loops: run a loop that never yields to the scheduler in bulk — its loads as regions,
        its tile math in one numpy call (runtime/sim/bulk_loop.py). False runs it op by op:
        slower, with the same results to the bit and the same reports.
    """
    launches: int = 2
    compute_slots: int | None = None
    check_races: bool = True
    check_uninitialized: bool = True
    static_checks: bool = True
    repoison: bool = True
    record_timeline: bool = True
    max_steps: int = 5_000_000
    warn_steps: int | None = 200_000
    progress: bool | Callable | None = None
    progress_interval_s: float = 5.0
    bulk_loops: bool = True

    def __new__(cls, *args, **kwargs):
        check_field_names(cls, args, kwargs, SimOptionsError, noun="option")
        return super().__new__(cls)

    def __repr__(self) -> str:
        """The fields that differ from their defaults: ``SimOptions(launches=3)``."""
        return one_line(compact(self))

    def __post_init__(self):
        check_field_types(self, SimOptionsError)
        if not isinstance(self.launches, int) or self.launches < 1:
            raise SimOptionsError(f"launches must be a positive int, got {self.launches}")
        if self.compute_slots is not None and (not isinstance(self.compute_slots, int) or self.compute_slots < 1):
            raise SimOptionsError(f"compute_slots must be None or a positive int, got {self.compute_slots}")
        if self.progress is not None and not isinstance(self.progress, bool) and not callable(self.progress):
            raise SimOptionsError(f"progress must be None, True, False or a function of a SimProgress, got {self.progress!r}")
        if self.max_steps < 1:
            raise SimOptionsError(f"max_steps must be a positive int (scheduler steps before giving up), got {self.max_steps}")
        if self.warn_steps is not None and self.warn_steps < 0:
            raise SimOptionsError(f"warn_steps must be None (never warn) or an int of 0 or more (the estimated "
                                  f"scheduler steps above which simulate warns), got {self.warn_steps}")
        if not 0 <= self.progress_interval_s < math.inf:       # (NaN fails this too)
            raise SimOptionsError(f"progress_interval_s must be a finite number of seconds, 0 or more, got "
                                  f"{self.progress_interval_s!r}")
