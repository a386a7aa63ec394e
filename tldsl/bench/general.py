"""The general lowering's speed (issue 18 item 5): plain tile programs no recipe matches, beside
torch on the same inputs in the same run.

    python -m tldsl.bench general [--rounds 5] [--iters 10] [--only NAME,...]
        [--rows R] [--whole-row N] [--threads T]            (the row programs; default ROW_DEFAULTS)
        [--gemm-stages S] [--gemm-group-m G] [--gemm-copies tma|cp.async] [--gemm-inflight 0|1]

Memory-bound programs (:mod:`.general_programs`), fp16 ``[16384, 8192]`` operands (256 MiB
each): ``y = 2x + 1``; a row softmax; RMSNorm; residual add + RMSNorm (``h = x + r`` and
``rms_norm(h) * w``). Each beside torch eager, ``torch.compile`` and a device-to-device copy of
as many bytes as the program must move (every input read once, every output written once):
its bandwidth is that byte count over its time. The gated GEMM ``relu(A @ B + bias) * (A @ C)``
as one part, at 8192³ and 8191×8200×4104 (M×N×K), beside cuBLAS + torch's epilogue (eager and
compiled). tldsl's times are ``tl.run``'s CUDA events around each launch (its kernels alone);
the rounds alternate tl.run's launches with the peers' (median over every round). Every
output is checked against torch first.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from typing import Callable

from .timing import copy_of, interleaved_ms


@dataclass
class Case:
    """One benchmark row: the program, its schedule and arguments, and torch's way to the same."""
    name: str
    kernel: object
    compute: object
    args: dict                     # name -> torch tensor (outputs poisoned)
    outputs: tuple[str, ...]
    torch_fn: Callable             # () -> tuple of the outputs, computed by torch
    moved_bytes: int = 0           # memory-bound: bytes the program must read and write
    flops: int = 0                 # the GEMM
    kwargs: dict = field(default_factory=dict)     # the program's own keyword arguments
    lowering: dict = field(default_factory=dict)   # tl.run's lowering options


#: the row programs' keywords (``threads``: the lowering's), each the fastest measured
#: (BENCHMARKS.md, eighteenth session): whole rows, one a task — rows held in registers, the next
#: task's fetched early, the lowering's threads (column tiles: 0.31 ms for the RMSNorm, 0.15 so)
ROW_DEFAULTS = {"row softmax": {"rows": 1, "whole_row": 16384}, "RMSNorm": {"rows": 1, "whole_row": 16384},
                "residual add + RMSNorm": {"rows": 1, "whole_row": 16384}}


def memory_cases(torch, M=16384, N=8192, rows: int | None = None, whole_row: int | None = None,
                 threads: int | None = None):
    """The memory-bound rows (fp16, ``[M, N]`` operands); the row programs' ``rows`` and
    ``whole_row`` where given, else :data:`ROW_DEFAULTS`; ``threads``: the lowering's threads a task."""
    import tldsl as tl
    from . import general_programs as gp
    dev, f16 = "cuda", torch.float16
    x = torch.randn(M, N, device=dev, dtype=f16)
    r = torch.randn(M, N, device=dev, dtype=f16)
    w = torch.randn(1, N, device=dev, dtype=f16)
    def nan():
        return torch.full((M, N), float("nan"), device=dev, dtype=f16)
    size = M * N * 2
    flat = tl.ComputeSchedule(tile=(32, 256, 16))
    by_rows = tl.ComputeSchedule(tile=(16, 256, 16))
    given = {k: v for k, v in (("rows", rows), ("whole_row", whole_row)) if v is not None}

    def kw(name):
        return given or {k: v for k, v in ROW_DEFAULTS[name].items() if k != "threads"}

    def low(name):
        t = threads if (given or threads) else ROW_DEFAULTS[name].get("threads")
        return {"threads": t} if t else {}

    def rms(h):
        hf = h.float()
        return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(f16)
    return [
        Case("y = 2x + 1", gp.scale_shift, flat, {"x": x, "y": nan()}, ("y",), lambda: (x * 2 + 1,), 2 * size),
        Case("row softmax", gp.row_softmax, by_rows, {"x": x, "y": nan()}, ("y",),
             lambda: (torch.softmax(x.float(), -1).to(f16),), 2 * size, kwargs=kw("row softmax"),
             lowering=low("row softmax")),
        Case("RMSNorm", gp.rms_norm, by_rows, {"x": x, "w": w, "y": nan()}, ("y",), lambda: (rms(x),), 2 * size,
             kwargs=kw("RMSNorm"), lowering=low("RMSNorm")),
        Case("residual add + RMSNorm", gp.add_rms_norm, by_rows, {"x": x, "r": r, "w": w, "h": nan(), "y": nan()},
             ("h", "y"), lambda: (x + r, rms(x + r)), 4 * size, kwargs=kw("residual add + RMSNorm"),
             lowering=low("residual add + RMSNorm")),
    ]


#: the gated GEMM's schedule: 128 x 128 output tiles (two warpgroups, both accumulators in
#: registers), 64-column K tiles in 4 stages (TMA copies), tasks walked in groups of 8 tile rows
GEMM_SCHEDULE = dict(tile=(128, 128, 64), stages=4, order="swizzled", group_m=8)


def gemm_cases(torch, shapes=((8192, 8192, 8192), (8191, 8200, 4104)), schedule: dict | None = None,
               lowering: dict | None = None):
    """The gated GEMM rows (fp16, fp32 accumulation), at :data:`GEMM_SCHEDULE` updated by ``schedule``."""
    import tldsl as tl
    from . import general_programs as gp
    dev, f16 = "cuda", torch.float16
    out = []
    for M, N, K in shapes:
        a = torch.randn(M, K, device=dev, dtype=f16) / 8
        b = torch.randn(K, N, device=dev, dtype=f16) / 8
        c = torch.randn(K, N, device=dev, dtype=f16) / 8
        bias = torch.randn(1, N, device=dev, dtype=f16)
        poisoned = torch.full((M, N), float("nan"), device=dev, dtype=f16)
        sched = tl.ComputeSchedule(**{**GEMM_SCHEDULE, **(schedule or {})})
        out.append(Case(f"relu(A@B+bias)*(A@C) {M}x{N}x{K}", gp.gated_gemm, sched,
                        {"a": a, "b": b, "bias": bias, "c": c, "out": poisoned}, ("out",),
                        lambda a=a, b=b, c=c, bias=bias: (torch.relu(a @ b + bias) * (a @ c),), flops=4 * M * N * K,
                        lowering=dict(lowering or {})))
    return out


def _check(torch, case, got) -> str:
    """'ok' or what differs, tldsl's outputs against torch's (fp16: relative to the largest)."""
    want = case.torch_fn()
    for name, w in zip(case.outputs, want):
        g = got[name]
        g = torch.as_tensor(g, device=w.device)
        err = (g.float() - w.float()).abs().max().item()
        scale = max(1.0, w.float().abs().max().item())
        if not err <= 2e-2 * scale:
            return f"{name}: max |tldsl - torch| = {err:.3g} (scale {scale:.3g})"
    return "ok"


def bench_case(torch, case, rounds: int, iters: int, compile_torch: bool = True) -> dict:
    """tldsl, torch eager, torch.compile (and a copy of the moved bytes) on one case."""
    import tldsl as tl
    res = tl.run(case.kernel, 1, [case.args], compute=case.compute, lowering=case.lowering or None, **case.kwargs)
    row = {"name": case.name, "check": _check(torch, case, res[0]), "lowering": _lowering(res.plan)}
    peers = {"torch eager": case.torch_fn}
    if compile_torch:
        try:
            compiled = torch.compile(case.torch_fn)
            compiled()
            peers["torch.compile"] = compiled
        except Exception as e:            # noqa: BLE001 - a missing compiler is a row note, not a crash
            row["torch.compile"] = f"n/a ({type(e).__name__})"
    if case.moved_bytes:
        peers["copy"] = copy_of(case.moved_bytes)
    ours, theirs = [], {k: [] for k in peers}
    for _ in range(rounds):
        ours += tl.run(case.kernel, 1, [case.args], compute=case.compute, options={"launches": iters + 1},
                       lowering=case.lowering or None, **case.kwargs).launch_ms[1:]
        for k, t in zip(peers, interleaved_ms(list(peers.values()), iters, warmup=1)):
            theirs[k].append(t)
    row["tldsl"] = statistics.median(ours)
    for k, ts in theirs.items():
        row[k] = statistics.median(ts)
    return row


def _lowering(plan) -> str:
    """How the kernel runs: its task groups' threads, and the tiles it holds in registers."""
    out = []
    for k in plan.kernels if plan is not None else []:
        lk = k.lowered
        held = len(getattr(lk, "held", ()))
        out.append(f"{getattr(lk, 'groups', 1)} x {lk.threads} threads" + (f", {held} tile(s) in registers" if held else ""))
    return "; ".join(out) or "—"


def _ms(x) -> str:
    return f"{x:.3f}" if isinstance(x, float) else (x or "—")


def _ratio(peer, ours) -> str:
    """peer time / tldsl time: above 1, tldsl is faster."""
    return f"{peer / ours:.3f}" if isinstance(peer, float) else "—"


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m tldsl.bench general", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--only", default="", help="comma-separated row names (a prefix each)")
    ap.add_argument("--rows", type=int, default=None, help="rows a task of the row programs takes")
    ap.add_argument("--whole-row", type=int, default=None,
                    help="the row programs' whole_row: longer rows go by column tiles (0: always)")
    ap.add_argument("--threads", type=int, default=None, help="the memory-bound programs' threads a task")
    ap.add_argument("--gemm-stages", type=int, default=None, help="the gated GEMM's stages (default 4)")
    ap.add_argument("--gemm-group-m", type=int, default=None, help="its tile rows a group (default 8)")
    ap.add_argument("--gemm-copies", choices=("tma", "cp.async"), default=None,
                    help="how its K loop stages operands (lowering option dot_loop_copies; default tma)")
    ap.add_argument("--gemm-inflight", type=int, default=None,
                    help="its K loop's WGMMA groups left running across iterations (lowering option wgmma_inflight)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from ..runtime.gpu import require_gpu
    require_gpu()
    sched = {k: v for k, v in (("stages", args.gemm_stages), ("group_m", args.gemm_group_m)) if v is not None}
    cases = memory_cases(torch, rows=args.rows, whole_row=args.whole_row, threads=args.threads) + gemm_cases(torch, schedule=sched, lowering={
        k: v for k, v in (("wgmma_inflight", args.gemm_inflight), ("dot_loop_copies", args.gemm_copies))
        if v is not None})
    if args.only:
        keep = [s.strip() for s in args.only.split(",")]
        cases = [c for c in cases if any(c.name.startswith(k) for k in keep)]
    print("| program | lowering | check | tldsl ms | torch eager ms | torch.compile ms | copy ms | tldsl GB/s or TFLOP/s "
          "| vs copy | vs eager | vs compile |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        row = bench_case(torch, case, args.rounds, args.iters)
        t = row["tldsl"]
        rate = (f"{case.moved_bytes / t / 1e6:.0f} GB/s" if case.moved_bytes else f"{case.flops / t / 1e9:.0f} TFLOP/s")
        cells = [case.name, row["lowering"], row["check"], _ms(t), _ms(row.get("torch eager")), _ms(row.get("torch.compile")),
                 _ms(row.get("copy")), rate, _ratio(row.get("copy"), t), _ratio(row.get("torch eager"), t),
                 _ratio(row.get("torch.compile"), t)]
        print("| " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
