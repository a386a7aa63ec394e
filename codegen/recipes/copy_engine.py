"""Recipe ``copy_engine``: a copy-engine communication part (``engine='copy_engine'``) is no
kernel but a host plan of copies, signal writes and stream waits per rank
(:mod:`..plan.copy_engine`), executed by ``tldsl.runtime.gpu.plan_exec``. Its plan is its
output: rendering returns it as it is."""
from __future__ import annotations

from ...ir import core
from ..ir_queries import only_part
from ..match.comm import match_copy_engine
from ..plan.copy_engine import WHAT, CopyEnginePlan, plan_copy_engine_part
from .recipe import Recipe


def render_copy_engine(plan: CopyEnginePlan) -> CopyEnginePlan:
    """The plan itself: nothing is generated for the copy engine."""
    return plan


RECIPE = Recipe("copy_engine", "comm", 10, match_copy_engine, plan_copy_engine_part, render_copy_engine,
                summary="copy-engine plan (cudaMemcpy + stream memops)")


def plan_copy_engine(kernel: core.Kernel, part: str | core.Part | None = None) -> CopyEnginePlan:
    """The host plan of a kernel's copy-engine part (the only one, or the one named): this
    recipe's match → plan → render, as ``lower`` runs them."""
    p = only_part(kernel, part, WHAT, "copy-engine parts", lambda q: q.role == "comm" and q.engine == "copy_engine",
                  verb="plan")
    return RECIPE.run(kernel, p)
