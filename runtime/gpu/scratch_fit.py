"""Fewer CTAs where the kernels' global-memory scratch would not fit the GPU's free memory.

A general kernel whose tiles overflow shared memory keeps them in a scratch private to each
task group of each CTA it launches (``scratch_bytes_per_cta``: whatever the tiles it holds at
once take, unbounded by the lowering). One CTA per SM is what the plan
grants for speed, but its CTAs walk the part's tasks in a loop, so fewer CTAs compute the same
result — and a whole-row tile of tens of megabytes on 132 CTAs would otherwise ask for gigabytes.
:func:`fit_scratch` shrinks the grids of the kernels that take scratch, all by the same factor,
until their scratch fits the budget, never below the fewest CTAs a kernel may run (its smallest
grid: a communication part's lanes; every task a part waiting on its own later tasks needs
resident). What still does not fit is refused before anything is allocated.
"""
from __future__ import annotations

import dataclasses

from ...ir import core
from .chains import at_once_needed
from .run_errors import ResidencyError

#: memory left to everything else (torch's allocator, the driver, the copies' staging) when the
#: budget is taken from the device's free memory: this much, or an eighth of what is free beside the
#: program's tensors where that is less (a small scratch still fits a nearly full GPU)
HEADROOM_BYTES = 512 * 1024 * 1024


def scratch_per_cta(lowered) -> int:
    """The global-memory scratch one CTA of ``lowered`` takes (0: none)."""
    return int(getattr(lowered, "scratch_bytes_per_cta", 0) or 0)


def scratch_bytes(kernels) -> int:
    """The scratch the planned ``kernels`` take together, every CTA of each (one allocation per
    rank and kernel, kept across launches: a chained kernel's too, though it runs after)."""
    return sum(k.ctas * scratch_per_cta(k.lowered) for k in kernels)


def _fewest(kernel: core.Kernel, planned) -> int:
    """The fewest CTAs ``planned`` may run: its recipe's smallest grid, or every task its part
    needs resident at once."""
    lk = planned.lowered
    return max(lk.grid(1)[0], at_once_needed(kernel.part(planned.part), kernel))


def _scaled(planned, fewest: int, factor: float) -> int:
    """``planned``'s CTAs times ``factor``, in whole clusters, at least ``fewest``."""
    cl = max(1, planned.lowered.cluster_dims[0])
    return max(fewest, int(planned.ctas * factor) // cl * cl)


def fit_scratch(kernel: core.Kernel, items: list, budget: int | None, describe=None) -> list:
    """``items`` (the plan's kernels and copy-engine parts) with the grids of the kernels taking
    scratch shrunk, by one factor, so that their scratch fits ``budget`` bytes (None: any). A
    :class:`~.run_errors.ResidencyError` where it does not fit even at their fewest CTAs.
    ``describe``: where the budget came from, for the error."""
    takers = [k for k in items if scratch_per_cta(getattr(k, "lowered", None)) > 0]
    if budget is None or scratch_bytes(takers) <= budget:
        return items
    fewest = {id(k): _fewest(kernel, k) for k in takers}
    least = sum(fewest[id(k)] * scratch_per_cta(k.lowered) for k in takers)
    if least > budget:
        parts = "; ".join(f"rank {k.rank} {k.part}: {fewest[id(k)]} CTA(s) x {scratch_per_cta(k.lowered):,} B"
                          for k in takers)
        raise ResidencyError(
            f"the kernels' global-memory scratch (the tiles that do not fit in shared memory) takes {least:,} B even "
            f"at their fewest CTAs ({parts}), over the {max(budget, 0):,} B "
            f"{describe or 'the launch may take'}; use smaller tiles (the shapes the program loads and computes), "
            "fewer ranks on this GPU, or free memory")
    lo, hi = 0.0, 1.0                # the largest factor that fits: the scratch only grows with it
    for _ in range(40):
        mid = (lo + hi) / 2
        need = sum(_scaled(k, fewest[id(k)], mid) * scratch_per_cta(k.lowered) for k in takers)
        lo, hi = (mid, hi) if need <= budget else (lo, mid)
    out = []
    for k in items:
        if id(k) in fewest:
            k = dataclasses.replace(k, grid=tuple(k.lowered.grid(_scaled(k, fewest[id(k)], lo))))
        out.append(k)
    return out
