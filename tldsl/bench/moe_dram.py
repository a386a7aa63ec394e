"""The least bytes MoE+ReduceScatter's grouped GEMM and combine move through DRAM, timed in their own
mix of reads and writes beside the pair and ``_grouped_mm``.

    python -m tldsl.bench probe moe_dram [--rows qwen3:8192:random,...] [--iters 20]

Why: ``bench moe --layer rs``'s last column times those bytes (:func:`.moe.pair_dram_split`) as one
device-to-device copy, half read and half written, while the pair reads 1.7-11x what it writes
(Qwen3-30B at 8192 tokens: 520 MB read, 302 MB written). DRAM that turns the bus around less may
move a read-heavy stream faster than a copy, so the copy alone may put the bound too high. Here the
same bytes are moved three ways, each checked once and then timed interleaved with our pair and
``_grouped_mm`` (layer 1 as ``bench moe --layer rs`` builds it, checked against torch's sequence
first):

* a copy of them all (as ``bench moe``'s column);
* a read pass over the bytes read (a float32 sum), then a write pass over the bytes written (a
  fill): the two directions one after the other;
* a mixed pass: a float32 sum over dim 0 of ``[f, n]`` into ``[n]``, reading ``f`` rows for each
  it writes (``f`` the pair's reads over its writes, rounded), its time scaled to the pair's bytes.

The table then gives how fast our pair moves its bytes against each (the pass's time over the
pair's) and how much of ``_grouped_mm``'s time each needs (the pass's over ``_grouped_mm``'s): where
the fastest pass already takes nearly ``_grouped_mm``'s time, the pair cannot reach 1.0x by any
schedule short of moving fewer bytes. Still an estimate: ``y_sorted`` skips DRAM where it fits L2
(Mixtral 2048's 34 MB)."""
from __future__ import annotations

import sys

#: the passes timed beside the pair, in the table's order
PASSES = ("copy", "read, then write", "mixed")


def mixed_fold(reads: int, writes: int) -> int:
    """Rows the mixed pass reads for each row it writes: the pair's reads over its writes,
    rounded, at least 1."""
    if reads <= 0 or writes <= 0:
        raise ValueError(f"the pair must read and write bytes, got {reads} read and {writes} written")
    return max(1, round(reads / writes))


def pass_times(t: dict, reads: int, writes: int) -> dict:
    """Each pass's time for the pair's bytes (ms) from the timed launches in ``t`` (``copy``,
    ``read``, ``write``, ``mixed``): the read and write passes added, the mixed pass scaled from the
    bytes it moved (``f`` times the writes read, the writes written) to the pair's."""
    f = mixed_fold(reads, writes)
    return {"copy": t["copy"], "read, then write": t["read"] + t["write"],
            "mixed": t["mixed"] * (reads + writes) / ((f + 1) * (writes // 4 * 4))}


HEADER = ("| row | MB read | MB written | mixed pass: rows read a row written | our GEMM + combine ms | "
          "`_grouped_mm` ms | copy ms | read pass ms | write pass ms | mixed pass ms (scaled) | "
          "TB/s: copy, read, write, mixed | our pair's speed against: " + ", ".join(PASSES)
          + " | the pass over `_grouped_mm`'s time: " + ", ".join(PASSES) + " |")

RULE = "|---" * (HEADER.count(" | ") + 1) + "|"


def table_row(label: str, reads: int, writes: int, t: dict) -> str:
    """One row of the probe's table from the launches' median ms in ``t``: ``pair``, ``gmm``,
    ``copy``, ``read``, ``write``, ``mixed``."""
    f = mixed_fold(reads, writes)
    bound = pass_times(t, reads, writes)
    w4 = writes // 4 * 4
    rates = [(reads + writes) / t["copy"], reads // 4 * 4 / t["read"], w4 / t["write"], (f + 1) * w4 / t["mixed"]]
    cells = [label, f"{reads / 1e6:.0f}", f"{writes / 1e6:.0f}", str(f), f"{t['pair']:.3f}", f"{t['gmm']:.3f}",
             f"{t['copy']:.3f}", f"{t['read']:.3f}", f"{t['write']:.3f}", f"{bound['mixed']:.3f}",
             ", ".join(f"{r / 1e9:.2f}" for r in rates),
             ", ".join(f"{bound[p] / t['pair']:.2f}" for p in PASSES),
             ", ".join(f"{bound[p] / t['gmm']:.2f}" for p in PASSES)]
    return "| " + " | ".join(cells) + " |"


def bound_passes(reads: int, writes: int) -> dict:
    """The passes, each one launch on the current stream, on buffers of their own: ``copy``,
    ``read``, ``write``, ``mixed``; each checked once here first (poisoned outputs, ones read).
    A RuntimeError where one computes other than it should."""
    import torch
    from .timing import copy_of
    f, n_r, n_w = mixed_fold(reads, writes), reads // 4, writes // 4
    x = torch.ones(n_r, device="cuda")
    s = torch.full((), float("nan"), device="cuda")
    y = torch.full((n_w,), float("nan"), device="cuda")
    xm = torch.ones(f, n_w, device="cuda")
    ym = torch.full((n_w,), float("nan"), device="cuda")
    passes = {"copy": copy_of(reads + writes), "read": lambda: torch.sum(x, dim=0, out=s),
              "write": lambda: y.fill_(1.0), "mixed": lambda: torch.sum(xm, dim=0, out=ym)}
    for p in ("read", "write", "mixed"):
        passes[p]()
    torch.cuda.synchronize()
    if not abs(s.item() - n_r) <= 1e-5 * n_r:
        raise RuntimeError(f"the read pass summed {n_r} ones to {s.item()}")
    if not bool((y == 1).all()) or not bool((ym == f).all()):
        raise RuntimeError("the write or mixed pass left other values than it writes")
    return passes


def probe_moe_dram(rows, iters: int = 20, out=sys.stdout) -> None:
    """For each row of layer 1 (``bench moe --layer rs``'s kernels, checked against torch's sequence
    first): our grouped GEMM then combine, ``_grouped_mm`` and the passes (:func:`bound_passes`)
    timed interleaved (:func:`.timing.interleaved_ms`), one table row each."""
    import torch
    from .baselines import MOE_MODELS
    from .moe import _check_close, pair_dram_split, rs_row
    from .timing import interleaved_ms
    print(HEADER, file=out)
    print(RULE, file=out, flush=True)
    for row in rows:
        r = rs_row(row)
        want = r.sequence()
        r.pair()
        _check_close(f"{row}: the grouped GEMM + combine differ from _grouped_mm + the weighted sum",
                     r.bufs["partial"], want)
        reads, writes = pair_dram_split(r.bufs, row.tokens * MOE_MODELS[row.model][3], r.experts_used())
        passes = bound_passes(reads, writes)
        names = ("pair", "gmm", "copy", "read", "write", "mixed")
        ms = interleaved_ms([r.pair, r.gmm] + [passes[n] for n in names[2:]], iters=iters)
        print(table_row(f"{row.model} {row.tokens} {row.routing}", reads, writes, dict(zip(names, ms))),
              file=out, flush=True)
        del passes, r
        torch.cuda.empty_cache()
