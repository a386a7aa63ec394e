"""Vector clocks for happens-before, kept sparse: a dict from task id to that task's clock.

A launch has one clock entry per task, so dense clocks cost (tasks)^2 memory — gigabytes at
W = 64 — while a task's clock only ever holds the tasks it is ordered after through a
notify -> wait chain: usually a handful. A missing entry is clock 0 (never ordered after)."""
from __future__ import annotations


def new_clock(tid: int) -> dict[int, int]:
    return {tid: 1}


def join_into(dst: dict[int, int], src: dict[int, int]) -> None:
    """dst = max(dst, src), entry by entry."""
    get = dst.get
    for t, c in src.items():
        if get(t, 0) < c:
            dst[t] = c
