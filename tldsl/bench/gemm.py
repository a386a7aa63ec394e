"""The GEMM benchmark on one GPU, with the peer measured in the same run.

    python -m tldsl.bench gemm [--shapes 8192x8192x8192,...] [--tune] [--iters 30] [--weights kn|nk]

The generated Hopper GEMM (a tile program lowered by ``tldsl.codegen``) against
``torch.matmul`` (cuBLAS), bf16, CUDA-event timing (median of ``--iters`` after warm-up),
TFLOP/s and ratios; and the same GEMM with the per-tile waits of AllGather+GEMM compiled in
(their flags set before the launch), which must cost almost nothing. Every output is checked
against torch, after poisoning it with NaN. ``--weights nk``: B stored [N, K], as a torch
``Linear`` keeps its weight (``tldsl.ops.gemm.linear`` against ``torch.matmul(a, w.t())``; no
waits row: AllGather+GEMM's tile program reads B [K, N]).
"""
from __future__ import annotations

import json
import sys
import time

from .timing import interleaved_ms, median_ms

LLAMA70B_MLP = [(m, 28672, 8192) for m in (2048, 4096, 8192, 16384)]
DEFAULT_SHAPES = [(8192, 8192, 8192)] + LLAMA70B_MLP

CANDIDATES = [  # (BM, BN, BK, stages, order, group_m[, cluster M])
    (128, 256, 64, 4, "swizzled", 8),
    (128, 256, 64, 3, "swizzled", 8),
    (256, 128, 64, 4, "swizzled", 8),
    (128, 128, 64, 5, "swizzled", 8),
    (128, 256, 64, 4, "row_major", 8),
    (128, 256, 64, 4, "swizzled", 16),
    (128, 256, 64, 4, "swizzled", 8, 2),      # clusters of 2 CTAs, B multicast
    (128, 256, 64, 3, "swizzled", 8, 2),
]


def candidate_schedule(c):
    """The compute schedule of one :data:`CANDIDATES` entry."""
    import tldsl as tl
    BM, BN, BK, stages, order, group_m, *cl = c
    return tl.ComputeSchedule(tile=(BM, BN, BK), stages=stages, order=order, group_m=group_m,
                              cluster=(cl[0] if cl else 1, 1))


#: how B is stored: [K, N] (``kn``, tldsl.ops.gemm.gemm) or [N, K] (``nk``, tldsl.ops.gemm.linear)
WEIGHT_LAYOUTS = ("kn", "nk")


def lower_plain(M, N, K, sched, weights: str = "kn"):
    import tldsl as tl
    from tldsl.codegen import lower_gemm
    from tldsl.ops.gemm import gemm, linear
    bf = tl.bfloat16
    b = tl.TensorSpec((N, K) if weights == "nk" else (K, N), bf)
    k = (linear if weights == "nk" else gemm).trace(1, tl.TensorSpec((M, K), bf), b, tl.TensorSpec((M, N), bf),
                                                     compute=sched)
    return lower_gemm(k)


def lower_with_waits(M, N, K, sched, world_size=2, comm_tile=128):
    """The compute part of AllGather+GEMM (its per-tile waits included) for the same shape."""
    import tldsl as tl
    from tldsl.codegen import lower_gemm
    from tldsl.ops.allgather_gemm import allgather_gemm
    bf = tl.bfloat16
    Ms = M // world_size
    k = allgather_gemm.trace(world_size, tl.TensorSpec((Ms, K), bf), tl.TensorSpec((K, N), bf),
                             tl.TensorSpec((M, N), bf), compute=sched, comm=tl.CommSchedule(tile_m=comm_tile))
    return lower_gemm(k, "gemm"), k


def _check(out, ref, what):
    import torch
    if torch.isnan(out).any():
        return f"{what}: NaN in output (tiles not written?)"
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    if err > 2e-2 * scale + 1e-2:
        return f"{what}: max |err| {err:.3g} vs max |ref| {scale:.3g}"
    return None


def bench_gemm(shapes, iters, tune, out=sys.stdout, json_path=None, weights: str = "kn"):
    import torch
    import tldsl as tl  # noqa: F401
    from tldsl.codegen import compile_many, CompileJob
    from tldsl.runtime.gpu import GemmKernel, require_gpu
    dev = require_gpu()
    print(f"# device: {dev}, torch {torch.__version__}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs"
          f"; B stored {'[N, K] (torch.matmul(a, w.t()))' if weights == 'nk' else '[K, N]'}", file=out)
    nk = weights == "nk"
    rows = []
    torch.manual_seed(0)
    for (M, N, K) in shapes:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) if nk else \
            torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        b_op = b.t() if nk else b                       # torch's operand: a view, as a Linear passes it
        ref = torch.matmul(a, b_op)
        t_torch = median_ms(lambda: torch.matmul(a, b_op), iters)
        cands = CANDIDATES if tune else CANDIDATES[:1]
        lowered = [lower_plain(M, N, K, candidate_schedule(c), weights) for c in cands]
        names = ("x", "w", "y") if nk else ("a", "b", "c")
        t0 = time.perf_counter()
        compiled = compile_many([CompileJob(lg.source, lg.entry, tuple(lg.options)) for lg in lowered], progress=False)
        t_compile = time.perf_counter() - t0
        best = None
        for c, lg, ck in zip(cands, lowered, compiled):
            kern = GemmKernel(lg, ck)
            cbuf = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            kern(**dict(zip(names, (a, b, cbuf))))
            torch.cuda.synchronize()
            bad = _check(cbuf, ref, f"{M}x{N}x{K} {c}")
            if bad:
                print(f"# WRONG: {bad}", file=out)
                continue
            t = median_ms(lambda: kern(**dict(zip(names, (a, b, cbuf)))), iters)
            print(f"#   {M}x{N}x{K} {c}: {t:.3f} ms ({2 * M * N * K / t / 1e9:.0f} TFLOP/s)", file=out)
            if best is None or t < best[0]:
                best = (t, c)
        if best is None:
            rows.append(dict(M=M, N=N, K=K, torch_ms=t_torch, ours_ms=None, error="every candidate wrong"))
            continue
        t_ours, c = best
        best_kern = GemmKernel(lowered[cands.index(c)], compiled[cands.index(c)])
        cplain = torch.empty((M, N), device="cuda", dtype=torch.bfloat16)
        ours = lambda: best_kern(**dict(zip(names, (a, b, cplain))))      # noqa: E731
        bad, t_waits = None, None
        if nk:        # ours and torch, interleaved (AllGather+GEMM's tile program reads B [K, N]: no waits row)
            t_ours, t_torch = interleaved_ms([ours, lambda: torch.matmul(a, b_op)], iters)
        else:         # the same GEMM with AllGather+GEMM's per-tile waits compiled in, flags already set
            lw, _ = lower_with_waits(M, N, K, candidate_schedule(c))
            kw = GemmKernel(lw)
            sig = {s: torch.full((4096,), 1 << 40, device="cuda", dtype=torch.int64) for s in lw.signals}
            cbuf = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            buffers = {"a_gathered": a, "b": b, "c": cbuf}
            kw(buffers, signals=sig)
            torch.cuda.synchronize()
            bad = _check(cbuf, ref, f"{M}x{N}x{K} with waits")
            if not bad:   # plain vs waits, interleaved, with torch in the same rounds
                t_ours, t_waits, t_torch = interleaved_ms(
                    [ours, lambda: kw(buffers, signals=sig), lambda: torch.matmul(a, b)], iters)
        flops = 2 * M * N * K
        rows.append(dict(M=M, N=N, K=K, schedule=list(c), torch_ms=t_torch, ours_ms=t_ours, waits_ms=t_waits,
                         torch_tflops=flops / t_torch / 1e9, ours_tflops=flops / t_ours / 1e9,
                         ratio=t_torch / t_ours, waits_cost=(t_waits / t_ours - 1) if t_waits else None,
                         compile_s=t_compile, error=bad))
    print("", file=out)
    print("| M | N | K | torch.matmul ms | TFLOP/s | tldsl ms | TFLOP/s | tldsl/torch | with waits ms | waits cost | schedule |",
          file=out)
    print("|---|---|---|---|---|---|---|---|---|---|---|", file=out)
    for r in rows:
        if r.get("ours_ms") is None:
            print(f"| {r['M']} | {r['N']} | {r['K']} | {r['torch_ms']:.3f} | | FAILED: {r['error']} | | | | | |", file=out)
            continue
        wm = f"{r['waits_ms']:.3f}" if r["waits_ms"] else ("WRONG" if r["error"] else "")
        wc = f"{100 * r['waits_cost']:+.1f}%" if r["waits_cost"] is not None else (r["error"] or "")
        print(f"| {r['M']} | {r['N']} | {r['K']} | {r['torch_ms']:.3f} | {r['torch_tflops']:.0f} | {r['ours_ms']:.3f} | "
              f"{r['ours_tflops']:.0f} | {r['ratio']:.3f} | {wm} | {wc} | {tuple(r['schedule'])} |", file=out)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def parse_shapes(text):
    """``MxNxK,MxNxK,...`` -> [(M, N, K), ...]."""
    return [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
