"""How the kernels of one launch share the SMs left after every kernel's least (the run plan's
grants, :func:`~.run_plan.plan_run`).

Split evenly (what every launch did before), a light kernel that waits on another's tiles — an
MoE combine behind its grouped GEMM — took half of the GPU from the kernel it waits for. Split by
work (the default), each kernel gets SMs in proportion to its part's estimated cost
(:func:`~.work.part_work`), so the kernels of a launch finish together; a kernel never gets less
than an even share over :data:`LIGHT_FLOOR` (the estimate ignores waiting and per-task overheads:
a kernel it underrates keeps some SMs), nor less than a part waiting on its own tasks needs
resident. Either way: each kernel at least its least, never more than it can use.
"""
from __future__ import annotations

from ...errors import InputError

#: how the SMs left after every kernel's least are shared: by estimated work, or evenly
SPLITS = ("work", "even")
#: under the work split, a kernel that can use more CTAs gets at least an even share over this
LIGHT_FLOOR = 8


def check_split(split) -> None:
    """Refuse a ``split`` that is not one of :data:`SPLITS` (before anything is built)."""
    if split not in SPLITS:
        raise InputError(f"split={split!r}: the SMs are shared by 'work' (the default) or 'even'")


def share(lows: list[int], highs: list[int], available: int, works: list[float] | None = None,
           needs: list[int] | None = None) -> list[int]:
    """CTAs per kernel: each its least, then the SMs left shared among those that can use more,
    never past what each can use — evenly (``works`` None), else by work (:func:`_by_work`)."""
    if works is not None:
        return _by_work(lows, highs, available, works, needs or [0] * len(lows))
    grants = list(lows)
    rest = available - sum(lows)
    active = [i for i, (g, h) in enumerate(zip(grants, highs)) if h > g]
    while rest > 0 and active:
        each = max(1, rest // len(active))
        for i in list(active):
            add = min(each, highs[i] - grants[i], rest)
            grants[i] += add
            rest -= add
            if grants[i] >= highs[i]:
                active.remove(i)
            if rest == 0:
                break
    return grants


def _by_work(lows: list[int], highs: list[int], available: int, works: list[float], needs: list[int]) -> list[int]:
    """The SMs the kernels that can use more CTAs share (all but the others' least), in
    proportion to ``works``: kernel ``i`` gets ``clamp(lam * works[i], floor_i, highs[i])`` with
    ``lam`` chosen so the grants fill the SMs. ``floor_i``: its least, an even share over
    :data:`LIGHT_FLOOR`, and ``needs[i]`` (a part waiting on its own tasks) — all three dropped
    for the least alone where they do not fit together. Whole CTAs: each rounded down, the SMs
    left go one at a time to the largest remainders. Without any work to go by: evenly."""
    n = len(lows)
    active = [i for i in range(n) if highs[i] > lows[i]]
    pool = available - sum(lows[i] for i in range(n) if i not in active)
    if not active or sum(works[i] for i in active) <= 0:
        return share(lows, highs, available)
    floors = {i: min(highs[i], max(lows[i], pool // len(active) // LIGHT_FLOOR, needs[i])) for i in active}
    if sum(floors.values()) > pool:
        floors = {i: lows[i] for i in active}

    def filled(lam: float) -> float:
        return sum(min(highs[i], max(floors[i], lam * works[i])) for i in active)

    lo, hi = 0.0, max(highs[i] / works[i] for i in active if works[i] > 0)
    if filled(hi) <= pool:
        lo = hi
    else:
        for _ in range(100):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if filled(mid) <= pool else (lo, mid)
    grants = list(lows)
    exact = {i: min(highs[i], max(floors[i], lo * works[i])) for i in active}
    for i in active:
        grants[i] = int(exact[i])
    rest = pool - sum(grants[i] for i in active)
    order = sorted(active, key=lambda i: (-(exact[i] - grants[i]), i))
    while rest > 0:
        more = [i for i in order if grants[i] < highs[i]]
        if not more:
            break
        for i in more[:rest]:
            grants[i] += 1
        rest -= len(more[:rest])
    return grants
