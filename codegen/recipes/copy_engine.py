"""Recipe ``copy_engine``: a copy-engine communication part (``engine='copy_engine'``) is no
kernel but a host plan of copies, signal writes and stream waits per rank
(:mod:`..plan.copy_engine`), executed by ``tldsl.runtime.dist.plan_exec``. Its plan is its
output: rendering returns it as it is."""
from __future__ import annotations

from ..match.comm import match_copy_engine
from ..plan.copy_engine import CopyEnginePlan, plan_copy_engine
from .recipe import Recipe


def render_copy_engine(plan: CopyEnginePlan) -> CopyEnginePlan:
    """The plan itself: nothing is generated for the copy engine."""
    return plan


RECIPE = Recipe("copy_engine", "comm", 10, match_copy_engine, plan_copy_engine, render_copy_engine,
                summary="copy-engine plan (cudaMemcpy + stream memops)")
