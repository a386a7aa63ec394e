"""Folding a chained compute part into its producer's kernel (``chain="folded"``).

A part that waits only on another compute part of its rank (:func:`.chains.chained_parts`:
an MoE combine behind its grouped GEMM) can run after its producer on the producer's stream, or
— where the producer's recipe has room for it — inside the producer's kernel: the grouped GEMM
recipe runs a row-gather combine on the three producer warps a TMA-loaded A leaves idle
(``side=``), each combine tile starting as soon as the GEMM tiles it reads are done, so the
combine's memory traffic overlaps the GEMM's tensor-core work instead of following it. The
folded part then has no kernel of its own: its entry in ``{part: lowered}`` is a
:class:`FoldedPart` naming the kernel that runs it, which the plan launches nothing for.

The folded kernel needs its whole grid resident at once (a CTA's combine warps may wait on GEMM
tiles another CTA runs, and the CTA cannot finish before them): its grid is the persistent one,
one CTA an SM, which the plan keeps within the SMs it gives the producer. The GEMM keeps its
schedule's tile order (``group_m``); the measurements below set column order (``bench moe
--fold on``), the order in which whole columns of GEMM tiles, the combine's inputs, finish first.

Not the default (``chain="after"`` is): measured on one H200 (BENCHMARKS.md, twenty-fourth
session), the folded kernel is correct and slower — 96 threads an SM keep too few gathers in
flight for a combine that moves 150–370 MB (Qwen3-30B's grouped GEMM and combine 0.51 ms folded
against 0.40 one after the other; Mixtral 1.54 against 1.54), and its combine tiles can only start
once a whole column of GEMM tiles is done, so the GEMM's tiles must go column by column, which
reads A from HBM once per column. The fused MoEReduceScatter at one rank: Qwen3-30B 1.32 ms
against 1.06, Mixtral 4.35 against 3.85.
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


def fold_chained(kernel: core.Kernel, lowered: dict, options: dict, kernels: set[str]) -> dict:
    """``lowered`` with every chained combine that its grouped-GEMM producer can host folded into
    it (the producer lowered again with ``side=``, the same ``options``); the other parts as
    they were. A pair the recipe refuses (a gathered A, a GEMM that could wait on the combine)
    stays two kernels, the combine chained after the GEMM. ``kernels``: the parts lowered to SM
    kernels (not copy-engine plans)."""
    from ...codegen import lower
    from ...codegen.errors import LoweringError
    out = dict(lowered)
    for part, producer in chained_parts(kernel, kernels).items():
        lp, lc = lowered[producer], lowered[part]
        if out[producer] is not lp:         # one side part per kernel: this producer hosts one already
            continue
        if getattr(lp, "kind", "") != "grouped_gemm" or getattr(lc, "kind", "") != "combine" or lp.gather:
            continue
        opts = {k: v for k, v in options.items() if k in ("cluster", "wait_timeout_ns")}
        try:
            out[producer] = lower(kernel, producer, side=part, **opts)
        except LoweringError:
            continue
        out[part] = FoldedPart(part, producer)
    return out
