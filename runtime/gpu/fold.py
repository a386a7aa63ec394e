"""Folding one of a chained pair of compute parts into the other's kernel (``chain="folded"``).

A part that waits only on another compute part of its rank (:func:`.chains.chained_parts`:
an MoE combine behind its grouped GEMM, AllGather+MoE's grouped GEMM behind the row gather that
stages its A) can run after its producer on the producer's stream, or — where the grouped GEMM's
recipe has room for the other — inside one kernel: the grouped GEMM recipe runs a row-gather
part on the three producer warps a TMA-loaded A leaves idle (``side=``), each of its tiles as
soon as its waits hold: a combine tile once the GEMM tiles it reads are done, a gather tile at
once (the GEMM tiles wait for it), so the row traffic overlaps the GEMM's tensor-core work
instead of following or preceding it. The folded part then has no kernel of its own: its entry
in ``{part: lowered}`` is a :class:`FoldedPart` naming the kernel that runs it, which the plan
launches nothing for.

The folded kernel needs its whole grid resident at once (a CTA's combine warps may wait on GEMM
tiles another CTA runs, a CTA's GEMM on another CTA's gather, and no CTA finishes before both):
its grid is the persistent one, one CTA an SM, which the plan keeps within the SMs it gives the
GEMM, and it runs without clusters (:data:`FOLDED_CLUSTER`). The GEMM keeps its
schedule's tile order (``group_m``); the measurements below set column order (``bench moe
--fold on``), the order in which whole columns of GEMM tiles, the combine's inputs, finish first.

Not the default (``chain="after"`` is): measured on one H200 (BENCHMARKS.md, twenty-fourth
session), the folded kernel is correct and slower — 96 threads an SM keep too few gathers in
flight for a combine that moves 150–370 MB (Qwen3-30B's grouped GEMM and combine 0.51 ms folded
against 0.40 one after the other; Mixtral 1.54 against 1.54), and its combine tiles can only start
once a whole column of GEMM tiles is done, so the GEMM's tiles must go column by column, which
reads A from HBM once per column. The fused MoEReduceScatter at one rank: Qwen3-30B 1.32 ms
against 1.06, Mixtral 4.35 against 3.85. AllGather+MoE's staged gather folded (twenty-sixth
session): the kernel pair gains where the GEMM is long and the gather large (Mixtral 32768 tokens
11.62 / 11.86 ms against 11.74 / 12.16 in two calls, the stress row 5.51 / 5.57 against 5.62 /
5.74), loses where they are short (Mixtral 2048, and the small-expert rows by far: the GEMM waits
on 96 threads' gather), and the fused AllGatherMoE at one rank did not gain from it (Mixtral 32768
26.20 ms against 25.95, the stress row 12.28 against 12.24). The folded kernel runs no half tiles
(every tile its 128 rows): with them, the stress row's folded gather took 6.32 ms against 5.42
without (thirty-third session). Re-measured without them (thirty-fourth session), the fused
AllGatherMoE at one rank (every expert's whole N) gains folded on the stress row (11.47 ms against
12.01) and Mixtral 8192 (6.16 against 6.29) and loses on Mixtral 32768 (25.82 against 25.04: the
folded kernel's missing clusters cost the 28672-column GEMM more than the gather it hides), while
the kernels at the TP = 2 slice reach ``_grouped_mm`` folded on all three (1.00-1.04x): mixed, so the
op's default stays two kernels until two ranks can be measured.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...ir import core
from .chains import chained_parts


@dataclass(frozen=True)
class FoldedPart:
    """A part that runs inside another part's kernel (``into``), not as a launch of its own."""
    part: str
    into: str

    def describe(self) -> str:
        return f"{self.part}: folded into the kernel of '{self.into}'"


def is_folded(lowered) -> bool:
    return isinstance(lowered, FoldedPart)


#: the folded kernel's clusters: none. Its whole grid must be resident at once, and the plan
#: counts SMs, not the places a cluster fits: pairs of CTAs need two free SMs of one GPC, which
#: the SMs other kernels of the launch hold (a reduce-scatter's lanes) may leave too few of — a
#: CTA pair left waiting for an SM would wait on tiles no resident CTA runs (a hang, where an
#: unfolded GEMM only runs later). Single CTAs fit wherever the plan counted an SM. Nor would
#: pairs pay: MoE+ReduceScatter's folded kernel with clusters of 2 (all 66 pairs resident, the
#: whole H200 its own) ran at the speed of the one without (Mixtral 32768 tokens 6.098 against
#: 6.103 ms; BENCHMARKS.md, thirty-second session), and so did AllGather+MoE's GEMM with its staged
#: gather folded (Mixtral 32768 tokens 1.00x ``_grouped_mm`` either way; fortieth session, call 3).
FOLDED_CLUSTER = (1, 1)


def fold_chained(kernel: core.Kernel, lowered: dict, options: dict, kernels: set[str]) -> dict:
    """``lowered`` with every chained pair that a grouped GEMM can host folded into the GEMM's
    kernel — a combine chained after its grouped GEMM, or a grouped GEMM chained after the row
    gather that stages its A (the GEMM lowered again with ``side=``, the same ``options`` but
    clusters: :data:`FOLDED_CLUSTER`) — the other parts as they were. A pair the recipe refuses
    (a gathered A, two parts waiting on each other) stays two kernels, one chained after the
    other. ``kernels``: the parts lowered to SM kernels (not copy-engine plans)."""
    from ...codegen import lower
    from ...codegen.errors import LoweringError
    out = dict(lowered)
    for part, producer in chained_parts(kernel, kernels).items():
        host, side = _host_and_side(lowered[producer], lowered[part], producer, part)
        if host is None or out[host] is not lowered[host] or out[side] is not lowered[side]:
            continue                        # not a pair a GEMM hosts, or one of the two folded already
        opts = {k: v for k, v in options.items() if k == "wait_timeout_ns"}
        try:
            out[host] = lower(kernel, host, side=side, cluster=FOLDED_CLUSTER, **opts)
        except LoweringError:
            continue
        out[side] = FoldedPart(side, host)
    return out


def _host_and_side(lp, lc, producer: str, part: str):
    """``(host, side)`` names of a chained pair (``part`` after ``producer``) where one is a
    grouped GEMM loading A by TMA and the other a row-gather (combine-recipe) kernel; else
    ``(None, None)``."""
    kinds = (getattr(lp, "kind", ""), getattr(lc, "kind", ""))
    if kinds == ("grouped_gemm", "combine") and not lp.gather:
        return producer, part
    if kinds == ("combine", "grouped_gemm") and not lc.gather:
        return part, producer
    return None, None
