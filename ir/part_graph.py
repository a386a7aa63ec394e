"""Which parts of a kernel wait on which: the graph of signals between parts.

A part waits on another where it waits on a signal the other notifies. The runtime reads it to
chain a part after its producer, the code generator to refuse folding two parts into one kernel
that could then wait on each other: both need "waits, directly or through other parts". The
simulator and the code generator both need the parts that wait on themselves only through others.
"""
from __future__ import annotations

from .core import Kernel
from .opdefs import NOTIFY_OPS, WAIT_OPS


def notifiers(kernel: Kernel) -> dict[str, set[str]]:
    """``{signal: the parts that notify it}``."""
    out: dict[str, set[str]] = {}
    for p in kernel.parts:
        for op in p.walk():
            if op.name in NOTIFY_OPS:
                out.setdefault(op.operands[0].owner.name, set()).add(p.name)
    return out


def waited_signals(part) -> list:
    """The signals ``part`` waits on, each once, in the order it first waits on them."""
    seen: dict[str, object] = {}
    for op in part.walk():
        if op.name in WAIT_OPS:
            seen.setdefault(op.operands[0].owner.name, op.operands[0].owner)
    return list(seen.values())


def waits_on(kernel: Kernel) -> dict[str, set[str]]:
    """``{part: the parts it waits on directly}`` (through a signal they notify)."""
    by_signal = notifiers(kernel)
    return {p.name: {q for s in waited_signals(p) for q in by_signal.get(s.name, ())} for p in kernel.parts}


def self_signals(part) -> list[str]:
    """The signals ``part`` both notifies and waits on: its tasks wait for each other."""
    ops = list(part.walk())
    notified = {op.operands[0].owner.name for op in ops if op.name in NOTIFY_OPS}
    return sorted(notified & {op.operands[0].owner.name for op in ops if op.name in WAIT_OPS})


def reaches(deps: dict[str, set[str]], a: str, b: str) -> bool:
    """Does part ``a`` wait on part ``b``, directly or through other parts (``deps``:
    :func:`waits_on`)?"""
    seen, todo = set(), [a]
    while todo:
        for y in deps.get(todo.pop(), ()):
            if y == b:
                return True
            if y not in seen:
                seen.add(y)
                todo.append(y)
    return False


def parts_waiting_through_others(kernel: Kernel) -> list[str]:
    """The compute parts that wait on their own tiles only *through other parts* (a cycle of the
    part graph, no signal they both notify and wait on). The GPU run plan keeps a part whose
    tiles wait for each other directly resident, or refuses the launch; such a part it gives
    whatever CTAs its share of the SMs allows, which may be fewer than its tiles, each CTA
    walking its tiles in order. With counters that only grow, a program that finishes with each
    of these parts on one slot (its tiles one after another in tile order) finishes with its
    tiles spread over any number of CTAs walking that order: the simulator checks them so, and a
    lowering must walk them in the schedule's order."""
    deps = waits_on(kernel)
    return [p.name for p in kernel.parts
            if p.role == "compute" and not self_signals(p) and reaches(deps, p.name, p.name)]
