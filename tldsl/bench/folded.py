"""Launching a folded kernel (a chained pair in one kernel, its waits real) beside the same parts
timed one after the other.

The parts timed one after the other are lowered stream-ordered: the signal between them is
dropped, so they count nothing. A folded kernel keeps that signal and waits on it, so it needs
counters of its own, from zero, and its own launch count. If it shared the stream-ordered parts'
counters and launch count, it would wait for an epoch that nobody notifies, and hang.
"""
from __future__ import annotations

#: a counter no wait can outrun: signals another part of the program notifies (the all-gather's,
#: at W = 1 already delivered), which every wait then finds satisfied
SATISFIED = 1 << 40


def comm_notified(ir) -> set[str]:
    """The signals a communication part of ``ir`` notifies (the all-gather's): at W = 1 every
    wait on them is already satisfied."""
    from tldsl.ir import NOTIFY_OPS
    return {op.operands[0].owner.name for p in ir.parts if p.role == "comm" for op in p.walk()
            if op.name in NOTIFY_OPS}


def folded_launches(ir, folded, prepare, device="cuda") -> "FoldedLaunches":
    """The launches of ``folded`` (a lowered kernel with a chained part folded in, lowered from
    ``ir``) as the benchmarks time it: counters for its signals, those a communication part
    notifies held satisfied, the others from zero; ``prepare(signals)``: its prepared launch."""
    slots = dict(folded.signal_slots)
    return FoldedLaunches(prepare, slots, satisfied=comm_notified(ir) & set(slots), device=device)


class FoldedLaunches:
    """``launch(stream)``: the next launch of a folded kernel, one epoch each, from 1.
    ``prepare(signals)`` packs the kernel's arguments with its counters (``signals``: name ->
    int64 tensor) and returns a prepared launch; ``slots``: the kernel's signals and their slot
    counts; ``satisfied``: those of them another part notifies, held at :data:`SATISFIED`."""

    def __init__(self, prepare, slots: dict[str, int], satisfied=(), device="cuda"):
        import torch
        unknown = sorted(set(satisfied) - set(slots))
        if unknown:
            raise ValueError(f"satisfied signals {unknown} are not among the folded kernel's {sorted(slots)}")
        self.signals = {name: torch.full((int(n),), SATISFIED if name in satisfied else 0, dtype=torch.int64,
                                         device=device)
                        for name, n in slots.items()}
        self.prepared = prepare(self.signals)
        self.launches = 0

    def launch(self, stream: int) -> None:
        self.launches += 1
        self.prepared.launch(stream, self.launches)
