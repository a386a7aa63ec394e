"""The hand-built launch paths the runtime may choose for speed, and when it does.

A fused op is its tile program; by default the fused-op runtime runs it
(:class:`~.program_engine.ProgramEngine`: :class:`~.program_op.FusedProgram`'s entry handshake,
parts on their own streams with the launch's epoch, exit handshake). For a few schedules of the
two fused GEMM ops a path written by hand was measured faster on 2x H200 (BENCHMARKS.md): the same
generated compute kernel, its communication part's work enqueued as a few stream-ordered copies
and memory operations with a lighter protocol of its own. Those are the recipes below — each
names the op, the schedule it takes, the engine class that runs it and the measurement that chose
it. The op's own checks, its introspection, ``close()`` and CUDA-graph capture are the same
whichever engine runs it (:class:`~.engine.EngineOp`); an engine adds only the checks of the
options that are its own (the pull's staging and handshake, the push's pusher).

A new hand-built path costs one row here and its engine class; an op never branches on which
engine it got.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from ...ir.schedule import CommSchedule


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A hand-built engine for one op's schedules: ``applies(comm, ce_executor)`` says which;
    ``engine`` is ``"module:Class"`` of :mod:`tldsl.runtime.dist` (imported on first use)."""

    name: str
    op: str
    schedule: str
    engine: str
    measured: str
    applies: Callable[[CommSchedule, str | None], bool]

    def engine_class(self):
        module, cls = self.engine.split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


def _copy_engine(mode: str | None):
    def applies(comm: CommSchedule, ce_executor: str | None) -> bool:
        return comm.engine == "copy_engine" and (mode is None or comm.mode == mode) and ce_executor != "plan"
    return applies


RECIPES: tuple[Recipe, ...] = (
    Recipe("copy_engine-push", "AllGatherMatmul", "copy-engine push, direct executor", "ag_push:PushAllGather",
           "probe ag_push: faster than or equal to the pull at every benchmark shape, up to 10% at the smallest; "
           "the default where this rank's rows are whole tiles", _copy_engine("push")),
    Recipe("copy_engine", "AllGatherMatmul", "copy-engine pull, direct executor", "ag_pull:PullAllGather",
           "the fused op's first measured path; staging by the GEMM or one kernel pass (probe ag_staging, "
           "ag_handshake)", _copy_engine("pull")),
    Recipe("copy_engine", "MatmulReduceScatter", "copy-engine push of the partials", "gemm_rs_copy:CopyEngineReduceScatter",
           "the GEMM on every SM, the copies behind its tiles: faster than the SM schedule's reserved lanes "
           "(12-30% GEMM slowdown) on 2x H200; the default", _copy_engine(None)),
)


def choose(op: str, comm: CommSchedule, ce_executor: str | None = None) -> Recipe | None:
    """The recipe that runs ``op`` with ``comm`` (and the copy-engine executor asked for), or None:
    the fused-op runtime runs the op's tile program."""
    for recipe in RECIPES:
        if recipe.op == op and recipe.applies(comm, ce_executor):
            return recipe
    return None
